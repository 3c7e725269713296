"""Jagged flash-attention backward for Hopper (sm_90), warp-specialized with TLX.

Semantics are those of `docs/CONTRACTS.md`; the math is `jfa.reference.jagged_attention_bwd_ref`:
Delta = rowsum(O * dO), P = exp(S*scale - LSE), dV = P^T dO, dS = P * (dP - Delta) with dP = dO V^T,
dK = scale * dS^T Q, dQ = scale * dS K.

KV-stationary. A *tile* is (sequence b, KV block of BLOCK_N keys, KV head). One program holds the
tile's K and V in shared memory, streams every query block that can see those keys (of every query
head of the GQA group) through a ring, and accumulates dK and dV in registers. So dK and dV are
written once per tile, in the input dtype, with no atomics: the GQA group sum is a register sum.
dQ is the only gradient that several programs add to (every KV tile of a sequence contributes to
every query row that sees it). Three ways to form it (`dq_mode`):

- "separate" (the default for short batches, and what `deterministic=True` runs but for RESIDENT_Q,
  below): the TLX kernel computes dK and dV only, and dQ comes from a query-stationary kernel in
  which each program owns its rows and walks the keys in a fixed order: no float atomics, bitwise
  reproducible. That is the forward kernel's dQ
  fork (`jagged_fwd.jagged_attention_dq`), or in the block-sparse fork the plain Triton `_dq_kernel`.
  It recomputes S and dP, yet measured 3-4x faster on the H200 than the fused atomic mode below;
- "atomic": fused; each consumer adds its `[BLOCK_M, D]` dQ piece to an fp32 accumulator with
  fp32 atomics, then one cast kernel;
- "tma_reduce": fused; the piece is staged in shared memory and added by one TMA reduce-add
  (`cp.reduce.async.bulk`), which frees the consumer at once instead of 64 atomics per thread.
  At D=64 consumer 1 hands its piece to consumer 0, and one reduce-add carries both. At D=128 the
  step runs in FlashAttention-3's orientation (`_consumer_q_step_split_dq`): each consumer forms
  half of dQ's columns from both consumers' dS, and reduce-adds its [BLOCK_M, D/2] half.
  The default at D=64 for batches of moderate length and at D=128 for long ones (`default_dq_mode`).
With broadcast-Q the fused modes give every program its own fp32 copy of the shared query's dQ
(B sequences would otherwise all add into the same `q_len` rows), and one reduce sums the copies;
the separate mode writes one fp32 partial per sequence and sums them in a fixed order. When the
shared query is a single block and every key head has one query head (`ONE_STEP_TUNING`),
each program keeps its block resident (RESIDENT_Q): Q loaded once, dQ summed in registers over all
of the program's key tiles and written once to its own partial, with no adds at all. That is
bitwise reproducible too, so where it is the default `deterministic=True` runs it as well.

Warp roles of the TLX kernel (`tlx.async_tasks`):
- producer (the default task, one warpgroup, few registers): TMA loads of the tile's K and V (one
  `[BLOCK_N/2, D]` half per consumer, guarded by `kv_full` / `kv_empty` mbarriers) and of each
  query block's Q and dO into a ring (`q_full` / `q_empty`);
- two consumers (`replicate=2`), each owning BLOCK_N/2 keys of the tile, so both read the same
  Q/dO slot: S^T = K Q^T and dP^T = V dO^T by wgmma from shared memory, P^T and dS^T in registers,
  dV += P^T dO and dK += dS^T Q by wgmma with the A operand from registers, dQ = dS K by wgmma with
  dS^T staged in shared memory (wgmma reads a transposed A only from there). The fused D=128 step
  computes S and dP instead, and stages P and dS for all three of dV, dK and dQ.

K is fed unscaled and the scale folds into the exp2 argument (`qk_scale_log2`): a bf16 K scaled in
advance overflowed exp2 in the seed and gave NaN gradients at large activations.

Jagged addressing and masks. q/dO are viewed as `[T, H*D]` and k/v as `[Tk, Hkv*D]`; a TMA box is
`[BLOCK_M, D]` rows of one head. Boxes may run into the next sequence (or past the tensor end, where
TMA fills zeros). Masking P^T to 0 for keys past the sequence end and for query rows past it makes
those rows contribute nothing, and dK/dV/dQ are written with row masks, so other sequences' rows
are never touched.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels import jagged_fwd
from jfa.kernels.common import (LOG2E, PINGPONG_BARRIER_FIRST, PINGPONG_THREADS, loop_segment, lse_delta_rows, num_sms,
                                per_step, persistent_programs, ring_slot, rows_descriptor, sequence_rows, sm_major,
                                visible_key_range, visible_mask)
from jfa.kernels.launch import CachedLaunch
from jfa.schedule import build_kv_tile_schedule, visible_query_blocks

# How dQ is formed (the `dq_mode` argument of `jagged_attention_bwd`).
DQ_SEPARATE: tl.constexpr = tl.constexpr(0)  # query-stationary `_dq_kernel`: no atomics, deterministic
DQ_ATOMIC: tl.constexpr = tl.constexpr(1)  # fused: each consumer adds its piece with fp32 atomics
DQ_TMA_REDUCE: tl.constexpr = tl.constexpr(2)  # fused: piece staged in shared memory, TMA reduce-add
DQ_MODES = {"separate": DQ_SEPARATE.value, "atomic": DQ_ATOMIC.value, "tma_reduce": DQ_TMA_REDUCE.value}
# The default, from the H200 measurements (scripts/dev_bwd_gpu.sh): the fused atomic path ran at
# 38-112 TFLOP/s, the separate dQ kernel path at 106-337 on the same shapes.
DEFAULT_DQ_MODE = "separate"
# ... except at head dim 64, where the fused tma_reduce kernel compiles without spills (`jfa.inspect`)
# and its five GEMM units beat the separate mode's seven. Measured on the H200 against the separate
# mode, same process, 3 alternating rounds (results/bwd-dq-modes-*): GEM +4-7%, broadcast-Q +8%
# (q=256) and +22% (q=64), window 128 +20%, GQA 4 +0-6%. With num_stages 0 and the dQ handoff
# between consumers (DQ_HANDOFF_BUFFERS) it also passed the separate mode on dense N=4096 (1.025x)
# and causal batches averaging 1024 keys (1.02-1.04x); causal at 2048 and 4096 is level (1.006x,
# 1.01x: results/bwd-dq-modes-handoff-*), where the separate mode's bitwise repeatable dQ is kept.
# So it is the default at D=64 for batches of at most FUSED_DQ_MAX_MEAN_KEYS keys per sequence on
# average, the longest measured (FUSED_DQ_MAX_MEAN_KEYS_CAUSAL when causal; a mean from the packed
# sizes: no GPU->host sync), and with broadcast-Q only where it keeps no more fp32 copies of dQ than
# the separate mode (one per program against one per sequence).
# At D=128 the fused step of the separate mode's orientation reloaded spilled values every step and
# ran 0.81x; FlashAttention-3's orientation (DQ_SPLIT) with the K/V slot indexed per step
# (`common.per_step`) ran against the separate mode (results/bwd-dq-modes-d128-split-*): GEM 1.04x
# at a mean of 512 queries per sequence rising to 1.14x at 2048, dense N=4096 1.08x, causal
# 1.14-1.31x, window 128 1.22x, GQA 4 1.13-1.15x; but 0.89x and 0.94x at means of 126 and 256
# queries, level at 253, and with broadcast-Q 0.90x (q=64) and 0.99x (q=256): a short query stream
# gives each K/V tile few steps, and the fused mode has room for one K/V slot only. So D=128 fuses
# from a mean of FUSED_DQ_MIN_MEAN_QUERIES query rows per sequence up. Measured again once the
# separate mode's dQ came from the forward's fork with a deeper K/V ring (results/dq-modes-deep-ring-*,
# separate against fused): GEM means of 126, 256 and 253 queries 1.15x, 1.13x and 1.02x, 512 level
# (1.006x), 1024 and up 0.92-0.95x, dense 0.90x: the bound holds. But with broadcast-Q the fused mode
# now won at q=64 (separate 0.97x) and q=256 (0.96x): there the separate mode writes, then sums, one
# fp32 dQ partial per sequence (0.6 GB at q=256 over 1152 sequences, about 0.25 ms of its 5.0 ms at
# the H200's bandwidth). So broadcast-Q is not bounded by its query rows, only by the copies of dQ.
FUSED_DQ_DEFAULT_HEAD_DIMS = (64, 128)
FUSED_DQ_DEFAULT_MODE = "tma_reduce"
FUSED_DQ_MAX_MEAN_KEYS = {64: 4096}  # no upper limit at a head dim not listed
FUSED_DQ_MAX_MEAN_KEYS_CAUSAL = {64: 1024}
FUSED_DQ_MIN_MEAN_QUERIES = {128: 512}  # no lower limit at a head dim not listed

NUM_CONSUMERS: tl.constexpr = tl.constexpr(2)  # consumer warpgroups, each owning half the tile's keys
# DQ_SPLIT's consumers meet at this named barrier once per query block, when both have staged their
# dS (the backward has no ping-pong, so the forward's ping-pong id and thread count serve: the same
# two warpgroups). dS alternates between two stages per consumer, so no second meeting is needed
# before a stage is rewritten: a consumer rewrites it two steps later, past the next step's meeting,
# which the other reaches only after waiting for the dQ wgmmas that read it.
DS_READY_BARRIER: tl.constexpr = PINGPONG_BARRIER_FIRST
DQ_SPLIT_DS_STAGES: tl.constexpr = tl.constexpr(2)  # dS stages per consumer, alternating by step
WARPGROUP_WARPS: tl.constexpr = tl.constexpr(specs.WARPGROUP_WARPS)
PRODUCER_WARPS = specs.WARPGROUP_WARPS  # the default task is one warpgroup (the kernel's num_warps)

# BLOCK_N keys per tile (BLOCK_N/2 per consumer), BLOCK_M query rows per streamed block, ring depths
# and the consumers' setmaxnreg budget. A consumer holds dK and dV ([64, D] fp32 each) plus the dQ
# piece, so it needs most of the register file: 2 x 240 + producer 24 (x128 threads) <= 64K.
# Shared memory at D=128 bf16: K,V 2 slots x 2x32 KB + Q,dO ring 2x(16+16) KB + dS^T staging 2x8 KB
# = 208 KB. A second K/V slot lets the next tile's keys land while this tile's last query blocks
# run: 6-10% faster on every measured shape than one slot (results/bwd-tuning-20261129T1405Z.json:
# dense 7.76 -> 7.22 ms, GEM L=2048 s=1 70.1 -> 66.1, PMA q=256 6.30 -> 5.70); deeper Q/dO rings
# gained nothing. The fused dQ modes have room for one K/V slot only: tma_reduce at D=128 stages P
# and dS (2x2x8 KB) and two fp32 halves of dQ (2x16 KB), and the atomic mode's layout change for its
# atomics takes as much compiler scratch.
# MASK_FREE_BULK: the query blocks that see every key of a consumer's tile run a step without mask
# arithmetic (masked blocks, bulk, masked blocks). At D=64, where the dK/dV kernel's elementwise work
# sets its pace, that compiles without spills and made the whole backward 14-43% faster; at D=128 the
# extra loops made ptxas reload spilled values in every loop (0.92-1.00x), so D=128 keeps the one
# masked loop (results/bwd-mask-free-bulk-ab-*). The fused D=128 step (DQ_SPLIT) compiles its bulk loop
# without reloads, in 481 instructions a step against the masked loop's 575, yet ran level or slower
# against the masked loop alone (dense 1.000x, GEM 0.99-1.01x, PMA q=256 0.970x, causal 0.99-1.01x;
# results/ab-bwd-split-bulk-*): its step is not paced by its elementwise instructions.
# DQ_HANDOFF_BUFFERS (tma_reduce only): > 0 makes consumer 1 hand its dQ piece to consumer 0 through
# a ring of that many fp32 stages, and consumer 0 reduce-adds the sum: half the global adds, which
# cost 6-10% of the backward (results/bwd-dq-reduce-cost-*). At D=64 (2 x 16 KB more shared memory)
# the whole backward ran GEM +2-8%, PMA +11-15% against one reduce-add per consumer
# (results/ab-bwd-dq-handoff-*). At D=128 (one slot, in the stage consumer 1 no longer needed, 224 KB)
# it ran 0.74-0.83x the separate mode, no better than without it (results/bwd-dq-modes-d128-variants-*).
# DQ_SPLIT (tma_reduce only): the step in FlashAttention-3's orientation, `_consumer_q_step_split_dq`;
# at D=128 the other orientation spills (see FUSED_DQ_MIN_MEAN_QUERIES for the measurements). With dQ
# split by head dimension too (FlashAttention-4's Hopper step: S^T and dP^T, so dV and dK read P^T and
# dS^T from registers and no P is staged) it ran dense 0.91x, GEM 0.92-0.96x with dP^T issued after
# P^T and no reloads (results/ab-bwd-fused-transposed-*), and 0.69x, 0.82-0.87x with S^T and dP^T
# issued together, where ptxas reloads 8-10 values a step (results/ab-bwd-split-t-*). FlashAttention-4's step
# (flash_attn/cute `_tile_size_bwd_sm90`) also streams 80-row query blocks at D=128 without causality, which
# Triton cannot express: every dimension of a tensor must be a power of two.
TUNING = {
    64: dict(BLOCK_M=64, BLOCK_N=128, NUM_Q_BUFFERS=3, NUM_KV_BUFFERS=2, CONSUMER_REGISTERS=240, MASK_FREE_BULK=True,
             DQ_HANDOFF_BUFFERS=2, DQ_SPLIT=False),
    128: dict(BLOCK_M=64, BLOCK_N=128, NUM_Q_BUFFERS=2, NUM_KV_BUFFERS=2, CONSUMER_REGISTERS=240,
              MASK_FREE_BULK=False, DQ_HANDOFF_BUFFERS=0, DQ_SPLIT=False),
}
FUSED_DQ_TUNING = {128: dict(NUM_KV_BUFFERS=1, DQ_SPLIT=True)}  # overrides of TUNING in the fused modes
# EARLY_V_RELEASE (DQ_SPLIT with broadcast-Q): with one K/V slot the next tile's keys cannot land
# while this tile runs, which costs most where a tile has few query blocks: a broadcast query of 64
# rows gives each tile one step. V's last read is the last step's dP, K's the last dQ and dK, so V
# gets its own empty barrier and the producer loads the next tile's V under the rest of that step.
# Measured on the H200 against main, whole backward, same process, 3 rounds (results/ab-bwd-early-v-*):
# PMA q=64 1.07x, q=256 1.04x; but dense D=128 0.985x and GEM 0.95-1.01x (L=1024 s=1 0.95x), where a
# tile runs 8 or more steps, so self-attention keeps one barrier.
# ONE_STEP_TUNING (the tma_reduce mode with broadcast-Q where every key tile runs one step: a
# broadcast query of at most BLOCK_M rows, one query head per key head): RESIDENT_Q. A program's tiles
# all have one key head (the grid is a multiple of the heads), so they all run the same query block: Q
# is loaded once, and dQ is summed in registers over the program's tiles and stored once, into the
# program's own partial (`_consumer_resident_q_step`). The per-tile dQ staging and reduce-add, the
# Q/dO ring and the consumers' dS meeting are gone, and the shared memory they took holds a second V
# slot and a dO per K/V slot, so a tile's K, V and dO all land a tile ahead. Measured on the H200
# against two K slots, one V and one Q/dO (the reduce-add per tile), whole backward, same process, 3
# rounds (results/ab-bwd-resident-q-*): PMA q=64 1.40x (190 -> 267 TFLOP/s); PMA q=256 (4 steps)
# unchanged. At D=64 it replaces the S^T step with the dQ handoff; its slots are half as large, so
# four of K, V and dO fit, and nothing spills: PMA q=64 at D=64 (8 heads) 1.16x (189 -> 219 TFLOP/s,
# results/ab-bwd-resident-q-d64-*). Both need V's own empty barrier (EARLY_V_RELEASE), freed after dP.
ONE_STEP_TUNING = {128: dict(NUM_KV_BUFFERS=2, NUM_V_BUFFERS=2, NUM_Q_BUFFERS=1, RESIDENT_Q=True),
                   64: dict(NUM_KV_BUFFERS=4, NUM_V_BUFFERS=4, NUM_Q_BUFFERS=1, RESIDENT_Q=True, EARLY_V_RELEASE=True,
                            DQ_HANDOFF_BUFFERS=0)}
# Each RESIDENT_Q program keeps one key head, so its grid is the largest multiple of the key heads
# that fits the SMs (`resident_q_grid`), and some head counts leave SMs idle. It still won at every
# count measured against the general step (dq_mode="tma_reduce", same process, 3 rounds, PMA q=64
# with as many tokens as the suite's; results/bwd-resident-q-by-heads-*): 4 heads (132 programs)
# 1.48x, 48 (96) 1.61x, 67 (67, half the SMs) 1.18x, 150 (two waves of 132 and 18) 1.34x.


def resident_q_grid(num_sms: int, kv_heads: int, max_tiles: int) -> int:
    """RESIDENT_Q's programs: a multiple of `kv_heads` (program p takes the tiles p, p + grid, ...,
    all of key head p % kv_heads), at most the SMs or the tiles, at least one per key head."""
    return max(kv_heads, min(num_sms, max_tiles) // kv_heads * kv_heads)


# The dK/dV kernel is launched at num_stages 1, where Triton's pipeliner makes every wgmma finish
# before the next instruction (`jagged_fwd.NUM_STAGES` says how), so each consumer's matrix
# multiplies overlap only the other consumer's softmax. Measured on the H200 against that: without
# the waits (num_stages 0; S^T and dP^T in flight together, dV and dK too) ptxas reloads spilled
# values inside the loop and the backward ran 0.86-0.93x (results/ab-num-stages-*); the consumers
# taking turns at the tensor cores like the forward's ran 0.87-0.93x (results/branch-bwd-pingpong-*).
# Since the rows-only masks and, at D=64, the mask-free bulk freed registers, D=64 compiles at
# num_stages 0 without spills in either dQ mode. Measured against 1 (results/ab-bwd-s0-*): the fused
# tma_reduce mode, D=64's default on GEM and PMA, ran 1.00-1.05x (GEM geometric mean 1.016x); the
# separate mode (dense) 0.99x; D=128, which still reloads 6-10 values per step there, 0.96-0.99x.
# The fused D=128 step (DQ_SPLIT) orders its own waits: its dK wgmma runs under the dQ store, and its
# measurements (FUSED_DQ_MIN_MEAN_QUERIES) are at num_stages 0.
# (The atomic mode, never a default, compiles as cleanly at D=64 and follows tma_reduce untimed.)
NUM_STAGES = 1
FUSED_DQ_NUM_STAGES = {64: 0, 128: 0}  # exceptions to NUM_STAGES in the atomic and tma_reduce modes


def launch_num_stages(head_dim: int, dq_mode: str) -> int:
    """The dK/dV kernel's num_stages for one configuration (NUM_STAGES, FUSED_DQ_NUM_STAGES)."""
    return NUM_STAGES if dq_mode == "separate" else FUSED_DQ_NUM_STAGES.get(head_dim, NUM_STAGES)

# The separate mode's dQ comes from the forward kernel's dQ fork (`jagged_fwd.jagged_attention_dq`:
# warp-specialized, TMA, the forward's schedule and K/V ring) rather than the plain Triton `_dq_kernel`
# below, except in the block-sparse fork (its key tiles are the selection's blocks, the dQ fork's at
# D=128 are half as long). Measured on the H200, whole backward, same process, 3 alternating rounds
# (results/ab-dq-fork-*): GEM L=256 1.11x (s=0.5) and 1.13x (s=1), L=512 s=0.5 1.07x, PMA q=64 1.02x,
# and PMA q=256 0.96x until the fork's K/V ring was deepened (`jagged_fwd.DQ_TUNING`), then 1.11x
# (results/ab-dq-fork-deep-ring-*).
# The deterministic dQ kernel is plain Triton (no warp specialization), in one of two shapes: query
# rows per program, keys per step, warps and software-pipeline stages. Measured on the H200
# (results/dq-configs-20261129T1350Z.json, same-process A/B in results/dq-shape-ab-20261129T1400Z.json):
# 128-row blocks, 8 warps and a 3-stage K/V pipeline are 8-10% faster than 64-row blocks when a
# block has many keys to walk (dense 3.24 -> 3.02 ms, GEM L=2048 s=1 31.0 -> 28.4 ms, PMA q=256 with
# keys up to 2048); with short sequences most of a 128-row block is padding and the deeper pipeline
# barely fills, and the 64-row shape wins (GEM L=256 s=1 0.81 against 0.86 ms, L=512 s=0.5 1.11
# against 1.18 ms). Both walk masked head tiles, mask-free bulk tiles, masked tail tiles; the
# mask-free bulk alone is worth 9% on the dense case (3.21 -> 2.93 ms in the probe).
# At D=64 the 128-row blocks run best with 4 warps (32 rows each; at D=128 that shape took twice as
# long, dense 5.9 against 3.0 ms), and they pay from a mean of 192 query rows whatever the keys:
# dense D=64 1.93 -> 1.56 ms, GEM D=64 H=8 L=256 s=1 1.12 -> 0.92 (short), L=512 s=0.5 1.50 -> 1.28
# (short), L=1024 s=1 10.0 -> 8.6, L=2048 s=1 35.7 -> 30.4; at L=256 s=0.5 (mean 126 rows) 0.59
# against the short shape's 0.58 (results/dq-configs-d64-*).
DQ_CONFIGS = {
    "short": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "long": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "long-d64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
}
# "long" from these mean query rows and mean keys per sequence on (1.5 of its query blocks; 6 key
# tiles); "long-d64" from the rows alone
DQ_LONG_MIN_MEAN_ROWS = 192
DQ_LONG_MIN_MEAN_KEYS = 384
DELTA_BLOCK_ROWS = 64  # rows per program of the Delta preprocess


# ---- device code -------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_rows", "num_heads", "stride_delta_head"])
def _delta_kernel(out_ptr, dout_ptr, delta_ptr, num_rows, num_heads, stride_row, stride_delta_head,
                  HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Delta[h, row] = sum_d O[row, h, d] * dO[row, h, d] in fp32 (the softmax backward's row term)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    valid = rows < num_rows
    offs = rows.to(tl.int64)[:, None] * stride_row + head * HEAD_DIM + dims[None, :]
    o = tl.load(out_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + head.to(tl.int64) * stride_delta_head + rows, tl.sum(o * do, 1), mask=valid)


@triton.jit
def _visible_keys_by_queries(kv_cols, q_rows, q_len, kv_len, window, CAUSAL: tl.constexpr,
                             HAS_WINDOW: tl.constexpr):
    """[keys, queries] booleans: the transpose of `common.visible_mask`, plus query-row validity.

    The backward computes S^T, so the mask is built in that orientation directly (transposing a
    register tile would cost a trip through shared memory). Query rows past the sequence end are
    another sequence's and must add nothing to dK/dV, hence the extra `q_rows < q_len`.
    """
    visible = (kv_cols[:, None] < kv_len) & (q_rows[None, :] < q_len)
    if CAUSAL:
        visible = visible & (kv_cols[:, None] <= q_rows[None, :] + (kv_len - q_len))
    if HAS_WINDOW:
        visible = visible & (kv_cols[:, None] >= q_rows[None, :] - window)
        visible = visible & (kv_cols[:, None] <= q_rows[None, :] + window)
    return visible


@triton.jit
def _full_block_range(first_key, last_key, first_row, num_blocks, q_len, kv_len, window,
                      BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(lo, hi): the query blocks i in [lo, hi) of rows first_row + i*BLOCK_M .. + BLOCK_M-1 that see
    every key first_key..last_key (all rows inside the sequence, the keys inside it, below the
    causal diagonal and inside the window): their steps need no mask. lo <= hi <= num_blocks."""
    hi = tl.where(last_key < kv_len, tl.maximum(q_len - first_row, 0) // BLOCK_M, 0)
    lo = 0
    if CAUSAL:
        lo = tl.maximum(lo, tl.cdiv(tl.maximum(last_key - (kv_len - q_len) - first_row, 0), BLOCK_M))
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.cdiv(tl.maximum(last_key - window - first_row, 0), BLOCK_M))
        hi = tl.minimum(hi, tl.maximum(first_key + window - first_row + 1, 0) // BLOCK_M)
    hi = tl.minimum(hi, num_blocks)
    return tl.minimum(lo, hi), hi


@triton.jit
def _kv_tile_geometry(tile, tile_entries_ptr, q_offsets_ptr, kv_offsets_ptr, num_kv_heads,
                      kv_blocks_per_seq, broadcast_q_len, window, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      BROADCAST_Q: tl.constexpr):
    """Decode tile id -> its keys and the query blocks that see them.

    Returns (kv_head, seq, q_start, q_len, out_row0, kv_start, kv_len, col0, first_row,
    num_q_blocks): the tile's keys are sequence-local columns col0 .. col0+BLOCK_N-1, and it visits
    query blocks starting at sequence-local rows first_row + i*BLOCK_M for i < num_q_blocks, counted by
    `jfa.schedule.visible_query_blocks` as the tile list is (the block-sparse fork visits the selected
    query blocks instead: `_query_block_row`).
    """
    entry = tl.load(tile_entries_ptr + tile // num_kv_heads)
    kv_head = tile % num_kv_heads
    seq = entry // kv_blocks_per_seq
    col0 = (entry % kv_blocks_per_seq) * BLOCK_N
    q_start, q_len, out_row0, kv_start, kv_len = sequence_rows(
        seq, q_offsets_ptr, kv_offsets_ptr, broadcast_q_len, BROADCAST_Q)
    first_row, num_q_blocks = visible_query_blocks(col0, q_len, kv_len, window, BLOCK_M, BLOCK_N, CAUSAL,
                                                   HAS_WINDOW)
    return (kv_head, seq, q_start, q_len, out_row0, kv_start, kv_len, col0, first_row, num_q_blocks)


@triton.jit
def _query_blocks_of(seq, kv_head, g, gqa_group, col0, num_q_blocks, q_blocks_ptr, q_block_counts_ptr, num_kv_heads,
                     sel_kv_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEL_WIDTH: tl.constexpr,
                     BLOCK_SPARSE: tl.constexpr):
    """(head, selected, count): the g-th query head of key head `kv_head`'s GQA group, and the query
    blocks of BLOCK_M rows it streams past this key tile.

    Dense: the geometry's consecutive blocks. Block-sparse: the transposed selection's row for
    (sequence, head, key block) lists the selecting query blocks of BLOCK_N rows in ascending order;
    each is streamed as BLOCK_N // BLOCK_M blocks of BLOCK_M rows.
    """
    head = kv_head * gqa_group + g
    if BLOCK_SPARSE:
        entry = (seq * num_kv_heads * gqa_group + head) * sel_kv_blocks + col0 // BLOCK_N
        selected = q_blocks_ptr + entry.to(tl.int64) * SEL_WIDTH
        count = tl.load(q_block_counts_ptr + entry) * (BLOCK_N // BLOCK_M)
    else:
        selected = num_q_blocks  # unused: consecutive query blocks
        count = num_q_blocks
    return head, selected, count


@triton.jit
def _query_block_row(block, first_row, selected, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_SPARSE: tl.constexpr):
    """Sequence-local first row of the `block`-th query block a key tile streams (the one place the
    block-sparse fork changes the backward's iteration)."""
    if BLOCK_SPARSE:
        SUB: tl.constexpr = BLOCK_N // BLOCK_M
        row = tl.load(selected + block // SUB) * BLOCK_N + (block % SUB) * BLOCK_M
    else:
        row = first_row + block * BLOCK_M
    return row


@triton.jit
def _consumer_q_step(q_tile, do_tile, k_tile, v_tile, ds_stage, dq_stages, handoff_fulls, handoff_empties, step,
                     desc_dq, dq_row0, dk, dv,
                     lse_ptr, delta_ptr, dq_ptr, head, q_start, q_len, out_row0, kv_len, kv_cols, q_row0, window,
                     stride_lse_head, stride_delta_head, stride_dq_row, qk_scale_log2, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, DQ_MODE: tl.constexpr, DQ_HANDOFF_BUFFERS: tl.constexpr,
                     cid: tl.constexpr, MASKED: tl.constexpr = True):
    """One query block against this consumer's keys: update dK, dV; add its dQ piece (fused modes).
    MASKED=False where every (key, query) pair of the block is visible (`_full_block_range`).

    S^T and dP^T are issued back to back so the second runs on the tensor cores while the first's
    exp2 is computed. The wgmma that reads dS^T from shared memory is waited for before returning,
    so the next step may overwrite the staging buffer.
    """
    dtype: tl.constexpr = q_tile.dtype
    # Without causality or a window, and with dQ left to its own kernel, a masked step masks rows
    # only, through LSE: rows past the sequence end load LSE = +inf, so their P and dS are exactly 0
    # and they add nothing to dK/dV. Keys past the sequence end get garbage dK/dV rows, which are
    # never stored (`_store_kv_grads` masks them) and feed nothing else (wgmma rows are independent).
    # Gradients bitwise equal to the full mask; D=128 +1-8.5% (results/bwd-rows-only-mask-ab-*).
    ROWS_BY_LSE: tl.constexpr = DQ_MODE == DQ_SEPARATE and not (CAUSAL or HAS_WINDOW)
    s_t = tlx.async_dot(k_tile, tlx.local_trans(q_tile))
    dp_t = tlx.async_dot(v_tile, tlx.local_trans(do_tile))
    q_rows = q_row0 + tl.arange(0, BLOCK_M)
    row_ok = q_rows < q_len
    lse_ptrs = lse_ptr + head.to(tl.int64) * stride_lse_head + out_row0 + q_rows
    delta_ptrs = delta_ptr + head.to(tl.int64) * stride_delta_head + out_row0 + q_rows
    if MASKED:
        lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf") if ROWS_BY_LSE else 0.0)
        delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    else:
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    s_t = tlx.async_dot_wait(1, s_t)
    p_t = tl.math.exp2(s_t * qk_scale_log2 - (lse * LOG2E)[None, :])
    if MASKED and not ROWS_BY_LSE:
        # tl.where, not a multiply: masked entries may be exp2(+inf) (rows whose LSE is -inf).
        visible = _visible_keys_by_queries(kv_cols, q_rows, q_len, kv_len, window, CAUSAL, HAS_WINDOW)
        p_t = tl.where(visible, p_t, 0.0)
    dp_t = tlx.async_dot_wait(0, dp_t)
    ds_t = p_t * (dp_t - delta[None, :])
    dv = tlx.async_dot(p_t.to(dtype), do_tile, dv)
    ds_t_low = ds_t.to(dtype)
    dk = tlx.async_dot(ds_t_low, q_tile, dk)
    if DQ_MODE != DQ_SEPARATE:
        tlx.local_store(ds_stage, ds_t_low)
        tlx.fence_async_shared()
        dq = tlx.async_dot(tlx.local_trans(ds_stage), k_tile)
        dq = tlx.async_dot_wait(0, dq)
        if DQ_MODE == DQ_ATOMIC:
            dims = tl.arange(0, HEAD_DIM)
            ptrs = (dq_ptr + (q_start + q_rows).to(tl.int64)[:, None] * stride_dq_row
                    + head * HEAD_DIM + dims[None, :])
            tl.atomic_add(ptrs, dq * sm_scale, mask=row_ok[:, None], sem="relaxed")
        else:
            if DQ_HANDOFF_BUFFERS > 0:
                # Both consumers formed a piece for the same query rows: consumer 1 hands its piece to
                # consumer 0 through a ring of stages, and one reduce-add carries the sum (half the
                # global fp32 adds; they cost 6-10% of the backward, results/bwd-dq-reduce-cost-*).
                # Both stream the same query blocks in the same order, so their `step` counts agree.
                slot, phase = ring_slot(step, DQ_HANDOFF_BUFFERS)
                if cid == 0:
                    tlx.barrier_wait(handoff_fulls[slot], phase)
                    dq += tlx.local_load(dq_stages[1 + slot])
                    tlx.barrier_arrive(handoff_empties[slot], 1)
                else:
                    tlx.barrier_wait(handoff_empties[slot], phase ^ 1)
                    tlx.local_store(dq_stages[1 + slot], dq)
                    tlx.barrier_arrive(handoff_fulls[slot], 1)
            if DQ_HANDOFF_BUFFERS == 0 or cid == 0:
                # The whole box is added: rows past the sequence end hold exact zeros (their dS is 0),
                # and TMA clips rows past the tensor end.
                dq_stage = dq_stages[cid]
                tlx.async_descriptor_store_wait(0)  # the previous reduce has read the staging buffer
                tlx.local_store(dq_stage, dq * sm_scale)
                tlx.fence_async_shared()
                tlx.async_descriptor_store(desc_dq, dq_stage, [dq_row0 + q_start + q_row0, head * HEAD_DIM],
                                           store_reduce="add")
    dv = tlx.async_dot_wait(0, dv)
    dk = tlx.async_dot_wait(0, dk)
    return dk, dv


@triton.jit
def _consumer_q_step_split_dq(q_tile, do_tile, k_tiles, kv_slot, v_tile, p_stage, ds_stages, ds_slot, dq_stage,
                              desc_dq, dq_row0, dk, dv, lse_log2, delta, lse_ptr, delta_ptr, head, q_start, q_len,
                              out_row0, kv_len, kv_cols, q_row0, next_q_row0, window, stride_lse_head,
                              stride_delta_head, qk_scale_log2, sm_scale, v_empty, last_block, cid: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                              HAS_WINDOW: tl.constexpr, MASKED: tl.constexpr, EARLY_V_RELEASE: tl.constexpr):
    """The fused tma_reduce step in FlashAttention-3's orientation (DQ_SPLIT, D=128).

    `_consumer_q_step` computes S^T (keys x queries), so P^T and dS^T feed the dV and dK wgmmas from
    registers, but every thread then holds LSE and Delta for 16 query columns, and the fused [64, D]
    dQ piece on top of that spills. Here S = Q K^T (queries x this consumer's keys): LSE and Delta
    are 2 values per thread; P and dS go to shared memory, and dV += P^T dO, dK += dS^T Q read them
    transposed from there. dQ is split by head dimension: consumer c forms dQ[:, c-th half of D] over
    all BLOCK_N keys from both consumers' dS (one named barrier per query block; `ds_slot` alternates
    the dS stages by step), a [64, 64] piece. dV is issued as soon as P is staged, so it runs while
    dS is formed (`results/ab-bwd-early-dv-d128-*`: 1.00-1.04x).
    `kv_slot` is the per-step index of `common.per_step`: three matrix multiplies read K or V here,
    and descriptors hoisted out of the loop spilled (34-46 reloads per step, and 0.81x the separate
    mode; 7-19 and 1.04-1.31x from a mean of 512 queries this way).
    With EARLY_V_RELEASE the tile's `last_block` frees V's slot (`v_empty`) once dP is done.
    `lse_log2` and `delta` of this block were loaded a step ahead; the step loads those of the block
    at `next_q_row0` and returns them: loaded in the step that uses them, their global-load latency
    held up the wgmma issue (`results/ncu-bwd-d128-fused-20261130T0420Z.json`; this way dense 1.075x,
    GEM 1.00-1.05x, causal 0.98-1.00x, `results/ab-bwd-lse-ahead-d128-*`).
    """
    dtype: tl.constexpr = q_tile.dtype
    k_tile = k_tiles[kv_slot * NUM_CONSUMERS + cid]
    KEYS: tl.constexpr = k_tile.shape[0]
    HALF_D: tl.constexpr = HEAD_DIM // NUM_CONSUMERS
    s = tlx.async_dot(q_tile, tlx.local_trans(k_tile))
    dp = tlx.async_dot(do_tile, tlx.local_trans(v_tile))
    # The head and the key columns too are re-derived each step (`per_step`), the columns from their
    # first (the vector's minimum, hoisted): kept across the loop they were reloaded from local memory
    # every step (7-19 values per step; 1 this way).
    head = per_step(head)
    kv_cols = per_step(tl.min(kv_cols, 0)) + tl.arange(0, KEYS)
    next_lse_log2, next_delta = lse_delta_rows(lse_ptr, delta_ptr, head, out_row0, next_q_row0, q_len,
                                               stride_lse_head, stride_delta_head, BLOCK_M)
    q_rows = q_row0 + tl.arange(0, BLOCK_M)
    row_ok = q_rows < q_len
    s = tlx.async_dot_wait(1, s)
    p = tl.math.exp2(s * qk_scale_log2 - lse_log2[:, None])
    if MASKED:
        # Keys past the sequence end must be masked here: their dS feeds dQ of valid rows.
        visible = visible_mask(q_rows, kv_cols, q_len, kv_len, window, CAUSAL, HAS_WINDOW) & row_ok[:, None]
        p = tl.where(visible, p, 0.0)
    # dV needs only P: it runs on the tensor cores while dS is formed (the wait for dP leaves it pending).
    tlx.local_store(p_stage, p.to(dtype))
    tlx.fence_async_shared()
    dv = tlx.async_dot(tlx.local_trans(p_stage), do_tile, dv)
    dp = tlx.async_dot_wait(1, dp)
    if EARLY_V_RELEASE:
        if last_block:  # the tile's last read of V: the producer may load the next tile's V
            tlx.barrier_arrive(v_empty, 1)
    ds = p * (dp - delta[:, None])
    ds_stage = ds_stages[ds_slot * NUM_CONSUMERS + cid]
    tlx.local_store(ds_stage, ds.to(dtype))
    tlx.fence_async_shared()
    tlx.named_barrier_wait(DS_READY_BARRIER, PINGPONG_THREADS)
    dq = tlx.async_dot(ds_stages[ds_slot * NUM_CONSUMERS],
                       tlx.local_slice(k_tiles[kv_slot * NUM_CONSUMERS], [0, cid * HALF_D], [KEYS, HALF_D]))
    dq = tlx.async_dot(ds_stages[ds_slot * NUM_CONSUMERS + 1],
                       tlx.local_slice(k_tiles[kv_slot * NUM_CONSUMERS + 1], [0, cid * HALF_D], [KEYS, HALF_D]), dq)
    # dK goes last, so the dQ store below runs while it does: wait for every group but dK's.
    dk = tlx.async_dot(tlx.local_trans(ds_stage), q_tile, dk)
    dq = tlx.async_dot_wait(1, dq)
    # Handing the staged piece to the producer instead (each thread stores and arrives on its own; the
    # producer issues the reduce-add, like FlashAttention-3's dQ writer warp) saved this warpgroup barrier
    # and 18 instructions a step but ran level: dense 0.98-1.00x, GEM 0.96-1.04x (results/ab-bwd-producer-adds-dq-*).
    # These stores are 2-way bank conflicted (a half-warp writes four 128-byte rows, which the swizzle
    # spreads over half the banks): 67M of the dense backward's 823M shared-memory wavefronts, and that
    # pipe sets the pace (results/ncu-bwd-d128-smem-*). Staged as eight [64, 8] boxes instead (32-byte
    # rows, no conflicts), the eight narrow reduce-adds cost far more: 0.76x (results/ab-bwd-dq-box32-*); the
    # same staging added by one reduce-add through a 3-D view [H*D/8, T, 8] of the accumulator ran dense 0.98x,
    # GEM 0.90-1.01x, PMA q=256 0.95x (results/ab-bwd-dq-groups-3d-*): the conflicts do not set the pace.
    # The whole box is added: rows past the sequence end hold exact zeros (their dS is 0), and TMA
    # clips rows past the tensor end.
    tlx.async_descriptor_store_wait(0)  # the previous reduce has read the staging buffer
    tlx.local_store(dq_stage, dq * sm_scale)
    tlx.fence_async_shared()
    tlx.async_descriptor_store(desc_dq, dq_stage, [dq_row0 + q_start + q_row0, head * HEAD_DIM + cid * HALF_D],
                               store_reduce="add")
    # dK is waited for here, before the next step issues S and dP. Leaving it in flight into the next step
    # (its Q slot freed there, once S is done) ran 0.94x dense and 0.96-0.97x on the fused GEM shapes,
    # likely because the producer got the slot back later (results/ab-bwd-defer-dk-wait-*).
    dv = tlx.async_dot_wait(0, dv)
    dk = tlx.async_dot_wait(0, dk)
    return dk, dv, next_lse_log2, next_delta


@triton.jit
def _consumer_resident_q_step(q_tile, do_tile, k_tile, v_tile, p_stage, ds_stage, dq_lo, dq_hi, lse_log2, delta,
                              q_len, kv_len, kv_cols, window, qk_scale_log2, sm_scale, v_empty, dk_ptr, dv_ptr,
                              kv_start, kv_head, stride_dkv_row, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """A key tile's only step with RESIDENT_Q: the program's one query block against this consumer's keys.

    Every tile of the program has the same query rows of the same head, so dQ stays in registers, in
    two [BLOCK_M, D/2] halves, summed over all of the program's tiles: no dQ staging or reduce-add per
    tile, and each consumer forms dQ from its own dS (from registers, as the forward's P V), so the
    consumers never wait for each other. S, dV and dK are `_consumer_q_step_split_dq`'s; dK, dV are
    fresh each tile (one step), and V's slot is freed as soon as dP has read it. dV is stored while
    the dQ wgmmas run, and dK is issued after that store, so at most two [KEYS, D] fp32 accumulators
    are live beside dQ.
    """
    dtype: tl.constexpr = q_tile.dtype
    KEYS: tl.constexpr = k_tile.shape[0]
    HALF_D: tl.constexpr = HEAD_DIM // 2
    s = tlx.async_dot(q_tile, tlx.local_trans(k_tile))
    dp = tlx.async_dot(do_tile, tlx.local_trans(v_tile))
    q_rows = tl.arange(0, BLOCK_M)
    s = tlx.async_dot_wait(1, s)
    p = tl.math.exp2(s * qk_scale_log2 - lse_log2[:, None])
    visible = visible_mask(q_rows, kv_cols, q_len, kv_len, window, CAUSAL, HAS_WINDOW) & (q_rows < q_len)[:, None]
    p = tl.where(visible, p, 0.0)
    tlx.local_store(p_stage, p.to(dtype))
    tlx.fence_async_shared()
    dv = tlx.async_dot(tlx.local_trans(p_stage), do_tile)
    dp = tlx.async_dot_wait(1, dp)
    tlx.barrier_arrive(v_empty, 1)
    ds = (p * (dp - delta[:, None])).to(dtype)
    tlx.local_store(ds_stage, ds)
    tlx.fence_async_shared()
    dq_lo = tlx.async_dot(ds, tlx.local_slice(k_tile, [0, 0], [KEYS, HALF_D]), dq_lo)
    dq_hi = tlx.async_dot(ds, tlx.local_slice(k_tile, [0, HALF_D], [KEYS, HALF_D]), dq_hi)
    dv = tlx.async_dot_wait(2, dv)
    kv_ok = kv_cols < kv_len
    _store_kv_rows(dv_ptr, dv.to(dtype), kv_start + kv_cols, kv_ok, kv_head, stride_dkv_row, HEAD_DIM)
    dk = tlx.async_dot(tlx.local_trans(ds_stage), q_tile)
    dq_lo = tlx.async_dot_wait(0, dq_lo)
    dq_hi = tlx.async_dot_wait(0, dq_hi)
    dk = tlx.async_dot_wait(0, dk)
    _store_kv_rows(dk_ptr, (dk * sm_scale).to(dtype), kv_start + kv_cols, kv_ok, kv_head, stride_dkv_row, HEAD_DIM)
    return dq_lo, dq_hi


@triton.jit
def _consumer_q_block(block, q_loads, q_tiles, do_tiles, q_fulls, q_empties, k_tiles, v_tiles, kv_slot, v_slot,
                      v_empty, last_head, ds_stages, p_stages, dq_stages, handoff_fulls, handoff_empties, desc_dq,
                      dq_row0, dk, dv, lse_ptr, delta_ptr, dq_ptr, head, q_start, q_len, out_row0, kv_len, kv_cols,
                      first_row, selected, head_blocks, lse_log2, delta, window, stride_lse_head,
                      stride_delta_head, stride_dq_row, qk_scale_log2, sm_scale, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_Q_BUFFERS: tl.constexpr, CAUSAL: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, DQ_MODE: tl.constexpr, DQ_HANDOFF_BUFFERS: tl.constexpr,
                      DQ_SPLIT: tl.constexpr, cid: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MASKED: tl.constexpr,
                      EARLY_V_RELEASE: tl.constexpr):
    """The `block`-th streamed query block: wait for its Q/dO slot, run the step, free the slot.
    With DQ_SPLIT, `lse_log2` and `delta` are this block's, and the next block's are returned;
    `last_head`: the GQA group's last head, whose last block ends the tile's reads of V."""
    slot, phase = ring_slot(q_loads, NUM_Q_BUFFERS)
    tlx.barrier_wait(q_fulls[slot], phase)
    q_row0 = _query_block_row(block, first_row, selected, BLOCK_M, BLOCK_N, BLOCK_SPARSE)
    if NUM_Q_BUFFERS == 1:  # a constant slot: its wgmma descriptors would be hoisted and spilled
        q_slot = per_step(slot)
    else:
        q_slot = slot
    kv_slot = per_step(kv_slot)
    kv_index = kv_slot * NUM_CONSUMERS + cid
    if EARLY_V_RELEASE:  # V's ring may be shallower than K's
        v_index = per_step(v_slot) * NUM_CONSUMERS + cid
    else:
        v_index = kv_index
    if DQ_SPLIT:
        next_q_row0 = _query_block_row(tl.minimum(block + 1, head_blocks - 1), first_row, selected, BLOCK_M, BLOCK_N,
                                       BLOCK_SPARSE)
        dk, dv, lse_log2, delta = _consumer_q_step_split_dq(
            q_tiles[q_slot], do_tiles[q_slot], k_tiles, kv_slot, v_tiles[v_index], p_stages[cid], ds_stages,
            q_loads % DQ_SPLIT_DS_STAGES, dq_stages[cid], desc_dq, dq_row0, dk, dv, lse_log2, delta, lse_ptr,
            delta_ptr, head, q_start, q_len, out_row0, kv_len, kv_cols, q_row0, next_q_row0, window, stride_lse_head,
            stride_delta_head, qk_scale_log2, sm_scale, v_empty, last_head & (block == head_blocks - 1), cid,
            HEAD_DIM, BLOCK_M, CAUSAL, HAS_WINDOW, MASKED, EARLY_V_RELEASE)
    else:
        dk, dv = _consumer_q_step(
            q_tiles[q_slot], do_tiles[q_slot], k_tiles[kv_index], v_tiles[v_index], ds_stages[cid], dq_stages,
            handoff_fulls, handoff_empties, q_loads, desc_dq, dq_row0, dk, dv, lse_ptr, delta_ptr, dq_ptr, head,
            q_start, q_len, out_row0, kv_len, kv_cols, q_row0, window, stride_lse_head, stride_delta_head,
            stride_dq_row, qk_scale_log2, sm_scale, HEAD_DIM, BLOCK_M, CAUSAL, HAS_WINDOW, DQ_MODE,
            DQ_HANDOFF_BUFFERS, cid, MASKED)
    tlx.barrier_arrive(q_empties[slot], 1)
    return dk, dv, q_loads + 1, lse_log2, delta


@triton.jit
def _load_kv_halves_into(desc, tiles, slot, empty, phase, fulls, kv_slot, ARM_BYTES: tl.constexpr, row0, kv_head,
                         KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, CONSUMERS: tl.constexpr):
    """Wait for ring slot `slot` to be free (`empty`), then TMA-load a tile's K (or V) into it, one
    [KEYS, HEAD_DIM] half per consumer, signalling the tile's `fulls[kv_slot]`; ARM_BYTES > 0 first arms
    it with the bytes of the whole tile (the first of its K and V loads)."""
    tlx.barrier_wait(empty, phase ^ 1)
    full = fulls[kv_slot]
    if ARM_BYTES > 0:
        tlx.barrier_expect_bytes(full, ARM_BYTES)
    for c in tl.static_range(CONSUMERS):
        tlx.async_descriptor_load(desc, tiles[slot * CONSUMERS + c], [row0 + c * KEYS, kv_head * HEAD_DIM], full)


@triton.jit
def _store_kv_rows(ptr, x, kv_rows, row_ok, kv_head, stride_dkv_row, HEAD_DIM: tl.constexpr):
    """Masked store of a consumer's dK or dV rows (keys past the sequence end are another's)."""
    dims = tl.arange(0, HEAD_DIM)
    offs = kv_rows.to(tl.int64)[:, None] * stride_dkv_row + kv_head * HEAD_DIM + dims[None, :]
    tl.store(ptr + offs, x, mask=row_ok[:, None])


@triton.jit
def _store_kv_grads(dk_ptr, dv_ptr, dk, dv, kv_rows, row_ok, kv_head, stride_dkv_row,
                    HEAD_DIM: tl.constexpr):
    """Masked store of a consumer's dK, dV rows."""
    _store_kv_rows(dk_ptr, dk, kv_rows, row_ok, kv_head, stride_dkv_row, HEAD_DIM)
    _store_kv_rows(dv_ptr, dv, kv_rows, row_ok, kv_head, stride_dkv_row, HEAD_DIM)


# Integers that change with the problem are not specialized (Triton would otherwise compile a
# variant for every combination of "divisible by 16" and "== 1" among them).
@triton.jit(do_not_specialize=["stride_lse_head", "stride_delta_head", "dq_partial_stride",
                               "dq_partial_rows", "num_kv_heads", "kv_blocks_per_seq", "broadcast_q_len", "window",
                               "gqa_group", "sel_kv_blocks"])
def _jagged_bwd_kernel(desc_q, desc_k, desc_v, desc_do, desc_dq, lse_ptr, delta_ptr, dq_accum_ptr,
                       dk_ptr, dv_ptr, q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr,
                       num_entries_ptr, q_blocks_ptr, q_block_counts_ptr, sel_kv_blocks,
                       stride_lse_head, stride_delta_head, stride_dq_row,
                       dq_partial_stride, dq_partial_rows,
                       stride_dkv_row, num_kv_heads, kv_blocks_per_seq, broadcast_q_len, window,
                       gqa_group, qk_scale_log2, sm_scale, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr,
                       DQ_MODE: tl.constexpr, NUM_Q_BUFFERS: tl.constexpr,
                       NUM_KV_BUFFERS: tl.constexpr, CONSUMER_REGISTERS: tl.constexpr,
                       BLOCK_SPARSE: tl.constexpr, SEL_WIDTH: tl.constexpr, MASK_FREE_BULK: tl.constexpr,
                       DQ_HANDOFF_BUFFERS: tl.constexpr, DQ_SPLIT: tl.constexpr, EARLY_V_RELEASE: tl.constexpr,
                       NUM_V_BUFFERS: tl.constexpr, RESIDENT_Q: tl.constexpr):
    CONSUMERS: tl.constexpr = NUM_CONSUMERS
    KEYS: tl.constexpr = BLOCK_N // CONSUMERS  # keys per consumer warpgroup
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    Q_BYTES: tl.constexpr = BLOCK_M * HEAD_DIM * tlx.size_of(dtype)
    KV_HALF_BYTES: tl.constexpr = KEYS * HEAD_DIM * tlx.size_of(dtype)

    num_tiles = tl.load(num_entries_ptr) * num_kv_heads
    first_tile = tl.program_id(0)
    tile_stride = tl.num_programs(0)
    # Broadcast-Q: this program's own copy of dQ, so the B sequences do not all add into the same
    # q_len rows (dq_partial_stride is 0 otherwise: one shared accumulator).
    dq_ptr = dq_accum_ptr + first_tile.to(tl.int64) * dq_partial_stride
    dq_row0 = first_tile * dq_partial_rows  # the same copy, as a row of the TMA view

    q_tiles = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, NUM_Q_BUFFERS)
    if RESIDENT_Q:  # one dO per key tile, in the K/V ring's slot
        do_tiles = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, NUM_KV_BUFFERS)
    else:
        do_tiles = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, NUM_Q_BUFFERS)
    k_tiles = tlx.local_alloc((KEYS, HEAD_DIM), dtype, NUM_KV_BUFFERS * CONSUMERS)
    v_tiles = tlx.local_alloc((KEYS, HEAD_DIM), dtype, NUM_V_BUFFERS * CONSUMERS)
    if RESIDENT_Q:  # consumer c's P and dS stages are buffers 2c and 2c+1 (each consumer reads only its own)
        stages_and_dq = tlx.storage_alias_spec(storage=tlx.storage_kind.smem)
        ds_stages = tlx.local_alloc((BLOCK_M, KEYS), dtype, 2 * CONSUMERS, reuse=stages_and_dq)
        p_stages = ds_stages
    elif DQ_SPLIT:  # dS and P (queries x keys): DQ_SPLIT_DS_STAGES dS stages and one P stage per consumer
        ds_stages = tlx.local_alloc((BLOCK_M, KEYS), dtype, DQ_SPLIT_DS_STAGES * CONSUMERS)
        p_stages = tlx.local_alloc((BLOCK_M, KEYS), dtype, CONSUMERS)
    else:  # dS^T (keys x queries); p_stages never read
        ds_stages = tlx.local_alloc((KEYS, BLOCK_M), dtype, CONSUMERS)
        p_stages = ds_stages
    if RESIDENT_Q:  # the program's dQ at its end, one [BLOCK_M, D/2] fp32 half at a time, in c's P and dS stages
        FLUSH_STRIDE: tl.constexpr = 2 * KEYS * tlx.size_of(dtype) // (HEAD_DIM // CONSUMERS * 4)  # stages per P+dS
        tl.static_assert(FLUSH_STRIDE * (HEAD_DIM // CONSUMERS * 4) == 2 * KEYS * tlx.size_of(dtype))
        dq_stages = tlx.local_alloc((BLOCK_M, HEAD_DIM // CONSUMERS), tl.float32, FLUSH_STRIDE * CONSUMERS,
                                    reuse=stages_and_dq)
    elif DQ_SPLIT:  # a half of dQ's columns per consumer
        dq_stages = tlx.local_alloc((BLOCK_M, HEAD_DIM // CONSUMERS), tl.float32, CONSUMERS)
    elif DQ_MODE == DQ_TMA_REDUCE and DQ_HANDOFF_BUFFERS > 0:  # consumer 0's stage, then the handoff ring
        dq_stages = tlx.local_alloc((BLOCK_M, HEAD_DIM), tl.float32, 1 + DQ_HANDOFF_BUFFERS)
    elif DQ_MODE == DQ_TMA_REDUCE:
        dq_stages = tlx.local_alloc((BLOCK_M, HEAD_DIM), tl.float32, CONSUMERS)
    else:  # never read: only the TMA reduce-add stages dQ
        dq_stages = ds_stages
    q_fulls = tlx.alloc_barriers(num_barriers=NUM_Q_BUFFERS, arrive_count=1)
    q_empties = tlx.alloc_barriers(num_barriers=NUM_Q_BUFFERS, arrive_count=CONSUMERS)
    kv_fulls = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS, arrive_count=1)
    kv_empties = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS, arrive_count=CONSUMERS)
    if EARLY_V_RELEASE:  # V's slot is freed after the tile's last dP, K's at the tile's end
        v_empties = tlx.alloc_barriers(num_barriers=NUM_V_BUFFERS, arrive_count=CONSUMERS)
    else:  # one barrier frees both
        v_empties = kv_empties
    if DQ_MODE == DQ_TMA_REDUCE and DQ_HANDOFF_BUFFERS > 0:
        # The handoff moves dQ with plain shared stores and loads, so every thread arrives (warp
        # barriers): racecheck orders a thread's accesses by its own arrive, not through the
        # warpgroup `bar.sync` before one elected thread's (scripts/racecheck_ws_probe.py).
        handoff_fulls = tlx.alloc_warp_barrier(DQ_HANDOFF_BUFFERS, num_warps=WARPGROUP_WARPS)
        handoff_empties = tlx.alloc_warp_barrier(DQ_HANDOFF_BUFFERS, num_warps=WARPGROUP_WARPS)
    else:  # never waited on
        handoff_fulls = q_fulls
        handoff_empties = q_empties

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads only
            kv_loads = 0
            q_loads = 0
            for tile in range(first_tile, num_tiles, tile_stride):
                (kv_head, seq, q_start, q_len, out_row0, kv_start, kv_len, col0, first_row,
                 num_q_blocks) = _kv_tile_geometry(
                     tile, tile_entries_ptr, q_offsets_ptr, kv_offsets_ptr, num_kv_heads,
                     kv_blocks_per_seq, broadcast_q_len, window, BLOCK_M, BLOCK_N, CAUSAL,
                     HAS_WINDOW, BROADCAST_Q)
                if num_q_blocks > 0:
                    kv_slot, kv_phase = ring_slot(kv_loads, NUM_KV_BUFFERS)
                    if RESIDENT_Q:  # the program's one query block, once
                        if kv_loads == 0:
                            tlx.barrier_expect_bytes(q_fulls[0], Q_BYTES)
                            tlx.async_descriptor_load(desc_q, q_tiles[0], [q_start + first_row, kv_head * HEAD_DIM],
                                                      q_fulls[0])
                    if EARLY_V_RELEASE:
                        # Separate rings: whichever slot frees first is filled first (V's after the
                        # tile's last dP when the rings are as deep, K's a tile ahead when K's is deeper).
                        # RESIDENT_Q's dO rides in the K/V slot, on its full barrier.
                        v_slot, v_phase = ring_slot(kv_loads, NUM_V_BUFFERS)
                        TILE_BYTES: tl.constexpr = 2 * CONSUMERS * KV_HALF_BYTES + (Q_BYTES if RESIDENT_Q else 0)
                        if NUM_KV_BUFFERS > NUM_V_BUFFERS:
                            _load_kv_halves_into(desc_k, k_tiles, kv_slot, kv_empties[kv_slot], kv_phase,
                                                 kv_fulls, kv_slot, TILE_BYTES, kv_start + col0, kv_head, KEYS,
                                                 HEAD_DIM, CONSUMERS)
                            _load_kv_halves_into(desc_v, v_tiles, v_slot, v_empties[v_slot], v_phase,
                                                 kv_fulls, kv_slot, 0, kv_start + col0, kv_head, KEYS, HEAD_DIM,
                                                 CONSUMERS)
                        else:
                            _load_kv_halves_into(desc_v, v_tiles, v_slot, v_empties[v_slot], v_phase,
                                                 kv_fulls, kv_slot, TILE_BYTES, kv_start + col0, kv_head, KEYS,
                                                 HEAD_DIM, CONSUMERS)
                            _load_kv_halves_into(desc_k, k_tiles, kv_slot, kv_empties[kv_slot], kv_phase,
                                                 kv_fulls, kv_slot, 0, kv_start + col0, kv_head, KEYS, HEAD_DIM,
                                                 CONSUMERS)
                        if RESIDENT_Q:
                            tlx.async_descriptor_load(desc_do, do_tiles[kv_slot],
                                                      [out_row0 + first_row, kv_head * HEAD_DIM], kv_fulls[kv_slot])
                    else:
                        tlx.barrier_wait(kv_empties[kv_slot], kv_phase ^ 1)
                        tlx.barrier_expect_bytes(kv_fulls[kv_slot], 2 * CONSUMERS * KV_HALF_BYTES)
                        for c in tl.static_range(CONSUMERS):
                            kv_coord = [kv_start + col0 + c * KEYS, kv_head * HEAD_DIM]
                            tlx.async_descriptor_load(desc_k, k_tiles[kv_slot * CONSUMERS + c],
                                                      kv_coord, kv_fulls[kv_slot])
                            tlx.async_descriptor_load(desc_v, v_tiles[kv_slot * CONSUMERS + c],
                                                      kv_coord, kv_fulls[kv_slot])
                    kv_loads += 1
                    if not RESIDENT_Q:
                        for g in range(gqa_group):
                            head, selected, head_blocks = _query_blocks_of(
                                seq, kv_head, g, gqa_group, col0, num_q_blocks, q_blocks_ptr, q_block_counts_ptr,
                                num_kv_heads, sel_kv_blocks, BLOCK_M, BLOCK_N, SEL_WIDTH, BLOCK_SPARSE)
                            for block in range(head_blocks):
                                row = _query_block_row(block, first_row, selected, BLOCK_M, BLOCK_N,
                                                       BLOCK_SPARSE)
                                slot, phase = ring_slot(q_loads, NUM_Q_BUFFERS)
                                tlx.barrier_wait(q_empties[slot], phase ^ 1)
                                tlx.barrier_expect_bytes(q_fulls[slot], 2 * Q_BYTES)
                                tlx.async_descriptor_load(desc_q, q_tiles[slot],
                                                          [q_start + row, head * HEAD_DIM],
                                                          q_fulls[slot])
                                tlx.async_descriptor_load(desc_do, do_tiles[slot],
                                                          [out_row0 + row, head * HEAD_DIM],
                                                          q_fulls[slot])
                                q_loads += 1

        with tlx.async_task(num_warps=WARPGROUP_WARPS, registers=CONSUMER_REGISTERS,
                            replicate=CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            kv_loads = 0
            q_loads = 0
            HALF_D: tl.constexpr = HEAD_DIM // CONSUMERS
            dq_lo = tl.zeros([BLOCK_M, HALF_D], tl.float32)  # RESIDENT_Q: the program's dQ, both halves of D
            dq_hi = tl.zeros([BLOCK_M, HALF_D], tl.float32)
            for tile in range(first_tile, num_tiles, tile_stride):
                (kv_head, seq, q_start, q_len, out_row0, kv_start, kv_len, col0, first_row,
                 num_q_blocks) = _kv_tile_geometry(
                     tile, tile_entries_ptr, q_offsets_ptr, kv_offsets_ptr, num_kv_heads,
                     kv_blocks_per_seq, broadcast_q_len, window, BLOCK_M, BLOCK_N, CAUSAL,
                     HAS_WINDOW, BROADCAST_Q)
                kv_cols = col0 + cid * KEYS + tl.arange(0, KEYS)
                kv_ok = kv_cols < kv_len
                if num_q_blocks > 0:
                    kv_slot, kv_phase = ring_slot(kv_loads, NUM_KV_BUFFERS)
                    v_slot, _ = ring_slot(kv_loads, NUM_V_BUFFERS)
                    if RESIDENT_Q:  # one query head per key head; the rows' LSE and Delta load under the waits
                        lse_log2, delta = lse_delta_rows(lse_ptr, delta_ptr, kv_head, out_row0, first_row, q_len,
                                                         stride_lse_head, stride_delta_head, BLOCK_M)
                        tlx.barrier_wait(q_fulls[0], 0)
                    tlx.barrier_wait(kv_fulls[kv_slot], kv_phase)
                    if RESIDENT_Q:  # the step stores dK and dV
                        # Buffers the loop would index by constants go through `per_step`, like the K/V slot:
                        # their wgmma descriptors, hoisted out of the tile loop, spilled (20-31 reloads per tile).
                        same = per_step(tl.to_tensor(0))
                        slot = per_step(kv_slot)
                        dq_lo, dq_hi = _consumer_resident_q_step(
                            q_tiles[same], do_tiles[slot], k_tiles[slot * CONSUMERS + cid],
                            v_tiles[slot * CONSUMERS + cid], p_stages[same + 2 * cid], ds_stages[same + 2 * cid + 1],
                            dq_lo, dq_hi, lse_log2, delta, q_len, kv_len, kv_cols, window, qk_scale_log2, sm_scale,
                            v_empties[kv_slot], dk_ptr, dv_ptr, kv_start, kv_head, stride_dkv_row, HEAD_DIM, BLOCK_M,
                            CAUSAL, HAS_WINDOW)
                    else:
                        dk = tl.zeros([KEYS, HEAD_DIM], tl.float32)
                        dv = tl.zeros([KEYS, HEAD_DIM], tl.float32)
                        for g in range(gqa_group):
                            head, selected, head_blocks = _query_blocks_of(
                                seq, kv_head, g, gqa_group, col0, num_q_blocks, q_blocks_ptr, q_block_counts_ptr,
                                num_kv_heads, sel_kv_blocks, BLOCK_M, BLOCK_N, SEL_WIDTH, BLOCK_SPARSE)
                            # Masked blocks, the mask-free bulk, masked blocks (MASK_FREE_BULK; else all masked).
                            BULK: tl.constexpr = MASK_FREE_BULK and not BLOCK_SPARSE
                            bulk_lo, bulk_hi = head_blocks, head_blocks
                            if BULK:
                                bulk_lo, bulk_hi = _full_block_range(
                                    col0 + cid * KEYS, col0 + cid * KEYS + KEYS - 1, first_row, head_blocks,
                                    q_len, kv_len, window, BLOCK_M, CAUSAL, HAS_WINDOW)
                            lse_log2 = tl.zeros([BLOCK_M], tl.float32)  # the first block's, with DQ_SPLIT
                            delta = tl.zeros([BLOCK_M], tl.float32)
                            if DQ_SPLIT and head_blocks > 0:
                                lse_log2, delta = lse_delta_rows(
                                    lse_ptr, delta_ptr, head, out_row0,
                                    _query_block_row(0, first_row, selected, BLOCK_M, BLOCK_N, BLOCK_SPARSE), q_len,
                                    stride_lse_head, stride_delta_head, BLOCK_M)
                            for segment in tl.static_range(3 if BULK else 1):
                                lo, hi = loop_segment(segment, 0, bulk_lo, bulk_hi, head_blocks)
                                for block in range(lo, hi):
                                    dk, dv, q_loads, lse_log2, delta = _consumer_q_block(
                                        block, q_loads, q_tiles, do_tiles, q_fulls, q_empties, k_tiles, v_tiles,
                                        kv_slot, v_slot, v_empties[v_slot], g == gqa_group - 1, ds_stages, p_stages,
                                        dq_stages, handoff_fulls, handoff_empties, desc_dq, dq_row0, dk, dv, lse_ptr,
                                        delta_ptr, dq_ptr, head, q_start, q_len, out_row0, kv_len, kv_cols, first_row,
                                        selected, head_blocks, lse_log2, delta, window, stride_lse_head,
                                        stride_delta_head, stride_dq_row, qk_scale_log2, sm_scale, HEAD_DIM, BLOCK_M,
                                        BLOCK_N, NUM_Q_BUFFERS, CAUSAL, HAS_WINDOW, DQ_MODE, DQ_HANDOFF_BUFFERS,
                                        DQ_SPLIT, cid, BLOCK_SPARSE, segment != 1, EARLY_V_RELEASE)
                    # Freed here, after the tile's last step. Freed in DQ_SPLIT's last step at its dQ wait (K's
                    # last read), the next tile's K/V landed sooner and the backward ran slower: PMA q=256 0.97x,
                    # dense 0.98x, GEM 0.93-1.01x (results/ab-bwd-kv-free-at-dq-*), as EARLY_V_RELEASE did on
                    # self-attention.
                    tlx.barrier_arrive(kv_empties[kv_slot], 1)
                    kv_loads += 1
                    if not RESIDENT_Q:
                        # Store inside the branch: joining the wgmma accumulators with a zero tile
                        # would route them through shared memory for a layout change.
                        _store_kv_grads(dk_ptr, dv_ptr, (dk * sm_scale).to(dtype), dv.to(dtype),
                                        kv_start + kv_cols, kv_ok, kv_head, stride_dkv_row, HEAD_DIM)
                else:  # no query sees these keys: their gradients are 0
                    zeros = tl.zeros([KEYS, HEAD_DIM], dtype)
                    _store_kv_grads(dk_ptr, dv_ptr, zeros, zeros, kv_start + kv_cols, kv_ok,
                                    kv_head, stride_dkv_row, HEAD_DIM)
            if RESIDENT_Q:  # plain stores: this program's partial is its own (every row, so none is zeroed)
                dq_row = dq_row0 + cid * BLOCK_M
                flush_stage = dq_stages[cid * FLUSH_STRIDE]
                tlx.local_store(flush_stage, dq_lo * sm_scale)
                tlx.fence_async_shared()
                tlx.async_descriptor_store(desc_dq, flush_stage, [dq_row, 0])
                tlx.async_descriptor_store_wait(0)
                tlx.local_store(flush_stage, dq_hi * sm_scale)
                tlx.fence_async_shared()
                tlx.async_descriptor_store(desc_dq, flush_stage, [dq_row, HALF_D])
            if DQ_MODE == DQ_TMA_REDUCE:
                tlx.async_descriptor_store_wait(0)  # shared memory must outlive the last reduce


@triton.jit
def _dq_step(acc, q, do, lse_log2, delta, k_ptr, v_ptr, kv_start, kv_head, col0, rows, row_ok, q_len, kv_len,
             window, stride_kv_row, qk_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASKED: tl.constexpr):
    """acc += dS K over the keys col0 .. col0+BLOCK_N-1 (scaled later); MASKED=False for bulk tiles.

    A bulk tile lies inside the sequence and is visible to every row of the block, so it loads and
    computes without masks. Rows past the sequence end need none either: their Q, dO, LSE and Delta
    were loaded as zeros, which makes P = 1 and dP = Delta = 0, hence dS = 0.
    """
    cols = col0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_offs = (kv_start + cols).to(tl.int64)[:, None] * stride_kv_row + kv_head * HEAD_DIM + dims[None, :]
    if MASKED:
        col_ok = cols < kv_len
        k = tl.load(k_ptr + kv_offs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kv_offs)
        v = tl.load(v_ptr + kv_offs)
    p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale_log2 - lse_log2[:, None])
    if MASKED:
        # tl.where, not a multiply: a row whose LSE is -inf has exp2(+inf) here
        visible = visible_mask(rows, cols, q_len, kv_len, window, CAUSAL, HAS_WINDOW)
        p = tl.where(visible & row_ok[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, acc)


@triton.jit(do_not_specialize=["stride_lse_head", "stride_delta_head", "dq_partial_stride",
                               "broadcast_q_len", "window", "gqa_group", "sel_q_blocks"])
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_offsets_ptr,
               kv_offsets_ptr, kv_blocks_ptr, kv_block_counts_ptr, sel_q_blocks, stride_q_row,
               stride_kv_row, stride_lse_head, stride_delta_head,
               dq_partial_stride, broadcast_q_len, window, gqa_group, qk_scale_log2, sm_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr,
               BLOCK_SPARSE: tl.constexpr, SEL_WIDTH: tl.constexpr, SEL_BLOCK: tl.constexpr):
    """Deterministic dQ: one program owns (query block, sequence, head) and walks its keys in order.

    Plain Triton, query-stationary: it recomputes S and dP (the KV-stationary kernel has them, but
    adding its pieces needs atomics, whose order is not reproducible). With broadcast-Q each
    sequence writes its own fp32 partial `dq_ptr[seq]`, summed in a fixed order afterwards.
    The key range is walked as masked head tiles, mask-free bulk tiles and masked tail tiles, like
    the forward's KV loop (`common.visible_key_range`). Block-sparse: the keys are the selected blocks
    of SEL_BLOCK keys of the block's row of the (forward's) selection, ascending, so those every row
    sees whole come first and run mask-free (`jagged_fwd._tile_geometry` says why).
    """
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // gqa_group
    q_start, q_len, out_row0, kv_start, kv_len = sequence_rows(
        seq, q_offsets_ptr, kv_offsets_ptr, broadcast_q_len, BROADCAST_Q)
    row_lo = q_block * BLOCK_M
    if row_lo < q_len:
        rows = row_lo + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        dims = tl.arange(0, HEAD_DIM)
        q_offs = (q_start + rows).to(tl.int64)[:, None] * stride_q_row + head * HEAD_DIM + dims[None, :]
        o_offs = (out_row0 + rows).to(tl.int64)[:, None] * stride_q_row + head * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptr + o_offs, mask=row_ok[:, None], other=0.0)
        lse_log2, delta = lse_delta_rows(lse_ptr, delta_ptr, head, out_row0, row_lo, q_len, stride_lse_head,
                                         stride_delta_head, BLOCK_M)
        row_hi = tl.minimum(row_lo + BLOCK_M, q_len) - 1
        kv_lo, kv_hi, full_lo, full_hi = visible_key_range(row_lo, row_hi, q_len, kv_len, window, CAUSAL,
                                                           HAS_WINDOW)
        # Tile boundaries: head tiles [first_col, bulk_lo), bulk [bulk_lo, bulk_hi), tail [bulk_hi, kv_hi).
        first_col = (kv_lo // BLOCK_N) * BLOCK_N
        end_col = tl.maximum(first_col + tl.cdiv(kv_hi - first_col, BLOCK_N) * BLOCK_N, first_col)
        bulk_lo = tl.minimum(first_col + tl.cdiv(tl.maximum(full_lo - first_col, 0), BLOCK_N) * BLOCK_N, end_col)
        bulk_hi = tl.minimum(tl.maximum(first_col + tl.maximum(full_hi - first_col, 0) // BLOCK_N * BLOCK_N,
                                        bulk_lo), end_col)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if BLOCK_SPARSE:
            SUB: tl.constexpr = SEL_BLOCK // BLOCK_N  # key steps per selected block
            entry = (seq * tl.num_programs(2) + head) * sel_q_blocks + row_lo // SEL_BLOCK
            selected = kv_blocks_ptr + entry.to(tl.int64) * SEL_WIDTH
            count = tl.where(kv_hi > kv_lo, tl.load(kv_block_counts_ptr + entry), 0)
            picks = tl.arange(0, SEL_WIDTH)
            blocks = tl.load(selected + picks, mask=picks < count, other=0)
            whole = tl.sum(((picks < count) & ((blocks + 1) * SEL_BLOCK <= full_hi)).to(tl.int32), 0)
            for step in range(0, whole * SUB):
                col0 = tl.load(selected + step // SUB) * SEL_BLOCK + (step % SUB) * BLOCK_N
                acc = _dq_step(acc, q, do, lse_log2, delta, k_ptr, v_ptr, kv_start, kv_head, col0, rows, row_ok,
                               q_len, kv_len, window, stride_kv_row, qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL,
                               HAS_WINDOW, False)
            for step in range(whole * SUB, count * SUB):
                col0 = tl.load(selected + step // SUB) * SEL_BLOCK + (step % SUB) * BLOCK_N
                acc = _dq_step(acc, q, do, lse_log2, delta, k_ptr, v_ptr, kv_start, kv_head, col0, rows, row_ok,
                               q_len, kv_len, window, stride_kv_row, qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL,
                               HAS_WINDOW, True)
        else:
            for col0 in range(first_col, bulk_lo, BLOCK_N):
                acc = _dq_step(acc, q, do, lse_log2, delta, k_ptr, v_ptr, kv_start, kv_head, col0, rows, row_ok,
                               q_len, kv_len, window, stride_kv_row, qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL,
                               HAS_WINDOW, True)
            for col0 in range(bulk_lo, bulk_hi, BLOCK_N):
                acc = _dq_step(acc, q, do, lse_log2, delta, k_ptr, v_ptr, kv_start, kv_head, col0, rows, row_ok,
                               q_len, kv_len, window, stride_kv_row, qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL,
                               HAS_WINDOW, False)
            for col0 in range(bulk_hi, kv_hi, BLOCK_N):
                acc = _dq_step(acc, q, do, lse_log2, delta, k_ptr, v_ptr, kv_start, kv_head, col0, rows, row_ok,
                               q_len, kv_len, window, stride_kv_row, qk_scale_log2, HEAD_DIM, BLOCK_N, CAUSAL,
                               HAS_WINDOW, True)
        out_ptrs = dq_ptr + seq.to(tl.int64) * dq_partial_stride + q_offs
        tl.store(out_ptrs, (acc * sm_scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


# ---- host side: configuration, inspection, launch ----------------------------------------------

# The hot path binds each kernel's arguments once per specialization (`jfa.kernels.launch`).
_jagged_bwd_launch = CachedLaunch(_jagged_bwd_kernel)
_delta_launch = CachedLaunch(_delta_kernel)
_dq_launch = CachedLaunch(_dq_kernel)
_TRITON_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_SIGNATURE_SCALARS = dict(
    lse_ptr="*fp32", delta_ptr="*fp32", dq_accum_ptr="*fp32", dk_ptr=None, dv_ptr=None,
    q_offsets_ptr="*i32", kv_offsets_ptr="*i32", tile_entries_ptr="*i32", num_entries_ptr="*i32",
    sel_kv_blocks="i32", stride_lse_head="i32", stride_delta_head="i32", stride_dq_row="i32", dq_partial_stride="i64",
    dq_partial_rows="i32",
    stride_dkv_row="i32", num_kv_heads="i32", kv_blocks_per_seq="i32", broadcast_q_len="i32",
    window="i32", gqa_group="i32", qk_scale_log2="fp32", sm_scale="fp32")


def default_dq_mode(head_dim: int, causal: bool, mean_keys: float, block_sparse: bool,
                    more_dq_copies: bool = False, mean_queries: float | None = None) -> str:
    """The dQ strategy when none is asked for and determinism is not: fused at FUSED_DQ_DEFAULT_HEAD_DIMS
    for dense-selection batches of at most FUSED_DQ_MAX_MEAN_KEYS keys per sequence on average
    (FUSED_DQ_MAX_MEAN_KEYS_CAUSAL when causal) and at least FUSED_DQ_MIN_MEAN_QUERIES query rows per
    sequence (`mean_queries`, default `mean_keys`; inf: no bound), else DEFAULT_DQ_MODE (the block-sparse fork has
    only the separate mode). `more_dq_copies`: with broadcast-Q the fused mode would keep more fp32
    copies of dQ than the separate mode (more programs than sequences), so it is not chosen."""
    mean_queries = mean_keys if mean_queries is None else mean_queries
    max_mean_keys = (FUSED_DQ_MAX_MEAN_KEYS_CAUSAL if causal else FUSED_DQ_MAX_MEAN_KEYS).get(head_dim, math.inf)
    fused = (head_dim in FUSED_DQ_DEFAULT_HEAD_DIMS and not block_sparse and not more_dq_copies
             and mean_keys <= max_mean_keys and mean_queries >= FUSED_DQ_MIN_MEAN_QUERIES.get(head_dim, 0))
    return FUSED_DQ_DEFAULT_MODE if fused else DEFAULT_DQ_MODE


def batch_dq_mode(head_dim: int, q_rows: int, kv_rows: int, num_seqs: int, num_sms: int, causal: bool,
                  broadcast_q: bool, block_sparse: bool) -> str:
    """`default_dq_mode` for a packed batch of `num_seqs` sequences, its means from the packed sizes
    (no GPU->host sync). With broadcast-Q the shared query's rows set no bound (see
    FUSED_DQ_MIN_MEAN_QUERIES); the fused mode's dQ copies (one per program, at most `num_sms`)
    outnumber the separate mode's (one per sequence) when there are fewer sequences than SMs."""
    per_seq = max(num_seqs, 1)
    return default_dq_mode(head_dim, causal, kv_rows / per_seq, block_sparse,
                           more_dq_copies=broadcast_q and num_sms > num_seqs,
                           mean_queries=math.inf if broadcast_q else q_rows / per_seq)


def resolve_dq_mode(dq_mode: str | None, deterministic: bool, default: str = DEFAULT_DQ_MODE,
                    resident_q: bool = False) -> str:
    """The dQ strategy to run: `dq_mode` if given, else `default` (`default_dq_mode`). Deterministic
    needs "separate", or "tma_reduce" where that runs RESIDENT_Q (`resident_q`), which adds nothing:
    each program stores its dQ once and the copies are summed in a fixed order. So where the default
    is that, deterministic=True runs it too, at no cost."""
    in_order = ("separate", "tma_reduce") if resident_q else ("separate",)
    if dq_mode is None:
        mode = default if not deterministic or default in in_order else "separate"
    else:
        mode = dq_mode
    if mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {sorted(DQ_MODES)} (or None for the default), got {dq_mode!r}")
    if deterministic and mode not in in_order:
        raise ValueError(f"dq_mode={mode!r} adds dQ with float atomics, which is not deterministic; "
                         "pass dq_mode='separate' (or None) with deterministic=True")
    return mode


def _dq_in_halves(config: dict) -> bool:
    """Whether the kernel moves dQ in [BLOCK_M, D/2] boxes (its TMA view of the dQ accumulator)."""
    return config["DQ_SPLIT"] or config["RESIDENT_Q"]


def kernel_config(head_dim: int, dtype: torch.dtype, *, causal: bool = False, window: int | None = None,
                  broadcast_q: bool = False, dq_mode: str = DEFAULT_DQ_MODE, selection_width: int = 0,
                  max_queries: int = 0, gqa_group: int = 1) -> dict:
    """The TLX kernel's constexprs for one problem class (tuning from TUNING, flags from the problem).

    `selection_width` > 0 compiles the block-sparse fork (the transposed selection's row width).
    `max_queries` (the longest sequence's queries; 0 when unknown) and `gqa_group` (query heads per key
    head) say how many steps a key tile runs: one picks ONE_STEP_TUNING with broadcast-Q.
    """
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {sorted(DQ_MODES)}, got {dq_mode!r}")
    if head_dim not in TUNING:
        raise ValueError(f"head_dim must be one of {sorted(TUNING)}, got {head_dim}")
    if dtype not in _TRITON_DTYPE_NAMES:
        raise TypeError(f"dtype must be one of {list(_TRITON_DTYPE_NAMES)}, got {dtype}")
    tuning = dict(TUNING[head_dim])
    if dq_mode != "separate":
        tuning.update(FUSED_DQ_TUNING.get(head_dim, {}))
    tuning["DQ_SPLIT"] = tuning["DQ_SPLIT"] and dq_mode == "tma_reduce"  # the split dQ is reduce-added by TMA
    tuning["EARLY_V_RELEASE"] = tuning["DQ_SPLIT"] and bool(broadcast_q)
    tuning["NUM_V_BUFFERS"] = tuning["NUM_KV_BUFFERS"]
    tuning["RESIDENT_Q"] = False
    if broadcast_q and dq_mode == "tma_reduce" and gqa_group * triton.cdiv(max_queries, tuning["BLOCK_M"]) == 1:
        tuning.update(ONE_STEP_TUNING.get(head_dim, {}))
    if selection_width and (window is not None or broadcast_q or dq_mode != "separate"
                            or tuning["BLOCK_N"] != specs.BLOCK_SPARSE_BLOCK):
        raise ValueError("the block-sparse backward takes no window or broadcast-Q, the separate dQ kernel, "
                         f"and {specs.BLOCK_SPARSE_BLOCK}-key tiles")
    return dict(HEAD_DIM=head_dim, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                BROADCAST_Q=bool(broadcast_q), DQ_MODE=DQ_MODES[dq_mode], BLOCK_SPARSE=selection_width > 0,
                SEL_WIDTH=max(selection_width, 1), **tuning)


def inspect_spec(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                 window: int | None = None, broadcast_q: bool = False, dq_mode: str = DEFAULT_DQ_MODE,
                 selection_width: int = 0, max_queries: int = 0, gqa_group: int = 1):
    """Compile-only description of one TLX configuration, for `jfa.inspect.inspect` (no GPU needed)."""
    from jfa.kernels.spec import KernelSpec

    constexprs = kernel_config(head_dim, dtype, causal=causal, window=window, broadcast_q=broadcast_q,
                               dq_mode=dq_mode, selection_width=selection_width, max_queries=max_queries,
                               gqa_group=gqa_group)
    name = _TRITON_DTYPE_NAMES[dtype]
    keys = constexprs["BLOCK_N"] // NUM_CONSUMERS.value
    signature = dict(desc_q=f"tensordesc<{name}[{constexprs['BLOCK_M']}, {head_dim}]>",
                     desc_k=f"tensordesc<{name}[{keys}, {head_dim}]>",
                     desc_v=f"tensordesc<{name}[{keys}, {head_dim}]>",
                     desc_do=f"tensordesc<{name}[{constexprs['BLOCK_M']}, {head_dim}]>",
                     desc_dq=f"tensordesc<fp32[{constexprs['BLOCK_M']}, "
                             f"{head_dim // NUM_CONSUMERS.value if _dq_in_halves(constexprs) else head_dim}]>",
                     **_SIGNATURE_SCALARS)
    signature["dk_ptr"] = signature["dv_ptr"] = f"*{name}"
    constexprs = constexprs | _selection_args(signature, selection_width, ("q_blocks_ptr", "q_block_counts_ptr"))
    signature.update({k: "constexpr" for k in constexprs})
    return KernelSpec(fn=_jagged_bwd_kernel, signature=signature, constexprs=constexprs,
                      num_warps=PRODUCER_WARPS, num_stages=launch_num_stages(head_dim, dq_mode), name="jagged_bwd",
                      aligned=("stride_dq_row", "stride_dkv_row"),
                      role_names=("producer", "consumer0", "consumer1"), target="sm_90")


def dq_config(q_rows: int, kv_rows: int, num_seqs: int, broadcast_q: bool, head_dim: int = 128) -> str:
    """The dQ kernel shape (a DQ_CONFIGS key) from the head dim and the mean query rows and keys per
    sequence.

    Computed from the tensors' sizes on the host: no device sync on the hot path.
    """
    seqs = max(num_seqs, 1)
    mean_rows = q_rows if broadcast_q else q_rows / seqs
    if head_dim == 64:
        return "long-d64" if mean_rows >= DQ_LONG_MIN_MEAN_ROWS else "short"
    long = mean_rows >= DQ_LONG_MIN_MEAN_ROWS and kv_rows / seqs >= DQ_LONG_MIN_MEAN_KEYS
    return "long" if long else "short"


def _selection_args(signature: dict, selection_width: int, names: tuple[str, str]) -> dict:
    """Give a spec's selection pointers their types: int32 pointers for the block-sparse fork, else
    compile-time None (what dense launches pass); returns the constexprs to add."""
    if selection_width:
        signature.update({name: "*i32" for name in names})
        return {}
    return {name: None for name in names}


def dq_inspect_spec(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                    window: int | None = None, broadcast_q: bool = False, config: str = "long",
                    selection_width: int = 0):
    """Compile-only description of the deterministic dQ kernel (fp32 partials with broadcast-Q)."""
    from jfa.kernels.spec import KernelSpec

    if config not in DQ_CONFIGS:
        raise ValueError(f"config must be one of {sorted(DQ_CONFIGS)}, got {config!r}")
    name = _TRITON_DTYPE_NAMES[dtype]
    shape = DQ_CONFIGS[config]
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=shape["BLOCK_M"], BLOCK_N=shape["BLOCK_N"], CAUSAL=bool(causal),
                      HAS_WINDOW=window is not None, BROADCAST_Q=bool(broadcast_q),
                      BLOCK_SPARSE=selection_width > 0, SEL_WIDTH=max(selection_width, 1),
                      SEL_BLOCK=specs.BLOCK_SPARSE_BLOCK)
    signature = dict(q_ptr=f"*{name}", k_ptr=f"*{name}", v_ptr=f"*{name}", do_ptr=f"*{name}",
                     lse_ptr="*fp32", delta_ptr="*fp32", dq_ptr="*fp32" if broadcast_q else f"*{name}",
                     q_offsets_ptr="*i32", kv_offsets_ptr="*i32", sel_q_blocks="i32", stride_q_row="i32",
                     stride_kv_row="i32", stride_lse_head="i32", stride_delta_head="i32",
                     dq_partial_stride="i64", broadcast_q_len="i32", window="i32", gqa_group="i32",
                     qk_scale_log2="fp32", sm_scale="fp32")
    constexprs = constexprs | _selection_args(signature, selection_width, ("kv_blocks_ptr", "kv_block_counts_ptr"))
    signature.update({k: "constexpr" for k in constexprs})
    return KernelSpec(fn=_dq_kernel, signature=signature, constexprs=constexprs, num_warps=shape["num_warps"],
                      num_stages=shape["num_stages"], name=f"jagged_bwd_dq_{config}", target="sm_90",
                      aligned=("stride_q_row", "stride_kv_row"))


def launch_dq(q, k, v, dout, lse, delta, dq_target, q_offsets, kv_offsets, max_seq_len_q, sm_scale, causal,
              window, broadcast_q, config: str, selection=None) -> None:
    """Run the deterministic dQ kernel in shape `config` into `dq_target`.

    `dq_target` is dq itself (q's dtype), or with broadcast-Q the fp32 per-sequence partials
    `[num_seqs, q_len, Hq, D]`. `selection` (the forward's `jfa.sparse.BlockSelection`) runs the
    block-sparse fork. Also what the CPU interpreter test launches.
    """
    shape = DQ_CONFIGS[config]
    num_seqs = kv_offsets.numel() - 1
    q_rows, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    row_width = q_heads * head_dim
    q_blocks = triton.cdiv(q_rows if broadcast_q else max_seq_len_q, shape["BLOCK_M"])
    _dq_launch[(max(1, q_blocks), num_seqs, q_heads)](
        q, k, v, dout, lse, delta, dq_target, q_offsets, kv_offsets,
        None if selection is None else selection.blocks, None if selection is None else selection.counts,
        0 if selection is None else selection.row_blocks, row_width, kv_heads * head_dim,
        lse.stride(0), delta.stride(0), q_rows * row_width if broadcast_q else 0, q_rows if broadcast_q else 0,
        0 if window is None else window, q_heads // kv_heads, sm_scale * LOG2E.value, sm_scale,
        HEAD_DIM=head_dim, BLOCK_M=shape["BLOCK_M"], BLOCK_N=shape["BLOCK_N"], CAUSAL=bool(causal),
        HAS_WINDOW=window is not None, BROADCAST_Q=bool(broadcast_q),
        BLOCK_SPARSE=selection is not None, SEL_WIDTH=1 if selection is None else selection.width,
        SEL_BLOCK=specs.BLOCK_SPARSE_BLOCK, num_warps=shape["num_warps"], num_stages=shape["num_stages"])


def is_supported(q: torch.Tensor) -> bool:
    """True when this kernel can run q's problem here: a Hopper GPU, a supported dtype and head_dim."""
    return (q.is_cuda and sm_major(q.device) == 9
            and q.dtype in specs.SUPPORTED_DTYPES and q.shape[-1] in specs.SUPPORTED_HEAD_DIMS)


def compute_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """Delta = rowsum(O * dO) in fp32, `[Hq, Tq_out]` like the LSE (one small Triton kernel)."""
    rows, heads, head_dim = out.shape
    delta = torch.empty((heads, rows), dtype=torch.float32, device=out.device)
    if rows:
        grid = (triton.cdiv(rows, DELTA_BLOCK_ROWS), heads)
        _delta_launch[grid](out, dout, delta, rows, heads, heads * head_dim, delta.stride(0),
                            HEAD_DIM=head_dim, BLOCK_ROWS=DELTA_BLOCK_ROWS)
    return delta


def jagged_attention_bwd(dout, q, k, v, out, lse, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                         sm_scale, causal, window, broadcast_q, *, deterministic=False, dq_mode=None,
                         grads=None, selection=None):
    """Run the backward; returns (dq, dk, dv) in the dtypes of q, k, v.

    Inputs are already validated (`jfa.jagged.validate_jagged_attention`), CUDA, contiguous rows;
    `out`/`lse` are the forward's. `grads` may give the (dq, dk, dv) buffers to fill, so tests can
    poison them. `deterministic=True` makes every gradient bitwise reproducible (see the module doc).
    `dq_mode` picks how dQ is formed: "separate" (its own deterministic kernel), "atomic" or
    "tma_reduce" (fused into the KV-stationary kernel, fp32 adds); None takes `default_dq_mode`'s.
    `selection` (the forward's `jfa.sparse.BlockSelection`) runs the block-sparse fork of both
    kernels: the dK/dV kernel streams, per key block, the query blocks that selected it (the
    transposed selection), the dQ kernel walks each query block's selected key blocks.
    """
    num_seqs = kv_offsets.numel() - 1
    q_heads, head_dim = q.shape[1], q.shape[2]
    programs = num_sms(q.device)
    kv_heads = k.shape[1]
    broadcast_q_len = q.shape[0] if broadcast_q else 0
    # RESIDENT_Q needs only the shared query's rows, which broadcast-Q knows without a sync.
    resident_q = broadcast_q and kernel_config(head_dim, q.dtype, broadcast_q=True, dq_mode="tma_reduce",
                                               max_queries=broadcast_q_len, gqa_group=q_heads // kv_heads)["RESIDENT_Q"]
    dq_mode = resolve_dq_mode(dq_mode, deterministic, batch_dq_mode(
        head_dim, q.shape[0], k.shape[0], num_seqs, programs, causal, broadcast_q, selection is not None), resident_q)
    if grads is None:
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    dq, dk, dv = grads
    if q.shape[0] == 0 or k.shape[0] == 0 or num_seqs == 0:  # no scores anywhere, no gradient
        for g in grads:
            g.zero_()
        return dq, dk, dv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    # Computing a missing bound costs a device sync; callers on the hot path pass both.
    if max_seq_len_kv is None:
        max_seq_len_kv = int((kv_offsets[1:] - kv_offsets[:-1]).max())
    if max_seq_len_q is None:
        max_seq_len_q = broadcast_q_len if broadcast_q else int((q_offsets[1:] - q_offsets[:-1]).max())
    q, k, v, dout, out = (t.contiguous() for t in (q, k, v, dout, out))
    delta = compute_delta(out, dout)
    by_key_block = None
    if selection is not None:
        from jfa.sparse import transposed_selection

        by_key_block = transposed_selection(selection, triton.cdiv(max_seq_len_kv, specs.BLOCK_SPARSE_BLOCK))
    config = kernel_config(head_dim, q.dtype, causal=causal, window=window, broadcast_q=broadcast_q,
                           dq_mode=dq_mode, selection_width=0 if by_key_block is None else by_key_block.width,
                           max_queries=max_seq_len_q, gqa_group=q_heads // kv_heads)
    fused_dq = dq_mode != "separate"
    schedule = build_kv_tile_schedule(q_offsets, kv_offsets, max_seq_len_kv=max_seq_len_kv,
                                      broadcast_q_len=broadcast_q_len, block_m=config["BLOCK_M"],
                                      block_n=config["BLOCK_N"], causal=causal, window=window,
                                      max_seq_len_q=max_seq_len_q)
    max_tiles = schedule.max_entries * kv_heads
    resident_q = config["RESIDENT_Q"]
    grid = (resident_q_grid(programs, kv_heads, max_tiles) if resident_q
            else persistent_programs(q.device, max_tiles),)
    row_width = q_heads * head_dim
    # fp32 dQ accumulator: one copy per program with broadcast-Q (summed below), else one shared.
    partials = grid[0] if (broadcast_q and fused_dq) else 1
    # Separate mode never touches the accumulator; a one-box stand-in keeps the signature whole.
    if resident_q:  # each consumer of each program writes its [BLOCK_M, D] dQ once, whole
        dq_accum = torch.empty((grid[0] * NUM_CONSUMERS.value, config["BLOCK_M"], 1, head_dim), dtype=torch.float32,
                               device=q.device)
    elif fused_dq:
        dq_accum = torch.zeros((partials, q.shape[0], q_heads, head_dim), dtype=torch.float32, device=q.device)
    else:
        dq_accum = torch.empty((1, config["BLOCK_M"], 1, head_dim), dtype=torch.float32, device=q.device)
    qk_scale_log2 = sm_scale * LOG2E.value
    _jagged_bwd_launch[grid](
        rows_descriptor(q, config["BLOCK_M"]), rows_descriptor(k, config["BLOCK_N"] // NUM_CONSUMERS.value),
        rows_descriptor(v, config["BLOCK_N"] // NUM_CONSUMERS.value), rows_descriptor(dout, config["BLOCK_M"]),
        rows_descriptor(dq_accum.flatten(0, 1), config["BLOCK_M"],
                         head_dim // NUM_CONSUMERS.value if _dq_in_halves(config) else None),
        lse, delta, dq_accum, dk, dv, q_offsets, kv_offsets, schedule.entries, schedule.num_entries,
        None if by_key_block is None else by_key_block.blocks, None if by_key_block is None else by_key_block.counts,
        0 if by_key_block is None else by_key_block.row_blocks, lse.stride(0), delta.stride(0), row_width,
        q.shape[0] * row_width if partials > 1 else 0,
        NUM_CONSUMERS.value * config["BLOCK_M"] if resident_q else q.shape[0] if partials > 1 else 0,
        kv_heads * head_dim,
        kv_heads, schedule.kv_blocks_per_seq, broadcast_q_len,
        0 if window is None else window, q_heads // kv_heads, qk_scale_log2, sm_scale,
        num_warps=PRODUCER_WARPS, num_stages=launch_num_stages(head_dim, dq_mode), **config)
    if resident_q:
        per_head = dq_accum.view(grid[0] // kv_heads, kv_heads, NUM_CONSUMERS.value, config["BLOCK_M"], head_dim)
        dq.copy_(per_head[:, :, :, :q.shape[0]].sum((0, 2)).transpose(0, 1))
        return dq, dk, dv
    if fused_dq:
        dq.copy_(dq_accum.sum(0) if partials > 1 else dq_accum[0])
        return dq, dk, dv
    # Separate (deterministic) dQ: broadcast-Q writes one fp32 partial per sequence, summed in a fixed order.
    dq_target = (torch.empty((num_seqs, q.shape[0], q_heads, head_dim), dtype=torch.float32, device=q.device)
                 if broadcast_q else dq)
    if selection is None:
        jagged_fwd.jagged_attention_dq(dout, q, k, v, lse, delta, dq_target.flatten(0, 1) if broadcast_q else dq,
                                       q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal, window,
                                       broadcast_q)
    else:
        launch_dq(q, k, v, dout, lse, delta, dq_target, q_offsets, kv_offsets, max_seq_len_q, sm_scale, causal,
                  window, broadcast_q, dq_config(q.shape[0], k.shape[0], num_seqs, broadcast_q, head_dim), selection)
    if broadcast_q:
        dq.copy_(dq_target.sum(0))
    return dq, dk, dv
