"""Half last KV tiles on or off: the jagged forward timed both ways in one process, in rounds that
alternate which goes first (do_bench medians; the H200's clock moves with its power cap, so only
same-process alternation compares fairly). Inputs, the fp32 reference check and FLOP counts are the
benchmark harness's (`jfa.workbench.bench`); both variants' outputs are also compared with each other.

    python scripts/ab_fwd_half_tail.py OUT.json [--rounds N] [--case NAME ...]   (GPU host, .gpu-bundle)

`results/fwd-half-tail-ab-*.json` are its runs; `jagged_fwd.HALF_TAIL_MAX_KV_LEN` comes from them.
"""
import argparse
import json

import torch

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.workbench import bench, envinfo

DEVICE = "cuda"

def _suite_case(suite: str, name: str, **changes) -> dict:
    case = next(c for c in specs.BENCH_SUITES[suite] if c["case"] == name)
    return dict(case, **changes)


CASES = {
    "pma q=256 kv~U[1,2048]": _suite_case("pma", "q=256,kv<=2048"),
    "pma q=64 kv~U[1,2048]": _suite_case("pma", "q=64,kv<=2048"),
    **{f"gem L={L} s={s:g}": _suite_case("gem", f"L={L},s={s}")
       for L, s in ((256, 0.5), (256, 1.0), (512, 0.5), (512, 1.0), (1024, 0.5), (1024, 1.0), (2048, 0.5))},
    "dense D=128": _suite_case("dense", "B=4,H=32,N=4096,D=128"),
    "gem L=1024 s=0.5 D=64 H=8": _suite_case("gem", "L=1024,s=0.5", head_dim=64, heads=8),
}


def _use_half_tail(on: bool) -> None:
    """Half last tiles compiled in for every length, or for none (the wrapper reads the bound per call)."""
    jagged_fwd.HALF_TAIL_MAX_KV_LEN = 1 << 30 if on else 0


def run_case(name, rounds):
    case = CASES[name]
    problem = bench.make_problem(case, DEVICE, 0)
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))
    args = (problem.q_offsets, problem.kv_offsets, problem.max_q, problem.max_kv, None, False, None,
            problem.kind == "pma")
    result = dict(case=name, ms={}, relerr_vs_ref={}, unwritten_rows={})
    outputs = {}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            _use_half_tail(on)
            if r == 0:
                poisoned = torch.full((problem.out_rows, problem.heads, problem.head_dim), float("nan"),
                                      device=DEVICE, dtype=q.dtype)
                outputs[on], _ = jagged_fwd.jagged_attention_fwd(q, k, v, *args, out=poisoned)
                result["unwritten_rows"][str(on)] = int(outputs[on].isnan().any(-1).any(-1).sum())
                result["relerr_vs_ref"][str(on)] = bench.check_output(problem, outputs[on])["rel_err"]
            result["ms"].setdefault(str(on), []).append(
                bench.do_bench_median(lambda: jagged_fwd.jagged_attention_fwd(q, k, v, *args), []))
    result["max_abs_diff_on_vs_off"] = float((outputs[True].float() - outputs[False].float()).abs().max())
    result["tflops_median"] = bench.median_tflops(case, problem, "fwd", result["ms"])
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
