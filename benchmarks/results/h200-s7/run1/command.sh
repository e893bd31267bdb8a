export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 280 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 50 --variants graph:3 --fast-variants graph:3 --gap-us 200 --timeline 300 --json $OUT/diag.json 2>&1 | grep -v Warning | tail -30
timeout 280 python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000 --gap-us 200 --json $OUT/split.json 2>&1 | tail -14
