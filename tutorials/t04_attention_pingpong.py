"""
Tutorial 4: attention forward, one consumer, then two in ping-pong
==================================================================

Why. Attention alternates two kinds of work per KV tile: tensor-core GEMMs (``S = Q K^T``,
``O += P V``) and element-wise softmax math on the CUDA cores (max, exp2, sums, rescale). One
warpgroup doing both leaves the tensor cores idle during its softmax. Two consumer warpgroups,
each owning half of the rows, can take turns: while one runs its softmax, the other's GEMM keeps
the tensor cores busy. That is **ping-pong** scheduling (FlashAttention-3's and the TLX tutorials').

How. The skeleton is tutorials 1-3: a producer loads the Q tile(s) once, then streams K and V
through rings with full/empty barriers; consumers compute. The online softmax keeps, per row,
the running max ``m`` and sum ``l`` and rescales the accumulator when the max grows. It works in
base 2: ``exp(x * sm_scale) == exp2(x * sm_scale * log2(e))``, and ``exp2`` is one hardware
instruction (``ex2``) where ``exp`` is a multiply plus ``ex2``.

``PINGPONG`` is a constexpr switch:

- ``False``: one consumer warpgroup per CTA, 64 query rows.
- ``True``: two consumers per CTA (``replicate=2``), 64 rows each. Two *named barriers* (CTA
  hardware barriers addressed by id, completed when 256 threads = both warpgroups have arrived)
  make them issue their ``Q K^T`` GEMMs in strict alternation: consumer 0 waits on
  ``TURN_OF_CONSUMER0``, which consumer 1 arrives at after issuing its own GEMM, and vice versa.

Layout: q, k, v, o are ``[B*H, N, D]`` fp16, viewed as ``[B*H*N, D]`` for TMA; N must be a
multiple of the CTA's rows and of BLOCK_N so that no tile straddles two heads.
"""
import math

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa.kernels.spec import KernelSpec
from jfa.specs import FWD_TOL, attention_flops, tflops

LOG2E = tl.constexpr(1.4426950408889634)
ROWS_PER_CONSUMER = tl.constexpr(64)  # one wgmma M-tile per warpgroup
CONSUMER_REGISTERS = tl.constexpr(232)
TURN_OF_CONSUMER0 = tl.constexpr(9)  # named-barrier ids; the compiler uses the low ids itself
TURN_OF_CONSUMER1 = tl.constexpr(10)
PAIR_THREADS = tl.constexpr(256)  # both consumer warpgroups take part in each named barrier
DEFAULT_CONFIG = dict(HEAD_DIM=64, BLOCK_N=64, NUM_STAGES=2, PINGPONG=True)


@triton.jit
def attention_fwd_kernel(q_desc, k_desc, v_desc, o_desc, seq_len, sm_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
                         PINGPONG: tl.constexpr):
    NUM_CONSUMERS: tl.constexpr = 2 if PINGPONG else 1
    q_tiles = tlx.local_alloc((ROWS_PER_CONSUMER, HEAD_DIM), tlx.dtype_of(q_desc), NUM_CONSUMERS)
    k_ring = tlx.local_alloc((BLOCK_N, HEAD_DIM), tlx.dtype_of(k_desc), NUM_STAGES)
    v_ring = tlx.local_alloc((BLOCK_N, HEAD_DIM), tlx.dtype_of(v_desc), NUM_STAGES)
    q_full = tlx.alloc_barriers(num_barriers=NUM_CONSUMERS, arrive_count=1)
    k_full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    k_empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=NUM_CONSUMERS)
    v_full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    v_empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=NUM_CONSUMERS)
    head_row = tl.program_id(1) * seq_len  # first row of this (batch, head) in the 2-D view
    q_row = head_row + tl.program_id(0) * NUM_CONSUMERS * ROWS_PER_CONSUMER
    kv_tiles = seq_len // BLOCK_N
    tile_bytes: tl.constexpr = BLOCK_N * HEAD_DIM * tlx.size_of(tlx.dtype_of(k_desc))

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: Q once, then K and V tile by tile
            for c in tl.static_range(NUM_CONSUMERS):
                tlx.barrier_expect_bytes(q_full[c], ROWS_PER_CONSUMER * HEAD_DIM * tlx.size_of(tlx.dtype_of(q_desc)))
                tlx.async_descriptor_load(q_desc, q_tiles[c], [q_row + c * ROWS_PER_CONSUMER, 0], q_full[c])
            for j in range(kv_tiles):
                slot = j % NUM_STAGES
                phase = (j // NUM_STAGES) & 1
                tlx.barrier_wait(k_empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(k_full[slot], tile_bytes)
                tlx.async_descriptor_load(k_desc, k_ring[slot], [head_row + j * BLOCK_N, 0], k_full[slot])
                tlx.barrier_wait(v_empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(v_full[slot], tile_bytes)
                tlx.async_descriptor_load(v_desc, v_ring[slot], [head_row + j * BLOCK_N, 0], v_full[slot])

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=NUM_CONSUMERS):
            consumer = tlx.async_task_replica_id()
            qk_scale = sm_scale * LOG2E
            m_i = tl.full([ROWS_PER_CONSUMER], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([ROWS_PER_CONSUMER], dtype=tl.float32)
            acc = tl.zeros([ROWS_PER_CONSUMER, HEAD_DIM], dtype=tl.float32)
            tlx.barrier_wait(q_full[consumer], 0)
            if PINGPONG and consumer == 1:
                tlx.named_barrier_arrive(TURN_OF_CONSUMER0, PAIR_THREADS)  # consumer 0 goes first
            for j in range(kv_tiles):
                slot = j % NUM_STAGES
                phase = (j // NUM_STAGES) & 1
                tlx.barrier_wait(k_full[slot], phase)
                if PINGPONG:
                    if consumer == 0:
                        tlx.named_barrier_wait(TURN_OF_CONSUMER0, PAIR_THREADS)
                    else:
                        tlx.named_barrier_wait(TURN_OF_CONSUMER1, PAIR_THREADS)
                qk = tlx.async_dot(q_tiles[consumer], tlx.local_trans(k_ring[slot]))
                if PINGPONG:  # GEMM issued: hand the tensor cores to the other consumer
                    if consumer == 0:
                        tlx.named_barrier_arrive(TURN_OF_CONSUMER1, PAIR_THREADS)
                    else:
                        tlx.named_barrier_arrive(TURN_OF_CONSUMER0, PAIR_THREADS)
                qk = tlx.async_dot_wait(0, qk)
                tlx.barrier_arrive(k_empty[slot])
                # Online softmax in base 2: rescale what was accumulated under the old max.
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                p = tl.math.exp2(qk * qk_scale - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                m_i = m_new
                tlx.barrier_wait(v_full[slot], phase)
                acc = tlx.async_dot(p.to(tlx.dtype_of(v_desc)), v_ring[slot], acc)
                acc = tlx.async_dot_wait(0, acc)
                tlx.barrier_arrive(v_empty[slot])
            o_desc.store([q_row + consumer * ROWS_PER_CONSUMER, 0], (acc / l_i[:, None]).to(tlx.dtype_of(o_desc)))


def attention_fwd(q, k, v, out=None, sm_scale=None, **cfg):
    """softmax(q k^T * sm_scale) v for fp16 ``[B*H, N, D]`` CUDA tensors, into `out` (or a new tensor)."""
    cfg = DEFAULT_CONFIG | cfg | {"HEAD_DIM": q.shape[-1]}
    rows_per_cta = ROWS_PER_CONSUMER.value * (2 if cfg["PINGPONG"] else 1)
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if t.shape != q.shape or t.dim() != 3 or t.dtype != torch.float16 or not t.is_contiguous():
            raise ValueError(f"{arg} must be a contiguous float16 [B*H, N, D] tensor shaped like q, "
                             f"got {t.dtype} {tuple(t.shape)}")
    bh, seq_len, head_dim = q.shape
    if seq_len % rows_per_cta or seq_len % cfg["BLOCK_N"]:
        raise ValueError(f"N ({seq_len}) must be a multiple of {rows_per_cta} and of BLOCK_N ({cfg['BLOCK_N']})")
    o = torch.empty_like(q) if out is None else out
    descs = [TensorDescriptor(t.view(-1, head_dim), shape=[bh * seq_len, head_dim], strides=[head_dim, 1],
                              block_shape=[rows, head_dim])
             for t, rows in ((q, ROWS_PER_CONSUMER.value), (k, cfg["BLOCK_N"]), (v, cfg["BLOCK_N"]),
                             (o, ROWS_PER_CONSUMER.value))]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    attention_fwd_kernel[(seq_len // rows_per_cta, bh)](*descs, seq_len, scale, **cfg)
    return o


def inspect_spec(**cfg) -> KernelSpec:
    """The kernel at `cfg` (defaults: DEFAULT_CONFIG), ready for `jfa.workbench.inspect.inspect`."""
    cfg = DEFAULT_CONFIG | cfg
    rows, d, n = ROWS_PER_CONSUMER.value, cfg["HEAD_DIM"], cfg["BLOCK_N"]
    roles = ("producer", "consumer0", "consumer1") if cfg["PINGPONG"] else ("producer", "consumer")
    return KernelSpec(
        fn=attention_fwd_kernel,
        signature={"q_desc": f"tensordesc<fp16[{rows},{d}]>", "k_desc": f"tensordesc<fp16[{n},{d}]>",
                   "v_desc": f"tensordesc<fp16[{n},{d}]>", "o_desc": f"tensordesc<fp16[{rows},{d}]>",
                   "seq_len": "i32", "sm_scale": "fp32"},
        constexprs=cfg, num_warps=4, role_names=roles, target="sm_90")


def run_check(bh: int = 6, seq_len: int = 512, head_dim: int = 64, seed: int = 0) -> None:
    """Both schedules against an fp32 softmax reference; outputs poisoned, every element checked."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(bh, seq_len, head_dim, device="cuda", dtype=torch.float16) for _ in range(3))
    scores = q.float() @ k.float().transpose(1, 2) / math.sqrt(head_dim)
    expected = torch.softmax(scores, dim=-1) @ v.float()
    for pingpong in (False, True):
        o = torch.full_like(q, float("nan"))
        attention_fwd(q, k, v, out=o, PINGPONG=pingpong)
        torch.testing.assert_close(o.float(), expected, **FWD_TOL, msg=lambda m: f"PINGPONG={pingpong}: {m}")
    print(f"t04 check passed: [{bh}, {seq_len}, {head_dim}], one consumer and ping-pong")


def bench(bh: int = 128, seq_len: int = 4096, head_dim: int = 128) -> dict:
    """TFLOP/s of both schedules on one dense shape."""
    q, k, v = (torch.randn(bh, seq_len, head_dim, device="cuda", dtype=torch.float16) for _ in range(3))
    flops = attention_flops([seq_len] * bh, [seq_len] * bh, heads=1, head_dim=head_dim)
    result = {}
    for pingpong in (False, True):
        ms = triton.testing.do_bench(lambda: attention_fwd(q, k, v, PINGPONG=pingpong, BLOCK_N=head_dim))
        result[pingpong] = tflops(flops, ms)
        print(f"  PINGPONG={pingpong}: {ms:.3f} ms, {result[pingpong]:.0f} TFLOP/s")
    return result


if __name__ == "__main__":
    from tutorials import main

    main(inspect_spec, run_check, bench)
