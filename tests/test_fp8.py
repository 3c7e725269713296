"""`jfa.jagged_attention_fp8` on the CPU: argument checks and the reference path on dequantized inputs
(the kernel itself: tests/gpu/test_fp8.py; its compile: the forward kernel's CPU compile tests)."""
import pytest
import torch

import jfa
from jfa import dispatch, fp8, reference
from jfa.dispatch import ReferenceFallbackWarning
from jfa.jagged import lengths_to_offsets

LENGTHS = [100, 0, 257, 1]


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(LENGTHS), 4, 64, generator=gen).to(torch.float8_e4m3fn) for _ in range(3)]


def test_cpu_runs_the_reference_on_dequantized_inputs(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    with pytest.warns(ReferenceFallbackWarning, match="FP8"):
        out, lse = jfa.jagged_attention_fp8(q, k, v, off, off, q_scale=0.5, v_scale=2.0, causal=True,
                                            return_lse=True)
    ref, ref_lse = reference.jagged_attention_ref(q.float() * 0.5, k.float(), v.float() * 2.0, off, off, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref.to(torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse.float(), atol=0, rtol=0)


@pytest.mark.parametrize("change, error, match", [
    (dict(q=torch.zeros(358, 4, 64)), TypeError, "q: dtype torch.float32"),
    (dict(v_scale=0.0), ValueError, "v_scale: must be finite and > 0"),
    (dict(k_scale="1"), TypeError, "k_scale: expected a float"),
    (dict(q_scale=float("nan")), ValueError, "q_scale"),
])
def test_bad_arguments_name_themselves(change, error, match):
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    call = dict(q=q, q_scale=1.0, k_scale=1.0, v_scale=1.0) | change
    with pytest.raises(error, match=match):
        jfa.jagged_attention_fp8(call["q"], k, v, off, off, q_scale=call["q_scale"], k_scale=call["k_scale"],
                                 v_scale=call["v_scale"])


@pytest.mark.parametrize("broadcast_q", [False, True], ids=["self", "broadcast_q"])
def test_custom_op_passes_opcheck_and_compiles_with_fullgraph(broadcast_q):
    """`jfa::jagged_attention_fp8_fwd`: schema, fake (meta) shapes and torch.compile(fullgraph=True)
    agree with eager (on the CPU its implementation is the reference)."""
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    if broadcast_q:
        q = q[:64].clone()
    q_off = lengths_to_offsets([64]) if broadcast_q else off
    v_t = fp8.transpose_values(v, off) if broadcast_q else v  # broadcast-Q also takes V pre-transposed
    args = (q, k, v_t, q_off, off, 64 if broadcast_q else 257, 257, 0.125, 0.5, 1.0, 2.0, not broadcast_q,
            None, broadcast_q, broadcast_q)
    # Not "test_schema": its mutation check multiplies the inputs, which CPU float8 cannot.
    torch.library.opcheck(fp8.jagged_attention_fp8_fwd, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    eager = fp8.jagged_attention_fp8_fwd(*args)
    compiled = torch.compile(fp8.jagged_attention_fp8_fwd, fullgraph=True, backend="eager")(*args)
    rows = 64 * (len(LENGTHS)) if broadcast_q else sum(LENGTHS)
    assert eager[0].shape == (rows, 4, 64) and eager[0].dtype == torch.bfloat16 and eager[1].shape == (4, rows)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_transposed_values_round_trip_with_aligned_sequences():
    """`transpose_values` (the PyTorch path here) lays each sequence from a 16-key column, zeros in
    the gaps, and `_packed_values` inverts it exactly."""
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    v_t = fp8.transpose_values(v, off)
    cols, width = fp8.transposed_value_layout(off, v.shape[0], "cpu")
    assert v_t.shape == (4 * 64, width) and v_t.dtype == torch.float8_e4m3fn
    starts = cols[off[:-1][torch.tensor(LENGTHS) > 0].long()]
    assert bool((starts % 16 == 0).all())
    assert torch.equal(fp8._packed_values(v_t, off, k).view(torch.uint8), v.view(torch.uint8))
    gaps = torch.ones(width, dtype=torch.bool)
    gaps[cols] = False
    assert not v_t.view(torch.uint8)[:, gaps].any()


def test_pre_transposed_values_give_the_same_attention(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    kwargs = dict(q_scale=0.5, v_scale=2.0, causal=True, return_lse=True)
    with pytest.warns(ReferenceFallbackWarning):
        packed = jfa.jagged_attention_fp8(q, k, v, off, off, **kwargs)
    transposed = jfa.jagged_attention_fp8(q, k, fp8.transpose_values(v, off), off, off, v_transposed=True, **kwargs)
    for got, want in zip(transposed, packed):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("bad", ["packed", "wrong_width", "bf16"])
def test_pre_transposed_values_are_checked(bad):
    q, k, v = inputs()
    off = lengths_to_offsets(LENGTHS)
    v_t = fp8.transpose_values(v, off)
    wrong = {"packed": v, "wrong_width": v_t[:, :-16].contiguous(), "bf16": v_t.to(torch.bfloat16)}[bad]
    with pytest.raises(ValueError, match="v: with v_transposed=True"):
        jfa.jagged_attention_fp8(q, k, wrong, off, off, v_transposed=True)
