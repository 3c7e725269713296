"""The reference-fallback warning names the user's line, never jfa's or torch's internals: Python
prints the line a warning points at, and that line is what a user reads."""
import warnings
from pathlib import Path

import pytest
import torch

import jfa
from jfa import dispatch
from jfa.jagged import lengths_to_offsets

LENGTHS = [30, 0, 17]


@pytest.fixture
def caught(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())  # each reason is told once per process
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


def _fallbacks(seen):
    found = [w for w in seen if issubclass(w.category, jfa.ReferenceFallbackWarning)]
    assert found, "no ReferenceFallbackWarning"
    return found


def _line_of(text: str) -> int:
    """The line of this file that holds `text` (the call the warning must point at)."""
    return next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


def qkv(dtype=torch.bfloat16, head_dim=64):
    return [torch.randn(sum(LENGTHS), 4, head_dim).to(dtype).requires_grad_(dtype.is_floating_point
                                                                           and dtype.itemsize > 1)
            for _ in range(3)]


def test_jagged_attention_warns_at_the_callers_line(caught):
    q, k, v = qkv()
    off = lengths_to_offsets(LENGTHS)
    jfa.jagged_attention(q, k, v, off, off, causal=True)  # the call
    for w in _fallbacks(caught):
        assert (w.filename, w.lineno) == (__file__, _line_of("causal=True)  # the call")), w


def test_block_attention_warns_at_the_callers_line(caught):
    q, k, v = qkv()
    jfa.block_attention(q, k, v, lengths_to_offsets(LENGTHS))  # block call
    for w in _fallbacks(caught):
        assert (w.filename, w.lineno) == (__file__, _line_of("# block call")), w


def test_block_sparse_attention_warns_at_the_callers_line(caught):
    q, k, v = qkv()
    off = lengths_to_offsets(LENGTHS)
    idx = torch.zeros(len(LENGTHS), 4, 1, 1, dtype=torch.int32)  # every query block sees key block 0
    jfa.block_sparse_attention(q, k, v, off, off, idx)  # sparse call
    for w in _fallbacks(caught):
        assert (w.filename, w.lineno) == (__file__, _line_of("# sparse call")), w


def test_fp8_warns_at_the_callers_line(caught):
    q, k, v = qkv(torch.float8_e4m3fn)
    off = lengths_to_offsets(LENGTHS)
    jfa.jagged_attention_fp8(q, k, v, off, off)  # fp8 call
    for w in _fallbacks(caught):
        assert (w.filename, w.lineno) == (__file__, _line_of("# fp8 call")), w


def test_the_first_frame_outside_jfa_and_torch_is_named(caught):
    """However deep inside jfa (and torch, as in a backward run by autograd) the warning is raised,
    it names the first frame outside both."""
    scope = {"dispatch": dispatch}
    inner = Path(dispatch.__file__).with_name("_deep_inside.py")
    via_torch = Path(torch.__file__).with_name("_engine.py")
    exec(compile("def inner():\n    dispatch.warn_fallback('deep')\n", str(inner), "exec"), scope)
    exec(compile("def engine():\n    inner()\n", str(via_torch), "exec"), scope)
    exec(compile("def entry():\n    engine()\n", str(inner), "exec"), scope)
    scope["entry"]()  # the user's line
    (w,) = _fallbacks(caught)
    assert (w.filename, w.lineno) == (__file__, _line_of('scope["entry"]()  # the user'))
