"""jfa against one peer, interleaved in one process, so both see the same GPU state.

Why: on the H200 the same kernel timed in one process moved by up to 13% between the first and a
later measurement (clocks fall as the GPU heats; `results/README`). `jfa.bench` times each provider
of a case once, one after the other, and rows re-measured in a later run (`--rerun`) were timed
in another thermal state than the peers' rows. Here every case is timed in rounds, the provider
order alternating per round (jfa, peer / peer, jfa / ...), and each provider's median over the
rounds is reported with the spread. Timings, inputs, checks and FLOP counts are `jfa.bench`'s.

    python -m jfa.head_to_head OUT.json [--peer fa4] [--suites gem,pma,dense] [--rounds 3]
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from jfa import bench, envinfo, specs
from jfa.providers import ISOLATED_PROVIDERS, PROVIDERS

MIN_ROUNDS = 2  # each provider is timed first at least once


def head_to_head(case: dict, peer: str, rounds: int, *, device="cuda", registry: dict | None = None,
                 timer: bench.Timer = bench.do_bench_median) -> dict:
    """jfa and `peer` on one case, forward and forward+backward, timed in alternating rounds."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds: at least {MIN_ROUNDS}, so that each provider is timed first once; got {rounds}")
    registry = PROVIDERS if registry is None else registry
    problems = bench.build_problems(case, device)
    checks = {p: {} for p in ("jfa", peer)}
    ready = {p: bench.prepare_provider(registry[p], problems, checks[p]) for p in checks}
    for p, r in ready.items():
        if r.fwd_bwd is None:
            raise ValueError(f"{p} has no backward here ({r.no_backward}); head-to-head times both passes")
    times = {p: {"fwd": [], "fwd+bwd": []} for p in ready}
    for r in range(rounds):
        for provider in (("jfa", peer) if r % 2 == 0 else (peer, "jfa")):
            calls = ready[provider]
            times[provider]["fwd"].append(timer(calls.fwd, []))
            times[provider]["fwd+bwd"].append(timer(calls.fwd_bwd, calls.grads))
    flops = {p: bench.case_flops(case, problems[0], p) for p in specs.BENCH_PASSES}
    result = dict(suite=case["suite"], case=case["case"], rounds=times, flops=flops,
                  checks=checks, providers={})
    for p, t in times.items():
        fwd, fwd_bwd = statistics.median(t["fwd"]), statistics.median(t["fwd+bwd"])
        result["providers"][p] = dict(
            fwd_ms=fwd, bwd_ms=fwd_bwd - fwd, fwd_tflops=specs.tflops(flops["fwd"], fwd),
            bwd_tflops=specs.tflops(flops["bwd"], fwd_bwd - fwd),
            fwd_spread=(max(t["fwd"]) - min(t["fwd"])) / fwd)
    ours, theirs = result["providers"]["jfa"], result["providers"][peer]
    result["speedup"] = dict(fwd=theirs["fwd_ms"] / ours["fwd_ms"], bwd=theirs["bwd_ms"] / ours["bwd_ms"])
    bench.clear_grads(problems)
    return result


def summary_markdown(report: dict) -> str:
    """A markdown table of one head-to-head report: TFLOP/s, each provider's forward spread over the
    rounds (max - min over the median), jfa's speedup per pass, and each suite's geometric mean."""
    peer = report["peer"]
    lines = [f"| case | jfa fwd | {peer} fwd | fwd speedup | jfa bwd | {peer} bwd | bwd speedup |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    logs: dict[str, dict[str, list[float]]] = {}
    for row in report["cases"]:
        label = f"{row['suite']} {row['case']}"
        if "error" in row:
            lines.append(f"| {label} | failed: {row['error'][:80]} |" + " |" * 5)
            continue
        ours, theirs, speedup = row["providers"]["jfa"], row["providers"][peer], row["speedup"]
        lines.append(f"| {label} | {ours['fwd_tflops']:.0f} (±{ours['fwd_spread'] * 50:.0f}%) | "
                     f"{theirs['fwd_tflops']:.0f} (±{theirs['fwd_spread'] * 50:.0f}%) | {speedup['fwd']:.2f}x | "
                     f"{ours['bwd_tflops']:.0f} | {theirs['bwd_tflops']:.0f} | {speedup['bwd']:.2f}x |")
        for pass_ in ("fwd", "bwd"):
            logs.setdefault(row["suite"], {}).setdefault(pass_, []).append(math.log(speedup[pass_]))
    lines.append("")
    for suite, by_pass in logs.items():
        means = ", ".join(f"{p} {math.exp(statistics.fmean(v)):.2f}x" for p, v in by_pass.items())
        lines.append(f"{suite}: geometric mean of jfa's speedup over {peer}: {means} ({len(by_pass['fwd'])} cases)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    # FlexAttention runs in its own process (jfa.bench), so it cannot share rounds with jfa here.
    parser.add_argument("--peer", default="fa4",
                        choices=[p for p in specs.BENCH_PROVIDERS if p != "jfa" and p not in ISOLATED_PROVIDERS])
    parser.add_argument("--suites", default="gem,pma,dense")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds: at least {MIN_ROUNDS}, so that each provider is timed first once")
    cases = bench.suite_cases(args.suites.split(","), quick=False)
    report = dict(kind="head-to-head", peer=args.peer, rounds=args.rounds, env=envinfo.environment(), cases=[])
    for case in cases:
        started = time.monotonic()
        try:
            row = head_to_head(case, args.peer, args.rounds)
        except Exception as exc:  # a failed case is a result, reported as such
            row = dict(suite=case["suite"], case=case["case"], error=bench._error_text(exc))
        report["cases"].append(row)
        args.out.write_text(json.dumps(report, indent=1))
        speed = row.get("speedup")
        print(f"{case['suite']:6s} {case['case']:26s} " + (
            f"fwd x{speed['fwd']:.2f}  bwd x{speed['bwd']:.2f}" if speed else f"FAILED {row['error'][:120]}")
              + f"  ({time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
