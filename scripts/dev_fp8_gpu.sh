#!/usr/bin/env bash
# GPU host, branch fwd-fp8: what this branch needs before it can merge, in one call (~6 min with a
# warm compile cache; carry .gpu-bundle). Writes under $OUT (default out/fp8):
#   1. the FP8 fork's GPU tests and the forward's (the branch also changed when half-tile code compiles);
#   2. a same-process A/B of the bf16 forward against main's (scripts/ab_fwd_vs_ref.py);
#   3. jfa's rows of the fp8 benchmark suite.
set -uo pipefail
OUT=${OUT:-out/fp8}; mkdir -p "$OUT"
source .gpu-bundle/activate.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
status=0
python3 -m pytest -m gpu tests/gpu/test_fp8.py tests/gpu/test_jagged_fwd.py tests/gpu/test_block_sparse.py -q \
  -p no:cacheprovider --results-json "$OUT/gpu-tests-fp8.json" 2>&1 | tail -15 || status=1
# main's forward: REF_FWD (a copy made where git history exists, e.g. wt/jagged_fwd_main.py), else git show.
ref=${REF_FWD:-$OUT/jagged_fwd_main.py}
[ -f "$ref" ] || git show main:jfa/kernels/jagged_fwd.py > "$ref" 2>/dev/null || rm -f "$ref"
if [ -f "$ref" ]; then
  python3 scripts/ab_fwd_vs_ref.py "$ref" "$OUT/ab-bf16-vs-main.json" --rounds 3 || status=1
else
  echo "no copy of main's jagged_fwd.py: set REF_FWD (git show main:jfa/kernels/jagged_fwd.py > wt/...)"; status=1
fi
PROVIDERS=jfa PASSES=fwd MAX_SECONDS=120 OUT=$OUT bash scripts/bench_gpu.sh fp8 || status=1
exit $status
