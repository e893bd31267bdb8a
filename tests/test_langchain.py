"""The LangChain adapter through langchain-core's own interfaces: ``BaseRetriever.invoke`` /
``batch`` / ``ainvoke`` -> ``list[Document]``, and ``VectorStore`` (add_documents,
similarity_search with scores and relevance scores, as_retriever, get_by_ids, delete), with
real MiniLM embeddings against a real sidecar; and a LangChain ``Embeddings`` as the embedder.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import uuid

import numpy as np
import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.vectorstores import VectorStore, VectorStoreRetriever  # noqa: E402

from kalos import Client, InvalidArgument  # noqa: E402
from kalos.embed import DEFAULT_DIM  # noqa: E402
from kalos.integrations.langchain import KalosRetriever, KalosVectorStore  # noqa: E402

from conftest import DEADLINE_S  # noqa: E402
from test_text import FACTS, QUESTIONS, client, minilm, sidecar  # noqa: E402, F401 (shared fixtures)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def ns() -> str:
    return f"lc-{uuid.uuid4().hex[:12]}"


def test_retriever_invoke_returns_documents_best_first(client, ns):
    ids = client.remember(FACTS, namespace=ns, metadata=[{"source": "notes", "i": i} for i in range(len(FACTS))])
    retriever = KalosRetriever(client=client, k=3, namespace=ns)
    assert isinstance(retriever, BaseRetriever)
    for question, want in QUESTIONS:
        docs = retriever.invoke(question)
        assert isinstance(docs, list) and len(docs) == 3 and all(isinstance(d, Document) for d in docs)
        best = docs[0]
        assert best.page_content == FACTS[want]
        assert best.id == str(ids[want])
        assert best.metadata["source"] == "notes" and best.metadata["i"] == want
        kalos = best.metadata["kalos"]
        assert kalos["id"] == int(ids[want]) and kalos["namespace"] == ns and kalos["created_at"] > 0
        scores = [d.metadata["kalos"]["score"] for d in docs]
        assert scores == sorted(scores, reverse=True)


def test_retriever_batch_ainvoke_and_threshold(client, ns):
    client.remember(FACTS, namespace=ns)
    retriever = KalosRetriever(client=client, k=2, namespace=ns)
    questions = [q for q, _ in QUESTIONS[:3]]
    batched = retriever.batch(questions)
    assert [docs[0].page_content for docs in batched] == [FACTS[w] for _, w in QUESTIONS[:3]]
    docs = asyncio.run(retriever.ainvoke(QUESTIONS[3][0]))
    assert docs[0].page_content == FACTS[QUESTIONS[3][1]]
    strict = KalosRetriever(client=client, k=6, namespace=ns, score_threshold=0.5)
    kept = strict.invoke(QUESTIONS[0][0])
    assert kept and all(d.metadata["kalos"]["score"] >= 0.5 for d in kept) and len(kept) < 6


def test_retriever_time_window(client, ns):
    client.remember(["old note about tea", "new note about tea"], namespace=ns, created_at=[100.0, 200.0])
    docs = KalosRetriever(client=client, k=5, namespace=ns, since=150.0).invoke("tea")
    assert [d.page_content for d in docs] == ["new note about tea"]


def test_vector_store_round_trip(client, ns):
    store = KalosVectorStore.from_texts(FACTS[:4], None, [{"n": i} for i in range(4)], client=client, namespace=ns)
    assert isinstance(store, VectorStore)
    docs = store.similarity_search(QUESTIONS[2][0], k=2)
    assert docs[0].page_content == FACTS[2] and docs[0].metadata["n"] == 2
    pairs = store.similarity_search_with_score(QUESTIONS[0][0], k=4)
    assert pairs[0][0].page_content == FACTS[0]
    assert [s for _, s in pairs] == sorted((s for _, s in pairs), reverse=True)
    relevance = store.similarity_search_with_relevance_scores(QUESTIONS[0][0], k=4)
    assert all(0.0 <= r <= 1.0 for _, r in relevance)

    added = store.add_documents([Document(page_content=FACTS[4], metadata={"n": 4})])
    assert len(added) == 1
    retriever = store.as_retriever(search_kwargs={"k": 1})
    assert isinstance(retriever, VectorStoreRetriever)
    assert retriever.invoke(QUESTIONS[4][0])[0].page_content == FACTS[4]

    [got] = store.get_by_ids(added)
    assert got.page_content == FACTS[4] and got.id == added[0]
    assert store.delete(added) is True
    assert store.get_by_ids(added) == []
    with pytest.raises(InvalidArgument, match="assigns ids"):
        store.add_texts(["x"], ids=["my-id"])
    by_vector = store.similarity_search_by_vector(store.embeddings.embed_query(FACTS[1]), k=1)
    assert by_vector[0].page_content == FACTS[1]


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


def test_langchain_embeddings_as_the_embedder(sidecar, ns):
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=HashEmbeddings()) as c:
        ids = c.remember(["purple elephants dance", "silver rivers flow"], namespace=ns)
        assert c.recall_text("rivers", k=1, namespace=ns)[0].id == int(ids[1])
        store = KalosVectorStore(c, embedding=HashEmbeddings(), namespace=ns)
        assert store.similarity_search("elephants", k=1)[0].page_content == "purple elephants dance"
