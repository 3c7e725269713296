#!/usr/bin/env bash
# GPU host: record tutorial 3's role timeline from in-kernel %globaltimer stamps, for notebook 01.
#   usage (repository root, .gpu-bundle carried):  bash scripts/record_timeline.sh [DEST_DIR]
# Writes DEST_DIR (default $OUT, else results) /t03-timeline-<date>.json with the environment block, and
# prints each role's busy fraction. A timeout guards against a pipeline that deadlocks instead of failing.
set -uo pipefail
dest=${1:-${OUT:-results}}
# Activating again when the caller already did is harmless (the site directories stack).
if [ -f .gpu-bundle/activate.sh ]; then source .gpu-bundle/activate.sh
else echo "no .gpu-bundle here: using the python3 on PATH (TLX must already be importable)"; fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$dest"
timeout "${TIMELINE_TIMEOUT_S:-180}" python3 -m tutorials.timeline --out "$dest"
