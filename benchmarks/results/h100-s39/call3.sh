#!/bin/bash
# Session 39, third device call. Call 2 found `--gpu-polling off`, agents, C = 2 and 4 slower on
# HEAD than on c5539f3 in the same call (368.9 / 373.8 us p50 against 228.3 / 241.5; the sweep's
# pass 357.5 against 219.7 us at 2.0 requests a pass), and than c5f1b05 in session 35 (212.4 /
# 235.5), while C >= 8 read faster. Between c5f1b05 and HEAD the sweep's changes are
# refactorings; the client gained the short path of Client.recall (a067ebb). Which one:
# HEAD, c5f1b05, HEAD with the short path off (noshort: _recall_one returns None), c5539f3,
# then HEAD again (order), agents and one namespace, C = 1, 2, 4, 8.
# Predicted: if the short path, noshort reads as c5f1b05 (C = 2 about 210-240 us p50) and HEAD
# twice about 370; if the sweep, noshort reads as HEAD.
#   mkdir -p .snap/trees/s35-c5f1b05 && git archive c5f1b05 src | tar -x -C .snap/trees/s35-c5f1b05
#   mkdir -p .snap/trees/noshort && git archive HEAD src | tar -x -C .snap/trees/noshort, then
#     in its client/client.py, _recall_one returns None first
#   BUDGET_S=330 OUT=$OUT bash benchmarks/results/h100-s39/call3.sh
#     (carry .snap/trees/{s35-base,s35-c5f1b05,noshort}, benchmarks/results/h100-s39)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader
T=.snap/trees
build_fence src $T/s35-base/src $T/s35-c5f1b05/src $T/noshort/src
OFF="--serve-arg=--gpu-polling --serve-arg=off"
for run in "src head" "$T/s35-c5f1b05/src c5f1b05" "$T/noshort/src noshort" "$T/s35-base/src c5539f3" "src head-again"; do
  set -- $run
  NEED_S=30 INTO=off-agents CROWD=1,2,4,8 crowd $1 $2 "" --crowd-scopes agents $OFF
done
for run in "src head" "$T/noshort/src noshort" "$T/s35-base/src c5539f3"; do
  set -- $run
  NEED_S=30 INTO=off-one CROWD=1,2,4,8 crowd $1 $2 "" $OFF
done
echo "=== done ${SECONDS}s"
summary
