"""The tile list and its persistent deal, and what a tile is: its rows, its keys, its iteration.

A persistent kernel runs one program per SM (`persistent_programs`). The host builds a list of
entries sorted by work, longest first (`jfa.schedule`); each program walks it:

- head-major (`tile_loop(..., ENTRY_MAJOR=False)`): tile t is head `t // entries`, entry
  `t % entries`, and program p takes tiles p, p + P, ...; the programs running together work on one
  head's blocks of a few sequences, which share their K/V through L2;
- entry-major (`ENTRY_MAJOR=True`, when every sequence is one query block and there is no K/V to
  share): tile t is entry `t // G`, head group `t % G`, dealt in zigzag turns (`zigzag_tile`), so
  the list stays longest first across heads and the deal balances it.

A query tile (forward, dQ) is (sequence, query block, head); `query_tile` decodes one and asks the
fork's iteration (`Fork.key_tiles`, consecutive key tiles by default) which key tiles it visits and
which of them need no mask. A key tile (dK/dV) is (sequence, key block, key head); `key_tile`
decodes one, and `Fork.query_blocks` says which query blocks stream past it.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from jfa.kernels.masks import visible_key_range, visible_query_blocks

ROWS_PER_CONSUMER: tl.constexpr = tl.constexpr(64)  # one wgmma M-tile of query rows per consumer warpgroup


# ---- the persistent deal ---------------------------------------------------------------------------

@triton.jit
def zigzag_tile(turn, prog, num_progs):
    """The tile program `prog` takes on its `turn`-th pass over a list sorted longest first.

    Each turn deals the next `num_progs` tiles, one per program, in alternating directions: program
    p takes the p-th of them on even turns and the (num_progs-1-p)-th on odd ones. Dealing always in
    the same direction would hand program 0 the longest tile of every turn and the last program the
    shortest, a gap that grows with every turn; alternating pairs each long draw with a short one.
    """
    return turn * num_progs + tl.where(turn % 2 == 0, prog, num_progs - 1 - prog)


@triton.jit
def zigzag_turns(num_tiles, prog, num_progs):
    """How many tiles program `prog` of `num_progs` takes from a list of `num_tiles` (`zigzag_tile`)."""
    full_turns = num_tiles // num_progs
    return full_turns + (zigzag_tile(full_turns, prog, num_progs) < num_tiles).to(tl.int32)


@triton.jit
def tile_loop(num_tiles, ENTRY_MAJOR: tl.constexpr):
    """(start, end, step) of this program's loop over the tile list: its zigzag turns entry-major
    (`dealt_tile` maps a turn to its tile), its every P-th tile head-major (the loop variable is the tile)."""
    prog = tl.program_id(0)
    num_progs = tl.num_programs(0)
    if ENTRY_MAJOR:
        return 0, zigzag_turns(num_tiles, prog, num_progs), 1
    return prog, num_tiles, num_progs


@triton.jit
def dealt_tile(step, ENTRY_MAJOR: tl.constexpr):
    """The tile of loop step `step` of `tile_loop`."""
    if ENTRY_MAJOR:
        return zigzag_tile(step, tl.program_id(0), tl.num_programs(0))
    return step


def persistent_programs(num_sms: int, units: int) -> int:
    """A persistent grid: one program per SM, fewer when there are fewer work units, at least one."""
    return max(1, min(num_sms, units))


# ---- where a sequence's rows are ---------------------------------------------------------------------

@triton.jit
def sequence_rows(seq, q_offsets_ptr, kv_offsets_ptr, broadcast_q_len, BROADCAST_Q: tl.constexpr):
    """(q_start, q_len, out_row0, kv_start, kv_len) of sequence `seq`.

    With broadcast-Q every sequence reads the one shared query (rows 0..q_len-1) while its output
    rows (and dO, LSE, Delta) start at seq * q_len.
    """
    kv_start = tl.load(kv_offsets_ptr + seq)
    kv_len = tl.load(kv_offsets_ptr + seq + 1) - kv_start
    if BROADCAST_Q:
        q_start = 0
        q_len = broadcast_q_len
        out_row0 = seq * broadcast_q_len
    else:
        q_start = tl.load(q_offsets_ptr + seq)
        q_len = tl.load(q_offsets_ptr + seq + 1) - q_start
        out_row0 = q_start
    return q_start, q_len, out_row0, kv_start, kv_len


class Problem(NamedTuple):
    """The runtime facts of one launch every role reads: the offsets and the shape of the batch."""

    q_offsets_ptr: object
    kv_offsets_ptr: object
    tile_entries_ptr: object
    num_entries: object  # the list's real entries (read once by each program)
    num_heads: object  # the heads the list is walked for: query heads (forward, dQ), key heads (dK/dV)
    blocks_per_seq: object  # query blocks (forward, dQ) or key blocks (dK/dV) per sequence
    broadcast_q_len: object  # the shared query's rows with broadcast-Q, else 0
    window: object
    gqa_group: object  # query heads per key head
    params: object  # the fork's runtime arguments (a tuple), passed to its hooks


# ---- query tiles: forward and dQ ------------------------------------------------------------------------

class QueryTile(NamedTuple):
    """One (sequence, query block, head) tile and the key tiles it visits.

    Its key tiles are n = 0 .. num_kv_tiles-1, the n-th starting at sequence-local column
    `Fork.key_tile_col(n, first_col, cursor, BLOCK_N)`; tiles bulk_lo <= n < bulk_hi need no mask
    (tile 0 is peeled and always masked, so bulk_lo >= 1). `half_tail` is 1 when the last of two or
    more key tiles holds at most BLOCK_N/2 visible keys and is taken as a half tile (HALF_TAIL only).
    `head` is the tile's first query head; `q_key` names its Q block, equal on consecutive tiles
    that may keep the loaded Q.
    """

    seq: object
    head: object
    q_block: object
    q_key: object
    q_row0: object  # first row of the tile's Q block in q
    out_row0: object  # first output row of the tile's sequence
    row_lo: object  # first sequence-local query row of the tile
    q_len: object
    kv_start: object
    kv_len: object
    first_col: object
    cursor: object
    num_kv_tiles: object
    bulk_lo: object
    bulk_hi: object
    half_tail: object


@triton.jit
def consecutive_key_tiles(seq, head, q_block, kv_lo, kv_hi, full_lo, full_hi, params, BLOCK_N: tl.constexpr):
    """The default key iteration: every key tile of [kv_lo, kv_hi), in order.

    Returns (first_col, cursor, num_kv_tiles, bulk_lo, bulk_hi): tiles start at first_col + n*BLOCK_N,
    those inside [full_lo, full_hi) form the mask-free bulk, `cursor` is unused.
    """
    first_col = (kv_lo // BLOCK_N) * BLOCK_N
    num_kv_tiles = tl.where(kv_hi > kv_lo, tl.cdiv(kv_hi - first_col, BLOCK_N), 0)
    bulk_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo - first_col, BLOCK_N), 1), num_kv_tiles)
    bulk_hi = tl.minimum(tl.maximum(tl.maximum(full_hi - first_col, 0) // BLOCK_N, bulk_lo), num_kv_tiles)
    return first_col, first_col, num_kv_tiles, bulk_lo, bulk_hi


@triton.jit
def consecutive_key_col(n, first_col, cursor, BLOCK_N: tl.constexpr):
    """The n-th key tile's first column under the default iteration."""
    return first_col + n * BLOCK_N


@triton.jit
def query_tile(tile, problem, FORK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HEADS_PER_TILE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               BROADCAST_Q: tl.constexpr, HALF_TAIL: tl.constexpr, REUSE_Q: tl.constexpr):
    """Decode a tile id of the query-tile list into a QueryTile.

    Entry-major when a tile pairs two heads (short queries: every sequence is one query block),
    head-major otherwise (`tile_loop`). REUSE_Q (broadcast-Q forward): tiles of the same query block
    and head share `q_key`, so a program keeps their Q loaded.
    """
    if HEADS_PER_TILE == 2:
        head_groups = problem.num_heads // HEADS_PER_TILE
        head = (tile % head_groups) * HEADS_PER_TILE
        entry = tl.load(problem.tile_entries_ptr + tile // head_groups)
    else:
        head = (tile // problem.num_entries) * HEADS_PER_TILE
        entry = tl.load(problem.tile_entries_ptr + tile % problem.num_entries)
    seq = entry // problem.blocks_per_seq
    q_block = entry % problem.blocks_per_seq
    q_start, q_len, out_row0, kv_start, kv_len = sequence_rows(seq, problem.q_offsets_ptr, problem.kv_offsets_ptr,
                                                               problem.broadcast_q_len, BROADCAST_Q)
    if REUSE_Q:
        q_key = q_block * problem.num_heads + head
    else:
        q_key = tile
    row_lo = q_block * BLOCK_M
    row_hi = tl.minimum(row_lo + BLOCK_M, q_len) - 1  # last real query row of the block
    kv_lo, kv_hi, full_lo, full_hi = visible_key_range(row_lo, row_hi, q_len, kv_len, problem.window, CAUSAL,
                                                       HAS_WINDOW)
    first_col, cursor, num_kv_tiles, bulk_lo, bulk_hi = FORK.key_tiles(seq, head, q_block, kv_lo, kv_hi, full_lo,
                                                                       full_hi, problem.params, BLOCK_N)
    if FORK.mask_mod is not None:  # a fork's own mask may cut any tile: none is mask-free
        bulk_lo = num_kv_tiles
        bulk_hi = num_kv_tiles
    half_tail = 0
    if HALF_TAIL:
        tail_keys = kv_hi - first_col - (num_kv_tiles - 1) * BLOCK_N
        half_tail = ((num_kv_tiles > 1) & (tail_keys <= BLOCK_N // 2)).to(tl.int32)
        bulk_lo = tl.minimum(bulk_lo, num_kv_tiles - half_tail)
        bulk_hi = tl.minimum(bulk_hi, num_kv_tiles - half_tail)
    return QueryTile(seq, head, q_block, q_key, q_start + row_lo, out_row0, row_lo, q_len, kv_start, kv_len,
                     first_col, cursor, num_kv_tiles, bulk_lo, bulk_hi, half_tail)


@triton.jit
def query_tile_at(step, problem, CFG: tl.constexpr, FORK: tl.constexpr, BLOCK_M: tl.constexpr,
                  REUSE_Q: tl.constexpr):
    """The QueryTile of loop step `step` of `tile_loop` (entry-major exactly when heads are paired), for a
    kernel configuration `CFG` with the fields HEADS_PER_TILE, BLOCK_N, CAUSAL, HAS_WINDOW, BROADCAST_Q,
    HALF_TAIL."""
    return query_tile(dealt_tile(step, CFG.HEADS_PER_TILE == 2), problem, FORK, BLOCK_M, CFG.BLOCK_N,
                      CFG.HEADS_PER_TILE, CFG.CAUSAL, CFG.HAS_WINDOW, CFG.BROADCAST_Q, CFG.HALF_TAIL, REUSE_Q)


@triton.jit
def consumer_rows(tile, cid: tl.constexpr, PAIRED: tl.constexpr, ROWS: tl.constexpr):
    """(first_row, rows, head) of consumer `cid` in a query tile: its own 64 rows of the tile's head, or
    (paired heads) the tile's 64 rows of head `tile.head + cid`."""
    if PAIRED:
        first_row = tile.row_lo
        head = tile.head + cid
    else:
        first_row = tile.row_lo + cid * ROWS
        head = tile.head
    return first_row, first_row + tl.arange(0, ROWS), head


@triton.jit
def loop_segment(segment: tl.constexpr, start, bulk_lo, bulk_hi, end):
    """[lo, hi) of segment 0 (leading masked tiles), 1 (the mask-free bulk) or 2 (trailing masked
    tiles) of start..end. Written `for segment in tl.static_range(3)`, the three loops share one
    call site, and each is compiled with its own MASKED = segment != 1."""
    if segment == 0:
        return start, bulk_lo
    elif segment == 1:
        return bulk_lo, bulk_hi
    else:
        return bulk_hi, end


# ---- key tiles: dK/dV --------------------------------------------------------------------------------

class KeyTile(NamedTuple):
    """One (sequence, key block, key head) tile: its keys are sequence-local columns col0 ..
    col0 + BLOCK_N - 1, and the query blocks that see them start at row first_row, num_q_blocks of
    them (`masks.visible_query_blocks`, the count the tile list sorts by). `cols` are the KEYS columns
    of one consumer's share."""

    seq: object
    kv_head: object
    q_start: object
    q_len: object
    out_row0: object
    kv_start: object
    kv_len: object
    col0: object
    first_row: object
    num_q_blocks: object
    cols: object


@triton.jit
def key_tile(tile, problem, share, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEYS: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr):
    """Decode a tile id of the key-tile list (head-minor: tile t is entry t // Hkv, key head t % Hkv);
    `share` picks which KEYS columns `cols` holds (a consumer's half)."""
    entry = tl.load(problem.tile_entries_ptr + tile // problem.num_heads)
    kv_head = tile % problem.num_heads
    seq = entry // problem.blocks_per_seq
    col0 = (entry % problem.blocks_per_seq) * BLOCK_N
    q_start, q_len, out_row0, kv_start, kv_len = sequence_rows(seq, problem.q_offsets_ptr, problem.kv_offsets_ptr,
                                                               problem.broadcast_q_len, BROADCAST_Q)
    first_row, num_q_blocks = visible_query_blocks(col0, q_len, kv_len, problem.window, BLOCK_M, BLOCK_N, CAUSAL,
                                                   HAS_WINDOW)
    cols = col0 + share * KEYS + tl.arange(0, KEYS)
    return KeyTile(seq, kv_head, q_start, q_len, out_row0, kv_start, kv_len, col0, first_row, num_q_blocks, cols)


@triton.jit
def consecutive_query_blocks(seq, head, kv_block, num_q_blocks, params, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The default dK/dV iteration: (cursor, count) of the query blocks streamed past a key tile,
    every visible one in order; `cursor` is unused."""
    return num_q_blocks, num_q_blocks


@triton.jit
def consecutive_query_row(block, first_row, cursor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The `block`-th streamed query block's first sequence-local row under the default iteration."""
    return first_row + block * BLOCK_M


# ---- host side -------------------------------------------------------------------------------------

def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device: one persistent program each."""
    return _device_properties(device.index).multi_processor_count


def sm_major(device: torch.device) -> int:
    """The major compute capability of a CUDA device (9 for Hopper)."""
    return _device_properties(device.index).major


_PROPERTIES: dict = {}


def _device_properties(index: int):
    """A device's properties, read once: they never change in a process, and torch's own query costs
    several µs per call, more in a backward (autograd runs it on its device thread)."""
    if index not in _PROPERTIES:
        _PROPERTIES[index] = torch.cuda.get_device_properties(index)
    return _PROPERTIES[index]
