"""CPU tests of jfa.workbench.head_to_head: alternating rounds, medians, speedups and the bwd subtraction,
with the reference standing in for both providers and a scripted timer (the real run is on the GPU
host)."""
import pytest

from jfa import specs
from jfa.workbench import head_to_head
from jfa.workbench.providers import ProviderRun
from tests.test_bench import FakeTimer, reference_provider, small_case


class ScriptedTimer:
    """Returns the next scripted time for (provider, pass) and records the order of calls."""

    def __init__(self, script):
        self.script = {key: list(times) for key, times in script.items()}
        self.order = []
        self.current = None

    def __call__(self, fn, grad_to_none):
        fn()
        pass_ = "fwd+bwd" if grad_to_none else "fwd"
        self.order.append((self.current(), pass_))
        return self.script[(self.current(), pass_)].pop(0)


def tagging_provider(name, order):
    """The reference provider, appending `name` to `order` at every forward call (which provider a timer runs)."""
    def build(problem):
        run = reference_provider(problem)
        forward = run.forward

        def tagged():
            order.append(name)
            return forward()
        run.forward = tagged
        return run
    return build


def test_rounds_alternate_and_medians_give_the_speedup():
    order = []
    timer = ScriptedTimer({("jfa", "fwd"): [1.0, 2.0, 1.2], ("jfa", "fwd+bwd"): [4.0, 5.0, 4.2],
                           ("peer", "fwd"): [2.0, 2.4, 9.0], ("peer", "fwd+bwd"): [6.0, 6.4, 13.0]})
    timer.current = lambda: order[-1]
    row = head_to_head.head_to_head(small_case(), "peer", 3, device="cpu",
                                    registry={p: tagging_provider(p, order) for p in ("jfa", "peer")}, timer=timer)
    assert [pass_ for _, pass_ in timer.order] == ["fwd"] * 6 + ["fwd+bwd"] * 6  # each pass its own rounds
    for pass_ in ("fwd", "fwd+bwd"):
        calls = [provider for provider, timed in timer.order if timed == pass_]
        assert calls[::2] == ["jfa", "peer", "jfa"]  # who goes first alternates by round
    ours, theirs = row["providers"]["jfa"], row["providers"]["peer"]
    assert ours["fwd_ms"] == 1.2 and ours["bwd_ms"] == pytest.approx(4.2 - 1.2)  # medians, bwd = fwd+bwd - fwd
    assert theirs["fwd_ms"] == 2.4 and theirs["bwd_ms"] == pytest.approx(6.4 - 2.4)
    assert row["speedup"]["fwd"] == pytest.approx(2.0)
    assert ours["fwd_spread"] == pytest.approx((2.0 - 1.0) / 1.2)
    assert ours["fwd_tflops"] == pytest.approx(specs.tflops(row["flops"]["fwd"], 1.2))
    assert row["checks"]["jfa"]["rel_err"] < specs.FWD_RELERR


def test_one_round_is_refused():
    with pytest.raises(ValueError, match="rounds"):
        head_to_head.head_to_head(small_case(), "peer", 1, device="cpu", registry={})


def test_summary_markdown_of_a_recorded_report():
    row = dict(suite="gem", case="L=256", providers={
        "jfa": dict(fwd_tflops=200.0, bwd_tflops=100.0, fwd_spread=0.1),
        "fa4": dict(fwd_tflops=100.0, bwd_tflops=125.0, fwd_spread=0.02)}, speedup=dict(fwd=2.0, bwd=0.8))
    report = dict(peer="fa4", cases=[row, dict(row, case="L=512", speedup=dict(fwd=0.5, bwd=0.8)),
                                     dict(suite="gem", case="L=1024", error="RuntimeError: out of memory")])
    text = head_to_head.summary_markdown(report)
    assert "| gem L=256 | 200 (±5%) | 100 (±1%) | 2.00x | 100 | 125 | 0.80x |" in text
    assert "| gem L=1024 | failed: RuntimeError: out of memory" in text
    assert "gem: geometric mean of jfa's speedup over fa4: fwd 1.00x, bwd 0.80x (2 cases)" in text


def test_a_peer_without_backward_is_refused():
    def forward_only(problem):
        run = reference_provider(problem)
        return ProviderRun(run.forward, run.to_packed, run.grad_inputs, no_backward="forward-only here")

    with pytest.raises(ValueError, match="peer has no backward here"):
        head_to_head.head_to_head(small_case(), "peer", 2, device="cpu",
                                  registry={"jfa": reference_provider, "peer": forward_only}, timer=FakeTimer())


def test_python_m_jfa_runs_the_head_to_head_command(capsys):
    from jfa.workbench import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["head-to-head", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m jfa head-to-head ")


def test_the_command_line_offers_only_in_process_peers(capsys):
    with pytest.raises(SystemExit):
        head_to_head.main(["out.json", "--peer", "flex"])
    assert "invalid choice: 'flex'" in capsys.readouterr().err


def test_several_peers_rotate_and_the_faster_peer_sets_the_bar():
    order = []
    # fa4 is the faster peer forward, fa2 backward: jfa's speedup over the faster is the smaller ratio.
    timer = ScriptedTimer({("jfa", "fwd"): [1.0] * 3, ("jfa", "fwd+bwd"): [4.0] * 3,
                           ("fa4", "fwd"): [1.5] * 3, ("fa4", "fwd+bwd"): [7.5] * 3,
                           ("fa2", "fwd"): [3.0] * 3, ("fa2", "fwd+bwd"): [7.5] * 3})
    timer.current = lambda: order[-1]
    registry = {p: tagging_provider(p, order) for p in ("jfa", "fa4", "fa2")}
    row = head_to_head.head_to_head(small_case(), ["fa4", "fa2"], 3, device="cpu", registry=registry, timer=timer)
    fwd_calls = [provider for provider, timed in timer.order if timed == "fwd"]
    assert fwd_calls[::3] == ["jfa", "fa4", "fa2"]  # each provider goes first once
    assert row["speedups"]["fa4"] == pytest.approx(dict(fwd=1.5, bwd=2.0))
    assert row["speedups"]["fa2"] == pytest.approx(dict(fwd=3.0, bwd=1.5))
    assert row["speedup"] == row["speedups"]["fa4"]  # the first peer's, as one-peer reports have it
    assert row["speedup_over_faster"] == pytest.approx(dict(fwd=1.5, bwd=1.5))
    with pytest.raises(ValueError, match="rounds: at least 3"):
        head_to_head.head_to_head(small_case(), ["fa4", "fa2"], 2, device="cpu", registry={})


def test_summary_markdown_with_two_peers():
    providers = {"jfa": dict(fwd_tflops=300.0, bwd_tflops=200.0, fwd_spread=0.02),
                 "fa4": dict(fwd_tflops=200.0, bwd_tflops=100.0, fwd_spread=0.04),
                 "fa2": dict(fwd_tflops=100.0, bwd_tflops=160.0, fwd_spread=0.0)}
    row = dict(suite="pma", case="q=64", providers=providers, speedup=dict(fwd=1.5, bwd=2.0),
               speedups=dict(fa4=dict(fwd=1.5, bwd=2.0), fa2=dict(fwd=3.0, bwd=1.25)),
               speedup_over_faster=dict(fwd=1.5, bwd=1.25))
    text = head_to_head.summary_markdown(dict(peer="fa4", peers=["fa4", "fa2"], cases=[row]))
    assert text.startswith("| case | jfa fwd | fa4 fwd | fa2 fwd | fwd vs fa4 | fwd vs fa2 | fwd vs faster | "
                           "jfa bwd | fa4 bwd | fa2 bwd | bwd vs fa4 | bwd vs fa2 | bwd vs faster |")
    assert "| pma q=64 | 300 (±1%) | 200 (±2%) | 100 (±0%) | 1.50x | 3.00x | 1.50x | 200 | 100 | 160 | 2.00x | " \
           "1.25x | 1.25x |" in text
    assert "pma: geometric mean of jfa's speedup over the faster peer: fwd 1.50x, bwd 1.25x (1 cases)" in text


def test_target_demand_against_the_ceilings_and_the_forward():
    def case(name, jfa, fa4):
        providers = {p: dict(fwd_tflops=fwd, bwd_tflops=bwd) for p, (fwd, bwd) in dict(jfa=jfa, fa4=fa4).items()}
        return dict(suite="gem", case=name, providers=providers)

    # "long": 1.5 x 400 = 600 asks above every forward (500), so it is held to jfa's forward (1.25x fa4's
    # backward); then "short" needs 1.5**2 / 1.25 = 1.8x fa4 = 180, 1.8 / (150 / 100) = 1.2x jfa's forward.
    report = dict(cases=[case("long", (500.0, 380.0), (450.0, 400.0)), case("short", (150.0, 120.0), (90.0, 100.0)),
                         dict(suite="gem", case="failed", error="x"), dict(case("other", (1.0, 1.0), (1.0, 1.0)),
                                                                           suite="dense")])
    text = head_to_head.target_demand_markdown(report, {"gem": 1.5}, {"GEMM": 800.0})
    assert text.startswith("| case | fa4 bwd | jfa bwd | target | asks | asks / GEMM | fastest fwd | "
                           "asks / fastest fwd | fastest bwd / fastest fwd |")
    assert "| gem long | 400 | 380 | 1.50x | 600 | 0.75x | 500 (jfa) | 1.20x | 0.80x |" in text
    assert "| gem short | 100 | 120 | 1.50x | 150 | 0.19x | 150 (jfa) | 1.00x | 0.80x |" in text
    assert "failed" not in text and "other" not in text  # a failed row and a suite without a target are left out
    assert text.endswith("gem: with its 1 cases above the fastest forward given a backward as fast as jfa's forward, "
                         "a geometric mean of 1.50x needs 1.80x fa4 on short (1.20x jfa's forward)")
    per_case = head_to_head.target_demand_markdown(report, {"gem": 1.5}, {"GEMM": 800.0}, mean_suites=())
    assert "geometric mean" not in per_case  # a per-case target has no mean to reach


def test_the_command_line_takes_a_list_of_peers(capsys):
    with pytest.raises(SystemExit):
        head_to_head.main(["out.json", "--peer", "fa4,fa4"])
    assert "invalid choice: 'fa4,fa4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        head_to_head.main(["out.json", "--peer", "fa4,fa2", "--rounds", "2"])
    assert "--rounds: at least 3" in capsys.readouterr().err
