"""PostgreSQL as the shared store of record, against a real server (tests/pg_server.py).

The store API against the SQLite store's behaviour, bit-exact vectors, bad input that writes
nothing, the change log under concurrent writers (a follower ends with exactly the union), two
sidecars on one database acting as two hosts (adds and deletes propagate, a stopped sidecar
catches up on restart without loss or duplicates, followers survive a server restart), the
password never shown, and the pgvector fallback search (or its clear refusal without pgvector).
Recalls are compared with the float64 reference; deadlines only turn hangs into failures.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from kalos import Client
from kalos.errors import DimensionMismatch, InvalidArgument, NotAKalosStore, StoreError
from kalos.store.sqlite import Store

psycopg = pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")

from conftest import DEADLINE_S, SidecarPool, unique_name, wait_until  # noqa: E402
from pg_server import PASSWORD, PgServer, find_bin_dir  # noqa: E402
from reference import assert_topk_matches, eligible_mask, model_arrays  # noqa: E402

from kalos.store.follow import apply_to_engine  # noqa: E402  (needs psycopg)
from kalos.store.postgres import PostgresStore, mask_url  # noqa: E402

DIM = 8

pytestmark = pytest.mark.skipif(
    find_bin_dir() is None,
    reason="PostgreSQL's server binaries (initdb, pg_ctl) are not installed: apt-get install postgresql "
    "(.ci/run does)",
)


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    try:
        server = PgServer().init().start()
    except KeyError:  # root, but no postgres OS user to run the server as
        pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as (apt-get install postgresql)")
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def url(pg: PgServer) -> str:
    """A fresh, empty database of its own for each test."""
    return pg.url(pg.create_database())


def _unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _all_rows(store: Any) -> dict[int, tuple[bytes, int, float]]:
    out = {}
    for ids, vecs, ns, times in store.iter_rows(batch=7):
        for i, v, n, t in zip(ids.tolist(), vecs, ns.tolist(), times.tolist()):
            assert i not in out
            out[i] = (v.tobytes(), n, t)
    return out


# -- the store API ------------------------------------------------------------------------------


def test_api_matches_the_sqlite_store(url: str, store_dir: Path, rng: np.random.Generator) -> None:
    """The same operations on both stores give the same answers, vectors bit for bit."""
    with Store.open(store_dir / "s.db", dim=DIM) as lite, PostgresStore.open(url, dim=DIM) as pgs:
        assert pgs.dim == DIM and pgs.path == mask_url(url) and PASSWORD not in repr(pgs)
        for store in (lite, pgs):
            assert store.namespaces() == {"default": 1} and store.count() == 0
        # Raw (not unit) vectors including awkward floats: the store keeps the exact bits.
        vecs = rng.standard_normal((40, DIM)).astype(np.float32) * np.float32(1e-30)
        vecs[0, 0] = np.float32(3.4028235e38)
        vecs[1] = np.nextafter(np.float32(1), np.float32(2))
        texts = [f"mémoire {i} ✓" if i % 3 else None for i in range(40)]
        meta = [{"z": i, "a": [1, {"k": None}], "ü": "x"} if i % 2 else None for i in range(40)]
        times = rng.uniform(0, 2e9, 40)
        results = []
        for store in (lite, pgs):
            a = store.add(vecs[:25], namespace="one", texts=texts[:25], metadata=meta[:25], created_at=times[:25])
            b = store.add(vecs[25:], namespace="two", texts=texts[25:], metadata=meta[25:], created_at=times[25:])
            c = store.add(vecs[:2], namespace="default", created_at=12.5)
            deleted = store.delete([3, 4, 4, 1000, 26])
            results.append((a, b, c, deleted))
        for x, y in zip(*results):
            for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
                assert np.array_equal(np.asarray(u), np.asarray(v))
        assert lite.namespaces() == pgs.namespaces() == {"default": 1, "one": 2, "two": 3}
        assert lite.namespace_counts() == pgs.namespace_counts() == {"default": 2, "one": 23, "two": 14}
        assert lite.count() == pgs.count() == 39
        probe = [5, 3, 41, 1, -7, 5, 26, 30]
        assert lite.get(probe) == pgs.get(probe)
        assert _all_rows(lite) == _all_rows(pgs)
        assert pgs.delete([]).size == 0 and pgs.get([]) == []
        assert pgs.integrity_check() == "ok" and pgs.size_bytes() > 0
        # Ids are never reused, even after deleting the highest one.
        top = int(max(_all_rows(pgs)))
        pgs.delete([top])
        assert int(pgs.add(vecs[:1], namespace="one")[0][0]) == top + 1
        # Loading in batches that leave exactly one row over, or hold one row each.
        for batch in (len(_all_rows(pgs)) - 1, 1):
            loaded = [(i.copy(), v.copy()) for i, v, _n, _t in pgs.iter_rows(batch=batch)]
            assert sum(len(i) for i, _ in loaded) == pgs.count()


def test_request_ids_and_undo_match_the_sqlite_store(url: str, store_dir: Path, rng: np.random.Generator) -> None:
    """Issue 19, item 9: an add's request id finds its ids again (the retry after a lost reply),
    and undo_add takes a committed add back whole, request id included, on both stores."""
    with Store.open(store_dir / "r.db", dim=DIM) as lite, PostgresStore.open(url, dim=DIM) as pgs:
        for store in (lite, pgs):
            assert store.find_request("req-1") is None
            ids, _ns, _t = store.add(_unit(rng, 5), namespace="default", request_id="req-1")
            assert store.find_request("req-1").tolist() == ids.tolist()
            other, _ns, _t = store.add(_unit(rng, 3), namespace="default", request_id="req-2")
            store.undo_add(other, "req-2")
            assert store.find_request("req-2") is None and store.count() == 5
            assert store.get(other.tolist()) == [None] * 3
            for bad in ("", "x" * 65, "a b", 7, "é"):
                with pytest.raises(InvalidArgument, match="request_id"):
                    store.add(_unit(rng, 1), namespace="default", request_id=bad)
            assert store.count() == 5


def test_bad_input_writes_nothing(url: str, rng: np.random.Generator) -> None:
    with PostgresStore.open(url, dim=DIM) as store:
        store.add(_unit(rng, 3), namespace="keep")
        before = (store.count(), store.change_mark(), store.namespaces())
        good = _unit(rng, 2)
        bad_calls = [
            (DimensionMismatch, dict(vectors=_unit(rng, 2, DIM + 1), namespace="x")),
            (InvalidArgument, dict(vectors=np.full((2, DIM), np.nan, np.float32), namespace="x")),
            (InvalidArgument, dict(vectors=np.zeros((1, DIM), np.float32), namespace="x")),
            (InvalidArgument, dict(vectors=good, namespace="")),
            (InvalidArgument, dict(vectors=good, namespace="a\x00b")),
            (InvalidArgument, dict(vectors=good, namespace="x", texts=["only one"])),
            (InvalidArgument, dict(vectors=good, namespace="x", texts=["ok", "nul\x00inside"])),
            (InvalidArgument, dict(vectors=good, namespace="x", metadata=[{1: "int key"}, None])),
            (InvalidArgument, dict(vectors=good, namespace="x", created_at=[1.0, float("inf")])),
        ]
        for error, kwargs in bad_calls:
            vectors = kwargs.pop("vectors")
            with pytest.raises(error):
                store.add(vectors, **kwargs)
        for ids in (["a"], [[1, 2]], [2**64]):
            with pytest.raises(InvalidArgument):
                store.delete(ids)
        assert (store.count(), store.change_mark(), store.namespaces()) == before


def test_open_checks(pg: PgServer, url: str, rng: np.random.Generator) -> None:
    with pytest.raises(InvalidArgument, match="pass dim"):
        PostgresStore.open(url)
    with pytest.raises(InvalidArgument, match="readonly"):
        PostgresStore.open(url, readonly=True)
    with PostgresStore.open(url, dim=DIM) as store:
        store.add(_unit(rng, 2), namespace="default")
    with pytest.raises(DimensionMismatch, match=f"dimension {DIM}, but dim={DIM + 1}"):
        PostgresStore.open(url, dim=DIM + 1)
    with PostgresStore.open(url, readonly=True) as ro:
        assert ro.dim == DIM and ro.count() == 2
        with pytest.raises(StoreError, match="readonly"):
            ro.add(_unit(rng, 1), namespace="default")
        with pytest.raises(StoreError, match="readonly"):
            ro.delete([1])
    # A database whose kalos_meta table is someone else's.
    other = pg.create_database()
    pg.psql("CREATE TABLE kalos_meta (key text PRIMARY KEY, value text); INSERT INTO kalos_meta VALUES ('format', 'x')",
            other)
    with pytest.raises(NotAKalosStore):
        PostgresStore.open(pg.url(other), dim=DIM)
    # A wrong password: the error names the server, never the password.
    bad = url.replace(PASSWORD, "wrong-" + PASSWORD[::-1])
    with pytest.raises(StoreError) as info:
        PostgresStore.open(bad, dim=DIM)
    assert PASSWORD[::-1] not in str(info.value) and "***" in str(info.value)


def test_mask_url() -> None:
    assert mask_url("postgresql://u:p%40ss@h:5/db?sslmode=require") == "postgresql://u:***@h:5/db?sslmode=require"
    assert mask_url("postgres://h/db?user=u&password=pw") == "postgres://h/db?user=u&password=***"
    assert mask_url("postgresql://u@h/db") == "postgresql://u@h/db"


# -- the change log -----------------------------------------------------------------------------


def _writer(url: str, seed: int, rounds: int, out: Any) -> None:
    """A child process: small adds and deletes of its own items, as fast as it can."""
    rng = np.random.default_rng(seed)
    live: list[int] = []
    with PostgresStore.open(url) as store:
        for r in range(rounds):
            ids, _, _ = store.add(_unit(rng, int(rng.integers(1, 4))), namespace=f"w{seed % 3}")
            live += ids.tolist()
            if r % 3 == 2:
                store.delete(live[:2])
                del live[:2]
    out.put(sorted(live))


class _Collected:
    """What a follower applied, as a dict id -> vector bytes (the engine's role in the tests)."""

    def __init__(self) -> None:
        self.items: dict[int, bytes] = {}
        self.duplicates = 0

    def apply(self, batch: Any) -> None:
        for change in batch.changes:
            if change.op == "add":
                for i, v in zip(change.ids.tolist(), change.vectors):
                    self.duplicates += i in self.items
                    self.items[i] = v.tobytes()
            else:
                for i in change.ids.tolist():
                    self.items.pop(i, None)


def test_concurrent_writers_leave_no_gap(url: str, children: Any, seed: int) -> None:
    """Three processes write at once while a follower reads continuously (short poll): it
    must end with exactly the union of their live items, each vector as stored."""
    with PostgresStore.open(url, dim=DIM) as store:
        got = _Collected()
        follower = store.follower(store.change_mark(), apply=got.apply, poll_interval_s=0.005).start()
        try:
            out = children.queue()
            procs = [children.start(_writer, url, seed + i, 150, out) for i in range(3)]
            expected = sorted(i for _ in procs for i in out.get(timeout=DEADLINE_S * 2))
            final = store.change_mark()
            wait_until(lambda: follower.mark >= final, "the follower to read the whole log")
        finally:
            follower.stop()
        rows = _all_rows(store)
    assert sorted(rows) == expected
    assert sorted(got.items) == expected
    assert got.duplicates == 0
    assert all(got.items[i] == rows[i][0] for i in expected)


def test_writers_are_serialised_so_seq_order_is_commit_order(url: str, pg: PgServer, rng: np.random.Generator) -> None:
    """White box: while another transaction holds the writer lock (as a slow writer would,
    between taking its seq and committing), an add waits; its seq comes after the other's."""
    from kalos.store.postgres import _WRITER_LOCK

    with PostgresStore.open(url, dim=DIM) as store:
        store.add(_unit(rng, 1), namespace="default")
        slow = psycopg.connect(url)
        slow.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITER_LOCK,))
        slow.execute("INSERT INTO kalos_changes (seq, op, ids) SELECT max(seq) + 1, 'add', '{}' FROM kalos_changes")
        done = threading.Event()
        thread = threading.Thread(target=lambda: (store.add(_unit(rng, 1), namespace="default"), done.set()))
        thread.start()
        assert not done.wait(0.5), "an add went ahead while another writer held the lock"
        slow.commit()
        slow.close()
        thread.join(DEADLINE_S)
        assert done.is_set()
        with psycopg.connect(url) as conn:
            log = conn.execute("SELECT seq, op, cardinality(ids) FROM kalos_changes ORDER BY seq").fetchall()
        assert log == [(1, "add", 1), (2, "add", 0), (3, "add", 1)]


def test_apply_to_engine_is_idempotent(url: str, rng: np.random.Generator) -> None:
    from kalos.engine.numpy_engine import NumpyEngine
    from kalos.store.postgres import fetch_changes

    with PostgresStore.open(url, dim=DIM) as store:
        a, _, _ = store.add(_unit(rng, 4), namespace="n1")
        store.delete(a[:1])
        b, _, _ = store.add(_unit(rng, 2), namespace="n2")
        store.delete(b[:1])
    engine = NumpyEngine(DIM)
    namespaces: dict[bytes, int] = {}
    with psycopg.connect(url) as conn:
        batch = fetch_changes(conn, DIM, 0)
    assert [c.op for c in batch.changes] == ["add", "delete", "add", "delete"] and batch.mark == 4
    # The snapshot no longer holds a[0] and b[0] (deleted later in the log), so they are never
    # added, and their deletes find nothing to delete.
    assert apply_to_engine(engine, namespaces, batch) == (4, 0)
    assert apply_to_engine(engine, namespaces, batch) == (0, 0)  # a replay after a reconnect
    assert sorted(engine.rows.ids[engine.rows.live].tolist()) == sorted(a[1:].tolist() + b[1:].tolist())
    assert namespaces == {b"default": 1, b"n1": 2, b"n2": 3}


# -- two sidecars on one database ----------------------------------------------------------------


class Host:
    """One sidecar (one "host") on the shared database, and a client of it."""

    def __init__(self, pool: SidecarPool, url: str, name: str, dim: int | None = DIM) -> None:
        self.pool, self.url, self.name, self.dim = pool, url, name, dim
        self.start()

    def start(self) -> None:
        self.proc = self.pool.start(self.url, name=self.name, dim=self.dim)
        self.client = Client(self.name, timeout=10.0)

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()

    def ids(self) -> set[int]:
        """Every id the sidecar serves: one recall over all namespaces with k above the test's
        item count (the default max_k, 256), so a follower's change cannot land in between."""
        hit = self.client.recall(np.ones(DIM, np.float32), k=256, namespace=None)
        ids = [i for i in hit.ids.tolist() if i != -1]
        assert len(ids) == len(set(ids)) < 256, f"duplicates (or too many items) in {self.name}: {ids}"
        return set(ids)


def _check_recalls(host: Host, model: dict, rng: np.random.Generator, namespace: str | None) -> None:
    ids, vectors, namespaces, created = model_arrays(model)
    eligible = eligible_mask(namespaces, created, namespace=namespace)
    queries = rng.standard_normal((3, DIM)).astype(np.float32)
    batch = host.client.recall_many(queries, k=10, namespace=namespace)
    assert_topk_matches(batch.ids, batch.scores, ids, vectors, queries, 10, eligible, context=host.name)


def test_two_sidecars_follow_each_other(url: str, sidecars: SidecarPool, rng: np.random.Generator) -> None:
    a = Host(sidecars, url, unique_name("a"))
    b = Host(sidecars, url, unique_name("b"))
    assert PASSWORD not in a.proc.ready_line and "***" in a.proc.ready_line
    model: dict[int, tuple[np.ndarray, str, float]] = {}

    def add(host: Host, n: int, namespace: str) -> np.ndarray:
        vecs = _unit(rng, n)
        ids = host.client.add(vecs, namespace=namespace, texts=[f"t{i}" for i in range(n)])
        for i, v in zip(ids.tolist(), vecs):
            model[i] = (v.astype(np.float64), namespace, 0.0)
        return ids

    def forget(ids: Any) -> None:
        for i in np.asarray(ids).tolist():
            model.pop(i)

    # Add via A, in a namespace B has never seen: recallable via B (same answers as A). One
    # single-item add too: a one-row change is its own case when the follower decodes it.
    ids = add(a, 20, "travel")
    add(a, 1, "travel")
    wait_until(lambda: b.ids() == set(model), "B to see A's adds")
    for host in (a, b):
        _check_recalls(host, model, rng, "travel")
        _check_recalls(host, model, rng, None)
    assert b.client.get(ids[:1])[0].text == "t0"
    # Delete via B: gone from A.
    b.client.delete(ids[:5].tolist())
    forget(ids[:5])
    wait_until(lambda: a.ids() == set(model), "A to see B's deletes")
    # Both write at once: both end with the union.
    add(b, 7, "default")
    add(a, 3, "default")
    for host in (a, b):
        wait_until(lambda h=host: h.ids() == set(model), f"{host.name} to hold the union")
        _check_recalls(host, model, rng, "default")

    # B is down while A writes (adds in a new namespace, deletes); restarted, B catches up.
    b.stop()
    new = add(a, 30, "later")
    a.client.delete([int(ids[5]), int(new[0])])
    forget([ids[5], new[0]])
    b.start()
    assert b.ids() == set(model)  # straight from the load: no wait, no loss, no duplicates
    assert int(b.client.stats()["count"]) == len(model)
    _check_recalls(b, model, rng, "later")
    # And B follows again after its restart.
    add(a, 2, "later")
    wait_until(lambda: b.ids() == set(model), "the restarted B to follow A")
    assert PASSWORD not in a.proc.log() + b.proc.log()
    stats = b.client.stats()
    assert stats["store"] == mask_url(url) and PASSWORD not in str(stats)


def test_followers_survive_a_server_restart(pg: PgServer, url: str, sidecars: SidecarPool,
                                            rng: np.random.Generator) -> None:
    a = Host(sidecars, url, unique_name("a"))
    b = Host(sidecars, url, unique_name("b"))
    first = a.client.add(_unit(rng, 3))
    wait_until(lambda: b.ids() == set(first.tolist()), "B to see the first adds")
    pg.restart()
    # A's store connection is broken by the restart; its add reconnects and succeeds.
    second = a.client.add(_unit(rng, 4))
    wait_until(lambda: b.ids() == set(first.tolist()) | set(second.tolist()), "B to follow after the restart")
    b.client.delete(first.tolist())
    wait_until(lambda: a.ids() == set(second.tolist()), "A to follow after the restart")
    logs = a.proc.log() + b.proc.log()
    assert "following" in logs and "again" in logs, logs[-2000:]
    assert PASSWORD not in logs


def test_second_sidecar_with_another_dim_is_refused(url: str, sidecars: SidecarPool) -> None:
    Host(sidecars, url, unique_name("a"))
    with pytest.raises(Exception, match=f"has dimension {DIM}, but dim={DIM * 2}") as info:
        sidecars.start(url, name=unique_name("b"), dim=DIM * 2, ready_timeout=60)
    assert PASSWORD not in str(info.value)


# -- the CLI: doctor and the server-side fallback search -----------------------------------------


def _kalos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kalos", *args], capture_output=True, text=True, timeout=DEADLINE_S)


def test_doctor_on_a_postgres_store(url: str, runtime_dir: Path, rng: np.random.Generator) -> None:
    with PostgresStore.open(url, dim=DIM) as store:
        store.add(_unit(rng, 5), namespace="n")
    out = _kalos("doctor", "--store", url, "--name", unique_name("d"))
    text = out.stdout + out.stderr
    assert "5 memories of dim 8" in text and "change log at 1" in text, text
    assert PASSWORD not in text and mask_url(url) in text


def test_fallback_search(pg: PgServer, url: str, rng: np.random.Generator) -> None:
    """With pgvector: exact cosine top-k on the server, equal to the reference. Without: a
    clear refusal naming pgvector (both from the store API and from `kalos recall --store`)."""
    vecs = _unit(rng, 50)
    with PostgresStore.open(url, dim=DIM) as store:
        ids, _, _ = store.add(vecs[:30], namespace="x")
        ids2, _, _ = store.add(vecs[30:], namespace="y")
        q = rng.standard_normal(DIM).astype(np.float32)
        cli = _kalos("recall", "--store", url, "--vector", ",".join(map(str, q.tolist())), "--namespace", "x",
                     "--json")
        assert PASSWORD not in cli.stdout + cli.stderr
        if not pg.has_pgvector():
            assert not store.has_vector
            with pytest.raises(StoreError, match="pgvector"):
                store.search(q, 5)
            assert cli.returncode == 2 and "pgvector" in cli.stderr, cli.stderr
            return
        assert store.has_vector
        all_ids = np.concatenate([ids, ids2])
        namespaces = ["x"] * 30 + ["y"] * 20
        for namespace in ("x", None):
            hits = store.search(q, 7, namespace)
            eligible = eligible_mask(namespaces, np.zeros(50), namespace=namespace)
            assert_topk_matches(np.array([[i for i, _ in hits]]), np.array([[s for _, s in hits]]),
                                all_ids, vecs.astype(np.float64), q, 7, eligible, context=f"pgvector ns={namespace}")
        assert cli.returncode == 0, cli.stderr


# -- caller keys with upsert (issue 22) ------------------------------------------------------------


def test_upsert_get_and_delete_by_keys_match_the_sqlite_store(url: str, store_dir: Path,
                                                               rng: np.random.Generator) -> None:
    first, second = _unit(rng, 3), _unit(rng, 2)
    results = []
    with PostgresStore.open(url, dim=DIM) as pg_store, Store.open(store_dir / "m.db", dim=DIM) as sqlite_store:
        for store in (pg_store, sqlite_store):
            ids, _, created, replaced = store.upsert(first, keys=["a", "b", "c"], namespace="n", created_at=100.0,
                                                     texts=["a1", "b1", "c1"], request_id="r1")
            assert not replaced.any()
            again, _, kept, replaced = store.upsert(second, keys=["c", "d"], namespace="n", created_at=200.0,
                                                    texts=["c2", "d2"], request_id="r2")
            assert replaced.tolist() == [True, False] and again[0] == ids[2] and kept[0] == 100.0
            assert store.find_request("r2").tolist() == again.tolist()
            other, _, _, _ = store.upsert(second[:1], keys=["a"], namespace="elsewhere")
            assert other[0] not in ids.tolist(), "the same key in another namespace is another item"
            items = store.get_keys(["c", "a", "zz", "c"], "n")
            assert [it and (it.key, it.text, it.created_at) for it in items] == [
                ("c", "c2", 100.0), ("a", "a1", 100.0), None, ("c", "c2", 100.0)]
            assert items[0].updated_at > 1e9 and items[1].updated_at is None
            with pytest.raises(InvalidArgument, match="key 'x' appears twice"):
                store.upsert(first, keys=["x", "y", "x"], namespace="n")
            assert store.get_keys(["x", "y"], "n") == [None, None]
            assert store.delete_keys(["a", "zz"], "n").tolist() == [ids[0]]
            assert store.get_keys(["a"], "elsewhere")[0].id == other[0]
            results.append(sorted((it.key, it.text) for it in store.get(list(_all_rows(store))) if it is not None))
    assert results[0] == results[1]


def test_a_pg_store_made_before_keys_is_migrated(url: str, rng: np.random.Generator) -> None:
    with PostgresStore.open(url, dim=DIM) as store:
        ids, _, _ = store.add(_unit(rng, 2), namespace="n", texts=["x", "y"])
    with psycopg.connect(url, autocommit=True) as conn:  # back to the schema of the release before keys
        conn.execute("DROP INDEX kalos_items_by_key")
        conn.execute("ALTER TABLE kalos_items DROP COLUMN key, DROP COLUMN updated_at")
        conn.execute("ALTER TABLE kalos_changes DROP CONSTRAINT kalos_changes_op_check,"
                     " ADD CONSTRAINT kalos_changes_op_check CHECK (op IN ('add', 'delete'))")
    with PostgresStore.open(url, readonly=True) as ro:
        assert [it.key for it in ro.get(ids)] == [None, None]
    with PostgresStore.open(url) as store:
        assert [it.text for it in store.get(ids)] == ["x", "y"]
        new, _, _, replaced = store.upsert(_unit(rng, 1), keys=["k"], namespace="n")
        again, _, _, replaced = store.upsert(_unit(rng, 1), keys=["k"], namespace="n")
        assert replaced.tolist() == [True] and again.tolist() == new.tolist()


def test_a_follower_applies_upserts_and_never_serves_both_versions(url: str, sidecars: SidecarPool,
                                                                   rng: np.random.Generator) -> None:
    a = Host(sidecars, url, unique_name("a"))
    b = Host(sidecars, url, unique_name("b"))
    keys = [f"m{i}" for i in range(12)]
    old = _unit(rng, 12)
    ids = a.client.add(old, keys=keys, namespace="mem", texts=["old"] * 12)
    model = {i: (v.astype(np.float64), "mem", 0.0) for i, v in zip(ids.tolist(), old)}
    wait_until(lambda: b.ids() == set(model), "B to see A's keyed adds")
    new = _unit(rng, 6)
    again = a.client.add(new, keys=keys[::2], namespace="mem", texts=["new"] * 6)
    assert again.tolist() == ids[::2].tolist()
    for i, v in zip(again.tolist(), new):
        model[i] = (v.astype(np.float64), "mem", 0.0)

    def b_serves_the_new_vectors() -> bool:
        hit = b.client.recall_many(new, k=1, namespace="mem")
        return hit.ids[:, 0].tolist() == again.tolist() and bool(np.all(hit.scores[:, 0] > 1 - 1e-5))

    wait_until(b_serves_the_new_vectors, "B to serve A's upserts")
    assert b.ids() == set(model), "one row per key on B: the upsert added no second one"
    for host in (a, b):
        _check_recalls(host, model, rng, "mem")
        # An old vector, recalled exactly, no longer finds its replaced item at score 1.
        hit = host.client.recall_many(old[::2], k=1, namespace="mem")
        assert np.all(hit.scores[:, 0] < 1 - 1e-4), f"{host.name} still serves an old version"
    assert [it.text for it in b.client.get(keys=keys[:2], namespace="mem")] == ["new", "old"]
    # Delete by key through B reaches A; a restarted B loads the upserted state.
    assert b.client.delete(keys=keys[:3], namespace="mem") == 3
    for i in ids[:3].tolist():
        model.pop(i)
    wait_until(lambda: a.ids() == set(model), "A to see B's delete by keys")
    b.stop()
    b.start()
    assert b.ids() == set(model)
    _check_recalls(b, model, rng, "mem")
