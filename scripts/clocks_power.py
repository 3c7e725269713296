"""SM clock and board power while one provider's pass runs one case back to back.

Under these kernels the H200 runs at its 700 W power cap, so the SM clock follows the power a kernel
draws: a kernel that does more work per second runs at a lower clock. Comparing providers by time
alone mixes the two; this script records, for each (pass, case, provider), the time per call and
the median SM clock and power that nvidia-smi reports every 50 ms over about 3 s of back-to-back
calls (the first third of the samples dropped while the clock settles). ms x MHz gives SM cycles.
A bf16 GEMM of GEMM_SIZE^3 runs the same way first: the tensor-core rate a kernel can sustain under the
cap, the ceiling for any attention rate (`specs.H200_BF16_GEMM_TFLOPS` is the anchors' do_bench figure).

    python scripts/clocks_power.py OUT.json     (GPU host, .gpu-bundle active, .fa4-part2 for FA4)
"""
import json
import statistics
import subprocess
import sys
import time

import torch

from jfa import specs
from jfa.workbench import bench, envinfo
from jfa.workbench.providers import PROVIDERS

# Each fwd_bwd case has its fwd case too, so the backward alone is their difference.
CASES = (("fwd", "pma", "q=256,kv<=2048"), ("fwd", "dense", "B=4,H=32,N=4096,D=128"), ("fwd", "gem", "L=2048,s=1.0"),
         ("fwd_bwd", "dense", "B=4,H=32,N=4096,D=128"), ("fwd_bwd", "gem", "L=2048,s=1.0"),
         ("fwd_bwd", "pma", "q=256,kv<=2048"))
COMPARED = ("jfa", "fa4")
GEMM_SIZE = 8192  # the anchors' ceiling GEMM: large enough that every SM stays busy
SECONDS = 3.0
SAMPLE_MS = 50
WARM_UP_CALLS = 10
CALLS_PER_SYNC = 10


def _sustained(call, flops: float) -> dict:
    """A row's measurements of `call` (`flops` per call): after a warm-up, SECONDS of back-to-back calls,
    their ms per call and TFLOP/s, and the upper medians of the SM clock and board power sampled meanwhile."""
    for _ in range(WARM_UP_CALLS):
        call()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, calls = time.time(), 0
    start.record()
    while time.time() - t0 < SECONDS:
        for _ in range(CALLS_PER_SYNC):
            call()
        calls += CALLS_PER_SYNC
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    lines = [line for line in smi.communicate()[0].strip().splitlines() if line.strip()]
    samples = [tuple(float(x) for x in line.split(",")) for line in lines]
    samples = samples[len(samples) // 3:]
    ms = start.elapsed_time(end) / calls
    return dict(ms_per_call=ms, tflops=specs.tflops(flops, ms),
                sm_clock_mhz_median=statistics.median_high(s[0] for s in samples),
                power_w_median=statistics.median_high(s[1] for s in samples), samples=len(samples))


def _gemm_row() -> dict:
    """The sustained bf16 GEMM on random data (zeros would draw less power)."""
    a, b = (torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return dict(case=f"bf16 GEMM {GEMM_SIZE}^3", pass_="gemm", provider="torch.matmul",
                **_sustained(lambda: torch.matmul(a, b), 2.0 * GEMM_SIZE ** 3))


def main(out_path: str) -> None:
    rows = [_gemm_row()]
    print(json.dumps(rows[0]), flush=True)
    for pass_, suite, name in CASES:
        case = next(c for c in specs.BENCH_SUITES[suite] if c["case"] == name)
        problems = bench.build_problems(case, "cuda")
        for provider in COMPARED:
            row = dict(case=f"{suite} {name}", pass_=pass_, provider=provider)
            try:
                ready = bench.prepare_provider(PROVIDERS[provider], problems, {})
                call = ready.fwd if pass_ == "fwd" else ready.fwd_bwd
                row.update(_sustained(call, bench.case_flops(case, problems[0],
                                                             "fwd" if pass_ == "fwd" else "fwd+bwd")))
            except Exception as exc:  # a provider that cannot run here gets a row that says why
                row.update(error=bench._error_text(exc))
            print(json.dumps(row), flush=True)
            rows.append(row)
        del problems
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(dict(kind="SM clock and board power under sustained load", env=envinfo.environment(), rows=rows),
                  f, indent=1)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("clocks_power.py needs a CUDA GPU (the GPU host, .gpu-bundle active)")
    main(args.out)
