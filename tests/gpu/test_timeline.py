"""Tutorial 3's recorded timeline on the H200: stamps that respect time, the ring protocol and the result.

One recording of every CTA (an uneven problem: partial tiles at the right and bottom edges, a last
k-step that is partly out of bounds) feeds all the checks; each check covers every CTA and role.
"""
import pytest
import torch
import triton

from jfa.specs import FWD_TOL
from tutorials import t03_ws_wgmma_gemm as t03
from tutorials import timeline

PROBLEM = dict(M=1000, N=776, K=2000)  # 8 x 7 CTAs, 32 k-steps
CUDA_EVENT_RESOLUTION_US = 0.5  # the CUDA documentation's figure for cudaEventElapsedTime


@pytest.fixture(scope="module")
def doc():
    return timeline.record(**PROBLEM, shown_programs=None, seed=1)


def role_sequences(doc) -> dict:
    """(program, role) -> every phase as (start, end), in the order the role did them."""
    order = {}
    for r in doc["waits"] + doc["records"]:
        step = doc["k_tiles"] if r["k"] is None else r["k"]
        order.setdefault((r["program"], r["role"]), []).append((step, r["phase"] in ("MMA", "issue loads", "epilogue"),
                                                                 r["start"], r["end"]))
    return {key: [(start, end) for *_, start, end in sorted(phases)] for key, phases in order.items()}


def phase_of(doc, program, role_name, phase) -> dict:
    """k -> the record of `phase` for one CTA's role."""
    role = f"CTA {program} {role_name}"
    return {r["k"]: r for r in doc["records"] + doc["waits"] if r["role"] == role and r["phase"] == phase}


@pytest.mark.gpu
def test_every_cta_and_role_was_recorded(doc):
    assert doc["num_programs"] == doc["shown_programs"] == 8 * 7
    roles = {r["role"] for r in doc["records"]}
    assert roles == {f"CTA {p} {role}" for p in range(doc["num_programs"]) for role in timeline.ROLE_NAMES}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert all(0 <= r["sm"] < sms for r in doc["records"])


@pytest.mark.gpu
def test_each_role_moves_forward_in_time(doc):
    sequences = role_sequences(doc)
    assert len(sequences) == doc["num_programs"] * len(timeline.ROLE_NAMES)
    for key, phases in sequences.items():
        for start, end in phases:
            assert end >= start, f"{key}: a phase ends ({end}) before it starts ({start})"
        for (_, end), (start, _) in zip(phases, phases[1:]):
            assert start >= end, f"{key}: a phase starts at {start}, before the previous one ended at {end}"


@pytest.mark.gpu
def test_every_stamp_lies_within_the_kernels_wall_time(doc):
    # CUDA events bracket the kernel, so they see at least the stamps' span, give or take their resolution.
    slack_us = CUDA_EVENT_RESOLUTION_US + doc["min_stamp_step_ns"] / 1000
    assert 0 < doc["span_us"] <= doc["wall_us"] + slack_us
    for r in doc["records"] + doc["waits"]:
        assert 0 <= r["start"] <= r["end"] <= doc["span_us"]


@pytest.mark.gpu
def test_loads_are_issued_before_the_mma_that_reads_them_and_slots_freed_before_reuse(doc):
    stages = doc["config"]["NUM_STAGES"]
    for program in range(doc["num_programs"]):
        issue = phase_of(doc, program, "producer", "issue loads")
        slot_wait = phase_of(doc, program, "producer", "wait empty")
        for consumer in timeline.ROLE_NAMES[1:]:
            mma = phase_of(doc, program, consumer, "MMA")
            for k in range(doc["k_tiles"]):
                # the full barrier completes only after the TMA loads issued here have landed
                assert issue[k]["start"] <= mma[k]["start"], (program, consumer, k)
                # the producer refills slot k % stages only after this consumer's MMA on k - stages ended
                if k >= stages:
                    assert mma[k - stages]["end"] <= slot_wait[k]["end"], (program, consumer, k)


@pytest.mark.gpu
@pytest.mark.parametrize("recorded", [False, True], ids=["plain", "RECORD"])
def test_both_kernels_compute_the_product(recorded):
    """The plain launch (timeline=None, a compile-time None) is tutorial 3 as before the switch."""
    torch.manual_seed(2)
    M, N, K = PROBLEM["M"], PROBLEM["N"], PROBLEM["K"]
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
    cfg = t03.DEFAULT_CONFIG
    k_tiles = triton.cdiv(K, cfg["BLOCK_K"])
    programs = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    stamps = torch.full((programs * len(timeline.ROLE_NAMES), t03.timeline_row_length(k_tiles)),
                        timeline.UNWRITTEN, device="cuda", dtype=torch.int64)
    t03.ws_gemm(a, b, out=c, timeline=stamps if recorded else None)
    torch.testing.assert_close(c.float(), a.float() @ b.float(), **FWD_TOL)
    if recorded:
        timeline.timeline_from_stamps(stamps.tolist(), k_tiles)  # raises if a role left a stamp unwritten
    else:
        assert (stamps == timeline.UNWRITTEN).all(), "the plain kernel must not touch the buffer"


@pytest.mark.gpu
def test_module_main_writes_a_timeline_the_notebook_finds(tmp_path):
    from jfa.workbench import widgets as jw

    assert timeline.main(["--out", str(tmp_path)]) == 0
    found = jw.newest_recorded("t03-timeline-*.json", results_dir=tmp_path)
    assert found is not None and found.doc["records"] and found.env["gpu"]
