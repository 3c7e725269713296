"""A small backward at D=128 and D=64, plain and causal with a window, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python scripts/sanitize_bwd_fused.py [--dq-mode separate]
    compute-sanitizer --tool racecheck python scripts/sanitize_bwd_fused.py [--dq-mode separate]

Lengths 1, 65, 0, 130, 300, 200 (an empty sequence, partial tiles, several query blocks per key
tile), GQA 2, bf16. In the default fused mode (dq_mode="tma_reduce") D=128 runs the split step
(`_consumer_q_step_split_dq`: dS exchanged through shared memory and a named barrier), D=64 the dQ
handoff ring between the consumers. `--dq-mode separate` runs the dQ fork of the forward kernel
(`jagged_fwd.jagged_attention_dq`). Each also runs a broadcast-Q case of 48 query rows: in the fused
mode a per-program dQ copy and, at D=128, V's slot freed early (`EARLY_V_RELEASE`); in the separate
mode two heads per tile and fp32 per-sequence partials. The broadcast-Q case runs twice: with GQA 2 (two
steps per key tile) and with one query head per key head (one step: `jagged_bwd.ONE_STEP_TUNING`, whose
programs keep the query block and its dQ resident, RESIDENT_Q, at both head dims).
"""
import argparse

import torch

from jfa.kernels import jagged_bwd, jagged_fwd

LENGTHS = [1, 65, 0, 130, 300, 200]
Q_HEADS, KV_HEADS = 4, 2
BROADCAST_Q_LEN = 48


def run(q, k, v, q_offsets, kv_offsets, max_q, max_kv, causal, window, broadcast_q, dq_mode, label):
    args = (q_offsets, kv_offsets, max_q, max_kv, None, causal, window, broadcast_q)
    out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, *args)
    grads = jagged_bwd.jagged_attention_bwd(torch.randn_like(out), q, k, v, out, lse, *args, dq_mode=dq_mode)
    torch.cuda.synchronize()
    finite = all(bool(g.isfinite().all()) for g in grads)
    print(f"{dq_mode} {label} causal={causal} window={window} ran", [tuple(g.shape) for g in grads],
          "finite", finite, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dq-mode", default="tma_reduce", choices=["tma_reduce", "separate"])
    dq_mode = parser.parse_args().dq_mode
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    rows = sum(LENGTHS)
    for head_dim in (128, 64):
        q = torch.randn(rows, Q_HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(rows, KV_HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for causal, window in ((False, None), (True, 40)):
            run(q, k, v, offsets, offsets, max(LENGTHS), max(LENGTHS), causal, window, False, dq_mode,
                f"D={head_dim}")
            shared_query = torch.tensor([0, BROADCAST_Q_LEN], dtype=torch.int32, device="cuda")
            group = Q_HEADS // KV_HEADS
            for keys, values in ((k, v), (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))):
                run(q[:BROADCAST_Q_LEN], keys, values, shared_query, offsets, BROADCAST_Q_LEN, max(LENGTHS),
                    causal, window, True, dq_mode,
                    f"D={head_dim} broadcast-Q q={BROADCAST_Q_LEN} GQA {Q_HEADS // keys.shape[1]}")


if __name__ == "__main__":
    main()
