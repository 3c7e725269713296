#!/usr/bin/env bash
# GPU host: run benchmark suites into one results JSON per suite, within a time budget.
#   usage (repository root):  bash scripts/bench_gpu.sh [--quick] [SUITE ...]     (default: every suite)
#   environment:  OUT          where the JSON files go (the device tool's $OUT; default results)
#                 MAX_SECONDS  budget for the whole call, shared by the suites (default 450: the device tool stops a
#                              command at 600 s, and bundle unpacking and one last case need the rest)
#                 PROVIDERS    comma-separated (default all)     PASSES  (default fwd,bwd)
#                 REDO_FAILED  1: rows that failed or were unavailable are run again (after a provider
#                              gained support or a fix); default 0 keeps them
#                 RERUN        1: rows of these suites/PROVIDERS/PASSES recorded by other code (another
#                              commit) are measured again, e.g. after a kernel change; resumable
#                 PREWARM      compile FlexAttention for a suite's cases this many at a time before
#                              timing them (default 6; 0 = off)
#
# Bundles that are present are activated: .fa4-part2 (after .fa4-part1/stage.sh staged its library
# in /tmp, possibly in an earlier call on the same warm machine) and then .gpu-bundle, so the TLX
# Triton comes first on the path. FlexAttention runs in its own process without them (jfa.workbench.bench).
#
# Resuming: a suite's file is results/bench-SUITE[-quick].json; when $OUT lacks it and results/ has
# it (copied back from an earlier call and committed), it is copied to $OUT first and only the
# missing (case, provider, pass) rows are run. A suite stopped by the budget says INCOMPLETE: run
# the same command again.
set -uo pipefail
dest=${OUT:-results}
budget=${MAX_SECONDS:-450}
providers=${PROVIDERS:-all}
passes=${PASSES:-fwd,bwd}
prewarm=${PREWARM:-6}
redo=()
[ "${REDO_FAILED:-0}" = 1 ] && redo=(--redo-failed)
[ "${RERUN:-0}" = 1 ] && redo+=(--rerun)
quick_flag="" suffix=""
if [ "${1:-}" = "--quick" ]; then quick_flag="--quick" suffix="-quick"; shift; fi
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(gem cross pma dense block_sparse fp8 block)
export PYTHONUNBUFFERED=1
# SDPA's cuDNN backend takes nested (jagged) tensors only with this switch (forward only; see
# jfa.workbench.providers.CUDNN_NESTED_NO_BACKWARD): without it the cuDNN rows of jagged suites say why not.
export TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1

if [ -f .fa4-part1/stage.sh ]; then source .fa4-part1/stage.sh; fi
if [ -f .fa4-part2/activate.sh ]; then
  source .fa4-part2/activate.sh || echo "bench_gpu: FA4 not activated (stage .fa4-part1 first); fa4 rows will say unavailable"
fi
if [ -f .gpu-bundle/activate.sh ]; then
  source .gpu-bundle/activate.sh
else
  echo "bench_gpu: no .gpu-bundle here: jfa rows will say unavailable (carry .gpu-bundle)"
fi
python3 -m jfa check

mkdir -p "$dest"
start=$(date +%s)
status=0
for suite in "${suites[@]}"; do
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -le 0 ]; then echo "bench_gpu: budget spent before suite $suite; run again to continue"; status=3; break; fi
  file="bench-$suite$suffix.json"
  if [ ! -f "$dest/$file" ] && [ -f "results/$file" ] && [ "$dest" != "results" ]; then cp "results/$file" "$dest/$file"; fi
  echo "== $suite ($left s left) -> $dest/$file"
  python3 -m jfa bench --suite "$suite" --providers "$providers" --passes "$passes" --out "$dest/$file" \
    --max-seconds "$left" --prewarm "$prewarm" "${redo[@]}" $quick_flag 2>&1 | tee -a "$dest/bench$suffix.log" || status=1
done
files=()
for suite in "${suites[@]}"; do [ -f "$dest/bench-$suite$suffix.json" ] && files+=("$dest/bench-$suite$suffix.json"); done
if [ ${#files[@]} -gt 0 ] && python3 -c "import plotly" 2>/dev/null; then
  python3 -m jfa report "${files[@]}" -o "$dest/report$suffix.html" || status=1
else
  echo "bench_gpu: no plotly here: render with 'python -m jfa report results/bench-*.json -o results/report.html'"
fi
exit $status
