"""Jagged flash-attention forward for Blackwell (sm_100) in TLX: compiled, not run here.

The original kernels target Blackwell; this workbench's GPU is a Hopper H200, so this module is
compile-verified only (`tests/test_jagged_fwd_sm100_compile.py`) and `jfa.jagged_attention` never
dispatches to it. It is a fork of the Hopper forward (`jagged_fwd`) in its warp roles, not in its
schedule: the tile list, the tile geometry (which key tiles a 128-row query block visits, which of
them need masks), the K/V ring and its producer, the online-softmax step and the masked epilogue
are `jagged_fwd`'s and `common`'s, imported. What changes is where the attention's state lives.

On Hopper two consumer warpgroups hold S, P and the output accumulator O in registers (64 query
rows each) and issue their own wgmma. On Blackwell, `tcgen05.mma` writes into tensor memory (TMEM,
128 lanes x 512 columns of 32 bits) and is issued by a single thread, so (as in tutorial 6):

- a **softmax** warpgroup (the default task; 128 threads = 128 TMEM lanes = one query row each)
  reads S from TMEM, masks it where the geometry says so, runs the online-softmax step, rescales O
  in TMEM only when some row's reference maximum moved (the conditional rescale: otherwise alpha is
  exactly 1 everywhere and the TMEM round trip is skipped), and writes P back into TMEM;
- an **MMA** warp issues S = Q K^T into TMEM and O += P V with P read from TMEM; MMA completion
  arrives on the barriers the other roles wait for (`s_full`, `o_done`) and frees ring slots;
- a **load** warp runs `jagged_fwd`'s producer steps: Q once per tile, K and V through the ring.

Per tile the softmax role ends with the masked row store of `common.store_rows` (a TMA store
would write past the sequence end) after signalling `o_free`, so the MMA warp may start the next
tile's O. One head per tile; the block-sparse, FP8 and half-tile variants of the Hopper kernel are
not forked here. TMEM: S 128 columns, P 64 (fp16/bf16 pairs), O HEAD_DIM; the CTA takes all 512.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels.common import (LOG2E, finalize_rows, online_softmax_step, persistent_programs, ring_slot,
                                rows_descriptor, sm_major, store_rows, visible_mask)
from jfa.kernels.jagged_fwd import (_SIGNATURE_AFTER_OUT, _TRITON_DTYPE_NAMES, _produce_kv_tile,
                                    _tile_geometry, _tile_loop)
from jfa.schedule import build_tile_schedule

BLOCK_M: tl.constexpr = tl.constexpr(128)  # query rows per tile: one per TMEM lane
BLOCK_N = 128  # keys per KV tile: S takes 128 TMEM columns
NUM_KV_BUFFERS = 2
NUM_Q_BUFFERS: tl.constexpr = tl.constexpr(2)  # the next tile's Q lands while this one computes
SINGLE_WARP_REGISTERS: tl.constexpr = tl.constexpr(24)  # the load and MMA warps only issue
SOFTMAX_WARPS = specs.WARPGROUP_WARPS  # the default task: 4 warps, 128 threads
NUM_STAGES = 1  # compiled (never run) as written; Blackwell's pipeliner passes were not studied here


@triton.jit
def _blackwell_tile(tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr, num_q_heads,
                    q_blocks_per_seq, broadcast_q_len, window, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr):
    """`jagged_fwd._tile_geometry` of a head-major tile with one head per tile and consecutive key
    tiles (no block-sparse selection, half tiles or FP8): (head, q_row0, out_row0, row_lo, q_len,
    kv_start, kv_len, first_col, num_kv_tiles, bulk_lo, bulk_hi). Each role decodes its own tile."""
    (head, q_key, q_row0, out_row0, row_lo, q_len, kv_start, v_start, kv_len, first_col, selected,
     num_kv_tiles, bulk_lo, bulk_hi, half_tail) = _tile_geometry(
         tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr, None, None, 0, num_q_heads,
         q_blocks_per_seq, broadcast_q_len, window, BLOCK_M, BLOCK_N, 1, CAUSAL, HAS_WINDOW, BROADCAST_Q,
         False, False, False, 1)
    return head, q_row0, out_row0, row_lo, q_len, kv_start, kv_len, first_col, num_kv_tiles, bulk_lo, bulk_hi


@triton.jit
def _jagged_fwd_sm100_kernel(desc_q, desc_k, desc_v, out_ptr, lse_ptr, q_offsets_ptr, kv_offsets_ptr,
                             tile_entries_ptr, num_entries_ptr, stride_out_row, stride_lse_head,
                             num_q_heads, q_blocks_per_seq, broadcast_q_len, window, gqa_group,
                             qk_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BROADCAST_Q: tl.constexpr,
                             NUM_KV_BUFFERS: tl.constexpr):
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    num_entries = tl.load(num_entries_ptr)
    num_tiles = num_entries * num_q_heads
    first_tile = tl.program_id(0)
    tile_stride = tl.num_programs(0)

    q_tiles = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, NUM_Q_BUFFERS)
    k_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, NUM_KV_BUFFERS)
    v_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, NUM_KV_BUFFERS)
    s_tmem = tlx.local_alloc((BLOCK_M, BLOCK_N), tl.float32, 1, tlx.storage_kind.tmem)
    p_tmem = tlx.local_alloc((BLOCK_M, BLOCK_N), dtype, 1, tlx.storage_kind.tmem)  # A of O += P V
    o_tmem = tlx.local_alloc((BLOCK_M, HEAD_DIM), tl.float32, 1, tlx.storage_kind.tmem)
    q_fulls = tlx.alloc_barriers(num_barriers=NUM_Q_BUFFERS, arrive_count=1)
    q_empties = tlx.alloc_barriers(num_barriers=NUM_Q_BUFFERS, arrive_count=1)
    k_fulls = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS, arrive_count=1)
    k_empties = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS, arrive_count=1)
    v_fulls = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS, arrive_count=1)
    v_empties = tlx.alloc_barriers(num_barriers=NUM_KV_BUFFERS, arrive_count=1)
    s_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # S of the current key tile is in TMEM
    p_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # its P is in TMEM, O rescaled
    o_done = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # its O += P V has completed
    o_free = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # a tile's O was read out

    with tlx.async_tasks():
        with tlx.async_task("default"):  # softmax, correction and epilogue: one thread per row
            kv_count = 0
            loop_start, loop_end, loop_step = _tile_loop(num_tiles, first_tile, tile_stride, False)
            for tile in range(loop_start, loop_end, loop_step):
                (head, q_row0, out_row0, row_lo, q_len, kv_start, kv_len, first_col, num_kv_tiles, bulk_lo,
                 bulk_hi) = _blackwell_tile(tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr,
                                            num_q_heads, q_blocks_per_seq, broadcast_q_len, window, BLOCK_N,
                                            CAUSAL, HAS_WINDOW, BROADCAST_Q)
                rows = row_lo + tl.arange(0, BLOCK_M)
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                for n in range(num_kv_tiles):
                    tlx.barrier_wait(s_full[0], kv_count & 1)
                    s = tlx.local_load(s_tmem[0])
                    if (n < bulk_lo) | (n >= bulk_hi):  # the peeled first tile and the edges
                        cols = first_col + n * BLOCK_N + tl.arange(0, BLOCK_N)
                        s = tl.where(visible_mask(rows, cols, q_len, kv_len, window, CAUSAL, HAS_WINDOW),
                                     s, float("-inf"))
                    p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, qk_scale_log2, True)
                    if n > 0:  # wait for the previous P V (it read the old P and wrote O)
                        tlx.barrier_wait(o_done[0], (kv_count - 1) & 1)
                        if tl.min(alpha, 0) < 1.0:  # some row's reference moved: rescale O
                            o = tlx.local_load(o_tmem[0])
                            tlx.local_store(o_tmem[0], o * alpha[:, None])
                    tlx.local_store(p_tmem[0], p.to(dtype))
                    tlx.barrier_arrive(p_full[0])
                    kv_count += 1
                if num_kv_tiles > 0:
                    tlx.barrier_wait(o_done[0], (kv_count - 1) & 1)
                    o = tlx.local_load(o_tmem[0])
                    tlx.barrier_arrive(o_free[0])
                    out, lse = finalize_rows(o, m_i, l_i, out_ptr.dtype.element_ty)
                else:  # the block sees no key at all: output 0, LSE -inf
                    out = tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty)
                    lse = tl.full([BLOCK_M], float("-inf"), tl.float32)
                store_rows(out_ptr, lse_ptr, out, lse, out_row0, row_lo, q_len, head, stride_out_row,
                           stride_lse_head, BLOCK_M, HEAD_DIM)

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # MMA issuer
            kv_count = 0
            q_count = 0
            tiles_done = 0
            loop_start, loop_end, loop_step = _tile_loop(num_tiles, first_tile, tile_stride, False)
            for tile in range(loop_start, loop_end, loop_step):
                (head, q_row0, out_row0, row_lo, q_len, kv_start, kv_len, first_col, num_kv_tiles, bulk_lo,
                 bulk_hi) = _blackwell_tile(tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr,
                                            num_q_heads, q_blocks_per_seq, broadcast_q_len, window, BLOCK_N,
                                            CAUSAL, HAS_WINDOW, BROADCAST_Q)
                if num_kv_tiles > 0:
                    q_slot, q_phase = ring_slot(q_count, NUM_Q_BUFFERS)
                    tlx.barrier_wait(q_fulls[q_slot], q_phase)
                    if tiles_done > 0:  # the previous tile's O must be read out before it is overwritten
                        tlx.barrier_wait(o_free[0], (tiles_done - 1) & 1)
                    for n in range(num_kv_tiles):
                        slot, phase = ring_slot(kv_count, NUM_KV_BUFFERS)
                        tlx.barrier_wait(k_fulls[slot], phase)
                        if n == num_kv_tiles - 1:  # the tile's last read of Q frees its buffer
                            tlx.async_dot(q_tiles[q_slot], tlx.local_trans(k_tiles[slot]), s_tmem[0],
                                          use_acc=False, mBarriers=[s_full[0], k_empties[slot], q_empties[q_slot]])
                        else:
                            tlx.async_dot(q_tiles[q_slot], tlx.local_trans(k_tiles[slot]), s_tmem[0],
                                          use_acc=False, mBarriers=[s_full[0], k_empties[slot]])
                        tlx.barrier_wait(p_full[0], kv_count & 1)
                        tlx.barrier_wait(v_fulls[slot], phase)
                        tlx.async_dot(p_tmem[0], v_tiles[slot], o_tmem[0], use_acc=n > 0,
                                      mBarriers=[o_done[0], v_empties[slot]])
                        kv_count += 1
                    q_count += 1
                    tiles_done += 1

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # TMA loads
            kv_count = 0
            q_count = 0
            loop_start, loop_end, loop_step = _tile_loop(num_tiles, first_tile, tile_stride, False)
            for tile in range(loop_start, loop_end, loop_step):
                (head, q_row0, out_row0, row_lo, q_len, kv_start, kv_len, first_col, num_kv_tiles, bulk_lo,
                 bulk_hi) = _blackwell_tile(tile, tile_entries_ptr, num_entries, q_offsets_ptr, kv_offsets_ptr,
                                            num_q_heads, q_blocks_per_seq, broadcast_q_len, window, BLOCK_N,
                                            CAUSAL, HAS_WINDOW, BROADCAST_Q)
                if num_kv_tiles > 0:
                    q_slot, q_phase = ring_slot(q_count, NUM_Q_BUFFERS)
                    tlx.barrier_wait(q_empties[q_slot], q_phase ^ 1)
                    tlx.barrier_expect_bytes(q_fulls[q_slot], BLOCK_M * HEAD_DIM * tlx.size_of(dtype))
                    tlx.async_descriptor_load(desc_q, q_tiles[q_slot], [q_row0, head * HEAD_DIM], q_fulls[q_slot])
                    q_count += 1
                    for n in range(num_kv_tiles):
                        key_col = first_col + n * BLOCK_N
                        _produce_kv_tile(desc_k, desc_v, k_tiles, v_tiles, k_fulls, k_empties, v_fulls,
                                         v_empties, kv_count, kv_start + key_col, kv_start + key_col, head,
                                         gqa_group, HEAD_DIM, NUM_KV_BUFFERS, 1, BLOCK_N)
                        kv_count += 1


def kernel_config(head_dim: int, *, causal: bool = False, window: int | None = None,
                  broadcast_q: bool = False) -> dict:
    """The kernel's constexprs for one problem class."""
    if head_dim not in specs.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {specs.SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return dict(HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                BROADCAST_Q=bool(broadcast_q), NUM_KV_BUFFERS=NUM_KV_BUFFERS)


def jagged_attention_fwd_sm100(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale,
                               causal=False, window=None, broadcast_q=False):
    """Launch on a Blackwell (sm_100) GPU: (out `[Tq_out, Hq, D]`, lse fp32 `[Hq, Tq_out]`).

    Inputs as `jagged_fwd.jagged_attention_fwd` takes them (validated, int32 offsets on q's device).
    Compiled, never run here: it refuses anything but an sm_100 device.
    """
    if not (q.is_cuda and sm_major(q.device) == 10):
        raise RuntimeError("jagged_attention_fwd_sm100 is compiled, not run here: it needs a Blackwell "
                           "(sm_100) GPU; jfa.jagged_attention runs the Hopper kernel or the reference")
    num_seqs = kv_offsets.numel() - 1
    q_heads, head_dim = q.shape[1], q.shape[2]
    q_len = q.shape[0] if broadcast_q else 0
    out_rows = num_seqs * q_len if broadcast_q else q.shape[0]
    out = torch.empty((out_rows, q_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((q_heads, out_rows), dtype=torch.float32, device=q.device)
    config = kernel_config(head_dim, causal=causal, window=window, broadcast_q=broadcast_q)
    schedule = build_tile_schedule(q_offsets, kv_offsets, max_seq_len_q=max_seq_len_q, block_m=BLOCK_M.value,
                                   block_n=BLOCK_N, causal=causal, window=window, broadcast_q=broadcast_q,
                                   max_seq_len_kv=max_seq_len_kv)
    grid = (persistent_programs(q.device, schedule.max_entries * q_heads),)
    _jagged_fwd_sm100_kernel[grid](
        rows_descriptor(q, BLOCK_M.value), rows_descriptor(k, BLOCK_N), rows_descriptor(v, BLOCK_N),
        out, lse, q_offsets, kv_offsets, schedule.entries, schedule.num_entries, out.stride(0), lse.stride(0),
        q_heads, schedule.q_blocks_per_seq, q_len, 0 if window is None else window, q_heads // k.shape[1],
        sm_scale * LOG2E.value, num_warps=SOFTMAX_WARPS, num_stages=NUM_STAGES, **config)
    return out, lse


def inspect_spec(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                 window: int | None = None, broadcast_q: bool = False):
    """Compile-only description of one configuration for `jfa.inspect.inspect`, target sm_100."""
    from jfa.kernels.spec import KernelSpec

    if dtype not in specs.SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {specs.SUPPORTED_DTYPES}, got {dtype}")
    constexprs = kernel_config(head_dim, causal=causal, window=window, broadcast_q=broadcast_q)
    name = _TRITON_DTYPE_NAMES[dtype]
    kv_box = f"tensordesc<{name}[{BLOCK_N}, {head_dim}]>"
    signature = dict(desc_q=f"tensordesc<{name}[{BLOCK_M.value}, {head_dim}]>", desc_k=kv_box, desc_v=kv_box,
                     out_ptr=f"*{name}",
                     **{k: v for k, v in _SIGNATURE_AFTER_OUT.items() if k not in ("sel_q_blocks", "acc_scale")})
    signature.update({k: "constexpr" for k in constexprs})
    return KernelSpec(fn=_jagged_fwd_sm100_kernel, signature=signature, constexprs=constexprs,
                      num_warps=SOFTMAX_WARPS, num_stages=NUM_STAGES, name="jagged_fwd_sm100",
                      aligned=("stride_out_row",),
                      role_names=("softmax", "mma", "load"), target="sm_100")
