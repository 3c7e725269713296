"""Block attention on Hopper (sm_90): every 64-token block of a jagged sequence attends only to itself.

Because the attention pattern is fixed, a block is one whole softmax problem: one QK GEMM, a plain
softmax (no running max, no correction, no log-sum-exp written to memory), one PV GEMM. The backward
recomputes P from Q and K and derives everything else from the same block, so it needs no separate
Delta pass either.

Work split. A *unit* is (block, head). The runtime builds the list of blocks on the GPU from the
offsets (`jfa.schedule.build_block_table`: start row and real row count of each block, and the block
count as a one-element device tensor), so a launch needs no host synchronisation. A persistent grid
(one program per SM) deals the units out round robin: program p takes units p, p+P, ...

Warp roles of one program:
- the producer (the default task, one warpgroup, few registers) loads each unit's tiles by TMA into
  one slot of a ring (`jfa.kernels.ring`): Q, K and V (and dO in the backward) side by side, landing
  on the slot's one full barrier;
- CONSUMERS consumer warpgroups (most registers), each owning whole 64-row blocks: the program's k-th
  unit goes to consumer k % CONSUMERS, so one consumer's softmax overlaps the other's GEMMs.

Partial blocks: the TMA box always reads 64 rows; rows past the sequence end belong to the next
sequence (or are zero-filled past the tensor end). Their keys are masked to -inf, their queries get
P = 0 in the backward so they add nothing to dK/dV, and their output rows are never stored.

GQA (Hq = GROUP * Hkv): the forward's unit is a query head. The backward's unit is a key head and
it loops over the GROUP query heads that read it, accumulating dK and dV in registers: the group sum
is a register reduction, deterministic and without atomics.

Fused rotary backward (ROTARY): the backward applies the conjugate rotary rotation to dQ, dK, dV
while they are fp32 registers and stores them side by side into one tensor
`dz[M, (Hq + 2*Hkv) * D]`, which the caller multiplies by the projection weight. The rotation never
leaves registers: the angles are loaded straight into the accumulator's layout, and each gradient is
rotated and stored one half of its columns at a time, dK and dV sharing the angles (`_store_grads`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels.launch import CachedLaunch
from jfa.kernels.ring import make_ring, ring_acquire, ring_release, ring_wait
from jfa.kernels.rotary import rotate_pairs
from jfa.kernels.softmax import LOG2E
from jfa.kernels.spec import TRITON_DTYPE_NAMES, KernelSpec
from jfa.kernels.tiles import sm_major, tile_loop
from jfa.kernels.tma import rows_descriptor

BLOCK: tl.constexpr = tl.constexpr(specs.BLOCK_ATTENTION_BLOCK)
WARPGROUP_WARPS: tl.constexpr = tl.constexpr(specs.WARPGROUP_WARPS)
# setmaxnreg budget of a consumer; the producer (TMA issue only) keeps the rest. The backward's dQ
# epilogue holds dK, dV and dQ, three [64, D] fp32 tiles (192 registers a thread at D=128).
CONSUMER_REGISTERS: tl.constexpr = tl.constexpr(240)
# Triton's default. A consumer waits for each wgmma as soon as it is issued, so the software
# pipeliner has nothing to overlap here (unlike the jagged forward's, launched at 0).
NUM_STAGES = 3
class ForwardConfig(NamedTuple):
    """The forward kernel's compile-time configuration (chosen by `jfa.configs.block_attention_forward`)."""

    HEAD_DIM: int
    GROUP: int  # query heads per key head
    RING_DEPTH: int  # ring slots, each one unit's Q, K and V
    CONSUMERS: int  # consumer warpgroups


class BackwardConfig(NamedTuple):
    """The backward kernel's compile-time configuration (chosen by `jfa.configs.block_attention_backward`)."""

    HEAD_DIM: int
    GROUP: int  # query heads per key head
    RING_DEPTH: int  # ring slots, each one query head's Q, K, V and dO
    CONSUMERS: int  # consumer warpgroups
    ROTARY: bool  # the conjugate rotary epilogue into one dz tensor


class BlockRows(NamedTuple):
    """Where a unit's block is: its first row in the packed tensors and how many of its 64 rows are real."""

    row0: object
    real_rows: object


class Angles(NamedTuple):
    """The rotary angles `sinu_pos [M, D]` as fp32: sin in the first D/2 columns, cos in the last D/2."""

    ptr: object
    row_stride: object


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

    A `tl.load` gets a coalesced layout that the compiler then keeps, so an [rows, pairs] tile of
    rotary angles would force the gradient it multiplies through shared memory into that layout.
    An elementwise inline-asm load is laid out like any elementwise op: the angles arrive directly in
    the wgmma accumulator's column-pair layout. Not pure, so the compiler neither hoists it out of
    the group loop nor merges the identical loads of dK and dV: either would keep the angles in
    registers across code that needs them.
    """
    return tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32,
                                     is_pure=False, pack=1)


@triton.jit
def _angles(angles, sinu_rows, first_pair, PAIRS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(sin, cos) [64, PAIRS] of pairs first_pair.. for the given rows, in the accumulator's layout.

    The loads are unmasked, so every index in `sinu_rows` must be a row of sinu_pos.
    """
    sin_ptrs = (angles.ptr + sinu_rows[:, None].to(tl.int64) * angles.row_stride
                + first_pair + tl.arange(0, PAIRS)[None, :])
    return _load_fp32_in_consumer_layout(sin_ptrs), _load_fp32_in_consumer_layout(sin_ptrs + HEAD_DIM // 2)


@triton.jit
def _halves(grad, HALF: tl.constexpr):
    """The left and right column halves of a [64, 2*HALF] accumulator (a register-only split)."""
    return tl.split(tl.permute(tl.reshape(grad, [BLOCK, 2, HALF]), [0, 2, 1]))


@triton.jit
def _store_grads(a_ptr, b_ptr, row_stride, col0, block, grad_a, grad_b, angles, CFG: tl.constexpr):
    """Store fp32 [64, D] gradients (grad_a, and grad_b unless it is None) in the outputs' dtype,
    conjugate-rotated first with CFG.ROTARY; both go to the same rows and columns of their own tensors
    (dK and dV).

    One half of the columns at a time (a register-only split of the accumulator): while dK, dV and
    dQ are all live, the angles of a whole tile (64 fp32 registers a thread at D=128) would spill;
    for one half they fit. A pair shares each half's angles: the loads are the epilogue's cost (a
    global-load latency the warpgroup waits for), so dK and dV pay for them once. Row indices are
    formed here, not by the caller, so that none stay live through the group loop. Rows past the
    sequence end take the angles of the block's last real row (a row of sinu_pos) and are not stored.
    """
    HALF: tl.constexpr = CFG.HEAD_DIM // 2
    offs_m = tl.arange(0, BLOCK)
    rows = block.row0 + offs_m
    row_ok = offs_m < block.real_rows
    sinu_rows = block.row0 + tl.minimum(offs_m, block.real_rows - 1)
    a_left, a_right = _halves(grad_a, HALF)
    if CFG.ROTARY:
        sin, cos = _angles(angles, sinu_rows, 0, HALF // 2, CFG.HEAD_DIM)
        a_left = rotate_pairs(a_left, sin, cos, True)
    _store_rows(a_ptr, row_stride, col0, rows, row_ok, a_left.to(a_ptr.dtype.element_ty), HALF)
    if grad_b is not None:
        b_left, b_right = _halves(grad_b, HALF)
        if CFG.ROTARY:
            b_left = rotate_pairs(b_left, sin, cos, True)
        _store_rows(b_ptr, row_stride, col0, rows, row_ok, b_left.to(b_ptr.dtype.element_ty), HALF)
    if CFG.ROTARY:
        sin, cos = _angles(angles, sinu_rows, HALF // 2, HALF // 2, CFG.HEAD_DIM)
        a_right = rotate_pairs(a_right, sin, cos, True)
    _store_rows(a_ptr, row_stride, col0 + HALF, rows, row_ok, a_right.to(a_ptr.dtype.element_ty), HALF)
    if grad_b is not None:
        if CFG.ROTARY:
            b_right = rotate_pairs(b_right, sin, cos, True)
        _store_rows(b_ptr, row_stride, col0 + HALF, rows, row_ok, b_right.to(b_ptr.dtype.element_ty), HALF)


@triton.jit
def _store_rows(base_ptr, row_stride, col0, rows, row_ok, tile, COLS: tl.constexpr):
    """Masked store of a [64, COLS] tile from column col0: rows past the sequence end belong to another block.

    Both kernels store through this rather than `epilogue.store_rows`, which stores whole heads
    (columns head * D onward) of `[rows, heads, D]` tensors: the gradients leave in column halves
    (`_store_grads`), with the rotary epilogue into column slices of dz. For the forward's whole heads,
    store_rows adds the head's column offset to every row's 64-bit address; here it joins the int32
    column indices, which takes fewer integer instructions per store.
    """
    cols = col0 + tl.arange(0, COLS)
    ptrs = base_ptr + rows[:, None].to(tl.int64) * row_stride + cols[None, :]
    tl.store(ptrs, tile, mask=row_ok[:, None])


# ---- forward ----------------------------------------------------------------------------------

@triton.jit
def _block_attn_fwd_kernel(desc_q, desc_k, desc_v, out_ptr, out_row_stride, block_start_ptr, block_rows_ptr,
                           num_blocks_ptr, sm_scale, heads_q, CFG: tl.constexpr):
    HEAD_DIM: tl.constexpr = CFG.HEAD_DIM
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    TILE_BYTES: tl.constexpr = BLOCK * HEAD_DIM * tlx.size_of(dtype)
    unit_start, unit_end, unit_step = tile_loop(tl.load(num_blocks_ptr) * heads_q, False)  # this program's units
    qk_scale_log2 = sm_scale * LOG2E

    # One ring slot per unit: its Q, K and V buffers share the slot's barriers.
    q_buffers = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, CFG.RING_DEPTH)
    k_buffers = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, CFG.RING_DEPTH)
    v_buffers = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, CFG.RING_DEPTH)
    ring = make_ring(q_buffers, CFG.RING_DEPTH)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads, one slot per unit
            loaded = 0
            for unit in range(unit_start, unit_end, unit_step):
                block = unit // heads_q
                head = unit % heads_q
                row0 = tl.load(block_start_ptr + block)
                index = ring_acquire(ring, loaded, 3 * TILE_BYTES)
                tlx.async_descriptor_load(desc_q, q_buffers[index], [row0, head * HEAD_DIM], ring.fulls[index])
                kv_col = (head // CFG.GROUP) * HEAD_DIM
                tlx.async_descriptor_load(desc_k, k_buffers[index], [row0, kv_col], ring.fulls[index])
                tlx.async_descriptor_load(desc_v, v_buffers[index], [row0, kv_col], ring.fulls[index])
                loaded += 1

        with tlx.async_task(num_warps=WARPGROUP_WARPS, registers=CONSUMER_REGISTERS, replicate=CFG.CONSUMERS):
            consumer = tlx.async_task_replica_id()
            offs_m = tl.arange(0, BLOCK)
            # this consumer's k-th unit is the program's (consumer + k*CFG.CONSUMERS)-th
            seen = consumer
            for unit in range(unit_start + consumer * unit_step, unit_end, unit_step * CFG.CONSUMERS):
                block = unit // heads_q
                head = unit % heads_q
                row0 = tl.load(block_start_ptr + block)
                real_rows = tl.load(block_rows_ptr + block)
                index = ring_wait(ring, seen)

                scores = tlx.async_dot(q_buffers[index], tlx.local_trans(k_buffers[index]))
                scores = tlx.async_dot_wait(0, scores)
                p, row_sum = _block_softmax(scores, offs_m < real_rows, qk_scale_log2)
                acc = tlx.async_dot(p.to(dtype), v_buffers[index])
                acc = tlx.async_dot_wait(0, acc)
                ring_release(ring, index)

                out = acc / row_sum[:, None]
                _store_rows(out_ptr, out_row_stride, head * HEAD_DIM, row0 + offs_m, offs_m < real_rows,
                            out.to(dtype), HEAD_DIM)
                seen += CFG.CONSUMERS


# ---- backward ---------------------------------------------------------------------------------

@triton.jit
def _block_attn_bwd_kernel(desc_q, desc_k, desc_v, desc_do, dq_ptr, dk_ptr, dv_ptr, dq_row_stride, dkv_row_stride,
                           sinu_ptr, sinu_row_stride, block_start_ptr, block_rows_ptr, num_blocks_ptr, sm_scale,
                           heads_kv, CFG: tl.constexpr):
    HEAD_DIM: tl.constexpr = CFG.HEAD_DIM
    GROUP: tl.constexpr = CFG.GROUP
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    TILE_BYTES: tl.constexpr = BLOCK * HEAD_DIM * tlx.size_of(dtype)
    unit_start, unit_end, unit_step = tile_loop(tl.load(num_blocks_ptr) * heads_kv, False)  # this program's units
    qk_scale_log2 = sm_scale * LOG2E
    angles = Angles(sinu_ptr, sinu_row_stride)

    # One ring slot per (unit, query head of the group): its Q, K, V and dO share the slot's barriers.
    q_buffers = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, CFG.RING_DEPTH)
    k_buffers = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, CFG.RING_DEPTH)
    v_buffers = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, CFG.RING_DEPTH)
    do_buffers = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, CFG.RING_DEPTH)
    # P and dS go through shared memory because dV = P^T dO and dK = dS^T Q need them transposed,
    # which wgmma reads directly from shared memory
    p_stage = tlx.local_alloc((BLOCK, BLOCK), dtype, CFG.CONSUMERS)
    ds_stage = tlx.local_alloc((BLOCK, BLOCK), dtype, CFG.CONSUMERS)
    ring = make_ring(q_buffers, CFG.RING_DEPTH)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: one slot per (unit, query head of the group)
            loaded = 0
            for unit in range(unit_start, unit_end, unit_step):
                block = unit // heads_kv
                kv_head = unit % heads_kv
                row0 = tl.load(block_start_ptr + block)
                for g in range(GROUP):
                    q_col = (kv_head * GROUP + g) * HEAD_DIM
                    index = ring_acquire(ring, loaded, 4 * TILE_BYTES)
                    tlx.async_descriptor_load(desc_q, q_buffers[index], [row0, q_col], ring.fulls[index])
                    tlx.async_descriptor_load(desc_k, k_buffers[index], [row0, kv_head * HEAD_DIM], ring.fulls[index])
                    tlx.async_descriptor_load(desc_v, v_buffers[index], [row0, kv_head * HEAD_DIM], ring.fulls[index])
                    tlx.async_descriptor_load(desc_do, do_buffers[index], [row0, q_col], ring.fulls[index])
                    loaded += 1

        with tlx.async_task(num_warps=WARPGROUP_WARPS, registers=CONSUMER_REGISTERS, replicate=CFG.CONSUMERS):
            consumer = tlx.async_task_replica_id()
            offs_m = tl.arange(0, BLOCK)
            p_tile = p_stage[consumer]
            ds_tile = ds_stage[consumer]
            seen = consumer * GROUP
            for unit in range(unit_start + consumer * unit_step, unit_end, unit_step * CFG.CONSUMERS):
                block = unit // heads_kv
                kv_head = unit % heads_kv
                rows = BlockRows(tl.load(block_start_ptr + block), tl.load(block_rows_ptr + block))
                row_ok = offs_m < rows.real_rows
                dk = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
                dv = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
                for g in range(GROUP):
                    index = ring_wait(ring, seen + g)

                    scores = tlx.async_dot(q_buffers[index], tlx.local_trans(k_buffers[index]))
                    scores = tlx.async_dot_wait(0, scores)
                    p, row_sum = _block_softmax(scores, row_ok, qk_scale_log2)
                    # query rows past the sequence end are another block's: they must add nothing
                    p = tl.where(row_ok[:, None], p / row_sum[:, None], 0.0)
                    tlx.local_store(p_tile, p.to(dtype))
                    tlx.fence_async_shared()
                    dv = tlx.async_dot(tlx.local_trans(p_tile), do_buffers[index], dv)
                    dp = tlx.async_dot(do_buffers[index], tlx.local_trans(v_buffers[index]))
                    dp = tlx.async_dot_wait(0, dp)
                    dv = tlx.async_dot_wait(0, dv)
                    # rowsum(P * dP) == rowsum(dO * O) exactly, from values already in registers
                    delta = tl.sum(p * dp, 1)
                    ds = p * (dp - delta[:, None])
                    tlx.local_store(ds_tile, ds.to(dtype))
                    tlx.fence_async_shared()
                    dk = tlx.async_dot(tlx.local_trans(ds_tile), q_buffers[index], dk)
                    dq = tlx.async_dot(ds_tile, k_buffers[index])
                    dq = tlx.async_dot_wait(0, dq)
                    dk = tlx.async_dot_wait(0, dk)
                    ring_release(ring, index)

                    _store_grads(dq_ptr, None, dq_row_stride, (kv_head * GROUP + g) * HEAD_DIM, rows, dq * sm_scale,
                                 None, angles, CFG)

                _store_grads(dk_ptr, dv_ptr, dkv_row_stride, kv_head * HEAD_DIM, rows, dk * sm_scale, dv, angles,
                             CFG)
                seen += CFG.CONSUMERS * GROUP


# ---- host side --------------------------------------------------------------------------------

_fwd_launch = CachedLaunch(_block_attn_fwd_kernel)  # binds its arguments once per specialization
_bwd_launch = CachedLaunch(_block_attn_bwd_kernel)


def is_supported(q: torch.Tensor) -> bool:
    """True where these kernels run: a CUDA tensor on a Hopper (sm_90) GPU, bf16/fp16, D 64 or 128."""
    if not (q.is_cuda and q.dtype in specs.SUPPORTED_DTYPES and q.dim() == 3
            and q.shape[-1] in specs.SUPPORTED_HEAD_DIMS):
        return False
    return sm_major(q.device) == 9


def launch_forward(q, k, v, out, blocks, config: ForwardConfig, *, programs: int):
    """Run the forward kernel into `out` (contiguous q, k, v of at least one row; out q's shape and dtype).

    `blocks` is the block table (`jfa.schedule.build_block_table`: block_start, block_rows,
    num_blocks) and `programs` the persistent grid.
    """
    block_start, block_rows, num_blocks = blocks
    rows_box = specs.BLOCK_ATTENTION_BLOCK
    _fwd_launch[(programs,)](
        rows_descriptor(q, rows_box), rows_descriptor(k, rows_box), rows_descriptor(v, rows_box),
        out, out.stride(0), block_start, block_rows, num_blocks, 1.0 / math.sqrt(config.HEAD_DIM), q.shape[1],
        num_warps=specs.WARPGROUP_WARPS, num_stages=NUM_STAGES, CFG=config)


def launch_backward(q, k, v, dout, dq, dk, dv, blocks, config: BackwardConfig, *, programs: int, sinu_pos=None):
    """Run the backward kernel into dq, dk, dv (contiguous inputs of at least one row).

    The gradients' rows are `stride(0)` elements apart, dk's and dv's alike: [T, H, D] tensors, or
    with the rotary epilogue (`config.ROTARY`, the angles `sinu_pos [M, D]`) column slices of one
    `dz` tensor. `blocks` and `programs` as for `launch_forward`.
    """
    block_start, block_rows, num_blocks = blocks
    rows_box = specs.BLOCK_ATTENTION_BLOCK
    # the kernel reads the angles as fp32 words; without the rotary epilogue it never reads them
    sinu = sinu_pos.to(torch.float32).contiguous() if config.ROTARY else dq
    _bwd_launch[(programs,)](
        rows_descriptor(q, rows_box), rows_descriptor(k, rows_box), rows_descriptor(v, rows_box),
        rows_descriptor(dout, rows_box), dq, dk, dv, dq.stride(0), dk.stride(0), sinu, sinu.stride(0),
        block_start, block_rows, num_blocks, 1.0 / math.sqrt(config.HEAD_DIM), k.shape[1],
        num_warps=specs.WARPGROUP_WARPS, num_stages=NUM_STAGES, CFG=config)


# ---- compile-only inspection ------------------------------------------------------------------

def inspect_spec(config: ForwardConfig | BackwardConfig, dtype: torch.dtype = torch.bfloat16) -> KernelSpec:
    """Compile-only description of one configuration (no GPU needed): `jfa.workbench.inspect`.

    A ForwardConfig describes the forward kernel, a BackwardConfig the backward (`jfa.configs` makes both).
    """
    if not isinstance(config, (ForwardConfig, BackwardConfig)):
        raise TypeError(f"config must be a ForwardConfig or a BackwardConfig, got {type(config).__name__}")
    elem = TRITON_DTYPE_NAMES[dtype]
    desc = f"tensordesc<{elem}[{specs.BLOCK_ATTENTION_BLOCK},{config.HEAD_DIM}]>"
    table = {"block_start_ptr": "*i32", "block_rows_ptr": "*i32", "num_blocks_ptr": "*i32", "sm_scale": "fp32"}
    if isinstance(config, ForwardConfig):
        signature = {"desc_q": desc, "desc_k": desc, "desc_v": desc, "out_ptr": f"*{elem}",
                     "out_row_stride": "i32", "heads_q": "i32", **table}
        fn, name = _block_attn_fwd_kernel, f"block_attn_fwd_d{config.HEAD_DIM}_g{config.GROUP}"
        aligned = ("out_row_stride",)
    else:
        signature = {"desc_q": desc, "desc_k": desc, "desc_v": desc, "desc_do": desc,
                     "dq_ptr": f"*{elem}", "dk_ptr": f"*{elem}", "dv_ptr": f"*{elem}",
                     "dq_row_stride": "i32", "dkv_row_stride": "i32",
                     "sinu_ptr": "*fp32" if config.ROTARY else f"*{elem}", "sinu_row_stride": "i32",
                     "heads_kv": "i32", **table}
        fn = _block_attn_bwd_kernel
        name = f"block_attn_bwd{'_rotary' if config.ROTARY else ''}_d{config.HEAD_DIM}_g{config.GROUP}"
        # sinu_row_stride is D, or dq's row stride without rotary: a multiple of 16 in every launch
        aligned = ("dq_row_stride", "dkv_row_stride", "sinu_row_stride")
    signature["CFG"] = "constexpr"
    roles = ("producer",) + tuple(f"consumer_wg{i}" for i in range(config.CONSUMERS))
    return KernelSpec(fn=fn, signature=signature, constexprs={"CFG": config}, num_warps=specs.WARPGROUP_WARPS,
                      num_stages=NUM_STAGES, name=name, role_names=roles, target="sm_90", aligned=aligned)
