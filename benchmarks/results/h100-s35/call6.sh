#!/bin/bash
# Session 35, call 6 (the session's last device seconds): on an H200, issue 18's own benchmark on
# this tree (the default serve, exact at C = 1, 16, 64, then fast at 1 and 64); on any other card,
# call 5's floor (the crowd at 1,024 rows, exact and fast, C = 16 and 64).
#   BUDGET_S=150 OUT=$OUT bash benchmarks/results/h100-s35/call6.sh   (carry this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
build_fence src
nvidia-smi --query-gpu=name --format=csv,noheader
FAST="--serve-arg=--precision --serve-arg=fast"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  NEED_S=60 INTO=targets CROWD=1,16,64 crowd src exact ""
  NEED_S=40 INTO=targets CROWD=1,64 crowd src fast "" $FAST
else
  NEED_S=40 INTO=floor CROWD=16,64 crowd src exact-n1024 "" --n 1024
  NEED_S=40 INTO=floor CROWD=16,64 crowd src fast-n1024 "" --n 1024 $FAST
fi
echo "=== done ${SECONDS}s"
summary
