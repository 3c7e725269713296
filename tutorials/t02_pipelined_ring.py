"""
Tutorial 2: the ring, its depth, and its phases
===============================================

Why. Tutorial 1 used two slots. Whether two are enough is a question of *bytes in flight*: a
memory system with bandwidth B and latency L only runs at full speed if about ``B * L`` bytes are
requested and not yet delivered at every moment (Little's law). Per SM of an H200 that is roughly
``4.3 TB/s / 132 SMs * ~1 us`` = ~30 KB. One 32 KB tile in flight per SM is borderline; while the
consumer holds the only other slot, the producer has nothing to request. More slots keep more
copies in flight; past the point where latency is covered, more slots only cost shared memory.

How. ``NUM_STAGES`` is a constexpr, so the ring depth is chosen per compile. Every role walks the
same sequence of iterations ``i = 0, 1, 2, ...`` and derives, without any shared counter:

- ``slot  = i % NUM_STAGES``          which buffer and which pair of barriers;
- ``phase = (i // NUM_STAGES) & 1``   which round through the ring this is, modulo 2.

An mbarrier completes once per round and its phase bit flips each time, so "wait for phase p"
means "wait until round p (mod 2) of this slot completed". The consumer waits ``full[slot]`` at
``phase``. The producer waits ``empty[slot]`` at ``phase ^ 1``: in round 0 that is the phase a
fresh barrier already shows as complete (all slots start empty); from round 1 on it waits for
the consumer's release from the previous round. One bit is enough because a role can never be
more than one round ahead of the other: the barriers themselves stop it.

The kernel sums each row of a long ``x[M, N]`` (fp32 accumulation): a pure streaming kernel, so
its speed is the speed of the ring. ``bench()`` shows it for depths 1 to 4.
"""
import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.tools.tensor_descriptor import TensorDescriptor

from jfa.kernels.spec import KernelSpec
from jfa.specs import H200_COPY_TBPS, TMA_ALIGN_BYTES

CONSUMER_REGISTERS = tl.constexpr(232)
DEFAULT_CONFIG = dict(BLOCK_M=64, BLOCK_N=256, NUM_STAGES=3)
BENCH_DEPTHS = (1, 2, 3, 4)


@triton.jit
def row_sums_kernel(x_desc, sums_ptr, n_rows, n_cols,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    x_ring = tlx.local_alloc((BLOCK_M, BLOCK_N), tlx.dtype_of(x_desc), NUM_STAGES)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    row_start = tl.program_id(0) * BLOCK_M
    n_tiles = tl.cdiv(n_cols, BLOCK_N)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer
            for i in range(n_tiles):
                slot = i % NUM_STAGES
                phase = (i // NUM_STAGES) & 1
                tlx.barrier_wait(empty[slot], phase ^ 1)
                tlx.barrier_expect_bytes(full[slot], BLOCK_M * BLOCK_N * tlx.size_of(tlx.dtype_of(x_desc)))
                tlx.async_descriptor_load(x_desc, x_ring[slot], [row_start, i * BLOCK_N], full[slot])

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS):  # consumer
            row_sums = tl.zeros([BLOCK_M], dtype=tl.float32)
            for i in range(n_tiles):
                slot = i % NUM_STAGES
                phase = (i // NUM_STAGES) & 1
                tlx.barrier_wait(full[slot], phase)
                x_tile = tlx.local_load(x_ring[slot])
                tlx.barrier_arrive(empty[slot])
                # Columns past n_cols arrive as zeros from TMA, so they add nothing.
                row_sums += tl.sum(x_tile.to(tl.float32), axis=1)
            rows = row_start + tl.arange(0, BLOCK_M)
            tl.store(sums_ptr + rows, row_sums, mask=rows < n_rows)


def row_sums(x: torch.Tensor, out: torch.Tensor | None = None, **cfg) -> torch.Tensor:
    """fp32 row sums of a contiguous 2-D fp16/bf16 CUDA tensor, written into `out` (or a new tensor)."""
    cfg = DEFAULT_CONFIG | cfg
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if (x.shape[1] * x.element_size()) % TMA_ALIGN_BYTES:
        raise ValueError(f"TMA needs {TMA_ALIGN_BYTES}-byte aligned rows: pad x.shape[1] ({x.shape[1]})")
    n_rows, n_cols = x.shape
    sums = torch.empty(n_rows, device=x.device, dtype=torch.float32) if out is None else out
    x_desc = TensorDescriptor(x, shape=[n_rows, n_cols], strides=[n_cols, 1],
                              block_shape=[cfg["BLOCK_M"], cfg["BLOCK_N"]])
    row_sums_kernel[(triton.cdiv(n_rows, cfg["BLOCK_M"]),)](x_desc, sums, n_rows, n_cols, **cfg)
    return sums


def inspect_spec(**cfg) -> KernelSpec:
    """The kernel at `cfg` (defaults: DEFAULT_CONFIG), ready for `jfa.workbench.inspect.inspect`."""
    cfg = DEFAULT_CONFIG | cfg
    return KernelSpec(
        fn=row_sums_kernel,
        signature={"x_desc": f"tensordesc<fp16[{cfg['BLOCK_M']},{cfg['BLOCK_N']}]>", "sums_ptr": "*fp32",
                   "n_rows": "i32", "n_cols": "i32"},
        constexprs=cfg, num_warps=4, role_names=("producer", "consumer"), target="sm_90")


def run_check(n_rows: int = 1000, n_cols: int = 5000, seed: int = 0) -> None:
    """Every ring depth against a float64 torch reference on fresh random data, outputs poisoned."""
    torch.manual_seed(seed)
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.float16)
    expected = x.double().sum(dim=1).float()
    for depth in BENCH_DEPTHS:
        sums = torch.full((n_rows,), float("nan"), device="cuda", dtype=torch.float32)
        row_sums(x, out=sums, NUM_STAGES=depth)
        torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-3, msg=lambda m: f"NUM_STAGES={depth}: {m}")
    print(f"t02 check passed: {n_rows}x{n_cols} row sums at ring depths {BENCH_DEPTHS}")


def bench(n_rows: int = 8192, n_cols: int = 32768) -> dict:
    """Achieved read bandwidth (TB/s) per ring depth; the H200's copy ceiling is printed alongside."""
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.float16)
    tbps = {}
    for depth in BENCH_DEPTHS:
        ms = triton.testing.do_bench(lambda: row_sums(x, NUM_STAGES=depth))
        tbps[depth] = x.numel() * x.element_size() / (ms * 1e-3) / 1e12
        print(f"  NUM_STAGES={depth}: {ms:.3f} ms, {tbps[depth]:.2f} TB/s "
              f"(H200 copy ceiling ~{H200_COPY_TBPS} TB/s read+write)")
    return tbps


if __name__ == "__main__":
    from jfa.workbench.inspect import inspect
    from tutorials import main

    for depth in BENCH_DEPTHS:
        report = inspect(inspect_spec(NUM_STAGES=depth))
        print(f"NUM_STAGES={depth}: shared memory {report.shared_bytes:,} B")
    print()
    main(inspect_spec, run_check, bench)
