export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 1000 --checks 30 --variants graph:3 --fast-variants graph:3 \
  --timeline 200 --json $OUT/diag.json > $OUT/diag.txt 2>&1
grep -A4 "^slot server" $OUT/diag.txt; grep "kernel timeline" $OUT/diag.txt | cut -c1-400
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_torch_engine.py -k "cuda_matches_reference and 1024" 2>&1 | tail -2
