"""User forks of the jagged kernels (`jfa.variant`) on a Hopper GPU against their own references.

The three examples of `jfa.variants` (ALIBI: a score modification with its derivative, GLOBAL_TOKENS:
a mask with a block-level form, SOFTCAP: a score modification whose derivative depends on the score)
run forward and backward through `jfa.runner` with NaN-poisoned outputs inside guard rows, every
element against `Variant.reference` in fp32 on fresh random inputs. A variant whose block mask rules
out blocks that hold visible pairs shows that the kernels skip those tiles rather than compute and
mask them, and a variant written the way a notebook cell would runs through the public call.
"""
import warnings

import pytest
import torch
import triton
import triton.language as tl

import jfa
from jfa import reference, runner, specs, variants
from jfa.kernels.bwd_dkdv import DQ_SPLIT
from jfa.variants import ALIBI, GLOBAL_TOKENS, SOFTCAP, alibi_slopes
from tests.gpu.test_jagged_fwd import DEVICE, assert_grads_close, assert_guards_untouched, offsets, poisoned, random_inputs

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 63, 64, 65, 129, 300, 1000]  # 1000: key tiles far outside a band, which a block mask skips
NUM_GLOBAL, BAND = 5, 40
SOFTCAP_AT = 2.0  # below the spread of the N(0, 1) logits, so the cap bends many of them


def variant_params(name, q_heads):
    return {"alibi": lambda: (alibi_slopes(q_heads, DEVICE),), "global_tokens": lambda: (NUM_GLOBAL, BAND),
            "softcap": lambda: (SOFTCAP_AT,)}[name]()


VARIANTS = {"alibi": ALIBI, "global_tokens": GLOBAL_TOKENS, "softcap": SOFTCAP}
HEADS = {"alibi": (8, 2), "global_tokens": (4, 4), "softcap": (4, 4)}  # ALiBi's slopes per query head, with GQA


def reference_of(variant, q, k, v, dout, off, *, causal, params, upcast=True):
    """(out, lse, (dq, dk, dv)) of the variant's fp32 reference (in q's dtype with `upcast=False`), by
    autograd."""
    leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    out, lse = variant.reference(*leaves, off, off, causal=causal, params=params, return_lse=True, upcast=upcast)
    return out.detach(), lse.detach(), torch.autograd.grad(out, leaves, dout.to(out.dtype))


def same_dtype_grads_of(variant, q, k, v, dout, off, *, causal, params):
    """The reference's gradients in the kernels' dtype, when called: `assert_matches`'s baseline."""
    return lambda: reference_of(variant, q, k, v, dout, off, causal=causal, params=params, upcast=False)[2]


def run_kernels(variant, q, k, v, dout, off, *, causal, params, dq_strategy=None):
    """The variant's forward and backward through the runner into poisoned views: (out, lse, grads)."""
    fork = variants._fork_call(runner, variant, params)  # what the variant's call hands the runner
    longest = int((off[1:] - off[:-1]).max())
    rows, heads, head_dim = q.shape
    out_buf, out_view = poisoned((rows, heads, head_dim), q.dtype)
    lse_buf, lse_view = poisoned((heads, rows), torch.float32, row_dim=1)
    out, lse = runner.forward(q, k, v, off, off, longest, longest, None, causal, None, False, out=out_view,
                              lse=lse_view, fork=fork)
    grad_buffers = [poisoned(tuple(t.shape), t.dtype) for t in (q, k, v)]
    grads = runner.backward(dout, q, k, v, out, lse, off, off, longest, longest, None, causal, None, False,
                            grads=tuple(view for _, view in grad_buffers), fork=fork, dq_strategy=dq_strategy)
    torch.cuda.synchronize()
    assert_guards_untouched(out_buf, out)
    assert_guards_untouched(lse_buf, lse, row_dim=1)
    for buffer, view in grad_buffers:
        assert_guards_untouched(buffer, view)
    return out, lse, grads


def assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, same_dtype_grads):
    """Every element of out and lse within specs' tolerances, the gradients by `assert_grads_close`
    (`same_dtype_grads()`: the reference's in the kernels' dtype); nothing left NaN."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "rows left unwritten (still NaN)"
    relerr = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-6)).item()
    assert relerr <= specs.FWD_RELERR, f"out: relative error {relerr:.2e}"
    torch.testing.assert_close(out.float(), ref_out, **specs.FWD_TOL)
    torch.testing.assert_close(lse, ref_lse, **specs.FWD_TOL)
    assert_grads_close(grads, ref_grads, same_dtype_grads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_its_reference(name, causal):
    """Forward and backward (the configured dQ strategy) of each example against its reference,
    which differs from plain attention (the hooks change the result)."""
    variant, heads = VARIANTS[name], HEADS[name]
    q, k, v, dout = random_inputs(LENGTHS, heads, seed=len(name) + causal)
    off = offsets(LENGTHS)
    params = variant_params(name, heads[0])
    ref_out, ref_lse, ref_grads = reference_of(variant, q, k, v, dout, off, causal=causal, params=params)
    plain, _ = reference.jagged_attention_ref(q, k, v, off, off, causal=causal)
    assert not torch.allclose(ref_out, plain, **specs.FWD_TOL), "the variant's hooks change nothing here"
    assert_matches(*run_kernels(variant, q, k, v, dout, off, causal=causal, params=params),
                   ref_out, ref_lse, ref_grads, same_dtype_grads_of(variant, q, k, v, dout, off, causal=causal,
                                                                    params=params))


@pytest.mark.parametrize("name", ["softcap"])
def test_fused_dq_takes_the_variant_hooks(name):
    """dQ fused into the dK/dV kernel (DQ_SPLIT) applies the score derivative too. (Forks with a block
    mask always take the dQ kernel: `configs.check_dq_strategy`.)"""
    variant, heads = VARIANTS[name], HEADS[name]
    q, k, v, dout = random_inputs(LENGTHS, heads, seed=len(name))
    off = offsets(LENGTHS)
    params = variant_params(name, heads[0])
    assert_matches(*run_kernels(variant, q, k, v, dout, off, causal=False, params=params, dq_strategy=DQ_SPLIT.value),
                   *reference_of(variant, q, k, v, dout, off, causal=False, params=params),
                   same_dtype_grads_of(variant, q, k, v, dout, off, causal=False, params=params))


# ---- block skipping: a block mask that rules out blocks holding visible pairs ------------------------

@triton.jit
def _every_pair(seq, head, q_idx, k_idx, params):
    return k_idx >= 0


@triton.jit
def _no_block_before(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    return k_lo >= params[0]


@triton.jit
def _keys_from(seq, head, q_idx, k_idx, params):
    return k_idx >= params[0]


# The mask says every pair is visible; the block mask (wrongly) rules out every block of keys before
# params[0], a multiple of every kernel's key tile. A kernel that computed those tiles and masked them
# by mask_mod would give full attention; one that skips them gives attention to keys >= params[0].
WRONG_BLOCK_MASK = jfa.variant("every pair, no block before params[0]", mask_mod=_every_pair,
                               block_mask=_no_block_before)
KEYS_FROM = jfa.variant("keys from params[0]", mask_mod=_keys_from)
RULED_OUT_KEYS = 128


def test_a_block_mask_skips_the_blocks_it_rules_out():
    """The forward, dQ and dK/dV kernels neither load nor compute the key tiles a block mask rules out:
    the result is attention without those keys (dK, dV exactly 0 there), not the variant's reference."""
    lengths = [0, 1, 100, 128, 129, 300, 700]
    q, k, v, dout = random_inputs(lengths, (4, 4), seed=17)
    off = offsets(lengths)
    params = (RULED_OUT_KEYS,)
    assert WRONG_BLOCK_MASK.fork.block_mask is not None
    with pytest.raises(ValueError, match="rules out"):
        WRONG_BLOCK_MASK.check_block_mask(300, 300, params=params)
    out, lse, grads = run_kernels(WRONG_BLOCK_MASK, q, k, v, dout, off, causal=False, params=params)
    assert_matches(out, lse, grads, *reference_of(KEYS_FROM, q, k, v, dout, off, causal=False, params=params),
                   same_dtype_grads_of(KEYS_FROM, q, k, v, dout, off, causal=False, params=params))
    wrong_ref = WRONG_BLOCK_MASK.reference(q, k, v, off, off, params=params)
    assert not torch.allclose(out.float(), wrong_ref, **specs.FWD_TOL)
    starts = off[:-1].repeat_interleave(torch.tensor(lengths, device=DEVICE))
    ruled_out = torch.arange(off[-1].item(), device=DEVICE) - starts < RULED_OUT_KEYS
    for name, grad in zip(("dk", "dv"), grads[1:]):
        assert (grad[ruled_out] == 0).all(), f"{name}: a ruled-out key got a gradient"


# ---- a variant as a notebook cell writes it (the cell: 30 lines or fewer) --------------------------

@triton.jit
def _temperature(score, seq, head, q_idx, k_idx, params):
    return score * tl.load(params[0] + seq)  # one temperature per sequence


@triton.jit
def _temperature_grad(grad, score, seq, head, q_idx, k_idx, params):
    return grad * tl.load(params[0] + seq)


@triton.jit
def _lookback(seq, head, q_idx, k_idx, params):
    return k_idx >= q_idx - params[1]  # no key more than params[1] rows back


TEMPERATURE_LOOKBACK = jfa.variant("temperature per sequence, bounded lookback", score_mod=_temperature,
                                   score_grad=_temperature_grad, mask_mod=_lookback)


def test_a_notebook_variant_runs_through_its_public_call():
    """A score modification reading a tensor per sequence and a mask, defined in this module: the
    variant's call runs the kernels (no fallback) and matches its reference, forward and backward."""
    lengths = [3, 64, 129, 0, 300]
    q, k, v, dout = random_inputs(lengths, (4, 2), seed=23)
    off = offsets(lengths)
    temperatures = torch.linspace(0.5, 2.0, len(lengths), device=DEVICE)
    params = (temperatures, 50)
    TEMPERATURE_LOOKBACK.check_score_grad(params=params)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jfa.ReferenceFallbackWarning)
        out, lse = TEMPERATURE_LOOKBACK(*leaves, off, off, causal=True, params=params, return_lse=True)
        grads = torch.autograd.grad(out, leaves, dout)
    assert_matches(out, lse, grads, *reference_of(TEMPERATURE_LOOKBACK, q, k, v, dout, off, causal=True,
                                                  params=params),
                   same_dtype_grads_of(TEMPERATURE_LOOKBACK, q, k, v, dout, off, causal=True, params=params))
