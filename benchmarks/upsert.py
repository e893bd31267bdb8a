"""Upsert of keyed rows against plain add, side by side, on one CPU sidecar (issue 22).

    PYTHONPATH=src python3 benchmarks/upsert.py [--dim 384] [--rows 1000] [--calls 20] [--blocks 3]

One CPU sidecar on a fresh store. Each call stores ``--rows`` rows (random unit vectors, a short
text each) and is timed from the client's call to its return (the rows durable and recallable):

* ``add``: plain adds (new ids, no keys);
* ``upsert new``: keyed adds whose keys are all new (an insert under a key lookup);
* ``upsert replace``: keyed adds whose keys all exist (every row's vector, text and metadata
  replaced in the store and swapped in the engine).

The three kinds run in alternating blocks (a busy shared machine skews them alike); the rows/s
of each is the median over its calls. Seeded (``--seed``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from kalos import Client
from kalos.server.launcher import SidecarProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=384, help="the rows' dimension (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=1000, help="rows per call (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=20, help="calls per kind and block (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=22, help="seed of the random rows (default: %(default)s)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    runtime = tempfile.mkdtemp(prefix="kubr", dir="/tmp")
    os.chmod(runtime, 0o700)
    os.environ.setdefault("KALOS_RUNTIME_DIR", runtime)
    tmp = tempfile.mkdtemp(prefix="kub", dir="/tmp")
    name = f"upsert-bench-{os.getpid()}"
    sidecar = SidecarProcess(os.path.join(tmp, "store.db"), name=name, dim=args.dim, device="cpu")
    try:
        with Client(name, timeout=30.0) as client:
            texts = [f"memory {i}" for i in range(args.rows)]
            pool = [[f"key-{b}-{i}" for i in range(args.rows)] for b in range(args.calls)]
            client.add(rng.standard_normal((args.rows, args.dim)), keys=pool[0], texts=texts)  # warm-up
            times: dict[str, list[float]] = {"add": [], "upsert new": [], "upsert replace": []}
            fresh = 0
            for block in range(args.blocks):
                for kind in times:
                    for call in range(args.calls):
                        vectors = rng.standard_normal((args.rows, args.dim)).astype(np.float32)
                        if kind == "add":
                            keys = None
                        elif kind == "upsert new":
                            fresh += 1
                            keys = [f"new-{fresh}-{i}" for i in range(args.rows)]
                        else:
                            keys = pool[call]
                            if block == 0 and call > 0:
                                client.add(vectors, keys=keys, texts=texts)  # first time: make them exist
                        t = time.perf_counter()
                        client.add(vectors, keys=keys, texts=texts)
                        times[kind].append(time.perf_counter() - t)
            stats = client.stats()
    finally:
        sidecar.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    print(f"CPU sidecar, dim {args.dim}, {args.rows:,} rows per call, {args.calls} calls x {args.blocks} blocks per kind, "
          f"{stats['count']:,} rows stored at the end")
    base = args.rows / float(np.median(times["add"]))
    for kind, samples in times.items():
        rate = args.rows / float(np.median(samples))
        print(f"  {kind:15s} {rate:10,.0f} rows/s   (median call {np.median(samples) * 1e3:7.1f} ms, "
              f"p90 {np.percentile(samples, 90) * 1e3:7.1f} ms)   {rate / base:4.2f}x add")


if __name__ == "__main__":
    main()
