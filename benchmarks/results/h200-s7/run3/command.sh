export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
L=lean_publish=1
EX="graph:3,graph:3:$L,graph:3:$L+max_k=8,graph:3:$L+scan=64x128x8x1,graph:3:$L+scan=32x256x4x1,graph:3:$L+scan=32x128x4x2,graph:3:$L+scan=16x256x4x1,graph:3:$L+scan=64x64x4x1,graph:3:$L+exact_final_warps=8,graph:3:$L+topk_warps=8"
FA="graph:3:$L,graph:3:$L+max_k=8,graph:3:$L+scan=64x128x4x1,graph:3:$L+scan=32x256x4x1,graph:3:$L+scan=64x256x8x1,graph:3:$L+scan=128x128x8x1,graph:3:$L+scan=32x128x4x2"
timeout 560 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 1000 --checks 40 --variants "$EX" --fast-variants "$FA" --timeline 200 --json $OUT/diag.json > $OUT/diag.log 2>&1
echo rc=$?
tail -5 $OUT/diag.log
