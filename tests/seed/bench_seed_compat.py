"""Latency of the seed article's handshake against kalos.server.seed_compat, with the article's C client.

    PYTHONPATH=src python tests/seed/bench_seed_compat.py --n 4096 --dim 1024 --requests 10000

Starts a SeedCompatServer (in this process, a thread, as the sidecar runs it) over a NumpyEngine
of N random unit vectors, builds tests/seed_client.c, and measures:

* hot: the client's end-to-end time per request (query write -> done == 1), back to back;
* search alone: the engine's search for the same k, timed in-process (what the handshake adds
  is the difference);
* cold pick-up: requests spaced ~--gap-ms apart (randomised), so the server has stopped
  spinning and sleeps at its 1 ms back-off; cold e2e minus the hot median is the pick-up delay;
* deep cold pick-up: the same with gaps past the server's 1 s switch to 2 ms sleeps;
* idle CPU: the server thread's CPU time with no client, in the first second of idle and
  over --idle-s seconds after it.

--blas-threads sets OPENBLAS_NUM_THREADS/OMP_NUM_THREADS before NumPy loads (0: leave as is).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096, help="live memories in the store")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--requests", type=int, default=10000, help="back-to-back requests (hot)")
    p.add_argument("--cold-requests", type=int, default=200, help="requests spaced --gap-ms apart")
    p.add_argument("--gap-ms", type=float, default=20.0)
    p.add_argument("--deep-requests", type=int, default=20, help="requests spaced --deep-gap-ms apart")
    p.add_argument("--deep-gap-ms", type=float, default=1500.0, help="past the server's 1 s deep-idle switch")
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--spin-us", type=float, default=2000.0)
    p.add_argument("--blas-threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=12345)
    return p.parse_args()


def main() -> None:
    args = _args()
    if args.blas_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.blas_threads)
    import subprocess

    import numpy as np

    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from kalos.engine import NumpyEngine, as_unit_rows
    from kalos.server.seed_compat import SeedCompatServer, unlink_segment

    cc = os.environ.get("CC", "cc")
    tmp = Path(tempfile.mkdtemp(prefix="kalos-seed-bench-"))
    client = tmp / "seed_client"
    subprocess.run([cc, "-O2", "-std=c11", f"-I{HERE.parent}", "-o", str(client),
                    str(HERE.parent / "seed_client.c"), "-lm", "-lrt"], check=True)

    rng = np.random.default_rng(args.seed)
    engine = NumpyEngine(args.dim, capacity=args.n)
    for start in range(0, args.n, 8192):
        stop = min(args.n, start + 8192)
        engine.add(1000 + np.arange(start, stop), as_unit_rows(rng.standard_normal((stop - start, args.dim))), 0, 0.0)
    lock = threading.Lock()
    search_ns: list[int] = []  # the duration of every search the server makes, in order

    def search(q, k):
        with lock:
            return engine.search(q, k)

    def timed_search(q, k):
        t0 = time.perf_counter_ns()
        try:
            return search(q, k)
        finally:
            search_ns.append(time.perf_counter_ns() - t0)

    q = as_unit_rows(rng.standard_normal((1, args.dim)))
    for _ in range(20):
        search(q, 8)
    t_search = []
    for _ in range(min(1000, max(50, args.requests // 10))):
        q = as_unit_rows(rng.standard_normal((1, args.dim)))
        t0 = time.perf_counter_ns()
        search(q, 8)
        t_search.append(time.perf_counter_ns() - t0)

    name = f"/kalos_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    srv = SeedCompatServer(search=timed_search, dim=args.dim, shm_name=name, spin_us=args.spin_us)
    srv.start()

    def run(n: int, *extra: str) -> tuple[np.ndarray, np.ndarray]:
        """(client e2e, server search) per request, in us."""
        first = len(search_ns)
        out = subprocess.run([str(client), str(n), str(args.seed), str(args.dim), name, *extra],
                             check=True, capture_output=True, text=True).stdout
        rows = [line.split() for line in out.splitlines()]
        assert all(int(r[1]) == 8 for r in rows)
        e2e = np.array([int(r[2]) for r in rows], dtype=np.float64) / 1e3
        return e2e, np.array(search_ns[first:], dtype=np.float64) / 1e3

    def pct(a: np.ndarray) -> str:
        return (f"p50 {np.percentile(a, 50):8.1f} us  p99 {np.percentile(a, 99):8.1f} us  "
                f"mean {a.mean():8.1f} us  max {a.max():8.1f} us  (n={len(a)})")

    try:
        run(min(200, args.requests))  # warm-up (also lets the server attach)
        hot = run(args.requests)
        cold = run(args.cold_requests, "--gap-us", str(int(args.gap_ms * 1000)))
        deep = run(args.deep_requests, "--gap-us", str(int(args.deep_gap_ms * 1000))) if args.deep_requests else None
        tid = srv._thread.ident
        clock = time.pthread_getcpuclockid(tid)
        time.sleep(0.05)  # let the last spin phase end
        c0, w0 = time.clock_gettime(clock), time.monotonic()
        time.sleep(0.9)  # the first second of idle: sleeps capped at 1 ms
        c1, w1 = time.clock_gettime(clock), time.monotonic()
        time.sleep(0.2)
        c2, w2 = time.clock_gettime(clock), time.monotonic()
        time.sleep(args.idle_s)  # deep idle: sleeps capped at 2 ms
        c3, w3 = time.clock_gettime(clock), time.monotonic()
    finally:
        srv.stop()
        unlink_segment(name)
    search_us = np.array(t_search, dtype=np.float64) / 1e3
    # What the handshake costs beyond the search when hot (write, pick-up, results, done);
    # pick-up after idle = e2e - that request's own search - the hot overhead. Subtracting each
    # request's measured search keeps a cold cache or parked BLAS threads out of the pick-up.
    hot, hot_search = hot
    overhead = np.percentile(hot - hot_search, 50)
    cold, cold_search = cold
    pickup = cold - cold_search - overhead
    print(f"store N={args.n} D={args.dim}, k=8, spin_us={args.spin_us}, blas_threads={args.blas_threads or 'default'}, "
          f"cpus={os.cpu_count()}, load avg {os.getloadavg()[0]:.2f}")
    print(f"hot handshake e2e          {pct(hot)}")
    print(f"  server's search (same)   {pct(hot_search)}")
    print(f"  e2e - search             {pct(hot - hot_search)}")
    print(f"search alone (no client)   {pct(search_us)}")
    print(f"cold e2e, gap ~{args.gap_ms:g} ms     {pct(cold)}")
    print(f"  server's search (same)   {pct(cold_search)}")
    print(f"  pick-up delay            {pct(pickup)}   (e2e - search - hot overhead p50)")
    if deep is not None:
        deep, deep_search = deep
        print(f"cold e2e, gap ~{args.deep_gap_ms:g} ms   {pct(deep)}")
        print(f"  server's search (same)   {pct(deep_search)}")
        print(f"  pick-up delay            {pct(deep - deep_search - overhead)}")
    print(f"idle server thread CPU   {100 * (c1 - c0) / (w1 - w0):.2f} % of one core in the first second of idle, "
          f"{100 * (c3 - c2) / (w3 - w2):.2f} % after ({w3 - w2:.1f} s)")
    print(f"server stats {srv.stats}")


if __name__ == "__main__":
    main()
