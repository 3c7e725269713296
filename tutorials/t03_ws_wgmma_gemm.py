"""
Tutorial 3: a warp-specialized wgmma GEMM with per-role register budgets
========================================================================

Why. On Hopper the tensor cores are driven by ``wgmma``: one *warpgroup* (4 warps, 128 threads)
issues an asynchronous matrix multiply whose operands come from shared memory and whose fp32
accumulator lives in that warpgroup's registers. A 64x128 fp32 accumulator is 64 registers per
thread; with the loop state around it a consumer wants ~200 registers. The register file is
fixed (64K 32-bit registers per SM), so the budget matters: a producer that only issues TMA copies
needs ~40, and every register it does not take can go to the math. ``setmaxnreg`` moves registers
between warpgroups at run time; TLX emits it from ``tlx.async_task(..., registers=N)``.

How. Three warpgroups in one CTA:

- the **producer** (default task) streams A and B tiles through a ``NUM_STAGES`` ring (tutorial 2);
- **two consumers** (``replicate=2``) each own one half of the 128-row output tile. They share the
  B tile and read their own half of A; ``tlx.async_task_replica_id()`` tells them apart.

One ``full`` barrier per stage covers the three copies of that stage (expected bytes: both A halves
plus B); one ``empty`` barrier per stage needs both consumers' arrivals (``arrive_count=2``)
before the producer may refill it. Each consumer issues ``tlx.async_dot`` (a wgmma) and waits
for it with ``tlx.async_dot_wait`` before releasing the stage; the epilogue converts the
accumulator to fp16 and writes it with a TMA store.

The inspect report shows the result: three roles, the consumers at 232 registers, the producer
at what is left, ``wgmma.mma_async`` and ``setmaxnreg`` in the PTX.

``RECORD=True`` (off by default, compiled out when off) makes one thread of each role write
``%globaltimer`` stamps around every wait and every step into ``timeline_ptr``, the raw material
of the Gantt chart in notebook 01; ``tutorials/timeline.py`` launches it and reads them back.
"""
import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.language.extra.cuda import globaltimer, smid

from jfa.kernels.spec import KernelSpec
from tutorials import check_gemm, gemm_operands

NUM_CONSUMERS = tl.constexpr(2)  # consumer warpgroups, each owning BLOCK_M // 2 output rows
CONSUMER_REGISTERS = tl.constexpr(232)
DEFAULT_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, NUM_STAGES=3)
# RECORD=True: one int64 row per (program, role), roles in order producer, consumer0, consumer1:
# [SM id, k-step 0 stamps, ..., k-step k_tiles-1 stamps, epilogue stamps (consumers only)].
NUM_ROLES = tl.constexpr(1 + NUM_CONSUMERS.value)
ROW_HEAD = tl.constexpr(1)  # the SM id
STAMPS_PER_STEP = tl.constexpr(3)
WAIT_START, WAIT_END, STEP_END = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # within a k-step
EPILOGUE_START, EPILOGUE_END = tl.constexpr(0), tl.constexpr(1)  # within the "step" after the last


def timeline_row_length(k_tiles: int) -> int:
    return ROW_HEAD.value + STAMPS_PER_STEP.value * (k_tiles + 1)


@triton.jit
def _timeline_row(timeline_ptr, role, k_tiles, RECORD: tl.constexpr):
    """This program's row for `role`, its SM id written at the head; timeline_ptr as is when not recording."""
    if RECORD:
        program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        row_length = ROW_HEAD + STAMPS_PER_STEP * (k_tiles + 1)
        timeline_ptr += (program.to(tl.int64) * NUM_ROLES + role) * row_length
        tl.store(timeline_ptr, smid().to(tl.int64))
    return timeline_ptr


@triton.jit
def _stamp(row, step, position, RECORD: tl.constexpr):
    """Store the time in ns: %globaltimer, not %clock64, so stamps taken on different SMs share one clock."""
    if RECORD:
        tl.store(row + ROW_HEAD + STAMPS_PER_STEP * step + position, globaltimer())


@triton.jit
def ws_gemm_kernel(a_desc, b_desc, c_desc, K, timeline_ptr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NUM_STAGES: tl.constexpr, RECORD: tl.constexpr = False):
    HALF_M: tl.constexpr = BLOCK_M // NUM_CONSUMERS
    # Stage s holds A halves at a_ring[s * NUM_CONSUMERS + consumer] and B at b_ring[s].
    a_ring = tlx.local_alloc((HALF_M, BLOCK_K), tlx.dtype_of(a_desc), NUM_STAGES * NUM_CONSUMERS)
    b_ring = tlx.local_alloc((BLOCK_K, BLOCK_N), tlx.dtype_of(b_desc), NUM_STAGES)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=NUM_CONSUMERS)
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer
            elem_bytes: tl.constexpr = tlx.size_of(tlx.dtype_of(a_desc))
            row = _timeline_row(timeline_ptr, 0, k_tiles, RECORD)
            for k in range(k_tiles):
                slot = k % NUM_STAGES
                phase = (k // NUM_STAGES) & 1
                _stamp(row, k, WAIT_START, RECORD)
                tlx.barrier_wait(empty[slot], phase ^ 1)
                _stamp(row, k, WAIT_END, RECORD)
                tlx.barrier_expect_bytes(full[slot], (BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * elem_bytes)
                for half in tl.static_range(NUM_CONSUMERS):
                    tlx.async_descriptor_load(a_desc, a_ring[slot * NUM_CONSUMERS + half],
                                              [off_m + half * HALF_M, k * BLOCK_K], full[slot])
                tlx.async_descriptor_load(b_desc, b_ring[slot], [k * BLOCK_K, off_n], full[slot])
                _stamp(row, k, STEP_END, RECORD)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=NUM_CONSUMERS):
            consumer = tlx.async_task_replica_id()
            row = _timeline_row(timeline_ptr, 1 + consumer, k_tiles, RECORD)
            acc = tl.zeros([HALF_M, BLOCK_N], dtype=tl.float32)
            for k in range(k_tiles):
                slot = k % NUM_STAGES
                phase = (k // NUM_STAGES) & 1
                _stamp(row, k, WAIT_START, RECORD)
                tlx.barrier_wait(full[slot], phase)
                _stamp(row, k, WAIT_END, RECORD)
                acc = tlx.async_dot(a_ring[slot * NUM_CONSUMERS + consumer], b_ring[slot], acc)
                # The wgmma reads shared memory asynchronously: the stage is free only once it is done.
                acc = tlx.async_dot_wait(0, acc)
                _stamp(row, k, STEP_END, RECORD)
                tlx.barrier_arrive(empty[slot])
            _stamp(row, k_tiles, EPILOGUE_START, RECORD)
            c_desc.store([off_m + consumer * HALF_M, off_n], acc.to(tlx.dtype_of(c_desc)))
            _stamp(row, k_tiles, EPILOGUE_END, RECORD)


def ws_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
            timeline: torch.Tensor | None = None, **cfg) -> torch.Tensor:
    """``a @ b`` for fp16 CUDA matrices (fp32 accumulation), written into `out` (or a new tensor).

    With `timeline` (int64, one row of `timeline_row_length(cdiv(K, BLOCK_K))` per program and
    role) the RECORD kernel writes its stamps there; see tutorials/timeline.py."""
    cfg = DEFAULT_CONFIG | cfg
    half_m = cfg["BLOCK_M"] // NUM_CONSUMERS.value
    c, a_desc, b_desc, c_desc = gemm_operands(a, b, out, (half_m, cfg["BLOCK_K"]), (cfg["BLOCK_K"], cfg["BLOCK_N"]),
                                              (half_m, cfg["BLOCK_N"]))
    (M, K), N = a.shape, b.shape[1]
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    if timeline is not None:
        rows = grid[0] * grid[1] * NUM_ROLES.value
        shape = (rows, timeline_row_length(triton.cdiv(K, cfg["BLOCK_K"])))
        if (timeline.dtype != torch.int64 or tuple(timeline.shape) != shape or not timeline.is_contiguous()
                or timeline.device != a.device):
            raise ValueError(f"timeline must be a contiguous int64 tensor of shape {shape} on {a.device}, "
                             f"got {timeline.dtype} {tuple(timeline.shape)} on {timeline.device}")
    ws_gemm_kernel[grid](a_desc, b_desc, c_desc, K, timeline, **cfg, RECORD=timeline is not None)
    return c


def inspect_spec(RECORD: bool = False, **cfg) -> KernelSpec:
    """The kernel at `cfg` (defaults: DEFAULT_CONFIG), ready for `jfa.workbench.inspect.inspect`; RECORD adds
    the stamps."""
    cfg = DEFAULT_CONFIG | cfg
    half_m = cfg["BLOCK_M"] // NUM_CONSUMERS.value
    # Without RECORD the timeline pointer is a compile-time None: not even a kernel parameter remains.
    timeline = {"timeline_ptr": "*i64"} if RECORD else {}
    return KernelSpec(
        fn=ws_gemm_kernel,
        signature={"a_desc": f"tensordesc<fp16[{half_m},{cfg['BLOCK_K']}]>",
                   "b_desc": f"tensordesc<fp16[{cfg['BLOCK_K']},{cfg['BLOCK_N']}]>",
                   "c_desc": f"tensordesc<fp16[{half_m},{cfg['BLOCK_N']}]>", "K": "i32"} | timeline,
        constexprs=cfg | {"RECORD": RECORD} | ({} if RECORD else {"timeline_ptr": None}),
        num_warps=4, role_names=("producer", "consumer0", "consumer1"), target="sm_90")


def run_check(M: int = 1000, N: int = 776, K: int = 520, seed: int = 0) -> None:
    """Against an fp32 torch matmul on fresh random data; `c` poisoned, every element checked."""
    check_gemm(ws_gemm, "t03", M, N, K, seed)


if __name__ == "__main__":
    from tutorials import main

    main(inspect_spec, run_check)
