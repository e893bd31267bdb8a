#!/bin/bash
# Session 26, call 2: where the graphed embedder's time goes in process (inproc.py), then the
# session 25 probe of recall_text in a GPU sidecar with the connection thread's CPU time
# (probe_extra.py): main as it is, a switch interval of 50 us, the sweep's wait for the kernel's
# news at 5 ms instead of 1. Carry .snap/model, .snap/bin, benchmarks/results/h200-s25 and this folder.
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
H=benchmarks/results/h200-s26
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -E "Model name|Thread|Core|Socket|MHz|NUMA node\(s\)" > $OUT/lscpu.txt; cat $OUT/lscpu.txt
{ echo "siblings of cpu0: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>&1)"
  echo "governor: $(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1)"
  for d in /sys/devices/system/cpu/cpu0/cpuidle/state*; do echo "idle $(cat $d/name 2>/dev/null) latency $(cat $d/latency 2>/dev/null) us"; done
  nproc; } >> $OUT/lscpu.txt 2>&1; tail -8 $OUT/lscpu.txt
echo "=== inproc $(date +%T) (${SECONDS}s)"
PYTHONPATH=.snap/model:src timeout 150 python3 $H/inproc.py > $OUT/inproc.txt 2>&1; tail -22 $OUT/inproc.txt
mkdir -p /tmp/extra
probe() { # label env...
  local label=$1; shift
  (( SECONDS + 70 < ${BUDGET_S:-540} )) || { echo "--- skipped $label"; return; }
  echo "=== probe $label $(date +%T) (${SECONDS}s)"
  env KALOS_PROBE_EXTRA=$H/probe_extra.py "$@" PYTHONPATH=.snap/model:src timeout 150 python3 \
    benchmarks/results/h200-s25/probe/probe_text.py --label $label --out /tmp/extra > $OUT/probe-$label.txt 2>&1
  sed -n '/client p50/,/recall (shared/p' $OUT/probe-$label.txt | grep -E "^  [a-z]|op recall_text|EmbedService|_run|Store.get|recall_for|send_frame" | head -24
}
probe main
probe switch50 KALOS_PROBE_SWITCH=5e-5
probe kwait5 KALOS_PROBE_KWAIT=0.005
probe switch20 KALOS_PROBE_SWITCH=2e-5
if (( SECONDS + 60 < ${BUDGET_S:-540} )); then
  echo "=== py-spy on main $(date +%T)"
  env KALOS_PROBE_EXTRA=$H/probe_extra.py PYTHONPATH=.snap/model:src timeout 120 python3 \
    benchmarks/results/h200-s25/probe/probe_text.py --label spy --rounds 100 --py-spy .snap/bin/py-spy --out /tmp/extra > /tmp/extra/probe-spy.txt 2>&1
fi
tar czf $OUT/extra.tgz -C /tmp/extra . 2>/dev/null; ls -la $OUT
