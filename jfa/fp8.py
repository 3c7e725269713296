"""FP8 jagged attention forward: E4M3 q, k, v with per-tensor scales, bf16 output.

The FP8 fork of the jagged forward kernel (`jfa.kernels.forks.fp8`) is a diff of the math, not of
the kernel: QK^T and P·V run as FP8 wgmma (twice the bf16 rate on Hopper), P is quantized to E4M3
in registers right before its P·V, and the scales fold into the softmax's exp2 argument (q and k)
and the epilogue (v). P needs no scale of its own: the conditional rescale keeps its entries in
[0, 2^8], inside E4M3's range (448).

Hopper's FP8 wgmma reads its B operand only K-major, so V goes in transposed (`[Hkv*D, keys]`,
`transposed_value_layout`): copied per call by the fork's gather-transpose kernel, or made once by
the caller with `transpose_values` and passed with `v_transposed=True`. Blackwell's block-scaled MXFP8
MMA (one E8M0 scale per 32 elements, `reference.mx_quantize`) has no Hopper counterpart; per-tensor
scales are what Hopper's wgmma can take without dequantizing.

Forward only: FP8 inputs carry no gradient here. Off a Hopper GPU the float32 reference runs on the
dequantized inputs, and says so once.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from jfa import dispatch, jagged, reference, specs
from jfa.kernels.forks import fp8 as fp8_fork
from jfa.kernels.forks.fp8 import transposed_value_layout, transposed_value_width

__all__ = ["jagged_attention_fp8", "jagged_attention_fp8_fwd", "transpose_values", "transposed_value_layout",
           "transposed_value_width"]


def _check_scale(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be finite and > 0 (real value = stored E4M3 value * {name}), got {value}")
    return float(value)


def transpose_values(v: Tensor, kv_offsets: Tensor) -> Tensor:
    """V in the layout the FP8 kernel reads, `[Hkv*D, width]` (`transposed_value_layout`), for
    `jagged_attention_fp8(..., v_transposed=True)`: make it once when the same V serves several
    calls, instead of one copy per call. On a Hopper GPU a gather-transpose kernel builds it (about
    1 ms for 2.4 M keys x 512 bytes on the H200), elsewhere PyTorch does."""
    jagged.validate_jagged_attention(v, v, v, kv_offsets, kv_offsets, fp8=True)  # reads the offsets once
    if dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, v, dtypes=jagged.FP8_DTYPES) is None:
        return fp8_fork.transposed_values(v, kv_offsets)
    rows, heads, dim = v.shape
    cols, width = transposed_value_layout(kv_offsets, rows, v.device)
    v_t = torch.zeros((heads * dim, width), dtype=torch.uint8, device=v.device)
    v_t.index_copy_(1, cols, v.reshape(rows, heads * dim).t().view(torch.uint8))  # bytes: no float8 index_copy
    return v_t.view(v.dtype)


def _packed_values(v_t: Tensor, kv_offsets: Tensor, like: Tensor) -> Tensor:
    """The inverse of `transpose_values`: `[Tk, Hkv, D]` shaped like `like` (k)."""
    cols, _ = transposed_value_layout(kv_offsets, like.shape[0], v_t.device)
    return v_t.view(torch.uint8)[:, cols].t().contiguous().view(v_t.dtype).reshape(like.shape)


def _check_transposed_values(v: Tensor, k: Tensor, kv_offsets: Tensor) -> None:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v: expected a torch.Tensor, got {type(v).__name__}")
    expected = (k.shape[1] * k.shape[2], transposed_value_width(k.shape[0], kv_offsets.numel() - 1))
    if v.dtype not in jagged.FP8_DTYPES or tuple(v.shape) != expected or not v.is_contiguous():
        raise ValueError(f"v: with v_transposed=True, expected a contiguous {jagged.FP8_DTYPES[0]} tensor of shape "
                         f"{expected} made by jfa.fp8.transpose_values(v, kv_offsets), got {v.dtype} "
                         f"{tuple(v.shape)}")
    if v.device != k.device:
        raise ValueError(f"v: is on {v.device} but k is on {k.device}; move it there")


def _reference(q, k, v, q_offsets, kv_offsets, sm_scale, scales, causal, window, broadcast_q, v_transposed):
    if v_transposed:
        v = _packed_values(v, kv_offsets, k)
    real = [t.float() * s for t, s in zip((q, k, v), scales)]
    out, lse = reference.jagged_attention_ref(*real, q_offsets, kv_offsets, sm_scale=sm_scale, causal=causal,
                                              window=window, broadcast_q=broadcast_q)
    return out.to(specs.FP8_OUT_DTYPE), lse.to(torch.float32)


@torch.library.custom_op("jfa::jagged_attention_fp8_fwd", mutates_args=())
def jagged_attention_fp8_fwd(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                             max_seq_len_q: int, max_seq_len_kv: int, sm_scale: float, q_scale: float,
                             k_scale: float, v_scale: float, causal: bool, window: int | None,
                             broadcast_q: bool, v_transposed: bool) -> tuple[Tensor, Tensor]:
    """FP8 forward -> (out [Tq_out, Hq, D] bfloat16, lse float32 [Hq, Tq_out]); inputs validated.
    `v_transposed`: v is `transpose_values(v, kv_offsets)`. This default implementation is the
    reference on the dequantized inputs."""
    dispatch.warn_fallback(f"FP8: q is on {q.device.type}, the TLX kernels need a CUDA (sm_90) GPU")
    return _reference(q, k, v, q_offsets, kv_offsets, sm_scale, (q_scale, k_scale, v_scale), causal, window,
                      broadcast_q, v_transposed)


@jagged_attention_fp8_fwd.register_kernel("cuda")
def _jagged_attention_fp8_fwd_cuda(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, q_scale,
                                   k_scale, v_scale, causal, window, broadcast_q, v_transposed):
    scales = (q_scale, k_scale, v_scale)
    why = dispatch.why_not_kernel(dispatch.FORWARD_KERNEL, q, k, v, dtypes=jagged.FP8_DTYPES)
    if why is not None:
        dispatch.warn_fallback(f"FP8: {why}")
        return _reference(q, k, v, q_offsets, kv_offsets, sm_scale, scales, causal, window, broadcast_q,
                          v_transposed)
    runner, _ = dispatch.load_runner()
    q_offsets, kv_offsets = dispatch.kernel_offsets(q, q_offsets, kv_offsets)
    v_t = v if v_transposed else fp8_fork.transposed_values(v, kv_offsets)
    fork = runner.ForkCall(fork=fp8_fork.FP8_FORK, forward_params=(float(v_scale),), base_tiles=True)
    return runner.forward(q, k, v_t, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, causal, window,
                          broadcast_q, fork=fork, qk_descale=q_scale * k_scale, out_dtype=specs.FP8_OUT_DTYPE)


@jagged_attention_fp8_fwd.register_fake
def _jagged_attention_fp8_fwd_fake(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale,
                                   q_scale, k_scale, v_scale, causal, window, broadcast_q, v_transposed):
    out_rows = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return (q.new_empty(out_rows, q.shape[1], q.shape[2], dtype=specs.FP8_OUT_DTYPE),
            q.new_empty(q.shape[1], out_rows, dtype=torch.float32))


def jagged_attention_fp8(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                         max_seq_len_q: int | None = None, max_seq_len_kv: int | None = None, *,
                         q_scale: float = 1.0, k_scale: float = 1.0, v_scale: float = 1.0,
                         sm_scale: float | None = None, causal: bool = False, window: int | None = None,
                         broadcast_q: bool = False, return_lse: bool = False, v_transposed: bool = False):
    """`jfa.jagged_attention` for float8_e4m3fn q, k, v whose real values are `q * q_scale` (and so
    on). Returns out [Tq_out, Hq, D] in bfloat16 (and lse float32 [Hq, Tq_out] with `return_lse`).
    `v_transposed=True`: v is `transpose_values(v, kv_offsets)`, the layout the kernel reads, made
    once by the caller (otherwise every call copies V into it).
    Validation reads the offsets (a sync when they live on the GPU); a validated call can go straight
    to the custom op `jagged_attention_fp8_fwd`, which torch.compile traces with no host sync."""
    problem = jagged.validate_jagged_attention(q, k, k if v_transposed else v, q_offsets, kv_offsets, max_seq_len_q,
                                               max_seq_len_kv, sm_scale=sm_scale, causal=causal, window=window,
                                               broadcast_q=broadcast_q, fp8=True)
    if v_transposed:
        _check_transposed_values(v, k, kv_offsets)
    scales = [_check_scale(name, value) for name, value in
              (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))]
    out, lse = jagged_attention_fp8_fwd(q, k, v, q_offsets, kv_offsets, problem.max_seq_len_q,
                                        problem.max_seq_len_kv, problem.sm_scale, *scales, causal, window,
                                        broadcast_q, bool(v_transposed))
    return (out, lse) if return_lse else out
