"""Kalos for LangChain: a retriever, a vector store and an embeddings adapter (langchain-core only).

::

    from kalos import Client
    from kalos.integrations.langchain import KalosRetriever, KalosVectorStore

    memory = Client()                                     # the sidecar `kalos serve --name default`
    memory.remember(["The deploy key is in vault under ops/deploy"])
    retriever = KalosRetriever(client=memory, k=4)        # a langchain_core BaseRetriever
    docs = retriever.invoke("where is the deploy key?", k=2, filter={"team": "ops"})

    store = KalosVectorStore(memory, embedding=my_embeddings, namespace="notes")
    store.add_documents(docs, ids=["a", "b"])             # the ids are Kalos keys: a second add upserts
    store.similarity_search_with_score("...", k=4, filter={"year": {"$gte": 2020}})

The ids of the store are Kalos *keys* (any str of 1 to 256 UTF-8 bytes, unique in the store's
namespace): the ids given to ``add_texts`` / ``add_documents`` (or the documents' own ``id``),
else a fresh UUID4 each. Adding an id again replaces that document (upsert); ``get_by_ids`` and
``delete`` take them. Each returned ``Document`` has ``id`` = its key (None for a memory stored
without one, e.g. by :meth:`kalos.Client.remember` without ``keys``), ``page_content`` = its
text and ``metadata`` = its metadata as stored, nothing added. ``kalos_metadata=True`` adds
``metadata["kalos"] = {"id", "score", "namespace", "created_at", "updated_at"}`` (the Kalos
item id, the cosine; ``score`` is None from ``get_by_ids``).

``filter=`` is a Kalos ``where`` clause (Chroma / mem0 syntax: ``{"user_id": "alice"}``,
``{"year": {"$gte": 2020}}``, ``$and`` / ``$or`` / ``$not``), evaluated inside the scan, so the
top-k among the matching documents is complete. A keyword argument the adapter does not know is
refused with :class:`kalos.InvalidArgument`, never ignored. The async methods (``aadd_texts``,
``asimilarity_search``, ``ainvoke``, ...) use :class:`kalos.AsyncClient`: a recall waits
without blocking the event loop.

Install with ``pip install 'kalos-recall[langchain]'``; importing this module without langchain-core
raises an ImportError naming that extra.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
import weakref
from typing import Any, Iterable, Sequence

try:
    from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.vectorstores import VectorStore
    from langchain_core.vectorstores.utils import maximal_marginal_relevance
    from pydantic import ConfigDict
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"kalos.integrations.langchain needs langchain-core: pip install 'kalos-recall[langchain]' ({exc})") from None

import numpy as np

from kalos.client.aio import AsyncClient
from kalos.client.client import Client, Hit, Item
from kalos.client.embed import embed_queries
from kalos.client.requests import as_matrix, to_timestamp
from kalos.errors import DimensionMismatch, InvalidArgument, InvalidQuery
from kalos.integrations._loops import LoopClients
from kalos.validation import MAX_KEY_BYTES, row_scales

__all__ = ["KalosRetriever", "KalosVectorStore", "KalosEmbeddings", "hit_to_document", "item_to_document"]

# The search keywords every search method takes besides k and filter (Client.recall's own).
_SEARCH_KEYWORDS = ("namespace", "since", "until")
_LIST_PAGE = 1000  # Client.list's largest page


def item_to_document(item: Item, score: float | None = None, *, kalos_metadata: bool = False) -> Document:
    """A Kalos item (or hit) as a LangChain Document: ``id`` = its key, its text and metadata as stored."""
    metadata = dict(item.metadata or {})
    if kalos_metadata:
        metadata["kalos"] = {"id": item.id, "score": score, "namespace": item.namespace,
                             "created_at": item.created_at, "updated_at": item.updated_at}
    return Document(id=item.key, page_content=item.text or "", metadata=metadata)


def hit_to_document(hit: Hit, *, kalos_metadata: bool = False) -> Document:
    """A Kalos :class:`~kalos.client.results.Hit` as a LangChain Document (see :func:`item_to_document`)."""
    return item_to_document(hit, hit.score, kalos_metadata=kalos_metadata)  # type: ignore[arg-type]


def _refuse(what: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise InvalidArgument(f"{what}: unknown keyword argument(s) {sorted(kwargs)}; Kalos does not ignore "
                              f"arguments it does not understand")


def _where(filter: Any) -> dict[str, Any]:
    """``filter=`` as recall's keyword arguments (none when no filter: every sidecar takes that)."""
    if filter is None:
        return {}
    if not isinstance(filter, dict):
        raise InvalidArgument(f"filter must be a dict (a Kalos where clause), got {type(filter).__name__}")
    return {"where": filter}


def _stored_ids(ids: Any, what: str) -> list[str]:
    """The ids of ``ids`` that could be stored keys, in order, repeats kept. LangChain ids are
    str: anything else, like an empty or over-long str, names no document (InMemoryVectorStore
    finds none), and must never reach the client, which reads integers as global item ids."""
    if isinstance(ids, str):
        raise InvalidArgument(f"{what} takes a list of ids, got the str {ids!r:.80}")
    return [i for i in ids if isinstance(i, str) and _fits_key(i)]


def _fits_key(key: str) -> bool:
    try:
        return 0 < len(key.encode("utf-8")) <= MAX_KEY_BYTES
    except UnicodeEncodeError:  # a lone surrogate: no stored key holds one
        return False


def _check_k(k: Any) -> int:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
        raise InvalidArgument(f"k must be an int >= 0, got {k!r:.80}")
    return int(k)


_ASYNC_CLIENTS: "weakref.WeakKeyDictionary[Client, LoopClients]" = weakref.WeakKeyDictionary()
_ASYNC_LOCK = threading.Lock()


def _async_client(client: Client) -> AsyncClient:
    """The :class:`AsyncClient` of ``client``'s sidecar for the running event loop, shared by this
    module's async methods (each one holds slots: one per Client and loop, not one per store or
    retriever; an AsyncClient serves one loop at a time)."""
    with _ASYNC_LOCK:
        clients = _ASYNC_CLIENTS.get(client)
        if clients is None:
            name, timeout = client.name, client.timeout
            clients = _ASYNC_CLIENTS[client] = LoopClients(lambda: AsyncClient(name, timeout))
    return clients.get()


class KalosRetriever(BaseRetriever):
    """``retriever.invoke(query, k=..., filter=...) -> list[Document]``: a text recall behind
    LangChain's interface.

    ``k``, ``filter`` (a where clause), ``namespace``, ``since`` and ``until`` are the defaults
    of every call, and each may be given to ``invoke`` / ``ainvoke`` too. ``namespace=None``
    searches every namespace; ``since``/``until`` (unix seconds) keep memories created in
    ``[since, until)``; ``score_threshold`` drops hits below that cosine. The query is embedded
    by the client's embedder (``Client(embedder=...)``).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    client: Client
    k: int = 4
    namespace: str | None = "default"
    since: float | None = None
    until: float | None = None
    filter: dict[str, Any] | None = None
    score_threshold: float | None = None
    kalos_metadata: bool = False

    def _arguments(self, kwargs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        k = kwargs.pop("k", self.k)
        call = {name: kwargs.pop(name, getattr(self, name)) for name in _SEARCH_KEYWORDS}
        call.update(_where(kwargs.pop("filter", self.filter)))
        _refuse("KalosRetriever.invoke", kwargs)
        return k, call

    def _documents(self, hits: list[Hit]) -> list[Document]:
        if self.score_threshold is not None:
            hits = [h for h in hits if h.score >= self.score_threshold]
        return [hit_to_document(h, kalos_metadata=self.kalos_metadata) for h in hits]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, call = self._arguments(kwargs)
        embedder = self.client.embedder
        if not hasattr(embedder, "embed_queries"):
            return self._documents(self.client.recall_text(query, k, **call))
        # Client.recall_text embeds with embed(), a LangChain Embeddings' embed_documents; a query
        # is embed_query's (they differ for asymmetric models: E5, Cohere).
        if not isinstance(query, str):
            raise InvalidArgument(f"a retriever's query is one str, got {type(query).__name__}")
        hits = self.client.recall(embed_queries(embedder, [query])[0], k, **call)
        items = self.client.get(hits.ids) if len(hits) else []
        return self._documents([Hit.from_item(item, score) for item, (_i, score) in zip(items, hits) if item is not None])

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, call = self._arguments(kwargs)
        if not isinstance(query, str):
            raise InvalidArgument(f"a retriever's query is one str, got {type(query).__name__}")
        vector = (await asyncio.to_thread(embed_queries, self.client.embedder, [query]))[0]
        aclient = _async_client(self.client)
        hits = await aclient.recall(vector, k, **call)
        items = await aclient.get(hits.ids) if len(hits) else []
        return self._documents([Hit.from_item(item, score) for item, (_i, score) in zip(items, hits) if item is not None])


class KalosEmbeddings(Embeddings):
    """A Kalos embedder (``kalos.client.embed``) as LangChain ``Embeddings``."""

    def __init__(self, embedder: Any) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return embed_queries(self.embedder, [text])[0].tolist()


class KalosVectorStore(VectorStore):
    """A LangChain ``VectorStore`` over one namespace of a Kalos sidecar (see the module docstring).

    ``embedding`` is any LangChain ``Embeddings`` or Kalos embedder; None uses the client's
    own (the packaged MiniLM by default). Its dimension must be the store's.
    """

    def __init__(
        self, client: Client, *, embedding: Any = None, namespace: str = "default", kalos_metadata: bool = False,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.kalos_metadata = kalos_metadata
        self._embedding = embedding
        if embedding is None:
            self._embedder = None
        else:
            from kalos.client.embed import as_embedder

            self._embedder = as_embedder(embedding)

    def _embedder_checked(self) -> Any:
        if self._embedder is None:
            return self.client.embedder
        if self._embedder.dim != self.client.dim:
            raise DimensionMismatch(
                f"embedding {self._embedder.name} makes {self._embedder.dim}-dimensional vectors but the store "
                f"of sidecar {self.client.name!r} holds dimension {self.client.dim}"
            )
        return self._embedder

    def _embed(self, texts: list[str]) -> np.ndarray:
        """The vectors of documents to store (``embed_documents`` of a LangChain Embeddings)."""
        return self._embedder_checked().embed(texts)

    def _embed_query(self, query: str) -> np.ndarray:
        """The vector of a search query (``embed_query`` of a LangChain Embeddings)."""
        if not isinstance(query, str):
            raise InvalidArgument(f"a search query is one str, got {type(query).__name__}")
        return embed_queries(self._embedder_checked(), [query])[0]

    @property
    def embeddings(self) -> Embeddings:
        if isinstance(self._embedding, Embeddings):
            return self._embedding
        return KalosEmbeddings(self._embedder if self._embedder is not None else self.client.embedder)

    @property
    def _aclient(self) -> AsyncClient:
        return _async_client(self.client)

    # -- writes ------------------------------------------------------------------------------

    def _add_batches(self, texts: Iterable[str], metadatas: Any, ids: Any, kwargs: dict[str, Any]
                     ) -> tuple[list[str], list[dict[str, Any]]]:
        """The ids of an add and its batches (the keyword arguments of one ``client.add`` each,
        less the vectors)."""
        namespace = kwargs.pop("namespace", self.namespace)
        batch_size = kwargs.pop("batch_size", None)
        _refuse("add_texts", kwargs)
        texts = list(texts)
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size < 1):
            raise InvalidArgument(f"add_texts: batch_size must be an int >= 1, got {batch_size!r}")
        if ids is not None and len(ids) != len(texts):
            raise InvalidArgument(f"add_texts: {len(ids)} ids for {len(texts)} texts")
        if metadatas is not None and len(metadatas) != len(texts):
            raise InvalidArgument(f"add_texts: {len(metadatas)} metadatas for {len(texts)} texts")
        # A document without an id gets a fresh UUID4, as LangChain's own stores do.
        keys = [str(uuid.uuid4()) if ids is None or ids[i] is None else ids[i] for i in range(len(texts))]
        # An id given twice keeps its later document, as InMemoryVectorStore does (the client
        # refuses a key twice in one add).
        for i, key in enumerate(keys):
            if not isinstance(key, str):
                raise InvalidArgument(f"add_texts: ids[{i}] must be a str or None, got {type(key).__name__} {key!r:.80}")
        last = {key: i for i, key in enumerate(keys)}
        kept = [i for i, key in enumerate(keys) if last[key] == i]
        if len(kept) < len(keys):
            texts = [texts[i] for i in kept]
            metadatas = None if metadatas is None else [metadatas[i] for i in kept]
            stored = [keys[i] for i in kept]
        else:
            stored = keys
        step = batch_size or max(1, len(texts))
        batches = [{"texts": texts[i : i + step], "keys": stored[i : i + step], "namespace": namespace,
                    "metadata": None if metadatas is None else list(metadatas[i : i + step])}
                   for i in range(0, len(texts), step)]
        return keys, batches

    def add_texts(
        self, texts: Iterable[str], metadatas: list[dict[str, Any]] | None = None, *,
        ids: list[str] | None = None, **kwargs: Any,
    ) -> list[str]:
        """Stores ``texts`` under ``ids`` (Kalos keys; an id already stored is replaced), else under
        fresh UUID4s; returns the ids. ``namespace=`` overrides the store's for this call;
        ``batch_size=`` splits the add into transactions of that many documents (default: one)."""
        keys, batches = self._add_batches(texts, metadatas, ids, kwargs)
        for batch in batches:
            self.client.add(self._embed(batch["texts"]), **batch)
        return keys

    async def aadd_texts(
        self, texts: Iterable[str], metadatas: list[dict[str, Any]] | None = None, *,
        ids: list[str] | None = None, **kwargs: Any,
    ) -> list[str]:
        keys, batches = self._add_batches(texts, metadatas, ids, kwargs)
        for batch in batches:
            vectors = await asyncio.to_thread(self._embed, batch["texts"])
            await self._aclient.add(vectors, **batch)
        return keys

    def _delete_request(self, ids: Any, kwargs: dict[str, Any]) -> tuple[list[str] | None, str]:
        namespace = kwargs.pop("namespace", self.namespace)
        _refuse("delete", kwargs)
        return None if ids is None else _stored_ids(ids, "delete"), namespace

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Deletes the documents of ``ids`` (ids not stored are ignored); ``ids=None``, as
        LangChain documents it, deletes every document of the store's namespace. True."""
        keys, namespace = self._delete_request(ids, kwargs)
        if keys is None:
            self.client.drop_namespace(namespace)
        elif keys:
            self.client.delete(keys=keys, namespace=namespace)
        return True

    async def adelete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        keys, namespace = self._delete_request(ids, kwargs)
        if keys is None:
            await self._aclient.drop_namespace(namespace)
        elif keys:
            await self._aclient.delete(keys=keys, namespace=namespace)
        return True

    # -- reads -------------------------------------------------------------------------------

    def _documents_of(self, items: list[Item | None]) -> list[Document]:
        return [item_to_document(item, kalos_metadata=self.kalos_metadata) for item in items if item is not None]

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The documents of those ``ids`` that are stored, in the order of ``ids``."""
        keys = _stored_ids(ids, "get_by_ids")
        return self._documents_of(self.client.get(keys=keys, namespace=self.namespace)) if keys else []

    async def aget_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        keys = _stored_ids(ids, "aget_by_ids")
        return self._documents_of(await self._aclient.get(keys=keys, namespace=self.namespace)) if keys else []

    def _search_request(self, filter: Any, kwargs: dict[str, Any], what: str) -> dict[str, Any]:
        call = {"namespace": kwargs.pop("namespace", self.namespace), "since": kwargs.pop("since", None),
                "until": kwargs.pop("until", None), **_where(filter)}
        _refuse(what, kwargs)
        return call

    def _pairs(self, hits: Any, items: list[Item | None]) -> list[tuple[Document, float]]:
        # A document deleted between the recall and the fetch is left out.
        return [(item_to_document(item, float(score), kalos_metadata=self.kalos_metadata), float(score))
                for item, (_id, score) in zip(items, hits) if item is not None]

    def _nearest(self, embedding: Any, k: Any, call: dict[str, Any], *, with_vectors: bool = False
                 ) -> tuple[Any, list[Item | None]]:
        """The ``k`` nearest documents' ``(id, cosine)`` pairs, best first, and their items."""
        if _check_k(k) == 0:
            return [], []
        query = np.asarray(embedding, np.float32)
        if k > self.client.max_k:
            return self._listed_nearest(query, k, call, with_vectors)
        hits = self.client.recall(query, k, **call)
        return hits, (self.client.get(hits.ids, with_vectors=with_vectors) if len(hits) else [])

    async def _anearest(self, embedding: Any, k: Any, call: dict[str, Any], *, with_vectors: bool = False
                        ) -> tuple[Any, list[Item | None]]:
        if _check_k(k) == 0:
            return [], []
        query = np.asarray(embedding, np.float32)
        if k > self.client.max_k:
            return await asyncio.to_thread(self._listed_nearest, query, k, call, with_vectors)
        hits = await self._aclient.recall(query, k, **call)
        return hits, (await self._aclient.get(hits.ids, with_vectors=with_vectors) if len(hits) else [])

    def _listed_nearest(self, query: np.ndarray, k: int, call: dict[str, Any], with_vectors: bool
                        ) -> tuple[list[tuple[int, float]], list[Item | None]]:
        """:meth:`_nearest` for a ``k`` past the sidecar's ``max_k``: every document passing the
        filters is listed and scored here (as InMemoryVectorStore, all there are up to ``k``,
        never cut short to ``max_k``)."""
        row = as_matrix(query, self.client.dim, single=True)
        unit = row[0].astype(np.float64) * row_scales(row, what="query", error=InvalidQuery)[0]
        since, until = (None if call[b] is None else to_timestamp(call[b], b) for b in ("since", "until"))
        listed: list[Item] = []
        cursor = None
        while True:
            page = self.client.list(namespace=call["namespace"], where=call.get("where"), limit=_LIST_PAGE,
                                    cursor=cursor)
            listed += [item for item in page.items if (since is None or item.created_at >= since)
                       and (until is None or item.created_at < until)]
            cursor = page.next_cursor
            if cursor is None:
                break
        items = [i for i in (self.client.get([i.id for i in listed], with_vectors=True) if listed else []) if i is not None]
        if not items:
            return [], []
        scores = np.stack([item.vector for item in items]).astype(np.float64) @ unit
        order = np.argsort(-scores, kind="stable")[:k]
        chosen = [items[i] if with_vectors else dataclasses.replace(items[i], vector=None) for i in order]
        return [(item.id, float(scores[i])) for item, i in zip(chosen, order)], chosen

    def similarity_search_with_score_by_vector(
        self, embedding: Sequence[float], k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        """``(Document, cosine)`` pairs, best first, among the documents that pass ``filter``.
        ``namespace=`` (None: every namespace), ``since=`` and ``until=`` narrow it further.
        ``k=0`` finds nothing; a ``k`` past the sidecar's ``max_k`` scores every matching
        document here, after listing them (slower, never incomplete)."""
        call = self._search_request(filter, kwargs, "similarity_search")
        return self._pairs(*self._nearest(embedding, k, call))

    async def _asearch_with_score_by_vector(
        self, embedding: Any, k: int, filter: Any, kwargs: dict[str, Any],
    ) -> list[tuple[Document, float]]:
        call = self._search_request(filter, kwargs, "asimilarity_search")
        return self._pairs(*(await self._anearest(embedding, k, call)))

    async def asimilarity_search_with_score_by_vector(
        self, embedding: Sequence[float], k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        return await self._asearch_with_score_by_vector(embedding, k, filter, kwargs)

    def _query_vector(self, query: str) -> np.ndarray:
        return self._embed_query(query)

    async def _aquery_vector(self, query: str) -> np.ndarray:
        return await asyncio.to_thread(self._embed_query, query)

    def similarity_search_with_score(
        self, query: str, k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        """``(Document, cosine)`` pairs, best first (filters as in :meth:`similarity_search_with_score_by_vector`)."""
        return self.similarity_search_with_score_by_vector(self._query_vector(query), k, filter, **kwargs)

    async def asimilarity_search_with_score(
        self, query: str, k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        return await self._asearch_with_score_by_vector(await self._aquery_vector(query), k, filter, kwargs)

    def similarity_search(self, query: str, k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any
                          ) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score(query, k, filter, **kwargs)]

    async def asimilarity_search(self, query: str, k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any
                                 ) -> list[Document]:
        return [doc for doc, _ in await self.asimilarity_search_with_score(query, k, filter, **kwargs)]

    def similarity_search_by_vector(
        self, embedding: list[float], k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score_by_vector(embedding, k, filter, **kwargs)]

    async def asimilarity_search_by_vector(
        self, embedding: list[float], k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[Document]:
        return [doc for doc, _ in await self._asearch_with_score_by_vector(embedding, k, filter, kwargs)]

    def _select_relevance_score_fn(self) -> Any:
        return lambda cosine: (1.0 + cosine) / 2.0  # cosine in [-1, 1] -> relevance in [0, 1]

    # -- maximal marginal relevance ------------------------------------------------------------

    def _mmr(self, embedding: Any, hits: Any, items: list[Item | None], k: int, lambda_mult: float) -> list[Document]:
        present = [(item, float(score)) for item, (_id, score) in zip(items, hits) if item is not None]
        if not present:
            return []
        chosen = maximal_marginal_relevance(
            np.asarray(embedding, np.float32), [item.vector for item, _ in present], lambda_mult=lambda_mult, k=k,
        )
        return [item_to_document(*present[i], kalos_metadata=self.kalos_metadata) for i in chosen]

    def _mmr_check(self, k: int, fetch_k: int) -> None:
        for label, value, least in (("k", k, 0), ("fetch_k", fetch_k, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgument(f"max_marginal_relevance_search: {label} must be an int >= {least}, got {value!r}")

    def max_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
        filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[Document]:
        """``k`` documents chosen for relevance and diversity among the ``fetch_k`` nearest that
        pass ``filter`` (their vectors come from the store: nothing is embedded again)."""
        self._mmr_check(k, fetch_k)
        call = self._search_request(filter, kwargs, "max_marginal_relevance_search")
        if k == 0:
            return []
        hits, items = self._nearest(embedding, fetch_k, call, with_vectors=True)
        return self._mmr(embedding, hits, items, k, lambda_mult)

    async def amax_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
        filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[Document]:
        self._mmr_check(k, fetch_k)
        call = self._search_request(filter, kwargs, "amax_marginal_relevance_search")
        if k == 0:
            return []
        hits, items = await self._anearest(embedding, fetch_k, call, with_vectors=True)
        return self._mmr(embedding, hits, items, k, lambda_mult)

    def max_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
        filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[Document]:
        return self.max_marginal_relevance_search_by_vector(
            self._query_vector(query), k, fetch_k, lambda_mult, filter, **kwargs)

    async def amax_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
        filter: dict[str, Any] | None = None, **kwargs: Any,
    ) -> list[Document]:
        return await self.amax_marginal_relevance_search_by_vector(
            await self._aquery_vector(query), k, fetch_k, lambda_mult, filter, **kwargs)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_texts(
        cls, texts: list[str], embedding: Any = None, metadatas: list[dict[str, Any]] | None = None, *,
        ids: list[str] | None = None, client: Client | None = None, name: str = "default",
        namespace: str = "default", kalos_metadata: bool = False, **kwargs: Any,
    ) -> "KalosVectorStore":
        """A store over ``client`` (or a new ``Client(name)``) holding ``texts``."""
        _refuse("from_texts", kwargs)
        store = cls(client if client is not None else Client(name), embedding=embedding, namespace=namespace,
                    kalos_metadata=kalos_metadata)
        store.add_texts(texts, metadatas, ids=ids)
        return store
