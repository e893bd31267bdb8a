"""What an LLM service imports: :class:`Client`.

Length: the client; one job (the caller's side of the sidecar), many calls. Its connection (the
hello, the segment, the slot channel) is :mod:`kalos.client.connection`, how a call's arguments
are checked and encoded :mod:`kalos.client.requests`, what the calls return
:mod:`kalos.client.results`, all shared with :mod:`kalos.client.aio`.

Recalls go through the client's slot in shared memory and never touch a socket; writes
(add, update, delete, drop_namespace) and lookups (get, list, count, stats) go over the control
socket to the sidecar, the only writer of the store. A client whose sidecar dies raises
:class:`SidecarUnavailable` within its timeout and connects again by itself on its next call.
"""
from __future__ import annotations

import dataclasses
import math
import os
import secrets
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from kalos.config import settings
from kalos.client.connection import Connection
from kalos.client.requests import (
    TimeLike,
    as_matrix,
    check_k,
    check_limit,
    check_same_layout,
    decode_cursor,
    encode_cursor,
    filter_words,
    key_or_id_message,
    looks_like_ids,
    recall_request,
    request_words,
    timestamps,
    where_clause,
    with_where,
)
from kalos.client.results import Hit, Page, Recall, RecallBatch, item_from_reply, single_hits
from kalos.errors import (
    DimensionMismatch,
    InvalidArgument,
    ProtocolMismatch,
    SidecarUnavailable,
    UnknownFilter,
    error_from_code,
)
from kalos.ipc.channel import SidecarExited
from kalos.ipc.control import (
    ConnectionClosed,
    array_blob,
    blob_array,
    encode_message,
    frame_too_large,
    raise_for_reply,
    recv_frame,
    send_frame,
)
from kalos.ipc.protocol import Op
from kalos.ipc.segment import Endpoint
from kalos.validation import (
    UNSET,
    Item,
    check_created_at,
    check_embed_texts,
    check_keys,
    check_namespace,
    check_request_id,
    check_texts,
    check_ttl,
    check_ttl_seconds,
    check_update,
    check_vectors,
    encode_metadata,
    keys_for_lookup,
)
from kalos.where import Where, compile_where

__all__ = ["Client", "Recall", "RecallBatch", "Item", "Hit", "Page"]

_FLOAT32 = np.dtype(np.float32)


#: Every live Client, for the fork handler below.
_LIVE_CLIENTS: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A child forked while another thread of the parent held a client's lock (a call in
    flight) inherits the lock held, by a thread it does not have: the child's first call would
    wait for ever. Its locks are new ones; its first call then drops the parent's connection
    (Client._connection), as after any fork."""
    for client in list(_LIVE_CLIENTS):
        client._lock = threading.RLock()
        client._embedder_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """A connection to the sidecar called ``name`` on this host. Thread-safe; a context manager.

    ``timeout`` bounds how long a call waits without a sign of life from the sidecar before
    it raises :class:`SidecarUnavailable` (a slow but live sidecar is waited for); at least four
    of the sidecar's heartbeat intervals (0.2 s by default), since it shows life only at each.
    ``spin_us`` is how long a recall busy-polls for its answer before it sleeps on its doorbell (default:
    ``KALOS_CLIENT_SPIN_US`` if set, else what the sidecar advises: 1000 for a GPU sidecar, 100
    for a CPU one; past cores - 1 connected clients the poll yields its core at each look).
    ``embedder`` turns text into vectors for :meth:`remember` and :meth:`recall_text`: None (the
    default: the sidecar embeds, with its one all-MiniLM-L6-v2 for every client of the host,
    so this process needs NumPy only; the sidecar needs the ``embed`` extra), or an embedder of
    this process: ``kalos.client.embed.default_embedder()`` (the same model here; needs the extra
    here), a SentenceTransformer, a LangChain Embeddings, a function ``list[str] -> [n, dim]``
    or a :class:`kalos.client.embed.Embedder`. Its dimension must be the store's.
    """

    def __init__(
        self, name: str = "default", timeout: float = 1.0, *, spin_us: float | None = None, embedder: Any = None,
    ) -> None:
        # Finite too: inf reached settimeout() as a raw OverflowError (issue 19); bool is no number.
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout)
                or not timeout > 0):
            raise InvalidArgument(f"timeout must be a positive finite number of seconds, got {timeout!r}")
        if spin_us is None and os.environ.get("KALOS_CLIENT_SPIN_US"):
            spin_us = settings().client_spin_us
        if spin_us is not None and (not isinstance(spin_us, (int, float)) or isinstance(spin_us, bool)
                                    or not math.isfinite(spin_us) or not spin_us >= 0):
            raise InvalidArgument(f"spin_us must be a finite number >= 0, got {spin_us!r}")
        self.name = name
        self.timeout = float(timeout)
        # None: as the sidecar advises in its hello (1 ms for a GPU sidecar, else the default).
        self._spin_s = None if spin_us is None else spin_us / 1e6
        self._endpoint = Endpoint(name)
        self._lock = threading.RLock()
        self._conn: Connection | None = None
        self._pid = os.getpid()
        self._last_request: tuple[Any, ...] | None = None
        # Where clauses registered with the sidecar: canonical JSON -> (its epoch, handle).
        self._where_handles: dict[str, tuple[int, int]] = {}
        # The text API's embedder: resolved (and, for the default model, loaded) on first use.
        self._embedder_spec = embedder
        self._embedder: Any = None
        self._embedder_lock = threading.Lock()
        _LIVE_CLIENTS.add(self)
        self._connect()

    # -- connection ------------------------------------------------------------------------

    def _connect(self) -> Connection:
        self._conn = Connection(self._endpoint, self.timeout, self._spin_s)
        self._last_request = None
        return self._conn

    def _connection(self) -> Connection:
        if self._pid != os.getpid():  # forked: the slot belongs to the parent; close our copies
            self._drop()
            self._pid = os.getpid()
        return self._conn if self._conn is not None else self._connect()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def dim(self) -> int:
        """The store's vector dimension."""
        with self._lock:
            return self._connection().layout.dim

    @property
    def max_k(self) -> int:
        with self._lock:
            return self._connection().layout.max_k

    def close(self) -> None:
        """Frees this client's slot. The client reconnects if used again."""
        with self._lock:
            self._drop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "connected" if self._conn is not None else "disconnected"
        return f"Client(name={self.name!r}, {state})"

    # -- recall (shared memory only) ---------------------------------------------------------

    def recall(
        self, vector: Any, k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
    ) -> Recall:
        """The ``k`` memories most similar to ``vector`` (cosine), best first.

        ``namespace=None`` searches every namespace; ``since``/``until`` (unix seconds or
        datetime) keep memories created in ``[since, until)``; ``where`` keeps memories whose
        metadata passes a filter in Chroma / mem0 syntax (:mod:`kalos.where`), e.g.
        ``{"user_id": "alice", "year": {"$gte": 2020}}``, applied inside the scan: the result
        is the true top-k of the matching memories however few match. Fewer than k hits come
        back when fewer memories match.
        """
        if where is None and since is None and until is None:
            hits = self._recall_one(vector, k, namespace)
            if hits is not None:
                return hits
        return self._recall(vector, k, namespace, since, until, single=True, where=where)

    def _recall_one(self, vector: Any, k: Any, namespace: Any) -> Recall | None:
        """:meth:`recall`'s usual call (one float32 vector of the store's dimension, an int k,
        no window, no where) on a connection already made, without the general path's layers:
        while a crowd's clients share the cores, each round of the sidecar waits for the
        clients' own Python, so that is kept short. None, with nothing written, where the call
        is not that one: :meth:`_recall` then takes it. A bad namespace is refused here, as
        there (InvalidQuery), before anything is written."""
        with self._lock:
            conn = self._conn
            if (conn is None or self._pid != os.getpid() or type(vector) is not np.ndarray
                    or (vector.dtype is not _FLOAT32 and vector.dtype != _FLOAT32) or type(k) is not int):
                return None  # (an unpickled array's float32 is equal, not the same object)
            layout = conn.layout
            if vector.shape != (layout.dim,) or not 0 < k <= layout.max_k:
                return None
            request = request_words(k, namespace, None, None)  # (InvalidQuery for a bad namespace)
            channel = conn.channel
            channel.query_row[:] = vector
            key = (Op.RECALL, 1, request)
            if key != self._last_request:
                channel.slot.write_request(Op.RECALL, 1, *request)
                self._last_request = key
            try:
                status = channel.wait(channel.submit())
            except SidecarExited:
                self._drop()
            except SidecarUnavailable:
                self._drop()
                raise
            else:
                if status:
                    raise error_from_code(status, channel.slot.read_message())
                return single_hits(channel.hit_ids, channel.hit_scores, k)
            # The sidecar exited: asked again once, of a sidecar that is back already, as
            # _recall does (and with its errors: the first exit is not chained to them).
            conn = self._connect()
            check_same_layout(conn.layout, layout, k)
            return self._recall(vector, k, namespace, None, None, single=True, retried=True)

    def recall_many(
        self, matrix: Any, k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
    ) -> RecallBatch:
        """One recall per row of ``matrix`` ``[Q, dim]``, answered in batches of the sidecar's
        max_batch; filters as in :meth:`recall`."""
        return self._recall(matrix, k, namespace, since, until, single=False, where=where)

    def _recall(
        self, queries: Any, k: int, namespace: str | None, since: Any, until: Any, *, single: bool,
        where: Any = None, retried: bool = False,
    ) -> Recall | RecallBatch:
        """A :class:`Recall` (``single``) or a :class:`RecallBatch`; ``retried``: the sidecar
        exited under this call once already (it is not asked again after another exit)."""
        clause = where_clause(where)
        with self._lock:
            conn = self._connection()
            layout = conn.layout
            rows, k, request = recall_request(queries, k, namespace, since, until, layout, single=single)
            plain = request
            if clause is not None:  # (registering may reconnect: the connection is looked up again)
                request = self._where_request(plain, clause)
                conn = self._connection()
                check_same_layout(conn.layout, layout, k)
            q = len(rows)
            if not single:
                ids = np.empty((q, k), np.int64)
                scores = np.empty((q, k), np.float32)
            step = layout.max_batch
            start = 0
            where_retried = False
            while start < q:
                stop = min(q, start + step)
                try:
                    self._round_trip(conn, rows[start:stop], request)
                except UnknownFilter:
                    # The sidecar no longer holds the handle (evicted from its bounded table):
                    # the clause is registered again, once.
                    if where_retried or clause is None:
                        raise
                    where_retried = True
                    self._where_handles.pop(clause.key, None)
                    request = self._where_request(plain, clause)
                    conn = self._connection()
                    continue
                except SidecarUnavailable as exc:
                    # A recall changes nothing, so after the sidecar exited it is safe to ask
                    # again: once, of a sidecar that is back already (a restart). A hung sidecar
                    # has used up the timeout already: the caller hears of it.
                    self._drop()
                    if retried or not isinstance(exc, SidecarExited):
                        raise
                    retried = True
                    conn = self._connect()
                    if clause is not None:  # a new sidecar: its own handles
                        request = self._where_request(plain, clause)
                        conn = self._connection()
                    check_same_layout(conn.layout, layout, k)
                    step = conn.layout.max_batch
                    continue
                slot = conn.channel.slot
                if single:
                    return single_hits(conn.channel.hit_ids, conn.channel.hit_scores, k)
                ids[start:stop] = slot.ids[: stop - start, :k]
                scores[start:stop] = slot.scores[: stop - start, :k]
                start = stop
            return RecallBatch(ids, scores)

    def _where_request(self, request: tuple[Any, ...], clause: Where) -> tuple[Any, ...]:
        """``request``'s words naming ``clause`` by its handle, registered with the sidecar on
        first use (one control round trip per clause and connection)."""
        cached = self._where_handles.get(clause.key)
        if cached is None or cached[0] != self._connection().epoch:
            if len(self._where_handles) >= 4096:  # many distinct clauses: keep it bounded
                self._where_handles.clear()
            cached = self._where_handles[clause.key] = _register_where(self, clause)
        return with_where(request, cached[1])

    def _round_trip(self, conn: Connection, rows: np.ndarray, request: tuple[Any, ...], op: Op = Op.RECALL) -> None:
        channel = conn.channel
        self._write_request(conn, rows, request, op)
        status = channel.wait(channel.submit())
        if status:
            raise error_from_code(status, channel.slot.read_message())

    def _write_request(self, conn: Connection, rows: np.ndarray, request: tuple[Any, ...], op: Op = Op.RECALL) -> None:
        """Writes one request into the slot, not yet submitted (also :class:`kalos.client.aio.AsyncClient`'s,
        which then waits without blocking its event loop)."""
        slot = conn.channel.slot
        n = len(rows)
        slot.queries[:n] = rows
        # Request words are ours alone, so unchanged ones need not be written again.
        key = (op, n, request)
        if key != self._last_request:
            slot.write_request(op, n, *request)
            self._last_request = key

    def ping(self) -> None:
        """One bare round trip through the slot (no search): a liveness and latency probe."""
        with self._lock:
            conn = self._connection()
            try:
                self._round_trip(conn, conn.channel.slot.queries[:0], (1, 0, 0.0, 0.0, b""), op=Op.PING)
            except SidecarUnavailable:
                self._drop()
                raise

    # -- writes and lookups (control socket) ---------------------------------------------

    def add(
        self, vectors: Any, texts: Sequence[str | None] | None = None,
        metadata: Sequence[dict[str, Any] | None] | None = None, namespace: str = "default",
        *, keys: Sequence[str] | None = None, created_at: float | Sequence[float] | None = None,
        request_id: str | None = None, ttl: float | Sequence[float | None] | None = None,
    ) -> np.ndarray:
        """Stores memories; returns their ids (int64) once they are durable and recallable.

        ``ttl``: seconds until the memories expire (one number for all, or one number or None
        per vector; None: never). From its ``expires_at`` on, a memory is never returned by
        recall, get or list, and the sidecar deletes it from the store in the background. An
        upsert sets the expiry anew (without ``ttl``: the memory no longer expires).

        ``keys`` (one str of 1 to 256 UTF-8 bytes per vector, distinct) are the caller's own
        ids, unique within ``namespace``: an add whose key is already there replaces that
        memory's vector, text and metadata (upsert), keeping its id and ``created_at`` and
        setting ``updated_at``; a recall sees the old version or the new, never both or
        neither. A key repeated within one call is refused (InvalidArgument), storing nothing.

        ``vectors`` is ``[n, dim]`` (or one ``[dim]`` vector); ``texts`` and ``metadata``
        (JSON-serialisable dicts), when given, have one entry per vector. The whole add is one
        transaction: on any error nothing is stored.

        Every add carries a request id (``request_id``, else a random one), which the store
        remembers with it. When the connection breaks before the reply, the add is sent again
        with the same id, and one that had committed returns its ids instead of being stored
        twice. When that is not possible (the sidecar stopped answering), the
        :class:`SidecarUnavailable` raised carries ``request_id``: an add retried with it is
        stored at most once.
        """
        with self._lock:
            conn = self._connection()
            if isinstance(vectors, np.ndarray) and vectors.ndim == 1:
                vectors = vectors[None, :]
            # The store's own checks, run here too so that a bad add fails before it is sent
            # (and before JSON could silently turn a metadata key 1 into "1").
            if created_at is not None:
                created_at = timestamps(created_at)
            matrix = check_vectors(vectors, conn.layout.dim)
            n = len(matrix)
            check_namespace(namespace)
            texts_list = None if texts is None else check_texts(texts, n)
            encode_metadata(metadata, n)
            key_list = None if keys is None else check_keys(keys, n)
            ttl_list = None if ttl is None else check_ttl(ttl, n)
            created = None if created_at is None else check_created_at(created_at, n).tolist()
            request_id = secrets.token_hex(16) if request_id is None else check_request_id(request_id)
            spec, blob = array_blob(matrix, "float32")
            message: dict[str, Any] = {"op": "add", "namespace": namespace, "vectors": spec, "texts": texts_list,
                                       "metadata": None if metadata is None else list(metadata), "created_at": created,
                                       "request_id": request_id}
            if key_list is not None:  # only when given: a sidecar without keys then still takes plain adds
                message["keys"] = key_list
            if ttl_list is not None:
                message["ttl"] = [None if math.isnan(t) else t for t in ttl_list.tolist()]
            reply, reply_blob = self._control(message, blob)
            ids, _ = blob_array(reply["ids"], reply_blob)
            return ids

    def delete(self, keys_or_ids: Any = None, /, ids: Any = None, *, keys: Any = None,
               namespace: str | None = "default", where: dict[str, Any] | None = None) -> int:
        """Deletes memories by key (in ``namespace``), by id (ids are global: ``namespace``
        does not apply), or every memory of ``namespace`` (None: of every namespace) whose
        metadata passes ``where`` (see :mod:`kalos.where`; ``{}`` passes every memory); returns
        how many went. Exactly one of keys, ids, where. Unknown keys and ids are ignored. A
        delete by ``where`` is one transaction: after a crash all of its memories are gone or none.

        ``delete([3, 4])``, a first argument of integers, is by id, as before keys existed; an
        explicit ``keys=`` is always keys (ids are global: ``keys=[5]`` taken for id 5 would reach
        past the namespace named).
        """
        if keys is None and keys_or_ids is not None and not looks_like_ids(keys_or_ids):
            keys_or_ids, keys = None, keys_or_ids  # (strings: keys, checked as such below)
        if where is not None:
            if keys is not None or ids is not None or keys_or_ids is not None:
                raise InvalidArgument("delete: pass keys, ids or where (one of them), got where and "
                                      + ("keys" if keys is not None else "ids"))
            message: dict[str, Any] = {"op": "delete", "where": compile_where(where).to_dict(),
                                       "namespace": None if namespace is None else check_namespace(namespace)}
        else:
            if namespace is None and keys is not None:
                raise InvalidArgument("delete: keys live in one namespace; namespace=None is for where= only")
            message = key_or_id_message("delete", keys_or_ids, ids, "default" if namespace is None else namespace,
                                        keys=keys)
            message.pop("wanted")
        return int(self._control(message)[0]["deleted"])

    def renew(self, keys: Sequence[str], ttl: float, *, namespace: str = "default") -> int:
        """Renews the expiry of the memories of ``keys`` (in ``namespace``) that expire: each
        gets ``ttl`` seconds from now (the sidecar's clock), all in one transaction; returns how
        many were renewed. Nothing is created: absent or expired keys, and memories that never
        expire, are left as they are (to give one an expiry, ``update(key, ttl=...)``). The
        refresh-on-read of a cache, or of LangGraph's store."""
        message = {"op": "renew", "keys": keys_for_lookup(keys), "namespace": check_namespace(namespace),
                   "ttl": check_ttl_seconds(ttl)}
        self._require_op("renew", "renew")
        return int(self._control(message)[0]["renewed"])

    def _require_op(self, op: str, what: str) -> None:
        """InvalidArgument unless the sidecar named ``op`` in its hello (a sidecar from before
        it would refuse the operation, or ignore a field of it and answer ok)."""
        with self._lock:
            ops = self._connection().ops
        if op not in ops:
            raise InvalidArgument(f"{what}: this sidecar is older than this client and cannot do it; "
                                  "restart it with this version of kalos")

    def drop_namespace(self, name: str) -> int:
        """Deletes every memory of namespace ``name`` in one transaction; returns how many went.
        The name stays known (stats lists it with 0); adding to it again is allowed."""
        return int(self._control({"op": "drop_namespace", "namespace": check_namespace(name)})[0]["deleted"])

    def list(self, *, namespace: str | None = None, where: dict[str, Any] | None = None, limit: int = 100,
             cursor: str | None = None) -> "Page":
        """One page of the stored memories of ``namespace`` (None: every namespace) whose metadata
        passes ``where``, in the order they were first added: at most ``limit`` (1 to 1000)
        :class:`Item` s and ``next_cursor`` (None on the last page) to pass as ``cursor`` for
        the next. Stable under concurrent writes: a memory present throughout is on exactly
        one page; one added meanwhile may or may not be. Expired memories are never listed.
        """
        message: dict[str, Any] = {"op": "list", "namespace": None if namespace is None else check_namespace(namespace),
                                   "limit": check_limit(limit), "after": decode_cursor(cursor)}
        if where is not None:
            message["where"] = compile_where(where).to_dict()
        reply, _ = self._control(message)
        items = [item_from_reply(item, "list") for item in reply["items"]]
        after = reply.get("next")
        return Page(items, None if after is None else encode_cursor(int(after)))

    def count(self, *, namespace: str | None = None, where: dict[str, Any] | None = None) -> int:
        """How many stored (unexpired) memories ``namespace`` (None: every namespace) holds whose
        metadata passes ``where`` (None: all)."""
        message: dict[str, Any] = {"op": "count",
                                   "namespace": None if namespace is None else check_namespace(namespace)}
        if where is not None:
            message["where"] = compile_where(where).to_dict()
        return int(self._control(message)[0]["count"])

    def get(
        self, keys_or_ids: Any = None, /, ids: Any = None, *, keys: Any = None, namespace: str = "default",
        with_vectors: bool = False,
    ) -> list[Item | None]:
        """The stored memories (text, metadata, namespace, created_at, key, updated_at) of ``keys``
        in ``namespace``, or of ``ids`` (global: ``namespace`` does not apply), aligned with
        them; None where absent. A key held only by another namespace is absent here.
        ``with_vectors=True`` also fills each item's ``vector`` (the stored float32 ``[dim]``,
        normalised at add).

        ``get([3, 4])``, a first argument of integers, is by id, as before keys existed; an
        explicit ``keys=`` is always keys (ids are global: ``keys=[5]`` taken for id 5 would reach
        past the namespace named).
        """
        if not isinstance(with_vectors, bool):
            raise InvalidArgument(f"get: with_vectors must be True or False, got {with_vectors!r}")
        message = key_or_id_message("get", keys_or_ids, ids, namespace, keys=keys)
        wanted = message.pop("wanted")
        # Each id travels once (the sidecar refuses repeats: each was a full copy in its reply)
        # and the answer is repeated here, where the caller asked for it.
        unique = list(dict.fromkeys(wanted))
        message["keys" if "keys" in message else "ids"] = unique
        if with_vectors:  # only when asked: a sidecar from before it still answers plain gets
            message["with_vectors"] = True
        reply, reply_blob = self._control(message)
        items = reply["items"]
        if not isinstance(items, list) or len(items) != len(unique):
            got = len(items) if isinstance(items, list) else type(items).__name__
            raise ProtocolMismatch(f"get of {len(unique)} ids was answered with {got} items")
        built = [item_from_reply(item, "get") if item is not None else None for item in items]
        if with_vectors:
            if "vectors" not in reply:
                raise ProtocolMismatch("this sidecar does not send vectors with get; upgrade it")
            vectors, _ = blob_array(reply["vectors"], reply_blob)
            present = [i for i, item in enumerate(built) if item is not None]
            if vectors.shape != (len(present), self.dim):
                raise ProtocolMismatch(f"get of {len(present)} items was answered with vectors of shape {vectors.shape}")
            for row, i in enumerate(present):
                built[i] = dataclasses.replace(built[i], vector=vectors[row].copy())
        found = dict(zip(unique, built))
        return [found[i] for i in wanted]

    def update(
        self, key_or_id: str | int, *, namespace: str = "default", text: str | None = UNSET,
        metadata: dict[str, Any] | None = UNSET, vector: Any = UNSET, merge: bool = False,
        ttl: float | None = UNSET,
    ) -> int:
        """Changes one memory in place; returns its id. Only what is given changes: ``text``
        (None clears it), ``metadata`` (replaced; with ``merge=True`` the dict's entries are
        merged into the stored ones; None clears it), ``vector`` (``[dim]``; a recall sees the
        old vector or the new, never both or neither), ``ttl`` (seconds from now, by the
        sidecar's clock, after which the memory is gone, whether it expired before or not;
        None: it never expires; :meth:`renew` renews only what expires).
        ``updated_at`` is set; the id, the key, the namespace and ``created_at`` stay.

        ``key_or_id``: a key (str) in ``namespace``, or an item id (int; ids are global, so
        ``namespace`` does not apply). A key that no memory of ``namespace`` holds (absent,
        expired, or only in another namespace) raises :class:`~kalos.errors.UnknownKey` (a
        KeyError), and nothing changes.
        """
        with self._lock:
            dim = self._connection().layout.dim
        if vector is not UNSET and vector is not None:
            vector = as_matrix(vector, dim, single=False, what="vector", error=InvalidArgument)
            if len(vector) != 1:
                raise InvalidArgument(f"update takes one vector of shape ({dim},), got {len(vector)} rows")
            vector = vector[0]
        change = check_update(key_or_id, dim, namespace=namespace, text=text, metadata=metadata,
                              vector=vector, merge=merge, ttl=ttl)
        message: dict[str, Any] = {"op": "update", "namespace": change.namespace, "merge": change.merge}
        message["key" if change.key is not None else "id"] = change.key if change.key is not None else change.id
        if change.text is not UNSET:  # absent from the message: kept
            message["text"] = change.text
        if change.metadata is not UNSET:
            message["metadata"] = change.metadata
        if change.ttl is not UNSET:
            self._require_op("update_ttl", "update(ttl=)")
            message["ttl"] = change.ttl
        blob: bytes | memoryview = b""
        if change.vector is not None:
            message["vector"], blob = array_blob(change.vector, "float32")
        return int(self._control(message, blob)[0]["id"])

    def stats(self) -> dict[str, Any]:
        """Live counts, namespaces, device, QPS and service-time percentiles of the sidecar."""
        reply, _ = self._control({"op": "stats"})
        reply.pop("ok", None)
        return reply

    def compact(self) -> int:
        """Squeezes deleted rows out of the engine now (it also happens by itself); returns how many."""
        return int(self._control({"op": "compact"})[0]["removed"])

    def _control(self, message: dict[str, Any], blob: bytes | memoryview = b"") -> tuple[dict[str, Any], bytearray]:
        op = message.get("op")
        try:
            body = encode_message(message)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{op}: not JSON-serialisable: {exc}") from None
        request_id = message.get("request_id")
        with self._lock:
            conn = self._connection()
            # Checked here against the sidecar's own limit (from its hello): a sidecar refuses
            # an oversized frame by hanging up, and the caller saw only "Broken pipe" (issue 19).
            problem = frame_too_large(len(body), len(blob), conn.max_message_bytes)
            if problem is not None:
                raise InvalidArgument(f"{op}: message {problem}")
            retried = False
            while True:
                sent = False
                try:
                    send_frame(conn.sock, message, blob, on_wait=self._waiter(conn))
                    sent = True
                    reply, reply_blob = recv_frame(
                        conn.sock, max_bytes=settings().max_message_bytes, on_wait=self._waiter(conn)
                    )
                    return raise_for_reply(reply), reply_blob
                except SidecarUnavailable as exc:
                    # First: it is a ConnectionError, so an OSError too. No sign of life within
                    # the timeout (a stopped or hung sidecar): the deadline is spent, so no
                    # retry; the caller hears it now.
                    self._drop()
                    raise self._unavailable(f"{exc} during {op}", request_id) from None
                except (ConnectionClosed, OSError) as exc:
                    self._drop()
                    # Again, once, on a new connection: always when the request never got out
                    # (nothing happened), and for an add also when its reply was lost, since
                    # its request id makes a second copy impossible.
                    if retried or (sent and request_id is None):
                        raise self._unavailable(f"the sidecar connection broke during {op} ({exc})", request_id) from None
                    retried = True
                    try:
                        conn = self._connect()
                    except SidecarUnavailable as again:
                        raise self._unavailable(f"{again} (retrying {op})", request_id) from None

    @staticmethod
    def _waiter(conn: Connection) -> Any:
        """The deadline of a control operation: it waits while the sidecar shows signs of life
        (its heartbeat) and fails once it has shown none for the client's timeout."""
        channel = conn.channel

        def on_wait(_started: bool, _idle_s: float) -> None:
            channel.check_alive()

        return on_wait

    @staticmethod
    def _unavailable(message: str, request_id: Any) -> SidecarUnavailable:
        if request_id is None:
            return SidecarUnavailable(message)
        exc = SidecarUnavailable(
            f"{message}; the add may have been stored: add(..., request_id={request_id!r}) again stores it at most once"
        )
        exc.request_id = request_id  # type: ignore[attr-defined]
        return exc

    # -- text memories (embedding in the sidecar or in this process, then the calls above) -----

    @property
    def embedder(self) -> Any:
        """The embedder of the text API (loaded on first use; by default the sidecar's, see the
        class); its dim is checked against the store's."""
        with self._embedder_lock:
            if self._embedder is None:
                if self._embedder_spec is None:
                    self._embedder = self._sidecar_embedder()
                else:
                    from kalos.client.embed import as_embedder

                    self._embedder = as_embedder(self._embedder_spec)
            embedder = self._embedder
        dim = self.dim
        if embedder.dim != dim:
            raise DimensionMismatch(
                f"embedder {embedder.name} makes {embedder.dim}-dimensional vectors but sidecar {self.name!r} "
                f"serves a store of dimension {dim}: serve a store created with --dim {embedder.dim}, "
                f"or pass Client(embedder=...) a model of dimension {dim}"
            )
        return embedder

    def _sidecar_embedder(self) -> "_SidecarEmbedder":
        """The sidecar's model, loaded there now (inside ``kalos.client.embed.load_progress`` the wait
        draws a progress bar). A sidecar from before sidecar embedding: the model in this process."""
        from kalos.client.embed import _load_stream, _LoadBar, as_embedder

        bar = _LoadBar(_load_stream.get())
        loaded = False
        info: dict[str, Any] | None = None
        try:
            bar.step("asking the sidecar")
            try:
                self._control({"op": "embedder"})
            except InvalidArgument as exc:
                if "unknown control operation" not in str(exc):
                    raise
            else:
                bar.step("the sidecar loads the weights", done=1)
                info, _ = self._control({"op": "embedder", "load": True})
                loaded = True
        finally:
            bar.close(finished=loaded)
        if info is None:
            return as_embedder(None)  # type: ignore[return-value]
        return _SidecarEmbedder(self, info)

    def remember(
        self, texts: str | Sequence[str], namespace: str = "default",
        metadata: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
        *, keys: Sequence[str] | None = None, created_at: float | Sequence[float] | None = None,
        ttl: float | Sequence[float | None] | None = None,
    ) -> np.ndarray:
        """Embeds ``texts`` (in the sidecar unless this client has an embedder of its own) and
        stores them as memories; returns their ids (int64). ``keys`` upsert and ``ttl`` expires
        as in :meth:`add`.

        One text may be passed as a plain str (and its metadata as one dict). The whole call
        is one transaction: on any error nothing is stored. For files of many rows use
        ``kalos import`` (batched and resumable).
        """
        if isinstance(texts, str):
            texts = [texts]
            if isinstance(metadata, dict):
                metadata = [metadata]
        texts = list(texts)
        if not texts:
            raise InvalidArgument("remember needs at least one text")
        # Checked before the (slow) embedding, and again by add.
        encode_metadata(metadata, len(texts))
        check_namespace(namespace)
        if keys is not None:
            check_keys(keys, len(texts))
        check_ttl(ttl, len(texts))
        vectors = self.embedder.embed(texts)
        return self.add(vectors, texts=texts, metadata=metadata, namespace=namespace, keys=keys, created_at=created_at,
                        ttl=ttl)

    def recall_text(
        self, text: str, k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
    ) -> list["Hit"]:
        """The ``k`` memories closest in meaning to ``text``, best first, with their texts.

        When the sidecar embeds (this client has no embedder of its own), one control round
        trip: the sidecar embeds ``text`` (of any length: the model reads its first 256 tokens),
        recalls it in this client's slot, batched with every other recall, and sends the hits
        with their texts and metadata. With an embedder of its own, the client embeds, recalls
        through shared memory, then fetches the hits' items in one control round trip. A memory
        deleted between the recall and the read of its item is left out, so fewer than k hits
        can come back. Filters as in :meth:`recall`.
        """
        if not isinstance(text, str):
            raise InvalidArgument(f"recall_text takes one str, got {type(text).__name__}; use recall_texts for several")
        return self.recall_texts([text], k, namespace, since, until, where=where)[0]

    def recall_texts(
        self, texts: Sequence[str], k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
    ) -> list[list["Hit"]]:
        """:meth:`recall_text` for several texts: one embedding batch, one recall batch, one fetch
        (all three in one round trip when the sidecar embeds and they fit one slot's batch and
        one message)."""
        if isinstance(texts, str):
            raise InvalidArgument("recall_texts takes a sequence of texts; use recall_text for one")
        texts = list(texts)
        if not texts:
            return []
        texts = check_embed_texts(texts)
        check_k(k, self.max_k)
        filter_words(namespace, since, until)  # bad filters fail before the (slow) embedding
        clause = where_clause(where)
        if isinstance(self.embedder, _SidecarEmbedder):
            with self._lock:
                conn = self._connection()
                fused = conn.fits_one_recall_text(texts)
            if fused:
                return self._recall_texts_in_sidecar(texts, int(k), namespace, since, until, clause)
        from kalos.client.embed import embed_queries

        vectors = embed_queries(self.embedder, texts)  # (a model may embed queries unlike documents)
        batch = self.recall_many(vectors, k=k, namespace=namespace, since=since, until=until, where=clause)
        hits = [batch[i] for i in range(len(texts))]
        wanted = np.concatenate([h.ids for h in hits]) if hits else np.empty(0, np.int64)
        items = dict(zip(wanted.tolist(), self.get(wanted))) if len(wanted) else {}
        return [
            [Hit.from_item(items[i], s) for i, s in hit if items.get(i) is not None]
            for hit in hits
        ]


    def _recall_texts_in_sidecar(self, texts: list[str], k: int, namespace: str | None, since: Any, until: Any,
                                 clause: Where | None) -> list[list["Hit"]]:
        """recall_texts as one control round trip (op ``recall_text``): the sidecar embeds the
        texts, recalls them in this client's slot (batched with the crowd's recalls) and sends
        the hits with their items. The slot's request words are then the sidecar's: the
        channel takes its sequence number back from the slot."""
        with self._lock:
            request = request_words(k, namespace, since, until)
            if clause is not None:
                request = self._where_request(request, clause)
            _k, flags, since_word, until_word, encoded, *handle = request
            message = {"op": "recall_text", "texts": texts, "k": k, "flags": flags, "since": since_word,
                       "until": until_word, "namespace": encoded.decode("utf-8", "surrogatepass"),
                       "where_handle": handle[0] if handle else 0}
            for attempt in range(2):
                try:
                    reply, _blob = self._control(message)
                    break
                except UnknownFilter:
                    # The sidecar no longer holds the handle (evicted from its bounded table):
                    # the clause is registered again, once.
                    if attempt or clause is None:
                        raise
                    self._where_handles.pop(clause.key, None)
                    message["where_handle"] = self._where_request(request[:5], clause)[5]
                finally:
                    self._resync_slot()
            try:
                hits = reply["hits"]
                if not isinstance(hits, list) or len(hits) != len(texts):
                    got = len(hits) if isinstance(hits, list) else type(hits).__name__
                    raise ProtocolMismatch(f"recall_text of {len(texts)} texts was answered with {got} hit lists")
                # Each Hit straight from its item's fields: an Item built first only to be
                # copied into the Hit cost a construction per hit.
                items = {fields["id"]: fields for fields in reply["items"]}
                return [[Hit.from_fields(items[i], s) for i, s in row if i in items] for row in hits]
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise ProtocolMismatch(
                    f"recall_text was answered with malformed hits or items: {type(exc).__name__}: {exc}") from None

    def _resync_slot(self) -> None:
        """After a control operation that may have recalled in this client's slot: the request
        words there are no longer this client's, and its sequence number is the slot's."""
        self._last_request = None
        conn = self._conn
        if conn is not None and conn.channel is not None:
            try:
                conn.channel.resync()
            except SidecarUnavailable:
                self._drop()  # (the next call connects again; this one's own outcome stands)


class _SidecarEmbedder:
    """The sidecar's model as an :class:`kalos.client.embed.Embedder`: texts go over the control socket
    (op ``embed``), unit float32 vectors come back. Batches of texts travel in frames well
    under the sidecar's message limit."""

    #: Texts per embed request: the sidecar embeds what is pending together anyway.
    _TEXTS_PER_REQUEST = 1024

    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self._client = client
        self.name = str(info["name"])
        self.dim = int(info["dim"])
        self.runtime = info.get("runtime")

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        from kalos.validation import check_embed_texts

        texts = check_embed_texts(texts)
        out = np.empty((len(texts), self.dim), np.float32)
        with self._client._lock:
            limit = self._client._connection().max_message_bytes
        # JSON writes a character as up to 12 bytes (a surrogate pair of \uXXXX): a frame of this
        # many characters fits.
        budget = max(1, limit // 16)
        start = 0
        while start < len(texts):
            stop, size = start, 0
            while stop < len(texts) and stop - start < self._TEXTS_PER_REQUEST and (
                    stop == start or size + len(texts[stop]) <= budget):
                size += len(texts[stop])
                stop += 1
            reply, blob = self._client._control({"op": "embed", "texts": texts[start:stop]})
            vectors, _ = blob_array(reply["vectors"], blob)
            if vectors.shape != (stop - start, self.dim):
                raise ProtocolMismatch(f"embed of {stop - start} texts was answered with shape {vectors.shape}")
            out[start:stop] = vectors
            start = stop
        return out

    def __repr__(self) -> str:
        return f"SidecarEmbedder({self.name!r}, dim={self.dim}, runtime={self.runtime!r})"


def _register_where(client: "Client", clause: Where) -> tuple[int, int]:
    """Registers ``clause`` with ``client``'s sidecar: ``(that sidecar's epoch, the handle)``."""
    with client._lock:
        handle = int(client._control({"op": "where", "where": clause.key})[0]["handle"])
        return client._connection().epoch, handle  # (_control may have connected again)
