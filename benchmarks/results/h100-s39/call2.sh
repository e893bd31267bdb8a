#!/bin/bash
# Session 39, second device call, named kind nvidia-h200 (an H100 may come instead). Branches on the card:
# - H200 (the card issue 18's targets are for; none lent since session 26): the default crowd
#   1-64 with the co-located GEMMs, HEAD then c5539f3 (session 35's base, the baseline of
#   BENCHMARKS.md's H100 tables), then fast precision at C = 1, 16, 64 on both. Predicted from the
#   H100 runs scaled by the single pass (74 against 97 us): HEAD C = 16 about 135-145 us p50 at
#   105-115k/s, C = 64 230-250 us at 220-240k/s; fast C = 64 about 0.75x exact.
# - H100: what never ran on a GPU: `--gpu-polling off`, agents in their own namespaces, C = 1-64
#   with the co-located case, HEAD (c7224a2, 54bcfe6) then c5539f3. Predicted: within session
#   35's noise (C = 64 about 100k recalls/s), then the fast crowd as above.
#   mkdir -p .snap/trees/s35-base && git archive c5539f3 src | tar -x -C .snap/trees/s35-base
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h100-s39/call2.sh
#     (carry .snap/trees/s35-base and benchmarks/results/h100-s39, which git ignores)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s35-base/src
[ -d $B ] || { echo "missing $B: see this script's header"; exit 1; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
build_fence src $B
FAST="--serve-arg=--precision --serve-arg=fast"
OFF="--serve-arg=--gpu-polling --serve-arg=off"
if [[ $card == *H200* ]]; then
  NEED_S=120 INTO=default crowd src this 16,64
  NEED_S=120 INTO=default crowd $B base 16,64
else
  NEED_S=100 INTO=off-agents crowd src this-off-agents 16,64 --crowd-scopes agents $OFF
  NEED_S=100 INTO=off-agents crowd $B base-off-agents 16,64 --crowd-scopes agents $OFF
fi
NEED_S=40 INTO=fast CROWD=1,16,64 crowd src this-fast "" $FAST
NEED_S=40 INTO=fast CROWD=1,16,64 crowd $B base-fast "" $FAST
echo "=== done ${SECONDS}s"
summary
