#!/usr/bin/env bash
# Issue 15's generate item on the device, one call: the RMSNorm and Hugging Face tests compiled there,
# generate's wall time with fuse(model)'s MLPs and RMSNorms (benchmarks/host_profile.py), then the RMSNorm
# kernel against eager, torch.compile and Liger at every width and M (benchmarks/norm_bench.py; NORM=0 skips it);
# HOST_COST=1 adds the host-cost table (benchmarks/host_cost.py). Carry .whl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=/tmp/autofuse-norm
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_norm.py tests/test_hf.py tests/test_bound.py tests/test_library.py 2>&1 \
    | tail -8 | tee "$OUT/tests.txt"
timeout 200 python3 benchmarks/host_profile.py --out "$OUT" --rounds "${ROUNDS:-8}" 2>&1 | grep -v "warn" \
    | grep "generate 64\|choices" | tee "$OUT/generate.txt"
[ "${HOST_COST:-0}" = 1 ] && timeout 150 python3 benchmarks/host_cost.py --out "$OUT" 2>&1 | grep -v "warn" \
    | tee "$OUT/host_cost.txt"
[ "${NORM:-1}" = 1 ] && timeout 220 python3 benchmarks/norm_bench.py --out "$OUT" 2>&1 | grep -v "warn" | tee "$OUT/norm_bench.txt"
true
