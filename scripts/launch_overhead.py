"""CPU time of one forward call against its GPU time, jfa and FA4, on the benchmark's short cases.

A call whose Python side takes longer than its kernel leaves the GPU waiting, and do_bench then
times the CPU. Three figures per provider: CPU time to issue 200 calls without waiting, GPU time
of 200 calls queued behind a spin (so the CPU is far ahead), and the do_bench median. The calls are
the benchmark's own (`jfa.providers`), on its inputs.

    python scripts/launch_overhead.py OUT.json      (GPU host, .gpu-bundle active, .fa4-part2 optional)
"""
import json
import sys
import time

import torch

from jfa import bench, envinfo, specs
from jfa.providers import PROVIDERS

CASES = (("gem", "L=256,s=0.5"), ("gem", "L=256,s=1.0"), ("pma", "q=64,kv<=2048"))
CALLS = 200
WARM_CALLS = 20
SPIN_CYCLES = 100_000_000  # ~50 ms of torch.cuda._sleep: the queue fills while the GPU spins


def _per_call(forward) -> dict:
    for _ in range(WARM_CALLS):
        forward()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(CALLS):
        forward()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)
    begin.record()
    for _ in range(CALLS):
        forward()
    end.record()
    torch.cuda.synchronize()
    return dict(cpu_issue_us=(issued - started) / CALLS * 1e6, wall_us=(done - started) / CALLS * 1e6,
                gpu_back_to_back_us=begin.elapsed_time(end) / CALLS * 1e3,
                do_bench_us=bench.do_bench_median(forward, []) * 1e3)


def main(out_path: str) -> None:
    rows = []
    for suite, name in CASES:
        case = next(c for c in specs.BENCH_SUITES[suite] if c["case"] == name)
        problem = bench.make_problem(case, "cuda", 0)
        row = dict(case=f"{suite} {name}")
        for provider in ("jfa", "fa4"):
            try:
                row[provider] = _per_call(PROVIDERS[provider](problem).forward)
            except Exception as exc:  # an unavailable peer is a row that says why
                row[provider] = dict(error=bench._error_text(exc))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump(dict(kind="forward launch overhead", env=envinfo.environment(), calls=CALLS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
