"""Block attention on Hopper (sm_90): every 64-token block of a jagged sequence attends only to itself.

Because the attention pattern is fixed, a block is one whole softmax problem: one QK GEMM, a plain
softmax (no running max, no correction, no log-sum-exp written to memory), one PV GEMM. The backward
recomputes P from Q and K and derives everything else from the same block, so it needs no separate
``Delta`` pass either.

Work split. A *unit* is (head, block). The list of blocks is built on the GPU from the offsets
(``jfa.schedule.build_block_table``: start row and real row count of each block, plus the block
count as a one-element device tensor), so launching needs no host synchronisation. A fixed grid of
persistent programs (one per SM) deals the units out round-robin: program ``p`` takes units
``p, p+P, ...``.

Warp layout of one program (Hopper warp specialisation):
- a producer warpgroup (the default task, few registers) streams the tiles of each unit by TMA into
  a ring of shared-memory slots, each slot with a ``full`` mbarrier (TMA bytes landed) and an
  ``empty`` mbarrier (the consumer is done with it);
- ``NUM_CONSUMERS`` consumer warpgroups (most registers), each owning whole 64-row blocks: consumer
  ``c`` takes the program's units ``c, c+NUM_CONSUMERS, ...`` so the two overlap one another's
  softmax with the other's GEMMs.

Partial blocks: the TMA box always reads 64 rows; rows past the sequence end belong to the next
sequence (or are zero-filled past the tensor end). Their keys are masked to -inf, their queries get
P = 0 in the backward so they add nothing to dK/dV, and their output rows are never stored.

GQA (``Hq = GROUP * Hkv``): the forward's unit is a query head. The backward's unit is a KV head and
it loops over the GROUP query heads that read it, accumulating dK and dV in registers: the group sum
is a register reduction, deterministic and without atomics.

Fused rotary backward (``ROTARY_EPILOGUE``): the same backward kernel applies the conjugate rotary
rotation to dQ, dK, dV while they are fp32 registers and stores them side by side into one tensor
``dz[M, (Hq + 2*Hkv) * D]``, which the caller multiplies by the projection weight. The rotation
never leaves registers: the angles are loaded straight into the accumulator's layout, and each
gradient is rotated and stored one half of its columns at a time, dK and dV sharing the angles
(see ``_store_grads``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from jfa.kernels.common import LOG2E, persistent_programs, ring_slot, rows_descriptor, sm_major
from jfa.kernels.launch import CachedLaunch
from jfa.schedule import build_block_table
from jfa.specs import BLOCK_ATTENTION_BLOCK

# tl.constexpr globals are readable inside @triton.jit functions; plain ints are not
BLOCK = tl.constexpr(BLOCK_ATTENTION_BLOCK)
NUM_CONSUMERS = 2  # consumer warpgroups per program (a kernel argument, so each config can differ)
WARPS_PER_GROUP = tl.constexpr(4)  # a Hopper warpgroup: the unit that issues one wgmma
# setmaxnreg budget of a consumer; the producer (TMA issue only) keeps the rest, 24. The backward's
# dQ epilogue holds dK, dV and dQ ([64, D] fp32 each, 192 registers a thread at D=128): at 232 it spilled.
CONSUMER_REGISTERS = tl.constexpr(240)
# Triton's num_stages for both kernels: its default, which every block-attention timing in results/
# was measured with; inspect_spec compiles at the same value so its report is of the kernel that runs.
# (A consumer takes one 64-token block against its one key tile and waits for each wgmma as soon as
# it is issued, so the pipeliner's waits change nothing here; jagged_fwd.NUM_STAGES is where they do.)
NUM_STAGES = 3
SMEM_BUDGET_BYTES = 200 * 1024  # ring + staging must fit Hopper's 227 KiB with room for barriers
MAX_RING_DEPTH = 4

FWD_TILES_PER_SLOT = 3  # Q, K, V
BWD_TILES_PER_SLOT = 4  # Q, K, V, dO
BWD_STAGING_TILES = 2  # P and dS, bf16 [64, 64] per consumer: the A operands of the transposed GEMMs


def ring_depth(head_dim: int, tiles_per_slot: int, staging_bytes: int = 0, elem_bytes: int = 2) -> int:
    """Deepest ring of ``tiles_per_slot`` [64, head_dim] tiles per slot that fits the shared memory."""
    slot_bytes = tiles_per_slot * BLOCK_ATTENTION_BLOCK * head_dim * elem_bytes
    return max(1, min(MAX_RING_DEPTH, (SMEM_BUDGET_BYTES - staging_bytes) // slot_bytes))


def fwd_ring_depth(head_dim: int) -> int:
    return ring_depth(head_dim, FWD_TILES_PER_SLOT)


def bwd_ring_depth(head_dim: int) -> int:
    return ring_depth(head_dim, BWD_TILES_PER_SLOT, NUM_CONSUMERS * BWD_STAGING_TILES * BLOCK_ATTENTION_BLOCK**2 * 2)


# ---- device helpers -------------------------------------------------------------------------

@triton.jit
def _block_softmax(scores, key_ok, qk_scale_log2):
    """Plain softmax of one whole block: the block is the full row, so no running max is needed."""
    scores = tl.where(key_ok[None, :], scores, float("-inf"))
    row_max = tl.max(scores, 1)
    p = tl.math.exp2((scores - row_max[:, None]) * qk_scale_log2)
    return p, tl.sum(p, 1)


@triton.jit
def _load_fp32_in_consumer_layout(ptrs):
    """fp32 loads that take the register layout of the values they are combined with.

    A ``tl.load`` gets a coalesced layout that the compiler then keeps, so an [rows, pairs] tile of
    rotary angles would force the gradient it multiplies through shared memory into that layout.
    An elementwise inline-asm load is laid out like any elementwise op: the angles arrive directly in
    the wgmma accumulator's column-pair layout. Not pure, so the compiler neither hoists it out of
    the group loop nor merges the identical loads of dK and dV: either would keep the angles in
    registers across code that needs them.
    """
    return tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32,
                                     is_pure=False, pack=1)


@triton.jit
def _angles(sinu_ptr, sinu_row_stride, sinu_rows, first_pair, PAIRS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(sin, cos) [64, PAIRS] of pairs first_pair.. for the given rows, in the accumulator's layout.

    ``sinu_pos`` holds sin(t_i) in its first D/2 columns and cos(t_i) in its last D/2. The loads are
    unmasked, so every index in ``sinu_rows`` must be a row of sinu_pos.
    """
    sin_ptrs = (sinu_ptr + sinu_rows[:, None].to(tl.int64) * sinu_row_stride
                + first_pair + tl.arange(0, PAIRS)[None, :])
    return _load_fp32_in_consumer_layout(sin_ptrs), _load_fp32_in_consumer_layout(sin_ptrs + HEAD_DIM // 2)


@triton.jit
def _rotary_conj(grad, sin, cos):
    """Conjugate rotary rotation of fp32 gradient columns [64, 2*PAIRS] by the angles' (sin, cos).

    The forward rotates each column pair (2i, 2i+1) by angle t_i: x' = x*cos + rotate_every_two(x)*sin.
    Its transpose rotates by -t_i: dx_even = g_even*cos + g_odd*sin, dx_odd = g_odd*cos - g_even*sin.
    The pair split and join stay in registers: a wgmma accumulator holds both columns of a pair in
    one thread.
    """
    g_even, g_odd = tl.split(tl.reshape(grad, [grad.shape[0], grad.shape[1] // 2, 2]))
    d_even = g_even * cos + g_odd * sin
    d_odd = g_odd * cos - g_even * sin
    return tl.reshape(tl.join(d_even, d_odd), [grad.shape[0], grad.shape[1]])


@triton.jit
def _halves(grad, HALF: tl.constexpr):
    """The left and right column halves of a [64, 2*HALF] accumulator (a register-only split)."""
    return tl.split(tl.permute(tl.reshape(grad, [BLOCK, 2, HALF]), [0, 2, 1]))


@triton.jit
def _store_grads(a_ptr, b_ptr, row_stride, col0, row0, real_rows, grad_a, grad_b, sinu_ptr, sinu_row_stride,
                 HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, PAIRED: tl.constexpr):
    """Store fp32 [64, D] gradients (grad_a, and grad_b when PAIRED) in the outputs' dtype, conjugate-rotated
    first if ROTARY; both go to the same rows and columns of their own tensors (dK and dV).

    One half of the columns at a time (a register-only split of the accumulator): while dK, dV and
    dQ are all live, the angles of a whole tile (64 fp32 registers a thread at D=128) would spill;
    for one half they fit. A pair shares each half's angles: the loads are the epilogue's cost (a
    global-load latency the warpgroup waits for), so dK and dV pay for them once. Row indices are
    formed here, not by the caller, so that none stay live through the group loop. Rows past the
    sequence end take the angles of the block's last real row (a row of sinu_pos) and are not stored.
    """
    offs_m = tl.arange(0, BLOCK)
    rows = row0 + offs_m
    row_ok = offs_m < real_rows
    HALF: tl.constexpr = HEAD_DIM // 2
    sinu_rows = row0 + tl.minimum(offs_m, real_rows - 1)
    a_left, a_right = _halves(grad_a, HALF)
    if ROTARY:
        sin, cos = _angles(sinu_ptr, sinu_row_stride, sinu_rows, 0, HALF // 2, HEAD_DIM)
        a_left = _rotary_conj(a_left, sin, cos)
    _store_rows(a_ptr, row_stride, col0, rows, row_ok, a_left.to(a_ptr.dtype.element_ty), HALF)
    if PAIRED:
        b_left, b_right = _halves(grad_b, HALF)
        if ROTARY:
            b_left = _rotary_conj(b_left, sin, cos)
        _store_rows(b_ptr, row_stride, col0, rows, row_ok, b_left.to(b_ptr.dtype.element_ty), HALF)
    if ROTARY:
        sin, cos = _angles(sinu_ptr, sinu_row_stride, sinu_rows, HALF // 2, HALF // 2, HEAD_DIM)
        a_right = _rotary_conj(a_right, sin, cos)
    _store_rows(a_ptr, row_stride, col0 + HALF, rows, row_ok, a_right.to(a_ptr.dtype.element_ty), HALF)
    if PAIRED:
        if ROTARY:
            b_right = _rotary_conj(b_right, sin, cos)
        _store_rows(b_ptr, row_stride, col0 + HALF, rows, row_ok, b_right.to(b_ptr.dtype.element_ty), HALF)


@triton.jit
def _store_rows(base_ptr, row_stride, col0, rows, row_ok, tile, COLS: tl.constexpr):
    """Masked store of a [64, COLS] tile: rows past the sequence end belong to another block."""
    cols = col0 + tl.arange(0, COLS)
    ptrs = base_ptr + rows[:, None].to(tl.int64) * row_stride + cols[None, :]
    tl.store(ptrs, tile, mask=row_ok[:, None])


# ---- forward ----------------------------------------------------------------------------------

@triton.jit
def _block_attn_fwd_kernel(
    desc_q, desc_k, desc_v,  # TMA descriptors over [T, H*D], box [64, D]
    out_ptr, out_row_stride,
    block_start_ptr, block_rows_ptr, num_blocks_ptr,
    sm_scale, heads_q,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_BUFFERS: tl.constexpr, NUM_CONSUMERS: tl.constexpr,
):
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    TILE_BYTES: tl.constexpr = BLOCK * HEAD_DIM * tlx.size_of(dtype)
    num_units = tl.load(num_blocks_ptr) * heads_q
    prog = tl.program_id(0)
    num_progs = tl.num_programs(0)

    q_ring = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_BUFFERS)
    k_ring = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_BUFFERS)
    v_ring = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_BUFFERS)
    slot_full = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    slot_empty = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads, one slot per unit
            loaded = 0
            for unit in range(prog, num_units, num_progs):
                block = unit // heads_q
                head = unit % heads_q
                row0 = tl.load(block_start_ptr + block)
                slot, phase = ring_slot(loaded, NUM_BUFFERS)
                tlx.barrier_wait(slot_empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(slot_full[slot], 3 * TILE_BYTES)
                tlx.async_descriptor_load(desc_q, q_ring[slot], [row0, head * HEAD_DIM], slot_full[slot])
                kv_col = (head // GROUP) * HEAD_DIM
                tlx.async_descriptor_load(desc_k, k_ring[slot], [row0, kv_col], slot_full[slot])
                tlx.async_descriptor_load(desc_v, v_ring[slot], [row0, kv_col], slot_full[slot])
                loaded += 1

        with tlx.async_task(num_warps=WARPS_PER_GROUP, registers=CONSUMER_REGISTERS, replicate=NUM_CONSUMERS):
            consumer = tlx.async_task_replica_id()
            qk_scale_log2 = sm_scale * LOG2E
            offs_m = tl.arange(0, BLOCK)
            offs_d = tl.arange(0, HEAD_DIM)
            # this consumer's k-th unit is the program's (consumer + k*NUM_CONSUMERS)-th
            seen = consumer
            for unit in range(prog + consumer * num_progs, num_units, num_progs * NUM_CONSUMERS):
                block = unit // heads_q
                head = unit % heads_q
                row0 = tl.load(block_start_ptr + block)
                real_rows = tl.load(block_rows_ptr + block)
                slot, phase = ring_slot(seen, NUM_BUFFERS)
                tlx.barrier_wait(slot_full[slot], phase)

                scores = tlx.async_dot(q_ring[slot], tlx.local_trans(k_ring[slot]))
                scores = tlx.async_dot_wait(0, scores)
                p, row_sum = _block_softmax(scores, offs_m < real_rows, qk_scale_log2)
                acc = tlx.async_dot(p.to(dtype), v_ring[slot])
                acc = tlx.async_dot_wait(0, acc)
                tlx.barrier_arrive(slot_empty[slot], 1)

                out = acc / row_sum[:, None]
                rows = row0 + offs_m
                _store_rows(out_ptr, out_row_stride, head * HEAD_DIM, rows, offs_m < real_rows,
                            out.to(dtype), HEAD_DIM)
                seen += NUM_CONSUMERS


# ---- backward ---------------------------------------------------------------------------------

@triton.jit
def _block_attn_bwd_kernel(
    desc_q, desc_k, desc_v, desc_do,  # TMA descriptors over [T, H*D], box [64, D]
    dq_ptr, dk_ptr, dv_ptr, dq_row_stride, dkv_row_stride,
    sinu_ptr, sinu_row_stride,
    block_start_ptr, block_rows_ptr, num_blocks_ptr,
    sm_scale, heads_kv,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_BUFFERS: tl.constexpr, NUM_CONSUMERS: tl.constexpr,
    ROTARY_EPILOGUE: tl.constexpr,
):
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    TILE_BYTES: tl.constexpr = BLOCK * HEAD_DIM * tlx.size_of(dtype)
    num_units = tl.load(num_blocks_ptr) * heads_kv
    prog = tl.program_id(0)
    num_progs = tl.num_programs(0)

    q_ring = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_BUFFERS)
    k_ring = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_BUFFERS)
    v_ring = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_BUFFERS)
    do_ring = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_BUFFERS)
    # P and dS go through shared memory because dV = P^T dO and dK = dS^T Q need them transposed,
    # which wgmma reads directly from shared memory
    p_stage = tlx.local_alloc((BLOCK, BLOCK), dtype, NUM_CONSUMERS)
    ds_stage = tlx.local_alloc((BLOCK, BLOCK), dtype, NUM_CONSUMERS)
    slot_full = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    slot_empty = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: one slot per (unit, query head of the group)
            loaded = 0
            for unit in range(prog, num_units, num_progs):
                block = unit // heads_kv
                kv_head = unit % heads_kv
                row0 = tl.load(block_start_ptr + block)
                for g in range(GROUP):
                    q_col = (kv_head * GROUP + g) * HEAD_DIM
                    slot, phase = ring_slot(loaded, NUM_BUFFERS)
                    tlx.barrier_wait(slot_empty[slot], phase ^ 1)
                    tlx.barrier_expect_bytes(slot_full[slot], 4 * TILE_BYTES)
                    tlx.async_descriptor_load(desc_q, q_ring[slot], [row0, q_col], slot_full[slot])
                    tlx.async_descriptor_load(desc_k, k_ring[slot], [row0, kv_head * HEAD_DIM], slot_full[slot])
                    tlx.async_descriptor_load(desc_v, v_ring[slot], [row0, kv_head * HEAD_DIM], slot_full[slot])
                    tlx.async_descriptor_load(desc_do, do_ring[slot], [row0, q_col], slot_full[slot])
                    loaded += 1

        with tlx.async_task(num_warps=WARPS_PER_GROUP, registers=CONSUMER_REGISTERS, replicate=NUM_CONSUMERS):
            consumer = tlx.async_task_replica_id()
            qk_scale_log2 = sm_scale * LOG2E
            offs_m = tl.arange(0, BLOCK)
            p_tile = p_stage[consumer]
            ds_tile = ds_stage[consumer]
            seen = consumer * GROUP
            for unit in range(prog + consumer * num_progs, num_units, num_progs * NUM_CONSUMERS):
                block = unit // heads_kv
                kv_head = unit % heads_kv
                row0 = tl.load(block_start_ptr + block)
                real_rows = tl.load(block_rows_ptr + block)
                row_ok = offs_m < real_rows
                dk = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
                dv = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
                for g in range(GROUP):
                    slot, phase = ring_slot(seen + g, NUM_BUFFERS)
                    tlx.barrier_wait(slot_full[slot], phase)

                    scores = tlx.async_dot(q_ring[slot], tlx.local_trans(k_ring[slot]))
                    scores = tlx.async_dot_wait(0, scores)
                    p, row_sum = _block_softmax(scores, row_ok, qk_scale_log2)
                    # query rows past the sequence end are another block's: they must add nothing
                    p = tl.where(row_ok[:, None], p / row_sum[:, None], 0.0)
                    tlx.local_store(p_tile, p.to(dtype))
                    tlx.fence_async_shared()
                    dv = tlx.async_dot(tlx.local_trans(p_tile), do_ring[slot], dv)
                    dp = tlx.async_dot(do_ring[slot], tlx.local_trans(v_ring[slot]))
                    dp = tlx.async_dot_wait(0, dp)
                    dv = tlx.async_dot_wait(0, dv)
                    # rowsum(P * dP) == rowsum(dO * O) exactly, from values already in registers
                    delta = tl.sum(p * dp, 1)
                    ds = p * (dp - delta[:, None])
                    tlx.local_store(ds_tile, ds.to(dtype))
                    tlx.fence_async_shared()
                    dk = tlx.async_dot(tlx.local_trans(ds_tile), q_ring[slot], dk)
                    dq = tlx.async_dot(ds_tile, k_ring[slot])
                    dq = tlx.async_dot_wait(0, dq)
                    dk = tlx.async_dot_wait(0, dk)
                    tlx.barrier_arrive(slot_empty[slot], 1)

                    _store_grads(dq_ptr, dq_ptr, dq_row_stride, (kv_head * GROUP + g) * HEAD_DIM, row0,
                                 real_rows, dq * sm_scale, dq, sinu_ptr, sinu_row_stride, HEAD_DIM,
                                 ROTARY_EPILOGUE, False)

                _store_grads(dk_ptr, dv_ptr, dkv_row_stride, kv_head * HEAD_DIM, row0, real_rows, dk * sm_scale,
                             dv, sinu_ptr, sinu_row_stride, HEAD_DIM, ROTARY_EPILOGUE, True)
                seen += NUM_CONSUMERS * GROUP


# ---- host wrappers ----------------------------------------------------------------------------

_TRITON_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# The hot path binds each kernel's arguments once per specialization (`jfa.kernels.launch`).
_block_attn_fwd_launch = CachedLaunch(_block_attn_fwd_kernel)
_block_attn_bwd_launch = CachedLaunch(_block_attn_bwd_kernel)


def is_supported(q: torch.Tensor) -> bool:
    """True where these kernels run: a CUDA tensor on a Hopper (sm_90) GPU, bf16/fp16, D 64 or 128."""
    if not (q.is_cuda and q.dtype in _TRITON_DTYPE_NAMES and q.dim() == 3 and q.shape[-1] in (64, 128)):
        return False
    return sm_major(q.device) == 9


def _row_descriptor(t: torch.Tensor):
    """TMA descriptor over a packed [T, H, D] tensor seen as [T, H*D], one box = one block's rows of one head."""
    return rows_descriptor(t, BLOCK_ATTENTION_BLOCK)


def block_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Block attention forward on the GPU: out [T, Hq, D] in q's dtype (inputs already validated).

    ``out`` (contiguous, q's shape and dtype) lets tests pass a poisoned buffer.
    """
    rows, heads_q, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    if rows == 0 or heads_q == 0:
        return out
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    block_start, block_rows, num_blocks = build_block_table(offsets.to(q.device), rows)
    grid = (persistent_programs(q.device, block_start.numel() * heads_q),)
    _block_attn_fwd_launch[grid](
        _row_descriptor(q), _row_descriptor(k), _row_descriptor(v),
        out, heads_q * head_dim,
        block_start, block_rows, num_blocks,
        1.0 / math.sqrt(head_dim), heads_q,
        GROUP=heads_q // k.shape[1], HEAD_DIM=head_dim,
        NUM_BUFFERS=fwd_ring_depth(head_dim), NUM_CONSUMERS=NUM_CONSUMERS,
        num_warps=WARPS_PER_GROUP.value, num_stages=NUM_STAGES,
    )
    return out


def _launch_bwd(q, k, v, offsets, dout, dq, dk, dv, dq_row_stride, dkv_row_stride, sinu_pos):
    """Run the backward kernel; dq/dk/dv may be views into one dz tensor (the rotary epilogue)."""
    rows, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    block_start, block_rows, num_blocks = build_block_table(offsets.to(q.device), rows)
    rotary = sinu_pos is not None
    # the kernel reads the angles as fp32 words; without ROTARY_EPILOGUE it never reads them
    sinu = sinu_pos.to(torch.float32).contiguous() if rotary else dq
    grid = (persistent_programs(q.device, block_start.numel() * heads_kv),)
    _block_attn_bwd_launch[grid](
        _row_descriptor(q), _row_descriptor(k), _row_descriptor(v), _row_descriptor(dout),
        dq, dk, dv, dq_row_stride, dkv_row_stride,
        sinu, sinu.stride(0),
        block_start, block_rows, num_blocks,
        1.0 / math.sqrt(head_dim), heads_kv,
        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim,
        NUM_BUFFERS=bwd_ring_depth(head_dim), NUM_CONSUMERS=NUM_CONSUMERS,
        ROTARY_EPILOGUE=rotary, num_warps=WARPS_PER_GROUP.value, num_stages=NUM_STAGES,
    )


def block_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                        dout: torch.Tensor, grads: tuple | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block attention backward on the GPU: (dq, dk, dv) in the inputs' dtype; P is recomputed.

    ``grads`` optionally gives the (dq, dk, dv) buffers to fill (contiguous; tests poison them).
    """
    rows, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    dq, dk, dv = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if grads is None else grads
    if rows == 0 or heads_q == 0:
        return dq, dk, dv
    _launch_bwd(q, k, v, offsets, dout, dq, dk, dv, heads_q * head_dim, heads_kv * head_dim, None)
    return dq, dk, dv


def block_attention_rotary_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                               dout: torch.Tensor, sinu_pos: torch.Tensor,
                               dz: torch.Tensor | None = None) -> torch.Tensor:
    """Backward of rotary + block attention: dz [M, (Hq + 2*Hkv) * D], the gradient of the projection.

    q, k, v are the *rotated* tensors the forward attended with. The kernel's epilogue applies the
    conjugate rotation to dQ, dK, dV in fp32 and stores them side by side: columns [0, Hq*D) hold
    dQ, then Hkv*D columns of dK, then Hkv*D of dV, the layout of ``x @ w`` that produced q, k, v.
    """
    rows, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    width = (heads_q + 2 * heads_kv) * head_dim
    dz = torch.empty(rows, width, dtype=q.dtype, device=q.device) if dz is None else dz
    if rows == 0 or heads_q == 0:
        return dz
    dk_view = dz[:, heads_q * head_dim:]
    dv_view = dz[:, (heads_q + heads_kv) * head_dim:]
    _launch_bwd(q, k, v, offsets, dout, dz, dk_view, dv_view, width, width, sinu_pos)
    return dz


# ---- compile-only inspection ------------------------------------------------------------------

def inspect_spec(direction: str = "fwd", head_dim: int = 128, group: int = 1, dtype: torch.dtype = torch.bfloat16,
                 rotary: bool = False):
    """`jfa.inspect.KernelSpec` of one configuration, compilable without a GPU.

    ``direction`` is "fwd" or "bwd"; ``rotary`` selects the backward's fused rotary epilogue.
    """
    from jfa.kernels.spec import KernelSpec

    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if rotary and direction != "bwd":
        raise ValueError("rotary=True is an option of the backward kernel; pass direction='bwd'")
    elem = _TRITON_DTYPE_NAMES[dtype]
    desc = f"tensordesc<{elem}[{BLOCK_ATTENTION_BLOCK},{head_dim}]>"
    table = {"block_start_ptr": "*i32", "block_rows_ptr": "*i32", "num_blocks_ptr": "*i32", "sm_scale": "fp32"}
    if direction == "fwd":
        signature = {"desc_q": desc, "desc_k": desc, "desc_v": desc, "out_ptr": f"*{elem}",
                     "out_row_stride": "i32", "heads_q": "i32", **table}
        constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "NUM_BUFFERS": fwd_ring_depth(head_dim),
                      "NUM_CONSUMERS": NUM_CONSUMERS}
        fn, name = _block_attn_fwd_kernel, f"block_attn_fwd_d{head_dim}_g{group}"
    else:
        signature = {"desc_q": desc, "desc_k": desc, "desc_v": desc, "desc_do": desc,
                     "dq_ptr": f"*{elem}", "dk_ptr": f"*{elem}", "dv_ptr": f"*{elem}",
                     "dq_row_stride": "i32", "dkv_row_stride": "i32",
                     "sinu_ptr": "*fp32" if rotary else f"*{elem}", "sinu_row_stride": "i32",
                     "heads_kv": "i32", **table}
        constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "NUM_BUFFERS": bwd_ring_depth(head_dim),
                      "NUM_CONSUMERS": NUM_CONSUMERS, "ROTARY_EPILOGUE": rotary}
        fn = _block_attn_bwd_kernel
        name = f"block_attn_bwd{'_rotary' if rotary else ''}_d{head_dim}_g{group}"
    roles = ("producer",) + tuple(f"consumer_wg{i}" for i in range(NUM_CONSUMERS))
    # sinu_row_stride is D, or dq's row stride without rotary: a multiple of 16 in every launch
    aligned = ("out_row_stride",) if direction == "fwd" else ("dq_row_stride", "dkv_row_stride", "sinu_row_stride")
    return KernelSpec(fn=fn, signature=signature, constexprs=constexprs, num_warps=WARPS_PER_GROUP.value,
                      num_stages=NUM_STAGES, name=name, role_names=roles, target="sm_90", aligned=aligned)
