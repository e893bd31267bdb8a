#!/bin/bash
# Session 23: C coroutines calling recall_text through one AsyncClient against a CPU sidecar that
# embeds (ONNX Runtime), this code (concurrent recall_text calls of one group go together: one
# embedding batch, one recall batch) beside b78554b (each alone, one after another on the slot),
# in one run, then again in the reverse order. 2-vCPU VM, 658 passages, k = 8, every answer's
# top-8 checked against the question's answer alone. Needs .snap/trees/aio-text-base = git
# archive of the change's base src, with the native pieces built.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/cpu-async-text-s23
bench() { # label src
  echo "=== $1 $(date +%T)"
  PYTHONPATH=$2 timeout 900 .venv/bin/python benchmarks/async_client.py --text-coroutines 1,4,16 --recalls 320 \
    > $out/$1.txt 2>&1
  tail -4 $out/$1.txt
}
bench this-1 src; bench base-1 .snap/trees/aio-text-base/src
bench base-2 .snap/trees/aio-text-base/src; bench this-2 src
