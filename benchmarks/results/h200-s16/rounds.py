"""Session 15 probe (copied for session 16): the GPU polling server's rounds in process, no client processes: for each
round size b (1 = the single-query round), b slots' requests published at once (one NumPy
store of their req_seq words), the host's time until every answer is in, and the GPU's
stamps of the last round: first seen -> staged (gathering) and staged -> published (the
pass). 65,536 x 1024 float32, k = 8, exact. Run from the repository root:
PYTHONPATH=src python3 benchmarks/results/h200-s16/rounds.py [window_us]."""
import sys
import time

import numpy as np

sys.path.insert(0, "tests")
from test_slot_server import ALL, Rig  # noqa: E402

window_us = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
rng = np.random.default_rng(0)
slots = 64
rig = Rig(rng, dim=1024, n=65536, slots=slots, device="cuda", max_k=16, idle_s=5.0, window_s=window_us * 1e-6)
t0 = time.perf_counter()
rig.server.warm()
print(f"warm (every round compiled and captured): {time.perf_counter() - t0:.1f} s", flush=True)
w = rig.server.words
lay = rig.layout
req = np.ndarray((slots,), np.uint64, rig.buf, lay.slot_offset(0) + 8 * w.req_seq, (lay.slot_size,))
resp = np.ndarray((slots,), np.uint64, rig.buf, lay.slot_offset(0) + 8 * w.resp_seq, (lay.slot_size,))
print(f"window {window_us:g} us")
print("   b   host p50 us   p90   gather us   pass us   per query us")
for b in (1, 2, 4, 8, 16, 32, 64):
    rig.active[:] = False
    rig.active[:b] = True
    for s in range(b):  # the request words, all but req_seq
        rig.submit(s, rng.standard_normal(1024).astype(np.float32), 8, flags=ALL)
    seqs = rig.seqs[:b].astype(np.uint64).copy()
    req[:b] = seqs
    rig.server.start(rig.active)
    host, gather, pas = [], [], []
    for it in range(300):
        while not (resp[:b] == seqs).all():
            rig.server.running()
        seqs = seqs + np.uint64(1)
        t = time.perf_counter()
        req[:b] = seqs
        while not (resp[:b] == seqs).all():
            pass
        host.append(time.perf_counter() - t)
        _wait, seen, staged, published = rig.server.stamps()
        gather.append(staged - seen)
        pas.append(published - staged)
        rig.server.running()
    rig.seqs[:b] = seqs.astype(np.int64)
    rig.server.stop()
    h = np.array(host[50:]) * 1e6
    print(f"  {b:2d}   {np.percentile(h, 50):9.1f}  {np.percentile(h, 90):6.1f}   {np.median(gather[50:]) / 1e3:8.1f}"
          f"   {np.median(pas[50:]) / 1e3:7.1f}   {np.percentile(h, 50) / b:8.1f}", flush=True)
rig.close()
