#!/bin/bash
# For the next session's first device call (session 33 had no device time left for it): each
# slot remembers the namespace it named last, so a batch round's lookup skips the table's probe
# loop for agents that keep to their own (predicted: the agents crowd's C = 16 p50 from 172 us
# toward the one-namespace crowd's 152; it was 20 us above it in session 33's call 1). Run from
# a checkout of b34ad3c(+) with `git apply benchmarks/results/h100-s33/candidate-slot-names.patch`,
# against b34ad3c itself (.snap/trees/s33-ns: `git archive b34ad3c src`): the batch rounds' CUDA
# test (exact, 40 slots) and the GPU-polling sidecar's (session 33's call 1 stopped it at its
# time limit, untested on the per-query namespaces), then the 'agents' crowd at 1, 4, 16, 64 of
# both trees and the "default" crowd at 16 and 64 of both, default `kalos serve --device cuda`
# (65,536 x 1024, k = 8, 2 s a crowd).
#   BUDGET_S=560 OUT=$OUT bash benchmarks/results/h100-s33/next.sh   (carry .snap/trees/s33-ns, this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s33-ns/src
build_fence src $B
cuda_tests ${TESTS_S:-240} tests/test_slot_server.py -k "every_size and exact-40 or sidecar_with_gpu_polling"
NEED_S=40 INTO=agents CROWD=1,4,16,64 crowd src this-agents "" --crowd-scopes agents
NEED_S=40 INTO=agents CROWD=1,4,16,64 crowd $B base-agents "" --crowd-scopes agents
NEED_S=25 INTO=default CROWD=16,64 crowd src this ""
NEED_S=25 INTO=default CROWD=16,64 crowd $B base ""
echo "=== done ${SECONDS}s"
summary
