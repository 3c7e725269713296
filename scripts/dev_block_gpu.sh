#!/usr/bin/env bash
# Block attention on a Hopper GPU, in one go: the gpu tests, a compute-sanitizer memcheck of a tiny
# case (partial blocks, GQA, the rotary epilogue), and the timing of the production shape
# (B=1152, H=4, D=128, lengths U[1,4096]): forward, forward+backward and the fused rotary backward.
# Run from the repository root (on the GPU host: `source .gpu-bundle/activate.sh` first).
# Logs and the timing JSON go to $OUT (default ./out/block). Phases: PHASES="tests memcheck timing".
set -uo pipefail
OUT=${OUT:-out/block}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PHASES=${PHASES:-tests memcheck timing}
status=0

if [[ " $PHASES " == *" tests "* ]]; then
echo "== gpu tests"
timeout "${TEST_TIMEOUT_S:-90}" $PY -m pytest -q --maxfail=8 tests/gpu/test_block_attn.py 2>&1 | tee "$OUT/tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $PHASES " == *" memcheck "* ]]; then
echo "== compute-sanitizer memcheck (tiny case)"
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$SANITIZER" ]; then
  # --report-api-errors no: Triton's module loader calls cuFuncSetAttribute once per kernel, gets
  # CUDA_ERROR_INVALID_VALUE and carries on; that host-side refusal is not a memory error of ours.
  timeout "${SANITIZER_TIMEOUT_S:-60}" "$SANITIZER" --tool memcheck --report-api-errors no --error-exitcode 3 $PY - <<'PY' 2>&1 | tee "$OUT/memcheck.log" | tail -8
import torch
from jfa import reference
from jfa.kernels import block_attn
lengths = [1, 63, 65, 0, 130]
offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
rows = sum(lengths)
q = torch.randn(rows, 4, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(rows, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
out = block_attn.block_attention_fwd(q, k, v, offsets)
grads = block_attn.block_attention_bwd(q, k, v, offsets, torch.randn_like(out))
dz = block_attn.block_attention_rotary_bwd(q, k, v, offsets, torch.randn_like(out), reference.make_sinu_pos(offsets, 64))
torch.cuda.synchronize()
print("memcheck case ran:", tuple(out.shape), tuple(dz.shape))
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "compute-sanitizer not found: memcheck NOT run"; status=1
fi
fi

if [[ " $PHASES " == *" timing "* ]]; then
echo "== timing (do_bench median)"
timeout "${TIMING_TIMEOUT_S:-90}" $PY - "$OUT/timing.json" <<'PY' 2>&1 | tee "$OUT/timing.log"
import json, sys
import torch
import triton.testing
from jfa import reference, specs
from jfa.kernels import block_attn, rotary

batch, heads, head_dim, max_len = 1152, 4, 128, 4096
gen = torch.Generator().manual_seed(0)
lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
rows = int(lengths.sum())
q, k, v, dout = (torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
sinu_pos = reference.make_sinu_pos(offsets, head_dim)
block = specs.BLOCK_ATTENTION_BLOCK
# FLOPs as the seed counts them (4*H*D per attended pair); a block of r rows attends r*r pairs
pairs = sum((min(block, int(n) - s)) ** 2 for n in lengths for s in range(0, int(n), block))
fwd_flops = 4.0 * heads * head_dim * pairs

def bench(fn):
    return triton.testing.do_bench(fn, warmup=specs.BENCH_WARMUP_MS, rep=specs.BENCH_REP_MS, return_mode="median")

fwd_ms = bench(lambda: block_attn.block_attention_fwd(q, k, v, offsets))
fwd_bwd_ms = bench(lambda: block_attn.block_attention_bwd(q, k, v, offsets, block_attn.block_attention_fwd(q, k, v, offsets)))
rot_bwd_ms = bench(lambda: block_attn.block_attention_rotary_bwd(q, k, v, offsets, dout, sinu_pos))
# The unfused path: plain backward, then the conjugate rotation and dz assembly, (a) as one Triton
# pass per gradient (jfa.kernels.rotary: the strong baseline), (b) as PyTorch fp32 ops.
unfused_triton_ms = bench(lambda: rotary.rotary_conj_dz(block_attn.block_attention_bwd(q, k, v, offsets, dout),
                                                        sinu_pos))
unfused_torch_ms = bench(lambda: torch.cat([reference.rotary_conj_ref(g, sinu_pos).to(q.dtype).flatten(1)
                                            for g in block_attn.block_attention_bwd(q, k, v, offsets, dout)], dim=1))
result = {
    "shape": dict(batch=batch, heads=heads, head_dim=head_dim, lengths=f"U[1,{max_len}]", rows=rows, dtype="bf16"),
    "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "bwd_ms": fwd_bwd_ms - fwd_ms, "rotary_bwd_ms": rot_bwd_ms,
    "unfused_rotary_bwd_ms": unfused_torch_ms, "unfused_triton_rotary_bwd_ms": unfused_triton_ms,
    "fwd_tflops": specs.tflops(fwd_flops, fwd_ms),
    "bwd_tflops": specs.tflops(specs.BWD_FLOP_FACTOR * fwd_flops, fwd_bwd_ms - fwd_ms),
}
for key, value in result.items():
    print(f"{key:>14}: {value:.3f}" if isinstance(value, float) else f"{key:>14}: {value}")
json.dump(result, open(sys.argv[1], "w"), indent=1)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
