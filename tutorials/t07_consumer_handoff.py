"""
Tutorial 7: two consumers, one output tile: a handoff through shared memory
===========================================================================

Why. Tutorial 3 gave each consumer warpgroup its own half of the output rows. Sometimes both
consumers produce partial results for the *same* output: split the K loop of a GEMM between them,
or, in the attention backward, both form a dQ piece for the same query rows (each from its own
keys). Each could add its partial into global memory (fp32 atomics, or a TMA reduce-add), but that
is two global read-modify-writes per tile. Handing one partial to the other through shared memory
needs only one. jfa's fused backward (`jfa.kernels.bwd_dkdv._split_dq_step`) goes one step further,
to tutorial 8's exchange: the consumers share their dS rather than their dQ partials, and each
consumer adds one half of dQ's columns, so every element of dQ leaves once per key tile.

How. ``C = A @ B`` with a ``[BLOCK_M, BLOCK_N]`` tile of C per program, and the K loop split
between two consumers: consumer c takes the k-steps ``c, c + 2, c + 4, ...``. The producer streams
every k-step's A and B tiles through one ring (tutorial 2); each stage is read by one consumer
only, so its ``empty`` barrier needs one arrival. After its last k-step:

- consumer 1 stores its fp32 accumulator into a shared-memory ``partial`` buffer with ordinary
  stores and arrives on the ``partial_full`` mbarrier;
- consumer 0 waits on ``partial_full``, adds the partial to its own accumulator, and writes the
  tile once.

A program here makes one tile, so one buffer and one barrier suffice. A loop over tiles (the
backward's loop over query blocks) reuses the buffer, and then it is a ring like any other:
``full``/``empty`` pairs and ``ring_slot`` phases, with consumer 1 as the producer.
"""
import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.kernels.spec import KernelSpec
from tutorials import check_gemm, gemm_operands

NUM_CONSUMERS = tl.constexpr(2)  # consumer warpgroups, each taking every other k-step
CONSUMER_REGISTERS = tl.constexpr(232)  # consumer 0 holds its accumulator and the partial: 2 x 64
DEFAULT_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, NUM_STAGES=4)


@triton.jit
def split_k_gemm_kernel(a_desc, b_desc, c_desc, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    a_ring = tlx.local_alloc((BLOCK_M, BLOCK_K), tlx.dtype_of(a_desc), NUM_STAGES)
    b_ring = tlx.local_alloc((BLOCK_K, BLOCK_N), tlx.dtype_of(b_desc), NUM_STAGES)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)  # one reader per stage
    partial = tlx.local_alloc((BLOCK_M, BLOCK_N), tl.float32, 1)
    partial_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: every k-step, whichever consumer will read it
            elem_bytes: tl.constexpr = tlx.size_of(tlx.dtype_of(a_desc))
            for k in range(k_tiles):
                slot = k % NUM_STAGES
                phase = (k // NUM_STAGES) & 1
                tlx.barrier_wait(empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(full[slot], (BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * elem_bytes)
                tlx.async_descriptor_load(a_desc, a_ring[slot], [off_m, k * BLOCK_K], full[slot])
                tlx.async_descriptor_load(b_desc, b_ring[slot], [k * BLOCK_K, off_n], full[slot])

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=NUM_CONSUMERS):
            consumer: tl.constexpr = tlx.async_task_replica_id()
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(consumer, k_tiles, NUM_CONSUMERS):
                slot = k % NUM_STAGES
                phase = (k // NUM_STAGES) & 1
                tlx.barrier_wait(full[slot], phase)
                acc = tlx.async_dot(a_ring[slot], b_ring[slot], acc)
                acc = tlx.async_dot_wait(0, acc)  # the stage is free once the wgmma has read it
                tlx.barrier_arrive(empty[slot])
            if consumer == 1:
                # The arrive follows a warpgroup barrier, so all 128 threads' stores precede it.
                tlx.local_store(partial[0], acc)
                tlx.barrier_arrive(partial_full[0])
            else:
                tlx.barrier_wait(partial_full[0], 0)  # the barrier's first phase: completed once
                acc += tlx.local_load(partial[0])
                c_desc.store([off_m, off_n], acc.to(tlx.dtype_of(c_desc)))


def split_k_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, **cfg) -> torch.Tensor:
    """``a @ b`` for fp16 CUDA matrices (fp32 accumulation), written into `out` (or a new tensor)."""
    cfg = DEFAULT_CONFIG | cfg
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    c, a_desc, b_desc, c_desc = gemm_operands(a, b, out, (bm, bk), (bk, bn), (bm, bn))
    split_k_gemm_kernel[(triton.cdiv(c.shape[0], bm), triton.cdiv(c.shape[1], bn))](a_desc, b_desc, c_desc,
                                                                                    a.shape[1], **cfg)
    return c


def inspect_spec(**cfg) -> KernelSpec:
    """The kernel at `cfg` (defaults: DEFAULT_CONFIG), ready for `jfa.workbench.inspect.inspect`."""
    cfg = DEFAULT_CONFIG | cfg
    return KernelSpec(
        fn=split_k_gemm_kernel,
        signature={"a_desc": f"tensordesc<fp16[{cfg['BLOCK_M']},{cfg['BLOCK_K']}]>",
                   "b_desc": f"tensordesc<fp16[{cfg['BLOCK_K']},{cfg['BLOCK_N']}]>",
                   "c_desc": f"tensordesc<fp16[{cfg['BLOCK_M']},{cfg['BLOCK_N']}]>", "K": "i32"},
        constexprs=cfg, num_warps=4, role_names=("producer", "consumer0", "consumer1"), target="sm_90")


def run_check(M: int = 1000, N: int = 776, K: int = 1440, seed: int = 0) -> None:
    """Against an fp32 torch matmul on fresh random data, `c` poisoned. K covers an odd number of
    k-steps (the last one partial), so consumer 0 takes one more than consumer 1."""
    check_gemm(split_k_gemm, "t07", M, N, K, seed)


if __name__ == "__main__":
    from tutorials import main

    main(inspect_spec, run_check)
