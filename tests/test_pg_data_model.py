"""update, list/count, scoped delete and TTL (issue 22) on a PostgreSQL store: the store API beside
the SQLite store's, and two sidecars on one database (the followers apply updates, scoped
deletes and expiries). Against a real server (tests/pg_server.py) and the float64 reference.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kalos.errors import InvalidArgument, UnknownKey
from kalos.store.sqlite import Store
from kalos.validation import check_update
from kalos.where import compile_where

psycopg = pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")

from conftest import SidecarPool, unique_name, wait_until  # noqa: E402
from pg_server import find_bin_dir  # noqa: E402
from test_pg_store import DIM, Host, _check_recalls, _unit, pg, url  # noqa: E402,F401  (fixtures)

from kalos.store.postgres import PostgresStore  # noqa: E402

pytestmark = pytest.mark.skipif(find_bin_dir() is None, reason="PostgreSQL's server binaries are not installed")


def test_update_list_count_delete_where_and_expiry_match_the_sqlite_store(url: str, store_dir: Path,
                                                                          rng: np.random.Generator) -> None:
    vectors = _unit(rng, 6)
    metas = [{"u": "alice", "n": 1}, {"u": "bob", "n": 2}, {"u": "alice", "n": 3}, None, {"u": "bob"}, {"n": 9}]
    answers = []
    with PostgresStore.open(url, dim=DIM) as pg_store, Store.open(store_dir / "m.db", dim=DIM) as sqlite_store:
        for store in (pg_store, sqlite_store):
            now = time.time()
            ids, _, _, _ = store.upsert(vectors, keys=[f"k{i}" for i in range(6)], namespace="n", metadata=metas,
                                        texts=[f"t{i}" for i in range(6)],
                                        expires_at=np.array([np.nan] * 5 + [now - 1]))  # k5: expired already
            assert store.namespace_counts()["n"] == 5
            got = store.update(check_update("k0", DIM, namespace="n", vector=vectors[3], text="moved",
                                            metadata={"n": 7}, merge=True))
            assert got[0] == ids[0]
            with pytest.raises(UnknownKey):
                store.update(check_update("k5", DIM, namespace="n", text="expired"))
            with pytest.raises(UnknownKey):
                store.update(check_update("k1", DIM, namespace="other", text="x"))
            page, after = store.list_items(namespace="n", limit=2)
            rest, end = store.list_items(namespace="n", limit=10, after=after)
            assert end is None and [it.id for it in page + rest] == ids[:5].tolist()
            alice = compile_where({"u": "alice"})
            counts = (store.count_items(), store.count_items(namespace="n", where=alice),
                      store.count_items(namespace="x"))
            deleted = store.delete_where(namespace="n", where=alice)
            expired = store.delete_expired()
            remaining = store.list_items(namespace=None, limit=100)[0]
            answers.append((counts, len(deleted), len(expired), [(it.key, it.text, it.metadata) for it in remaining],
                            [(it.key, it.text, it.metadata) for it in page]))
            dropped = store.delete_where(namespace="n")
            assert len(dropped) == 3 and store.count_items() == 0
    assert answers[0] == answers[1], answers
    assert answers[0][0] == (5, 2, 0) and answers[0][1:3] == (2, 1)


def test_renew_and_update_ttl_match_the_sqlite_store(url: str, store_dir: Path, rng: np.random.Generator) -> None:
    """Store.renew renews the live expiring rows of the keys only; update(ttl=) sets or removes
    an expiry; both stores alike."""
    vectors = _unit(rng, 4)
    answers = []
    with PostgresStore.open(url, dim=DIM) as pg_store, Store.open(store_dir / "r.db", dim=DIM) as sqlite_store:
        for store in (pg_store, sqlite_store):
            now = time.time()
            ids, _, _, _ = store.upsert(vectors, keys=["a", "b", "forever", "gone"], namespace="r",
                                        expires_at=np.array([now + 60, now + 60, np.nan, now - 1]))
            renewed, ns_id = store.renew(["a", "forever", "gone", "absent"], "r", 600.0)
            assert renewed.tolist() == [ids[0]] and ns_id is not None
            assert store.renew(["a"], "nowhere", 600.0)[0].tolist() == []
            store.update(check_update("b", DIM, namespace="r", ttl=None))
            store.update(check_update("forever", DIM, namespace="r", ttl=5.0))
            with pytest.raises(UnknownKey):
                store.update(check_update("gone", DIM, namespace="r", ttl=5.0))
            a, b, forever = store.get(ids[:3])
            assert a.expires_at > now + 590 and b.expires_at is None and now + 4 < forever.expires_at < now + 60
            answers.append([it.key for it in store.list_items(namespace="r", limit=10)[0]])
    assert answers[0] == answers[1] == ["a", "b", "forever"]


def test_deletes_name_the_rows_that_had_expired_as_the_sqlite_store(url: str, store_dir: Path,
                                                                    rng: np.random.Generator) -> None:
    """``expired_out`` of delete, delete_keys and delete_where: the deleted rows that had expired
    (the sidecar does not count them as deleted), the same in both stores."""
    vectors = _unit(rng, 4)
    answers = []
    with PostgresStore.open(url, dim=DIM) as pg_store, Store.open(store_dir / "e.db", dim=DIM) as sqlite_store:
        for store in (pg_store, sqlite_store):
            got = []
            for ns in ("ids", "keys", "where"):
                ids, _, _, _ = store.upsert(vectors, keys=[f"k{i}" for i in range(4)], namespace=ns,
                                            metadata=[{"g": 1}] * 4,
                                            expires_at=np.array([time.time() - 1, np.nan, time.time() + 60, np.nan]))
                expired: list[int] = []
                if ns == "ids":
                    deleted = store.delete(ids, expired_out=expired)
                elif ns == "keys":
                    deleted = store.delete_keys(["k0", "k1", "k2"], ns, expired_out=expired)
                else:
                    deleted = store.delete_where(namespace=ns, where=compile_where({"g": 1}), expired_out=expired)
                got.append((len(deleted), [ids.tolist().index(i) for i in expired]))
            answers.append(got)
            store.delete_where(namespace=None)
    assert answers[0] == answers[1] == [(4, [0]), (3, [0]), (4, [0])], answers


def test_followers_apply_updates_scoped_deletes_and_expiries(url: str, sidecars: SidecarPool,
                                                             rng: np.random.Generator) -> None:
    a = Host(sidecars, url, unique_name("a"))
    b = Host(sidecars, url, unique_name("b"))
    vectors = _unit(rng, 20)
    metas = [{"g": i % 4} for i in range(20)]
    ids = a.client.add(vectors, keys=[f"k{i}" for i in range(20)], namespace="m", metadata=metas)
    model = {i: (v.astype(np.float64), "m", 0.0) for i, v in zip(ids.tolist(), vectors)}
    wait_until(lambda: b.ids() == set(model), "B to see A's adds")
    # An update of a vector through A: B serves the new one (and never both).
    new = _unit(rng, 1)[0]
    a.client.update("k3", namespace="m", vector=new, text="updated")
    model[int(ids[3])] = (new.astype(np.float64), "m", 0.0)

    def b_serves_the_update() -> bool:
        hit = b.client.recall(new, k=1, namespace="m")
        return hit.ids.tolist() == [ids[3]] and hit.scores[0] > 1 - 1e-5

    wait_until(b_serves_the_update, "B to serve A's update")
    assert b.client.get(keys=["k3"], namespace="m")[0].text == "updated"
    _check_recalls(b, model, rng, "m")
    # A scoped delete through B reaches A.
    assert b.client.delete(where={"g": 1}, namespace="m") == 5
    for i, m in zip(ids.tolist(), metas):
        if m["g"] == 1:
            model.pop(i)
    wait_until(lambda: a.ids() == set(model), "A to see B's scoped delete")
    _check_recalls(a, model, rng, None)
    # Expiring rows added through A: B stops serving them at their expiry, and one of the two
    # sweeps them from the database.
    short = a.client.add(_unit(rng, 3), namespace="m", ttl=1.5)
    expiry = a.client.get(ids=short[:1].tolist())[0].expires_at
    wait_until(lambda: set(short.tolist()) <= b.ids(), "B to see A's expiring adds")
    while time.time() <= expiry:
        time.sleep(0.01)
    for host in (a, b):
        assert not set(short.tolist()) & host.ids(), f"{host.name} served an expired memory"
        assert host.client.get(ids=short.tolist()) == [None] * 3
    with PostgresStore.open(url, readonly=True) as ro:
        wait_until(lambda: ro.count() == len(model), "the expired rows to leave the database")
    assert b.client.drop_namespace("m") == len(model)
    wait_until(lambda: a.ids() == set(), "A to see B's drop_namespace")
    with pytest.raises(InvalidArgument):
        a.client.delete(where={"g": {"$bad": 1}}, namespace="m")


def test_namespaces_of_255_bytes_on_postgresql_and_its_followers(url: str, sidecars: SidecarPool,
                                                                 rng: np.random.Generator) -> None:
    """Names that agree on their first 254 bytes are two namespaces in the database, in the sidecar
    that wrote them and in a follower that loaded them from it; 256 bytes are refused."""
    base = "users/alice/memories/" + "x" * 233
    names = [base + "a", base + "b", "日本" * 42 + "abc"]  # 255 UTF-8 bytes each
    assert [len(n.encode()) for n in names] == [255, 255, 255]
    with PostgresStore.open(url, dim=DIM) as store:
        for name in names:
            store.add(_unit(rng, 3), namespace=name, metadata=[{"n": i} for i in range(3)])
        for name in names:
            items, _ = store.list_items(namespace=name)
            assert {it.namespace for it in items} == {name} and len(items) == 3
            assert store.count_items(namespace=name, where=compile_where({"n": {"$gte": 1}})) == 2
        assert len(store.delete_where(namespace=names[0])) == 3 and store.count_items(namespace=names[1]) == 3
        with pytest.raises(InvalidArgument, match="255"):
            store.add(_unit(rng, 1), namespace="n" * 256)
    a = Host(sidecars, url, unique_name("a"))
    b = Host(sidecars, url, unique_name("b"))
    vectors = _unit(rng, 4)
    ids = a.client.add(vectors, namespace=names[0], keys=[f"k{i}" for i in range(4)])
    wait_until(lambda: set(ids.tolist()) <= b.ids(), "B to see A's adds")
    for host in (a, b):
        for name, want in ((names[0], set(ids.tolist())), (names[1], None)):
            hit = host.client.recall(vectors[0], k=10, namespace=name)
            assert want is None or set(hit.ids.tolist()) == want, (host.name, name)
            assert {it.namespace for it in host.client.get(ids=hit.ids.tolist())} == {name}
        assert host.client.count(namespace=names[1]) == 3 and host.client.get(keys=["k0"], namespace=names[1]) == [None]
