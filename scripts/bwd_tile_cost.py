"""What one backward key tile costs: a fixed part and a part per streamed query block.

The backward is KV-stationary: a tile holds 128 keys of one sequence and head, and streams every query
block that sees them, q_len/64 steps. PMA q=256 runs 4 steps per tile; dense N=4096 runs 64. Here the
fused D=128 step (dq_mode "tma_reduce", FlashAttention-3's orientation) runs self-attention with 1024
keys per sequence and 256 to 4096 queries, the batch cut as q_len grows, so the FLOPs, the tiles' K/V and
the fp32 dQ accumulator stay the same size while the steps per tile go from 4 to 64. (Broadcast-Q cannot
be used for this: its per-program dQ copies grow with q_len and outgrow L2.) torch.profiler gives the
KV-stationary kernel's device time; with T tiles per SM (the busiest SM's) the time per tile is
a + b * steps, fitted by least squares: a is what a tile's boundary costs, b one step. PMA q=256 itself,
broadcast, is timed beside them.

    python scripts/bwd_tile_cost.py OUT.json        (GPU host, .gpu-bundle active)
"""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from jfa import specs
from jfa.kernels import jagged_bwd, jagged_fwd
from jfa.workbench import bench, envinfo

Q_LENS = (256, 512, 1024, 2048, 4096)
KV_LEN = 1024
REFERENCE_Q_LEN = 256  # PMA q=256: its batch sets every row's query rows (batch * q_len)
DQ_MODE = "tma_reduce"  # the fused step PMA q=256 and the long self-attention shapes run at D=128
PROFILED_CALLS = 10
MAIN_KERNEL = "_jagged_bwd_kernel"


def _kernel_ms(call) -> float:
    """Mean device milliseconds per call of the KV-stationary kernel (after one warm-up call)."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            call()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()
               if e.device_type.name == "CUDA" and MAIN_KERNEL in e.key) / 1e3 / PROFILED_CALLS


def _row(name, case, q_lens, kv_lens, broadcast, sms):
    problem = bench.make_problem(case, "cuda", 0, lengths=(q_lens, kv_lens))
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
    max_q, max_kv = max(q_lens), max(kv_lens)
    out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, problem.q_offsets, problem.kv_offsets, max_q, max_kv,
                                               None, False, None, broadcast)
    dout = torch.randn_like(out)
    config = jagged_bwd.TUNING[case["head_dim"]]
    tiles = sum(-(-x // config["BLOCK_N"]) for x in kv_lens) * case["heads"]
    steps_per_tile = -(-max_q // config["BLOCK_M"])
    ms = _kernel_ms(lambda: jagged_bwd.jagged_attention_bwd(
        dout, q, k, v, out, lse, problem.q_offsets, problem.kv_offsets, max_q, max_kv, None, False, None, broadcast,
        dq_mode=DQ_MODE))
    busiest = -(-tiles // sms)  # persistent programs: the busiest SM's tiles set the time
    row = dict(case=name, batch=len(kv_lens), q_len=max_q, kv_len=max_kv, broadcast_q=broadcast, tiles=tiles,
               steps_per_tile=steps_per_tile, kernel_ms=ms,
               kernel_tflops=bench.case_flops(case, problem, "bwd") / ms / 1e9,
               us_per_tile=ms * 1e3 / busiest, us_per_step=ms * 1e3 / (busiest * steps_per_tile))
    print(json.dumps(row), flush=True)
    del q, k, v, out, lse, dout, problem
    torch.cuda.empty_cache()
    return row


def main(out_path: str) -> None:
    pma_case = next(c for c in specs.BENCH_SUITES["pma"] if c["q_len"] == REFERENCE_Q_LEN)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    query_rows = pma_case["batch"] * REFERENCE_Q_LEN
    rows = []
    for q_len in Q_LENS:
        batch = query_rows // q_len
        case = dict(pma_case, kind="self", batch=batch, q_len=q_len)
        rows.append(_row(f"self q={q_len} kv={KV_LEN}", case, [q_len] * batch, [KV_LEN] * batch, False, sms))
    xs = [r["steps_per_tile"] for r in rows]
    ys = [r["us_per_tile"] for r in rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    step_us = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    fit = dict(tile_boundary_us=mean_y - step_us * mean_x, step_us=step_us)
    print(json.dumps(fit), flush=True)
    drawn = bench.case_lengths(pma_case)[1]
    rows.append(_row(f"pma {pma_case['case']}", pma_case, [REFERENCE_Q_LEN] * len(drawn), drawn, True, sms))
    with open(out_path, "w") as f:
        json.dump(dict(kind="backward tile cost", env=envinfo.environment(), sms=sms, dq_mode=DQ_MODE, fit=fit,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
