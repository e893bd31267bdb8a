#!/bin/bash
# Device run: the batch path's threshold selection and device-side query norms (CUDA tests,
# per-kernel profile of batch graphs against the per-chunk top-K, checked against float64),
# and the slot server's tests and in-process diagnostics. Carry [".carry"].
export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
tar xzf .carry/tcache.tgz -C /tmp 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
echo "== pytest -m cuda"; date +%T
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_torch_engine.py tests/test_slot_server.py -m cuda 2>&1 | tail -15
echo "== gpu_diag --batches"; date +%T
timeout 150 python3 benchmarks/gpu_diag.py --batches ${BATCHES:-64,256,1024} --out $OUT > $OUT/diag_batches.log 2>&1
sed -n '/== summary ==/,$p' $OUT/diag_batches.log; tail -3 $OUT/diag_batches.log
echo "== slot_server_diag"; date +%T
timeout 150 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 100 \
    --json $OUT/slot_diag.json > $OUT/slot_diag.log 2>&1; tail -14 $OUT/slot_diag.log
date +%T
tar czf $OUT/tcache.tgz -C /tmp tcache
