"""Jagged flash-attention forward for Blackwell (sm_100) in TLX: compiled, not run here.

The workbench's GPU is a Hopper H200, so this kernel is compile-verified only
(`tests/test_fwd_sm100_compile.py`) and `jfa.jagged_attention` never dispatches to it. It shares
the Hopper forward's (`fwd_sm90`) building blocks: the tile list and its deal, a tile's geometry
(`tiles.query_tile`: which key tiles a 128-row query block visits, which of them need masks), the
load warp's producers (`producers.load_query_rows`, `load_key_tiles`) and rings, the visibility
test, the online-softmax step and the masked epilogue. What changes is where the attention's state
lives.

On Hopper two consumer warpgroups hold S, P and the output accumulator O in registers (64 query
rows each) and issue their own wgmma. On Blackwell, `tcgen05.mma` writes into tensor memory (TMEM,
128 lanes x 512 columns of 32 bits) and is issued by a single thread, so (as in tutorial 6):

- a **softmax** warpgroup (the default task; 128 threads = 128 TMEM lanes = one query row each)
  reads S from TMEM, masks it where the tile's geometry says so, runs the online-softmax step,
  rescales O in TMEM only when some row's reference maximum moved (otherwise alpha is exactly 1
  everywhere and the TMEM round trip is skipped), and writes P back into TMEM;
- an **MMA** warp issues S = Q K^T into TMEM and O += P V with P read from TMEM; MMA completion
  arrives on the barriers the other roles wait for (`s_full`, `o_done`) and frees ring slots;
- a **load** warp loads Q once per tile and streams the tile's key tiles through the K and V rings.

Per tile the softmax role ends with the masked row store of `epilogue.store_rows` (a TMA store
would write past the sequence end) after signalling `o_free`, so the MMA warp may start the next
tile's O. One head per tile, consecutive key tiles (`hooks.DEFAULT_FORK`); the forks, half tiles
and paired heads of the Hopper kernel are not written here. TMEM: S 128 columns, P 64
(fp16/bf16 pairs), O HEAD_DIM; the CTA takes all 512.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa import specs
from jfa.kernels.epilogue import store_rows
from jfa.kernels.hooks import DEFAULT_FORK
from jfa.kernels.masks import visible
from jfa.kernels.producers import load_key_tiles, load_query_rows
from jfa.kernels.ring import make_ring, ring_wait
from jfa.kernels.softmax import finalize_rows, online_softmax_step
from jfa.kernels.spec import TRITON_DTYPE_NAMES, KernelSpec
from jfa.kernels.tiles import Problem, query_tile, sm_major, tile_loop
from jfa.kernels.tma import rows_descriptor

BLOCK_M: tl.constexpr = tl.constexpr(128)  # query rows per tile: one per TMEM lane
BLOCK_N = 128  # keys per key tile: S takes 128 TMEM columns
KV_BUFFERS = 2
Q_BUFFERS: tl.constexpr = tl.constexpr(2)  # the next tile's Q lands while this one computes
SINGLE_WARP_REGISTERS: tl.constexpr = tl.constexpr(24)  # the load and MMA warps only issue
SOFTMAX_WARPS = specs.WARPGROUP_WARPS  # the default task: 4 warps, 128 threads
# At 1 stage Triton's software pipeliner leaves the loops as written: the roles order their work by
# their own mbarrier waits.
NUM_STAGES = 1


class ForwardConfig(NamedTuple):
    """The kernel's compile-time configuration (`forward_config`)."""

    HEAD_DIM: int
    BLOCK_N: int  # keys per key tile
    KV_BUFFERS: int  # K/V ring depth
    CAUSAL: bool
    HAS_WINDOW: bool
    BROADCAST_Q: bool


def forward_config(head_dim: int, *, causal: bool = False, window: int | None = None,
                   broadcast_q: bool = False) -> ForwardConfig:
    """The configuration of one problem class."""
    if head_dim not in specs.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {specs.SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return ForwardConfig(HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, KV_BUFFERS=KV_BUFFERS, CAUSAL=bool(causal),
                         HAS_WINDOW=window is not None, BROADCAST_Q=bool(broadcast_q))


@triton.jit
def _tile(tile, problem, CFG: tl.constexpr, FORK: tl.constexpr):
    """`tiles.query_tile` of a head-major tile with one head; each role decodes its own."""
    return query_tile(tile, problem, FORK, BLOCK_M, CFG.BLOCK_N, 1, CFG.CAUSAL, CFG.HAS_WINDOW, CFG.BROADCAST_Q,
                      False, False)


@triton.jit
def _fwd_sm100_kernel(desc_q, desc_k, desc_v, out_ptr, lse_ptr, q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr,
                      num_entries_ptr, stride_out_row, stride_lse_head, num_q_heads, q_blocks_per_seq,
                      broadcast_q_len, window, gqa_group, qk_scale_log2, CFG: tl.constexpr, FORK: tl.constexpr):
    # FORK is `hooks.DEFAULT_FORK`: consecutive key tiles and plain operand loads
    HEAD_DIM: tl.constexpr = CFG.HEAD_DIM
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    dtype: tl.constexpr = tlx.dtype_of(desc_q)
    Q_BYTES: tl.constexpr = BLOCK_M * HEAD_DIM * tlx.size_of(dtype)
    num_entries = tl.load(num_entries_ptr)
    problem = Problem(q_offsets_ptr, kv_offsets_ptr, tile_entries_ptr, num_entries, num_q_heads, q_blocks_per_seq,
                      broadcast_q_len, window, gqa_group, None)
    num_tiles = num_entries * num_q_heads
    loop_start, loop_end, loop_step = tile_loop(num_tiles, False)  # this program's tiles, every role

    q_buffers = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, Q_BUFFERS)
    k_buffers = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, CFG.KV_BUFFERS)
    v_buffers = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, CFG.KV_BUFFERS)
    s_tmem = tlx.local_alloc((BLOCK_M, BLOCK_N), tl.float32, 1, tlx.storage_kind.tmem)
    p_tmem = tlx.local_alloc((BLOCK_M, BLOCK_N), dtype, 1, tlx.storage_kind.tmem)  # A of O += P V
    o_tmem = tlx.local_alloc((BLOCK_M, HEAD_DIM), tl.float32, 1, tlx.storage_kind.tmem)
    q_ring = make_ring(q_buffers, Q_BUFFERS)
    k_ring = make_ring(k_buffers, CFG.KV_BUFFERS)
    v_ring = make_ring(v_buffers, CFG.KV_BUFFERS)
    # One-deep handshakes between the softmax and MMA roles, a phase per key tile (or per query tile).
    s_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # S of the current key tile is in TMEM
    p_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # its P is in TMEM, O rescaled
    o_done = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # its O += P V has completed
    o_free = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # a tile's O was read out

    with tlx.async_tasks():
        with tlx.async_task("default"):  # softmax, correction and epilogue: one thread per row
            kv_count = 0
            for step in range(loop_start, loop_end, loop_step):
                tile = _tile(step, problem, CFG, FORK)
                rows = tile.row_lo + tl.arange(0, BLOCK_M)
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                for n in range(tile.num_kv_tiles):
                    tlx.barrier_wait(s_full[0], kv_count & 1)
                    s = tlx.local_load(s_tmem[0])
                    if (n < tile.bulk_lo) | (n >= tile.bulk_hi):  # the peeled first tile and the edges
                        cols = FORK.key_tile_col(n, tile.first_col, tile.cursor, BLOCK_N) + tl.arange(0, BLOCK_N)
                        s = tl.where(visible(rows[:, None], cols[None, :], tile.q_len, tile.kv_len, window,
                                             CFG.CAUSAL, CFG.HAS_WINDOW), s, float("-inf"))
                    p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, qk_scale_log2, True)
                    if n > 0:  # wait for the previous P V (it read the old P and wrote O)
                        tlx.barrier_wait(o_done[0], (kv_count - 1) & 1)
                        if tl.min(alpha, 0) < 1.0:  # some row's reference moved: rescale O
                            o = tlx.local_load(o_tmem[0])
                            tlx.local_store(o_tmem[0], o * alpha[:, None])
                    tlx.local_store(p_tmem[0], p.to(dtype))
                    tlx.barrier_arrive(p_full[0])
                    kv_count += 1
                if tile.num_kv_tiles > 0:
                    tlx.barrier_wait(o_done[0], (kv_count - 1) & 1)
                    o = tlx.local_load(o_tmem[0])
                    tlx.barrier_arrive(o_free[0])
                    out, lse = finalize_rows(o, m_i, l_i, out_ptr.dtype.element_ty)
                else:  # the block sees no key at all: output 0, LSE -inf
                    out = tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty)
                    lse = tl.full([BLOCK_M], float("-inf"), tl.float32)
                store_rows(out_ptr, lse_ptr, out, lse, tile.out_row0, tile.row_lo, tile.q_len, tile.head,
                           stride_out_row, stride_lse_head, BLOCK_M, HEAD_DIM)

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # MMA issuer
            kv_count = 0
            q_count = 0
            tiles_done = 0
            for step in range(loop_start, loop_end, loop_step):
                tile = _tile(step, problem, CFG, FORK)
                if tile.num_kv_tiles > 0:
                    q_index = ring_wait(q_ring, q_count)
                    if tiles_done > 0:  # the previous tile's O must be read out before it is overwritten
                        tlx.barrier_wait(o_free[0], (tiles_done - 1) & 1)
                    for n in range(tile.num_kv_tiles):
                        k_index = ring_wait(k_ring, kv_count)
                        # MMA completion releases the K slot, and after the tile's last read, the Q slot
                        if n == tile.num_kv_tiles - 1:
                            tlx.async_dot(q_ring.buffers[q_index], tlx.local_trans(k_ring.buffers[k_index]),
                                          s_tmem[0], use_acc=False,
                                          mBarriers=[s_full[0], k_ring.empties[k_index], q_ring.empties[q_index]])
                        else:
                            tlx.async_dot(q_ring.buffers[q_index], tlx.local_trans(k_ring.buffers[k_index]),
                                          s_tmem[0], use_acc=False, mBarriers=[s_full[0], k_ring.empties[k_index]])
                        tlx.barrier_wait(p_full[0], kv_count & 1)
                        v_index = ring_wait(v_ring, kv_count)
                        tlx.async_dot(p_tmem[0], v_ring.buffers[v_index], o_tmem[0], use_acc=n > 0,
                                      mBarriers=[o_done[0], v_ring.empties[v_index]])
                        kv_count += 1
                    q_count += 1
                    tiles_done += 1

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # TMA loads
            kv_count = 0
            q_count = 0
            for step in range(loop_start, loop_end, loop_step):
                tile = _tile(step, problem, CFG, FORK)
                if tile.num_kv_tiles > 0:
                    load_query_rows(desc_q, q_ring, q_count, tile.q_row0, tile.head, 1, 0, 0, HEAD_DIM, Q_BYTES)
                    q_count += 1
                    kv_count = load_key_tiles(desc_k, desc_v, None, None, k_ring, v_ring, kv_count, tile, problem,
                                              1, HEAD_DIM, BLOCK_M, BLOCK_N, False, FORK)


# ---- host side ------------------------------------------------------------------------------------

def launch(q, k, v, out, lse, q_offsets, kv_offsets, schedule, config: ForwardConfig, *, programs: int,
           qk_scale_log2: float, window: int | None):
    """Run the kernel into `out` and `lse` on a Blackwell (sm_100) GPU (validated inputs, at least one
    output row and key); it refuses any other device.

    `schedule` is the query-tile list (`jfa.schedule.build_tile_schedule` with BLOCK_M rows and
    `config.BLOCK_N` keys per tile), `programs` the persistent grid and `qk_scale_log2` sm_scale * log2(e).
    """
    if not (q.is_cuda and sm_major(q.device) == 10):
        raise RuntimeError("fwd_sm100 is compiled, not run here: it needs a Blackwell (sm_100) GPU; "
                           "jfa.jagged_attention runs the Hopper kernel or the reference")
    q_heads = q.shape[1]
    _fwd_sm100_kernel[(programs,)](
        rows_descriptor(q, BLOCK_M.value), rows_descriptor(k, config.BLOCK_N), rows_descriptor(v, config.BLOCK_N),
        out, lse, q_offsets, kv_offsets, schedule.entries, schedule.num_entries, out.stride(0), lse.stride(0),
        q_heads, schedule.q_blocks_per_seq, q.shape[0] if config.BROADCAST_Q else 0, 0 if window is None else window,
        q_heads // k.shape[1], qk_scale_log2, num_warps=SOFTMAX_WARPS, num_stages=NUM_STAGES, CFG=config,
        FORK=DEFAULT_FORK)


def inspect_spec(config: ForwardConfig = forward_config(128), dtype: torch.dtype = torch.bfloat16) -> KernelSpec:
    """Compile-only description of one configuration for `jfa.workbench.inspect`, target sm_100."""
    if dtype not in specs.SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {specs.SUPPORTED_DTYPES}, got {dtype}")
    name = TRITON_DTYPE_NAMES[dtype]
    kv_box = f"tensordesc<{name}[{config.BLOCK_N}, {config.HEAD_DIM}]>"
    signature = dict(desc_q=f"tensordesc<{name}[{BLOCK_M.value}, {config.HEAD_DIM}]>", desc_k=kv_box,
                     desc_v=kv_box, out_ptr=f"*{name}", lse_ptr="*fp32", q_offsets_ptr="*i32",
                     kv_offsets_ptr="*i32", tile_entries_ptr="*i32", num_entries_ptr="*i32", stride_out_row="i32",
                     stride_lse_head="i32", num_q_heads="i32", q_blocks_per_seq="i32", broadcast_q_len="i32",
                     window="i32", gqa_group="i32", qk_scale_log2="fp32", CFG="constexpr", FORK="constexpr")
    return KernelSpec(fn=_fwd_sm100_kernel, signature=signature, constexprs=dict(CFG=config, FORK=DEFAULT_FORK),
                      num_warps=SOFTMAX_WARPS, num_stages=NUM_STAGES, name="fwd_sm100", aligned=("stride_out_row",),
                      role_names=("softmax", "mma", "load"), target="sm_100")
