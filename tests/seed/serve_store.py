"""A sidecar stand-in for the tests: serves a store through SeedCompatServer in its own process.

    python serve_store.py STORE.npz SHM_NAME [SPIN_US]

STORE.npz holds ``ids`` (int64), ``vectors`` (unit float32 rows) and ``deleted`` (ids deleted
after the add), which rebuild exactly the engine the test uses as its reference. Prints
"serving" once started, serves until its stdin is closed, then prints the server's stats as
one JSON line. BLAS runs single-threaded (set before NumPy loads): a multi-threaded OpenBLAS
whose threads busy-wait is slowed tenfold on a small host where the article's client spins on
another core, and the test should not depend on that.
"""
from __future__ import annotations

import json
import os
import sys
import threading

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from kalos.engine import NumpyEngine  # noqa: E402
from kalos.server.seed_compat import SeedCompatServer  # noqa: E402


def main() -> None:
    store_path, shm_name = sys.argv[1], sys.argv[2]
    spin_us = float(sys.argv[3]) if len(sys.argv) > 3 else 2000.0
    data = np.load(store_path)
    ids, vectors, deleted = data["ids"], data["vectors"], data["deleted"]
    engine = NumpyEngine(vectors.shape[1], capacity=max(1, len(ids)))
    engine.add(ids, vectors, 0, 0.0)
    engine.delete(deleted)
    lock = threading.Lock()

    def search(q, k):
        with lock:
            return engine.search(q, k)

    server = SeedCompatServer(search=search, dim=vectors.shape[1], shm_name=shm_name, spin_us=spin_us)
    server.start()
    print("serving", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.stop()
    print(json.dumps(server.stats), flush=True)


if __name__ == "__main__":
    main()
