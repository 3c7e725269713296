"""Jagged flash-attention forward for Hopper (sm_90), warp-specialized with TLX.

Semantics are those of `docs/CONTRACTS.md` (packed `[T, H, D]` sequences, bottom-right causal,
symmetric window, GQA, broadcast-Q "PMA"). This module holds the kernel and its host wrapper.

Work unit. A *tile* is (sequence b, query block of 64 x NUM_CONSUMERS rows, query head h). Its
rows are split between the consumer warpgroups, 64 rows each (two; three for long sequences at
head dim 64, LONG_TUNING); all stream the same K/V tiles of sequence b's visible key range. Short
queries (every sequence <= 64 rows, e.g. broadcast-Q with q_len 64) would leave the second consumer
with padding only, so there a tile is (b, 64 rows, heads h and h+1) for two consumers: each
consumer takes one head and the K/V ring carries both heads' tiles (HEADS_PER_TILE = 2).
The list of (sequence, query block) entries is built on the GPU (`jfa.schedule`), sorted by KV
work, longest first, and a persistent grid of one program per SM works through the tiles. Two
orders (`ENTRY_MAJOR`): head-major, tile t = head (pair) `t // entries`, entry `t % entries`, each
program taking every P-th tile, so that the programs running together work on one head's query
blocks of a few sequences, which share their K/V through L2; and, when every sequence is a single
query block (short queries, PMA q=64) and there is no K/V to share, entry-major, tile t = entry
`t // G`, head group `t % G`, dealt in zigzag turns (`common.zigzag_tile`): the list then stays
longest first across heads, which the zigzag deal balances (the busiest SM's excess work on PMA
q=64 drops from 8% to 0.6%; measured 246 -> 256 TFLOP/s). For longer queries entry-major ordering
cost more through L2 than it gained (dense 643 -> 566 TFLOP/s).

Warp roles of one program (Hopper warp specialization, `tlx.async_tasks`):
- producer (the default task, 4 warps, few registers): TMA loads of Q (twice-buffered, 64 rows
  per consumer) and of K and V into an N-deep ring, each slot guarded by a `full` mbarrier (the TMA
  bytes landed) and an `empty` one (every consumer is done with it);
- NUM_CONSUMERS consumers (`replicate`, 4 warps each, most registers): QK^T by wgmma, online
  softmax in registers, P·V by wgmma with P taken from registers. They take turns issuing wgmma,
  round robin (`common.pingpong_*`): a turn issues QK^T of tile n and P·V of tile n-1 together,
  and the consumer's softmax of tile n runs while its P·V and the other consumers' turns keep the
  tensor cores busy (FlashAttention-3's schedule; see NUM_STAGES for what this needs from Triton).

Jagged addressing. q is viewed as a 2-D `[Tq, Hq*D]` tensor and k, v as `[Tk, Hkv*D]`; a TMA box
is `[rows, D]` at column `head*D`. A box may run past the sequence into the next one (or past the
tensor end, where TMA fills zeros): those keys are masked to -inf and those query rows are never
stored.

Epilogue (`_store_output`). A consumer's output block whose 64 rows all lie inside the sequence is
written to shared memory and leaves by one TMA store; a block that runs past the sequence's end,
whose box would write the next sequence's rows, is read back from that stage and stored from
registers with a row mask. The stage is the consumer's Q slot, free once the tile's last QK^T is
done and released to the producer only after the store has read it (a buffer of its own with
broadcast-Q, below). Measured against the register store of every block on the H200, same process,
3 rounds (results/ab-fwd-stage-out-*): PMA q=256 +4.8%, GEM +0.8-7.7% (L=256 s=1 +7.7%), cross
+3-9%, dense D=128 +2.3%, but GEM L=1024 s=0.5 -3.4% and L=2048 s=0.5 -0.9%: jagged lengths where a
share of the blocks is partial (it was -3.5% too with those blocks kept on the plain register store).

KV loop peeling. Key tiles that no mask can touch (inside the sequence, below the causal diagonal,
inside the window for every row of the block) run without mask arithmetic; only the first tile and
the edge tiles (window start, causal diagonal, window end, sequence end) pay for it.

Half last tile. A jagged sequence rarely ends on a tile boundary: on average half of its last key
tile is padding, which costs the same wgmma work as real keys. When the last of two or more key
tiles holds at most BLOCK_N/2 visible keys, the producer loads only its first half (a second pair of
TMA descriptors with half-height boxes, into the first half of the ring slot) and the consumers run
its QK^T and P·V at half width. It pays only on short sequences, where that half tile is a large
share of the work, and is compiled in only when no KV sequence exceeds `HALF_TAIL_MAX_KV_LEN`.

Broadcast-Q. q is `[q_len, Hq, D]`, shared by every sequence; a tile's Q block is loaded once and
kept while the program's consecutive tiles have the same (query block, head). Head-major, tiles t
and t+P share the head and, when P is a multiple of the query blocks per sequence, the block; Q then
changes only with the head, so one Q slot per consumer serves and the output is staged in buffers of
its own, in the shared memory of the second slot.
Entry-major (q_len fits one tile), consecutive tiles of a program are an odd distance apart under
the zigzag deal, so with several head groups the head changes and Q is loaded again: tens of KB per
tile against the ~1 MB of K/V it streams, and from L2, where the one shared Q stays. Output rows of
sequence b start at `b*q_len`. Q is never copied per sequence.

dQ fork (DQ, `jagged_attention_dq`). The backward's query-stationary dQ is this kernel with another
step: the producer loads dO beside Q, and a KV step (`_consumer_dq_step`) issues S = Q K^T,
dP = dO V^T and the previous tile's dQ += dS K in one ping-pong turn, then forms dS = P (dP - Delta)
from the forward's LSE while that dQ runs. dS takes P's part and K takes V's, so K stays in the ring
a step longer. Tiles, schedule, masks, peeling and half last tiles are the forward's; broadcast-Q
writes one fp32 partial per sequence (no Q reuse: dO differs per sequence).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa import specs
from jfa.fp8 import transposed_value_layout
from jfa.kernels.common import (LOG2E, finalize_rows, loop_segment, lse_delta_rows, online_softmax_step,
                                persistent_programs, pingpong_enter, pingpong_exit, pingpong_start, ring_slot,
                                rows_descriptor, sequence_rows, sm_major, store_rows, visible_key_range, visible_mask,
                                zigzag_tile, zigzag_turns)
from jfa.kernels.launch import CachedLaunch
from jfa.schedule import build_tile_schedule

NUM_Q_BUFFERS = 2  # the next tile's Q lands while this one computes (Q_BUFFERS, unless a tuning says otherwise)
WARPGROUP_WARPS: tl.constexpr = tl.constexpr(specs.WARPGROUP_WARPS)  # wgmma's unit: 4 warps
PRODUCER_WARPS = specs.WARPGROUP_WARPS  # the default task is one warpgroup (the kernel's num_warps)


# Per-configuration tuning, keyed by (head_dim, heads per tile): BLOCK_N keys per KV tile, the K/V
# ring depth, and the consumers' register budget (setmaxnreg). Shared memory at D=128 bf16, one head
# per tile: Q 2x2x16 KB + K,V 2x2x32 KB = 192 KB of the 227 KB an H200 SM allows; two heads per
# tile double the K/V ring, so its KV tiles are 64 keys. At D=128 with one head per tile the
# consumers hold a 64x128 fp32 accumulator, the 64x128 scores and P: at 232 registers ptxas spilled
# inside the KV loop, at 240 (the producer, which only issues TMA, drops to 24) it does not
# (`jfa.inspect` reports the spill bytes).
# NUM_CONSUMERS warpgroups ping-pong on the tensor cores, round robin (LONG_TUNING has three).
TUNING = {
    (64, 1): dict(BLOCK_N=128, NUM_KV_BUFFERS=3, CONSUMER_REGISTERS=232, NUM_CONSUMERS=2),
    (128, 1): dict(BLOCK_N=128, NUM_KV_BUFFERS=2, CONSUMER_REGISTERS=240, NUM_CONSUMERS=2),
    (64, 2): dict(BLOCK_N=128, NUM_KV_BUFFERS=2, CONSUMER_REGISTERS=232, NUM_CONSUMERS=2),
    (128, 2): dict(BLOCK_N=64, NUM_KV_BUFFERS=2, CONSUMER_REGISTERS=232, NUM_CONSUMERS=2),
}
# Long sequences at D=64: a consumer's accumulator is half the D=128 one and three consumers of 64
# rows fit (160 registers each, no spills; FlashAttention-3's 192-row tile for head dim 64), so
# each K/V tile loaded serves 192 query rows instead of 128. Measured on the H200 against TUNING,
# same process, 3 rounds (results/fwd-d64-three-consumers-ab-*): dense D=64 +14%, GEM D=64 from a
# mean of 1024 rows +1-11%; on shorter sequences a 192-row tile leaves up to a third of its rows
# empty (GEM L=256 0.71-0.74x, L=512 s=1 0.90x). So it applies where queries and keys both average
# at least LONG_MEAN_LEN per sequence (means from the packed sizes: no GPU->host sync).
LONG_TUNING = {(64, 1): dict(BLOCK_N=128, NUM_KV_BUFFERS=3, CONSUMER_REGISTERS=160, NUM_CONSUMERS=3)}
LONG_MEAN_LEN = 1024
# Short key sequences: when the keys average at most SHORT_KV_MEAN_LEN per sequence, a tile streams
# one to three 128-key tiles, and what of a tile does not overlap (the peeled first QK^T, the last
# P·V, the padding of the last key tile) is a large share of its work. 64-key tiles in a ring twice
# as deep (the same shared memory, no spills) make each of those half as long. Measured on the
# H200 against TUNING, same process, 3 rotating rounds (results/fwd-short-kv-tuning-*): GEM L=256
# s=0.5 (mean 126 keys) +8.5%, L=256 s=1 (256) +4.8%, L=512 s=0.5 (253) +4.4%; at a mean of 512 or
# more they lost (L=512 s=1 -7%, L=1024 s=0.5 -4%, L=1024 s=1 -13%, dense -10%, PMA q=256 -1.5%).
# The bound sits between the two. The mean is total keys over sequences: no GPU->host sync.
SHORT_KV_TUNING = {(128, 1): dict(BLOCK_N=64, NUM_KV_BUFFERS=4, CONSUMER_REGISTERS=240, NUM_CONSUMERS=2)}
SHORT_KV_MEAN_LEN = 384
# Half last tiles (HALF_TAIL) are compiled in when no KV sequence is longer than this, i.e. at most
# two 128-key tiles, where half a tile is a quarter or more of the work. Measured on the H200 against
# whole last tiles, same process, alternating rounds (results/fwd-half-tail-ab-*): GEM L=256 s=0.5
# +8-9% in both runs (every round faster); at L=512 s=0.5 +1% and L=1024 s=0.5 -0.5% (8 rounds),
# while L=512 s=1 and dense, which have no partial tile, ran 2.6% and 1.5% slower with the path
# compiled in.
HALF_TAIL_MAX_KV_LEN = 256
# The dQ fork (DQ) holds, per consumer, the dQ accumulator, S, dP and dS, and its Q ring carries dO
# too. At D=128 128-key tiles put S, dP and dS (64 + 64 + 32 registers) beside the 64 of dQ, so it
# takes 64-key tiles. A K slot is released a step later than in the forward (dQ += dS K reads it
# during the next step), so with two slots the producer could load the next K only when a step
# ended: D=128 keeps four slots and single-buffers Q and dO instead (two heads per tile: 32-key
# slots). Measured on the H200 against two slots with Q and dO double-buffered, whole backward in
# the separate mode, same process, 3 alternating rounds (results/ab-dq-fork-deep-ring-*): GEM L=256
# s=0.5 0.995x, s=1 1.03x, L=512 s=0.5 1.06x, L=1024 s=1 1.14x, dense 1.11x, PMA q=64 1.02x.
DQ_TUNING = {
    (64, 1): dict(BLOCK_N=64, NUM_KV_BUFFERS=3, CONSUMER_REGISTERS=232, NUM_CONSUMERS=2, Q_BUFFERS=2),
    (128, 1): dict(BLOCK_N=64, NUM_KV_BUFFERS=4, CONSUMER_REGISTERS=240, NUM_CONSUMERS=2, Q_BUFFERS=1),
    (64, 2): dict(BLOCK_N=64, NUM_KV_BUFFERS=3, CONSUMER_REGISTERS=232, NUM_CONSUMERS=2, Q_BUFFERS=2),
    (128, 2): dict(BLOCK_N=32, NUM_KV_BUFFERS=4, CONSUMER_REGISTERS=240, NUM_CONSUMERS=2, Q_BUFFERS=1),
}
# With broadcast-Q the fork stores fp32 per-sequence partials, and at D=128 their masked store takes
# 64 KB of layout-conversion scratch: three K/V slots, and with two heads per tile 32-key K/V tiles.
DQ_PARTIALS_TUNING = {
    (128, 1): dict(BLOCK_N=64, NUM_KV_BUFFERS=3, CONSUMER_REGISTERS=240, NUM_CONSUMERS=2, Q_BUFFERS=1),
    (128, 2): dict(BLOCK_N=32, NUM_KV_BUFFERS=3, CONSUMER_REGISTERS=240, NUM_CONSUMERS=2, Q_BUFFERS=1),
}
MIN_HALF_TILE_KEYS = 32  # a half last tile is a wgmma's N, which TLX takes from 32 up
# Launched (and inspected) at num_stages 0. At num_stages >= 1 Triton's software pipeliner puts a
# `wgmma.wait_group 0` right after every `tlx.async_dot` whose result it cannot prove safe to leave
# in flight, which is every one here (visible in the TTGIR that `jfa.inspect` compiles): each wgmma
# then finished before the next instruction, QK^T never overlapped P·V, and the only overlap left
# was between the two consumers. At 0 the pass is skipped and the waits are those written. That
# alone was 0.86-1.0x on the H200, because P·V was issued after the ping-pong turn and queued behind
# the other consumer's QK^T; issuing both in one turn as well gives 0.99-1.06x the num_stages 1
# kernel with outputs equal bit for bit (GEM L=1024 +5-6%, dense D=64 +3.6%, PMA q=256 -0.6%;
# results/ab-num-stages-*, results/fwd-s0-pv-in-turn-*). The ring loads are mbarrier-driven, so the
# pass has nothing else to do in this kernel.
NUM_STAGES = 0
ROWS_PER_CONSUMER: tl.constexpr = tl.constexpr(64)  # one wgmma M-tile of query rows per consumer
# FP8's transposed V starts every sequence on a TMA-aligned column: 16 bytes are 16 one-byte keys.
V_T_ALIGN_KEYS: tl.constexpr = tl.constexpr(specs.TMA_ALIGN_BYTES)
TRANSPOSE_BLOCK_COLS, TRANSPOSE_BLOCK_CHANNELS = 128, 64  # transposed_values' block of V^T


@triton.jit
def _tile_loop(num_tiles, prog, num_progs, ENTRY_MAJOR: tl.constexpr):
    """(start, end, step) of a program's tile loop: zigzag turns entry-major (`zigzag_tile` maps a
    turn to its tile), the program's every P-th tile head-major (the loop variable is the tile)."""
    if ENTRY_MAJOR:
        return 0, zigzag_turns(num_tiles, prog, num_progs), 1
    return prog, num_tiles, num_progs


@triton.jit
def _tile_geometry(tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr,
                   kv_blocks_ptr, kv_block_counts_ptr, sel_q_blocks,
                   num_q_heads, q_blocks_per_seq, broadcast_q_len, window, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEADS_PER_TILE: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr, ENTRY_MAJOR: tl.constexpr,
                   HALF_TAIL: tl.constexpr, BLOCK_SPARSE: tl.constexpr, SEL_WIDTH: tl.constexpr,
                   FP8: tl.constexpr = False, DQ: tl.constexpr = False):
    """Decode tile id -> where its rows are and which key tiles it visits.

    Returns (head, q_key, q_row0, out_row0, row_lo, q_len, kv_start, v_start, kv_len, first_col,
    selected, num_kv_tiles, bulk_lo, bulk_hi, half_tail). `v_start` is where the keys start in V's
    layout: kv_start, or with FP8 (V transposed) `transposed_value_col(kv_start, seq)`. Key tiles
    are numbered n = 0..num_kv_tiles-1 and start at sequence-local column `_key_tile_col(n, ...)`:
    `first_col + n*BLOCK_N`, or with BLOCK_SPARSE the n-th selected block, read from `selected` (the
    tile's row of the selection); tiles bulk_lo <= n < bulk_hi need no mask (tile 0 is peeled and
    always masked, so bulk_lo >= 1). half_tail is 1 when the last of two or more key tiles holds at
    most BLOCK_N/2 visible keys: it is then loaded and multiplied as a half tile (with HALF_TAIL
    only; bulk_lo, bulk_hi <= num_kv_tiles - half_tail). `head` is the tile's first query head
    (HEADS_PER_TILE of them). `q_key` identifies the Q block: equal keys on consecutive tiles let
    the Q tile be reused (broadcast-Q only, and not in the dQ fork, DQ, whose dO differs per sequence).

    Block-sparse (`jfa.sparse`): the selection holds, per (sequence, query head, query block), the
    distinct selected key blocks in ascending order, padded to SEL_WIDTH entries, and their count.
    Without a window every row sees key 0, so the blocks every row sees whole are a prefix of that
    order: they form the mask-free bulk, and the masked blocks (the sequence's partial last block,
    blocks the causal diagonal cuts) come after it.
    """
    if ENTRY_MAJOR:  # the module docstring says when and why
        head_groups = num_q_heads // HEADS_PER_TILE
        head = (tile % head_groups) * HEADS_PER_TILE
        entry = tl.load(tile_entries_ptr + tile // head_groups)
    else:
        head = (tile // num_entries) * HEADS_PER_TILE
        entry = tl.load(tile_entries_ptr + tile % num_entries)
    seq = entry // q_blocks_per_seq
    q_block = entry % q_blocks_per_seq
    q_start, q_len, out_row0, kv_start, kv_len = sequence_rows(seq, q_offsets_ptr, kv_offsets_ptr,
                                                               broadcast_q_len, BROADCAST_Q)
    if BROADCAST_Q and not DQ:
        q_key = q_block * num_q_heads + head
    else:
        q_key = tile
    row_lo = q_block * BLOCK_M
    row_hi = tl.minimum(row_lo + BLOCK_M, q_len) - 1  # last real query row of the block
    kv_lo, kv_hi, full_lo, full_hi = visible_key_range(row_lo, row_hi, q_len, kv_len, window, CAUSAL,
                                                       HAS_WINDOW)
    first_col = (kv_lo // BLOCK_N) * BLOCK_N
    if BLOCK_SPARSE:
        sel_entry = (seq * num_q_heads + head) * sel_q_blocks + q_block
        selected = kv_blocks_ptr + sel_entry.to(tl.int64) * SEL_WIDTH
        num_kv_tiles = tl.where(kv_hi > kv_lo, tl.load(kv_block_counts_ptr + sel_entry), 0)
        picks = tl.arange(0, SEL_WIDTH)
        blocks = tl.load(selected + picks, mask=picks < num_kv_tiles, other=0)
        whole = (picks < num_kv_tiles) & ((blocks + 1) * BLOCK_N <= full_hi)
        bulk_lo = tl.minimum(1, num_kv_tiles)
        bulk_hi = tl.maximum(tl.sum(whole.to(tl.int32), 0), bulk_lo)
    else:
        selected = first_col  # unused: consecutive key tiles
        num_kv_tiles = tl.where(kv_hi > kv_lo, tl.cdiv(kv_hi - first_col, BLOCK_N), 0)
        bulk_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo - first_col, BLOCK_N), 1), num_kv_tiles)
        bulk_hi = tl.minimum(tl.maximum(tl.maximum(full_hi - first_col, 0) // BLOCK_N, bulk_lo),
                             num_kv_tiles)
    half_tail = 0
    if HALF_TAIL:
        tail_keys = kv_hi - first_col - (num_kv_tiles - 1) * BLOCK_N
        half_tail = ((num_kv_tiles > 1) & (tail_keys <= BLOCK_N // 2)).to(tl.int32)
        bulk_lo = tl.minimum(bulk_lo, num_kv_tiles - half_tail)
        bulk_hi = tl.minimum(bulk_hi, num_kv_tiles - half_tail)
    q_row0 = q_start + row_lo
    v_start = transposed_value_col(kv_start, seq) if FP8 else kv_start
    return (head, q_key, q_row0, out_row0, row_lo, q_len, kv_start, v_start, kv_len, first_col,
            selected, num_kv_tiles, bulk_lo, bulk_hi, half_tail)


@triton.jit
def transposed_value_col(kv_start, seq):
    """Column of sequence `seq`'s first key in FP8's transposed V (`transposed_values`).

    The keys are V^T's innermost dimension there, and a TMA load whose innermost start coordinate
    is not 16-byte aligned faults (illegal instruction on the H200), so every sequence starts on a
    16-key boundary: its packed start rounded up, plus one 16-key gap per earlier sequence, which
    keeps sequences from overlapping whatever their lengths."""
    return tl.cdiv(kv_start, V_T_ALIGN_KEYS) * V_T_ALIGN_KEYS + seq * V_T_ALIGN_KEYS


@triton.jit
def _key_tile_col(n, first_col, selected, BLOCK_N: tl.constexpr, BLOCK_SPARSE: tl.constexpr):
    """Sequence-local first key of a tile's n-th key tile: consecutive tiles, or the n-th selected
    block (the one line where the block-sparse fork changes the iteration)."""
    if BLOCK_SPARSE:
        col = tl.load(selected + n) * BLOCK_N
    else:
        col = first_col + n * BLOCK_N
    return col


@triton.jit
def _first_keys(tile, KEYS: tl.constexpr):
    """The first KEYS rows of a `[BLOCK_N, D]` K or V buffer (the whole buffer when KEYS = BLOCK_N)."""
    if KEYS == tile.shape[0]:
        return tile
    return tlx.local_slice(tile, [0, 0], [KEYS, tile.shape[1]])


@triton.jit
def _load_ring_tiles(desc, tiles, fulls, empties, slot, phase, kv_row, head, gqa_group,
                     HEAD_DIM: tl.constexpr, HEADS_PER_TILE: tl.constexpr, KEYS: tl.constexpr,
                     TRANSPOSED: tl.constexpr = False):
    """TMA-load one K (or V) tile per head of the tile into ring slot `slot`, first KEYS keys each.
    TRANSPOSED: `desc` views the tensor as `[heads*D, keys]` (FP8's V^T) and the box is `[D, KEYS]`."""
    BYTES: tl.constexpr = KEYS * HEAD_DIM * tlx.size_of(tlx.dtype_of(desc))
    for lane in tl.static_range(HEADS_PER_TILE):
        buf = slot * HEADS_PER_TILE + lane
        # GQA: query heads j*G .. j*G+G-1 read KV head j
        kv_col = ((head + lane) // gqa_group) * HEAD_DIM
        tlx.barrier_wait(empties[buf], phase ^ 1)
        tlx.barrier_expect_bytes(fulls[buf], BYTES)
        if TRANSPOSED:
            tlx.async_descriptor_load(desc, tiles[buf], [kv_col, kv_row], fulls[buf])
        else:
            tlx.async_descriptor_load(desc, _first_keys(tiles[buf], KEYS), [kv_row, kv_col], fulls[buf])


@triton.jit
def _produce_kv_tile(desc_k, desc_v, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties,
                     kv_count, kv_row, v_row, head, gqa_group, HEAD_DIM: tl.constexpr,
                     NUM_KV_BUFFERS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, KEYS: tl.constexpr,
                     FP8: tl.constexpr = False):
    """TMA-load the next KV tile (its first KEYS keys, `desc_k`/`desc_v` boxes of that many rows)
    into the ring: K first, so QK^T can start while V lands. `v_row`: the tile's first key in V's
    layout (FP8: V comes transposed, its sequences 16-key aligned)."""
    slot, phase = ring_slot(kv_count, NUM_KV_BUFFERS)
    _load_ring_tiles(desc_k, k_tiles, k_fulls, k_empties, slot, phase, kv_row, head, gqa_group,
                     HEAD_DIM, HEADS_PER_TILE, KEYS)
    _load_ring_tiles(desc_v, v_tiles, v_fulls, v_empties, slot, phase, v_row, head, gqa_group,
                     HEAD_DIM, HEADS_PER_TILE, KEYS, FP8)


@triton.jit
def _values(tile, FP8: tl.constexpr):
    """The `[keys, D]` B operand of P·V. FP8 wgmma reads B only K-major (keys contiguous), so the FP8
    fork keeps V transposed in shared memory, `[D, keys]`, and multiplies its transposed view."""
    if FP8:
        tile = tlx.local_trans(tile)
    return tile


@triton.jit
def _consumer_drain(p, acc, v_tiles, v_fulls, v_empties, kv_count, cid: tl.constexpr,
                    NUM_KV_BUFFERS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, KEYS: tl.constexpr,
                    FP8: tl.constexpr = False):
    """The last KV tile's P·V (its first KEYS keys), which no later QK^T hides."""
    LANE: tl.constexpr = cid if HEADS_PER_TILE == 2 else 0
    v_slot, v_phase = ring_slot(kv_count - 1, NUM_KV_BUFFERS)
    v_buf = v_slot * HEADS_PER_TILE + LANE
    tlx.barrier_wait(v_fulls[v_buf], v_phase)
    if FP8:  # no half tiles in the FP8 fork
        values = _values(v_tiles[v_buf], FP8)
    else:
        values = _first_keys(v_tiles[v_buf], KEYS)
    acc = tlx.async_dot(p.to(v_tiles.dtype), values, acc)
    acc = tlx.async_dot_wait(0, acc)
    tlx.barrier_arrive(v_empties[v_buf], 1)
    return acc


@triton.jit
def _consumer_kv_step(q_tile, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, p, acc,
                      m_i, l_i, kv_count, col0, rows, q_len, kv_len, window, qk_scale_log2,
                      cid: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                      NUM_KV_BUFFERS: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
                      KEYS: tl.constexpr, FP8: tl.constexpr = False, CONSUMERS: tl.constexpr = 2):
    """One KV tile of a consumer (its first KEYS keys): issue QK^T(n) and P·V(n-1) in one ping-pong
    turn, then softmax(n).

    The P·V of the previous tile runs on the tensor cores while this warpgroup waits for QK^T and
    computes the softmax, so the exp2 work hides behind a matrix multiply. Both are issued inside
    the turn (K and V waited for first) so the other consumer's wgmmas queue behind both, not
    between them. With two heads per tile each ring slot holds one K (and V) tile per consumer, at
    index `slot * 2 + cid`.
    """
    LANE: tl.constexpr = cid if HEADS_PER_TILE == 2 else 0
    k_slot, k_phase = ring_slot(kv_count, NUM_KV_BUFFERS)
    k_buf = k_slot * HEADS_PER_TILE + LANE
    tlx.barrier_wait(k_fulls[k_buf], k_phase)
    v_slot, v_phase = ring_slot(kv_count - 1, NUM_KV_BUFFERS)
    v_buf = v_slot * HEADS_PER_TILE + LANE
    tlx.barrier_wait(v_fulls[v_buf], v_phase)
    pingpong_enter(cid)
    qk = tlx.async_dot(q_tile, tlx.local_trans(_first_keys(k_tiles[k_buf], KEYS)))
    acc = tlx.async_dot(p.to(v_tiles.dtype), _values(v_tiles[v_buf], FP8), acc)
    pingpong_exit(cid, CONSUMERS)

    qk = tlx.async_dot_wait(1, qk)
    tlx.barrier_arrive(k_empties[k_buf], 1)
    if MASKED:
        cols = col0 + tl.arange(0, KEYS)
        qk = tl.where(visible_mask(rows, cols, q_len, kv_len, window, CAUSAL, HAS_WINDOW), qk,
                      float("-inf"))
    p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i, qk_scale_log2, MASKED)

    acc = tlx.async_dot_wait(0, acc)
    tlx.barrier_arrive(v_empties[v_buf], 1)
    acc = acc * alpha[:, None]
    return p, acc, m_i, l_i, kv_count + 1


@triton.jit
def _consumer_dq_step(q_tile, do_tile, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, ds, acc,
                      lse_log2, delta, kv_count, col0, rows, q_len, kv_len, window, qk_scale_log2,
                      cid: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      NUM_KV_BUFFERS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, KEYS: tl.constexpr,
                      CONSUMERS: tl.constexpr, FIRST: tl.constexpr):
    """One KV tile of the dQ fork (DQ): issue S(n) = Q K(n)^T, dP(n) = dO V(n)^T and dQ += dS(n-1) K(n-1)
    in one ping-pong turn, then form dS(n) = P(n) * (dP(n) - Delta), P(n) = exp2(S(n)*scale - LSE).

    `_consumer_kv_step` with the backward's math: dS takes P's part and K takes V's (dQ = dS K as
    O = P V), so the previous tile's dQ wgmma runs while this one's dS is formed. V(n) is released
    once dP(n) is done; K(n) only after the next step's dQ wgmma has read it (the K/V ring's depth
    covers that: the producer refills a K slot NUM_KV_BUFFERS tiles later). FIRST: the peeled first
    tile, with no dQ pending (`ds` unused). Invisible (query, key) pairs get P = 0, hence dS = 0:
    keys past the sequence end read the next sequence's rows, and a row that sees no key has LSE -inf.
    """
    LANE: tl.constexpr = cid if HEADS_PER_TILE == 2 else 0
    PENDING: tl.constexpr = 0 if FIRST else 1  # the previous tile's dQ wgmma, issued after S and dP
    slot, phase = ring_slot(kv_count, NUM_KV_BUFFERS)
    buf = slot * HEADS_PER_TILE + LANE
    tlx.barrier_wait(k_fulls[buf], phase)
    tlx.barrier_wait(v_fulls[buf], phase)
    pingpong_enter(cid)
    s = tlx.async_dot(q_tile, tlx.local_trans(_first_keys(k_tiles[buf], KEYS)))
    dp = tlx.async_dot(do_tile, tlx.local_trans(_first_keys(v_tiles[buf], KEYS)))
    if not FIRST:  # the previous tile is whole: only the last tile can be a half one
        prev_slot, _ = ring_slot(kv_count - 1, NUM_KV_BUFFERS)
        prev_buf = prev_slot * HEADS_PER_TILE + LANE
        acc = tlx.async_dot(ds.to(k_tiles.dtype), k_tiles[prev_buf], acc)
    pingpong_exit(cid, CONSUMERS)

    s = tlx.async_dot_wait(PENDING + 1, s)
    p = tl.math.exp2(s * qk_scale_log2 - lse_log2[:, None])
    if MASKED:
        cols = col0 + tl.arange(0, KEYS)
        p = tl.where(visible_mask(rows, cols, q_len, kv_len, window, CAUSAL, HAS_WINDOW), p, 0.0)
    dp = tlx.async_dot_wait(PENDING, dp)
    tlx.barrier_arrive(v_empties[buf], 1)
    ds = p * (dp - delta[:, None])
    if not FIRST:
        acc = tlx.async_dot_wait(0, acc)
        tlx.barrier_arrive(k_empties[prev_buf], 1)
    return ds, acc, kv_count + 1


@triton.jit
def _store_output(out, lse, stage, desc_out, out_ptr, lse_ptr, out_row0, first_row, q_len, head, stride_out_row,
                  stride_lse_head, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, STAGE_OUT: tl.constexpr):
    """The epilogue's stores of a consumer's `[ROWS, D]` output block and its LSE.

    With STAGE_OUT the block is first written to `stage` (the consumer's Q slot, or with head-major
    broadcast-Q a stage of its own). A block whose rows all lie inside the sequence then leaves by one
    TMA store; one that runs past the sequence's end, whose box would write the next sequence's rows,
    is read back in a row-major layout for the masked register store (`store_rows`). Either way the
    layout change goes through `stage` instead of Triton's 16.5 KB scratch, and a whole block no longer
    queues 16 stores per thread ahead of the next tile's loads (ncu on PMA q=256: reloads of spilled
    tile values waited behind them). The store has read `stage` before it is written again (the wait
    here) and before a Q slot goes back to the producer (the caller's wait)."""
    if STAGE_OUT:
        tlx.async_descriptor_store_wait(0)  # the previous output's store has read `stage`
        tlx.local_store(stage, out)
        if first_row + ROWS <= q_len:
            tlx.fence_async_shared()
            tlx.async_descriptor_store(desc_out, stage, [out_row0 + first_row, head * HEAD_DIM])
            store_rows(out_ptr, lse_ptr, None, lse, out_row0, first_row, q_len, head, stride_out_row,
                       stride_lse_head, ROWS, HEAD_DIM)
        else:
            store_rows(out_ptr, lse_ptr, tlx.local_load(stage), lse, out_row0, first_row, q_len, head,
                       stride_out_row, stride_lse_head, ROWS, HEAD_DIM)
    else:
        store_rows(out_ptr, lse_ptr, out, lse, out_row0, first_row, q_len, head, stride_out_row, stride_lse_head,
                   ROWS, HEAD_DIM)


@triton.jit
def _jagged_fwd_kernel(desc_q, desc_k, desc_v, desc_k_tail, desc_v_tail, desc_do, desc_out, out_ptr, lse_ptr,
                       q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr, num_entries_ptr,
                       kv_blocks_ptr, kv_block_counts_ptr, sel_q_blocks, stride_out_row, stride_lse_head,
                       num_q_heads, q_blocks_per_seq, broadcast_q_len, window, gqa_group,
                       qk_scale_log2, acc_scale, delta_ptr, stride_delta_head,
                       HEAD_DIM: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
                       BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       BROADCAST_Q: tl.constexpr, ENTRY_MAJOR: tl.constexpr, NUM_KV_BUFFERS: tl.constexpr,
                       CONSUMER_REGISTERS: tl.constexpr, HALF_TAIL: tl.constexpr,
                       BLOCK_SPARSE: tl.constexpr, SEL_WIDTH: tl.constexpr, FP8: tl.constexpr,
                       NUM_CONSUMERS: tl.constexpr, DQ: tl.constexpr, Q_BUFFERS: tl.constexpr):
    CONSUMERS: tl.constexpr = NUM_CONSUMERS
    ROWS: tl.constexpr = ROWS_PER_CONSUMER
    # One head per tile: the consumers split BLOCK_M = 64 x CONSUMERS query rows. Two heads per tile
    # (short queries): both consumers take the same 64 rows, consumer c of query head `head + c`.
    BLOCK_M: tl.constexpr = ROWS * CONSUMERS if HEADS_PER_TILE == 1 else ROWS
    ROW_STEP: tl.constexpr = ROWS if HEADS_PER_TILE == 1 else 0
    HEAD_STEP: tl.constexpr = 0 if HEADS_PER_TILE == 1 else 1
    KV_READERS: tl.constexpr = CONSUMERS // HEADS_PER_TILE  # consumers that free each K/V tile
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty  # q's dtype, bf16 from FP8 inputs, fp32 dQ partials
    Q_BYTES: tl.constexpr = ROWS * HEAD_DIM * tlx.size_of(dtype)
    Q_SLOT_BYTES: tl.constexpr = Q_BYTES * (2 if DQ else 1)  # the dQ fork loads dO beside Q
    # The output leaves through shared memory (`_store_output`), in q's dtype: not the FP8 fork's
    # bf16 output of one-byte inputs, nor the dQ fork's. Its stage is the consumer's Q slot, dead once
    # the tile's last QK^T is done. Head-major broadcast-Q keeps its Q block for the next tile and
    # changes it only with the head (every few dozen tiles): one Q slot per consumer serves there, and
    # the shared memory of the second holds stages of its own (OWN_STAGE). Entry-major broadcast-Q
    # keeps its Q block while the head stays and has no room for stages (two heads per tile): it keeps
    # the register store.
    STAGE_OUT: tl.constexpr = not FP8 and not DQ and not (BROADCAST_Q and ENTRY_MAJOR)
    OWN_STAGE: tl.constexpr = STAGE_OUT and BROADCAST_Q
    Q_SLOTS: tl.constexpr = 1 if OWN_STAGE else Q_BUFFERS

    num_entries = tl.load(num_entries_ptr)
    num_tiles = num_entries * (num_q_heads // HEADS_PER_TILE)
    first_tile = tl.program_id(0)
    tile_stride = tl.num_programs(0)

    q_tiles = tlx.local_alloc((ROWS, HEAD_DIM), dtype, Q_SLOTS * CONSUMERS)
    if DQ:
        do_tiles = tlx.local_alloc((ROWS, HEAD_DIM), dtype, Q_SLOTS * CONSUMERS)
    else:
        do_tiles = q_tiles  # unused
    if OWN_STAGE:
        out_stages = tlx.local_alloc((ROWS, HEAD_DIM), dtype, CONSUMERS)
    else:
        out_stages = q_tiles  # unused: the stage is the consumer's Q slot
    k_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, NUM_KV_BUFFERS * HEADS_PER_TILE)
    v_tiles = tlx.local_alloc((HEAD_DIM, BLOCK_N) if FP8 else (BLOCK_N, HEAD_DIM), dtype,
                              NUM_KV_BUFFERS * HEADS_PER_TILE)
    q_fulls = tlx.alloc_barriers(num_barriers=Q_SLOTS * CONSUMERS, arrive_count=1)
    q_empties = tlx.alloc_barriers(num_barriers=Q_SLOTS * CONSUMERS, arrive_count=1)
    k_fulls = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS * HEADS_PER_TILE, arrive_count=1)
    k_empties = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS * HEADS_PER_TILE,
                                   arrive_count=KV_READERS)
    v_fulls = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS * HEADS_PER_TILE, arrive_count=1)
    v_empties = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS * HEADS_PER_TILE,
                                   arrive_count=KV_READERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads only
            kv_count = 0
            q_loads = 0
            loaded_q_key = -1
            loop_start, loop_end, loop_step = _tile_loop(num_tiles, first_tile, tile_stride, ENTRY_MAJOR)
            for step in range(loop_start, loop_end, loop_step):
                tile = zigzag_tile(step, first_tile, tile_stride) if ENTRY_MAJOR else step
                (head, q_key, q_row0, out_row0, row_lo, q_len, kv_start, v_start, kv_len,
                 first_col, selected, num_kv_tiles, bulk_lo, bulk_hi, half_tail) = _tile_geometry(
                     tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr,
                     kv_blocks_ptr, kv_block_counts_ptr, sel_q_blocks, num_q_heads,
                     q_blocks_per_seq, broadcast_q_len, window, BLOCK_M, BLOCK_N, HEADS_PER_TILE,
                     CAUSAL, HAS_WINDOW, BROADCAST_Q, ENTRY_MAJOR, HALF_TAIL, BLOCK_SPARSE,
                     SEL_WIDTH, FP8, DQ)
                if num_kv_tiles > 0:
                    if q_key != loaded_q_key:
                        q_slot, q_phase = ring_slot(q_loads, Q_SLOTS)
                        for c in tl.static_range(CONSUMERS):
                            buf = q_slot * CONSUMERS + c
                            tlx.barrier_wait(q_empties[buf], q_phase ^ 1)
                            tlx.barrier_expect_bytes(q_fulls[buf], Q_SLOT_BYTES)
                            tlx.async_descriptor_load(
                                desc_q, q_tiles[buf],
                                [q_row0 + c * ROW_STEP, (head + c * HEAD_STEP) * HEAD_DIM],
                                q_fulls[buf])
                            if DQ:
                                tlx.async_descriptor_load(
                                    desc_do, do_tiles[buf],
                                    [out_row0 + row_lo + c * ROW_STEP, (head + c * HEAD_STEP) * HEAD_DIM],
                                    q_fulls[buf])
                        q_loads += 1
                        loaded_q_key = q_key
                    num_steps = num_kv_tiles - half_tail  # key tiles loaded whole
                    for n in range(num_steps):
                        key_col = _key_tile_col(n, first_col, selected, BLOCK_N, BLOCK_SPARSE)
                        _produce_kv_tile(desc_k, desc_v, k_tiles, v_tiles, k_fulls, k_empties,
                                         v_fulls, v_empties, kv_count, kv_start + key_col,
                                         v_start + key_col, head, gqa_group,
                                         HEAD_DIM, NUM_KV_BUFFERS, HEADS_PER_TILE, BLOCK_N, FP8)
                        kv_count += 1
                    if HALF_TAIL and half_tail:  # compiled only with HALF_TAIL
                        kv_row = kv_start + first_col + num_steps * BLOCK_N
                        _produce_kv_tile(desc_k_tail, desc_v_tail, k_tiles, v_tiles, k_fulls,
                                         k_empties, v_fulls, v_empties, kv_count, kv_row, kv_row,
                                         head, gqa_group, HEAD_DIM, NUM_KV_BUFFERS, HEADS_PER_TILE,
                                         BLOCK_N // 2)
                        kv_count += 1

        with tlx.async_task(num_warps=WARPGROUP_WARPS, registers=CONSUMER_REGISTERS,
                            replicate=CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            LANE: tl.constexpr = cid if HEADS_PER_TILE == 2 else 0
            pingpong_start(cid, CONSUMERS)
            kv_count = 0
            q_loads = 0
            loaded_q_key = -1
            loop_start, loop_end, loop_step = _tile_loop(num_tiles, first_tile, tile_stride, ENTRY_MAJOR)
            for step in range(loop_start, loop_end, loop_step):
                tile = zigzag_tile(step, first_tile, tile_stride) if ENTRY_MAJOR else step
                (head, q_key, q_row0, out_row0, row_lo, q_len, kv_start, v_start, kv_len,
                 first_col, selected, num_kv_tiles, bulk_lo, bulk_hi, half_tail) = _tile_geometry(
                     tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr,
                     kv_blocks_ptr, kv_block_counts_ptr, sel_q_blocks, num_q_heads,
                     q_blocks_per_seq, broadcast_q_len, window, BLOCK_M, BLOCK_N, HEADS_PER_TILE,
                     CAUSAL, HAS_WINDOW, BROADCAST_Q, ENTRY_MAJOR, HALF_TAIL, BLOCK_SPARSE,
                     SEL_WIDTH, FP8, DQ)
                first_row = row_lo + cid * ROW_STEP
                rows = first_row + tl.arange(0, ROWS)
                my_head = head + cid * HEAD_STEP
                if num_kv_tiles > 0:
                    m_i = tl.full([ROWS], float("-inf"), tl.float32)
                    l_i = tl.zeros([ROWS], tl.float32)
                    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
                    if DQ:
                        lse_log2, delta = lse_delta_rows(lse_ptr, delta_ptr, my_head, out_row0, first_row, q_len,
                                                         stride_lse_head, stride_delta_head, ROWS)
                    if q_key != loaded_q_key:
                        # Release the previous Q only now: with two Q buffers the producer has
                        # already been able to prefetch this one.
                        if q_loads > 0:
                            if STAGE_OUT:  # the previous output's TMA store has read its stage
                                tlx.async_descriptor_store_wait(0)
                            prev_slot, _ = ring_slot(q_loads - 1, Q_SLOTS)
                            tlx.barrier_arrive(q_empties[prev_slot * CONSUMERS + cid], 1)
                        q_slot, q_phase = ring_slot(q_loads, Q_SLOTS)
                        tlx.barrier_wait(q_fulls[q_slot * CONSUMERS + cid], q_phase)
                        q_loads += 1
                        loaded_q_key = q_key
                    q_tile = q_tiles[((q_loads - 1) % Q_SLOTS) * CONSUMERS + cid]
                    do_tile = do_tiles[((q_loads - 1) % Q_SLOTS) * CONSUMERS + cid]

                    # Peeled first KV tile: QK^T (dQ fork: S and dP) only, with no P·V (dS K) before it.
                    first_key = _key_tile_col(0, first_col, selected, BLOCK_N, BLOCK_SPARSE)
                    if DQ:
                        p, acc, kv_count = _consumer_dq_step(
                            q_tile, do_tile, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, None,
                            acc, lse_log2, delta, kv_count, first_key, rows, q_len, kv_len, window,
                            qk_scale_log2, cid, True, CAUSAL, HAS_WINDOW, NUM_KV_BUFFERS, HEADS_PER_TILE,
                            BLOCK_N, CONSUMERS, True)
                    else:
                        k_slot, k_phase = ring_slot(kv_count, NUM_KV_BUFFERS)
                        k_buf = k_slot * HEADS_PER_TILE + LANE
                        tlx.barrier_wait(k_fulls[k_buf], k_phase)
                        pingpong_enter(cid)
                        qk = tlx.async_dot(q_tile, tlx.local_trans(k_tiles[k_buf]))
                        pingpong_exit(cid, CONSUMERS)
                        qk = tlx.async_dot_wait(0, qk)
                        tlx.barrier_arrive(k_empties[k_buf], 1)
                        cols = first_key + tl.arange(0, BLOCK_N)
                        qk = tl.where(visible_mask(rows, cols, q_len, kv_len, window, CAUSAL,
                                                   HAS_WINDOW), qk, float("-inf"))
                        p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i, qk_scale_log2, True)
                        kv_count += 1

                    # Leading edge (window start), mask-free bulk, trailing edge (diagonal/end).
                    num_steps = num_kv_tiles - half_tail  # key tiles taken whole
                    for segment in tl.static_range(3):
                        lo, hi = loop_segment(segment, 1, bulk_lo, bulk_hi, num_steps)
                        for n in range(lo, hi):
                            col0 = _key_tile_col(n, first_col, selected, BLOCK_N, BLOCK_SPARSE)
                            if DQ:
                                p, acc, kv_count = _consumer_dq_step(
                                    q_tile, do_tile, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties,
                                    p, acc, lse_log2, delta, kv_count, col0, rows, q_len, kv_len, window,
                                    qk_scale_log2, cid, segment != 1, CAUSAL, HAS_WINDOW, NUM_KV_BUFFERS,
                                    HEADS_PER_TILE, BLOCK_N, CONSUMERS, False)
                            else:
                                p, acc, m_i, l_i, kv_count = _consumer_kv_step(
                                    q_tile, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, p,
                                    acc, m_i, l_i, kv_count, col0, rows, q_len,
                                    kv_len, window, qk_scale_log2, cid, segment != 1, CAUSAL, HAS_WINDOW,
                                    BLOCK_N, NUM_KV_BUFFERS, HEADS_PER_TILE, BLOCK_N, FP8, CONSUMERS)

                    # Drain: the last tile's P·V (the dQ fork's dS K); a half last tile multiplies
                    # only its half. Issuing the next tile's first QK^T here, to run under the epilogue
                    # (head-major broadcast-Q, same Q block), ran level: PMA q=256 0.992x
                    # (results/ab-fwd-lookahead-qk-*).
                    if DQ:
                        acc_tiles, acc_fulls, acc_empties = k_tiles, k_fulls, k_empties
                    else:
                        acc_tiles, acc_fulls, acc_empties = v_tiles, v_fulls, v_empties
                    if HALF_TAIL and half_tail:  # compiled only with HALF_TAIL
                        tail_col = first_col + num_steps * BLOCK_N
                        if DQ:
                            p_tail, acc, kv_count = _consumer_dq_step(
                                q_tile, do_tile, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, p,
                                acc, lse_log2, delta, kv_count, tail_col, rows, q_len, kv_len, window,
                                qk_scale_log2, cid, True, CAUSAL, HAS_WINDOW, NUM_KV_BUFFERS, HEADS_PER_TILE,
                                BLOCK_N // 2, CONSUMERS, False)
                        else:
                            p_tail, acc, m_i, l_i, kv_count = _consumer_kv_step(
                                q_tile, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, p,
                                acc, m_i, l_i, kv_count, tail_col,
                                rows, q_len, kv_len, window, qk_scale_log2, cid, True, CAUSAL,
                                HAS_WINDOW, BLOCK_N, NUM_KV_BUFFERS, HEADS_PER_TILE, BLOCK_N // 2, FP8,
                                CONSUMERS)
                        acc = _consumer_drain(p_tail, acc, acc_tiles, acc_fulls, acc_empties, kv_count,
                                              cid, NUM_KV_BUFFERS, HEADS_PER_TILE, BLOCK_N // 2, FP8)
                    else:
                        acc = _consumer_drain(p, acc, acc_tiles, acc_fulls, acc_empties, kv_count, cid,
                                              NUM_KV_BUFFERS, HEADS_PER_TILE, BLOCK_N, FP8)

                    # Finalize inside the branch: joining the wgmma accumulator with a zero tile
                    # would make the compiler convert fp32 accumulators through shared memory.
                    if FP8 or DQ:  # V's per-tensor scale (FP8) or sm_scale (dQ), applied once
                        acc = acc * acc_scale
                    if DQ:
                        store_rows(out_ptr, lse_ptr, acc.to(out_dtype), None, out_row0, first_row, q_len,
                                   my_head, stride_out_row, stride_lse_head, ROWS, HEAD_DIM)
                    else:
                        out, lse = finalize_rows(acc, m_i, l_i, out_dtype)
                        if OWN_STAGE:
                            stage = out_stages[cid]
                        else:
                            stage = q_tile
                        _store_output(out, lse, stage, desc_out, out_ptr, lse_ptr, out_row0, first_row, q_len,
                                      my_head, stride_out_row, stride_lse_head, ROWS, HEAD_DIM, STAGE_OUT)
                elif DQ:  # the block sees no key at all: dQ 0
                    store_rows(out_ptr, lse_ptr, tl.zeros([ROWS, HEAD_DIM], out_dtype), None, out_row0,
                               first_row, q_len, my_head, stride_out_row, stride_lse_head, ROWS, HEAD_DIM)
                else:  # the block sees no key at all: output 0, LSE -inf
                    store_rows(out_ptr, lse_ptr, tl.zeros([ROWS, HEAD_DIM], out_dtype),
                               tl.full([ROWS], float("-inf"), tl.float32), out_row0, first_row,
                               q_len, my_head, stride_out_row, stride_lse_head, ROWS, HEAD_DIM)
            if STAGE_OUT:  # shared memory must outlive the last output's TMA store
                tlx.async_descriptor_store_wait(0)


_SIGNATURE_AFTER_OUT = dict(
    lse_ptr="*fp32", q_offsets_ptr="*i32", kv_offsets_ptr="*i32",
    tile_entries_ptr="*i32", num_entries_ptr="*i32", sel_q_blocks="i32", stride_out_row="i32",
    stride_lse_head="i32",
    num_q_heads="i32", q_blocks_per_seq="i32", broadcast_q_len="i32", window="i32",
    gqa_group="i32", qk_scale_log2="fp32", acc_scale="fp32")
_jagged_fwd_launch = CachedLaunch(_jagged_fwd_kernel)  # the hot path: binds its arguments once per specialization
_TRITON_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv"}
FP8_DTYPE = torch.float8_e4m3fn
FP8_OUT_DTYPE = specs.FP8_OUT_DTYPE


def tile_rows(heads_per_tile: int, num_consumers: int = 2) -> int:
    """Query rows of one tile: every consumer's rows of one head, or one consumer's of two heads."""
    return ROWS_PER_CONSUMER.value * (num_consumers // heads_per_tile)


def heads_per_tile(max_seq_len_q: int, q_heads: int) -> int:
    """2 when every query block fits one consumer (<= 64 rows) and the heads pair up, else 1.

    With one head per tile, a query sequence of 64 rows or fewer would leave the second consumer
    computing on padding rows only, half the tensor-core work wasted; pairing heads gives each
    consumer real rows (broadcast-Q with q_len 64, short jagged queries).
    """
    return 2 if max_seq_len_q <= ROWS_PER_CONSUMER.value and q_heads % 2 == 0 else 1


def kernel_config(head_dim: int, dtype: torch.dtype, *, causal: bool = False,
                  window: int | None = None, broadcast_q: bool = False,
                  heads_per_tile: int = 1, entry_major: bool = False, half_tail: bool = False,
                  selection_width: int = 0, short_kv: bool = False, long_seqs: bool = False,
                  dq: bool = False) -> dict:
    """The kernel's constexprs for one problem class (tuning from TUNING, flags from the problem).

    `dq` compiles the dQ fork (`jagged_attention_dq`), tuned by DQ_TUNING.

    `short_kv` (keys average at most SHORT_KV_MEAN_LEN per sequence, `is_short_kv`) takes
    SHORT_KV_TUNING's entry where it has one; `long_seqs` (`is_long`) takes LONG_TUNING's.

    `selection_width` > 0 compiles the block-sparse fork: the padded width of the canonical block
    selection (`jfa.sparse`), a power of two. An FP8 `dtype` (E4M3) compiles the FP8 fork: FP8
    wgmma for QK^T and P·V, with V transposed in memory and P quantized in registers.
    """
    if head_dim not in specs.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {specs.SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if dtype not in _TRITON_DTYPE_NAMES:
        raise TypeError(f"dtype must be one of {list(_TRITON_DTYPE_NAMES)}, got {dtype}")
    if heads_per_tile not in (1, 2):
        raise ValueError(f"heads_per_tile must be 1 or 2, got {heads_per_tile}")
    if short_kv and long_seqs:
        raise ValueError("short_kv and long_seqs exclude each other (keys average at most "
                         f"{SHORT_KV_MEAN_LEN} or at least {LONG_MEAN_LEN}): pass at most one")
    if dtype == FP8_DTYPE and (heads_per_tile != 1 or half_tail or short_kv or long_seqs):
        raise ValueError("the FP8 forward takes one head per tile, no half last tiles and no short-key "
                         "or long-sequence tuning")
    if selection_width:
        if selection_width & (selection_width - 1):
            raise ValueError(f"selection_width must be a power of two, got {selection_width}")
        # One selection per query head and per 128-row query block: both consumers of a tile walk
        # the same list, so a tile is one head's query block; no window (its bulk is not a prefix).
        # Its key tiles are the selection's blocks (specs.BLOCK_SPARSE_BLOCK keys), so no short-key
        # tuning, and its query blocks are the selection's 128 rows, so two consumers.
        if heads_per_tile != 1 or window is not None or broadcast_q or half_tail or short_kv or long_seqs:
            raise ValueError("the block-sparse forward takes one head per tile and no window, "
                             "broadcast-Q, half last tiles, short-key or long-sequence tuning")
    if dq and (dtype == FP8_DTYPE or selection_width or short_kv or long_seqs):
        raise ValueError("the dQ fork takes bf16 or fp16, no block selection and no short-key or "
                         "long-sequence tuning")
    key = (head_dim, heads_per_tile)
    tuning = TUNING[key]
    if dq:
        tuning = DQ_PARTIALS_TUNING.get(key, DQ_TUNING[key]) if broadcast_q else DQ_TUNING[key]
    if short_kv:
        tuning = SHORT_KV_TUNING.get(key, tuning)
    if long_seqs:
        tuning = LONG_TUNING.get(key, tuning)
    return dict(HEAD_DIM=head_dim, HEADS_PER_TILE=heads_per_tile, CAUSAL=bool(causal),
                HAS_WINDOW=window is not None, BROADCAST_Q=bool(broadcast_q),
                ENTRY_MAJOR=bool(entry_major),
                HALF_TAIL=half_tail and tuning["BLOCK_N"] // 2 >= MIN_HALF_TILE_KEYS,
                BLOCK_SPARSE=selection_width > 0, SEL_WIDTH=max(selection_width, 1),
                FP8=dtype == FP8_DTYPE, DQ=dq, **(dict(Q_BUFFERS=NUM_Q_BUFFERS) | tuning))


def inspect_spec(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                 window: int | None = None, broadcast_q: bool = False, heads_per_tile: int = 1,
                 entry_major: bool = False, half_tail: bool = False, selection_width: int = 0,
                 short_kv: bool = False, long_seqs: bool = False, dq: bool = False):
    """Compile-only description of one configuration, for `jfa.inspect.inspect` (no GPU needed);
    `dq` describes the dQ fork (fp32 per-sequence partials with broadcast-Q)."""
    from jfa.kernels.spec import KernelSpec

    constexprs = kernel_config(head_dim, dtype, causal=causal, window=window, broadcast_q=broadcast_q,
                               heads_per_tile=heads_per_tile, entry_major=entry_major,
                               half_tail=half_tail, selection_width=selection_width, short_kv=short_kv,
                               long_seqs=long_seqs, dq=dq)
    name = _TRITON_DTYPE_NAMES[dtype]
    kv_box = f"tensordesc<{name}[{constexprs['BLOCK_N']}, {head_dim}]>"
    tail_box = f"tensordesc<{name}[{constexprs['BLOCK_N'] // 2}, {head_dim}]>"
    fp8 = constexprs["FP8"]
    rows_box = f"tensordesc<{name}[{ROWS_PER_CONSUMER.value}, {head_dim}]>"
    out_name = "fp32" if dq and broadcast_q else _TRITON_DTYPE_NAMES[FP8_OUT_DTYPE] if fp8 else name
    signature = dict(desc_q=rows_box, desc_k=kv_box,
                     desc_v=f"tensordesc<{name}[{head_dim}, {constexprs['BLOCK_N']}]>" if fp8 else kv_box,
                     desc_k_tail=tail_box, desc_v_tail=tail_box, desc_do=rows_box if dq else "constexpr",
                     desc_out="constexpr" if dq or fp8 else rows_box,
                     out_ptr=f"*{out_name}", **_SIGNATURE_AFTER_OUT,
                     delta_ptr="*fp32" if dq else "constexpr", stride_delta_head="i32")
    if not dq:  # launched with None there
        constexprs = constexprs | dict(desc_do=None, delta_ptr=None)
    if dq or fp8:
        constexprs = constexprs | dict(desc_out=None)
    if selection_width:
        signature.update(kv_blocks_ptr="*i32", kv_block_counts_ptr="*i32")
    else:  # launched with None there: compile-time constants
        signature.update(kv_blocks_ptr="constexpr", kv_block_counts_ptr="constexpr")
        constexprs = constexprs | dict(kv_blocks_ptr=None, kv_block_counts_ptr=None)
    signature.update({k: "constexpr" for k in constexprs})
    return KernelSpec(fn=_jagged_fwd_kernel, signature=signature, constexprs=constexprs,
                      num_warps=PRODUCER_WARPS, num_stages=NUM_STAGES, name="jagged_dq" if dq else "jagged_fwd",
                      aligned=("stride_out_row",),
                      role_names=("producer",) + tuple(f"consumer{c}" for c in range(constexprs["NUM_CONSUMERS"])),
                      target="sm_90")


def is_supported(q: torch.Tensor) -> bool:
    """True when this kernel can run q's problem here: a Hopper GPU, a supported dtype and head_dim."""
    return (q.is_cuda and sm_major(q.device) == 9
            and q.dtype in specs.SUPPORTED_DTYPES + (FP8_DTYPE,) and q.shape[-1] in specs.SUPPORTED_HEAD_DIMS)


def is_short_kv(total_keys: int, num_seqs: int) -> bool:
    """True when the keys average at most SHORT_KV_MEAN_LEN per sequence (SHORT_KV_TUNING applies)."""
    return total_keys <= SHORT_KV_MEAN_LEN * num_seqs


def is_long(total_rows: int, total_keys: int, num_seqs: int) -> bool:
    """True when query rows and keys both average at least LONG_MEAN_LEN per sequence (LONG_TUNING applies)."""
    return min(total_rows, total_keys) >= LONG_MEAN_LEN * num_seqs


@triton.jit
def _transpose_values_kernel(v_ptr, source_key_ptr, v_t_ptr, channels, width,
                             BLOCK_COLS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr):
    """One [channels, columns] block of V^T: each column gathers its source key's row (coalesced
    along the channels), the block is stored along the columns (coalesced along the keys); gap
    columns (source key -1) get zeros."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    chans = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    source = tl.load(source_key_ptr + cols, mask=cols < width, other=-1)
    in_channels = chans[:, None] < channels
    block = tl.load(v_ptr + source[None, :].to(tl.int64) * channels + chans[:, None],
                    mask=in_channels & (source[None, :] >= 0), other=0)
    tl.store(v_t_ptr + chans[:, None].to(tl.int64) * width + cols[None, :], block,
             mask=in_channels & (cols[None, :] < width))


def transposed_values(v: torch.Tensor, kv_offsets: torch.Tensor) -> torch.Tensor:
    """FP8's V operand, `[Hkv*D, width]` in `jfa.fp8.transposed_value_layout` (keys contiguous,
    every sequence from a 16-key column, zeros between), built on v's device with no host sync.
    The copy is a gather-transpose kernel: torch's column scatter (22 ms) and its byte transpose
    (35 ms with a row scatter) took longer than the attention kernel (13.6 ms) for 2.4 M keys x
    512 bytes on the H200; this one takes about 1 ms."""
    rows, heads, dim = v.shape
    channels = heads * dim
    cols, width = transposed_value_layout(kv_offsets, rows, v.device)
    source_key = torch.full((width,), -1, dtype=torch.int32, device=v.device)
    source_key[cols] = torch.arange(rows, dtype=torch.int32, device=v.device)
    v_t = torch.empty((channels, width), dtype=torch.uint8, device=v.device)
    grid = (triton.cdiv(width, TRANSPOSE_BLOCK_COLS), triton.cdiv(channels, TRANSPOSE_BLOCK_CHANNELS))
    _transpose_values_kernel[grid](v.reshape(rows, channels).contiguous().view(torch.uint8), source_key, v_t,
                                   channels, width, TRANSPOSE_BLOCK_COLS, TRANSPOSE_BLOCK_CHANNELS)
    return v_t.view(v.dtype)


def jagged_attention_fwd(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale,
                         causal, window, broadcast_q, *, out=None, lse=None, schedule=None,
                         selection=None, descale=(1.0, 1.0, 1.0)):
    """Run the forward kernel; returns (out `[Tq_out, Hq, D]` in q's dtype, lse fp32 `[Hq, Tq_out]`).

    Inputs are already validated (`jfa.jagged.validate_jagged_attention`). `out` and `lse` may be
    given (contiguous rows; lse's head stride is free) so tests can poison them and check that only
    valid rows are written. `schedule` (a `jfa.schedule.TileSchedule`) skips building the tile list.
    `max_seq_len_kv` only bounds the work values the tile list sorts by; the kernel reads every KV
    range from the offsets. `selection` (a `jfa.sparse.BlockSelection`, validated) runs the
    block-sparse fork: each 128-row query block visits only its selected key blocks. FP8 (E4M3)
    q, k, v run the FP8 fork, output bf16; `descale` = (q, k, v) per-tensor scales, so that
    q_real = q * descale[0] and so on; there a 2-D v is V already in the kernel's layout
    (`jfa.fp8.transpose_values`), else it is copied into it.
    """
    num_seqs = kv_offsets.numel() - 1
    q_heads, head_dim = q.shape[1], q.shape[2]
    q_len = q.shape[0] if broadcast_q else 0
    out_rows = num_seqs * q_len if broadcast_q else q.shape[0]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    fp8 = q.dtype == FP8_DTYPE
    if out is None:
        out = torch.empty((out_rows, q_heads, head_dim), dtype=FP8_OUT_DTYPE if fp8 else q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((q_heads, out_rows), dtype=torch.float32, device=q.device)
    if out_rows == 0:
        return out, lse
    if k.shape[0] == 0:  # no keys anywhere (a zero-row TMA descriptor is invalid)
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    q_descale, k_descale, v_descale = descale
    _launch(q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, causal, window, broadcast_q,
            sm_scale * q_descale * k_descale * LOG2E.value, float(v_descale), schedule=schedule, selection=selection)
    return out, lse


def jagged_attention_dq(dout, q, k, v, lse, delta, dq, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                        sm_scale, causal, window, broadcast_q) -> None:
    """The backward's dQ by this kernel's dQ fork (DQ), written into `dq`.

    The forward's tiles, schedule and K/V ring, with the step math of `_consumer_dq_step`: each
    program owns its query rows and walks their keys in order, so dQ needs no atomics and repeats bit
    for bit. `lse` is the forward's, `delta` = rowsum(O * dO) (`jagged_bwd.compute_delta`), both
    `[Hq, Tq_out]`. `dq` is dQ itself (q's dtype), or with broadcast-Q fp32 per-sequence partials
    `[num_seqs * q_len, Hq, D]` (sequence b's from row b * q_len, like its output rows), which the
    caller sums. Inputs as for `jagged_attention_fwd`, with at least one query row and one key.
    """
    _launch(q, k, v, dq, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, causal, window, broadcast_q,
            sm_scale * LOG2E.value, sm_scale, dout=dout, delta=delta)


def _launch(q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, causal, window, broadcast_q,
            qk_scale_log2, acc_scale, *, schedule=None, selection=None, dout=None, delta=None):
    """Configure, schedule and launch the kernel into `out`: the forward (writing `lse`), or with
    `dout` and `delta` its dQ fork (reading `lse`). `acc_scale` multiplies the accumulator once.
    A missing `max_seq_len_q` costs a device sync; a missing `max_seq_len_kv` becomes all the keys."""
    if max_seq_len_q is None:  # callers on the hot path pass it
        max_seq_len_q = q.shape[0] if broadcast_q else int((q_offsets[1:] - q_offsets[:-1]).max())
    if max_seq_len_kv is None:  # every sequence fits in all keys: a loose bound, but no sync
        max_seq_len_kv = k.shape[0]
    num_seqs = kv_offsets.numel() - 1
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    fp8 = q.dtype == FP8_DTYPE
    dq = dout is not None
    pairing = 1 if selection is not None or fp8 else heads_per_tile(max_seq_len_q, q_heads)
    plain = selection is None and not fp8  # the forks keep their own key tiles
    config = kernel_config(head_dim, q.dtype, causal=causal, window=window,
                           broadcast_q=broadcast_q, heads_per_tile=pairing,
                           half_tail=plain and max_seq_len_kv <= HALF_TAIL_MAX_KV_LEN,
                           selection_width=0 if selection is None else selection.width,
                           short_kv=plain and not dq and is_short_kv(k.shape[0], num_seqs),
                           long_seqs=plain and not dq and is_long(out.shape[0], k.shape[0], num_seqs), dq=dq)
    if schedule is None:
        schedule = build_tile_schedule(q_offsets, kv_offsets, max_seq_len_q=max_seq_len_q,
                                       block_m=tile_rows(pairing, config["NUM_CONSUMERS"]),
                                       block_n=config["BLOCK_N"],
                                       causal=causal, window=window, broadcast_q=broadcast_q,
                                       max_seq_len_kv=max_seq_len_kv)
    config["ENTRY_MAJOR"] = schedule.q_blocks_per_seq == 1
    max_tiles = schedule.max_entries * (q_heads // pairing)
    grid = (persistent_programs(q.device, max_tiles),)
    if fp8:  # a 2-D v is V^T already (`jfa.fp8.transpose_values`)
        v_t = v if v.ndim == 2 else transposed_values(v, kv_offsets)
        desc_v = TensorDescriptor(v_t, shape=list(v_t.shape), strides=[v_t.shape[1], 1],
                                  block_shape=[head_dim, config["BLOCK_N"]])
    else:
        desc_v = rows_descriptor(v, config["BLOCK_N"])
    _jagged_fwd_launch[grid](
        rows_descriptor(q, ROWS_PER_CONSUMER.value),
        rows_descriptor(k, config["BLOCK_N"]), desc_v,
        rows_descriptor(k, config["BLOCK_N"] // 2), rows_descriptor(k if fp8 else v, config["BLOCK_N"] // 2),
        rows_descriptor(dout, ROWS_PER_CONSUMER.value) if dq else None,
        None if dq or fp8 else rows_descriptor(out, ROWS_PER_CONSUMER.value),
        out, lse, q_offsets, kv_offsets, schedule.entries, schedule.num_entries,
        None if selection is None else selection.blocks,
        None if selection is None else selection.counts,
        0 if selection is None else selection.row_blocks,
        out.stride(0), lse.stride(0), q_heads, schedule.q_blocks_per_seq, q.shape[0] if broadcast_q else 0,
        0 if window is None else window, q_heads // kv_heads, qk_scale_log2, acc_scale,
        delta, 0 if delta is None else delta.stride(0),
        num_warps=PRODUCER_WARPS, num_stages=NUM_STAGES, **config)
