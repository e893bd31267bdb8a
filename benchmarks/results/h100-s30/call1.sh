#!/bin/bash
# Session 30, call 1: where a crowd's round of 16 and 64 goes, kernel by kernel (the slot
# server in process, benchmarks/rounds.py --profile), the cuBLAS GEMM against the Triton
# score-writing scan at rounds of 16; then recall_text on this tree (issue 20).
#   OUT=$OUT bash benchmarks/results/h100-s30/call1.sh   (carry .snap/model)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== rounds $(date +%T)"
PYTHONPATH=src timeout 330 python3 benchmarks/rounds.py --sizes 1,8,16,32,64 --profile 16,64 --rounds 300 \
  --variant 'gemm16:exact:{}' --variant 'triton16:exact:{"gemm_min_q": 32, "scores_max_q": 16}' \
  --variant 'gemm16:fast:{}' --variant 'triton16:fast:{"gemm_min_q": 32, "scores_max_q": 16}' \
  > $OUT/rounds.txt 2>&1; tail -8 $OUT/rounds.txt
for label in ${TEXTS-cache-1 nocache-1}; do
  (( SECONDS < 480 )) || break
  echo "=== text $label $(date +%T) (${SECONDS}s)"
  extra=; [ $label = nocache-1 ] && extra=KALOS_ITEM_CACHE_BYTES=0
  env $extra PYTHONPATH=.snap/model:src timeout 100 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 300 --embed-runtime triton > $OUT/text-$label.txt 2>&1
  pkill -9 -f "kalos serve" 2>/dev/null; sleep 1
  grep -E "one round trip \||in process" $OUT/text-$label.txt | head -4
done
echo "=== ${SECONDS}s"
