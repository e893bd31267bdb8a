"""Session 18 probe: the GPU polling server's rounds in process (rounds_tuning.py's loop) with
the default tuning, for several slot counts (the polling kernel reads every slot's words at
each poll): for each round size b, the host's time until every answer is in and the GPU's pass.
Run from the repository root: PYTHONPATH=src python3 benchmarks/results/h200-s18/rounds_slots.py"""
import sys
import time

import numpy as np

sys.path.insert(0, "tests")
import test_slot_server  # noqa: E402
from test_slot_server import ALL, Rig  # noqa: E402

from kalos.engine.gpu import TorchEngine  # noqa: E402

VARIANTS = {  # name: (precision, tuning overrides)
    "exact default": ("exact", {}),
    "exact gemm>=2": ("exact", {"gemm_min_q": 2}),
    "exact gemm>=4": ("exact", {"gemm_min_q": 4}),
    "exact gemm>=8": ("exact", {"gemm_min_q": 8}),
    "exact fused": ("exact", {"scores_max_q": 0, "gemm_min_q": 65}),
    "fast default": ("fast", {}),
    "fast gemm>=2": ("fast", {"gemm_min_q": 2}),
    "fast gemm>=8": ("fast", {"gemm_min_q": 8}),
}
VARIANTS = {f"exact {n} slots": ("exact", {}, n) for n in map(int, (sys.argv[1] if len(sys.argv) > 1 else "9,16,128").split(","))}
names = list(VARIANTS)
sizes = (1, 2, 8)
table = {}
for name in names:
    precision, tune, slots = VARIANTS[name]
    rng = np.random.default_rng(0)
    # (the rig's engine, made with this variant's tuning)
    test_slot_server.TorchEngine = lambda *a, tune=tune, **kw: TorchEngine(*a, tune=tune, **kw)
    rig = Rig(rng, precision=precision, dim=1024, n=65536, slots=slots, device="cuda", max_k=16, idle_s=5.0,
              window_s=20e-6)
    assert all(getattr(rig.engine.tuning, key) == value for key, value in tune.items()), name
    t0 = time.perf_counter()
    rig.server.warm()
    print(f"{name}: warm {time.perf_counter() - t0:.1f} s", flush=True)
    w = rig.server.words
    lay = rig.layout
    req = np.ndarray((slots,), np.uint64, rig.buf, lay.slot_offset(0) + 8 * w.req_seq, (lay.slot_size,))
    resp = np.ndarray((slots,), np.uint64, rig.buf, lay.slot_offset(0) + 8 * w.resp_seq, (lay.slot_size,))
    for b in sizes:
        rig.active[:] = 0
        rig.active[:b] = 1
        for s in range(b):  # the request words, all but req_seq
            rig.submit(s, rng.standard_normal(1024).astype(np.float32), 8, flags=ALL)
        seqs = rig.seqs[:b].astype(np.uint64).copy()
        req[:b] = seqs
        rig.server.start(rig.active)
        host, pas = [], []
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
            pas.append(published - staged)
            rig.server.running()
        rig.seqs[:b] = seqs.astype(np.int64)
        rig.server.stop()
        h = np.array(host[50:]) * 1e6
        table[name, b] = (np.percentile(h, 50), np.median(pas[50:]) / 1e3)
        print(f"  b={b:2d} host p50 {table[name, b][0]:7.1f} us  pass {table[name, b][1]:7.1f} us", flush=True)
    rig.close()
    del rig
print("\nround host p50 / GPU pass us, by round size b (65,536 x 1024, k = 8)")
print(f"{'variant':16s}" + "".join(f"{'b=' + str(b):>14s}" for b in sizes))
for name in names:
    print(f"{name:16s}" + "".join(f"{table[name, b][0]:7.0f}/{table[name, b][1]:<6.0f}" for b in sizes))
