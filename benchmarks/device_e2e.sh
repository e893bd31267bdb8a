#!/usr/bin/env bash
# Device run 2: `kalos bench --device cuda` (baselines, engine in-process, end to end through
# shared memory, under GPU load). Run from the repo root on the GPU machine.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f .carry/tcache.tgz ] && tar xzf .carry/tcache.tgz -C /tmp 2>/dev/null
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1
python3 -c "import kalos.sync as s; print('memory fence:', s.FENCE_IMPLEMENTATION)"
timeout 500 python3 -m kalos bench --device cuda --json "$OUT/bench_gpu.json" "$@" 2>&1 | tee "$OUT/bench_gpu.txt"
