#!/bin/bash
# Session 40, first device call (kind nvidia-h200; an H100 may come). Two questions:
# 1. The fast crowd's pass of 32-64 queries: cuBLAS's 16-bit GEMM plus group_max_kernel against the
#    Triton score-writing scan with one query block of 64 (each row tile read once for all, its
#    group maxima written by the scan). Predicted: fast b=64 GPU pass 10-20 us shorter (the GEMM
#    ran at ~67% of the bus on an H100, and the group maxima's pass over 16 MiB of scores goes);
#    exact (tf32) the same tile: within +-10 us (cuBLAS tf32 was 106 against 94.8 us for 16).
# 2. AsyncClient with 1, 16 and 64 coroutines on a GPU sidecar: this tree (callers that one
#    answer woke join the next request together) beside f3236b1 (session 39's end, whose requests
#    alternate one caller and the rest: 8.5 recalls a request at 16 on the VM). 16 coroutines
#    read 999 us p50, 15.5k/s at 9ae2966 (H100). Predicted: this tree 16 coroutines under 300 us
#    p50 and above 50k/s; f3236b1 about half that rate.
#   mkdir -p .snap/trees/s39end && git archive f3236b1 src | tar -x -C .snap/trees/s39end
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h200-s40/call1.sh
#     (carry benchmarks/results/h200-s40 and .snap/trees/s39end)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
build_fence src
gcc -O2 -shared -fPIC $inc src/kalos/engine/_dots.c -o src/kalos/engine/_dots$ext 2>/dev/null || true
F16='"scores_f16_batch": {"block_n": 64, "block_d": 64, "block_q": 64, "warps": 8, "stages": 3}'
F16W4='"scores_f16_batch": {"block_n": 64, "block_d": 64, "block_q": 64, "warps": 4, "stages": 3}'
TF32='"scores_f32_batch": {"block_n": 64, "block_d": 32, "block_q": 64, "warps": 8, "stages": 3}'
SCAN='"gemm_min_q": 128, "scores_max_q": 64'
NEED_S=200 rounds scan64 src --sizes 1,16,32,64 --profile 64 --profile-rounds 30 \
  --variant "gemm:fast:{}" --variant "scan64:fast:{$SCAN, $F16}" --variant "scan64w4:fast:{$SCAN, $F16W4}" \
  --variant "gemm:exact:{}" --variant "scan64:exact:{$SCAN, $TF32}"
build_fence .snap/trees/s39end/src
for tree in src .snap/trees/s39end/src; do
  echo "=== async $tree $(date +%T) (${SECONDS}s)" | tee -a $OUT/async-cuda.txt
  (( SECONDS + 40 < budget )) && PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 benchmarks/async_client.py \
    --device cuda --sizes 65536 --dim 1024 --recalls 1500 --coroutines 1,16,64 --only-coroutines >> $OUT/async-cuda.txt 2>&1
  pkill -9 -f "kalos[ ]serve" 2>/dev/null
done
echo "=== done ${SECONDS}s"
summary | grep -v "^variant" ; grep -A6 "^variant" $OUT/rounds-scan64.txt
grep -E "p50|===" $OUT/async-cuda.txt
