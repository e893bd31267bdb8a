"""The seed article's handshake against `kalos serve --seed-compat`, beside the main channel.

    python benchmarks/seed_compat_e2e.py --device cuda --n 65536 --dim 1024 --requests 3000

Builds the article's C client (tests/seed_client.c) with the system compiler, fills a store
with N random unit vectors, starts `kalos serve --seed-compat` on it, and measures in one run:
the article's client (its ready/done handshake, top-8, as published) and the Kalos client
(`Client.recall`, k=8, through its own slot) against the same sidecar. Latencies are the
clients' own wall-clock per request; p50/p99 over all requests after a warm-up.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kalos.client.client import Client  # noqa: E402
from kalos.server.launcher import SidecarProcess  # noqa: E402
from kalos.store.sqlite import Store  # noqa: E402
from kalos.tools.bench import percentiles, time_calls  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu",
                    help="the sidecar's --device: cpu, cuda or cuda:N (default: %(default)s)")
    ap.add_argument("--n", type=int, default=65536,
                    help="rows in the store (random unit vectors) (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=3000,
                    help="recalls per client, k=8, with a warm-up of about 100 not counted (default: %(default)s)")
    args = ap.parse_args()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("no C compiler: the article's client cannot be built")
    with tempfile.TemporaryDirectory(prefix="kalos-seed-bench-") as tmp:
        binary = Path(tmp) / "seed_client"
        subprocess.run([cc, "-O2", "-std=c11", f"-I{ROOT / 'tests'}", "-o", str(binary),
                        str(ROOT / "tests" / "seed_client.c"), "-lm", "-lrt"], check=True)
        rng = np.random.default_rng(11)
        store = Path(tmp) / "store.db"
        with Store.open(store, dim=args.dim) as s:
            for lo in range(0, args.n, 65536):
                m = rng.standard_normal((min(65536, args.n - lo), args.dim), dtype=np.float32)
                s.add(m / np.linalg.norm(m, axis=1, keepdims=True), namespace="default")
        shm = f"/kalos_seed_bench_{os.getpid()}"
        name = f"seedbench{os.getpid()}"
        extra = ["--seed-compat", "--seed-compat-shm", shm]
        try:
            with SidecarProcess(store, name=name, device=args.device, extra_args=extra, ready_timeout=600) as sc:
                print(sc.ready_line, flush=True)
                out = subprocess.run([str(binary), str(args.requests), "7", str(args.dim), shm],
                                     capture_output=True, text=True, timeout=900, check=True).stdout
                seed_ns = np.array([int(line.split()[2]) for line in out.splitlines()], dtype=np.float64)
                seed = percentiles(seed_ns[min(100, len(seed_ns) // 10):] / 1e9)
                queries = rng.standard_normal((512, args.dim), dtype=np.float32)
                with Client(name) as client:
                    main_channel = percentiles(time_calls(lambda i: client.recall(queries[i % 512], k=8),
                                                          args.requests, 100))
                    stats = client.stats()
        finally:
            try:
                os.unlink(f"/dev/shm{shm}")
            except FileNotFoundError:
                pass
    print(f"\nN={args.n:,} dim={args.dim} k=8 float32, device {args.device}, {os.cpu_count()} CPUs")
    print(f"{'path':<58} {'p50 us':>9} {'p99 us':>9}")
    print(f"{'article C client, ready/done handshake (--seed-compat)':<58} {seed['p50_us']:>9.1f} {seed['p99_us']:>9.1f}")
    print(f"{'Kalos Client.recall, own slot (main channel)':<58} {main_channel['p50_us']:>9.1f} {main_channel['p99_us']:>9.1f}")
    print(f"seed-compat counters: {stats['seed_compat']}")


if __name__ == "__main__":
    main()
