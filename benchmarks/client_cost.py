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

import numpy as np

from kalos.client.client import Client
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


def instant(sidecar_pid: int, slot, client: Client, q: np.ndarray) -> tuple[float, float]:
    """A recall's round trip against an answerer that answers at once: the sidecar is paused
    (SIGSTOP) and a forked child, which shares the client's mapping of the segment, spins on the
    slot and answers each request with the hits already in it. What is left is the client's
    own cost, its wait's looks included, and the two cores' exchange of the slot's cache lines."""
    client.recall(q, 8)  # the slot holds a real answer to hand out again
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
        return timed(lambda: client.recall(q, 8))
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.kill(sidecar_pid, signal.SIGCONT)


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
            channel = client._connection().channel
            slot = channel.slot
            print("recall k=8, instant answerer       p50 %.2f us  p99 %.2f us" % instant(sidecar.pid, slot, client, q))

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
