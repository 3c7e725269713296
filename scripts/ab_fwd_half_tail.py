"""Half last KV tiles on or off: the jagged forward timed both ways in one process, in rounds that
alternate which goes first (do_bench medians; the H200's clock moves with its power cap, so only
same-process alternation compares fairly). Each variant's output is checked against the fp32
reference on 16 of the case's sequences, and the two variants' outputs against each other.

    python scripts/ab_fwd_half_tail.py OUT.json [--rounds N] [--case NAME ...]   (GPU host, .gpu-bundle)

`results/fwd-half-tail-ab-*.json` are its runs; `jagged_fwd.HALF_TAIL_MAX_KV_LEN` comes from them.
"""
import argparse
import json

import torch

from jfa import envinfo, specs
from jfa.bench import do_bench_median
from jfa.jagged import gem_lengths, lengths_to_offsets
from jfa.kernels import jagged_fwd
from jfa.reference import jagged_attention_ref

CHECKED_SEQUENCES = 16


def _gem(max_len, sparsity):
    return [int(x) for x in gem_lengths(specs.GEM_BATCH, max_len, sparsity, seed=specs.BENCH_SEED)]


# name -> (broadcast q_len or None, KV lengths, heads, head_dim)
CASES = {
    "pma q=256 kv~U[1,2048]": (256, _gem(2048, 0.5), 4, 128),
    "pma q=64 kv~U[1,2048]": (64, _gem(2048, 0.5), 4, 128),
    "gem L=256 s=0.5": (None, _gem(256, 0.5), 4, 128),
    "gem L=256 s=1": (None, _gem(256, 1.0), 4, 128),
    "gem L=512 s=0.5": (None, _gem(512, 0.5), 4, 128),
    "gem L=512 s=1": (None, _gem(512, 1.0), 4, 128),
    "gem L=1024 s=0.5": (None, _gem(1024, 0.5), 4, 128),
    "gem L=1024 s=1": (None, _gem(1024, 1.0), 4, 128),
    "gem L=2048 s=0.5": (None, _gem(2048, 0.5), 4, 128),
    "dense D=128": (None, [4096] * 4, 32, 128),
    "gem L=1024 s=0.5 D=64 H=8": (None, _gem(1024, 0.5), 8, 64),
}


def _use_half_tail(on: bool) -> None:
    """Half last tiles compiled in for every length, or for none (the wrapper reads the bound per call)."""
    jagged_fwd.HALF_TAIL_MAX_KV_LEN = 1 << 30 if on else 0


def _relerr_on_some_sequences(out, q, k, v, lengths, q_len):
    """Largest relative error against the fp32 reference over CHECKED_SEQUENCES spread-out sequences."""
    kv_starts = [0] + torch.tensor(lengths).cumsum(0).tolist()
    worst = 0.0
    for seq in range(0, len(lengths), max(1, len(lengths) // CHECKED_SEQUENCES))[:CHECKED_SEQUENCES]:
        if lengths[seq] == 0:  # nothing to compare (the output is zeros, the reference too)
            continue
        kv = slice(kv_starts[seq], kv_starts[seq + 1])
        rows = slice(seq * q_len, (seq + 1) * q_len) if q_len else kv
        q_seq = q if q_len else q[kv]
        one = lengths_to_offsets([lengths[seq]])
        expected, _ = jagged_attention_ref(q_seq.float(), k[kv].float(), v[kv].float(),
                                           lengths_to_offsets([q_seq.shape[0]]) if q_len else one, one,
                                           broadcast_q=bool(q_len))
        worst = max(worst, float((out[rows].float() - expected).norm() / expected.norm()))
    return worst


def run_case(name, rounds):
    q_len, lengths, heads, dim = CASES[name]
    offsets = lengths_to_offsets(lengths).to(device="cuda", dtype=torch.int32)
    q = torch.randn(q_len or sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = specs.attention_flops([q_len] * len(lengths) if q_len else lengths, lengths, heads, dim)
    out_rows = len(lengths) * q_len if q_len else sum(lengths)
    args = (offsets, offsets, q_len or max(lengths), max(lengths), None, False, None, bool(q_len))
    result = dict(case=name, ms={}, relerr_vs_ref={}, unwritten_rows={})
    outputs = {}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            _use_half_tail(on)
            if r == 0:
                poisoned = torch.full((out_rows, heads, dim), float("nan"), device="cuda", dtype=torch.bfloat16)
                outputs[on], _ = jagged_fwd.jagged_attention_fwd(q, k, v, *args, out=poisoned)
                result["relerr_vs_ref"][str(on)] = _relerr_on_some_sequences(outputs[on], q, k, v, lengths, q_len)
                result["unwritten_rows"][str(on)] = int(outputs[on].isnan().any(-1).any(-1).sum())
            result["ms"].setdefault(str(on), []).append(
                do_bench_median(lambda: jagged_fwd.jagged_attention_fwd(q, k, v, *args), []))
    result["max_abs_diff_on_vs_off"] = float((outputs[True].float() - outputs[False].float()).abs().max())
    result["tflops_median"] = {on: flops / sorted(t)[len(t) // 2] / 1e9 for on, t in result["ms"].items()}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--case", action="append", choices=list(CASES),
                        help="a case to run (repeatable; default: every case)")
    args = parser.parse_args()
    default_bound = jagged_fwd.HALF_TAIL_MAX_KV_LEN
    rows = []
    for name in args.case or list(CASES):
        row = run_case(name, args.rounds)
        print(name.ljust(26), "  ".join(f"half={on} {tf:6.1f}" for on, tf in row["tflops_median"].items()),
              "relerr", row["relerr_vs_ref"], "unwritten", row["unwritten_rows"],
              "diff", row["max_abs_diff_on_vs_off"], flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    jagged_fwd.HALF_TAIL_MAX_KV_LEN = default_bound
    with open(args.out, "w") as f:
        json.dump(dict(kind="A/B forward half last KV tile", env=envinfo.environment(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
