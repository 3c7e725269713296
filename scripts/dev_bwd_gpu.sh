#!/usr/bin/env bash
# Jagged attention backward on a Hopper GPU, in one go (about 4 minutes; every step under `timeout`):
#   1. compile every kernel configuration the tests use, one process each, in parallel (Triton's disk cache
#      then serves the tests, which would otherwise compile ~15 configurations one after another);
#   2. the gpu tests (tests/gpu/test_jagged_bwd.py);
#   3. compute-sanitizer memcheck and racecheck on one tiny case;
#   4. timings (do_bench median): fwd+bwd minus fwd, and the backward alone in each dq_mode, on the
#      GEM shapes, PMA and dense, as TFLOP/s with specs.attention_flops(pass_="bwd").
# Run from the repository root (on the GPU host: `source .gpu-bundle/activate.sh` first). Racecheck
# flags Triton's warp-specialization preamble (setmaxnreg bookkeeping bytes written before and read
# after a CTA-wide bar.sync), not kernel code: see the SASS at the reported offsets.
# Logs and the timing JSON go to $OUT (default ./out/bwd). SKIP_TESTS=1 skips step 2.
set -uo pipefail
OUT=${OUT:-out/bwd}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
status=0
SCRATCH=$(mktemp -d)  # helper scripts and per-process logs: $OUT keeps only a few files

echo "== parallel compile warm-up (one process per configuration, each under its own timeout)"
cat > "$SCRATCH/warm_one.py" <<'PY'
import sys, time
import torch
from jfa.kernels import jagged_bwd

head_dim, dtype, causal, window, broadcast_q, dq_mode = eval(sys.argv[1])
dtype = getattr(torch, dtype)
start = time.time()
lens = [3, 70]
q = torch.randn(3 if broadcast_q else sum(lens), 2, head_dim, device="cuda", dtype=dtype)
k, v = (torch.randn(sum(lens), 2, head_dim, device="cuda", dtype=dtype) for _ in range(2))
out_rows = 3 * len(lens) if broadcast_q else q.shape[0]
out = torch.randn(out_rows, 2, head_dim, device="cuda", dtype=dtype)
lse = torch.zeros(2, out_rows, device="cuda")
q_off = torch.tensor([0, 3] if broadcast_q else [0, 3, 73], dtype=torch.int32, device="cuda")
kv_off = torch.tensor([0, 3, 73], dtype=torch.int32, device="cuda")
jagged_bwd.jagged_attention_bwd(out, q, k, v, out, lse, q_off, kv_off, 70, 70, None, causal, window, broadcast_q,
                                dq_mode=dq_mode)
torch.cuda.synchronize()
print(f"ok {time.time() - start:5.1f}s {sys.argv[1]}")
PY
# (head_dim, dtype, causal, window, broadcast_q, dq_mode), as the tests use them
CONFIGS=(
  '(128, "bfloat16", False, None, False, "separate")' '(64, "bfloat16", False, None, False, "separate")'
  '(128, "float16", False, None, False, "separate")' '(64, "float16", False, None, False, "separate")'
  '(128, "bfloat16", True, None, False, "separate")' '(128, "bfloat16", False, 32, False, "separate")'
  '(128, "bfloat16", True, 32, False, "separate")' '(64, "bfloat16", True, None, False, "separate")'
  '(128, "bfloat16", False, None, True, "separate")' '(128, "bfloat16", True, 32, True, "separate")'
  '(64, "bfloat16", False, None, True, "separate")'
)
for mode in atomic tma_reduce; do
  CONFIGS+=("(128, \"bfloat16\", False, None, False, \"$mode\")" "(128, \"bfloat16\", True, 32, False, \"$mode\")"
            "(64, \"bfloat16\", True, None, False, \"$mode\")" "(128, \"bfloat16\", False, None, True, \"$mode\")"
            "(128, \"bfloat16\", True, 32, True, \"$mode\")")
done
for i in "${!CONFIGS[@]}"; do
  timeout -k 5 "${WARMUP_TIMEOUT_S:-80}" $PY "$SCRATCH/warm_one.py" "${CONFIGS[$i]}" > "$SCRATCH/warm_$i.log" 2>&1 &
done
wait
for i in "${!CONFIGS[@]}"; do
  if grep -q "^ok" "$SCRATCH/warm_$i.log"; then grep "^ok" "$SCRATCH/warm_$i.log"
  else echo "FAIL or TIMEOUT ${CONFIGS[$i]}:"; tail -15 "$SCRATCH/warm_$i.log"; status=1; fi
done 2>&1 | tee "$OUT/warmup.log"

if [ "${SKIP_TESTS:-0}" = 1 ]; then echo "== gpu tests skipped (SKIP_TESTS=1)"; else
for group in "self_attention or is_supported" "cross_attention or broadcast_q" "fused_dq_modes" \
             "deterministic or large_logits or public_api or torch_compile"; do
  echo "== gpu tests: $group"
  timeout -k 5 "${TEST_TIMEOUT_S:-50}" $PY -m pytest -v -rs -p no:cacheprovider tests/gpu/test_jagged_bwd.py -k "$group" 2>&1 \
    | tee -a "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|Error|assert|relative error|passed|failed" | head -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
fi

SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
cat > "$SCRATCH/tiny_case.py" <<'PY'
import torch
from jfa.kernels import jagged_bwd
lens = [1, 65, 0, 130]
offsets = torch.tensor([0, 1, 66, 66, 196], dtype=torch.int32, device="cuda")
q = torch.randn(196, 4, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(196, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
out, dout = torch.randn_like(q), torch.randn_like(q)
lse = torch.randn(4, 196, device="cuda")
for dq_mode in ("separate", "tma_reduce"):
    grads = jagged_bwd.jagged_attention_bwd(dout, q, k, v, out, lse, offsets, offsets, 130, 130, None, True, None,
                                            False, dq_mode=dq_mode)
    torch.cuda.synchronize()
    print(f"tiny case ran ({dq_mode}):", [tuple(g.shape) for g in grads])
PY
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool (tiny case: lengths 1,65,0,130, GQA 2, D=64, causal; dq_mode separate, tma_reduce)"
  if [ -n "$SANITIZER" ]; then
    timeout "${SANITIZER_TIMEOUT_S:-30}" "$SANITIZER" --tool $tool --report-api-errors no --error-exitcode 3 $PY "$SCRATCH/tiny_case.py" 2>&1 \
      | tee "$OUT/$tool.log" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    echo "compute-sanitizer not found: $tool NOT run"; status=1
  fi
done

echo "== timing (do_bench median)"
timeout "${TIMING_TIMEOUT_S:-100}" $PY - "$OUT/timing.json" <<'PY' 2>&1 | tee "$OUT/timing.log"
import json, sys, time
import torch
import triton.testing
from jfa import specs
from jfa.jagged import gem_lengths
from jfa.kernels import jagged_bwd, jagged_fwd

def bench(fn):
    return triton.testing.do_bench(fn, warmup=specs.BENCH_WARMUP_MS, rep=specs.BENCH_REP_MS, return_mode="median")

def offsets_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device="cuda")

def case(name, q_lens, kv_lens, heads, head_dim, broadcast_q=False):
    q_off, kv_off = offsets_of([q_lens[0]] if broadcast_q else q_lens), offsets_of(kv_lens)
    q_rows = q_lens[0] if broadcast_q else sum(q_lens)
    out_rows = sum(q_lens)
    q = torch.randn(q_rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(kv_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(out_rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    max_q, max_kv = max(q_lens), max(kv_lens)
    args = (q_off, kv_off, max_q, max_kv, None, False, None, broadcast_q)
    fwd = lambda: jagged_fwd.jagged_attention_fwd(q, k, v, *args)
    bwd = lambda mode=None: jagged_bwd.jagged_attention_bwd(dout, q, k, v, out, lse, *args, dq_mode=mode)
    row = dict(case=name, rows=out_rows, heads=heads, head_dim=head_dim)
    flops = specs.attention_flops(q_lens, kv_lens, heads, head_dim, pass_="bwd")
    try:
        out, lse = fwd()
        row["fwd_ms"] = bench(fwd)
        row["fwd_bwd_minus_fwd_ms"] = bench(lambda: (fwd(), bwd())) - row["fwd_ms"]
    except Exception as exc:  # time the backward alone on stand-in O and LSE
        print(f"  forward kernel failed ({type(exc).__name__}: {str(exc)[:200]}); backward alone only")
        out, lse = torch.randn_like(dout), torch.zeros(heads, out_rows, device="cuda")
    # The atomic mode was 3-4x slower than the default in round 2: timed on the smaller cases only.
    modes = ("separate", "tma_reduce", "atomic") if out_rows < 600_000 else ("separate", "tma_reduce")
    for mode in modes:
        row[f"bwd_{mode}_ms"] = bench(lambda: bwd(mode))
    if broadcast_q:  # the fixed-order reduce of the per-program dQ copies, on its own
        programs = torch.cuda.get_device_properties(0).multi_processor_count
        partials = torch.zeros(programs, q_rows, heads, head_dim, device="cuda")
        row["bcast_dq_reduce_ms"] = bench(lambda: partials.sum(0))
    for key in [k for k in row if k.endswith("_ms") and k.startswith(("bwd", "fwd_bwd"))]:
        if key != "bcast_dq_reduce_ms":
            row[key.replace("_ms", "_tflops")] = specs.tflops(flops, row[key])
    print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return row

rows = []
for c in specs.BENCH_SUITES["pma"]:
    kv = [int(x) for x in gem_lengths(c["batch"], c["max_len"], c["sparsity"], seed=specs.BENCH_SEED)]
    rows.append(case(f"pma {c['case']}", [c["q_len"]] * len(kv), kv, c["heads"], c["head_dim"], broadcast_q=True))
dense = specs.BENCH_SUITES["dense"][0]
lens = [dense["max_len"]] * dense["batch"]
rows.append(case(f"dense {dense['case']}", lens, lens, dense["heads"], dense["head_dim"]))
# GEM last, largest last: if the step runs out of time, the other suites are already printed.
gem = specs.BENCH_SUITES["gem"]
for c in gem:
    lens = gem_lengths(c["batch"], c["max_len"], c["sparsity"], seed=specs.BENCH_SEED)
    lens = [int(x) for x in lens]
    rows.append(case(f"gem {c['case']}", lens, lens, c["heads"], c["head_dim"]))
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), open(sys.argv[1], "w"),
          indent=1)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
rm -rf "$SCRATCH"
echo "== exit status $status"
exit $status
