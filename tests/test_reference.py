"""The references against naive float64 loops written here, row by row, on fresh random inputs.

The naive loops share no code with `jfa.reference`: they compute one (sequence, query row, head) at
a time with the visibility rule spelled out as a Python condition, so a masking or offset bug in the
vectorized reference shows up as a mismatch.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from jfa import reference, specs

FP32_TOL = dict(atol=2e-5, rtol=2e-5)  # fp32 reference vs float64 truth, O(1) values, short rows
FP32_GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
FP64_TOL = dict(atol=1e-10, rtol=1e-10)


def offsets_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def mask_rule(causal, window):
    """CONTRACTS.md, literally: causal is bottom-right aligned, the window is |i - j| <= W."""
    def visible(b, h, i, j, lq, lk):
        if causal and j > i + (lk - lq):
            return False
        return window is None or abs(i - j) <= window
    return visible


def naive_attention(q, k, v, q_lens, kv_lens, scale, visible, *, broadcast_q=False):
    """float64 attention, one (sequence, query row, head) at a time: out [rows, H, D], lse [H, rows].

    `visible(b, h, i, j, lq, lk)` says whether query i of sequence b, head h, sees key j.
    """
    q, k, v = q.double(), k.double(), v.double()
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    out_rows, lse_rows = [], []
    q_start = kv_start = 0
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        for i in range(lq):
            outs, lses = [], []
            for h in range(heads):
                keys = [j for j in range(lk) if visible(b, h, i, j, lq, lk)]
                if not keys:
                    outs.append(q.new_zeros(head_dim))
                    lses.append(q.new_tensor(float("-inf")))
                    continue
                rows = torch.tensor(keys) + kv_start
                scores = k[rows, h // group] @ q[q_start + i, h] * scale
                top = scores.max()
                weights = torch.exp(scores - top)
                outs.append(weights @ v[rows, h // group] / weights.sum())
                lses.append(top + torch.log(weights.sum()))
            out_rows.append(torch.stack(outs))
            lse_rows.append(torch.stack(lses))
        q_start += 0 if broadcast_q else lq
        kv_start += lk
    if not out_rows:
        return q.new_zeros(0, heads, head_dim), q.new_zeros(heads, 0)
    return torch.stack(out_rows), torch.stack(lse_rows, dim=1)


# Lengths with empty query and KV sequences, lq != lk, and lq > lk (causal then hides whole rows).
Q_LENS = [5, 0, 7, 3, 9]
KV_LENS = [6, 4, 0, 9, 4]
MASKS = [(False, None), (True, None), (False, 2), (True, 3)]


def make_qkv(q_rows, kv_rows, q_heads, kv_heads, head_dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (randn(q_rows, q_heads, head_dim, gen=gen, dtype=dtype),
            randn(kv_rows, kv_heads, head_dim, gen=gen, dtype=dtype),
            randn(kv_rows, kv_heads, head_dim, gen=gen, dtype=dtype))


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2)])
def test_jagged_forward_matches_naive(causal, window, q_heads, kv_heads):
    head_dim = 8
    q, k, v = make_qkv(sum(Q_LENS), sum(KV_LENS), q_heads, kv_heads, head_dim, seed=q_heads + 10 * causal)
    out, lse = reference.jagged_attention_ref(q, k, v, offsets_of(Q_LENS), offsets_of(KV_LENS),
                                              causal=causal, window=window)
    want_out, want_lse = naive_attention(q, k, v, Q_LENS, KV_LENS, 1 / math.sqrt(head_dim), mask_rule(causal, window))
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (sum(Q_LENS), q_heads, head_dim) and lse.shape == (q_heads, sum(Q_LENS))
    torch.testing.assert_close(out.double(), want_out, **FP32_TOL)
    torch.testing.assert_close(lse.double(), want_lse, **FP32_TOL)


def test_fully_masked_rows_give_zero_and_minus_inf():
    # Sequence 0 has lq=5 > lk=2: causal hides every key from its first 3 rows; sequence 1 has no KV.
    q, k, v = make_qkv(8, 2, 2, 2, 8, seed=3)
    out, lse = reference.jagged_attention_ref(q, k, v, offsets_of([5, 3]), offsets_of([2, 0]), causal=True)
    hidden = [0, 1, 2, 5, 6, 7]
    assert torch.all(out[hidden] == 0)
    assert torch.all(torch.isneginf(lse[:, hidden]))
    assert torch.all(torch.isfinite(lse[:, [3, 4]]))


@pytest.mark.parametrize("causal,window", [(False, None), (True, 1)])
def test_broadcast_q_matches_naive(causal, window):
    q_len, kv_lens, head_dim = 4, [6, 0, 3, 9], 8
    q, k, v = make_qkv(q_len, sum(kv_lens), 4, 2, head_dim, seed=5)
    out, lse = reference.jagged_attention_ref(q, k, v, offsets_of([q_len]), offsets_of(kv_lens), causal=causal,
                                              window=window, broadcast_q=True)
    want_out, want_lse = naive_attention(q, k, v, [q_len] * len(kv_lens), kv_lens, 1 / math.sqrt(head_dim),
                                         mask_rule(causal, window), broadcast_q=True)
    assert out.shape == (q_len * len(kv_lens), 4, head_dim)
    torch.testing.assert_close(out.double(), want_out, **FP32_TOL)
    torch.testing.assert_close(lse.double(), want_lse, **FP32_TOL)


def test_custom_scale_float64_and_low_precision_inputs():
    q, k, v = make_qkv(sum(Q_LENS), sum(KV_LENS), 2, 1, 16, seed=7, dtype=torch.float64)
    args = (offsets_of(Q_LENS), offsets_of(KV_LENS))
    want_out, want_lse = naive_attention(q, k, v, Q_LENS, KV_LENS, 0.3, mask_rule(False, 4))
    out, lse = reference.jagged_attention_ref(q, k, v, *args, sm_scale=0.3, window=4)
    assert out.dtype == torch.float64  # float64 in, float64 out: lets tests check the reference itself
    torch.testing.assert_close(out, want_out, **FP64_TOL)
    torch.testing.assert_close(lse, want_lse, **FP64_TOL)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    out16, _ = reference.jagged_attention_ref(q16, k16, v16, *args, sm_scale=0.3, window=4)
    assert out16.dtype == torch.float32  # bf16 is upcast, never computed in bf16
    want16, _ = naive_attention(q16, k16, v16, Q_LENS, KV_LENS, 0.3, mask_rule(False, 4))
    torch.testing.assert_close(out16.double(), want16, **FP32_TOL)
    low16, _ = reference.jagged_attention_ref(q16, k16, v16, *args, sm_scale=0.3, window=4, upcast=False)
    assert low16.dtype == torch.bfloat16  # upcast=False: PyTorch's own bf16 computation, the tests' baseline
    torch.testing.assert_close(low16.double(), want16, **specs.FWD_TOL)
    assert not torch.equal(low16.double(), out16.to(torch.bfloat16).double())  # it did compute in bf16


GRAD_CASES = [(False, None, False), (True, 2, False), (True, None, True), (False, 1, True)]


def grad_problem(broadcast_q):
    """Inputs of the gradient tests: GQA, lq != lk, an empty KV sequence (and an empty q one unless PMA)."""
    q_len = 4
    q_lens = [q_len] * 4 if broadcast_q else Q_LENS[:4]
    kv_lens = KV_LENS[:4]
    q, k, v = make_qkv(q_len if broadcast_q else sum(q_lens), sum(kv_lens), 4, 2, 8, seed=11)
    grad_out = torch.randn(sum(q_lens), 4, 8, generator=torch.Generator().manual_seed(12))
    q_offsets = offsets_of([q_len]) if broadcast_q else offsets_of(q_lens)
    return q, k, v, grad_out, q_offsets, offsets_of(kv_lens), q_lens, kv_lens


def naive_grads(q, k, v, grad_out, q_lens, kv_lens, causal, window, broadcast_q):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, _ = naive_attention(*leaves, q_lens, kv_lens, 1 / math.sqrt(q.shape[-1]), mask_rule(causal, window),
                             broadcast_q=broadcast_q)
    return torch.autograd.grad(out, leaves, grad_out.double())


@pytest.mark.parametrize("causal,window,broadcast_q", GRAD_CASES)
def test_jagged_autograd_matches_naive_float64_autograd(causal, window, broadcast_q):
    q, k, v, grad_out, q_offsets, kv_offsets, q_lens, kv_lens = grad_problem(broadcast_q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = reference.jagged_attention_ref(*leaves, q_offsets, kv_offsets, causal=causal, window=window,
                                            broadcast_q=broadcast_q)
    got = torch.autograd.grad(out, leaves, grad_out)
    want = naive_grads(q, k, v, grad_out, q_lens, kv_lens, causal, window, broadcast_q)
    for name, g, w in zip("qkv", got, want):
        assert torch.all(torch.isfinite(g)), f"d{name} has non-finite values"
        torch.testing.assert_close(g.double(), w, **FP32_GRAD_TOL, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal,window,broadcast_q", GRAD_CASES)
def test_explicit_backward_matches_naive_float64_autograd(causal, window, broadcast_q):
    q, k, v, grad_out, q_offsets, kv_offsets, q_lens, kv_lens = grad_problem(broadcast_q)
    got = reference.jagged_attention_bwd_ref(grad_out.double(), q.double(), k.double(), v.double(), q_offsets,
                                             kv_offsets, causal=causal, window=window, broadcast_q=broadcast_q)
    want = naive_grads(q, k, v, grad_out, q_lens, kv_lens, causal, window, broadcast_q)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, **FP64_TOL, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_jagged_at_scale_matches_sdpa(causal):
    """Thousands of tokens: equal lengths make the problem dense, so SDPA is an independent check."""
    batch, length, heads, head_dim = 16, 256, 4, 64
    q, k, v = make_qkv(batch * length, batch * length, heads, heads, head_dim, seed=13)
    offsets = offsets_of([length] * batch)
    out, _ = reference.jagged_attention_ref(q, k, v, offsets, offsets, causal=causal)
    dense = [t.view(batch, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*dense, is_causal=causal).transpose(1, 2).reshape_as(out)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ---- block attention -----------------------------------------------------------------------------
def block_rule(block):
    return lambda b, h, i, j, lq, lk: i // block == j // block


@pytest.mark.parametrize("block,lengths", [(4, [9, 0, 4, 13, 1]), (specs.BLOCK_ATTENTION_BLOCK, [130, 64, 5])])
def test_block_attention_matches_naive(block, lengths):
    q, k, v = make_qkv(sum(lengths), sum(lengths), 4, 2, 8, seed=17)
    out = reference.block_attention_ref(q, k, v, offsets_of(lengths), block)
    want, _ = naive_attention(q, k, v, lengths, lengths, 1 / math.sqrt(8), block_rule(block))
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), want, **FP32_TOL)


def test_block_attention_gradients_match_naive():
    lengths, block = [9, 3, 6], 4
    q, k, v = make_qkv(sum(lengths), sum(lengths), 2, 2, 8, seed=19)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(20))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(reference.block_attention_ref(*leaves, offsets_of(lengths), block), leaves, grad_out)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, _ = naive_attention(*leaves64, lengths, lengths, 1 / math.sqrt(8), block_rule(block))
    want = torch.autograd.grad(want_out, leaves64, grad_out.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, **FP32_GRAD_TOL)


# ---- block-sparse attention ----------------------------------------------------------------------
def test_block_sparse_matches_naive():
    q_lens, kv_lens, block_m, block_n, heads = [7, 0, 5], [9, 3, 10], 2, 3, 2
    q, k, v = make_qkv(sum(q_lens), sum(kv_lens), heads, 1, 8, seed=23)
    gen = torch.Generator().manual_seed(24)
    n_q_blocks, max_sel = 4, 3
    # Random picks in [-1, 4): -1 is padding, 3 is beyond the 3-block KV sequences of batch 0 and 2
    # only partially; repeats happen and must count once.
    kv_block_idx = torch.randint(-1, 4, (3, heads, n_q_blocks, max_sel), generator=gen, dtype=torch.int32)
    chosen = kv_block_idx.tolist()

    def rule(b, h, i, j, lq, lk):
        return (j // block_n) in chosen[b][h][i // block_m] and j <= i + (lk - lq)

    out, lse = reference.block_sparse_attention_ref(q, k, v, offsets_of(q_lens), offsets_of(kv_lens), kv_block_idx,
                                                    block_m, block_n, causal=True)
    want_out, want_lse = naive_attention(q, k, v, q_lens, kv_lens, 1 / math.sqrt(8), rule)
    torch.testing.assert_close(out.double(), want_out, **FP32_TOL)
    torch.testing.assert_close(lse.double(), want_lse, **FP32_TOL)


def test_block_sparse_with_every_block_selected_is_dense():
    q_lens, kv_lens, block_m, block_n = [7, 5], [9, 10], 4, 4
    q, k, v = make_qkv(sum(q_lens), sum(kv_lens), 2, 2, 8, seed=29)
    every = torch.arange(3, dtype=torch.int32).expand(2, 2, 2, 3)
    out, lse = reference.block_sparse_attention_ref(q, k, v, offsets_of(q_lens), offsets_of(kv_lens), every,
                                                    block_m, block_n)
    want_out, want_lse = reference.jagged_attention_ref(q, k, v, offsets_of(q_lens), offsets_of(kv_lens))
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)


# ---- rotary ----------------------------------------------------------------------------------------
def naive_rotary(x, sinu_pos, sign=1.0):
    """Pair p of every row turns by its angle: sin in column p of sinu_pos, cos in column D/2 + p."""
    x = x.double()
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for p in range(half):
        sin, cos = sign * sinu_pos[:, p, None].double(), sinu_pos[:, half + p, None].double()
        a, b = x[..., 2 * p], x[..., 2 * p + 1]
        out[..., 2 * p] = a * cos - b * sin
        out[..., 2 * p + 1] = b * cos + a * sin
    return out


def test_rotary_and_conjugate_match_naive_and_invert():
    lengths, heads, head_dim = [5, 0, 8], 3, 16
    offsets = offsets_of(lengths)
    sinu_pos = reference.make_sinu_pos(offsets, head_dim)
    x = randn(sum(lengths), heads, head_dim, gen=torch.Generator().manual_seed(31))
    rotated = reference.rotary_ref(x, sinu_pos)
    torch.testing.assert_close(rotated.double(), naive_rotary(x, sinu_pos), **FP32_TOL)
    torch.testing.assert_close(reference.rotary_conj_ref(x, sinu_pos).double(), naive_rotary(x, sinu_pos, -1.0),
                               **FP32_TOL)
    torch.testing.assert_close(reference.rotary_conj_ref(rotated, sinu_pos), x, **FP32_TOL)
    # Positions restart at each sequence: row 0 of every sequence is not rotated (sin 0, cos 1).
    starts = offsets[:-1][torch.tensor(lengths) > 0].long()
    torch.testing.assert_close(rotated[starts], x[starts])


def test_rotary_backward_is_the_conjugate():
    x = randn(6, 2, 8, gen=torch.Generator().manual_seed(37)).requires_grad_()
    sinu_pos = reference.make_sinu_pos(offsets_of([6]), 8)
    grad_out = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(38))
    (grad_x,) = torch.autograd.grad(reference.rotary_ref(x, sinu_pos), x, grad_out)
    torch.testing.assert_close(grad_x, reference.rotary_conj_ref(grad_out, sinu_pos), **FP32_TOL)


def test_fused_projection_rotary_block_attention_matches_composition():
    lengths, q_heads, kv_heads, head_dim, embed, block = [70, 0, 9], 4, 2, 8, 12, specs.BLOCK_ATTENTION_BLOCK
    gen = torch.Generator().manual_seed(41)
    rows = sum(lengths)
    x = randn(rows, embed, gen=gen)
    w = randn(embed, (q_heads + 2 * kv_heads) * head_dim, gen=gen) / math.sqrt(embed)
    bias = randn((q_heads + 2 * kv_heads) * head_dim, gen=gen)
    offsets = offsets_of(lengths)
    sinu_pos = reference.make_sinu_pos(offsets, head_dim)
    out = reference.fused_projection_rotary_block_attention_ref(x, w, sinu_pos, offsets, q_heads, kv_heads, bias)

    qkv = x.double() @ w.double() + bias.double()
    q = naive_rotary(qkv[:, :q_heads * head_dim].reshape(rows, q_heads, head_dim), sinu_pos)
    k = naive_rotary(qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim),
                     sinu_pos)
    v = naive_rotary(qkv[:, (q_heads + kv_heads) * head_dim:].reshape(rows, kv_heads, head_dim), sinu_pos)
    want, _ = naive_attention(q, k, v, lengths, lengths, 1 / math.sqrt(head_dim), block_rule(block))
    assert out.shape == (rows, q_heads * head_dim)
    torch.testing.assert_close(out.double(), want.reshape(rows, -1), atol=1e-4, rtol=1e-4)


# ---- FP8 quantization ------------------------------------------------------------------------------
E4M3_REL_STEP = 2.0 ** -4  # 3 mantissa bits: round-to-nearest error <= half of 2**-3 relative
E4M3_MIN_SUBNORMAL = 2.0 ** -9


def test_fp8_per_block_round_trip():
    rows, heads, head_dim, block_rows = 300, 2, 16, specs.FP8_BLOCK_ROWS
    x = randn(rows, heads, head_dim, gen=torch.Generator().manual_seed(43)) * 5
    x[:block_rows, 1] = 0  # an all-zero (block, head) must not divide by zero
    x_fp8, scale = reference.fp8_quantize_per_block(x, block_rows)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.shape == (3, heads)
    assert scale[0, 1] == 1.0
    back = reference.fp8_dequantize_per_block(x_fp8, scale, block_rows)
    step = scale.repeat_interleave(block_rows, 0)[:rows, :, None]
    assert torch.all((back - x).abs() <= E4M3_REL_STEP * x.abs() + E4M3_MIN_SUBNORMAL * step)
    # Each nonzero block's largest element maps to E4M3's largest value: the full range is used.
    for start in range(0, rows, block_rows):
        block_top = x_fp8[start:start + block_rows].float().abs().amax(dim=(0, 2))
        nonzero = x[start:start + block_rows].abs().amax(dim=(0, 2)) > 0
        assert torch.all(block_top[nonzero] == reference.FP8_E4M3_MAX)


def test_mx_round_trip_scale_format_and_accuracy():
    x = randn(40, 3, 64, gen=torch.Generator().manual_seed(47)) * torch.logspace(-3, 3, 64)
    x[0, 0, :specs.MX_BLOCK] = 0
    elements, scales = reference.mx_quantize(x)
    assert elements.dtype == torch.float8_e4m3fn and elements.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (40, 3, 64 // specs.MX_BLOCK)
    # The scale byte is E8M0's bit pattern: check against torch's own E8M0 type.
    scale_values = torch.exp2(scales.float() - reference.E8M0_BIAS)
    torch.testing.assert_close(scale_values.to(torch.float8_e8m0fnu).view(torch.uint8), scales)
    block_top = elements.float().abs().unflatten(-1, (-1, specs.MX_BLOCK)).amax(-1)
    nonzero = block_top > 0
    assert torch.all((block_top[nonzero] >= 256) & (block_top[nonzero] <= reference.FP8_E4M3_MAX))
    back = reference.mx_dequantize(elements, scales)
    step = scale_values.repeat_interleave(specs.MX_BLOCK, -1)
    # The shared exponent puts the block max in [256, 512): elements above 448 saturate (OCP MX rule).
    saturated = x.abs() > reference.FP8_E4M3_MAX * step
    assert saturated.any(), "the inputs should exercise saturation"
    torch.testing.assert_close(back[saturated], x[saturated].sign() * reference.FP8_E4M3_MAX * step[saturated])
    error = (back - x).abs()[~saturated]
    assert torch.all(error <= E4M3_REL_STEP * x.abs()[~saturated] + E4M3_MIN_SUBNORMAL * step[~saturated])
    assert F.cosine_similarity(back.flatten(), x.flatten(), dim=0) > 0.999


def test_mx_rejects_ragged_last_dim():
    with pytest.raises(ValueError, match="multiple of the MX block"):
        reference.mx_quantize(torch.randn(4, 33))


def test_fp8_quantize_per_tensor_maps_the_largest_value_to_448():
    x = torch.randn(300, 2, 16, dtype=torch.float64) * 7
    x_fp8, scale = reference.fp8_quantize_per_tensor(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and isinstance(scale, float)
    assert float(x_fp8.float().abs().max()) == reference.FP8_E4M3_MAX
    back = x_fp8.double() * scale
    assert torch.all((back - x).abs() <= E4M3_REL_STEP * x.abs() + E4M3_MIN_SUBNORMAL * scale)
    zeros, unit = reference.fp8_quantize_per_tensor(torch.zeros(4, 1, 8))
    assert unit == 1.0 and not zeros.float().any()


def test_fp8_agreement_is_cosine_and_sqnr():
    want = torch.randn(1000, dtype=torch.float64)
    noise = torch.randn(1000, dtype=torch.float64) * 0.01
    cosine, sqnr = reference.fp8_agreement(want + noise, want)
    assert cosine == pytest.approx(float(F.cosine_similarity(want + noise, want, dim=0)))
    assert sqnr == pytest.approx(10 * math.log10(float(want.square().sum() / noise.square().sum())))
    cosine, sqnr = reference.fp8_agreement(want, want)  # exact: no division by a zero noise power
    assert cosine == pytest.approx(1.0) and math.isfinite(sqnr)
