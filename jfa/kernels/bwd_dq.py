"""The backward's dQ kernel for Hopper (sm_90): query-stationary, deterministic.

dQ = sm_scale * dS K, with dS = P * (dP - Delta), P = exp2(S * scale - LSE) and dP = dO V^T
(`jfa.reference.jagged_attention_bwd_ref`). Each program owns its query tiles and walks their keys in
order, so dQ needs no atomics and repeats bit for bit.

It is the forward's shape with another step: the same query tiles, persistent deal and K/V stream
(`tiles.query_tile`, `producers.load_key_tiles`), the producer loading dO beside Q, and consumers that
take turns issuing. A turn issues S(n) = Q K(n)^T, dP(n) = dO V(n)^T and the previous tile's
dQ += dS(n-1) K(n-1); the consumer forms dS(n) while that dQ runs. dS takes P's part and K takes
V's (dQ = dS K as O = P V), so a K slot is freed one step later than in the forward, after the next
step's dQ wgmma has read it: the K/V ring is deeper for it.

With broadcast-Q every sequence writes its own fp32 partial of the shared query's dQ (rows
seq * q_len ..), which the caller sums in a fixed order.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels.epilogue import store_rows
from jfa.kernels.hooks import (DEFAULT_FORK, backward_probabilities, key_tiles_to_take, key_tile_in_view,
                               score_gradient)
from jfa.kernels.launch import CachedLaunch
from jfa.kernels.pingpong import pingpong_enter, pingpong_exit, pingpong_start
from jfa.kernels.producers import load_key_tiles, load_query_rows
from jfa.kernels.ring import leading_rows, make_key_value_rings, make_ring, ring_index, ring_release, ring_wait
from jfa.kernels.softmax import lse_delta_rows
from jfa.kernels.spec import TRITON_DTYPE_NAMES, KernelSpec
from jfa.kernels.tiles import ROWS_PER_CONSUMER, Problem, consumer_rows, loop_segment, query_tile_at, tile_loop
from jfa.kernels.tma import rows_descriptor

CONSUMERS: tl.constexpr = tl.constexpr(2)
WARPGROUP_WARPS: tl.constexpr = tl.constexpr(specs.WARPGROUP_WARPS)
PRODUCER_WARPS = specs.WARPGROUP_WARPS
NUM_STAGES = 0  # the waits are the ones written (`fwd_sm90.NUM_STAGES` says why)


class DQConfig(NamedTuple):
    """The dQ kernel's compile-time configuration (chosen by `jfa.configs`)."""

    HEAD_DIM: int
    BLOCK_N: int  # keys per key tile
    KV_BUFFERS: int  # K/V ring depth
    Q_BUFFERS: int  # Q/dO ring depth
    CONSUMER_REGISTERS: int
    HEADS_PER_TILE: int  # 2: short queries, each consumer takes one head of the same 64 rows
    CAUSAL: bool
    HAS_WINDOW: bool
    BROADCAST_Q: bool
    HALF_TAIL: bool


@triton.jit
def _dq_step(q_tile, do_tile, k_ring, v_ring, ds, acc, lse_log2, delta, count, col, rows, tile, head, problem,
             qk_scale_log2, cid: tl.constexpr, LANE: tl.constexpr, KEYS: tl.constexpr, MASKED: tl.constexpr,
             FIRST: tl.constexpr, CFG: tl.constexpr, FORK: tl.constexpr):
    """One key tile (its first KEYS keys): issue S(n), dP(n) and dQ += dS(n-1) K(n-1) in one turn, then
    form dS(n). FIRST: the peeled first tile, no dQ pending (`ds` unused). Returns (ds, acc, count + 1).

    V(n) is released once dP(n) is done, K(n) only after the next step's dQ wgmma has read it.
    Invisible pairs get P = 0, hence dS = 0: keys past the sequence end read the next sequence's rows."""
    PENDING: tl.constexpr = 0 if FIRST else 1  # the previous tile's dQ wgmma, issued after S and dP
    k_index = ring_wait(k_ring, count, LANE)
    v_index = ring_wait(v_ring, count, LANE)
    pingpong_enter(cid)
    s = tlx.async_dot(q_tile, tlx.local_trans(leading_rows(k_ring.buffers[k_index], KEYS)))
    dp = tlx.async_dot(do_tile, tlx.local_trans(leading_rows(v_ring.buffers[v_index], KEYS)))
    if not FIRST:  # the previous tile is whole: only the last one can be a half tile
        prev_index = ring_index(k_ring, count - 1, LANE)
        acc = tlx.async_dot(ds.to(k_ring.buffers.dtype), k_ring.buffers[prev_index], acc)
    pingpong_exit(cid, CONSUMERS)

    s = tlx.async_dot_wait(PENDING + 1, s)
    if MASKED or FORK.score_mod is not None:
        q_idx = rows[:, None]
        k_idx = (col + tl.arange(0, KEYS))[None, :]
    else:
        q_idx = rows
        k_idx = col
    p = backward_probabilities(s, lse_log2[:, None], q_idx, k_idx, tile.seq, head, tile.q_len, tile.kv_len,
                               problem.window, problem.params, qk_scale_log2, MASKED, CFG.CAUSAL, CFG.HAS_WINDOW, FORK)
    dp = tlx.async_dot_wait(PENDING, dp)
    ring_release(v_ring, v_index)
    ds = score_gradient(p * (dp - delta[:, None]), s, q_idx, k_idx, tile.seq, head, problem.params, qk_scale_log2,
                        FORK)
    if not FIRST:
        acc = tlx.async_dot_wait(0, acc)
        ring_release(k_ring, prev_index)
    return ds, acc, count + 1


@triton.jit
def _drain(ds, acc, k_ring, count, LANE: tl.constexpr, KEYS: tl.constexpr):
    """The last key tile's dQ += dS K (its first KEYS keys), which no later step hides."""
    k_index = ring_wait(k_ring, count - 1, LANE)
    acc = tlx.async_dot(ds.to(k_ring.buffers.dtype), leading_rows(k_ring.buffers[k_index], KEYS), acc)
    acc = tlx.async_dot_wait(0, acc)
    ring_release(k_ring, k_index)
    return acc


@triton.jit
def _dq_kernel(desc_q, desc_k, desc_v, desc_k_half, desc_v_half, desc_do, dq_ptr, lse_ptr, delta_ptr, q_offsets_ptr,
               kv_offsets_ptr, tile_entries_ptr, num_entries_ptr, stride_dq_row, stride_lse_head, stride_delta_head,
               num_q_heads, q_blocks_per_seq, broadcast_q_len, window, gqa_group, qk_scale_log2, sm_scale, fork_params,
               CFG: tl.constexpr, FORK: tl.constexpr):
    ROWS: tl.constexpr = ROWS_PER_CONSUMER
    HEAD_DIM: tl.constexpr = CFG.HEAD_DIM
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    PAIRED: tl.constexpr = CFG.HEADS_PER_TILE == 2  # short queries, dealt entry-major (`fwd_sm90`)
    BLOCK_M: tl.constexpr = ROWS if PAIRED else ROWS * CONSUMERS
    KV_READERS: tl.constexpr = CONSUMERS // CFG.HEADS_PER_TILE
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    dq_dtype: tl.constexpr = dq_ptr.dtype.element_ty  # q's dtype, or fp32 partials with broadcast-Q
    Q_AND_DO_BYTES: tl.constexpr = 2 * ROWS * HEAD_DIM * tlx.size_of(dtype)

    num_entries = tl.load(num_entries_ptr)
    problem = Problem(q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr, num_entries, num_q_heads, q_blocks_per_seq,
                      broadcast_q_len, window, gqa_group, fork_params)
    num_tiles = num_entries * (num_q_heads // CFG.HEADS_PER_TILE)
    loop_start, loop_end, loop_step = tile_loop(num_tiles, PAIRED)  # this program's tiles, both roles

    q_buffers = tlx.local_alloc((ROWS, HEAD_DIM), dtype, CFG.Q_BUFFERS * CONSUMERS)
    do_buffers = tlx.local_alloc((ROWS, HEAD_DIM), dtype, CFG.Q_BUFFERS * CONSUMERS)  # beside Q, on its barriers
    k_buffers = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, CFG.KV_BUFFERS * CFG.HEADS_PER_TILE)
    v_buffers = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, CFG.KV_BUFFERS * CFG.HEADS_PER_TILE)
    q_ring = make_ring(q_buffers, CFG.Q_BUFFERS, CONSUMERS)
    k_ring, v_ring = make_key_value_rings(k_buffers, v_buffers, CFG.KV_BUFFERS, CFG.HEADS_PER_TILE, KV_READERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads only
            kv_count = 0
            q_loads = 0
            for step in range(loop_start, loop_end, loop_step):
                tile = query_tile_at(step, problem, CFG, FORK, BLOCK_M, False)
                if tile.num_kv_tiles > 0:
                    load_query_rows(desc_q, q_ring, q_loads, tile.q_row0, tile.head, CONSUMERS, PAIRED, ROWS,
                                    HEAD_DIM, Q_AND_DO_BYTES, desc_do, do_buffers, tile.out_row0 + tile.row_lo)
                    q_loads += 1
                    kv_count = load_key_tiles(desc_k, desc_v, desc_k_half, desc_v_half, k_ring, v_ring, kv_count,
                                              tile, problem, CFG.HEADS_PER_TILE, HEAD_DIM, BLOCK_M, BLOCK_N,
                                              CFG.HALF_TAIL, FORK)

        with tlx.async_task(num_warps=WARPGROUP_WARPS, registers=CFG.CONSUMER_REGISTERS, replicate=CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            LANE: tl.constexpr = cid if PAIRED else 0
            pingpong_start(cid, CONSUMERS)
            kv_count = 0
            q_loads = 0
            for step in range(loop_start, loop_end, loop_step):
                tile = query_tile_at(step, problem, CFG, FORK, BLOCK_M, False)
                first_row, rows, head = consumer_rows(tile, cid, PAIRED, ROWS)
                num_steps, first = key_tiles_to_take(tile, problem, BLOCK_M, BLOCK_N, FORK)
                if first < tile.num_kv_tiles:
                    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
                    lse_log2, delta = lse_delta_rows(lse_ptr, delta_ptr, head, tile.out_row0, first_row, tile.q_len,
                                                     stride_lse_head, stride_delta_head, ROWS)
                    # Release the previous Q/dO only now: the producer has already loaded this tile's.
                    if q_loads > 0:
                        ring_release(q_ring, ring_index(q_ring, q_loads - 1, cid))
                    q_index = ring_wait(q_ring, q_loads, cid)
                    q_loads += 1
                    q_tile = q_ring.buffers[q_index]
                    do_tile = do_buffers[q_index]

                    col = FORK.key_tile_col(first, tile.first_col, tile.cursor, BLOCK_N)
                    ds, acc, kv_count = _dq_step(q_tile, do_tile, k_ring, v_ring, None, acc, lse_log2, delta, kv_count,
                                                 col, rows, tile, head, problem, qk_scale_log2, cid, LANE, BLOCK_N,
                                                 True, True, CFG, FORK)
                    for segment in tl.static_range(3):
                        lo, hi = loop_segment(segment, first + 1, tile.bulk_lo, tile.bulk_hi, num_steps)
                        for n in range(lo, hi):
                            col, visible = key_tile_in_view(tile, n, fork_params, BLOCK_M, BLOCK_N, FORK)
                            if visible:
                                ds, acc, kv_count = _dq_step(q_tile, do_tile, k_ring, v_ring, ds, acc, lse_log2, delta,
                                                             kv_count, col, rows, tile, head, problem, qk_scale_log2,
                                                             cid, LANE, BLOCK_N, segment != 1, False, CFG, FORK)
                    if CFG.HALF_TAIL and tile.half_tail:
                        col = tile.first_col + num_steps * BLOCK_N
                        ds_half, acc, kv_count = _dq_step(q_tile, do_tile, k_ring, v_ring, ds, acc, lse_log2, delta,
                                                          kv_count, col, rows, tile, head, problem, qk_scale_log2, cid,
                                                          LANE, BLOCK_N // 2, True, False, CFG, FORK)
                        acc = _drain(ds_half, acc, k_ring, kv_count, LANE, BLOCK_N // 2)
                    else:
                        acc = _drain(ds, acc, k_ring, kv_count, LANE, BLOCK_N)
                    # Stored inside the branch: joining the wgmma accumulator with a zero tile would
                    # convert it through shared memory.
                    store_rows(dq_ptr, lse_ptr, (acc * sm_scale).to(dq_dtype), None, tile.out_row0, first_row,
                               tile.q_len, head, stride_dq_row, stride_lse_head, ROWS, HEAD_DIM)
                else:  # the block sees no key at all: dQ 0
                    store_rows(dq_ptr, lse_ptr, tl.zeros([ROWS, HEAD_DIM], dq_dtype), None, tile.out_row0, first_row,
                               tile.q_len, head, stride_dq_row, stride_lse_head, ROWS, HEAD_DIM)


# ---- host side ------------------------------------------------------------------------------------

_dq_launch = CachedLaunch(_dq_kernel)


def tile_rows(config: DQConfig) -> int:
    """Query rows of one tile (every consumer's rows of one head, or one consumer's of two heads)."""
    return ROWS_PER_CONSUMER.value * (CONSUMERS.value // config.HEADS_PER_TILE)


def launch(dout, q, k, v, lse, delta, dq, q_offsets, kv_offsets, schedule, config: DQConfig, *, programs: int,
           sm_scale: float, qk_scale_log2: float, window: int | None, fork=DEFAULT_FORK, fork_params=None):
    """Run the dQ kernel into `dq`: dQ itself (q's dtype), or with broadcast-Q the fp32 per-sequence
    partials `[num_seqs * q_len, Hq, D]` (sequence b's from row b * q_len, like its output rows).

    `lse` is the forward's and `delta` = rowsum(O * dO) (`bwd_delta.compute_delta`), both `[Hq, Tq_out]`;
    `schedule` is the query-tile list for `tile_rows(config)` rows and BLOCK_N keys per tile.
    """
    q_heads = q.shape[1]
    half = config.BLOCK_N // 2
    _dq_launch[(programs,)](
        rows_descriptor(q, ROWS_PER_CONSUMER.value), rows_descriptor(k, config.BLOCK_N),
        rows_descriptor(v, config.BLOCK_N), rows_descriptor(k, half), rows_descriptor(v, half),
        rows_descriptor(dout, ROWS_PER_CONSUMER.value), dq, lse, delta, q_offsets, kv_offsets, schedule.entries,
        schedule.num_entries, dq.stride(0), lse.stride(0), delta.stride(0), q_heads, schedule.q_blocks_per_seq,
        q.shape[0] if config.BROADCAST_Q else 0, 0 if window is None else window, q_heads // k.shape[1],
        qk_scale_log2, sm_scale, fork_params, num_warps=PRODUCER_WARPS, num_stages=NUM_STAGES, CFG=config, FORK=fork)


def inspect_spec(config: DQConfig, dtype: torch.dtype = torch.bfloat16, fork=DEFAULT_FORK,
                 params_signature=None) -> KernelSpec:
    """Compile-only description of one configuration (no GPU needed): `jfa.workbench.inspect`."""
    name = TRITON_DTYPE_NAMES[dtype]
    rows_box = f"tensordesc<{name}[{ROWS_PER_CONSUMER.value}, {config.HEAD_DIM}]>"
    kv_box = f"tensordesc<{name}[{config.BLOCK_N}, {config.HEAD_DIM}]>"
    half_box = f"tensordesc<{name}[{config.BLOCK_N // 2}, {config.HEAD_DIM}]>"
    signature = dict(desc_q=rows_box, desc_k=kv_box, desc_v=kv_box, desc_k_half=half_box, desc_v_half=half_box,
                     desc_do=rows_box, dq_ptr="*fp32" if config.BROADCAST_Q else f"*{name}", lse_ptr="*fp32",
                     delta_ptr="*fp32", q_offsets_ptr="*i32", kv_offsets_ptr="*i32", tile_entries_ptr="*i32",
                     num_entries_ptr="*i32", stride_dq_row="i32", stride_lse_head="i32", stride_delta_head="i32",
                     num_q_heads="i32", q_blocks_per_seq="i32", broadcast_q_len="i32", window="i32", gqa_group="i32",
                     qk_scale_log2="fp32", sm_scale="fp32", fork_params=params_signature or "constexpr", CFG="constexpr",
                     FORK="constexpr")
    constexprs = dict(CFG=config, FORK=fork)
    if params_signature is None:
        constexprs["fork_params"] = None
    return KernelSpec(fn=_dq_kernel, signature=signature, constexprs=constexprs, num_warps=PRODUCER_WARPS,
                      num_stages=NUM_STAGES, name="jagged_bwd_dq", aligned=("stride_dq_row",),
                      role_names=("producer", "consumer0", "consumer1"), target="sm_90")
