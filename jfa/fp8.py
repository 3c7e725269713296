"""FP8 jagged attention forward: E4M3 q, k, v with per-tensor scales, bf16 output.

The FP8 fork of the jagged forward kernel (`jfa.kernels.jagged_fwd` compiled for an E4M3 dtype) is
a diff of the math, not of the kernel: QK^T and P·V run as FP8 wgmma (twice the bf16 rate on
Hopper), P is quantized to E4M3 in registers right before its P·V, and the scales fold into the
softmax's exp2 argument (q and k) and the epilogue (v). P needs no scale of its own: the
conditional rescale keeps its entries in [0, 2^8], inside E4M3's range (448).

Hopper's FP8 wgmma reads its B operand only K-major, so V goes in transposed (`[Hkv*D, keys]`,
made by `jagged_fwd.transposed_values`, one copy per call). Blackwell's block-scaled MXFP8 MMA (one
E8M0 scale per 32 elements, `reference.mx_quantize`) has no Hopper counterpart; per-tensor scales
are what Hopper's wgmma can take without dequantizing.

Forward only: FP8 inputs carry no gradient here. Off a Hopper GPU the float32 reference runs on the
dequantized inputs, and says so once.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from jfa import jagged, reference, specs
from jfa.ops import _kernel_offsets, _load_kernel_module, _warn_once, _why_not_kernel

__all__ = ["jagged_attention_fp8", "jagged_attention_fp8_fwd"]


def _check_scale(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be finite and > 0 (real value = stored E4M3 value * {name}), got {value}")
    return float(value)


def _reference(q, k, v, q_offsets, kv_offsets, sm_scale, scales, causal, window, broadcast_q):
    real = [t.float() * s for t, s in zip((q, k, v), scales)]
    out, lse = reference.jagged_attention_ref(*real, q_offsets, kv_offsets, sm_scale=sm_scale, causal=causal,
                                              window=window, broadcast_q=broadcast_q)
    return out.to(specs.FP8_OUT_DTYPE), lse.to(torch.float32)


@torch.library.custom_op("jfa::jagged_attention_fp8_fwd", mutates_args=())
def jagged_attention_fp8_fwd(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                             max_seq_len_q: int, max_seq_len_kv: int, sm_scale: float, q_scale: float,
                             k_scale: float, v_scale: float, causal: bool, window: int | None,
                             broadcast_q: bool) -> tuple[Tensor, Tensor]:
    """FP8 forward -> (out [Tq_out, Hq, D] bfloat16, lse float32 [Hq, Tq_out]); inputs validated.
    This default implementation is the reference on the dequantized inputs."""
    _warn_once(f"FP8: q is on {q.device.type}, the TLX kernels need a CUDA (sm_90) GPU")
    return _reference(q, k, v, q_offsets, kv_offsets, sm_scale, (q_scale, k_scale, v_scale), causal, window,
                      broadcast_q)


@jagged_attention_fp8_fwd.register_kernel("cuda")
def _jagged_attention_fp8_fwd_cuda(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, q_scale,
                                   k_scale, v_scale, causal, window, broadcast_q):
    scales = (q_scale, k_scale, v_scale)
    why = _why_not_kernel("jagged_fwd", q, k, v, dtypes=jagged.FP8_DTYPES)
    if why is not None:
        _warn_once(f"FP8: {why}")
        return _reference(q, k, v, q_offsets, kv_offsets, sm_scale, scales, causal, window, broadcast_q)
    module, _ = _load_kernel_module("jagged_fwd")
    q_offsets, kv_offsets = _kernel_offsets(q, q_offsets, kv_offsets)
    return module.jagged_attention_fwd(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale,
                                       causal, window, broadcast_q, descale=scales)


@jagged_attention_fp8_fwd.register_fake
def _jagged_attention_fp8_fwd_fake(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale,
                                   q_scale, k_scale, v_scale, causal, window, broadcast_q):
    out_rows = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return (q.new_empty(out_rows, q.shape[1], q.shape[2], dtype=specs.FP8_OUT_DTYPE),
            q.new_empty(q.shape[1], out_rows, dtype=torch.float32))


def jagged_attention_fp8(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                         max_seq_len_q: int | None = None, max_seq_len_kv: int | None = None, *,
                         q_scale: float = 1.0, k_scale: float = 1.0, v_scale: float = 1.0,
                         sm_scale: float | None = None, causal: bool = False, window: int | None = None,
                         broadcast_q: bool = False, return_lse: bool = False):
    """`jfa.jagged_attention` for float8_e4m3fn q, k, v whose real values are `q * q_scale` (and so
    on). Returns out [Tq_out, Hq, D] in bfloat16 (and lse float32 [Hq, Tq_out] with `return_lse`).
    Validation reads the offsets (a sync when they live on the GPU); a validated call can go straight
    to the custom op `jagged_attention_fp8_fwd`, which torch.compile traces with no host sync."""
    problem = jagged.validate_jagged_attention(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv,
                                               sm_scale=sm_scale, causal=causal, window=window,
                                               broadcast_q=broadcast_q, fp8=True)
    scales = [_check_scale(name, value) for name, value in
              (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))]
    out, lse = jagged_attention_fp8_fwd(q, k, v, q_offsets, kv_offsets, problem.max_seq_len_q,
                                        problem.max_seq_len_kv, problem.sm_scale, *scales, causal, window,
                                        broadcast_q)
    return (out, lse) if return_lse else out
