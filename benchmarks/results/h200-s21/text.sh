#!/bin/bash
# Session 21 text run: issue 20's H200 recall_text. Parts (arguments, in order; none: all):
#   forward  the embedder's forward pass per bucket, the model's own kernels against the Triton ones
#            (benchmarks/embed_forward.py: device time per replay, kernels per replay, embed([q]) in
#            process, cosine against sentence-transformers);
#   triton, graphs  recall_text end to end over 65,536 memories (benchmarks/text_recall.py) with that
#            --embed-runtime: one round trip (op recall_text) alternated question by question with
#            the three round trips it replaces, beside sentence-transformers + torch.topk in process;
#   tests    the CUDA tests of both runtimes.
# Carry .snap/model (benchmarks/export_model.py) and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
[ -f src/kalos/ipc/_fence$ext ] || gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.snap/model:src
parts=${*:-forward triton graphs tests}
for part in $parts; do
  echo "=== $part $(date +%T)"
  case $part in
    forward)
      timeout 170 python3 benchmarks/embed_forward.py --rounds 300 > $OUT/embed-forward.txt 2>&1
      grep -vE "Warning|warn" $OUT/embed-forward.txt | tail -16;;
    triton|graphs)
      timeout 200 python3 benchmarks/text_recall.py --device cuda --filler random --rounds 400 --embed-runtime $part \
        > $OUT/text-$part.txt 2>&1
      grep -E "^\||embedder|agree|top-1|Error|Traceback|whole run" $OUT/text-$part.txt | head -16;;
    tests)
      timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_minilm_kernels.py tests/test_sidecar_embed.py \
        > $OUT/text-cuda-tests.txt 2>&1
      grep -E "passed|failed|^FAILED|Error" $OUT/text-cuda-tests.txt | tail -6;;
  esac
done
echo "end $(date +%T)"
