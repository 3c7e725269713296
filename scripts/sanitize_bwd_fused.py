"""A small backward at D=128 and D=64, plain and causal with a window, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python scripts/sanitize_bwd_fused.py [--dq-strategy split|handoff|resident|none]
    compute-sanitizer --tool racecheck python scripts/sanitize_bwd_fused.py [--dq-strategy split|handoff|resident|none]

Lengths 1, 65, 0, 130, 300, 200 (an empty sequence, partial tiles, several query blocks per key
tile), GQA 2, bf16, through `jfa.runner` with the dQ strategy forced (`bwd_dkdv.DQ_*`):

- split (the default): dQ fused into the dK/dV kernel, each consumer reduce-adding half of dQ's
  columns after the two have exchanged dS through shared memory and a named barrier
  (`bwd_dkdv._split_dq_step`); at both head dims;
- handoff: dQ fused, consumer 1 handing its dQ piece to consumer 0 through a ring of fp32 stages and
  consumer 0 reduce-adding the sum; at D=64 (its stages fit shared memory there only);
- none: the dQ kernel (`bwd_dq`) after the dK/dV kernel, deterministic;
- resident: broadcast-Q only (one query block, one query head per key head, D=128): each program
  keeps its query block and sums its dQ in registers.

Each head dim also runs a broadcast-Q case of 48 query rows, with GQA 2 and with one query head per
key head: in the fused modes a per-program dQ copy (with split, V's slot freed early:
`EARLY_V_RELEASE`), with the dQ kernel two heads per tile and fp32 per-sequence partials.
"""
import argparse

import torch

from jfa import runner
from jfa.kernels.bwd_dkdv import DQ_HANDOFF, DQ_NONE, DQ_RESIDENT, DQ_SPLIT

LENGTHS = [1, 65, 0, 130, 300, 200]
Q_HEADS, KV_HEADS = 4, 2
BROADCAST_Q_LEN = 48
STRATEGIES = {"split": DQ_SPLIT.value, "handoff": DQ_HANDOFF.value, "resident": DQ_RESIDENT.value,
              "none": DQ_NONE.value}


def run(q, k, v, q_offsets, kv_offsets, max_q, max_kv, causal, window, broadcast_q, strategy, label):
    args = (q_offsets, kv_offsets, max_q, max_kv, None, causal, window, broadcast_q)
    out, lse = runner.forward(q, k, v, *args)
    grads = runner.backward(torch.randn_like(out), q, k, v, out, lse, *args, dq_strategy=STRATEGIES[strategy])
    torch.cuda.synchronize()
    finite = all(bool(g.isfinite().all()) for g in grads)
    print(f"dq={strategy} {label} causal={causal} window={window} ran", [tuple(g.shape) for g in grads],
          "finite", finite, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dq-strategy", default="split", choices=list(STRATEGIES))
    strategy = parser.parse_args().dq_strategy
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    shared_query = torch.tensor([0, BROADCAST_Q_LEN], dtype=torch.int32, device="cuda")
    rows = sum(LENGTHS)
    group = Q_HEADS // KV_HEADS
    for head_dim in (128, 64):
        if (strategy == "resident" and head_dim != 128) or (strategy == "handoff" and head_dim != 64):
            continue
        q = torch.randn(rows, Q_HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(rows, KV_HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for causal, window in ((False, None), (True, 40)):
            if strategy != "resident":
                run(q, k, v, offsets, offsets, max(LENGTHS), max(LENGTHS), causal, window, False, strategy,
                    f"D={head_dim}")
            for keys, values in ((k, v), (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))):
                if strategy == "resident" and keys.shape[1] != Q_HEADS:
                    continue  # one query head per key head only
                run(q[:BROADCAST_Q_LEN], keys, values, shared_query, offsets, BROADCAST_Q_LEN, max(LENGTHS),
                    causal, window, True, strategy,
                    f"D={head_dim} broadcast-Q q={BROADCAST_Q_LEN} GQA {Q_HEADS // keys.shape[1]}")


if __name__ == "__main__":
    main()
