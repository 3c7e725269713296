"""
Tutorial 8: two consumers that need each other's half: an exchange through shared memory
=========================================================================================

Why. Tutorial 7 handed one consumer's partial result to the other: a one-way trip, one mbarrier.
Sometimes each consumer needs what the *other* computed. In jfa's fused attention backward at
D=128 (`jfa.kernels.bwd_dkdv._split_dq_step`) consumer c owns 64 of a key tile's 128 keys and forms
dS for them, but dQ = dS K sums over all 128 keys: neither consumer can form any part of dQ alone.
So each stages its dS in shared memory, both meet at a named barrier, and then consumer c forms the
c-th half of dQ's *columns* from both halves of dS. No matrix multiply is done twice, each consumer
keeps a [64, 64] accumulator instead of [64, 128], and each half of dQ leaves once, by one TMA
reduce-add.

How. The same exchange in a chain of two GEMMs, ``Y = (A @ B) @ W``, one 64-row block of Y per
program (B and W: 128 columns, W: 128 rows):

- ``X = A @ B`` is split by columns: consumer c computes ``X_c = A @ B[:, c-th half]`` ([64, 64]
  fp32), rounds it to fp16 and stores it in its own stage, ``x_stages[c]``;
- ``fence_async_shared`` makes those ordinary stores visible to wgmma (which reads shared memory
  through the async proxy), and a *named barrier* over both consumer warpgroups (256 threads,
  tutorial 4) says that both halves are staged;
- consumer c computes ``Y[:, c-th half] = X_0 @ W[:64, c-th half] + X_1 @ W[64:, c-th half]``:
  two wgmmas whose A operands are the two staged halves and whose B operands are slices of W,
  and TMA-stores its half of the block.

A program makes one block here, so each stage is written once. In a loop (the backward's loop over
query blocks) a consumer may rewrite its stage only after the other has read it: a second named
barrier after the reads, or two stages per consumer used alternately, as jfa's backward does
(`jfa.kernels.bwd_dkdv.DS_STAGES`): a stage is rewritten two steps later, past the next step's
barrier, which the other consumer reaches only after waiting for the wgmmas that read it.
"""
import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.kernels.spec import KernelSpec
from jfa.specs import FWD_TOL
from tutorials import check_matrices, matrix_descriptor

NUM_CONSUMERS = tl.constexpr(2)  # consumer warpgroups, each forming half of X's and of Y's columns
HALF = tl.constexpr(64)  # the columns each consumer forms: one wgmma N-tile
BLOCK_M = 64  # rows of Y per program: one wgmma M-tile, shared by both consumers
CONSUMER_REGISTERS = tl.constexpr(232)
BOTH_STAGED = tl.constexpr(9)  # named-barrier id; the compiler uses the low ids itself
PAIR_THREADS = tl.constexpr(256)  # both consumer warpgroups take part
INNER_DIMS = (64, 128)  # A's columns (B's rows): one TMA box, one wgmma K loop


@triton.jit
def chain_kernel(a_desc, b_desc, w_desc, y_desc, BLOCK_M: tl.constexpr, K: tl.constexpr):
    dtype: tl.constexpr = tlx.dtype_of(a_desc)
    a_tile = tlx.local_alloc((BLOCK_M, K), dtype, 1)
    b_halves = tlx.local_alloc((K, HALF), dtype, NUM_CONSUMERS)  # B's column halves
    w_halves = tlx.local_alloc((HALF, NUM_CONSUMERS * HALF), dtype, NUM_CONSUMERS)  # W's row halves
    x_stages = tlx.local_alloc((BLOCK_M, HALF), dtype, NUM_CONSUMERS)  # X's column halves, fp16
    loaded = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    off_m = tl.program_id(0) * BLOCK_M

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: every operand once, all on one barrier
            elements: tl.constexpr = BLOCK_M * K + NUM_CONSUMERS * (K * HALF + HALF * NUM_CONSUMERS * HALF)
            tlx.barrier_expect_bytes(loaded[0], elements * tlx.size_of(dtype))
            tlx.async_descriptor_load(a_desc, a_tile[0], [off_m, 0], loaded[0])
            for c in tl.static_range(NUM_CONSUMERS):
                tlx.async_descriptor_load(b_desc, b_halves[c], [0, c * HALF], loaded[0])
                tlx.async_descriptor_load(w_desc, w_halves[c], [c * HALF, 0], loaded[0])

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=NUM_CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            tlx.barrier_wait(loaded[0], 0)
            x = tlx.async_dot(a_tile[0], b_halves[cid])
            x = tlx.async_dot_wait(0, x)
            tlx.local_store(x_stages[cid], x.to(dtype))
            tlx.fence_async_shared()
            tlx.named_barrier_wait(BOTH_STAGED, PAIR_THREADS)  # the other consumer's half is staged too
            y = tlx.async_dot(x_stages[0], tlx.local_slice(w_halves[0], [0, cid * HALF], [HALF, HALF]))
            y = tlx.async_dot(x_stages[1], tlx.local_slice(w_halves[1], [0, cid * HALF], [HALF, HALF]), y)
            y = tlx.async_dot_wait(0, y)
            y_desc.store([off_m, cid * HALF], y.to(tlx.dtype_of(y_desc)))


def chain(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(a @ b) @ w`` for float16 CUDA matrices, the intermediate rounded to float16 as the kernel
    stages it: a [M, K] with K in INNER_DIMS, b [K, 128], w [128, 128]; written into `out` or a new
    tensor. A ValueError names the argument that does not fit."""
    width = NUM_CONSUMERS.value * HALF.value
    check_matrices(a=a, b=b, w=w)
    if a.shape[1] not in INNER_DIMS:
        raise ValueError(f"a.shape[1] must be one of {INNER_DIMS} (one TMA box), got {a.shape[1]}")
    if tuple(b.shape) != (a.shape[1], width) or tuple(w.shape) != (width, width):
        raise ValueError(f"b must be [{a.shape[1]}, {width}] and w [{width}, {width}]; "
                         f"got b {tuple(b.shape)}, w {tuple(w.shape)}")
    y = torch.empty(a.shape[0], width, device=a.device, dtype=a.dtype) if out is None else out
    k = a.shape[1]
    chain_kernel[(triton.cdiv(a.shape[0], BLOCK_M),)](
        matrix_descriptor(a, (BLOCK_M, k)), matrix_descriptor(b, (k, HALF.value)),
        matrix_descriptor(w, (HALF.value, width)), matrix_descriptor(y, (BLOCK_M, HALF.value)), BLOCK_M=BLOCK_M, K=k)
    return y


def inspect_spec(K: int = 128) -> KernelSpec:
    """The kernel with A's inner dimension `K`, ready for `jfa.workbench.inspect.inspect`."""
    width = NUM_CONSUMERS.value * HALF.value
    return KernelSpec(
        fn=chain_kernel,
        signature={"a_desc": f"tensordesc<fp16[{BLOCK_M},{K}]>", "b_desc": f"tensordesc<fp16[{K},{HALF.value}]>",
                   "w_desc": f"tensordesc<fp16[{HALF.value},{width}]>",
                   "y_desc": f"tensordesc<fp16[{BLOCK_M},{HALF.value}]>"},
        constexprs=dict(BLOCK_M=BLOCK_M, K=K), num_warps=4, role_names=("producer", "consumer0", "consumer1"),
        target="sm_90")


def run_check(M: int = 1000, seed: int = 0) -> None:
    """Against fp32 torch on fresh random data, the output poisoned with NaN; M leaves the last block
    partial (TMA clips its store). The reference rounds X to float16 where the kernel stages it."""
    torch.manual_seed(seed)
    for k in INNER_DIMS:
        a = torch.randn(M, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, 128, device="cuda", dtype=torch.float16) / k ** 0.5
        w = torch.randn(128, 128, device="cuda", dtype=torch.float16)
        y = torch.full((M, 128), float("nan"), device="cuda", dtype=torch.float16)
        chain(a, b, w, out=y)
        x = (a.float() @ b.float()).half().float()
        torch.testing.assert_close(y.float(), x @ w.float(), **FWD_TOL)
        print(f"t08 check passed: (({M}x{k}) @ ({k}x128)) @ (128x128) against fp32 torch")


if __name__ == "__main__":
    from tutorials import main

    main(inspect_spec, run_check)
