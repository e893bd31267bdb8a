export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 60 --variants graph:3 \
  --fast-variants "graph:3,graph:3:single_scan=f16,graph:3:scan8=64x256x4x3,graph:3:scan8=128x256x8x3,graph:3:scan8=128x128x4x4" \
  --timeline 200 --json $OUT/diag.json 2>&1 | tail -60
python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000 --gap-us 200 --json $OUT/split.json 2>&1 | tail -8
