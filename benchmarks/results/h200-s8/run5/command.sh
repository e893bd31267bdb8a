export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
# benchmarks/.data/*.npy were made on the development machine (MiniLM on its CPU), equivalent to:
#   python3 benchmarks/fast_real_text.py --save-vectors benchmarks/.data/paragraphs.npy --save-queries benchmarks/.data/questions.npy
python3 benchmarks/fast_real_text.py --vectors benchmarks/.data/paragraphs.npy --queries benchmarks/.data/questions.npy --device cuda --json $OUT/real_text.json 2>&1 | tail -5
python3 -m kalos bench --device cuda --gpu-sizes 65536 --batches 1,64 --repeats 2000 --gpu-polling graph --clients "" --json $OUT/bench.json > $OUT/bench.txt 2>&1
tail -40 $OUT/bench.txt
