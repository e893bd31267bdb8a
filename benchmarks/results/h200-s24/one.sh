#!/bin/bash
# Session 24: one device call (machines were scarce: a single call may be all there is) that
# decides issue 20's GIL candidate and measures issue 18's gathering candidate, each beside
# main in the same call. Trees from benchmarks/results/h200-s22/make_trees.sh; carry .snap/model,
# .snap/trees/n-{base,watch,rest20,gather,pre3} and benchmarks/results/h200-s2{2,4}. In order,
# each step only while the 600 s the call may run leave room for it:
#   text base, text watch (recall_text, 100 questions); text rest20 only if watch's one round
#   trip p50 is 2 ms or more (then rest20 takes watch's place below);
#   crowd base: 1-64 (with 48) and beside the GEMMs at 1, 16, 64;
#   crowd watch (or rest20): 1-64 and beside the GEMMs at 1, 16;
#   crowd gather: as base; then, if time is left, gather in fast precision and n-pre3 (main
#   before control protocol 3). A table of every crowd last.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for t in base rest20 watch gather pre3; do
  s=.snap/trees/n-$t/src; [ -d $s ] || continue
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
budget=${BUDGET_S:-585}  # (the seconds this call may run, less a margin)
room() { (( SECONDS + $1 < budget )) || { echo "--- skipped $2: ${SECONDS}s gone"; return 1; }; }
text() { # variant
  room 60 "text $1" || return 1
  echo "=== text $1 $(date +%T) (${SECONDS}s)"
  PYTHONPATH=.snap/model:.snap/trees/n-$1/src timeout 80 python3 benchmarks/text_recall.py --device cuda \
    --filler random --rounds 100 --embed-runtime triton > $OUT/text-$1.txt 2>&1
  grep -E "one round trip|three round|embed op|Error|Traceback" $OUT/text-$1.txt | head -4
}
p50_of() { grep "one round trip" $OUT/text-$1.txt | awk -F'|' '{gsub(/ /,"",$3); print $3}'; }
crowd() { # variant label sizes colocated estimate extra...
  local v=$1 label=$2 sizes=$3 colo=$4 est=$5; shift 5
  room $est "crowd $label" || return 1
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=.snap/trees/n-$v/src timeout $(( budget - SECONDS )) python3 .snap/trees/n-$v/src/kalos/tools/crowd.py \
    --device cuda --crowd $sizes --crowd-seconds 2 ${colo:+--colocated $colo} "$@" > $OUT/crowd-$label.txt 2>&1
  grep -E "GEMMs|first error|Traceback|Error" $OUT/crowd-$label.txt | head -6
}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
text base; text watch
gil=watch
w=$(p50_of watch); echo "watch one round trip p50: ${w:-none} ms"
if [ -z "$w" ] || awk "BEGIN{exit !($w >= 2.0)}"; then text rest20; gil=rest20; fi
all=1,2,4,8,16,32,48,64
crowd base base $all 1,16,64 150
crowd $gil $gil $all 1,16 130
crowd gather gather $all 1,16,64 150
crowd gather gather-fast 1,16,64 "" 45 --serve-arg=--precision --serve-arg=fast
crowd pre3 pre3 1,8,16,64 1,16 90
echo; echo "=== crowds, p50 us / p99 us / recalls/s (failed, errors, wrong), ${SECONDS}s"
for f in $OUT/crowd-*.txt; do
  echo "--- $(basename $f .txt)"
  grep -E "^ +[0-9]+ " $f | awk '{printf "  C=%-3s %7s %8s %9s  (%s %s %s) q/pass %s\n",$1,$2,$3,$5,$8,$9,$10,$12}'
done
