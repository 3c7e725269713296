"""The notebooks' toolkit: read the real code, check a kernel or a fork, measure it, write it up.

One call does one thing and returns an object that shows itself in a notebook cell (HTML tables,
syntax-highlighted code, plotly figures) and as text elsewhere:

| call | what it does |
|---|---|
| `setup(results)` | notebook setup: plotly renders as data, the results directory to show recordings from |
| `machine()` | whether the TLX kernels run here, and why not, in one line |
| `show(obj)` | the package's own source of a function, kernel, class or variant, with its file and lines |
| `compile_kernels(target)` | the kernels a call runs, compiled for sm_90: roles, registers, spills, shared memory |
| `check(target)` | the kernel against its fp32 reference on fresh random inputs, forward and backward |
| `benchmark(variant)` | TFLOP/s of the unforked kernel, a fork and the peers over a few GEM-like shapes |
| `sweep()` | a panel sweeping shapes and options: live check and TFLOP/s on a GPU, recordings elsewhere |
| `try_fork(variant)` | a fork's compile report, its correctness and its speed, in one report |
| `write_up(path, ...)` | a self-contained HTML page of a variant: code, check, benchmark, environment |

Nothing here pretends: on a machine where the kernels cannot run (no Hopper GPU, no TLX), a check
says so in one line, compiles the kernels for sm_90 to show what they ask of the machine, and shows
the recorded GPU runs under a label that names the GPU and the date. It never compares the PyTorch
reference with itself and calls that a check. The recordings come from the results directory the
caller passes (or names once in `setup`): the newest gpu-tests recording for test outcomes and the
newest head-to-head (or benchmark) recording for speed.
"""
from __future__ import annotations

import dataclasses
import html
import inspect as pyinspect
import json
import math
import re
from pathlib import Path
from typing import Callable, Iterable

import torch

from jfa import specs

__all__ = ["setup", "machine", "Machine", "show", "Source", "Case", "compile_kernels", "CompileReport", "check",
           "CheckReport", "TensorCheck", "benchmark", "Benchmark", "sweep", "Sweep", "try_fork", "ForkReport",
           "write_up", "WriteUp", "HEADS", "CHECK_LENGTHS"]

HEADS = 4  # query heads of every default shape here (the GEM suite's), so per-head params have this size
HEAD_DIM = 128
CHECK_LENGTHS = (0, 1, 63, 64, 65, 129, 300, 777)  # edges of the 64- and 128-row tiles, and a few tiles
BROADCAST_Q_LEN = 100  # the shared query of a broadcast-Q check: not a multiple of a tile
CHECK_DENSITY = 0.5  # block-sparse checks select this fraction of the key blocks
TARGET_ARCH = "sm_90"
PEERS = ("fa4", "fa2")
GEM = dict(batch=specs.GEM_BATCH, heads=specs.GEM_HEADS, head_dim=specs.GEM_HEAD_DIM)
SWEEP_BATCH_CHOICES = (64, 256, specs.GEM_BATCH)
SWEEP_LENGTHS = (256, 512, 1024, 2048, 4096)
SWEEP_CHECK_BATCH = 8  # sequences of each live sweep point's check (its timing uses the full batch)
H2H_PATTERN = "h2h-*.json"
GPU_TESTS_PATTERN = "gpu-tests-*.json"
HEAD_TO_HEAD_KIND = "head-to-head"
# The gpu-marked test modules that check each entry point's kernels (their recorded outcomes are shown).
TEST_MODULES = {"jagged": ("tests/gpu/test_jagged_fwd.py", "tests/gpu/test_jagged_bwd.py"),
                "variant": ("tests/gpu/test_variants.py", "tests/gpu/test_exercises.py"),
                "block": ("tests/gpu/test_block_attn.py",),
                "block_sparse": ("tests/gpu/test_block_sparse.py",),
                "fp8": ("tests/gpu/test_fp8.py",)}
BENCH_SUITE = {"block": "block", "block_sparse": "block_sparse", "fp8": "fp8"}  # kinds the head-to-head lacks
SKIP_COUNT_LENGTH = 2048  # the sequence over which a block mask's skipped key tiles are counted
BLOCK_MASK_CHECKS = ((64, 64), (64, 128), (128, 64), (128, 128))  # the kernels' row and key tile sizes
BLOCK_MASK_CHECK_LENGTH = 700  # queries and keys of the sequence a block mask is checked over

LIVE_DEVICE = "cuda"  # where live checks and timings run (tests run the plumbing on the CPU through it)

_state = {"results": None}


# ==== showing things ===============================================================================
def _esc(text) -> str:
    return html.escape(str(text))


def _table_html(header: Iterable, rows: Iterable[Iterable], *, align_right_from: int = 1) -> str:
    """A small HTML table with inline styles (they survive a saved notebook and a write-up)."""
    cell = "padding:2px 10px;border-bottom:1px solid #ddd;"
    head = "".join(f'<th style="{cell}text-align:{"right" if i >= align_right_from else "left"}">{_esc(h)}</th>'
                   for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(
        f'<td style="{cell}text-align:{"right" if i >= align_right_from else "left"}">{c}</td>'
        for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f'<table style="border-collapse:collapse;font-size:13px"><tr>{head}</tr>{body}</table>'


def _table_text(header: list, rows: list[list]) -> str:
    cells = [[str(h) for h in header]] + [[html.unescape(re.sub("<[^>]+>", "", str(c))) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def _verdict_html(ok: bool | None, text: str) -> str:
    color = {True: "#1a7f37", False: "#cf222e", None: "#6e7781"}[ok]
    return f'<span style="color:{color};font-weight:bold">{_esc(text)}</span>'


@dataclasses.dataclass
class Section:
    """One part of a report: a title, its HTML and text, and the figures that follow it."""

    title: str
    html: str
    text: str
    figures: list = dataclasses.field(default_factory=list)


def figure_bundle(fig) -> dict:
    """A plotly figure as a display bundle (its JSON mime type and a text line), built here so the
    figure never displays itself: it lands where the caller puts the bundle (a cell, a panel)."""
    title = fig.layout.title.text if fig.layout.title and fig.layout.title.text else "figure"
    return {"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "text/plain": f"<plotly figure: {title}>"}


class Report:
    """What every result of this module shares: sections shown as HTML (`_repr_html_`), as text
    (`repr`), and in a notebook cell as HTML followed by its figures (`_ipython_display_`)."""

    def sections(self) -> list[Section]:
        raise NotImplementedError

    def headline(self) -> str:
        """One line: what this is and its verdict."""
        raise NotImplementedError

    def figures(self) -> list:
        return [fig for s in self.sections() for fig in s.figures]

    def html(self, *, figures: bool = False, headline: bool = True) -> str:
        """The report as an HTML fragment; with `figures`, plotly figures as divs that need plotly.js
        on the page (the write-up inlines it); without `headline`, for a page that shows it as a heading."""
        parts = [f'<div style="font-weight:bold;margin:4px 0">{_esc(self.headline())}</div>'] if headline else []
        for s in self.sections():
            if s.title:
                parts.append(f'<div style="font-weight:bold;margin:8px 0 2px">{_esc(s.title)}</div>')
            parts.append(s.html)
            if figures:
                parts += [_figure_div(fig) for fig in s.figures]
        return "<div>" + "\n".join(parts) + "</div>"

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        parts = [self.headline()]
        for s in self.sections():
            parts.append((f"\n{s.title}\n" if s.title else "\n") + s.text)
        return "\n".join(parts)

    def bundles(self) -> list[dict]:
        """Display bundles in order: each section's HTML (with its text) and then its figures."""
        out = [{"text/html": f'<div style="font-weight:bold;margin:4px 0">{_esc(self.headline())}</div>',
                "text/plain": self.headline()}]
        for s in self.sections():
            title = f'<div style="font-weight:bold;margin:8px 0 2px">{_esc(s.title)}</div>' if s.title else ""
            out.append({"text/html": title + s.html, "text/plain": (f"{s.title}\n" if s.title else "") + s.text})
            out += [figure_bundle(fig) for fig in s.figures]
        return out

    def _ipython_display_(self):
        from IPython.display import display

        if not self.figures():  # one output: the whole report
            display({"text/html": self.html(), "text/plain": repr(self)}, raw=True)
            return
        for bundle in self.bundles():
            display(bundle, raw=True)


def _figure_div(fig) -> str:
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False)


# ==== setup and the machine ============================================================================
def setup(results=None) -> "Machine":
    """Set up a notebook: plotly figures render as data (JupyterLab draws them; a saved notebook holds
    no plotly.js), and `results` (the checkout's results directory) is where recordings are shown
    from when a call names none. Returns `machine()`, which a cell shows as one line."""
    import plotly.io as pio

    pio.renderers.default = "plotly_mimetype"
    pio.templates.default = "plotly_white"
    _state["results"] = None if results is None else Path(results)
    return machine()


def _results_dir(results) -> Path | None:
    return Path(results) if results is not None else _state["results"]


@dataclasses.dataclass(frozen=True)
class Machine:
    """Whether the sm_90 TLX kernels run here (`runs`), the GPU or the reason they do not (`why`),
    and whether TLX compiles here (`compiles`: compile-only views need no GPU)."""

    runs: bool
    why: str
    compiles: bool

    @property
    def line(self) -> str:
        if self.runs:
            return f"TLX kernels run here: {self.why}; checks and timings below are live."
        compile_note = ("they compile for sm_90 here, so the cells show the compiled kernels and the recorded "
                        "GPU runs" if self.compiles else "TLX does not import here either, so only recorded runs show")
        return f"TLX kernels do not run here ({self.why}): {compile_note}."

    def __repr__(self) -> str:
        return self.line

    def _repr_html_(self) -> str:
        return f"<div>{_verdict_html(self.runs, 'live' if self.runs else 'not live')} {_esc(self.line)}</div>"


def machine() -> Machine:
    """Whether the TLX kernels run on this machine (a Hopper GPU with TLX), and why not."""
    from jfa.workbench.envinfo import gpu_status, tlx_status

    runs, why = gpu_status()
    if runs:
        major, minor = torch.cuda.get_device_capability()
        why = f"{why} (sm_{major}{minor})"
    return Machine(runs=runs, why=why, compiles=tlx_status()[0])


def _live(live: bool | None) -> bool:
    return machine().runs if live is None else bool(live)


# ==== show: the package's own source ===================================================================
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the jfa package


@dataclasses.dataclass
class Listing:
    """One block of source: where it is (module, file, lines) and the code."""

    name: str
    path: str
    first: int
    code: str

    @property
    def last(self) -> int:
        return self.first + self.code.count("\n") - (1 if self.code.endswith("\n") else 0)

    @property
    def title(self) -> str:
        return f"{self.name}  ({self.path}:{self.first}-{self.last})"


class Source(Report):
    """Source code shown with its module path and line range (`show`); `.code` is the text."""

    def __init__(self, listings: list[Listing], title: str | None = None):
        self.listings = listings
        self.title = title

    @property
    def code(self) -> str:
        return "\n".join(listing.code for listing in self.listings)

    def headline(self) -> str:
        return self.title or self.listings[0].title

    def sections(self) -> list[Section]:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        out = []
        for listing in self.listings:
            formatter = HtmlFormatter(noclasses=True, linenos="inline", linenostart=listing.first, style="default",
                                      cssstyles="font-size:12px;line-height:1.3;padding:4px")
            numbered = "\n".join(f"{listing.first + i:5d}  {line}" for i, line in enumerate(listing.code.splitlines()))
            title = listing.title if (self.title or len(self.listings) > 1) else ""
            out.append(Section(title, highlight(listing.code, PythonLexer(), formatter), numbered))
        return out


def _resolve(obj):
    """A dotted name's object ("jfa.kernels.ring.make_ring"), else obj itself."""
    if not isinstance(obj, str):
        return obj
    import importlib

    parts = obj.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ValueError(f"show: {obj!r} names no importable module or attribute")


def _python_object(obj):
    """The Python function behind a @triton.jit function (its `.fn`), else obj."""
    from jfa.kernels.twin import JIT_FUNCTION_TYPES

    return obj.fn if isinstance(obj, JIT_FUNCTION_TYPES) else obj


def _where(obj) -> tuple[str, str]:
    """(dotted name, file path as shown) of a function, class or module."""
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    qualname = getattr(obj, "__qualname__", None) if not pyinspect.ismodule(obj) else None
    name = f"{module}.{qualname}" if qualname else module
    try:
        file = Path(pyinspect.getsourcefile(obj) or pyinspect.getfile(obj)).resolve()
    except (TypeError, OSError):
        return name, "?"
    if module == "__main__" or not file.exists():
        return (qualname or name), "defined in this notebook"
    return name, str(file.relative_to(PACKAGE_ROOT)) if file.is_relative_to(PACKAGE_ROOT) else file.name


def _bound(spec, lines: list[str], start: int, what: str) -> int:
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise TypeError(f"show: lines: each bound is an int (a line of the object, 1 = its first) or a str "
                        f"(the first line containing it), got {type(spec).__name__}")
    if isinstance(spec, int):
        if not 1 <= spec <= len(lines):
            raise ValueError(f"show: lines: the {what} line {spec} is outside the object's 1..{len(lines)}")
        return spec - 1
    for i in range(start, len(lines)):
        if spec in lines[i]:
            return i
    raise ValueError(f"show: lines: no line of the object contains {spec!r} (the {what} bound)")


def _listing(obj, lines=None) -> Listing:
    target = _python_object(obj)
    try:
        source, first = pyinspect.getsourcelines(target)
    except (OSError, TypeError) as exc:
        raise TypeError(f"show: no source for {obj!r} ({exc}); pass a function, class, @triton.jit function, "
                        "module, NamedTuple or a dotted name") from None
    first = max(first, 1)
    if lines is not None:
        if not (isinstance(lines, tuple) and len(lines) == 2):
            raise TypeError(f"show: lines: expected (first, last), got {lines!r}")
        lo = _bound(lines[0], source, 0, "first")
        hi = _bound(lines[1], source, lo, "last")
        if hi < lo:
            raise ValueError(f"show: lines: the last line ({hi + 1}) comes before the first ({lo + 1})")
        source, first = source[lo:hi + 1], first + lo
    name, path = _where(target)
    return Listing(name=name, path=path, first=first, code="".join(source))


def _fork_hooks(fork) -> dict:
    """The hooks of a fork that differ from the unforked kernels' (`hooks.DEFAULT_FORK`)."""
    from jfa.kernels.hooks import DEFAULT_FORK

    return {name: fn for name, fn in fork._asdict().items() if fn is not None and fn is not getattr(DEFAULT_FORK, name)}


def show(obj, *, lines=None, title=None) -> Source:
    """The real source of `obj`: a function or class of the package (a NamedTuple included), a
    `@triton.jit` function (its Python source), a module, a dotted name ("jfa.kernels.ring.make_ring"),
    or a variant or fork (the source of each hook it replaces). Shown highlighted, titled with the
    module path and line range; `lines=(first, last)` picks a sub-range, each bound a line of the
    object (1 = its first, decorators included) or a str (the first line containing it)."""
    from jfa.kernels.hooks import Fork

    obj = _resolve(obj)
    fork = getattr(obj, "fork", obj)
    if isinstance(fork, Fork):
        if lines is not None:
            raise ValueError("show: lines picks lines of one function; show a single hook for that")
        hooks = _fork_hooks(fork)
        name = getattr(obj, "name", None)
        heading = title or (f"variant {name!r}: its hooks" if name else "fork: its hooks")
        return Source([_listing(fn) for fn in hooks.values()], heading)
    return Source([_listing(obj, lines)], title)


# ==== cases: GEM-like batches ===========================================================================
@dataclasses.dataclass(frozen=True)
class Case:
    """A GEM-like batch: `batch` sequences of lengths U[(2s-1)L, L] (`jfa.jagged.gem_lengths`, the
    benchmark's seed), `heads` heads of `head_dim`, with the call's options; `q_len` makes it
    broadcast-Q (one shared query of q_len rows against every sequence, the PMA suite's kind)."""

    max_len: int = 1024
    sparsity: float = 0.5
    batch: int = specs.GEM_BATCH
    heads: int = specs.GEM_HEADS
    head_dim: int = specs.GEM_HEAD_DIM
    dtype: str = "bfloat16"
    causal: bool = False
    window: int | None = None
    q_len: int | None = None

    @property
    def broadcast_q(self) -> bool:
        return self.q_len is not None

    @property
    def label(self) -> str:
        suite_case = self.suite_case()
        if suite_case is not None:
            return suite_case[1]
        parts = [f"L={self.max_len}", f"s={self.sparsity}"]
        if self.q_len is not None:
            parts.insert(0, f"q={self.q_len}")
        if (self.batch, self.heads, self.head_dim) != (GEM["batch"], GEM["heads"], GEM["head_dim"]):
            parts += [f"B={self.batch}", f"H={self.heads}", f"D={self.head_dim}"]
        if self.dtype != "bfloat16":
            parts.append(self.dtype)
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        return ",".join(parts)

    def _shape(self) -> dict:
        return dict(kind="pma" if self.broadcast_q else "jagged", batch=self.batch, heads=self.heads,
                    head_dim=self.head_dim, max_len=self.max_len, sparsity=self.sparsity, kv_len=None, q_len=self.q_len,
                    density=None, dtype=self.dtype)

    def bench_case(self) -> dict:
        """The case as `jfa.workbench.bench` builds tensors for it (suite "live")."""
        return dict(suite="live", case=self.label, **self._shape())

    def suite_case(self) -> tuple[str, str] | None:
        """(suite, case) of the benchmark suite case with exactly this shape, if there is one."""
        if self.causal or self.window is not None:
            return None
        mine = self._shape()
        for suite in ("gem", "pma"):
            for case in specs.BENCH_SUITES[suite]:
                if {k: case[k] for k in mine} == mine:
                    return suite, case["case"]
        return None


DEFAULT_CASES = (Case(max_len=512), Case(max_len=1024), Case(max_len=2048))


# ==== which kernels a target runs ========================================================================
@dataclasses.dataclass(frozen=True)
class _Target:
    """What a check is of: the entry point's kind, the variant (for forks), a label."""

    kind: str  # "jagged", "variant", "block", "block_sparse", "fp8"
    label: str
    variant: object = None

    @property
    def forks_operands(self) -> bool:
        """A variant that replaces P·V or the V operand, which its PyTorch reference does not model."""
        if self.variant is None:
            return False
        return bool(set(_fork_hooks(self.variant.fork)) & {"value_shape", "load_values", "value_operand", "pv",
                                                          "scale_output"})


KINDS = {"jagged": "jfa.jagged_attention", "block": "jfa.block_attention",
         "block_sparse": "jfa.block_sparse_attention", "fp8": "jfa.jagged_attention_fp8"}


def _target(target) -> _Target:
    from jfa.variants import Variant

    if target is None:
        target = "jagged"
    if isinstance(target, Variant):
        return _Target("variant", f"variant {target.name!r}", target)
    if isinstance(target, str):
        if target not in KINDS:
            raise ValueError(f"target: one of {sorted(KINDS)}, a jfa entry point or a jfa.variant(...), got {target!r}")
        return _Target(target, KINDS[target])
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', '')}"
    by_function = {"jfa.ops.jagged_attention": "jagged", "jfa.block.block_attention": "block",
                   "jfa.sparse.block_sparse_attention": "block_sparse", "jfa.fp8.jagged_attention_fp8": "fp8"}
    if name in by_function:
        return _Target(by_function[name], KINDS[by_function[name]])
    raise TypeError(f"target: expected {', '.join(KINDS.values())}, a jfa.variant(...) or one of "
                    f"{sorted(KINDS)}, got {target!r}")


def _heads(heads) -> tuple[int, int]:
    if isinstance(heads, int):
        return heads, heads
    q_heads, kv_heads = heads
    if q_heads % kv_heads:
        raise ValueError(f"heads: the query heads ({q_heads}) must be a multiple of the key heads ({kv_heads})")
    return int(q_heads), int(kv_heads)


def _kernel_specs(t: _Target, head_dim: int, dtype, causal: bool, window, broadcast_q: bool, params: tuple,
                  heads: tuple[int, int]) -> dict:
    """name -> KernelSpec of the kernels the target runs, compiled as for a GEM-like batch."""
    from jfa import configs
    from jfa.kernels.hooks import DEFAULT_FORK
    from jfa.variants import Variant

    if t.kind == "variant":
        found = t.variant.kernel_specs(head_dim, dtype, causal=causal, window=window, broadcast_q=broadcast_q,
                                       params=params)
    elif t.kind == "jagged":
        found = Variant("jagged", DEFAULT_FORK).kernel_specs(head_dim, dtype, causal=causal, window=window,
                                                             broadcast_q=broadcast_q)
    elif t.kind == "block_sparse":  # at this batch the runner's base tiles are the configured ones
        from jfa.kernels.forks.block_sparse import BLOCK_SPARSE_FORK

        selection = (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), 1, 1, 1)
        found = Variant("block-sparse", BLOCK_SPARSE_FORK).kernel_specs(head_dim, dtype, causal=causal,
                                                                        params=selection)
    elif t.kind == "fp8":
        from jfa.kernels import fwd_sm90
        from jfa.kernels.forks.fp8 import FP8_FORK

        config = configs.forward_config(configs.gem_like_shape(head_dim, causal=causal, window=window,
                                                               broadcast_q=broadcast_q, base_tiles=True))
        found = {"forward": fwd_sm90.inspect_spec(config, torch.float8_e4m3fn, FP8_FORK, ("fp32",),
                                                  specs.FP8_OUT_DTYPE)}
    else:  # block attention
        from jfa.kernels import block_attn

        group = heads[0] // heads[1]
        found = {"forward": block_attn.inspect_spec(configs.block_attention_forward(head_dim, group), dtype),
                 "backward": block_attn.inspect_spec(configs.block_attention_backward(head_dim, group), dtype)}
    return found


KERNEL_LABELS = {"forward": "forward (fwd_sm90)", "dq": "dQ (bwd_dq)", "dkdv": "dK/dV (bwd_dkdv)"}
BLOCK_KERNEL_LABELS = {"forward": "forward (block_attn)", "backward": "backward (block_attn)"}


# ==== compile reports ====================================================================================
class CompileReport(Report):
    """The kernels of one call compiled for sm_90 (`jfa.workbench.inspect`): per kernel its roles'
    registers, spills, shared memory and the spill traffic inside its MMA loops; a kernel that does
    not compile shows the compiler's message instead. `reports[name]` is the `KernelReport` (or the
    error text); `baseline`, when given, is the unforked kernels' report for comparison."""

    def __init__(self, what: str, reports: dict, target: str = TARGET_ARCH, baseline: "CompileReport | None" = None,
                 labels: dict | None = None):
        self.what = what
        self.reports = reports
        self.target = target
        self.baseline = baseline
        self.labels = KERNEL_LABELS if labels is None else labels

    @property
    def ok(self) -> bool:
        return all(not isinstance(r, str) for r in self.reports.values())

    def headline(self) -> str:
        verdict = "compiles" if self.ok else "does NOT compile"
        return f"{self.what}: {verdict} for {self.target} ({len(self.reports)} kernels)"

    def _row(self, name: str, report) -> list:
        label = self.labels.get(name, name)
        if isinstance(report, str):
            return [label, _verdict_html(False, "compile error"), "", "", "", ""]
        roles = ", ".join(f"{r.name} {r.registers if r.registers is not None else '-'}" for r in report.roles
                          if r.name != "padding")
        spills = f"{report.spill_bytes.get('stores', 0)} / {report.spill_bytes.get('loads', 0)}"
        loops = "-" if report.loops is None else str(sum(loop["local_loads"] for loop in report.loops))
        base = self.baseline.reports.get(name) if self.baseline else None
        if base is not None and not isinstance(base, str):
            spills += (f" (unforked {base.spill_bytes.get('stores', 0)} / {base.spill_bytes.get('loads', 0)})")
        return [label, f"{report.total_warps}", roles, spills, loops, f"{report.shared_bytes:,}"]

    HEADER = ["kernel", "warps", "registers per thread, by role", "spill stores / loads (B)",
              "spill reloads in MMA loops", "shared memory (B)"]

    def sections(self) -> list[Section]:
        rows = [self._row(name, r) for name, r in self.reports.items()]
        errors = [(name, r) for name, r in self.reports.items() if isinstance(r, str)]
        html_ = _table_html(self.HEADER, rows)
        text = _table_text(self.HEADER, rows)
        for name, message in errors:
            html_ += f"<pre style='color:#cf222e;white-space:pre-wrap'>{_esc(name)}: {_esc(message)}</pre>"
            text += f"\n{name}: {message}"
        return [Section("", html_, text)]


def _inspect(spec, target: str = TARGET_ARCH):
    """`jfa.workbench.inspect.inspect` of one spec; the error's text where it does not compile."""
    from jfa.workbench.inspect import inspect

    try:
        return inspect(spec, target)
    except Exception as exc:  # a learner's hook that does not compile is a result to show, not a crash
        return f"{type(exc).__name__}: {exc}"


def compile_kernels(target=None, *, head_dim: int = HEAD_DIM, dtype=torch.bfloat16, causal: bool = False,
                    window: int | None = None, broadcast_q: bool = False, params: tuple = (), heads=HEADS,
                    kernels: Iterable[str] | None = None, baseline: bool = False) -> CompileReport:
    """The kernels `target` runs (as `check` takes it: an entry point, its kind's name or a variant),
    compiled for sm_90 on any machine, as for a GEM-like batch with these options. `kernels` picks some
    ("forward", "dq", "dkdv"; block attention's "forward", "backward"); `baseline` adds the unforked
    kernels' spills for comparison (a variant only)."""
    from jfa import configs

    t = _target(target)
    found = _kernel_specs(t, head_dim, dtype, causal, window, broadcast_q, tuple(params), _heads(heads))
    if kernels is not None:
        kernels = tuple(kernels)
        unknown = [k for k in kernels if k not in found]
        if unknown:
            raise ValueError(f"kernels: {unknown} are not kernels of {t.label}; choose from {list(found)}")
        found = {k: found[k] for k in kernels}
    base = None
    if baseline and t.kind == "variant":
        base = compile_kernels("jagged", head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                               broadcast_q=broadcast_q, kernels=[k for k in found if k in KERNEL_LABELS])
    what = f"{t.label}, D={head_dim} {str(dtype).replace('torch.', '')}" + (", causal" if causal else "") + (
        f", window={window}" if window is not None else "") + (", broadcast-Q" if broadcast_q else "") + (
        f", configured as for a GEM-like batch (B={specs.GEM_BATCH}, L={configs.INSPECT_MAX_LEN})" if t.kind != "block" else "")
    return CompileReport(what, {name: _inspect(spec) for name, spec in found.items()}, baseline=base,
                         labels=BLOCK_KERNEL_LABELS if t.kind == "block" else KERNEL_LABELS)


# ==== recorded runs ======================================================================================
def recorded_label(rec) -> str:
    """"recorded on the H200, 2026-11-30 (commit ..., file)": what a recorded number must carry."""
    env = rec.env
    gpu = env.get("gpu") or "GPU"
    short = "H200" if "H200" in gpu else gpu
    date = (env.get("date") or "?")[:10]
    kind = "fixture transcribed from runs " if rec.is_fixture else ""
    return f"{kind}recorded on the {short}, {date} (commit {(env.get('commit') or '?')[:12]}; {rec.where})"


def _slug(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()


def _test_matches(test_id: str, slug: str) -> bool:
    """Whether a parametrized test id names this variant (`[alibi-full]`, `[relative_bias]`)."""
    match = re.search(r"\[(.*)\]$", test_id)
    return bool(match) and slug in match.group(1).split("-")


def _recorded_tests_section(t: _Target, results: Path | None) -> Section:
    """The recorded gpu-tests outcomes of the target's test modules (a variant's own tests where
    there are any), labelled with the GPU and the date."""
    from jfa.workbench.widgets import newest_recorded

    title = "Recorded GPU tests"
    if results is None:
        line = "no results directory given: pass results= (or call lab.setup(RESULTS)) to show the recorded runs"
        return Section(title, f"<div>{_esc(line)}</div>", line)
    modules = TEST_MODULES[t.kind]
    rec = newest_recorded(GPU_TESTS_PATTERN, results,
                          where=lambda doc: any(t_["test"].startswith(modules) for t_ in doc.get("tests", [])))
    if rec is None:
        line = f"no recorded GPU test run of {', '.join(modules)} in {results}"
        return Section(title, f"<div>{_esc(line)}</div>", line)
    tests = [entry for entry in rec.doc.get("tests", []) if entry["test"].startswith(modules)]
    note = ""
    if t.kind == "variant":
        slug = _slug(t.variant.name)
        own = [entry for entry in tests if _test_matches(entry["test"], slug)]
        if own:
            tests = own
        else:
            note = (f"no recorded run of variant {t.variant.name!r} itself (a variant defined here has none); "
                    "these are the recorded runs of the package's own variants:")
    by_module: dict[str, dict[str, int]] = {}
    for entry in tests:
        counts = by_module.setdefault(entry["test"].split("::")[0], {})
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    rows = [[module, ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))]
            for module, counts in by_module.items()]
    failed = [entry for entry in tests if entry["outcome"] != "passed"]
    label = recorded_label(rec)
    html_ = f"<div><i>{_esc(label)}</i></div>" + (f"<div>{_esc(note)}</div>" if note else "")
    html_ += _table_html(["test module", "outcomes"], rows)
    text = label + ("\n" + note if note else "") + "\n" + _table_text(["test module", "outcomes"], rows)
    for entry in failed[:10]:
        html_ += f"<div style='color:#cf222e'>{_esc(entry['outcome'])}: {_esc(entry['test'])}</div>"
        text += f"\n{entry['outcome']}: {entry['test']}"
    if t.kind == "variant" and not note:
        listed = "".join(f"<div style='font-size:12px'>{_esc(e['outcome'])} {_esc(e['test'])}</div>" for e in tests)
        html_ += listed
        text += "".join(f"\n  {e['outcome']} {e['test']}" for e in tests)
    return Section(title, html_, text)


def _newest_head_to_head(results: Path | None):
    from jfa.workbench.widgets import newest_recorded

    if results is None:
        return None
    return newest_recorded(H2H_PATTERN, results, where=lambda doc: doc.get("kind") == HEAD_TO_HEAD_KIND)


def _head_to_head_rows(rec) -> list[dict]:
    """A head-to-head recording's medians as `jfa.workbench.bench` rows (fwd and bwd per provider)."""
    rows = []
    for case in rec.doc.get("cases", []):
        for provider, numbers in case.get("providers", {}).items():
            for pass_ in ("fwd", "bwd"):
                rows.append({"suite": case["suite"], "case": case["case"], "provider": provider, "pass": pass_,
                             "ms": numbers[f"{pass_}_ms"], "tflops": numbers[f"{pass_}_tflops"], "ok": True,
                             "error": None, "params": {}})
    return rows


def _recorded_speed_section(t: _Target, results: Path | None) -> Section:
    """Recorded speed: the head-to-head's suites for the jagged kernels (a variant's unforked kernel),
    the benchmark suite of the kind otherwise."""
    from jfa.workbench.widgets import newest_bench

    title = "Recorded speed"
    if results is None:
        line = "no results directory given: no recorded speed to show"
        return Section(title, f"<div>{_esc(line)}</div>", line)
    if t.kind in BENCH_SUITE:
        suite = BENCH_SUITE[t.kind]
        rec = newest_bench(suite, results)
        rows = [r for r in rec.doc.get("rows", []) if r.get("suite") == suite] if rec else []
        what = f"the {suite} benchmark suite"
    else:
        rec = _newest_head_to_head(results)
        rows = _head_to_head_rows(rec) if rec else []
        what = "the head-to-head (jfa against FlashAttention-4 and -2, same process)"
    if rec is None or not rows:
        line = f"no recorded run of {what} in {results}"
        return Section(title, f"<div>{_esc(line)}</div>", line)
    note = " The numbers are the unforked kernel's: a fork's own speed needs a GPU." if t.kind == "variant" else ""
    table = _speed_table(rows)
    label = f"{recorded_label(rec)}: {what}, TFLOP/s.{note}"
    return Section(title, f"<div><i>{_esc(label)}</i></div>" + table[0], label + "\n" + table[1])


def _speed_table(rows: list[dict]) -> tuple[str, str]:
    """TFLOP/s per (suite case) and provider, fwd and bwd: (html, text)."""
    ok = [r for r in rows if r.get("ok")]
    providers = list(dict.fromkeys(r["provider"] for r in ok))
    cases = list(dict.fromkeys((r["suite"], r["case"]) for r in ok))
    by = {(r["suite"], r["case"], r["provider"], r["pass"]): r for r in ok}
    header = ["case"] + [f"{p} {pass_}" for pass_ in ("fwd", "bwd") for p in providers]
    body = []
    for suite, case in cases:
        cells = [f"{suite} {case}" if suite != "live" else case]
        for pass_ in ("fwd", "bwd"):
            for p in providers:
                r = by.get((suite, case, p, pass_))
                cells.append(f"{r['tflops']:.0f}" if r and r.get("tflops") else "-")
        body.append(cells)
    return _table_html(header, body), _table_text(header, body)


# ==== the live check =====================================================================================
@dataclasses.dataclass
class TensorCheck:
    """One tensor of a check against its reference: the errors and the verdict."""

    name: str
    shape: tuple
    max_abs: float
    rel: float  # ||got - want|| / ||want|| over the finite entries
    sqnr_db: float
    bad: int  # elements outside the tolerance (or non-finite where the reference is finite)
    total: int
    tolerance: str
    passed: bool

    def cells(self) -> list:
        return [self.name, "x".join(map(str, self.shape)), f"{self.max_abs:.2e}", f"{self.rel:.2e}",
                f"{self.sqnr_db:.1f}", f"{self.bad} / {self.total:,}", self.tolerance,
                _verdict_html(self.passed, "pass" if self.passed else "FAIL")]


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    """(mask of entries to compare, max abs error, relative error, SQNR dB): entries where both are the
    same infinity (a row that saw no key: LSE -inf) count as equal and are left out of the norms."""
    got, want = got.detach().double(), want.detach().double()
    same_inf = torch.isinf(want) & (got == want)
    finite = torch.isfinite(want) & ~same_inf
    diff = (got - want)[finite]
    ref = want[finite]
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    rel = float(diff.norm() / ref.norm().clamp_min(1e-30)) if diff.numel() else 0.0
    noise = float(diff.square().sum())
    sqnr = float(10 * math.log10(float(ref.square().sum()) / noise)) if noise > 0 else float("inf")
    return same_inf, max_abs, rel, sqnr


def _compare_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: dict, relerr: float | None = None,
                   min_sqnr_db: float | None = None) -> TensorCheck:
    """Every element within `tol` (torch.isclose), the relative error within `relerr` and the SQNR above
    `min_sqnr_db` where given."""
    same_inf, max_abs, rel, sqnr = _errors(got, want)
    close = torch.isclose(got.detach().double(), want.detach().double(), **tol) | same_inf
    bad = int((~close).sum())
    passed = bad == 0 and (relerr is None or rel <= relerr) and (min_sqnr_db is None or sqnr >= min_sqnr_db)
    words = f"atol {tol['atol']:g}, rtol {tol['rtol']:g}" + (f", rel <= {relerr:g}" if relerr else "") + (
        f", SQNR >= {min_sqnr_db:g} dB" if min_sqnr_db else "")
    return TensorCheck(name, tuple(got.shape), max_abs, rel, sqnr, bad, got.numel(), words, passed)


def _compare_agreement(name: str, got: torch.Tensor, want: torch.Tensor) -> TensorCheck:
    """Cosine similarity and SQNR against the reference (the FP8 kernel's bars, `specs.FP8_MIN_*`)."""
    from jfa.reference import fp8_agreement

    same_inf, max_abs, rel, sqnr = _errors(got, want)
    keep = ~same_inf & torch.isfinite(want)
    cosine, sqnr_db = fp8_agreement(got[keep], want[keep])
    bad = int((~torch.isfinite(got[keep])).sum())
    passed = bad == 0 and cosine >= specs.FP8_MIN_COSINE and sqnr_db >= specs.FP8_MIN_SQNR_DB
    words = f"cosine {cosine:.4f} >= {specs.FP8_MIN_COSINE}, SQNR >= {specs.FP8_MIN_SQNR_DB:g} dB"
    return TensorCheck(name, tuple(got.shape), max_abs, rel, sqnr_db, bad, got.numel(), words, passed)


def _offsets(lengths, device) -> torch.Tensor:
    from jfa.jagged import lengths_to_offsets

    return lengths_to_offsets(torch.tensor(list(lengths), dtype=torch.int64), device=device)


def _randn(shape, gen, device, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _on(params: tuple, device) -> tuple:
    return tuple(p.to(device) if torch.is_tensor(p) else p for p in params)


def _why_not_live(t: _Target, q, k, v) -> str | None:
    """Why the kernel would not run on these tensors (the entry point would run the reference)."""
    from jfa import dispatch, jagged

    if t.kind == "fp8":
        return dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, q, k, v, dtypes=jagged.FP8_DTYPES)
    if t.kind == "block":
        return dispatch.why_not_kernel("block_attn", q, k, v)
    return dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, q, k, v)


def _run_live_check(t: _Target, *, lengths, heads, head_dim, dtype, causal, window, broadcast_q, params, density,
                    seed, backward, device=None) -> list[TensorCheck]:
    """Run the kernel and its fp32 reference on fresh inputs (seed `seed`); compare every element."""
    import jfa
    from jfa import reference

    q_heads, kv_heads = heads
    device = device or LIVE_DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    q_lens = [BROADCAST_Q_LEN] if broadcast_q else list(lengths)
    rows_q, rows_kv = sum(q_lens), sum(lengths)
    out_rows = BROADCAST_Q_LEN * len(lengths) if broadcast_q else rows_q
    q_off, kv_off = _offsets(q_lens, device), _offsets(lengths, device)
    base = [_randn((rows_q, q_heads, head_dim), gen, device, dtype),
            _randn((rows_kv, kv_heads, head_dim), gen, device, dtype),
            _randn((rows_kv, kv_heads, head_dim), gen, device, dtype)]
    dout = _randn((out_rows, q_heads, head_dim), gen, device, dtype)
    params = _on(params, device)
    backward = backward and t.kind != "fp8"

    if t.kind == "fp8":
        quantized = [reference.fp8_quantize_per_tensor(x) for x in base]
        inputs = [x for x, _ in quantized]
        scales = [s for _, s in quantized]
        why = _why_not_live(t, *inputs)
        if why:
            raise RuntimeError(f"the kernel would not run here ({why}); nothing was checked")
        out = jfa.jagged_attention_fp8(*inputs, q_off, kv_off, q_scale=scales[0], k_scale=scales[1],
                                       v_scale=scales[2], causal=causal, window=window, broadcast_q=broadcast_q)
        real = [x.float() * s for x, s in quantized]
        want, _ = reference.jagged_attention_ref(*real, q_off, kv_off, causal=causal, window=window,
                                                 broadcast_q=broadcast_q)
        return [_compare_agreement("out", out, want)]

    why = _why_not_live(t, *base)
    if why:
        raise RuntimeError(f"the kernel would not run here ({why}); nothing was checked")
    leaves = [x.clone().requires_grad_(backward) for x in base]
    ref_leaves = [x.float().requires_grad_(backward) for x in base]
    lse = want_lse = None
    if t.kind == "jagged":
        options = dict(causal=causal, window=window, broadcast_q=broadcast_q, return_lse=True)
        out, lse = jfa.jagged_attention(*leaves, q_off, kv_off, **options)
        want, want_lse = reference.jagged_attention_ref(*ref_leaves, q_off, kv_off, causal=causal, window=window,
                                                        broadcast_q=broadcast_q)
    elif t.kind == "variant":
        options = dict(causal=causal, window=window, broadcast_q=broadcast_q, return_lse=True, params=params)
        out, lse = t.variant(*leaves, q_off, kv_off, **options)
        want, want_lse = t.variant.reference(*ref_leaves, q_off, kv_off, **options)
    elif t.kind == "block":
        out = jfa.block_attention(*leaves, q_off)
        want = reference.block_attention_ref(*ref_leaves, q_off)
    else:  # block-sparse
        from jfa.workbench.bench import block_sparse_selection

        selection, _ = block_sparse_selection(list(lengths), q_heads, density, seed)
        selection = selection.to(device)
        block = specs.BLOCK_SPARSE_BLOCK
        out, lse = jfa.block_sparse_attention(*leaves, q_off, kv_off, selection, causal=causal, return_lse=True)
        want, want_lse = reference.block_sparse_attention_ref(*ref_leaves, q_off, kv_off, selection, block, block,
                                                              causal=causal)
    checks = []
    statistical = t.forks_operands
    if statistical:
        checks.append(_compare_agreement("out", out, want))
    else:
        checks.append(_compare_close("out", out, want, specs.FWD_TOL, specs.FWD_RELERR))
        if lse is not None:
            checks.append(_compare_close("lse", lse, want_lse, specs.FWD_TOL))
    if backward:
        grads = torch.autograd.grad(out, leaves, dout)
        want_grads = torch.autograd.grad(want, ref_leaves, dout.float())
        for name, got, ref_grad in zip(("dq", "dk", "dv"), grads, want_grads):
            if statistical:
                checks.append(_compare_agreement(name, got, ref_grad))
            elif t.kind == "block":
                checks.append(_compare_close(name, got, ref_grad, specs.BLOCK_ATTN_GRAD_TOL,
                                             min_sqnr_db=specs.BLOCK_ATTN_GRAD_SNR_DB))
            else:
                checks.append(_compare_close(name, got, ref_grad, specs.GRAD_TOL, specs.GRAD_RELERR))
    return checks


class CheckReport(Report):
    """A check of one kernel (or fork): on a Hopper GPU, `tensors` holds every output and gradient
    against the fp32 reference and `passed` the verdict; elsewhere `passed` is None (nothing was
    checked), and the report holds the compiled kernels and the recorded GPU runs instead."""

    def __init__(self, what: str, live: bool, *, line: str, tensors: list[TensorCheck] | None = None,
                 error: str | None = None, compiled: CompileReport | None = None, extra: list[Section] = (),
                 seed: int | None = None):
        self.what = what
        self.live = live
        self.line = line
        self.tensors = tensors or []
        self.error = error
        self.compiled = compiled
        self.extra = list(extra)
        self.seed = seed

    @property
    def passed(self) -> bool | None:
        if not self.live:
            return None
        return self.error is None and bool(self.tensors) and all(c.passed for c in self.tensors)

    def headline(self) -> str:
        if not self.live:
            return f"{self.what}: not checked here. {self.line}"
        if self.error:
            return f"{self.what}: FAILED to run: {self.error}"
        verdict = "PASS" if self.passed else "FAIL"
        return f"{self.what}: {verdict} against the fp32 reference ({self.line})"

    HEADER = ["tensor", "shape", "max |err|", "rel err", "SQNR (dB)", "outside tolerance", "tolerance", "verdict"]

    def sections(self) -> list[Section]:
        out = []
        if self.tensors:
            rows = [c.cells() for c in self.tensors]
            out.append(Section(f"TLX kernel against the fp32 reference (seed {self.seed})",
                               _table_html(self.HEADER, rows), _table_text(self.HEADER, rows)))
        if self.compiled is not None:
            out.append(Section(f"Compiled for {self.compiled.target} (what the kernels ask of the machine)",
                               self.compiled.html(), repr(self.compiled)))
        return out + self.extra


UNSUPPORTED_OPTIONS = {"block": ("causal", "window", "broadcast_q"), "block_sparse": ("window", "broadcast_q")}


def _fresh_seed() -> int:
    """A new seed for every check, from the OS (the global torch seed stays as the notebook set it)."""
    import secrets

    return secrets.randbelow(2**31 - 1)


def check(target=None, *, lengths=None, heads=HEADS, head_dim: int = HEAD_DIM, dtype=torch.bfloat16,
          causal: bool = False, window: int | None = None, broadcast_q: bool = False, params: tuple = (),
          density: float = CHECK_DENSITY, seed: int | None = None, backward: bool = True, compile: bool = True,
          results=None, live: bool | None = None) -> CheckReport:
    """Check a kernel against its fp32 reference: `target` is jfa.jagged_attention (the default),
    jfa.block_attention, jfa.block_sparse_attention, jfa.jagged_attention_fp8 (or their kinds' names
    "jagged", "block", "block_sparse", "fp8"), or a `jfa.variant(...)` with its `params`.

    On a Hopper GPU: fresh random inputs (`seed`, new each call unless given) over `lengths` (edge
    lengths by default; the KV lengths with `broadcast_q`), the kernel forward and backward through its
    public call, every element of the output, LSE and gradients against the reference within
    `jfa.specs`' tolerances (FP8, and forks of P·V that the reference does not model: cosine and SQNR).
    Elsewhere: one line saying so, the kernels compiled for sm_90 (`compile=False` skips that), and
    the recorded GPU test outcomes and speed from `results` (or the directory `setup` was given)."""
    t = _target(target)
    heads_ = _heads(heads)
    lengths = CHECK_LENGTHS if lengths is None else tuple(int(n) for n in lengths)
    given = dict(causal=causal, window=window, broadcast_q=broadcast_q)
    for option in UNSUPPORTED_OPTIONS.get(t.kind, ()):
        if given[option] not in (None, False):
            raise ValueError(f"{option}: {t.label} has no {option} option")
    options = dict(lengths=lengths, heads=heads_, head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                   broadcast_q=broadcast_q, params=tuple(params), density=density, backward=backward)
    flags = ", ".join([f"D={head_dim}", str(dtype).replace("torch.", ""), f"heads {heads_[0]}/{heads_[1]}"]
                      + (["causal"] if causal else []) + ([f"window={window}"] if window is not None else [])
                      + ([f"broadcast-Q q={BROADCAST_Q_LEN}"] if broadcast_q else []))
    what = f"{t.label} ({flags})"
    if _live(live):
        seed = _fresh_seed() if seed is None else int(seed)
        passes = "forward and backward" if backward and t.kind != "fp8" else "forward"
        line = f"{passes}, {len(lengths)} sequences of {min(lengths)}..{max(lengths)} tokens, seed {seed}"
        try:
            tensors = _run_live_check(t, seed=seed, **options)
        except Exception as exc:  # a kernel that fails to compile or launch is this check's result
            return CheckReport(what, True, line=line, error=f"{type(exc).__name__}: {exc}", seed=seed)
        return CheckReport(what, True, line=line, tensors=tensors, seed=seed)
    m = machine()
    line = f"The kernel check needs a Hopper GPU with TLX ({m.why})."
    compiled = None
    if compile and m.compiles:
        compiled = compile_kernels(target, head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                                   broadcast_q=broadcast_q, params=tuple(params), heads=heads_)
    results = _results_dir(results)
    extra = [_recorded_tests_section(t, results), _recorded_speed_section(t, results)]
    return CheckReport(what, False, line=line, compiled=compiled, extra=extra)


# ==== timing ==============================================================================================
def _timer():
    from jfa.workbench.bench import do_bench_median

    return do_bench_median


def _time_jagged_case(case: Case, variant=None, params: tuple = (), peers: Iterable[str] = PEERS,
                      timer=None, base: bool = True, device=None) -> list[dict]:
    """Bench rows (fwd and bwd) of one case on this GPU: the unforked kernel (jfa.jagged_attention),
    `variant` with `params`, and each peer (through `jfa.workbench.providers`, which runs them without
    masks: with causal or a window they are left out, saying so). Every call validates its inputs, the
    fork's and the base's alike (offsets on the host, so no GPU sync is timed)."""
    import jfa
    from jfa.workbench import bench, providers

    timer = timer or _timer()
    device = device or LIVE_DEVICE
    bench_case = case.bench_case()
    problem = bench.make_problem(bench_case, device, 0)
    q, k, v = problem.q, problem.k, problem.v
    q_off, kv_off = problem.q_offsets.cpu(), problem.kv_offsets.cpu()
    options = dict(causal=case.causal, window=case.window, broadcast_q=case.broadcast_q)
    flops = {p: specs.attention_flops(problem.q_lens, problem.kv_lens, case.heads, case.head_dim, pass_=p,
                                      causal=case.causal, window=case.window) for p in ("fwd", "bwd")}
    params_dev = _on(tuple(params), device)

    def rows_of(provider: str, result: dict, error: str | None, notes=()) -> list[dict]:
        return [bench.make_row(bench_case, provider, p, ms=result.get(p), flops=flops[p], ok=p in result,
                               error=error, params={"flops": flops[p], "notes": list(notes)}) for p in ("fwd", "bwd")]

    def timed(provider: str, call: Callable[[], torch.Tensor]) -> list[dict]:
        try:
            grad_out = torch.randn_like(call())
            fwd_bwd = lambda: torch.autograd.grad(call(), (q, k, v), grad_out)  # noqa: E731
            fwd_bwd()  # compile and first touch, untimed
            if q.is_cuda:
                torch.cuda.synchronize()
            return rows_of(provider, bench.time_passes(("fwd", "bwd"), call, fwd_bwd, timer, []), None)
        except Exception as exc:  # a fork that fails is a row saying why
            return rows_of(provider, {}, f"{type(exc).__name__}: {exc}")

    why = _why_not_live(_Target("jagged", "jfa"), q, k, v)
    if why:
        return rows_of("jfa", {}, f"unavailable: {why}")
    rows = []
    if base:
        rows += timed("jfa", lambda: jfa.jagged_attention(q, k, v, q_off, kv_off, problem.max_q, problem.max_kv,
                                                          **options))
    if variant is not None:
        rows += timed(fork_label(variant), lambda: variant(q, k, v, q_off, kv_off, problem.max_q, problem.max_kv,
                                                           params=params_dev, **options))
    for peer in peers:
        if case.causal or case.window is not None:
            rows += rows_of(peer, {}, "not timed: jfa.workbench.providers runs the peers without causal or "
                                      "window masks")
            continue
        extra: dict = {}
        try:
            ready = bench.prepare_provider(providers.PROVIDERS[peer], [problem], extra)
            result = bench.time_passes(("fwd", "bwd"), ready.fwd, ready.fwd_bwd, timer, ready.grads)
            rows += rows_of(peer, result, ready.no_backward, extra.get("notes", ()))
        except Exception as exc:  # a peer missing here (not installed, no API for the kind) is a row
            rows += rows_of(peer, {}, bench._error_text(exc))
        finally:
            bench.clear_grads([problem])
    return rows


NOTE_CHARS = 240  # of a failed row's error shown under a table


def fork_label(variant) -> str:
    """How a fork is named in tables and legends."""
    return f"{variant.name} (fork)"


class Benchmark(Report):
    """TFLOP/s of the unforked kernel, a fork and the peers over some cases, measured live or
    recorded (`source` says which). `rows` are `jfa.workbench.bench` rows; `figure(pass_)` plots them."""

    def __init__(self, rows: list[dict], source: str, live: bool, notes: list[str] = ()):
        self.rows = rows
        self.source = source
        self.live = live
        self.notes = list(notes)

    def headline(self) -> str:
        return f"Benchmark, {self.source}"

    def figure(self, pass_: str = "fwd"):
        """Grouped bars: TFLOP/s per case and provider of one pass."""
        from jfa.workbench.plots import tflops_bar

        kind = "measured live" if self.live else "recorded"
        return tflops_bar(self.rows, pass_=pass_, title=f"{pass_} TFLOP/s ({kind})")

    def sections(self) -> list[Section]:
        if not any(r.get("ok") for r in self.rows):
            text = "no numbers" + ("".join(f"\n{n}" for n in self.notes))
            return [Section("", f"<div>{_esc(text)}</div>", text)]
        html_, text = _speed_table(self.rows)
        failed = sorted({f"{r['provider']}: {r['error'][:NOTE_CHARS]}" for r in self.rows
                         if not r.get("ok") and r.get("error")})
        notes = self.notes + failed
        if notes:
            html_ += "".join(f"<div style='font-size:12px'>{_esc(n)}</div>" for n in notes)
            text += "".join(f"\n{n}" for n in notes)
        figures = [self.figure(p) for p in ("fwd", "bwd") if any(r.get("ok") and r["pass"] == p for r in self.rows)]
        return [Section("TFLOP/s (FLOPs as jfa.specs.attention_flops counts them)", html_, text, figures)]


def benchmark(variant=None, *, params: tuple = (), cases: Iterable[Case] | None = None, peers: Iterable[str] = PEERS,
              results=None, live: bool | None = None, timer=None) -> Benchmark:
    """TFLOP/s of the unforked kernel (jfa.jagged_attention), `variant` (with `params`) and the peers on
    each of `cases` (GEM-like batches, by default L = 512, 1024, 2048 with s = 0.5), forward and backward.

    On a Hopper GPU they are timed here (`jfa.workbench.bench`'s timer, every provider on the same
    inputs). Elsewhere the table holds the recorded head-to-head numbers of the cases that are
    benchmark suite cases, labelled with the GPU and the date, and says that the fork needs a GPU."""
    cases = tuple(DEFAULT_CASES if cases is None else cases)
    peers = tuple(peers)
    if _live(live):
        rows, notes = [], []
        for case in cases:
            try:
                rows += _time_jagged_case(case, variant, params, peers, timer)
            except Exception as exc:  # a case that cannot be built or run here is a note, the others still run
                notes.append(f"{case.label}: {type(exc).__name__}: {exc}")
        return Benchmark(rows, f"measured live on {machine().why}", True, notes)
    notes = []
    if variant is not None:
        notes.append(f"{fork_label(variant)}: not measured (its speed needs a Hopper GPU)")
    rec = _newest_head_to_head(_results_dir(results))
    if rec is None:
        return Benchmark([], "no recorded head-to-head (pass results=)", False, notes)
    wanted = {c.suite_case() for c in cases} - {None}
    rows = [r for r in _head_to_head_rows(rec) if (r["suite"], r["case"]) in wanted
            and r["provider"] in ("jfa",) + peers]
    skipped = [c.label for c in cases if c.suite_case() is None]
    if skipped:
        notes.append(f"not in the recording (no suite case of that shape): {', '.join(skipped)}")
    return Benchmark(rows, recorded_label(rec), False, notes)


# ==== sweep: a panel =======================================================================================
def _measure_point(case: Case) -> dict:
    """One live sweep point: a check on a small batch with the case's options, then the case timed."""
    from jfa.jagged import gem_lengths

    lengths = [int(n) for n in gem_lengths(SWEEP_CHECK_BATCH, case.max_len, case.sparsity, seed=1)]
    report = check("jagged", lengths=lengths, heads=case.heads, head_dim=case.head_dim,
                   dtype=getattr(torch, case.dtype), causal=case.causal, window=case.window,
                   broadcast_q=case.broadcast_q, compile=False, live=True)
    return {"check": report, "rows": _time_jagged_case(case)}


class Sweep:
    """A panel of controls over a plot redrawn in place (an ipywidgets Output whose content is
    replaced, never appended to). `refresh()` redraws with the controls' values and returns the
    figure; `figure` is the one shown; `points` caches measured points, so moving a control back
    costs no GPU time."""

    def __init__(self, controls: dict, render: Callable[..., tuple], header: str):
        import ipywidgets

        self.controls = controls
        self._render = render
        self.header = ipywidgets.HTML(f"<i>{_esc(header)}</i>")
        self.output = ipywidgets.Output()
        self.widget = ipywidgets.VBox([self.header, ipywidgets.HBox(list(controls.values()),
                                       layout=ipywidgets.Layout(flex_flow="row wrap")), self.output])
        self.figure = None
        self.points: dict = {}
        self.refresh()
        for control in controls.values():
            control.observe(lambda _change: self.refresh(), names="value")

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def status(self, text: str) -> None:
        """Show one line in place of the plot while the panel works (a live measurement)."""
        self.output.outputs = ({"output_type": "display_data", "data": _text_bundle(text), "metadata": {}},)

    def refresh(self):
        """Redraw with the controls' current values: the Output's content is replaced whole."""
        figure, parts = self._render(self, **self.values())
        bundles = ([figure_bundle(figure)] if figure is not None else []) + parts
        self.output.outputs = tuple({"output_type": "display_data", "data": b, "metadata": {}} for b in bundles)
        self.figure = figure
        return figure

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        title = self.figure.layout.title.text if self.figure is not None else "no figure"
        return f"sweep panel: {title}"


def _text_bundle(text: str, html_: str | None = None) -> dict:
    return {"text/plain": text, "text/html": html_ or f"<div>{_esc(text)}</div>"}


def _recorded_render(rec):
    """The recorded panel's render: the head-to-head's cases of one suite, TFLOP/s per provider."""
    import plotly.graph_objects as go

    from jfa.workbench.plots import PROVIDER_COLORS

    rows = _head_to_head_rows(rec)
    label = recorded_label(rec)

    def render(panel, suite, pass_, metric):
        chosen = [r for r in rows if r["suite"] == suite and r["pass"] == pass_]
        cases = list(dict.fromkeys(r["case"] for r in chosen))
        providers = list(dict.fromkeys(r["provider"] for r in chosen))
        by = {(r["case"], r["provider"]): r for r in chosen}
        fig = go.Figure()
        for p in providers:
            if metric == "speedup of jfa" and p == "jfa":
                continue
            values = [(by[(c, p)]["ms"] / by[(c, "jfa")]["ms"] if metric == "speedup of jfa" else by[(c, p)]["tflops"])
                      if (c, p) in by and (c, "jfa") in by else None for c in cases]
            fig.add_bar(name=p if metric != "speedup of jfa" else f"jfa vs {p}", x=cases, y=values,
                        marker_color=PROVIDER_COLORS.get(p))
        if metric == "speedup of jfa":
            fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
        fig.update_layout(title=f"{suite} {pass_}: {metric} (recorded)", barmode="group", height=380,
                          yaxis_title="x (peer time / jfa time)" if metric == "speedup of jfa" else "TFLOP/s",
                          margin=dict(l=60, r=20, t=50, b=60))
        table_html, table_text = _speed_table([r for r in rows if r["suite"] == suite])
        return fig, [_text_bundle(f"{label}\n{table_text}", f"<div><i>{_esc(label)}</i></div>{table_html}")]
    return rows, render


def _live_render(measure: Callable[[Case], dict]):
    """The live panel's render: each chosen L measured once (cached), TFLOP/s and error against L."""
    from plotly.subplots import make_subplots

    from jfa.workbench.plots import PROVIDER_COLORS

    def render(panel, lengths, sparsity, head_dim, dtype, causal, window, broadcast_q, batch, pass_):
        if not lengths:
            return None, [_text_bundle("choose at least one L")]
        points = {}  # L -> the measured point
        for length in sorted(lengths):
            case = Case(max_len=length, sparsity=sparsity, batch=batch, head_dim=head_dim, dtype=dtype,
                        causal=causal, window=window, q_len=broadcast_q)
            if case not in panel.points:
                panel.status(f"measuring {case.label} (a check, then the timings) ...")
                panel.points[case] = measure(case)
            points[length] = panel.points[case]
        fig = make_subplots(rows=1, cols=2, subplot_titles=(f"{pass_} TFLOP/s", "check: relative error"),
                            horizontal_spacing=0.12)
        xs = list(points)
        rows = {n: [r for r in point["rows"] if r["pass"] == pass_] for n, point in points.items()}
        for provider in dict.fromkeys(r["provider"] for mine in rows.values() for r in mine):
            ys = [next((r["tflops"] for r in rows[n] if r["provider"] == provider and r.get("ok")), None) for n in xs]
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=provider, row=1, col=1,
                            marker_color=PROVIDER_COLORS.get(provider))
        tensors = list(dict.fromkeys(c.name for point in points.values() for c in point["check"].tensors))
        for name in tensors:
            ys = [next((c.rel for c in points[n]["check"].tensors if c.name == name), None) for n in xs]
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=f"{name} rel err", row=1, col=2)
        fig.add_hline(y=specs.GRAD_RELERR, line_dash="dot", line_color="gray", row=1, col=2)
        fig.update_yaxes(type="log", row=1, col=2)
        fig.update_xaxes(title_text="L (longest sequence)", type="log", row=1, col=1)
        fig.update_xaxes(title_text="L", type="log", row=1, col=2)
        options = f"s={sparsity}, B={batch}, D={head_dim}, {dtype}" + (", causal" if causal else "") + (
            f", window={window}" if window else "") + (f", broadcast-Q q={broadcast_q}" if broadcast_q else "")
        fig.update_layout(title=f"live: {options}", height=420, margin=dict(l=60, r=20, t=70, b=60))
        verdicts = "; ".join(f"L={n}: {'pass' if point['check'].passed else 'FAIL'}" for n, point in points.items())
        notes = sorted({f"{r['provider']}: {r['error'][:NOTE_CHARS]}" for mine in rows.values() for r in mine
                        if not r.get("ok") and r.get("error")})
        return fig, [_text_bundle("checks (kernel against the fp32 reference, small batch): " + verdicts
                                  + "".join(f"\n{n}" for n in notes))]
    return render


def sweep(results=None, *, live: bool | None = None, measure: Callable[[Case], dict] | None = None,
          lengths: tuple = (1024, 2048), batch: int = specs.GEM_BATCH) -> Sweep | Report:
    """A panel that sweeps shapes and options. On a Hopper GPU: L (several at once), sparsity, head
    dim, dtype, causal, window, broadcast-Q and batch as controls, starting at `lengths` and `batch`
    (the panel measures its first points as it opens); each point is checked against the reference (a
    small batch) and timed against FA4 and FA2 where they are installed, then TFLOP/s and the check's
    error are plotted against L, redrawn in place. Elsewhere: the recorded head-to-head's suite cases
    (suite, pass, TFLOP/s or speedup), labelled recorded. `measure` replaces the live measurement of
    one `Case` (it returns {"check": CheckReport, "rows": [...]})."""
    import ipywidgets

    unknown = [length for length in lengths if length not in SWEEP_LENGTHS]
    if not lengths or unknown:
        raise ValueError(f"lengths: a non-empty tuple of {SWEEP_LENGTHS}, got {lengths!r}")
    if batch not in SWEEP_BATCH_CHOICES:
        raise ValueError(f"batch: one of {SWEEP_BATCH_CHOICES}, got {batch!r}")
    if _live(live):
        dropdown = dict(layout=ipywidgets.Layout(width="180px"))
        controls = {
            "lengths": ipywidgets.SelectMultiple(options=SWEEP_LENGTHS, value=tuple(lengths), description="L",
                                                 rows=len(SWEEP_LENGTHS)),
            "sparsity": ipywidgets.Dropdown(options=(0.5, 1.0), value=0.5, description="s", **dropdown),
            "head_dim": ipywidgets.Dropdown(options=specs.SUPPORTED_HEAD_DIMS, value=128, description="D",
                                            **dropdown),
            "dtype": ipywidgets.Dropdown(options=("bfloat16", "float16"), value="bfloat16", description="dtype",
                                         **dropdown),
            "causal": ipywidgets.Checkbox(value=False, description="causal"),
            "window": ipywidgets.Dropdown(options=(("none", None), ("128", 128), ("512", 512)), value=None,
                                          description="window", **dropdown),
            "broadcast_q": ipywidgets.Dropdown(options=(("off", None), ("q=64", 64), ("q=256", 256)), value=None,
                                               description="broadcast-Q", **dropdown),
            "batch": ipywidgets.Dropdown(options=SWEEP_BATCH_CHOICES, value=batch, description="B",
                                         **dropdown),
            "pass_": ipywidgets.ToggleButtons(options=("fwd", "bwd"), value="fwd", description="pass"),
        }
        header = (f"measured live on {machine().why}: each point checked against the fp32 reference and timed "
                  "(peers through jfa.workbench.providers, where installed)")
        return Sweep(controls, _live_render(measure or _measure_point), header)
    rec = _newest_head_to_head(_results_dir(results))
    if rec is None:
        line = (f"{machine().line} No recorded head-to-head in {_results_dir(results)} to show instead"
                if _results_dir(results) else f"{machine().line} Pass results= to show the recorded runs")
        return _Line(line)
    rows, render = _recorded_render(rec)
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    controls = {
        "suite": ipywidgets.Dropdown(options=suites, value="gem" if "gem" in suites else suites[0],
                                     description="suite"),
        "pass_": ipywidgets.ToggleButtons(options=("fwd", "bwd"), value="fwd", description="pass"),
        "metric": ipywidgets.ToggleButtons(options=("TFLOP/s", "speedup of jfa"), value="TFLOP/s",
                                           description="show"),
    }
    header = f"{machine().line} Shown: {recorded_label(rec)}."
    return Sweep(controls, render, header)


class _Line(Report):
    def __init__(self, line: str):
        self.line = line

    def headline(self) -> str:
        return self.line

    def sections(self) -> list[Section]:
        return []


# ==== try_fork ============================================================================================
def _cpu_checks(variant, params: tuple) -> list[tuple[str, bool | None, str]]:
    """The variant's own CPU checks: (what, passed or None where it does not apply, message)."""
    out = []
    fork = variant.fork
    if fork.score_mod is not None:
        try:
            variant.check_score_grad(params=params)
            out.append(("score_grad is the derivative of score_mod (central differences, float64)", True, "ok"))
        except Exception as exc:  # the check's own message says what is wrong
            out.append(("score_grad is the derivative of score_mod (central differences, float64)", False, str(exc)))
    if fork.block_mask is not None:  # over the lab's HEADS heads, which per-head params are sized for
        try:
            for block_m, block_n in BLOCK_MASK_CHECKS:
                variant.check_block_mask(BLOCK_MASK_CHECK_LENGTH, BLOCK_MASK_CHECK_LENGTH, params=params, heads=HEADS,
                                         block_m=block_m, block_n=block_n)
            out.append((f"block_mask never rules out a block that mask_mod sees ({BLOCK_MASK_CHECK_LENGTH} x "
                        f"{BLOCK_MASK_CHECK_LENGTH}, the kernels' tiles)", True, "ok"))
        except Exception as exc:
            out.append(("block_mask never rules out a block that mask_mod sees", False, str(exc)))
    operands = set(_fork_hooks(fork)) & {"value_shape", "load_values", "value_operand", "pv", "scale_output"}
    if operands:
        out.append((f"{', '.join(sorted(operands))}: the PyTorch reference does not model these hooks", None,
                    "only the GPU check (cosine and SQNR against the unforked math) tests them"))
    return out


def skipped_key_tiles(variant, params: tuple = (), length: int = SKIP_COUNT_LENGTH, block: int = 128,
                      causal: bool = False) -> float | None:
    """The fraction of a `length`-token sequence's key tiles (`block` x `block`, head 0) that the
    variant's block mask rules out, of those causal (if set) leaves: what the kernels skip. None
    without a block mask."""
    from jfa.kernels.twin import TwinPointer, torch_twin

    if variant.fork.block_mask is None:
        return None
    twin = torch_twin(variant.fork.block_mask)
    twin_params = tuple(TwinPointer(p.cpu()) if torch.is_tensor(p) else p for p in params)
    tiles = skipped = 0
    for q_lo in range(0, length, block):
        for k_lo in range(0, length, block):
            if causal and k_lo > q_lo + block - 1:
                continue
            tiles += 1
            skipped += not bool(twin(0, 0, q_lo, q_lo + block - 1, k_lo, k_lo + block - 1, twin_params))
    return skipped / max(tiles, 1)


def _reference_change(variant, params: tuple, causal: bool, window) -> tuple[float, float]:
    """(max |variant - plain|, max |plain|) of the PyTorch references on a small CPU batch: whether the
    hooks change the math at all (no kernel involved)."""
    from jfa import reference

    params = _on(params, "cpu")
    gen = torch.Generator().manual_seed(0)
    lengths = (1, 100, 600)
    off = _offsets(lengths, "cpu")
    q, k, v = (torch.randn(sum(lengths), HEADS, 64, generator=gen) for _ in range(3))
    mine = variant.reference(q, k, v, off, off, causal=causal, window=window, params=params)
    plain, _ = reference.jagged_attention_ref(q, k, v, off, off, causal=causal, window=window)
    return float((mine - plain).abs().max()), float(plain.abs().max())


class ForkReport(Report):
    """`try_fork`'s result: the fork's compile report, its correctness (`check`: live on a GPU; the
    CPU checks elsewhere), and on a GPU its speed against the unforked kernel and the peers."""

    def __init__(self, variant, compiled: CompileReport | None, check: CheckReport | None, cpu_checks: list,
                 speed: Benchmark | None, notes: list[str]):
        self.variant = variant
        self.compiled = compiled
        self.check = check
        self.cpu_checks = cpu_checks
        self.speed = speed
        self.notes = notes

    @property
    def passed(self) -> bool | None:
        """The live check's verdict; False where a CPU check or the compile fails; None otherwise."""
        if self.compiled is not None and not self.compiled.ok:
            return False
        if any(ok is False for _, ok, _ in self.cpu_checks):
            return False
        return None if self.check is None else self.check.passed

    def headline(self) -> str:
        checked = ("compiled and CPU-checked" if self.compiled is not None else "CPU-checked") + (
            "" if self.check is not None else "; the kernel check needs a Hopper GPU")
        verdict = {True: "passes its GPU check", False: "FAILS", None: checked}[self.passed]
        return f"fork {self.variant.name!r}: {verdict}"

    def sections(self) -> list[Section]:
        out = []
        if self.compiled is not None:
            out.append(Section("Compiled for sm_90", self.compiled.html(), repr(self.compiled)))
        if self.cpu_checks:
            rows = [[what, _verdict_html(ok, {True: "pass", False: "FAIL", None: "n/a"}[ok]), _esc(message)]
                    for what, ok, message in self.cpu_checks]
            out.append(Section("The variant's own checks (CPU, PyTorch twins of the hooks)",
                               _table_html(["check", "verdict", "message"], rows, align_right_from=9),
                               _table_text(["check", "verdict", "message"], rows)))
        if self.check is not None:
            out.append(Section("Correctness of the kernel", self.check.html(), repr(self.check)))
        if self.notes:
            out.append(Section("", "".join(f"<div>{_esc(n)}</div>" for n in self.notes), "\n".join(self.notes)))
        if self.speed is not None:
            section = self.speed.sections()[0]
            out.append(Section(f"Speed, {self.speed.source}", section.html, section.text, section.figures))
        return out


def try_fork(variant, params: tuple = (), *, head_dim: int = HEAD_DIM, dtype=torch.bfloat16, causal: bool = False,
             window: int | None = None, broadcast_q: bool = False, cases: Iterable[Case] | None = None,
             kernels: Iterable[str] | None = None, compile: bool = True, results=None,
             live: bool | None = None) -> ForkReport:
    """One call for a fork exercise: `variant` (a `jfa.variant(...)`) with its `params`.

    Returns its compile report (registers, spills and shared memory of its forward, dQ and dK/dV
    kernels for sm_90, next to the unforked kernels' spills); its own CPU checks (score_grad against
    score_mod's derivative, the block mask against the mask; with a block mask, the share of key tiles
    it skips); on a Hopper GPU its check against its reference (forward and backward, fresh inputs)
    and its speed against jfa.jagged_attention and the peers on `cases` (one GEM-like batch by
    default), plotted. Without a GPU it says that the kernel check and the speed need one."""
    from jfa.variants import Variant

    if not isinstance(variant, Variant):
        raise TypeError(f"variant: expected a jfa.variant(...), got {type(variant).__name__}")
    params = tuple(params)
    m = machine()
    compiled = None
    if compile and m.compiles:
        compiled = compile_kernels(variant, head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                                   broadcast_q=broadcast_q, params=params, kernels=kernels, baseline=True)
    cpu = _cpu_checks(variant, params)
    notes = []
    skipped = skipped_key_tiles(variant, params, causal=causal)
    if skipped is not None:
        notes.append(f"The block mask rules out {skipped:.0%} of the 128 x 128 key tiles of a {SKIP_COUNT_LENGTH}-"
                     "token sequence (head 0): the kernels neither load nor compute those.")
    if variant.fork.score_mod is not None or variant.fork.mask_mod is not None:
        change, scale = _reference_change(variant, params, causal, window)
        notes.append(f"What the hooks change (PyTorch references only, no kernel involved): max |variant - plain "
                     f"attention| = {change:.3g} (outputs up to {scale:.3g})"
                     + ("; the hooks change nothing here" if change == 0 else "") + ".")
    live_ = _live(live)
    check_report = speed = None
    if live_:
        check_report = check(variant, head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                             broadcast_q=broadcast_q, params=params, compile=False, live=True)
        if cases is None:  # one GEM-like batch with the options of this call
            cases = (Case(head_dim=head_dim, dtype=str(dtype).replace("torch.", ""), causal=causal, window=window,
                          q_len=64 if broadcast_q else None),)
        speed = benchmark(variant, params=params, cases=cases, live=True)
    else:
        notes.append(f"The kernel check and the speed need a Hopper GPU with TLX ({m.why}).")
    return ForkReport(variant, compiled, check_report, cpu, speed, notes)


# ==== write_up ============================================================================================
class WriteUp(Report):
    """The written page: its path and size; shows a one-line summary and the page's sections."""

    def __init__(self, path: Path, title: str, parts: list[tuple[str, str]]):
        self.path = path
        self.title = title
        self.parts = parts

    def headline(self) -> str:
        return f"wrote {self.path} ({self.path.stat().st_size / 1e6:.1f} MB, opens in a browser with no server)"

    def sections(self) -> list[Section]:
        return [Section("", "<ul>" + "".join(f"<li>{_esc(h)}</li>" for h, _ in self.parts) + "</ul>",
                        "\n".join(f"- {h}" for h, _ in self.parts))]


PAGE_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#1f2328}
h1{font-size:26px}h2{font-size:19px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
pre{overflow-x:auto}"""


def _environment_section() -> tuple[str, str]:
    from jfa.workbench.envinfo import environment

    env = environment()
    rows = [[key, _esc(value if value is not None else "-")] for key, value in env.items()]
    return "Environment (where this page was written)", _table_html(["", ""], rows, align_right_from=9)


def _section_html(obj) -> tuple[str, str]:
    """(heading, html) of a write-up section: a report, a figure, (heading, text) or (heading, object)."""
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str):
        heading, body = obj
        if isinstance(body, str):
            return heading, "".join(f"<p>{_esc(p)}</p>" for p in body.split("\n\n"))
        return heading, _section_html(body)[1]
    if isinstance(obj, Report):
        return obj.headline(), obj.html(figures=True, headline=False)
    if hasattr(obj, "to_plotly_json"):
        return (obj.layout.title.text or "figure"), _figure_div(obj)
    if hasattr(obj, "_repr_html_"):
        return type(obj).__name__, obj._repr_html_()
    raise TypeError(f"write_up: a section is a report of this module, a plotly figure, an object with _repr_html_, "
                    f"or (heading, text); got {type(obj).__name__}")


def write_up(path, *, title: str, variant=None, params: tuple = (), summary: str = "", check: Report | None = None,
             bench: Benchmark | None = None, cases: Iterable[Case] | None = None, results=None,
             sections: Iterable = (), live: bool | None = None) -> WriteUp:
    """Write a self-contained HTML page of an experiment to `path`: plotly.js inline, no network, so it
    opens from disk in any browser. It holds `summary` (paragraphs), the variant's code (the source
    of each hook it replaces), its check (`check`, e.g. a `try_fork` or `check` report; by default
    the live check on a GPU, the variant's CPU checks elsewhere), the benchmark against the unforked
    kernel and the peers over `cases` with its plots (`bench`, or `benchmark(variant, ...)`: live
    on a GPU, the recorded numbers elsewhere), `sections` (reports, figures or (heading, text)),
    and the environment block. Returns the `WriteUp`; keep the file out of git."""
    from plotly.offline import get_plotlyjs

    path = Path(path)
    parts: list[tuple[str, str]] = []
    if summary:
        parts.append(("Summary", "".join(f"<p>{_esc(p)}</p>" for p in summary.split("\n\n"))))
    if variant is not None:
        parts.append((f"The variant {variant.name!r}: its hooks", show(variant).html(headline=False)))
        if check is None:
            if _live(live):
                check = check_fn(variant, params=params, live=True, compile=False)
            else:
                check = ForkReport(variant, None, None, _cpu_checks(variant, tuple(params)), None,
                                   [f"The kernel check needs a Hopper GPU ({machine().why})."])
    if check is not None:
        parts.append((f"Correctness: {check.headline()}", check.html(figures=True, headline=False)))
    if bench is None and (variant is not None or cases is not None):
        bench = benchmark(variant, params=params, cases=cases, results=results, live=live)
    if bench is not None:
        parts.append((f"Speed: {bench.source}", bench.html(figures=True, headline=False)))
    parts += [_section_html(s) for s in sections]
    parts.append(_environment_section())
    body = "\n".join(f"<h2>{_esc(h)}</h2>\n{content}" for h, content in parts)
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
            f"<style>{PAGE_STYLE}</style>\n<script type=\"text/javascript\">{get_plotlyjs()}</script>\n</head>"
            f"<body><h1>{_esc(title)}</h1>\n{body}\n</body></html>\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return WriteUp(path, title, parts)


check_fn = check  # write_up's own `check` argument shadows the function inside it
