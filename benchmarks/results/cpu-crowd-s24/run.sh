#!/bin/bash
# Session 24: the CPU crowd 1-64 after landing the sweep's wait for the GPU kernel's news and the
# gathering rounds (both GPU-polling paths; a CPU sidecar's crowded clients still sleep), beside
# 5468e60 (main before them) in one run, both orders. Needs .snap/trees/cpu-base = git archive
# 5468e60 src, with the native pieces built (see benchmarks/crowd_ab.sh).
cd "$(dirname "$0")/../../.."
args=(-- --device cpu --n 65536 --dim 384 --crowd 1,2,4,8,16,32,64 --crowd-seconds 3)
bash benchmarks/crowd_ab.sh benchmarks/results/cpu-crowd-s24/run1 this=src base=.snap/trees/cpu-base/src "${args[@]}"
bash benchmarks/crowd_ab.sh benchmarks/results/cpu-crowd-s24/run2 base=.snap/trees/cpu-base/src this=src "${args[@]}"
