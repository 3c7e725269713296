"""Plotly figures for benchmark rows and kernel traces, shared by the notebooks and `python -m jfa report`.

Every function takes plain data (rows of a results JSON, or small record lists) and returns a
`plotly.graph_objects.Figure`, so it works from stored JSON on a machine without a GPU. Rows are the
`jfa.workbench.bench` format: {"suite", "case", "provider", "pass", "ms", "tflops", "ok", "error", "params"}.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

import plotly.graph_objects as go

from jfa import specs

# A small template of our own: the stock ones repeat ~8 KB of styling inside every figure's JSON,
# which a report of dozens of figures would pay again and again.
_AXIS = dict(showline=True, linecolor="black", ticks="outside", gridcolor="#e5e5e5")
# Titles start at the left, as in the notebooks' plotly_white: a centred long title runs under the
# mode bar plotly shows at the top right.
FIGURE_TEMPLATE = go.layout.Template(layout=dict(plot_bgcolor="white", title=dict(x=0.05), xaxis=_AXIS,
                                                 yaxis=dict(_AXIS, showgrid=True)))
# One color per provider in every figure, so jfa is the same blue in all of them.
COLORWAY = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
PROVIDER_COLORS = dict(zip(specs.BENCH_PROVIDERS, COLORWAY))
FIGURE_HEIGHT = 420
ROOFLINE_POINTS = 64  # samples of the roof curve across the plotted intensity range
ROOFLINE_MARGIN = 2.0  # the roof is drawn this factor beyond the smallest and largest intensity


def _provider_order(providers: Iterable[str]) -> list[str]:
    """Providers in specs.BENCH_PROVIDERS order, unknown names after them alphabetically."""
    known = [p for p in specs.BENCH_PROVIDERS if p in providers]
    return known + sorted(set(providers) - set(known))


def ok_rows(rows: Iterable[Mapping], *, suite: str | None = None, pass_: str | None = None) -> list[Mapping]:
    """The successful rows, optionally of one suite and one pass."""
    return [r for r in rows if r.get("ok") and (suite is None or r["suite"] == suite)
            and (pass_ is None or r["pass"] == pass_)]


def _cases_in_order(rows: Sequence[Mapping]) -> list[str]:
    return list(dict.fromkeys(r["case"] for r in rows))


def _finish(fig: go.Figure, title: str, legend: str = "provider", **layout) -> go.Figure:
    fig.update_layout(title=title, template=FIGURE_TEMPLATE, height=FIGURE_HEIGHT, legend_title_text=legend,
                      margin=dict(l=60, r=20, t=50, b=80), **layout)
    return fig


def tflops_bar(rows: Iterable[Mapping], *, suite: str | None = None, pass_: str = "fwd",
               title: str | None = None) -> go.Figure:
    """Grouped bars: TFLOP/s of each provider on each case of one pass."""
    picked = ok_rows(rows, suite=suite, pass_=pass_)
    cases = _cases_in_order(picked)
    fig = go.Figure()
    for provider in _provider_order({r["provider"] for r in picked}):
        by_case = {r["case"]: r for r in picked if r["provider"] == provider}
        fig.add_bar(name=provider, x=cases, marker_color=PROVIDER_COLORS.get(provider),
                    y=[by_case[c]["tflops"] if c in by_case else None for c in cases],
                    customdata=[by_case[c]["ms"] if c in by_case else None for c in cases],
                    hovertemplate="%{x}<br>%{y:.1f} TFLOP/s<br>%{customdata:.3f} ms<extra>" + provider + "</extra>")
    return _finish(fig, title or f"{suite or 'all suites'}: {pass_} TFLOP/s", barmode="group",
                   yaxis_title="TFLOP/s", xaxis_title="case")


def speedups(rows: Iterable[Mapping], *, suite: str | None = None, pass_: str = "fwd",
             baseline: str = specs.BENCH_BASELINE_PROVIDER) -> dict[str, dict[str, float]]:
    """{peer: {case: peer_ms / baseline_ms}}: above 1 means the baseline is faster on that case."""
    picked = ok_rows(rows, suite=suite, pass_=pass_)
    base = {r["case"]: r["ms"] for r in picked if r["provider"] == baseline}
    result: dict[str, dict[str, float]] = {}
    for r in picked:
        if r["provider"] != baseline and r["case"] in base:
            result.setdefault(r["provider"], {})[r["case"]] = r["ms"] / base[r["case"]]
    return result


def speedup_bar(rows: Iterable[Mapping], *, suite: str | None = None, pass_: str = "fwd",
                baseline: str = specs.BENCH_BASELINE_PROVIDER, title: str | None = None) -> go.Figure:
    """Speedup of `baseline` over each peer per case (peer time / baseline time), 1.0 marked."""
    rows = list(rows)
    ratio = speedups(rows, suite=suite, pass_=pass_, baseline=baseline)
    cases = _cases_in_order(ok_rows(rows, suite=suite, pass_=pass_))
    fig = go.Figure()
    for peer in _provider_order(ratio):
        fig.add_bar(name=f"vs {peer}", x=cases, marker_color=PROVIDER_COLORS.get(peer),
                    y=[ratio[peer].get(c) for c in cases],
                    hovertemplate="%{x}<br>%{y:.2f}x<extra>" + baseline + " vs " + peer + "</extra>")
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    default_title = f"{suite or 'all suites'}: {pass_} speedup of {baseline} (peer time / {baseline} time)"
    return _finish(fig, title or default_title,
                   barmode="group", yaxis_title="speedup (x)", xaxis_title="case")


def roofline(rows: Iterable[Mapping], *, suite: str | None = None, pass_: str = "fwd",
             peak_tflops: float = specs.H200_BF16_GEMM_TFLOPS, bandwidth_tbps: float = specs.H200_COPY_TBPS,
             title: str | None = None) -> go.Figure:
    """TFLOP/s against arithmetic intensity (params.flops / params.bytes), under the two roofs.

    Roofs: the dense bf16 GEMM rate and the copy bandwidth times the intensity (TB/s x FLOP/B =
    TFLOP/s); a point near the slanted roof is memory-bound, near the flat one compute-bound.
    """
    picked = [r for r in ok_rows(rows, suite=suite, pass_=pass_) if r["params"].get("bytes")]
    fig = go.Figure()
    intensities = [r["params"]["flops"] / r["params"]["bytes"] for r in picked]
    lo = min(intensities, default=1.0) / ROOFLINE_MARGIN
    hi = max(intensities + [peak_tflops / bandwidth_tbps], default=1.0) * ROOFLINE_MARGIN
    xs = [lo * (hi / lo) ** (i / (ROOFLINE_POINTS - 1)) for i in range(ROOFLINE_POINTS)]
    fig.add_scatter(x=xs, y=[min(peak_tflops, bandwidth_tbps * x) for x in xs], mode="lines", name="roofline",
                    line=dict(color="black"),
                    hovertemplate=f"min({peak_tflops:.0f} TFLOP/s, {bandwidth_tbps} TB/s x intensity)<extra></extra>")
    for provider in _provider_order({r["provider"] for r in picked}):
        mine = [(r, ai) for r, ai in zip(picked, intensities) if r["provider"] == provider]
        fig.add_scatter(x=[ai for _, ai in mine], y=[r["tflops"] for r, _ in mine], mode="markers", name=provider,
                        marker=dict(color=PROVIDER_COLORS.get(provider), size=9), text=[r["case"] for r, _ in mine],
                        hovertemplate="%{text}<br>%{x:.0f} FLOP/B<br>%{y:.1f} TFLOP/s<extra>" + provider + "</extra>")
    return _finish(fig, title or f"{suite or 'all suites'}: {pass_} roofline", xaxis_type="log", yaxis_type="log",
                   xaxis_title="arithmetic intensity (FLOP per byte of compulsory traffic)", yaxis_title="TFLOP/s")


def _records(records: Iterable, fields: Sequence[str]) -> list[dict]:
    """Accept dicts or tuples in `fields` order."""
    out = []
    for rec in records:
        out.append(dict(rec) if isinstance(rec, Mapping) else dict(zip(fields, rec)))
    return out


def warp_timeline(records: Iterable, *, title: str = "warp-role timeline", time_unit: str = "cycles") -> go.Figure:
    """Gantt chart of warp-role activity: records are (role, start, end[, label]) tuples or dicts.

    One row per role (in first-seen order), one bar per record spanning start..end.
    """
    recs = _records(records, ("role", "start", "end", "label"))
    for rec in recs:
        if rec["end"] < rec["start"]:
            raise ValueError(f"records: end ({rec['end']}) before start ({rec['start']}) for role {rec['role']!r}")
    roles = list(dict.fromkeys(r["role"] for r in recs))
    fig = go.Figure()
    for role in roles:
        mine = [r for r in recs if r["role"] == role]
        fig.add_bar(name=role, orientation="h", y=[role] * len(mine), base=[r["start"] for r in mine],
                    x=[r["end"] - r["start"] for r in mine], text=[r.get("label") or "" for r in mine],
                    hovertemplate="%{y} %{text}<br>%{base} .. %{x}<extra></extra>")
    return _finish(fig, title, barmode="overlay", xaxis_title=time_unit, yaxis_title="role",
                   yaxis=dict(categoryorder="array", categoryarray=roles[::-1]), legend="role")


def ring_depth_sweep(records: Iterable, *, title: str = "K/V ring depth sweep", y_title: str = "TFLOP/s"
                     ) -> go.Figure:
    """Lines of a metric against ring depth: records are (series, depth, value) tuples or dicts."""
    recs = _records(records, ("series", "depth", "value"))
    fig = go.Figure()
    for series in dict.fromkeys(r["series"] for r in recs):
        mine = sorted((r for r in recs if r["series"] == series), key=lambda r: r["depth"])
        fig.add_scatter(x=[r["depth"] for r in mine], y=[r["value"] for r in mine], mode="lines+markers",
                        name=str(series))
    return _finish(fig, title, xaxis_title="ring depth (stages)", yaxis_title=y_title, legend="series",
                   xaxis=dict(dtick=1))


def tile_cost(rows: Iterable[Mapping], *, dense_tflops: float | None = None,
              title: str = "Forward, broadcast-Q q=256: every sequence the same KV length") -> go.Figure:
    """TFLOP/s of jfa (and FA4 where timed) against the one KV length all sequences share.

    Rows are `scripts/fwd_tile_cost.py`'s: cases "kv=N" hold the FLOPs equal while the tiles grow,
    so the curve shows a tile's fixed cost fading and the steady rate it fades into;
    `dense_tflops` marks a dense rate for comparison.
    """
    fixed = sorted((r for r in rows if r["case"].startswith("kv=")), key=lambda r: int(r["case"][3:]))
    keys = [int(r["case"][3:]) for r in fixed]
    fig = go.Figure()
    for provider in ("jfa", "fa4"):
        if all(f"{provider}_tflops" in r for r in fixed):
            fig.add_scatter(x=keys, y=[r[f"{provider}_tflops"] for r in fixed], mode="lines+markers", name=provider,
                            marker_color=PROVIDER_COLORS.get(provider),
                            customdata=[r.get(f"{provider}_us_per_tile_per_sm") for r in fixed],
                            hovertemplate="%{x} keys<br>%{y:.0f} TFLOP/s<extra>" + provider + "</extra>")
    if dense_tflops is not None:
        fig.add_hline(y=dense_tflops, line_dash="dot", annotation_text="jfa, dense D=128")
    return _finish(fig, title, xaxis_title="keys per sequence (log scale)", yaxis_title="TFLOP/s",
                   xaxis=dict(type="log", tickvals=keys))


def clock_probe(rows: Iterable[Mapping], *, title: str = "Same kernel, same inputs: time against the SM clock"
                ) -> go.Figure:
    """Each timing of `scripts/clock_probe.py` at the mean SM clock nvidia-smi logged during it.

    Rows without clock samples (a timing shorter than the log's interval) are left out. Under a power
    cap the clock, not the code, sets how far apart repeated timings of one kernel land.
    """
    sampled = [r for r in rows if r.get("sm_clock_mhz_mean") is not None]
    fig = go.Figure()
    fig.add_scatter(x=[r["sm_clock_mhz_mean"] for r in sampled], y=[r["ms"] for r in sampled], mode="markers",
                    name="jfa", marker_color=PROVIDER_COLORS.get("jfa"),
                    customdata=[[r["i"], r.get("power_w_mean")] for r in sampled],
                    hovertemplate="timing %{customdata[0]}<br>%{x} MHz, %{customdata[1]} W<br>%{y:.3f} ms<extra></extra>")
    return _finish(fig, title, xaxis_title="mean SM clock during the timing (MHz)", yaxis_title="ms (do_bench median)")


# A notebook cell in JupyterLab is wider than plotly's default width, a report's column about as wide.
MIN_FIGURE_WIDTH = 700
CHAR_WIDTH_EM = 0.6  # the mean width of a character of plotly's default font, in font sizes
TITLE_FONT_SIZE = 17  # plotly's defaults, where a figure sets none
ANNOTATION_FONT_SIZE = 12


def _text_width(text: str, size: float) -> float:
    return max(len(re.sub(r"<[^>]+>", "", line)) for line in re.split(r"<br\s*/?>", text)) * size * CHAR_WIDTH_EM


def overflowing_titles(fig: go.Figure, width: int = MIN_FIGURE_WIDTH) -> list[str]:
    """The title and subplot titles of `fig` that would be cut at the figure's edge, or run into
    their neighbour, at `width` pixels (an estimate from the characters' count: plotly lays text
    out in the browser)."""
    layout = fig.layout
    width = layout.width or width
    margin_l = layout.margin.l if layout.margin.l is not None else 80
    margin_r = layout.margin.r if layout.margin.r is not None else 80
    plot_width = width - margin_l - margin_r
    cut = []
    title = layout.title.text or ""
    if title and _text_width(title, layout.title.font.size or TITLE_FONT_SIZE) > 0.95 * width:
        cut.append(title)
    centered = sorted((a for a in layout.annotations if a.xref == "paper" and a.xanchor == "center" and a.text),
                      key=lambda a: a.x)
    halves = [_text_width(a.text, (a.font.size if a.font and a.font.size else ANNOTATION_FONT_SIZE)) / 2
              for a in centered]
    for i, (a, half) in enumerate(zip(centered, halves)):
        room = min(a.x * plot_width + margin_l, (1 - a.x) * plot_width + margin_r)
        if i + 1 < len(centered):
            room = min(room, (centered[i + 1].x - a.x) * plot_width - halves[i + 1])
        if i > 0:
            room = min(room, (a.x - centered[i - 1].x) * plot_width - halves[i - 1])
        if half > room:
            cut.append(a.text)
    return cut
