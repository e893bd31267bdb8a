#!/bin/bash
# Session 23: the CPU crowd 1-64 after control protocol 3 (each client rings the sidecar, and is
# rung, through a socket pair of its own, instead of a doorbell eventfd shared by every client
# and a wake eventfd of its own), beside 978da6a (the change's base) in one run, then again in
# the reverse order. 2-vCPU VM, 65,536 x 384, k = 8, 3 s a size.
# Needs .snap/trees/s23pre = git archive 978da6a src, with the native pieces built.
cd "$(dirname "$0")/../../.."
args=(-- --device cpu --n 65536 --dim 384 --crowd 1,2,4,8,16,32,64 --crowd-seconds 3)
bash benchmarks/crowd_ab.sh benchmarks/results/cpu-crowd-s23/run1 this=src base=.snap/trees/s23pre/src "${args[@]}"
bash benchmarks/crowd_ab.sh benchmarks/results/cpu-crowd-s23/run2 base=.snap/trees/s23pre/src this=src "${args[@]}"
