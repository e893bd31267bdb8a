#!/bin/bash
# Device run: CUDA tests of the batch path, `kalos bench --device cuda` end to end (batches,
# several clients at once, a GEMM load), and the per-kernel profile of
# batch graphs. Carry [".carry"].
export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
tar xzf .carry/tcache.tgz -C /tmp 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
echo "== pytest -m cuda (batch path, zero copy, slot server)"; date +%T
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_torch_engine.py tests/test_slot_server.py -m cuda \
    -k "grid_axis or in_place or registered or slot or (matches_reference and 1024 and v1)" 2>&1 | tail -6
echo "== kalos bench"; date +%T
timeout 300 python3 -m kalos bench --device cuda --gpu-sizes 65536 --batches ${BENCH_BATCHES:-1,64,256,1024} \
    --clients 8x64,4x256 --repeats 1000 ${BENCH_ARGS:-} --json $OUT/bench.json > $OUT/bench.log 2>&1
sed -n '/^summary/,$p' $OUT/bench.log; grep -E "clients x|agreement|answered by|Error|error" $OUT/bench.log | head -20
echo "== gpu_diag --batches"; date +%T
timeout 100 python3 benchmarks/gpu_diag.py --batches ${BATCHES:-256,1024} --out $OUT > $OUT/diag_batches.log 2>&1
grep -E "'select'|'graph'|collect|group_max|final_kernel" $OUT/diag_batches.log | sed -n '/== summary/,$p;1,200p' | cut -c1-170 | tail -40
date +%T
