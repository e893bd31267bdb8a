#!/bin/bash
# For the next session's first device call (session 34 had no device time left for it): the
# kernel cleanups in candidate-kernel-helpers.patch (a `_windowed` helper for the three copies of
# "(since > -inf) | (until < inf)", `_slice_limit` for select.py's two copies, `_named` where
# _take_requests spelled it out; the namespace lookup's name entries declared once, as
# layout.NAME_ENTRY_DTYPE, where the kernels and the slot server wrote offsets 8, 9 and 16;
# interpreter tests pass) compiled on a GPU, and the CUDA tests
# of what session 34 changed after its last call (the places tests with the namespaces'
# validation and the one-namespace shortcut). Predicted: no change in any crowd (the helpers are
# inlined). Run from a checkout of 1e58364(+) with `git apply
# benchmarks/results/h100-s34/candidate-kernel-helpers.patch`, against 1e58364 itself
# (.snap/trees/s34-head: `git archive 1e58364 src`):
#   BUDGET_S=540 OUT=$OUT bash benchmarks/results/h100-s34/next.sh   (carry .snap/trees/s34-head, this folder, h100-s32)
cd "$(dirname "$0")/../../.."
source benchmarks/results/h100-s32/lib.sh
B=.snap/trees/s34-head/src
build_fence src $B
cuda_tests ${TESTS_S:-240} tests/test_torch_engine.py tests/test_slot_server.py \
  -k "places or every_size and exact-40 or answers_while_running or sidecar_with_gpu_polling"
NEED_S=30 INTO=default CROWD=1,16,64 crowd src this ""
NEED_S=30 INTO=default CROWD=1,16,64 crowd $B base ""
NEED_S=30 INTO=agents CROWD=16,64 crowd src this-agents "" --crowd-scopes agents
NEED_S=30 INTO=agents CROWD=16,64 crowd $B base-agents "" --crowd-scopes agents
echo "=== done ${SECONDS}s"
summary
