"""CPU time of a forward and of a forward + backward call against their GPU time, jfa and FA4, on
the benchmark's short cases.

A call whose Python side takes longer than its kernels leaves the GPU waiting, and do_bench then
times the CPU. Three figures per provider and pass: CPU time to issue the calls without waiting, GPU
time of the calls queued behind a spin (so the CPU is far ahead), and the do_bench median. The calls
are the benchmark's own (`jfa.workbench.providers`), on its inputs. The forward + backward is timed twice:
as autograd runs it by default, where the backward's Python runs on autograd's CUDA device thread,
and with `torch.autograd.set_multithreading_enabled(False)`, where it runs on the calling thread.
"jfa, triton launch" is jfa with its kernels launched through Triton's own `kernel[grid]` path
instead of `jfa.kernels.launch.CachedLaunch`, so one run shows what that saves. The providers take
turns over ROUNDS rounds, each figure is their median.

    python scripts/launch_overhead.py OUT.json      (GPU host, .gpu-bundle active, .fa4-part2 optional)
"""
import contextlib
import json
import statistics
import sys
import time

import torch

from jfa import specs
from jfa.kernels import block_attn, jagged_bwd, jagged_fwd
from jfa.workbench import bench, envinfo
from jfa.workbench.providers import PROVIDERS

CASES = (("gem", "L=256,s=0.5"), ("gem", "L=256,s=1.0"), ("pma", "q=64,kv<=2048"))
# Calls per measurement: few enough that the launches of one measurement fit CUDA's launch queue
# (about a thousand), which would otherwise make the CPU wait for the GPU while it is timed.
CALLS = {"fwd": 200, "fwd_bwd": 50}
WARM_CALLS = 20
SPIN_CYCLES = 400_000_000  # ~0.2 s of torch.cuda._sleep: longer than the CPU takes to issue the calls
ROUNDS = 3
CACHED_LAUNCHES = ((jagged_fwd, "_jagged_fwd_launch"), (jagged_bwd, "_jagged_bwd_launch"),
                   (jagged_bwd, "_delta_launch"), (jagged_bwd, "_dq_launch"), (block_attn, "_block_attn_fwd_launch"),
                   (block_attn, "_block_attn_bwd_launch"))
PROVIDER_RUNS = {"jfa": ("jfa", False), "jfa, triton launch": ("jfa", True), "fa4": ("fa4", False)}


class _TritonLaunch:
    """Stands in for a CachedLaunch: every call through Triton's own `kernel[grid]`."""

    def __init__(self, cached):
        self.kernel = cached.kernel

    def __getitem__(self, grid):
        return self.kernel[grid]


@contextlib.contextmanager
def _launch_path(through_triton: bool):
    kept = [(module, name, getattr(module, name)) for module, name in CACHED_LAUNCHES]
    if through_triton:
        for module, name, cached in kept:
            setattr(module, name, _TritonLaunch(cached))
    try:
        yield
    finally:
        for module, name, cached in kept:
            setattr(module, name, cached)


def _per_call(call, calls: int) -> dict:
    for _ in range(WARM_CALLS):
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # the GPU is busy while the calls are issued: no launch waits
    started = time.perf_counter()
    for _ in range(calls):
        call()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)
    begin.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return dict(cpu_issue_us=(issued - started) / calls * 1e6,
                gpu_back_to_back_us=begin.elapsed_time(end) / calls * 1e3,
                do_bench_us=bench.do_bench_median(call, []) * 1e3)


def _passes(run, grad_out) -> dict:
    """The forward, and the forward + backward (the benchmark's own step) with autograd's device
    threads on and off."""
    fwd_bwd = bench._backward_step(run, grad_out)
    result = dict(fwd=_per_call(run.forward, CALLS["fwd"]), fwd_bwd=_per_call(fwd_bwd, CALLS["fwd_bwd"]))
    with torch.autograd.set_multithreading_enabled(False):
        result["fwd_bwd_caller_thread"] = _per_call(fwd_bwd, CALLS["fwd_bwd"])
    return result


def _median_figures(rounds: list) -> dict:
    """{pass: {figure: median over rounds}} from the rounds' {pass: {figure: value}}."""
    return {name: {figure: statistics.median(r[name][figure] for r in rounds) for figure in rounds[0][name]}
            for name in rounds[0]}


def main(out_path: str) -> None:
    rows = []
    for suite, name in CASES:
        case = next(c for c in specs.BENCH_SUITES[suite] if c["case"] == name)
        problem = bench.make_problem(case, "cuda", 0)
        rounds = {label: [] for label in PROVIDER_RUNS}
        errors = {}
        for round_ in range(ROUNDS):
            labels = list(PROVIDER_RUNS)
            for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
                if label in errors:  # failed in an earlier round: not retried
                    continue
                provider, through_triton = PROVIDER_RUNS[label]
                try:
                    with _launch_path(through_triton):
                        run = PROVIDERS[provider](problem)
                        rounds[label].append(_passes(run, torch.randn_like(run.forward())))
                except Exception as exc:  # an unavailable peer is a row that says why
                    errors[label] = dict(error=bench._error_text(exc))
        row = dict(case=f"{suite} {name}")
        for label in PROVIDER_RUNS:
            row[label] = errors.get(label) or dict(_median_figures(rounds[label]), rounds=rounds[label])
        print(json.dumps(row)[:2000], flush=True)
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump(dict(kind="launch overhead", env=envinfo.environment(), calls=CALLS, rounds=ROUNDS, rows=rows),
                  f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
