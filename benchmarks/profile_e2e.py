"""Where the host time of one end-to-end recall goes: py-spy on the sidecar and on the client.

    PYTHONPATH=src python3 benchmarks/profile_e2e.py --device cuda --out $OUT

Builds a store of N random unit rows, starts ``kalos serve`` on it, and runs a recall loop
(k=8, ``--batch`` queries per call) from this process for ``--seconds`` while two py-spy processes
sample the sidecar and this client (non-blocking, so the loop keeps its pace). Writes the
collapsed stacks to $OUT/{sidecar,client}.txt and prints the top self-time lines of each and
the loop's own p50/p99.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from kalos import Client
from kalos.launcher import SidecarProcess
from kalos.store import Store


def top_frames(path: Path, limit: int = 25) -> None:
    """Self time per innermost frame, and inclusive time per frame, from py-spy's raw output."""
    self_t: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_t[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    print(f"\n== {path.name}: {total} samples; self time ==")
    for frame, n in self_t.most_common(limit):
        print(f"{100 * n / total:6.1f}%  {frame}")
    print(f"== {path.name}: inclusive ==")
    for frame, n in incl.most_common(limit + 15):
        print(f"{100 * n / total:6.1f}%  {frame}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--extra", default="", help="extra arguments for kalos serve")
    ap.add_argument("--batch", type=int, default=1, help="queries per call (recall_many above 1)")
    args = ap.parse_args()
    out = Path(args.out)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "s.db"
        with Store.open(store, dim=args.dim) as s:
            for lo in range(0, args.n, 65536):
                x = rng.standard_normal((min(65536, args.n - lo), args.dim)).astype(np.float32)
                s.add(x / np.linalg.norm(x, axis=1, keepdims=True), namespace="default")
        queries = rng.standard_normal((256, args.dim)).astype(np.float32)
        with SidecarProcess(store, name="prof", device=args.device, extra_args=args.extra.split(),
                            ready_timeout=600) as sidecar, Client("prof") as client:
            print(sidecar.ready_line, flush=True)
            b = args.batch

            def call(i: int) -> None:
                if b == 1:
                    client.recall(queries[i % 256], k=8)
                else:
                    client.recall_many(queries[(i * b) % 256 : (i * b) % 256 + b], k=8)

            for i in range(300):
                call(i)
            spies = [
                subprocess.Popen(["py-spy", "record", "--nonblocking", "-r", str(args.rate), "-d", str(int(args.seconds)),
                                  "-f", "raw", "-o", str(out / f"{who}.txt"), "--pid", str(pid)],
                                 stdout=subprocess.DEVNULL, stderr=open(out / f"{who}.err", "w"))
                for who, pid in (("sidecar", sidecar.process.pid), ("client", os.getpid()))
            ]
            time.sleep(0.5)
            lat = []
            end = time.monotonic() + args.seconds - 1.0
            i = 0
            while time.monotonic() < end:
                a = time.perf_counter()
                call(i)
                lat.append((time.perf_counter() - a) * 1e6)
                i += 1
            for spy in spies:
                spy.wait(timeout=60)
            stats = client.stats()
    print(f"recall p50 {np.median(lat):.1f} us, p99 {np.percentile(lat, 99):.1f} us over {len(lat)} calls; "
          f"sidecar service p50 {stats['service_p50_us']} us")
    for who in ("sidecar", "client"):
        path = out / f"{who}.txt"
        if path.exists():
            top_frames(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
