"""What ``Client.recall`` costs the client process by itself: a CPU sidecar on a tiny store
answers for real first, then the channel's wait (and its submit) are replaced by fakes that
answer at once, so what is left is the client's own Python (validation, the slot writes, the
fences, reading the hits back).

    PYTHONPATH=src python3 benchmarks/client_cost.py
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import timeit
from typing import Callable

import numpy as np

from kalos.client.client import Client
from kalos.client.results import Recall
from kalos.ipc.sync import full_fence


def timed(fn, n: int = 20000) -> tuple[float, float]:
    """p50 / p99 in us of ``n`` calls after 2,000 warm-up ones."""
    for _ in range(2000):
        fn()
    ts = np.empty(n)
    for i in range(n):
        a = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - a
    return float(np.percentile(ts, 50) * 1e6), float(np.percentile(ts, 99) * 1e6)


def exchange_only(channel) -> Callable[[], Recall]:
    """The slot exchange of a single recall and nothing else (the query row in, the two fences
    around req_seq, a spin on resp_seq, the hits out): the floor under Client.recall's own
    Python, against the same answerer."""
    slot = channel.slot
    row, ids, scores = slot.queries[0], slot.ids[0], slot.scores[0]
    req, resp, q = slot.req_seq, slot.resp_seq, row.copy()
    seq = [int(req[0])]

    def exchange() -> Recall:
        row[:] = q
        seq[0] += 1
        full_fence()
        req[0] = seq[0]
        full_fence()
        while resp[0] != seq[0]:
            pass
        full_fence()
        return Recall(ids[:8].copy(), scores[:8].copy())

    return exchange


def instant(sidecar_pid: int, client: Client, q: np.ndarray) -> tuple[tuple[float, float], tuple[float, float]]:
    """A recall's round trip against an answerer that answers at once, and the bare slot
    exchange's (:func:`exchange_only`): the sidecar is paused (SIGSTOP) and a forked child,
    which shares the client's mapping of the segment, spins on the slot and answers each request
    with the hits already in it. What is left is the client's own cost, its wait's looks
    included, and the two cores' exchange of the slot's cache lines."""
    client.recall(q, 8)  # the slot holds a real answer to hand out again
    channel = client._connection().channel
    slot = channel.slot
    os.kill(sidecar_pid, signal.SIGSTOP)
    child = os.fork()
    if child == 0:  # the answerer: nothing but the words a sidecar writes
        try:
            req, resp, status = slot.req_seq, slot.resp_seq, slot.status
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                seq = req[0]
                if seq != resp[0]:
                    status[0] = 0
                    full_fence()
                    resp[0] = seq
        finally:
            os._exit(0)
    try:
        recall = timed(lambda: client.recall(q, 8))
        exchange = exchange_only(channel)
        floor = timed(exchange)
        channel.resync()  # (the exchange numbered requests behind the channel's back)
        return recall, floor
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.kill(sidecar_pid, signal.SIGCONT)


def crowd_checks() -> tuple[float, float]:
    """What the crowd benchmark's client (kalos.tools.crowd) adds to each recall to check its
    answer, best of five in us: checked there and then (ids as a set, scores by numpy; before
    ea9ff64), and kept in arrays to be checked after the crowd (since)."""
    rng = np.random.default_rng(2)
    hits = Recall(rng.permutation(1000)[:8].astype(np.int64), rng.random(8).astype(np.float32))
    ref_set, ref_scores = set(hits.ids.tolist()), hits.scores.astype(np.float64)
    kept_ids, kept_scores = np.empty((1000, 8), np.int64), np.empty((1000, 8), np.float32)

    def inline() -> bool:
        return set(hits.ids.tolist()) != ref_set or not np.abs(hits.scores - ref_scores).max() <= 1e-4

    def kept() -> None:
        kept_ids[5, :8] = hits.ids
        kept_scores[5, :8] = hits.scores

    return tuple(min(timeit.repeat(fn, number=20000, repeat=5)) / 20000 * 1e6 for fn in (inline, kept))


def main() -> int:
    name = f"client-cost-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "kalos", "serve", "--name", name, "--device", "cpu", "--dim", "1024",
             "--store", os.path.join(tmp, "store.db")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            client = None
            for _ in range(300):
                try:
                    client = Client(name)
                    client.dim
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.05)
            if client is None:
                raise SystemExit("the sidecar did not start")
            rng = np.random.default_rng(1)
            client.add(rng.standard_normal((64, 1024)).astype(np.float32), texts=[str(i) for i in range(64)])
            q = rng.standard_normal(1024).astype(np.float32)
            print("ping, real                        p50 %.2f us  p99 %.2f us" % timed(client.ping))
            print("recall k=8, real                  p50 %.2f us  p99 %.2f us" % timed(lambda: client.recall(q, 8)))
            print("crowd's answer check: between recalls %.2f us, kept for after the crowd %.2f us" % crowd_checks())
            channel = client._connection().channel
            slot = channel.slot
            recall, floor = instant(sidecar.pid, client, q)
            print("recall k=8, instant answerer       p50 %.2f us  p99 %.2f us" % recall)
            print("slot exchange only, same answerer  p50 %.2f us  p99 %.2f us" % floor)

            def answered_at_once(seq: int) -> int:
                slot.resp_seq[0] = seq
                return 0

            channel.wait = answered_at_once
            print("recall k=8, wait faked            p50 %.2f us  p99 %.2f us" % timed(lambda: client.recall(q, 8)))

            def submitted_at_once() -> int:
                channel._seq += 1
                return channel._seq

            channel.submit = submitted_at_once
            print("recall k=8, submit and wait faked p50 %.2f us  p99 %.2f us" % timed(lambda: client.recall(q, 8)))
        finally:
            sidecar.terminate()
            sidecar.wait()
    return 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", "")).parse_args()
    raise SystemExit(main())
