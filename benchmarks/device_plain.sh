#!/usr/bin/env bash
# Issue 15's un-graphed decode calls on the device, one call: the plain-call race's tests compiled there
# (tests/test_plain.py and the bound-launch tests), the host-cost table (benchmarks/host_cost.py), generate with
# fuse(model) (benchmarks/host_profile.py; GENERATE=0 skips it) and the "never slower" sweep at decode M with plain calls
# (benchmarks/never_slower.py, empty user cache; SWEEP_S seconds, 0 skips it; SWEEP_ARGS its arguments); FORMS=1
# adds the forms of torch.compile(mode="reduce-overhead") (benchmarks/compile_forms_probe.py; FORMS_REPEATS processes
# per form, FORMS_S seconds in all); TESTS=0 skips the tests. Carry .whl.
set -uo pipefail
# The wheels once per call: device_runner_ups.sh installs them before it runs this script (WHEELS=0).
[ "${WHEELS:-1}" = 1 ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target .site .whl/*.whl || exit 1; }
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/env.txt"
[ "${TESTS:-1}" = 1 ] && AUTOFUSE_CACHE_DIR=$(mktemp -d) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_plain.py \
    tests/test_bound.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
AUTOFUSE_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/host_cost.py --out "$OUT" 2>&1 | grep -v "warn" \
    | tee "$OUT/host_cost.txt"
[ "${GENERATE:-1}" = 1 ] && AUTOFUSE_CACHE_DIR=$(mktemp -d) timeout 200 python3 benchmarks/host_profile.py --out "$OUT" --rounds "${ROUNDS:-8}" \
    2>&1 | grep -v "warn" | grep "generate 64\|choices\|Error" | tee "$OUT/generate.txt"
[ "${FORMS:-0}" = 1 ] && AUTOFUSE_CACHE_DIR=$(mktemp -d) timeout "${FORMS_S:-240}" python3 benchmarks/compile_forms_probe.py \
    --out "$OUT" --only "${FORMS_ONLY:-}" --repeats "${FORMS_REPEATS:-1}" 2>&1 | grep '^{\|Error' | cut -c1-1500 | tee "$OUT/compile_forms.txt"
[ "${SWEEP_S:-150}" -gt 0 ] && AUTOFUSE_CACHE_DIR=$(mktemp -d) timeout "${SWEEP_S:-150}" python3 \
    benchmarks/never_slower.py --out "$OUT" ${SWEEP_ARGS:---mlps 4 --linears 3 --tokens 1,2,5,16} 2>&1 \
    | grep -v warn | tee "$OUT/never_slower.txt" | tail -30
# At most 8 files come back: everything in one archive.
(cd "$OUT" && tar czf results.tgz --exclude=results.tgz -- * && find . -type f ! -name results.tgz -delete)
true
