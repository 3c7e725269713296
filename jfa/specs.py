"""One source of truth for the facts shared by kernels, tests, benchmarks and notebooks.

Supported shapes and dtypes, tolerances, FLOP formulas, benchmark suites and the provider list live
here and are imported everywhere else, so a number is changed in one place only.
"""
from __future__ import annotations

import math

import torch

# ---- what the kernels accept ---------------------------------------------------------------
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
BLOCK_ATTENTION_BLOCK = 64  # block attention: each 64-token block attends only to itself
MX_BLOCK = 32  # MXFP8: one E8M0 scale per 32 contiguous elements
INT32_MAX = 2**31 - 1

# ---- tolerances (the seed's own, see shared/design/seed-notes.md) ---------------------------
FWD_TOL = dict(atol=1e-2, rtol=1e-2)
GRAD_TOL = dict(atol=2e-2, rtol=2e-2)
FWD_RELERR = 1e-2  # ||out - ref|| / ||ref||, bf16/fp16 forward
GRAD_RELERR = 2e-2
BLOCK_ATTN_GRAD_TOL = dict(atol=0.1, rtol=0.2)
BLOCK_ATTN_GRAD_SNR_DB = 45.0
ROTARY_FWD_SNR_DB = 35.0
ROTARY_GRAD_SNR_DB = 20.0
MXFP8_MIN_COSINE = 0.97
MXFP8_MIN_SQNR_DB = 8.0

# ---- FLOP formulas ----------------------------------------------------------------------------
BWD_FLOP_FACTOR = 2.5  # backward = 2.5x forward (two GEMMs forward, five backward)


def attention_pairs(q_lens, kv_lens, *, causal: bool = False, window: int | None = None) -> int:
    """Number of (query, key) pairs attended: sum over sequences of the visible score entries."""
    total = 0
    for lq, lk in zip(q_lens, kv_lens):
        lq, lk = int(lq), int(lk)
        if not causal and window is None:
            total += lq * lk
            continue
        for i in range(lq):
            hi = min(lk - 1, i) if causal else lk - 1
            lo = 0
            if window is not None:
                lo = max(lo, i - window)
                hi = min(hi, i + window)
            total += max(0, hi - lo + 1)
    return total


def attention_flops(q_lens, kv_lens, heads: int, head_dim: int, *, pass_: str = "fwd",
                    causal: bool = False, window: int | None = None) -> float:
    """FLOPs of attention as the seed counts them: forward 4*H*D*sum(lq*lk), bwd 2.5x, fwd+bwd 3.5x."""
    fwd = 4.0 * heads * head_dim * attention_pairs(q_lens, kv_lens, causal=causal, window=window)
    factor = {"fwd": 1.0, "bwd": BWD_FLOP_FACTOR, "fwd+bwd": 1.0 + BWD_FLOP_FACTOR}[pass_]
    return fwd * factor


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 and math.isfinite(ms) else float("nan")


# ---- ceilings measured on the H200 (shared/design/anchors-h200.md) ----------------------------
H200_BF16_GEMM_TFLOPS = 790.0
H200_COPY_TBPS = 4.3
