"""This tree's jagged forward against another version of `jfa/kernels/jagged_fwd.py`, timed in one
process in rounds that alternate which goes first (the H200's clock moves with its power cap, so
only same-process alternation compares fairly). Inputs, the fp32 reference check and FLOP counts
are the benchmark harness's (`jfa.workbench.bench`); the two versions' outputs are also compared.

    git show main:jfa/kernels/jagged_fwd.py > /tmp/jagged_fwd_ref.py
    python scripts/ab_fwd_vs_ref.py /tmp/jagged_fwd_ref.py OUT.json [--rounds N] [--suites pma,gem,dense,fp8]
        [--head-dim 64]
    (GPU host, .gpu-bundle)
"""
import argparse
import importlib.util
import json
import os

import torch

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.workbench import bench, envinfo

DEVICE = "cuda"
SUITES = "pma,gem,dense"  # any of specs.BENCH_SUITES whose problems the plain forward call runs (not block kinds)


def at_head_dim(case: dict, head_dim: int | None) -> dict:
    """`case` at another head dim with the heads scaled to keep the work per token (None: as is)."""
    if head_dim is None or head_dim == case["head_dim"]:
        return case
    heads = case["heads"] * case["head_dim"] // head_dim
    return dict(case, head_dim=head_dim, heads=heads, case=f"{case['case']},D={head_dim},H={heads}")


def load_reference(path: str):
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(case, versions, rounds):
    problem = bench.make_problem(case, DEVICE, 0)
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
    args = (problem.q_offsets, problem.kv_offsets, problem.max_q, problem.max_kv, None, False, None,
            problem.kind == "pma")
    result = dict(case=f"{case['suite']} {case['case']}", ms={}, relerr_vs_ref={})
    outputs = {}
    for r in range(rounds):
        for name in (list(versions) if r % 2 == 0 else list(versions)[::-1]):
            module = versions[name]
            if r == 0:
                outputs[name], _ = module.jagged_attention_fwd(q, k, v, *args)
                result["relerr_vs_ref"][name] = bench.check_output(problem, outputs[name])["rel_err"]
            result["ms"].setdefault(name, []).append(
                bench.do_bench_median(lambda: module.jagged_attention_fwd(q, k, v, *args), []))
    result["max_abs_diff"] = float((outputs["this"].float() - outputs["ref"].float()).abs().max())
    result["tflops_median"] = bench.median_tflops(case, problem, "fwd", result["ms"])
    return result


def run_ab(args, versions, cases, run_case, details, kind):
    """Time every case with `run_case`, print each row's ratio and `details(row)`, write OUT."""
    rows = []
    for case in cases:
        row = run_case(case, versions, args.rounds)
        ratio = row["tflops_median"]["this"] / row["tflops_median"]["ref"]
        print(f"{row['case']:<32} this {row['tflops_median']['this']:6.1f}  ref {row['tflops_median']['ref']:6.1f}"
              f"  x{ratio:.3f}  {details(row)}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    doc = dict(kind=kind, reference=args.reference, env=envinfo.environment(), rows=rows)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


def ab_parser(doc: str, module_path: str, rounds: int) -> argparse.ArgumentParser:
    """The A/B scripts' common arguments: the reference copy of `module_path`, OUT, rounds, suites."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("reference", help=f"a copy of another version's {module_path}")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--suites", default=SUITES)
    parser.add_argument("--head-dim", type=int, choices=specs.SUPPORTED_HEAD_DIMS, default=None,
                        help="run the suites' cases at this head dim, with the heads scaled to keep the work")
    return parser


def suite_cases(args) -> list[dict]:
    return [at_head_dim(case, args.head_dim) for suite in args.suites.split(",") for case in specs.BENCH_SUITES[suite]]


def ab_main(doc: str, module, module_path: str, rounds: int, run_case, details, kind: str) -> None:
    """An A/B script's whole run: parse its arguments, then time `module` against the reference copy
    of `module_path` on the chosen suites (`run_ab`)."""
    args = ab_parser(doc, module_path, rounds).parse_args()
    run_ab(args, {"this": module, "ref": load_reference(args.reference)}, suite_cases(args), run_case, details,
           kind)


def main():
    ab_main(__doc__, jagged_fwd, "jfa/kernels/jagged_fwd.py", 4, run_case,
            lambda row: f"relerr {row['relerr_vs_ref']}  diff {row['max_abs_diff']:.2e}",
            "same-process A/B of the jagged forward against another version")


if __name__ == "__main__":
    main()
