"""The fork exercises (`jfa.workbench.exercises`) on a machine without a GPU.

One exercise per notebook from 03; each starter runs as a notebook cell and builds a fork that does
not yet do the task (the CPU checks or the references show what is missing); each worked solution
passes its variant's CPU checks, changes the math (its reference differs from plain attention,
where the reference models its hooks), and compiles for sm_90 (the forward through
`Variant.kernel_specs` and `jfa.workbench.inspect`). The kernels run in tests/gpu/test_exercises.py.
"""
import linecache
from pathlib import Path

import pytest
import torch

from jfa import reference
from jfa.variants import Variant
from jfa.workbench import exercises, lab
from jfa.workbench import inspect as jinspect

REPO = Path(__file__).resolve().parents[1]
ALL = list(exercises.EXERCISES.values())
IDS = [e.name for e in ALL]
E4M3_CONVERSION = "cvt.rn.satfinite.e4m3x2.f32"  # fp32 pairs to E4M3 in the PTX of the 06 solution


def _run_cell(source: str, name: str) -> dict:
    """Run `source` as a notebook cell: its text in linecache, so @triton.jit finds its source."""
    filename = f"<exercise cell {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def _starter(ex) -> Variant:
    return _run_cell(ex.starter, ex.notebook)["my_fork"]


def _references(variant: Variant, params, causal=False):
    """(variant's reference, plain attention) on a small CPU batch of 3 sequences."""
    lengths = [1, 100, 300]
    off = torch.tensor([0, 1, 101, 401], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 64, generator=gen) for _ in range(3))
    mine = variant.reference(q, k, v, off, off, causal=causal, params=params)
    plain, _ = reference.jagged_attention_ref(q, k, v, off, off, causal=causal)
    return mine, plain, (q, k, v, off)


def test_one_exercise_per_notebook_from_03_on():
    assert list(exercises.EXERCISES) == ["03", "04", "05", "06", "07", "08"]
    for key, ex in exercises.EXERCISES.items():
        assert list((REPO / "notebooks").glob(f"{key}_*.ipynb")), f"exercise {key}: no notebook {key}_*"
        assert ex.task and ex.shows and isinstance(ex.solution, Variant)
    assert len(set(IDS)) == len(IDS), "the GPU tests' ids are the solutions' names"
    assert exercises.exercise("05_block_sparse.ipynb") is exercises.SINKS_AND_WINDOW
    with pytest.raises(KeyError, match="no exercise for notebook '02'"):
        exercises.exercise("02")


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_the_starter_runs_as_a_cell_and_builds_a_fork(ex):
    fork = _starter(ex)
    assert isinstance(fork, Variant)
    listings = lab.show(fork).listings
    assert listings and all(listing.path == "defined in this notebook" for listing in listings)
    assert "TODO" in ex.starter, "the starter marks what to change"


def test_each_starter_leaves_its_task_undone():
    """What each task asks is missing from its starter, and the CPU checks or references show it."""
    relative, softcap, sinks, _, block, own = (_starter(exercises.EXERCISES[k]) for k in ("03", "04", "05", "06",
                                                                                         "07", "08"))
    params = exercises.RELATIVE_BIAS.params()
    mine, plain, _ = _references(relative, params)
    assert torch.equal(mine, plain), "the 03 starter adds no bias yet"
    with pytest.raises(ValueError, match="differs from the derivative"):
        softcap.check_score_grad(params=exercises.RATIONAL_SOFTCAP.params())
    assert lab.skipped_key_tiles(sinks, exercises.SINKS_AND_WINDOW.params(), causal=True) == 0
    assert lab.skipped_key_tiles(exercises.SINKS_AND_WINDOW.solution, exercises.SINKS_AND_WINDOW.params(),
                                 causal=True) > 0.5
    # 07's starter is block attention written as a mask: its reference is jfa.block_attention's
    mine, _, (q, k, v, off) = _references(block, exercises.BLOCK_CAUSAL.params())
    torch.testing.assert_close(mine, reference.block_attention_ref(q, k, v, off))
    solved, _, _ = _references(exercises.BLOCK_CAUSAL.solution, exercises.BLOCK_CAUSAL.params())
    assert not torch.allclose(solved, mine), "the solution is causal inside the blocks"
    mine, plain, _ = _references(own, (128, torch.ones(4)))
    assert torch.equal(mine, plain), "the 08 template changes nothing yet"


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_the_solution_passes_its_cpu_checks_and_changes_the_math(ex):
    params = ex.params()
    checks = lab._cpu_checks(ex.solution, params)
    assert checks and not [c for c in checks if c[1] is False], checks
    if set(lab._fork_hooks(ex.solution.fork)) & {"score_mod", "mask_mod"}:
        mine, plain, _ = _references(ex.solution, params, causal=ex.options.get("causal", False))
        assert torch.isfinite(mine).all()
        assert (mine - plain).abs().max() > 1e-2, "the hooks change the output"
    else:  # a fork of P·V: its reference is plain attention, and the CPU checks say they do not apply
        assert [ok for _, ok, _ in checks] == [None]


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_the_solution_compiles_for_sm90(ex):
    specs = ex.solution.kernel_specs(params=ex.params(), causal=ex.options.get("causal", False))
    report = jinspect.inspect(specs["forward"], "sm_90", want_ptx=ex.notebook == "06")
    assert [r.name for r in report.roles][:3] == ["producer", "consumer0", "consumer1"]
    assert report.shared_bytes <= 227 * 1024
    if ex.notebook == "06":
        assert E4M3_CONVERSION in report.ptx, "P is rounded to E4M3 in the forward"


def test_params_are_sized_for_the_heads():
    table, radius = exercises.RELATIVE_BIAS.params(heads=8)
    assert table.shape == (8, 2 * radius + 1)
    history, temperature = exercises.TARGET_AWARE.params(heads=2)
    assert isinstance(history, int) and temperature.shape == (2,)


def test_the_exercise_calls_pass_its_params_and_options(monkeypatch):
    seen = {}
    monkeypatch.setattr(lab, "try_fork", lambda fork, params, **kw: seen.update(fork=fork, params=params, **kw))
    monkeypatch.setattr(lab, "check", lambda fork, **kw: seen.update(checked=fork, **kw))
    ex = exercises.SINKS_AND_WINDOW
    ex.try_fork(compile=False)
    assert seen["fork"] is ex.solution and seen["params"] == (4, 256) and seen["causal"] is True
    mine = _starter(ex)
    ex.check(mine, lengths=(1, 2))
    assert seen["checked"] is mine and seen["lengths"] == (1, 2)


def test_start_prints_the_starter_outside_ipython(capsys):
    exercises.RELATIVE_BIAS.start()
    assert capsys.readouterr().out.strip() == exercises.RELATIVE_BIAS.starter.strip()
    assert "Exercise 03" in repr(exercises.RELATIVE_BIAS)
    assert exercises.RELATIVE_BIAS._repr_markdown_().startswith("**Exercise 03")
