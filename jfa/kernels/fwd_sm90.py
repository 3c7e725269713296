"""Jagged flash-attention forward for Hopper (sm_90): the warp-specialized skeleton.

Semantics are `docs/CONTRACTS.md`'s (packed `[T, H, D]` sequences, bottom-right causal, symmetric
window, GQA, broadcast-Q). The kernel is a persistent loop over query tiles (`tiles.query_tile`:
one sequence's query block of one head, or of two heads when the queries are short) with two roles:

- the producer (the default task, one warpgroup, few registers) loads each tile's Q block once per
  consumer into the Q ring and streams the tile's key tiles through the K and V rings
  (`producers.load_key_tiles`);
- CONSUMERS consumer warpgroups (`replicate`, most of the registers) each own 64 query rows (or one
  of the paired heads). A consumer computes S = Q·K^T by wgmma, the online softmax in registers and
  O += P·V by wgmma with P from registers. The consumers take turns issuing (`pingpong`): a turn
  issues Q·K^T of key tile n and P·V of tile n-1 together, and the softmax of tile n runs while
  those and the other consumer's turn keep the tensor cores busy.

Per tile a consumer peels the first key tile (Q·K^T only), runs the rest as masked edge tiles and a
mask-free bulk (`tiles.loop_segment`), drains the last P·V, then normalizes and stores its rows
(`epilogue.store_output`: through its Q slot and one TMA store when the block lies inside its
sequence, from registers with a row mask when it runs past the end). A half last tile (HALF_TAIL)
loads and multiplies only the first half of a key tile when that is all that is left.

Broadcast-Q reads one shared query for every sequence (output rows of sequence b start at
b * q_len): head-major tiles of the same query block and head keep their Q loaded (REUSE_Q), with
one Q slot per consumer and the output staged in buffers of its own.

What a fork changes (the key iteration, scores, masks, operands) comes in through `hooks.Fork`.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels.epilogue import store_output, store_rows
from jfa.kernels.hooks import DEFAULT_FORK, key_tiles_to_take, key_tile_in_view, softmax_scores
from jfa.kernels.launch import CachedLaunch
from jfa.kernels.pingpong import pingpong_enter, pingpong_exit, pingpong_start
from jfa.kernels.producers import load_key_tiles, load_query_rows
from jfa.kernels.ring import leading_rows, make_key_value_rings, make_ring, ring_index, ring_release, ring_wait
from jfa.kernels.softmax import finalize_rows, online_softmax_step
from jfa.kernels.spec import TRITON_DTYPE_NAMES, KernelSpec
from jfa.kernels.tiles import (ROWS_PER_CONSUMER, Problem, consumer_rows, loop_segment, query_tile_at, sm_major,
                              tile_loop)
from jfa.kernels.tma import rows_descriptor
from jfa.kernels.twin import torch_twin

Q_BUFFERS: tl.constexpr = tl.constexpr(2)  # the next tile's Q lands while this one computes
WARPGROUP_WARPS: tl.constexpr = tl.constexpr(specs.WARPGROUP_WARPS)
PRODUCER_WARPS = specs.WARPGROUP_WARPS  # the default task is one warpgroup (the kernel's num_warps)
# Launched at num_stages 0: at 1 or more Triton's software pipeliner puts a `wgmma.wait_group 0` right
# after every `tlx.async_dot` it cannot prove safe to leave in flight (every one here), so Q·K^T
# would never overlap P·V. The ring loads are mbarrier-driven: the pass has nothing else to do here.
NUM_STAGES = 0


class ForwardConfig(NamedTuple):
    """The forward kernel's compile-time configuration (chosen by `jfa.configs`)."""

    HEAD_DIM: int
    BLOCK_N: int  # keys per key tile
    KV_BUFFERS: int  # K/V ring depth
    CONSUMERS: int  # consumer warpgroups
    CONSUMER_REGISTERS: int  # setmaxnreg budget of a consumer; the producer keeps the rest
    HEADS_PER_TILE: int  # 2: short queries, each consumer takes one head of the same 64 rows
    CAUSAL: bool
    HAS_WINDOW: bool
    BROADCAST_Q: bool
    HALF_TAIL: bool  # a last key tile with at most BLOCK_N/2 keys runs as a half tile


@triton.jit
def _attend_key_tile(q_tile, k_ring, v_ring, p, acc, m_i, l_i, count, col, rows, tile, head, problem, qk_scale_log2,
                     cid: tl.constexpr, LANE: tl.constexpr, CONSUMERS: tl.constexpr, KEYS: tl.constexpr,
                     MASKED: tl.constexpr, CFG: tl.constexpr, FORK: tl.constexpr):
    """One key tile of a consumer (its first KEYS keys): issue Q·K^T(n) and P·V(n-1) in one turn,
    then the softmax of tile n while P·V runs. Returns (p, acc, m_i, l_i, count + 1).

    Both are issued inside the turn, K and V waited for first, so the other consumer's wgmmas queue
    behind both rather than between them.
    """
    k_index = ring_wait(k_ring, count, LANE)
    v_index = ring_wait(v_ring, count - 1, LANE)
    pingpong_enter(cid)
    qk = tlx.async_dot(q_tile, tlx.local_trans(leading_rows(k_ring.buffers[k_index], KEYS)))
    # the previous tile is whole: only the last one can be a half tile
    acc = FORK.pv(p, FORK.value_operand(v_ring.buffers[v_index], CFG.BLOCK_N), acc)
    pingpong_exit(cid, CONSUMERS)

    qk = tlx.async_dot_wait(1, qk)
    ring_release(k_ring, k_index)
    scores, scale_log2 = _scores(qk, rows, col, KEYS, tile, head, problem, qk_scale_log2, MASKED, CFG, FORK)
    p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i, scale_log2, MASKED)

    acc = tlx.async_dot_wait(0, acc)
    ring_release(v_ring, v_index)
    acc = acc * alpha[:, None]
    return p, acc, m_i, l_i, count + 1


@triton.jit
def _scores(qk, rows, col, KEYS: tl.constexpr, tile, head, problem, qk_scale_log2, MASKED: tl.constexpr,
            CFG: tl.constexpr, FORK: tl.constexpr):
    """`hooks.softmax_scores` of a [rows, KEYS] tile whose keys start at column `col`."""
    if MASKED or FORK.score_mod is not None:
        cols = col + tl.arange(0, KEYS)
        q_idx = rows[:, None]
        k_idx = cols[None, :]
    else:
        q_idx = rows
        k_idx = col
    return softmax_scores(qk, q_idx, k_idx, tile.seq, head, tile.q_len, tile.kv_len, problem.window, problem.params,
                          qk_scale_log2, MASKED, CFG.CAUSAL, CFG.HAS_WINDOW, FORK)


@triton.jit
def _drain(p, acc, v_ring, count, LANE: tl.constexpr, KEYS: tl.constexpr, CFG: tl.constexpr, FORK: tl.constexpr):
    """The last key tile's P·V (its first KEYS keys), which no later Q·K^T hides."""
    v_index = ring_wait(v_ring, count - 1, LANE)
    acc = FORK.pv(p, FORK.value_operand(v_ring.buffers[v_index], KEYS), acc)
    acc = tlx.async_dot_wait(0, acc)
    ring_release(v_ring, v_index)
    return acc


@triton.jit
def _forward_kernel(desc_q, desc_k, desc_v, desc_k_half, desc_v_half, desc_out, out_ptr, lse_ptr, q_offsets_ptr,
                    kv_offsets_ptr, tile_entries_ptr, num_entries_ptr, stride_out_row, stride_lse_head, num_q_heads,
                    q_blocks_per_seq, broadcast_q_len, window, gqa_group, qk_scale_log2, fork_params,
                    CFG: tl.constexpr, FORK: tl.constexpr):
    ROWS: tl.constexpr = ROWS_PER_CONSUMER
    HEAD_DIM: tl.constexpr = CFG.HEAD_DIM
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    CONSUMERS: tl.constexpr = CFG.CONSUMERS
    # One head per tile: the consumers split BLOCK_M = 64 x CONSUMERS query rows. Two heads per tile
    # (short queries, dealt entry-major): both consumers take the same 64 rows, consumer c head + c.
    PAIRED: tl.constexpr = CFG.HEADS_PER_TILE == 2
    BLOCK_M: tl.constexpr = ROWS if PAIRED else ROWS * CONSUMERS
    KV_READERS: tl.constexpr = CONSUMERS // CFG.HEADS_PER_TILE  # consumers that read each K/V tile
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    # The output leaves through shared memory in q's dtype (`store_output`), staged in the consumer's
    # Q slot, dead once the tile's last Q·K^T is done. Broadcast-Q keeps its Q block for the next
    # tile: head-major, one Q slot per consumer serves (Q changes only with the head) and the second
    # slot's memory holds stages of its own; entry-major (paired heads) has no room and stores from
    # registers. A fork whose output dtype differs from its inputs' (FP8) stores from registers.
    STAGED: tl.constexpr = out_dtype == dtype and not (CFG.BROADCAST_Q and PAIRED)
    OWN_STAGE: tl.constexpr = STAGED and CFG.BROADCAST_Q
    REUSE_Q: tl.constexpr = CFG.BROADCAST_Q
    Q_SLOTS: tl.constexpr = 1 if OWN_STAGE else Q_BUFFERS
    Q_BYTES: tl.constexpr = ROWS * HEAD_DIM * tlx.size_of(dtype)

    num_entries = tl.load(num_entries_ptr)
    problem = Problem(q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr, num_entries, num_q_heads, q_blocks_per_seq,
                      broadcast_q_len, window, gqa_group, fork_params)
    num_tiles = num_entries * (num_q_heads // CFG.HEADS_PER_TILE)
    loop_start, loop_end, loop_step = tile_loop(num_tiles, PAIRED)  # this program's tiles, both roles

    q_buffers = tlx.local_alloc((ROWS, HEAD_DIM), dtype, Q_SLOTS * CONSUMERS)
    if OWN_STAGE:
        out_stages = tlx.local_alloc((ROWS, HEAD_DIM), dtype, CONSUMERS)
    else:
        out_stages = q_buffers  # the stage is the consumer's Q slot
    k_buffers = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, CFG.KV_BUFFERS * CFG.HEADS_PER_TILE)
    v_buffers = tlx.local_alloc(FORK.value_shape(BLOCK_N, HEAD_DIM), dtype, CFG.KV_BUFFERS * CFG.HEADS_PER_TILE)
    q_ring = make_ring(q_buffers, Q_SLOTS, CONSUMERS)
    k_ring, v_ring = make_key_value_rings(k_buffers, v_buffers, CFG.KV_BUFFERS, CFG.HEADS_PER_TILE, KV_READERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads only
            kv_count = 0
            q_loads = 0
            loaded_q_key = -1
            for step in range(loop_start, loop_end, loop_step):
                tile = query_tile_at(step, problem, CFG, FORK, BLOCK_M, REUSE_Q)
                if tile.num_kv_tiles > 0:
                    if tile.q_key != loaded_q_key:
                        load_query_rows(desc_q, q_ring, q_loads, tile.q_row0, tile.head, CONSUMERS, PAIRED, ROWS,
                                        HEAD_DIM, Q_BYTES)
                        q_loads += 1
                        loaded_q_key = tile.q_key
                    kv_count = load_key_tiles(desc_k, desc_v, desc_k_half, desc_v_half, k_ring, v_ring, kv_count,
                                              tile, problem, CFG.HEADS_PER_TILE, HEAD_DIM, BLOCK_M, BLOCK_N,
                                              CFG.HALF_TAIL, FORK)

        with tlx.async_task(num_warps=WARPGROUP_WARPS, registers=CFG.CONSUMER_REGISTERS, replicate=CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            LANE: tl.constexpr = cid if PAIRED else 0  # the K/V lane of this consumer's head
            pingpong_start(cid, CONSUMERS)
            kv_count = 0
            q_loads = 0
            loaded_q_key = -1
            for step in range(loop_start, loop_end, loop_step):
                tile = query_tile_at(step, problem, CFG, FORK, BLOCK_M, REUSE_Q)
                first_row, rows, head = consumer_rows(tile, cid, PAIRED, ROWS)
                num_steps, first = key_tiles_to_take(tile, problem, BLOCK_M, BLOCK_N, FORK)
                if first < tile.num_kv_tiles:
                    m_i = tl.full([ROWS], float("-inf"), tl.float32)
                    l_i = tl.zeros([ROWS], tl.float32)
                    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
                    if tile.q_key != loaded_q_key:
                        # Release the previous Q only now: with two Q slots the producer has already
                        # been able to load this one.
                        if q_loads > 0:
                            if STAGED:  # the previous output's TMA store has read its stage
                                tlx.async_descriptor_store_wait(0)
                            ring_release(q_ring, ring_index(q_ring, q_loads - 1, cid))
                        ring_wait(q_ring, q_loads, cid)
                        q_loads += 1
                        loaded_q_key = tile.q_key
                    q_tile = q_ring.buffers[ring_index(q_ring, q_loads - 1, cid)]

                    # The peeled first key tile: Q·K^T only, no P·V before it.
                    col = FORK.key_tile_col(first, tile.first_col, tile.cursor, BLOCK_N)
                    k_index = ring_wait(k_ring, kv_count, LANE)
                    pingpong_enter(cid)
                    qk = tlx.async_dot(q_tile, tlx.local_trans(k_ring.buffers[k_index]))
                    pingpong_exit(cid, CONSUMERS)
                    qk = tlx.async_dot_wait(0, qk)
                    ring_release(k_ring, k_index)
                    scores, scale_log2 = _scores(qk, rows, col, BLOCK_N, tile, head, problem, qk_scale_log2, True, CFG,
                                                 FORK)
                    p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i, scale_log2, True)
                    kv_count += 1

                    # Leading edge (window start), mask-free bulk, trailing edge (diagonal, sequence end).
                    for segment in tl.static_range(3):
                        lo, hi = loop_segment(segment, first + 1, tile.bulk_lo, tile.bulk_hi, num_steps)
                        for n in range(lo, hi):
                            col, visible = key_tile_in_view(tile, n, fork_params, BLOCK_M, BLOCK_N, FORK)
                            if visible:
                                p, acc, m_i, l_i, kv_count = _attend_key_tile(
                                    q_tile, k_ring, v_ring, p, acc, m_i, l_i, kv_count, col, rows, tile, head, problem,
                                    qk_scale_log2, cid, LANE, CONSUMERS, BLOCK_N, segment != 1, CFG, FORK)

                    # Drain: the last tile's P·V; a half last tile multiplies only its half.
                    if CFG.HALF_TAIL and tile.half_tail:
                        col = tile.first_col + num_steps * BLOCK_N
                        p_half, acc, m_i, l_i, kv_count = _attend_key_tile(
                            q_tile, k_ring, v_ring, p, acc, m_i, l_i, kv_count, col, rows, tile, head, problem,
                            qk_scale_log2, cid, LANE, CONSUMERS, BLOCK_N // 2, True, CFG, FORK)
                        acc = _drain(p_half, acc, v_ring, kv_count, LANE, BLOCK_N // 2, CFG, FORK)
                    else:
                        acc = _drain(p, acc, v_ring, kv_count, LANE, BLOCK_N, CFG, FORK)

                    # Finalize inside the branch: joining the wgmma accumulator with a zero tile
                    # would make the compiler convert fp32 accumulators through shared memory.
                    if FORK.scale_output is not None:
                        acc = FORK.scale_output(acc, fork_params)
                    out, lse = finalize_rows(acc, m_i, l_i, out_dtype)
                    if OWN_STAGE:
                        stage = out_stages[cid]
                    else:
                        stage = q_tile
                    store_output(out, lse, stage, desc_out, out_ptr, lse_ptr, tile.out_row0, first_row, tile.q_len,
                                 head, stride_out_row, stride_lse_head, ROWS, HEAD_DIM, STAGED)
                else:  # the block sees no key at all: output 0, LSE -inf
                    store_rows(out_ptr, lse_ptr, tl.zeros([ROWS, HEAD_DIM], out_dtype),
                               tl.full([ROWS], float("-inf"), tl.float32), tile.out_row0, first_row, tile.q_len, head,
                               stride_out_row, stride_lse_head, ROWS, HEAD_DIM)
            if STAGED:  # shared memory must outlive the last output's TMA store
                tlx.async_descriptor_store_wait(0)


# ---- host side ------------------------------------------------------------------------------------

_forward_launch = CachedLaunch(_forward_kernel)  # binds its arguments once per specialization


def is_supported(q: torch.Tensor) -> bool:
    """True when the jagged kernels can run q's problem here: a Hopper GPU, a kernel dtype and head dim
    (FP8 through its fork)."""
    return (q.is_cuda and sm_major(q.device) == 9 and q.dtype in specs.SUPPORTED_DTYPES + (torch.float8_e4m3fn,)
            and q.shape[-1] in specs.SUPPORTED_HEAD_DIMS)


def tile_rows(config: ForwardConfig) -> int:
    """Query rows of one tile: every consumer's rows of one head, or one consumer's of two heads."""
    return ROWS_PER_CONSUMER.value * (config.CONSUMERS // config.HEADS_PER_TILE)


def launch(q, k, v, out, lse, q_offsets, kv_offsets, schedule, config: ForwardConfig, *, programs: int,
           qk_scale_log2: float, window: int | None, fork=DEFAULT_FORK, fork_params=None, desc_v=None):
    """Run the forward kernel into `out` and `lse` (validated inputs, at least one output row and key).

    `schedule` is the query-tile list (`jfa.schedule.build_tile_schedule` with `tile_rows(config)`
    rows and BLOCK_N keys per tile) and `programs` the persistent grid; `qk_scale_log2` is
    sm_scale * log2(e) (times the FP8 fork's descales). `desc_v` replaces V's TMA view for a fork
    whose V buffers have their own layout (`Fork.value_shape`); its half tiles are never taken.
    """
    q_heads = q.shape[1]
    half = config.BLOCK_N // 2
    _forward_launch[(programs,)](
        rows_descriptor(q, ROWS_PER_CONSUMER.value), rows_descriptor(k, config.BLOCK_N),
        rows_descriptor(v, config.BLOCK_N) if desc_v is None else desc_v,
        rows_descriptor(k, half), rows_descriptor(v if desc_v is None else k, half),
        rows_descriptor(out, ROWS_PER_CONSUMER.value) if out.dtype == q.dtype else None,
        out, lse, q_offsets, kv_offsets, schedule.entries, schedule.num_entries, out.stride(0), lse.stride(0),
        q_heads, schedule.q_blocks_per_seq, q.shape[0] if config.BROADCAST_Q else 0, 0 if window is None else window,
        q_heads // k.shape[1], qk_scale_log2, fork_params, num_warps=PRODUCER_WARPS, num_stages=NUM_STAGES,
        CFG=config, FORK=fork)


def inspect_spec(config: ForwardConfig, dtype: torch.dtype = torch.bfloat16, fork=DEFAULT_FORK, params_signature=None,
                 out_dtype: torch.dtype | None = None) -> KernelSpec:
    """Compile-only description of one configuration (no GPU needed): `jfa.workbench.inspect`."""
    name = TRITON_DTYPE_NAMES[dtype]
    out_name = TRITON_DTYPE_NAMES[out_dtype or dtype]
    rows_box = f"tensordesc<{name}[{ROWS_PER_CONSUMER.value}, {config.HEAD_DIM}]>"
    kv_box = f"tensordesc<{name}[{config.BLOCK_N}, {config.HEAD_DIM}]>"
    half_box = f"tensordesc<{name}[{config.BLOCK_N // 2}, {config.HEAD_DIM}]>"
    v_shape = torch_twin(fork.value_shape)(config.BLOCK_N, config.HEAD_DIM)
    staged = (out_dtype or dtype) == dtype
    signature = dict(desc_q=rows_box, desc_k=kv_box, desc_v=f"tensordesc<{name}[{v_shape[0]}, {v_shape[1]}]>",
                     desc_k_half=half_box, desc_v_half=half_box,
                     desc_out=f"tensordesc<{out_name}[{ROWS_PER_CONSUMER.value}, {config.HEAD_DIM}]>" if staged
                     else "constexpr",
                     out_ptr=f"*{out_name}", lse_ptr="*fp32", q_offsets_ptr="*i32", kv_offsets_ptr="*i32",
                     tile_entries_ptr="*i32", num_entries_ptr="*i32", stride_out_row="i32", stride_lse_head="i32",
                     num_q_heads="i32", q_blocks_per_seq="i32", broadcast_q_len="i32", window="i32", gqa_group="i32",
                     qk_scale_log2="fp32", fork_params=params_signature or "constexpr", CFG="constexpr", FORK="constexpr")
    constexprs = dict(CFG=config, FORK=fork)
    if params_signature is None:
        constexprs["fork_params"] = None
    if not staged:
        constexprs["desc_out"] = None
    return KernelSpec(fn=_forward_kernel, signature=signature, constexprs=constexprs, num_warps=PRODUCER_WARPS,
                      num_stages=NUM_STAGES, name="jagged_fwd", aligned=("stride_out_row",),
                      role_names=("producer",) + tuple(f"consumer{c}" for c in range(config.CONSUMERS)),
                      target="sm_90")
