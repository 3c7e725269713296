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

from jfa import envinfo, specs
from jfa.bench import do_bench_median
from jfa.jagged import gem_lengths, lengths_to_offsets
from jfa.kernels import jagged_fwd

Q_LEN = 256
TIMINGS = 24


def main(out_path: str) -> None:
    heads, dim = specs.GEM_HEADS, specs.GEM_HEAD_DIM
    lengths = [int(x) for x in gem_lengths(specs.GEM_BATCH, specs.PMA_KV_MAX_LEN, 0.5, seed=specs.BENCH_SEED)]
    kv_offsets = lengths_to_offsets(lengths).to(device="cuda", dtype=torch.int32)
    q = torch.randn(Q_LEN, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = specs.attention_flops([Q_LEN] * len(lengths), lengths, heads, dim)

    def forward():
        return jagged_fwd.jagged_attention_fwd(q, k, v, kv_offsets, kv_offsets, Q_LEN, max(lengths), None,
                                               False, None, True)

    forward()
    torch.cuda.synchronize()
    rows = []
    for i in range(TIMINGS):
        start = time.time()
        ms = do_bench_median(forward, [])
        rows.append(dict(i=i, start=start, end=time.time(), ms=ms, tflops=flops / ms / 1e9))
        print(f"{i:2d} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    with open(out_path, "w") as f:
        json.dump(dict(kind="PMA q=256 forward, repeated, with wall-clock windows", env=envinfo.environment(),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
