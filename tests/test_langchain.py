"""The LangChain adapter through langchain-core's own interfaces, against a real sidecar.

* ``BaseRetriever.invoke`` / ``batch`` / ``ainvoke`` with real MiniLM embeddings: best first,
  ``k`` / ``filter`` / ``namespace`` at call time, unknown keyword arguments refused.
* ``KalosVectorStore`` against langchain-core's own ``InMemoryVectorStore`` as the oracle, on
  fresh random documents with the same deterministic embedding: similarity search (with
  scores, by vector, with ``filter``), maximal marginal relevance, sync and async, must return
  the same documents in the same order with the same cosines.
* caller ids as Kalos keys (UUIDs, upsert, ``get_by_ids`` order, delete), no metadata added
  unless ``kalos_metadata=True``, and ``langchain_core.indexing.index()`` with an
  ``InMemoryRecordManager`` (incremental and full cleanup).
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import random
import uuid

import numpy as np
import pytest

pytest.importorskip("langchain_core")

from conftest import DEADLINE_S, in_two_event_loops  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings  # noqa: E402
from langchain_core.indexing import InMemoryRecordManager, index  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore, VectorStoreRetriever  # noqa: E402
from test_text import FACTS, QUESTIONS, client, minilm, sidecar  # noqa: E402, F401 (shared fixtures)

from kalos import AsyncClient, Client, InvalidArgument  # noqa: E402
from kalos.client.embed import DEFAULT_DIM  # noqa: E402
from kalos.integrations.langchain import KalosRetriever, KalosVectorStore  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

USERS = ["alice", "bob", "carol"]


@pytest.fixture
def ns() -> str:
    return f"lc-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def fake() -> DeterministicFakeEmbedding:
    return DeterministicFakeEmbedding(size=DEFAULT_DIM)


@pytest.fixture
def fake_client(sidecar, fake):  # noqa: F811
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=fake) as c:
        yield c


def random_documents(seed: int, n: int) -> list[Document]:
    """``n`` documents of random words with random metadata and UUID ids (a fresh corpus per seed)."""
    r = random.Random(seed)
    words = [f"w{r.randrange(10**6)}" for _ in range(200)]
    return [
        Document(id=str(uuid.UUID(int=r.getrandbits(128), version=4)),
                 page_content=" ".join(r.choices(words, k=r.randint(3, 9))),
                 metadata={"user": r.choice(USERS), "year": r.randint(2015, 2025), "i": i})
        for i in range(n)
    ]


def assert_same_pairs(got: list[tuple[Document, float]], want: list[tuple[Document, float]]) -> None:
    assert [d.id for d, _ in got] == [d.id for d, _ in want]
    assert [(d.page_content, d.metadata) for d, _ in got] == [(d.page_content, d.metadata) for d, _ in want]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], atol=2e-5)


# -- the retriever -----------------------------------------------------------------------------


def test_retriever_invoke_returns_documents_best_first(client, ns):
    keys = [f"fact-{i}" for i in range(len(FACTS))]
    ids = client.remember(FACTS, namespace=ns, metadata=[{"source": "notes", "i": i} for i in range(len(FACTS))],
                          keys=keys)
    retriever = KalosRetriever(client=client, k=3, namespace=ns)
    assert isinstance(retriever, BaseRetriever)
    for question, want in QUESTIONS:
        docs = retriever.invoke(question)
        assert isinstance(docs, list) and len(docs) == 3 and all(isinstance(d, Document) for d in docs)
        best = docs[0]
        assert best.page_content == FACTS[want] and best.id == keys[want]
        assert best.metadata == {"source": "notes", "i": want}  # nothing added
    [doc] = KalosRetriever(client=client, k=1, namespace=ns, kalos_metadata=True).invoke(QUESTIONS[0][0])
    kalos = doc.metadata.pop("kalos")
    assert doc.metadata == {"source": "notes", "i": QUESTIONS[0][1]}
    assert kalos["id"] == int(ids[QUESTIONS[0][1]]) and kalos["namespace"] == ns and kalos["created_at"] > 0
    assert 0.0 < kalos["score"] <= 1.0


def test_retriever_k_namespace_and_filter_at_call_time(client, ns):
    client.remember(FACTS, namespace=ns, metadata=[{"half": i % 2} for i in range(len(FACTS))])
    retriever = KalosRetriever(client=client, k=2, namespace=ns)
    assert len(retriever.invoke(QUESTIONS[0][0])) == 2
    assert len(retriever.invoke(QUESTIONS[0][0], k=1)) == 1
    assert len(retriever.invoke(QUESTIONS[0][0], k=5)) == 5
    assert retriever.invoke(QUESTIONS[0][0], namespace=f"{ns}-empty") == []
    odd = retriever.invoke(QUESTIONS[0][0], k=len(FACTS), filter={"half": 1})
    assert sorted(d.page_content for d in odd) == sorted(FACTS[1::2])
    docs = asyncio.run(retriever.ainvoke(QUESTIONS[0][0], k=len(FACTS), filter={"half": 0}))
    assert sorted(d.page_content for d in docs) == sorted(FACTS[0::2])
    for call in (lambda: retriever.invoke("x", top_k=1), lambda: asyncio.run(retriever.ainvoke("x", score=1))):
        with pytest.raises(InvalidArgument, match="unknown keyword"):
            call()


def test_retriever_batch_ainvoke_and_threshold(client, ns):
    client.remember(FACTS, namespace=ns)
    retriever = KalosRetriever(client=client, k=2, namespace=ns)
    questions = [q for q, _ in QUESTIONS[:3]]
    batched = retriever.batch(questions)
    assert [docs[0].page_content for docs in batched] == [FACTS[w] for _, w in QUESTIONS[:3]]
    docs = asyncio.run(retriever.ainvoke(QUESTIONS[3][0]))
    assert docs[0].page_content == FACTS[QUESTIONS[3][1]] and docs[0].id is None  # stored without a key
    strict = KalosRetriever(client=client, k=6, namespace=ns, score_threshold=0.5, kalos_metadata=True)
    kept = strict.invoke(QUESTIONS[0][0])
    assert kept and all(d.metadata["kalos"]["score"] >= 0.5 for d in kept) and len(kept) < 6


def test_retriever_time_window(client, ns):
    client.remember(["old note about tea", "new note about tea"], namespace=ns, created_at=[100.0, 200.0])
    docs = KalosRetriever(client=client, k=5, namespace=ns, since=150.0).invoke("tea")
    assert [d.page_content for d in docs] == ["new note about tea"]


# -- the vector store against InMemoryVectorStore -------------------------------------------------


def test_vector_store_equals_in_memory_vector_store(fake_client, fake, ns, seed):
    docs = random_documents(seed, 60)
    store = KalosVectorStore(fake_client, embedding=fake, namespace=ns)
    oracle = InMemoryVectorStore(fake)
    assert store.add_documents(docs) == [d.id for d in docs] == oracle.add_documents(docs)
    r = random.Random(seed + 1)
    for _ in range(6):
        query = docs[r.randrange(len(docs))].page_content + " " + f"q{r.randrange(1000)}"
        k = r.randint(1, 12)
        assert_same_pairs(store.similarity_search_with_score(query, k=k), oracle.similarity_search_with_score(query, k=k))
        vector = fake.embed_query(query)
        assert_same_pairs(store.similarity_search_with_score_by_vector(vector, k=k),
                          oracle.similarity_search_with_score_by_vector(vector, k=k))
        assert [d.id for d in store.similarity_search_by_vector(vector, k=k)] == \
            [d.id for d in oracle.similarity_search_by_vector(vector, k=k)]
        user, year = r.choice(USERS), r.randint(2016, 2024)
        assert_same_pairs(
            store.similarity_search_with_score(query, k=k, filter={"user": user, "year": {"$gte": year}}),
            oracle.similarity_search_with_score(
                query, k=k, filter=lambda d: d.metadata["user"] == user and d.metadata["year"] >= year),
        )
        fetch_k, lambda_mult = r.randint(k, 30), r.choice([0.0, 0.25, 0.5, 0.9])
        assert [d.id for d in store.max_marginal_relevance_search(query, k=k, fetch_k=fetch_k, lambda_mult=lambda_mult)] == \
            [d.id for d in oracle.max_marginal_relevance_search(query, k=k, fetch_k=fetch_k, lambda_mult=lambda_mult)]
        assert [d.id for d in store.max_marginal_relevance_search(query, k=k, fetch_k=fetch_k, filter={"user": user})] == \
            [d.id for d in oracle.max_marginal_relevance_search(
                query, k=k, fetch_k=fetch_k, filter=lambda d: d.metadata["user"] == user)]

        async def both() -> None:
            assert_same_pairs(await store.asimilarity_search_with_score(query, k=k, filter={"user": user}),
                              await oracle.asimilarity_search_with_score(
                                  query, k=k, filter=lambda d: d.metadata["user"] == user))
            assert_same_pairs(await store.asimilarity_search_with_score_by_vector(vector, k=k),
                              oracle.similarity_search_with_score_by_vector(vector, k=k))
            assert [d.id for d in await store.amax_marginal_relevance_search(query, k=k, fetch_k=fetch_k)] == \
                [d.id for d in await oracle.amax_marginal_relevance_search(query, k=k, fetch_k=fetch_k)]

        asyncio.run(both())
    # Upsert of a third of them, delete of another third: both stores agree again.
    changed = [Document(id=d.id, page_content=d.page_content + " revised", metadata={**d.metadata, "v": 2})
               for d in docs[:20]]
    store.add_documents(changed)
    oracle.add_documents(changed)
    gone = [d.id for d in docs[20:40]]
    store.delete(gone)
    oracle.delete(gone)
    ids = [d.id for d in docs]
    assert store.get_by_ids(ids) == oracle.get_by_ids(ids)
    query = changed[3].page_content
    assert_same_pairs(store.similarity_search_with_score(query, k=50), oracle.similarity_search_with_score(query, k=50))


def test_vector_store_ids_are_keys_and_nothing_is_added(fake_client, fake, ns):
    store = KalosVectorStore(fake_client, embedding=fake, namespace=ns)
    assert isinstance(store, VectorStore)
    ids = store.add_texts(["alpha", "beta"], [{"n": 1}, {}])
    assert all(uuid.UUID(i).version == 4 for i in ids)  # fresh UUIDs where none were given
    [doc] = store.similarity_search("alpha", k=1)
    assert doc == Document(id=ids[0], page_content="alpha", metadata={"n": 1})
    # The order of get_by_ids is the caller's; unknown ids are left out.
    assert [d.page_content for d in store.get_by_ids([ids[1], "nope", ids[0]])] == ["beta", "alpha"]
    assert store.get_by_ids([]) == []
    assert store.add_texts(["beta v2"], ids=[ids[1]]) == [ids[1]]  # upsert: replaced, not added
    assert [d.page_content for d in store.similarity_search("x", k=10)] in (["alpha", "beta v2"], ["beta v2", "alpha"])
    [with_kalos] = KalosVectorStore(fake_client, embedding=fake, namespace=ns, kalos_metadata=True).get_by_ids([ids[0]])
    assert set(with_kalos.metadata) == {"n", "kalos"} and with_kalos.metadata["kalos"]["score"] is None
    assert store.delete([ids[0], "never-there"]) is True
    assert store.get_by_ids(ids) == [Document(id=ids[1], page_content="beta v2", metadata={})]
    assert store.add_texts(["a", "b", "c"], ids=["x1", "x2", "x3"], batch_size=2) == ["x1", "x2", "x3"]
    assert len(store.get_by_ids(["x1", "x2", "x3"])) == 3
    other = KalosVectorStore(fake_client, embedding=fake, namespace=f"{ns}-other")
    other.add_texts(["elsewhere"], ids=["x1"])
    assert store.delete() is True  # ids=None: every document of this store's namespace, as LangChain says
    assert store.get_by_ids(["x1", "x2", "x3", ids[1]]) == [] and store.similarity_search("a", k=5) == []
    assert [d.page_content for d in other.get_by_ids(["x1"])] == ["elsewhere"]
    assert asyncio.run(other.adelete()) is True and other.get_by_ids(["x1"]) == []


def test_ids_that_are_not_keys_name_no_document_in_any_namespace(fake_client, fake, ns):
    """An integer id is a global Kalos item id to the client: get_by_ids([id]) and delete([id])
    read and deleted another namespace's document. As InMemoryVectorStore, an id that cannot be
    a stored key (not a str, empty, over-long) finds nothing and deletes nothing."""
    secret = KalosVectorStore(fake_client, embedding=fake, namespace=f"{ns}-secret")
    public = KalosVectorStore(fake_client, embedding=fake, namespace=ns)
    secret.add_texts(["the launch code"], ids=["s1"])
    [item] = fake_client.get(keys=["s1"], namespace=secret.namespace)
    oracle = InMemoryVectorStore(fake)
    oracle.add_texts(["x"], ids=["s1"])
    for bad in ([item.id], [np.int64(item.id)], [""], ["k" * 300], ["\ud800"]):
        assert public.get_by_ids(bad) == oracle.get_by_ids(bad) == []
        assert asyncio.run(public.aget_by_ids(bad)) == []
        assert public.delete(bad) is True and asyncio.run(public.adelete(bad)) is True
    assert [d.page_content for d in secret.get_by_ids(["s1"])] == ["the launch code"]
    assert [d.id for d in public.get_by_ids([item.id, "nope"])] == []


def test_get_with_vectors_returns_the_stored_normalised_vectors(fake_client, ns, rng):
    """What MMR reads: Client.get(..., with_vectors=True), by keys and by ids, absent ones None."""
    vectors = rng.standard_normal((5, DEFAULT_DIM)).astype(np.float32) * rng.uniform(0.1, 10.0, (5, 1)).astype(np.float32)
    ids = fake_client.add(vectors, keys=[f"v{i}" for i in range(5)], namespace=ns)
    want = vectors.astype(np.float64) / np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
    by_key = fake_client.get(keys=["v3", "absent", "v0", "v3"], namespace=ns, with_vectors=True)
    assert by_key[1] is None and [i.key for i in (by_key[0], by_key[2], by_key[3])] == ["v3", "v0", "v3"]
    for item, row in ((by_key[0], 3), (by_key[2], 0), (by_key[3], 3)):
        assert item.vector.dtype == np.float32 and item.vector.shape == (DEFAULT_DIM,)
        np.testing.assert_allclose(item.vector, want[row], atol=1e-6)
    by_id = fake_client.get(ids=[int(ids[4]), 2**62], with_vectors=True)
    np.testing.assert_allclose(by_id[0].vector, want[4], atol=1e-6)
    assert by_id[1] is None
    assert fake_client.get(keys=["v1"], namespace=ns)[0].vector is None  # only when asked
    with pytest.raises(InvalidArgument, match="with_vectors"):
        fake_client.get(keys=["v1"], namespace=ns, with_vectors="yes")


@pytest.mark.parametrize("call", [
    lambda s: s.add_texts(["x"], unknown=1),
    lambda s: s.add_texts(["x"], batch_size=0),
    lambda s: s.similarity_search("x", k=1, where={"a": 1}),
    lambda s: s.similarity_search_with_score("x", k=1, fetch_k=3),
    lambda s: s.similarity_search_by_vector([0.0] * DEFAULT_DIM, k=1, score_threshold=0.2),
    lambda s: s.max_marginal_relevance_search("x", k=1, foo=2),
    lambda s: s.max_marginal_relevance_search("x", k=-1),
    lambda s: s.similarity_search("x", k=-1),
    lambda s: s.add_texts(["x"], ids=[5]),
    lambda s: s.delete(["x"], cascade=True),
    lambda s: s.delete("kept"),
    lambda s: s.similarity_search("x", k=1, filter="user = alice"),
    lambda s: s.similarity_search("x", k=1, filter={"user": {"$regex": "a.*"}}),
    lambda s: asyncio.run(s.asimilarity_search("x", k=1, top_k=3)),
    lambda s: asyncio.run(s.aadd_texts(["x"], upsert=True)),
    lambda s: KalosVectorStore.from_texts(["x"], s.embeddings, client=s.client, namespace=s.namespace, colour=1),
])
def test_unknown_arguments_are_refused_and_change_nothing(fake_client, fake, ns, call):
    store = KalosVectorStore(fake_client, embedding=fake, namespace=ns)
    store.add_texts(["kept"], ids=["kept"])
    with pytest.raises(InvalidArgument):
        call(store)
    assert [d.id for d in store.similarity_search("kept", k=5)] == ["kept"]


def test_relevance_scores_and_as_retriever(fake_client, fake, ns):
    store = KalosVectorStore.from_texts(["one", "two", "three"], fake, [{"n": i} for i in range(3)],
                                        ids=["1", "2", "3"], client=fake_client, namespace=ns)
    relevance = store.similarity_search_with_relevance_scores("two", k=3)
    assert relevance[0][0].id == "2" and relevance[0][1] == pytest.approx(1.0, abs=1e-5)
    assert all(0.0 <= r <= 1.0 for _, r in relevance)
    retriever = store.as_retriever(search_kwargs={"k": 1})
    assert isinstance(retriever, VectorStoreRetriever)
    assert [d.id for d in retriever.invoke("three")] == ["3"]
    assert [d.id for d in retriever.invoke("three", filter={"n": {"$lt": 2}})] in (["1"], ["2"])
    mmr = store.as_retriever(search_type="mmr", search_kwargs={"k": 2, "fetch_k": 3})
    assert len(mmr.invoke("one")) == 2 and mmr.invoke("one")[0].id == "1"


def test_indexing_api_incremental_and_full_cleanup(fake_client, fake, ns):
    store = KalosVectorStore(fake_client, embedding=fake, namespace=ns)
    manager = InMemoryRecordManager(namespace=f"kalos/{ns}")
    manager.create_schema()
    a = [Document(page_content=f"a{i}", metadata={"source": "a.txt"}) for i in range(3)]
    b = [Document(page_content=f"b{i}", metadata={"source": "b.txt"}) for i in range(2)]

    def contents() -> list[str]:
        return sorted(d.page_content for d in store.similarity_search("anything", k=50))

    result = index(a + b, manager, store, cleanup="incremental", source_id_key="source", key_encoder="sha256")
    assert (result["num_added"], result["num_skipped"], result["num_deleted"]) == (5, 0, 0)
    assert contents() == ["a0", "a1", "a2", "b0", "b1"]
    result = index(a + b, manager, store, cleanup="incremental", source_id_key="source", key_encoder="sha256")
    assert (result["num_added"], result["num_skipped"], result["num_deleted"]) == (0, 5, 0)
    # a.txt changed: its old chunks go, b.txt's stay.
    a2 = [Document(page_content="a0", metadata={"source": "a.txt"}),
          Document(page_content="a-new", metadata={"source": "a.txt"})]
    result = index(a2, manager, store, cleanup="incremental", source_id_key="source", key_encoder="sha256")
    assert (result["num_added"], result["num_skipped"], result["num_deleted"]) == (1, 1, 2)
    assert contents() == ["a-new", "a0", "b0", "b1"]
    # Full: whatever is not in this run goes.
    result = index(b[:1], manager, store, cleanup="full", source_id_key="source", key_encoder="sha256")
    assert (result["num_added"], result["num_skipped"], result["num_deleted"]) == (0, 1, 3)
    assert contents() == ["b0"]
    result = asyncio.run(_aindex(a[:1], manager, store))
    assert (result["num_added"], result["num_deleted"]) == (1, 1)
    assert contents() == ["a0"]


async def _aindex(docs, manager, store):
    from langchain_core.indexing import aindex

    return await aindex(docs, manager, store, cleanup="full", source_id_key="source", key_encoder="sha256")


class HashEmbeddings(Embeddings):
    """A LangChain Embeddings of a user's own (deterministic bag of words, 384-dim)."""

    def _one(self, text: str) -> list[float]:
        v = np.zeros(DEFAULT_DIM, np.float32)
        for word in text.lower().split():
            v[int(hashlib.md5(word.strip(".,?!").encode()).hexdigest(), 16) % DEFAULT_DIM] += 1.0
        return v.tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._one(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._one(text)


def test_langchain_embeddings_as_the_embedder(sidecar, ns):  # noqa: F811
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=HashEmbeddings()) as c:
        ids = c.remember(["purple elephants dance", "silver rivers flow"], namespace=ns)
        assert c.recall_text("rivers", k=1, namespace=ns)[0].id == int(ids[1])
        store = KalosVectorStore(c, embedding=HashEmbeddings(), namespace=ns)
        assert store.similarity_search("elephants", k=1)[0].page_content == "purple elephants dance"


def test_async_calls_from_two_event_loops_each_get_their_own_client(fake_client, fake, ns, rng):
    """One AsyncClient binds its lock and futures to one loop: shared by two threads each running
    asyncio.run, their calls hung. Each loop now has its own; a closed loop's one is closed."""
    store = KalosVectorStore(fake_client, embedding=fake, namespace=ns)
    vectors = rng.standard_normal((20, DEFAULT_DIM)).astype(np.float32)
    keys = [f"d{i}" for i in range(20)]
    fake_client.add(vectors, keys=keys, texts=keys, namespace=ns)

    async def step(i: int) -> None:
        [doc] = await store.asimilarity_search_by_vector(vectors[i % 20].tolist(), k=1)
        assert doc.id == keys[i % 20]

    assert in_two_event_loops(step, 60) == []

    async def both_loops() -> tuple[object, object]:
        inner: list[object] = []

        def other_loop() -> None:
            async def mine() -> None:
                inner.append(store._aclient)
            asyncio.run(mine())
        await asyncio.to_thread(other_loop)
        return store._aclient, inner[0]

    here, there = asyncio.run(both_loops())
    assert here is not there and asyncio.run(both_loops())[0] is not here  # a new loop, a new client

    async def clients_now() -> int:
        await store.asimilarity_search_by_vector(vectors[0].tolist(), k=1)  # connects this loop's
        return (await asyncio.to_thread(fake_client.stats))["clients"]

    first = asyncio.run(clients_now())
    # The first loop's client (closed with its loop) gave its slots back: none piles up.
    assert asyncio.run(clients_now()) == first == asyncio.run(clients_now())


class QueryUnlikeDocuments(Embeddings):
    """An asymmetric model (E5, Cohere): a query is embedded unlike a document. Here a query is
    the document embedding of its text reversed, so "ahpla" finds "alpha" at cosine 1 by
    embed_query and nothing in particular by embed_documents."""

    def __init__(self) -> None:
        self.base = DeterministicFakeEmbedding(size=DEFAULT_DIM)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.base.embed_documents(texts)

    def embed_query(self, text: str) -> list[float]:
        return self.base.embed_documents([text[::-1]])[0]


def test_searches_embed_their_query_with_embed_query(sidecar, ns):  # noqa: F811
    """LangChain's contract: documents by embed_documents, queries by embed_query. Searches,
    MMR and the retriever embedded the query with embed_documents."""
    asym = QueryUnlikeDocuments()
    texts = ["alpha", "beta", "gamma", "delta"]
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=asym) as c:
        for store in (KalosVectorStore(c, embedding=asym, namespace=ns), KalosVectorStore(c, namespace=ns)):
            store.add_texts(texts, ids=texts)
            oracle = InMemoryVectorStore(asym)
            oracle.add_texts(texts, ids=texts)
            assert_same_pairs(store.similarity_search_with_score("ahpla", k=4),
                              oracle.similarity_search_with_score("ahpla", k=4))
            [(doc, score)] = asyncio.run(store.asimilarity_search_with_score("ammag", k=1))
            assert doc.id == "gamma" and score == pytest.approx(1.0, abs=1e-5)
            assert store.max_marginal_relevance_search("ateb", k=1, fetch_k=4)[0].id == "beta"
            assert asyncio.run(store.amax_marginal_relevance_search("ateb", k=1, fetch_k=4))[0].id == "beta"
            assert np.allclose(store.embeddings.embed_query("ahpla"), asym.embed_documents(["alpha"])[0], atol=1e-6)
        retriever = KalosRetriever(client=c, k=1, namespace=ns)
        assert [d.id for d in retriever.invoke("atled")] == ["delta"]
        assert [d.id for d in asyncio.run(retriever.ainvoke("atled"))] == ["delta"]
        # The client's own text API with that embedder: queries by embed_query too.
        assert c.recall_text("ahpla", k=1, namespace=ns)[0].text == "alpha"

        async def recall_async() -> str:
            async with AsyncClient(sidecar.name, timeout=DEADLINE_S, embedder=asym) as ac:
                return (await ac.recall_text("ammag", k=1, namespace=ns))[0].text

        assert asyncio.run(recall_async()) == "gamma"


def test_k_zero_k_past_max_k_and_a_repeated_id_as_in_memory_vector_store(fake_client, fake, ns, rng):
    """InMemoryVectorStore returns what exists for any k, nothing for k=0, and keeps the later
    document of an id given twice in one add; the store raised for the three."""
    store = KalosVectorStore(fake_client, embedding=fake, namespace=ns)
    oracle = InMemoryVectorStore(fake)
    texts = [f"doc {i} {rng.integers(1000)}" for i in range(fake_client.max_k + 20)]
    ids = [f"i{i}" for i in range(len(texts))]
    ids[5] = ids[3]  # given twice: the document at 5 wins
    for s in (store, oracle):
        assert s.add_texts(texts, [{"n": i % 3} for i in range(len(texts))], ids=ids, batch_size=100) == ids
    assert store.get_by_ids(["i3"]) == oracle.get_by_ids(["i3"]) == [Document(id="i3", page_content=texts[5], metadata={"n": 2})]
    query = "doc 7"
    k = fake_client.max_k + 50
    assert_same_pairs(store.similarity_search_with_score(query, k=k), oracle.similarity_search_with_score(query, k=k))
    assert len(store.similarity_search(query, k=k)) == len(texts) - 1
    want = oracle.similarity_search_with_score(query, k=k, filter=lambda d: d.metadata["n"] == 1)
    assert_same_pairs(store.similarity_search_with_score(query, k=k, filter={"n": 1}), want)
    assert_same_pairs(asyncio.run(store.asimilarity_search_with_score(query, k=k, filter={"n": 1})), want)
    assert [d.id for d in store.max_marginal_relevance_search(query, k=3, fetch_k=k)] == \
        [d.id for d in oracle.max_marginal_relevance_search(query, k=3, fetch_k=k)]
    for call in (lambda s: s.similarity_search(query, k=0), lambda s: s.max_marginal_relevance_search(query, k=0)):
        assert call(store) == call(oracle) == []
    assert asyncio.run(store.asimilarity_search(query, k=0)) == []
    assert store.similarity_search_by_vector([0.0] * DEFAULT_DIM, k=0) == []
