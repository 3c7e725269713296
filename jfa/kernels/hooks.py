"""What a fork may change in the kernel skeletons, and the skeletons' calls into it.

The forward, dQ and dK/dV kernels each take one compile-time `Fork`: a named tuple of
`@triton.jit` functions. A field that is None compiles to nothing, so the unforked kernel carries no
trace of the hooks. A fork replaces a few fields (`Fork(...)._replace(...)`, `jfa.variant(...)` for
user forks) and keeps the warp roles, rings, schedule and epilogues.

The hooks, with the arguments they receive:

iteration (forward and dQ visit key tiles; dK/dV streams query blocks):
    key_tiles(seq, head, q_block, kv_lo, kv_hi, full_lo, full_hi, params, BLOCK_N)
        -> (first_col, cursor, num_tiles, bulk_lo, bulk_hi)   the key tiles a query block visits
    key_tile_col(n, first_col, cursor, BLOCK_N) -> col           the n-th one's first key
    query_blocks(seq, head, kv_block, num_q_blocks, params, BLOCK_M, BLOCK_N) -> (cursor, count)
    query_block_row(block, first_row, cursor, BLOCK_M, BLOCK_N) -> row
math (scores are fp32 logits already multiplied by sm_scale; q_idx and k_idx are sequence-local
positions shaped to broadcast against them, so `k_idx - q_idx` is a tile in either orientation):
    score_mod(score, seq, head, q_idx, k_idx, params) -> score
    score_grad(grad, score, seq, head, q_idx, k_idx, params) -> grad   d(loss)/d(score) from
        d(loss)/d(score_mod(score)); required with score_mod in the backward
    mask_mod(seq, head, q_idx, k_idx, params) -> visible   ANDed with padding, causal and window
    block_mask(seq, head, q_lo, q_hi, k_lo, k_hi, params) -> may the rows q_lo..q_hi see any key of
        k_lo..k_hi? (inclusive; a conservative block form of mask_mod: key tiles it rules out are
        neither loaded nor computed)
operands (FP8 and microscaled forks):
    value_shape(BLOCK_N, HEAD_DIM) -> the shape of a V buffer in shared memory
    load_values(desc, buffer, kv_start, col, seq, kv_col, barrier, KEYS)   the producer's V load
    value_operand(buffer, KEYS) -> P·V's B operand (the first KEYS keys) from a V buffer
    pv(p, values, acc) -> acc   P·V's wgmma, P still fp32 (the fork quantizes it)
    scale_output(acc, params) -> acc   the accumulator before normalization

`params` is the tuple of runtime arguments the fork was called with (tensors, numbers), the same
for every hook; `jfa.variant` passes the user's.
"""
from typing import NamedTuple

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.kernels.masks import visible
from jfa.kernels.ring import leading_rows
from jfa.kernels.softmax import LN2, LOG2E
from jfa.kernels.tiles import consecutive_key_col, consecutive_key_tiles, consecutive_query_blocks, \
    consecutive_query_row


@triton.jit
def key_major_values(BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A V buffer as the keys' rows: `[BLOCK_N, HEAD_DIM]`, the B operand of P·V as loaded."""
    return (BLOCK_N, HEAD_DIM)


@triton.jit
def load_value_rows(desc, buffer, kv_start, col, seq, kv_col, barrier, KEYS: tl.constexpr):
    """TMA-load the first KEYS keys of a V tile (rows kv_start + col ..) into `buffer`."""
    tlx.async_descriptor_load(desc, leading_rows(buffer, KEYS), [kv_start + col, kv_col], barrier)


@triton.jit
def leading_value_rows(buffer, KEYS: tl.constexpr):
    """P·V's B operand from a key-major V buffer: its first KEYS keys."""
    return leading_rows(buffer, KEYS)


@triton.jit
def pv_wgmma(p, values, acc):
    """acc += P·V by wgmma, P cast to V's dtype in registers (the A operand), V from shared memory."""
    return tlx.async_dot(p.to(values.dtype), values, acc)


class Fork(NamedTuple):
    """The hooks of the kernel skeletons (module docstring); None keeps the built-in behaviour."""

    key_tiles: object = consecutive_key_tiles
    key_tile_col: object = consecutive_key_col
    query_blocks: object = consecutive_query_blocks
    query_block_row: object = consecutive_query_row
    score_mod: object = None
    score_grad: object = None
    mask_mod: object = None
    block_mask: object = None
    value_shape: object = key_major_values
    load_values: object = load_value_rows
    value_operand: object = leading_value_rows
    pv: object = pv_wgmma
    scale_output: object = None


DEFAULT_FORK = Fork()


@triton.jit
def softmax_scores(qk, q_idx, k_idx, seq, head, q_len, kv_len, window, params, qk_scale_log2, MASKED: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, FORK: tl.constexpr):
    """(scores, scale_log2) of one tile for `softmax.online_softmax_step` or the backward's P.

    Raw Q·K^T comes in; invisible pairs leave as -inf where MASKED. Without a score_mod the scores
    stay raw and `qk_scale_log2` (sm_scale * log2 e) scales them inside the exponent; with one, the
    hook sees the sm_scale'd logits and its output is scaled by log2 e alone.
    """
    if FORK.score_mod is not None:
        scores = FORK.score_mod(qk * (qk_scale_log2 * LN2), seq, head, q_idx, k_idx, params)
        scale_log2 = LOG2E
    else:
        scores = qk
        scale_log2 = qk_scale_log2
    if MASKED:
        ok = visible(q_idx, k_idx, q_len, kv_len, window, CAUSAL, HAS_WINDOW)
        if FORK.mask_mod is not None:
            ok = ok & FORK.mask_mod(seq, head, q_idx, k_idx, params)
        scores = tl.where(ok, scores, float("-inf"))
    return scores, scale_log2


@triton.jit
def backward_probabilities(s, lse_log2, q_idx, k_idx, seq, head, q_len, kv_len, window, params, qk_scale_log2,
                           MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, FORK: tl.constexpr,
                           rows_ok=None):
    """P of one tile of the backward, recomputed from raw Q·K^T `s` and the forward's LSE (log2 units,
    already broadcast against `s`); invisible pairs get 0 where MASKED, and so do query rows past the
    sequence end where `rows_ok` is given (a kernel that sums over query rows, dK and dV, needs it).

    The mask applies after the exponential, as a select: a query row that saw no key has LSE -inf,
    and exp2 of its scores is inf or NaN, never used."""
    if FORK.score_mod is not None:
        p = tl.math.exp2(FORK.score_mod(s * (qk_scale_log2 * LN2), seq, head, q_idx, k_idx, params) * LOG2E - lse_log2)
    else:
        p = tl.math.exp2(s * qk_scale_log2 - lse_log2)
    if MASKED:
        ok = visible(q_idx, k_idx, q_len, kv_len, window, CAUSAL, HAS_WINDOW)
        if FORK.mask_mod is not None:
            ok = ok & FORK.mask_mod(seq, head, q_idx, k_idx, params)
        if rows_ok is not None:
            ok = ok & rows_ok
        p = tl.where(ok, p, 0.0)
    return p


@triton.jit
def score_gradient(ds, s, q_idx, k_idx, seq, head, params, qk_scale_log2, FORK: tl.constexpr):
    """dS with respect to the sm_scale'd logits: through the fork's score_grad when it modifies scores."""
    if FORK.score_mod is not None:
        ds = FORK.score_grad(ds, s * (qk_scale_log2 * LN2), seq, head, q_idx, k_idx, params)
    return ds


@triton.jit
def block_visible(seq, head, q_lo, q_hi, k_lo, k_hi, params, FORK: tl.constexpr):
    """Whether a key tile may hold a visible pair for these rows: the fork's block_mask, else always."""
    if FORK.block_mask is None:
        ok = True
    else:
        ok = FORK.block_mask(seq, head, q_lo, q_hi, k_lo, k_hi, params)
    return ok


@triton.jit
def key_tile_in_view(tile, n, params, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FORK: tl.constexpr):
    """(first key, whether to visit) of a query tile's n-th key tile: the fork's iteration and block mask."""
    col = FORK.key_tile_col(n, tile.first_col, tile.cursor, BLOCK_N)
    return col, block_visible(tile.seq, tile.head, tile.row_lo, tile.row_lo + BLOCK_M - 1, col, col + BLOCK_N - 1,
                              params, FORK)


@triton.jit
def key_tiles_to_take(tile, problem, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FORK: tl.constexpr):
    """(whole key tiles, the first one to visit) of a query tile: the key tiles taken whole (all but a
    half last one), and the first the fork's block_mask admits (`num_steps` when none does; 0 without
    a block mask). The consumers peel that first tile."""
    num_steps = tile.num_kv_tiles - tile.half_tail
    if FORK.block_mask is None:
        first = 0
    else:
        first = num_steps
        for back in range(num_steps):
            n = num_steps - 1 - back
            _, visible = key_tile_in_view(tile, n, problem.params, BLOCK_M, BLOCK_N, FORK)
            if visible:
                first = n
    return num_steps, first
