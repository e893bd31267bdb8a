#!/bin/bash
# For the next device session: the GIL candidates for recall_text on the H200 (BENCHMARKS.md,
# text recall on the H200), each beside main in one call. Make the trees first (make_trees.sh)
# and carry .snap/model, .snap/trees/n-* (base, rest20, rest50, sleep, watch, gather, gathernap,
# pre3) and this folder. Parts
# (arguments, in order; about 360 s and 380 s, so two calls: `next.sh text crowd-a`, then
# `next.sh crowd-b tests`):
#   text     recall_text one round trip against three, 100 questions: n-base, n-watch, n-rest20,
#            n-sleep (n-rest50 only if n-rest20 does not reach n-sleep's figure);
#   crowd-a  the crowd 1-64 and beside the GEMMs at 1 and 16: n-watch, then n-base;
#   crowd-b  the same: n-rest20, then n-sleep, then n-pre3 (main before control protocol 3:
#            the baseline of session 23's bells; n-base is main after it);
#   crowd-c  the gathering candidate (candidate-gather.patch): the crowd 1-64 and beside the
#            GEMMs at 1, 16 and 64 for n-gather, then n-base; n-gathernap at 16-64 (beside the
#            GEMMs at 64); n-gather in fast precision at 1, 16, 64 (about 330 s: a call of its own);
#   text3, crowd-gil, crowd-pre3  (session 24, the tree folder over 64 MiB with every tree: the
#            carry split in two calls) text for n-base, n-watch, n-rest20; their crowds; n-pre3's;
#   tests    the CUDA tests of a sidecar with GPU polling under clients, on n-watch and n-rest20
#            (and every test of the patch's own on the CPU: apply it to a checkout, .ci/run).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in base rest20 rest50 sleep watch gather gathernap pre3; do
  s=.snap/trees/n-$t/src; [ -d $s ] || continue; gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c \
    -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
text() { # variant
  echo "=== text $1 $(date +%T)"
  PYTHONPATH=.snap/model:.snap/trees/n-$1/src timeout 90 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 100 --embed-runtime triton > $OUT/next-text-$1.txt 2>&1
  grep -E "one round trip|three round|embed op|Error|Traceback" $OUT/next-text-$1.txt | head -4
}
show() { grep -E "^ +[0-9]+ |GEMMs|first error|Traceback|Error" "$1" | head -24; }
crowd() { # variant [label sizes colocated extra...]
  local v=$1 label=${2:-$1} sizes=${3:-1,2,4,8,16,32,64} colo=${4-1,16}; shift $(( $# < 4 ? $# : 4 ))
  echo "=== crowd $label $(date +%T)"; PYTHONPATH=.snap/trees/n-$v/src timeout 150 python3 .snap/trees/n-$v/src/kalos/tools/crowd.py \
    --device cuda --crowd $sizes --crowd-seconds 2 --colocated $colo "$@" > $OUT/next-crowd-$label.txt 2>&1
  show $OUT/next-crowd-$label.txt
}
for part in ${*:-text crowd-a crowd-b tests}; do
  case $part in
    text) for v in base watch rest20 sleep; do text $v; done;;
    text-rest50) text rest50;;
    text3) for v in base watch rest20; do text $v; done;;
    crowd-gil) crowd watch; crowd rest20; crowd base;;
    crowd-pre3) crowd pre3;;
    crowd-a) crowd watch; crowd base;;
    crowd-b) crowd rest20; crowd sleep; crowd pre3;;
    crowd-c) crowd gather gather 1,2,4,8,16,32,48,64 1,16,64; crowd base base-c 1,2,4,8,16,32,48,64 1,16,64
             crowd gathernap gathernap 16,32,48,64 64
             crowd gather gather-fast 1,16,64 "" --serve-arg=--precision --serve-arg=fast;;
    tests)
      for v in watch rest20; do
        echo "=== tests $v $(date +%T)"
        PYTHONPATH=.snap/trees/n-$v/src timeout 100 python3 -m pytest -q -m cuda -p no:cacheprovider \
          -k "sidecar_with_gpu_polling" tests/test_slot_server.py > $OUT/next-cuda-tests-$v.txt 2>&1
        grep -E "passed|failed|^FAILED|Error" $OUT/next-cuda-tests-$v.txt | tail -4
      done;;
  esac
done
echo "end $(date +%T)"
