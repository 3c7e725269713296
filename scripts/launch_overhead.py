"""CPU time of a forward and of a forward + backward call against their GPU time, jfa and FA4, on
the benchmark's short cases.

A call whose Python side takes longer than its kernels leaves the GPU waiting, and do_bench then
times the CPU. Three figures per provider and pass: CPU time to issue the calls without waiting, GPU
time of the calls queued behind a spin (so the CPU is far ahead), and the do_bench median. The calls
are the benchmark's own (`jfa.providers`), on its inputs. The forward + backward is timed twice:
as autograd runs it by default, where the backward's Python runs on autograd's CUDA device thread,
and with `torch.autograd.set_multithreading_enabled(False)`, where it runs on the calling thread.

    python scripts/launch_overhead.py OUT.json      (GPU host, .gpu-bundle active, .fa4-part2 optional)
"""
import json
import sys
import time

import torch

from jfa import bench, envinfo, specs
from jfa.providers import PROVIDERS

CASES = (("gem", "L=256,s=0.5"), ("gem", "L=256,s=1.0"), ("pma", "q=64,kv<=2048"))
# Calls per measurement: few enough that the launches of one measurement fit CUDA's launch queue
# (about a thousand), which would otherwise make the CPU wait for the GPU while it is timed.
CALLS = {"fwd": 200, "fwd_bwd": 50}
WARM_CALLS = 20
SPIN_CYCLES = 400_000_000  # ~0.2 s of torch.cuda._sleep: longer than the CPU takes to issue the calls


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


def main(out_path: str) -> None:
    rows = []
    for suite, name in CASES:
        case = next(c for c in specs.BENCH_SUITES[suite] if c["case"] == name)
        problem = bench.make_problem(case, "cuda", 0)
        row = dict(case=f"{suite} {name}")
        for provider in ("jfa", "fa4"):
            try:
                run = PROVIDERS[provider](problem)
                row[provider] = _passes(run, torch.randn_like(run.forward()))
            except Exception as exc:  # an unavailable peer is a row that says why
                row[provider] = dict(error=bench._error_text(exc))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump(dict(kind="launch overhead", env=envinfo.environment(), calls=CALLS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
