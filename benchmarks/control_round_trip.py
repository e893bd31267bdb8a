"""A control operation's round trip, with the client looking at its socket until the reply
comes (``ClientChannel.look_for_reply``, for as long as the sidecar advises its clients to spin)
against reading at once, which blocks until the reply wakes the reader (``Client(spin_us=0)``:
no spin anywhere, as every control operation waited before). One sidecar, both clients in one
process, connected one at a time (the sidecar's advice counts the connected clients), the
operations timed in alternating blocks:

* ``get 1``: one item with a 100-character text (near the floor of a control round trip);
* ``get 8``: eight of them (what ``recall_text`` sends back, and the get that follows a recall);
* ``count``: one SQLite count over the store's 4,096 rows.

    PYTHONPATH=src python3 benchmarks/control_round_trip.py [--device cuda] [--rounds 3000]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kalos.client.client import Client
from kalos.server.launcher import SidecarProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="the sidecar's device (default: cpu)")
    parser.add_argument("--rounds", type=int, default=3000, help="timed calls per operation and client")
    parser.add_argument("--blocks", type=int, default=6, help="alternations of the two clients")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kcrt", dir="/tmp"))
    os.environ["KALOS_RUNTIME_DIR"] = str(tmp / "run")
    sidecar = SidecarProcess(tmp / "crt.db", name="crt", dim=384, device=args.device)
    try:
        with Client("crt") as client:
            vectors = np.random.default_rng(7).standard_normal((4096, 384), dtype=np.float32)
            ids = client.add(vectors, texts=[f"memory {i}: " + "x" * 90 for i in range(4096)])
        one, eight = [int(ids[0])], [int(i) for i in ids[:8]]
        ops = {"get 1": lambda c: c.get(one), "get 8": lambda c: c.get(eight), "count": lambda c: c.count()}
        clients = {"spin": {}, "block": {"spin_us": 0}}
        times: dict[tuple[str, str], list[float]] = {}
        cpu: dict[tuple[str, str], list[float]] = {}  # the client process's CPU time per call
        per_block = max(1, args.rounds // args.blocks)
        looked_us = 0.0
        for block in range(args.blocks):
            for name, kwargs in clients.items():
                with Client("crt", **kwargs) as client:
                    if name == "spin":
                        looked_us = client._connection().channel.spin_budget_s() * 1e6
                    for label, op in ops.items():
                        for _ in range(200 if block == 0 else 20):  # warm-up
                            op(client)
                        out = times.setdefault((label, name), [])
                        used = cpu.setdefault((label, name), [])
                        for _ in range(per_block):
                            c = time.process_time()
                            t = time.perf_counter()
                            op(client)
                            out.append(time.perf_counter() - t)
                            used.append(time.process_time() - c)
        print(f"control round trips, sidecar on {args.device} ({os.cpu_count()} CPUs), {per_block * args.blocks} calls "
              f"per operation and client in {args.blocks} alternating blocks; the spinning client looks for up to "
              f"{looked_us:g} us")
        print("| operation | looks, then reads: p50 / p99 us | reads at once: p50 / p99 us | ratio of p50 | "
              "client CPU per call, mean us: looks / reads at once |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for label in ops:
            a = np.asarray(times[(label, "spin")]) * 1e6
            b = np.asarray(times[(label, "block")]) * 1e6
            ca, cb = (np.mean(cpu[(label, name)]) * 1e6 for name in ("spin", "block"))
            print(f"| {label} | {np.percentile(a, 50):.1f} / {np.percentile(a, 99):.1f} | "
                  f"{np.percentile(b, 50):.1f} / {np.percentile(b, 99):.1f} | {np.median(a) / np.median(b):.2f} | "
                  f"{ca:.1f} / {cb:.1f} |")
    finally:
        sidecar.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
