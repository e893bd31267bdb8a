#!/bin/bash
# Session 14 run 1: the CUDA tests on this code, then the text recall on the H200 (issue 20),
# 65,536 memories (695 passages + random filler), three sidecars one after another, each beside
# the in-process baseline (sentence-transformers + torch.topk): the session's start (ad2bbd0,
# .snap/trees/head) with sentence-transformers in the sidecar; this code with it; this code with
# the CUDA graphs. Outputs: $OUT/run1-*.txt.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in src .snap/trees/head/src; do gcc -O2 -shared -fPIC $inc $t/kalos/ipc/_fence.c -o $t/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "=== CUDA tests"
PYTHONPATH=.snap/model:src timeout 260 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/ > $OUT/run1-cuda-tests.txt 2>&1; tail -4 $OUT/run1-cuda-tests.txt
text() {  # name tree runtime
  echo "=== text $1"
  PYTHONPATH=.snap/model:$2 timeout 150 python3 benchmarks/text_recall.py --device cuda --filler random --rounds 500 \
    --embed-runtime $3 > $OUT/run1-text-$1.txt 2>&1
  grep -E "^\| |hits,|runtime|Error|error" $OUT/run1-text-$1.txt | head -14
}
text head-torch .snap/trees/head/src torch
text src-torch src torch
text src-graphs src graphs
