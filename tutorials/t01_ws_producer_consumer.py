"""
Tutorial 1: a producer and a consumer, in one kernel
====================================================

Why. A GPU kernel that loads a tile, computes on it, then loads the next one leaves the memory
system idle while it computes and the math units idle while it waits. Warp specialization splits
the warps of one CTA into *roles* that run different code at the same time: a **producer** whose
only job is to bring tiles in, and a **consumer** that only computes. While the consumer works on
tile i, the producer is already fetching tile i+1.

How. The two roles share a small **ring** of shared-memory slots (here 2) and two mbarriers per
slot (a hardware barrier object in shared memory that counts arrivals and flips a one-bit
*phase* when it completes):

- ``full[s]``: "slot s holds data". The producer tells it how many bytes to expect
  (``barrier_expect_bytes``) and starts a TMA copy that completes the barrier when the bytes land.
  The consumer waits on it.
- ``empty[s]``: "slot s may be overwritten". The consumer arrives on it once the tile is in its
  registers; the producer waits on it before reusing the slot.

A barrier is waited on *by phase*: round r through the ring waits for phase ``r & 1``. The
producer's very first wait on ``empty`` must not block (the slots start out empty), so it waits
for the opposite phase, which a fresh barrier reports as already complete. Tutorial 2 looks at
the ring and its phases in detail.

The kernel computes ``y = x * scale`` for a row-major ``x[M, N]``: each program owns
``BLOCK_M`` rows and streams across the columns one ``[BLOCK_M, BLOCK_N]`` tile at a time.
The producer is the ``default`` task (the kernel's own 4 warps); the consumer is one extra
warpgroup. Each extra role may ask for a per-thread register budget (``registers=``, applied
with ``setmaxnreg``); the default role runs with what the register file has left.

Here nothing is short: 8 warps are 256 threads, and an SM's 65,536 registers give each of them
256, the most ``setmaxnreg`` grants. The consumer's 232 is therefore a decrease
(``setmaxnreg.dec 232``) and the producer keeps its 256. A budget moves registers from one role to
another only when the roles together want more than the register file holds: with 12 warps
(tutorial 3, the attention kernels) each thread starts with 170, and the consumers' 232 or 240
come from the producer, which drops to 40 or 24.
"""
import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa.kernels.spec import KernelSpec
from jfa.specs import TMA_ALIGN_BYTES

# Globals read inside a kernel must be constexpr.
RING_SLOTS = tl.constexpr(2)  # double buffering: one slot is filled while the other is consumed
CONSUMER_REGISTERS = tl.constexpr(232)  # below the 256 a thread may hold at 8 warps: a setmaxnreg.dec
DEFAULT_CONFIG = dict(BLOCK_M=64, BLOCK_N=128)


@triton.jit
def scale_tiles_kernel(x_desc, y_ptr, n_rows, n_cols, scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The ring and its barriers are allocated before the roles split, so both roles see them.
    x_ring = tlx.local_alloc((BLOCK_M, BLOCK_N), tlx.dtype_of(x_desc), RING_SLOTS)
    full = tlx.alloc_barriers(num_barriers=RING_SLOTS, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=RING_SLOTS, arrive_count=1)
    row_start = tl.program_id(0) * BLOCK_M
    n_tiles = tl.cdiv(n_cols, BLOCK_N)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: the kernel's own num_warps warps
            for i in range(n_tiles):
                slot = i % RING_SLOTS
                phase = (i // RING_SLOTS) & 1
                tlx.barrier_wait(empty[slot], phase ^ 1)  # first round passes: slots start empty
                tlx.barrier_expect_bytes(full[slot], BLOCK_M * BLOCK_N * tlx.size_of(tlx.dtype_of(x_desc)))
                # TMA fills out-of-bounds rows/columns with zeros; the consumer masks them out.
                tlx.async_descriptor_load(x_desc, x_ring[slot], [row_start, i * BLOCK_N], full[slot])

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS):  # consumer
            rows = row_start + tl.arange(0, BLOCK_M)
            for i in range(n_tiles):
                slot = i % RING_SLOTS
                phase = (i // RING_SLOTS) & 1
                tlx.barrier_wait(full[slot], phase)
                x_tile = tlx.local_load(x_ring[slot])
                tlx.barrier_arrive(empty[slot])  # the tile is in registers: hand the slot back
                cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
                y_tile = (x_tile.to(tl.float32) * scale).to(y_ptr.dtype.element_ty)
                in_bounds = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
                tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y_tile, mask=in_bounds)


def scale_tiles(x: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                BLOCK_M: int = DEFAULT_CONFIG["BLOCK_M"], BLOCK_N: int = DEFAULT_CONFIG["BLOCK_N"]):
    """``x * scale`` for a contiguous 2-D fp16/bf16 CUDA tensor, written into `out` (or a new tensor)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if (x.shape[1] * x.element_size()) % TMA_ALIGN_BYTES:
        raise ValueError(f"TMA needs {TMA_ALIGN_BYTES}-byte aligned rows: pad x.shape[1] ({x.shape[1]})")
    n_rows, n_cols = x.shape
    y = torch.empty_like(x) if out is None else out
    x_desc = TensorDescriptor(x, shape=[n_rows, n_cols], strides=[n_cols, 1], block_shape=[BLOCK_M, BLOCK_N])
    scale_tiles_kernel[(triton.cdiv(n_rows, BLOCK_M),)](x_desc, y, n_rows, n_cols, scale,
                                                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return y


def inspect_spec(**cfg) -> KernelSpec:
    """The kernel at `cfg` (defaults: DEFAULT_CONFIG), ready for `jfa.workbench.inspect.inspect`."""
    cfg = DEFAULT_CONFIG | cfg
    return KernelSpec(
        fn=scale_tiles_kernel,
        signature={"x_desc": f"tensordesc<fp16[{cfg['BLOCK_M']},{cfg['BLOCK_N']}]>", "y_ptr": "*fp16",
                   "n_rows": "i32", "n_cols": "i32", "scale": "fp32"},
        constexprs=cfg, num_warps=4, role_names=("producer", "consumer"), target="sm_90")


def run_check(n_rows: int = 1000, n_cols: int = 3000, seed: int = 0) -> None:
    """Compare with torch on fresh random data; every element is checked, none left unwritten."""
    torch.manual_seed(seed)
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.float16)
    scale = 1.7
    y = torch.full_like(x, float("nan"))  # poison: an element the kernel skips stays NaN
    scale_tiles(x, scale, out=y)
    expected = (x.float() * scale).half()
    torch.testing.assert_close(y, expected)  # fp16 defaults: within one rounding step
    print(f"t01 check passed: {n_rows}x{n_cols}, every element matches x * {scale}")


if __name__ == "__main__":
    from tutorials import main

    main(inspect_spec, run_check)
