export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 60 --variants graph:3,graph:3:max_k=8 \
  --fast-variants "graph:3,graph:3:chunk_rescore_k=16,graph:3:chunk_rescore_chunk=512+chunk_rescore_k=16,graph:3:chunk_rescore_chunk=512,graph:3:chunk_rescore_chunk=2048+chunk_rescore_k=32" \
  --timeline 200 --json $OUT/diag.json > $OUT/diag.txt 2>&1
grep -A12 "^slot server" $OUT/diag.txt; grep "kernel timeline" $OUT/diag.txt | cut -c1-400
timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/test_torch_engine.py -k "int8 or (cuda and fast)" 2>&1 | tail -5
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_slot_server.py -m cuda -k "fast and graph" 2>&1 | tail -5
