#!/bin/bash
# Session 30, call 2: (1) reading the round's queries from the slots, by how the read is
# spread (stage_probe.py); (2) the rounds of 1-64 in process (benchmarks/rounds.py): the
# session's start (538d535, .snap/trees/s30-base: git archive 538d535 src), then this tree
# with group maxima taken 8 queries a program (the default, GEMM from 16 queries) and with
# rounds of 8 or 16 scanned by Triton, the scan writing the group maxima (scan8, scan16),
# with the round's queries read by 4 or 8 programs each (stage4, stage8), then the start
# again; kernels profiled at 16 and 64.
# (stage4 and stage8 ran with 2 and 1 warps a program, the code then; the probe found 4 warps
# the ones that pay, and the crowd of call3 ran split 8 with 4.)
#   OUT=$OUT bash benchmarks/results/h100-s30/call2.sh   (carry .snap/trees/s30-base and this folder)
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
for s in src .snap/trees/s30-base/src; do
  gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== stage probe $(date +%T)"
PYTHONPATH=src timeout 120 python3 benchmarks/results/h100-s30/stage_probe.py > $OUT/stage.txt 2>&1; tail -30 $OUT/stage.txt
rounds() { # label tree [args...]
  local label=$1 tree=$2; shift 2
  (( SECONDS < ${LIMIT:-480} )) || { echo "--- skipped $label: ${SECONDS}s gone"; return; }
  echo "=== rounds $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$tree timeout $(( 540 - SECONDS )) python3 benchmarks/rounds.py --sizes 1,2,4,8,16,32,64 --rounds 300 "$@" \
    > $OUT/rounds-$label.txt 2>&1
  grep -A12 "^variant" $OUT/rounds-$label.txt
}
S='"gemm_min_q": 32, "scores_max_q": 16'
rounds base-1 .snap/trees/s30-base/src --profile 16,64
rounds this src --profile 16,64 \
  --variant 'gemm16:exact:{}' --variant "scan16:exact:{$S}" --variant "scan8:exact:{$S, \"scan_threshold_min_q\": 8}" \
  --variant "scan16-stage4:exact:{$S, \"stage_split\": 4}" --variant "scan16-stage8:exact:{$S, \"stage_split\": 8}" \
  --variant 'gemm16:fast:{}' --variant "scan16:fast:{$S}" --variant "scan8:fast:{$S, \"scan_threshold_min_q\": 8}" \
  --variant "scan16-stage4:fast:{$S, \"stage_split\": 4}"
rounds base-2 .snap/trees/s30-base/src
echo "=== ${SECONDS}s"
