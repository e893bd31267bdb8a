#!/bin/bash
# Session 23: C coroutines of one process, single recalls through one AsyncClient, this code
# (concurrent single recalls go to the sidecar together) beside f9ba55f (each alone, one after
# another on the slot), in one run, then again in the reverse order. 2-vCPU VM, CPU sidecar,
# k = 8, every answer checked against float64. Needs .snap/trees/aio-base = git archive f9ba55f
# src, with the native pieces built (or copied from src/).
cd "$(dirname "$0")/../../.."
out=benchmarks/results/cpu-async-crowd-s23
bench() { # label src
  echo "=== $1 $(date +%T)"
  PYTHONPATH=$2 timeout 900 .venv/bin/python benchmarks/async_client.py --sizes 1000,50000 --coroutines 1,4,16,64 \
    --only-coroutines --recalls 1600 > $out/$1.txt 2>&1
  cat $out/$1.txt
}
bench this-1 src; bench base-1 .snap/trees/aio-base/src
bench base-2 .snap/trees/aio-base/src; bench this-2 src
