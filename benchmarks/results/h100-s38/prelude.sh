# Sourced by call1.sh and call2.sh (from the repository root): the shared helpers, the base tree
# and the old crowd.py checked, the candidate applied to src where src lacks it, the fences built.
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s38base/src
[ -d $B ] && [ -f .snap/crowd-old/crowd.py ] || { echo "missing $B or .snap/crowd-old: see call1.sh's header"; exit 1; }
grep -q GIL_SWITCH_INTERVAL_S src/kalos/server/sidecar.py \
  || patch -p1 -s < benchmarks/results/h100-s38/candidate-switch-interval.patch || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
build_fence src $B
