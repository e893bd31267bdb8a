#!/bin/bash
# The trees next.sh compares with main, each main's src (HEAD) with one change; and py-spy's
# binary for its probe. Run from the repository root: bash benchmarks/results/h200-s25/make_trees.sh
set -e
cd "$(dirname "$0")/../../.."
tree() { rm -rf .snap/trees/n-$1 && mkdir -p .snap/trees/n-$1 && git archive HEAD src | tar -x -C .snap/trees/n-$1; }
# n-gap0: a round goes at its window (no going on while the crowd keeps coming).
tree gap0
sed -i 's/^DEFAULT_GAP_S = .*/DEFAULT_GAP_S = 0.0/' .snap/trees/n-gap0/src/kalos/engine/gpu/slot_server.py
grep -q '^DEFAULT_GAP_S = 0.0$' .snap/trees/n-gap0/src/kalos/engine/gpu/slot_server.py
# n-yieldnap: a client that spun yielding its core naps before it sleeps.
tree yieldnap
python3 - <<'PY'
p = ".snap/trees/n-yieldnap/src/kalos/ipc/channel.py"
s = open(p).read()
old = '''        if clients <= self._nap_clients or self._crowded == "yield":
            return self._spin_s, False, True'''
assert old in s, "ClientChannel._budgets changed: port the yieldnap change by hand"
open(p, "w").write(s.replace(old, old.replace("False, True", "True, True")))
PY
mkdir -p .snap/bin && cp "$(command -v py-spy || echo .venv/bin/py-spy)" .snap/bin/py-spy
du -sh .snap/trees/n-gap0 .snap/trees/n-yieldnap .snap/bin .snap/model 2>/dev/null
