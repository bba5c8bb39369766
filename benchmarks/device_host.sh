#!/usr/bin/env bash
# Issue 15 on the device, one call: the bound-launch tests and every GPU-marked test (compiled there), the
# host-cost table (benchmarks/host_cost.py), generate's wall time and host profiles
# (benchmarks/host_profile.py), one MLP under torch.compile(mode="reduce-overhead") (benchmarks/compile_bench.py),
# then the Hugging Face forwards (benchmarks/hf_bench.py). Carry .whl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=/tmp/autofuse-host
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
{ timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_bound.py 2>&1 | tail -15
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tail -15; } | tee "$OUT/tests.txt"
timeout 120 python3 benchmarks/host_cost.py --out "$OUT" 2>&1 | grep -v "warn" | tee "$OUT/host_cost.txt"
timeout 150 python3 benchmarks/host_profile.py --out "$OUT" 2>&1 | grep -v "warn" | grep "generate 64" \
    | tee "$OUT/generate.txt"
timeout 200 python3 benchmarks/compile_bench.py --layers 1 --out "$OUT" 2>&1 | grep '^{' | tee "$OUT/compile.txt"
timeout 150 python3 benchmarks/hf_bench.py --out "$OUT" 2>&1 | grep -v "warn" | tail -7
