#!/usr/bin/env bash
# The jagged forward kernel on a Hopper GPU, in one go: its gpu tests, the timing of the benchmark
# shapes (GEM-like jagged self-attention, broadcast-Q "PMA", dense) against the H200 anchors, the
# cost of building the tile schedule, and compute-sanitizer memcheck + racecheck on a tiny case.
# Run from the repository root (on the GPU host: `source .gpu-bundle/activate.sh` first).
# Logs and the timing JSON go to $OUT (default ./out/fwd). Phases: PHASES="tests bench sanitize".
set -uo pipefail
OUT=${OUT:-out/fwd}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PHASES=${PHASES:-smoke tests bench sanitize}
status=0

if [[ " $PHASES " == *" smoke "* ]]; then
  # One small launch first: a pipeline deadlock shows up here in seconds, not as a silent test hang.
  echo "== smoke"
  timeout "${SMOKE_TIMEOUT_S:-40}" $PY - <<'PY' 2>&1 | tee "$OUT/smoke.log"
import torch
from jfa import reference
from jfa.kernels import jagged_fwd
lengths = [300, 5, 129]
off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
q, k, v = (torch.randn(sum(lengths), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, off, off, 300, 300, None, False, None, False)
ref, ref_lse = reference.jagged_attention_ref(q, k, v, off, off)
print("smoke max abs err out", (out.float() - ref).abs().max().item(), "lse", (lse - ref_lse).abs().max().item())
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "smoke failed: skipping the rest"; exit 1; }
fi

if [[ " $PHASES " == *" tests "* ]]; then
  echo "== gpu tests"
  # In parallel where pytest-xdist is installed (the compiles dominate), with a per-test timeout
  # where pytest-timeout is (a pipeline deadlock then names its test instead of stalling the run).
  extra=()
  $PY -c "import xdist" 2>/dev/null && extra+=(-n "${TEST_WORKERS:-8}")
  $PY -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout "${PER_TEST_TIMEOUT_S:-60}")
  timeout "${TEST_TIMEOUT_S:-100}" $PY -m pytest -v --tb=short -p no:cacheprovider --maxfail=10 "${extra[@]}" tests/gpu/test_jagged_fwd.py 2>&1 \
    | tee "$OUT/tests.log" | grep -v "PASSED" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $PHASES " == *" bench "* ]]; then
  echo "== timing (do_bench median, TFLOP/s = 4*H*D*sum(lq*lk) / time)"
  timeout "${BENCH_TIMEOUT_S:-90}" $PY - "$OUT/bench.json" <<'PY' 2>&1 | tee "$OUT/bench.log"
import json, math, sys
import torch, triton
from jfa import specs
from jfa.jagged import gem_lengths
from jfa.kernels import jagged_fwd
from jfa.schedule import build_tile_schedule, clear_cache

# FA4 forward TFLOP/s on the same H200 (shared/design/anchors-h200.md), the targets' yardstick.
FA4_FWD = {("gem", 256, 1.0): 201, ("gem", 512, 1.0): 340, ("gem", 1024, 1.0): 449,
           ("gem", 2048, 1.0): 525, ("gem", 256, 0.5): 98, ("gem", 512, 0.5): 203,
           ("gem", 1024, 0.5): 344, ("gem", 2048, 0.5): 406, ("pma", 64): 182, ("pma", 256): 406,
           ("dense",): 690}
H, D, B = specs.GEM_HEADS, specs.GEM_HEAD_DIM, specs.GEM_BATCH

def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

def bench(q_lens, kv_lens, heads, head_dim, broadcast_q=False):
    q_rows = q_lens[0] if broadcast_q else sum(q_lens)
    q = torch.randn(q_rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(kv_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_off, kv_off = offsets([q_lens[0]] if broadcast_q else q_lens), offsets(kv_lens)
    args = (q, k, v, q_off, kv_off, max(q_lens), max(kv_lens), None, False, None, broadcast_q)
    run = lambda: jagged_fwd.jagged_attention_fwd(*args)
    ms = triton.testing.do_bench(run, warmup=specs.BENCH_WARMUP_MS, rep=specs.BENCH_REP_MS, return_mode="median")
    def build():
        clear_cache()
        build_tile_schedule(q_off, kv_off, max_seq_len_q=max(q_lens), max_seq_len_kv=max(kv_lens),
                            block_m=128, block_n=128, causal=False, window=None, broadcast_q=broadcast_q)
    sched_ms = triton.testing.do_bench(build, warmup=5, rep=20, return_mode="median")
    flops = specs.attention_flops([q_lens[0]] * len(kv_lens) if broadcast_q else q_lens, kv_lens, heads, head_dim)
    return ms, sched_ms, specs.tflops(flops, ms)

rows, ratios = [], []
cases = [("gem", L, s) for s in (1.0, 0.5) for L in (256, 512, 1024, 2048)] + [("pma", 64), ("pma", 256), ("dense",)]
for case in cases:
    if case[0] == "gem":
        lens = gem_lengths(B, case[1], case[2], seed=specs.BENCH_SEED).tolist()
        ms, sched_ms, tf = bench(lens, lens, H, D)
    elif case[0] == "pma":
        kv = gem_lengths(B, specs.PMA_KV_MAX_LEN, 0.5, seed=specs.BENCH_SEED).tolist()
        ms, sched_ms, tf = bench([case[1]], kv, H, D, broadcast_q=True)
    else:
        ms, sched_ms, tf = bench([4096] * 4, [4096] * 4, 32, 128)
    fa4 = FA4_FWD[case]
    if case[0] == "gem":
        ratios.append(tf / fa4)
    rows.append(dict(case=str(case), ms=ms, schedule_build_ms=sched_ms, tflops=tf, fa4_tflops=fa4))
    print(f"{str(case):<22} {ms:8.3f} ms  {tf:6.1f} TFLOP/s  (FA4 {fa4}, x{tf / fa4:.2f})  schedule build {sched_ms * 1e3:6.1f} us", flush=True)
geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
print(f"GEM geometric mean vs FA4: x{geo:.3f}")
json.dump(dict(rows=rows, gem_geomean_vs_fa4=geo, gpu=torch.cuda.get_device_name()), open(sys.argv[1], "w"), indent=1)
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $PHASES " == *" sanitize "* ]]; then
  cat > "$OUT/sanitize_case.py" <<'PY'
import torch
from jfa.kernels import jagged_fwd
lengths = [1, 63, 130, 0, 65]
offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
q = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
out, lse = jagged_fwd.jagged_attention_fwd(q, k, v, offsets, offsets, 130, 130, None, True, 40, False)
pma, _ = jagged_fwd.jagged_attention_fwd(q[:16], k, v, torch.tensor([0, 16], dtype=torch.int32, device="cuda"),
                                         offsets, 16, 130, None, False, None, True)
# D=128 with half last tiles (130, 200, 129: a last tile of 2, 72 and 1 keys; 256: whole tiles)
tails = [130, 200, 256, 129, 1]
tail_offsets = torch.tensor([0] + torch.tensor(tails).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
q2, k2, v2 = (torch.randn(sum(tails), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
half, _ = jagged_fwd.jagged_attention_fwd(q2, k2, v2, tail_offsets, tail_offsets, 256, 256, None, False, None, False)
# broadcast-Q of 200 rows (two query blocks, head-major): whole blocks through the output stages, the
# last one partial
bq = torch.randn(200, 2, 128, device="cuda", dtype=torch.bfloat16)
head_major, _ = jagged_fwd.jagged_attention_fwd(bq, k2, v2, torch.tensor([0, 200], dtype=torch.int32, device="cuda"),
                                                tail_offsets, 200, 256, None, False, None, True)
torch.cuda.synchronize()
print("sanitizer case ran:", tuple(out.shape), tuple(pma.shape), tuple(half.shape), tuple(head_major.shape),
      bool(torch.isfinite(out).all() and torch.isfinite(half).all() and torch.isfinite(head_major).all()))
PY
  SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [ -n "$SANITIZER" ]; then
    # --report-api-errors no: Triton's module loader calls cuFuncSetAttribute once per kernel, gets
    # CUDA_ERROR_INVALID_VALUE and carries on; that host-side refusal is not a memory error of ours.
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool (tiny case)"
      timeout "${SANITIZER_TIMEOUT_S:-60}" "$SANITIZER" --tool $tool --report-api-errors no --error-exitcode 3 \
        $PY "$OUT/sanitize_case.py" 2>&1 \
        | tee "$OUT/$tool.log" | tail -8
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
  else
    echo "compute-sanitizer not found: memcheck/racecheck NOT run"; status=1
  fi
fi
exit $status
