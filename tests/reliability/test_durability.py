"""Suite 6 — durability: kill -9 during bulk imports and during compactions; the store is exactly right.

Bulk imports: a client process adds large batches (2,000-8,000 rows of dimension 16 with
texts and metadata; ``--long``: up to 20,000) back to back, and the sidecar is killed by
SIGKILL a random 0-600 ms into each run. Compactions: the engine holds 20,000 rows of dimension
64 (``--long``: 60,000); a client deletes random batches of 100-600 ids and calls compact()
after each (re-adding a large batch when the store runs low); half of the kills are aimed at a
compaction (0-5 ms after the client announces it), half fall at a random moment.

After every kill, with the sidecar dead, the store is opened readonly (Store.open) and must
pass SQLite's integrity_check and hold exactly the acknowledged items (every acknowledged add
minus every acknowledged delete) plus possibly the one operation in flight, wholly or not at
all; every row is complete (vector bytes, text, metadata, namespace). The sidecar then restarts
on the same store, its count equals the store's and recalls find kept items (each its own
nearest neighbour) and never deleted ones, and the workload goes on.
"""
from __future__ import annotations

import time
import traceback
from typing import Any

import numpy as np
from conftest import DEADLINE_S, _seed_value, unique_name

from kalos import Client, SidecarUnavailable
from reliability._support import Snapshot, Workload, parse_text, read_store, tracebacks

Expected = dict[int, tuple[int, int, int, int]]  # id -> (client, op, row, rows of that add)


def _bulk_importer(name: str, seed: int, max_rows: int, cmd: Any, out: Any) -> None:
    """Adds big batches back to back; reports each acknowledged one, then the one that failed."""
    try:
        w = Workload(seed, dim=16)
        rng = np.random.default_rng([seed, 5])
        op = 0
        while True:
            cmd.get()  # "go": a sidecar is up
            try:
                client = Client(name, timeout=5.0)
            except SidecarUnavailable:  # killed already
                out.put(("failed", None))
                continue
            while True:
                op += 1
                n = int(rng.integers(2000, max_rows + 1))
                vectors, texts, metadata = w.batch(1, op, n)
                try:
                    ids = client.add(vectors, texts=texts, metadata=metadata, namespace=w.namespace(1))
                except SidecarUnavailable:
                    out.put(("failed", ("add", 1, op, n)))
                    break
                out.put(("acked-add", 1, op, n, ids.tolist()))
            client.close()
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc()))


def _compactor(name: str, seed: int, rows: int, cmd: Any, out: Any) -> None:
    """Deletes batches and compacts after each, re-adding when the store runs low."""
    try:
        w = Workload(seed, dim=64)
        rng = np.random.default_rng([seed, 6])
        op = 0
        while True:
            _go, live = cmd.get()  # the parent knows which ids survived the last kill
            client = None
            in_flight: tuple = ()
            try:
                client = Client(name, timeout=5.0)
                while True:
                    op += 1
                    if len(live) < rows // 2:
                        n = rows // 2
                        vectors, texts, metadata = w.batch(2, op, n)
                        in_flight = ("add", 2, op, n)
                        ids = client.add(vectors, texts=texts, metadata=metadata, namespace=w.namespace(2))
                        live.extend(ids.tolist())
                        out.put(("acked-add", 2, op, n, ids.tolist()))
                    else:
                        picks = sorted(rng.choice(live, size=int(rng.integers(100, 600)), replace=False).tolist())
                        in_flight = ("delete", picks)
                        client.delete(picks)
                        chosen = set(picks)
                        live = [i for i in live if i not in chosen]
                        out.put(("acked-delete", picks))
                        in_flight = ("compact",)
                        out.put(("compact-start",))
                        client.compact()
                        out.put(("acked-compact",))
            except SidecarUnavailable:
                out.put(("failed", in_flight))
            if client is not None:
                client.close()
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc()))


def check_store(snap: Snapshot, w: Workload, expected: Expected, *, add: tuple | None = None,
                delete: list[int] | None = None, context: str) -> tuple[str, Expected]:
    """Asserts ``snap`` holds ``expected`` plus all or none of the in-flight ``add``/``delete``.

    Returns what happened to the operation in flight, and the rows it added (if it committed).
    """
    assert snap.integrity == "ok", f"{context}: integrity_check says {snap.integrity!r}"
    committed: Expected = {}
    for item_id, row in snap.rows.items():
        origin = parse_text(row.text)
        assert origin is not None, f"{context}: row {item_id} has foreign text {row.text!r}"
        client, op, r = origin
        if item_id in expected:
            assert expected[item_id][:3] == origin, f"{context}: row {item_id} is {row.text}, expected {expected[item_id]}"
            n = expected[item_id][3]
        else:
            assert add is not None and (client, op) == add[1:3], \
                f"{context}: row {item_id} ({row.text}) belongs to no acknowledged or in-flight add"
            n = add[3]
            committed[item_id] = (client, op, r, n)
        assert row.namespace == w.namespace(client), f"{context}: {row.text} in namespace {row.namespace!r}"
        assert row.metadata == w.metadata(client, op, r), f"{context}: {row.text} has metadata {row.metadata!r}"
        assert row.vector == w.unit(client, op, n)[r].tobytes(), f"{context}: {row.text} has a torn vector"
    if committed:
        assert len(committed) == add[3], f"{context}: the add in flight is half there ({len(committed)} of {add[3]} rows)"
    missing = set(expected) - set(snap.rows)
    doomed = set(delete or ())
    assert missing <= doomed, f"{context}: {len(missing - doomed)} acknowledged rows lost, e.g. {sorted(missing - doomed)[:5]}"
    assert not missing or missing == doomed, \
        f"{context}: the delete in flight is half done ({len(missing)} of {len(doomed)} rows gone)"
    if committed:
        return "in-flight add committed whole", committed
    if missing:
        return "in-flight delete committed whole", committed
    return "in-flight operation not committed", committed


def _agree(name: str, w: Workload, expected: Expected, gone: list[int], rng: np.random.Generator, context: str) -> None:
    """The restarted sidecar serves what the store holds: kept items found, deleted ones never."""
    with Client(name, timeout=30.0) as checker:
        assert checker.stats()["count"] == len(expected), context
        for i in rng.choice(sorted(expected), size=min(5, len(expected)), replace=False).tolist():
            client, op, r, n = expected[i]
            hit = checker.recall(w.unit(client, op, n)[r], k=1, namespace=w.namespace(client))
            assert hit.ids.tolist() == [i], f"{context}: item {i} is not its own nearest neighbour"
        if gone:
            assert checker.get(gone[:50]) == [None] * len(gone[:50]), f"{context}: a deleted item is back"


def _messages(out: Any, until: str) -> list[tuple]:
    got = []
    while True:
        msg = out.get(timeout=DEADLINE_S * 2)
        assert msg[0] != "error", msg[1]
        got.append(msg)
        if msg[0] == until:
            return got


def test_kill9_during_bulk_imports_keeps_exactly_the_acknowledged_rows(sidecars, children, store_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    rng = np.random.default_rng(seed)
    kills, max_rows = scale((5, 8000), (40, 20000))
    w = Workload(seed, dim=16)
    name = unique_name("bulk")
    store = store_dir / "bulk.db"
    procs = [sidecars.start(store, name=name, dim=16)]
    cmd, out = children.queue(), children.queue()
    children.start(_bulk_importer, name, seed, max_rows, cmd, out)
    expected: Expected = {}
    outcomes: dict[str, int] = {}
    rows_acked = 0
    for cycle in range(kills):
        cmd.put("go")
        time.sleep(float(rng.uniform(0, 0.6)))
        procs[-1].kill()
        context = f"kill {cycle + 1}"
        for msg in _messages(out, "failed"):
            if msg[0] == "acked-add":
                _kind, client, op, n, ids = msg
                rows_acked += n
                expected.update({i: (client, op, r, n) for r, i in enumerate(ids)})
        outcome, committed = check_store(read_store(store, label=context), w, expected, add=msg[1] or None,
                                         context=context)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        expected.update(committed)  # committed though never acknowledged: from now on it must stay
        procs.append(sidecars.start(store, name=name))
        _agree(name, w, expected, [], rng, context)
    procs[-1].stop()
    for i, proc in enumerate(procs):
        found = tracebacks(proc.log())
        assert not found, f"sidecar {i}: {found[0]}"
    print(f"RELIABILITY durability-bulk: kills={kills} rows_acknowledged={rows_acked} rows_in_store={len(expected)} "
          f"outcomes={outcomes} integrity=ok")


def test_kill9_during_compactions_keeps_exactly_the_acknowledged_rows(sidecars, children, store_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    rng = np.random.default_rng(seed)
    kills, rows = scale((6, 20000), (40, 60000))
    w = Workload(seed, dim=64)
    name = unique_name("compact")
    store = store_dir / "compact.db"
    procs = [sidecars.start(store, name=name, dim=64)]
    with Client(name, timeout=30.0) as loader:
        vectors, texts, metadata = w.batch(3, 0, rows)
        ids = loader.add(vectors, texts=texts, metadata=metadata, namespace=w.namespace(3))
    expected: Expected = {i: (3, 0, r, rows) for r, i in enumerate(ids.tolist())}
    gone: list[int] = []
    cmd, out = children.queue(), children.queue()
    children.start(_compactor, name, seed, rows, cmd, out)
    outcomes: dict[str, int] = {}
    during = {"compact": 0, "delete": 0, "add": 0, "between": 0}
    deleted_acked = compactions = 0
    for cycle in range(kills):
        cmd.put(("go", sorted(expected)))
        aimed = cycle % 2 == 0
        if aimed:  # at a compaction: right after the client says it is starting one
            msgs = _messages(out, "compact-start")
            time.sleep(float(rng.uniform(0, 0.005)))
        else:
            msgs = []
            time.sleep(float(rng.uniform(0.05, 1.0)))
        procs[-1].kill()
        context = f"kill {cycle + 1} ({'aimed at a compaction' if aimed else 'random'})"
        msgs += _messages(out, "failed")
        for msg in msgs:
            if msg[0] == "acked-add":
                _kind, client, op, n, new_ids = msg
                expected.update({i: (client, op, r, n) for r, i in enumerate(new_ids)})
            elif msg[0] == "acked-delete":
                for i in msg[1]:
                    del expected[i]
                gone += msg[1]
                deleted_acked += len(msg[1])
            elif msg[0] == "acked-compact":
                compactions += 1
        in_flight = msgs[-1][1]  # () when the kill fell between operations or during the connect
        during[in_flight[0] if in_flight else "between"] += 1
        snap = read_store(store, label=context)
        outcome, committed = check_store(snap, w, expected, add=in_flight if in_flight[:1] == ("add",) else None,
                                         delete=in_flight[1] if in_flight[:1] == ("delete",) else None, context=context)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        expected.update(committed)
        if in_flight[:1] == ("delete",) and outcome.startswith("in-flight delete"):
            for i in in_flight[1]:
                del expected[i]
            gone += in_flight[1]
        procs.append(sidecars.start(store, name=name))
        _agree(name, w, expected, gone[-200:], rng, context)
    procs[-1].stop()
    for i, proc in enumerate(procs):
        found = tracebacks(proc.log())
        assert not found, f"sidecar {i}: {found[0]}"
    print(f"RELIABILITY durability-compact: kills={kills} killed_during={during} compactions_acked={compactions} "
          f"rows_deleted_acked={deleted_acked} rows_in_store={len(expected)} outcomes={outcomes} integrity=ok")
