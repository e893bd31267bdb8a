"""The mem0 provider (kalos.integrations.mem0) against a real sidecar, with mem0 installed.

* mem0's own ``Memory`` selecting ``{"provider": "kalos"}`` after ``register()``, driven with
  ``infer=False`` (no LLM is called) and a deterministic embedder in place of the network one:
  add, search scoped by user (never another user's memory), get_all, update, delete,
  delete_all, history.
* the ``VectorStoreBase`` calls mem0 makes (insert with UUIDs and payloads, search, search_batch,
  get, update, delete, list, col_info, list_cols, delete_col, reset) on fresh random vectors and
  payloads against a float64 brute-force reference, with filters by user_id / agent_id / run_id
  and mem0's operators (eq ne gt gte lt lte in nin contains icontains, "*", AND OR NOT).
"""
from __future__ import annotations

import hashlib
import os
import random
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from conftest import DEADLINE_S, short_tempdir  # noqa: E402

# Read by mem0 when it is imported: no telemetry (a network call), its files under a temp dir.
os.environ["MEM0_TELEMETRY"] = "False"
os.environ.setdefault("MEM0_DIR", short_tempdir("m0"))

pytest.importorskip("mem0")

from mem0 import Memory  # noqa: E402
from mem0.configs.base import MemoryConfig  # noqa: E402
from test_text import TextSidecar  # noqa: E402

from kalos import Client, InvalidArgument, InvalidQuery, UnknownKey  # noqa: E402
from kalos.integrations.mem0 import KalosMem0, mem0_where, register  # noqa: E402

DIM = 16
USERS = ["alice", "bob", "carol"]
AGENTS = ["planner", "coder"]


@pytest.fixture(scope="module")
def sidecar16() -> Iterator[TextSidecar]:
    sc = TextSidecar(DIM)
    try:
        yield sc
    finally:
        sc.close()


@pytest.fixture
def client16(sidecar16: TextSidecar) -> Iterator[Client]:
    with Client(sidecar16.name, timeout=DEADLINE_S) as c:
        yield c


@pytest.fixture
def collection() -> str:
    return f"m0-{uuid.uuid4().hex[:12]}"


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


class HashEmbedder:
    """A deterministic stand-in for mem0's embedder: a seeded random unit vector per text."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"embedding_dims": DIM})()

    def embed(self, text: Any, memory_action: str | None = None) -> list[float]:
        seed = int.from_bytes(hashlib.sha256(str(text).encode()).digest()[:8], "little")
        return unit(np.random.default_rng(seed).standard_normal(DIM)).tolist()

    def embed_batch(self, texts: list[str], memory_action: str | None = None) -> list[list[float]]:
        return [self.embed(t, memory_action) for t in texts]


@pytest.fixture
def memory(sidecar16: TextSidecar, collection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Memory:
    register()
    # mem0 builds its (network) embedder and LLM clients at construction: given a dummy key
    # they construct offline, and with infer=False the LLM is never called; the embedder is
    # replaced by the deterministic one before any call.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    config = MemoryConfig(
        vector_store={"provider": "kalos", "config": {"sidecar": sidecar16.name, "collection_name": collection,
                                                       "embedding_model_dims": DIM, "timeout": DEADLINE_S}},
        history_db_path=str(tmp_path / "history.db"),
    )
    m = Memory(config)
    assert isinstance(m.vector_store, KalosMem0)
    m.embedding_model = HashEmbedder()
    return m


def test_memory_add_search_scoped_by_user_update_delete_history(memory: Memory, client16: Client, collection: str):
    facts = {
        "alice": ["alice likes green tea", "alice lives in Lisbon", "alice's cat is called Miso"],
        "bob": ["bob likes espresso", "bob lives in Oslo"],
    }
    added: dict[str, list[str]] = {}
    for user, texts in facts.items():
        for text in texts:
            result = memory.add([{"role": "user", "content": text}], user_id=user, infer=False)
            added.setdefault(user, []).extend(r["id"] for r in result["results"])
    assert client16.count(namespace=collection) == 5
    # A search scoped by user: only that user's memories, the closest first (its own text is closest).
    for user, texts in facts.items():
        for text in texts:
            hits = memory.search(text, filters={"user_id": user}, top_k=10, threshold=0.0)["results"]
            assert hits and hits[0]["memory"] == text
            assert {h["memory"] for h in hits} <= set(texts)
            assert all(h["user_id"] == user for h in hits)
    everything = memory.get_all(filters={"user_id": "alice"})["results"]
    assert sorted(m["memory"] for m in everything) == sorted(facts["alice"])
    assert memory.get_all(filters={"user_id": "nobody"})["results"] == []

    target = added["alice"][1]
    memory.update(target, "alice moved to Berlin")
    assert memory.get(target)["memory"] == "alice moved to Berlin"
    hits = memory.search("alice moved to Berlin", filters={"user_id": "alice"}, top_k=1, threshold=0.0)["results"]
    assert hits[0]["id"] == target
    assert [h["event"] for h in memory.history(target)] == ["ADD", "UPDATE"]

    memory.delete(added["bob"][0])
    assert memory.get(added["bob"][0]) is None
    assert [m["memory"] for m in memory.get_all(filters={"user_id": "bob"})["results"]] == ["bob lives in Oslo"]
    memory.delete_all(user_id="alice")
    assert memory.get_all(filters={"user_id": "alice"})["results"] == []
    assert [m["memory"] for m in memory.get_all(filters={"user_id": "bob"})["results"]] == ["bob lives in Oslo"]


def random_filter(r: random.Random) -> tuple[dict[str, Any], Callable[[dict[str, Any]], bool]]:
    """A mem0 filter and the same condition as a Python predicate (written independently of the provider)."""
    def field() -> tuple[dict[str, Any], Callable[[dict[str, Any]], bool]]:
        choice = r.randrange(11)
        if choice == 0:
            u = r.choice(USERS)
            return {"user_id": u}, lambda p: p.get("user_id") == u
        if choice == 1:
            a = r.choice(AGENTS)
            return {"agent_id": {"ne": a}}, lambda p: p.get("agent_id") != a
        if choice == 2:
            lo, hi = sorted(r.sample(range(0, 100), 2))
            return {"n": {"gte": lo, "lt": hi}}, lambda p: "n" in p and lo <= p["n"] < hi
        if choice == 3:
            t = r.randrange(100)
            return {"n": {"gt": t}}, lambda p: "n" in p and p["n"] > t
        if choice == 4:
            t = r.randrange(100)
            return {"n": {"lte": t}}, lambda p: "n" in p and p["n"] <= t
        if choice == 5:
            us = r.sample(USERS, 2)
            return {"user_id": {"in": us}}, lambda p: p.get("user_id") in us
        if choice == 6:
            us = r.sample(USERS, 1)
            return {"user_id": {"nin": us}}, lambda p: p.get("user_id") not in us
        if choice == 7:
            return {"run_id": "*"}, lambda p: "run_id" in p
        if choice == 8:
            us = r.sample(USERS, 2)
            return {"user_id": us}, lambda p: p.get("user_id") in us
        if choice == 9:
            s = r.choice(["ab", "CD", "e"])
            return {"data": {"icontains": s}}, lambda p: s.lower() in p["data"].lower()
        s = r.choice(["ab", "cd", "x"])
        return {"data": {"contains": s}}, lambda p: s in p["data"]

    kind = r.randrange(5)
    if kind <= 1:
        return field()
    subs = [field() for _ in range(r.randint(1, 3))]
    if kind == 2:
        return {"AND": [f for f, _ in subs]}, lambda p: all(g(p) for _, g in subs)
    if kind == 3:
        return {"OR": [f for f, _ in subs]}, lambda p: any(g(p) for _, g in subs)
    return {"NOT": [f for f, _ in subs]}, lambda p: not any(g(p) for _, g in subs)


def test_vector_store_calls_against_the_reference(client16: Client, sidecar16: TextSidecar, collection: str, seed: int):
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    store = KalosMem0(collection_name=collection, embedding_model_dims=DIM, sidecar=sidecar16.name, timeout=DEADLINE_S)
    n = 300
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    ids = [str(uuid.UUID(int=r.getrandbits(128), version=4)) for _ in range(n)]
    letters = "abcdeABCDEx"
    payloads = []
    for i in range(n):
        p: dict[str, Any] = {"user_id": r.choice(USERS), "agent_id": r.choice(AGENTS), "n": r.randrange(100),
                             "data": "".join(r.choices(letters, k=8)), "hash": f"h{i}"}
        if r.random() < 0.3:
            p["run_id"] = f"run-{r.randrange(3)}"
        payloads.append(p)
    for start in range(0, n, 100):
        store.insert(vectors[start : start + 100].tolist(), payloads[start : start + 100], ids[start : start + 100])
    assert store.col_info()["count"] == n and collection in store.list_cols()

    normalised = unit(vectors.astype(np.float64))

    def reference(query: np.ndarray, k: int, keep: Callable[[dict[str, Any]], bool]) -> tuple[list[str], np.ndarray]:
        rows = [i for i in range(n) if keep(payloads[i])]
        if not rows:
            return [], np.empty(0)
        scores = normalised[rows] @ unit(query.astype(np.float64))
        order = np.argsort(-scores, kind="stable")[:k]
        return [ids[rows[i]] for i in order], scores[order]

    for _ in range(40):
        flt, keep = random_filter(r)
        query = rng.standard_normal(DIM).astype(np.float32)
        k = r.randint(1, 20)
        want_ids, want_scores = reference(query, k, keep)
        got = store.search("unused", query.tolist(), top_k=k, filters=flt)
        assert [g.id for g in got] == want_ids, flt
        np.testing.assert_allclose([g.score for g in got], want_scores, atol=1e-5)
        assert all(keep(g.payload) for g in got)
        assert sorted(row.id for row in store.list(filters=flt)[0]) == sorted(i for i, p in zip(ids, payloads) if keep(p))
    # search_batch: one batched recall, each answer equal to its search.
    flt, keep = random_filter(r)
    queries = rng.standard_normal((5, DIM)).astype(np.float32)
    batch = store.search_batch(["q"] * 5, queries.tolist(), top_k=4, filters=flt)
    for q, answer in zip(queries, batch):
        assert [a.id for a in answer] == reference(q, 4, keep)[0]
    batch = store.search_batch(["q"] * 5, queries.tolist(), top_k=4, filters={"user_id": "bob"})
    for q, answer in zip(queries, batch):
        assert [a.id for a in answer] == reference(q, 4, lambda p: p["user_id"] == "bob")[0]
    # A top_k past the sidecar's max_k is answered whole (scored here), never cut to max_k.
    wide = client16.max_k + 20
    assert n > wide
    want_ids, want_scores = reference(queries[0], wide, lambda p: True)
    got = store.search("", queries[0].tolist(), top_k=wide)
    assert [g.id for g in got] == want_ids and len(got) == wide
    np.testing.assert_allclose([g.score for g in got], want_scores, atol=1e-5)
    [answer] = store.search_batch(["q"], queries[:1].tolist(), top_k=wide, filters={"user_id": "bob"})
    assert [a.id for a in answer] == reference(queries[0], wide, lambda p: p["user_id"] == "bob")[0]

    # get / update / delete by mem0's UUIDs.
    row = store.get(ids[7])
    assert row.id == ids[7] and row.payload == payloads[7]
    new_vector = rng.standard_normal(DIM).astype(np.float32)
    store.update(ids[7], vector=new_vector.tolist(), payload={**payloads[7], "data": "revised"})
    assert store.get(ids[7]).payload["data"] == "revised"
    [top] = store.search("", new_vector.tolist(), top_k=1)
    assert top.id == ids[7] and top.score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(UnknownKey):
        store.update(str(uuid.uuid4()), payload={"data": "x"})
    store.delete(ids[7])
    assert store.get(ids[7]) is None
    assert len(store.list(top_k=10)[0]) == 10 and len(store.list()[0]) == n - 1
    store.reset()
    assert store.col_info()["count"] == 0 and store.list()[0] == []
    store.insert([vectors[0].tolist()], [payloads[0]], [ids[0]])
    assert store.get(ids[0]).payload == payloads[0]
    store.delete_col()
    assert store.get(ids[0]) is None


def test_bad_filters_and_arguments_are_refused(client16: Client, sidecar16: TextSidecar, collection: str):
    store = KalosMem0(collection_name=collection, embedding_model_dims=DIM, sidecar=sidecar16.name, timeout=DEADLINE_S)
    store.insert([[1.0] + [0.0] * (DIM - 1)], [{"user_id": "alice", "data": "x"}], ["a"])
    for bad in ({"n": {"regex": "a.*"}}, {"AND": {"user_id": "a"}}, {"user_id": None}, {"n": {"gt": "ten"}},
                {"data": {"contains": 3}}):
        with pytest.raises(InvalidArgument):
            store.search("", [1.0] * DIM, top_k=1, filters=bad)
    with pytest.raises(InvalidArgument):
        store.search("", [1.0] * DIM, top_k=0)
    with pytest.raises(Exception, match="dimension"):
        KalosMem0(collection_name=collection, embedding_model_dims=DIM + 1, sidecar=sidecar16.name)
    assert mem0_where({"OR": [{"user_id": "a"}], "$or": [{"user_id": "a"}]}) == {"$or": [{"user_id": "a"}]}
    # Different conditions under OR and $or: both hold (neither spelling widens the scope).
    both = {"OR": [{"user_id": "alice"}], "$or": [{"user_id": "bob"}]}
    assert mem0_where(both) == {"$and": [{"$or": [{"user_id": "alice"}]}, {"$or": [{"user_id": "bob"}]}]}
    assert store.search("", [1.0] + [0.0] * (DIM - 1), top_k=5, filters=both) == []
    assert store.search("", [1.0] + [0.0] * (DIM - 1), top_k=5, filters={**both, "data": {"contains": "x"}}) == []
    assert store.col_info()["count"] == 1


def test_iso_date_ranges_filter_as_instants(client16: Client, sidecar16: TextSidecar, collection: str, seed: int):
    """mem0 stores created_at / updated_at as ISO text and documents range filters on them
    ({"created_at": {"gte": "2025-01-01T00:00:00"}}); Qdrant, its default store, compares them as
    instants (naive ones as UTC). They raised InvalidArgument here."""
    from datetime import datetime, timedelta, timezone

    rng = np.random.default_rng(seed)
    store = KalosMem0(collection_name=collection, embedding_model_dims=DIM, sidecar=sidecar16.name, timeout=DEADLINE_S)
    base = datetime(2024, 1, 1, tzinfo=timezone.utc)
    instants = [base + timedelta(hours=int(h)) for h in rng.integers(0, 24 * 800, 30)]
    # The spellings mem0 and people write: mem0's own isoformat() with an offset, naive, Z, date only.
    spell = [lambda t: t.isoformat(), lambda t: t.replace(tzinfo=None).isoformat(),
             lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ"),
             lambda t: t.astimezone(timezone(timedelta(hours=-8))).isoformat()]
    payloads = [{"data": f"m{i}", "user_id": USERS[i % 3], "created_at": spell[i % 4](t), "updated_at": spell[i % 4](t)}
                for i, t in enumerate(instants)]
    ids = [str(uuid.uuid4()) for _ in payloads]
    store.insert(rng.standard_normal((30, DIM)).tolist(), payloads, ids)
    query = rng.standard_normal(DIM).tolist()
    for _ in range(6):
        lo, hi = sorted(base + timedelta(hours=int(h)) for h in rng.integers(0, 24 * 800, 2))
        bounds = {"gte": lo.replace(tzinfo=None).isoformat(), "lt": hi.strftime("%Y-%m-%dT%H:%M:%S+00:00")}
        want = {ids[i] for i, t in enumerate(instants) if lo <= t < hi}
        for flt in ({"created_at": bounds}, {"updated_at": {"gt": bounds["gte"]}}):
            expected = want if "created_at" in flt else {ids[i] for i, t in enumerate(instants) if t > lo}
            assert {r.id for r in store.search("", query, top_k=30, filters=flt)} == expected, flt
            assert {r.id for r in store.list(filters=flt)[0]} == expected, flt
            scoped = {**flt, "user_id": "bob", "data": {"contains": "m"}}  # the listed path too
            assert {r.id for r in store.search("", query, top_k=30, filters=scoped)} == \
                {i for i in expected if payloads[ids.index(i)]["user_id"] == "bob"}
    assert {r.id for r in store.search("", query, top_k=30, filters={"created_at": {"gte": "2024-01-01"}})} == set(ids)
    # Payloads come back as mem0 wrote them: nothing of Kalos's added.
    assert store.get(ids[0]).payload == payloads[0]
    store.update(ids[0], payload={**payloads[0], "created_at": "1999-01-01T00:00:00"})
    assert store.get(ids[0]).payload["created_at"] == "1999-01-01T00:00:00"
    assert [r.id for r in store.list(filters={"created_at": {"lt": "2000-01-01"}})[0]] == [ids[0]]
    with pytest.raises(InvalidArgument):
        store.search("", query, top_k=1, filters={"created_at": {"gte": "not a date"}})


def test_a_query_with_no_direction_is_refused_on_the_listed_path_too(client16: Client, sidecar16: TextSidecar,
                                                                    collection: str):
    """contains / icontains and a top_k past max_k score here after listing; a zero or NaN query
    gave all-NaN scores there and returned rows in arbitrary order, where a recall refuses it."""
    store = KalosMem0(collection_name=collection, embedding_model_dims=DIM, sidecar=sidecar16.name, timeout=DEADLINE_S)
    store.insert(np.eye(DIM)[:3].tolist(), [{"data": f"alpha {i}"} for i in range(3)], ["a", "b", "c"])
    for vector in ([0.0] * DIM, [float("nan")] * DIM):
        for call in (lambda: store.search("", vector, top_k=2, filters={"data": {"contains": "a"}}),
                     lambda: store.search("", vector, top_k=client16.max_k + 1),
                     lambda: store.search("", vector, top_k=2)):
            with pytest.raises(InvalidQuery, match="no direction"):
                call()
    assert [r.id for r in store.search("", np.eye(DIM)[1].tolist(), top_k=1, filters={"data": {"contains": "a"}})] == ["b"]
