"""The jagged kernels of this tree against those of an earlier commit, interleaved in one process.

A change that must not cost speed (a refactoring, a cleanup) is measured here: both versions time
the same inputs in rotating rounds on one GPU, so clocks and heat treat them alike.

    python scripts/ab_against_commit.py prepare COMMIT DIR      # here: DIR/jfa_old, that commit's jfa
    python scripts/ab_against_commit.py run OUT.json --old DIR [--suites gem,pma,dense] [--rounds 3]
    python scripts/ab_against_commit.py warm --old DIR --shard I/N     # compile ahead, one shard of the cases

`prepare` copies COMMIT's `jfa` package from git as `jfa_old`, with its imports and op namespace
renamed, so both import side by side. `run` times, per case of the suites (jfa.specs.BENCH_SUITES),
the forward and forward+backward of both through the same thin autograd wrapper around their host
entry points (the new `jfa.runner`, the old kernel modules' `jagged_attention_fwd/_bwd`), after
checking both against the fp32 reference (`jfa.workbench.bench`'s checks). It writes each case's
times, TFLOP/s and the new/old speedup per pass, with the environment block.

`warm` runs each case's providers once, forward and backward, without timing: shards of it in
parallel processes fill Triton's compile cache before `run` (compiles are serial within a process).

`--candidate NAME=STRATEGY` adds the new kernels with dQ forced to a bwd_dkdv strategy (DQ_NONE,
DQ_SPLIT, DQ_RESIDENT) as a third provider, on the cases where it applies (`--candidate-dims`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OLD_PACKAGE = "jfa_old"
RENAMES = ((re.compile(r"\bfrom jfa\b"), f"from {OLD_PACKAGE}"), (re.compile(r"\bimport jfa\b"), f"import {OLD_PACKAGE}"),
           (re.compile(r"([\"'])jfa::"), rf"\1{OLD_PACKAGE}::"), (re.compile(r"torch\.ops\.jfa\b"), f"torch.ops.{OLD_PACKAGE}"),
           (re.compile(r"([\"'])jfa\."), rf"\1{OLD_PACKAGE}."))


def prepare(commit: str, dest: Path) -> None:
    """Write COMMIT's jfa package to dest/jfa_old with its imports and op namespace renamed."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", commit, "jfa"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        target = dest / OLD_PACKAGE
        if target.exists():
            raise SystemExit(f"{target} exists: remove it first")
        Path(tmp, "jfa").rename(target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        for pattern, replacement in RENAMES:
            text = pattern.sub(replacement, text)
        path.write_text(text)
    (target / "COMMIT").write_text(commit + "\n")


def _providers(runner, bwd_dkdv):
    """Builders (jfa.workbench.providers' interface) of the new and the old kernels, and of a new one
    with dQ forced to a strategy."""
    import torch

    from jfa.workbench import providers

    def wrapper(forward, backward):
        class Attention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, problem):
                out, lse = forward(q, k, v, problem)
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.problem = problem
                return out

            @staticmethod
            def backward(ctx, dout):
                q, k, v, out, lse = ctx.saved_tensors
                return (*backward(dout.contiguous(), q, k, v, out, lse, ctx.problem), None)
        return Attention

    def arguments(p):
        return (p.q_offsets, p.kv_offsets, p.max_q, p.max_kv, None, False, None, p.kind == "pma")

    def build(attention):
        def builder(problem):
            if problem.kind not in ("jagged", "pma", "dense"):
                raise providers.ProviderUnavailable(f"no {problem.kind} here")
            q, k, v = problem.q, problem.k, problem.v
            return providers.ProviderRun(lambda: attention.apply(q, k, v, problem), lambda out: out, [q, k, v])
        return builder

    old_fwd = importlib.import_module(f"{OLD_PACKAGE}.kernels.jagged_fwd")
    old_bwd = importlib.import_module(f"{OLD_PACKAGE}.kernels.jagged_bwd")
    new = wrapper(lambda q, k, v, p: runner.forward(q, k, v, *arguments(p)),
                  lambda do, q, k, v, o, lse, p: runner.backward(do, q, k, v, o, lse, *arguments(p)))
    before = wrapper(lambda q, k, v, p: old_fwd.jagged_attention_fwd(q, k, v, *arguments(p)),
                     lambda do, q, k, v, o, lse, p: old_bwd.jagged_attention_bwd(do, q, k, v, o, lse, *arguments(p)))

    def forced(strategy):
        return wrapper(lambda q, k, v, p: runner.forward(q, k, v, *arguments(p)),
                       lambda do, q, k, v, o, lse, p: runner.backward(do, q, k, v, o, lse, *arguments(p),
                                                                      dq_strategy=strategy))
    return build(new), build(before), lambda name: build(forced(getattr(bwd_dkdv, name).value))


def run(out_path: Path, old_dir: Path, suites: list[str], rounds: int, candidates: dict, candidate_dims: set) -> None:
    sys.path.insert(0, str(old_dir))
    from jfa import runner, specs
    from jfa.kernels import bwd_dkdv
    from jfa.workbench import envinfo, head_to_head

    build_new, build_old, build_forced = _providers(runner, bwd_dkdv)
    registry = {"jfa": build_new, "old": build_old}
    registry.update({name: build_forced(strategy) for name, strategy in candidates.items()})
    old_commit = (old_dir / OLD_PACKAGE / "COMMIT").read_text().strip()
    cases = []
    report = dict(kind="ab-against-commit", old_commit=old_commit, peers=["old", *candidates], env=envinfo.environment(),
                  rounds=rounds, cases=cases, summary={})
    for suite in suites:
        for case in specs.BENCH_SUITES[suite]:
            peers = ("old",) + tuple(name for name in candidates if case["head_dim"] in candidate_dims)
            print(f"{suite} {case['case']}: jfa vs {', '.join(peers)}", flush=True)
            try:
                row = head_to_head.head_to_head(case, peers, max(rounds, head_to_head.min_rounds(peers)),
                                                registry=registry)
            except Exception as exc:  # a case that fails is a row that says so
                row = dict(suite=suite, case=case["case"], error=f"{type(exc).__name__}: {exc}")
            cases.append(row)
            report["summary"] = _geometric_means(cases)
            out_path.write_text(json.dumps(report, indent=1, default=str) + "\n")  # rewritten after every case
            if "error" not in row:
                print("  " + ", ".join(f"{peer}: fwd {s['fwd']:.3f}x bwd {s['bwd']:.3f}x"
                                       for peer, s in row["speedups"].items()), flush=True)
    print(json.dumps(report["summary"], indent=1))


def warm(old_dir: Path, suites: list[str], candidates: dict, candidate_dims: set, shard: int, shards: int) -> None:
    """Compile every kernel the `run` of these arguments times: its cases' providers, once each."""
    sys.path.insert(0, str(old_dir))
    from jfa import runner, specs
    from jfa.kernels import bwd_dkdv
    from jfa.workbench import bench

    build_new, build_old, build_forced = _providers(runner, bwd_dkdv)
    cases = [case for suite in suites for case in specs.BENCH_SUITES[suite]]
    for case in cases[shard::shards]:
        problem = bench.build_problems(case, "cuda")[0]
        builders = [build_new, build_old] + [build_forced(s) for s in candidates.values()
                                             if case["head_dim"] in candidate_dims]
        for builder in builders:
            run_ = builder(problem)
            run_.forward().float().sum().backward()
        bench.clear_grads([problem])
        print(f"warm: {case['suite']} {case['case']}", flush=True)


def _geometric_means(cases: list[dict]) -> dict:
    """Per suite and pass: the geometric mean and the least of new/old (the `speedups` over "old")."""
    logs: dict = {}
    for row in cases:
        if "error" in row:
            continue
        for pass_, ratio in row["speedups"]["old"].items():
            logs.setdefault(row["suite"], {}).setdefault(pass_, []).append(ratio)
    return {suite: {pass_: dict(geomean=math.exp(statistics.fmean(math.log(r) for r in ratios)), least=min(ratios),
                                cases=len(ratios)) for pass_, ratios in by_pass.items()}
            for suite, by_pass in logs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="copy COMMIT's jfa package into DIR as jfa_old")
    prep.add_argument("commit")
    prep.add_argument("dest", type=Path)
    go = commands.add_parser("run", help="time this tree's kernels against DIR/jfa_old's")
    go.add_argument("out", type=Path)
    go.add_argument("--old", type=Path, required=True, help="the directory `prepare` wrote into")
    go.add_argument("--suites", default="gem,pma,dense")
    go.add_argument("--rounds", type=int, default=3)
    hot = commands.add_parser("warm", help="compile one shard of `run`'s kernels ahead")
    hot.add_argument("--old", type=Path, required=True)
    hot.add_argument("--suites", default="gem,pma,dense")
    hot.add_argument("--shard", default="0/1", help="I/N: the I-th of N shards of the cases")
    for sub in (go, hot):
        sub.add_argument("--candidate", action="append", default=[], metavar="NAME=STRATEGY",
                         help="a new-kernel provider with dQ forced to a bwd_dkdv strategy, e.g. split64=DQ_SPLIT")
        sub.add_argument("--candidate-dims", default="64", help="head dims the candidates run on (comma-separated)")
    args = parser.parse_args(argv)
    candidates = dict(item.split("=", 1) for item in args.candidate) if args.command != "prepare" else {}
    if args.command == "warm":
        shard, shards = (int(x) for x in args.shard.split("/"))
        warm(args.old, args.suites.split(","), candidates, {int(d) for d in args.candidate_dims.split(",")}, shard,
             shards)
        return 0
    if args.command == "prepare":
        args.dest.mkdir(parents=True, exist_ok=True)
        prepare(args.commit, args.dest)
        return 0
    run(args.out, args.old, args.suites.split(","), args.rounds, candidates,
        {int(d) for d in args.candidate_dims.split(",")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
