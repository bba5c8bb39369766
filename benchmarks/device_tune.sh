#!/usr/bin/env bash
# Tune one shapes file on the device and bring the winners back as an export under $OUT.
#   [OPS=gated_pairs,down] [TRAIN=1] [TOKENS=1,16] bash benchmarks/device_tune.sh SHAPES TRIALS SECONDS_PER_KEY NAME TOTAL_SECONDS
# OPS keeps only those ops' keys; TRAIN=1 adds the training ops (gated_bwd) to what OPS allows; TOKENS overrides
# the file's token counts. Issue 16's tuned sweep: SHAPES from `python3 benchmarks/never_slower.py --write-shapes F`.
# The device image lacks optuna and diskcache: run ../shared/device/wheels.sh here first and
# carry .whl. The cache lives in /tmp; only the export (JSON) and the log come back.
set -euo pipefail
shapes=$1 trials=$2 seconds=$3 name=$4 total=$5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=/tmp/autofuse-tune-$name
start=$(date +%s)
# Cut off at TOTAL_SECONDS so the export below still runs: every key finished by then is exported.
extra=()
[ -n "${OPS:-}" ] && extra+=(--ops "$OPS")
[ "${TRAIN:-0}" = 1 ] && extra+=(--train)
[ -n "${TOKENS:-}" ] && extra+=(--tokens "$TOKENS")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/$name.gpu.txt"
timeout "$total" python3 -m autofuse.cli tune --shapes "$shapes" --trials "$trials" --time-budget "$seconds" "${extra[@]}" \
    2>"$OUT/$name.progress.log" | tee "$OUT/$name.table.txt" || echo "tune stopped early (exit $?)"
echo "tune wall seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/$name.table.txt"
python3 -m autofuse.cli cache export -o "$OUT/$name.json"
