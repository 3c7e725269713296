"""Panels for the notebooks: pure functions that compute tables and figures, thin ipywidgets wrappers.

Every panel is split in two so it works both in JupyterLab and when a notebook is executed headless
(nbval, nbconvert): a pure function turns parameters into a table or a figure (unit-tested, output
deterministic), and a wrapper shows ipywidgets controls whose changes re-render that function's
result in place. The wrapper always renders once with the default values, so a headless run still
stores a static table or figure in the notebook.

Sections: notebook setup; the environment; recorded results (what the notebooks show when no GPU is
present: real runs in the results directory the caller names first, labeled fixtures in its
`recorded/` next, else a plain "no recorded H200 run yet"; the package holds no results of its own); the K/V ring simulator and the shared-memory / register / tensor-memory
budget calculator (notebook 02); the panel wrapper; tutorial 2's sweep (02); benchmark rows and the
write-up summary (08); the tile-dealing picture and the GEM-like sweep (03); recompute-vs-store
arithmetic and the dQ strategies' recorded costs (04).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
from pathlib import Path
from typing import Callable

from jfa.specs import (MBARRIER_BYTES, REGISTERS_PER_SM, SETMAXNREG_MAX, SETMAXNREG_MIN, SETMAXNREG_STEP,
                       SHARED_BYTES_PER_BLOCK, TMEM_ALLOC_MIN_COLUMNS, TMEM_COLUMNS, TMEM_LANES, WARP_SIZE,
                       WARPGROUP_WARPS)

RECORDED_SUBDIR = "recorded"  # labeled fixtures, inside a results directory
NO_RECORDING = "no recorded H200 run yet"


# ==== notebook setup ============================================================================
def setup_notebook() -> None:
    """Render plotly figures as JSON mime bundles: JupyterLab draws them with its plotly extension,
    and the saved notebook carries only the figure's data, never the 4 MB plotly.js library."""
    import plotly.io as pio

    pio.renderers.default = "plotly_mimetype"
    pio.templates.default = "plotly_white"


# ==== the environment ===========================================================================
def live_gpu() -> bool:
    """True where the sm_90 TLX kernels can run here; elsewhere the notebooks show recorded runs."""
    from jfa.workbench.envinfo import gpu_status

    return gpu_status()[0]


ENV_KEYS = ("python", "torch", "cuda", "triton", "tlx", "fa4", "gpu", "sm", "driver", "commit")


def environment_markdown() -> str:
    """Versions, the GPU, and what runs live here versus what is shown from recorded runs."""
    from jfa.workbench.envinfo import environment, gpu_status, tlx_status

    env = environment()
    tlx_ok, tlx_why = tlx_status()
    gpu_ok, gpu_why = gpu_status()
    rows = [(key, env[key] if env[key] is not None else "-") for key in ENV_KEYS]
    rows += [
        ("TLX kernels compile here", "yes, for sm_90 and sm_100" if tlx_ok else f"no ({tlx_why})"),
        ("TLX kernels run here", f"yes, on {gpu_why}" if gpu_ok else f"no ({gpu_why})"),
        ("numbers shown", "measured live on this GPU" if gpu_ok
         else "kernels compiled here and inspected; speed and kernel checks from recorded H200 runs, labeled"),
    ]
    return "\n".join(["| | |", "|---|---|"] + [f"| {key} | {value} |" for key, value in rows])


# ==== recorded results ==========================================================================
def recordings_dir(results_dir: Path) -> Path:
    """Where a notebook writes new recordings: $JFA_RESULTS_DIR where set (the GPU host's output
    folder, whose files come back), else `results_dir`."""
    return Path(os.environ.get("JFA_RESULTS_DIR") or results_dir)


def save_recording(kind: str, payload: dict, directory: Path) -> Path:
    """Write `<directory>/<kind>-<UTC stamp>.json`: the payload next to the environment block that
    produced it, so a notebook run on the GPU host leaves a recording the CPU notebooks can show."""
    from jfa.workbench.envinfo import environment

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = directory / f"{kind}-{stamp}.json"
    path.write_text(json.dumps({"kind": kind, "env": environment(), **payload}, indent=1, default=str) + "\n")
    return path


@dataclasses.dataclass
class Recorded:
    """One results JSON: its path, its content, whether it is a small fixture (from `recorded/`), and
    the results directory it was found in."""

    path: Path
    doc: dict
    is_fixture: bool
    results_dir: Path

    @property
    def where(self) -> Path:
        """The file from its results directory's name on (results/bench-gem.json), as text cites it."""
        base = Path(self.results_dir).parent
        return self.path.relative_to(base) if self.path.is_relative_to(base) else self.path

    @property
    def env(self) -> dict:
        return self.doc.get("env", {})

    def provenance(self) -> str:
        """One line saying where the numbers come from, so no reader takes them for a live run."""
        env = self.env
        commit = (env.get("commit") or "?")[:12]
        kind = "recorded fixture" if self.is_fixture else "recorded run"
        source = f"; source: {self.doc['source']}" if self.doc.get("source") else ""
        return (f"{kind}: {env.get('gpu') or '?'}, torch {env.get('torch') or '?'}, triton {env.get('triton') or '?'},"
                f" commit {commit}, {env.get('date') or '?'} ({self.where}){source}")


def _date_key(path: Path, doc: dict) -> tuple[str, str]:
    return (str(doc.get("env", {}).get("date") or ""), path.name)


def _load_all(directory: Path, pattern: str, is_fixture: bool, results_dir: Path) -> list[Recorded]:
    found = []
    for path in sorted(directory.glob(pattern)):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a half-written or foreign file is not a recording
        if isinstance(doc, dict):
            found.append(Recorded(path, doc, is_fixture, results_dir))
    return found


def newest_recorded(pattern: str, results_dir: Path, recorded_dir: Path | None = None,
                    where: Callable[[dict], bool] | None = None) -> Recorded | None:
    """The newest real results file in `results_dir` matching `pattern` (a glob such as
    "bench-*.json"), else the newest fixture in `recorded_dir` (default: results_dir/recorded), else
    None. `where` filters on the JSON document.

    Real runs from the GPU host always win over fixtures; None means there is nothing recorded,
    and the caller must say so rather than show anything else."""
    results_dir = Path(results_dir)
    recorded_dir = results_dir / RECORDED_SUBDIR if recorded_dir is None else Path(recorded_dir)
    for directory, is_fixture in ((results_dir, False), (recorded_dir, True)):
        candidates = [r for r in _load_all(directory, pattern, is_fixture, results_dir)
                      if where is None or where(r.doc)]
        if candidates:
            return max(candidates, key=lambda r: _date_key(r.path, r.doc))
    return None


def newest_recorded_tests(name_contains: str, results_dir: Path,
                          pattern: str = "gpu-tests-*.json") -> Recorded | None:
    """The newest `pytest --results-json` recording (`pattern`) that holds tests whose node id
    contains `name_contains`: a later run of other tests only (a single suite) does not hide it."""
    return newest_recorded(pattern, results_dir,
                           where=lambda doc: any(name_contains in t.get("test", "") for t in doc.get("tests", [])))


def recorded_test_outcomes(rec: Recorded | None, name_contains: str) -> list[dict]:
    """The test entries of a `pytest --results-json` file whose node id contains `name_contains`."""
    if rec is None:
        return []
    return [t for t in rec.doc.get("tests", []) if name_contains in t.get("test", "")]


def recorded_tests_text(rec: Recorded | None, name_contains: str) -> str:
    """The recorded outcome of matching GPU tests, with provenance, or the plain NO_RECORDING line."""
    tests = recorded_test_outcomes(rec, name_contains)
    if not tests:
        return f"{NO_RECORDING} of tests matching {name_contains!r}"
    lines = [rec.provenance()]
    lines += [f"  {t['outcome']:<8} {t['test']} ({t.get('seconds', 0.0):.2f} s)" for t in tests]
    return "\n".join(lines)


# ==== the K/V ring simulator ====================================================================
@dataclasses.dataclass(frozen=True)
class RingStep:
    """One thing a role did: `action` on `tile` in ring `slot`, from tick `start` to tick `end`."""

    role: str  # "producer" or "consumer"
    action: str  # "load", "compute", or "wait" (blocked on a barrier)
    tile: int
    slot: int
    parity: int  # the phase parity the role waited for (before a load/compute: the wait that passed)
    start: int
    end: int
    barrier: str  # the barrier waited on, e.g. "empty[1]"


def ring_slot(i: int, depth: int) -> tuple[int, int]:
    """Tile i lives in slot i % depth and is in the ring's round (i // depth); the barriers of that
    round complete phase (i // depth) & 1, because an mbarrier's phase is one bit that flips on
    every completion."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1 ring slot, got {depth}")
    if i < 0:
        raise ValueError(f"tile index must be >= 0, got {i}")
    return i % depth, (i // depth) & 1


class _MBarrier:
    """An mbarrier reduced to what the ring needs: it completes a phase after `arrive_count` arrivals.

    `try_wait(parity)` passes when the phase of that parity is the one completed last, i.e. the
    current (in-progress) phase has the other parity. A fresh barrier is in phase 0, so a wait for
    parity 1 passes at once: that is how the producer's first pass over the empty slots does not block.
    """

    def __init__(self, arrive_count: int = 1):
        self.arrive_count = arrive_count
        self.pending = arrive_count
        self.completed_phases = 0

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.completed_phases += 1
            self.pending = self.arrive_count

    def try_wait(self, parity: int) -> bool:
        return (self.completed_phases & 1) != parity


def simulate_ring(n_tiles: int, depth: int, load_ticks: int = 2, compute_ticks: int = 3) -> list[RingStep]:
    """Run a producer and a consumer over a ring of `depth` slots for `n_tiles` tiles.

    The producer issues loads as TMA does: it waits on empty[slot] for parity phase ^ 1, starts the
    copy and moves on, one issue per tick; each load takes `load_ticks` and then arrives on
    full[slot] (TMA's byte count completing the barrier), so up to `depth` loads are in flight at
    once, one per free slot. The consumer waits on full[slot] for parity phase, computes for
    `compute_ticks`, then arrives on empty[slot]. Arrivals at a tick are seen by waits at the same
    tick. Returns every load, compute and stall, ordered by start tick.

    A tile then costs max(compute_ticks, (load_ticks + compute_ticks) / depth) ticks in the steady
    state: compute-bound, depth 2 already hides the loads; load-bound, each slot adds a load in
    flight until depth reaches (load_ticks + compute_ticks) / compute_ticks, where the consumer never
    waits again after the first tile and deeper rings only cost shared memory.
    """
    for name, value in (("n_tiles", n_tiles), ("depth", depth), ("load_ticks", load_ticks),
                        ("compute_ticks", compute_ticks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    full = [_MBarrier() for _ in range(depth)]
    empty = [_MBarrier() for _ in range(depth)]
    # The producer is free again one tick after an issue (the copy runs on its own); the consumer
    # after its compute. `flip` turns a tile's round parity into the parity the role waits for.
    roles = {
        "producer": dict(next_tile=0, free_at=0, waiting_since=None, barriers=empty, flip=1, after=full,
                         ticks=load_ticks, occupies=1, action="load", name="empty"),
        "consumer": dict(next_tile=0, free_at=0, waiting_since=None, barriers=full, flip=0, after=empty,
                         ticks=compute_ticks, occupies=compute_ticks, action="compute", name="full"),
    }
    arrivals: list[tuple[int, list, int]] = []  # (tick it lands, barriers, slot)
    steps: list[RingStep] = []
    tick = 0
    while any(r["next_tile"] < n_tiles for r in roles.values()):
        for landing in [a for a in arrivals if a[0] == tick]:
            landing[1][landing[2]].arrive()
            arrivals.remove(landing)
        for role_name, role in roles.items():
            i = role["next_tile"]
            if i >= n_tiles or role["free_at"] > tick:
                continue
            slot, phase = ring_slot(i, depth)
            parity = phase ^ role["flip"]
            barrier = f"{role['name']}[{slot}]"
            if not role["barriers"][slot].try_wait(parity):
                if role["waiting_since"] is None:
                    role["waiting_since"] = tick
                continue
            if role["waiting_since"] is not None:
                steps.append(RingStep(role_name, "wait", i, slot, parity, role["waiting_since"], tick, barrier))
                role["waiting_since"] = None
            steps.append(RingStep(role_name, role["action"], i, slot, parity, tick, tick + role["ticks"], barrier))
            arrivals.append((tick + role["ticks"], role["after"], slot))
            role["free_at"] = tick + role["occupies"]
            role["next_tile"] = i + 1
        tick += 1
    return sorted(steps, key=lambda s: (s.start, s.role != "producer"))


def loads_in_flight(steps: list[RingStep]) -> int:
    """The most loads in flight at one tick: what a deeper ring buys when loads are slow."""
    loads = [s for s in steps if s.action == "load"]
    return max((sum(1 for s in loads if s.start <= t < s.end) for t in {s.start for s in loads}), default=0)


def ring_trace_text(steps: list[RingStep]) -> str:
    """The simulation as a step-by-step table: who did what, in which slot, after waiting for which phase."""
    lines = [f"{'tick':>4}  {'role':<9}{'action':<9}{'tile':>4}{'slot':>5}  barrier wait"]
    for s in steps:
        if s.action == "wait":
            what = f"blocked on {s.barrier} until tick {s.end} (waiting for phase parity {s.parity})"
        else:
            what = f"{s.barrier} parity {s.parity} passed"
        lines.append(f"{s.start:>4}  {s.role:<9}{s.action:<9}{s.tile:>4}{s.slot:>5}  {what}")
    return "\n".join(lines)


def ring_summary(steps: list[RingStep]) -> dict:
    """Total ticks, and the ticks each role spent blocked: the number a deeper ring should shrink."""
    end = max((s.end for s in steps), default=0)
    stalled = {role: sum(s.end - s.start for s in steps if s.role == role and s.action == "wait")
               for role in ("producer", "consumer")}
    return {"ticks": end, "producer_stalled": stalled["producer"], "consumer_stalled": stalled["consumer"]}


ROLE_COLORS = {"load": "#4C78A8", "compute": "#F58518", "wait": "#BBBBBB"}


def ring_figure(steps: list[RingStep], title: str = "K/V ring: who works and who waits"):
    """A Gantt chart of the simulation: the producer's stalls and issues on top, each slot's load in
    flight on a row of its own (several overlap: TMA copies run side by side), the consumer below."""
    import plotly.graph_objects as go

    slots = sorted({s.slot for s in steps})
    rows = ["consumer"] + [f"load, slot {slot}" for slot in reversed(slots)] + ["producer"]  # bottom to top

    def row(s: RingStep) -> str:
        return f"load, slot {s.slot}" if s.action == "load" else s.role

    def _bar_label(s: RingStep) -> str:  # tile and phase parity; the slot where the row does not say it
        return {"load": f"t{s.tile} p{s.parity}", "compute": f"t{s.tile} s{s.slot} p{s.parity}"}.get(s.action, "")

    fig = go.Figure()
    for action, color in ROLE_COLORS.items():
        chosen = [s for s in steps if s.action == action]
        if not chosen:
            continue
        fig.add_trace(go.Bar(
            name=action, orientation="h", marker_color=color,
            y=[row(s) for s in chosen], x=[s.end - s.start for s in chosen], base=[s.start for s in chosen],
            text=[_bar_label(s) for s in chosen],
            textposition="inside", insidetextanchor="middle",
            hovertext=[f"tile {s.tile}, slot {s.slot}, {s.barrier} parity {s.parity}" for s in chosen]))
    issues = [s for s in steps if s.action == "load"]
    fig.add_trace(go.Scatter(
        name="issue", mode="markers", x=[s.start for s in issues], y=["producer"] * len(issues),
        marker=dict(symbol="triangle-right", size=10, color=ROLE_COLORS["load"]),
        hovertext=[f"issues tile {s.tile} into slot {s.slot}" for s in issues]))
    fig.update_layout(barmode="overlay", title=title, xaxis_title="tick", height=160 + 28 * len(rows),
                      yaxis=dict(categoryorder="array", categoryarray=rows),
                      margin=dict(l=100, r=20, t=50, b=40))
    return fig


# ==== the budget calculator =====================================================================
@dataclasses.dataclass
class AttentionConfig:
    """One forward-attention kernel configuration, as the budget calculator sees it.

    `block_m` query rows per CTA are split evenly among `consumer_groups` warpgroups (each holds
    block_m / consumer_groups rows: ping-pong on Hopper, two TMEM halves on Blackwell); K and V
    tiles of `block_n` rows sit in rings of `kv_stages` slots: one ring each, or with
    `shared_kv_ring` one ring whose slots take K and V tiles in turn (the Blackwell tutorials'
    layout). `producer_warps` issue the loads with `producer_registers` per thread; every consumer
    warpgroup gets `consumer_registers`.
    """

    arch: str = "sm_90"
    block_m: int = 128
    block_n: int = 128
    head_dim: int = 128
    kv_stages: int = 2
    shared_kv_ring: bool = False
    consumer_groups: int = 2
    producer_warps: int = WARPGROUP_WARPS
    producer_registers: int = 24
    consumer_registers: int = 240
    element_bytes: int = 2  # bf16 / fp16

    def validate(self) -> None:
        if self.arch not in SHARED_BYTES_PER_BLOCK:
            raise ValueError(f"arch must be one of {sorted(SHARED_BYTES_PER_BLOCK)}, got {self.arch!r}")
        for name in ("block_m", "block_n", "head_dim", "kv_stages", "consumer_groups", "producer_warps",
                     "element_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.block_m % self.consumer_groups:
            raise ValueError(f"block_m ({self.block_m}) must split evenly among consumer_groups "
                             f"({self.consumer_groups})")
        for name in ("producer_registers", "consumer_registers"):
            value = getattr(self, name)
            if not SETMAXNREG_MIN <= value <= SETMAXNREG_MAX or value % SETMAXNREG_STEP:
                raise ValueError(f"{name} must be a multiple of {SETMAXNREG_STEP} in "
                                 f"[{SETMAXNREG_MIN}, {SETMAXNREG_MAX}] (setmaxnreg's rule), got {value}")

    @property
    def rows_per_group(self) -> int:
        return self.block_m // self.consumer_groups


@dataclasses.dataclass(frozen=True)
class BudgetLine:
    resource: str
    used: int
    limit: int
    unit: str
    note: str

    @property
    def fits(self) -> bool:
        return self.used <= self.limit


def _tmem_allocation(columns: int) -> int:
    """TMEM is allocated in powers of two of at least 32 columns."""
    alloc = TMEM_ALLOC_MIN_COLUMNS
    while alloc < columns:
        alloc *= 2
    return alloc


def attention_budget(cfg: AttentionConfig) -> list[BudgetLine]:
    """Shared memory, registers and (sm_100) tensor memory that `cfg` needs, against the hardware limits.

    A first-order count: tiles, rings and barriers, not the compiler's scratch space; the
    compile-only inspection (`jfa.workbench.inspect`) gives the exact numbers for a real kernel.
    """
    cfg.validate()
    def tile(rows: int, cols: int) -> int:
        return rows * cols * cfg.element_bytes

    q_bytes = cfg.consumer_groups * tile(cfg.rows_per_group, cfg.head_dim)
    rings = 1 if cfg.shared_kv_ring else 2
    kv_bytes = rings * cfg.kv_stages * tile(cfg.block_n, cfg.head_dim)
    barriers = 2 * cfg.consumer_groups + 2 * rings * cfg.kv_stages  # Q full/empty; full/empty per ring slot
    smem = q_bytes + kv_bytes + barriers * MBARRIER_BYTES
    ring_words = "one shared K/V ring" if cfg.shared_kv_ring else "K and V rings"
    lines = [BudgetLine("shared memory", smem, SHARED_BYTES_PER_BLOCK[cfg.arch], "bytes",
                        f"Q {q_bytes:,} + {ring_words} {kv_bytes:,} ({cfg.kv_stages} stages)"
                        f" + {barriers} mbarriers")]

    group_threads = WARPGROUP_WARPS * WARP_SIZE
    producer_threads = cfg.producer_warps * WARP_SIZE
    registers = (cfg.producer_registers * producer_threads
                 + cfg.consumer_registers * group_threads * cfg.consumer_groups)
    lines.append(BudgetLine("registers per SM", registers, REGISTERS_PER_SM, "registers",
                            f"producer {producer_threads} thr x {cfg.producer_registers}"
                            f" + {cfg.consumer_groups} consumer WG x {group_threads} thr x {cfg.consumer_registers}"))

    s_fp32 = cfg.rows_per_group * cfg.block_n  # one S tile per consumer group, fp32
    o_fp32 = cfg.rows_per_group * cfg.head_dim
    if cfg.arch == "sm_90":
        # Hopper: wgmma accumulates in registers, spread over the warpgroup's 128 threads.
        p_regs = s_fp32 * cfg.element_bytes // 4  # P in bf16, two values packed per 32-bit register
        acc = (s_fp32 + o_fp32 + p_regs) // group_threads
        lines.append(BudgetLine("accumulator registers per consumer thread", acc, cfg.consumer_registers,
                                "registers", f"S {s_fp32 // group_threads} + O {o_fp32 // group_threads}"
                                f" + P {p_regs // group_threads} (fp32 accumulators live in registers)"))
    else:
        # Blackwell: tcgen05 accumulates in tensor memory; 128 lanes hold 128 rows of each tile.
        lanes_used = max(cfg.rows_per_group, TMEM_LANES)
        columns = cfg.consumer_groups * (cfg.block_n + cfg.head_dim) * lanes_used // TMEM_LANES
        lines.append(BudgetLine("tensor memory columns", _tmem_allocation(columns), TMEM_COLUMNS, "columns",
                                f"{cfg.consumer_groups} x (S {cfg.block_n} + O {cfg.head_dim}) = {columns},"
                                f" P aliases S in bf16; allocated as a power of two >= {TMEM_ALLOC_MIN_COLUMNS}"))
    return lines


def budget_text(lines: list[BudgetLine]) -> str:
    """The budget as a fixed-width table with a verdict per resource."""
    out = [f"{'resource':<42}{'used':>10}{'limit':>10}  {'':<8}note"]
    for b in lines:
        verdict = "fits" if b.fits else "OVER"
        out.append(f"{b.resource:<42}{b.used:>10,}{b.limit:>10,}  {verdict:<8}{b.note}")
    return "\n".join(out)


# ==== the panel wrapper =========================================================================
def mime_bundle(obj) -> tuple[dict, dict]:
    """(data, metadata) of `obj` as IPython would display it, without letting it display itself.

    A plotly figure (and anything else with an `_ipython_display_`) shows itself through a new
    output of its own: from a widget's callback that output has no cell to go to and JupyterLab puts
    it in the Log Console. Its mime bundle, published under the panel's display id, replaces the
    panel's output instead."""
    if hasattr(obj, "_repr_mimebundle_"):
        bundle = obj._repr_mimebundle_()
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        return dict(data), dict(metadata or {})
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:  # plain Python (a test): the text is all there is
        return {"text/plain": repr(obj)}, {}
    data, metadata = shell.display_formatter.format(obj)
    return data or {"text/plain": repr(obj)}, metadata


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _placeholder(data: dict) -> dict:
    """A blank of the figure's height (text/html), or an empty line: what a panel's output shows for
    the moment between two renders."""
    height = (data.get(PLOTLY_MIME) or {}).get("layout", {}).get("height")
    if height:
        return {"text/html": f'<div style="height: {int(height)}px"></div>', "text/plain": ""}
    return {"text/plain": ""}


def panel(controls: dict, render: Callable[..., object]) -> Callable[[], object]:
    """Show `controls` (name -> ipywidget) and `render(**values)` below them, re-rendered in place.

    The first render is one output with a display id, so a headless execution stores it as a static
    output; each change of a control replaces that same output with the new render. A figure goes
    out as its mime bundle (`mime_bundle`): displaying itself, it would land in a new output (the Log
    Console, from a widget's callback). JupyterLab keeps an output's renderer while the output's
    mime type stays the same, and plotly's renderer draws once and ignores later data; so a rich
    render replaces first a blank of its height, then the blank, and each figure gets a renderer
    of its own. Returns a function that re-renders with the controls' current values (what a test
    can call), its `controls` the controls by name."""
    import ipywidgets
    from IPython.display import DisplayHandle, display

    def values() -> dict:
        return {name: widget.value for name, widget in controls.items()}

    display(ipywidgets.HBox(list(controls.values()), layout=ipywidgets.Layout(flex_flow="row wrap")))
    handle = DisplayHandle()
    data, metadata = mime_bundle(render(**values()))
    handle.display(data, metadata=metadata, raw=True)

    def refresh(_change=None):
        result = render(**values())
        data, metadata = mime_bundle(result)
        if set(data) - {"text/plain"}:
            handle.update(_placeholder(data), raw=True)
        handle.update(data, metadata=metadata, raw=True)
        return result

    for widget in controls.values():
        widget.observe(refresh, names="value")
    refresh.controls = controls
    return refresh


class Text:
    """Plain text shown as-is (a pre block in JupyterLab; text/plain when executed headless)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.text}


def ring_panel(n_tiles: int = 8, depth: int = 2, load_ticks: int = 4, compute_ticks: int = 2):
    """Ring depth and the load/compute ticks as sliders; the Gantt chart and stall counts below.

    It opens on loads slower than compute, where one more slot is one more load in flight."""
    import ipywidgets

    controls = {
        "depth": ipywidgets.IntSlider(value=depth, min=1, max=6, description="ring depth"),
        "load_ticks": ipywidgets.IntSlider(value=load_ticks, min=1, max=6, description="load ticks"),
        "compute_ticks": ipywidgets.IntSlider(value=compute_ticks, min=1, max=6, description="compute ticks"),
    }

    def render(depth, load_ticks, compute_ticks):
        steps = simulate_ring(n_tiles, depth, load_ticks, compute_ticks)
        summary = ring_summary(steps)
        return ring_figure(steps, title=f"depth {depth}: {summary['ticks']} ticks, consumer stalled "
                                        f"{summary['consumer_stalled']}, producer stalled {summary['producer_stalled']}")
    return panel(controls, render)


def budget_panel(**defaults):
    """The budget calculator with one control per AttentionConfig field; the table below."""
    import ipywidgets

    cfg = AttentionConfig(**defaults)
    controls = {
        "arch": ipywidgets.Dropdown(options=sorted(SHARED_BYTES_PER_BLOCK), value=cfg.arch, description="arch"),
        "block_m": ipywidgets.Dropdown(options=[64, 128, 256], value=cfg.block_m, description="BLOCK_M"),
        "block_n": ipywidgets.Dropdown(options=[32, 64, 128, 256], value=cfg.block_n, description="BLOCK_N"),
        "head_dim": ipywidgets.Dropdown(options=[64, 128, 256], value=cfg.head_dim, description="head_dim"),
        "kv_stages": ipywidgets.IntSlider(value=cfg.kv_stages, min=1, max=6, description="K/V stages"),
        "shared_kv_ring": ipywidgets.Checkbox(value=cfg.shared_kv_ring, description="one shared K/V ring"),
        "consumer_groups": ipywidgets.IntSlider(value=cfg.consumer_groups, min=1, max=3, description="consumer WGs"),
        "consumer_registers": ipywidgets.IntSlider(value=cfg.consumer_registers, min=SETMAXNREG_MIN,
                                                   max=SETMAXNREG_MAX, step=SETMAXNREG_STEP,
                                                   description="consumer regs"),
        "producer_registers": ipywidgets.IntSlider(value=cfg.producer_registers, min=SETMAXNREG_MIN,
                                                   max=SETMAXNREG_MAX, step=SETMAXNREG_STEP,
                                                   description="producer regs"),
    }

    def render(**values):
        try:
            return Text(budget_text(attention_budget(dataclasses.replace(cfg, **values))))
        except ValueError as exc:  # an impossible combination is shown, not raised, in a live panel
            return Text(f"not a valid configuration: {exc}")
    return panel(controls, render)


# ==== tutorial 2's ring on the GPU: depth x tile-size sweep =====================================
T02_SWEEP_KIND = "t02-ring-sweep"
T02_SWEEP_SHAPE = (8192, 32768)  # 512 MiB of fp16: far beyond L2, so every tile comes from HBM
T02_BLOCK_NS = (64, 128, 256)


def measure_t02_sweep(block_ns=T02_BLOCK_NS, depths=None, block_m: int = 64) -> list[dict]:
    """Time tutorial 2's row-sum kernel (GPU only) at every ring depth and tile width; TB/s read."""
    import torch
    import triton

    from tutorials import t02_pipelined_ring as t02

    depths = t02.BENCH_DEPTHS if depths is None else depths
    n_rows, n_cols = T02_SWEEP_SHAPE
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.float16)
    rows = []
    for block_n in block_ns:
        for depth in depths:
            ms = triton.testing.do_bench(lambda: t02.row_sums(x, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=depth))
            rows.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=depth, ms=ms,
                             tbps=x.numel() * x.element_size() / (ms * 1e-3) / 1e12))
    return rows


def t02_sweep_figure(rows: list[dict], title: str):
    """Read bandwidth against ring depth, one line per tile width, with the H200 copy ceiling."""
    import plotly.graph_objects as go

    from jfa.specs import H200_COPY_TBPS

    fig = go.Figure()
    for block_n in sorted({r["BLOCK_N"] for r in rows}):
        chosen = sorted((r for r in rows if r["BLOCK_N"] == block_n), key=lambda r: r["NUM_STAGES"])
        fig.add_trace(go.Scatter(x=[r["NUM_STAGES"] for r in chosen], y=[r["tbps"] for r in chosen],
                                 mode="lines+markers", name=f"BLOCK_N={block_n}"))
    fig.add_hline(y=H200_COPY_TBPS, line_dash="dot", annotation_text="H200 copy (read+write)")
    fig.update_layout(title=title, xaxis_title="ring depth (NUM_STAGES)", yaxis_title="TB/s read",
                      height=320, margin=dict(l=60, r=20, t=50, b=40))
    return fig


def t02_sweep_panel(results_dir: Path):
    """Pick tile widths; the plot shows live timings on a Hopper GPU (recorded into
    `recordings_dir(results_dir)`), else the newest sweep recorded in `results_dir`."""
    import ipywidgets

    if live_gpu():
        rows, source = measure_t02_sweep(), "measured live"
        save_recording(T02_SWEEP_KIND, {"rows": rows}, recordings_dir(results_dir))
    else:
        rec = newest_recorded(f"{T02_SWEEP_KIND}-*.json", results_dir)
        if rec is None:
            print(f"{NO_RECORDING} of the tutorial 2 ring sweep (run this notebook on the GPU host to record one)")
            return None
        rows, source = rec.doc["rows"], rec.provenance()
    print(source)
    controls = {"block_ns": ipywidgets.SelectMultiple(options=sorted({r["BLOCK_N"] for r in rows}),
                                                      value=tuple(sorted({r["BLOCK_N"] for r in rows})),
                                                      description="BLOCK_N")}

    def render(block_ns):
        return t02_sweep_figure([r for r in rows if r["BLOCK_N"] in block_ns], "tutorial 2: ring depth vs bandwidth")
    return panel(controls, render)


# ==== benchmark results (jfa.workbench.bench rows) ==============================================
BENCH_PATTERN = "bench-*.json"


def newest_bench(suite: str, results_dir: Path) -> Recorded | None:
    """The newest benchmark file in `results_dir` holding successful rows of `suite` (real runs before
    fixtures)."""
    return newest_recorded(BENCH_PATTERN, results_dir, where=lambda doc: any(
        r.get("suite") == suite and r.get("ok") for r in doc.get("rows", [])))


def measured_providers(rows: list[dict], suite: str, pass_: str) -> list[str]:
    from jfa.specs import BENCH_PROVIDERS

    present = {r["provider"] for r in rows if r.get("ok") and r["suite"] == suite and r["pass"] == pass_}
    return [p for p in BENCH_PROVIDERS if p in present] + sorted(present - set(BENCH_PROVIDERS))


def results_table_markdown(rows: list[dict], suite: str, pass_: str, providers: list[str]) -> str:
    """TFLOP/s per case (rows) and provider (columns); '-' where a provider has no successful row."""
    picked = {(r["case"], r["provider"]): r for r in rows
              if r.get("ok") and r["suite"] == suite and r["pass"] == pass_ and r["provider"] in providers}
    cases = list(dict.fromkeys(case for case, _ in picked))
    lines = ["| case | " + " | ".join(providers) + " |", "|---|" + "---:|" * len(providers)]
    for case in cases:
        cells = [f"{picked[(case, p)]['tflops']:.0f}" if (case, p) in picked else "-" for p in providers]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def experiment_summary_markdown(rec: Recorded | None, suite: str, pass_: str, providers: list[str],
                                title: str = "Experiment") -> str:
    """A write-up skeleton: provenance, the environment block, the TFLOP/s table, what is missing."""
    if rec is None:
        return f"## {title}\n\n{NO_RECORDING} of suite `{suite}`."
    rows = rec.doc.get("rows", [])
    have = measured_providers(rows, suite, pass_)
    missing = [p for p in providers if p not in have]
    failed = [r for r in rows if not r.get("ok") and r["suite"] == suite and r["pass"] == pass_]
    env_rows = [f"| {key} | {rec.env.get(key) if rec.env.get(key) is not None else '-'} |"
                for key in ENV_KEYS + ("date",) if key in rec.env]
    parts = [f"## {title}: suite `{suite}`, {pass_}", "", f"Source: {rec.provenance()}", "",
             "| environment | |", "|---|---|", *env_rows, "",
             f"TFLOP/s ({pass_}; FLOPs as `jfa.specs.attention_flops` counts them):", "",
             results_table_markdown(rows, suite, pass_, [p for p in providers if p in have] or have)]
    if missing:
        parts += ["", "Not in this recording: " + ", ".join(f"`{p}`" for p in missing) + f" ({NO_RECORDING})."]
    if failed:
        parts += ["", f"{len(failed)} failed rows: " + "; ".join(
            f"{r['case']} {r['provider']}: {(r.get('error') or '?')[:80]}" for r in failed[:5])]
    return "\n".join(parts)


def bench_panel(rec: Recorded, suite: str):
    """Pass and providers as controls; the TFLOP/s bars of the recorded suite below."""
    import ipywidgets

    from jfa.workbench.plots import tflops_bar

    rows = rec.doc.get("rows", [])
    passes = [p for p in ("fwd", "bwd", "fwd+bwd") if measured_providers(rows, suite, p)]
    controls = {
        "pass_": ipywidgets.Dropdown(options=passes, value=passes[0], description="pass"),
        "providers": ipywidgets.SelectMultiple(options=measured_providers(rows, suite, passes[0]),
                                               value=tuple(measured_providers(rows, suite, passes[0])),
                                               description="providers"),
    }

    def render(pass_, providers):
        chosen = [r for r in rows if r["provider"] in providers]
        return tflops_bar(chosen, suite=suite, pass_=pass_, title=f"{suite}: {pass_} TFLOP/s ({rec.path.name})")
    return panel(controls, render)


# ==== notebook 03: the tile scheduler and the GEM-like sweep ====================================
def deal_tiles(work: list[int], n_programs: int, zigzag: bool = False) -> list[list[int]]:
    """Deal tiles to persistent programs as the forward kernel does: program p takes tiles p, p + P,
    p + 2P... or, with `zigzag` (its order when every sequence is one query block,
    `common.zigzag_tile`), turn by turn the next P tiles go to programs 0..P-1 on even turns and
    P-1..0 on odd ones.

    `work` is each tile's cost (KV tiles it visits) in list order; returns each program's costs."""
    if n_programs < 1:
        raise ValueError(f"n_programs must be >= 1, got {n_programs}")
    dealt = [[] for _ in range(n_programs)]
    for tile, cost in enumerate(work):
        turn, offset = divmod(tile, n_programs)
        dealt[n_programs - 1 - offset if zigzag and turn % 2 else offset].append(cost)
    return dealt


SUBPLOT_TITLE_SIZE = 13


def schedule_figure(dealt: dict[str, list[list[int]]]):
    """One panel per ordering: stacked bars of the work each program drew; the tallest bar is the time."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    # Two short lines per title: one line of three names is wider than its column at notebook widths.
    fig = make_subplots(rows=1, cols=len(dealt), shared_yaxes=True,
                        subplot_titles=[f"{name}<br>longest program {max(map(sum, per))}" for name, per in dealt.items()])
    fig.update_annotations(font_size=SUBPLOT_TITLE_SIZE)
    for col, per_program in enumerate(dealt.values(), start=1):
        depth = max(map(len, per_program))
        for k in range(depth):  # k-th tile drawn by every program, stacked
            fig.add_trace(go.Bar(x=list(range(len(per_program))),
                                 y=[tiles[k] if k < len(tiles) else 0 for tiles in per_program],
                                 showlegend=False, marker_line_width=0.5, marker_line_color="white"), row=1, col=col)
    fig.update_layout(barmode="stack", height=340, margin=dict(l=50, r=20, t=70, b=40),
                      yaxis_title="KV tiles visited")
    fig.update_xaxes(title_text="program (SM)")
    return fig


def measure_jfa_fwd(batch: int, max_len: int, sparsity: float, heads: int, head_dim: int, seed: int = 0) -> dict:
    """Time jfa.jagged_attention forward (GPU) on GEM-like bf16 self-attention; one bench-style row."""
    import torch
    import triton

    from jfa import specs
    from jfa.jagged import gem_lengths, lengths_to_offsets
    from jfa.ops import jagged_attention

    lengths = gem_lengths(batch, max_len, sparsity, seed)
    offsets = lengths_to_offsets(lengths, device="cuda")
    rows = int(lengths.sum())
    q, k, v = (torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = triton.testing.do_bench(lambda: jagged_attention(q, k, v, offsets, offsets, max_len, max_len))
    flops = specs.attention_flops(lengths.tolist(), lengths.tolist(), heads, head_dim)
    return {"suite": "live", "case": f"B={batch},L={max_len},s={sparsity},H={heads},D={head_dim}",
            "provider": "jfa", "pass": "fwd", "ms": ms, "tflops": specs.tflops(flops, ms), "ok": True}


def gem_sweep_panel(results_dir: Path):
    """L and s (and B, H, D where a live GPU can measure them) as controls; TFLOP/s of every provider
    (the peers from the newest gem benchmark in `results_dir`)."""
    import ipywidgets

    from jfa.specs import BENCH_SUITES, GEM_BATCH, GEM_HEAD_DIM, GEM_HEADS
    from jfa.workbench.plots import tflops_bar

    cases = BENCH_SUITES["gem"]
    live = live_gpu()
    rec = newest_bench("gem", results_dir)
    print(("jfa measured live on this GPU; peers from: " if live else "recorded, not live: ")
          + (rec.provenance() if rec else NO_RECORDING))
    if rec is None and not live:
        return None
    rows = rec.doc["rows"] if rec else []
    controls = {
        "max_len": ipywidgets.Dropdown(options=sorted({c["max_len"] for c in cases}), value=1024, description="L"),
        "sparsity": ipywidgets.Dropdown(options=sorted({c["sparsity"] for c in cases}), value=0.5, description="s"),
        "batch": ipywidgets.Dropdown(options=[GEM_BATCH] + ([64, 256] if live else []), value=GEM_BATCH,
                                     description="B"),
        "heads": ipywidgets.Dropdown(options=[GEM_HEADS] + ([8] if live else []), value=GEM_HEADS, description="H"),
        "head_dim": ipywidgets.Dropdown(options=[GEM_HEAD_DIM] + ([64] if live else []), value=GEM_HEAD_DIM,
                                        description="D"),
        "pass_": ipywidgets.Dropdown(options=["fwd", "bwd"], value="fwd", description="pass"),
    }

    def render(max_len, sparsity, batch, heads, head_dim, pass_):
        case = f"L={max_len},s={sparsity}"
        standard = (batch, heads, head_dim) == (GEM_BATCH, GEM_HEADS, GEM_HEAD_DIM)
        chosen = [r for r in rows if r["suite"] == "gem" and r["case"] == case] if standard else []
        if live and pass_ == "fwd":
            chosen.append(dict(measure_jfa_fwd(batch, max_len, sparsity, heads, head_dim), suite="gem", case=case))
        if not chosen:
            return Text(f"{NO_RECORDING} of B={batch}, {case}, H={heads}, D={head_dim}, {pass_}")
        return tflops_bar(chosen, suite="gem", pass_=pass_,
                          title=f"B={batch} H={heads} D={head_dim} {case}: {pass_} TFLOP/s")
    return panel(controls, render)


# ==== notebook 04: the backward =================================================================
FLOPS_PER_MULTIPLY_ADD = 2


def recompute_vs_store(q_lens, kv_lens, heads: int, head_dim: int, *, p_element_bytes: int,
                       lse_element_bytes: int) -> dict:
    """What keeping P for the backward would cost, against what the backward keeps instead (the LSE).

    Storing P means writing `heads * sum(lq * lk)` probabilities in the forward and reading them
    back in the backward, at best at the copy bandwidth; recomputing it costs one QK^T GEMM
    (2 * head_dim FLOPs per visible pair and head), at best at the GEMM peak. Both floors use the
    H200 ceilings of `jfa.specs`, so the comparison is of lower bounds, like for like.
    """
    from jfa.specs import H200_BF16_GEMM_TFLOPS, H200_COPY_TBPS, attention_pairs

    for name, value in (("heads", heads), ("head_dim", head_dim), ("p_element_bytes", p_element_bytes),
                        ("lse_element_bytes", lse_element_bytes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    pairs = attention_pairs(q_lens, kv_lens)
    rows = sum(int(n) for n in q_lens)
    p_bytes = pairs * heads * p_element_bytes
    lse_bytes = rows * heads * lse_element_bytes
    recompute_flops = FLOPS_PER_MULTIPLY_ADD * head_dim * pairs * heads
    return dict(rows=rows, pairs=pairs, p_bytes=p_bytes, lse_bytes=lse_bytes,
                p_over_lse=p_bytes / lse_bytes if lse_bytes else float("nan"),
                store_ms=2 * p_bytes / (H200_COPY_TBPS * 1e12) * 1e3,  # written once, read once
                recompute_ms=recompute_flops / (H200_BF16_GEMM_TFLOPS * 1e12) * 1e3)


def recording_line(rec: Recorded) -> str:
    """Every environment fact of a recording, untruncated (its commit may carry a note)."""
    facts = ", ".join(f"{key} {value}" for key, value in rec.env.items() if value is not None)
    source = f"; source: {rec.doc['source']}" if rec.doc.get("source") else ""
    return f"recorded run ({rec.where}): {facts}{source}"
