"""This tree's jagged backward against another version of `jfa/kernels/jagged_bwd.py`, timed in one
process in rounds that alternate which goes first (the forward's A/B, `ab_fwd_vs_ref.py`, for the
backward). Both versions get the same forward output, LSE and upstream gradient; the whole backward
(Delta, the dK/dV kernel, the dQ kernel) is timed, and the gradients are compared bit for bit.
`--head-dim 64` runs the suites' cases at D=64 with twice the heads (the same work per token).

    git show main:jfa/kernels/jagged_bwd.py > /tmp/jagged_bwd_ref.py
    python scripts/ab_bwd_vs_ref.py /tmp/jagged_bwd_ref.py OUT.json [--rounds N] [--suites gem,pma,dense]
        [--head-dim 64]                                                        (GPU host, .gpu-bundle)
"""

import torch
from ab_fwd_vs_ref import DEVICE, ab_main

from jfa.kernels import jagged_bwd, jagged_fwd
from jfa.workbench import bench


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
    result["tflops_median"] = bench.median_tflops(case, problem, "bwd", result["ms"])
    return result


def main():
    ab_main(__doc__, jagged_bwd, "jfa/kernels/jagged_bwd.py", 3, run_case,
            lambda row: f"bitwise equal {row['bitwise_equal']}",
            "same-process A/B of the jagged backward against another version")


if __name__ == "__main__":
    main()
