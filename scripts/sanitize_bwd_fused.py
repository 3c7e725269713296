"""A small fused-dQ backward (dq_mode="tma_reduce") at D=128 and D=64, plain and causal with a window,
for compute-sanitizer:

    compute-sanitizer --tool memcheck  python scripts/sanitize_bwd_fused.py
    compute-sanitizer --tool racecheck python scripts/sanitize_bwd_fused.py

Lengths 1, 65, 0, 130, 300, 200 (an empty sequence, partial tiles, several query blocks per key
tile), GQA 2, bf16. D=128 runs the split step (`_consumer_q_step_split_dq`: dS exchanged through
shared memory and a named barrier), D=64 the dQ handoff ring between the consumers.
"""
import torch

from jfa.kernels import jagged_bwd, jagged_fwd

LENGTHS = [1, 65, 0, 130, 300, 200]
Q_HEADS, KV_HEADS = 4, 2


def main():
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    rows = sum(LENGTHS)
    for head_dim in (128, 64):
        q = torch.randn(rows, Q_HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(rows, KV_HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for causal, window in ((False, None), (True, 40)):
            args = (offsets, offsets, max(LENGTHS), max(LENGTHS), None, causal, window, False)
            out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, *args)
            grads = jagged_bwd.jagged_attention_bwd(torch.randn_like(q), q, k, v, out, lse, *args,
                                                    dq_mode="tma_reduce")
            torch.cuda.synchronize()
            finite = all(bool(g.isfinite().all()) for g in grads)
            print(f"fused D={head_dim} causal={causal} window={window} ran", [tuple(g.shape) for g in grads],
                  "finite", finite, flush=True)


if __name__ == "__main__":
    main()
