"""Caller keys with upsert, get/delete by key, and recalls in a namespace that holds nothing
(issue 22), against a real sidecar process and the float64 reference.

Every random test prints its seed (KALOS_TEST_SEED replays it).
"""
from __future__ import annotations

import json
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import SidecarPool, _seed_value, run_guarded, short_tempdir, unique_name
from reference import assert_topk_matches, eligible_mask, model_arrays

from kalos import Client
from kalos.errors import InvalidArgument, InvalidQuery
from kalos.store.sqlite import Store

DIM = 8


class Keyed:
    """A sidecar, a client, and the model of what the store must hold: id -> (vector, ns, created)."""

    def __init__(self, name: str, client: Client, store: Path, rng: np.random.Generator) -> None:
        self.name, self.client, self.store, self.rng = name, client, store, rng
        self.model: dict[int, tuple[np.ndarray, str, float]] = {}

    def upsert(self, keys: list[str], namespace: str, texts: list[str] | None = None) -> np.ndarray:
        vectors = self.rng.standard_normal((len(keys), DIM)).astype(np.float32)
        ids = self.client.add(vectors, keys=keys, texts=texts, namespace=namespace)
        for j, i in enumerate(ids.tolist()):
            created = self.model[i][2] if i in self.model else 0.0
            self.model[i] = (vectors[j].astype(np.float64), namespace, created)
        return ids

    def check(self, namespace: str | None, k: int = 5, context: str = "") -> None:
        ids, vectors, namespaces, created = model_arrays(self.model)
        eligible = eligible_mask(namespaces, created, namespace=namespace)
        queries = self.rng.standard_normal((4, DIM)).astype(np.float32)
        for qi, q in enumerate(queries):
            hit = self.client.recall(q, k=k, namespace=namespace)
            assert_topk_matches(hit.ids[None], hit.scores[None], ids, vectors, q, k, eligible, padded=False,
                                context=f"{context} recall {qi}")
        batch = self.client.recall_many(queries, k=k, namespace=namespace)
        assert_topk_matches(batch.ids, batch.scores, ids, vectors, queries, k, eligible, context=f"{context} batch")


@pytest.fixture
def keyed(sidecars: SidecarPool) -> Iterator[Keyed]:
    seed = _seed_value()
    print(f"seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    store_dir = short_tempdir("ks")
    name = unique_name("keys")
    try:
        sidecars.start(Path(store_dir) / "m.db", name=name, dim=DIM)
        with Client(name, timeout=5.0) as client:
            yield Keyed(name, client, Path(store_dir) / "m.db", np.random.default_rng(seed))
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def test_an_upsert_replaces_the_vector_and_recall_sees_only_the_new_one(keyed):
    first = keyed.upsert([f"k{i}" for i in range(40)], "u", texts=[f"old {i}" for i in range(40)])
    keyed.check("u", context="before")
    old = {i: keyed.model[i][0].copy() for i in first.tolist()}
    again = keyed.upsert([f"k{i}" for i in range(0, 40, 2)], "u", texts=[f"new {i}" for i in range(0, 40, 2)])
    assert again.tolist() == first[::2].tolist(), "an upserted key keeps its id"
    assert keyed.client.stats()["namespaces"]["u"] == 40, "an upsert adds no second row"
    keyed.check("u", context="after the upsert")
    keyed.check(None, context="after the upsert, every namespace")
    # Each replaced item's old vector, recalled exactly, now finds the new version (or another
    # item) but never scores 1.0 against an id that was replaced: the old row is gone.
    for i in again.tolist():
        hit = keyed.client.recall(old[i].astype(np.float32), k=1, namespace="u")
        if hit.ids[0] == i:
            new = keyed.model[i][0]
            expected = float(new @ old[i] / np.linalg.norm(new) / np.linalg.norm(old[i]))
            assert abs(float(hit.scores[0]) - expected) < 1e-5, f"id {i} still answers with its old vector"
    items = keyed.client.get(keys=["k0", "k1"], namespace="u")
    assert [it.text for it in items] == ["new 0", "old 1"] and [it.key for it in items] == ["k0", "k1"]


def test_upsert_keeps_created_at_and_sets_updated_at(keyed):
    ids = keyed.client.add(np.eye(DIM, dtype=np.float32)[:2], keys=["a", "b"], namespace="t", created_at=1000.0)
    before = keyed.client.get(keys=["a", "b"], namespace="t")
    assert [it.created_at for it in before] == [1000.0, 1000.0]
    assert [it.updated_at for it in before] == [None, None], "never revised: no updated_at"
    t0 = time.time()
    again = keyed.client.add(np.eye(DIM, dtype=np.float32)[2:3], keys=["a"], namespace="t", texts=["moved to Berlin"],
                             metadata=[{"city": "Berlin"}], created_at=5000.0)
    assert again.tolist() == ids[:1].tolist()
    a, b = keyed.client.get(keys=["a", "b"], namespace="t")
    assert a.created_at == 1000.0, "an upsert keeps created_at (the created_at it was given is for new keys)"
    assert t0 - 1 <= a.updated_at <= time.time() + 1
    assert (a.text, a.metadata, a.key, a.namespace) == ("moved to Berlin", {"city": "Berlin"}, "a", "t")
    assert b.updated_at is None
    # The time filter still sees the item at its (kept) creation time.
    hit = keyed.client.recall(np.eye(DIM, dtype=np.float32)[2], k=2, namespace="t", since=900, until=1100)
    assert hit.ids[0] == ids[0] and hit.scores[0] == pytest.approx(1.0, abs=1e-6)
    assert keyed.client.get(ids=[int(ids[0])])[0].key == "a", "get by id carries the key too"


def test_duplicate_and_bad_keys_are_refused_and_nothing_is_stored(keyed):
    vectors = np.eye(DIM, dtype=np.float32)[:3]
    keyed.client.add(vectors[:1], keys=["kept"], namespace="d", texts=["original"])
    cases = [
        (["x", "y", "x"], "key 'x' appears twice"),
        (["kept", "y", "kept"], "key 'kept' appears twice"),
        (["x", 7, "z"], r"keys\[1\] must be a str, got int"),
        (["x", "y" * 257, "z"], "257 UTF-8 bytes"),
        (["x", "", "z"], r"keys\[1\] is empty"),
        (["x", "y"], "keys has 2 entries for 3 vectors"),
        ("xyz", "ordered sequence"),
        (["x", "\ud800", "z"], "lone surrogate"),
    ]
    for keys, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            keyed.client.add(vectors, keys=keys, namespace="d")
    assert keyed.client.stats()["namespaces"]["d"] == 1
    assert keyed.client.get(keys=["kept"], namespace="d")[0].text == "original"
    with Store.open(keyed.store, readonly=True) as store:
        assert store.count() == 1


def test_the_sidecar_itself_refuses_duplicate_keys(keyed):
    """A client that skips its own checks (another language's): the sidecar checks again."""
    from kalos.ipc.control import array_blob

    spec, blob = array_blob(np.eye(DIM, dtype=np.float32)[:2], "float32")
    with pytest.raises(InvalidArgument, match="key 'dup' appears twice"):
        keyed.client._control({"op": "add", "namespace": "d", "vectors": spec, "keys": ["dup", "dup"]}, blob)
    assert keyed.client.get(keys=["dup"], namespace="d") == [None]


def test_get_and_delete_by_keys_stay_in_their_namespace(keyed):
    a = keyed.upsert(["p", "q", "r"], "ns-a")
    b = keyed.upsert(["p"], "ns-b")
    assert b[0] not in a.tolist(), "the same key in another namespace is another item"
    got = keyed.client.get(keys=["q", "p", "nope", "q"], namespace="ns-a")
    assert [None if it is None else it.id for it in got] == [a[1], a[0], None, a[1]]
    assert keyed.client.get(keys=["q"], namespace="ns-b") == [None], "q exists only in ns-a"
    assert keyed.client.delete(keys=["q"], namespace="ns-b") == 0, "nothing of ns-a goes"
    assert keyed.client.delete(keys=["p", "q", "missing"], namespace="ns-a") == 2
    del keyed.model[int(a[0])], keyed.model[int(a[1])]
    keyed.check("ns-a", context="after delete by keys")
    keyed.check(None, context="after delete by keys, everywhere")
    assert keyed.client.get(keys=["p"], namespace="ns-b")[0].id == b[0]
    # The ids form, positional as before keys existed, still works.
    assert keyed.client.delete([int(a[2])]) == 1 and keyed.client.get([int(a[2])]) == [None]
    for call, message in [
        (lambda: keyed.client.get(keys=[1.5]), r"keys\[0\] must be a str, got float"),
        (lambda: keyed.client.get(keys="p"), "keys must be a sequence of str"),
        (lambda: keyed.client.get(keys=["k" * 300]), "300 UTF-8 bytes"),
        (lambda: keyed.client.delete(keys=["p"], ids=[1]), "both"),
        (lambda: keyed.client.delete(), "neither"),
        (lambda: keyed.client.delete(keys=["p"], namespace=""), "namespace must not be empty"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            call()
    assert keyed.client.get(keys=["p"], namespace="ns-b")[0].id == b[0], "the refused calls changed nothing"


def test_a_retried_upsert_with_its_request_id_is_applied_once(keyed):
    vectors = np.eye(DIM, dtype=np.float32)[:2]
    first = keyed.client.add(vectors, keys=["a", "b"], namespace="r", request_id="req-1")
    second = keyed.client.add(vectors[:1], keys=["a"], namespace="r", texts=["v2"], request_id="req-2")
    updated = keyed.client.get(keys=["a"], namespace="r")[0].updated_at
    # The reply of req-2 was "lost": the client sends it again, and gets the same ids back
    # without the store being written again (updated_at unchanged).
    again = keyed.client.add(vectors[:1], keys=["a"], namespace="r", texts=["v2"], request_id="req-2")
    assert again.tolist() == second.tolist() == first[:1].tolist()
    assert keyed.client.get(keys=["a"], namespace="r")[0].updated_at == updated
    assert keyed.client.stats()["namespaces"]["r"] == 2


def test_a_namespace_that_never_held_a_memory_answers_with_no_hits(keyed):
    keyed.client.add(np.ones((1, DIM), np.float32), namespace="present")  # a plain add: no keys needed here
    q = np.ones(DIM, dtype=np.float32)
    hit = keyed.client.recall(q, k=5, namespace="never-used")
    assert len(hit) == 0 and hit.ids.dtype == np.int64
    batch = keyed.client.recall_many(np.ones((3, DIM), np.float32), k=4, namespace="never-used")
    assert batch.ids.shape == (3, 4) and (batch.ids == -1).all() and (batch.scores == -np.inf).all()
    assert [len(r) for r in batch] == [0, 0, 0]
    # A time window takes the slot-by-slot path: the same empty answer.
    assert len(keyed.client.recall(q, k=3, namespace="never-used", since=0, until=10**10)) == 0
    # The slot's previous answer must not leak into the empty one.
    assert len(keyed.client.recall(q, k=1, namespace="present")) == 1
    assert len(keyed.client.recall(q, k=1, namespace="never-used")) == 0
    # Malformed names are still errors, naming the problem.
    with pytest.raises(InvalidQuery, match="255 UTF-8 bytes"):
        keyed.client.recall(q, namespace="n" * 256)
    with pytest.raises(InvalidQuery):
        keyed.client.recall(q, namespace="")
    # The first add to the namespace makes it recallable at once (the empty answer is not cached).
    ids = keyed.client.add(np.ones((1, DIM), np.float32), namespace="never-used")
    assert keyed.client.recall(q, k=5, namespace="never-used").ids.tolist() == ids.tolist()


def test_kalos_add_jsonl_upserts_rows_with_a_key(keyed, tmp_path):
    def row(vector: np.ndarray, **fields: object) -> str:
        return json.dumps({"vector": vector.tolist(), **fields})

    eye = np.eye(DIM)
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join([row(eye[0], key="a", text="a1"), row(eye[1], text="plain"),
                               row(eye[2], key="b", text="b1", namespace="other")]) + "\n")
    kalos = [sys.executable, "-m", "kalos", "add", str(path), "--name", keyed.name]
    result = run_guarded(kalos)
    assert result.returncode == 0, result.stderr
    path.write_text(row(eye[3], key="a", text="a2") + "\n")
    assert run_guarded(kalos).returncode == 0
    assert keyed.client.stats()["namespaces"]["default"] == 2, "the second 'a' replaced the first"
    (a,) = keyed.client.get(keys=["a"], namespace="default")
    assert a.text == "a2" and keyed.client.recall(eye[3].astype(np.float32), k=1).ids.tolist() == [a.id]
    # A key twice in one file (one namespace) is refused, naming both lines, and nothing is added.
    path.write_text("\n".join([row(eye[4], key="c"), row(eye[5], key="c")]) + "\n")
    result = run_guarded(kalos)
    assert result.returncode != 0 and "m.jsonl:2: key 'c' is also on line 1" in result.stderr
    assert keyed.client.get(keys=["c"], namespace="default") == [None]


# -- the store alone -------------------------------------------------------------------------------


def test_a_store_made_before_keys_opens_and_gains_the_columns(tmp_path):
    path = tmp_path / "old.db"
    with Store.open(path, dim=4) as store:
        store.add(np.eye(4, dtype=np.float32)[:2], namespace="default", texts=["a", "b"])
    # Turn it into the schema of the release before keys: items without key/updated_at,
    # requests without ids, no key index.
    conn = sqlite3.connect(path)
    conn.executescript(
        "DROP INDEX IF EXISTS items_by_key;"
        "CREATE TABLE items_old AS SELECT id, namespace_id, created_at, text, metadata, vector FROM items;"
        "DROP TABLE requests;"
        "CREATE TABLE requests (seq INTEGER PRIMARY KEY, request_id TEXT NOT NULL UNIQUE,"
        " first_id INTEGER NOT NULL, n INTEGER NOT NULL);"
    )
    conn.execute("DROP TABLE items")
    conn.execute(
        "CREATE TABLE items (id INTEGER PRIMARY KEY AUTOINCREMENT, namespace_id INTEGER NOT NULL REFERENCES"
        " namespaces(id), created_at REAL NOT NULL, text TEXT, metadata TEXT, vector BLOB NOT NULL)"
    )
    conn.execute("INSERT INTO items SELECT * FROM items_old")
    conn.execute("DROP TABLE items_old")
    conn.commit()
    conn.close()
    with Store.open(path, readonly=True) as ro:  # readonly: no migration, items simply have no key
        assert [it.key for it in ro.get([1, 2])] == [None, None]
        assert ro.get_keys(["a"], "default") == [None]
        assert ro.ids_of_keys(["a", "b", "a"], "default") == [None, None, None], "one answer per key asked"
    with Store.open(path) as store:  # writable: migrated
        cols = {r[1] for r in store._conn.execute("PRAGMA table_info(items)")}
        assert {"key", "updated_at"} <= cols
        assert [it.text for it in store.get([1, 2])] == ["a", "b"]
        ids, _, _, replaced = store.upsert(np.eye(4, dtype=np.float32)[2:], keys=["x", "y"], namespace="default",
                                           request_id="r")
        assert not replaced.any() and store.find_request("r").tolist() == ids.tolist()
        again, _, _, replaced = store.upsert(np.eye(4, dtype=np.float32)[:1], keys=["y"], namespace="default")
        assert replaced.tolist() == [True] and again.tolist() == ids[1:].tolist()
        assert store.count() == 4
    with Store.open(path) as store:  # a second open finds it migrated
        assert store.get_keys(["y"], "default")[0].id == ids[1]


def test_an_explicit_keys_argument_is_never_taken_for_ids():
    """keys=[5] names key "5"-like keys in one namespace; reading it as the global item id 5
    reached another namespace's memory. Only the positional first argument may be ids."""
    from kalos.client.requests import key_or_id_message

    with pytest.raises(InvalidArgument, match=r"keys\[0\] must be a str"):
        key_or_id_message("get", None, None, "public", keys=[5])
    with pytest.raises(InvalidArgument, match="keys given twice"):
        key_or_id_message("get", ["a"], None, "public", keys=["b"])
    assert key_or_id_message("get", None, None, "public", keys=["a"])["keys"] == ["a"]
    # The documented positional form: get([3, 4]) is by id, get(["a"]) by key.
    assert key_or_id_message("get", [3, 4], None, "public")["ids"] == [3, 4]
    assert key_or_id_message("delete", ["a"], None, "public")["keys"] == ["a"]


def test_a_client_never_reads_or_deletes_another_namespace_through_keys_of_ints(keyed: Keyed):
    """Client.get(keys=[id]) and delete(keys=[id]) with the id of another namespace's memory are
    refused (a key is a str), not served by id; get([id]) and delete(ids=[id]) stay by id."""
    secret = int(keyed.client.add(np.eye(DIM, dtype=np.float32)[:1], keys=["s"], texts=["the launch code"],
                                  namespace="secret")[0])
    for call in (lambda: keyed.client.get(keys=[secret], namespace="public"),
                 lambda: keyed.client.delete(keys=[secret], namespace="public")):
        with pytest.raises(InvalidArgument, match=r"keys\[0\] must be a str"):
            call()
    assert keyed.client.get(keys=["s"], namespace="secret")[0].text == "the launch code"
    assert keyed.client.get([secret])[0].text == "the launch code"  # positional ints: ids, as documented
    assert keyed.client.get(["s"], namespace="secret")[0].id == secret  # positional strs: keys
    with pytest.raises(InvalidArgument, match="keys given twice"):
        keyed.client.get(["s"], keys=["s"], namespace="secret")
    assert keyed.client.delete(["s"], namespace="secret") == 1
