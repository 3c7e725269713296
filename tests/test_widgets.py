"""jfa.workbench.widgets: the ring simulator, the budget calculator, recorded-results loading, the panels."""
import json
from pathlib import Path

import pytest

from jfa.specs import REGISTERS_PER_SM, SHARED_BYTES_PER_BLOCK, TMEM_COLUMNS
from jfa.workbench import widgets as jw

RESULTS = Path(__file__).resolve().parents[1] / "results"  # the checkout's recorded runs


# ---- ring ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("i,depth,expected", [(0, 3, (0, 0)), (2, 3, (2, 0)), (3, 3, (0, 1)), (7, 3, (1, 0)),
                                              (5, 1, (0, 1))])
def test_ring_slot_is_index_mod_depth_and_round_parity(i, depth, expected):
    assert jw.ring_slot(i, depth) == expected


@pytest.mark.parametrize("i,depth,name", [(0, 0, "depth"), (-1, 2, "tile index")])
def test_ring_slot_rejects_bad_input_by_name(i, depth, name):
    with pytest.raises(ValueError, match=name):
        jw.ring_slot(i, depth)


def test_mbarrier_fresh_barrier_reports_the_opposite_parity_complete():
    bar = jw._MBarrier(arrive_count=2)
    assert bar.try_wait(1) and not bar.try_wait(0)
    bar.arrive()
    assert not bar.try_wait(0), "one arrival of two must not complete the phase"
    bar.arrive()
    assert bar.try_wait(0) and not bar.try_wait(1)


@pytest.mark.parametrize("depth,load,compute", [(1, 2, 3), (2, 2, 3), (3, 4, 1), (4, 1, 5), (2, 3, 3), (4, 6, 1)])
def test_simulated_ring_respects_the_protocol(depth, load, compute):
    n = 9
    steps = jw.simulate_ring(n, depth, load, compute)
    loads = {s.tile: s for s in steps if s.action == "load"}
    computes = {s.tile: s for s in steps if s.action == "compute"}
    assert sorted(loads) == sorted(computes) == list(range(n))
    for i in range(n):
        slot, phase = jw.ring_slot(i, depth)
        assert (loads[i].slot, loads[i].parity) == (slot, phase ^ 1)
        assert (computes[i].slot, computes[i].parity) == (slot, phase)
        assert loads[i].end - loads[i].start == load and computes[i].end - computes[i].start == compute
        assert computes[i].start >= loads[i].end, "consumer read a slot before its data landed"
        if i >= depth:
            assert loads[i].start >= computes[i - depth].end, "producer overwrote a slot still in use"
    issues = [loads[i].start for i in range(n)]
    assert all(a < b for a, b in zip(issues, issues[1:])), "the producer issues one load per tick, in order"
    assert jw.loads_in_flight(steps) <= depth
    consumer = sorted((s for s in steps if s.role == "consumer"), key=lambda s: s.start)
    assert all(a.end <= b.start for a, b in zip(consumer, consumer[1:])), "the consumer does one thing at a time"
    waits = sorted((s for s in steps if s.role == "producer" and s.action == "wait"), key=lambda s: s.start)
    assert all(a.end <= b.start for a, b in zip(waits, waits[1:]))


def test_loads_overlap_up_to_the_ring_depth():
    """The producer does not wait for a load to land before issuing the next: with 3 free slots,
    3 loads are in flight at once."""
    steps = jw.simulate_ring(8, 3, load_ticks=4, compute_ticks=2)
    assert [s.start for s in steps if s.action == "load"][:3] == [0, 1, 2]
    assert jw.loads_in_flight(steps) == 3
    assert jw.loads_in_flight(jw.simulate_ring(8, 1, load_ticks=4, compute_ticks=2)) == 1


def test_depth_helps_while_loads_are_slower_than_compute_until_the_pipeline_is_full():
    """Loads of 4 ticks, compute of 2: each slot adds a load in flight, 1 < 2 < 3, until
    (load + compute) / compute = 3 slots keep the consumer busy; from there on depth buys nothing."""
    n, load, compute = 8, 4, 2
    ticks = {d: jw.ring_summary(jw.simulate_ring(n, d, load, compute))["ticks"] for d in (1, 2, 3, 4, 6)}
    assert ticks[1] > ticks[2] > ticks[3] == ticks[4] == ticks[6] == load + n * compute
    assert jw.ring_summary(jw.simulate_ring(n, 1, load, compute)) == {"ticks": 48, "producer_stalled": 35,
                                                                       "consumer_stalled": 32}
    assert jw.ring_summary(jw.simulate_ring(n, 3, load, compute))["consumer_stalled"] == load  # the first load only


def test_compute_bound_ring_needs_two_slots_and_no_more():
    """Loads of 2 ticks, compute of 3: double buffering hides every load but the first."""
    n, load, compute = 8, 2, 3
    ticks = {d: jw.ring_summary(jw.simulate_ring(n, d, load, compute))["ticks"] for d in (1, 2, 3, 4)}
    assert ticks[1] > ticks[2] == ticks[3] == ticks[4] == load + n * compute


@pytest.mark.parametrize("load,compute", [(1, 1), (2, 3), (4, 2), (6, 1), (5, 3)])
def test_ring_time_never_grows_with_depth_and_is_full_at_load_plus_compute_over_compute(load, compute):
    n = 10
    ticks = [jw.ring_summary(jw.simulate_ring(n, d, load, compute))["ticks"] for d in range(1, 10)]
    assert all(a >= b for a, b in zip(ticks, ticks[1:]))
    full = -(-(load + compute) // compute)  # ceil: the slots that cover one load and one compute
    assert ticks[full - 1] == load + n * compute
    if full > 1:
        assert ticks[full - 2] > ticks[full - 1], "one slot fewer must be slower"


def test_simulate_ring_rejects_non_positive_arguments():
    with pytest.raises(ValueError, match="compute_ticks"):
        jw.simulate_ring(4, 2, 1, 0)


def test_ring_trace_and_figure_render():
    steps = jw.simulate_ring(4, 2, 2, 3)
    text = jw.ring_trace_text(steps)
    assert "empty[0] parity 1 passed" in text and "blocked on full[0]" in text
    fig = jw.ring_figure(steps)
    assert {trace.name for trace in fig.data} == {"load", "compute", "wait", "issue"}
    assert list(fig.layout.yaxis.categoryarray) == ["consumer", "load, slot 1", "load, slot 0", "producer"]


# ---- budget -------------------------------------------------------------------------------------
def _by_resource(cfg):
    return {line.resource: line for line in jw.attention_budget(cfg)}


def test_hopper_budget_counts_tiles_rings_barriers_and_registers():
    lines = _by_resource(jw.AttentionConfig())  # 2 consumers x 64 rows, BLOCK_N = D = 128, 2 stages
    q, kv, barriers = 2 * 64 * 128 * 2, 2 * 2 * 128 * 128 * 2, (2 * 2 + 2 * 2 * 2) * 8
    assert lines["shared memory"].used == q + kv + barriers
    assert lines["shared memory"].limit == SHARED_BYTES_PER_BLOCK["sm_90"]
    assert lines["registers per SM"].used == 128 * 24 + 2 * 128 * 240
    assert lines["registers per SM"].limit == REGISTERS_PER_SM
    acc = lines["accumulator registers per consumer thread"]
    assert acc.used == (64 * 128 + 64 * 128 + 64 * 128 // 2) // 128 and acc.fits
    assert "tensor memory columns" not in lines


def test_blackwell_seed_uses_all_tmem_columns_and_256_rows_overflow_hopper_registers():
    seed = jw.AttentionConfig(arch="sm_100", block_m=256, kv_stages=3, shared_kv_ring=True, producer_warps=1)
    tmem = _by_resource(seed)["tensor memory columns"]
    assert (tmem.used, tmem.limit, tmem.fits) == (TMEM_COLUMNS, TMEM_COLUMNS, True)
    assert not _by_resource(jw.AttentionConfig(block_m=256))["accumulator registers per consumer thread"].fits
    assert not _by_resource(jw.AttentionConfig(kv_stages=4))["shared memory"].fits


def test_tmem_allocation_is_a_power_of_two_from_32():
    assert [jw._tmem_allocation(c) for c in (1, 32, 33, 200, 512)] == [32, 32, 64, 256, 512]


@pytest.mark.parametrize("kwargs,name", [
    (dict(arch="sm_80"), "arch"), (dict(block_m=0), "block_m"), (dict(block_m=128, consumer_groups=3), "block_m"),
    (dict(consumer_registers=100), "consumer_registers"), (dict(producer_registers=16), "producer_registers"),
])
def test_budget_rejects_impossible_configurations_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        jw.attention_budget(jw.AttentionConfig(**kwargs))


def test_budget_text_marks_overflow():
    text = jw.budget_text(jw.attention_budget(jw.AttentionConfig(kv_stages=4)))
    assert "OVER" in text.splitlines()[1] and "fits" in text.splitlines()[2]


# ---- recorded results ---------------------------------------------------------------------------
def _write(path, date, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": {"gpu": "NVIDIA H200", "date": date}, **extra}))
    return path


def test_newest_recorded_prefers_real_runs_then_the_newest(tmp_path):
    fixture = _write(tmp_path / "recorded" / "bench-a.json", "2030-01-01")
    assert jw.newest_recorded("bench-*.json", results_dir=tmp_path).path == fixture
    assert jw.newest_recorded("bench-*.json", results_dir=tmp_path).is_fixture
    _write(tmp_path / "bench-old.json", "2026-01-01")
    new = _write(tmp_path / "bench-new.json", "2026-06-01")
    (tmp_path / "bench-broken.json").write_text("{not json")
    found = jw.newest_recorded("bench-*.json", results_dir=tmp_path)
    assert found.path == new and not found.is_fixture
    assert jw.newest_recorded("gpu-tests-*.json", results_dir=tmp_path) is None


def test_newest_recorded_tests_skips_later_runs_of_other_tests(tmp_path):
    """A later recording of one suite only (e.g. the FP8 tests) does not hide the newest run of t01."""
    def write(name, date, tests):
        path = tmp_path / name
        path.write_text(json.dumps({"env": {"date": date}, "tests": [{"test": t, "outcome": "passed"} for t in tests]}))
        return path
    write("gpu-tests-a.json", "2026-01-01", ["tests/gpu/test_tutorials.py::test_run_check[t01]"])
    full = write("gpu-tests-b.json", "2026-02-01", ["tests/gpu/test_tutorials.py::test_run_check[t01]", "x"])
    write("gpu-tests-c-fp8.json", "2026-03-01", ["tests/gpu/test_fp8.py::test_edge_lengths"])
    assert jw.newest_recorded_tests("t01", results_dir=tmp_path).path == full
    assert jw.newest_recorded_tests("t99", results_dir=tmp_path) is None


def test_newest_recorded_filters_on_the_document(tmp_path):
    _write(tmp_path / "bench-1.json", "2026-06-01", rows=[{"suite": "pma", "ok": True}])
    _write(tmp_path / "bench-2.json", "2026-07-01", rows=[{"suite": "gem", "ok": True}])
    found = jw.newest_recorded("bench-*.json", results_dir=tmp_path,
                               where=lambda d: any(r["suite"] == "pma" for r in d["rows"]))
    assert found.path.name == "bench-1.json"


def test_recorded_tests_text_reports_outcomes_or_says_nothing_was_recorded(tmp_path):
    rec = jw.Recorded(_write(tmp_path / "gpu-tests-1.json", "2026-06-01",
                             tests=[{"test": "tests/gpu/test_tutorials.py::test_run[t01]", "outcome": "passed",
                                     "seconds": 1.5}]), None, False, tmp_path)
    rec.doc = json.loads(rec.path.read_text())
    assert "passed   tests/gpu/test_tutorials.py::test_run[t01]" in jw.recorded_tests_text(rec, "t01")
    assert jw.recorded_tests_text(rec, "t09").startswith(jw.NO_RECORDING)
    assert jw.recorded_tests_text(None, "t01").startswith(jw.NO_RECORDING)


def test_save_recording_round_trips_with_the_environment(tmp_path):
    path = jw.save_recording("t02-ring-sweep", {"rows": [{"NUM_STAGES": 2, "tbps": 1.0}]}, tmp_path)
    assert path.parent == tmp_path
    found = jw.newest_recorded("t02-ring-sweep-*.json", results_dir=tmp_path)
    assert found.doc["rows"][0]["NUM_STAGES"] == 2 and "torch" in found.env
    assert found.where == Path(tmp_path.name) / path.name


def test_recordings_go_where_jfa_results_dir_says(tmp_path, monkeypatch):
    monkeypatch.delenv("JFA_RESULTS_DIR", raising=False)
    assert jw.recordings_dir(tmp_path) == tmp_path
    monkeypatch.setenv("JFA_RESULTS_DIR", str(tmp_path / "out"))
    assert jw.recordings_dir(tmp_path) == tmp_path / "out"


def test_the_shipped_fixture_is_labeled_and_has_no_jfa_numbers():
    rec = jw.newest_recorded("bench-*.json", results_dir=RESULTS / "no-such-dir",
                             recorded_dir=RESULTS / jw.RECORDED_SUBDIR)
    assert rec is not None and rec.is_fixture and rec.doc["source"]
    assert all(r["provider"] != "jfa" for r in rec.doc["rows"])
    summary = jw.experiment_summary_markdown(rec, "gem", "fwd", ["jfa", "fa2", "fa4"])
    assert "| L=2048,s=1.0 | 346 | 525 |" in summary  # the anchors table, FA2 and FA4 forward
    assert f"`jfa` ({jw.NO_RECORDING})" in summary


def test_summary_without_recording_says_so():
    assert jw.NO_RECORDING in jw.experiment_summary_markdown(None, "gem", "fwd", ["jfa"])


# ---- panels -------------------------------------------------------------------------------------
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"


@pytest.fixture
def published(monkeypatch):
    """What a panel publishes, as a kernel would send it: an IPython shell whose display publisher
    records every output with its display id and whether it updates an earlier one."""
    pytest.importorskip("ipywidgets")
    pio = pytest.importorskip("plotly.io")
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # what jw.setup_notebook sets
    had_shell = InteractiveShell.initialized()
    shell = InteractiveShell.instance()
    saved, shell.display_pub = shell.display_pub, CapturingDisplayPublisher()
    try:
        yield shell.display_pub.outputs
    finally:
        shell.display_pub = saved
        if not had_shell:
            InteractiveShell.clear_instance()


def _panel_outputs(outputs):
    """The renders below the controls: every output must carry the panel's display id; a figure's
    update is preceded by a blank of its height (a new renderer for each figure in JupyterLab)."""
    rendered = [o for o in outputs if WIDGET_VIEW not in o["data"]]
    ids = {(o["transient"] or {}).get("display_id") for o in rendered}
    assert None not in ids and len(ids) == 1, f"a render went to an output of its own: {rendered}"
    renders = []
    for o in rendered:
        if "text/html" in o["data"] and 'style="height' in o["data"]["text/html"]:
            assert o["update"], "a blank is only ever an update"
            continue
        if renders and PLOTLY in o["data"]:
            blank = rendered[rendered.index(o) - 1]["data"]
            height = o["data"][PLOTLY]["layout"]["height"]
            assert blank.get("text/html") == f'<div style="height: {height}px"></div>', blank
        renders.append(o)
    return renders


def test_panel_renders_once_and_again_on_change(published):
    import ipywidgets

    slider = ipywidgets.IntSlider(value=2, min=1, max=5)
    calls = []

    def render(depth):
        calls.append(depth)
        return jw.Text(f"depth {depth}")

    refresh = jw.panel({"depth": slider}, render)
    slider.value = 4
    assert calls == [2, 4]
    assert refresh().text == "depth 4"
    rendered = _panel_outputs(published)
    assert [o["update"] for o in rendered] == [False, True, True]
    assert [o["data"]["text/plain"] for o in rendered] == ["depth 2", "depth 4", "depth 4"]


def test_ring_panel_replaces_its_figure_in_place(published):
    """Moving the depth slider republishes the chart under the panel's display id; a plotly figure
    displaying itself would make a new output instead (in JupyterLab: the Log Console)."""
    refresh = jw.ring_panel()
    assert any(WIDGET_VIEW in o["data"] for o in published), "the controls were not shown"
    refresh.controls["depth"].value = 3
    rendered = _panel_outputs(published)
    assert [o["update"] for o in rendered] == [False, True]
    titles = [o["data"][PLOTLY]["layout"]["title"]["text"] for o in rendered]
    assert titles[0].startswith("depth 2: 26 ticks") and titles[1].startswith("depth 3: 20 ticks")


def test_gem_sweep_panel_replaces_its_bars_in_place(published):
    refresh = jw.gem_sweep_panel(RESULTS)
    if refresh is None:
        pytest.skip("no recorded gem benchmark in results/")
    controls = refresh.controls
    controls["max_len"].value, controls["pass_"].value = 2048, "bwd"
    controls["max_len"].value = 256
    rendered = _panel_outputs(published)
    assert [o["update"] for o in rendered] == [False, True, True, True]
    last = rendered[-1]["data"]
    shown = last[PLOTLY]["layout"]["title"]["text"] if PLOTLY in last else last["text/plain"]
    assert "L=256" in shown and "bwd" in shown


def test_mime_bundle_of_a_figure_is_the_renderers_and_of_text_is_plain(monkeypatch):
    pio = pytest.importorskip("plotly.io")
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")
    data, _ = jw.mime_bundle(jw.ring_figure(jw.simulate_ring(3, 2)))
    assert list(data) == [PLOTLY]
    assert jw.mime_bundle(jw.Text("x")) == ({"text/plain": "x"}, {})


def test_budget_panel_shows_invalid_configurations_instead_of_raising():
    pytest.importorskip("ipywidgets")
    refresh = jw.budget_panel(block_m=64, consumer_groups=1)
    assert "shared memory" in refresh().text


# ---- notebook 04: the backward ------------------------------------------------------------------
def test_recompute_vs_store_counts_bytes_and_floors_by_hand():
    from jfa.specs import H200_BF16_GEMM_TFLOPS, H200_COPY_TBPS

    got = jw.recompute_vs_store([3, 5], [4, 2], heads=2, head_dim=8, p_element_bytes=2, lse_element_bytes=4)
    pairs = 3 * 4 + 5 * 2
    assert got["rows"] == 8 and got["pairs"] == pairs
    assert got["p_bytes"] == pairs * 2 * 2 and got["lse_bytes"] == 8 * 2 * 4
    assert got["p_over_lse"] == pytest.approx(pairs * 4 / 64)
    assert got["store_ms"] == pytest.approx(2 * pairs * 4 / (H200_COPY_TBPS * 1e12) * 1e3)
    assert got["recompute_ms"] == pytest.approx(2 * 8 * pairs * 2 / (H200_BF16_GEMM_TFLOPS * 1e12) * 1e3)


@pytest.mark.parametrize("name", ["heads", "head_dim", "p_element_bytes", "lse_element_bytes"])
def test_recompute_vs_store_rejects_bad_sizes_by_name(name):
    kwargs = dict(heads=1, head_dim=8, p_element_bytes=2, lse_element_bytes=4)
    kwargs[name] = 0
    with pytest.raises(ValueError, match=name):
        jw.recompute_vs_store([1], [1], **kwargs)


def test_schedule_figure_titles_fit_their_columns():
    from jfa.workbench.plots import overflowing_titles

    dealt = {name: jw.deal_tiles(list(range(100, 0, -1)), 12, zigzag="zigzag" in name)
             for name in ("sequence order", "scheduler order", "scheduler order, zigzag")}
    fig = jw.schedule_figure(dealt)
    assert len(fig.layout.annotations) == 3 and overflowing_titles(fig) == []


def test_panel_figures_titles_fit(published):
    from jfa.workbench.plots import overflowing_titles

    ring = jw.ring_panel()
    for name, value in (("depth", 6), ("load_ticks", 6), ("compute_ticks", 1), ("depth", 1)):
        ring.controls[name].value = value
        assert overflowing_titles(ring()) == []
    gem = jw.gem_sweep_panel(RESULTS)
    if gem is not None:
        assert overflowing_titles(gem()) == []


def test_deal_tiles_strided_or_zigzag_like_the_forward_kernel():
    """Strided: program p takes every P-th tile. Zigzag: turn 0 left to right, turn 1 right to left."""
    assert jw.deal_tiles([6, 5, 4, 3, 2, 1, 0], 3) == [[6, 3, 0], [5, 2], [4, 1]]
    assert jw.deal_tiles([6, 5, 4, 3, 2, 1, 0], 3, zigzag=True) == [[6, 1, 0], [5, 2], [4, 3]]
    longest_first = sorted(range(1, 101), reverse=True)
    strided = [sum(t) for t in jw.deal_tiles(longest_first, 10)]
    zigzag = [sum(t) for t in jw.deal_tiles(longest_first, 10, zigzag=True)]
    assert max(strided) - min(strided) == 90 and max(zigzag) - min(zigzag) <= 10
    with pytest.raises(ValueError, match="n_programs"):
        jw.deal_tiles([1], 0)
