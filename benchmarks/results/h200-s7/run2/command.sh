export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt
mkdir -p -m 700 /tmp/krt
L=lean_publish=1
EX="graph:3,graph:3:$L,graph:3:$L+max_k=8,graph:3:$L+score_chunk=512,graph:3:$L+score_chunk=2048,graph:3:$L+scan=64x128x8x1,graph:3:$L+scan=32x256x4x1,graph:3:$L+scan=32x128x4x2,graph:3:$L+scan=16x256x4x1"
FA="graph:3,graph:3:$L,graph:3:$L+max_k=8,graph:3:$L+scan=64x128x4x1,graph:3:$L+scan=32x256x4x1,graph:3:$L+scan=64x256x8x1,graph:3:$L+max_k=8+scan=64x128x4x1"
timeout 560 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 1000 --checks 30 --variants "$EX" --fast-variants "$FA" --timeline 200 --json $OUT/diag.json > $OUT/diag.log 2>&1
grep -o '"variant": "[^"]*"\|kernel timeline.*' $OUT/diag.log | paste - - | sed 's/kernel timeline (median us per round)://' | cut -c1-400 | tail -20
tail -20 $OUT/diag.log
