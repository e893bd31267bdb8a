export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
timeout 300 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 40 --variants "graph:3,graph:3:scan=32x128x4x1x128,graph:3:scan=32x128x4x1x96,graph:3:scan=32x128x4x1x128+max_k=8" --fast-variants "graph:3,graph:3:scan=32x128x4x1x96,graph:3:scan=32x128x4x1x80,graph:3:scan=32x128x4x1x128" --timeline 200 --json $OUT/diag.json > $OUT/diag.log 2>&1
echo diag rc=$?; tail -10 $OUT/diag.log
