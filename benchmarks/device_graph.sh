#!/bin/bash
# Device run: the CUDA-graph slot server (SlotGraphServer) and the fused single-query scan:
# CUDA tests, in-process round trips (phase stamps), then kalos bench end to end (client
# processes), polling beside the sweep, with the GEMM process's rate while recalls run.
# Environment: SKIP_TESTS, SKIP_BENCH, VARIANTS / FAST_VARIANTS (slot_server_diag), MODES.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
if [ -z "$SKIP_TESTS" ]; then
  echo "== pytest -m cuda (torch engine; slot server, alone and in a sidecar)"; date +%T
  timeout ${TESTS_S:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_slot_server.py tests/test_torch_engine.py \
      -m cuda 2>&1 | tail -4
fi
echo "== slot_server_diag (SM / memory clocks sampled every 20 ms into clocks.csv)"; date +%T
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu --format=csv,noheader -lms 20 > $OUT/clocks.csv &
SMI=$!
timeout 120 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 100 \
    --variants "${VARIANTS:-graph:3}" --fast-variants "${FAST_VARIANTS:-graph:3}" --json $OUT/diag.json 2>&1 \
    | grep -v "UserWarning\|_warn_once" | tail -12
kill $SMI
if [ -z "$SKIP_BENCH" ]; then
  echo "== kalos bench --gpu-polling ${MODES:-graph}"; date +%T
  timeout ${BENCH_S:-230} python3 -m kalos bench --device cuda --gpu-sizes 65536 --batches 1,64 --repeats 2000 \
      --gpu-polling "${MODES:-graph}" --clients "" --json $OUT/bench.json 2>&1 | tee $OUT/bench.log \
      | grep -v "^  kalos sidecar\|^  (store" | tail -40
fi
date +%T
