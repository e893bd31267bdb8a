# Session 32's device calls share these (sourced by callN.sh, from the repository root): the
# ctypes fence helper built for each tree, a crowd and the rounds in process, each skipped
# when the call's budget (BUDGET_S, seconds) would not hold it; outputs go to $OUT. A crowd
# runs this checkout's crowd.py against the tree's server (from call 3 on; calls 1-2 ran the
# tree's own crowd.py, but call 2's base-windows, which ran this one's).
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
build_fence() { for s in "$@"; do gcc -O2 -shared -fPIC $inc $s/kalos/ipc/_fence.c -o $s/kalos/ipc/_fence$ext || exit 1; done; }
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-540}
crowd() { # tree label [colocated sizes] [crowd.py args...]   (CROWD: the sizes, default 1-64;
  # INTO: append to $OUT/crowd-$INTO.txt, under a line naming the label, instead of crowd-label.txt)
  local tree=$1 label=$2 colo=$3; shift 3
  local file=$OUT/crowd-${INTO:-$label}.txt
  (( SECONDS + ${NEED_S:-60} < budget )) || { echo "--- skipped crowd $label: ${SECONDS}s gone"; return 1; }
  echo "=== crowd $label $(date +%T) (${SECONDS}s)"
  [ -n "$INTO" ] && echo "##### $label" >> $file || : > $file
  PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 src/kalos/tools/crowd.py --device cuda \
    --crowd ${CROWD:-1,2,4,8,16,32,64} --crowd-seconds 2 ${colo:+--colocated $colo} "$@" >> $file 2>&1
  pkill -9 -f "kalos[ ]serve" 2>/dev/null
  grep -E "Traceback|Error" $file | head -4
}
cuda_tests() { # seconds pytest-args...   (this tree's CUDA tests, into $OUT/cuda-tests.txt; added in session 33)
  local limit=$1; shift
  nvidia-smi --query-gpu=name --format=csv,noheader
  echo "=== cuda tests $(date +%T)"
  PYTHONPATH=src timeout -s INT -k 5 $limit python3 -m pytest -v -p no:cacheprovider -m cuda "$@" > $OUT/cuda-tests.txt 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/cuda-tests.txt | tail -8
}
rounds() { # label tree [rounds.py args...]
  local label=$1 tree=$2; shift 2
  (( SECONDS + ${NEED_S:-60} < budget )) || { echo "--- skipped rounds $label: ${SECONDS}s gone"; return 1; }
  echo "=== rounds $label $(date +%T) (${SECONDS}s)"
  PYTHONPATH=$tree timeout $(( budget - SECONDS )) python3 benchmarks/rounds.py --rounds 300 "$@" \
    > $OUT/rounds-$label.txt 2>&1
}
summary() { # the crowds' rows and the rounds' tables, last
  for f in $(ls $OUT/crowd-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"
    grep -E "^#####|^ +[0-9]+ +[0-9.]+ |GEMMs [0-9]" $f | head -24; done
  for f in $(ls $OUT/rounds-*.txt 2>/dev/null); do echo "--- $(basename $f .txt)"
    grep -A4 "^variant" $f; grep -E "collect_kernel|scan_topk" $f | head -4; done
}
