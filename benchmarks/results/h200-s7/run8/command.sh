export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
timeout 100 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 60 --variants "" --fast-variants "graph:3,graph:3:single_chunk_rescore=0" --timeline 200 --json $OUT/diag.json > $OUT/diag.log 2>&1
echo diag rc=$?; tail -4 $OUT/diag.log
timeout 80 python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000 --gap-us 200 --precisions fast --json $OUT/split.json > $OUT/split.log 2>&1
echo split rc=$?; tail -3 $OUT/split.log
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_slot_server.py tests/test_torch_engine.py -m cuda -k "fast" > $OUT/cuda_tests.log 2>&1
echo tests rc=$?; tail -3 $OUT/cuda_tests.log
