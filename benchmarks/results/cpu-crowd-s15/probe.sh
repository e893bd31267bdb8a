#!/bin/bash
# Session 15 probe on the 2-vCPU VM: does a client's spin (spin, then yield; nap past two
# clients per core) cost the CPU crowd its batching? This code, the CPU engine, 65,536 x 384,
# crowds 1, 2, 8, with the default client spin and with KALOS_CLIENT_SPIN_US=0 (block at once).
cd "$(dirname "$0")/../../.."
out=benchmarks/results/cpu-crowd-s15
PYTHONPATH=src timeout 900 .venv/bin/python src/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 --crowd 1,2,8 --crowd-seconds 3 > $out/probe-default.txt 2>&1
KALOS_CLIENT_SPIN_US=0 PYTHONPATH=src timeout 900 .venv/bin/python src/kalos/tools/crowd.py --device cpu --n 65536 --dim 384 --crowd 1,2,8 --crowd-seconds 3 > $out/probe-spin0.txt 2>&1
