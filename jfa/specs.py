"""One source of truth for the facts shared by kernels, tests, benchmarks and notebooks.

Supported shapes and dtypes, tolerances, FLOP formulas, benchmark suites and the provider list live
here and are imported everywhere else, so a number is changed in one place only.
"""
from __future__ import annotations

import math

import torch

from jfa.kernels.masks import visible_key_range
from jfa.kernels.twin import torch_twin

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
# An element past GRAD_TOL passes where the tensor's largest error is at most this many times that of
# the same computation in PyTorch in the kernels' dtype (FlashAttention's test criterion): a 16-bit
# gradient summed over many rows carries an absolute error that grows with them, which no fixed atol
# bounds.
GRAD_BASELINE_FACTOR = 2.0
BLOCK_ATTN_GRAD_TOL = dict(atol=0.1, rtol=0.2)
BLOCK_ATTN_GRAD_SNR_DB = 45.0
ROTARY_FWD_SNR_DB = 35.0
ROTARY_GRAD_SNR_DB = 20.0
MXFP8_MIN_COSINE = 0.97  # the MXFP8 work's bars for a whole quantized attention against fp32
MXFP8_MIN_SQNR_DB = 8.0
# The FP8 kernel (E4M3 inputs, P rounded to E4M3) against the fp32 reference on its own dequantized
# inputs: it measures 31.6-32.2 dB on the FP8 suite and its numerics emulated 33 dB; P rounded to E5M2
# instead, one mantissa bit less, emulates at 27 dB, under this bar.
FP8_MIN_SQNR_DB = 28.0
FP8_MIN_COSINE = 0.999
FP8_OUT_DTYPE = torch.bfloat16  # the FP8 fork's output (E4M3 inputs; LSE stays fp32)

# ---- FLOP formulas ----------------------------------------------------------------------------
BWD_FLOP_FACTOR = 2.5  # backward = 2.5x forward (two GEMMs forward, five backward)


def attention_pairs(q_lens, kv_lens, *, causal: bool = False, window: int | None = None) -> int:
    """Number of visible (query, key) pairs, with the masks of docs/CONTRACTS.md: for every query row,
    the keys the kernels' own `jfa.kernels.masks.visible_key_range` gives it.

    Causal is bottom-right aligned (query i sees keys j <= i + lk - lq); the window is |i - j| <= W.
    """
    total = 0
    key_range = torch_twin(visible_key_range)
    for lq, lk in zip(q_lens, kv_lens):
        lq, lk = int(lq), int(lk)
        if not causal and window is None:
            total += lq * lk
            continue
        rows = torch.arange(lq)
        kv_lo, kv_hi, _, _ = key_range(rows, rows, lq, lk, 0 if window is None else window, causal, window is not None)
        total += int((torch.as_tensor(kv_hi) - kv_lo).clamp(min=0).sum())
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
H200_SM_COUNT = 132  # streaming multiprocessors: the persistent kernels' program count


# ==== benchmark suites and providers (owned by jfa/bench.py; suites are data) ==================
# A case names its shape only; jfa/bench.py turns it into tensors (lengths from
# jfa.jagged.gem_lengths with BENCH_SEED). Kinds:
#   "jagged"       self- or cross-attention on packed sequences (kv_len fixed => cross-attention)
#   "pma"          one shared query of q_len rows against B jagged KV sequences (broadcast-Q)
#   "dense"        B equal sequences of max_len (LLM-style), through each provider's varlen/dense API
#   "block_sparse" jagged self-attention visiting a random fraction `density` of KV blocks
#   "fp8"          jagged self-attention with E4M3 inputs, forward only
#   "block"        block attention: each 64-token block of a sequence attends only to itself
BENCH_WARMUP_MS = 25  # triton.testing.do_bench anchors (shared/design/anchors-h200.md)
BENCH_REP_MS = 100
BENCH_SEED = 0
BENCH_PASSES = ("fwd", "bwd", "fwd+bwd")
# Rotate input sets until they span several L2s (50 MiB on H200) so no timed call is served from
# cache left by the previous one; capped because big cases already overflow L2 with one set.
BENCH_ROTATION_BYTES = 4 * 50 * 2**20
BENCH_MAX_INPUT_SETS = 4
BENCH_CHECK_MAX_ROWS = 16384  # reference check on a subset of sequences holding at most this many rows
BLOCK_SPARSE_BLOCK = 128  # block-sparse selection granularity (rows and columns)
FP8_BENCH_DTYPE = "float8_e4m3fn"


def _case(suite: str, name: str, kind: str, *, batch: int, heads: int, head_dim: int, max_len: int,
          sparsity: float = 1.0, kv_len: int | None = None, q_len: int | None = None,
          density: float | None = None, dtype: str = "bfloat16") -> dict:
    return dict(suite=suite, case=name, kind=kind, batch=batch, heads=heads, head_dim=head_dim,
                max_len=max_len, sparsity=sparsity, kv_len=kv_len, q_len=q_len, density=density,
                dtype=dtype)


def _gem_cases(suite: str, kind: str, *, batch: int, heads: int, head_dim: int, max_lens, sparsities,
               **extra) -> tuple[dict, ...]:
    return tuple(_case(suite, f"L={L},s={s}", kind, batch=batch, heads=heads, head_dim=head_dim,
                       max_len=L, sparsity=s, **extra) for L in max_lens for s in sparsities)


GEM_BATCH, GEM_HEADS, GEM_HEAD_DIM = 1152, 4, 128
CROSS_KV_LEN = 256
PMA_KV_MAX_LEN = 2048  # KV lengths U[1, 2048]: gem_lengths with s = 0.5
BLOCK_SPARSE_DENSITIES = (0.25, 0.5, 0.75, 1.0)

BENCH_SUITES: dict[str, tuple[dict, ...]] = {
    "gem": _gem_cases("gem", "jagged", batch=GEM_BATCH, heads=GEM_HEADS, head_dim=GEM_HEAD_DIM,
                      max_lens=(256, 512, 1024, 2048), sparsities=(0.5, 1.0)),
    "cross": _gem_cases("cross", "jagged", batch=GEM_BATCH, heads=GEM_HEADS, head_dim=GEM_HEAD_DIM,
                        max_lens=(256, 512, 1024, 2048), sparsities=(0.5, 1.0), kv_len=CROSS_KV_LEN),
    "pma": tuple(_case("pma", f"q={q},kv<={PMA_KV_MAX_LEN}", "pma", batch=GEM_BATCH, heads=GEM_HEADS,
                       head_dim=GEM_HEAD_DIM, max_len=PMA_KV_MAX_LEN, sparsity=0.5, q_len=q)
                 for q in (64, 256)),
    "dense": tuple(_case("dense", f"B=4,H=32,N=4096,D={d}", "dense", batch=4, heads=32, head_dim=d,
                         max_len=4096) for d in (128, 64)),
    "block_sparse": tuple(_case("block_sparse", f"L=2048,density={p}", "block_sparse", batch=GEM_BATCH,
                                heads=GEM_HEADS, head_dim=GEM_HEAD_DIM, max_len=2048, density=p)
                          for p in BLOCK_SPARSE_DENSITIES),
    "fp8": _gem_cases("fp8", "fp8", batch=GEM_BATCH, heads=GEM_HEADS, head_dim=GEM_HEAD_DIM,
                      max_lens=(1024, 2048), sparsities=(0.5, 1.0), dtype=FP8_BENCH_DTYPE),
    "block": tuple(_case("block", f"L={L},s={s},D={d}", "block", batch=GEM_BATCH, heads=GEM_HEADS,
                         head_dim=d, max_len=L, sparsity=s)
                   for L in (1024, 2048, 4096) for s in (0.5, 1.0) for d in (64, 128)),
}

# `--quick`: the same kinds at toy sizes, for smoke runs (seconds, any GPU).
BENCH_QUICK_SUITES: dict[str, tuple[dict, ...]] = {
    "gem": _gem_cases("gem", "jagged", batch=8, heads=2, head_dim=64, max_lens=(128,),
                      sparsities=(0.5, 1.0)),
    "cross": _gem_cases("cross", "jagged", batch=8, heads=2, head_dim=64, max_lens=(128,),
                        sparsities=(0.5,), kv_len=64),
    "pma": (_case("pma", "q=16,kv<=128", "pma", batch=8, heads=2, head_dim=64, max_len=128,
                  sparsity=0.5, q_len=16),),
    "dense": (_case("dense", "B=2,H=2,N=256,D=64", "dense", batch=2, heads=2, head_dim=64,
                    max_len=256),),
    "block_sparse": (_case("block_sparse", "L=512,density=0.5", "block_sparse", batch=4, heads=2,
                           head_dim=64, max_len=512, density=0.5),),
    "fp8": _gem_cases("fp8", "fp8", batch=8, heads=2, head_dim=64, max_lens=(128,), sparsities=(0.5,),
                      dtype=FP8_BENCH_DTYPE),
    "block": (_case("block", "L=256,s=0.5,D=64", "block", batch=8, heads=2, head_dim=64, max_len=256,
                    sparsity=0.5),),
}

# Providers, in report order. "jfa" is ours; the rest are peers measured on the same inputs.
BENCH_PROVIDERS = ("jfa", "fa2", "fa3", "fa4", "flex", "sdpa_cudnn", "sdpa_flash")
BENCH_BASELINE_PROVIDER = "jfa"  # speedups in the report are jfa's time over each peer's
# The backward issue's speed targets: jfa's backward over FA4's, per case of a suite, or over the
# suite's geometric mean where the suite is in BWD_TARGET_MEAN_SUITES.
BWD_TARGET_PEER = "fa4"
BWD_TARGETS = {"gem": 1.5, "pma": 1.5, "dense": 1.17}
BWD_TARGET_MEAN_SUITES = ("gem",)

# ---- compile-only inspection (jfa/inspect.py, tutorials) --------------------------------------
INSPECT_TARGETS = {"sm_90": 90, "sm_100": 100}  # target name -> CUDA compute capability
WARP_SIZE = 32
WARPGROUP_WARPS = 4  # wgmma and setmaxnreg act on whole warpgroups of 4 warps
SETMAXNREG_MAX = 256  # per-thread register ceiling that setmaxnreg can grant
TMEM_COLUMNS = 512  # Blackwell tensor memory per SM: 128 lanes x 512 columns of 32 bits

# ---- references, validation, ops (jfa/reference.py, jfa/jagged.py, jfa/ops.py) ----------------
FP8_BLOCK_ROWS = 128  # per-block FP8: one scale per 128 rows of a head (one Hopper Q/KV tile)
TMA_ALIGN_BYTES = 16  # TMA needs 16-byte aligned base addresses: kernel inputs must start aligned

# ---- notebooks' budget calculator (jfa/widgets.py): per-SM limits of H100/H200 and B200 ---------
SHARED_BYTES_PER_BLOCK = {"sm_90": 227 * 1024, "sm_100": 227 * 1024}  # opt-in maximum for one CTA
REGISTERS_PER_SM = 65536  # 32-bit registers shared by all resident threads
SETMAXNREG_MIN = 24  # setmaxnreg accepts 24..256 registers per thread, in steps of 8
SETMAXNREG_STEP = 8
MBARRIER_BYTES = 8  # one mbarrier object in shared memory
TMEM_LANES = 128  # tensor memory rows: one accumulator row per lane
TMEM_ALLOC_MIN_COLUMNS = 32  # tcgen05.alloc grants powers of two from 32 columns up
