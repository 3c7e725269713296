"""The softmax of attention in the exp2 domain: the forward's streaming step and the backward's P.

The kernels never compute `exp`: e^x = 2^(x * log2 e), and `exp2` is one instruction on the GPU. Q·K^T
is multiplied by `qk_scale_log2 = sm_scale * log2(e)` inside the exponent, so running maxima live in
scaled log2 units. The log-sum-exp the forward writes is in natural-log units (the contract's), and
the backward turns it back with LOG2E.
"""
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # e^x = 2^(x * log2 e)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # back to natural log for the LSE

# Keep the running row maximum until a new tile's maximum exceeds it by more than this many log2
# units (the seed's choice of 8). Probabilities are then bounded by 2^8 = 256 before normalization,
# far inside fp32 and bf16 range (and E4M3's 448), and most key tiles after the first few leave the
# reference alone. On Blackwell that skips a tensor-memory round trip of the accumulator; here the
# accumulator is in registers and is multiplied by alpha (exactly 1 for such rows) either way.
RESCALE_THRESHOLD_LOG2: tl.constexpr = tl.constexpr(8.0)


@triton.jit
def online_softmax_step(scores, m_i, l_i, scale_log2, MAY_HAVE_EMPTY_ROWS: tl.constexpr):
    """Fold one tile of scores into the running (max, sum); returns (p, alpha, m_new, l_new).

    `scores` are raw scores with invisible entries already -inf; `scale_log2` turns them into log2
    units (`sm_scale * LOG2E` for raw Q·K^T). The row reference `m` only moves when the tile's
    maximum exceeds it by more than RESCALE_THRESHOLD_LOG2; `alpha` is the factor the caller applies
    to its accumulator (exactly 1 for rows whose reference stayed). With MAY_HAVE_EMPTY_ROWS (masked
    tiles) a row may have seen no key yet (m = -inf); it takes reference 0 so its probabilities are
    exp2(-inf) = 0 instead of NaN.
    """
    tile_max = tl.max(scores, 1) * scale_log2
    candidate = tl.maximum(m_i, tile_max)
    # -inf - -inf is NaN and compares False: a row that still sees nothing keeps m = -inf.
    moves = (candidate - m_i) > RESCALE_THRESHOLD_LOG2
    m_new = tl.where(moves, candidate, m_i)
    if MAY_HAVE_EMPTY_ROWS:
        reference = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        reference = m_new
    p = tl.math.exp2(scores * scale_log2 - reference[:, None])
    alpha = tl.where(moves, tl.math.exp2(m_i - m_new), 1.0)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def finalize_rows(acc, m_i, l_i, out_dtype: tl.constexpr):
    """Epilogue math: (acc / l in out_dtype, natural-log LSE); a row that saw no key gets 0 and -inf.

    The cast happens here, in the accumulator's register layout, so the layout change a masked
    store needs moves 16-bit values through shared memory instead of fp32 ones (half the scratch).
    """
    saw_keys = l_i > 0.0
    inv_l = tl.where(saw_keys, 1.0 / l_i, 0.0)
    out = (acc * inv_l[:, None]).to(out_dtype)
    lse = tl.where(saw_keys, (m_i + tl.math.log2(l_i)) * LN2, float("-inf"))
    return out, lse


@triton.jit
def lse_delta_rows(lse_ptr, delta_ptr, head, out_row0, q_row0, q_len, stride_lse_head, stride_delta_head,
                   ROWS: tl.constexpr):
    """The backward's per-row terms of the query block at sequence-local row `q_row0`: LSE in log2
    units and Delta = rowsum(O * dO), both 0 past `q_len`. Both are `[heads, rows]` tensors indexed
    by `out_row0 + row`."""
    q_rows = q_row0 + tl.arange(0, ROWS)
    row_ok = q_rows < q_len
    lse = tl.load(lse_ptr + head.to(tl.int64) * stride_lse_head + out_row0 + q_rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + head.to(tl.int64) * stride_delta_head + out_row0 + q_rows, mask=row_ok, other=0.0)
    return lse * LOG2E, delta
