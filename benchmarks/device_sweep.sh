#!/usr/bin/env bash
# Issue 16 on the device, one call per GPU: the padded layout's tests compiled there, the unaligned probe
# (benchmarks/unaligned_probe.py, with the padded MLP rows), the "never slower" sweep
# (benchmarks/never_slower.py: seeded held-out shapes, empty user cache) and, with COMPILE=1, one MLP
# under torch.compile(mode="reduce-overhead") (benchmarks/compile_bench.py). PROBE=0 skips the tests and
# the probe; IMPORT=DIR imports tuned exports first (issue 16's tuned rerun). Carry .whl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 AUTOFUSE_CACHE_DIR=$(mktemp -d)
# IMPORT=DIR: the exports of benchmarks/device_sweep_tune.sh, imported into that (otherwise empty) user cache.
if [ -n "${IMPORT:-}" ]; then
    for f in "$IMPORT"/*.json; do python3 -m autofuse.cli cache import "$f" || exit 1; done
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
[ "${PROBE:-1}" = 1 ] && timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_layout.py tests/test_hf.py::test_an_odd_intermediate_size_runs_in_padded_storage 2>&1 \
    | tail -5 | tee "$OUT/tests.txt"
[ "${PROBE:-1}" = 1 ] && timeout 90 python3 benchmarks/unaligned_probe.py --out "$OUT" 2>&1 | grep -v warn | tail -20
timeout "${SWEEP_S:-420}" python3 benchmarks/never_slower.py --out "$OUT" ${SWEEP_ARGS:-} 2>&1 | grep -v warn \
    | tee "$OUT/never_slower.txt" | tail -40
if [ "${COMPILE:-0}" = 1 ]; then
    AUTOFUSE_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/compile_bench.py --layers 1 --out "$OUT" 2>&1 \
        | grep '^{' | tee "$OUT/compile.txt"
fi
