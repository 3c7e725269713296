"""The backward's dK/dV kernel for Hopper (sm_90): key-stationary, warp-specialized.

The math is `jfa.reference.jagged_attention_bwd_ref`'s: P = exp2(S * scale - LSE), dV = P^T dO,
dS = P * (dP - Delta) with dP = dO V^T, dK = sm_scale * dS^T Q, dQ = sm_scale * dS K.

A tile is (sequence, key block of BLOCK_N keys, key head). The producer loads the tile's K and V
once, one [BLOCK_N/2, D] half per consumer, and streams every query block that sees those keys (of
every query head of the GQA group) through the Q/dO ring. Each of the two consumers owns half the
keys and accumulates their dK and dV in registers, so dK and dV are written once per tile, in the
input dtype, without atomics (the GQA group sum is a register sum).

dQ sums over every key tile of a sequence. Four ways to form it (`DQ`):

- DQ_NONE: this kernel computes dK and dV only, and `bwd_dq` computes dQ: deterministic. The step
  computes S^T = K Q^T (keys x queries), so P^T and dS^T feed the dV and dK wgmmas straight from
  registers;
- DQ_SPLIT: fused, in FlashAttention-3's orientation: S = Q K^T (queries x keys), P and dS staged in
  shared memory for dV and dK, and dQ split by head dimension: consumer c forms dQ[:, c-th half of
  D] over all BLOCK_N keys from both consumers' dS (they meet at a named barrier once per query
  block) and adds it by one TMA reduce-add into an fp32 accumulator;
- DQ_RESIDENT (broadcast-Q with one query block per key head): each program keeps its one query
  block loaded and sums its dQ in registers over all its key tiles, storing it once into its own
  partial: no adds at all, so it is deterministic too;
- DQ_HANDOFF (D=64): fused in the S^T orientation: each consumer stages dS^T and forms its [64, D]
  dQ piece by one more wgmma; consumer 1 hands its piece to consumer 0 through a small ring of fp32
  stages, and consumer 0 reduce-adds the sum, half the global adds.

With broadcast-Q the fused modes give every program its own fp32 copy of the shared query's dQ (the
B sequences would all add into the same q_len rows), summed afterwards.

K goes in unscaled and the scale folds into the exp2 argument: a bf16 K scaled in advance overflows
exp2 at large activations and gives NaN gradients.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels.epilogue import reduce_add_rows, store_key_rows
from jfa.kernels.hooks import DEFAULT_FORK, backward_probabilities, block_visible, score_gradient
from jfa.kernels.launch import CachedLaunch
from jfa.kernels.masks import full_query_blocks
from jfa.kernels.pingpong import PINGPONG_BARRIER_FIRST, PINGPONG_THREADS
from jfa.kernels.ring import make_ring, per_step, ring_slot
from jfa.kernels.softmax import LOG2E, lse_delta_rows
from jfa.kernels.spec import TRITON_DTYPE_NAMES, KernelSpec
from jfa.kernels.tiles import Problem, key_tile, loop_segment, sm_major
from jfa.kernels.tma import rows_descriptor

DQ_NONE: tl.constexpr = tl.constexpr(0)  # dQ comes from `bwd_dq`
DQ_SPLIT: tl.constexpr = tl.constexpr(1)  # fused: each consumer reduce-adds half of dQ's columns
DQ_RESIDENT: tl.constexpr = tl.constexpr(2)  # fused: the program's one query block's dQ summed in registers
DQ_HANDOFF: tl.constexpr = tl.constexpr(3)  # fused: consumer 1's dQ piece added into consumer 0's, one reduce-add
HANDOFF_STAGES: tl.constexpr = tl.constexpr(2)  # consumer 1's dQ pieces in flight to consumer 0
CONSUMERS: tl.constexpr = tl.constexpr(2)  # consumer warpgroups, each owning half of a tile's keys
# DQ_SPLIT's consumers meet here once per query block, when both have staged their dS (the dK/dV
# kernel takes no ping-pong turns, so the ping-pong barrier's id serves). dS alternates between two
# stages per consumer, so a consumer rewrites a stage two steps later, past the next meeting, which
# the other reaches only after waiting for the dQ wgmmas that read it.
DS_READY_BARRIER: tl.constexpr = PINGPONG_BARRIER_FIRST
DS_STAGES: tl.constexpr = tl.constexpr(2)
WARPGROUP_WARPS: tl.constexpr = tl.constexpr(specs.WARPGROUP_WARPS)
PRODUCER_WARPS = specs.WARPGROUP_WARPS


class DKDVConfig(NamedTuple):
    """The dK/dV kernel's compile-time configuration (chosen by `jfa.configs`)."""

    HEAD_DIM: int
    BLOCK_M: int  # query rows per streamed block
    BLOCK_N: int  # keys per tile, BLOCK_N / 2 per consumer
    Q_BUFFERS: int  # Q/dO ring depth
    KV_BUFFERS: int  # K ring depth (and V's, but with EARLY_V_RELEASE)
    V_BUFFERS: int
    CONSUMER_REGISTERS: int
    MASK_FREE_BULK: bool  # query blocks that see every key of a consumer run a step without masks
    DQ: int  # DQ_NONE, DQ_SPLIT, DQ_RESIDENT or DQ_HANDOFF
    EARLY_V_RELEASE: bool  # V's slot is freed after the tile's last dP, K's at the tile's end
    CAUSAL: bool
    HAS_WINDOW: bool
    BROADCAST_Q: bool


def num_stages(config: DKDVConfig) -> int:
    """The launch's num_stages: 1 without fused dQ, where Triton's pipeliner waits on every wgmma right
    after issuing it and the two consumers overlap each other's softmax (leaving S^T and dP^T in flight
    together makes ptxas reload spilled values in the loop); 0 for the fused steps, whose own waits
    keep dK running under the dQ store."""
    return 1 if config.DQ == DQ_NONE.value else 0


class HandoffDQ(NamedTuple):
    """DQ_HANDOFF's shared memory: each consumer's dS^T stage, consumer 0's reduce-add stage followed by
    the ring of stages consumer 1 hands its pieces through, that ring's barriers, the accumulator's view."""

    ds_stages: object
    dq_stages: object
    fulls: object
    empties: object
    desc_dq: object
    row0: object  # the program's copy's first row in the accumulator's view


@triton.jit
def _dkdv_step(q_tile, do_tile, k_tile, v_tile, dk, dv, key, q_row0, head, problem, lse_ptr, delta_ptr,
               stride_lse_head, stride_delta_head, qk_scale_log2, handoff, step, sm_scale, cid: tl.constexpr,
               MASKED: tl.constexpr, CFG: tl.constexpr, FORK: tl.constexpr):
    """One query block against this consumer's keys, in the S^T orientation: update dK, dV, and with
    DQ_HANDOFF add the block's dQ piece.

    S^T and dP^T are issued back to back, so the second runs on the tensor cores while the first's
    exp2 is computed. Without fused dQ, causality, window or a fork's mask, a masked step masks only
    query rows, through the LSE: rows past the sequence end load LSE = +inf, so their P and dS are
    exactly 0 and they add nothing (keys past the end get garbage dK/dV rows, never stored, but with
    fused dQ they would reach dQ: then every pair is masked).
    """
    dtype: tl.constexpr = q_tile.dtype
    ROWS_BY_LSE: tl.constexpr = not (CFG.CAUSAL or CFG.HAS_WINDOW or FORK.mask_mod is not None
                                     or CFG.DQ == DQ_HANDOFF)
    s_t = tlx.async_dot(k_tile, tlx.local_trans(q_tile))
    dp_t = tlx.async_dot(v_tile, tlx.local_trans(do_tile))
    q_rows = q_row0 + tl.arange(0, CFG.BLOCK_M)
    row_ok = q_rows < key.q_len
    lse_ptrs = lse_ptr + head.to(tl.int64) * stride_lse_head + key.out_row0 + q_rows
    delta_ptrs = delta_ptr + head.to(tl.int64) * stride_delta_head + key.out_row0 + q_rows
    if MASKED:
        lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf") if ROWS_BY_LSE else 0.0)
        delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    else:
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    s_t = tlx.async_dot_wait(1, s_t)
    q_idx = q_rows[None, :]
    k_idx = key.cols[:, None]
    p_t = backward_probabilities(s_t, (lse * LOG2E)[None, :], q_idx, k_idx, key.seq, head, key.q_len, key.kv_len,
                                 problem.window, problem.params, qk_scale_log2, MASKED and not ROWS_BY_LSE,
                                 CFG.CAUSAL, CFG.HAS_WINDOW, FORK, row_ok[None, :])
    dp_t = tlx.async_dot_wait(0, dp_t)
    ds_t = score_gradient(p_t * (dp_t - delta[None, :]), s_t, q_idx, k_idx, key.seq, head, problem.params,
                          qk_scale_log2, FORK)
    dv = tlx.async_dot(p_t.to(dtype), do_tile, dv)
    ds_t_low = ds_t.to(dtype)
    dk = tlx.async_dot(ds_t_low, q_tile, dk)
    if CFG.DQ == DQ_HANDOFF:
        _hand_off_dq(ds_t_low, k_tile, handoff, step, key, q_row0, head, sm_scale, cid, CFG)
    dv = tlx.async_dot_wait(0, dv)
    dk = tlx.async_dot_wait(0, dk)
    return dk, dv


@triton.jit
def _hand_off_dq(ds_t_low, k_tile, handoff, step, key, q_row0, head, sm_scale, cid: tl.constexpr, CFG: tl.constexpr):
    """DQ_HANDOFF's dQ piece of one query block: dQ = dS K from the staged dS^T (wgmma reads a
    transposed A only from shared memory); consumer 1 hands its piece to consumer 0, which adds it to
    its own and reduce-adds the sum. Both stream the same query blocks in the same order, so their
    `step` counts agree. The handoff moves dQ by plain shared-memory stores and loads, so every
    thread arrives on its warp barriers (racecheck orders a thread's accesses by its own arrive)."""
    ds_stage = handoff.ds_stages[cid]
    tlx.local_store(ds_stage, ds_t_low)
    tlx.fence_async_shared()
    dq = tlx.async_dot(tlx.local_trans(ds_stage), k_tile)
    dq = tlx.async_dot_wait(0, dq)
    slot, phase = ring_slot(step, HANDOFF_STAGES)
    if cid == 0:
        tlx.barrier_wait(handoff.fulls[slot], phase)
        dq += tlx.local_load(handoff.dq_stages[1 + slot])
        tlx.barrier_arrive(handoff.empties[slot], 1)
        # The whole box is added: rows past the sequence end hold exact zeros (their dS is 0), and TMA
        # clips rows past the tensor end.
        reduce_add_rows(handoff.desc_dq, handoff.dq_stages[0], dq, sm_scale, handoff.row0 + key.q_start + q_row0,
                        head, CFG.HEAD_DIM)
    else:
        tlx.barrier_wait(handoff.empties[slot], phase ^ 1)
        tlx.local_store(handoff.dq_stages[1 + slot], dq)
        tlx.barrier_arrive(handoff.fulls[slot], 1)


@triton.jit
def _split_dq_step(q_tile, do_tile, k_buffers, kv_slot, v_tile, p_stage, ds_stages, ds_slot, dq_stage, desc_dq,
                   dq_row0, dk, dv, lse_log2, delta, key, q_row0, next_q_row0, head, problem, lse_ptr, delta_ptr,
                   stride_lse_head, stride_delta_head, qk_scale_log2, sm_scale, v_empty, last_block,
                   cid: tl.constexpr, MASKED: tl.constexpr, CFG: tl.constexpr, FORK: tl.constexpr):
    """One query block of the fused step (DQ_SPLIT): dK, dV, and half of dQ's columns reduce-added.

    S = Q K^T (queries x this consumer's keys) keeps LSE and Delta at 2 values per thread; P and dS go
    to shared memory, and dV += P^T dO, dK += dS^T Q read them transposed. dV is issued as soon as P
    is staged, so it runs while dS is formed; dK goes last, so the dQ store runs while it does.
    `lse_log2`, `delta` of this block were loaded a step ahead; the step loads those of the block at
    `next_q_row0` and returns them (loaded in the step that uses them, their latency held up the
    wgmma issue). With EARLY_V_RELEASE the tile's `last_block` frees V's slot once dP is done.
    The head, the key columns and the K/V slot are re-derived each step (`ring.per_step`): kept
    across the loop, their wgmma descriptors and values were reloaded from local memory every step.
    """
    dtype: tl.constexpr = q_tile.dtype
    k_tile = k_buffers[kv_slot * CONSUMERS + cid]
    KEYS: tl.constexpr = k_tile.shape[0]
    HALF_D: tl.constexpr = CFG.HEAD_DIM // CONSUMERS
    s = tlx.async_dot(q_tile, tlx.local_trans(k_tile))
    dp = tlx.async_dot(do_tile, tlx.local_trans(v_tile))
    head = per_step(head)
    kv_cols = per_step(tl.min(key.cols, 0)) + tl.arange(0, KEYS)
    next_lse_log2, next_delta = lse_delta_rows(lse_ptr, delta_ptr, head, key.out_row0, next_q_row0, key.q_len,
                                               stride_lse_head, stride_delta_head, CFG.BLOCK_M)
    q_rows = q_row0 + tl.arange(0, CFG.BLOCK_M)
    row_ok = q_rows < key.q_len
    s = tlx.async_dot_wait(1, s)
    q_idx = q_rows[:, None]
    k_idx = kv_cols[None, :]
    # Keys past the sequence end must be masked here: their dS feeds dQ of valid rows.
    p = backward_probabilities(s, lse_log2[:, None], q_idx, k_idx, key.seq, head, key.q_len, key.kv_len,
                               problem.window, problem.params, qk_scale_log2, MASKED, CFG.CAUSAL, CFG.HAS_WINDOW, FORK,
                               row_ok[:, None])
    tlx.local_store(p_stage, p.to(dtype))
    tlx.fence_async_shared()
    dv = tlx.async_dot(tlx.local_trans(p_stage), do_tile, dv)
    dp = tlx.async_dot_wait(1, dp)
    if CFG.EARLY_V_RELEASE:
        if last_block:  # the tile's last read of V: the producer may load the next tile's V
            tlx.barrier_arrive(v_empty, 1)
    ds = score_gradient(p * (dp - delta[:, None]), s, q_idx, k_idx, key.seq, head, problem.params, qk_scale_log2,
                        FORK)
    ds_stage = ds_stages[ds_slot * CONSUMERS + cid]
    tlx.local_store(ds_stage, ds.to(dtype))
    tlx.fence_async_shared()
    tlx.named_barrier_wait(DS_READY_BARRIER, PINGPONG_THREADS)
    dq = tlx.async_dot(ds_stages[ds_slot * CONSUMERS],
                       tlx.local_slice(k_buffers[kv_slot * CONSUMERS], [0, cid * HALF_D], [KEYS, HALF_D]))
    dq = tlx.async_dot(ds_stages[ds_slot * CONSUMERS + 1],
                       tlx.local_slice(k_buffers[kv_slot * CONSUMERS + 1], [0, cid * HALF_D], [KEYS, HALF_D]), dq)
    dk = tlx.async_dot(tlx.local_trans(ds_stage), q_tile, dk)
    dq = tlx.async_dot_wait(1, dq)  # every group but dK's
    # The whole box is added: rows past the sequence end hold exact zeros (their dS is 0), and TMA
    # clips rows past the tensor end.
    reduce_add_rows(desc_dq, dq_stage, dq, sm_scale, dq_row0 + key.q_start + q_row0, head, CFG.HEAD_DIM, cid * HALF_D)
    dv = tlx.async_dot_wait(0, dv)
    dk = tlx.async_dot_wait(0, dk)
    return dk, dv, next_lse_log2, next_delta


@triton.jit
def _resident_dq_step(q_tile, do_tile, k_tile, v_tile, p_stage, ds_stage, dq_lo, dq_hi, lse_log2, delta, key, problem,
                      qk_scale_log2, sm_scale, v_empty, dk_ptr, dv_ptr, stride_dkv_row, CFG: tl.constexpr,
                      FORK: tl.constexpr):
    """A key tile's only step with DQ_RESIDENT: the program's one query block against this consumer's keys.

    dQ stays in registers in two [BLOCK_M, D/2] halves, summed over all of the program's tiles, and
    each consumer forms it from its own dS from registers, so the consumers never wait for each
    other. S, dV and dK are `_split_dq_step`'s; dK, dV are fresh each tile, V's slot is freed as soon
    as dP has read it, dV is stored while the dQ wgmmas run and dK is issued after that store, so at
    most two [KEYS, D] fp32 accumulators are live beside dQ.
    """
    dtype: tl.constexpr = q_tile.dtype
    KEYS: tl.constexpr = k_tile.shape[0]
    HALF_D: tl.constexpr = CFG.HEAD_DIM // 2
    s = tlx.async_dot(q_tile, tlx.local_trans(k_tile))
    dp = tlx.async_dot(do_tile, tlx.local_trans(v_tile))
    q_rows = tl.arange(0, CFG.BLOCK_M)
    s = tlx.async_dot_wait(1, s)
    q_idx = q_rows[:, None]
    k_idx = key.cols[None, :]
    p = backward_probabilities(s, lse_log2[:, None], q_idx, k_idx, key.seq, key.kv_head, key.q_len, key.kv_len,
                               problem.window, problem.params, qk_scale_log2, True, CFG.CAUSAL, CFG.HAS_WINDOW, FORK,
                               (q_rows < key.q_len)[:, None])
    tlx.local_store(p_stage, p.to(dtype))
    tlx.fence_async_shared()
    dv = tlx.async_dot(tlx.local_trans(p_stage), do_tile)
    dp = tlx.async_dot_wait(1, dp)
    tlx.barrier_arrive(v_empty, 1)
    ds = score_gradient(p * (dp - delta[:, None]), s, q_idx, k_idx, key.seq, key.kv_head, problem.params,
                        qk_scale_log2, FORK).to(dtype)
    tlx.local_store(ds_stage, ds)
    tlx.fence_async_shared()
    dq_lo = tlx.async_dot(ds, tlx.local_slice(k_tile, [0, 0], [KEYS, HALF_D]), dq_lo)
    dq_hi = tlx.async_dot(ds, tlx.local_slice(k_tile, [0, HALF_D], [KEYS, HALF_D]), dq_hi)
    dv = tlx.async_dot_wait(2, dv)
    kv_ok = key.cols < key.kv_len
    store_key_rows(dv_ptr, dv.to(dtype), key.kv_start + key.cols, kv_ok, key.kv_head, stride_dkv_row, CFG.HEAD_DIM)
    dk = tlx.async_dot(tlx.local_trans(ds_stage), q_tile)
    dq_lo = tlx.async_dot_wait(0, dq_lo)
    dq_hi = tlx.async_dot_wait(0, dq_hi)
    dk = tlx.async_dot_wait(0, dk)
    store_key_rows(dk_ptr, (dk * sm_scale).to(dtype), key.kv_start + key.cols, kv_ok, key.kv_head, stride_dkv_row,
                   CFG.HEAD_DIM)
    return dq_lo, dq_hi


@triton.jit
def _load_halves(desc, buffers, slot, empty, phase, full, BYTES: tl.constexpr, row0, kv_head, KEYS: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """Wait for ring slot `slot` to be free (`empty`), then TMA-load a tile's K (or V) into it, one
    [KEYS, HEAD_DIM] half per consumer, on barrier `full`; BYTES > 0 first announces the whole tile's
    bytes (the first of its K and V loads)."""
    tlx.barrier_wait(empty, phase ^ 1)
    if BYTES > 0:
        tlx.barrier_expect_bytes(full, BYTES)
    for c in tl.static_range(CONSUMERS):
        tlx.async_descriptor_load(desc, buffers[slot * CONSUMERS + c], [row0 + c * KEYS, kv_head * HEAD_DIM], full)


# Integers that change with the problem are not specialized (Triton would otherwise compile a variant
# for every combination of "divisible by 16" and "== 1" among them).
@triton.jit(do_not_specialize=["stride_lse_head", "stride_delta_head", "dq_partial_stride", "dq_partial_rows",
                               "num_kv_heads", "kv_blocks_per_seq", "broadcast_q_len", "window", "gqa_group"])
def _dkdv_kernel(desc_q, desc_k, desc_v, desc_do, desc_dq, lse_ptr, delta_ptr, dq_accum_ptr, dk_ptr, dv_ptr,
                 q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr, num_entries_ptr, stride_lse_head, stride_delta_head,
                 stride_dq_row, dq_partial_stride, dq_partial_rows, stride_dkv_row, num_kv_heads, kv_blocks_per_seq,
                 broadcast_q_len, window, gqa_group, qk_scale_log2, sm_scale, fork_params, CFG: tl.constexpr,
                 FORK: tl.constexpr):
    HEAD_DIM: tl.constexpr = CFG.HEAD_DIM
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    KEYS: tl.constexpr = BLOCK_N // CONSUMERS  # keys per consumer warpgroup
    HALF_D: tl.constexpr = HEAD_DIM // CONSUMERS
    RESIDENT: tl.constexpr = CFG.DQ == DQ_RESIDENT
    SPLIT: tl.constexpr = CFG.DQ == DQ_SPLIT
    HANDOFF: tl.constexpr = CFG.DQ == DQ_HANDOFF
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    Q_BYTES: tl.constexpr = BLOCK_M * HEAD_DIM * tlx.size_of(dtype)
    KV_HALF_BYTES: tl.constexpr = KEYS * HEAD_DIM * tlx.size_of(dtype)

    num_entries = tl.load(num_entries_ptr)
    problem = Problem(q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr, num_entries, num_kv_heads, kv_blocks_per_seq,
                      broadcast_q_len, window, gqa_group, fork_params)
    num_tiles = num_entries * num_kv_heads
    first_tile = tl.program_id(0)
    tile_stride = tl.num_programs(0)
    # Broadcast-Q: this program's own copy of dQ (dq_partial_stride is 0 otherwise: one shared accumulator).
    dq_row0 = first_tile * dq_partial_rows  # the copy's first row in the accumulator's TMA view

    q_buffers = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, CFG.Q_BUFFERS)
    if RESIDENT:  # one dO per key tile, in the K/V ring's slot
        do_buffers = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, CFG.KV_BUFFERS)
    else:
        do_buffers = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, CFG.Q_BUFFERS)
    k_buffers = tlx.local_alloc((KEYS, HEAD_DIM), dtype, CFG.KV_BUFFERS * CONSUMERS)
    v_buffers = tlx.local_alloc((KEYS, HEAD_DIM), dtype, CFG.V_BUFFERS * CONSUMERS)
    if RESIDENT:  # consumer c's P and dS stages are buffers 2c and 2c + 1; the program's dQ leaves through them
        stages_and_dq = tlx.storage_alias_spec(storage=tlx.storage_kind.smem)
        ds_stages = tlx.local_alloc((BLOCK_M, KEYS), dtype, 2 * CONSUMERS, reuse=stages_and_dq)
        p_stages = ds_stages
        FLUSH_STRIDE: tl.constexpr = 2 * KEYS * tlx.size_of(dtype) // (HALF_D * 4)  # dQ stages per P + dS
        tl.static_assert(FLUSH_STRIDE * (HALF_D * 4) == 2 * KEYS * tlx.size_of(dtype))
        dq_stages = tlx.local_alloc((BLOCK_M, HALF_D), tl.float32, FLUSH_STRIDE * CONSUMERS, reuse=stages_and_dq)
    elif SPLIT:  # dS and P (queries x keys), and half of dQ's columns per consumer
        ds_stages = tlx.local_alloc((BLOCK_M, KEYS), dtype, DS_STAGES * CONSUMERS)
        p_stages = tlx.local_alloc((BLOCK_M, KEYS), dtype, CONSUMERS)
        dq_stages = tlx.local_alloc((BLOCK_M, HALF_D), tl.float32, CONSUMERS)
    elif HANDOFF:  # dS^T (keys x queries) per consumer; consumer 0's reduce stage, then the handoff ring
        ds_stages = tlx.local_alloc((KEYS, BLOCK_M), dtype, CONSUMERS)
        dq_stages = tlx.local_alloc((BLOCK_M, HEAD_DIM), tl.float32, 1 + HANDOFF_STAGES)
    q_ring = make_ring(q_buffers, CFG.Q_BUFFERS, 1, CONSUMERS)
    kv_ring = make_ring(k_buffers, CFG.KV_BUFFERS, 1, CONSUMERS)  # one barrier pair guards a tile's K and V
    if CFG.EARLY_V_RELEASE:  # V's slot is freed after the tile's last dP, K's at the tile's end
        v_empties = tlx.alloc_barriers(num_barriers=CFG.V_BUFFERS, arrive_count=CONSUMERS)
    else:
        v_empties = kv_ring.empties
    if HANDOFF:
        handoff = HandoffDQ(ds_stages, dq_stages, tlx.alloc_warp_barrier(HANDOFF_STAGES, num_warps=WARPGROUP_WARPS),
                            tlx.alloc_warp_barrier(HANDOFF_STAGES, num_warps=WARPGROUP_WARPS), desc_dq, dq_row0)
    else:
        handoff = None

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads only
            kv_loads = 0
            q_loads = 0
            for tile in range(first_tile, num_tiles, tile_stride):
                key = key_tile(tile, problem, 0, BLOCK_M, BLOCK_N, KEYS, CFG.CAUSAL, CFG.HAS_WINDOW, CFG.BROADCAST_Q)
                if key.num_q_blocks > 0:
                    kv_slot, kv_phase = ring_slot(kv_loads, CFG.KV_BUFFERS)
                    if RESIDENT:  # the program's one query block, once
                        if kv_loads == 0:
                            tlx.barrier_expect_bytes(q_ring.fulls[0], Q_BYTES)
                            tlx.async_descriptor_load(desc_q, q_ring.buffers[0],
                                                      [key.q_start + key.first_row, key.kv_head * HEAD_DIM],
                                                      q_ring.fulls[0])
                    kv_row = key.kv_start + key.col0
                    if CFG.EARLY_V_RELEASE:
                        # Separate rings: whichever frees first is filled first (V's after the tile's
                        # last dP when the rings are as deep, K's a tile ahead when K's is deeper).
                        # DQ_RESIDENT's dO rides in the K/V slot, on its full barrier.
                        v_slot, v_phase = ring_slot(kv_loads, CFG.V_BUFFERS)
                        TILE_BYTES: tl.constexpr = 2 * CONSUMERS * KV_HALF_BYTES + (Q_BYTES if RESIDENT else 0)
                        if CFG.KV_BUFFERS > CFG.V_BUFFERS:
                            _load_halves(desc_k, k_buffers, kv_slot, kv_ring.empties[kv_slot], kv_phase,
                                         kv_ring.fulls[kv_slot], TILE_BYTES, kv_row, key.kv_head, KEYS, HEAD_DIM)
                            _load_halves(desc_v, v_buffers, v_slot, v_empties[v_slot], v_phase, kv_ring.fulls[kv_slot],
                                         0, kv_row, key.kv_head, KEYS, HEAD_DIM)
                        else:
                            _load_halves(desc_v, v_buffers, v_slot, v_empties[v_slot], v_phase, kv_ring.fulls[kv_slot],
                                         TILE_BYTES, kv_row, key.kv_head, KEYS, HEAD_DIM)
                            _load_halves(desc_k, k_buffers, kv_slot, kv_ring.empties[kv_slot], kv_phase,
                                         kv_ring.fulls[kv_slot], 0, kv_row, key.kv_head, KEYS, HEAD_DIM)
                        if RESIDENT:
                            tlx.async_descriptor_load(desc_do, do_buffers[kv_slot],
                                                      [key.out_row0 + key.first_row, key.kv_head * HEAD_DIM],
                                                      kv_ring.fulls[kv_slot])
                    else:
                        tlx.barrier_wait(kv_ring.empties[kv_slot], kv_phase ^ 1)
                        tlx.barrier_expect_bytes(kv_ring.fulls[kv_slot], 2 * CONSUMERS * KV_HALF_BYTES)
                        for c in tl.static_range(CONSUMERS):
                            kv_coord = [kv_row + c * KEYS, key.kv_head * HEAD_DIM]
                            tlx.async_descriptor_load(desc_k, k_buffers[kv_slot * CONSUMERS + c], kv_coord,
                                                      kv_ring.fulls[kv_slot])
                            tlx.async_descriptor_load(desc_v, v_buffers[kv_slot * CONSUMERS + c], kv_coord,
                                                      kv_ring.fulls[kv_slot])
                    kv_loads += 1
                    if not RESIDENT:
                        for g in range(gqa_group):
                            head = key.kv_head * gqa_group + g
                            cursor, head_blocks = FORK.query_blocks(key.seq, head, key.col0 // BLOCK_N,
                                                                    key.num_q_blocks, fork_params, BLOCK_M, BLOCK_N)
                            for block in range(head_blocks):
                                row = FORK.query_block_row(block, key.first_row, cursor, BLOCK_M, BLOCK_N)
                                if block_visible(key.seq, head, row, row + BLOCK_M - 1, key.col0, key.col0 + BLOCK_N - 1,
                                                 fork_params, FORK):
                                    slot, phase = ring_slot(q_loads, CFG.Q_BUFFERS)
                                    tlx.barrier_wait(q_ring.empties[slot], phase ^ 1)
                                    tlx.barrier_expect_bytes(q_ring.fulls[slot], 2 * Q_BYTES)
                                    tlx.async_descriptor_load(desc_q, q_ring.buffers[slot],
                                                              [key.q_start + row, head * HEAD_DIM], q_ring.fulls[slot])
                                    tlx.async_descriptor_load(desc_do, do_buffers[slot],
                                                              [key.out_row0 + row, head * HEAD_DIM], q_ring.fulls[slot])
                                    q_loads += 1

        with tlx.async_task(num_warps=WARPGROUP_WARPS, registers=CFG.CONSUMER_REGISTERS, replicate=CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            kv_loads = 0
            q_loads = 0
            dq_lo = tl.zeros([BLOCK_M, HALF_D], tl.float32)  # DQ_RESIDENT: the program's dQ, both halves of D
            dq_hi = tl.zeros([BLOCK_M, HALF_D], tl.float32)
            dq_ptr = dq_accum_ptr + first_tile.to(tl.int64) * dq_partial_stride
            for tile in range(first_tile, num_tiles, tile_stride):
                key = key_tile(tile, problem, cid, BLOCK_M, BLOCK_N, KEYS, CFG.CAUSAL, CFG.HAS_WINDOW,
                               CFG.BROADCAST_Q)
                kv_cols = key.cols
                kv_ok = kv_cols < key.kv_len
                if key.num_q_blocks > 0:
                    kv_slot, kv_phase = ring_slot(kv_loads, CFG.KV_BUFFERS)
                    v_slot, _ = ring_slot(kv_loads, CFG.V_BUFFERS)
                    if RESIDENT:  # one query head per key head; the rows' LSE and Delta load under the waits
                        lse_log2, delta = lse_delta_rows(lse_ptr, delta_ptr, key.kv_head, key.out_row0,
                                                         key.first_row, key.q_len, stride_lse_head,
                                                         stride_delta_head, BLOCK_M)
                        tlx.barrier_wait(q_ring.fulls[0], 0)
                    tlx.barrier_wait(kv_ring.fulls[kv_slot], kv_phase)
                    if RESIDENT:
                        # Buffers the loop would index by constants go through `per_step`, like the K/V
                        # slot: their wgmma descriptors, hoisted out of the tile loop, spilled.
                        same = per_step(tl.to_tensor(0))
                        slot = per_step(kv_slot)
                        dq_lo, dq_hi = _resident_dq_step(
                            q_ring.buffers[same], do_buffers[slot], k_buffers[slot * CONSUMERS + cid],
                            v_buffers[slot * CONSUMERS + cid], p_stages[same + 2 * cid], ds_stages[same + 2 * cid + 1],
                            dq_lo, dq_hi, lse_log2, delta, key, problem, qk_scale_log2, sm_scale, v_empties[kv_slot],
                            dk_ptr, dv_ptr, stride_dkv_row, CFG, FORK)
                    else:
                        dk = tl.zeros([KEYS, HEAD_DIM], tl.float32)
                        dv = tl.zeros([KEYS, HEAD_DIM], tl.float32)
                        for g in range(gqa_group):
                            head = key.kv_head * gqa_group + g
                            cursor, head_blocks = FORK.query_blocks(key.seq, head, key.col0 // BLOCK_N,
                                                                    key.num_q_blocks, fork_params, BLOCK_M, BLOCK_N)
                            # Masked blocks, the mask-free bulk, masked blocks (MASK_FREE_BULK; else all masked).
                            BULK: tl.constexpr = CFG.MASK_FREE_BULK and FORK.mask_mod is None
                            bulk_lo, bulk_hi = head_blocks, head_blocks
                            if BULK:
                                bulk_lo, bulk_hi = full_query_blocks(key.col0 + cid * KEYS,
                                                                     key.col0 + cid * KEYS + KEYS - 1,
                                                                     key.first_row, head_blocks, key.q_len,
                                                                     key.kv_len, window, BLOCK_M, CFG.CAUSAL,
                                                                     CFG.HAS_WINDOW)
                            lse_log2 = tl.zeros([BLOCK_M], tl.float32)  # the first block's, with DQ_SPLIT
                            delta = tl.zeros([BLOCK_M], tl.float32)
                            if SPLIT and head_blocks > 0:
                                lse_log2, delta = lse_delta_rows(
                                    lse_ptr, delta_ptr, head, key.out_row0,
                                    FORK.query_block_row(0, key.first_row, cursor, BLOCK_M, BLOCK_N), key.q_len,
                                    stride_lse_head, stride_delta_head, BLOCK_M)
                            for segment in tl.static_range(3 if BULK else 1):
                                lo, hi = loop_segment(segment, 0, bulk_lo, bulk_hi, head_blocks)
                                for block in range(lo, hi):
                                    q_row0 = FORK.query_block_row(block, key.first_row, cursor, BLOCK_M, BLOCK_N)
                                    if block_visible(key.seq, head, q_row0, q_row0 + BLOCK_M - 1, key.col0,
                                                     key.col0 + BLOCK_N - 1, fork_params, FORK):
                                        slot, phase = ring_slot(q_loads, CFG.Q_BUFFERS)
                                        tlx.barrier_wait(q_ring.fulls[slot], phase)
                                        if CFG.Q_BUFFERS == 1:  # a constant slot: its descriptors would be hoisted
                                            q_slot = per_step(slot)
                                        else:
                                            q_slot = slot
                                        step_kv_slot = per_step(kv_slot)
                                        kv_index = step_kv_slot * CONSUMERS + cid
                                        if CFG.EARLY_V_RELEASE:  # V's ring may be shallower than K's
                                            v_index = per_step(v_slot) * CONSUMERS + cid
                                        else:
                                            v_index = kv_index
                                        if SPLIT:
                                            next_q_row0 = FORK.query_block_row(tl.minimum(block + 1, head_blocks - 1),
                                                                               key.first_row, cursor, BLOCK_M,
                                                                               BLOCK_N)
                                            dk, dv, lse_log2, delta = _split_dq_step(
                                                q_ring.buffers[q_slot], do_buffers[q_slot], k_buffers, step_kv_slot,
                                                v_buffers[v_index], p_stages[cid], ds_stages, q_loads % DS_STAGES,
                                                dq_stages[cid], desc_dq, dq_row0, dk, dv, lse_log2, delta, key, q_row0,
                                                next_q_row0, head, problem, lse_ptr, delta_ptr, stride_lse_head,
                                                stride_delta_head, qk_scale_log2, sm_scale, v_empties[v_slot],
                                                (g == gqa_group - 1) & (block == head_blocks - 1), cid, segment != 1,
                                                CFG, FORK)
                                        else:
                                            dk, dv = _dkdv_step(
                                                q_ring.buffers[q_slot], do_buffers[q_slot], k_buffers[kv_index],
                                                v_buffers[v_index], dk, dv, key, q_row0, head, problem, lse_ptr,
                                                delta_ptr, stride_lse_head, stride_delta_head, qk_scale_log2, handoff,
                                                q_loads, sm_scale, cid, segment != 1, CFG, FORK)
                                        tlx.barrier_arrive(q_ring.empties[slot], 1)
                                        q_loads += 1
                    # Freed after the tile's last step, K's slot (and V's without EARLY_V_RELEASE).
                    tlx.barrier_arrive(kv_ring.empties[kv_slot], 1)
                    kv_loads += 1
                    if not RESIDENT:
                        # Stored inside the branch: joining the wgmma accumulators with a zero tile
                        # would route them through shared memory for a layout change.
                        store_key_rows(dk_ptr, (dk * sm_scale).to(dtype), key.kv_start + kv_cols, kv_ok, key.kv_head,
                                       stride_dkv_row, HEAD_DIM)
                        store_key_rows(dv_ptr, dv.to(dtype), key.kv_start + kv_cols, kv_ok, key.kv_head,
                                       stride_dkv_row, HEAD_DIM)
                else:  # no query sees these keys: their gradients are 0
                    zeros = tl.zeros([KEYS, HEAD_DIM], dtype)
                    store_key_rows(dk_ptr, zeros, key.kv_start + kv_cols, kv_ok, key.kv_head, stride_dkv_row, HEAD_DIM)
                    store_key_rows(dv_ptr, zeros, key.kv_start + kv_cols, kv_ok, key.kv_head, stride_dkv_row, HEAD_DIM)
            if RESIDENT:  # plain stores: this program's partial is its own (every row, so none is zeroed)
                dq_row = dq_row0 + cid * BLOCK_M
                flush_stage = dq_stages[cid * FLUSH_STRIDE]
                tlx.local_store(flush_stage, dq_lo * sm_scale)
                tlx.fence_async_shared()
                tlx.async_descriptor_store(desc_dq, flush_stage, [dq_row, 0])
                tlx.async_descriptor_store_wait(0)
                tlx.local_store(flush_stage, dq_hi * sm_scale)
                tlx.fence_async_shared()
                tlx.async_descriptor_store(desc_dq, flush_stage, [dq_row, HALF_D])
            if CFG.DQ != DQ_NONE:
                tlx.async_descriptor_store_wait(0)  # shared memory must outlive the last store


# ---- host side ------------------------------------------------------------------------------------

_dkdv_launch = CachedLaunch(_dkdv_kernel)


def is_supported(q: torch.Tensor) -> bool:
    """True when the backward kernels can run q's problem here: a Hopper GPU, bf16/fp16, a kernel head dim."""
    return (q.is_cuda and sm_major(q.device) == 9 and q.dtype in specs.SUPPORTED_DTYPES
            and q.shape[-1] in specs.SUPPORTED_HEAD_DIMS)


def dq_box_cols(config: DKDVConfig) -> int:
    """Columns of one box of the fp32 dQ accumulator: a whole row's D with DQ_HANDOFF, half of it else."""
    return config.HEAD_DIM if config.DQ == DQ_HANDOFF.value else config.HEAD_DIM // CONSUMERS.value


def launch(dout, q, k, v, lse, delta, dk, dv, dq_accum, q_offsets, kv_offsets, schedule, config: DKDVConfig, *,
           programs: int, sm_scale: float, qk_scale_log2: float, window: int | None, dq_partial_rows: int = 0,
           fork=DEFAULT_FORK, fork_params=None):
    """Run the dK/dV kernel: dK and dV into `dk`, `dv` (k's dtype), and with fused dQ its fp32 sums into
    `dq_accum` `[copies, rows, Hq, D]` (one copy per program with broadcast-Q: `dq_partial_rows` rows
    each; DQ_RESIDENT: each consumer of each program writes its [BLOCK_M, D] block once, whole).

    `schedule` is the key-tile list (`jfa.schedule.build_kv_tile_schedule`, BLOCK_M and BLOCK_N).
    """
    q_heads = q.shape[1]
    keys = config.BLOCK_N // CONSUMERS.value
    copies = dq_accum.shape[0]
    _dkdv_launch[(programs,)](
        rows_descriptor(q, config.BLOCK_M), rows_descriptor(k, keys), rows_descriptor(v, keys),
        rows_descriptor(dout, config.BLOCK_M), rows_descriptor(dq_accum.flatten(0, 1), config.BLOCK_M,
                                                              dq_box_cols(config)),
        lse, delta, dq_accum, dk, dv, q_offsets, kv_offsets, schedule.entries, schedule.num_entries, lse.stride(0),
        delta.stride(0), q_heads * config.HEAD_DIM, dq_accum[0].numel() if copies > 1 else 0, dq_partial_rows,
        k.shape[1] * config.HEAD_DIM, k.shape[1], schedule.kv_blocks_per_seq, q.shape[0] if config.BROADCAST_Q else 0,
        0 if window is None else window, q_heads // k.shape[1], qk_scale_log2, sm_scale, fork_params,
        num_warps=PRODUCER_WARPS, num_stages=num_stages(config), CFG=config, FORK=fork)


def inspect_spec(config: DKDVConfig, dtype: torch.dtype = torch.bfloat16, fork=DEFAULT_FORK,
                 params_signature=None) -> KernelSpec:
    """Compile-only description of one configuration (no GPU needed): `jfa.workbench.inspect`."""
    name = TRITON_DTYPE_NAMES[dtype]
    keys = config.BLOCK_N // CONSUMERS.value
    rows_box = f"tensordesc<{name}[{config.BLOCK_M}, {config.HEAD_DIM}]>"
    kv_box = f"tensordesc<{name}[{keys}, {config.HEAD_DIM}]>"
    signature = dict(desc_q=rows_box, desc_k=kv_box, desc_v=kv_box, desc_do=rows_box,
                     desc_dq=f"tensordesc<fp32[{config.BLOCK_M}, {dq_box_cols(config)}]>", lse_ptr="*fp32",
                     delta_ptr="*fp32", dq_accum_ptr="*fp32", dk_ptr=f"*{name}", dv_ptr=f"*{name}",
                     q_offsets_ptr="*i32", kv_offsets_ptr="*i32", tile_entries_ptr="*i32", num_entries_ptr="*i32",
                     stride_lse_head="i32", stride_delta_head="i32", stride_dq_row="i32", dq_partial_stride="i64",
                     dq_partial_rows="i32", stride_dkv_row="i32", num_kv_heads="i32", kv_blocks_per_seq="i32",
                     broadcast_q_len="i32", window="i32", gqa_group="i32", qk_scale_log2="fp32", sm_scale="fp32",
                     fork_params=params_signature or "constexpr", CFG="constexpr", FORK="constexpr")
    constexprs = dict(CFG=config, FORK=fork)
    if params_signature is None:
        constexprs["fork_params"] = None
    return KernelSpec(fn=_dkdv_kernel, signature=signature, constexprs=constexprs, num_warps=PRODUCER_WARPS,
                      num_stages=num_stages(config), name="jagged_bwd_dkdv", aligned=("stride_dq_row", "stride_dkv_row"),
                      role_names=("producer", "consumer0", "consumer1"), target="sm_90")
