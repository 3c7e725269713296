"""The backward's preprocess: Delta = rowsum(O * dO), the softmax backward's per-row term.

dS = P * (dP - Delta) needs, for every query row, the dot product of its output and its output's
gradient. It is computed once, before the dK/dV and dQ kernels, which then load it per query block
beside the forward's LSE. One small Triton kernel: a program per 64 rows of one head.
"""
import torch
import triton
import triton.language as tl

from jfa.kernels.launch import CachedLaunch
from jfa.kernels.spec import TRITON_DTYPE_NAMES, KernelSpec

BLOCK_ROWS = 64  # rows per program


@triton.jit(do_not_specialize=["num_rows", "num_heads", "stride_delta_head"])
def _delta_kernel(out_ptr, dout_ptr, delta_ptr, num_rows, num_heads, stride_row, stride_delta_head,
                  HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Delta[h, row] = sum_d O[row, h, d] * dO[row, h, d] in fp32."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    valid = rows < num_rows
    offs = rows.to(tl.int64)[:, None] * stride_row + head * HEAD_DIM + dims[None, :]
    o = tl.load(out_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + head.to(tl.int64) * stride_delta_head + rows, tl.sum(o * do, 1), mask=valid)


_delta_launch = CachedLaunch(_delta_kernel)


def compute_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """Delta = rowsum(O * dO) in fp32, `[Hq, Tq_out]` like the LSE (contiguous `[T, H, D]` inputs)."""
    rows, heads, head_dim = out.shape
    delta = torch.empty((heads, rows), dtype=torch.float32, device=out.device)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_ROWS), heads)
        _delta_launch[grid](out, dout, delta, rows, heads, heads * head_dim, delta.stride(0), HEAD_DIM=head_dim,
                            BLOCK_ROWS=BLOCK_ROWS)
    return delta


def inspect_spec(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> KernelSpec:
    """Compile-only description of the preprocess (no GPU needed): `jfa.workbench.inspect`."""
    name = TRITON_DTYPE_NAMES[dtype]
    signature = dict(out_ptr=f"*{name}", dout_ptr=f"*{name}", delta_ptr="*fp32", num_rows="i32", num_heads="i32",
                     stride_row="i32", stride_delta_head="i32", HEAD_DIM="constexpr", BLOCK_ROWS="constexpr")
    return KernelSpec(fn=_delta_kernel, signature=signature, constexprs=dict(HEAD_DIM=head_dim, BLOCK_ROWS=BLOCK_ROWS),
                      name="jagged_bwd_delta", aligned=("stride_row",), target="sm_90")
