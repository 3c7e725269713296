"""CPU tests of jfa.workbench.plots and jfa.workbench.report, from the stored fake run
(tests/data/bench_fake_run.json)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jfa import specs
from jfa.workbench import plots, report

FIXTURE = Path(__file__).parent / "data" / "bench_fake_run.json"
REPORT_MAX_BYTES = 200 * 1024
PLOTLY_BUNDLE_MIN_BYTES = 1_000_000  # plotly.min.js is ~4 MB: a page this large embedded it


@pytest.fixture(scope="module")
def fake_run() -> dict:
    return json.loads(FIXTURE.read_text())


def row(case, provider, ms, *, pass_="fwd", flops=1e12, bytes_=1e10, ok=True, suite="gem"):
    return {"suite": suite, "case": case, "provider": provider, "pass": pass_, "ms": ms if ok else None,
            "tflops": specs.tflops(flops, ms) if ok else None, "ok": ok, "error": None if ok else "boom",
            "params": {"flops": flops, "bytes": bytes_}}


ROWS = [row("a", "jfa", 2.0), row("a", "fa2", 3.0), row("a", "fa4", 1.0), row("b", "fa2", 4.0), row("b", "jfa", 4.0),
        row("b", "fa4", 9.0, ok=False), row("a", "jfa", 5.0, pass_="bwd")]


# ---- figures ----------------------------------------------------------------------------------------
def test_tflops_bar_has_one_trace_per_provider_in_order():
    fig = plots.tflops_bar(ROWS, suite="gem", pass_="fwd")
    assert [t.name for t in fig.data] == ["jfa", "fa2", "fa4"]
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["jfa"].x) == ["a", "b"]
    assert list(by_name["jfa"].y) == [pytest.approx(500.0), pytest.approx(250.0)]  # 1e12 FLOP in 2 ms, 4 ms
    assert list(by_name["fa4"].y) == [pytest.approx(1000.0), None]  # the failed row is a gap, not a bar


def test_speedups_are_peer_time_over_jfa_time():
    assert plots.speedups(ROWS, suite="gem", pass_="fwd") == {"fa2": {"a": 1.5, "b": 1.0}, "fa4": {"a": 0.5}}
    fig = plots.speedup_bar(ROWS, suite="gem", pass_="fwd")
    assert [t.name for t in fig.data] == ["vs fa2", "vs fa4"]
    assert list(fig.data[0].y) == [1.5, 1.0]


def test_roofline_is_min_of_compute_and_bandwidth():
    fig = plots.roofline(ROWS, suite="gem", pass_="fwd", peak_tflops=800.0, bandwidth_tbps=4.0)
    roof = fig.data[0]
    for x, y in zip(roof.x, roof.y):
        assert y == pytest.approx(min(800.0, 4.0 * x))
    assert min(roof.y) < 800.0 and max(roof.y) == 800.0  # both roofs are on the plot
    points = {t.name: t for t in fig.data[1:]}
    assert list(points["jfa"].x) == [pytest.approx(100.0)] * 2  # 1e12 FLOP / 1e10 B


def test_warp_timeline_bars_span_start_to_end():
    fig = plots.warp_timeline([("load", 0, 10), {"role": "mma", "start": 5, "end": 30, "label": "S=QK"},
                               ("load", 12, 20)])
    load = next(t for t in fig.data if t.name == "load")
    assert list(load.base) == [0, 12] and list(load.x) == [10, 8]
    with pytest.raises(ValueError, match="end"):
        plots.warp_timeline([("load", 10, 5)])


def test_ring_depth_sweep_sorts_by_depth():
    fig = plots.ring_depth_sweep([("fwd", 3, 300.0), ("fwd", 2, 250.0), {"series": "bwd", "depth": 2, "value": 200.0}])
    fwd = next(t for t in fig.data if t.name == "fwd")
    assert list(fwd.x) == [2, 3] and list(fwd.y) == [250.0, 300.0]


def test_tile_cost_plots_the_fixed_length_cases_by_key_count():
    rows = [dict(case="kv=512", jfa_tflops=485.0, fa4_tflops=316.0), dict(case="kv=128", jfa_tflops=294.0,
                                                                         fa4_tflops=112.0),
            dict(case="kv~U[1,2048]", jfa_tflops=433.0, fa4_tflops=375.0)]
    fig = plots.tile_cost(rows, dense_tflops=611.0)
    assert [t.name for t in fig.data] == ["jfa", "fa4"]
    assert list(fig.data[0].x) == [128, 512] and list(fig.data[0].y) == [294.0, 485.0]
    assert fig.layout.shapes[0].y0 == 611.0
    assert len(plots.tile_cost([dict(case="kv=128", jfa_tflops=1.0)]).data) == 1  # no FA4 timing: no FA4 line


def test_clock_probe_plots_time_against_the_logged_clock():
    rows = [dict(i=0, ms=1.19), dict(i=1, ms=1.31, sm_clock_mhz_mean=1665, power_w_mean=303),
            dict(i=2, ms=1.42, sm_clock_mhz_mean=1545, power_w_mean=690)]
    fig = plots.clock_probe(rows)
    assert list(fig.data[0].x) == [1665, 1545] and list(fig.data[0].y) == [1.31, 1.42]  # unsampled row left out


def test_figures_from_the_stored_run(fake_run):
    rows = fake_run["rows"]
    assert len(plots.tflops_bar(rows, suite="gem", pass_="bwd").data) == 3
    assert set(plots.speedups(rows, suite="gem", pass_="fwd")) == {"fa2", "fa4"}


def test_no_default_title_is_cut(fake_run):
    """At plotly's default width (narrower than a JupyterLab cell) every default title fits."""
    rows = fake_run["rows"]
    suites = {r["suite"] for r in rows}
    figures = [fn(rows, suite=suite, pass_=pass_) for fn in (plots.tflops_bar, plots.speedup_bar, plots.roofline)
               for suite in suites for pass_ in ("fwd", "bwd")]
    figures += [plots.warp_timeline([("load", 0, 1)]), plots.ring_depth_sweep([("fwd", 2, 1.0)]),
                plots.tile_cost([dict(case="kv=128", jfa_tflops=1.0)]), plots.clock_probe([])]
    for fig in figures:
        assert plots.overflowing_titles(fig) == [], fig.layout.title.text


def test_overflowing_titles_finds_a_long_title_and_crowded_subplot_titles():
    from plotly.subplots import make_subplots

    assert plots.overflowing_titles(plots.tflops_bar(ROWS, title="x" * 80)) == ["x" * 80]
    crowded = make_subplots(rows=1, cols=3, subplot_titles=["a name of thirty-five characters ok"] * 3)
    assert len(plots.overflowing_titles(crowded)) == 3
    assert plots.overflowing_titles(make_subplots(rows=1, cols=3, subplot_titles=["short"] * 3)) == []


# ---- the HTML report ----------------------------------------------------------------------------------
def test_report_page_from_the_stored_run(tmp_path, fake_run):
    out = tmp_path / "report.html"
    assert report.main([str(FIXTURE), "-o", str(out)]) == 0
    page = out.read_text()
    # gem: fwd and bwd, each TFLOP/s + speedup + roofline; pma: fwd only
    assert page.count('class="plotly-graph-div"') == 3 * 2 + 3
    assert len(re.findall(r'<script[^>]+src="https://cdn\.plot\.ly/plotly-[^"]+\.min\.js"', page)) == 1
    assert len(page.encode()) < REPORT_MAX_BYTES < PLOTLY_BUNDLE_MIN_BYTES
    for value in fake_run["env"].values():
        assert str(value) in page
    assert "unavailable: fa3: `import flash_attn_interface` failed" in page
    assert "wrong output: 12 of 3145728" in page and "&lt;script&gt;" in page  # errors are escaped, not markup
    assert "Q expanded B times" in page


def test_report_lists_every_run_of_a_resumed_file(fake_run):
    resumed = dict(fake_run, resumed=[dict(fake_run["env"], commit="c0ffee1", first_row=2)])
    page = report.env_section([(FIXTURE, resumed)])
    assert f"{FIXTURE.name} (rows 2+)" in page and "c0ffee1" in page


def test_later_file_replaces_the_same_row(tmp_path, fake_run):
    newer = dict(fake_run, rows=[dict(fake_run["rows"][0], ms=123.0)])
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(newer))
    merged = report.merge_rows([(FIXTURE, fake_run), (path, newer)])
    assert len(merged) == len(fake_run["rows"])
    first = fake_run["rows"][0]
    match = [r for r in merged if (r["suite"], r["case"], r["provider"], r["pass"]) ==
             (first["suite"], first["case"], first["provider"], first["pass"])]
    assert [r["ms"] for r in match] == [123.0] and match[0]["file"] == "newer.json"


@pytest.mark.parametrize("content, message", [(None, "no such file"), ("{not json", "not JSON"),
                                              ('{"rows": []}', "not a jfa bench file")])
def test_report_rejects_bad_inputs(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert report.main([str(path), "-o", str(tmp_path / "r.html")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_report_needs_a_file(capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main([])
    assert exit_info.value.code == 2
