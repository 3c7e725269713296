"""`jfa.variant` on the CPU: the references of the three example variants against attention written
out by hand, gradients through them, the hook checks (`check_score_grad`, `check_block_mask`), the
argument checks of `jfa.variant` and of `params`, and the reference fallback of a variant's call
(the kernels themselves: tests/gpu/test_variants.py)."""
import math
import re
import warnings

import pytest
import torch
import triton
import triton.language as tl

import jfa
from jfa import dispatch
from jfa.jagged import lengths_to_offsets
from jfa.variants import ALIBI, GLOBAL_TOKENS, SOFTCAP, alibi_slopes

LENGTHS = [5, 0, 9, 1, 12]
HEADS = (4, 2)
NUM_GLOBAL, BAND = 2, 3
CAP = 1.5
EXACT = dict(atol=1e-10, rtol=1e-10)  # float64 references against float64 hand-written attention


def inputs(dtype=torch.float64, heads=HEADS, head_dim=8, lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    q = torch.randn(rows, heads[0], head_dim, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(rows, heads[1], head_dim, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, lengths_to_offsets(lengths)


def hand_attention(q, k, v, lengths, *, causal=False, score=None, visible=None):
    """(out, lse) of self-attention over each sequence, written out: scores q k^T / sqrt(D), `score(s, h,
    i, j)` applied, pairs outside `visible(h, i, j)` (and the causal triangle) dropped, softmax, P V."""
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    outs, lses, start = [], [], 0
    for n in lengths:
        rows = slice(start, start + n)
        start += n
        keys, values = k[rows].repeat_interleave(group, 1), v[rows].repeat_interleave(group, 1)
        s = torch.einsum("ihd,jhd->hij", q[rows], keys) / math.sqrt(head_dim)
        h, i, j = torch.arange(heads)[:, None, None], torch.arange(n)[None, :, None], torch.arange(n)[None, None, :]
        if score is not None:
            s = score(s, h, i, j)
        ok = torch.ones(heads, n, n, dtype=torch.bool)
        if causal:
            ok &= j <= i
        if visible is not None:
            ok &= visible(h, i, j)
        s = s.masked_fill(~ok, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row without a key: output 0
        outs.append(torch.einsum("hij,jhd->ihd", p, values))
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.cat(outs), torch.cat(lses, dim=1)


SLOPES = alibi_slopes(HEADS[0])
EXAMPLES = {  # variant, its params, the same math by hand
    "alibi": (ALIBI, (SLOPES,), dict(score=lambda s, h, i, j: s - SLOPES[h] * (i - j).abs())),
    "global_tokens": (GLOBAL_TOKENS, (NUM_GLOBAL, BAND),
                      dict(visible=lambda h, i, j: (i < NUM_GLOBAL) | (j < NUM_GLOBAL) | ((i - j).abs() <= BAND))),
    "softcap": (SOFTCAP, (CAP,), dict(score=lambda s, h, i, j: CAP * torch.tanh(s / CAP))),
}


@pytest.fixture(autouse=True)
def quiet_fallback():
    """On the CPU a variant's call runs its reference by design; the warning is tested separately."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jfa.ReferenceFallbackWarning)
        yield


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_reference_equals_attention_written_by_hand(name, causal):
    variant, params, by_hand = EXAMPLES[name]
    q, k, v, off = inputs()
    out, lse = variant.reference(q, k, v, off, off, causal=causal, params=params, return_lse=True)
    want_out, want_lse = hand_attention(q, k, v, LENGTHS, causal=causal, **by_hand)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want_out, **EXACT)
    torch.testing.assert_close(lse, want_lse, **EXACT)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_reference_gradients_match_finite_differences(name):
    variant, params, _ = EXAMPLES[name]
    q, k, v, off = inputs(heads=(2, 1), head_dim=4, lengths=[3, 0, 6])
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: variant.reference(a, b, c, off, off, causal=True, params=params), leaves)


def test_reference_gradients_equal_the_hand_written_ones():
    """Autograd through a variant's reference is autograd through the same math (softcap, GQA)."""
    variant, params, by_hand = EXAMPLES["softcap"]
    q, k, v, off = inputs()
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = []
    for attention in (lambda a, b, c: variant.reference(a, b, c, off, off, params=params),
                      lambda a, b, c: hand_attention(a, b, c, LENGTHS, **by_hand)[0]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads.append(torch.autograd.grad(attention(*leaves), leaves, grad_out))
    for name, got, want in zip("qkv", *grads):
        torch.testing.assert_close(got, want, **EXACT, msg=lambda m, n=name: f"d{n}: {m}")


# ---- the hook checks -----------------------------------------------------------------------------

@triton.jit
def _softcap_grad_forgotten(grad, score, seq, head, q_idx, k_idx, params):
    return grad  # the derivative of the identity, not of the cap


@triton.jit
def _band_blocks_forgotten(seq, head, q_lo, q_hi, k_lo, k_hi, params):
    return (q_lo < params[0]) | (k_lo < params[0])  # the global rows and columns only: no band


@pytest.mark.parametrize("variant,params", [(SOFTCAP, (CAP,)), (SOFTCAP, (30.0,)), (ALIBI, (SLOPES,))],
                         ids=["softcap", "softcap_30", "alibi"])
def test_check_score_grad_passes_for_the_examples(variant, params):
    variant.check_score_grad(params=params)


def test_check_score_grad_catches_a_wrong_derivative():
    wrong = jfa.variant("softcap, wrong derivative", score_mod=SOFTCAP.fork.score_mod,
                        score_grad=_softcap_grad_forgotten)
    with pytest.raises(ValueError, match=re.escape("score_grad of variant 'softcap, wrong derivative' differs from "
                                                   "the derivative of score_mod by")):
        wrong.check_score_grad(params=(CAP,))


@pytest.mark.parametrize("q_len,kv_len,params", [(300, 300, (NUM_GLOBAL, BAND)), (200, 700, (5, 40)),
                                                 (129, 64, (0, 0)), (64, 1000, (70, 100))])
def test_check_block_mask_passes_for_global_tokens(q_len, kv_len, params):
    GLOBAL_TOKENS.check_block_mask(q_len, kv_len, params=params, heads=2)
    GLOBAL_TOKENS.check_block_mask(q_len, kv_len, params=params, block_m=128, block_n=128)


def test_check_block_mask_catches_a_block_mask_that_rules_out_visible_pairs():
    wrong = jfa.variant("global tokens, no band blocks", mask_mod=GLOBAL_TOKENS.fork.mask_mod,
                        block_mask=_band_blocks_forgotten)
    with pytest.raises(ValueError, match=re.escape("block_mask of variant 'global tokens, no band blocks' rules out "
                                                   "rows 64..127 x keys 64..127 (head 0), where mask_mod sees a "
                                                   "visible pair: the kernels would skip it")):
        wrong.check_block_mask(300, 300, params=(NUM_GLOBAL, BAND))


def test_checks_pass_for_variants_without_the_hook_they_check():
    GLOBAL_TOKENS.check_score_grad(params=(NUM_GLOBAL, BAND))  # no score_mod
    SOFTCAP.check_block_mask(100, 100, params=(CAP,))  # no block_mask


# ---- jfa.variant's arguments -----------------------------------------------------------------------

@triton.jit
def _three_arguments(seq, head, q_idx):
    return q_idx >= 0


@triton.jit
def _mask(seq, head, q_idx, k_idx, params):
    return q_idx >= k_idx


@pytest.mark.parametrize("hooks,error,message", [
    (dict(mask_mod=lambda seq, head, q_idx, k_idx, params: True), TypeError,
     "mask_mod: expected a @triton.jit function, got function; decorate it with @triton.jit"),
    (dict(score_mod=SOFTCAP.fork.score_mod, score_grad=print), TypeError,
     "score_grad: expected a @triton.jit function, got builtin_function_or_method"),
    (dict(mask_mod=_three_arguments), TypeError,
     "mask_mod: _three_arguments(seq, head, q_idx) takes 3 arguments; a mask_mod takes "
     "(seq, head, q_idx, k_idx, params)"),
    (dict(score_mod=_mask, score_grad=SOFTCAP.fork.score_grad), TypeError,
     "score_mod: _mask(seq, head, q_idx, k_idx, params) takes 5 arguments; a score_mod takes "
     "(score, seq, head, q_idx, k_idx, params)"),
    (dict(mask_mod=_mask, block_mask=_mask), TypeError, "block_mask: _mask(seq, head, q_idx, k_idx, params) takes 5 "
     "arguments; a block_mask takes (seq, head, q_lo, q_hi, k_lo, k_hi, params)"),
    (dict(), ValueError, "variant: give score_mod (with score_grad) or mask_mod"),
    (dict(score_mod=SOFTCAP.fork.score_mod), ValueError, "score_grad: score_mod and score_grad go together"),
    (dict(score_grad=SOFTCAP.fork.score_grad, mask_mod=_mask), ValueError,
     "score_grad: score_mod and score_grad go together"),
    (dict(score_mod=SOFTCAP.fork.score_mod, score_grad=SOFTCAP.fork.score_grad, block_mask=GLOBAL_TOKENS.fork.block_mask),
     ValueError, "block_mask: it is the block-level form of mask_mod; pass mask_mod too"),
], ids=["mask_mod_not_jit", "score_grad_not_jit", "mask_mod_arity", "score_mod_arity", "block_mask_arity",
        "no_hooks", "score_mod_without_score_grad", "score_grad_without_score_mod", "block_mask_without_mask_mod"])
def test_variant_rejects_bad_hooks(hooks, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        jfa.variant("bad", **hooks)


@pytest.mark.parametrize("name", ["", None, 3])
def test_variant_needs_a_name(name):
    with pytest.raises(TypeError, match="^name: expected a non-empty str naming the variant"):
        jfa.variant(name, mask_mod=_mask)


@pytest.mark.parametrize("params,error,message", [
    ([CAP], TypeError, "params: expected a tuple of tensors and numbers (what the hooks read), got list; "
                       "wrap a single value as (value,)"),
    (CAP, TypeError, "params: expected a tuple of tensors and numbers (what the hooks read), got float"),
    ((torch.ones(4, device="meta"),), ValueError, "params[0]: is on meta but q is on cpu; move it to q's device"),
    ((CAP, "1"), TypeError, "params[1]: expected a tensor, int or float, got str"),
    ((True,), TypeError, "params[0]: expected a tensor, int or float, got bool"),
], ids=["list", "bare_number", "device", "str", "bool"])
def test_params_are_checked(params, error, message):
    q, k, v, off = inputs()
    for call in (SOFTCAP, SOFTCAP.reference):
        with pytest.raises(error, match="^" + re.escape(message)):
            call(q, k, v, off, off, params=params)


# ---- the call on the CPU, and its compile-only description -----------------------------------------

def test_a_call_on_the_cpu_runs_the_reference_and_says_so_once(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    q, k, v, off = inputs(dtype=torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = SOFTCAP(*leaves, off, off, causal=True, params=(CAP,), return_lse=True)
        again = SOFTCAP(*leaves, off, off, causal=True, params=(CAP,))
    fallback = [w for w in caught if issubclass(w.category, jfa.ReferenceFallbackWarning)]
    assert len(fallback) == 1
    assert "variant 'softcap'" in str(fallback[0].message) and "q is on cpu" in str(fallback[0].message)
    want, want_lse = SOFTCAP.reference(*leaves, off, off, causal=True, params=(CAP,), return_lse=True)
    assert torch.equal(out, want) and torch.equal(again, want) and torch.equal(lse, want_lse)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    want_grads = torch.autograd.grad(want, leaves, torch.ones_like(want))
    for name, got, expected in zip("qkv", grads, want_grads):
        assert torch.equal(got, expected), f"d{name}"


def test_kernel_specs_describe_the_three_kernels_with_the_hooks():
    """Compile-only descriptions (nothing compiled here): every kernel carries the variant's fork, and
    the params' types come from the values given (a tensor's dtype, a Python float)."""
    for variant, params, types in ((SOFTCAP, (CAP,), ("fp32",)), (ALIBI, (SLOPES,), ("*fp32",)),
                                   (GLOBAL_TOKENS, (NUM_GLOBAL, BAND), ("i32", "i32"))):
        kernel_specs = variant.kernel_specs(head_dim=64, causal=True, params=params)
        assert set(kernel_specs) == {"forward", "dq", "dkdv"}
        for spec in kernel_specs.values():
            assert spec.constexprs["FORK"] is variant.fork
            assert spec.signature["fork_params"] == types
