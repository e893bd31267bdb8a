export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 60 --variants "" --fast-variants graph:3 \
  --timeline 200 --json $OUT/diag.json > $OUT/diag.txt 2>&1
grep -A3 "^slot server" $OUT/diag.txt; grep "kernel timeline" $OUT/diag.txt | cut -c1-400
python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000 --gap-us 200 --json $OUT/split.json 2>&1 | tail -4
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_torch_engine.py -k "int8 or (cuda and fast)" 2>&1 | tail -3
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_slot_server.py -m cuda -k "fast" 2>&1 | tail -3
