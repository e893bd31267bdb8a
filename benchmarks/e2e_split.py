"""Where an end-to-end single recall's time goes outside the GPU: a sidecar process with the
GPU polling server, and this process as its client, timing the same recall four ways:

* ``client``: ``Client.recall`` back to back (what ``kalos bench`` reports);
* ``client, gap``: the same, ``--gap-us`` apart (the server's next round is waiting already);
* ``raw slot``: the query written into the client's slot, ``submit``, spin on ``resp_seq``:
  the channel without the client's Python around it (validation, request words, reading the
  hits back);
* ``raw slot, gap``.

``client`` minus ``raw slot`` is the client's Python; ``raw slot`` against the in-process
round trip of ``diagnostics.py slot-server`` is what a second process costs; ``gap`` against
back to back is what pacing costs (a request landing before the next round waits for it).

    PYTHONPATH=src python3 benchmarks/e2e_split.py --n 65536 --dim 1024 --repeats 2000
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kalos.client.client import Client
from kalos.server.launcher import SidecarProcess
from kalos.store.sqlite import Store


def spin_for(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def timed(call, repeats: int, gap_s: float) -> np.ndarray:
    """Per-call wall time (us) of ``call(i)`` after 200 untimed calls, ``gap_s`` apart."""
    samples = []
    clock = time.perf_counter
    for i in range(repeats + 200):
        if gap_s:
            spin_for(gap_s)
        t = clock()
        call(i)
        samples.append(clock() - t)
    return np.array(samples[200:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=65536,
                    help="rows in the store (random unit vectors) (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    ap.add_argument("--k", type=int, default=8, help="k of every recall (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2000,
                    help="timed recalls per way, after 200 untimed ones (default: %(default)s)")
    ap.add_argument("--gap-us", type=float, default=200,
                    help="the gap ways' pause between recalls, in microseconds (default: %(default)s)")
    ap.add_argument("--precisions", default="exact,fast",
                    help="the sidecar's --precision, one sidecar each, comma-separated: exact, fast "
                    "(default: %(default)s)")
    ap.add_argument("--polling", default="graph",
                    help="the sidecar's --gpu-polling: graph or off (default: %(default)s)")
    ap.add_argument("--device", default="cuda", help="the sidecar's --device (default: %(default)s)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the table's rows to FILE as JSON")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    queries = rng.standard_normal((512, args.dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    table = []
    with tempfile.TemporaryDirectory(prefix="kalos-e2e-split-") as tmp:
        store = Path(tmp) / "store.db"
        with Store.open(store, dim=args.dim) as s:
            for lo in range(0, args.n, 65536):
                s.add(x[lo : lo + 65536], namespace="default")
        for precision in args.precisions.split(","):
            name = f"split-{os.getpid()}-{precision}"
            extra = ["--precision", precision, "--gpu-polling", args.polling, "--slots", "32"]
            with SidecarProcess(store, name=name, device=args.device, extra_args=extra, ready_timeout=600) as sidecar, \
                    Client(name) as client:
                print(f"  {sidecar.ready_line}", flush=True)
                client.recall(queries[0], k=args.k)  # the request words are now in the slot
                channel = client._connection().channel
                slot = channel.slot

                def raw(i: int) -> None:
                    slot.queries[0] = queries[i % 512]
                    seq = channel.submit()
                    while slot.resp_seq[0] != seq:
                        pass

                def recall(i: int) -> None:
                    client.recall(queries[i % 512], k=args.k)

                row = {"precision": precision, "polling": args.polling}
                for label, call, gap in (("client", recall, 0), ("raw slot", raw, 0),
                                         ("client, gap", recall, args.gap_us), ("raw slot, gap", raw, args.gap_us)):
                    lat = timed(call, args.repeats, gap / 1e6)
                    row[label] = (round(float(np.percentile(lat, 50)), 1), round(float(np.percentile(lat, 99)), 1))
                    print(f"  {precision} {label}: p50 {row[label][0]} us, p99 {row[label][1]} us", flush=True)
                expected = np.argsort(-(x @ queries[7]))[: args.k] + 1
                got = client.recall(queries[7], k=args.k).ids
                row["top_k_matches"] = bool(np.array_equal(np.sort(got), np.sort(expected)))
                stats = client.stats()
                row["gpu_polled"] = stats.get("gpu_polled", 0)
                table.append(row)
    print(f"\nend to end split, N={args.n:,} dim={args.dim} k={args.k}, --gpu-polling {args.polling}, "
          f"gap {args.gap_us:g} us (p50 / p99 us)")
    print(f"{'precision':<9} {'client':>14} {'raw slot':>14} {'client, gap':>14} {'raw slot, gap':>14} {'ok':>3}")
    for r in table:
        cells = " ".join(f"{r[c][0]:>6} / {r[c][1]:<5}" for c in ("client", "raw slot", "client, gap", "raw slot, gap"))
        print(f"{r['precision']:<9} {cells} {'yes' if r['top_k_matches'] else 'NO':>3}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
