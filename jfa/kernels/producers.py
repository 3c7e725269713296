"""The producer warpgroup's work: TMA loads into the rings, in the order the consumers take them.

The producer is the default task of every warp-specialized kernel here, one warpgroup with few
registers that only issues TMA copies. It walks the same tiles as the consumers, in the same order,
and counts what it loads exactly as they count what they take, so every ring slot's phase matches
(`jfa.kernels.ring`).

- `load_query_rows`: a query tile's Q block (and dO for the dQ kernel), one box per consumer lane;
- `load_key_tiles`: the K/V stream of a query tile: every key tile it visits, K first so that
  Q·K^T can start while V lands; a half last tile through half-height boxes into its slot's first
  half. Forward and dQ share it.
"""
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.kernels.hooks import key_tile_in_view
from jfa.kernels.ring import leading_rows, ring_acquire


@triton.jit
def load_query_rows(desc, ring, count, row0, head, CONSUMERS: tl.constexpr, PAIRED: tl.constexpr, ROWS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BYTES: tl.constexpr, desc_extra=None, extra=None, extra_row0=0):
    """Load a query tile's Q into slot `count` of `ring`, one box per consumer (`tiles.consumer_rows`):
    consumer c's ROWS rows from row0 + c*ROWS of `head`, or with PAIRED heads rows row0.. of head + c.
    With `desc_extra`, a second tensor's boxes (dO, from rows extra_row0 ..) land in `extra[index]` on
    the same barriers (BYTES counts both)."""
    ROW_STEP: tl.constexpr = 0 if PAIRED else ROWS
    HEAD_STEP: tl.constexpr = 1 if PAIRED else 0
    for c in tl.static_range(CONSUMERS):
        index = ring_acquire(ring, count, BYTES, c)
        col = (head + c * HEAD_STEP) * HEAD_DIM
        tlx.async_descriptor_load(desc, ring.buffers[index], [row0 + c * ROW_STEP, col], ring.fulls[index])
        if desc_extra is not None:
            tlx.async_descriptor_load(desc_extra, extra[index], [extra_row0 + c * ROW_STEP, col], ring.fulls[index])


@triton.jit
def load_kv_tile(desc_k, desc_v, k_ring, v_ring, count, kv_start, col, seq, head, gqa_group, LANES: tl.constexpr,
                 HEAD_DIM: tl.constexpr, KEYS: tl.constexpr, FORK: tl.constexpr):
    """Load key tile `count` (its first KEYS keys from column `col`) into the K and V rings, one
    tile per lane (lane l serves query head head + l, which reads key head (head + l) // gqa_group)."""
    K_BYTES: tl.constexpr = KEYS * HEAD_DIM * tlx.size_of(tlx.dtype_of(desc_k))
    V_BYTES: tl.constexpr = KEYS * HEAD_DIM * tlx.size_of(tlx.dtype_of(desc_v))
    for lane in tl.static_range(LANES):
        index = ring_acquire(k_ring, count, K_BYTES, lane)
        kv_col = ((head + lane) // gqa_group) * HEAD_DIM
        tlx.async_descriptor_load(desc_k, leading_rows(k_ring.buffers[index], KEYS), [kv_start + col, kv_col],
                                  k_ring.fulls[index])
    for lane in tl.static_range(LANES):
        index = ring_acquire(v_ring, count, V_BYTES, lane)
        kv_col = ((head + lane) // gqa_group) * HEAD_DIM
        FORK.load_values(desc_v, v_ring.buffers[index], kv_start, col, seq, kv_col, v_ring.fulls[index], KEYS)


@triton.jit
def load_key_tiles(desc_k, desc_v, desc_k_half, desc_v_half, k_ring, v_ring, count, tile, problem,
                   LANES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HALF_TAIL: tl.constexpr, FORK: tl.constexpr):
    """The K/V stream of one query tile (`tiles.QueryTile`): returns the ring count after it.

    The key tiles the fork's block_mask rules out are skipped here and, by the same test, by the
    consumers. A half last tile (HALF_TAIL) comes through the half-height descriptors."""
    num_steps = tile.num_kv_tiles - tile.half_tail  # key tiles loaded whole
    for n in range(num_steps):
        col, visible = key_tile_in_view(tile, n, problem.params, BLOCK_M, BLOCK_N, FORK)
        if visible:
            load_kv_tile(desc_k, desc_v, k_ring, v_ring, count, tile.kv_start, col, tile.seq, tile.head,
                         problem.gqa_group, LANES, HEAD_DIM, BLOCK_N, FORK)
            count += 1
    if HALF_TAIL and tile.half_tail:
        col = tile.first_col + num_steps * BLOCK_N
        load_kv_tile(desc_k_half, desc_v_half, k_ring, v_ring, count, tile.kv_start, col, tile.seq, tile.head,
                     problem.gqa_group, LANES, HEAD_DIM, BLOCK_N // 2, FORK)
        count += 1
    return count
