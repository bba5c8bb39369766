#!/usr/bin/env bash
# Issue 15: the shipped file of this GPU's kind tuned again where a host-bound library record keeps no runner-up
# kernel (benchmarks/runner_ups_shipped.py, at most RETUNE_S seconds; the file is written after every key), copied
# to $OUT; then, with that file in place, benchmarks/device_plain.sh (TESTS=0 GENERATE=... SWEEP_S=... as there),
# which packs $OUT into results.tgz. Carry .whl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H100*) file=cache/nvidia-h100-triton-3.6.0.json ;;
  *H200*) file=cache/nvidia-h200-triton-3.6.0.json ;;
  *) echo "no shipped file for this GPU"; exit 1 ;;
esac
PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=$(mktemp -d) timeout "${RETUNE_S:-300}" \
    python3 benchmarks/runner_ups_shipped.py "$file" --out "$OUT" 2>&1 | grep -v "warn" | tee "$OUT/runner_ups.txt" | tail -3
cp "$file" "$OUT/"
WHEELS=0 bash benchmarks/device_plain.sh
