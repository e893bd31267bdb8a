#!/bin/bash
# For the next session's first device call (session 35's machine would not start for it): the
# crowd's floor on the host. Issue 18 asks fast C = 64 p50 <= 0.6x exact; fast stays 0.81x
# (h100-s35/call4). If the clients' turnaround (64 processes on 16 cores, the rounds' gathering)
# and not the pass sets the pace, a store of 1,024 rows (a pass of a few us) shows it: predicted
# C = 64 p50 near 150 us for exact and fast alike at N = 1,024, which would put 0.6x of the exact
# 250 us (150) at the floor, out of reach of any faster pass. The default serve, exact and fast,
# at N = 1,024 then 65,536, C = 16 and 64, on the checkout it runs from. On an H200, run issue 18's
# own benchmark too (CROWD=1,2,4,8,16,32,64 exact and fast beside the session's baseline tree).
#   BUDGET_S=330 OUT=$OUT bash benchmarks/results/h100-s35/next.sh   (carry this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
build_fence src
FAST="--serve-arg=--precision --serve-arg=fast"
for n in 1024 65536; do
  NEED_S=45 INTO=floor CROWD=16,64 crowd src exact-n$n "" --n $n
  NEED_S=45 INTO=floor CROWD=16,64 crowd src fast-n$n "" --n $n $FAST
done
echo "=== done ${SECONDS}s"
summary
