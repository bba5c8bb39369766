#!/usr/bin/env bash
# Issue 16's tuned rerun, the tuning half: tune the never-slower sweep's drawn shapes
# (`never_slower.py --write-shapes`, seed 16) at one group of its token counts, and bring the winners back
# as an export under $OUT. One device call per group of token counts, each cut at 560 s (what finished by
# then is exported);
# then copy the exports into a folder of the repo that git ignores (e.g. .sweep/), carry it, and run
#   IMPORT=.sweep PROBE=0 bash benchmarks/device_sweep.sh
# which imports them into the sweep's user cache before measuring.
#   bash benchmarks/device_sweep_tune.sh TOKENS [TRIALS] [SECONDS_PER_KEY]
# TOKENS: some of the sweep's 1,2,5,16,48,77,128,300,1000,2048,5000. Keys: 40 per M up to 64 (gated_pairs, down
# and the one-launch mlp of 12 MLPs, 4 Linears), 28 per larger M. At 24 trials / 12 s the sixth session's keys
# took 5-12 s each on the H100; at 12 / 4 fewer, not measured yet. Suggested groups of 56-84 keys:
# 1,2 / 5,16 / 48,77 / 128,300,1000 / 2048,5000.
# Carry .whl.
set -euo pipefail
tokens=$1 trials=${2:-12} seconds=${3:-4}
# `import autofuse` needs neither optuna nor diskcache: device_tune.sh installs them (once) below.
PYTHONPATH=$PWD python3 benchmarks/never_slower.py --write-shapes /tmp/sweep-shapes.json
cp /tmp/sweep-shapes.json "$OUT/sweep-shapes.json"
OPS=gated_pairs,down,linear,mlp TOKENS=$tokens bash benchmarks/device_tune.sh /tmp/sweep-shapes.json "$trials" \
    "$seconds" "sweep-${tokens//,/-}" 560
