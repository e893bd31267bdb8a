#!/bin/bash
# The crowd of single recalls (src/kalos/tools/crowd.py, = kalos bench --crowd) for several
# source trees in one run, one after another, each into OUT_DIR/LABEL.txt, then their p50 us and
# recalls/s side by side per crowd size. Run from the repository root:
#   bash benchmarks/crowd_ab.sh OUT_DIR LABEL=SRC_DIR [LABEL=SRC_DIR...] [-- crowd.py arguments]
# e.g. bash benchmarks/crowd_ab.sh benchmarks/results/cpu-crowd-s22 this=src base=.snap/trees/x/src \
#        -- --device cpu --n 65536 --dim 384 --crowd 1,2,4,8,16,32,64 --crowd-seconds 2
# A tree needs its native helpers built (pip install -e . builds src's; for another tree, gcc
# -O2 -shared -fPIC each of kalos/ipc/_fence.c and kalos/engine/_dots.c as setup.py does).
set -u
out=${1:?usage: crowd_ab.sh OUT_DIR LABEL=SRC_DIR... [-- crowd.py arguments]}; shift
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#trees[@]} -gt 0 ] || { echo "crowd_ab.sh: name at least one LABEL=SRC_DIR" >&2; exit 2; }
python=${PYTHON:-$(command -v .venv/bin/python || command -v python3)}
mkdir -p "$out"
for tree in "${trees[@]}"; do
  label=${tree%%=*} src=${tree#*=}
  echo "== $label ($src) $(date +%T)"
  PYTHONPATH=$src timeout 1800 "$python" "$src/kalos/tools/crowd.py" "$@" > "$out/$label.txt" 2>&1 \
    || echo "   $label: crowd.py exited with $? (see $out/$label.txt)"
  grep -E "Traceback|Error" "$out/$label.txt" | head -3
done
# The table: crowd rows are "C p50 p99 p99.9 recalls/s ..." (the crowd alone: the first block).
echo; printf "%4s" C; for tree in "${trees[@]}"; do printf " | %22s" "${tree%%=*} p50 us, recalls/s"; done; echo
for c in $(awk '/^ +C +p50/{n++} n==1 && /^ +[0-9]+ /{print $1}' "$out/${trees[0]%%=*}.txt"); do
  printf "%4s" "$c"
  for tree in "${trees[@]}"; do
    printf " | %22s" "$(awk -v c="$c" '/^ +C +p50/{n++} n==1 && $1==c {printf "%s, %s", $2, $5; exit}' "$out/${tree%%=*}.txt")"
  done; echo
done
