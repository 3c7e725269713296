"""jfa against its peers, interleaved in one process, so all see the same GPU state.

Why: on the H200 the same kernel timed in one process moved by up to 13% between the first and a
later measurement (clocks fall as the GPU heats). `jfa.workbench.bench` times each provider of a case
once, one after the other, and rows re-measured in a later run (`--rerun`) were timed in another
thermal state than the peers' rows. Here every case is timed in rounds, the provider order rotating
per round (jfa, fa4, fa2 / fa4, fa2, jfa / fa2, jfa, fa4 / ...; with one peer that alternates), and
the forward's rounds all run before the forward+backward's: on the H200 a forward timed right after a
forward+backward reads up to 6% slower than one timed after a forward, which would tie a forward's
time to the order of the passes around it. Each provider's median over the rounds is reported with
the spread, with jfa's speedup over each peer and over the faster peer of each pass (the issues' "no
shape slower than the faster of FA2 and FA4"). Timings, inputs, checks and FLOP counts are
`jfa.workbench.bench`'s.

    python -m jfa head-to-head OUT.json [--peer fa4[,fa2]] [--suites gem,pma,dense] [--rounds 3]
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from jfa import specs
from jfa.workbench import bench, envinfo
from jfa.workbench.providers import ISOLATED_PROVIDERS, PROVIDERS

COMPARED_PASSES = ("fwd", "bwd")  # backward time = fwd+bwd - fwd


def min_rounds(peers) -> int:
    """Rounds enough for every provider (jfa and each peer) to be timed first once."""
    return 1 + len(peers)


def round_order(providers: tuple[str, ...], round_: int) -> tuple[str, ...]:
    """The providers in the order round `round_` times them: rotated by one per round."""
    shift = round_ % len(providers)
    return providers[shift:] + providers[:shift]


def head_to_head(case: dict, peers, rounds: int, *, device="cuda", registry: dict | None = None,
                 timer: bench.Timer = bench.do_bench_median) -> dict:
    """jfa and each of `peers` (a name or several) on one case, forward and forward+backward, timed in
    rotating rounds. `speedup` is jfa's over the first peer, `speedups` over each, and `speedup_over_faster`
    over the faster peer of each pass."""
    peers = (peers,) if isinstance(peers, str) else tuple(peers)
    if rounds < min_rounds(peers):
        raise ValueError(f"rounds: at least {min_rounds(peers)}, so that each provider is timed first once; "
                         f"got {rounds}")
    registry = PROVIDERS if registry is None else registry
    providers = ("jfa",) + peers
    problems = bench.build_problems(case, device)
    checks = {p: {} for p in providers}
    ready = {p: bench.prepare_provider(registry[p], problems, checks[p]) for p in providers}
    for p, r in ready.items():
        if r.fwd_bwd is None:
            raise ValueError(f"{p} has no backward here ({r.no_backward}); head-to-head times both passes")
    times = {p: {"fwd": [], "fwd+bwd": []} for p in providers}
    for pass_ in ("fwd", "fwd+bwd"):  # each pass its own rounds (module docstring)
        for r in range(rounds):
            for provider in round_order(providers, r):
                calls = ready[provider]
                fn, grads = (calls.fwd, []) if pass_ == "fwd" else (calls.fwd_bwd, calls.grads)
                times[provider][pass_].append(timer(fn, grads))
    flops = {p: bench.case_flops(case, problems[0], p) for p in specs.BENCH_PASSES}
    result = dict(suite=case["suite"], case=case["case"], rounds=times, flops=flops,
                  checks=checks, providers={})
    for p, t in times.items():
        fwd, fwd_bwd = statistics.median(t["fwd"]), statistics.median(t["fwd+bwd"])
        result["providers"][p] = dict(
            fwd_ms=fwd, bwd_ms=fwd_bwd - fwd, fwd_tflops=specs.tflops(flops["fwd"], fwd),
            bwd_tflops=specs.tflops(flops["bwd"], fwd_bwd - fwd),
            fwd_spread=(max(t["fwd"]) - min(t["fwd"])) / fwd)
    ours = result["providers"]["jfa"]
    result["speedups"] = {peer: {pass_: result["providers"][peer][f"{pass_}_ms"] / ours[f"{pass_}_ms"]
                                 for pass_ in COMPARED_PASSES} for peer in peers}
    result["speedup"] = result["speedups"][peers[0]]
    result["speedup_over_faster"] = {pass_: min(s[pass_] for s in result["speedups"].values())
                                     for pass_ in COMPARED_PASSES}
    bench.clear_grads(problems)
    return result


def summary_markdown(report: dict) -> str:
    """A markdown table of one head-to-head report: TFLOP/s, each provider's forward spread over the
    rounds (max - min over the median), jfa's speedup per pass over each peer (and over the faster one
    where there are several), and each suite's geometric means. Reads one-peer reports too."""
    peers = report.get("peers", [report["peer"]])
    several = len(peers) > 1
    ratio_columns = ([f"vs {p}" for p in peers] + ["vs faster"]) if several else ["speedup"]
    header = ["case", "jfa fwd"] + [f"{p} fwd" for p in peers] + [f"fwd {c}" for c in ratio_columns]
    header += ["jfa bwd"] + [f"{p} bwd" for p in peers] + [f"bwd {c}" for c in ratio_columns]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    logs: dict[str, dict[str, dict[str, list[float]]]] = {}
    for row in report["cases"]:
        label = f"{row['suite']} {row['case']}"
        if "error" in row:
            lines.append(f"| {label} | failed: {row['error'][:80]} |" + " |" * (len(header) - 2))
            continue
        speedups = row.get("speedups", {peers[0]: row["speedup"]})
        if several:
            speedups = dict(speedups, faster=row["speedup_over_faster"])
        cells = [label]
        for pass_ in COMPARED_PASSES:
            for p in ("jfa",) + tuple(peers):
                numbers = row["providers"][p]
                spread = f" (±{numbers['fwd_spread'] * 50:.0f}%)" if pass_ == "fwd" else ""
                cells.append(f"{numbers[f'{pass_}_tflops']:.0f}{spread}")
            cells += [f"{s[pass_]:.2f}x" for s in speedups.values()]
            for name, s in speedups.items():
                logs.setdefault(row["suite"], {}).setdefault(name, {}).setdefault(pass_, []).append(math.log(s[pass_]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for suite, by_peer in logs.items():
        for name, by_pass in by_peer.items():
            over = "the faster peer" if name == "faster" else name
            means = ", ".join(f"{p} {math.exp(statistics.fmean(v)):.2f}x" for p, v in by_pass.items())
            lines.append(f"{suite}: geometric mean of jfa's speedup over {over}: {means} ({len(by_pass['fwd'])} cases)")
    return "\n".join(lines)


def target_demand_markdown(report: dict, targets: dict, ceilings: dict, peer: str = specs.BWD_TARGET_PEER,
                           mean_suites=specs.BWD_TARGET_MEAN_SUITES) -> str:
    """What backward speedup targets over `peer` ask of the GPU, case by case in one head-to-head
    report: the rate a target sets (target x the peer's backward TFLOP/s), against each GEMM ceiling
    (`ceilings`: label -> TFLOP/s), a hard bound, and against the fastest forward of any provider on
    the case, an empirical one: the fastest backward's share of it is shown beside (a backward runs
    five GEMMs to the forward's two, with more shared-memory traffic per FLOP).

    `targets` maps suite -> speedup. For each suite whose target is a geometric mean (`mean_suites`)
    it adds one line: if every case whose rate is above the fastest forward got a backward as fast as
    jfa's forward, the speedup each other case would need for the mean to reach the target, and what
    that is against jfa's forward."""
    header = ["case", f"{peer} bwd", "jfa bwd", "target", "asks"] + [f"asks / {label}" for label in ceilings]
    header += ["fastest fwd", "asks / fastest fwd", "fastest bwd / fastest fwd"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    held, free = {}, {}
    for row in report["cases"]:
        target = targets.get(row["suite"])
        if target is None or "error" in row:
            continue
        rates = row["providers"]
        peer_bwd = rates[peer]["bwd_tflops"]
        asks = target * peer_bwd
        fastest_fwd = max(rates, key=lambda p: rates[p]["fwd_tflops"])
        fwd_rate = rates[fastest_fwd]["fwd_tflops"]
        bwd_rate = max(r["bwd_tflops"] for r in rates.values())
        cells = [f"{row['suite']} {row['case']}", f"{peer_bwd:.0f}", f"{rates['jfa']['bwd_tflops']:.0f}",
                 f"{target:.2f}x", f"{asks:.0f}"] + [f"{asks / ceiling:.2f}x" for ceiling in ceilings.values()]
        cells += [f"{fwd_rate:.0f} ({fastest_fwd})", f"{asks / fwd_rate:.2f}x", f"{bwd_rate / fwd_rate:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
        jfa_fwd_over_peer = rates["jfa"]["fwd_tflops"] / peer_bwd
        (held if asks > fwd_rate else free).setdefault(row["suite"], []).append((row["case"], jfa_fwd_over_peer))
    lines.append("")
    for suite, cases in free.items():
        capped = held.get(suite, [])
        if not capped or suite not in mean_suites:
            continue
        total = len(cases) + len(capped)
        each = math.exp((total * math.log(targets[suite]) - sum(math.log(c) for _, c in capped)) / len(cases))
        needs = ", ".join(f"{case} ({each / jfa_fwd:.2f}x jfa's forward)" for case, jfa_fwd in cases)
        lines.append(f"{suite}: with its {len(capped)} cases above the fastest forward given a backward as fast as "
                     f"jfa's forward, a geometric mean of {targets[suite]:.2f}x needs {each:.2f}x {peer} on {needs}")
    return "\n".join(lines)


def _peer_list(text: str) -> list[str]:
    """`--peer`: one peer or a comma-separated list, each timed in jfa's process (not FlexAttention,
    which runs in its own: `jfa.workbench.bench`)."""
    choices = [p for p in specs.BENCH_PROVIDERS if p != "jfa" and p not in ISOLATED_PROVIDERS]
    peers = [p for p in text.split(",") if p]
    unknown = [p for p in peers if p not in choices]
    if unknown or not peers or len(set(peers)) != len(peers):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (one or more distinct of {', '.join(choices)}, "
                                         "comma-separated)")
    return peers


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m jfa head-to-head", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the report JSON to write (rewritten after every case)")
    parser.add_argument("--peer", default=["fa4"], type=_peer_list, help="fa4, or several: fa4,fa2")
    parser.add_argument("--suites", default="gem,pma,dense")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rounds < min_rounds(args.peer):
        parser.error(f"--rounds: at least {min_rounds(args.peer)}, so that each provider is timed first once")
    if not torch.cuda.is_available():
        print("head-to-head needs a CUDA GPU (it times jfa and its peers); on this machine render recorded "
              "runs with `python -m jfa report RUN.json ... -o REPORT.html`", file=sys.stderr)
        return 2
    cases = bench.suite_cases(args.suites.split(","), quick=False)
    report = dict(kind="head-to-head", peer=args.peer[0], peers=args.peer, rounds=args.rounds,
                  env=envinfo.environment(), cases=[])
    for case in cases:
        started = time.monotonic()
        try:
            row = head_to_head(case, args.peer, args.rounds)
        except Exception as exc:  # a failed case is a result, reported as such
            row = dict(suite=case["suite"], case=case["case"], error=bench._error_text(exc))
        report["cases"].append(row)
        args.out.write_text(json.dumps(report, indent=1))
        speeds = row.get("speedups")
        print(f"{case['suite']:6s} {case['case']:26s} " + (
            "  ".join(f"{peer}: fwd x{s['fwd']:.2f} bwd x{s['bwd']:.2f}" for peer, s in speeds.items())
            if speeds else f"FAILED {row['error'][:120]}") + f"  ({time.monotonic() - started:.0f} s)", flush=True)
    return 0

