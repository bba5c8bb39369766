#!/usr/bin/env bash
# Issue 8 on the device, one call: the compile/export tests on the GPU, `autofuse profile` for
# gemma-2b at M = 1 and 4096, benchmarks/compile_bench.py, then every GPU-marked test. Carry .whl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=/tmp/autofuse-toolchain
python3 -m pytest -q -p no:cacheprovider tests/test_compile_integration.py 2>&1 | tail -3 | tee "$OUT/tests.txt"
python3 -m autofuse.cli profile --mlp 2048,16384,gelu_tanh --tokens 1,4096 --out /tmp/profile 2>&1 \
    | grep -v "^USDT\|warn" | tee "$OUT/profile.txt"
# The traces and profile.json as one file: $OUT brings back at most 8 files.
tar -czf "$OUT/profile.tar.gz" -C /tmp profile
python3 benchmarks/compile_bench.py --out "$OUT" 2>&1 | grep -v warn | tail -20
# Regression check: every GPU-marked test (the fused kernels and the compile integration on the GPU).
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
