"""`python -m jfa bench`: time every provider on the same inputs, check it first, append JSON rows.

A run takes suites from `jfa.specs.BENCH_SUITES` (shapes only), builds the tensors here (lengths from
`jfa.jagged.gem_lengths`), and for each (case, provider):

1. builds the provider on every input set (`jfa.workbench.providers`); an unavailable provider becomes a row
   with `ok: false` and the reason, never a crash;
2. checks its output against the fp32 reference (`jfa.reference`) on a subset of sequences and
   records how many rows were compared (`checked_rows`); a wrong output is a failed row too;
3. times fwd and fwd+bwd with `triton.testing.do_bench` (median, after warm-up), rotating input sets
   so a small case is not served from the L2 left by the previous call; bwd = (fwd+bwd) - fwd;
4. appends the rows to `--out` and rewrites it at once, so a run stopped by `--max-seconds` (or
   killed) resumes where it was: (suite, case, provider, pass) rows already present are skipped.

FlexAttention needs the Triton that torch ships, not the TLX build on this process's path, so it runs
in `jfa.workbench.flex_worker` with a cleaned environment and sends its rows back as JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TextIO

import torch

from jfa import specs
from jfa.workbench.providers import ISOLATED_PROVIDERS, PROVIDERS, Problem, ProviderRun, ProviderUnavailable

# The worker runs as `python -m FLEX_WORKER` in IMPORT_ROOT, the directory this jfa was imported from (a
# checkout or site-packages), with only that directory on its PYTHONPATH: it imports this same jfa.
FLEX_WORKER = "jfa.workbench.flex_worker"
IMPORT_ROOT = Path(__file__).resolve().parents[2]
# Environment the TLX bundles add (.gpu-bundle/activate.sh, .fa4-part2/activate.sh): a worker that
# must see torch's own Triton starts without them.
BUNDLE_ENV_VARS = ("EXTRA_SITE_DIRS", "TRITON_PLUGIN_PATHS", "TRITON_PTXAS_PATH", "TRITON_CUOBJDUMP_PATH",
                   "TRITON_NVDISASM_PATH")
PROGRESS_BAR_WIDTH = 20
STDERR_TAIL_CHARS = 2000
LSE_BYTES = 4  # float32 log-sum-exp per (head, output row)
OUTPUT_ELEMENT_BYTES = 2  # every provider writes bf16 outputs (FP8 kernels included)
NEVER_PICKED = 2.0  # block-sparse score of blocks past a sequence: above every torch.rand value

Timer = Callable[[Callable[[], object], list], float]


class OutputMismatch(RuntimeError):
    """The provider ran but its output disagrees with the reference."""


# ---- problems: the input sets of one case (`providers.Problem`) ------------------------------
def _gem_lengths(batch: int, max_len: int, sparsity: float, seed: int) -> list[int]:
    from jfa.jagged import gem_lengths

    return [int(n) for n in gem_lengths(batch, max_len, sparsity, seed)]


def case_lengths(case: dict) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) per batch; pma lists its shared q_len once per batch."""
    batch, max_len = case["batch"], case["max_len"]
    if case["kind"] == "dense":
        return [max_len] * batch, [max_len] * batch
    lengths = _gem_lengths(batch, max_len, case["sparsity"], specs.BENCH_SEED)
    if case["kind"] == "pma":
        return [case["q_len"]] * batch, lengths
    if case["kv_len"] is not None:
        return lengths, [case["kv_len"]] * batch
    return lengths, lengths


def _offsets(lengths: Iterable[int], device) -> torch.Tensor:
    bounds = [0, *itertools.accumulate(lengths)]
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _block_sizes(lengths: Iterable[int], block: int) -> list[int]:
    """Sizes of the `block`-token blocks of each sequence, the last one partial."""
    sizes = []
    for n in lengths:
        sizes += [block] * (n // block) + ([n % block] if n % block else [])
    return sizes


def block_sparse_selection(lengths: list[int], heads: int, density: float, seed: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random KV-block selection: each (sequence, head, query block) keeps ceil(density * n) blocks.

    Returns (kv_block_idx [B, H, nqb, max_sel] int32, -1 padded, as `block_sparse_attention_ref`
    takes it; the same as a dense [B, H, nqb, nkb] bool mask for FlexAttention).
    """
    block = specs.BLOCK_SPARSE_BLOCK
    n_blocks = torch.tensor([-(-n // block) for n in lengths])
    widest = max(int(n_blocks.max()), 1)
    keep = torch.clamp(torch.ceil(density * n_blocks).to(torch.int64), min=1)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(len(lengths), heads, widest, widest, generator=gen)
    beyond = torch.arange(widest)[None, :] >= n_blocks[:, None]  # [B, nkb]: blocks past the sequence
    scores = scores.masked_fill(beyond[:, None, None, :], NEVER_PICKED)
    order = scores.argsort(dim=-1)
    rank = order.argsort(dim=-1)
    dense = (rank < keep[:, None, None, None]) & ~beyond[:, None, None, :]
    max_sel = int(keep.max())
    unused = torch.arange(max_sel)[None, None, None, :] >= keep[:, None, None, None]
    idx = order[..., :max_sel].to(torch.int32).masked_fill(unused, -1)
    return idx, dense


def _random(shape, gen: torch.Generator, device, dtype: torch.dtype, grad: bool) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return t.requires_grad_(grad)


def make_problem(case: dict, device, set_index: int, lengths: tuple[list[int], list[int]] | None = None) -> Problem:
    """Input set `set_index` of `case`: same lengths as every other set, fresh random values."""
    q_lens, kv_lens = lengths or case_lengths(case)
    kind, heads, head_dim = case["kind"], case["heads"], case["head_dim"]
    dtype = getattr(torch, case["dtype"])
    grad = kind != "fp8"  # the FP8 kernels are forward-only
    gen = torch.Generator(device=device).manual_seed(specs.BENCH_SEED + 1 + set_index)
    q_rows = case["q_len"] if kind == "pma" else sum(q_lens)
    q = _random((q_rows, heads, head_dim), gen, device, dtype, grad)
    k = _random((sum(kv_lens), heads, head_dim), gen, device, dtype, grad)
    v = _random((sum(kv_lens), heads, head_dim), gen, device, dtype, grad)
    q_offsets = _offsets([case["q_len"]] if kind == "pma" else q_lens, device)
    problem = Problem(kind, case["batch"], heads, head_dim, q, k, v, q_offsets, _offsets(kv_lens, device),
                      q_lens, kv_lens, max(q_lens, default=0), max(kv_lens, default=0))
    if kind == "block":
        problem.block_offsets = _offsets(_block_sizes(q_lens, specs.BLOCK_ATTENTION_BLOCK), device)
    if kind == "block_sparse":
        idx, dense = block_sparse_selection(q_lens, heads, case["density"], specs.BENCH_SEED)
        problem.kv_block_idx, problem.kv_block_dense = idx.to(device), dense.to(device)
    return problem


# ---- what a case costs: FLOPs and compulsory bytes per pass ------------------------------------
def case_flops(case: dict, problem: Problem, pass_: str) -> float:
    """FLOPs by `specs.attention_flops`; block kinds count each (query block, key block) pair as a
    small dense attention problem, so only the scores actually computed are counted."""
    heads, head_dim = case["heads"], case["head_dim"]
    if case["kind"] == "block":
        sizes = _block_sizes(problem.q_lens, specs.BLOCK_ATTENTION_BLOCK)
        return specs.attention_flops(sizes, sizes, heads, head_dim, pass_=pass_)
    if case["kind"] == "block_sparse":
        block = specs.BLOCK_SPARSE_BLOCK
        dense = problem.kv_block_dense.cpu()
        widest = dense.shape[-1]
        starts = torch.arange(widest) * block
        sizes = (torch.tensor(problem.q_lens)[:, None] - starts[None, :]).clamp(0, block)  # [B, nblocks]
        picked = dense.nonzero()  # rows of (b, h, qb, kb)
        q_sizes = sizes[picked[:, 0], picked[:, 2]].tolist()
        kv_sizes = sizes[picked[:, 0], picked[:, 3]].tolist()
        return specs.attention_flops(q_sizes, kv_sizes, 1, head_dim, pass_=pass_)
    return specs.attention_flops(problem.q_lens, problem.kv_lens, heads, head_dim, pass_=pass_)


def median_tflops(case: dict, problem: Problem, pass_: str, ms_by_variant: dict) -> dict:
    """TFLOP/s at each variant's median time over rounds (`ms_by_variant`: variant -> list of ms),
    the upper median so that an even number of rounds never averages two of them."""
    flops = case_flops(case, problem, pass_)
    return {name: specs.tflops(flops, statistics.median_high(ms)) for name, ms in ms_by_variant.items()}


def case_bytes(problem: Problem, pass_: str) -> float:
    """Compulsory HBM traffic: each input read once, each output written once (roofline x-axis).

    fwd reads q, k, v and writes o and the LSE; bwd reads q, k, v, o, dO and the LSE and writes dq,
    dk, dv (plus the Delta = rowsum(o * dO) it makes and reads back).
    """
    row = problem.heads * problem.head_dim
    elem = problem.q.element_size()
    q_in, kv, out = problem.q.shape[0], problem.k.shape[0], problem.out_rows
    fwd = row * (elem * (q_in + 2 * kv) + OUTPUT_ELEMENT_BYTES * out) + LSE_BYTES * problem.heads * out
    bwd = (row * (elem * (2 * q_in + 4 * kv) + OUTPUT_ELEMENT_BYTES * 2 * out)
           + 2 * LSE_BYTES * problem.heads * out)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]


def input_sets_for(problem: Problem) -> int:
    """How many input sets to rotate so consecutive timed calls touch different memory."""
    set_bytes = sum(t.numel() * t.element_size() for t in (problem.q, problem.k, problem.v))
    return max(1, min(specs.BENCH_MAX_INPUT_SETS, math.ceil(specs.BENCH_ROTATION_BYTES / max(set_bytes, 1))))


# ---- the reference check -------------------------------------------------------------------------
def _checked_batches(problem: Problem) -> list[int]:
    """The longest sequence, the shortest non-empty one, then evenly spaced ones, within the row budget."""
    rows_of = problem.q_lens
    nonempty = [b for b in range(problem.batch) if rows_of[b] > 0]
    if not nonempty:
        return []
    candidates = [max(nonempty, key=lambda b: rows_of[b]), min(nonempty, key=lambda b: rows_of[b])]
    stride = max(1, len(nonempty) // 64)
    candidates += nonempty[::stride]
    chosen, rows = [], 0
    for b in dict.fromkeys(candidates):
        if chosen and rows + rows_of[b] > specs.BENCH_CHECK_MAX_ROWS:
            continue
        chosen.append(b)
        rows += rows_of[b]
    return sorted(chosen)


def _slices(offsets: torch.Tensor, batches: list[int]) -> list[slice]:
    bounds = offsets.tolist()
    return [slice(bounds[b], bounds[b + 1]) for b in batches]


def _gather(t: torch.Tensor, pieces: list[slice]) -> torch.Tensor:
    return torch.cat([t[s] for s in pieces]) if pieces else t[:0]


def reference_rows(problem: Problem, batches: list[int]) -> tuple[torch.Tensor, list[slice]]:
    """fp32 reference output of `batches` and where their rows sit in the provider's packed output."""
    from jfa import reference

    q, k, v = problem.q.detach(), problem.k.detach(), problem.v.detach()
    kv_pieces = _slices(problem.kv_offsets, batches)
    kv_sub = _offsets([problem.kv_lens[b] for b in batches], q.device)
    if problem.kind == "pma":
        q_len = q.shape[0]
        out_pieces = [slice(b * q_len, (b + 1) * q_len) for b in batches]
        ref, _ = reference.jagged_attention_ref(q, _gather(k, kv_pieces), _gather(v, kv_pieces),
                                                problem.q_offsets, kv_sub, broadcast_q=True)
        return ref, out_pieces
    q_pieces = _slices(problem.q_offsets, batches)
    q_sub = _offsets([problem.q_lens[b] for b in batches], q.device)
    q_s, k_s, v_s = _gather(q, q_pieces), _gather(k, kv_pieces), _gather(v, kv_pieces)
    if problem.kind == "block":
        return reference.block_attention_ref(q_s, k_s, v_s, q_sub), q_pieces
    if problem.kind == "block_sparse":
        block = specs.BLOCK_SPARSE_BLOCK
        ref, _ = reference.block_sparse_attention_ref(q_s, k_s, v_s, q_sub, kv_sub,
                                                      problem.kv_block_idx[batches], block, block)
        return ref, q_pieces
    ref, _ = reference.jagged_attention_ref(q_s, k_s, v_s, q_sub, kv_sub)
    return ref, q_pieces


def check_output(problem: Problem, out_packed: torch.Tensor) -> dict:
    """Compare a provider's packed output with the fp32 reference; raise OutputMismatch if wrong.

    bf16/fp16: every checked element within specs.FWD_TOL. FP8 inputs: cosine similarity and SQNR
    against the reference on the same (already quantized) inputs (`specs.FP8_MIN_*`).
    """
    expected_shape = (problem.out_rows, problem.heads, problem.head_dim)
    if tuple(out_packed.shape) != expected_shape:
        raise OutputMismatch(f"output shape {tuple(out_packed.shape)}, expected {expected_shape}")
    batches = _checked_batches(problem)
    ref, pieces = reference_rows(problem, batches)
    got = _gather(out_packed.detach(), pieces).float()
    ref = ref.float()
    diff = got - ref
    stats = {"checked_rows": int(got.shape[0]),
             "max_abs_err": float(diff.abs().max()) if diff.numel() else 0.0,
             "rel_err": float(diff.norm() / ref.norm().clamp_min(1e-30))}
    if not bool(torch.isfinite(got).all()):
        raise OutputMismatch(f"non-finite output in the {stats['checked_rows']} checked rows")
    if problem.kind == "fp8":
        from jfa.reference import fp8_agreement

        cosine, sqnr_db = fp8_agreement(got, ref)
        stats.update(cosine=cosine, sqnr_db=sqnr_db)
        if cosine < specs.FP8_MIN_COSINE or sqnr_db < specs.FP8_MIN_SQNR_DB:
            raise OutputMismatch(f"FP8 output off: cosine {cosine:.4f} (min {specs.FP8_MIN_COSINE}), "
                                 f"SQNR {sqnr_db:.1f} dB (min {specs.FP8_MIN_SQNR_DB})")
        return stats
    bad = ~torch.isclose(got, ref, **specs.FWD_TOL)
    if bool(bad.any()):
        raise OutputMismatch(f"{int(bad.sum())} of {bad.numel()} checked elements outside {specs.FWD_TOL} "
                             f"(max abs err {stats['max_abs_err']:.3g}, rel err {stats['rel_err']:.3g})")
    return stats


# ---- timing ----------------------------------------------------------------------------------------
def do_bench_median(fn: Callable[[], object], grad_to_none: list) -> float:
    """triton.testing.do_bench median in ms, with the anchors' warm-up and repetition times."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=specs.BENCH_WARMUP_MS, rep=specs.BENCH_REP_MS,
                    grad_to_none=grad_to_none or None, return_mode="median")


def time_passes(passes: Iterable[str], fwd: Callable[[], object], fwd_bwd: Callable[[], object] | None,
                timer: Timer, grad_to_none: list) -> dict[str, float]:
    """Milliseconds per requested pass. bwd is not timed alone: it is (fwd+bwd) - fwd, both medians.

    Missing backward (fwd_bwd None) leaves bwd and fwd+bwd out of the result.
    """
    passes = list(passes)
    need_fwd = "fwd" in passes or ("bwd" in passes and fwd_bwd is not None)
    need_fwd_bwd = fwd_bwd is not None and ("bwd" in passes or "fwd+bwd" in passes)
    fwd_ms = timer(fwd, []) if need_fwd else None
    fwd_bwd_ms = timer(fwd_bwd, grad_to_none) if need_fwd_bwd else None
    result = {}
    if "fwd" in passes:
        result["fwd"] = fwd_ms
    if "fwd+bwd" in passes and fwd_bwd_ms is not None:
        result["fwd+bwd"] = fwd_bwd_ms
    if "bwd" in passes and fwd_bwd_ms is not None:
        result["bwd"] = fwd_bwd_ms - fwd_ms
    return result


def _rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs calls[0], calls[1], ... in turn: a different input set every call."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _backward(run: ProviderRun, out: torch.Tensor, grad_out: torch.Tensor) -> None:
    """The backward of `out`; the gradients are returned, not accumulated into `.grad` (do_bench's
    first calls do not reset it, and a nested-tensor leaf cannot accumulate)."""
    torch.autograd.grad(out, run.grad_inputs, grad_out, allow_unused=True)


def _backward_step(run: ProviderRun, grad_out: torch.Tensor) -> Callable[[], None]:
    """Forward + backward, as one timed call."""
    def step() -> None:
        _backward(run, run.forward(), grad_out)
    return step


# ---- rows ---------------------------------------------------------------------------------------------
def _error_text(exc: BaseException) -> str:
    if isinstance(exc, ProviderUnavailable):
        return str(exc)
    if isinstance(exc, OutputMismatch):
        return f"wrong output: {exc}"
    return f"{type(exc).__name__}: {exc}"


def shape_params(case: dict) -> dict:
    """The case's shape fields that apply to it (None ones left out)."""
    return {key: case[key] for key in ("kind", "batch", "heads", "head_dim", "max_len", "sparsity", "kv_len",
                                       "q_len", "density", "dtype") if case.get(key) is not None}


def case_params(case: dict, problem: Problem, n_sets: int) -> dict:
    params = shape_params(case)
    params.update(total_q=problem.q.shape[0], total_kv=problem.k.shape[0], out_rows=problem.out_rows,
                  input_sets=n_sets)
    return params


def make_row(case: dict, provider: str, pass_: str, *, ms: float | None, flops: float | None, ok: bool,
             error: str | None, params: dict) -> dict:
    ok = ok and ms is not None and math.isfinite(ms) and ms > 0
    if ms is not None and not ok and error is None:
        error = f"{pass_} time not positive ({ms:.4g} ms): fwd+bwd and fwd medians too close to subtract"
    return {"suite": case["suite"], "case": case["case"], "provider": provider, "pass": pass_,
            "ms": ms if ok else None, "tflops": specs.tflops(flops, ms) if ok and flops else None,
            "ok": ok, "error": None if ok else error, "params": params}


@dataclass
class ReadyProvider:
    """One provider set up on a case's input sets: checked against the reference, warmed up."""

    fwd: Callable[[], object]  # one forward, a different input set each call
    fwd_bwd: Callable[[], object] | None  # forward + backward; None where the provider has no backward
    grads: list  # the tensors whose .grad do_bench resets
    no_backward: str | None  # why there is no backward, if there is none


def prepare_provider(builder: Callable, problems: list[Problem], extra: dict) -> ReadyProvider:
    """Build `builder`'s runs on every input set, check the first against the reference, and run
    each set once (compile, autotune, first touch) before any timing. `extra` is filled as this
    goes (the provider's notes, then the check's statistics), so a failure's row still carries them."""
    runs = [builder(problem) for problem in problems]
    extra["notes"] = runs[0].notes
    with torch.no_grad():  # one output per input set: a nested-tensor output's shape is its own
        outs = [run.forward() for run in runs]
    extra.update(check_output(problems[0], runs[0].to_packed(outs[0])))
    fwd = _rotating([run.forward for run in runs])
    fwd_bwd, grads = None, []
    if runs[0].no_backward is None:
        grad_outs = [torch.randn_like(out) for out in outs]
        fwd_bwd = _rotating([_backward_step(run, g) for run, g in zip(runs, grad_outs)])
        grads = [t for run in runs for t in run.grad_inputs]
    warm_up = fwd_bwd or fwd
    for _ in runs:  # compile, autotune and first-touch every input set before any timing
        warm_up()
    if problems[0].q.is_cuda:
        torch.cuda.synchronize()
    return ReadyProvider(fwd, fwd_bwd, grads, runs[0].no_backward)


def clear_grads(problems: list[Problem]) -> None:
    """Drop the .grad that timed backward passes left on the inputs."""
    for problem in problems:
        for t in (problem.q, problem.k, problem.v):
            t.grad = None


def measure_provider(case: dict, provider: str, builder: Callable, problems: list[Problem],
                     passes: list[str], timer: Timer) -> list[dict]:
    """All rows of one provider on one case: check first, then time; every failure is a row."""
    base = case_params(case, problems[0], len(problems))
    flops = {p: case_flops(case, problems[0], p) for p in passes}
    bytes_ = {p: case_bytes(problems[0], p) for p in passes}

    def rows_for(result: dict[str, float], error: str | None, extra: dict) -> list[dict]:
        return [make_row(case, provider, p, ms=result.get(p), flops=flops[p], ok=p in result,
                         error=error, params={**base, **extra, "flops": flops[p], "bytes": bytes_[p]})
                for p in passes]

    extra: dict = {}
    try:
        ready = prepare_provider(builder, problems, extra)
        result = time_passes(passes, ready.fwd, ready.fwd_bwd, timer, ready.grads)
    except Exception as exc:  # a broken provider is a result to report, not a reason to stop the run
        return rows_for({}, _error_text(exc), extra)
    finally:
        clear_grads(problems)
    rows = rows_for(result, None, extra)
    for row in rows:
        if not row["ok"] and row["error"] is None:  # a pass left out of `result`: no backward here
            row["error"] = ready.no_backward
    return rows


def build_problems(case: dict, device) -> list[Problem]:
    lengths = case_lengths(case)
    first = make_problem(case, device, 0, lengths)
    return [first] + [make_problem(case, device, i, lengths) for i in range(1, input_sets_for(first))]


def measure_case_in_process(case: dict, providers: list[str], passes: list[str], device="cuda",
                            timer: Timer = do_bench_median, registry: dict | None = None) -> list[dict]:
    """Rows of `providers` on `case`, all in this process (also the flex worker's entry point)."""
    registry = PROVIDERS if registry is None else registry
    problems = build_problems(case, device)
    rows = []
    for provider in providers:
        rows += measure_provider(case, provider, registry[provider], problems, passes, timer)
    return rows


def compile_case_in_process(case: dict, provider: str, device="cuda", registry: dict | None = None) -> None:
    """Run `provider` once forward and backward on one input set of `case`, untimed and unchecked.

    What it leaves behind is the point: torch.compile's and Triton's on-disk caches, which a later
    timed run of the same shapes reads instead of compiling again (see `warm_isolated`).
    """
    registry = PROVIDERS if registry is None else registry
    run = registry[provider](make_problem(case, device, 0, case_lengths(case)))
    out = run.forward()
    if run.no_backward is None:
        _backward(run, out, torch.randn_like(out))
    torch.cuda.synchronize()


# ---- FlexAttention in its own process ------------------------------------------------------------------
def isolated_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without the TLX/FA4 bundles: only IMPORT_ROOT on PYTHONPATH."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in BUNDLE_ENV_VARS}
    env["PYTHONPATH"] = str(IMPORT_ROOT)
    return env


class WorkerTimeout(RuntimeError):
    """The worker ran past the time this run had left; its case stays to do."""


def _run_worker(job: dict, timeout_s: float | None, python: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`jfa.workbench.flex_worker` on `job`, in the cleaned environment: (the process, its JSON or None).

    Raises subprocess.TimeoutExpired when it runs past `timeout_s`.
    """
    with tempfile.TemporaryDirectory(prefix="jfa-worker-") as tmp:
        spec, out = Path(tmp) / "job.json", Path(tmp) / "rows.json"
        spec.write_text(json.dumps(job))
        done = subprocess.run([python, "-m", FLEX_WORKER, str(spec), str(out)], env=isolated_env(),
                              cwd=IMPORT_ROOT, capture_output=True, text=True, timeout=timeout_s)
        result = json.loads(out.read_text()) if done.returncode == 0 and out.exists() else None
    return done, result


def measure_case_isolated(case: dict, provider: str, passes: list[str], timeout_s: float | None,
                          python: str = sys.executable) -> list[dict]:
    """Run one provider on one case in `jfa.workbench.flex_worker`; a crash becomes failed rows."""
    try:
        done, result = _run_worker({"case": case, "provider": provider, "passes": passes}, timeout_s, python)
    except subprocess.TimeoutExpired:
        raise WorkerTimeout(f"{provider} worker ran past {timeout_s:.0f} s") from None
    if result is not None:
        return result["rows"]
    why = f"{provider} worker exited with {done.returncode}: {done.stderr[-STDERR_TAIL_CHARS:].strip()}"
    return [make_row(case, provider, p, ms=None, flops=None, ok=False, error=why, params=shape_params(case))
            for p in passes]


def warm_isolated(jobs: list[tuple[dict, str]], workers: int, timeout_s: float | None,
                  python: str = sys.executable, stream: TextIO = sys.stderr) -> None:
    """Compile the isolated providers' kernels for `jobs` [(case, provider)], `workers` at a time.

    FlexAttention compiles for minutes per shape, on the CPU. Doing that for every case in parallel
    processes first, then timing one case at a time (each now a cache hit), keeps the GPU to one
    timed kernel at a time while the compiles share the host's cores. A worker that fails or runs
    out of time is only reported here; the timed run makes its failed row.
    """
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(job: tuple[dict, str]) -> str:
        case, provider = job
        try:
            done, _ = _run_worker({"case": case, "provider": provider, "compile_only": True}, timeout_s, python)
        except subprocess.TimeoutExpired:
            return "out of time"
        return "ok" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr[-STDERR_TAIL_CHARS:].strip()}"

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for (case, provider), outcome in zip(jobs, pool.map(compile_one, jobs)):
            print(f"bench: warmed {case['suite']} {case['case']} {provider} "
                  f"({time.monotonic() - started:.0f} s): {outcome}", file=stream, flush=True)


# ---- the results file ----------------------------------------------------------------------------------
# Environment fields that say which code produced a row; a resumed run that differs in any of them
# is recorded in the file's "resumed" list.
PROVENANCE_KEYS = ("commit", "torch", "triton", "tlx", "fa4")


class ResultsFile:
    """`{"env": {...}, "rows": [...]}` on disk, rewritten atomically after every case.

    `env` is the environment of the run that created the file. When a later run with other code
    (see PROVENANCE_KEYS) resumes it and adds rows, its env is appended to `"resumed"` with
    `"first_row"`, the index of the first row it adds: rows from there on (up to the next entry) are
    that run's. Dropping rows (`drop_failed`) moves the later entries' `first_row` with them.
    """

    def __init__(self, path: Path, env: dict):
        self.path = Path(path)
        self.data = {"env": env, "rows": []}
        self._resumed_env = None  # recorded when this run adds its first row, after any drop
        if self.path.exists():
            self.data = json.loads(self.path.read_text())
            if not isinstance(self.data, dict) or not isinstance(self.data.get("rows"), list):
                raise ValueError(f"--out {self.path}: not a jfa results file (no 'rows' list); pick another path")
            recorded_gpu = self.data.get("env", {}).get("gpu")
            if recorded_gpu != env.get("gpu"):
                raise ValueError(f"--out {self.path} holds results from GPU {recorded_gpu!r}, this is "
                                 f"{env.get('gpu')!r}: write to another file")
            latest = (self.data.get("resumed") or [self.data.get("env", {})])[-1]
            if any(latest.get(k) != env.get(k) for k in PROVENANCE_KEYS):
                self._resumed_env = env

    def key_set(self) -> set[tuple[str, str, str, str]]:
        return {(r["suite"], r["case"], r["provider"], r["pass"]) for r in self.data["rows"]}

    def run_env(self, index: int) -> dict:
        """The environment of the run that recorded row `index`."""
        env = self.data.get("env", {})
        for run in self.data.get("resumed", []):
            if run["first_row"] <= index:
                env = run
        return env

    def _drop(self, drop: list[bool]) -> int:
        """Remove the rows flagged in `drop`, moving the later runs' `first_row` with them; a resumed
        run left with no rows is forgotten."""
        kept = [not flag for flag in drop]
        runs = self.data.get("resumed", [])
        for run in runs:
            run["first_row"] = sum(kept[:run["first_row"]])
        before = len(self.data["rows"])
        self.data["rows"] = [r for r, keep in zip(self.data["rows"], kept) if keep]
        if runs:
            ends = [run["first_row"] for run in runs[1:]] + [len(self.data["rows"])]
            self.data["resumed"] = [run for run, end in zip(runs, ends) if end > run["first_row"]]
        return before - len(self.data["rows"])

    def drop_failed(self, suites: set[str], providers: set[str]) -> int:
        return self._drop([not r["ok"] and r["suite"] in suites and r["provider"] in providers
                           for r in self.data["rows"]])

    def drop_stale(self, suites: set[str], providers: set[str], passes: set[str], env: dict) -> int:
        """Drop the selected rows that a run with other code or versions (PROVENANCE_KEYS) recorded.

        Rows this code already measured stay, so an interrupted re-measurement resumes.
        """
        return self._drop([r["suite"] in suites and r["provider"] in providers and r["pass"] in passes
                           and any(self.run_env(i).get(k) != env.get(k) for k in PROVENANCE_KEYS)
                           for i, r in enumerate(self.data["rows"])])

    def add(self, rows: list[dict]) -> None:
        if rows and self._resumed_env is not None:
            self.data.setdefault("resumed", []).append(dict(self._resumed_env, first_row=len(self.data["rows"])))
            self._resumed_env = None
        self.data["rows"].extend(rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, allow_nan=False))
        os.replace(tmp, self.path)


# ---- the run ---------------------------------------------------------------------------------------------
def suite_cases(suites: Iterable[str], quick: bool) -> list[dict]:
    table = specs.BENCH_QUICK_SUITES if quick else specs.BENCH_SUITES
    return [dict(case) for suite in suites for case in table[suite]]


def _progress(stream: TextIO, done: int, total: int, elapsed: float, label: str, rows: list[dict]) -> None:
    filled = PROGRESS_BAR_WIDTH * done // max(total, 1)
    bar = "#" * filled + "." * (PROGRESS_BAR_WIDTH - filled)
    summary = "  ".join(f"{r['pass']} {r['tflops']:.1f}" if r["ok"] else f"{r['pass']} FAILED" for r in rows)
    unit = " TFLOP/s" if any(r["ok"] for r in rows) else ""
    print(f"[{bar}] {done}/{total} {elapsed:5.0f}s  {label}  {summary}{unit}", file=stream, flush=True)


def run_bench(suites: list[str], providers: list[str], passes: list[str], out: Path, *, quick: bool = False,
              max_seconds: float | None = None, redo_failed: bool = False, rerun: bool = False, device="cuda",
              timer: Timer = do_bench_median, registry: dict | None = None,
              isolated: frozenset[str] = ISOLATED_PROVIDERS, env: dict | None = None,
              clock: Callable[[], float] = time.monotonic, stream: TextIO = sys.stderr,
              prewarm_workers: int = 0) -> bool:
    """Run what `out` lacks; return True when every (case, provider, pass) is in the file.

    With `prewarm_workers`, the isolated providers' cases still to do are first compiled that many at
    a time in parallel (`warm_isolated`), inside the same `max_seconds`. `rerun` measures again the
    rows of these suites, providers and passes that other code recorded (after a kernel change).
    """
    if env is None:
        from jfa.workbench.envinfo import environment
        env = environment()
    registry = PROVIDERS if registry is None else registry
    results = ResultsFile(out, env)
    if redo_failed:
        results.drop_failed(set(suites), set(providers))
    if rerun:
        dropped = results.drop_stale(set(suites), set(providers), set(passes), env)
        print(f"bench: --rerun: {dropped} rows recorded by other code will be measured again", file=stream)
    present = results.key_set()
    todo = []
    for case in suite_cases(suites, quick):
        missing = [p for p in providers if any((case["suite"], case["case"], p, ps) not in present for ps in passes)]
        if missing:
            todo.append((case, missing))
    total = sum(len(missing) for _, missing in todo)
    started, done = clock(), 0
    print(f"bench: {total} (case, provider) runs to do, {len(present)} rows already in {out}", file=stream)
    warm_jobs = [(case, p) for case, missing in todo for p in missing if p in isolated]
    if prewarm_workers > 0 and warm_jobs:
        warm_isolated(warm_jobs, prewarm_workers, None if max_seconds is None else max_seconds - (clock() - started),
                      stream=stream)
    for case, missing in todo:
        problems = None  # built on first in-process use; dropping the last case's tensors first
        for provider in missing:
            elapsed = clock() - started
            if max_seconds is not None and elapsed >= max_seconds:
                print(f"bench: stopped at --max-seconds {max_seconds:.0f} with {total - done} runs left; "
                      "run the same command again to resume", file=stream)
                return False
            label = f"{case['suite']} {case['case']} {provider}"
            if provider in isolated:
                remaining = None if max_seconds is None else max_seconds - elapsed
                try:
                    rows = measure_case_isolated(case, provider, passes, remaining)
                except WorkerTimeout as exc:
                    print(f"bench: {exc}; stopping, rerun to resume", file=stream)
                    return False
            else:
                problems = problems or build_problems(case, device)
                rows = measure_provider(case, provider, registry[provider], problems, passes, timer)
            rows = [r for r in rows if (r["suite"], r["case"], r["provider"], r["pass"]) not in present]
            results.add(rows)
            done += 1
            _progress(stream, done, total, clock() - started, label, rows)
    return True


# ---- command line ----------------------------------------------------------------------------------
def _csv(choices: Iterable[str], what: str) -> Callable[[str], list[str]]:
    choices = list(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if names == ["all"]:
            return choices
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; choose from {','.join(choices)} "
                                             "or 'all' (comma-separated)")
        return names
    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-seconds takes a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--max-seconds must be > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jfa bench",
        description="Time attention providers on the benchmark suites of jfa.specs; append rows to a JSON file.")
    parser.add_argument("--suite", required=True, type=_csv(specs.BENCH_SUITES, "suite"),
                        help=f"comma-separated suites: {','.join(specs.BENCH_SUITES)} or all")
    parser.add_argument("--providers", default=list(specs.BENCH_PROVIDERS),
                        type=_csv(specs.BENCH_PROVIDERS, "provider"),
                        help=f"comma-separated providers (default all): {','.join(specs.BENCH_PROVIDERS)}")
    parser.add_argument("--passes", default=["fwd", "bwd"], type=_csv(specs.BENCH_PASSES, "pass"),
                        help="comma-separated passes: fwd,bwd,fwd+bwd (default fwd,bwd)")
    parser.add_argument("--out", required=True, type=Path,
                        help="results JSON; rows already there are skipped (resume), new rows appended")
    parser.add_argument("--quick", action="store_true", help="toy sizes of every suite, for smoke runs")
    parser.add_argument("--max-seconds", type=_positive_seconds, default=None,
                        help="stop cleanly before starting work past this many seconds (rerun to resume)")
    parser.add_argument("--redo-failed", action="store_true",
                        help="drop failed rows of these suites/providers from --out and run them again")
    parser.add_argument("--rerun", action="store_true",
                        help="measure again the rows of these suites/providers/passes that other code "
                             "(another commit or versions) recorded in --out; resumable")
    parser.add_argument("--prewarm", type=int, default=0, metavar="N",
                        help="first compile FlexAttention for every case to do, N processes at a time "
                             "(untimed), so the timed runs hit the compile caches (default 0: off)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU; on this machine render recorded runs with "
              "`python -m jfa report RUN.json ... -o REPORT.html`", file=sys.stderr)
        return 2
    try:
        complete = run_bench(args.suite, args.providers, args.passes, args.out, quick=args.quick,
                             max_seconds=args.max_seconds, redo_failed=args.redo_failed, rerun=args.rerun,
                             prewarm_workers=args.prewarm)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    print(f"bench: {'complete' if complete else 'INCOMPLETE (rerun to resume)'}: {args.out}", file=sys.stderr)
    return 0
