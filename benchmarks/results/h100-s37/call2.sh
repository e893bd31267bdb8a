#!/bin/bash
# Session 37, call 2: the default serve (GPU polling), exact, C = 1-64 with the co-located case
# (bf16 GEMMs beside C = 16 and 64), this tree against c5539f3 (.snap/trees/s35-base), alternated
# this, base, base, this; then fast on this tree once. Since c5539f3 the serving code changed in
# recall_loop only (the sweep's queued pass, the filter lookup, the error answers), which GPU
# polling's crowd does not take but for the handed-over requests, and the client's single recall
# (Client._recall_one, fewer layers of Python). Predicted: C = 1 a few us under c5539f3 (the
# client's Python, about 1.2 us less on the 2-vCPU VM, so 3-4 us here), C = 16 and 64 a few
# percent faster (each round waits for its clients' Python); else session 35's default crowd.
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s37/call2.sh   (carry .snap/trees/s35-base, this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
[ -d $B ] || { echo "missing $B"; exit 1; }
build_fence src $B
FAST="--serve-arg=--precision --serve-arg=fast"
NEED_S=100 INTO=default crowd src this 16,64
NEED_S=100 INTO=default crowd $B base 16,64
NEED_S=100 INTO=default crowd $B base2 16,64
NEED_S=100 INTO=default crowd src this2 16,64
NEED_S=60 INTO=fast crowd src this-fast "" $FAST
echo "=== done ${SECONDS}s"
summary
