"""
Tutorial 5: the accumulator moves to tensor memory (Blackwell, compiled, not run here)
======================================================================================

Why. In tutorial 3 the wgmma accumulator lived in the consumer's registers: 64 of them per thread
for a 64x128 fp32 tile, which is why consumers needed big register budgets and why two of them
were needed to cover a 128-row tile. Blackwell (sm_100) adds **tensor memory (TMEM)**: 128 lanes x
512 columns of 32-bit cells per SM, written directly by the tensor cores. Its MMA, ``tcgen05.mma``,
reads A and B from shared memory and accumulates into TMEM, and a *single thread* issues it. The
math no longer needs a warpgroup holding registers; registers are only needed when the result is
read out (``tcgen05.ld``) for the epilogue.

How. The roles change shape accordingly:

- a **load** warp (1 warp, 24 registers) streams A and B tiles through a ``NUM_STAGES`` ring;
- an **MMA** warp (1 warp, 24 registers) issues ``tlx.async_dot`` into the TMEM accumulator.
  ``mBarriers=[empty[slot]]`` asks the hardware to arrive on the slot's empty barrier once that
  MMA has finished reading shared memory, so nobody waits on the MMA in the loop; after the last
  one, ``tlx.tcgen05_commit(acc_full)`` makes ``acc_full`` complete when all MMAs are done;
- the **epilogue** (default task, 4 warps = 128 threads, one per TMEM lane) waits on ``acc_full``,
  loads the accumulator from TMEM (``tlx.local_load``), converts it and stores it with TMA.

The accumulator is allocated with ``tlx.local_alloc(..., tlx.storage_kind.tmem)``; a 128x128 fp32
tile takes 128 of the 512 columns. The inspect report for sm_100 shows it, along with the
``tcgen05.*`` instructions. This machine's GPU is a Hopper H200, so ``run_check`` refuses politely
unless it finds a Blackwell GPU: the kernel is compile-verified only.
"""
import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.kernels.spec import KernelSpec
from tutorials import check_gemm, gemm_operands

SINGLE_WARP_REGISTERS = tl.constexpr(24)  # the load and MMA warps only issue instructions
DEFAULT_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, NUM_STAGES=3)


@triton.jit
def tmem_gemm_kernel(a_desc, b_desc, c_desc, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    a_ring = tlx.local_alloc((BLOCK_M, BLOCK_K), tlx.dtype_of(a_desc), NUM_STAGES)
    b_ring = tlx.local_alloc((BLOCK_K, BLOCK_N), tlx.dtype_of(b_desc), NUM_STAGES)
    acc_tmem = tlx.local_alloc((BLOCK_M, BLOCK_N), tl.float32, 1, tlx.storage_kind.tmem)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    acc_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # epilogue: TMEM -> registers -> global
            tlx.barrier_wait(acc_full[0], 0)
            acc = tlx.local_load(acc_tmem[0])
            c_desc.store([off_m, off_n], acc.to(tlx.dtype_of(c_desc)))

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # MMA issuer
            for k in range(k_tiles):
                slot = k % NUM_STAGES
                phase = (k // NUM_STAGES) & 1
                tlx.barrier_wait(full[slot], phase)
                # The first MMA overwrites whatever TMEM held; later ones accumulate.
                tlx.async_dot(a_ring[slot], b_ring[slot], acc_tmem[0], use_acc=k > 0,
                              mBarriers=[empty[slot]])
            tlx.tcgen05_commit(acc_full[0])

        with tlx.async_task(num_warps=1, registers=SINGLE_WARP_REGISTERS):  # TMA loads
            stage_bytes: tl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * tlx.size_of(tlx.dtype_of(a_desc))
            for k in range(k_tiles):
                slot = k % NUM_STAGES
                phase = (k // NUM_STAGES) & 1
                tlx.barrier_wait(empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(full[slot], stage_bytes)
                tlx.async_descriptor_load(a_desc, a_ring[slot], [off_m, k * BLOCK_K], full[slot])
                tlx.async_descriptor_load(b_desc, b_ring[slot], [k * BLOCK_K, off_n], full[slot])


def tmem_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, **cfg) -> torch.Tensor:
    """``a @ b`` for fp16 CUDA matrices on a Blackwell GPU, written into `out` (or a new tensor)."""
    cfg = DEFAULT_CONFIG | cfg
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    c, a_desc, b_desc, c_desc = gemm_operands(a, b, out, (bm, bk), (bk, bn), (bm, bn))
    tmem_gemm_kernel[(triton.cdiv(c.shape[0], bm), triton.cdiv(c.shape[1], bn))](a_desc, b_desc, c_desc,
                                                                                a.shape[1], **cfg)
    return c


def inspect_spec(**cfg) -> KernelSpec:
    """The kernel at `cfg` (defaults: DEFAULT_CONFIG), ready for `jfa.workbench.inspect.inspect` on sm_100."""
    cfg = DEFAULT_CONFIG | cfg
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    return KernelSpec(
        fn=tmem_gemm_kernel,
        signature={"a_desc": f"tensordesc<fp16[{bm},{bk}]>", "b_desc": f"tensordesc<fp16[{bk},{bn}]>",
                   "c_desc": f"tensordesc<fp16[{bm},{bn}]>", "K": "i32"},
        constexprs=cfg, num_warps=4, role_names=("epilogue", "mma", "load"), target="sm_100")


def run_check(M: int = 1000, N: int = 776, K: int = 520, seed: int = 0) -> None:
    """On a Blackwell GPU: against an fp32 torch matmul, `c` poisoned. Elsewhere: refuse, saying why."""
    from tutorials import blackwell_tlx_available

    ready, why = blackwell_tlx_available()
    if not ready:
        raise RuntimeError(f"t05 is compiled, not run here: {why}")
    check_gemm(tmem_gemm, "t05", M, N, K, seed)


if __name__ == "__main__":
    from tutorials import main

    main(inspect_spec, run_check, blackwell=True)
