"""`python -m jfa report RUN.json [RUN.json ...] -o REPORT.html`: one self-contained HTML page.

Per suite: TFLOP/s per case and provider for each pass, the speedup of jfa over each peer, and a
roofline (the bf16 GEMM ceiling and the copy-bandwidth roof at the case's arithmetic intensity). Then
the environment of every input file and the rows that failed, with their errors. plotly.js is loaded
from its CDN once (`include_plotlyjs="cdn"`), not embedded, which keeps the page small.
"""
from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

from jfa import specs
from jfa.workbench import plots

ENV_KEYS = ("gpu", "sm", "driver", "cuda", "torch", "triton", "tlx", "fa4", "python", "commit", "date", "host")
# auto-fill, not auto-fit: a figure is drawn as soon as it is parsed, and with auto-fit the first one
# would be drawn across the whole page width before its neighbours exist.
PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }
table { border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; display: block; overflow-x: auto; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1em; }
.grid > div { min-width: 0; }
"""


class ResultsError(ValueError):
    """A results file that cannot be read; the message names the file and what is wrong."""


def load_results(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not isinstance(data.get("env"), dict):
        raise ResultsError(f"{path}: not a jfa bench file (expected {{'env': {{...}}, 'rows': [...]}})")
    return data


def merge_rows(results: list[tuple[Path, dict]]) -> list[dict]:
    """All rows; a (suite, case, provider, pass) seen again in a later file replaces the earlier one."""
    merged: dict[tuple, dict] = {}
    for path, data in results:
        for row in data["rows"]:
            merged[(row["suite"], row["case"], row["provider"], row["pass"])] = {**row, "file": Path(path).name}
    return list(merged.values())


def _table(header: list[str], body: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape('' if c is None else str(c))}</td>" for c in r) + "</tr>"
                   for r in body)
    return f"<table><tr>{head}</tr>{rows}</table>"


class _FigureWriter:
    """Figure divs; the first one carries the CDN <script> tag for plotly.js, the rest reuse it."""

    def __init__(self):
        self.count = 0

    def __call__(self, fig) -> str:
        include = "cdn" if self.count == 0 else False
        self.count += 1
        return fig.to_html(full_html=False, include_plotlyjs=include, config={"displaylogo": False, "responsive": True})


def _suite_order(rows: list[dict]) -> list[str]:
    present = {r["suite"] for r in rows}
    return [s for s in specs.BENCH_SUITES if s in present] + sorted(present - set(specs.BENCH_SUITES))


def _pass_order(rows: list[dict]) -> list[str]:
    present = {r["pass"] for r in rows}
    return [p for p in specs.BENCH_PASSES if p in present] + sorted(present - set(specs.BENCH_PASSES))


def suite_section(suite: str, rows: list[dict], figure) -> str:
    mine = [r for r in rows if r["suite"] == suite]
    parts = [f"<h2 id='suite-{html.escape(suite)}'>{html.escape(suite)}</h2>"]
    notes = sorted({n for r in mine for n in r["params"].get("notes", [])})
    if notes:
        parts.append("<p>Notes: " + "; ".join(html.escape(n) for n in notes) + "</p>")
    if not plots.ok_rows(mine):
        parts.append("<p>No successful rows.</p>")
        return "\n".join(parts)
    figures = []
    for pass_ in _pass_order(mine):
        if not plots.ok_rows(mine, pass_=pass_):
            continue
        figures.append(figure(plots.tflops_bar(mine, suite=suite, pass_=pass_)))
        if plots.speedups(mine, suite=suite, pass_=pass_):
            figures.append(figure(plots.speedup_bar(mine, suite=suite, pass_=pass_)))
        figures.append(figure(plots.roofline(mine, suite=suite, pass_=pass_)))
    parts.append("<div class='grid'>" + "".join(f"<div>{f}</div>" for f in figures) + "</div>")
    return "\n".join(parts)


def env_section(results: list[tuple[Path, dict]]) -> str:
    """One line per run that wrote rows: the file's first run, then each resumed run (jfa.workbench.bench)."""
    body = []
    for path, data in results:
        body.append([Path(path).name] + [data["env"].get(k) for k in ENV_KEYS])
        body += [[f"{Path(path).name} (rows {run['first_row']}+)"] + [run.get(k) for k in ENV_KEYS]
                 for run in data.get("resumed", [])]
    return "<h2 id='environment'>Environment</h2>" + _table(["file", *ENV_KEYS], body)


def failures_section(rows: list[dict]) -> str:
    failed = [r for r in rows if not r["ok"]]
    header = ["suite", "case", "provider", "pass", "error"]
    broken = [[r["suite"], r["case"], r["provider"], r["pass"], r["error"]] for r in failed
              if not str(r.get("error") or "").startswith("unavailable:")]
    missing = [[r["suite"], r["case"], r["provider"], r["pass"], r["error"]] for r in failed
               if str(r.get("error") or "").startswith("unavailable:")]
    parts = [f"<h2 id='failures'>Failed rows ({len(broken)})</h2>",
             _table(header, broken) if broken else "<p>None.</p>",
             f"<h2 id='unavailable'>Unavailable ({len(missing)})</h2>",
             _table(header, missing) if missing else "<p>None.</p>"]
    return "\n".join(parts)


def render(results: list[tuple[Path, dict]]) -> str:
    """The whole page as one HTML string."""
    rows = merge_rows(results)
    figure = _FigureWriter()
    suites = _suite_order(rows)
    toc = " | ".join(f"<a href='#suite-{html.escape(s)}'>{html.escape(s)}</a>" for s in suites)
    ok = sum(1 for r in rows if r["ok"])
    intro = (f"<p>{ok} of {len(rows)} rows ok, from {len(results)} file(s). TFLOP/s use "
             f"forward FLOPs 4&middot;H&middot;D&middot;&Sigma;(l<sub>q</sub>&middot;l<sub>k</sub>), backward "
             f"{specs.BWD_FLOP_FACTOR}&times; that; bwd time = (fwd+bwd) &minus; fwd. Speedup = peer time / "
             f"{specs.BENCH_BASELINE_PROVIDER} time. Roofs: {specs.H200_BF16_GEMM_TFLOPS:.0f} TFLOP/s bf16 GEMM, "
             f"{specs.H200_COPY_TBPS} TB/s copy.</p>")
    body = [f"<h1>jfa benchmark report</h1>{intro}<p>{toc} | <a href='#environment'>environment</a> | "
            f"<a href='#failures'>failures</a></p>"]
    body += [suite_section(s, rows, figure) for s in suites]
    body += [env_section(results), failures_section(rows)]
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>jfa benchmark report</title>"
            f"<style>{PAGE_STYLE}</style></head><body>" + "\n".join(body) + "</body></html>")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jfa report",
                                     description="Render jfa bench results JSON files as one HTML page.")
    parser.add_argument("results", nargs="+", type=Path, help="results JSON files written by `python -m jfa bench`")
    parser.add_argument("-o", "--output", type=Path, required=True,
                        help="HTML file to write")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = [(path, load_results(path)) for path in args.results]
    except ResultsError as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    page = render(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(page)
    print(f"report: wrote {args.output} ({len(page) // 1024} KB)", file=sys.stderr)
    return 0
