"""This tree's jagged backward against another version of `jfa/kernels/jagged_bwd.py`, timed in one
process in rounds that alternate which goes first (the forward's A/B, `ab_fwd_vs_ref.py`, for the
backward). Both versions get the same forward output, LSE and upstream gradient; the whole backward
(Delta, the dK/dV kernel, the dQ kernel) is timed, and the gradients are compared bit for bit.
`--head-dim 64` runs the suites' cases at D=64 with twice the heads (the same work per token).

    git show main:jfa/kernels/jagged_bwd.py > /tmp/jagged_bwd_ref.py
    python scripts/ab_bwd_vs_ref.py /tmp/jagged_bwd_ref.py OUT.json [--rounds N] [--suites gem,pma,dense]
        [--head-dim 64]                                                        (GPU host, .gpu-bundle)
"""
import argparse
import json
import statistics

import torch
from ab_fwd_vs_ref import DEVICE, SUITES, load_reference

from jfa import bench, envinfo, specs
from jfa.kernels import jagged_bwd, jagged_fwd


def at_head_dim(case: dict, head_dim: int) -> dict:
    if head_dim == case["head_dim"]:
        return case
    heads = case["heads"] * case["head_dim"] // head_dim
    return dict(case, head_dim=head_dim, heads=heads, case=f"{case['case']},D={head_dim},H={heads}")


def run_case(case, versions, rounds):
    problem = bench.make_problem(case, DEVICE, 0)
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
    args = (problem.q_offsets, problem.kv_offsets, problem.max_q, problem.max_kv, None, False, None,
            problem.kind == "pma")
    out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    result = dict(case=f"{case['suite']} {case['case']}", ms={})
    grads = {}
    for r in range(rounds):
        for name in (list(versions) if r % 2 == 0 else list(versions)[::-1]):
            module = versions[name]
            if r == 0:
                grads[name] = [g.clone() for g in module.jagged_attention_bwd(dout, q, k, v, out, lse, *args)]
            result["ms"].setdefault(name, []).append(
                bench.do_bench_median(lambda: module.jagged_attention_bwd(dout, q, k, v, out, lse, *args), []))
    result["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(grads["this"], grads["ref"]))
    flops = bench.case_flops(case, problem, "bwd")
    result["tflops_median"] = {name: specs.tflops(flops, statistics.median_high(t)) for name, t in result["ms"].items()}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="a copy of another version's jfa/kernels/jagged_bwd.py")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--suites", default=SUITES)
    parser.add_argument("--head-dim", type=int, choices=specs.SUPPORTED_HEAD_DIMS, default=None)
    args = parser.parse_args()
    versions = {"this": jagged_bwd, "ref": load_reference(args.reference)}
    rows = []
    for suite in args.suites.split(","):
        for case in specs.BENCH_SUITES[suite]:
            row = run_case(at_head_dim(case, args.head_dim or case["head_dim"]), versions, args.rounds)
            ratio = row["tflops_median"]["this"] / row["tflops_median"]["ref"]
            print(f"{row['case']:<32} this {row['tflops_median']['this']:6.1f}  ref {row['tflops_median']['ref']:6.1f}"
                  f"  x{ratio:.3f}  bitwise equal {row['bitwise_equal']}", flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    doc = dict(kind="same-process A/B of the jagged backward against another version", reference=args.reference,
               env=envinfo.environment(), rows=rows)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
