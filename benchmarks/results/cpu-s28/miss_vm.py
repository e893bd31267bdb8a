# Session 28: the item cache's miss of 8 items (ItemCache.encoded with a 0-byte cache, so every
# call reads the store and encodes the items), over a 2,000-row SQLite store of short texts with
# metadata, 6,000 calls (the first 500 not timed). Run once per tree:
#   PYTHONPATH=<tree>/src python3 benchmarks/results/cpu-s28/miss_vm.py
import os, tempfile, time
import numpy as np
from kalos.server.item_cache import ItemCache
from kalos.store.sqlite import Store

tmp = tempfile.mkdtemp()
store = Store.open(os.path.join(tmp, "m.db"), dim=384)
rng = np.random.default_rng(0)
ids = store.add(rng.standard_normal((2000, 384)).astype(np.float32), namespace="default",
                texts=[f"memory {i}: the user said something about topic {i % 97} at the meeting" for i in range(2000)],
                metadata=[{"user": "u1", "i": i} for i in range(2000)])[0]
cache = ItemCache(store, 0)
picks = [ids[rng.choice(2000, 8, replace=False)].tolist() for _ in range(64)]
times = []
for r in range(6000):
    start = time.perf_counter_ns()
    cache.encoded(picks[r % 64], check_floor=lambda n: None)
    times.append(time.perf_counter_ns() - start)
times = np.array(times[500:]) / 1e3
print(f"miss of 8 items: p50 {np.percentile(times, 50):.1f} us, mean {times.mean():.1f}")
