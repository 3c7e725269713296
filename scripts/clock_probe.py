"""Does jfa's time follow the GPU clock? The forward on PMA q=256 x KV U[1, 2048], timed 24 times back
to back (do_bench medians), each timing with its wall-clock window, to set against an nvidia-smi log
of SM clock, power and throttle reasons taken alongside:

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,noheader -lms 100 > smi.csv &
    python scripts/clock_probe.py OUT.json        (GPU host, .gpu-bundle active)

`results/clock-probe-*.json` joins the two: the H200 sat at its software power cap (throttle reason
0x4, ~690-700 W) with the SM clock between 1.3 and 1.7 GHz, and the time followed the clock.
"""
import json
import sys
import time

import torch

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.workbench import bench, envinfo

TIMINGS = 24


def main(out_path: str) -> None:
    case = next(c for c in specs.BENCH_SUITES["pma"] if c["q_len"] == 256)
    problem = bench.make_problem(case, "cuda", 0)
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
    flops = bench.case_flops(case, problem, "fwd")

    def forward():
        return jagged_fwd.jagged_attention_fwd(q, k, v, problem.q_offsets, problem.kv_offsets, problem.max_q,
                                               problem.max_kv, None, False, None, True)

    forward()
    torch.cuda.synchronize()
    rows = []
    for i in range(TIMINGS):
        start = time.time()
        ms = bench.do_bench_median(forward, [])
        rows.append(dict(i=i, start=start, end=time.time(), ms=ms, tflops=flops / ms / 1e9))
        print(f"{i:2d} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    with open(out_path, "w") as f:
        json.dump(dict(kind="PMA q=256 forward, repeated, with wall-clock windows", env=envinfo.environment(),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
