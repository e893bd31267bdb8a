"""Kalos as a vector store of mem0 (``mem0ai``): the provider ``"kalos"`` of mem0's ``Memory``.

::

    from mem0 import Memory
    from kalos.integrations.mem0 import register

    register()                                  # once per process: makes "kalos" a mem0 provider
    memory = Memory.from_config({
        "vector_store": {"provider": "kalos",
                         "config": {"sidecar": "default", "collection_name": "mem0", "embedding_model_dims": 384}},
        "embedder": {...}, "llm": {...},
    })

Each mem0 collection is a Kalos namespace (``collection_name``: mem0 itself opens ``<name>_entities``
and, with telemetry on, ``mem0migrations`` beside it); each memory is a Kalos item whose *key* is
mem0's UUID, whose metadata is mem0's payload (``user_id``, ``agent_id``, ``run_id``, ``data``,
``hash``, ``created_at``, ... as mem0 writes them) and whose text is the payload's ``data``.
Scores are cosines (higher is closer), as mem0's default Qdrant store returns them.

Filters (mem0's syntax, the keys of the payload): ``{"user_id": "alice"}``, ``{"k": "*"}`` (the key
exists), ``{"k": [a, b]}`` (any of), ``{"k": {"eq" | "ne" | "gt" | "gte" | "lt" | "lte" | "in" |
"nin": v}}`` (several operators in one dict: all hold), ``AND`` / ``OR`` / ``NOT`` (also spelled
``$and`` / ``$or`` / ``$not``; ``NOT: [f1, f2]`` holds when none of them does). They become a
Kalos ``where`` clause evaluated inside the scan, so a search scoped to one user returns the
true top-k of that user's memories and never another user's. ``contains`` / ``icontains``
(substring, and case-insensitive substring) have no counterpart in the scan: a search using
them scores the matching memories of the collection here, exactly, after listing them (slower
for a large collection, never incomplete); so does a ``top_k`` above the sidecar's ``max_k``.

Dates: mem0 writes ``created_at`` / ``updated_at`` as ISO 8601 text and documents range filters
on them (``{"created_at": {"gte": "2025-01-01T00:00:00"}}``). A range whose operands are all
ISO dates compares instants, as Qdrant does (a date or datetime without a zone is UTC): each
top-level payload value that is an ISO date is stored with its unix seconds beside it (a
metadata key starting ``__kalos_mem0_date:``, never returned), and the range reads those. A
memory stored before that (an older kalos-recall) gains them when it is next updated.

Install with ``pip install 'kalos-recall[mem0]'``.
"""
from __future__ import annotations

import datetime as _dt
import re
import sys
import types
import uuid
from typing import Any, Iterable, Optional

import numpy as np

try:
    from mem0.vector_stores.base import VectorStoreBase
    from pydantic import BaseModel, ConfigDict, Field
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"kalos.integrations.mem0 needs mem0: pip install 'kalos-recall[mem0]' ({exc})") from None

from kalos.client.client import Client, Item
from kalos.client.requests import as_matrix
from kalos.errors import DimensionMismatch, InvalidArgument, InvalidQuery, UnknownKey
from kalos.validation import row_scales
from kalos.where import compile_where

__all__ = ["KalosMem0", "KalosMem0Config", "OutputData", "mem0_where", "register", "PROVIDER"]

#: The provider name that :func:`register` gives Kalos in mem0's configuration.
PROVIDER = "kalos"

_OPERATORS = {"eq": "$eq", "ne": "$ne", "gt": "$gt", "gte": "$gte", "lt": "$lt", "lte": "$lte",
              "in": "$in", "nin": "$nin"}
_SUBSTRING = ("contains", "icontains")
_LOGICAL = {"AND": "AND", "$and": "AND", "OR": "OR", "$or": "OR", "NOT": "NOT", "$not": "NOT"}
_LIST_PAGE = 1000  # Client.list's largest page
_RANGES = ("gt", "gte", "lt", "lte")
#: The metadata key of the unix seconds of an ISO-date payload field (added at insert and
#: update, never returned): the scan compares numbers, and mem0 writes its dates as ISO text.
_DATE = "__kalos_mem0_date:"
# Qdrant's (mem0's default store) test for a datetime range operand, as in its _ISO_DATETIME_RE.
_ISO_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2})?(\.\d+)?(Z|[+-]\d{2}:?\d{2})?)?$")


def _iso_seconds(value: Any) -> float | None:
    """Unix seconds of an ISO 8601 date or datetime string (naive ones read as UTC, as Qdrant
    reads them), else None."""
    if not isinstance(value, str) or not _ISO_DATETIME.match(value):
        return None
    try:
        parsed = _dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=_dt.timezone.utc)
    return parsed.timestamp()


def _with_dates(payload: Any) -> Any:
    """``payload`` as stored: each top-level ISO date value gains its unix seconds beside it."""
    if not isinstance(payload, dict):
        return payload
    dates = {_DATE + k: t for k, v in payload.items() if isinstance(k, str) and (t := _iso_seconds(v)) is not None}
    return {**payload, **dates} if dates else payload


def _without_dates(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metadata.items() if not k.startswith(_DATE)}


class KalosMem0Config(BaseModel):
    """The ``vector_store.config`` of provider ``"kalos"``: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    collection_name: str = Field("mem0", description="the Kalos namespace of this collection")
    embedding_model_dims: Optional[int] = Field(None, description="checked against the sidecar's dimension")
    sidecar: str = Field("default", description="the name of the Kalos sidecar (kalos serve --name)")
    timeout: float = Field(5.0, description="seconds without a sign of life before SidecarUnavailable")


class OutputData(BaseModel):
    """One row as mem0's vector stores return it."""

    id: Optional[str]
    score: Optional[float]
    payload: Optional[dict]


# -- mem0 filters -> Kalos where ----------------------------------------------------------------


def _has_substring(filters: Any) -> bool:
    if isinstance(filters, dict):
        return any(k in _SUBSTRING or _has_substring(v) for k, v in filters.items())
    if isinstance(filters, list):
        return any(_has_substring(v) for v in filters)
    return False


def _logical_items(filters: dict[str, Any]) -> Iterable[tuple[str, str, Any]]:
    """``(kind, key, value)`` per entry. ``OR`` and ``$or`` with the same conditions are one
    (mem0's ``Memory.search`` may pass its processed ``$or`` beside the caller's ``OR``); with
    different conditions both must hold, so that no spelling widens a scope."""
    seen: dict[str, list[Any]] = {}
    for key, value in filters.items():
        kind = _LOGICAL.get(key)
        if kind is not None:
            if value in seen.setdefault(kind, []):
                continue
            seen[kind].append(value)
        yield kind or "FIELD", key, value


def _sub_filters(kind: str, value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict) and kind == "NOT":
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InvalidArgument(f"mem0 filter: {kind} takes a list of filter dicts, got {value!r:.80}")
    return value


def _field_where(key: str, value: Any) -> dict[str, Any]:
    if value is None:
        raise InvalidArgument(f"mem0 filter: {key!r} has no value (None)")
    if isinstance(value, dict):
        ops: dict[str, Any] = {}
        for op, operand in value.items():
            name = op[1:] if op.startswith("$") else op
            if name not in _OPERATORS:
                raise InvalidArgument(f"mem0 filter: unknown operator {op!r} for {key!r}; known: "
                                      f"{sorted(_OPERATORS) + list(_SUBSTRING)}")
            ops[_OPERATORS[name]] = operand
        ranges = [(op, operand) for op, operand in value.items() if op.lstrip("$") in _RANGES]
        seconds = [_iso_seconds(operand) for _, operand in ranges]
        if ranges and all(t is not None for t in seconds):
            # A range of ISO dates (mem0's documented form for created_at / updated_at), as
            # Qdrant reads it: compared as instants, on the seconds stored beside the field.
            dates = {_OPERATORS[op.lstrip("$")]: t for (op, _), t in zip(ranges, seconds)}
            rest = {o: v for o, v in ops.items() if o not in dates}
            return {_DATE + key: dates} if not rest else {"$and": [{key: rest}, {_DATE + key: dates}]}
        return {key: ops}
    if value == "*":
        return {key: {"$exists": True}}
    if isinstance(value, list):
        return {key: {"$in": value}}
    return {key: value}


def mem0_where(filters: dict[str, Any] | None) -> dict[str, Any] | None:
    """A mem0 filter (without ``contains`` / ``icontains``) as a Kalos where clause (None: no filter).
    InvalidArgument names a malformed part."""
    if not filters:
        return None
    if not isinstance(filters, dict):
        raise InvalidArgument(f"mem0 filters must be a dict, got {type(filters).__name__}")
    parts: list[dict[str, Any]] = []
    for kind, key, value in _logical_items(filters):
        if kind == "FIELD":
            parts.append(_field_where(key, value))
            continue
        subs = [w for w in (mem0_where(s) for s in _sub_filters(kind, value)) if w is not None]
        if not subs:
            continue
        if kind == "AND":
            parts.append({"$and": subs})
        elif kind == "OR":
            parts.append({"$or": subs})
        else:  # NOT: none of them holds
            parts.append({"$not": {"$or": subs}})
    if not parts:
        return None
    where = parts[0] if len(parts) == 1 else {"$and": parts}
    compile_where(where)  # a bad operand is refused here, naming the part
    return where


def _matches(filters: dict[str, Any] | None, payload: dict[str, Any]) -> bool:
    """Whether ``payload`` passes a mem0 filter, ``contains`` / ``icontains`` included."""
    if not filters:
        return True
    for kind, key, value in _logical_items(filters):
        if kind == "AND":
            ok = all(_matches(s, payload) for s in _sub_filters(kind, value))
        elif kind == "OR":
            subs = _sub_filters(kind, value)
            ok = not subs or any(_matches(s, payload) for s in subs)
        elif kind == "NOT":
            ok = not any(_matches(s, payload) for s in _sub_filters(kind, value))
        elif isinstance(value, dict) and any(op in _SUBSTRING for op in value):
            rest = {op: v for op, v in value.items() if op not in _SUBSTRING}
            got = payload.get(key)
            ok = isinstance(got, str) and (not rest or compile_where(_field_where(key, rest)).matches(payload))
            for op in _SUBSTRING:
                if ok and op in value:
                    if not isinstance(value[op], str):
                        raise InvalidArgument(f"mem0 filter: {op} of {key!r} takes a str, got {value[op]!r:.80}")
                    ok = value[op] in got if op == "contains" else value[op].lower() in got.lower()
        else:
            ok = compile_where(_field_where(key, value)).matches(payload)
        if not ok:
            return False
    return True


# -- the provider ---------------------------------------------------------------------------------


def _row(item: Item, score: float | None = None) -> OutputData:
    return OutputData(id=item.key, score=score, payload=_without_dates(item.metadata or {}))


class KalosMem0(VectorStoreBase):
    """mem0's ``VectorStoreBase`` over one namespace (``collection_name``) of a Kalos sidecar."""

    def __init__(self, collection_name: str = "mem0", embedding_model_dims: int | None = None,
                 sidecar: str = "default", timeout: float = 5.0, client: Client | None = None) -> None:
        self.collection_name = collection_name
        self.client = client if client is not None else Client(sidecar, timeout=timeout)
        self.create_col(collection_name, embedding_model_dims)

    # -- collections --------------------------------------------------------------------------

    def create_col(self, name: str, vector_size: int | None = None, distance: str = "cosine") -> None:
        """Selects namespace ``name`` (Kalos namespaces need no creation); checks the dimension."""
        if vector_size is not None and vector_size != self.client.dim:
            raise DimensionMismatch(f"mem0 embeds in {vector_size} dimensions but sidecar {self.client.name!r} "
                                    f"holds dimension {self.client.dim}")
        if distance not in ("cosine", None):
            raise InvalidArgument(f"Kalos scores by cosine only, not {distance!r}")
        self.collection_name = name

    def list_cols(self) -> list[str]:
        """The namespaces that hold memories."""
        counts = self.client.stats().get("namespaces", {})
        return sorted(name for name, n in counts.items() if n) if isinstance(counts, dict) else []

    def delete_col(self) -> None:
        self.client.drop_namespace(self.collection_name)

    def col_info(self) -> dict[str, Any]:
        return {"name": self.collection_name, "count": self.client.count(namespace=self.collection_name),
                "dimension": self.client.dim, "distance": "cosine"}

    def reset(self) -> None:
        """Deletes every memory of the collection (the namespace stays usable)."""
        self.delete_col()

    # -- rows --------------------------------------------------------------------------------

    def insert(self, vectors: Any, payloads: list[dict] | None = None, ids: list[str] | None = None) -> None:
        """Stores ``vectors`` with ``payloads`` under ``ids`` (mem0's UUIDs; an id stored already is
        replaced), in one transaction."""
        n = len(vectors)
        if ids is None:
            ids = [str(uuid.uuid4()) for _ in range(n)]
        if payloads is None:
            payloads = [{} for _ in range(n)]
        if len(ids) != n or len(payloads) != n:
            raise InvalidArgument(f"insert: {n} vectors, {len(ids)} ids and {len(payloads)} payloads")
        if n == 0:
            return
        texts = [p.get("data") if isinstance(p, dict) and isinstance(p.get("data"), str) else None for p in payloads]
        self.client.add(np.asarray(vectors, np.float32), texts=texts, metadata=[_with_dates(p) for p in payloads],
                        namespace=self.collection_name, keys=[str(i) for i in ids])

    def _query(self, vectors: Any) -> np.ndarray:
        query = np.asarray(vectors, np.float32)
        if query.ndim == 2 and len(query) == 1:
            query = query[0]
        return query

    def _k(self, top_k: Any) -> int:
        if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 1:
            raise InvalidArgument(f"top_k must be an int >= 1, got {top_k!r}")
        return int(top_k)

    def _scored_here(self, filters: dict | None, k: int) -> bool:
        """Whether a search is scored here, after listing: filters the scan cannot evaluate, or a
        ``top_k`` past the sidecar's ``max_k`` (never cut short to it)."""
        return _has_substring(filters) or k > self.client.max_k

    def _rows_of(self, hits: Any) -> list[OutputData]:
        items = self.client.get(hits.ids) if len(hits) else []
        return [_row(item, float(score)) for item, (_id, score) in zip(items, hits) if item is not None]

    def search(self, query: str, vectors: Any, top_k: int = 5, filters: dict | None = None) -> list[OutputData]:
        """The ``top_k`` memories closest to ``vectors`` (one query vector) among those passing
        ``filters``, best first, with their cosine as ``score``."""
        k = self._k(top_k)
        if self._scored_here(filters, k):
            return self._search_listed(self._query(vectors), k, filters)
        where = mem0_where(filters)
        extra = {} if where is None else {"where": where}
        return self._rows_of(self.client.recall(self._query(vectors), k, namespace=self.collection_name, **extra))

    def search_batch(self, queries: list, vectors_list: list, top_k: int = 1, filters: dict | None = None
                     ) -> list[list[OutputData]]:
        """One :meth:`search` per vector of ``vectors_list``, answered by one batched recall."""
        if len(queries) != len(vectors_list):
            raise InvalidArgument(f"search_batch: {len(queries)} queries and {len(vectors_list)} vectors")
        if not vectors_list:
            return []
        k = self._k(top_k)
        if self._scored_here(filters, k):
            return [self._search_listed(self._query(v), k, filters) for v in vectors_list]
        where = mem0_where(filters)
        extra = {} if where is None else {"where": where}
        batch = self.client.recall_many(np.asarray(vectors_list, np.float32), k, namespace=self.collection_name,
                                        **extra)
        wanted = np.unique(batch.ids[batch.ids >= 0])
        items = {item.id: item for item in (self.client.get(wanted) if len(wanted) else []) if item is not None}
        return [[_row(items[i], float(s)) for i, s in hit if i in items] for hit in batch]

    def _listed(self, filters: dict | None) -> list[Item]:
        """Every memory of the collection passing ``filters`` (the scan's part first, then the rest here)."""
        where = None if _has_substring(filters) else mem0_where(filters)
        out: list[Item] = []
        cursor = None
        while True:
            page = self.client.list(namespace=self.collection_name, where=where, limit=_LIST_PAGE, cursor=cursor)
            out += [item for item in page.items if where is not None or _matches(filters, item.metadata or {})]
            cursor = page.next_cursor
            if cursor is None:
                return out

    def _search_listed(self, query: np.ndarray, k: int, filters: dict | None) -> list[OutputData]:
        # Refused as a recall refuses it: a NaN or zero query has no direction, and its scores
        # (all NaN) ordered the rows arbitrarily.
        row = as_matrix(query, self.client.dim, single=True)
        unit = row[0].astype(np.float64) * row_scales(row, what="query", error=InvalidQuery)[0]
        items = self._listed(filters)
        if not items:
            return []
        with_vectors = [i for i in self.client.get([item.id for item in items], with_vectors=True) if i is not None]
        if not with_vectors:
            return []
        matrix = np.stack([item.vector for item in with_vectors]).astype(np.float64)
        scores = matrix @ unit
        order = np.argsort(-scores, kind="stable")[:k]
        return [_row(with_vectors[i], float(scores[i])) for i in order]

    def delete(self, vector_id: str) -> None:
        self.client.delete(keys=[str(vector_id)], namespace=self.collection_name)

    def update(self, vector_id: str, vector: Any = None, payload: dict | None = None) -> None:
        """Replaces the vector and/or the payload of ``vector_id``; UnknownKey (a KeyError) if absent."""
        change: dict[str, Any] = {}
        if vector is not None:
            change["vector"] = self._query(vector)
        if payload is not None:
            change["metadata"] = _with_dates(payload)
            change["text"] = payload.get("data") if isinstance(payload.get("data"), str) else None
        if change:
            self.client.update(str(vector_id), namespace=self.collection_name, **change)
        elif self.client.get(keys=[str(vector_id)], namespace=self.collection_name)[0] is None:
            raise UnknownKey(f"update: no memory {vector_id!r} in collection {self.collection_name!r}")

    def get(self, vector_id: str) -> OutputData | None:
        [item] = self.client.get(keys=[str(vector_id)], namespace=self.collection_name)
        return None if item is None else _row(item)

    def list(self, filters: dict | None = None, top_k: int | None = None) -> list[list[OutputData]]:
        """The memories passing ``filters`` (at most ``top_k``; None: all), oldest first, wrapped in
        one more list as mem0's own stores return them."""
        limit = None if top_k is None else self._limit(top_k)
        if _has_substring(filters):
            items = self._listed(filters)
        else:
            where = mem0_where(filters)
            items, cursor = [], None
            while limit is None or len(items) < limit:
                page_size = _LIST_PAGE if limit is None else min(_LIST_PAGE, limit - len(items))
                page = self.client.list(namespace=self.collection_name, where=where, limit=page_size, cursor=cursor)
                items += page.items
                cursor = page.next_cursor
                if cursor is None:
                    break
        return [[_row(item) for item in (items if limit is None else items[:limit])]]

    @staticmethod
    def _limit(top_k: Any) -> int:
        if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 1:
            raise InvalidArgument(f"top_k must be an int >= 1 or None, got {top_k!r}")
        return int(top_k)


def register() -> None:
    """Makes ``"kalos"`` a vector store provider of mem0's configuration (idempotent).

    mem0 has no public registry for third-party vector stores: its ``VectorStoreConfig``
    accepts only the names in its private ``_provider_configs`` table and imports the config
    class from ``mem0.configs.vector_stores.<provider>``, and ``VectorStoreFactory`` maps the
    name to a class path. This adds ``"kalos"`` to both tables and installs the module
    ``mem0.configs.vector_stores.kalos`` (holding :class:`KalosMem0Config`); nothing of mem0's
    own providers changes.
    """
    from mem0.utils.factory import VectorStoreFactory
    from mem0.vector_stores.configs import VectorStoreConfig

    module_name = f"mem0.configs.vector_stores.{PROVIDER}"
    if module_name not in sys.modules:
        module = types.ModuleType(module_name, "Kalos's vector store config for mem0 (kalos.integrations.mem0.register)")
        module.KalosMem0Config = KalosMem0Config  # type: ignore[attr-defined]
        sys.modules[module_name] = module
    VectorStoreFactory.provider_to_class[PROVIDER] = f"{__name__}.KalosMem0"
    VectorStoreConfig.__private_attributes__["_provider_configs"].default[PROVIDER] = "KalosMem0Config"
