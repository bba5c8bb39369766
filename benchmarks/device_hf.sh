#!/usr/bin/env bash
# Issue 6 on the device, one call: tests/test_hf.py on the GPU, then benchmarks/hf_bench.py; and
# benchmarks/train_bench.py again (issue 5's peaks after its `del got` fix).
#   bash benchmarks/device_hf.sh
# Carry .whl (../shared/device/wheels.sh) and .whl-hf (transformers and its dependencies as
# py3.12 wheels, less what the image has). Everything comes back under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    .whl-hf/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=/tmp/autofuse-hf
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_hf.py 2>&1 | tail -4 | tee "$OUT/hf-tests.txt"
python3 benchmarks/hf_bench.py --out "$OUT" 2>&1 | grep -v "warn" | tail -20
python3 benchmarks/train_bench.py --out "$OUT" 2>&1 | grep -v "warn" | grep -v training-run | tail -12
