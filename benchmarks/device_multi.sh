#!/usr/bin/env bash
# Issue 7 on a 2-GPU device, one call: the public shape set tuned on one GPU, then on both
# (--devices 0,1), each from an empty autofuse cache and an empty Triton compile cache, wall times
# compared; then the spread: the same keys tuned on GPU 0 and GPU 1 at once, apart.
#   bash benchmarks/device_multi.sh TRIALS SECONDS_PER_KEY     (SKIP_SPREAD=1: the wall times only)
# Carry .whl. Everything comes back under $OUT.
set -uo pipefail
trials=${1:-4} seconds=${2:-3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpus.txt"
shapes=autofuse/examples/public.json
run() {  # name, extra args...
  local name=$1; shift
  export AUTOFUSE_CACHE_DIR=/tmp/af-$name TRITON_CACHE_DIR=/tmp/triton-$name
  local start=$(python3 -c 'import time; print(time.time())')
  python3 -m autofuse.cli tune --shapes $shapes --trials "$trials" --time-budget "$seconds" "$@" \
      >"$OUT/$name.table.txt" 2>"$OUT/$name.progress.log"
  local rc=$?
  echo "$name exit $rc wall_s $(python3 -c "import time; print(round(time.time() - $start, 1))")" | tee -a "$OUT/walls.txt"
  python3 -m autofuse.cli cache export -o "$OUT/$name.json" >/dev/null
}
CUDA_VISIBLE_DEVICES=0 run one-gpu
run two-gpus --devices 0,1
cp /tmp/af-two-gpus/workers/*.log "$OUT/" 2>/dev/null
[ -n "${SKIP_SPREAD:-}" ] && { cat "$OUT/walls.txt"; exit 0; }
# Spread: four keys' shapes tuned on each GPU at the same time, separate caches, same seed.
cat > /tmp/spread.json <<'JSON'
{"dtype": "bfloat16", "tokens": [16, 4096],
 "mlps": [{"name": "gemma-2b", "d_model": 2048, "d_ff": 16384, "activation": "gelu_tanh"}]}
JSON
for g in 0 1; do
  (export CUDA_VISIBLE_DEVICES=$g AUTOFUSE_CACHE_DIR=/tmp/af-spread$g TRITON_CACHE_DIR=/tmp/triton-spread$g
   python3 -m autofuse.cli tune --shapes /tmp/spread.json --trials 12 --time-budget 8 --ops gated_up,down \
       >"$OUT/spread-gpu$g.table.txt" 2>/dev/null) &
done
wait
cat "$OUT/walls.txt" "$OUT"/spread-gpu*.table.txt
