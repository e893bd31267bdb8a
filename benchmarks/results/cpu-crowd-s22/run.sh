#!/bin/bash
# Session 22, the 2-vCPU VM, after the mend of the whole change since bbcaeca: the crowd of
# single recalls, 1-64 client processes beside one (C = 1), this code and then bbcaeca (the
# change's base; .snap/trees/bbca = git archive bbcaeca src, its _fence and _dots built with -O2)
# in one run, 65,536 x 384, k = 8, default `kalos serve --device cpu`. The change's serving
# parts: op recall_text (a client's recall submitted by the sidecar in its slot) and the one
# function that numbers a request for both (kalos.ipc.channel._publish_request).
cd "$(dirname "$0")/../../.."
bash benchmarks/crowd_ab.sh benchmarks/results/cpu-crowd-s22 this=src base=.snap/trees/bbca/src \
  -- --device cpu --n 65536 --dim 384 --crowd 1,2,4,8,16,32,64 --crowd-seconds 2
# The same again in the reverse order (base first), into rev/.
bash benchmarks/crowd_ab.sh benchmarks/results/cpu-crowd-s22/rev base=.snap/trees/bbca/src this=src \
  -- --device cpu --n 65536 --dim 384 --crowd 1,2,4,8,16,32,64 --crowd-seconds 2
