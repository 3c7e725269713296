"""Tutorial 3's RECORD switch and tutorials/timeline.py on a machine without a GPU.

The instrumented kernel is compiled (not run) and its PTX read; the conversion of the raw stamp
buffer to Gantt records is checked exactly on a hand-made buffer whose answers are worked out below.
"""
import json

import pytest
import torch

from jfa.workbench import plots
from jfa.workbench import widgets as jw
from jfa.workbench.inspect import inspect
from tutorials import t03_ws_wgmma_gemm as t03
from tutorials import timeline

U = timeline.UNWRITTEN
BASE_NS = 5_000_000  # %globaltimer is absolute: the conversion must subtract the earliest stamp
K_TILES = 2
# Hand-made stamps, ns after BASE_NS, one row per (program, role): [SM, (wait start, wait end, step end)
# for k = 0, 1, (epilogue start, epilogue end, unused)]. The producer has no epilogue.
FAKE = {
    (0, "producer"): [7, 0, 100, 300, 300, 400, 600, U, U, U],
    (0, "consumer0"): [7, 0, 350, 1350, 1350, 1400, 2400, 2400, 2900, U],
    (0, "consumer1"): [7, 50, 380, 1380, 1380, 1420, 2420, 2420, 3000, U],
    (1, "producer"): [9, 20, 120, 320, 320, 420, 620, U, U, U],
    (1, "consumer0"): [9, 20, 370, 1370, 1370, 1420, 2420, 2420, 2920, U],
    (1, "consumer1"): [9, 20, 370, 1370, 1370, 1420, 2420, 2420, 3100, U],
}


def fake_stamps() -> list:
    return [[row[0]] + [t if t == U else BASE_NS + t for t in row[1:]] for row in FAKE.values()]


def rec(role, start, end, label, phase, k):
    return dict(role=f"CTA 0 {role}", start=start, end=end, label=label, program=0, sm=7, phase=phase, k=k)


# ---- the kernel ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reports():
    return {record: inspect(t03.inspect_spec(RECORD=record), want_ptx=True) for record in (False, True)}


def test_record_kernel_reads_the_global_timer_and_sm_id_and_stores_them(reports):
    ptx = reports[True].ptx
    assert "%globaltimer" in ptx and "%smid" in ptx
    assert ptx.count("st.global") >= 2 * len(timeline.ROLE_NAMES), "every role stores its stamps"


def test_plain_kernel_has_no_instrumentation_left(reports):
    ptx = reports[False].ptx
    assert "%globaltimer" not in ptx and "%smid" not in ptx
    assert "st.global" not in ptx, "the plain kernel writes C only through TMA"


def test_instrumentation_keeps_the_roles_and_their_registers(reports):
    plain, recorded = reports[False], reports[True]
    def budget(report):
        return [(role.name, role.warps, role.registers) for role in report.roles]

    assert budget(recorded) == budget(plain)
    assert recorded.instructions["wgmma.mma_async"] == plain.instructions["wgmma.mma_async"]


def test_ws_gemm_rejects_a_timeline_of_the_wrong_shape_before_launch():
    a, b = torch.randn(256, 128).half(), torch.randn(128, 128).half()
    with pytest.raises(ValueError, match=r"timeline must be a contiguous int64 tensor of shape \(6, 10\)"):
        t03.ws_gemm(a, b, timeline=torch.zeros(6, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        t03.ws_gemm(a, b, timeline=torch.zeros(6, 10, dtype=torch.int32))


def test_row_length_matches_the_fake_layout():
    assert t03.timeline_row_length(K_TILES) == len(FAKE[0, "producer"])
    assert timeline.ROLE_NAMES == ("producer", "consumer0", "consumer1")


# ---- the conversion ------------------------------------------------------------------------------
def test_records_and_waits_are_the_stamps_in_microseconds_since_the_first_stamp():
    doc = timeline.timeline_from_stamps(fake_stamps(), K_TILES, shown_programs=1)
    assert doc["records"] == [
        rec("producer", 0.1, 0.3, "issue loads k=0", "issue loads", 0),
        rec("producer", 0.4, 0.6, "issue loads k=1", "issue loads", 1),
        rec("consumer0", 0.35, 1.35, "MMA k=0", "MMA", 0),
        rec("consumer0", 1.4, 2.4, "MMA k=1", "MMA", 1),
        rec("consumer0", 2.4, 2.9, "epilogue", "epilogue", None),
        rec("consumer1", 0.38, 1.38, "MMA k=0", "MMA", 0),
        rec("consumer1", 1.42, 2.42, "MMA k=1", "MMA", 1),
        rec("consumer1", 2.42, 3.0, "epilogue", "epilogue", None),
    ]
    assert doc["waits"] == [
        rec("producer", 0.0, 0.1, "wait empty k=0", "wait empty", 0),
        rec("producer", 0.3, 0.4, "wait empty k=1", "wait empty", 1),
        rec("consumer0", 0.0, 0.35, "wait full k=0", "wait full", 0),
        rec("consumer0", 1.35, 1.4, "wait full k=1", "wait full", 1),
        rec("consumer1", 0.05, 0.38, "wait full k=0", "wait full", 0),
        rec("consumer1", 1.38, 1.42, "wait full k=1", "wait full", 1),
    ]


def test_span_busy_fractions_and_timer_step_cover_every_program():
    doc = timeline.timeline_from_stamps(fake_stamps(), K_TILES, shown_programs=1)
    assert (doc["num_programs"], doc["shown_programs"], doc["k_tiles"]) == (2, 1, 2)
    assert doc["span_us"] == 3.1  # program 1's consumer1 ends last, 3100 ns after the first stamp
    # busy / (last stamp - first stamp) per role, summed over both programs
    assert doc["busy_fraction"] == {"producer": (400 + 400) / (600 + 600),
                                    "consumer0": (2500 + 2500) / (2900 + 2900),
                                    "consumer1": (2580 + 2680) / (2950 + 3080)}
    assert doc["min_stamp_step_ns"] == 40  # program 0's consumer1: 1380 -> 1420


def test_all_programs_are_kept_when_asked():
    doc = timeline.timeline_from_stamps(fake_stamps(), K_TILES, shown_programs=None)
    assert {r["role"] for r in doc["records"]} == {f"CTA {p} {role}" for p in (0, 1) for role in timeline.ROLE_NAMES}
    assert {r["sm"] for r in doc["records"] if r["program"] == 1} == {9}


def test_an_unwritten_stamp_is_an_error_naming_the_role():
    stamps = fake_stamps()
    stamps[4][5] = U  # program 1, consumer0, k=1 wait end
    with pytest.raises(ValueError, match="program 1 consumer0 has a stamp that was never written"):
        timeline.timeline_from_stamps(stamps, K_TILES)


@pytest.mark.parametrize("stamps, k_tiles, match", [(fake_stamps()[:5], K_TILES, "3 rows per program"),
                                                     ([], K_TILES, "3 rows per program"),
                                                     (fake_stamps(), 0, "k_tiles")])
def test_bad_buffers_are_rejected_by_name(stamps, k_tiles, match):
    with pytest.raises(ValueError, match=match):
        timeline.timeline_from_stamps(stamps, k_tiles)


# ---- the document, as notebook 01 reads it ------------------------------------------------------
def test_saved_document_is_found_by_the_notebook_and_plots(tmp_path):
    doc = timeline.timeline_from_stamps(fake_stamps(), K_TILES) | dict(time_unit="us", wall_us=4.0)
    path = timeline.save(doc, tmp_path)
    assert path.parent == tmp_path and path.name.startswith("t03-timeline-") and path.suffix == ".json"
    found = jw.newest_recorded("t03-timeline-*.json", results_dir=tmp_path)
    assert found is not None and found.path == path
    assert json.loads(path.read_text())["env"]["date"], "every results JSON carries the environment block"
    fig = plots.warp_timeline(found.doc["records"], title="t")
    assert [trace.name for trace in fig.data] == [f"CTA {p} {role}" for p in (0, 1) for role in timeline.ROLE_NAMES]


def test_summary_names_every_role_and_the_wall_time():
    doc = timeline.timeline_from_stamps(fake_stamps(), K_TILES) | dict(problem=dict(M=256, N=128, K=128), wall_us=4.0)
    text = timeline.summary_text(doc)
    assert "3.1 us of 4.0 us kernel time" in text and "40 ns" in text
    assert "producer   busy  66.7%" in text and "consumer0" in text and "consumer1" in text


def test_module_main_refuses_without_a_hopper_gpu(monkeypatch, tmp_path, capsys):
    import tutorials

    monkeypatch.setattr(tutorials, "hopper_tlx_available", lambda: (False, "no GPU in this test"))
    assert timeline.main(["--out", str(tmp_path)]) == 1
    assert "no GPU in this test" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing is written without a recording"
