export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
timeout 200 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 60 --variants "graph:3,graph:3:max_k=8" --fast-variants "graph:3,graph:3:max_k=8" --timeline 200 --json $OUT/diag.json > $OUT/diag.log 2>&1
echo diag rc=$?; tail -6 $OUT/diag.log
timeout 200 python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000 --gap-us 200 --json $OUT/split.json > $OUT/split.log 2>&1
echo split rc=$?; tail -4 $OUT/split.log
timeout 180 python3 -m kalos bench --device cuda --gpu-sizes 65536 --batches 1,64 --repeats 2000 --gpu-polling graph --clients "" --json $OUT/bench.json > $OUT/bench.log 2>&1
echo bench rc=$?; grep -A30 "^summary" $OUT/bench.log | head -30
