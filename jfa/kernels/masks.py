"""Which (query, key) pairs may attend, and the ranges of key tiles and query blocks that follow.

This is the one definition of visibility. The kernels call these functions; the host schedules
(`jfa.schedule`) and the PyTorch references (`jfa.reference`) run the very same source on torch
tensors through `jfa.kernels.twin.torch_twin`, so the three can never disagree.

Positions are sequence-local. A key past the sequence end is never visible: a TMA box may hold rows
of the next sequence (or zeros past the tensor end), and masking them is what makes that harmless.
Causal is bottom-right aligned (query i sees key j iff j <= i + kv_len - q_len, FlashAttention's
convention); the window is the symmetric band |i - j| <= W.

The functions broadcast: `visible(rows[:, None], cols[None, :], ...)` is a [queries, keys] tile,
`visible(rows[None, :], cols[:, None], ...)` its transpose (the backward's S^T orientation).
"""
import triton
import triton.language as tl


@triton.jit
def visible(q_idx, k_idx, q_len, kv_len, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """May query `q_idx` attend to key `k_idx`? (Elementwise, broadcasting; query rows past the
    sequence end are the caller's to mask where they matter.)"""
    ok = k_idx < kv_len
    if CAUSAL:
        ok = ok & (k_idx <= q_idx + (kv_len - q_len))
    if HAS_WINDOW:
        ok = ok & (k_idx >= q_idx - window)
        ok = ok & (k_idx <= q_idx + window)
    return ok


@triton.jit
def visible_key_range(row_lo, row_hi, q_len, kv_len, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(kv_lo, kv_hi, full_lo, full_hi) for the query rows row_lo..row_hi (row_hi the last real one).

    Keys in [kv_lo, kv_hi) are visible to some row of the block, keys in [full_lo, full_hi) to every
    row (possibly empty, full_lo >= full_hi). A key tile inside the second range needs no mask.
    """
    kv_lo = 0
    kv_hi = kv_len
    full_lo = 0
    full_hi = kv_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, row_hi + (kv_len - q_len) + 1)
        full_hi = tl.minimum(full_hi, row_lo + (kv_len - q_len) + 1)
    if HAS_WINDOW:
        kv_lo = tl.maximum(row_lo - window, 0)
        kv_hi = tl.minimum(kv_hi, row_hi + window + 1)
        full_lo = tl.maximum(row_hi - window, 0)
        full_hi = tl.minimum(full_hi, row_lo + window + 1)
    return kv_lo, kv_hi, full_lo, full_hi


@triton.jit
def visible_query_blocks(col0, q_len, kv_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(first_row, num_blocks): the BLOCK_M-row query blocks, from sequence-local row first_row on,
    that see a key of the BLOCK_N-key tile starting at column col0 (0 blocks when no row does)."""
    col_last = tl.minimum(col0 + BLOCK_N, kv_len) - 1  # the tile's last real key
    q_lo = q_len * 0
    q_hi = q_len
    if CAUSAL:
        q_lo = tl.maximum(q_lo, col0 - (kv_len - q_len))
    if HAS_WINDOW:
        q_lo = tl.maximum(q_lo, col0 - window)
        q_hi = tl.minimum(q_hi, col_last + window + 1)
    first_row = (q_lo // BLOCK_M) * BLOCK_M  # q_lo >= 0: truncation is floor
    return first_row, tl.where(q_hi > q_lo, (q_hi - first_row + (BLOCK_M - 1)) // BLOCK_M, 0)


@triton.jit
def full_query_blocks(first_key, last_key, first_row, num_blocks, q_len, kv_len, window, BLOCK_M: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(lo, hi): the query blocks i in [lo, hi) of rows first_row + i*BLOCK_M .. + BLOCK_M-1 that see
    every key first_key..last_key (all rows inside the sequence, the keys inside it, below the causal
    diagonal and inside the window): their steps need no mask. lo <= hi <= num_blocks."""
    hi = tl.where(last_key < kv_len, tl.maximum(q_len - first_row, 0) // BLOCK_M, 0)
    lo = 0
    if CAUSAL:
        lo = tl.maximum(lo, tl.cdiv(tl.maximum(last_key - (kv_len - q_len) - first_row, 0), BLOCK_M))
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.cdiv(tl.maximum(last_key - window - first_row, 0), BLOCK_M))
        hi = tl.minimum(hi, tl.maximum(first_key + window - first_row + 1, 0) // BLOCK_M)
    hi = tl.minimum(hi, num_blocks)
    return tl.minimum(lo, hi), hi
