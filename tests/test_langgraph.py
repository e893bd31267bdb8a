"""KalosStore (kalos.integrations.langgraph) against LangGraph's own InMemoryStore.

Seeded random sequences of operations (put with per-put ``index``, get, delete, search with and
without a query, with filters the scan evaluates and ones it cannot, limit and offset,
list_namespaces with prefix / suffix / max_depth, mixed batches, abatch) run against both
stores with the same deterministic embedding; every result must be equal (timestamps aside,
scores within float tolerance). Where InMemoryStore keeps leftovers (a namespace a get touched,
vectors of paths a later put no longer indexes) the sequences stay clear of them: see the
module docstring of kalos.integrations.langgraph.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any, Callable, Iterator

import numpy as np
import pytest

pytest.importorskip("langgraph")

from conftest import DEADLINE_S, in_two_event_loops  # noqa: E402
from langchain_core.embeddings import DeterministicFakeEmbedding  # noqa: E402
from langgraph.store.base import GetOp, InvalidNamespaceError, ListNamespacesOp, MatchCondition, PutOp, SearchOp  # noqa: E402
from langgraph.store.memory import InMemoryStore  # noqa: E402
from test_text import TextSidecar  # noqa: E402

from kalos import Client, InvalidArgument, InvalidQuery  # noqa: E402
from kalos.integrations.langgraph import KalosStore  # noqa: E402

DIM = 8
NAMESPACES = [("users", "alice"), ("users", "bob"), ("users", "alice", "notes"), ("docs",), ("docs", "x", "y")]
KINDS = ["a", "b", "c"]
LANGS = ["en", "de"]
# A key is always put with the same index argument (InMemoryStore keeps the vectors of a
# previous put's paths, so changing it would compare against that leftover).
INDEXES: list[Any] = [None, False, ["tags[*]"], ["text", "meta.note"]]


@pytest.fixture(scope="module")
def sidecar8() -> Iterator[TextSidecar]:
    sc = TextSidecar(DIM)
    try:
        yield sc
    finally:
        sc.close()


@pytest.fixture(scope="module")
def client8(sidecar8: TextSidecar) -> Iterator[Client]:
    with Client(sidecar8.name, timeout=DEADLINE_S) as c:
        yield c


def stores(client: Client, **kwargs: Any) -> tuple[KalosStore, InMemoryStore]:
    embed = DeterministicFakeEmbedding(size=DIM)
    index = {"dims": DIM, "embed": embed, "fields": ["text"]}
    return (KalosStore(index=index, client=client, prefix=f"lg{uuid.uuid4().hex[:10]}", **kwargs),
            InMemoryStore(index=index))


def same(got: Any, want: Any) -> None:
    """Results equal but for timestamps; scores within tolerance."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            same(g, w)
    elif want is None:
        assert got is None
    elif isinstance(want, tuple):
        assert got == want
    else:
        assert (got.namespace, got.key, got.value) == (want.namespace, want.key, want.value)
        w_score, g_score = getattr(want, "score", None), getattr(got, "score", None)
        assert (g_score is None) == (w_score is None), (got, want)
        if w_score is not None:
            assert g_score == pytest.approx(w_score, abs=2e-5)


class Generator:
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.n = 0
        self.used: set[tuple[str, ...]] = set()
        self.keys: dict[tuple[str, ...], set[str]] = {}

    def text(self) -> str:
        self.n += 1
        return f"t{self.n} " + " ".join(self.r.choice("abcdefgh") * 3 for _ in range(3))

    def value(self) -> dict[str, Any]:
        r = self.r
        # Booleans and numbers mixed: for InMemoryStore True == 1 == 1.0 and float(True) is 1.0.
        return {"text": self.text(), "tags": [self.text(), self.text()],
                "n": r.choice([True, False]) if r.random() < 0.1 else r.randrange(10),
                "kind": r.choice(KINDS), "flag": r.choice([True, False, 1, 0, 1.0]),
                "meta": {"lang": r.choice(LANGS), "note": self.text()}}

    def put(self) -> PutOp:
        ns = self.r.choice(NAMESPACES)
        key = f"k{self.r.randrange(12)}"
        self.used.add(ns)
        self.keys.setdefault(ns, set()).add(key)
        return PutOp(ns, key, self.value(), index=INDEXES[int(key[1:]) % len(INDEXES)])

    def known(self) -> tuple[tuple[str, ...], str]:
        ns = self.r.choice(sorted(self.used))
        return ns, self.r.choice(sorted(self.keys[ns]) + ["never"])

    def filter(self) -> dict[str, Any] | None:
        r = self.r
        return r.choice([
            None, None, {"kind": r.choice(KINDS)}, {"n": {"$gte": r.randrange(10)}},
            {"n": {"$lt": r.randrange(10)}, "kind": r.choice(KINDS)}, {"flag": r.choice([True, False, 1, 0])},
            {"n": r.randrange(10)}, {"kind": {"$ne": r.choice(KINDS)}}, {"meta": {"lang": r.choice(LANGS)}},
            {"n": {"$gt": 2, "$lte": 7}}, {"flag": {"$eq": True}, "n": {"$ne": 3}},
        ])

    def search(self) -> SearchOp:
        r = self.r
        prefix = r.choice([(), ("users",), ("users", "alice"), ("docs",), ("docs", "x"), ("nothing",)])
        query = r.choice([None, self.text(), f"t{r.randrange(1, self.n + 1)}"])
        return SearchOp(prefix, self.filter(), r.choice([1, 3, 10]), r.choice([0, 0, 1, 4]), query)

    def list_namespaces(self) -> ListNamespacesOp:
        r = self.r
        conditions = r.choice([None, (MatchCondition("prefix", ("users",)),), (MatchCondition("suffix", ("alice",)),),
                               (MatchCondition("prefix", ("users", "*")),),
                               (MatchCondition("prefix", ("users",)), MatchCondition("suffix", ("notes",)))])
        return ListNamespacesOp(conditions, r.choice([None, 1, 2]), r.choice([2, 100]), r.choice([0, 0, 1]))

    def op(self) -> Any:
        choice = self.r.random()
        if not self.used or choice < 0.4:
            return self.put()
        if choice < 0.5:
            return GetOp(*self.known())
        if choice < 0.6:
            return PutOp(*self.known(), None)
        if choice < 0.9:
            return self.search()
        return self.list_namespaces()


def expected(oracle: InMemoryStore, ops: list[Any], held: set[tuple[str, ...]]) -> list[Any]:
    """InMemoryStore's results, list_namespaces over the namespaces that hold items.

    ``held``: the namespaces that ever held an item. InMemoryStore's dict of namespaces is a
    defaultdict, so a put that the same batch's delete cancels still leaves an empty entry, which
    places that namespace in the order of item-less searches although nothing was ever stored
    there; KalosStore places a namespace when its first item is stored. Such entries go."""
    results = oracle.batch(ops)
    held.update(ns for ns, items in oracle._data.items() if items)
    for ns in [ns for ns, items in oracle._data.items() if not items and ns not in held]:
        del oracle._data[ns]
    for i, op in enumerate(ops):
        if isinstance(op, ListNamespacesOp):
            holding = InMemoryStore()
            holding._data.update({ns: items for ns, items in oracle._data.items() if items})
            results[i] = holding.batch([op])[0]
    return results


def test_operation_sequences_equal_in_memory_store(client8: Client, seed: int):
    gen = Generator(seed)
    kalos, oracle = stores(client8)
    held: set[tuple[str, ...]] = set()
    for step in range(220):
        r = gen.r.random()
        ops = [gen.op() for _ in range(gen.r.randint(2, 4))] if r < 0.15 else [gen.op()]
        # Reads see the state before the batch, as in InMemoryStore (computed before the puts).
        # A batch that lists namespaces runs one op at a time: expected() lists the namespaces
        # holding items after the oracle's puts, not before. Skipping it instead would leave the
        # generator believing in puts that never ran, and its next get would touch a namespace
        # in InMemoryStore only (a leftover that changes InMemoryStore's namespace order).
        mixed = len(ops) > 1 and any(isinstance(o, ListNamespacesOp) for o in ops)
        for batch in ([op] for op in ops) if mixed else [ops]:
            want = expected(oracle, batch, held)
            got = asyncio.run(kalos.abatch(batch)) if gen.r.random() < 0.3 else kalos.batch(batch)
            same(got, want)
    # The convenience API on top of batch, and a last full comparison.
    for ns in sorted(gen.used):
        same(kalos.search(ns, limit=100), oracle.search(ns, limit=100))
        same(kalos.search(ns, query="t1 aaa", limit=100), oracle.search(ns, query="t1 aaa", limit=100))
    assert kalos.list_namespaces() == sorted(ns for ns, items in oracle._data.items() if items)


def test_put_get_search_delete_through_the_public_api(client8: Client):
    kalos, oracle = stores(client8)
    for s in (kalos, oracle):
        s.put(("users", "alice", "memories"), "m1", {"text": "likes green tea", "kind": "pref"})
        s.put(("users", "alice", "memories"), "m2", {"text": "lives in Lisbon", "kind": "fact"}, index=False)
        s.put(("users", "bob", "memories"), "m1", {"text": "likes espresso", "kind": "pref"})
    same(kalos.get(("users", "alice", "memories"), "m1"), oracle.get(("users", "alice", "memories"), "m1"))
    for kwargs in ({}, {"query": "tea"}, {"filter": {"kind": "pref"}}, {"query": "coffee", "limit": 1, "offset": 1}):
        same(kalos.search(("users",), **kwargs), oracle.search(("users",), **kwargs))
    assert kalos.list_namespaces(max_depth=2) == oracle.list_namespaces(max_depth=2) == [("users", "alice"), ("users", "bob")]
    item = kalos.get(("users", "alice", "memories"), "m1")
    assert item.created_at.tzinfo is not None and item.updated_at >= item.created_at
    kalos.delete(("users", "bob", "memories"), "m1")
    assert kalos.get(("users", "bob", "memories"), "m1") is None
    assert kalos.list_namespaces() == [("users", "alice", "memories")]
    assert asyncio.run(kalos.aget(("users", "alice", "memories"), "m2")).value["text"] == "lives in Lisbon"


def test_bad_input_is_refused(client8: Client):
    kalos, _ = stores(client8)
    long_ns = ("x" * 200, "y" * 60)
    with pytest.raises(InvalidNamespaceError, match="255"):
        kalos.put(long_ns, "k", {"a": 1})
    with pytest.raises(InvalidNamespaceError):
        kalos.put(("a.b",), "k", {"a": 1})
    with pytest.raises(InvalidArgument, match="reserved|Kalos's own"):
        kalos.put(("a",), "k", {"__kalos_lg_key": 1})
    with pytest.raises(InvalidArgument, match="JSON"):
        kalos.put(("a",), "k", {"a": object()})
    with pytest.raises(InvalidArgument, match=r"key 'k+'\.\.\. is 300 UTF-8 bytes; KalosStore keys hold at most 254"):
        kalos.put(("a",), "k" * 300, {"a": 1})
    with pytest.raises(InvalidArgument, match="key 'éé.* is 256 UTF-8 bytes"):
        kalos.put(("a",), "é" * 128, {"a": 1})  # its own length, not that of the row key 'd:...'
    with pytest.raises(InvalidArgument, match="lone surrogate"):
        kalos.get(("a",), "x\ud800")
    kalos.put(("a",), "k" * 254, {"a": 1})
    kalos.delete(("a",), "k" * 254)
    assert kalos.list_namespaces() == []
    ok = ("n" * 100, "m" * 100)  # 200 bytes of labels plus the prefix: fits
    kalos.put(ok, "k", {"a": 1})
    assert kalos.get(ok, "k").value == {"a": 1}


def test_a_batch_with_one_unstorable_put_writes_nothing(client8: Client):
    """The puts of a batch go as one add per namespace: a value the client's encoder refuses
    (a lone surrogate passes json.dumps; a nested non-str key is turned into a str by it) was
    refused only at its namespace's add, after the earlier namespaces were written."""
    kalos, memory = stores(client8)
    for bad in ({"text": "second", "note": "bad \ud800"}, {"text": "second", "nested": {1: "x"}}):
        ops = [PutOp(("a",), "k1", {"text": "first"}), GetOp(("a",), "k0", refresh_ttl=True),
               PutOp(("b",), "k2", bad)]
        with pytest.raises(InvalidArgument, match="cannot be stored"):
            kalos.batch(ops)
        with pytest.raises(InvalidArgument, match="cannot be stored"):
            asyncio.run(kalos.abatch(ops))
        assert kalos.get(("a",), "k1") is None and kalos.get(("b",), "k2") is None
    assert kalos.list_namespaces() == []
    # A namespace that cannot be a Kalos namespace is LangGraph's InvalidNamespaceError, for a
    # read too (InMemoryStore stores such labels; nothing can be stored under them here).
    for call in (lambda: kalos.get(("x\ud800",), "k"), lambda: kalos.put(("x\ud800",), "k", {"text": "t"}),
                 lambda: kalos.put(("x\u202e",), "k", {"text": "t"}),
                 lambda: kalos.batch([PutOp(("a",), "k1", {"text": "first"}), GetOp(("x\ud800",), "k")])):
        with pytest.raises(InvalidNamespaceError):
            call()
    assert kalos.list_namespaces() == [] and memory.list_namespaces() == []


def test_ttl_expires_and_refresh_on_read_renews(client8: Client):
    kalos, _ = stores(client8, ttl={"default_ttl": 0.05, "refresh_on_read": True})  # 3 s
    assert kalos.supports_ttl
    ns = ("s",)
    kalos.put(ns, "refreshed", {"text": "a"})
    kalos.put(ns, "plain", {"text": "b"})
    kalos.put(ns, "forever", {"text": "c"}, ttl=None)
    time.sleep(2.0)
    assert kalos.get(ns, "refreshed") is not None  # renews its 3 s
    time.sleep(2.0)
    assert kalos.get(ns, "plain", refresh_ttl=False) is None
    assert kalos.get(ns, "refreshed", refresh_ttl=False) is not None
    assert sorted(i.key for i in kalos.search(ns, query="a", refresh_ttl=False)) == ["forever", "refreshed"]
    time.sleep(2.5)
    assert kalos.get(ns, "refreshed") is None
    assert [i.key for i in kalos.search(ns)] == ["forever"]


def test_refresh_on_read_off_yields_to_an_explicit_refresh_ttl(client8: Client):
    """``refresh_on_read=False`` is the default of each call; ``refresh_ttl=True`` still renews
    (BaseStore resolves the two into the op, as for LangGraph's PostgresStore)."""
    kalos, _ = stores(client8, ttl={"default_ttl": 0.02, "refresh_on_read": False})  # 1.2 s
    ns = ("r",)
    kalos.put(ns, "asked", {"text": "a"})
    kalos.put(ns, "default", {"text": "b"})
    time.sleep(0.7)
    assert kalos.get(ns, "default") is not None  # the config's default: not renewed
    assert kalos.get(ns, "asked", refresh_ttl=True) is not None  # renewed: 1.2 s from now
    time.sleep(0.8)
    assert kalos.get(ns, "default") is None
    assert kalos.get(ns, "asked") is not None


def test_a_put_replaces_the_vectors_of_the_previous_one(client8: Client):
    """What InMemoryStore keeps (the old version's vectors) is gone here: a query equal to a text
    only the old version indexed scores the item by its current text, and no row is left over."""
    kalos, _ = stores(client8)
    embed = DeterministicFakeEmbedding(size=DIM)
    ns = ("u",)
    kalos.put(ns, "k", {"text": "current text", "tags": ["old tag one", "old tag two"]}, index=["text", "tags[*]"])
    [hit] = kalos.search(ns, query="old tag two")
    assert hit.score == pytest.approx(1.0, abs=1e-5)
    kalos.put(ns, "k", {"text": "current text", "tags": ["old tag one", "old tag two"]}, index=["text"])
    [hit] = kalos.search(ns, query="old tag two")
    q, t = np.asarray(embed.embed_query("old tag two")), np.asarray(embed.embed_query("current text"))
    assert hit.score == pytest.approx(float(q @ t / np.linalg.norm(q) / np.linalg.norm(t)), abs=1e-5)
    assert client8.count(namespace=kalos._kalos_namespace(ns)) == 2  # the document and its one vector
    kalos.put(ns, "k", {"text": "x"}, index=False)
    assert [h.score for h in kalos.search(ns, query="current text")] == [None]  # only the fill now
    assert client8.count(namespace=kalos._kalos_namespace(ns)) == 1
    kalos.delete(ns, "k")
    assert client8.count(namespace=kalos._kalos_namespace(ns)) == 0


def test_abatch_from_two_event_loops_each_gets_its_own_client(client8: Client):
    """KalosStore shared one AsyncClient by every loop: two threads each running asyncio.run
    hung. Each loop now has its own (a hang guard, not a timing assertion, bounds the threads)."""
    kalos, _ = stores(client8)
    for i in range(10):
        kalos.put(("loops",), f"k{i}", {"text": f"item {i}"})

    async def step(i: int) -> None:
        found = await kalos.asearch(("loops",), query=f"item {i % 10}", limit=1)
        assert len(found) == 1
        assert (await kalos.aget(("loops",), f"k{i % 10}")) is not None

    assert in_two_event_loops(step, 40) == []

    async def mine() -> object:
        return kalos._async_client()

    async def with_another_loop_alive() -> tuple[object, object]:
        return await mine(), await asyncio.to_thread(asyncio.run, mine())

    here, there = asyncio.run(with_another_loop_alive())
    assert here is not there


def test_a_refresh_on_read_does_not_undo_a_delete_or_a_put_made_meanwhile(sidecar8: TextSidecar):
    """refresh_ttl renewed an item's expiry by storing the rows it had read again: another
    writer's delete between that read and the add was undone (the deleted memory came back), a
    delete and a new put of the same key there lost the put, and a put without a ttl got one.
    Now the item's rows are renewed in place, together, and only where they expire. Another
    writer's changes are run inside the window deterministically, from the refresh's call."""
    prefix = f"lg{uuid.uuid4().hex[:10]}"
    index = {"dims": DIM, "embed": DeterministicFakeEmbedding(size=DIM), "fields": ["text"]}
    with Client(sidecar8.name, timeout=DEADLINE_S) as mine, Client(sidecar8.name, timeout=DEADLINE_S) as theirs:
        reader = KalosStore(index=index, client=mine, prefix=prefix)
        other = KalosStore(index=index, client=theirs, prefix=prefix)
        for key, text in [("m", "secret to forget"), ("p", "old value"), ("f", "old forever"), ("kept", "still here")]:
            reader.put(("u",), key, {"text": text}, ttl=60)
        real_renew = mine.renew

        def meanwhile(change: Callable[[], None]) -> None:
            def renew_after_the_change(*args: Any, **kwargs: Any) -> Any:
                mine.renew = real_renew  # type: ignore[method-assign]
                change()
                return real_renew(*args, **kwargs)

            mine.renew = renew_after_the_change  # type: ignore[method-assign]

        try:
            meanwhile(lambda: other.delete(("u",), "m"))
            assert reader.get(("u",), "m", refresh_ttl=True).value == {"text": "secret to forget"}
            meanwhile(lambda: other.put(("u",), "p", {"text": "new value"}, ttl=60))
            assert reader.get(("u",), "p", refresh_ttl=True).value == {"text": "old value"}
            meanwhile(lambda: other.put(("u",), "f", {"text": "new forever"}, ttl=None))
            assert reader.get(("u",), "f", refresh_ttl=True).value == {"text": "old forever"}
        finally:
            mine.renew = real_renew  # type: ignore[method-assign]
        assert other.get(("u",), "m") is None
        assert other.get(("u",), "p").value == {"text": "new value"}
        forever = mine.get(keys=[KalosStore._doc_key("f"), KalosStore._vec_key("f", "text")], namespace=f"{prefix}.u")
        assert [row.expires_at for row in forever] == [None, None]
        assert "m" not in [i.key for i in other.search(("u",), query="secret to forget", limit=5)]
        assert [i.key for i in other.search(("u",))] == ["p", "f", "kept"]
        # An undisturbed refresh keeps the item's rows (same ids) and renews them together.
        rows = [KalosStore._doc_key("kept"), KalosStore._vec_key("kept", "text")]
        before = mine.get(keys=rows, namespace=f"{prefix}.u")
        assert reader.get(("u",), "kept", refresh_ttl=True) is not None
        after = mine.get(keys=rows, namespace=f"{prefix}.u")
        assert [r.id for r in after] == [r.id for r in before]
        assert after[0].expires_at == after[1].expires_at > before[0].expires_at
        assert other.search(("u",), query="still here", limit=1)[0].key == "kept"


def test_filters_on_dollar_and_empty_value_keys_match_as_in_memory_store(client8: Client):
    """The where compiler takes "$x" for an operator and refuses "": such filters raised
    InvalidArgument, while InMemoryStore matches them as value keys."""
    kalos, memory = stores(client8)
    for store in (kalos, memory):
        store.put(("f",), "a", {"text": "one", "$x": 1, "": "e"})
        store.put(("f",), "b", {"text": "two", "$x": 2, "": "f"})
    for flt in ({"$x": 1}, {"": "f"}, {"$x": {"$gte": 1}, "": "e"}, {"$x": 3}):
        same(kalos.search(("f",), filter=flt), memory.search(("f",), filter=flt))
        same(kalos.search(("f",), query="one", filter=flt), memory.search(("f",), query="one", filter=flt))


class ZeroForBlank(DeterministicFakeEmbedding):
    """Embeds the query "blank" as all zeros (and "nan" as NaN): a query with no direction."""

    def embed_query(self, text: str) -> list[float]:
        if text in ("blank", "nan"):
            return [0.0 if text == "blank" else float("nan")] * DIM
        return super().embed_query(text)


def test_a_query_with_no_direction_is_refused_where_scored_here_too(client8: Client):
    """A filter the scan cannot evaluate (JSON containment) scores the items here; a zero or NaN
    query vector gave all-NaN scores there and returned items in arbitrary order, where the
    recall path refuses it."""
    index = {"dims": DIM, "embed": ZeroForBlank(size=DIM), "fields": ["text"]}
    kalos = KalosStore(index=index, client=client8, prefix=f"lg{uuid.uuid4().hex[:10]}")
    kalos.put(("z",), "a", {"text": "one", "meta": {"tag": "t"}})
    for flt in ({"meta": {"tag": "t"}}, {"text": "one"}):  # scored here / recalled by the sidecar
        for query in ("blank", "nan"):
            with pytest.raises(InvalidQuery, match="no direction"):
                kalos.search(("z",), query=query, filter=flt)
        assert [i.key for i in kalos.search(("z",), query="one", filter=flt)] == ["a"]
