"""jfa's forward against the TLX wheel's own Hopper attention tutorial, on dense shapes.

`tlx.tutorials.hopper_fa_ws_pipelined_pingpong_persistent` is the reference design jfa's forward
grew from (producer warpgroup, two ping-ponging consumer warpgroups, K/V ring, persistent grid).
On equal-length sequences jfa pays for nothing it does not use, so the two should match; a gap
here is a cost of jfa's code, not of jagged work. Timed in alternating rounds in one process
(do_bench medians); outputs compared to each other.

    python scripts/tlx_tutorial_vs_jfa.py OUT.json      (GPU host, .gpu-bundle active)
"""
import json
import statistics
import sys

import torch
from tlx.tutorials import hopper_fa_ws_pipelined_pingpong_persistent as tutorial

from jfa.kernels import jagged_fwd
from jfa.workbench import envinfo
from jfa.workbench.bench import do_bench_median

SHAPES = ((4, 32, 4096, 128), (1, 32, 16384, 128), (4, 32, 4096, 64))  # B, H, N, D
ROUNDS = 4


def main(out_path: str) -> None:
    rows = []
    for batch, heads, n, dim in SHAPES:
        q, k, v = (torch.randn(batch, heads, n, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        packed = [t.transpose(1, 2).reshape(batch * n, heads, dim).contiguous() for t in (q, k, v)]
        offsets = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device="cuda")
        scale = dim ** -0.5
        contenders = {
            "tlx_tutorial": lambda: tutorial.attention(q, k, v, scale),
            "jfa": lambda: jagged_fwd.jagged_attention_fwd(*packed, offsets, offsets, n, n, scale, False, None, False),
        }
        ours = contenders["jfa"]()[0].float()
        theirs = contenders["tlx_tutorial"]().transpose(1, 2).reshape(batch * n, heads, dim).float()
        times = {name: [] for name in contenders}
        order = list(contenders)
        for r in range(ROUNDS):
            for name in (order if r % 2 == 0 else order[::-1]):
                times[name].append(do_bench_median(contenders[name], []))
        flops = 4.0 * batch * heads * n * n * dim
        row = dict(shape=dict(batch=batch, heads=heads, n=n, head_dim=dim), ms=times,
                   tflops={name: flops / statistics.median(t) / 1e9 for name, t in times.items()},
                   relerr_jfa_vs_tutorial=float((ours - theirs).norm() / theirs.norm()))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump(dict(kind="jfa forward vs the TLX Hopper tutorial", env=envinfo.environment(), rounds=ROUNDS,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
