"""The block-sparse fork: each 128-row query block visits only the key blocks it selects.

Nothing of the skeletons changes but their iteration. The forward and dQ kernels walk a query
block's key tiles through `Fork.key_tiles` / `Fork.key_tile_col`; here the n-th tile is the n-th
selected block instead of the n-th consecutive one. The dK/dV kernel streams past each key block the
query blocks that selected it (`Fork.query_blocks` / `Fork.query_block_row`, over the transposed
selection). The selection comes canonical (`jfa.sparse.canonical_selection`): per (sequence, head,
row block) distinct blocks in ascending order, padded, and their count.

Without a window every query row sees key 0, so the blocks every row sees whole are a prefix of
the ascending order: they form the mask-free bulk, and the masked ones (the sequence's partial last
block, blocks the causal diagonal cuts) come after it.

A kernel whose tiles are shorter than a selection block (the dQ kernel's 64 keys, the dK/dV kernel's
64 query rows) takes each selected block as SELECTION_BLOCK // tile consecutive tiles.

Runtime arguments (`params`), for either direction of the selection:
    (blocks_ptr, counts_ptr, row_blocks, width, num_heads)
"""
import triton
import triton.language as tl

from jfa import specs
from jfa.kernels.hooks import Fork

SELECTION_BLOCK: tl.constexpr = tl.constexpr(specs.BLOCK_SPARSE_BLOCK)  # rows and keys of a selection block


@triton.jit
def _selection_row(seq, head, row_block, params):
    """(pointer to the first pick, count) of the selection's row for (sequence, head, row block)."""
    blocks_ptr, counts_ptr, row_blocks, width, num_heads = params
    entry = (seq * num_heads + head) * row_blocks + row_block
    return blocks_ptr + entry.to(tl.int64) * width, tl.load(counts_ptr + entry)


@triton.jit
def _tile_start(n, cursor, TILE: tl.constexpr):
    """The first row or key of the n-th TILE-long tile over the selected blocks listed at `cursor`."""
    TILES_PER_BLOCK: tl.constexpr = SELECTION_BLOCK // TILE
    return tl.load(cursor + n // TILES_PER_BLOCK) * SELECTION_BLOCK + (n % TILES_PER_BLOCK) * TILE


@triton.jit
def selected_key_tiles(seq, head, q_block, kv_lo, kv_hi, full_lo, full_hi, params, BLOCK_N: tl.constexpr):
    """A query block's key tiles: its selected blocks, in ascending order; the whole ones lead (the bulk)."""
    TILES_PER_BLOCK: tl.constexpr = SELECTION_BLOCK // BLOCK_N
    cursor, count = _selection_row(seq, head, q_block, params)
    count = tl.where(kv_hi > kv_lo, count, 0)
    whole = 0
    for pick in range(count):
        whole += ((tl.load(cursor + pick) + 1) * SELECTION_BLOCK <= full_hi).to(tl.int32)
    num_tiles = count * TILES_PER_BLOCK
    bulk_lo = tl.minimum(1, num_tiles)
    bulk_hi = tl.maximum(whole * TILES_PER_BLOCK, bulk_lo)
    return 0, cursor, num_tiles, bulk_lo, bulk_hi


@triton.jit
def selected_key_col(n, first_col, cursor, BLOCK_N: tl.constexpr):
    """The first key of a query block's n-th key tile."""
    return _tile_start(n, cursor, BLOCK_N)


@triton.jit
def selecting_query_blocks(seq, head, kv_block, num_q_blocks, params, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """(cursor, count) of the query blocks streamed past a key block: those that selected it."""
    cursor, count = _selection_row(seq, head, kv_block, params)
    return cursor, count * (SELECTION_BLOCK // BLOCK_M)


@triton.jit
def selecting_query_row(block, first_row, cursor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first row of the `block`-th query block streamed past a key block."""
    return _tile_start(block, cursor, BLOCK_M)


BLOCK_SPARSE_FORK = Fork(key_tiles=selected_key_tiles, key_tile_col=selected_key_col,
                         query_blocks=selecting_query_blocks, query_block_row=selecting_query_row)


def selection_params(selection, num_heads: int) -> tuple:
    """The fork's `params` for a selection (`jfa.sparse.BlockSelection`, either direction)."""
    return (selection.blocks, selection.counts, selection.row_blocks, selection.width, num_heads)
