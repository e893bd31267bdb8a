"""Suite 2 — client death: kill -9 clients mid-request, mid-add, mid-hello and while holding slots.

Workload: two honest client processes recall without pause in a namespace nobody writes to,
each answer checked exactly against the float64 reference. Faults, round after round, each a
fresh victim process killed by SIGKILL a random 0-150 ms (adds: 0-250 ms) after it reports
being in place:

* ``recall-spin`` / ``recall-sleep``: in a loop of heavy recall_many (3 x max_batch rows,
  k = max_k), spinning on its slot or asleep on its doorbell;
* ``add``: in a loop of 3,000-row adds with texts and metadata (in place once one is acknowledged);
* ``idle``: connected, holding a slot, doing nothing;
* ``connect``: connecting and closing in a loop (killed mid-hello, mid-attach or mid-close);
* ``forked``: a client that forked (the child recalls through a slot of its own); both die;
* ``hello-vanish``: a raw client that asks for a slot and hangs up before reading the answer.

Oracle: after every round the sidecar's ``stats()["clients"]`` is back to the survivors (the
dead client's slot reclaimed); the honest clients never see a wrong answer or an error; every
add a victim started is in the store entirely or not at all, with the right contents; the
sidecar never logs a traceback and is alive at the end.
"""
from __future__ import annotations

import queue as queue_mod
import time

import numpy as np
from conftest import DEADLINE_S, _seed_value, unique_name, wait_until

from kalos import Client
from reliability._support import (
    BASE_CLIENT,
    Workload,
    hello_and_vanish,
    honest,
    kill9,
    parse_text,
    read_store,
    tracebacks,
    victim_add,
    victim_connect,
    victim_forked,
    victim_idle,
    victim_recall,
)

KINDS = ("recall-spin", "recall-sleep", "add", "idle", "connect", "forked", "hello-vanish")
ADD_ROWS = 3000


def test_killed_clients_free_their_slots_and_disturb_no_one(sidecars, children, store_dir, runtime_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    rng = np.random.default_rng(seed)
    rounds = scale(14, 140)
    w = Workload(seed)
    name = unique_name("cdeath")
    proc = sidecars.start(store_dir / "d.db", name=name, dim=w.dim, extra_args=["--slots", "10"])
    base_n = 3000
    vectors, texts, metadata = w.batch(BASE_CLIENT, 0, base_n)
    observer = Client(name, timeout=30.0)
    try:
        base_ids = observer.add(vectors, texts=texts, metadata=metadata, namespace="default")
        unit = w.unit(BASE_CLIENT, 0, base_n)
        out, stop = children.queue(), children.event()
        for i in range(2):
            children.start(honest, name, base_ids, unit, "default", seed + i, stop, out)
        for _ in range(2):
            msg = out.get(timeout=DEADLINE_S * 2)
            assert msg[0] == "warm", msg
        survivors = 3  # the observer and the two honest clients
        assert observer.stats()["clients"] == survivors

        killed: dict[str, int] = {kind: 0 for kind in KINDS}
        victim_client = 0
        for r in range(rounds):
            kind = KINDS[r % len(KINDS)]
            # A queue per victim: SIGKILL can catch a victim's queue feeder holding the queue's
            # shared write lock, which would silence every later victim on a shared queue.
            victims = children.queue()
            if kind == "hello-vanish":
                for _ in range(5):
                    hello_and_vanish(str(runtime_dir), name)
            else:
                if kind == "recall-spin":
                    p = children.start(victim_recall, name, seed + r, 1e6, victims)
                elif kind == "recall-sleep":
                    p = children.start(victim_recall, name, seed + r, 0.0, victims)
                elif kind == "add":
                    victim_client += 1
                    p = children.start(victim_add, name, seed, victim_client, ADD_ROWS, victims)
                elif kind == "idle":
                    p = children.start(victim_idle, name, victims)
                elif kind == "connect":
                    p = children.start(victim_connect, name, victims)
                else:
                    p = children.start(victim_forked, name, victims)
                try:
                    msg = victims.get(timeout=DEADLINE_S * 2)
                except queue_mod.Empty:
                    raise AssertionError(f"round {r}: the {kind} victim (alive: {p.is_alive()}) never got in place; "
                                         f"sidecar log tail: {proc.log()[-2000:]}") from None
                assert msg[0] == "warm", f"victim {kind}: {msg}"
                time.sleep(float(rng.uniform(0, 0.25 if kind == "add" else 0.15)))
                kill9(p.pid)
                if kind == "forked":
                    kill9(msg[2])
                p.join(timeout=DEADLINE_S)
            killed[kind] += 1
            wait_until(lambda: observer.stats()["clients"] == survivors,
                       f"round {r} ({kind}): the dead client's slot to be reclaimed", timeout=30)
            assert proc.process.poll() is None, f"the sidecar died in round {r} ({kind})"

        stop.set()
        answered = 0
        for _ in range(2):
            msg = out.get(timeout=DEADLINE_S * 2)
            assert msg[0] == "honest", msg
            assert not msg[3], "honest client saw wrong answers:\n" + "\n".join(msg[3][:5])
            answered += msg[2]
        wait_until(lambda: observer.stats()["clients"] == 1, "the honest clients' slots to be freed", timeout=30)
        stats = observer.stats()
    finally:
        observer.close()

    # Every add a victim started is in the store entirely, with its contents, or not at all.
    snap = read_store(store_dir / "d.db", label="end")
    assert snap.integrity == "ok", snap.integrity
    groups: dict[tuple[int, int], list[int]] = {}
    for item_id, row in snap.rows.items():
        origin = parse_text(row.text)
        assert origin is not None, f"row {item_id} has foreign text {row.text!r}"
        client, op, r = origin
        n = base_n if client == BASE_CLIENT else ADD_ROWS
        assert row.namespace == w.namespace(client) and row.metadata == w.metadata(client, op, r), row
        assert row.vector == w.unit(client, op, n)[r].tobytes(), f"{row.text}: torn vector"
        groups.setdefault((client, op), []).append(item_id)
    partial = {key: len(ids) for key, ids in groups.items() if len(ids) != (base_n if key[0] == BASE_CLIENT else ADD_ROWS)}
    assert not partial, f"adds present in part: {partial}"
    assert stats["count"] == len(snap.rows)
    found = tracebacks(proc.log())
    assert not found, found[0]
    assert proc.process.poll() is None
    committed = sum(1 for key in groups if key[0] != BASE_CLIENT)
    print(f"RELIABILITY client-death: rounds={rounds} killed={killed} slots_reclaimed=all "
          f"honest_recalls_checked={answered} wrong=0 victim_adds_committed_whole={committed} "
          f"partial_adds=0 sidecar_errors={stats['errors']}")
