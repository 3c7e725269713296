"""The jagged forward's tuning entry against variants of it, timed in one process.

`jagged_fwd.TUNING[(head_dim, heads_per_tile)]` holds BLOCK_N (keys per KV tile), NUM_KV_BUFFERS
(the K/V ring's depth) and CONSUMER_REGISTERS; `jagged_fwd.SHORT_KV_TUNING` may hold another entry for
the same key, used where keys average at most SHORT_KV_MEAN_LEN per sequence. "current" is the entry a
case uses; a variant overrides some of its values (in both tables, so in whichever entry the case
takes). Each case of the named benchmark suites (`jfa.workbench.bench` inputs) is timed for the current entry
and every variant in rounds whose order rotates (the H200's clock moves with its power cap, so only
same-process rounds compare), and every output is checked against the fp32 reference first. A variant that does not
compile or launch (e.g. its ring outgrows shared memory) is recorded with its error. Cases that the
entry does not configure (PMA q=64 runs two heads per tile, entry (128, 2)) time the same kernel
under every name: their spread is the run's noise.

    python scripts/sweep_fwd_tuning.py OUT.json --variant BLOCK_N=64,NUM_KV_BUFFERS=4 [--variant ...]
        [--key 128,1] [--suites pma,gem,dense] [--rounds 3]                  (GPU host, .gpu-bundle)
"""
import argparse
import json

import torch

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.workbench import bench, envinfo

CURRENT = "current"


def parse_variant(text: str) -> dict:
    """"BLOCK_N=64,NUM_KV_BUFFERS=4" -> {"BLOCK_N": 64, "NUM_KV_BUFFERS": 4}."""
    pairs = [item.split("=") for item in text.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f"--variant takes NAME=INT[,NAME=INT...], got {text!r}")
    return {name.strip(): int(value) for name, value in pairs}


def run_case(case, key, variants, rounds):
    problem = bench.make_problem(case, "cuda", 0)
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
    args = (problem.q_offsets, problem.kv_offsets, problem.max_q, problem.max_kv, None, False, None,
            problem.kind == "pma")
    call = lambda: jagged_fwd.jagged_attention_fwd(q, k, v, *args)
    tables = [t for t in (jagged_fwd.TUNING, jagged_fwd.SHORT_KV_TUNING) if key in t]
    bases = [dict(t[key]) for t in tables]
    row = dict(case=f"{case['suite']} {case['case']}", ms={}, rel_err={}, errors={})
    names = list(variants)
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in row["errors"]:
                    continue
                for table, base in zip(tables, bases):
                    table[key] = dict(base, **variants[name])
                try:
                    if r == 0:
                        row["rel_err"][name] = bench.check_output(problem, call()[0])["rel_err"]
                    row["ms"].setdefault(name, []).append(bench.do_bench_median(call, []))
                except Exception as exc:  # a variant that cannot run is a result, recorded as such
                    row["errors"][name] = bench._error_text(exc)
    finally:
        for table, base in zip(tables, bases):
            table[key] = base
    row["tflops_median"] = bench.median_tflops(case, problem, "fwd", row["ms"])
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--variant", type=parse_variant, action="append", required=True)
    parser.add_argument("--key", default="128,1", help="the TUNING entry: head_dim,heads_per_tile")
    parser.add_argument("--suites", default="pma,gem,dense")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    key = tuple(int(x) for x in args.key.split(","))
    if key not in jagged_fwd.TUNING:
        parser.error(f"--key must name one of {sorted(jagged_fwd.TUNING)}, got {key}")
    variants = {CURRENT: {}} | {",".join(f"{n}={v}" for n, v in var.items()): var for var in args.variant}
    rows = []
    for suite in args.suites.split(","):
        for case in specs.BENCH_SUITES[suite]:
            if case["head_dim"] != key[0]:
                continue
            row = run_case(case, key, variants, args.rounds)
            print(f"{row['case']:<30} " + "  ".join(f"{n} {t:6.1f}" for n, t in row["tflops_median"].items())
                  + (f"  errors: {sorted(row['errors'])}" if row["errors"] else ""), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(kind="jagged forward tuning sweep, same process", key=list(key),
                       current=jagged_fwd.TUNING[key], current_short_kv=jagged_fwd.SHORT_KV_TUNING.get(key),
                       variants=variants, rounds=args.rounds,
                       env=envinfo.environment(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
