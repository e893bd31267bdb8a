"""Suite 1 — crash: kill -9 the sidecar at random moments under load, many times, and restart it.

Workload: writer processes (adds of 1-40 rows with texts and metadata, deletes of their own
acknowledged items) and recaller processes (single and batched recalls, many aimed at what the
writers touch right now), each with one Client for the whole test and a 1 s timeout.
Fault: after a random 0.05-1.2 s of load, SIGKILL of the sidecar; the store is read (readonly)
while it is dead; a new sidecar starts on the same store and name.
Oracle (see reliability._support):

* every call returns or raises SidecarUnavailable, and one that raises does so within
  2 x timeout + slack (connect once, ask once); no other exception, no hang;
* every client recovers by itself (no new Client) after every restart;
* every snapshot: integrity_check "ok"; each add acknowledged before the kill present in full;
  every row complete and from an add invoked before the kill; unacknowledged adds and deletes
  all-or-nothing; deleted items never back;
* every recall answer is the top-k of a state the store could have been in during the call;
* the sidecars' logs hold no traceback, and the slots of the clients are all freed at the end.
"""
from __future__ import annotations

import time

import numpy as np
from conftest import DEADLINE_S, _seed_value, unique_name, wait_until

from kalos import Client
from reliability._support import (
    BASE_CLIENT,
    AddOp,
    History,
    Workload,
    check_recalls,
    parse_records,
    read_store,
    recaller,
    succeeded,
    tracebacks,
    writer,
)

TIMEOUT = 1.0
SLACK = 10.0  # scheduling on a shared 2-core machine; a hang is anything past this


def test_kill9_sidecar_under_load_loses_nothing_acknowledged(sidecars, children, store_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    rng = np.random.default_rng(seed)
    kills = scale(6, 100)
    n_writers, n_recallers = scale((2, 3), (3, 5))
    name = unique_name("crash")
    store = store_dir / "crash.db"
    w = Workload(seed)
    procs = [sidecars.start(store, name=name, dim=w.dim)]

    base_n = 300
    vectors, texts, metadata = w.batch(BASE_CLIENT, 0, base_n)
    with Client(name, timeout=30.0) as loader:
        t0 = time.monotonic()
        base_ids = loader.add(vectors, texts=texts, metadata=metadata, namespace="default").tolist()
        base = AddOp(BASE_CLIENT, 0, t0, time.monotonic(), True, base_ids, base_n)

    ctx = children.ctx
    stop = children.event()
    out = children.queue()
    n_clients = n_writers + n_recallers
    progress = ctx.Array("d", n_clients, lock=False)
    wprogress = ctx.Array("l", n_writers, lock=False)
    writers = list(range(n_writers))
    for c in writers:
        children.start(writer, name, seed, c, TIMEOUT, stop, progress, wprogress, out, 10**9)
    for c in range(n_writers, n_clients):
        children.start(recaller, name, seed, c, TIMEOUT, stop, progress, wprogress, writers, out, 10**9, [None])

    def all_progressed_since(t: float) -> bool:
        return all(progress[c] > t for c in range(n_clients))

    started = time.monotonic()
    wait_until(lambda: all_progressed_since(started), "every client's first answer", timeout=DEADLINE_S * 2)
    snapshots = []
    for cycle in range(kills):
        time.sleep(float(rng.uniform(0.05, 1.2)))
        procs[-1].kill()  # SIGKILL and reap: dead from here on
        t_kill = time.monotonic()
        snapshots.append(read_store(store, t=t_kill, label=f"after kill {cycle + 1}"))
        procs.append(sidecars.start(store, name=name))
        restarted = time.monotonic()
        wait_until(lambda: all_progressed_since(restarted), f"every client to recover after kill {cycle + 1}",
                   timeout=DEADLINE_S)
    time.sleep(0.3)
    stop.set()

    records: list[tuple] = []
    errors = []
    for _ in range(n_clients):
        msg = out.get(timeout=DEADLINE_S * 2)
        if msg[0] == "error":
            errors.append(msg[2])
        else:
            records.extend(msg[2])
    assert not errors, errors[0]
    with Client(name, timeout=30.0) as observer:
        # Every worker closed its client: only the observer's slot is still taken.
        wait_until(lambda: observer.stats()["clients"] == 1, "the workers' slots to be freed", timeout=30)
    procs[-1].stop()
    snapshots.append(read_store(store, label="after the last, clean stop"))

    adds, deletes, recalls, unexpected = parse_records(records)
    assert not unexpected, f"calls that raised something other than SidecarUnavailable: {unexpected[:5]}"
    adds.append(base)
    calls = adds[:-1] + deletes + recalls
    failures = [c for c in calls if not succeeded(c)]
    slow = [(type(c).__name__, c.client, c.op, round(c.t1 - c.t0, 2)) for c in failures
            if c.t1 - c.t0 > 2 * TIMEOUT + SLACK]
    assert not slow, f"calls that took longer than 2 x timeout + {SLACK} s to fail: {slow[:10]}"

    history = History(w, adds, deletes, snapshots)
    history.check_snapshots()
    assert not history.problems, "\n".join(history.problems[:20])
    verdict = check_recalls(history.item_table(), recalls)
    assert not verdict.mismatches, "\n".join(verdict.mismatches[:10])
    for i, proc in enumerate(procs):
        found = tracebacks(proc.log())
        assert not found, f"sidecar incarnation {i}: {found[0]}"

    print(f"RELIABILITY crash: kills={kills} calls={len(calls)} failed_fast={len(failures)} recalls_answered={verdict.recalls} "
          f"recall_rows_checked={verdict.rows} "
          f"mismatches={len(verdict.mismatches)} cross_delivered={verdict.cross_delivered} "
          f"snapshots={history.stats['snapshots']} rows_checked={history.stats['rows_checked']} "
          f"acked_adds={history.stats['acked_adds']} unacked_adds={history.stats['unacked_adds']} "
          f"(committed anyway: {history.stats['unacked_adds_committed']}) acked_deletes={history.stats['acked_deletes']} "
          f"unacked_deletes={history.stats['unacked_deletes']} longest_failure_s="
          f"{max([c.t1 - c.t0 for c in failures] or [0]):.2f}")
