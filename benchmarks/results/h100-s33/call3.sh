#!/bin/bash
# Session 33, call 3 (two one-line commands, the second recorded here): every CUDA-marked test
# but the slot server's (call 1 ran those) and the MiniLM ones (the model is not on the device),
# this tree (per-query namespaces in the GPU rounds). The one failure is the sidecar's own
# embedder, whose model was not carried either.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix)
gcc -O2 -shared -fPIC $(python3-config --includes) src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext
PYTHONPATH=src timeout -s INT -k 5 400 python3 -m pytest -q -p no:cacheprovider -m cuda tests \
  --deselect tests/test_slot_server.py --ignore tests/test_minilm_kernels.py > $OUT/cuda-all.txt 2>&1
