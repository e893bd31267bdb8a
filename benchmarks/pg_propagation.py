"""PostgreSQL as the shared store: cross-sidecar propagation delay, and sidecar start time.

Starts its own PostgreSQL server (tests/pg_server.py: Debian's binaries, loopback port,
durable settings: fsync and synchronous_commit on, as a real deployment) and measures:

1. propagation: two sidecars ("hosts" A and B) on one database; a client adds ONE item via A
   and spins recall on B (the item's own vector, k=1) until the id appears. The delay is from
   the add call to the first recall on B that returns the id. Side by side: the raw PostgreSQL
   NOTIFY round trip (a committed NOTIFY on one connection until a LISTENing connection
   receives it: the floor of any NOTIFY-driven follower), and the same-sidecar add -> recall
   (add via A, then recall via A: the add's own acknowledgement latency).
2. start: sidecar start (process spawn to ready line, and the engine load the ready line
   reports) for N items of dim D loaded from PostgreSQL, beside the same data in the SQLite
   store, plus each sidecar's peak RSS (VmHWM) against the engine's own bytes.

    PYTHONPATH=src:tests python benchmarks/pg_propagation.py --adds 500 --n 1000000 --dim 384

Prints a Markdown table and writes --json FILE if asked.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import psycopg  # noqa: E402
from pg_server import PgServer  # noqa: E402

from kalos import Client  # noqa: E402
from kalos.server.launcher import SidecarProcess  # noqa: E402
from kalos.store.postgres import PostgresStore  # noqa: E402
from kalos.store.sqlite import Store  # noqa: E402


def pct(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def notify_round_trip(url: str, repeats: int) -> list[float]:
    out = []
    with psycopg.connect(url, autocommit=True) as listener, psycopg.connect(url, autocommit=True) as sender:
        listener.execute("LISTEN kalos_bench")
        for i in range(repeats):
            t0 = time.perf_counter()
            sender.execute("SELECT pg_notify('kalos_bench', %s)", (str(i),))
            for _ in listener.notifies(timeout=10, stop_after=1):
                pass
            out.append(time.perf_counter() - t0)
    return out


def propagation(url: str, dim: int, adds: int, rng: np.random.Generator, pause_s: float = 0.0) -> dict[str, list[float]]:
    a = SidecarProcess(url, name=f"bench-a-{os.getpid()}", dim=dim, device="cpu")
    b = SidecarProcess(url, name=f"bench-b-{os.getpid()}", dim=dim, device="cpu")
    try:
        with Client(f"bench-a-{os.getpid()}") as ca, Client(f"bench-b-{os.getpid()}") as cb:
            # Some background items, so that k=1 has something to beat.
            ids = ca.add(unit(rng, 1000, dim), namespace="bench")
            deadline = time.monotonic() + 60
            while int(cb.stats()["count"]) < len(ids):
                assert time.monotonic() < deadline, "B never saw the background items"
                time.sleep(0.01)
            same, cross, after_ack = [], [], []
            for _ in range(adds):
                v = unit(rng, 1, dim)
                t0 = time.perf_counter()
                new = int(ca.add(v, namespace="bench")[0])
                acked = time.perf_counter()
                assert int(ca.recall(v[0], k=1, namespace="bench").ids[0]) == new
                same.append(time.perf_counter() - t0)
                while int(cb.recall(v[0], k=1, namespace="bench").ids[0]) != new:
                    if time.perf_counter() - t0 > 30:
                        raise RuntimeError(f"id {new} did not reach B within 30 s")
                    if pause_s:
                        time.sleep(pause_s)
                done = time.perf_counter()
                cross.append(done - t0)
                after_ack.append(done - acked)
            del ids
        return {"same": same, "cross": cross, "after_ack": after_ack}
    finally:
        a.stop()
        b.stop()


def populate(url: str, sqlite_path: Path, n: int, dim: int, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    batch = 20000
    t_pg = t_lite = 0.0
    with PostgresStore.open(url, dim=dim) as pgs, Store.open(sqlite_path, dim=dim) as lite:
        for start in range(0, n, batch):
            m = min(batch, n - start)
            v = unit(rng, m, dim)
            ns = f"ns{(start // batch) % 4}"
            t0 = time.perf_counter()
            pgs.add(v, namespace=ns, created_at=1.7e9 + start)
            t1 = time.perf_counter()
            lite.add(v, namespace=ns, created_at=1.7e9 + start)
            t2 = time.perf_counter()
            t_pg += t1 - t0
            t_lite += t2 - t1
            print(f"\r  populated {start + m:,}/{n:,}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return t_pg, t_lite


def vm_hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_time(store: str, dim: int, repeats: int) -> dict[str, list[float]]:
    spawn, load, rss = [], [], []
    for r in range(repeats):
        name = f"bench-s-{os.getpid()}-{r}"
        t0 = time.perf_counter()
        proc = SidecarProcess(store, name=name, device="cpu", ready_timeout=900)
        spawn.append(time.perf_counter() - t0)
        # "... loaded in 12.34 s; ..."
        load.append(float(proc.ready_line.split("loaded in ")[1].split(" s")[0]))
        rss.append(vm_hwm_mib(proc.pid))
        proc.stop()
    return {"spawn": spawn, "load": load, "rss_mib": rss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adds", type=int, default=500, help="single-item adds timed (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=384, help="dimension (default: %(default)s)")
    parser.add_argument("--n", type=int, default=1_000_000, help="items for the start-time rows (default: %(default)s)")
    parser.add_argument("--starts", type=int, default=3, help="sidecar starts timed per store (default: %(default)s)")
    parser.add_argument("--skip-start", action="store_true", help="only the propagation rows")
    parser.add_argument("--poll-us", type=float, default=0.0,
                        help="pause between B's recalls while waiting for the id (default: 0, back to back)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the results to FILE as JSON")
    args = parser.parse_args()
    rng = np.random.default_rng(7)
    runtime = tempfile.mkdtemp(prefix="kb", dir="/tmp")
    os.environ["KALOS_RUNTIME_DIR"] = runtime
    server = PgServer(durable=True).init().start()
    results: dict = {"host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} vCPUs, "
                             f"Linux {platform.release()}", "dim": args.dim,
               "adds": args.adds, "poll_us": args.poll_us}
    try:
        url = server.url(server.create_database("bench"))
        notify = notify_round_trip(url, args.adds)
        prop = propagation(url, args.dim, args.adds, rng, args.poll_us / 1e6)
        results["propagation"] = {"notify_rtt": pct(notify), **{k: pct(v) for k, v in prop.items()}}
        print(f"\npropagation, {args.adds} single-item adds (dim {args.dim}), B polled every {args.poll_us:g} us, "
              "ms p50 / p99:")
        print(f"| PostgreSQL NOTIFY round trip (baseline) | {pct(notify)[0]:.2f} | {pct(notify)[1]:.2f} |")
        print(f"| same sidecar: add via A -> recallable via A | {pct(prop['same'])[0]:.2f} | {pct(prop['same'])[1]:.2f} |")
        print(f"| cross sidecar: add via A -> recallable via B | {pct(prop['cross'])[0]:.2f} | {pct(prop['cross'])[1]:.2f} |")
        print(f"| ... of which after A acknowledged the add | {pct(prop['after_ack'])[0]:.2f} | {pct(prop['after_ack'])[1]:.2f} |")
        if not args.skip_start:
            big = server.url(server.create_database("big"))
            lite_dir = Path(tempfile.mkdtemp(prefix="kbs", dir="/var/tmp"))
            lite = lite_dir / "big.db"
            t_pg, t_lite = populate(big, lite, args.n, args.dim, 11)
            results["populate_s"] = {"postgres": t_pg, "sqlite": t_lite}
            print(f"populated {args.n:,} x {args.dim}: PostgreSQL {t_pg:.1f} s, SQLite {t_lite:.1f} s")
            server.psql("VACUUM ANALYZE", big.rsplit("/", 1)[1])  # as a long-running database would be
            for label, store in (("postgres", big), ("sqlite", str(lite))):
                r = start_time(store, args.dim, args.starts)
                results[f"start_{label}"] = r
                print(f"| start from {label}: spawn->ready {np.median(r['spawn']):.2f} s (runs {r['spawn']}), "
                      f"load {np.median(r['load']):.2f} s, peak RSS {np.median(r['rss_mib']):,.0f} MiB |")
            shutil.rmtree(lite_dir, ignore_errors=True)
    finally:
        server.destroy()
        shutil.rmtree(runtime, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
