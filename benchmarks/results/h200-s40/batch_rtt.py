"""Session 40: what one client's request of Q queries costs end to end on a GPU sidecar (default
serve: the polling rounds take single recalls and hand a batch to the sweep), p50 / p99 over
alternated blocks, Q = 1, 16, 64; beside it, Q single recalls from Q threads' own clients (one
slot each, gathered by the polling rounds), to tell whether an AsyncClient should spread its
callers over several slots.
    PYTHONPATH=src python3 benchmarks/results/h200-s40/batch_rtt.py [--device cuda]"""
import argparse
import os
import shutil
import tempfile
import threading
import time

import numpy as np

from kalos import Client
from kalos.server.launcher import SidecarProcess

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--n", type=int, default=65536)
ap.add_argument("--dim", type=int, default=1024)
ap.add_argument("--reps", type=int, default=600)
args = ap.parse_args()
tmp = tempfile.mkdtemp(prefix="kbr", dir="/tmp")
name = f"batch-rtt-{os.getpid()}"
side = SidecarProcess(os.path.join(tmp, "s.db"), name=name, dim=args.dim, device=args.device)
try:
    rng = np.random.default_rng(0)
    with Client(name, timeout=30.0) as c:
        m = rng.standard_normal((args.n, args.dim)).astype(np.float32)
        for s in range(0, args.n, 8192):
            c.add(m[s:s + 8192])
        qs = rng.standard_normal((64, args.dim)).astype(np.float32)
        lat = {q: [] for q in (1, 16, 64)}
        for _ in range(3):
            for q in lat:
                for _ in range(50):
                    c.recall_many(qs[:q], k=8) if q > 1 else c.recall(qs[0], k=8)
                for _ in range(args.reps // 3):
                    t = time.perf_counter()
                    c.recall_many(qs[:q], k=8) if q > 1 else c.recall(qs[0], k=8)
                    lat[q].append(time.perf_counter() - t)
    for q, v in lat.items():
        a = np.asarray(v) * 1e6
        print(f"one client, a request of {q:2d} queries: p50 {np.percentile(a, 50):8.1f} us  p99 {np.percentile(a, 99):8.1f} us")
    for q in (16, 64):  # Q threads, each its own client, all sending single recalls at once, in rounds
        clients = [Client(name, timeout=30.0) for _ in range(q)]
        rounds = []
        barrier = threading.Barrier(q + 1)
        stop = False

        def worker(i):
            while True:
                barrier.wait()
                if stop:
                    return
                clients[i].recall(qs[i], k=8)
                barrier.wait()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(q)]
        for t in threads:
            t.start()
        for r in range(args.reps // 2):
            t0 = time.perf_counter()
            barrier.wait()
            barrier.wait()
            rounds.append(time.perf_counter() - t0)
        stop = True
        barrier.wait()
        for t in threads:
            t.join()
        for cl in clients:
            cl.close()
        a = np.asarray(rounds[50:]) * 1e6
        print(f"{q:2d} threads, a single recall each at once (all answered): p50 {np.percentile(a, 50):8.1f} us  "
              f"p99 {np.percentile(a, 99):8.1f} us")
finally:
    side.stop()
    shutil.rmtree(tmp, ignore_errors=True)
