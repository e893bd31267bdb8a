"""Suite 4 — load with an oracle: many client processes, concurrent adds and deletes, every answer checked.

Workload: 8 recaller processes x 250 recalls (``--long``: 32 x 500), single and batched (2-5
rows), k from 1 to 16, over every namespace or one of them; 60 % aimed at the items the writers
are adding or deleting at that very moment. Two writer processes add (1-40 rows, texts and
metadata) and delete their own acknowledged items throughout. No faults: the sidecar stays up.

Oracle (reliability._support.check_recalls): each operation is logged with its invocation and
completion times (time.monotonic, one clock for the host). A recall over [t0, t1] must be the
exact top-k of some state S of the store with sure ⊆ S ⊆ possible: an add acknowledged before
t0 and not being deleted is in ``sure`` (so it must come back if it ranks), a delete
acknowledged before t0 puts the item outside ``possible`` (so it must never come back), and
anything in flight may go either way; an item appears with its exact score or not at all.

Reported: recalls and rows checked, mismatches (must be 0), lost responses (a recall that
raised or never returned: must be 0) and cross-delivered ones (a wrong answer that fits another
client's query: must be 0). After the run the store is also checked like a crash snapshot.
"""
from __future__ import annotations

import time

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
    tracebacks,
    writer,
)

TIMEOUT = 60.0  # no faults here: any SidecarUnavailable is a lost response


def test_every_answer_under_load_is_a_valid_topk_of_some_linearisation(sidecars, children, store_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    n_recallers, per_recaller = scale((8, 250), (32, 500))
    n_writers = 2
    w = Workload(seed)
    name = unique_name("load")
    store = store_dir / "load.db"
    proc = sidecars.start(store, name=name, dim=w.dim, extra_args=["--slots", str(n_recallers + n_writers + 4)])
    base_n = 400
    vectors, texts, metadata = w.batch(BASE_CLIENT, 0, base_n)
    with Client(name, timeout=30.0) as loader:
        t0 = time.monotonic()
        base_ids = loader.add(vectors, texts=texts, metadata=metadata, namespace="default").tolist()
        base = AddOp(BASE_CLIENT, 0, t0, time.monotonic(), True, base_ids, base_n)

    ctx = children.ctx
    writers_stop, recallers_stop = children.event(), children.event()
    out = children.queue()
    n_clients = n_writers + n_recallers
    progress = ctx.Array("d", n_clients, lock=False)
    wprogress = ctx.Array("l", n_writers, lock=False)
    writer_ids = list(range(n_writers))
    for c in writer_ids:
        children.start(writer, name, seed, c, TIMEOUT, writers_stop, progress, wprogress, out, 10**9)
    wait_until(lambda: all(wprogress[c] >= 2 for c in writer_ids), "the writers' first adds", timeout=DEADLINE_S)
    namespaces = [None, None, None, "default", "w0", "w1"]
    for c in range(n_writers, n_clients):
        children.start(recaller, name, seed, c, TIMEOUT, recallers_stop, progress, wprogress, writer_ids, out,
                       per_recaller, namespaces)
    records: list[tuple] = []
    errors = []
    for _ in range(n_recallers):  # recallers stop by themselves after per_recaller recalls
        msg = out.get(timeout=DEADLINE_S * 20)
        if msg[0] == "error":
            errors.append(msg[2])
        else:
            records.extend(msg[2])
    writers_stop.set()
    for _ in range(n_writers):
        msg = out.get(timeout=DEADLINE_S * 2)
        if msg[0] == "error":
            errors.append(msg[2])
        else:
            records.extend(msg[2])
    assert not errors, errors[0]
    proc.stop()
    final = read_store(store, label="after the load")

    adds, deletes, recalls, unexpected = parse_records(records)
    lost = [r for r in recalls if r.status != "ok"]
    assert not unexpected, f"calls that raised: {unexpected[:5]}"
    assert len(recalls) == n_recallers * per_recaller, "a recall went missing from the log"
    assert all(a.ok for a in adds) and all(d.ok for d in deletes), "a write failed with the sidecar up"
    adds.append(base)
    history = History(w, adds, deletes, [final])
    history.check_snapshots()
    assert not history.problems, "\n".join(history.problems[:20])
    verdict = check_recalls(history.item_table(), recalls)
    found = tracebacks(proc.log())
    assert not found, found[0]
    print(f"RELIABILITY load: clients={n_recallers}x{per_recaller} recalls_checked={verdict.recalls} "
          f"rows_checked={verdict.rows} mismatches={len(verdict.mismatches)} lost={len(lost)} "
          f"cross_delivered={verdict.cross_delivered} concurrent_adds={len(adds) - 1} "
          f"concurrent_deletes={len(deletes)} items_in_store={len(final.rows)}")
    assert not lost, f"{len(lost)} recalls got no answer"
    assert not verdict.mismatches, "\n".join(verdict.mismatches[:10])
    assert verdict.cross_delivered == 0
