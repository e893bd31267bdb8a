#!/bin/bash
# Device run: the slot server after the review's fixes (CUDA tests, in-process diagnostics,
# end to end side by side with its under-load row), and py-spy on a batch-256 end-to-end loop.
# Call with carry [".carry", ".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PATH=/tmp/site/bin:$PATH PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
tar xzf .carry/tcache.tgz -C /tmp 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
echo "== pytest -m cuda tests/test_slot_server.py"; date +%T
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_slot_server.py -m cuda 2>&1 | tail -8
echo "== slot_server_diag"; date +%T
timeout 150 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 100 \
    --json $OUT/diag.json 2>&1 | tail -20
echo "== profile_e2e batch 256"; date +%T
mkdir -p $OUT/prof256
timeout 90 python3 benchmarks/profile_e2e.py --batch 256 --extra "--max-batch 256" --seconds 6 --out $OUT/prof256 2>&1 | tail -70
echo "== kalos bench --gpu-polling"; date +%T
timeout 230 python3 -m kalos bench --device cuda --gpu-sizes 65536 --batches 1,64 --repeats 2000 --gpu-polling \
    --json $OUT/bench.json 2>&1 | tee $OUT/bench.log | tail -30
date +%T
tar czf $OUT/tcache.tgz -C /tmp tcache
