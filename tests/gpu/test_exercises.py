"""The fork exercises' worked solutions on a Hopper GPU, and the lab's live paths that run them.

Every solution of `jfa.workbench.exercises` runs forward and backward through its public call
against its fp32 reference on fresh inputs (`lab.check`: every element of out, LSE, dQ, dK and dV
within jfa.specs' tolerances; the P·V fork of 06, which its reference does not model, by cosine and
SQNR, and less exact than the plain kernel). Then the lab's other live paths, once each on small
shapes: the check of every entry point, a sweep point, `try_fork` against the unforked kernel and a
live write-up. The shapes are the lab's defaults, so the kernels compile a few configurations only.
"""
import re

import pytest

from jfa.workbench import exercises, lab

pytestmark = pytest.mark.gpu

ALL = list(exercises.EXERCISES.values())
IDS = [e.name for e in ALL]
SMALL = lab.Case(max_len=512, batch=64)  # a sweep point or a benchmark case that times in milliseconds


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_solution_matches_its_reference(ex):
    report = ex.check(compile=False, seed=sum(map(ord, ex.name)))
    assert report.live and report.passed, repr(report)
    expected = ["out", "dq", "dk", "dv"] if ex.notebook == "06" else ["out", "lse", "dq", "dk", "dv"]
    assert [c.name for c in report.tensors] == expected


def test_e4m3_p_is_less_exact_than_the_plain_kernel():
    """Rounding P to E4M3 costs agreement: the fork's output SQNR sits well below the plain kernel's."""
    fork = exercises.E4M3_P.check(compile=False, seed=7, backward=False)
    plain = lab.check(compile=False, seed=7, backward=False)
    assert fork.passed and plain.passed, repr(fork) + "\n" + repr(plain)
    assert fork.tensors[0].sqnr_db < plain.tensors[0].sqnr_db - 3, (fork.tensors[0], plain.tensors[0])


@pytest.mark.parametrize("target,options", [("jagged", dict(causal=True, heads=(4, 2))),
                                            ("jagged", dict(broadcast_q=True)), ("block", {}),
                                            ("block_sparse", dict(causal=True)), ("fp8", {})],
                         ids=["jagged-causal-gqa", "broadcast-q", "block", "block-sparse", "fp8"])
def test_lab_checks_each_entry_point_live(target, options):
    report = lab.check(target, compile=False, seed=11, **options)
    assert report.live and report.passed, repr(report)


def test_a_sweep_point_is_checked_and_timed_live():
    point = lab._measure_point(SMALL)
    assert point["check"].passed, repr(point["check"])
    ours = [r for r in point["rows"] if r["provider"] == "jfa"]
    assert [r["pass"] for r in ours] == ["fwd", "bwd"] and all(r["ok"] and r["tflops"] > 0 for r in ours), ours
    for peer in lab.PEERS:  # timed where installed, else a row saying why not
        rows = [r for r in point["rows"] if r["provider"] == peer]
        assert len(rows) == 2 and all(r["ok"] or r["error"] for r in rows), rows


def test_try_fork_times_the_fork_against_the_unforked_kernel():
    ex = exercises.SINKS_AND_WINDOW
    report = ex.try_fork(compile=False, cases=(lab.Case(max_len=1024, batch=256, causal=True),))
    assert report.passed, repr(report)
    timed = {r["provider"] for r in report.speed.rows if r["ok"]}
    assert {"jfa", lab.fork_label(ex.solution)} <= timed, report.speed.rows
    assert report.speed.live and report.figures(), "the speed is plotted"


def test_write_up_holds_the_live_check_and_benchmark(tmp_path):
    ex = exercises.TARGET_AWARE
    written = lab.write_up(tmp_path / "writeup.html", title="target-aware attention", variant=ex.solution,
                           params=ex.params(), cases=(SMALL,))
    page = written.path.read_text()
    assert "measured live on" in page and "PASS against the fp32 reference" in page
    assert "target_aware_blocks" in page and "Plotly.newPlot" in page, "the hooks and the plots"
    assert not any("src" in tag for tag in re.findall(r"<script[^>]*>", page))
