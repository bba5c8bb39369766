#!/usr/bin/env bash
# Issue 14 on the device, one call: every GPU-marked test, the kernel tests compiled on the GPU,
# whether the shipped file resolves (config sources of the public shapes), and a bench of the public
# set at M = 1 and 4096 against eager (speed unchanged by the refactor?). Carry .whl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=/tmp/autofuse-registry
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_linear.py tests/test_mlp.py tests/test_split_k.py \
    tests/test_backward.py tests/test_render.py 2>&1 | tail -3 | tee "$OUT/kernel_tests.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/sources.txt"
import torch, autofuse
for d, f, act in ((768, 2048, "gelu_tanh"), (2048, 16384, "gelu_tanh"), (4096, 14336, "silu")):
    m = autofuse.get_mlp(d, f, activation=act, dtype=torch.bfloat16)
    for M in (1, 16, 4096):
        print(d, f, M, m.config_sources(M), {k: v.short() for k, v in m.config_for(M).items()})
PY
timeout 150 python3 -m autofuse.cli bench --tokens 1,4096 --providers eager,autofuse-tuned --rounds 2 --out /tmp/bench \
    2>&1 | grep -v "^USDT\|warn" | tee "$OUT/bench.txt"
cp /tmp/bench/bench.json "$OUT/" 2>/dev/null || true
