"""What one forward tile costs on broadcast-Q q=256: a fixed part and a part per 128 keys.

Every sequence gets the same KV length n*128 (n = 1, 2, 4, 8, 16) and the batch shrinks as n grows
(B*n = 9216), so the FLOPs stay equal while the tiles get longer: time per tile = a + b*n gives the
per-tile overhead a and the steady per-KV-step cost b. The benchmark's U[1, 2048] lengths, as drawn
and rounded up to whole KV tiles, are timed alongside, and FA4 on the same inputs (Q repeated per
sequence, its varlen API) when `flash_attn.cute` imports. Times are do_bench medians.

    python scripts/fwd_tile_cost.py OUT.json        (GPU host, .gpu-bundle active, .fa4-part2 optional)
"""
import json
import sys

import torch

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.workbench import bench, envinfo

Q_LEN = 256
TOTAL_KV_TILES = 9216  # B * n for every fixed-length case: 1152 sequences of 8 KV tiles
KV_TILE = 128  # jagged_fwd.TUNING[(128, 1)]["BLOCK_N"]
QUERY_BLOCK = 128  # rows of a one-head tile


def _fa4():
    try:
        import flash_attn.cute as fa4
    except Exception as exc:  # FA4 is optional here: the jfa rows stand alone
        print(f"FA4 not timed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return fa4


def main(out_path: str) -> None:
    pma_case = next(c for c in specs.BENCH_SUITES["pma"] if c["q_len"] == Q_LEN)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    drawn = bench.case_lengths(pma_case)[1]
    cases = [(f"kv={n * KV_TILE}", [n * KV_TILE] * (TOTAL_KV_TILES // n)) for n in (1, 2, 4, 8, 16)]
    cases += [(f"kv~U[1,{specs.PMA_KV_MAX_LEN}]", drawn),
              (f"kv~U[1,{specs.PMA_KV_MAX_LEN}] rounded up to {KV_TILE}", [-(-x // KV_TILE) * KV_TILE for x in drawn])]
    fa4 = _fa4()
    rows = []
    for name, lengths in cases:
        batch = len(lengths)
        case = dict(pma_case, batch=batch)
        problem = bench.make_problem(case, "cuda", 0, lengths=([Q_LEN] * batch, lengths))
        q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
        kv_offsets, heads, dim = problem.kv_offsets, problem.heads, problem.head_dim
        flops = bench.case_flops(case, problem, "fwd")
        tiles = batch * (Q_LEN // QUERY_BLOCK) * heads
        kv_steps = sum(-(-x // KV_TILE) for x in lengths) * (Q_LEN // QUERY_BLOCK) * heads
        ms = bench.do_bench_median(lambda: jagged_fwd.jagged_attention_fwd(q, k, v, problem.q_offsets, kv_offsets,
                                                                           Q_LEN, max(lengths), None, False, None,
                                                                           True), [])
        row = dict(case=name, batch=batch, tiles=tiles, kv_steps=kv_steps, flops=flops, jfa_ms=ms,
                   jfa_tflops=flops / ms / 1e9, jfa_us_per_tile_per_sm=ms * 1e3 * sms / tiles,
                   jfa_us_per_step_per_sm=ms * 1e3 * sms / kv_steps)
        if fa4 is not None:
            q_rep = q.unsqueeze(0).expand(batch, Q_LEN, heads, dim).reshape(batch * Q_LEN, heads, dim).contiguous()
            cu_q = torch.arange(0, (batch + 1) * Q_LEN, Q_LEN, dtype=torch.int32, device="cuda")
            fa4_ms = bench.do_bench_median(lambda: fa4.flash_attn_varlen_func(
                q_rep, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=kv_offsets, max_seqlen_q=Q_LEN,
                max_seqlen_k=max(lengths)), [])
            row.update(fa4_ms=fa4_ms, fa4_tflops=flops / fa4_ms / 1e9)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, problem
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(dict(kind="forward tile cost, broadcast-Q q=256", env=envinfo.environment(), sms=sms, rows=rows),
                  f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
