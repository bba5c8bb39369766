#!/usr/bin/env bash
# Issue 5 / 16 on the device, one call: GPU tests of the backward (TESTS=0 skips them), tune the backward
# kernel (gated_bwd) for the training shapes, then benchmarks/train_bench.py with those winners (ROUNDS
# rounds, default 3; TRAINING_RUN=0 skips its 300-step loss comparison) and, with PROFILE=1,
# benchmarks/train_profile.py's kernels per step at gemma-7b M=16384 and Llama-3-8B M=4096.
#   bash benchmarks/device_train.sh TRIALS SECONDS_PER_KEY
# Carry .whl (../shared/device/wheels.sh). Everything comes back under $OUT.
set -uo pipefail
trials=${1:-24} seconds=${2:-20}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=/tmp/autofuse-train
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_gpu.py 2>&1 | tail -5 | tee "$OUT/gpu-tests.txt"
fi
start=$(date +%s)
python3 -m autofuse.cli tune --shapes benchmarks/shapes/train.json --train --ops gated_bwd \
    --trials "$trials" --time-budget "$seconds" 2>"$OUT/train-tune.progress.log" | tee "$OUT/train-tune.table.txt"
echo "tune wall seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/train-tune.table.txt"
python3 -m autofuse.cli cache export -o "$OUT/train-tune.json"
extra=()
[ "${TRAINING_RUN:-1}" = 1 ] || extra+=(--no-training-run)
python3 benchmarks/train_bench.py --out "$OUT" --rounds "${ROUNDS:-3}" "${extra[@]}" 2>&1 | grep -v "warn" \
    | python3 benchmarks/train_table.py
if [ "${PROFILE:-0}" = 1 ]; then
    python3 benchmarks/train_profile.py --out "$OUT" --point gemma-7b,16384 --point llama-3-8b,4096 2>&1 \
        | grep -v "warn" | python3 benchmarks/train_table.py
fi
