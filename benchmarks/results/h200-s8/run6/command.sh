export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 60 --variants "" \
  --fast-variants "graph:3,graph:3:single_topk_warps=4,graph:3:single_topk_warps=16,graph:3:single_final_tile=8192,graph:3:single_final_tile=32768+single_topk_warps=16,graph:3:chunk_rescore_k=16+single_final_tile=8192+single_topk_warps=4" \
  --timeline 200 --json $OUT/diag.json > $OUT/diag.txt 2>&1
grep -A12 "^slot server" $OUT/diag.txt; grep "kernel timeline" $OUT/diag.txt | cut -c1-400
