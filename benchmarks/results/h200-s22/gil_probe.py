"""The GIL convoy behind recall_text's 3.6 ms on the H200 (BENCHMARKS.md, text recall on the H200).

A "sweep" thread loops on ``--work`` iterations of Python work, then waits as the variant says:
``yield`` (os.sched_yield, as the sweep does while the GPU polls), ``rest`` (a GIL-free spin of
kalos.ipc._fence.spin_pending for ``--rest-us``, candidate-rest.patch), ``sleep`` (20 us), or no
thread at all (``alone``). The main thread times an op of 20 GIL releases (sha256 of 20 KB each),
as a control thread's embed or get releases it. Run from the repository root:
``python3 benchmarks/results/h200-s22/gil_probe.py`` (needs the built kalos.ipc._fence).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
from kalos.ipc import sync  # noqa: E402


def run(mode: str, work: int, rest_us: float, ops: int) -> tuple[float, float]:
    stop = threading.Event()
    n = 64
    req, answered = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    active, busy = np.zeros(n, bool), np.ones(n, bool)

    def sweep() -> None:
        while not stop.is_set():
            x = 0
            for i in range(work):
                x += i
            if mode == "yield":
                os.sched_yield()
            elif mode == "rest":
                sync.spin_pending(req, answered, active, busy, int(rest_us * 1e3))
            elif mode == "sleep":
                time.sleep(20e-6)

    thread = threading.Thread(target=sweep)
    if mode != "alone":
        thread.start()
    data = b"x" * 20_000
    took = []
    for _ in range(ops):
        t = time.perf_counter()
        for _ in range(20):
            hashlib.sha256(data).digest()  # (releases the GIL: more than 2,047 bytes)
        took.append(time.perf_counter() - t)
        time.sleep(0.001)
    stop.set()
    if mode != "alone":
        thread.join()
    took.sort()
    return took[len(took) // 2] * 1e3, took[int(len(took) * 0.99)] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=int, default=300, help="Python loop iterations per look (default 300, ~10 us)")
    parser.add_argument("--rest-us", type=float, default=20.0, help="the rest variant's GIL-free spin (default 20)")
    parser.add_argument("--ops", type=int, default=300, help="ops timed per variant (default 300)")
    args = parser.parse_args()
    if sync.spin_pending is None:
        raise SystemExit("kalos.ipc._fence is not built here (pip install -e . builds it)")
    for mode in ("alone", "yield", "rest", "sleep"):
        p50, p99 = run(mode, args.work, args.rest_us, args.ops)
        print(f"{mode:6s} 20 GIL releases: p50 {p50:.3f} ms, p99 {p99:.3f} ms")


if __name__ == "__main__":
    main()
