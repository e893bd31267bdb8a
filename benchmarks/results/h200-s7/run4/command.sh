export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
A=lean_publish=1+topk_warps=8+exact_final_warps=8
EX="graph:3:$A,graph:3:$A+max_k=8,graph:3:$A+scan_filter=0,graph:3:lean_publish=1+topk_warps=16+exact_final_warps=16,graph:3:$A+max_k=8+scan_filter=0,graph:3:$A+score_chunk=512"
FA="graph:3:lean_publish=1+topk_warps=8,graph:3:lean_publish=1+topk_warps=8+max_k=8,graph:3:lean_publish=1+topk_warps=8+scan_filter=0"
timeout 560 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 1000 --checks 40 --variants "$EX" --fast-variants "$FA" --timeline 200 --ceiling --json $OUT/diag.json > $OUT/diag.log 2>&1
echo rc=$?
grep "torch.mv" $OUT/diag.log
tail -3 $OUT/diag.log
