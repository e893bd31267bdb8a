export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 benchmarks/int8_scan_probe.py --n 65536 --dim 1024 --json $OUT/probe.json 2>&1 | tee $OUT/probe.txt
python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000 --gap-us 200 --json $OUT/split.json 2>&1 | tail -25
