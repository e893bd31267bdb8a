#!/usr/bin/env bash
# Device run 1: native fence, CUDA tests, engine variants (benchmarks/gpu_engine.py).
# Run from the repo root on the GPU machine: bash benchmarks/device_engine.sh
export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
[ -f .carry/tcache.tgz ] && tar xzf .carry/tcache.tgz -C /tmp 2>/dev/null
python3 -c "import sysconfig, os; print('Python.h present:', os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; tail -3 "$OUT/build.log"
python3 -c "import kalos.sync as s; print('memory fence:', s.FENCE_IMPLEMENTATION)"
timeout 150 python3 -m pytest tests/test_torch_engine.py tests/test_channel.py -q -p no:cacheprovider 2>&1 | tail -4
timeout 330 python3 benchmarks/gpu_engine.py --out "$OUT" --iters 200 --no-sweep "$@" 2>&1 | tee "$OUT/engine.txt" | tail -60
