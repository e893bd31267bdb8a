"""update, list/count, scoped delete, drop_namespace and TTL (issue 22), against a real sidecar
process, the store alone, and the float64 reference.

Every random test prints its seed (KALOS_TEST_SEED replays it).
"""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from conftest import SidecarPool, _seed_value, short_tempdir, unique_name, wait_until
from reference import assert_topk_matches, eligible_mask, model_arrays

from kalos import Client, KalosError, UnknownKey
from kalos.errors import DimensionMismatch, InvalidArgument
from kalos.store.sqlite import Store
from kalos.validation import check_update
from kalos.where import compile_where

DIM = 8


class Memory:
    """A sidecar, a client, and the model of what must be served: id -> (vector, ns, created)."""

    def __init__(self, name: str, client: Client, store: Path, rng: np.random.Generator) -> None:
        self.name, self.client, self.store, self.rng = name, client, store, rng
        self.model: dict[int, tuple[np.ndarray, str, float]] = {}

    def add(self, n: int, namespace: str, *, keys: list[str] | None = None, **kwargs: object) -> np.ndarray:
        vectors = self.rng.standard_normal((n, DIM)).astype(np.float32)
        ids = self.client.add(vectors, keys=keys, namespace=namespace, **kwargs)
        for j, i in enumerate(ids.tolist()):
            created = self.model[i][2] if i in self.model else 0.0
            self.model[i] = (vectors[j].astype(np.float64), namespace, created)
        return ids

    def check(self, namespace: str | None, k: int = 5, context: str = "") -> None:
        ids, vectors, namespaces, created = model_arrays(self.model)
        eligible = eligible_mask(namespaces, created, namespace=namespace)
        queries = self.rng.standard_normal((4, DIM)).astype(np.float32)
        batch = self.client.recall_many(queries, k=k, namespace=namespace)
        assert_topk_matches(batch.ids, batch.scores, ids, vectors, queries, k, eligible, context=context)


@pytest.fixture
def memory(sidecars: SidecarPool) -> Iterator[Memory]:
    seed = _seed_value()
    print(f"seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    store_dir = short_tempdir("dm")
    name = unique_name("dm")
    try:
        sidecars.start(Path(store_dir) / "m.db", name=name, dim=DIM)
        with Client(name, timeout=5.0) as client:
            yield Memory(name, client, Path(store_dir) / "m.db", np.random.default_rng(seed))
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


# -- update --------------------------------------------------------------------------------------


def test_update_changes_only_what_is_given(memory):
    ids = memory.add(3, "u", keys=["a", "b", "c"], texts=["ta", "tb", "tc"],
                     metadata=[{"x": 1, "y": "keep"}, None, {"z": True}], created_at=1000.0)
    t0 = time.time()
    assert memory.client.update("a", namespace="u", text="moved to Berlin") == ids[0]
    a, b = memory.client.get(keys=["a", "b"], namespace="u")
    assert (a.text, a.metadata, a.created_at, a.key) == ("moved to Berlin", {"x": 1, "y": "keep"}, 1000.0, "a")
    assert t0 - 1 <= a.updated_at <= time.time() + 1 and b.updated_at is None
    memory.check("u", context="after a text update: the vectors are as they were")

    memory.client.update("a", namespace="u", metadata={"x": 2, "new": [1, 2]}, merge=True)
    assert memory.client.get(keys=["a"], namespace="u")[0].metadata == {"x": 2, "y": "keep", "new": [1, 2]}
    memory.client.update("a", namespace="u", metadata={"only": "this"})
    assert memory.client.get(keys=["a"], namespace="u")[0].metadata == {"only": "this"}
    memory.client.update("b", namespace="u", metadata={"from": "nothing"}, merge=True)
    assert memory.client.get(keys=["b"], namespace="u")[0].metadata == {"from": "nothing"}
    memory.client.update(int(ids[2]), text=None, metadata=None)  # by id; None clears
    c = memory.client.get(ids=[int(ids[2])])[0]
    assert (c.text, c.metadata, c.key, c.namespace) == (None, None, "c", "u")
    assert memory.client.stats()["namespaces"]["u"] == 3


def test_update_of_the_vector_is_what_recall_serves(memory):
    ids = memory.add(30, "v", keys=[f"k{i}" for i in range(30)])
    memory.add(10, "other")
    for i in (0, 7, 29):
        old = memory.model[int(ids[i])][0].astype(np.float32)
        new = memory.rng.standard_normal(DIM).astype(np.float32)
        assert memory.client.update(f"k{i}", namespace="v", vector=new * 3.0) == ids[i]  # any norm: normalised
        memory.model[int(ids[i])] = (new.astype(np.float64), "v", 0.0)
        hit = memory.client.recall(new, k=1, namespace="v")
        assert hit.ids[0] == ids[i] and hit.scores[0] == pytest.approx(1.0, abs=1e-5)
        hit = memory.client.recall(old, k=30, namespace="v")
        assert hit.ids.tolist().count(int(ids[i])) == 1, "one row per id: the old one is gone"
    memory.check("v", context="after vector updates")
    memory.check(None, context="after vector updates, every namespace")
    assert memory.client.stats()["count"] == 40


def test_a_recall_during_vector_updates_sees_the_old_or_the_new_never_neither(memory):
    (item,) = memory.add(1, "swap", keys=["only"]).tolist()
    versions = np.stack([memory.model[item][0].astype(np.float32), memory.rng.standard_normal(DIM).astype(np.float32)])
    query = memory.rng.standard_normal(DIM).astype(np.float32)
    unit = versions / np.linalg.norm(versions, axis=1, keepdims=True)
    allowed = unit.astype(np.float64) @ (query / np.linalg.norm(query))
    stop, seen, problems = threading.Event(), [], []

    def recaller() -> None:
        with Client(memory.name, timeout=5.0) as reader:
            while not stop.is_set():
                hit = reader.recall(query, k=1, namespace="swap")
                if hit.ids.tolist() != [item] or np.min(np.abs(allowed - hit.scores[0])) > 1e-5:
                    problems.append((hit.ids.tolist(), hit.scores.tolist()))
                seen.append(1)

    thread = threading.Thread(target=recaller)
    thread.start()
    try:
        for n in range(60):
            memory.client.update("only", namespace="swap", vector=versions[n % 2])
    finally:
        stop.set()
        thread.join(30)
    assert seen and not problems, problems[:5]


def test_update_of_a_missing_key_is_unknown_key_and_bad_updates_change_nothing(memory):
    memory.add(1, "here", keys=["k"], texts=["original"], metadata=[{"a": 1}])
    for call in [
        lambda: memory.client.update("nope", namespace="here", text="x"),
        lambda: memory.client.update("k", namespace="elsewhere", text="x"),  # the key lives in another namespace
        lambda: memory.client.update("k", text="x"),  # ... and "default" is another namespace
        lambda: memory.client.update(10**12, text="x"),
    ]:
        with pytest.raises(UnknownKey) as caught:
            call()
        assert isinstance(caught.value, KeyError) and isinstance(caught.value, KalosError)
        assert "no memory has" in str(caught.value) and not str(caught.value).startswith("'")
    cases = [
        (dict(), InvalidArgument, "nothing to change"),
        (dict(metadata={"a": 2}, merge="yes"), InvalidArgument, "merge must be True or False"),
        (dict(metadata=None, merge=True), InvalidArgument, "merges a dict"),
        (dict(text="x", merge=True), InvalidArgument, "needs metadata="),
        (dict(metadata={1: "int key"}), InvalidArgument, "not a str"),
        (dict(metadata={"f": float("nan")}), InvalidArgument, "not JSON-serialisable"),
        (dict(metadata="a string"), InvalidArgument, "must be a dict or None"),
        (dict(text=7), InvalidArgument, "must be a str or None"),
        (dict(vector=None), InvalidArgument, "always has a vector"),
        (dict(vector=np.zeros(DIM)), InvalidArgument, "all zeros"),
        (dict(vector=np.full(DIM, np.nan)), InvalidArgument, "NaN"),
        (dict(vector=np.ones(DIM + 1)), DimensionMismatch, "dimension"),
        (dict(vector=np.ones((2, DIM))), InvalidArgument, "one vector"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            memory.client.update("k", namespace="here", **kwargs)
    for item, message in [(1.5, "key \\(str\\) or an id"), (True, "key \\(str\\) or an id"), ("", "empty"),
                          ("x" * 300, "300 UTF-8 bytes")]:
        with pytest.raises(InvalidArgument, match=message):
            memory.client.update(item, namespace="here", text="x")
    (item,) = memory.client.get(keys=["k"], namespace="here")
    assert (item.text, item.metadata, item.updated_at) == ("original", {"a": 1}, None)


def test_the_sidecar_itself_checks_an_update(memory):
    """A client that skips its own checks: the sidecar refuses the same things."""
    memory.add(1, "here", keys=["k"])
    for message, error, text in [
        ({"op": "update", "namespace": "here", "text": "x"}, InvalidArgument, "a key or an id"),
        ({"op": "update", "namespace": "here", "key": "k", "id": 1, "text": "x"}, InvalidArgument, "a key or an id"),
        ({"op": "update", "namespace": "here", "key": "k"}, InvalidArgument, "nothing to change"),
        ({"op": "update", "namespace": "here", "key": "missing", "text": "x"}, UnknownKey, "no memory"),
        ({"op": "update", "namespace": "here", "key": "k", "metadata": [1]}, InvalidArgument, "dict or None"),
    ]:
        with pytest.raises(error, match=text):
            memory.client._control(message)
    assert memory.client.get(keys=["k"], namespace="here")[0].updated_at is None


def test_async_client_update_list_count_delete_where(memory):
    from kalos import AsyncClient

    memory.add(1, "a", keys=["k"], texts=["before"])

    async def main() -> None:
        async with AsyncClient(memory.name, timeout=5.0) as client:
            await client.update("k", namespace="a", text="after", metadata={"m": 1})
            with pytest.raises(UnknownKey):
                await client.update("absent", namespace="a", text="x")
            await client.add(np.ones((2, DIM)), namespace="a", metadata=[{"m": 2}, {"m": 1}], ttl=[None, 60])
            page = await client.list(namespace="a", where={"m": 1})
            assert [it.text for it in page] == ["after", None] and page.next_cursor is None
            assert page.items[1].expires_at is not None
            assert await client.count(namespace="a", where={"m": {"$gte": 1}}) == 3
            assert await client.delete(where={"m": 2}, namespace="a") == 1
            assert await client.drop_namespace("a") == 2

    asyncio.run(main())
    assert memory.client.count(namespace="a") == 0


class _TableEmbedder:
    """A Kalos embedder (dim, name, embed) of fixed random vectors, one per text."""

    name = "table"
    dim = DIM

    def __init__(self, rng: np.random.Generator, texts: list[str]) -> None:
        self.table = {t: rng.standard_normal(DIM).astype(np.float32) for t in texts}

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.table[t] for t in texts])


def test_text_hits_carry_key_and_updated_at(memory):
    from kalos import AsyncClient

    embedder = _TableEmbedder(memory.rng, ["keyed", "revised", "plain"])
    with Client(memory.name, timeout=5.0, embedder=embedder) as client:
        client.add(embedder.embed(["keyed"]), texts=["keyed"], keys=["k"], namespace="h")
        client.add(embedder.embed(["plain"]), texts=["plain"], namespace="h")
        [hit] = client.recall_text("keyed", k=1, namespace="h")
        assert (hit.text, hit.key, hit.updated_at) == ("keyed", "k", None)
        t0 = time.time()
        client.add(embedder.embed(["revised"]), texts=["revised"], keys=["k"], namespace="h")  # upsert
        hits = client.recall_text("revised", k=2, namespace="h")
        assert [(h.text, h.key) for h in hits] == [("revised", "k"), ("plain", None)]
        assert t0 - 1 <= hits[0].updated_at <= time.time() + 1 and hits[1].updated_at is None
        assert hits[0].created_at <= t0 and hits[0].id == client.get(keys=["k"], namespace="h")[0].id

    async def main() -> list:
        async with AsyncClient(memory.name, timeout=5.0, embedder=embedder) as client:
            return await client.recall_text("revised", k=2, namespace="h")

    hits = asyncio.run(main())
    assert [(h.text, h.key, h.updated_at is None) for h in hits] == [("revised", "k", False), ("plain", None, True)]


def test_get_with_vectors_by_keys_or_by_ids_never_both(memory):
    ids = memory.add(3, "g", keys=["a", "b", "c"])
    want = {i: v / np.linalg.norm(v) for i, (v, _ns, _t) in memory.model.items()}
    by_key = memory.client.get(keys=["c", "absent", "a"], namespace="g", with_vectors=True)
    by_id = memory.client.get(ids=[int(ids[1]), 10**12, int(ids[1])], with_vectors=True)
    assert [it and it.key for it in by_key] == ["c", None, "a"] and [it and it.key for it in by_id] == ["b", None, "b"]
    for item in by_key + by_id:
        if item is not None:
            assert item.vector.dtype == np.float32 and item.vector.shape == (DIM,)
            np.testing.assert_allclose(item.vector, want[item.id], atol=1e-6)
    assert memory.client.get(keys=["g-other"], namespace="elsewhere", with_vectors=True) == [None]
    for kwargs in (dict(keys=["a"], ids=[int(ids[0])]), dict()):
        with pytest.raises(InvalidArgument, match="one of them"):
            memory.client.get(namespace="g", with_vectors=True, **kwargs)
    with pytest.raises(InvalidArgument, match="one of them"):  # the sidecar checks too
        memory.client._control({"op": "get", "keys": ["a"], "ids": [int(ids[1])], "namespace": "g"})


def test_store_update_is_durable_and_checked(tmp_path):
    path = tmp_path / "s.db"
    with Store.open(path, dim=4) as store:
        ids, _, _, _ = store.upsert(np.eye(4, dtype=np.float32)[:2], keys=["a", "b"], namespace="n",
                                    metadata=[{"x": 1}, None])
        before = store.get([int(ids[0])])[0]
        got = store.update(check_update("a", 4, namespace="n", vector=np.eye(4)[3], metadata={"y": 2}, merge=True))
        assert got == (int(ids[0]), store.namespaces()["n"], before.created_at)
        with pytest.raises(UnknownKey):
            store.update(check_update("a", 4, namespace="default", text="x"))
        seq = store._write_seq
    with Store.open(path, readonly=True) as store:
        (item,) = store.get([int(ids[0])])
        assert item.metadata == {"x": 1, "y": 2} and item.updated_at is not None
        vectors = {i: v.copy() for batch in store.iter_rows() for i, v in zip(batch[0].tolist(), batch[1])}
        assert vectors[int(ids[0])].tolist() == [0, 0, 0, 1]
    with Store.open(path) as store:
        assert store._write_seq == seq, "the refused update wrote no transaction"


# -- list, count, scoped delete, drop_namespace ---------------------------------------------------


def _tagged(memory: Memory, n: int, namespace: str) -> tuple[np.ndarray, list[dict]]:
    metas = [{"user": str(memory.rng.choice(["alice", "bob", "carol"])), "n": int(i),
              "even": bool(i % 2 == 0)} for i in range(n)]
    return memory.add(n, namespace, metadata=metas), metas


def _all_pages(client: Client, limit: int, **kwargs: object) -> list:
    items, cursor, pages = [], None, 0
    while True:
        page = client.list(limit=limit, cursor=cursor, **kwargs)
        assert len(page) <= limit
        items += page.items
        pages += 1
        cursor = page.next_cursor
        if cursor is None:
            return items
        assert pages < 10_000


def test_list_and_count_page_through_every_matching_memory_once(memory):
    a_ids, a_meta = _tagged(memory, 130, "a")
    b_ids, b_meta = _tagged(memory, 45, "b")
    everything = dict(zip(a_ids.tolist(), a_meta)) | dict(zip(b_ids.tolist(), b_meta))
    for limit in (1, 7, 100, 1000):
        got = _all_pages(memory.client, limit, namespace="a")
        assert [it.id for it in got] == a_ids.tolist()
    assert [it.id for it in _all_pages(memory.client, 33)] == sorted(everything)
    assert memory.client.count() == 175 and memory.client.count(namespace="b") == 45
    for where in [{"user": "alice"}, {"n": {"$gte": 100}}, {"$or": [{"even": True}, {"user": "bob"}]},
                  {"user": {"$nin": ["alice", "bob"]}, "n": {"$lt": 30}}, {"missing": {"$exists": True}}, {}]:
        clause = compile_where(where)
        for namespace in (None, "a"):
            expected = [i for i, m in sorted(everything.items())
                        if clause.matches(m) and (namespace is None or i in set(a_ids.tolist()))]
            got = _all_pages(memory.client, 10, namespace=namespace, where=where)
            assert [it.id for it in got] == expected, (where, namespace)
            assert memory.client.count(namespace=namespace, where=where) == len(expected)
    page = memory.client.list(namespace="b", limit=3)
    assert [(it.namespace, it.metadata) for it in page] == [("b", m) for m in b_meta[:3]]
    assert memory.client.list(namespace="never-used").items == [] and memory.client.count(namespace="never-used") == 0
    for kwargs, message in [(dict(limit=0), "limit must be"), (dict(limit=1001), "limit must be"),
                            (dict(limit=True), "limit must be"), (dict(cursor="garbage"), "not one that list"),
                            (dict(cursor=5), "not one that list"), (dict(where={"$regex": 1}), "where"),
                            (dict(namespace=""), "namespace must not be empty")]:
        with pytest.raises(InvalidArgument, match=message):
            memory.client.list(**kwargs)
    with pytest.raises(InvalidArgument, match="where"):
        memory.client.count(where={"n": {"$bogus": 1}})
    # The sidecar checks what a client that skips its own checks sends.
    for message, text in [({"op": "list", "limit": 0}, "limit"), ({"op": "list", "after": -1}, "after"),
                          ({"op": "list", "where": "x"}, "where"), ({"op": "count", "namespace": ""}, "namespace")]:
        with pytest.raises(InvalidArgument, match=text):
            memory.client._control(message)


def test_list_is_stable_under_concurrent_writes(memory):
    """Writes between every two pages (another client's: deletes of memories already listed and
    still ahead, adds, upserts of listed and unlisted keys, updates), and a writer thread besides:
    every memory present throughout is listed exactly once."""
    ids = memory.add(300, "s", keys=[f"k{i}" for i in range(300)])
    doomed = sorted(ids[1::3].tolist())  # deleted while the listing runs, from both ends
    throughout = set(ids.tolist()) - set(doomed)
    stop, errors = threading.Event(), []

    def writer() -> None:
        try:
            with Client(memory.name, timeout=5.0) as w:
                rng = np.random.default_rng(2)
                while not stop.is_set():
                    w.add(rng.standard_normal((1, DIM)), keys=[f"k{3 * int(rng.integers(100))}"], namespace="s")
                    w.update(int(rng.choice(sorted(throughout))), metadata={"thread": True})
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    seen: list[int] = []
    cursor, rounds, deleted = None, 0, set()
    rng = np.random.default_rng(1)
    try:
        with Client(memory.name, timeout=5.0) as w:
            while True:
                page = memory.client.list(namespace="s", limit=7, cursor=cursor)
                seen += [it.id for it in page]
                cursor = page.next_cursor
                if cursor is None:
                    break
                rounds += 1
                for victim in doomed[:1] + doomed[-1:]:
                    w.delete(ids=[victim])
                    deleted.add(victim)
                doomed = doomed[1:-1]
                w.add(rng.standard_normal((1, DIM)), namespace="s")  # a new id: after every listed one
                w.add(rng.standard_normal((1, DIM)), keys=[f"k{int(rng.integers(300))}"], namespace="s")  # same id
                w.update(int(rng.choice(sorted(throughout))), metadata={"touched": True})
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors
    assert rounds >= 40 and len(deleted) >= 80, (rounds, len(deleted))
    assert len(seen) == len(set(seen)), "an item was listed twice"
    assert throughout <= set(seen), f"skipped: {sorted(throughout - set(seen))[:10]}"
    assert seen == sorted(seen)


def test_delete_by_where_and_drop_namespace(memory):
    a_ids, a_meta = _tagged(memory, 60, "a")
    b_ids, b_meta = _tagged(memory, 40, "b")
    keep = memory.add(5, "c")
    alice_a = {i for i, m in zip(a_ids.tolist(), a_meta) if m["user"] == "alice"}
    assert memory.client.delete(where={"user": "alice"}, namespace="a") == len(alice_a)
    for i in alice_a:
        del memory.model[i]
    memory.check("a", context="after delete where in a")
    memory.check(None, context="after delete where, everywhere")
    assert memory.client.count(namespace="a", where={"user": "alice"}) == 0
    assert memory.client.count(namespace="b", where={"user": "alice"}) == sum(m["user"] == "alice" for m in b_meta)
    # namespace=None: every namespace.
    big = {i for i, m in zip(a_ids.tolist() + b_ids.tolist(), a_meta + b_meta) if m["n"] >= 35 and i in memory.model}
    assert memory.client.delete(where={"n": {"$gte": 35}}, namespace=None) == len(big)
    for i in big:
        del memory.model[i]
    memory.check(None, context="after delete where everywhere")
    assert memory.client.delete(where={"n": {"$gte": 35}}, namespace=None) == 0
    # Bad calls change nothing.
    before = memory.client.count()
    for kwargs, message in [(dict(where={"n": {"$near": 1}}), "where"), (dict(where=[1]), "where must be a dict"),
                            (dict(keys=["x"], where={}), "one of them"), (dict(ids=[1], where={}), "one of them"),
                            (dict(keys=["x"], namespace=None), "namespace=None")]:
        with pytest.raises(InvalidArgument, match=message):
            memory.client.delete(**kwargs)
    with pytest.raises(InvalidArgument, match="exactly one"):
        memory.client._control({"op": "delete", "ids": [1], "where": {}})
    assert memory.client.count() == before
    # drop_namespace: every memory of it, nothing else; the name may be used again.
    in_b = sum(1 for _, ns, _ in memory.model.values() if ns == "b")
    assert memory.client.drop_namespace("b") == in_b > 0
    memory.model = {i: v for i, v in memory.model.items() if v[1] != "b"}
    assert memory.client.stats()["namespaces"]["b"] == 0 and memory.client.count(namespace="c") == 5
    assert len(memory.client.recall(np.ones(DIM, np.float32), k=3, namespace="b")) == 0
    memory.check(None, context="after drop_namespace")
    assert memory.client.drop_namespace("b") == 0
    again = memory.add(2, "b")
    assert memory.client.recall(memory.model[int(again[0])][0].astype(np.float32), k=1, namespace="b").ids[0] == again[0]
    assert [it.id for it in memory.client.get(ids=keep.tolist())] == keep.tolist()
    with pytest.raises(InvalidArgument, match="namespace"):
        memory.client.drop_namespace("")


def test_kalos_list_and_count(memory):
    import json
    import sys

    from conftest import run_guarded

    ids, metas = _tagged(memory, 5, "cli")
    base = [sys.executable, "-m", "kalos"]
    result = run_guarded(base + ["list", "--name", memory.name, "--namespace", "cli", "--limit", "2", "--json"])
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["id"] for row in lines[:-1]] == ids[:2].tolist() and lines[-1]["next_cursor"]
    result = run_guarded(base + ["list", "--name", memory.name, "--namespace", "cli", "--limit", "2", "--all",
                                 "--cursor", lines[-1]["next_cursor"]])
    assert result.returncode == 0, result.stderr
    assert [int(line.split("\t")[0]) for line in result.stdout.splitlines()] == ids[2:].tolist()
    expected = sum(m["user"] == "bob" for m in metas)
    result = run_guarded(base + ["count", "--name", memory.name, "--where", '{"user": "bob"}'])
    assert result.returncode == 0 and result.stdout.strip() == str(expected), result.stderr
    result = run_guarded(base + ["count", "--name", memory.name, "--where", '{"user": {"$like": 1}}'])
    assert result.returncode == 2 and "where" in result.stderr
    # kalos add --ttl: the rows expire.
    path = memory.store.parent / "t.jsonl"
    path.write_text(json.dumps({"vector": [1.0] * DIM, "text": "brief", "namespace": "cli-ttl"}) + "\n")
    for ttl, code in [("-1", 2), ("0.5", 0)]:
        result = run_guarded(base + ["add", str(path), "--name", memory.name, "--ttl", ttl])
        assert result.returncode == code, result.stderr
    (item,) = memory.client.list(namespace="cli-ttl").items
    assert item.text == "brief" and item.expires_at is not None
    _wait_past(item.expires_at)
    assert memory.client.count(namespace="cli-ttl") == 0
    # Namespaces of 255 UTF-8 bytes through the shell: add, recall, list and count; 256 refused.
    long_a, long_b = ("日本" * 42 + "ab" + tail for tail in ("a", "b"))
    assert len(long_a.encode()) == len(long_b.encode()) == 255
    vector = memory.rng.standard_normal(DIM)
    path.write_text("".join(json.dumps({"vector": vector.tolist(), "text": f"in {ns[-1]}", "namespace": ns},
                                       ensure_ascii=False) + "\n" for ns in (long_a, long_b)), encoding="utf-8")
    result = run_guarded(base + ["add", str(path), "--name", memory.name])
    assert result.returncode == 0, result.stderr
    result = run_guarded(base + ["recall", "--name", memory.name, "--namespace", long_b, "-k", "3", "--json",
                                 "--vector", ",".join(f"{x:.6f}" for x in vector)])
    assert result.returncode == 0, result.stderr
    assert [(h["namespace"], h["text"]) for h in json.loads(result.stdout)] == [(long_b, "in b")]
    result = run_guarded(base + ["list", "--name", memory.name, "--namespace", long_a, "--json"])
    assert result.returncode == 0, result.stderr
    assert [json.loads(line).get("text") for line in result.stdout.splitlines()] == ["in a", None]
    result = run_guarded(base + ["count", "--name", memory.name, "--namespace", long_a + "x"])
    assert result.returncode == 2 and "256 UTF-8 bytes" in result.stderr, result.stderr


# -- namespaces of up to 255 bytes -------------------------------------------------------------------


def test_namespaces_of_255_bytes_are_served_apart(memory):
    from kalos.ipc.protocol import NAMESPACE_BYTES
    from kalos.validation import MAX_NAMESPACE_BYTES

    assert MAX_NAMESPACE_BYTES == 255 and NAMESPACE_BYTES == 256
    prefix = "users/alice/memories/" + "x" * 60  # names that agree on their first 64 bytes and more
    names = [prefix + "a" * (255 - len(prefix)), prefix + "b" * (255 - len(prefix)), prefix + "é" * 40,
             "日本" * 42 + "abc"]  # 255 bytes of 3-byte characters and ASCII
    assert [len(n.encode()) for n in names] == [255, 255, 161, 255]
    for name in names:
        memory.add(6, name, keys=[f"{name[-3:]}{i}" for i in range(6)])
    for name in names:
        memory.check(name, context=f"namespace of {len(name.encode())} bytes")
        single = memory.client.recall(memory.rng.standard_normal(DIM).astype(np.float32), k=3, namespace=name)
        assert {it.namespace for it in memory.client.get(ids=single.ids.tolist())} == {name}
        assert memory.client.count(namespace=name) == 6 and memory.client.stats()["namespaces"][name] == 6
    assert memory.client.update(f"{names[1][-3:]}0", namespace=names[1], text="t") >= 1
    with pytest.raises(UnknownKey):  # the same key in the namespace that differs in its last bytes only
        memory.client.update(f"{names[1][-3:]}0", namespace=names[0], text="t")
    assert memory.client.drop_namespace(names[0]) == 6 and memory.client.count(namespace=names[1]) == 6
    with pytest.raises(InvalidArgument, match="256 UTF-8 bytes"):
        memory.client.add(np.ones((1, DIM)), namespace="n" * 256)


# -- TTL ---------------------------------------------------------------------------------------------


class _Clock:
    """A stand-in for the store module's ``time``: ``time()`` returns what the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def test_store_expiry_at_its_boundary(tmp_path, monkeypatch):
    import kalos.store.sqlite

    clock = _Clock(1_000_000.0)
    monkeypatch.setattr(kalos.store.sqlite, "time", clock)
    rng = np.random.default_rng(_seed_value())
    with Store.open(tmp_path / "t.db", dim=4) as store:
        vectors = rng.standard_normal((3, 4)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        ids, _, _ = store.add(vectors, namespace="n", metadata=[{"g": 1}] * 3,
                              expires_at=np.array([clock.now + 10, np.nan, clock.now + 20]))
        keyed, _, _, _ = store.upsert(vectors[:1], keys=["k"], namespace="n", expires_at=np.array([clock.now + 10]))
        assert [it.expires_at for it in store.get(ids)] == [clock.now + 10, None, clock.now + 20]
        clock.now += 10 - 1e-6  # just before: everything is there
        assert all(store.get(ids)) and store.get_keys(["k"], "n")[0] is not None
        assert store.count_items(namespace="n") == 4 and store.count_items(where=compile_where({"g": 1})) == 3
        assert store.namespace_counts()["n"] == 4
        assert len(store.delete_expired()) == 0
        clock.now += 1e-6  # at expires_at: gone from get, get_keys, list, count and update at once
        assert [it is None for it in store.get(ids)] == [True, False, False]
        assert store.get_keys(["k"], "n") == [None]
        assert [it.id for it in store.list_items(namespace="n")[0]] == [int(ids[1]), int(ids[2])]
        assert store.count_items(namespace="n") == 2 and store.count_items(where=compile_where({"g": 1})) == 2
        assert store.namespace_counts()["n"] == 2, "stats' counts leave out what expired (not yet swept)"
        with pytest.raises(UnknownKey):
            store.update(check_update("k", 4, namespace="n", text="x"))
        # An upsert of the expired key: a new memory under its id, which expires no more.
        again, _, created, replaced = store.upsert(vectors[1:2], keys=["k"], namespace="n", created_at=5.0)
        assert again.tolist() == keyed.tolist() and replaced.tolist() == [True] and created.tolist() == [5.0]
        (item,) = store.get_keys(["k"], "n")
        assert (item.created_at, item.updated_at, item.expires_at) == (5.0, None, None)
        assert store.delete_expired().tolist() == [int(ids[0])]
        assert store.delete_expired().tolist() == []
        clock.now += 10
        assert store.delete_expired().tolist() == [int(ids[2])]
        assert store.expiries()[0].tolist() == []
        for bad, message in [(np.array([1.0, 2.0]), "shape"), (np.array([np.inf, 1, 1]), "finite")]:
            with pytest.raises(InvalidArgument, match=message):
                store.add(vectors, namespace="n", expires_at=bad)
        assert store.count() == 2


def test_check_ttl():
    from kalos.validation import check_ttl

    assert check_ttl(None, 3) is None and check_ttl([None, None], 2) is None
    assert check_ttl(2, 2).tolist() == [2.0, 2.0]
    got = check_ttl([1.5, None], 2)
    assert got[0] == 1.5 and np.isnan(got[1])
    for ttl, message in [(0, "> 0"), (-1, "> 0"), (float("nan"), "> 0"), (float("inf"), "> 0"), (True, "number"),
                         ("5", "seconds"), ([1], "1 entries for 2"), ([1, "x"], r"ttl\[1\]"), ({1, 2}, "seconds"),
                         ([1, 0], r"ttl\[1\] must be a finite"), (10**400, "finite"),
                         ([1, 10**400], r"ttl\[1\] must be a finite")]:
        with pytest.raises(InvalidArgument, match=message):
            check_ttl(ttl, 2)


def _wait_past(t: float) -> None:
    while time.time() <= t:
        time.sleep(max(0.0, min(0.01, t - time.time())))


def test_expired_memories_are_never_served_from_the_moment_they_expire(memory):
    ids = memory.add(3, "ttl", keys=["a", "b", "c"], ttl=[1.0, None, 1.5], metadata=[{"g": 1}] * 3)
    forever = memory.add(2, "ttl")
    items = memory.client.get(ids=ids.tolist())
    assert items[1].expires_at is None and items[0].expires_at < items[2].expires_at
    a_vector = memory.model[int(ids[0])][0].astype(np.float32)
    # Before: served by every path (a recall of its own vector finds it first).
    while time.time() < items[0].expires_at - 0.2:
        assert memory.client.recall(a_vector, k=1, namespace="ttl").ids.tolist() == [ids[0]]
        time.sleep(0.05)
    _wait_past(items[0].expires_at)
    # From expires_at on: no recall, get, list or count returns it (no waiting for a sweep).
    assert int(ids[0]) not in memory.client.recall(a_vector, k=5, namespace="ttl").ids.tolist()
    assert memory.client.get(keys=["a"], namespace="ttl") == [None]
    assert int(ids[0]) not in [it.id for it in memory.client.list(namespace="ttl")]
    assert memory.client.count(namespace="ttl", where={"g": 1}) == 2
    del memory.model[int(ids[0])]
    memory.check("ttl", context="after the first expiry")
    with pytest.raises(UnknownKey):
        memory.client.update("a", namespace="ttl", text="too late")
    # An upsert of b with a ttl makes it expire; one of c without a ttl keeps it for ever.
    memory.add(1, "ttl", keys=["b"], ttl=0.5)
    memory.add(1, "ttl", keys=["c"])
    b_expiry = memory.client.get(keys=["b"], namespace="ttl")[0].expires_at
    _wait_past(max(b_expiry, items[2].expires_at))
    del memory.model[int(ids[1])]
    assert [it is None for it in memory.client.get(keys=["b", "c"], namespace="ttl")] == [True, False]
    memory.check("ttl", context="after the upserts' expiries")
    assert memory.client.count(namespace="ttl") == 3
    # The sweep deletes them from the store too, in the background.
    def swept() -> bool:
        with Store.open(memory.store, readonly=True) as store:
            return store.count() == 3

    wait_until(swept, "the expired rows to leave the store", timeout=10)
    assert memory.client.stats()["count"] == 3
    assert [it.id for it in memory.client.get(ids=forever.tolist())] == forever.tolist()
    for ttl, message in [(0, "> 0"), ([1.0], "1 entries for 2"), ("1", "seconds")]:
        with pytest.raises(InvalidArgument, match=message):
            memory.client.add(np.ones((2, DIM)), namespace="ttl", ttl=ttl)
    with pytest.raises(InvalidArgument, match="> 0"):  # the sidecar checks too
        from kalos.ipc.control import array_blob

        spec, blob = array_blob(np.ones((1, DIM), np.float32), "float32")
        memory.client._control({"op": "add", "namespace": "ttl", "vectors": spec, "ttl": [-1]}, blob)
    assert memory.client.count(namespace="ttl") == 3
    # With no recall at all, the expirer thread tombstones rows at their expiry: stats does not
    # expire anything.
    before = memory.client.stats()["count"]
    quiet = memory.client.add(np.ones((2, DIM)), namespace="quiet", ttl=0.3)
    _wait_past(memory.client.get(ids=quiet[:1].tolist())[0].expires_at)
    wait_until(lambda: memory.client.stats()["count"] == before, "the expirer to tombstone the rows", timeout=5)


class _PollingKernel:
    """Stands in for the GPU's slot server (CUDA only), which answers single recalls without a
    sweep pass and knows nothing of expiries: polling until stopped; records when it stops and starts."""

    served = 0

    def __init__(self, n_slots: int) -> None:
        self.handed = np.zeros(n_slots, np.uint64)  # nothing handed to the host
        self.in_use = np.zeros(n_slots, np.int64)  # (the channel mirrors its slot table here)
        self.taken = np.zeros(n_slots, np.int64)  # (no round holds a slot)
        self.host_words = np.zeros(8, np.int64)  # (it writes no news: the sweep looks once a wait)
        self.on = True
        self.stops: list[float] = []
        self.starts: list[float] = []

    def running(self) -> bool:
        return self.on

    @property
    def stopped(self) -> bool:
        return not self.on

    def stop(self) -> None:
        if self.on:
            self.stops.append(time.time())
        self.on = False

    def start(self, active: np.ndarray) -> None:
        self.on = True
        self.starts.append(time.time())

    def set_namespaces(self, names: object) -> None:
        pass

    def forget(self, slot: int) -> None:
        pass


def test_gpu_polling_stops_before_an_expiry_and_stays_off_until_it_passed(runtime_dir, rng):
    """The polling kernel cannot tell an expired row, so the sweep stops it just before the first
    expiry and answers itself (tombstoning the row at its expires_at) until that has passed."""
    import os

    from kalos.ipc.channel import wake_pair
    from kalos.ipc.control import array_blob
    from kalos.server.expirer import _EXPIRY_LEAD_S
    from kalos.server.sidecar import Sidecar, SidecarConfig

    directory = short_tempdir("gpx")
    sidecar = Sidecar(SidecarConfig(store=os.path.join(directory, "s.db"), name=unique_name("gpx"), dim=DIM,
                                    device="cpu", slots=4))
    thread = None
    try:
        vectors = rng.standard_normal((2, DIM)).astype(np.float32)
        spec, blob = array_blob(vectors, "float32")
        _, out = sidecar._control._op_add({"vectors": spec, "namespace": "t", "ttl": [1.0, None]}, bytearray(blob))
        doomed, kept = np.frombuffer(out, np.int64).tolist()
        expires_at = sidecar._expirer.schedule.expires_at(doomed)
        # A row that was to expire first, upserted since without a ttl: its stale heap entry
        # must not stop the polling.
        for ttl in ([0.3], None):
            spec, blob = array_blob(vectors[1:], "float32")
            sidecar._control._op_add({"vectors": spec, "namespace": "u", "keys": ["s"], "ttl": ttl}, bytearray(blob))
        assert sidecar._expirer.schedule.earliest() == expires_at  # the re-timed row counts no more
        kernel = _PollingKernel(sidecar.layout.n_slots)
        channel = sidecar.channel
        sidecar._polling.install(kernel, channel)  # polling, as after a recall
        thread = threading.Thread(target=sidecar._recall_loop._sweep_until_stopped, args=(channel,), daemon=True)
        thread.start()
        wait_until(lambda: kernel.stops, "the sweep to stop the polling kernel", timeout=5)
        assert expires_at - 0.5 < kernel.stops[0] < expires_at, (kernel.stops[0] - expires_at, _EXPIRY_LEAD_S)
        # A recall now, before the expiry: the sweep answers it and leaves the kernel off.
        slot = channel.take_slot(wake_pair()[0])
        view = channel.slots[slot]
        view.op[0], view.k[0], view.n_queries[0], view.flags[0] = 1, 2, 1, 0
        view.namespace[0], view.namespace_len[0] = b"t", 1
        view.queries[0] = vectors[0]
        seq = 0

        def recall() -> list[int]:
            nonlocal seq
            seq += 1
            view.req_seq[0] = seq
            channel.ring()  # as a client's ring does when the sweep sleeps
            wait_until(lambda: int(view.resp_seq[0]) == seq, "the sweep's answer", timeout=5)
            return [i for i in view.ids[0, :2].tolist() if i >= 0]

        if time.time() < expires_at:
            assert doomed in recall()
        assert not kernel.starts, "the kernel was started again before the expiry"
        _wait_past(expires_at)
        assert recall() == [kept], "the sweep's pass at the expiry tombstoned the row"
        assert kernel.starts, "with no expiry ahead the sweep starts the kernel again"
        assert kernel.starts[0] >= expires_at
    finally:
        sidecar._stopping.set()
        if thread is not None:
            thread.join(10)
        sidecar.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_an_add_that_fits_stops_the_gpu_polling_once_and_one_that_grows_the_engine_twice(rng):
    """The polling kernel reads the engine's rows, so every add stops it before the engine takes
    its rows. Making room before the store commits (issue 19) moves the columns only when the
    engine grows: only then does it stop the kernel too, so a crowd beside writers whose rows
    fit keeps its polling while the store commits."""
    from kalos.ipc.control import array_blob

    with in_process_sidecar("room") as sidecar:
        kernel = _PollingKernel(sidecar.layout.n_slots)
        sidecar._polling.install(kernel, sidecar.channel)
        rows_at_stops: list[int] = []
        kernel.stop = lambda: rows_at_stops.append(len(sidecar.engine))

        def add(n: int) -> None:
            spec, blob = array_blob(rng.standard_normal((n, DIM)).astype(np.float32), "float32")
            sidecar._control._op_add({"vectors": spec, "namespace": "t"}, bytearray(blob))

        capacity = sidecar.engine.capacity
        add(1)
        assert rows_at_stops == [0]  # once, before the engine's add: the room was there
        rows_at_stops.clear()
        add(capacity)  # past the capacity: the engine grows before the commit, then adds
        assert rows_at_stops == [1, 1]
        assert sidecar.engine.capacity > capacity and len(sidecar.engine) == capacity + 1


@contextlib.contextmanager
def in_process_sidecar(prefix: str) -> Iterator[Any]:
    """A CPU sidecar in this process that does not serve (no threads run): its control
    operations, expirer and engine are called directly, in the order a test needs."""
    import os

    from kalos.server.sidecar import Sidecar, SidecarConfig

    directory = short_tempdir(prefix)
    sidecar = Sidecar(SidecarConfig(store=os.path.join(directory, "s.db"), name=unique_name(prefix), dim=DIM,
                                    device="cpu", slots=4))
    try:
        yield sidecar
    finally:
        sidecar.close()
        shutil.rmtree(directory, ignore_errors=True)


def _add_two_rows(sidecar: Any, rng: np.random.Generator, ttl: list[float | None] | None = None
                  ) -> tuple[np.ndarray, list[int]]:
    """Two random rows added through the in-process sidecar's add operation (``ttl``: the add's);
    their vectors and ids."""
    from kalos.ipc.control import array_blob

    vectors = rng.standard_normal((2, DIM)).astype(np.float32)
    spec, blob = array_blob(vectors, "float32")
    message = {"vectors": spec, "namespace": "t", **({} if ttl is None else {"ttl": ttl})}
    _, out = sidecar._control._op_add(message, bytearray(blob))
    return vectors, np.frombuffer(out, np.int64).tolist()


def _expire_right_after(sidecar: Any, step: str, row: int) -> None:
    """The store's ``step`` (once) followed at once by ``row``'s expiry and the expirer's
    tombstoning of it, as the sweep would do between that step and the next."""
    original = getattr(sidecar.store, step)
    expires_at = sidecar._expirer.schedule.expires_at(row)

    def then_expired(*args: Any) -> Any:
        result = original(*args)
        setattr(sidecar.store, step, original)
        _wait_past(expires_at)
        sidecar._expirer.expire_due()
        assert row not in sidecar.engine
        return result

    setattr(sidecar.store, step, then_expired)


@pytest.mark.parametrize("expired", ["before the update reads the row back", "after it read the row back"])
def test_a_vector_update_racing_the_expiry_does_not_bring_the_row_back(rng, expired):
    """An update of a row's vector commits while the row is live; the expirer tombstones it
    (its time has come) before the update puts the new vector into the engine. The row must
    not be served from then on: the update leaves out a row already gone, and schedules the
    expiry of one it read live again (an adversarial review found it recallable until the
    store's sweep deleted it)."""
    from kalos.ipc.control import array_blob

    with in_process_sidecar("ttlu") as sidecar:
        _, (doomed, kept) = _add_two_rows(sidecar, rng, ttl=[0.4, None])
        _expire_right_after(sidecar, "update" if expired.startswith("before") else "get", doomed)
        new = rng.standard_normal(DIM).astype(np.float32)
        spec, blob = array_blob(new, "float32")
        sidecar._control._op_update({"id": doomed, "vector": spec}, bytearray(blob))
        sidecar._expirer.expire_due()  # what the sweep does before its next pass
        assert doomed not in sidecar.engine, "the expired row is served again"
        ids, _ = sidecar.engine.search((new / np.linalg.norm(new))[None], 2)
        assert ids[0].tolist() == [kept, -1]


def test_update_renews_or_removes_an_expiry_in_place(memory):
    """update(key, ttl=...) re-times a memory where it is (same id, nothing created): a later
    expiry keeps it served past its old one, ttl=None keeps it for ever, a shorter one ends it
    sooner; an absent key is UnknownKey and bad ttls are refused, changing nothing."""
    ids = memory.add(3, "retime", keys=["later", "never", "sooner"], ttl=[0.8, 0.8, None])
    client = memory.client
    before = client.get(ids=ids.tolist())
    assert client.update("later", namespace="retime", ttl=2.5) == ids[0]
    assert client.update(int(ids[1]), ttl=None) == ids[1]
    assert client.update("sooner", namespace="retime", ttl=0.8) == ids[2]
    after = client.get(ids=ids.tolist())
    assert after[0].expires_at > before[0].expires_at + 1.0
    assert after[1].expires_at is None and after[2].expires_at is not None
    assert [a.text for a in after] == [b.text for b in before]
    _wait_past(max(before[0].expires_at, after[2].expires_at))
    del memory.model[int(ids[2])]
    memory.check("retime", context="past the old expiry and the new short one")
    assert [it is None for it in client.get(ids=ids.tolist())] == [False, False, True]
    with pytest.raises(UnknownKey):
        client.update("absent", namespace="retime", ttl=5)
    with pytest.raises(UnknownKey):  # expired: gone, not brought back
        client.update("sooner", namespace="retime", ttl=5)
    for ttl, message in [(0, "> 0"), (-1, "> 0"), (float("nan"), "> 0"), (float("inf"), "> 0"),
                         ("5", "seconds"), ([5], "seconds"), (True, "seconds")]:
        with pytest.raises(InvalidArgument, match=message):
            client.update("later", namespace="retime", ttl=ttl)
    with pytest.raises(InvalidArgument, match="> 0"):  # the sidecar checks too
        client._control({"op": "update", "key": "later", "namespace": "retime", "ttl": -1})
    assert client.get(keys=["later", "absent"], namespace="retime")[0].expires_at == after[0].expires_at
    assert client.get(keys=["absent"], namespace="retime") == [None]
    # A sidecar from before update_ttl would ignore the field and answer ok: refused here.
    connection = client._connection()
    connection.ops, ops = connection.ops - {"update_ttl"}, connection.ops
    try:
        with pytest.raises(InvalidArgument, match="older"):
            client.update("later", namespace="retime", ttl=60)
    finally:
        connection.ops = ops
    _wait_past(after[0].expires_at)
    del memory.model[int(ids[0])]
    memory.check("retime", context="past the renewed expiry")


def test_renew_renews_only_memories_that_expire(memory):
    """renew(keys, ttl): the expiring memories of keys get ttl from now, together; memories
    that never expire keep none; absent and expired keys are skipped (nothing created); the
    count says how many were renewed; bad input is refused and changes nothing."""
    client = memory.client
    ids = memory.add(4, "renew", keys=["a", "b", "forever", "short"], ttl=[0.8, 0.8, None, 0.2])
    _wait_past(client.get(keys=["short"], namespace="renew")[0].expires_at)
    del memory.model[int(ids[3])]
    assert client.renew(["a", "b", "forever", "short", "absent", "a"], 2.0, namespace="renew") == 2
    a, b, forever = client.get(ids=ids[:3].tolist())
    assert a.expires_at == b.expires_at and a.expires_at > time.time() + 1.5
    assert forever.expires_at is None
    assert client.get(keys=["short", "absent"], namespace="renew") == [None, None]
    assert client.renew(["a"], 2.0, namespace="nowhere") == 0
    for keys, ttl, message in [("a", 1, "keys"), (["a"], 0, "> 0"), (["a"], [1], "seconds"),
                               (["a"], None, "seconds"), ([""], 1, "key")]:
        with pytest.raises(InvalidArgument, match=message):
            client.renew(keys, ttl, namespace="renew")
    with pytest.raises(InvalidArgument, match="> 0"):  # the sidecar checks too
        client._control({"op": "renew", "keys": ["a"], "namespace": "renew", "ttl": -1})
    assert client.get(ids=[int(ids[0])])[0].expires_at == a.expires_at
    _wait_past(a.expires_at - 1.0)
    memory.check("renew", context="past the old expiries")
    _wait_past(a.expires_at)
    del memory.model[int(ids[0])], memory.model[int(ids[1])]
    memory.check("renew", context="past the renewed expiries")


def test_an_update_whose_ttl_ends_before_the_sidecar_re_reads_the_row_is_not_served(rng):
    """A ttl shorter than the way from the commit to the re-time (1e-9 s): the store has the
    row expired when the sidecar reads it back. It must leave the engine, not keep its old
    (here: no) expiry and be recalled for ever."""
    with in_process_sidecar("ttls") as sidecar:
        vectors, (fleeting, kept) = _add_two_rows(sidecar, rng)
        sidecar._control._op_update({"id": fleeting, "ttl": 1e-9, "metadata": {"m": 1}}, bytearray())
        sidecar._expirer.expire_due()
        assert fleeting not in sidecar.engine
        unit = vectors[0] / np.linalg.norm(vectors[0])
        ids, _ = sidecar.engine.search(unit[None], 2)
        assert ids[0].tolist() == [kept, -1]


def test_a_ttl_update_racing_the_old_expiry_keeps_the_row_served(rng):
    """update(ttl=) commits a later expiry while the row is live; the expirer tombstones the
    row at its old time before the update re-times it in the engine. The store keeps the row
    (it has the new expiry), so the engine must serve it again, not lose it until a restart."""
    with in_process_sidecar("ttlt") as sidecar:
        vectors, (renewed, kept) = _add_two_rows(sidecar, rng, ttl=[0.3, None])
        _expire_right_after(sidecar, "update", renewed)
        sidecar._control._op_update({"id": renewed, "ttl": 60}, bytearray())
        sidecar._expirer.expire_due()
        assert renewed in sidecar.engine, "a memory the store keeps is no longer served"
        assert sidecar._expirer.schedule.expires_at(renewed) > time.time() + 50
        unit = vectors[0] / np.linalg.norm(vectors[0])
        ids, _ = sidecar.engine.search(unit[None], 2)
        assert ids[0].tolist() == [renewed, kept]


def test_deletes_do_not_count_memories_that_had_expired(rng):
    """Delete by ids, keys, where, and drop_namespace count only what get and count showed: a
    memory past its expiry that the expirer has not deleted from the store yet is gone already
    (they counted it). The expirer's thread is not running here, so such rows wait in the store."""
    from kalos.ipc.control import array_blob

    with in_process_sidecar("ttld") as sidecar:
        control = sidecar._control

        def add(namespace: str, keys: list[str], ttl: list[float | None]) -> list[int]:
            spec, blob = array_blob(rng.standard_normal((len(keys), DIM)).astype(np.float32), "float32")
            _, out = control._op_add({"vectors": spec, "namespace": namespace, "keys": keys, "ttl": ttl,
                                      "metadata": [{"g": 1}] * len(keys)}, bytearray(blob))
            return np.frombuffer(out, np.int64).tolist()

        added = {ns: add(ns, ["x", "y"], [0.2, None]) for ns in "abcd"}
        by_id = added["a"]
        _wait_past(max(sidecar._expirer.schedule.expires_at(ids[0]) for ids in added.values()))
        assert control._op_count({"namespace": "a"}, bytearray())[0]["count"] == 1
        assert control._op_delete({"ids": by_id}, bytearray())[0]["deleted"] == 1
        assert control._op_delete({"keys": ["x", "y"], "namespace": "b"}, bytearray())[0]["deleted"] == 1
        assert control._op_delete({"where": {"g": 1}, "namespace": "c"}, bytearray())[0]["deleted"] == 1
        assert control._op_drop_namespace({"namespace": "d"}, bytearray())[0]["deleted"] == 1
        assert control._op_count({"namespace": None}, bytearray())[0]["count"] == 0


def test_expiry_survives_a_restart(sidecars, store_dir):
    name = unique_name("ttlr")
    path = store_dir / "r.db"
    proc = sidecars.start(path, name=name, dim=DIM)
    rng = np.random.default_rng(_seed_value())
    vectors = rng.standard_normal((4, DIM)).astype(np.float32)
    with Client(name, timeout=5.0) as client:
        ids = client.add(vectors, ttl=[0.6, 0.6, None, 60.0])
        expiry = client.get(ids=ids[:1].tolist())[0].expires_at
    proc.kill()  # kill -9: the expiries are in the store, the heap is gone
    _wait_past(expiry)
    sidecars.start(path, name=name)
    with Client(name, timeout=5.0) as client:
        assert [it is None for it in client.get(ids=ids.tolist())] == [True, True, False, False]
        for v in vectors[:2]:
            assert not set(client.recall(v, k=4).ids.tolist()) & set(ids[:2].tolist())
        assert client.count() == 2
        assert client.stats()["count"] == 2, "the engine never served the rows that expired while it was down"
