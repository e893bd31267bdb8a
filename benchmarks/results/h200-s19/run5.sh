#!/bin/bash
# Session 19 run 5: the final kernel's re-score split over programs (Tuning.final_split_rows):
# the CUDA tests of the engine and the slot server, the engine's graphs by variant (probe4.py),
# then the polling rounds in process, split against one program per query (benchmarks/rounds.py).
cd "$(dirname "$0")/../../.."
ext=$(python3-config --extension-suffix); inc=$(python3-config --includes)
gcc -O2 -shared -fPIC $inc src/kalos/ipc/_fence.c -o src/kalos/ipc/_fence$ext || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PYTHONPATH=src timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_slot_server.py tests/test_torch_engine.py \
  > $OUT/run5-cuda-tests.txt 2>&1; tail -3 $OUT/run5-cuda-tests.txt; grep -E "^FAILED|Error" $OUT/run5-cuda-tests.txt | head -5
PYTHONPATH=src:benchmarks timeout 150 python3 benchmarks/results/h200-s19/probe4.py > $OUT/run5-probe4.txt 2>&1
sed -n '/== table/,$p' $OUT/run5-probe4.txt | cut -c1-150; grep -E "fail|Error" $OUT/run5-probe4.txt | head -5
PYTHONPATH=src timeout 200 python3 benchmarks/rounds.py --sizes 1,2,8,16,32,64 --slots 64 --rounds 240 \
  --variant 'one program:exact:{"final_split_rows": 0}' --variant 'split 8:exact:{}' \
  --variant 'one program:fast:{"final_split_rows": 0}' --variant 'split 8:fast:{}' > $OUT/run5-rounds.txt 2>&1
sed -n '/^round host/,$p' $OUT/run5-rounds.txt; grep -E "Error|Traceback" -A3 $OUT/run5-rounds.txt | head -12
