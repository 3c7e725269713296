"""
Tutorial 6: attention with S, P and O in tensor memory (Blackwell, compiled, not run here)
==========================================================================================

Why. Tutorial 4 kept everything of the attention in the consumers' registers: the scores S, the
probabilities P (the A operand of ``P V``, which wgmma can read from registers) and the output
accumulator O. That is why it needed two 64-row consumers with 232 registers each. Blackwell's
``tcgen05.mma`` writes its result into **tensor memory** (TMEM, tutorial 5) and may also read its A
operand from there. So the original kernels (and FlashAttention-4) move the attention's state off
the registers:

- ``S = Q K^T`` lands in TMEM; the softmax warps read it out (``tcgen05.ld``), one thread per row;
- P is written back into TMEM: no shared memory round trip, and ``O += P V`` reads it as its A
  operand straight from there;
- O lives in TMEM for the whole KV loop; the rescale of the online softmax becomes a TMEM
  load-multiply-store (the *correction* step, which FlashAttention-4 gives its own warps).

How. Three roles around one 128-row Q tile (TMEM has 128 lanes: one query row per lane):

- a **load** warp streams K and V through rings with full/empty barriers, as in tutorial 2;
- an **MMA** warp, one thread issuing, per KV tile: ``S = Q K^T`` (its completion arrives on
  ``s_full`` and frees the K slot), then, once P is in TMEM, ``O += P V`` (arrives on ``o_done``
  and frees the V slot). The next S is issued only after ``p_full``, when the softmax has read
  this one;
- the **softmax** warpgroup (default task, 4 warps = 128 threads = 128 TMEM lanes) waits on
  ``s_full``, computes the new row maxima and P, waits on ``o_done`` of the previous tile (so the
  ``P V`` that read the old P and wrote O is finished), rescales O in TMEM, stores P and arrives on
  ``p_full``. After the last tile it normalizes O and
  stores it with TMA.

TMEM budget (per lane = query row): S takes 128 columns, P 64 (two fp16 per 32-bit cell), O
``HEAD_DIM``; allocations round up to a power of two, so the CTA takes all 512 (the inspect
report's ``tensor memory``). The originals lay P over S's columns (``tlx.storage_alias_spec``);
with µTLX 3.8 that alias of an fp16 buffer over an fp32 one fails to compile.

This is the simplest correct arrangement: the softmax of tile j and the MMAs of tile j+1 do not
overlap. The production kernels overlap two Q tiles (two softmax groups, as the TLX tutorials'
``NUM_MMA_GROUPS=2``) and skip the rescale when the maximum barely moved. Layout as tutorial 4:
fp16 ``[B*H, N, D]`` viewed as ``[B*H*N, D]``, N a multiple of 128. The GPU here is a Hopper
H200, so ``run_check`` refuses unless it finds a Blackwell GPU: compile-verified only.
"""
import math

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa.kernels.spec import KernelSpec
from jfa.specs import FWD_TOL

LOG2E = tl.constexpr(1.4426950408889634)
BLOCK_M = tl.constexpr(128)  # query rows per CTA: one per TMEM lane
SINGLE_WARP_REGISTERS = tl.constexpr(24)  # the load and MMA warps only issue instructions
DEFAULT_CONFIG = dict(HEAD_DIM=128, BLOCK_N=128, NUM_STAGES=2)


@triton.jit
def tmem_attention_kernel(q_desc, k_desc, v_desc, o_desc, seq_len, sm_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    dtype: tl.constexpr = tlx.dtype_of(q_desc)
    q_tile = tlx.local_alloc((BLOCK_M, HEAD_DIM), dtype, 1)
    k_ring = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, NUM_STAGES)
    v_ring = tlx.local_alloc((BLOCK_N, HEAD_DIM), dtype, NUM_STAGES)
    # S, P and O each take columns of their own: 128 + 64 (P's fp16 pairs) + HEAD_DIM, rounded up
    # to all 512 (the docstring says why P does not overlay S here).
    s_tmem = tlx.local_alloc((BLOCK_M, BLOCK_N), tl.float32, 1, tlx.storage_kind.tmem)
    p_tmem = tlx.local_alloc((BLOCK_M, BLOCK_N), dtype, 1, tlx.storage_kind.tmem)  # A of O += P V
    o_tmem = tlx.local_alloc((BLOCK_M, HEAD_DIM), tl.float32, 1, tlx.storage_kind.tmem)
    q_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    k_full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    k_empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    v_full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    v_empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    s_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # S(j) is in TMEM
    p_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # P(j) is in TMEM, O rescaled
    o_done = tlx.alloc_barriers(num_barriers=1, arrive_count=1)  # O += P(j) V(j) has completed
    head_row = tl.program_id(1) * seq_len
    q_row = head_row + tl.program_id(0) * BLOCK_M
    kv_tiles = seq_len // BLOCK_N

    with tlx.async_tasks():
        with tlx.async_task("default"):  # softmax and correction: one thread per query row
            qk_scale = sm_scale * LOG2E
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in range(kv_tiles):
                tlx.barrier_wait(s_full[0], j & 1)
                s = tlx.local_load(s_tmem[0])
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                p = tl.math.exp2(s * qk_scale - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
                if j > 0:  # O holds tiles < j under the old maxima: wait for P(j-1) V, rescale
                    tlx.barrier_wait(o_done[0], (j - 1) & 1)
                    o = tlx.local_load(o_tmem[0])
                    tlx.local_store(o_tmem[0], o * alpha[:, None])
                tlx.local_store(p_tmem[0], p.to(dtype))
                tlx.barrier_arrive(p_full[0])
            tlx.barrier_wait(o_done[0], (kv_tiles - 1) & 1)
            o = tlx.local_load(o_tmem[0])
            o_desc.store([q_row, 0], (o / l_i[:, None]).to(tlx.dtype_of(o_desc)))

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # MMA issuer
            tlx.barrier_wait(q_full[0], 0)
            for j in range(kv_tiles):
                slot = j % NUM_STAGES
                phase = (j // NUM_STAGES) & 1
                tlx.barrier_wait(k_full[slot], phase)
                tlx.async_dot(q_tile[0], tlx.local_trans(k_ring[slot]), s_tmem[0], use_acc=False,
                              mBarriers=[s_full[0], k_empty[slot]])
                tlx.barrier_wait(p_full[0], j & 1)
                tlx.barrier_wait(v_full[slot], phase)
                tlx.async_dot(p_tmem[0], v_ring[slot], o_tmem[0], use_acc=j > 0,
                              mBarriers=[o_done[0], v_empty[slot]])

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # TMA loads
            tile_bytes: tl.constexpr = BLOCK_N * HEAD_DIM * tlx.size_of(dtype)
            tlx.barrier_expect_bytes(q_full[0], BLOCK_M * HEAD_DIM * tlx.size_of(dtype))
            tlx.async_descriptor_load(q_desc, q_tile[0], [q_row, 0], q_full[0])
            for j in range(kv_tiles):
                slot = j % NUM_STAGES
                phase = (j // NUM_STAGES) & 1
                tlx.barrier_wait(k_empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(k_full[slot], tile_bytes)
                tlx.async_descriptor_load(k_desc, k_ring[slot], [head_row + j * BLOCK_N, 0], k_full[slot])
                tlx.barrier_wait(v_empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(v_full[slot], tile_bytes)
                tlx.async_descriptor_load(v_desc, v_ring[slot], [head_row + j * BLOCK_N, 0], v_full[slot])


def tmem_attention(q, k, v, out=None, sm_scale=None, **cfg):
    """softmax(q k^T * sm_scale) v for fp16 ``[B*H, N, D]`` CUDA tensors on a Blackwell GPU."""
    cfg = DEFAULT_CONFIG | cfg | {"HEAD_DIM": q.shape[-1]}
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if t.shape != q.shape or t.dim() != 3 or t.dtype != torch.float16 or not t.is_contiguous():
            raise ValueError(f"{arg} must be a contiguous float16 [B*H, N, D] tensor shaped like q, "
                             f"got {t.dtype} {tuple(t.shape)}")
    bh, seq_len, head_dim = q.shape
    if seq_len % BLOCK_M.value or seq_len % cfg["BLOCK_N"]:
        raise ValueError(f"N ({seq_len}) must be a multiple of {BLOCK_M.value} and of BLOCK_N ({cfg['BLOCK_N']})")
    o = torch.empty_like(q) if out is None else out
    descs = [TensorDescriptor(t.view(-1, head_dim), shape=[bh * seq_len, head_dim], strides=[head_dim, 1],
                              block_shape=[rows, head_dim])
             for t, rows in ((q, BLOCK_M.value), (k, cfg["BLOCK_N"]), (v, cfg["BLOCK_N"]), (o, BLOCK_M.value))]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    tmem_attention_kernel[(seq_len // BLOCK_M.value, bh)](*descs, seq_len, scale, **cfg)
    return o


def inspect_spec(**cfg) -> KernelSpec:
    """The kernel at `cfg` (defaults: DEFAULT_CONFIG), ready for `jfa.workbench.inspect.inspect` on sm_100."""
    cfg = DEFAULT_CONFIG | cfg
    m, d, n = BLOCK_M.value, cfg["HEAD_DIM"], cfg["BLOCK_N"]
    return KernelSpec(
        fn=tmem_attention_kernel,
        signature={"q_desc": f"tensordesc<fp16[{m},{d}]>", "k_desc": f"tensordesc<fp16[{n},{d}]>",
                   "v_desc": f"tensordesc<fp16[{n},{d}]>", "o_desc": f"tensordesc<fp16[{m},{d}]>",
                   "seq_len": "i32", "sm_scale": "fp32"},
        constexprs=cfg, num_warps=4, role_names=("softmax", "mma", "load"), target="sm_100")


def run_check(bh: int = 6, seq_len: int = 512, head_dim: int = 128, seed: int = 0) -> None:
    """On a Blackwell GPU: against an fp32 softmax reference, output poisoned. Elsewhere: refuse."""
    from tutorials import blackwell_tlx_available

    ready, why = blackwell_tlx_available()
    if not ready:
        raise RuntimeError(f"t06 is compiled, not run here: {why}")
    torch.manual_seed(seed)
    q, k, v = (torch.randn(bh, seq_len, head_dim, device="cuda", dtype=torch.float16) for _ in range(3))
    expected = torch.softmax(q.float() @ k.float().transpose(1, 2) / math.sqrt(head_dim), dim=-1) @ v.float()
    o = torch.full_like(q, float("nan"))
    tmem_attention(q, k, v, out=o)
    torch.testing.assert_close(o.float(), expected, **FWD_TOL)
    print(f"t06 check passed: [{bh}, {seq_len}, {head_dim}] against an fp32 reference")


if __name__ == "__main__":
    from tutorials import main

    main(inspect_spec, run_check, blackwell=True)
