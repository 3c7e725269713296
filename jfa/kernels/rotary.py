"""Rotary position embedding in one memory-bound Triton pass: the rotation and its conjugate.

Rotary rotates every interleaved column pair (2p, 2p+1) of a head by the angle of pair p at that
row: `x' = x*cos + rotate_every_two(x)*sin` with `rotate_every_two(x1, x2) = (-x2, x1)`, and
`sinu_pos[M, D]` holding sin in its first D/2 columns and cos in its last D/2 (`jfa.reference`).
The conjugate (sin negated) undoes it, and since a rotation is orthogonal it is also its backward.

Why a kernel. In PyTorch the rotation is a handful of elementwise passes over fp32 copies; it is
memory-bound either way, so the floor is one pass: read each value and its row's angles once, rotate
in fp32 registers, write the output dtype once. A program owns a block of rows and loads their
angles once for all the heads it rotates.

Two users:
- the forward of `jfa.fused_projection_rotary_block_attention` (q, k and v of the projection);
- the *unfused* rotary backward, attention backward then the conjugate of dQ, dK, dV written side
  by side into `dz`: the baseline the fused epilogue of `jfa.kernels.block_attn` is measured against.
The rotation of a tile itself, `rotate_pairs`, is written once: the fused epilogue calls it too.

Plain Triton (no TLX), so it runs on any CUDA GPU and in Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32  # rows per program: a [32, D] tile of each head, the angles of 32 rows
NUM_WARPS = 4


@triton.jit
def rotate_pairs(x, sin, cos, CONJUGATE: tl.constexpr):
    """Rotate every column pair (2p, 2p+1) of fp32 `x [rows, 2*P]` by the angle of pair p (`sin`,
    `cos` [rows, P]); CONJUGATE rotates by minus the angle (the transpose, hence the backward).

    The pair split and join stay in registers: in a row-major tile and in a wgmma accumulator alike,
    one thread holds both columns of a pair.
    """
    x_even, x_odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    if CONJUGATE:
        even = x_even * cos + x_odd * sin
        odd = x_odd * cos - x_even * sin
    else:
        even = x_even * cos - x_odd * sin
        odd = x_odd * cos + x_even * sin
    return tl.reshape(tl.join(even, odd), [x.shape[0], x.shape[1]])


@triton.jit
def _rotary_kernel(src_ptr, dst_ptr, sinu_ptr, rows, heads, src_row_stride, dst_row_stride, sinu_row_stride,
                   CONJUGATE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """dst[r, h] = rotation of src[r, h] by the angles of row r, for every head h (or its conjugate)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = (row < rows)[:, None]
    row64 = row.to(tl.int64)[:, None]
    pair = tl.arange(0, HALF)[None, :]
    sin = tl.load(sinu_ptr + row64 * sinu_row_stride + pair, mask=row_ok, other=0.0).to(tl.float32)
    cos = tl.load(sinu_ptr + row64 * sinu_row_stride + HALF + pair, mask=row_ok, other=0.0).to(tl.float32)
    col = tl.arange(0, HEAD_DIM)[None, :]
    for head in range(heads):
        x = tl.load(src_ptr + row64 * src_row_stride + head * HEAD_DIM + col, mask=row_ok, other=0.0)
        rotated = rotate_pairs(x.to(tl.float32), sin, cos, CONJUGATE)
        tl.store(dst_ptr + row64 * dst_row_stride + head * HEAD_DIM + col,
                 rotated.to(dst_ptr.dtype.element_ty), mask=row_ok)


def rotate(src: torch.Tensor, sinu_pos: torch.Tensor, *, conjugate: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary rotation (or its conjugate) of `src [M, H, D]`, returned in src's dtype (or into `out`).

    `src` and `out` may be views with any row stride as long as each row's H*D values are
    contiguous: a column slice of the projection `qkv`, or of `dz`. `sinu_pos` is `[M, D]`.
    """
    rows, heads, head_dim = src.shape
    if head_dim % 2:
        raise ValueError(f"rotary pairs columns: head_dim must be even, got {head_dim}")
    if tuple(sinu_pos.shape) != (rows, head_dim):
        raise ValueError(f"sinu_pos must be [M, D] = [{rows}, {head_dim}], got {tuple(sinu_pos.shape)}")
    out = torch.empty_like(src, memory_format=torch.contiguous_format) if out is None else out
    if tuple(out.shape) != tuple(src.shape):
        raise ValueError(f"out must have src's shape {tuple(src.shape)}, got {tuple(out.shape)}")
    for name, t in (("src", src), ("out", out), ("sinu_pos", sinu_pos)):
        if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != head_dim):
            raise ValueError(f"{name}: each row's values must be contiguous (strides {t.stride()}); "
                             "pass a column slice of a row-major tensor or call .contiguous()")
    if rows and heads:
        _rotary_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            src, out, sinu_pos, rows, heads, src.stride(0), out.stride(0), sinu_pos.stride(0),
            CONJUGATE=conjugate, HEAD_DIM=head_dim, BLOCK_ROWS=BLOCK_ROWS,
            num_warps=NUM_WARPS)
    return out


def rotary_conj_dz(grads: tuple[torch.Tensor, ...], sinu_pos: torch.Tensor) -> torch.Tensor:
    """The unfused rotary backward's epilogue: `dz = [conj(dQ) | conj(dK) | conj(dV)]`, `[M, sum H*D]`.

    One conjugate pass per gradient, each writing its column slice of `dz` in the gradients' dtype.
    """
    rows, head_dim = grads[0].shape[0], grads[0].shape[2]
    widths = [g.shape[1] * head_dim for g in grads]
    dz = torch.empty(rows, sum(widths), dtype=grads[0].dtype, device=grads[0].device)
    for grad, part in zip(grads, dz.split(widths, dim=1)):
        rotate(grad, sinu_pos, conjugate=True, out=part.view(rows, grad.shape[1], head_dim))
    return dz
