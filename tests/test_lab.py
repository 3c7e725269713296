"""jfa.workbench.lab on a machine without a GPU, as the notebooks use it there.

`show` gives the package's own source with its file and line range; `machine` says in one line
whether the kernels run; `check` off a GPU compiles the kernels and shows the recorded GPU runs
under their label, and never reports a pass; the live check's comparisons run here with the
PyTorch reference standing in for the kernel, to show that they pass a right output and fail a
wrong one (plumbing only: the kernels are checked on the GPU, tests/gpu/test_exercises.py); the
sweep panel redraws in place; `try_fork` reports a fork's compile and CPU checks; `write_up` writes
a page that opens with no server. Recordings are synthetic files in a temporary results directory,
so the tests do not follow the checkout's results.
"""
import json
import linecache
import re
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import jfa
from jfa.kernels import fwd_sm90, hooks, ring
from jfa.variants import ALIBI, GLOBAL_TOKENS, alibi_slopes
from jfa.workbench import envinfo, lab
from jfa.workbench.inspect import KernelReport, Role

DATE = "2026-11-30T17:21:30+00:00"
ENV = {"gpu": "NVIDIA H200", "sm": "sm_90", "torch": "2.11.0+cu130", "triton": "3.8.0", "commit": "abc1234def",
       "date": DATE}
GEM_TFLOPS = {"L=512,s=0.5": 300.0, "L=1024,s=0.5": 400.0, "L=2048,s=0.5": 500.0}


def _h2h_case(suite: str, case: str, jfa_tflops: float) -> dict:
    providers = {name: {"fwd_ms": 1.0 / scale, "bwd_ms": 2.0 / scale, "fwd_tflops": jfa_tflops * scale,
                        "bwd_tflops": 0.8 * jfa_tflops * scale, "fwd_spread": 0.01}
                 for name, scale in (("jfa", 1.0), ("fa4", 0.9), ("fa2", 0.6))}
    return {"suite": suite, "case": case, "providers": providers}


@pytest.fixture
def results(tmp_path) -> Path:
    """A results directory with a gpu-tests, a head-to-head and a block benchmark recording."""
    tests = [("tests/gpu/test_jagged_fwd.py::test_forward[a]", "passed"),
             ("tests/gpu/test_jagged_fwd.py::test_forward[b]", "passed"),
             ("tests/gpu/test_jagged_bwd.py::test_backward[a]", "failed"),
             ("tests/gpu/test_variants.py::test_variant_matches_its_reference[alibi-full]", "passed"),
             ("tests/gpu/test_variants.py::test_variant_matches_its_reference[softcap-full]", "passed"),
             ("tests/gpu/test_block_attn.py::test_forward_matches_reference[x]", "passed")]
    directory = tmp_path / "results"
    directory.mkdir()
    (directory / "gpu-tests-20261130T171823Z.json").write_text(json.dumps(
        {"env": ENV, "tests": [{"test": t, "outcome": o, "seconds": 1.0} for t, o in tests]}))
    cases = [_h2h_case("gem", case, tflops) for case, tflops in GEM_TFLOPS.items()]
    cases.append(_h2h_case("pma", "q=64,kv<=2048", 250.0))
    (directory / "h2h-fa4-fa2-20261130T171151Z.json").write_text(json.dumps(
        {"kind": "head-to-head", "peers": ["fa4", "fa2"], "env": ENV, "cases": cases}))
    rows = [{"suite": "block", "case": "L=1024,s=0.5,D=128", "provider": p, "pass": ps, "ms": 1.0, "tflops": t,
             "ok": True, "error": None, "params": {}} for p, t in (("jfa", 128.0), ("fa2", 79.0)) for ps in ("fwd", "bwd")]
    (directory / "bench-block.json").write_text(json.dumps({"env": ENV, "rows": rows}))
    return directory


@pytest.fixture(autouse=True)
def no_remembered_results(monkeypatch):
    """Each test starts with no results directory from `setup`."""
    monkeypatch.setitem(lab._state, "results", None)


@pytest.fixture
def fake_compile(monkeypatch):
    """Compiles skipped: each kernel 'compiles' to the same report (the real compile has its own test)."""
    names = []

    def inspect(spec, target="sm_90"):
        names.append(spec.name)
        return KernelReport(name=spec.name, target=target, roles=[Role("producer", 4, None, 24),
                                                                   Role("consumer0", 4, 240, 240)],
                            total_warps=8, shared_bytes=123_456, tmem_columns=None, setmaxnreg={}, instructions={},
                            spill_bytes={"stores": 8, "loads": 16}, loops=[])
    monkeypatch.setattr(lab, "_inspect", inspect)
    return names


@pytest.fixture
def no_gpu(monkeypatch):
    """The machine as these tests assume it: no CUDA GPU, TLX importable."""
    monkeypatch.setattr(envinfo, "gpu_status", lambda: (False, "no CUDA GPU"))
    monkeypatch.setattr(envinfo, "tlx_status", lambda: (True, "importable"))


def _define(source: str, name: str = "cell") -> dict:
    """Run `source` as a notebook cell would: with its text in linecache, so @triton.jit finds it."""
    filename = f"<notebook {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


# ---- show -----------------------------------------------------------------------------------------
def test_show_gives_a_jit_functions_own_lines_with_its_file_and_range():
    shown = lab.show(ring.make_ring)
    listing = shown.listings[0]
    assert listing.name == "jfa.kernels.ring.make_ring" and listing.path == "jfa/kernels/ring.py"
    file_lines = Path(ring.__file__).read_text().splitlines()
    assert listing.code.splitlines() == file_lines[listing.first - 1:listing.last]
    assert listing.code.startswith("@triton.jit\ndef make_ring(")
    assert f"jfa/kernels/ring.py:{listing.first}-{listing.last}" in shown.headline()
    page = shown._repr_html_()
    assert "make_ring" in page and "style=" in page, "highlighted with inline styles"
    assert f"{listing.first:5d}  @triton.jit" in repr(shown)


def test_show_picks_lines_by_number_or_by_text():
    whole = lab.show(fwd_sm90._attend_key_tile).listings[0]
    part = lab.show(fwd_sm90._attend_key_tile, lines=(2, 3)).listings[0]
    assert part.first == whole.first + 1 and part.code.splitlines() == whole.code.splitlines()[1:3]
    by_text = lab.show(fwd_sm90._attend_key_tile, lines=("ring_wait(k_ring", "return")).listings[0]
    assert by_text.code.lstrip().startswith("k_index = ring_wait(k_ring")
    assert by_text.code.rstrip().endswith("return p, acc, m_i, l_i, count + 1")
    with pytest.raises(ValueError, match="no line"):
        lab.show(fwd_sm90._attend_key_tile, lines=("no such text", "return"))
    with pytest.raises(ValueError, match="outside"):
        lab.show(fwd_sm90._attend_key_tile, lines=(1, 10_000))


def test_show_takes_classes_dotted_names_variants_and_notebook_code():
    assert "class Fork(NamedTuple)" in lab.show(hooks.Fork).code
    assert lab.show("jfa.kernels.ring.make_ring").code == lab.show(ring.make_ring).code
    both = lab.show(GLOBAL_TOKENS)
    assert [listing.name for listing in both.listings] == ["jfa.variants._global_tokens",
                                                           "jfa.variants._global_tokens_blocks"]
    cell = _define("import triton\n\n@triton.jit\ndef my_bias(score, seq, head, q_idx, k_idx, params):\n"
                   "    return score + 1\n")
    mine = lab.show(cell["my_bias"]).listings[0]
    assert mine.path == "defined in this notebook" and "return score + 1" in mine.code
    with pytest.raises(TypeError, match="no source"):
        lab.show(3)


# ---- machine ---------------------------------------------------------------------------------------
def test_machine_says_in_one_line_why_the_kernels_do_not_run(no_gpu):
    m = lab.machine()
    assert not m.runs and m.compiles
    assert "\n" not in m.line and "do not run here (no CUDA GPU)" in m.line and "recorded" in m.line
    assert "not live" in m._repr_html_()


def test_machine_on_a_hopper_gpu(monkeypatch):
    monkeypatch.setattr(envinfo, "gpu_status", lambda: (True, "NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    m = lab.machine()
    assert m.runs and "run here: NVIDIA H200 (sm_90)" in m.line


# ---- check off a GPU: compiled kernels and the recorded runs, never a pass ------------------------------
def test_check_off_a_gpu_compiles_and_shows_the_recorded_run(no_gpu, fake_compile, results):
    report = lab.check(jfa.jagged_attention, causal=True, results=results)
    assert report.passed is None and not report.live and report.tensors == []
    assert "not checked here" in report.headline() and "PASS" not in repr(report)
    assert "needs a Hopper GPU" in report.headline()
    assert fake_compile == ["jagged_fwd", "jagged_bwd_dq", "jagged_bwd_dkdv"]
    text = repr(report)
    assert "recorded on the H200, 2026-11-30" in text and "commit abc1234def" in text
    assert re.search(r"tests/gpu/test_jagged_fwd.py\s+2 passed", text)
    assert re.search(r"tests/gpu/test_jagged_bwd.py\s+1 failed", text)
    assert "failed: tests/gpu/test_jagged_bwd.py::test_backward[a]" in text
    assert re.search(r"gem L=1024,s=0.5\s+400\s+360\s+240", text), "the recorded head-to-head's TFLOP/s"
    page = report._repr_html_()
    assert "recorded on the H200, 2026-11-30" in page and "123,456" in page


def test_check_of_each_entry_point_names_its_kernels_and_recordings(no_gpu, fake_compile, results):
    block = lab.check(jfa.block_attention, results=results)
    assert list(block.compiled.reports) == ["forward", "backward"]
    assert "forward (block_attn)" in repr(block.compiled)
    assert re.search(r"tests/gpu/test_block_attn.py\s+1 passed", repr(block))
    assert "block L=1024,s=0.5,D=128" in repr(block)
    fp8 = lab.check("fp8", results=results)
    assert list(fp8.compiled.reports) == ["forward"]
    assert "no recorded GPU test run of tests/gpu/test_fp8.py" in repr(fp8)
    sparse = lab.check(jfa.block_sparse_attention, compile=False, results=results)
    assert sparse.compiled is None and "test_block_sparse.py" in repr(sparse)
    with pytest.raises(ValueError, match="causal"):
        lab.check("block", causal=True)
    with pytest.raises(TypeError, match="target"):
        lab.check(print)


def test_check_of_a_variant_shows_its_own_recorded_tests_or_says_there_are_none(no_gpu, results):
    alibi = repr(lab.check(ALIBI, params=(alibi_slopes(4),), compile=False, results=results))
    assert "test_variant_matches_its_reference[alibi-full]" in alibi and "softcap-full" not in alibi
    assert "unforked kernel" in alibi, "the recorded speed is the unforked kernel's, and says so"
    mine = jfa.variant("my own", mask_mod=GLOBAL_TOKENS.fork.mask_mod)
    text = repr(lab.check(mine, params=(4, 64), compile=False, results=results))
    assert "no recorded run of variant 'my own' itself" in text


def test_check_without_a_results_directory_says_where_to_find_one(no_gpu):
    text = repr(lab.check(compile=False))
    assert "no results directory given" in text and "lab.setup(RESULTS)" in text


def test_setup_remembers_the_results_directory(no_gpu, results, monkeypatch):
    import plotly.io as pio

    monkeypatch.setattr(pio.renderers, "default", pio.renderers.default)
    monkeypatch.setattr(pio.templates, "default", pio.templates.default)
    assert not lab.setup(results).runs
    assert pio.renderers.default == "plotly_mimetype"
    assert "recorded on the H200" in repr(lab.check(compile=False))


def test_a_compile_error_is_shown_not_raised(no_gpu):
    @triton.jit
    def broken(score, seq, head, q_idx, k_idx, params):
        return score + tl.no_such_function(score)

    @triton.jit
    def broken_grad(grad, score, seq, head, q_idx, k_idx, params):
        return grad

    report = lab.compile_kernels(jfa.variant("broken", score_mod=broken, score_grad=broken_grad), kernels=["forward"])
    assert not report.ok and isinstance(report.reports["forward"], str)
    assert "does NOT compile" in report.headline() and "compile error" in repr(report)


def test_compile_kernels_really_compiles_a_variant_for_sm90():
    report = lab.compile_kernels(ALIBI, params=(alibi_slopes(4),), kernels=["forward"])
    assert report.ok, repr(report)
    forward = report.reports["forward"]
    assert forward.target == "sm_90" and [r.name for r in forward.roles][:3] == ["producer", "consumer0", "consumer1"]
    assert re.search(r"forward \(fwd_sm90\)\s+12\s+producer 24, consumer0 2\d\d, consumer1 2\d\d", repr(report))


# ---- the live check's comparisons, with the reference standing in for the kernel ------------------------
@pytest.fixture
def reference_as_kernel(monkeypatch):
    """The live path on the CPU: every entry point's CPU fallback (the reference) stands in for its kernel."""
    monkeypatch.setattr(lab, "LIVE_DEVICE", "cpu")
    monkeypatch.setattr(lab, "_why_not_live", lambda target, *tensors: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jfa.ReferenceFallbackWarning)
        yield


@pytest.mark.parametrize("target,options", [
    ("jagged", {}), ("jagged", dict(causal=True, window=40, heads=(4, 2))), ("jagged", dict(broadcast_q=True)),
    ("block", {}), ("block_sparse", dict(causal=True)), ("fp8", {}),
    (ALIBI, dict(params=(alibi_slopes(4),))), (GLOBAL_TOKENS, dict(params=(4, 64), causal=True))],
    ids=["jagged", "causal-window-gqa", "broadcast-q", "block", "block-sparse", "fp8", "alibi", "global-tokens"])
def test_the_live_comparison_passes_a_right_output(reference_as_kernel, target, options):
    report = lab.check(target, head_dim=64, lengths=(0, 1, 65, 200), seed=5, live=True, **options)
    assert report.live and report.passed, repr(report)
    names = [c.name for c in report.tensors]
    assert names[0] == "out" and (names[-3:] == ["dq", "dk", "dv"] or target == "fp8")
    assert "seed 5" in report.headline() and "PASS" in report.headline()


def test_the_live_comparison_fails_a_wrong_output(reference_as_kernel, monkeypatch):
    right = jfa.jagged_attention

    def off_by_a_bit(*args, **kwargs):
        out, lse = right(*args, **kwargs)
        return out * 1.05, lse
    monkeypatch.setattr(jfa, "jagged_attention", off_by_a_bit)
    report = lab.check(head_dim=64, lengths=(1, 65, 200), live=True)
    assert report.passed is False and "FAIL" in report.headline()
    out = report.tensors[0]
    assert out.name == "out" and not out.passed and out.bad > 0 and out.rel > 0.04
    assert [c.name for c in report.tensors if c.passed] == ["lse"]


def test_the_live_check_reports_a_kernel_that_cannot_run(monkeypatch):
    def launch_fails(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(lab, "_run_live_check", launch_fails)
    report = lab.check(head_dim=64, live=True)
    assert report.live and report.passed is False
    assert "FAILED to run: RuntimeError: CUDA error: an illegal memory access" in report.headline()


# ---- benchmark, off a GPU: the recorded numbers, labelled ---------------------------------------------
def test_benchmark_off_a_gpu_is_the_recorded_head_to_head(no_gpu, results):
    bench = lab.benchmark(ALIBI, params=(alibi_slopes(4),), results=results)
    assert not bench.live and bench.source.startswith("recorded on the H200, 2026-11-30")
    cases = {r["case"] for r in bench.rows}
    assert cases == set(GEM_TFLOPS) and {r["provider"] for r in bench.rows} == {"jfa", "fa4", "fa2"}
    assert "alibi (fork): not measured (its speed needs a Hopper GPU)" in repr(bench)
    assert [f.layout.title.text for f in bench.figures()] == ["fwd TFLOP/s (recorded)", "bwd TFLOP/s (recorded)"]
    odd = lab.benchmark(cases=[lab.Case(max_len=1024, causal=True)], results=results)
    assert odd.rows == [] and "not in the recording" in repr(odd)


def test_cases_name_the_suite_cases_they_match():
    assert lab.Case(max_len=2048).suite_case() == ("gem", "L=2048,s=0.5")
    assert lab.Case(max_len=2048, q_len=64).suite_case() == ("pma", "q=64,kv<=2048")
    assert lab.Case(max_len=1024, causal=True).suite_case() is None
    assert lab.Case(max_len=1024, causal=True, head_dim=64).label == "L=1024,s=0.5,B=1152,H=4,D=64,causal"


# ---- sweep: redrawn in place ------------------------------------------------------------------------
def test_the_recorded_sweep_redraws_in_place(no_gpu, results, capsys):
    panel = lab.sweep(results)
    assert isinstance(panel, lab.Sweep)
    assert "recorded on the H200, 2026-11-30" in panel.header.value
    first = panel.output.outputs
    assert len(first) == 2 and "application/vnd.plotly.v1+json" in first[0]["data"]
    assert panel.figure.layout.title.text == "gem fwd: TFLOP/s (recorded)"
    assert list(panel.figure.data[0].y) == list(GEM_TFLOPS.values())
    panel.controls["pass_"].value = "bwd"
    assert panel.figure.layout.title.text == "gem bwd: TFLOP/s (recorded)"
    assert len(panel.output.outputs) == 2, "the Output's content is replaced, not appended to"
    assert panel.output.outputs[0]["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"] == \
        "gem bwd: TFLOP/s (recorded)"
    panel.controls["suite"].value = "pma"
    panel.controls["metric"].value = "speedup of jfa"
    assert [trace.name for trace in panel.figure.data] == ["jfa vs fa4", "jfa vs fa2"]
    assert panel.figure.data[0].y[0] == pytest.approx(1 / 0.9)
    assert capsys.readouterr().out == "", "nothing displayed itself outside the panel"


def test_the_sweep_without_a_recording_says_so(no_gpu, tmp_path):
    line = lab.sweep(tmp_path)
    assert "No recorded head-to-head" in repr(line) and "do not run here" in repr(line)


def test_the_live_sweep_measures_each_point_once_and_redraws(no_gpu, capsys):
    measured = []

    def measure(case):
        measured.append(case.max_len)
        check = lab.CheckReport("fake", True, line="", tensors=[
            lab.TensorCheck("out", (1,), 0.0, 1e-3 * case.max_len / 1024, 50.0, 0, 1, "", True)])
        rows = [{"suite": "live", "case": case.label, "provider": p, "pass": ps, "ms": 1.0, "ok": True,
                 "tflops": case.max_len / 10 * (1 if p == "jfa" else 0.8), "error": None, "params": {}}
                for p in ("jfa", "fa4") for ps in ("fwd", "bwd")]
        return {"check": check, "rows": rows}

    panel = lab.sweep(live=True, measure=measure)
    assert sorted(measured) == [1024, 2048]
    assert [trace.name for trace in panel.figure.data] == ["jfa", "fa4", "out rel err"]
    assert list(panel.figure.data[0].y) == [102.4, 204.8]
    panel.controls["lengths"].value = (512, 1024, 2048)
    assert sorted(measured) == [512, 1024, 2048], "a point measured once is not measured again"
    assert list(panel.figure.data[0].x) == [512, 1024, 2048] and len(panel.output.outputs) == 2
    panel.controls["causal"].value = True
    assert len(measured) == 6 and "causal" in panel.figure.layout.title.text
    assert "L=512: pass" in panel.output.outputs[1]["data"]["text/plain"]
    assert capsys.readouterr().out == ""


# ---- try_fork off a GPU ------------------------------------------------------------------------------
def test_try_fork_off_a_gpu_reports_compile_and_cpu_checks(no_gpu, fake_compile):
    report = lab.try_fork(GLOBAL_TOKENS, params=(4, 64))
    assert report.passed is None and report.check is None and report.speed is None
    assert "needs a Hopper GPU" in report.headline()
    assert set(report.compiled.reports) == {"forward", "dq", "dkdv"}
    assert report.compiled.baseline is not None and "unforked 8 / 16" in repr(report.compiled)
    text = repr(report)
    assert "block_mask never rules out a block" in text and "pass" in text
    assert re.search(r"rules out \d+% of the 128 x 128 key tiles", text)
    assert "no kernel involved" in text


def test_try_fork_catches_a_wrong_derivative_on_the_cpu(no_gpu):
    @triton.jit
    def doubled(score, seq, head, q_idx, k_idx, params):
        return 2 * score

    @triton.jit
    def wrong(grad, score, seq, head, q_idx, k_idx, params):
        return grad

    report = lab.try_fork(jfa.variant("doubled", score_mod=doubled, score_grad=wrong), compile=False)
    assert report.passed is False and "FAILS" in report.headline()
    assert "differs from the derivative of score_mod" in repr(report)


def test_skipped_key_tiles_counts_what_a_block_mask_rules_out():
    assert lab.skipped_key_tiles(ALIBI) is None
    band = lab.skipped_key_tiles(GLOBAL_TOKENS, (0, 1), length=1024, block=128)
    assert band == pytest.approx(1 - (8 + 2 * 7) / 64), "a narrow band keeps the diagonal tiles and their neighbours"


# ---- write_up -------------------------------------------------------------------------------------------
def test_write_up_writes_a_self_contained_page(no_gpu, results, tmp_path):
    path = tmp_path / "out" / "writeup.html"
    written = lab.write_up(path, title="Global tokens at L=2048", variant=GLOBAL_TOKENS, params=(4, 64),
                           summary="What I tried.\n\nWhat I found.", results=results,
                           sections=[("Notes", "A closing paragraph.")])
    page = path.read_text()
    assert written.path == path and "wrote" in written.headline()
    assert "<h1>Global tokens at L=2048</h1>" in page and "<p>What I found.</p>" in page
    assert "_global_tokens_blocks" in page and "k_lo" in page, "the hooks' source"
    assert "block_mask never rules out a block" in page, "the variant's own checks"
    assert "recorded on the H200, 2026-11-30" in page and "Plotly.newPlot" in page, "the benchmark and its plots"
    assert f"<td style=\"padding:2px 10px;border-bottom:1px solid #ddd;text-align:left\">{torch.__version__}" in page
    assert "A closing paragraph." in page
    scripts = re.findall(r"<script[^>]*>", page)
    assert scripts and not any("src" in tag for tag in scripts), "no external script: it opens with no network"
    assert len(page) > 3_000_000, "plotly.js is inline"
