"""
A timeline of tutorial 3's roles, from timestamps the kernel writes itself
==========================================================================

Why. Warp specialization is a claim about time: while the consumers multiply k-step *i*, the
producer is already loading *i+1*, and nobody waits unless the ring is full or empty. A profiler
shows a kernel as one bar; only the kernel can say when each role waited and when it worked. So
tutorial 3 has a ``RECORD`` switch: one thread of each role reads ``%globaltimer`` before and after
every barrier wait and every step, and stores the stamps in a global int64 buffer.

``%globaltimer`` (nanoseconds) rather than ``%clock64`` (cycles): the cycle counter is per SM,
starts anywhere and ticks at the SM's current clock, so cycles of two CTAs on two SMs cannot be put
on one axis; the global timer is one clock for the whole GPU. Its price is a coarser step (the
recording says the smallest step it saw, ``min_stamp_step_ns``), and every stamp is one more global
store, so a recorded run is slightly slower than a plain one.

How. ``record()`` runs the RECORD kernel on fresh random inputs (checked against fp32 torch), turns
the stamps of a few CTAs into Gantt records relative to the kernel's first stamp, in microseconds,
and ``save()`` writes ``results/t03-timeline-<date>.json`` with the environment block, which
notebook 01 plots with ``jfa.workbench.plots.warp_timeline`` where no GPU is present. Records are the busy
phases (the producer issuing a k-step's TMA loads, a consumer's MMA, its epilogue): a gap in a
role's row is time spent waiting on a barrier, listed separately under ``waits``.

    python -m tutorials.timeline --out results
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from tutorials import t03_ws_wgmma_gemm as t03

ROLE_NAMES = t03.inspect_spec().role_names  # the kernel's row order: producer, consumer0, consumer1
# What each role does between a k-step's stamps: (the wait, the work that follows it).
STEP_PHASES = {role: ("wait empty", "issue loads") if role == "producer" else ("wait full", "MMA")
               for role in ROLE_NAMES}
EPILOGUE = "epilogue"
UNWRITTEN = -1  # the buffer's poison: %globaltimer never reads negative
NS_PER_US = 1000.0
DEFAULT_PROBLEM = dict(M=1024, N=1024, K=4096)  # 64 CTAs (one wave on an H200), 64 k-steps each
DEFAULT_SHOWN_PROGRAMS = 2
RESULTS_PATTERN = "t03-timeline-{stamp}.json"
# The GPU spins this long (~2 ms at H200 clocks) before the timed launch, so the Python launch
# overhead (descriptors, argument binding: hundreds of us) is hidden and the events time the kernel.
LAUNCH_HIDING_SLEEP_CYCLES = 4_000_000


def _row_phases(row: list, role: str, k_tiles: int) -> list[tuple]:
    """(phase, k, start_ns, end_ns, is_wait) of one role's row, in the order the role did them."""
    def stamp(step, position):
        return row[t03.ROW_HEAD.value + t03.STAMPS_PER_STEP.value * step + position]

    wait, work = STEP_PHASES[role]
    phases = []
    for k in range(k_tiles):
        phases.append((wait, k, stamp(k, t03.WAIT_START.value), stamp(k, t03.WAIT_END.value), True))
        phases.append((work, k, stamp(k, t03.WAIT_END.value), stamp(k, t03.STEP_END.value), False))
    if role != "producer":
        phases.append((EPILOGUE, None, stamp(k_tiles, t03.EPILOGUE_START.value),
                       stamp(k_tiles, t03.EPILOGUE_END.value), False))
    return phases


def timeline_from_stamps(stamps: list, k_tiles: int, shown_programs: int | None = DEFAULT_SHOWN_PROGRAMS) -> dict:
    """The raw RECORD buffer (rows of ints, program-major, then role) as Gantt records.

    Times are microseconds since the earliest stamp of any program (the kernel's start as the
    kernel saw it). Records and waits cover the first `shown_programs` programs (None: all); the
    busy fractions and the span cover every program. Raises ValueError on an unwritten stamp.
    """
    if k_tiles < 1:
        raise ValueError(f"k_tiles must be at least 1, got {k_tiles}")
    if not stamps or len(stamps) % len(ROLE_NAMES):
        raise ValueError(f"stamps must hold {len(ROLE_NAMES)} rows per program, got {len(stamps)} rows")
    num_programs = len(stamps) // len(ROLE_NAMES)
    shown = num_programs if shown_programs is None else min(shown_programs, num_programs)
    phases = {}  # (program, role) -> phases
    for index, row in enumerate(stamps):
        program, role = divmod(index, len(ROLE_NAMES))
        phases[program, ROLE_NAMES[role]] = _row_phases(row, ROLE_NAMES[role], k_tiles)
        if UNWRITTEN in [row[0]] + [t for p in phases[program, ROLE_NAMES[role]] for t in p[2:4]]:
            raise ValueError(f"stamps: program {program} {ROLE_NAMES[role]} has a stamp that was never written "
                             f"(the kernel did not run to the end, or this is not its RECORD buffer)")
    start_ns = min(p[2] for rows in phases.values() for p in rows)
    end_ns = max(p[3] for rows in phases.values() for p in rows)

    def us(ns):
        return (ns - start_ns) / NS_PER_US

    records, waits = [], []
    for (program, role), rows in phases.items():
        if program >= shown:
            continue
        sm = stamps[program * len(ROLE_NAMES) + ROLE_NAMES.index(role)][0]
        for phase, k, start, end, is_wait in rows:
            label = phase if k is None else f"{phase} k={k}"
            (waits if is_wait else records).append(
                dict(role=f"CTA {program} {role}", start=us(start), end=us(end), label=label,
                     program=program, sm=sm, phase=phase, k=k))
    return dict(records=records, waits=waits, span_us=us(end_ns), num_programs=num_programs,
                shown_programs=shown, k_tiles=k_tiles, busy_fraction=_busy_fractions(phases),
                min_stamp_step_ns=_min_step(phases))


def _busy_fractions(phases: dict) -> dict:
    """Per role, over all programs: time in busy phases / time from the role's first to last stamp."""
    busy, alive = dict.fromkeys(ROLE_NAMES, 0), dict.fromkeys(ROLE_NAMES, 0)
    for (_, role), rows in phases.items():
        busy[role] += sum(end - start for _, _, start, end, is_wait in rows if not is_wait)
        alive[role] += rows[-1][3] - rows[0][2]
    return {role: busy[role] / alive[role] if alive[role] else 0.0 for role in ROLE_NAMES}


def _min_step(phases: dict) -> int | None:
    """The smallest positive difference between two stamps of one role: the timer's step, or more."""
    steps = []
    for rows in phases.values():
        times = sorted({t for p in rows for t in p[2:4]})
        steps += [later - earlier for earlier, later in zip(times, times[1:])]
    return min(steps, default=None)


def record(M: int = DEFAULT_PROBLEM["M"], N: int = DEFAULT_PROBLEM["N"], K: int = DEFAULT_PROBLEM["K"],
           shown_programs: int | None = DEFAULT_SHOWN_PROGRAMS, seed: int = 0, **cfg) -> dict:
    """Run tutorial 3 with RECORD on this GPU and return the timeline document (without `env`).

    The first launch compiles and warms up; the second, timed by CUDA events, is the one recorded
    (`wall_us`: the kernel's time on the GPU, launch overhead hidden behind a spin on the stream).
    Its result is checked against an fp32 torch matmul, so a timeline always comes from a correct run.
    """
    import torch
    import triton

    from jfa.specs import FWD_TOL
    from tutorials import hopper_tlx_available

    ready, why = hopper_tlx_available()
    if not ready:
        raise RuntimeError(f"the RECORD kernel runs on a Hopper GPU only: {why}")
    cfg = t03.DEFAULT_CONFIG | cfg
    torch.manual_seed(seed)
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    c = torch.empty(M, N, device="cuda", dtype=torch.float16)
    k_tiles = triton.cdiv(K, cfg["BLOCK_K"])
    programs = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    stamps = torch.empty(programs * len(ROLE_NAMES), t03.timeline_row_length(k_tiles), device="cuda",
                         dtype=torch.int64)
    t03.ws_gemm(a, b, out=c, timeline=stamps, **cfg)
    c.fill_(float("nan"))
    stamps.fill_(UNWRITTEN)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(LAUNCH_HIDING_SLEEP_CYCLES)
    begin.record()
    t03.ws_gemm(a, b, out=c, timeline=stamps, **cfg)
    end.record()
    torch.cuda.synchronize()
    torch.testing.assert_close(c.float(), a.float() @ b.float(), **FWD_TOL)
    doc = timeline_from_stamps(stamps.tolist(), k_tiles, shown_programs)
    return dict(kernel="tutorials.t03_ws_wgmma_gemm.ws_gemm_kernel", timer="%globaltimer", time_unit="us",
                problem=dict(M=M, N=N, K=K, dtype="float16"), config=cfg, wall_us=begin.elapsed_time(end) * 1e3,
                **doc)


def save(doc: dict, results_dir: str | Path = "results") -> Path:
    """Write `doc` with the environment block as results_dir/t03-timeline-<UTC date>.json; return the path."""
    from jfa.workbench.envinfo import environment

    env = environment()
    stamp = dt.datetime.fromisoformat(env["date"]).strftime("%Y%m%dT%H%M%SZ")
    path = Path(results_dir) / RESULTS_PATTERN.format(stamp=stamp)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc | {"env": env}, indent=1) + "\n")
    return path


def summary_text(doc: dict) -> str:
    """A few lines: the problem, the span against the wall time, each role's busy fraction."""
    problem = doc.get("problem", {})
    lines = [f"t03 timeline: {problem.get('M')}x{problem.get('K')} @ {problem.get('K')}x{problem.get('N')}, "
             f"{doc['num_programs']} CTAs x {doc['k_tiles']} k-steps, {doc['shown_programs']} CTAs kept as records",
             f"  stamps span {doc['span_us']:.1f} us" + (f" of {doc['wall_us']:.1f} us kernel time (CUDA events)"
                                                         if "wall_us" in doc else ""),
             f"  smallest step between two stamps: {doc['min_stamp_step_ns']} ns"]
    lines += [f"  {role:<10} busy {fraction:6.1%} of its lifetime" for role, fraction in doc["busy_fraction"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tutorials import hopper_tlx_available

    parser = argparse.ArgumentParser(prog="python -m tutorials.timeline",
                                     description="Record tutorial 3's role timeline on this GPU and save it as JSON.")
    parser.add_argument("--out", default="results", help="directory for t03-timeline-<date>.json")
    for dim, size in DEFAULT_PROBLEM.items():
        parser.add_argument(f"--{dim}", type=int, default=size)
    parser.add_argument("--programs", type=int, default=DEFAULT_SHOWN_PROGRAMS, help="CTAs kept as records")
    args = parser.parse_args(argv)
    ready, why = hopper_tlx_available()
    if not ready:
        print(f"no timeline recorded: {why}", file=sys.stderr)
        return 1
    doc = record(args.M, args.N, args.K, shown_programs=args.programs)
    print(summary_text(doc))
    print(f"wrote {save(doc, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
