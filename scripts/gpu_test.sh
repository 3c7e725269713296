#!/usr/bin/env bash
# GPU host: run every `gpu`-marked test with triton 3.8 + TLX and record the outcome as JSON.
#   usage (repository root, .gpu-bundle carried):  bash scripts/gpu_test.sh [DEST_DIR] [extra pytest args]
# Collects tests/gpu only: CPU test modules import packages (plotly) the GPU host lacks.
# Writes DEST_DIR/gpu-tests-<date>.json (env block: GPU, driver, CUDA, torch, triton, TLX, commit, date).
set -uo pipefail
dest=${1:-results}; shift || true
[ -f .gpu-bundle/activate.sh ] || { echo "no .gpu-bundle here: build it with 'bash ../shared/gpu/make-bundle.sh' and carry it"; exit 2; }
source .gpu-bundle/activate.sh
export PYTHONUNBUFFERED=1
mkdir -p "$dest"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
python3 -m jfa check
# Kernel compiles dominate the run: spread the tests over processes where pytest-xdist is installed.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-8}")
# Tests that assert on wall-clock times run afterwards, alone: beside 7 compiling workers the host is
# too busy to time (SDPA's nested path once timed its forward above its forward + backward).
python3 -m pytest -m "gpu and not timing" tests/gpu -p no:cacheprovider -q "${workers[@]}" \
    --results-json "$dest/gpu-tests-$stamp.json" "$@"
parallel_status=$?
python3 -m pytest -m "gpu and timing" tests/gpu -p no:cacheprovider -q \
    --results-json "$dest/gpu-tests-$stamp.json" --results-json-append "$@"
timing_status=$?
exit $(( parallel_status > timing_status ? parallel_status : timing_status ))
