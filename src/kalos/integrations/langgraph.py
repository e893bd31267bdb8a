"""Kalos as a LangGraph long-term memory store: :class:`KalosStore`, a ``langgraph.store.base.BaseStore``.

::

    from kalos.integrations.langgraph import KalosStore

    store = KalosStore("default", index={"dims": 384, "embed": embeddings, "fields": ["text"]})
    store.put(("users", "alice", "memories"), "m1", {"text": "likes green tea", "kind": "pref"})
    store.search(("users", "alice"), query="what does she drink?", filter={"kind": "pref"}, limit=3)

``name`` is the sidecar's (``kalos serve --name``); ``index`` and ``ttl`` are LangGraph's
``IndexConfig`` and ``TTLConfig``, as for ``InMemoryStore(index=...)``; ``prefix`` separates
several stores in one sidecar. Results equal ``langgraph.store.memory.InMemoryStore``'s for the
same operations (tests/test_langgraph.py runs generated sequences against both), except where
that store keeps leftovers: a namespace is listed while it holds items (InMemoryStore also
lists one that a ``get`` touched or whose items were all deleted, as ``PostgresStore`` does
not), and a put replaces the item's vectors (InMemoryStore keeps a previous put's vectors for
paths the new value no longer indexes).

How items are kept: the namespace tuple, joined by ``.`` (a label may not hold one) after
``prefix``, is a Kalos namespace of at most 255 UTF-8 bytes. Each item is one *document* row
(Kalos key ``d:<key>``: the value as metadata, a constant placeholder vector) and one *vector*
row per embedded text (the text's embedding, the value's fields copied beside it, so that a
``filter`` is evaluated inside the scan: a filtered search returns the true top ``limit``).
The puts of a batch are one Kalos add per namespace and ttl (an upsert of all their rows, one
transaction, in which the vector rows of paths no longer indexed are overwritten as dead
rows that nothing reads), then a delete of those dead rows (after a crash in between, the
item's next put or delete removes them). A search with a query recalls vector rows
(max-pooled per item, as InMemoryStore scores an item by its best text); without one it lists
documents, namespaces in the order their first item was stored, items in the order they were first
put. (InMemoryStore orders namespaces by their first touch: a get of a namespace that holds
nothing, or a put that a delete in the same batch cancels, places it too.)
Filters with nested objects or lists (InMemoryStore's JSON containment) are evaluated here,
after listing, exactly.

TTL (``supports_ttl``): a put's ``ttl`` (minutes, LangGraph's unit) becomes the Kalos
expiry; expired items are never returned and the sidecar sweeps them. ``refresh_on_read``
(per call: ``refresh_ttl``) renews the expiry of the items a get or search returns, in place
(``Client.renew``: an item deleted meanwhile stays deleted).

``abatch`` runs the same steps as ``batch`` on the event loop: recalls through
:class:`kalos.AsyncClient` (waited for without blocking the loop), the index's ``aembed_query``
/ ``aembed_documents``, the control calls in worker threads (as AsyncClient runs them).

Install with ``pip install 'kalos-recall[langgraph]'``.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from datetime import datetime, timezone
from typing import Any, Iterable, Sequence

try:
    from langgraph.store.base import (
        BaseStore,
        GetOp,
        IndexConfig,
        InvalidNamespaceError,
        Item,
        ListNamespacesOp,
        MatchCondition,
        Op,
        PutOp,
        Result,
        SearchItem,
        SearchOp,
        TTLConfig,
        ensure_embeddings,
        get_text_at_path,
        tokenize_path,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"kalos.integrations.langgraph needs langgraph: pip install 'kalos-recall[langgraph]' ({exc})") from None

import numpy as np

from kalos.client.aio import AsyncClient
from kalos.client.client import Client
from kalos.client.client import Item as KalosItem
from kalos.client.requests import as_matrix
from kalos.errors import DimensionMismatch, InvalidArgument, InvalidQuery
from kalos.integrations._loops import LoopClients
from kalos.validation import MAX_KEY_BYTES, check_namespace, encode_metadata, row_scales

__all__ = ["KalosStore", "MAX_NAMESPACE_BYTES"]

#: A namespace tuple joined (with the store's prefix) must fit a Kalos namespace.
MAX_NAMESPACE_BYTES = 255

_R = "__kalos_lg_"  # reserved metadata keys: a value may not use them
_PREFIX, _KIND, _KEY, _DEPTH = _R + "prefix", _R + "kind", _R + "key", _R + "depth"
_PATHS, _NVEC, _PATH = _R + "paths", _R + "nvec", _R + "path"
_CREATED, _UPDATED, _TTL = _R + "created", _R + "updated", _R + "ttl"
_LIST_PAGE = 1000  # Client.list's largest page
_DOC = "d:"  # the Kalos key of an item's document row is this + the item's key


def _call(name: str, *args: Any, **kwargs: Any) -> tuple[str, str, tuple, dict]:
    """One Client call, yielded by the store's steps (run by :meth:`KalosStore._drive` or ``_adrive``)."""
    return ("kalos", name, args, kwargs)


def _embed(name: str, *args: Any) -> tuple[str, str, tuple, dict]:
    """One call of the index's Embeddings (``embed_query`` / ``embed_documents``; ``a...`` when async)."""
    return ("embed", name, args, {})


def _label(depth: int) -> str:
    return f"{_R}ns{depth}"


def _stamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


# -- LangGraph filters --------------------------------------------------------------------------


def _compare(value: Any, wanted: Any) -> bool:
    """InMemoryStore's filter semantics (JSON containment for objects, exact lists, ``==``)."""
    if isinstance(wanted, dict):
        if any(k.startswith("$") for k in wanted):
            return all(_apply(value, op, operand) for op, operand in wanted.items())
        if not isinstance(value, dict):
            return False
        return all(_compare(value.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, (list, tuple)):
        return (isinstance(value, (list, tuple)) and len(value) == len(wanted)
                and all(_compare(v, w) for v, w in zip(value, wanted)))
    return value == wanted


def _apply(value: Any, op: str, operand: Any) -> bool:
    if op == "$eq":
        return value == operand
    if op == "$ne":
        return value != operand
    if op in _RANGE:
        try:
            return _RANGE[op](float(value), float(operand))
        except (TypeError, ValueError):
            raise InvalidArgument(f"filter: {op} compares numbers, got {value!r:.40} and {operand!r:.40}") from None
    raise InvalidArgument(f"filter: unknown operator {op!r} (known: $eq $ne $gt $gte $lt $lte)")


_RANGE = {"$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b, "$lt": lambda a, b: a < b,
          "$lte": lambda a, b: a <= b}


def _matches(flt: dict[str, Any] | None, value: dict[str, Any]) -> bool:
    return not flt or all(_compare(value.get(k), v) for k, v in flt.items())


def _scalar(x: Any) -> bool:
    return isinstance(x, (str, bool)) or (isinstance(x, (int, float)) and math.isfinite(x))


def _equal_where(field: str, operand: Any) -> dict[str, Any]:
    """``value[field] == operand`` in Python's sense (True == 1 == 1.0) as a Kalos clause."""
    if isinstance(operand, str):
        return {field: operand}
    same = [operand]
    if isinstance(operand, bool):
        same.append(int(operand))
    elif operand in (0, 1):
        same.append(bool(operand))
    return {field: {"$in": same}}


def _where_of(flt: dict[str, Any] | None) -> dict[str, Any] | None:
    """A LangGraph filter as a Kalos where clause with the same meaning, or None when it has
    objects or lists (JSON containment, evaluated after listing instead)."""
    parts: list[dict[str, Any]] = []
    for field, wanted in (flt or {}).items():
        # The where compiler reads "$..." as an operator and refuses "" as a field name;
        # InMemoryStore matches such value keys like any other: compared here after listing.
        if not isinstance(field, str) or not field or field.startswith(("$", _R)):
            return None
        if _scalar(wanted):
            parts.append(_equal_where(field, wanted))
            continue
        if not isinstance(wanted, dict) or not wanted or not all(k.startswith("$") for k in wanted):
            return None
        for op, operand in wanted.items():
            if not _scalar(operand):
                return None
            if op == "$eq":
                parts.append(_equal_where(field, operand))
            elif op == "$ne":
                parts.append({"$not": _equal_where(field, operand)})
            elif op in _RANGE and not isinstance(operand, (str, bool)):
                # float(True) is 1.0 in InMemoryStore's comparison; a number only in the scan's.
                either = [{field: {op: operand}}] + [{field: b} for b in (True, False) if _RANGE[op](float(b), operand)]
                parts.append(either[0] if len(either) == 1 else {"$or": either})
            else:
                return None
    return {"$and": parts} if parts else {}


# -- the store ---------------------------------------------------------------------------------------


class KalosStore(BaseStore):
    """A LangGraph ``BaseStore`` over a Kalos sidecar (see the module docstring)."""

    supports_ttl: bool = True

    def __init__(self, name: str = "default", *, index: IndexConfig | None = None, ttl: TTLConfig | None = None,
                 prefix: str = "langgraph", client: Client | None = None, timeout: float = 5.0) -> None:
        if not isinstance(prefix, str) or not prefix or "." in prefix:
            raise InvalidArgument(f"prefix must be a non-empty str without '.', got {prefix!r}")
        self.client = client if client is not None else Client(name, timeout=timeout)
        self.prefix = prefix
        self.ttl_config = ttl
        self.index_config = None
        self.embeddings = None
        self._fields: list[tuple[str, Any]] = []
        if index:
            self.index_config = dict(index)
            self.embeddings = ensure_embeddings(index.get("embed"))
            dims = index.get("dims")
            if dims is not None and dims != self.client.dim:
                raise DimensionMismatch(f"index dims {dims} differ from sidecar {self.client.name!r}'s dimension {self.client.dim}")
            self._fields = [(p, tokenize_path(p) if p != "$" else p) for p in (index.get("fields") or ["$"])]
        self._placeholder = np.zeros(self.client.dim, np.float32)
        self._placeholder[0] = 1.0  # documents need a vector; no recall of documents ever reads it
        name_, timeout_ = self.client.name, self.client.timeout
        self._aclients = LoopClients(lambda: AsyncClient(name_, timeout_))

    # -- names -------------------------------------------------------------------------------

    def _kalos_namespace(self, namespace: tuple[str, ...]) -> str:
        if not isinstance(namespace, tuple) or not namespace:
            raise InvalidNamespaceError(f"namespace must be a non-empty tuple of str, got {namespace!r}")
        for label in namespace:
            if not isinstance(label, str) or not label or "." in label:
                raise InvalidNamespaceError(f"namespace labels are non-empty str without '.', got {label!r} in {namespace!r}")
        joined = ".".join((self.prefix, *namespace))
        try:
            size = len(joined.encode("utf-8"))
            check_namespace(joined)  # the client's own rules (valid Unicode, no control characters)
        except UnicodeEncodeError:
            raise InvalidNamespaceError(f"namespace {namespace!r} is not valid Unicode (a lone surrogate); "
                                        f"Kalos namespaces are UTF-8") from None
        except InvalidArgument as exc:
            raise InvalidNamespaceError(f"namespace {namespace!r} cannot be a Kalos namespace: {exc}") from None
        if size > MAX_NAMESPACE_BYTES:
            raise InvalidNamespaceError(
                f"namespace {namespace!r} joined with prefix {self.prefix!r} is {size} UTF-8 bytes; "
                f"Kalos namespaces hold at most {MAX_NAMESPACE_BYTES}")
        return joined

    def _tuple_of(self, kalos_namespace: str) -> tuple[str, ...] | None:
        head, _, rest = kalos_namespace.partition(".")
        return tuple(rest.split(".")) if head == self.prefix and rest else None

    @staticmethod
    def _doc_key(key: str) -> str:
        if not isinstance(key, str):
            raise InvalidArgument(f"a key is a str, got {type(key).__name__}")
        if not key:
            raise InvalidArgument("a key is a non-empty str, got ''")
        try:
            size = len(key.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument(f"key {key!r:.80} is not valid Unicode (lone surrogate)") from None
        # The document row's Kalos key is "d:" + key, so a key has two bytes less than a Kalos key.
        if size > MAX_KEY_BYTES - len(_DOC):
            raise InvalidArgument(f"key {key[:40]!r}... is {size} UTF-8 bytes; KalosStore keys hold at most "
                                  f"{MAX_KEY_BYTES - len(_DOC)}")
        return _DOC + key

    @staticmethod
    def _vec_key(key: str, path: str) -> str:
        return "v:" + hashlib.sha256(json.dumps([key, path]).encode()).hexdigest()[:48]

    def _prefix_where(self, namespace_prefix: tuple[str, ...]) -> dict[str, Any]:
        clause: dict[str, Any] = {_PREFIX: self.prefix}
        if namespace_prefix:
            clause[_DEPTH] = {"$gte": len(namespace_prefix)}
            clause.update({_label(i): label for i, label in enumerate(namespace_prefix)})
        return clause

    # -- rows -> items ---------------------------------------------------------------------------

    @staticmethod
    def _value(metadata: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in metadata.items() if not k.startswith(_R)}

    def _item(self, row: KalosItem, score: float | None = None, *, search: bool = False) -> Item:
        meta = row.metadata or {}
        namespace = self._tuple_of(row.namespace) or ()
        args = dict(value=self._value(meta), key=meta[_KEY], namespace=namespace,
                    created_at=_stamp(meta[_CREATED]), updated_at=_stamp(meta[_UPDATED]))
        return SearchItem(**args, score=score) if search else Item(**args)

    # -- batch ---------------------------------------------------------------------------------

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Reads first, against the state before the batch; then the puts, the last one per
        (namespace, key) winning (InMemoryStore's order)."""
        return self._drive(self._batch(list(ops)))

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch` on the event loop: recalls through :class:`kalos.AsyncClient` (waited for
        without blocking the loop), the index's ``aembed_*``, control calls in worker threads."""
        return await self._adrive(self._batch(list(ops)))

    # The operations are written once, as generators that yield each call they need (a Client
    # method or an Embeddings one) and receive its result; the two drivers below run them.

    def _drive(self, steps: Any) -> Any:
        result = None
        while True:
            try:
                target, name, args, kwargs = steps.send(result)
            except StopIteration as done:
                return done.value
            result = getattr(self.client if target == "kalos" else self.embeddings, name)(*args, **kwargs)

    async def _adrive(self, steps: Any) -> Any:
        result = None
        while True:
            try:
                target, name, args, kwargs = steps.send(result)
            except StopIteration as done:
                return done.value
            if target == "kalos":
                result = await getattr(self._async_client(), name)(*args, **kwargs)
            else:
                result = await getattr(self.embeddings, "a" + name)(*args, **kwargs)

    def _async_client(self) -> AsyncClient:
        """The running loop's AsyncClient (one serves one loop at a time; see ``_loops``)."""
        return self._aclients.get()

    def _batch(self, ops: list[Op]) -> Any:
        for op in ops:
            # Every op is checked (a put as the client will check its rows) before anything
            # runs: one refused after earlier puts, or a get's refresh, had written would leave
            # the batch half applied.
            if isinstance(op, (PutOp, GetOp)):
                self._kalos_namespace(op.namespace)
                self._doc_key(op.key)
                if isinstance(op, PutOp) and op.value is not None:
                    self._check_value(op)
            elif isinstance(op, SearchOp):
                self._check_search(op)
            elif not isinstance(op, ListNamespacesOp):
                raise InvalidArgument(f"unknown store operation {type(op).__name__}")
        results: list[Result] = [None] * len(ops)
        puts: dict[tuple[tuple[str, ...], str], PutOp] = {}
        for i, op in enumerate(ops):
            if isinstance(op, GetOp):
                results[i] = yield from self._get(op)
            elif isinstance(op, SearchOp):
                results[i] = yield from self._search(op)
            elif isinstance(op, ListNamespacesOp):
                results[i] = yield from self._list_namespaces(op)
            else:
                puts[(op.namespace, op.key)] = op
        if puts:
            yield from self._apply_puts(list(puts.values()))
        return results

    # -- get -----------------------------------------------------------------------------------

    def _get(self, op: GetOp) -> Any:
        ns = self._kalos_namespace(op.namespace)
        [row] = yield _call("get", keys=[self._doc_key(op.key)], namespace=ns)
        if row is None:
            return None
        if op.refresh_ttl:
            yield from self._refresh([row])
        return self._item(row)

    # -- put -----------------------------------------------------------------------------------

    def _texts(self, op: PutOp) -> list[tuple[str, str]]:
        """``(path, text)`` of every text of ``op.value`` to embed (InMemoryStore's paths)."""
        if self.embeddings is None or op.index is False:
            return []
        fields = self._fields if op.index is None else [(p, tokenize_path(p)) for p in op.index]
        out: list[tuple[str, str]] = []
        for path, tokens in fields:
            texts = get_text_at_path(op.value, tokens)
            if len(texts) > 1:
                out += [(f"{path}.{i}", t) for i, t in enumerate(texts)]
            elif texts:
                out.append((path, texts[0]))
        return out

    def _check_value(self, op: PutOp) -> dict[str, Any]:
        value = op.value
        if not isinstance(value, dict):
            raise InvalidArgument(f"put: a value is a dict, got {type(value).__name__}")
        for k in value:
            if not isinstance(k, str):
                raise InvalidArgument(f"put: value keys are str (JSON), got {k!r}")
            if k.startswith(_R):
                raise InvalidArgument(f"put: value keys starting with {_R!r} are Kalos's own, got {k!r}")
        try:
            encode_metadata([value], 1)  # the client's encoder: JSON, str keys throughout, valid Unicode
        except InvalidArgument as exc:
            raise InvalidArgument(f"put: the value of {op.key!r} cannot be stored: {exc}") from None
        if op.ttl is not None and (not isinstance(op.ttl, (int, float)) or isinstance(op.ttl, bool)
                                   or not math.isfinite(op.ttl) or op.ttl <= 0):
            raise InvalidArgument(f"put: ttl is a positive number of minutes or None, got {op.ttl!r}")
        return value

    def _apply_puts(self, puts: list[PutOp]) -> Any:
        values = {id(op): self._check_value(op) for op in puts if op.value is not None}
        texts = {id(op): self._texts(op) for op in puts if op.value is not None}
        unique = list(dict.fromkeys(t for ts in texts.values() for _, t in ts))
        vectors: dict[str, np.ndarray] = {}
        if unique:
            embedded = np.asarray((yield _embed("embed_documents", unique)), np.float32)
            if embedded.shape != (len(unique), self.client.dim):
                raise DimensionMismatch(f"the index's embed returned shape {embedded.shape}, expected "
                                        f"({len(unique)}, {self.client.dim})")
            vectors = dict(zip(unique, embedded))
        by_namespace: dict[str, list[PutOp]] = {}
        for op in puts:
            by_namespace.setdefault(self._kalos_namespace(op.namespace), []).append(op)
        now = time.time()
        for ns, ops in by_namespace.items():
            rows_before = yield _call("get", keys=[self._doc_key(op.key) for op in ops], namespace=ns)
            old = {row.metadata[_KEY]: row for row in rows_before if row is not None}
            # One add (one transaction) per namespace and ttl, then the deletes of dead rows.
            adds: dict[float | None, dict[str, list[Any]]] = {}
            stale: list[str] = []
            gone: list[str] = []
            for op in ops:
                if op.value is None:
                    if op.key in old:
                        gone.append(op.key)
                    continue
                previous = old.get(op.key)
                rows = adds.setdefault(op.ttl, {"vectors": [], "texts": [], "metadata": [], "keys": []})
                stale += self._rows(op, values[id(op)], texts[id(op)], vectors, now,
                                    previous.metadata if previous is not None else None, rows)
            for ttl, rows in adds.items():
                extra = {} if ttl is None else {"ttl": float(ttl) * 60.0}
                yield _call("add", np.stack(rows["vectors"]), texts=rows["texts"], metadata=rows["metadata"],
                            namespace=ns, keys=rows["keys"], **extra)
            if stale:
                yield _call("delete", keys=stale, namespace=ns)
            for key in gone:
                yield _call("delete", where={_KEY: key, _PREFIX: self.prefix}, namespace=ns)

    def _rows(self, op: PutOp, value: dict[str, Any], texts: list[tuple[str, str]], vectors: dict[str, np.ndarray],
              now: float, previous: dict[str, Any] | None, rows: dict[str, list[Any]]) -> list[str]:
        """Appends the Kalos rows of one put to ``rows``; returns the keys of its dead vector rows
        (those of paths the previous version indexed and this one does not), to delete after."""
        common = {**value, _PREFIX: self.prefix, _KEY: op.key, _DEPTH: len(op.namespace),
                  **{_label(i): label for i, label in enumerate(op.namespace)},
                  _CREATED: now if previous is None else previous[_CREATED], _UPDATED: now}
        if op.ttl is not None:
            common[_TTL] = float(op.ttl)
        paths = [p for p, _ in texts]
        rows["metadata"] += [{**common, _KIND: "doc", _PATHS: paths, _NVEC: len(paths)}]
        rows["metadata"] += [{**common, _KIND: "vec", _PATH: p} for p in paths]
        rows["keys"] += [self._doc_key(op.key)] + [self._vec_key(op.key, p) for p in paths]
        rows["vectors"] += [self._placeholder] + [vectors[t] for _, t in texts]
        rows["texts"] += [None] + [t for _, t in texts]
        stale = [self._vec_key(op.key, p) for p in (previous or {}).get(_PATHS, []) if p not in paths]
        # Overwritten in the same transaction, so that no search meets an old version's vector.
        rows["metadata"] += [{_PREFIX: self.prefix, _KEY: op.key, _KIND: "dead"} for _ in stale]
        rows["keys"] += stale
        rows["vectors"] += [self._placeholder] * len(stale)
        rows["texts"] += [None] * len(stale)
        return stale

    def _refresh(self, rows: Sequence[KalosItem]) -> Any:
        """Renews the expiry of the items of ``rows`` (those put with a ttl), each item's rows
        (its document and its vectors) together in one transaction (``Client.renew``): nothing
        is created, so an item another writer deleted meanwhile stays deleted, and one it put
        again without a ttl keeps none. Called when the op's ``refresh_ttl`` is true: BaseStore
        already resolved it from the call and ``ttl_config["refresh_on_read"]`` (an explicit
        ``refresh_ttl=True`` wins over the config)."""
        renewals: dict[tuple[str, float], list[str]] = {}
        for row in rows:
            meta = row.metadata or {}
            if _TTL not in meta:
                continue
            key = meta[_KEY]
            paths = meta.get(_PATHS, []) if meta.get(_KIND) == "doc" else None
            if paths is None:  # a vector row: its document names the item's other vectors
                [doc] = yield _call("get", keys=[self._doc_key(key)], namespace=row.namespace)
                if doc is None:
                    continue
                paths = doc.metadata.get(_PATHS, [])
            keys = renewals.setdefault((row.namespace, float(meta[_TTL]) * 60.0), [])
            keys += [self._doc_key(key)] + [self._vec_key(key, p) for p in paths]
        for (namespace, seconds), keys in renewals.items():
            yield _call("renew", list(dict.fromkeys(keys)), seconds, namespace=namespace)

    # -- search ----------------------------------------------------------------------------------

    def _check_search(self, op: SearchOp) -> None:
        if not isinstance(op.namespace_prefix, tuple):
            raise InvalidNamespaceError(f"namespace_prefix must be a tuple, got {op.namespace_prefix!r}")
        for label in op.namespace_prefix:
            if not isinstance(label, str) or "." in label:
                raise InvalidNamespaceError(f"namespace labels are str without '.', got {label!r}")
        for name, v in (("limit", op.limit), ("offset", op.offset)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgument(f"search: {name} must be an int >= 0, got {v!r}")
        if op.filter is not None and not isinstance(op.filter, dict):
            raise InvalidArgument(f"search: filter must be a dict, got {type(op.filter).__name__}")

    def _namespace_order(self) -> Any:
        """Kalos namespaces of this store in the order they were first used."""
        names = (yield _call("stats")).get("namespaces", {})
        return {ns: i for i, ns in enumerate(names) if self._tuple_of(ns) is not None}

    def _listed(self, where: dict[str, Any]) -> Any:
        out: list[KalosItem] = []
        cursor = None
        while True:
            page = yield _call("list", namespace=None, where=where, limit=_LIST_PAGE, cursor=cursor)
            out += page.items
            cursor = page.next_cursor
            if cursor is None:
                return out

    def _documents(self, op: SearchOp, where: dict[str, Any] | None, extra: dict[str, Any]) -> Any:
        """The documents passing the prefix and the filter, in InMemoryStore's order."""
        clause = {**self._prefix_where(op.namespace_prefix), _KIND: "doc", **extra}
        rows = yield from self._listed({"$and": [clause, where]} if where else clause)
        if where is None:  # a filter the scan cannot evaluate
            rows = [r for r in rows if _matches(op.filter, self._value(r.metadata or {}))]
        order = yield from self._namespace_order()
        return sorted(rows, key=lambda r: order.get(r.namespace, len(order)))  # stable: id order within

    def _search(self, op: SearchOp) -> Any:
        self._check_search(op)
        where = _where_of(op.filter)
        if not (op.query and self.embeddings is not None):
            docs = (yield from self._documents(op, where, {}))[op.offset : op.offset + op.limit]
            if op.refresh_ttl:
                yield from self._refresh(docs)
            return [self._item(r, search=True) for r in docs]
        query = np.asarray((yield _embed("embed_query", op.query)), np.float32)
        scored = yield from self._scored(op, query, where)
        kept = scored[op.offset : op.offset + op.limit]
        found = [self._item(row, score, search=True) for row, score in kept]
        rows = [row for row, _ in kept]
        if len(found) < op.limit:
            # InMemoryStore's corner case: items with no vector fill what the scored ones leave.
            fill = (yield from self._documents(op, where, {_NVEC: 0}))[: op.limit - len(found)]
            found += [self._item(r, search=True) for r in fill]
            rows += fill
        if op.refresh_ttl:
            yield from self._refresh(rows)
        return found

    def _scored(self, op: SearchOp, query: np.ndarray, where: dict[str, Any] | None) -> Any:
        """Items best first by their best vector's cosine, at least ``offset + limit`` of them
        (all when fewer exist)."""
        wanted = op.offset + op.limit
        if wanted == 0:
            return []
        clause = {**self._prefix_where(op.namespace_prefix), _KIND: "vec"}
        if where is None:
            return (yield from self._scored_here(op, query, clause))
        full = {"$and": [clause, where]} if where else clause
        k = min(self.client.max_k, max(wanted, 8))
        while True:
            hits = yield _call("recall", query, k, namespace=None, where=full)
            rows = (yield _call("get", hits.ids)) if len(hits) else []
            best: dict[tuple[str, str], tuple[KalosItem, float]] = {}
            for row, (_id, score) in zip(rows, hits):
                if row is not None:
                    best.setdefault((row.namespace, row.metadata[_KEY]), (row, float(score)))
            if len(best) >= wanted or len(hits) < k:
                return list(best.values())
            if k == self.client.max_k:  # many vectors per item: score every matching one here
                return (yield from self._scored_here(op, query, full))
            k = min(self.client.max_k, 2 * k)

    def _scored_here(self, op: SearchOp, query: np.ndarray, clause: dict[str, Any]) -> Any:
        # Refused as a recall refuses it: a NaN or zero query has no direction, and its scores
        # (all NaN) ordered the items arbitrarily.
        row = as_matrix(query, self.client.dim, single=True)
        unit = row[0].astype(np.float64) * row_scales(row, what="query", error=InvalidQuery)[0]
        listed = yield from self._listed(clause)
        rows = [r for r in listed if _matches(op.filter, self._value(r.metadata or {}))]
        if not rows:
            return []
        fetched = yield _call("get", [r.id for r in rows], with_vectors=True)
        with_vectors = [r for r in fetched if r is not None]
        if not with_vectors:
            return []
        matrix = np.stack([r.vector for r in with_vectors]).astype(np.float64)
        scores = matrix @ unit
        best: dict[tuple[str, str], tuple[KalosItem, float]] = {}
        for i in np.argsort(-scores, kind="stable"):
            row = with_vectors[i]
            best.setdefault((row.namespace, row.metadata[_KEY]), (row, float(scores[i])))
        return list(best.values())

    # -- list_namespaces ----------------------------------------------------------------------------

    def _list_namespaces(self, op: ListNamespacesOp) -> Any:
        counts = (yield _call("stats")).get("namespaces", {})
        namespaces = [t for ns, n in counts.items() if n and (t := self._tuple_of(ns)) is not None]
        if op.match_conditions:
            namespaces = [t for t in namespaces if all(_does_match(c, t) for c in op.match_conditions)]
        if op.max_depth is not None:
            namespaces = sorted({t[: op.max_depth] for t in namespaces})
        else:
            namespaces = sorted(namespaces)
        return namespaces[op.offset : op.offset + op.limit]


def _does_match(condition: MatchCondition, namespace: tuple[str, ...]) -> bool:
    path = condition.path
    if len(namespace) < len(path):
        return False
    if condition.match_type == "prefix":
        pairs = zip(namespace, path)
    elif condition.match_type == "suffix":
        pairs = zip(reversed(namespace), reversed(path))
    else:
        raise InvalidArgument(f"unknown namespace match type {condition.match_type!r} (prefix or suffix)")
    return all(p == "*" or n == p for n, p in pairs)
