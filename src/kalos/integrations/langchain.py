"""Kalos for LangChain: a retriever, a vector store and an embeddings adapter (langchain-core only).

::

    from kalos import Client
    from kalos.integrations.langchain import KalosRetriever, KalosVectorStore

    memory = Client()                                     # the sidecar `kalos serve --name default`
    memory.remember(["The deploy key is in vault under ops/deploy"])
    retriever = KalosRetriever(client=memory, k=4)        # a langchain_core BaseRetriever
    docs = retriever.invoke("where is the deploy key?")   # list[Document], best first

    store = KalosVectorStore.from_texts(texts, embedding=None, client=memory, namespace="notes")
    store.similarity_search_with_score("...", k=4)        # [(Document, cosine), ...]

Each returned ``Document`` has ``id`` = the Kalos item id (as a string), ``page_content`` = the
memory's text and ``metadata`` = the stored metadata plus ``"kalos": {"id", "score",
"namespace", "created_at"}`` (nested, so it never collides with keys of your own).

Install with ``pip install 'kalos-recall[langchain]'``; importing this module without langchain-core
raises an ImportError naming that extra.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

try:
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.vectorstores import VectorStore
    from pydantic import ConfigDict
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"kalos.integrations.langchain needs langchain-core: pip install 'kalos-recall[langchain]' ({exc})") from None

import numpy as np

from kalos.client import Client, Hit
from kalos.errors import DimensionMismatch, InvalidArgument

__all__ = ["KalosRetriever", "KalosVectorStore", "KalosEmbeddings", "hit_to_document"]


def hit_to_document(hit: Hit) -> Document:
    """A Kalos hit as a LangChain Document (see the module docstring for the fields)."""
    metadata = dict(hit.metadata or {})
    metadata["kalos"] = {"id": hit.id, "score": hit.score, "namespace": hit.namespace, "created_at": hit.created_at}
    return Document(id=str(hit.id), page_content=hit.text or "", metadata=metadata)


class KalosRetriever(BaseRetriever):
    """``retriever.invoke(query) -> list[Document]``: ``client.recall_text`` behind LangChain's interface.

    ``namespace=None`` searches every namespace; ``since``/``until`` (unix seconds) keep
    memories created in ``[since, until)``; ``score_threshold`` drops hits below that cosine.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    client: Client
    k: int = 4
    namespace: str | None = "default"
    since: float | None = None
    until: float | None = None
    score_threshold: float | None = None

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        hits = self.client.recall_text(query, k=self.k, namespace=self.namespace, since=self.since, until=self.until)
        if self.score_threshold is not None:
            hits = [h for h in hits if h.score >= self.score_threshold]
        return [hit_to_document(h) for h in hits]


class KalosEmbeddings(Embeddings):
    """A Kalos embedder (``kalos.embed``) as LangChain ``Embeddings``."""

    def __init__(self, embedder: Any) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed([text])[0].tolist()


class KalosVectorStore(VectorStore):
    """A LangChain ``VectorStore`` over a Kalos sidecar. Kalos assigns the ids (int64, as strings).

    ``embedding`` is any LangChain ``Embeddings`` or Kalos embedder; None uses the client's
    own (the packaged MiniLM by default). Its dimension must be the store's.
    """

    def __init__(self, client: Client, *, embedding: Any = None, namespace: str = "default") -> None:
        self.client = client
        self.namespace = namespace
        if embedding is None:
            self._embedder = None
        else:
            from kalos.embed import as_embedder

            self._embedder = as_embedder(embedding)

    def _embed(self, texts: list[str]) -> np.ndarray:
        if self._embedder is None:
            return self.client.embedder.embed(texts)
        if self._embedder.dim != self.client.dim:
            raise DimensionMismatch(
                f"embedding {self._embedder.name} makes {self._embedder.dim}-dimensional vectors but the store "
                f"of sidecar {self.client.name!r} holds dimension {self.client.dim}"
            )
        return self._embedder.embed(texts)

    @property
    def embeddings(self) -> Embeddings:
        return KalosEmbeddings(self._embedder if self._embedder is not None else self.client.embedder)

    def add_texts(
        self, texts: Iterable[str], metadatas: list[dict[str, Any]] | None = None, *,
        ids: list[str] | None = None, namespace: str | None = None, **kwargs: Any,
    ) -> list[str]:
        if ids is not None and any(i is not None for i in ids):
            raise InvalidArgument("Kalos assigns ids itself; add without ids and keep the ones returned")
        texts = list(texts)
        if not texts:
            return []
        vectors = self._embed(texts)
        added = self.client.add(vectors, texts=texts, metadata=metadatas, namespace=namespace or self.namespace)
        return [str(i) for i in added.tolist()]

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [doc for doc, _score in self.similarity_search_with_score(query, k, **kwargs)]

    def similarity_search_with_score(
        self, query: str, k: int = 4, *, namespace: str | None = "", since: float | None = None,
        until: float | None = None, **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        """``(Document, cosine)`` pairs, best first. ``namespace`` defaults to the store's; None: all."""
        return self._search(self._embed([query])[0], k, namespace, since, until)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return [doc for doc, _score in self._search(np.asarray(embedding, np.float32), k,
                                                    kwargs.get("namespace", ""), kwargs.get("since"),
                                                    kwargs.get("until"))]

    def _search(self, vector: np.ndarray, k: int, namespace: str | None, since: Any, until: Any
                ) -> list[tuple[Document, float]]:
        ns = self.namespace if namespace == "" else namespace
        hits = self.client.recall(vector, k=k, namespace=ns, since=since, until=until)
        items = self.client.get(hits.ids) if len(hits) else []
        return [(hit_to_document(Hit.from_item(item, score)), score)
                for item, (_id, score) in zip(items, hits) if item is not None]

    def _select_relevance_score_fn(self) -> Any:
        return lambda cosine: (1.0 + cosine) / 2.0  # cosine in [-1, 1] -> relevance in [0, 1]

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        if ids is None:
            raise InvalidArgument("delete needs the ids to delete (Kalos does not drop a whole store this way)")
        self.client.delete([int(i) for i in ids])
        return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        items = self.client.get([int(i) for i in ids])
        return [hit_to_document(Hit.from_item(item, 0.0)) for item in items if item is not None]

    @classmethod
    def from_texts(
        cls, texts: list[str], embedding: Any = None, metadatas: list[dict[str, Any]] | None = None, *,
        ids: list[str] | None = None, client: Client | None = None, name: str = "default",
        namespace: str = "default", **kwargs: Any,
    ) -> "KalosVectorStore":
        """A store over ``client`` (or a new ``Client(name)``) holding ``texts``."""
        store = cls(client if client is not None else Client(name), embedding=embedding, namespace=namespace)
        store.add_texts(texts, metadatas, ids=ids)
        return store
