"""What one backward key tile costs on broadcast-Q: a fixed part and a part per streamed query block.

The backward is KV-stationary: a tile holds 128 keys of one sequence and head and streams every
query block of the shared query past them, q_len/64 steps. So the shared query's length sets the
steps per tile while the KV lengths set the tiles. Here q_len runs 128 .. 2048 (2 to 32 steps; 64 is
the one-step RESIDENT_Q kernel, another design) over the PMA suite's drawn KV lengths, the batch cut
as q_len grows so the FLOPs stay equal. torch.profiler gives each launch's device time. From the
KV-stationary kernel's alone: the time of one step per SM, and the tile's fixed cost, estimated as
what a row's steps cost beyond the longest tiles' step (the steadiest): (its step - that step) x its
steps per tile. (A least-squares line through all rows, as fwd_tile_cost.py fits, is pulled by the
2-step row and does not describe the others.) Delta, the zeroed per-program dQ copies and their sum
are reported beside it, and the dQ mode the backward picked for each row.

    python scripts/bwd_tile_cost.py OUT.json        (GPU host, .gpu-bundle active)
"""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from jfa import bench, envinfo, specs
from jfa.kernels import jagged_bwd, jagged_fwd

Q_LENS = (128, 192, 256, 512, 1024, 2048)
REFERENCE_Q_LEN = 256  # the suite's case: its batch sets the FLOPs every row keeps
PROFILED_CALLS = 10
MAIN_KERNEL = "_jagged_bwd_kernel"
DELTA_KERNEL = "_delta_kernel"


def _device_ms_by_kernel(call) -> dict:
    """Mean device milliseconds per call of every kernel `call` launches (after one warm-up call)."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            call()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.device_time_total > 0:
            totals[event.key] = totals.get(event.key, 0.0) + event.device_time_total / 1e3 / PROFILED_CALLS
    return totals


def main(out_path: str) -> None:
    pma_case = next(c for c in specs.BENCH_SUITES["pma"] if c["q_len"] == REFERENCE_Q_LEN)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    drawn = bench.case_lengths(pma_case)[1]
    tile = jagged_bwd.TUNING[pma_case["head_dim"]]["BLOCK_N"]
    block = jagged_bwd.TUNING[pma_case["head_dim"]]["BLOCK_M"]
    rows = []
    for q_len in Q_LENS:
        batch = len(drawn) * REFERENCE_Q_LEN // q_len
        lengths = drawn[:batch]
        case = dict(pma_case, batch=batch, q_len=q_len)
        problem = bench.make_problem(case, "cuda", 0, lengths=([q_len] * batch, lengths))
        q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
        heads, kv_offsets = problem.heads, problem.kv_offsets
        out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, problem.q_offsets, kv_offsets, q_len, max(lengths),
                                                   None, False, None, True)
        dout = torch.randn_like(out)
        tiles = sum(-(-x // tile) for x in lengths) * heads
        steps = tiles * (q_len // block)
        dq_mode = jagged_bwd.batch_dq_mode(pma_case["head_dim"], q.shape[0], k.shape[0], batch, sms, False, True,
                                           False)

        def backward():
            return jagged_bwd.jagged_attention_bwd(dout, q, k, v, out, lse, problem.q_offsets, kv_offsets, q_len,
                                                   max(lengths), None, False, None, True)

        by_kernel = _device_ms_by_kernel(backward)
        main_ms = sum(ms for name, ms in by_kernel.items() if MAIN_KERNEL in name)
        flops = bench.case_flops(case, problem, "bwd")
        total_ms = bench.do_bench_median(backward, [])
        row = dict(q_len=q_len, batch=batch, dq_mode=dq_mode, tiles=tiles, steps=steps, steps_per_tile=q_len // block,
                   flops=flops, backward_ms=total_ms, backward_tflops=flops / total_ms / 1e9,
                   main_kernel_ms=main_ms, main_kernel_tflops=flops / main_ms / 1e9,
                   delta_ms=sum(ms for name, ms in by_kernel.items() if DELTA_KERNEL in name),
                   us_per_tile_per_sm=main_ms * 1e3 * sms / tiles, us_per_step_per_sm=main_ms * 1e3 * sms / steps,
                   device_ms_by_kernel=by_kernel)
        print(json.dumps({key: value for key, value in row.items() if key != "device_ms_by_kernel"}), flush=True)
        rows.append(row)
        del q, k, v, out, lse, dout, problem
        torch.cuda.empty_cache()
    steady_step_us = max(rows, key=lambda r: r["steps_per_tile"])["us_per_step_per_sm"]
    for row in rows:
        row["tile_overhead_us"] = (row["us_per_step_per_sm"] - steady_step_us) * row["steps_per_tile"]
        print(f"q_len {row['q_len']}: {row['us_per_step_per_sm']:.2f} us a step, "
              f"tile overhead {row['tile_overhead_us']:.2f} us", flush=True)
    with open(out_path, "w") as f:
        json.dump(dict(kind="backward tile cost, broadcast-Q", env=envinfo.environment(), sms=sms,
                       steady_step_us=steady_step_us, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
