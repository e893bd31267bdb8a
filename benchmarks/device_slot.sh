#!/bin/bash
# Device run: the slot server's CUDA tests and its in-process diagnostics.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
tar xzf .carry/tcache.tgz -C /tmp 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_slot_server.py -m cuda 2>&1 | tail -25
timeout 330 python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000 --checks 200 \
    ${DIAG_ARGS:-} --json $OUT/diag.json 2>&1 | tail -30
tar czf $OUT/tcache.tgz -C /tmp tcache
