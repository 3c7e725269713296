"""CPU tests of jfa.workbench.bench: suites, FLOP and byte formulas, the reference check, timing logic, rows,
resumability, the flex worker plumbing and the command line. Providers and the timer are fakes here;
the real providers run on the GPU host (scripts/bench_gpu.sh)."""
from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jfa import reference, specs
from jfa.workbench import bench, providers
from jfa.workbench.providers import PROVIDERS, ProviderRun, ProviderUnavailable

FIXTURE = Path(__file__).parent / "data" / "bench_fake_run.json"
ROW_KEYS = {"suite", "case", "provider", "pass", "ms", "tflops", "ok", "error", "params"}
ENV_KEYS = {"gpu", "driver", "cuda", "torch", "triton", "tlx", "fa4", "commit", "date", "host"}
FAKE_ENV = {"gpu": None, "host": "cpu-test"}
FWD_MS, FWD_BWD_MS = 1.0, 3.0


# ---- helpers ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def two_input_sets(monkeypatch):
    """Rotation logic needs two sets to be exercised; more would only slow the CPU reference down."""
    monkeypatch.setattr(specs, "BENCH_MAX_INPUT_SETS", 2)


def small_case(kind="jagged", **over) -> dict:
    case = dict(suite="t", case=f"{kind}-case", kind=kind, batch=5, heads=2, head_dim=16, max_len=40, sparsity=0.5,
                kv_len=None, q_len=None, density=None, dtype="bfloat16")
    case.update(over)
    return case


def reference_provider(problem) -> ProviderRun:
    """A correct 'provider': the reference itself, in the provider's output dtype."""
    def forward():
        if problem.kind == "block":
            out = reference.block_attention_ref(problem.q, problem.k, problem.v, problem.q_offsets)
        elif problem.kind == "block_sparse":
            block = specs.BLOCK_SPARSE_BLOCK
            out, _ = reference.block_sparse_attention_ref(problem.q, problem.k, problem.v, problem.q_offsets,
                                                          problem.kv_offsets, problem.kv_block_idx, block, block)
        else:
            out, _ = reference.jagged_attention_ref(problem.q, problem.k, problem.v, problem.q_offsets,
                                                    problem.kv_offsets, broadcast_q=problem.kind == "pma")
        return out.to(torch.bfloat16)
    return ProviderRun(forward, lambda out: out, [problem.q, problem.k, problem.v],
                       no_backward="unavailable: forward-only here" if problem.kind == "fp8" else None)


def off_by_a_bit_provider(problem) -> ProviderRun:
    right = reference_provider(problem)
    return ProviderRun(lambda: right.forward() + 0.1, right.to_packed, right.grad_inputs)


def raising_provider(problem) -> ProviderRun:
    raise RuntimeError("kernel launch failed: too many resources requested")


def unavailable_provider(problem) -> ProviderRun:
    raise ProviderUnavailable("peer not installed here")


class FakeTimer:
    """do_bench stand-in: runs fn once (so the closure really works) and returns fixed medians."""

    def __init__(self, fwd_ms=FWD_MS, fwd_bwd_ms=FWD_BWD_MS):
        self.fwd_ms, self.fwd_bwd_ms, self.calls = fwd_ms, fwd_bwd_ms, []

    def __call__(self, fn, grad_to_none):
        fn()
        self.calls.append("fwd+bwd" if grad_to_none else "fwd")
        return self.fwd_bwd_ms if grad_to_none else self.fwd_ms


def check_row_schema(row: dict) -> None:
    assert set(row) == ROW_KEYS
    assert isinstance(row["suite"], str) and isinstance(row["case"], str) and isinstance(row["provider"], str)
    assert row["pass"] in specs.BENCH_PASSES
    assert isinstance(row["ok"], bool) and isinstance(row["params"], dict)
    if row["ok"]:
        assert row["ms"] > 0 and row["tflops"] > 0 and row["error"] is None
        assert math.isclose(row["tflops"], specs.tflops(row["params"]["flops"], row["ms"]), rel_tol=1e-9)
    else:
        assert row["ms"] is None and row["tflops"] is None and isinstance(row["error"], str) and row["error"]


TINY_SUITE = (small_case(case="c1", batch=3, max_len=24), small_case(case="c2", batch=3, max_len=24, sparsity=1.0))


@pytest.fixture
def tiny_quick_suite(monkeypatch):
    """A two-case suite "t" for whole runs: the run logic is the subject, not the shapes."""
    monkeypatch.setitem(specs.BENCH_QUICK_SUITES, "t", TINY_SUITE)


def run(tmp_path, providers, registry, *, suites=("t",), passes=("fwd", "bwd"), **kw):
    out = tmp_path / "run.json"
    stream = io.StringIO()
    done = bench.run_bench(list(suites), list(providers), list(passes), out, quick=True, device="cpu",
                           timer=kw.pop("timer", FakeTimer()), registry=registry, isolated=frozenset(),
                           env=FAKE_ENV, stream=stream, **kw)
    return done, json.loads(out.read_text()) if out.exists() else None, stream.getvalue()


# ---- suites -----------------------------------------------------------------------------------
def test_gem_suite_is_the_published_grid():
    gem = specs.BENCH_SUITES["gem"]
    assert {(c["max_len"], c["sparsity"]) for c in gem} == {(L, s) for L in (256, 512, 1024, 2048) for s in (0.5, 1.0)}
    assert all((c["batch"], c["heads"], c["head_dim"], c["kind"], c["kv_len"]) == (1152, 4, 128, "jagged", None)
               for c in gem)


def test_other_suites_match_the_issue():
    assert {c["kv_len"] for c in specs.BENCH_SUITES["cross"]} == {256}
    assert {c["q_len"] for c in specs.BENCH_SUITES["pma"]} == {64, 256}
    assert all(c["max_len"] == 2048 and c["sparsity"] == 0.5 and c["batch"] == 1152 for c in specs.BENCH_SUITES["pma"])
    assert {(c["batch"], c["heads"], c["max_len"], c["head_dim"]) for c in specs.BENCH_SUITES["dense"]} == \
        {(4, 32, 4096, 128), (4, 32, 4096, 64)}
    assert max(c["max_len"] for c in specs.BENCH_SUITES["block"]) == 4096
    assert all(c["dtype"] == "float8_e4m3fn" for c in specs.BENCH_SUITES["fp8"])
    assert sorted(c["density"] for c in specs.BENCH_SUITES["block_sparse"]) == sorted(specs.BLOCK_SPARSE_DENSITIES)


@pytest.mark.parametrize("table", [specs.BENCH_SUITES, specs.BENCH_QUICK_SUITES])
def test_every_suite_has_unique_case_names_and_a_quick_twin(table):
    assert set(table) == set(specs.BENCH_SUITES) == set(specs.BENCH_QUICK_SUITES)
    for suite, cases in table.items():
        assert cases and len({c["case"] for c in cases}) == len(cases)
        assert {c["kind"] for c in cases} == {c["kind"] for c in specs.BENCH_SUITES[suite]}
        assert all(c["suite"] == suite for c in cases)


def test_registry_matches_the_provider_list():
    assert tuple(PROVIDERS) == specs.BENCH_PROVIDERS


def test_case_lengths_by_kind():
    pma = small_case("pma", q_len=7)
    q_lens, kv_lens = bench.case_lengths(pma)
    assert q_lens == [7] * 5 and kv_lens == [int(n) for n in bench._gem_lengths(5, 40, 0.5, specs.BENCH_SEED)]
    assert bench.case_lengths(small_case(kv_len=9))[1] == [9] * 5
    assert bench.case_lengths(small_case("dense")) == ([40] * 5, [40] * 5)


# ---- FLOPs and bytes, by hand -------------------------------------------------------------------
def meta_problem(kind, q_lens, kv_lens, heads=2, head_dim=4, q_rows=None, dtype=torch.bfloat16):
    empty = lambda rows: torch.empty(rows, heads, head_dim, device="meta", dtype=dtype)  # noqa: E731
    rows = sum(q_lens) if q_rows is None else q_rows
    return providers.Problem(kind, len(kv_lens), heads, head_dim, empty(rows), empty(sum(kv_lens)),
                             empty(sum(kv_lens)), None, None, q_lens, kv_lens, max(q_lens), max(kv_lens))


def test_jagged_flops_by_hand():
    problem = meta_problem("jagged", [3, 5], [3, 5])
    case = small_case(heads=2, head_dim=4)
    # 4 * H * D * sum(lq * lk) = 4 * 2 * 4 * (9 + 25) = 1088
    assert bench.case_flops(case, problem, "fwd") == 1088
    assert bench.case_flops(case, problem, "bwd") == 2720
    assert bench.case_flops(case, problem, "fwd+bwd") == 3808


def test_median_tflops_takes_each_variants_upper_median():
    problem = meta_problem("jagged", [3, 5], [3, 5])
    ms = {"this": [3.0, 1.0, 2.0, 9.0], "ref": [4.0]}  # upper median of four rounds: 3.0, not 2.5
    assert bench.median_tflops(small_case(heads=2, head_dim=4), problem, "fwd", ms) == {
        "this": specs.tflops(1088, 3.0), "ref": specs.tflops(1088, 4.0)}


def test_pma_flops_count_every_batch():
    problem = meta_problem("pma", [2, 2], [3, 4], q_rows=2)
    assert bench.case_flops(small_case("pma", heads=2, head_dim=4), problem, "fwd") == 4 * 2 * 4 * (2 * 3 + 2 * 4)


def test_block_attention_flops_count_blocks_only():
    problem = meta_problem("block", [70], [70])
    # blocks of 64 and 6: 64*64 + 6*6 = 4132 pairs instead of 70*70
    assert bench.case_flops(small_case("block", heads=2, head_dim=4), problem, "fwd") == 4 * 2 * 4 * 4132


def test_block_sparse_flops_count_selected_blocks():
    problem = meta_problem("block_sparse", [200], [200], heads=1)
    problem.kv_block_dense = torch.tensor([[[[True, False], [True, True]]]])
    # query block 0 (128 rows) sees key block 0 (128); query block 1 (72 rows) sees both (128 + 72)
    pairs = 128 * 128 + 72 * 128 + 72 * 72
    assert bench.case_flops(small_case("block_sparse", heads=1, head_dim=4), problem, "fwd") == 4 * 4 * pairs


def test_bytes_by_hand():
    problem = meta_problem("jagged", [3, 5], [3, 5], heads=2, head_dim=4)
    row = 2 * 4
    fwd = row * (2 * (8 + 2 * 8) + 2 * 8) + 4 * 2 * 8
    bwd = row * (2 * (2 * 8 + 4 * 8) + 2 * 2 * 8) + 2 * 4 * 2 * 8
    assert bench.case_bytes(problem, "fwd") == fwd
    assert bench.case_bytes(problem, "bwd") == bwd
    assert bench.case_bytes(problem, "fwd+bwd") == fwd + bwd


def test_block_sparse_selection_keeps_the_density():
    lengths, heads, density = [300, 1, 129], 3, 0.5
    idx, dense = bench.block_sparse_selection(lengths, heads, density, seed=1)
    n_blocks = [3, 1, 2]
    for b, n in enumerate(n_blocks):
        keep = math.ceil(density * n)
        assert (dense[b].sum(-1) == keep).all()
        assert not dense[b, ..., n:].any()
        chosen = idx[b]
        assert ((chosen >= 0).sum(-1) == keep).all()
        for h in range(heads):
            for qb in range(dense.shape[2]):
                picked = sorted(int(j) for j in chosen[h, qb] if j >= 0)
                assert picked == dense[b, h, qb].nonzero().flatten().tolist()


def test_input_sets_rotate_small_cases_only():
    small = meta_problem("jagged", [3], [3])
    assert bench.input_sets_for(small) == specs.BENCH_MAX_INPUT_SETS == 2
    huge = meta_problem("jagged", [specs.BENCH_ROTATION_BYTES], [1], heads=1, head_dim=1)
    assert bench.input_sets_for(huge) == 1


# ---- timing logic with a fake timer --------------------------------------------------------------------
def test_bwd_is_fwd_bwd_minus_fwd():
    timer = FakeTimer(fwd_ms=1.5, fwd_bwd_ms=4.0)
    ms = bench.time_passes(["fwd", "bwd", "fwd+bwd"], lambda: None, lambda: None, timer, [torch.zeros(1)])
    assert ms == {"fwd": 1.5, "bwd": 2.5, "fwd+bwd": 4.0}
    assert timer.calls == ["fwd", "fwd+bwd"]


def test_bwd_alone_still_times_the_forward_to_subtract():
    timer = FakeTimer()
    ms = bench.time_passes(["bwd"], lambda: None, lambda: None, timer, [torch.zeros(1)])
    assert ms == {"bwd": FWD_BWD_MS - FWD_MS}
    assert timer.calls == ["fwd", "fwd+bwd"]


def test_forward_only_provider_times_forward_only():
    timer = FakeTimer()
    assert bench.time_passes(["fwd", "bwd"], lambda: None, None, timer, []) == {"fwd": FWD_MS}
    assert timer.calls == ["fwd"]


def test_rotation_cycles_through_input_sets():
    seen = []
    call = bench._rotating([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


# ---- real providers, where the CPU can say something about them -------------------------------------------
def test_jfa_never_times_the_reference_fallback():
    case = small_case()
    problems = bench.build_problems(case, "cpu")
    rows = bench.measure_provider(case, "jfa", PROVIDERS["jfa"], problems, ["fwd"], FakeTimer())
    assert not rows[0]["ok"] and rows[0]["error"].startswith("unavailable: jfa forward would run the reference")


@pytest.mark.parametrize("kind, extra", [("jagged", {}), ("jagged", {"kv_len": 24}), ("pma", {"q_len": 6}),
                                         ("dense", {})])
def test_sdpa_plumbing_is_right_with_the_math_backend(kind, extra):
    """The nested-tensor (and dense) layouts of the SDPA peers, run by the one backend the CPU has."""
    case = small_case(kind, dtype="float32", **extra)
    problems = bench.build_problems(case, "cpu")

    def sdpa_math(problem):
        return providers._build_sdpa(problem, "MATH", "sdpa_math")

    rows = bench.measure_provider(case, "sdpa_math", sdpa_math, problems, ["fwd", "bwd"], FakeTimer())
    assert all(r["ok"] for r in rows), [r["error"] for r in rows]


def test_cudnn_nested_rows_are_forward_only():
    run = PROVIDERS["sdpa_cudnn"](bench.build_problems(small_case("jagged"), "cpu")[0])
    assert run.no_backward == providers.CUDNN_NESTED_NO_BACKWARD


@pytest.mark.parametrize("provider, kind", [("fa2", "block_sparse"), ("fa2", "fp8"), ("sdpa_flash", "block"),
                                            ("sdpa_cudnn", "block_sparse")])
def test_peers_refuse_kinds_they_have_no_api_for(provider, kind):
    case = small_case(kind, q_len=4, density=0.5, dtype="float8_e4m3fn" if kind == "fp8" else "bfloat16")
    with pytest.raises(ProviderUnavailable, match=f"unavailable: {provider} has no API for the '{kind}' kind"):
        PROVIDERS[provider](bench.build_problems(case, "cpu")[0])


def test_fa2_refuses_more_sequences_than_a_cuda_grid_row_holds(monkeypatch):
    """Past gridDim.y's limit FA2's launch fails with a bare "invalid argument": the row says why instead."""
    problem = bench.build_problems(small_case("block", max_len=150), "cpu")[0]
    monkeypatch.setattr(providers, "FA2_MAX_SEQUENCES", problem.block_offsets.numel() - 2)
    with pytest.raises(ProviderUnavailable, match="caps a grid's y dimension"):
        PROVIDERS["fa2"](problem)


# ---- rows from providers ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, extra", [("jagged", {}), ("jagged", {"kv_len": 24}), ("pma", {"q_len": 6}),
                                         ("dense", {}), ("block", {"max_len": 150}),
                                         ("block_sparse", {"max_len": 260, "density": 0.5, "batch": 2})])
def test_correct_provider_gives_ok_rows(kind, extra):
    case = small_case(kind, **extra)
    problems = bench.build_problems(case, "cpu")
    rows = bench.measure_provider(case, "ref", reference_provider, problems, ["fwd", "bwd", "fwd+bwd"], FakeTimer())
    assert [r["pass"] for r in rows] == ["fwd", "bwd", "fwd+bwd"]
    for row in rows:
        check_row_schema(row)
        assert row["ok"], row["error"]
        assert row["params"]["checked_rows"] == problems[0].out_rows  # small: every sequence checked
        assert row["params"]["flops"] == bench.case_flops(case, problems[0], row["pass"])
    assert [r["ms"] for r in rows] == [FWD_MS, FWD_BWD_MS - FWD_MS, FWD_BWD_MS]
    assert all(t.grad is None for p in problems for t in (p.q, p.k, p.v))


def test_fp8_rows_check_cosine_and_say_no_backward():
    case = small_case("fp8", dtype=specs.FP8_BENCH_DTYPE)
    problems = bench.build_problems(case, "cpu")
    assert problems[0].q.dtype == torch.float8_e4m3fn
    rows = bench.measure_provider(case, "ref", reference_provider, problems, ["fwd", "bwd"], FakeTimer())
    assert rows[0]["ok"] and rows[0]["params"]["cosine"] > specs.MXFP8_MIN_COSINE
    assert not rows[1]["ok"] and rows[1]["error"] == "unavailable: forward-only here"


@pytest.mark.parametrize("builder, message", [
    (off_by_a_bit_provider, "wrong output: "),
    (raising_provider, "RuntimeError: kernel launch failed: too many resources requested"),
    (unavailable_provider, "unavailable: peer not installed here"),
])
def test_failing_provider_becomes_error_rows(builder, message):
    case = small_case()
    rows = bench.measure_provider(case, "bad", builder, bench.build_problems(case, "cpu"), ["fwd", "bwd"], FakeTimer())
    assert len(rows) == 2
    for row in rows:
        check_row_schema(row)
        assert not row["ok"] and row["error"].startswith(message)


def test_check_sees_a_single_wrong_row():
    case = small_case()
    problem = bench.build_problems(case, "cpu")[0]
    good = reference_provider(problem).forward()
    bad = good.clone()
    bad[-1, -1, -1] += 1.0  # last row of the last sequence
    assert bench.check_output(problem, good)["checked_rows"] == problem.out_rows
    with pytest.raises(bench.OutputMismatch, match="1 of"):
        bench.check_output(problem, bad)
    with pytest.raises(bench.OutputMismatch, match="shape"):
        bench.check_output(problem, good[:-1])


def test_check_subset_respects_the_row_budget(monkeypatch):
    monkeypatch.setattr(specs, "BENCH_CHECK_MAX_ROWS", 50)
    problem = bench.build_problems(small_case(batch=12, max_len=30), "cpu")[0]
    batches = bench._checked_batches(problem)
    longest = max(range(12), key=lambda b: problem.q_lens[b])
    assert longest in batches and sum(problem.q_lens[b] for b in batches) <= 50 + max(problem.q_lens)
    assert bench.check_output(problem, reference_provider(problem).forward())["checked_rows"] == \
        sum(problem.q_lens[b] for b in batches)


def test_negative_bwd_time_is_an_error_not_a_number():
    case = small_case()
    rows = bench.measure_provider(case, "ref", reference_provider, bench.build_problems(case, "cpu"), ["fwd", "bwd"],
                                  FakeTimer(fwd_ms=2.0, fwd_bwd_ms=1.5))
    assert rows[0]["ok"] and not rows[1]["ok"] and "not positive" in rows[1]["error"]


# ---- runs, JSON, resumability ------------------------------------------------------------------------
def test_run_writes_the_schema(tmp_path, tiny_quick_suite):
    done, data, log = run(tmp_path, ["ref", "bad"], {"ref": reference_provider, "bad": raising_provider})
    assert done and set(data) == {"env", "rows"} and data["env"] == FAKE_ENV
    assert len(data["rows"]) == len(TINY_SUITE) * 2 * 2
    for row in data["rows"]:
        check_row_schema(row)
    assert "4/4" in log and "FAILED" in log


def test_stored_fake_run_has_the_schema():
    data = json.loads(FIXTURE.read_text())
    assert ENV_KEYS <= set(data["env"])
    for row in data["rows"]:
        check_row_schema(row)


def test_resume_skips_what_is_there(tmp_path, tiny_quick_suite):
    built = []

    def counting(name, inner):
        def builder(problem):
            built.append(name)
            return inner(problem)
        return builder

    registry = {"a": counting("a", reference_provider), "b": counting("b", unavailable_provider)}
    run(tmp_path, ["a"], registry)
    first = len(built)
    _, data, log = run(tmp_path, ["a", "b"], registry)
    assert set(built[first:]) == {"b"}  # a's cases were skipped
    assert "rows already in" in log
    keys = [(r["case"], r["provider"], r["pass"]) for r in data["rows"]]
    assert len(keys) == len(set(keys)) == len(TINY_SUITE) * 2 * 2


def test_max_seconds_stops_cleanly_and_resumes(tmp_path, tiny_quick_suite):
    ticks = iter(range(0, 1000, 10))  # every clock read advances 10 s
    done, data, log = run(tmp_path, ["a"], {"a": reference_provider}, max_seconds=15, clock=lambda: next(ticks))
    assert not done and "to resume" in log
    assert {r["case"] for r in data["rows"]} == {TINY_SUITE[0]["case"]}
    done, data, _ = run(tmp_path, ["a"], {"a": reference_provider})
    assert done and len(data["rows"]) == len(TINY_SUITE) * 2


def test_redo_failed_runs_failures_again(tmp_path, tiny_quick_suite):
    run(tmp_path, ["a"], {"a": raising_provider})
    _, data, _ = run(tmp_path, ["a"], {"a": reference_provider}, redo_failed=True)
    assert data["rows"] and all(r["ok"] for r in data["rows"])


def test_results_from_another_gpu_are_refused(tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"env": {"gpu": "NVIDIA H100"}, "rows": []}))
    with pytest.raises(ValueError, match="another file"):
        bench.ResultsFile(out, {"gpu": "NVIDIA H200"})
    out.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a jfa results file"):
        bench.ResultsFile(out, {"gpu": None})


def test_resuming_with_other_code_records_its_environment(tmp_path):
    out = tmp_path / "r.json"
    first = {"gpu": "G", "commit": "aaa", "triton": "3.8.0"}
    bench.ResultsFile(out, first).add([{"row": 0}])
    bench.ResultsFile(out, dict(first)).add([{"row": 1}])  # same code: nothing recorded
    assert "resumed" not in json.loads(out.read_text())
    second = dict(first, commit="bbb", triton="3.6.0")
    bench.ResultsFile(out, second).add([{"row": 2}])
    bench.ResultsFile(out, dict(second)).add([{"row": 3}])
    data = json.loads(out.read_text())
    assert data["env"] == first
    assert data["resumed"] == [dict(second, first_row=2)]


def test_redoing_failed_rows_keeps_every_run_pointing_at_its_rows(tmp_path):
    out = tmp_path / "r.json"
    first = {"gpu": "G", "commit": "aaa"}
    row = lambda i, ok: {"suite": "s", "case": f"c{i}", "provider": "p", "pass": "fwd", "ok": ok}
    bench.ResultsFile(out, first).add([row(0, True), row(1, False)])
    second = dict(first, commit="bbb")
    bench.ResultsFile(out, second).add([row(2, False), row(3, True)])
    third = bench.ResultsFile(out, dict(first, commit="ccc"))
    assert third.drop_failed({"s"}, {"p"}) == 2
    third.add([row(1, True), row(2, True)])
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["rows"]] == ["c0", "c3", "c1", "c2"]
    assert [(run["commit"], run["first_row"]) for run in data["resumed"]] == [("bbb", 1), ("ccc", 2)]


def test_rerun_measures_rows_of_other_code_again_and_resumes(tmp_path):
    out = tmp_path / "r.json"
    row = lambda case, provider, pass_: {"suite": "s", "case": case, "provider": provider, "pass": pass_, "ok": True}
    old = {"gpu": "G", "commit": "aaa"}
    bench.ResultsFile(out, old).add([row("c0", "p", "fwd"), row("c0", "p", "bwd"), row("c0", "q", "bwd"),
                                     row("c1", "p", "bwd")])
    new = dict(old, commit="bbb")
    results = bench.ResultsFile(out, new)
    assert results.drop_stale({"s"}, {"p"}, {"bwd"}, new) == 2  # p's bwd rows; p fwd and q stay
    results.add([row("c0", "p", "bwd")])  # interrupted after one case
    again = bench.ResultsFile(out, dict(new))
    assert again.drop_stale({"s"}, {"p"}, {"bwd"}, dict(new)) == 0  # this code's row is kept
    again.add([row("c1", "p", "bwd")])
    data = json.loads(out.read_text())
    assert [(r["case"], r["provider"], r["pass"]) for r in data["rows"]] == [
        ("c0", "p", "fwd"), ("c0", "q", "bwd"), ("c0", "p", "bwd"), ("c1", "p", "bwd")]
    assert [(run["commit"], run["first_row"]) for run in data["resumed"]] == [("bbb", 2)]
    assert bench.ResultsFile(out, new).run_env(0)["commit"] == "aaa"
    assert bench.ResultsFile(out, new).run_env(3)["commit"] == "bbb"
    newer = dict(new, commit="ccc")  # re-measuring every row of bbb's run leaves that run no rows
    results = bench.ResultsFile(out, newer)
    assert results.drop_stale({"s"}, {"p"}, {"bwd"}, newer) == 2
    results.add([row("c0", "p", "bwd"), row("c1", "p", "bwd")])
    data = json.loads(out.read_text())
    assert [(run["commit"], run["first_row"]) for run in data["resumed"]] == [("ccc", 2)]


def test_a_resumed_run_that_adds_nothing_is_not_recorded(tmp_path):
    out = tmp_path / "r.json"
    bench.ResultsFile(out, {"gpu": "G", "commit": "aaa"}).add([{"row": 0}])
    bench.ResultsFile(out, {"gpu": "G", "commit": "bbb"}).add([])
    assert "resumed" not in json.loads(out.read_text())


# ---- the flex worker plumbing -------------------------------------------------------------------------
def test_isolated_env_drops_the_bundles():
    env = bench.isolated_env({"PYTHONPATH": "/tmp/gpu-site:/tmp/triton-tlx:/repo", "EXTRA_SITE_DIRS": "/tmp/x",
                              "TRITON_PLUGIN_PATHS": "/tmp/libutlx.so", "TRITON_PTXAS_PATH": "/usr/bin/ptxas",
                              "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"})
    assert env == {"PYTHONPATH": str(bench.IMPORT_ROOT), "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"}


def test_crashing_worker_becomes_error_rows():
    case = small_case()
    rows = bench.measure_case_isolated(case, "flex", ["fwd", "bwd"], timeout_s=60, python="false")
    assert [r["pass"] for r in rows] == ["fwd", "bwd"]
    for row in rows:
        check_row_schema(row)
        assert row["error"].startswith("flex worker exited with 1")


def test_prewarm_reports_each_job_and_never_raises():
    """A failing compile worker is only reported; the timed run makes the failed row later."""
    case = small_case()
    log = io.StringIO()
    bench.warm_isolated([(case, "flex"), (dict(case, case="other"), "flex")], workers=2, timeout_s=60,
                        python="false", stream=log)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2
    assert all("flex" in line and "exit 1" in line for line in lines)


def test_prewarm_option_parses():
    args = bench.build_parser().parse_args(["--suite", "gem", "--out", "x.json", "--prewarm", "4"])
    assert args.prewarm == 4
    assert bench.build_parser().parse_args(["--suite", "gem", "--out", "x.json"]).prewarm == 0


def test_worker_without_arguments_prints_usage():
    done = subprocess.run([sys.executable, "-m", bench.FLEX_WORKER], capture_output=True, text=True,
                          env=bench.isolated_env(), timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


# ---- command line -------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--suite", "nope", "--out", "x.json"], "unknown suite"),
    (["--suite", "gem", "--providers", "fa9", "--out", "x.json"], "unknown provider"),
    (["--suite", "gem", "--passes", "sideways", "--out", "x.json"], "unknown pass"),
    (["--suite", "gem", "--out", "x.json", "--max-seconds", "-5"], "must be > 0"),
    (["--suite", "gem", "--out", "x.json", "--max-seconds", "soon"], "number of seconds"),
    (["--suite", "gem"], "--out"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_parses_lists_and_all():
    args = bench.build_parser().parse_args(["--suite", "gem,pma", "--providers", "all", "--passes", "fwd,fwd+bwd",
                                            "--out", "r.json", "--quick", "--max-seconds", "500"])
    assert args.suite == ["gem", "pma"] and args.providers == list(specs.BENCH_PROVIDERS)
    assert args.passes == ["fwd", "fwd+bwd"] and args.quick and args.max_seconds == 500


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU prints")
def test_cli_without_gpu_points_to_the_report(capsys):
    assert bench.main(["--suite", "gem", "--out", "x.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
