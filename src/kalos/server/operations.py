"""The control socket's side of the sidecar: connections, and the operations they ask for.

Everything that is not a recall comes here (hello and its slot, add, delete, update, get, list,
count, stats, compact, where, the embedder), one thread per connection, off the hot path. Kept
apart from the lifecycle (which binds the socket and owns the threads) and from the recall loop
(which must not wait for any of this): the operations are where the store and the engine are
written in the same order, under ``_write_lock``, and each engine change is made under
``_state_lock`` with the GPU's polling stopped (:class:`kalos.server.slot_polling.SlotPolling`).

Control connections are bounded: at most ``slots + spare_connections`` at once; one stuck
mid-frame, or one without a slot that stays silent, is dropped (``control_stall_s``,
``control_idle_s``); one that holds a slot may idle between requests for ever.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import numpy as np

from kalos.config import settings
from kalos.engine import Engine, Filter
from kalos.errors import (
    DimensionMismatch,
    InvalidArgument,
    InvalidQuery,
    KalosError,
    ProtocolMismatch,
    ServerError,
    error_from_code,
)
from kalos.ipc.channel import SidecarChannel, wake_socket
from kalos.ipc.control import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    array_blob,
    blob_array,
    encode_value,
    encoded_ok_reply,
    error_reply,
    frame_too_large,
    ok_reply,
    peer_credentials,
    recv_fd,
    recv_frame,
    send_fd,
    send_frame,
)
from kalos.ipc.protocol import NAMESPACE_BYTES, REQUEST_DTYPE, Layout, Op
from kalos.ipc.segment import Endpoint, Segment
from kalos.server.cohort import Cohort
from kalos.server.expirer import Expirer
from kalos.server.metrics import Metrics
from kalos.server.filters import FilterCache
from kalos.server.item_cache import ItemCache, item_fields
from kalos.server.slot_polling import SlotPolling
from kalos.server.state_lock import StateLock
from kalos.validation import (
    UNSET,
    Item,
    check_keys,
    check_namespace,
    check_request_id,
    check_ttl,
    check_ttl_seconds,
    check_update,
    check_vectors,
    keys_for_lookup,
    normalise_rows,
)
from kalos.where import Where, compile_where

if TYPE_CHECKING:
    from kalos.server.sidecar_embed import EmbedService

__all__ = ["ControlServer"]

# The sidecar's one logger, whichever of its modules logs.
log = logging.getLogger("kalos.server.sidecar")
# How often a control connection's thread wakes from a silent socket to check its deadlines.
_CONTROL_POLL_S = 1.0
_CORES = len(os.sched_getaffinity(0))


class SidecarParts(Protocol):
    """What the control server reads from its sidecar (:class:`kalos.server.sidecar.Sidecar`) at
    each use, because the sidecar's lifecycle replaces them under running threads: the listening
    socket, the channel and the segment (None once closed: a connection's thread that outlives
    the sidecar's close ends in an error it logs)."""

    @property
    def listener(self) -> socket.socket | None: ...

    @property
    def channel(self) -> SidecarChannel | None: ...

    @property
    def segment(self) -> Segment | None: ...


class ControlServer:
    """Serves the control connections of one sidecar: :meth:`accept` is the acceptor thread.

    The state the operations act on is handed over explicitly, once. Three things are read
    from ``sidecar`` at each use instead, because its lifecycle changes them under running
    threads: the listening socket (bound again when its name is removed), and the channel and
    the segment (taken away by ``close``, which a connection thread may outlive).
    """

    def __init__(self, sidecar: SidecarParts, *, name: str, endpoint: Endpoint, epoch: int, layout: Layout,
                 engine: Engine, store: Any, metrics: Metrics, cohort: Cohort, embedding: EmbedService,
                 seed: Any, quarantined: list[int], namespaces: dict[bytes, int], filters: FilterCache,
                 polling: SlotPolling, expirer: Expirer, state_lock: StateLock, write_lock: threading.Lock,
                 wrote: threading.Event, stopping: threading.Event, client_spin_us: float, client_crowded: str,
                 start_thread: Callable[..., None]) -> None:
        self._sidecar = sidecar
        self._name = name
        self.endpoint = endpoint
        self.epoch = epoch
        self.layout = layout
        self.engine = engine
        self.store = store  # a Store or a PostgresStore
        self.items = ItemCache(store, settings().item_cache_bytes)  # (what get and recall_text reply with)
        self.metrics = metrics
        self.cohort = cohort
        self.embedding = embedding
        self._seed = seed  # the seed-compat server, or None
        self.quarantined = quarantined  # the sidecar's list: an update that replaces a damaged vector shortens it
        self._namespaces = namespaces
        self._filters = filters
        self._polling = polling
        self._expirer = expirer
        self._state_lock = state_lock
        self._write_lock = write_lock
        self._wrote = wrote
        self._stopping = stopping
        self.client_spin_us = client_spin_us
        self.client_crowded = client_crowded
        self._start_thread = start_thread
        self.connections: set[socket.socket] = set()
        self._refused = 0

    def accept(self) -> None:
        """The acceptor thread's body: admits each control connection and serves it in a thread of its own."""
        while not self._stopping.is_set():
            listener = self._sidecar.listener
            if listener is None:
                return  # closed by close()
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return  # listener closed by close()
                if listener is not self._sidecar.listener:
                    continue  # _check_socket bound a new one

                # Out of file descriptors (EMFILE: a flood of connections) or an aborted peer.
                # Returning here stopped all accepting for the sidecar's lifetime, even after the
                # flood was gone (tests/reliability/test_hostile.py): wait a little, then go on.
                log.warning("accepting a control connection failed (%s); retrying", exc)
                time.sleep(0.05)
                continue
            pid, uid, _gid = peer_credentials(conn)
            if uid != os.getuid():
                log.warning("refused a control connection from uid %d (pid %d): not this sidecar's user", uid, pid)
                try:
                    send_frame(conn, error_reply(ProtocolMismatch(f"uid {uid} may not use the sidecar of uid {os.getuid()}")))
                except OSError:
                    # It hung up before hearing why. Raising here ended this thread, and with it
                    # every later connection of anyone (tests/reliability/test_security.py).
                    pass
                finally:
                    conn.close()
                continue
            limit = self.layout.n_slots + settings().spare_connections
            if len(self.connections) >= limit:
                # Each connection costs a thread and its buffers: 300 that announced 200 MB
                # frames and went silent cost ~1 MiB each, without limit (issue 19). Slot
                # holders fit below the limit by construction; the spare ones time out.
                self._refused += 1
                if self._refused in (1, 10, 100) or self._refused % 1000 == 0:
                    log.warning("refused control connection %d of pid %d: %d connections are open (limit %d)",
                                self._refused, pid, len(self.connections), limit)
                try:
                    conn.settimeout(0.1)
                    send_frame(conn, error_reply(InvalidArgument(
                        f"sidecar {self._name!r} has {len(self.connections)} control connections open, its "
                        f"limit ({self.layout.n_slots} slots + KALOS_SPARE_CONNECTIONS={settings().spare_connections}); "
                        f"try again later"
                    )))
                except OSError:
                    pass
                finally:
                    conn.close()
                continue
            self.connections.add(conn)
            self._start_thread(self._serve_connection, f"kalos-conn-{pid}", conn)

    def _serve_connection(self, conn: socket.socket) -> None:
        slot: int | None = None
        config = settings()
        max_bytes, stall_s, idle_s = config.max_message_bytes, config.control_stall_s, config.control_idle_s

        def on_wait(started: bool, idle: float) -> None:
            # Called every _CONTROL_POLL_S that no byte moved. A frame (or reply) stuck halfway
            # is dropped after stall_s; so is a connection that never said hello after idle_s.
            # A client that holds a slot may idle between requests for ever: it is legitimate.
            if self._stopping.is_set():
                raise ConnectionClosed("the sidecar is stopping")
            if started and idle >= stall_s:
                raise TimeoutError(f"nothing moved for {idle:.1f} s in the middle of a frame (KALOS_CONTROL_STALL_S)")
            if not started and slot is None and idle >= idle_s:
                raise TimeoutError(f"no request for {idle:.1f} s and no slot held (KALOS_CONTROL_IDLE_S)")

        try:
            conn.settimeout(_CONTROL_POLL_S)
            while not self._stopping.is_set():
                try:
                    message, blob = recv_frame(conn, max_bytes=max_bytes, on_wait=on_wait)
                except ProtocolMismatch as exc:
                    send_frame(conn, error_reply(exc), on_wait=on_wait)
                    return  # the stream is out of step: drop the connection
                op = message.get("op")
                try:
                    if op == "hello":
                        if slot is not None:
                            raise InvalidArgument("this connection already holds a slot")
                        # The hello's fd exchange follows its frame at once: bounded by the stall time.
                        conn.settimeout(max(stall_s, _CONTROL_POLL_S))
                        try:
                            slot = self._hello(conn, message)
                        finally:
                            conn.settimeout(_CONTROL_POLL_S)
                        continue
                    if op == "recall_text":  # (the one operation that uses this connection's slot)
                        reply, out_blob = self._recall_text(message, slot)
                    else:
                        handler = self._handlers.get(op) if isinstance(op, str) else None
                        if handler is None:
                            raise InvalidArgument(f"unknown control operation {op!r}")
                        reply, out_blob = handler(self, message, blob)
                except (ConnectionClosed, ConnectionError, TimeoutError):
                    # The client hung up mid-operation (it died, e.g. mid-hello), or stalled in
                    # the hello's fd exchange: not a server error, so no traceback in the log;
                    # the finally below frees what it held.
                    raise
                except KalosError as exc:
                    reply, out_blob = error_reply(exc), b""
                except Exception as exc:
                    log.exception("control operation %r failed", op)
                    reply, out_blob = error_reply(ServerError(f"{op} failed: {type(exc).__name__}: {exc}")), b""
                send_frame(conn, reply, out_blob, on_wait=on_wait)
        except TimeoutError as exc:
            log.info("dropped a control connection: %s", exc)
        except (ConnectionClosed, OSError):
            pass
        finally:
            channel = self._sidecar.channel
            if slot is not None and channel is not None:
                self._polling.release(channel, slot)
            self.connections.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket, message: dict[str, Any]) -> int | None:
        # type() is int: True == 1 in Python, and "protocol": true is not a version (issue 19).
        if type(message.get("protocol")) is not int or message.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"client speaks control protocol {message.get('protocol')!r}, this sidecar {PROTOCOL_VERSION}"
            )
        wake = wake_socket(recv_fd(conn))  # (closed on refusal: a refused hello keeps no descriptor)
        try:
            slot = self._polling.admit(self._sidecar.channel, wake)
        except BaseException:
            wake.close()
            raise
        if slot is None:
            wake.close()
            raise InvalidArgument(f"all {self.layout.n_slots} slots are in use; restart the sidecar with more --slots")
        self.cohort.forget(slot)  # a new client: quick until it shows otherwise
        crowded = self.client_crowded
        if crowded == "yield" and self._polling.server is None:  # the GPU's polling failed: the sweep answers
            crowded = "nap"
        try:
            send_frame(conn, ok_reply(
                slot=slot, segment=self.endpoint.segment_name, epoch=self.epoch, dim=self.layout.dim,
                max_k=self.layout.max_k, max_batch=self.layout.max_batch, n_slots=self.layout.n_slots,
                client_spin_us=self.client_spin_us, client_crowded=crowded,
                # (A client from before client_crowded reads this: it sleeps at once where told not to nap.)
                client_naps=crowded != "sleep",
                max_message_bytes=settings().max_message_bytes,
                # (A client waits a few of these without a stamp before it calls this sidecar dead.)
                heartbeat_s=self._sidecar.config.heartbeat_interval_s,
                # Operations added since the protocol's version: a client uses them only when named.
                ops=["recall_text", "update_ttl", "renew"],
            ))
            send_fd(conn, self._sidecar.segment.fileno())  # the segment has no name (protocol 2 on)
        except BaseException:
            # The client hung up before it learnt its slot (it died mid-hello). The caller never
            # receives the slot number, so its cleanup cannot free it: free it here, or the slot
            # leaks for the sidecar's lifetime (found by tests/reliability/test_client_death.py).
            self._polling.release(self._sidecar.channel, slot)
            raise
        return slot

    def _op_add(self, message: dict[str, Any], blob: bytearray) -> tuple[dict[str, Any], bytes]:
        request_id = check_request_id(message.get("request_id"))
        vectors, _ = blob_array(message.get("vectors"), blob)
        if vectors.dtype != np.float32:
            raise InvalidArgument(f"vectors must be float32, got {vectors.dtype}")
        namespace = message.get("namespace", "default")
        # The store's own checks (shape, dimension, NaN/inf, zero rows), before normalising.
        unit = normalise_rows(check_vectors(vectors, self.store.dim).copy(), what="vector", error=InvalidArgument)
        keys = message.get("keys")
        if keys is not None:
            keys = check_keys(keys, len(unit))  # duplicates in the call refused here: nothing written
        ttl = check_ttl(message.get("ttl"), len(unit))
        with self._write_lock:
            if request_id is not None:
                done = self.store.find_request(request_id)
                if done is not None:
                    # A retry of an add that committed but whose reply never arrived (the
                    # connection broke; the sidecar was stopped or restarted meanwhile): the
                    # ids of that add, not a second copy (issue 19).
                    if len(done) != len(unit):
                        raise InvalidArgument(
                            f"request_id {request_id!r} was an add of {len(done)} rows; this add has {len(unit)}"
                        )
                    spec, out = array_blob(done, "int64")
                    return ok_reply(ids=spec, repeated=True), out
            self._make_room(len(unit))
            # The sidecar's clock sets the expiry: the one its recalls, gets and lists compare with.
            expires_at = None if ttl is None else time.time() + ttl
            if keys is not None:
                ids = self._upsert(unit, keys, namespace, message, request_id, expires_at)
                spec, out = array_blob(ids, "int64")
                return ok_reply(ids=spec), out
            ids, namespace_id, created_at = self.store.add(
                unit, namespace=namespace, texts=message.get("texts"), metadata=message.get("metadata"),
                created_at=message.get("created_at"), request_id=request_id, expires_at=expires_at,
            )
            try:
                with self._state_lock:
                    self._polling.pause()
                    self.engine.add(ids, unit, np.int32(namespace_id), created_at, message.get("metadata"))
                    self._namespaces[namespace.encode()] = namespace_id
                    self._expirer.note(ids, expires_at)
            except BaseException as exc:
                self._undo_add(ids, request_id, exc)
                raise
            self._wrote.set()
        spec, out = array_blob(ids, "int64")
        return ok_reply(ids=spec), out

    def _make_room(self, extra: int) -> None:
        """Room in the engine for ``extra`` more rows before the store commits (``_write_lock``
        held): an allocation that fails (MemoryError, CUDA out of memory) then fails a write that
        stored nothing. After the commit it left rows that recall could not see, and a retry
        stored them twice (issue 19). Only growing changes the engine, so only then are the
        sweep (its state lock) and the GPU's polling stopped: beside a crowd, a write whose rows
        fit waits for one pass of the sweep and stops the polling once (the engine's add), not
        twice. (Whether they fit is read without the state lock: every writer that grows the
        engine holds ``_write_lock``; what the sweep's expiries change without it, tombstones
        and compaction, only leaves more room; a sharded engine adds where the room is.)"""
        if self.engine.has_room(extra):
            return
        with self._state_lock:
            self._polling.pause()
            self.engine.reserve(extra)

    def _upsert(self, unit: np.ndarray, keys: list[str], namespace: str, message: dict[str, Any],
                request_id: str | None, expires_at: np.ndarray | None = None) -> np.ndarray:
        """A keyed add (``_write_lock`` held, room reserved): the store's upsert commits, then the
        engine swaps each replaced row for its new vector under one ``_state_lock`` hold, so no
        recall (the sweep holds that lock while it searches) sees both versions or neither.
        A replaced item keeps its id: its row is tombstoned and the id added again."""
        ids, namespace_id, created_at, replaced = self.store.upsert(
            unit, keys=keys, namespace=namespace, texts=message.get("texts"), metadata=message.get("metadata"),
            created_at=message.get("created_at"), request_id=request_id, expires_at=expires_at,
        )
        try:
            with self._state_lock:
                self._polling.pause()
                if replaced.any():
                    self.engine.delete(ids[replaced])
                self.engine.add(ids, unit, np.int32(namespace_id), created_at, message.get("metadata"))
                self._namespaces[namespace.encode()] = namespace_id
                # The call's expiry replaces the stored one (None: these rows never expire).
                self._expirer.note(ids, expires_at)
        except BaseException as exc:
            if not replaced.any():
                self._undo_add(ids, request_id, exc)  # only new rows: take them back, as an add does
                raise
            # The old versions are overwritten in the store and cannot be put back; the store
            # holds exactly one (the new) version of each key, which a restart serves.
            log.exception("upsert of %d rows committed but the engine failed", len(ids))
            raise ServerError(
                f"upsert committed ({len(ids)} rows) but the engine failed ({type(exc).__name__}: {exc}): "
                "the new versions are stored and are served after the sidecar restarts"
            ) from exc
        self._wrote.set()
        return ids

    def _undo_add(self, ids: np.ndarray, request_id: str | None, exc: BaseException) -> None:
        """Takes a committed add back out of the store after the engine refused it, so that the
        error the client gets means what it says: nothing was stored (``_write_lock`` held)."""
        try:
            with self._state_lock:
                # The engine may hold the rows' ids already (it failed writing their vectors):
                # tombstone them, or recall could return what the store no longer has.
                self._polling.pause()
                self.engine.delete(ids)
                self._expirer.schedule.forget(ids)
            self.store.undo_add(ids, request_id)
        except Exception:
            log.exception("add of %d rows (ids %d-%d) committed, the engine failed (%s: %s), and taking it back "
                          "failed too: the rows are stored but not served until a restart",
                          len(ids), int(ids[0]), int(ids[-1]), type(exc).__name__, exc)
            raise ServerError(
                f"add failed after its commit ({type(exc).__name__}: {exc}) and could not be undone: its "
                f"{len(ids)} rows (ids {int(ids[0])}-{int(ids[-1])}) are stored but not served until the sidecar restarts"
            ) from exc
        self._wrote.set()

    def _op_delete(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Deletes by ``keys`` (in ``namespace``), by ``ids``, or by ``where`` (in ``namespace``,
        None: every namespace; one store transaction, so a crash leaves all of them or none)."""
        keys, where = message.get("keys"), message.get("where")
        if sum(value is not None for value in (keys, message.get("ids"), where)) > 1:
            raise InvalidArgument("delete: give keys, ids or where (exactly one)")
        expired: list[int] = []
        if keys is not None:
            namespace = check_namespace(message.get("namespace", "default"))
            delete = lambda: self.store.delete_keys(keys, namespace, expired_out=expired)  # noqa: E731
        elif where is not None:
            clause = compile_where(where)
            namespace = _optional_namespace(message.get("namespace", "default"))
            delete = lambda: self.store.delete_where(namespace=namespace, where=clause, expired_out=expired)  # noqa: E731
        else:
            ids = _int_list(message.get("ids"), "ids")
            delete = lambda: self.store.delete(ids, expired_out=expired)  # noqa: E731
        deleted = self._delete_committed(delete)
        # Rows that had expired were gone for get, list and count already: not deleted now.
        return ok_reply(deleted=len(deleted) - len(expired)), b""

    def _delete_committed(self, delete: Callable[[], np.ndarray]) -> np.ndarray:
        """Runs a store delete, then tombstones what it deleted in the engine (``_write_lock``
        keeps the two in the store's order); returns the ids deleted."""
        with self._write_lock:
            deleted = delete()
            with self._state_lock:
                self._polling.pause()
                self.engine.delete(deleted)
                self._expirer.schedule.forget(deleted)
                if self.quarantined:  # (a deleted damaged row is no longer one to report)
                    gone = set(deleted.tolist())
                    self.quarantined[:] = [i for i in self.quarantined if i not in gone]
            self._wrote.set()
        return deleted

    def _op_drop_namespace(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Deletes every memory of one namespace (one transaction). The name stays registered
        with its id, so no other namespace can ever take that id (an engine row or a follower's
        map that still names it could then leak one namespace's memories into another's)."""
        namespace = check_namespace(message.get("namespace"))
        expired: list[int] = []
        deleted = self._delete_committed(
            lambda: self.store.delete_where(namespace=namespace, where=None, expired_out=expired))
        return ok_reply(deleted=len(deleted) - len(expired)), b""

    def _op_list(self, message: dict[str, Any], _blob: bytearray) -> tuple[bytes, bytes]:
        """One page of items in id order after ``after``: ``items`` and ``next`` (the id to page
        on from, None on the last page)."""
        where = message.get("where")
        items, after = self.store.list_items(
            namespace=_optional_namespace(message.get("namespace")),
            where=None if where is None else compile_where(where),
            limit=message.get("limit", 100), after=message.get("after", 0),
        )
        return _checked_reply("list: the page", "ask for a smaller limit",
                              items=[item_fields(item) for item in items], next=after,
                              floor=_text_chars(items)), b""

    def _op_count(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        where = message.get("where")
        count = self.store.count_items(namespace=_optional_namespace(message.get("namespace")),
                                       where=None if where is None else compile_where(where))
        return ok_reply(count=count), b""

    def _op_update(self, message: dict[str, Any], blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Changes what the message carries of one memory (``text``, ``metadata``, a vector in the
        blob, ``ttl``; a field absent from the message is kept). A new vector replaces the
        engine's row under one ``_state_lock`` hold, after the store's commit, as an upsert does:
        a recall sees the old vector or the new, never both or neither. A new ttl re-times the
        row where it is: nothing is created, and the row keeps its id (LangGraph's refresh of an
        item's expiry on read)."""
        if ("key" in message) == ("id" in message):
            raise InvalidArgument("update: the message names a key or an id (exactly one)")
        item = message["key"] if "key" in message else message["id"]
        vector: Any = UNSET
        if message.get("vector") is not None:
            vector, _ = blob_array(message["vector"], blob)
            if vector.dtype != np.float32:
                raise InvalidArgument(f"vector must be float32, got {vector.dtype}")
        change = check_update(
            item, self.store.dim, namespace=message.get("namespace", "default"),
            text=message["text"] if "text" in message else UNSET,
            metadata=message["metadata"] if "metadata" in message else UNSET,
            vector=vector, merge=message.get("merge", False), ttl=message["ttl"] if "ttl" in message else UNSET,
        )
        if change.vector is not None:
            unit = normalise_rows(change.vector[None].copy(), what="vector", error=InvalidArgument)
            change = dataclasses.replace(change, vector=unit[0])
        with self._write_lock:
            if change.vector is not None:
                self._make_room(1)  # as an add: an allocation failure stores nothing
            item_id, namespace_id, created_at = self.store.update(change)
            indexed = stored = None
            if change.vector is not None or change.metadata is not UNSET or change.ttl is not UNSET:
                # What where filters see from now on (the stored metadata, merged or replaced),
                # and when the row expires.
                stored = self.store.get([item_id])[0]
                indexed = [stored.metadata if stored is not None else None]
                if change.vector is None:
                    with self._state_lock:
                        self._polling.pause()
                        self.engine.set_metadata(np.array([item_id], dtype=np.int64), indexed)
            if change.vector is not None:
                try:
                    with self._state_lock:
                        self._polling.pause()
                        ids = np.array([item_id], dtype=np.int64)
                        self.engine.delete(ids)
                        if stored is not None:  # (expired since the commit: gone, not served again)
                            self.engine.add(ids, unit, np.int32(namespace_id), np.array([created_at]), indexed)
                            # Its expiry once more: the expirer may have tombstoned the old row
                            # between the commit and here, and dropped it from its schedule; a
                            # time already past is tombstoned again before the next recall.
                            expires = np.nan if stored.expires_at is None else stored.expires_at
                            self._expirer.note(ids, np.array([expires], dtype=np.float64))
                    if item_id in self.quarantined:  # a damaged vector replaced: served again
                        self.quarantined.remove(item_id)
                except BaseException as exc:
                    log.exception("update of id %d committed but the engine failed", item_id)
                    raise ServerError(
                        f"update of id {item_id} committed but the engine failed ({type(exc).__name__}: {exc}): "
                        "the new vector is stored and is served after the sidecar restarts"
                    ) from exc
            elif change.ttl is not UNSET:
                self._retime(np.array([item_id], dtype=np.int64), namespace_id, [stored])
            self._wrote.set()
        return ok_reply(id=item_id), b""

    def _op_renew(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Renews the expiry of the memories of ``keys`` in ``namespace`` that expire, to now +
        ``ttl`` seconds, in one transaction (kalos.store.sqlite.Store.renew): the refresh of
        what an agent framework read (LangGraph's refresh_ttl). Nothing is created; memories
        that never expire, and absent or expired keys, stay as they are."""
        keys = keys_for_lookup(message.get("keys"))
        namespace = check_namespace(message.get("namespace", "default"))
        ttl = check_ttl_seconds(message.get("ttl"))
        with self._write_lock:
            ids, namespace_id = self.store.renew(keys, namespace, ttl)
            if len(ids):
                self._retime(ids, namespace_id)
            self._wrote.set()
        return ok_reply(renewed=len(ids)), b""

    def _retime(self, ids: np.ndarray, namespace_id: int, items: list[Item | None] | None = None) -> None:
        """The engine's rows and expiry schedule of ``ids`` (of one namespace), whose expiry a
        committed write changed and whose vectors it did not, as the store has them now
        (``items``: ``store.get(ids)`` when the caller read it already)."""
        if items is None:
            items = self.store.get(ids)
        gone = np.array([i for i, item in zip(ids.tolist(), items) if item is None], dtype=np.int64)
        live = [item for item in items if item is not None]
        live_ids = np.array([item.id for item in live], dtype=np.int64)
        expires = np.array([np.nan if item.expires_at is None else item.expires_at for item in live], dtype=np.float64)
        with self._state_lock:
            self._polling.pause()
            if len(gone):  # expired since the commit (a ttl shorter than the way here): not served
                self.engine.delete(gone)
                self._expirer.schedule.forget(gone)
            # Rows whose old expiry passed between the commit and here: the expirer tombstoned
            # them, and the store keeps them (with the new expiry). Served again.
            lost = [item for item in live if item.id not in self.engine and item.id not in self.quarantined]
            vectors = self.store.vectors([item.id for item in lost]) if lost else {}
            lost = [item for item in lost if item.id in vectors]
            if lost:
                lost_ids = np.array([item.id for item in lost], dtype=np.int64)
                try:
                    self.engine.reserve(len(lost))
                    self.engine.add(lost_ids, np.stack([vectors[item.id] for item in lost]), np.int32(namespace_id),
                                    np.array([item.created_at for item in lost]), [item.metadata for item in lost])
                except BaseException as exc:
                    log.exception("a change of expiry of ids %s committed but the engine failed", lost_ids.tolist())
                    raise ServerError(
                        f"the new expiry of ids {lost_ids.tolist()[:8]} is committed but the engine failed "
                        f"({type(exc).__name__}: {exc}): they are stored and served after the sidecar restarts"
                    ) from exc
            self._expirer.note(live_ids, expires)

    def _op_get(self, message: dict[str, Any], _blob: bytearray) -> tuple[bytes, bytes]:
        keys = message.get("keys")
        if keys is not None and message.get("ids") is not None:
            raise InvalidArgument("get: the message names keys or ids (one of them), got both")
        wanted = keys if keys is not None else _int_list(message.get("ids"), "ids")
        if isinstance(wanted, list) and len(set(map(repr, wanted))) != len(wanted):
            # Each repeat was a full copy in the reply: get([id] * 100) of a 1 MiB text cost the
            # sidecar 108 MiB (issue 19). Client.get sends each id (key) once and repeats locally.
            dup, times = collections.Counter(map(repr, wanted)).most_common(1)[0]
            what = "key" if keys is not None else "id"
            raise InvalidArgument(f"get: {what}s must be distinct; {what} {dup} appears {times} times")
        with_vectors = message.get("with_vectors", False)
        if not isinstance(with_vectors, bool):
            raise InvalidArgument(f"get: with_vectors must be true or false, got {with_vectors!r}")
        what, advice = "get: the reply", "ask for fewer ids at a time"
        if not with_vectors:
            # By key: the ids the keys name now, then their items as by id (a key deleted and
            # added again in between names an id that is gone: None, as a read after the delete).
            ids = wanted if keys is None else self.store.ids_of_keys(
                keys, check_namespace(message.get("namespace", "default")))
            present = [item_id for item_id in ids if item_id is not None]
            bodies = dict(zip(present, self.items.encoded(present, check_floor=_floor_check(what, advice))))
            items_json = _json_list(bodies.get(item_id) or b"null" for item_id in ids)
            return _encoded_reply(what, advice, items=items_json), b""
        if keys is not None:
            items = self.store.get_keys(keys, check_namespace(message.get("namespace", "default")))
        else:
            items = self.store.get(wanted)
        n_present = sum(item is not None for item in items)
        # (Before the vectors are read: their bytes, and the texts' at least.)
        _refuse_past_limit(what, advice, _text_chars(items), 4 * self.store.dim * n_present, at_least=True)
        found = [item.id for item in items if item is not None]
        by_id = self.store.vectors(found) if found else {}
        # An item deleted between the two reads is absent, not an item without its vector.
        items = [item if item is not None and item.id in by_id else None for item in items]
        present = [item.id for item in items if item is not None]
        # One row per item present, in the order of the items.
        matrix = np.zeros((len(present), self.store.dim), np.float32)
        for row, item_id in enumerate(present):
            matrix[row] = by_id[item_id]
        spec, blob = array_blob(matrix, "float32")
        return _checked_reply(what, advice, items=[item_fields(item) for item in items], vectors=spec,
                              blob_len=len(blob)), blob

    def _op_stats(self, _message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        with self._state_lock:
            engine = {
                "count": len(self.engine), "capacity": self.engine.capacity, "tombstones": self.engine.tombstones,
                "device": self.engine.device, "engine": self.engine.name, "engine_bytes": self.engine.memory_bytes(),
                "clients": int(self._sidecar.channel.active.sum()),
                # Single recalls the GPU's polling answered by itself (not in "queries").
                "gpu_polled": self._polling.server.served if self._polling.server is not None else 0,
                # ... in this many rounds (SlotGraphServer.rounds: queued, a few more than ran).
                "gpu_rounds": self._polling.server.rounds if self._polling.server is not None else 0,
                # The engine's own counters (searches, fallbacks, graph captures and errors).
                "engine_stats": {key: value for key, value in getattr(self.engine, "stats", {}).items()
                                 if isinstance(value, (int, float, str))},
                **self.cohort.stats(),
            }
        return ok_reply(
            name=self._name, pid=os.getpid(), epoch=self.epoch, dim=self.store.dim,
            store=str(self.store.path), store_bytes=self.store.size_bytes(),
            namespaces=self.store.namespace_counts(), slots=self.layout.n_slots, max_k=self.layout.max_k,
            max_batch=self.layout.max_batch, **engine, **self.metrics.snapshot(),
            seed_compat=self._seed.stats if self._seed is not None else None,
            quarantined=len(self.quarantined), quarantined_ids=self.quarantined[:100],
            item_cache=self.items.stats(),
        ), b""

    def _op_compact(self, _message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        with self._write_lock, self._state_lock:
            self._polling.pause()
            before = self.engine.tombstones
            self.engine.compact()
        return ok_reply(removed=before), b""

    def _op_where(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Registers a where clause (JSON text) for recalls: its handle, which a slot's request
        carries (``where_handle`` with the HAS_WHERE flag), and its canonical form."""
        text = message.get("where")
        if not isinstance(text, str):
            raise InvalidArgument(f"where: the clause travels as JSON text, got {type(text).__name__}")
        where = Where.from_json(text)
        handle = self._filters.register(where)
        return ok_reply(handle=handle, key=where.key), b""

    def _rows_where(self, namespace: str | None, where: Where | None) -> np.ndarray:
        """Ids (int64, ascending) of the rows the engine serves in ``namespace`` (None: every
        namespace) whose metadata passes ``where`` (None: all): the same index and cached mask
        a filtered recall uses. Rows the engine does not serve (quarantined) are not counted."""
        flt_where = None if where is None or where.is_trivial else where
        with self._state_lock:
            if namespace is not None:
                ns = self._namespaces.get(namespace.encode())
                if ns is None:
                    return np.empty(0, np.int64)
            else:
                ns = None
            ids = self.engine.ids_where(Filter(namespace=ns, where=flt_where))
        return np.sort(ids)

    def _op_embedder(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """The sidecar's model (name, dim, runtime); ``"load": true`` waits until it is loaded."""
        if message.get("load", False) is not False:
            if message.get("load") is not True:
                raise InvalidArgument(f"embedder: load must be true or false, got {message.get('load')!r}")
            self.embedding.load()
        info = self.embedding.info()
        if info["dim"] != self.store.dim:
            raise DimensionMismatch(
                f"embedder {info['name']} makes {info['dim']}-dimensional vectors but sidecar {self._name!r} "
                f"serves a store of dimension {self.store.dim}: serve a store created with --dim {info['dim']}, "
                f"or pass Client(embedder=...) a model of dimension {self.store.dim}"
            )
        return ok_reply(**info), b""

    def _op_embed(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Embeds ``texts`` with the sidecar's model (batched with other clients' pending texts)."""
        from kalos.validation import check_embed_texts

        texts = message.get("texts")
        if not isinstance(texts, list) or not texts:
            raise InvalidArgument(f"embed: texts must be a non-empty list of str, got {str(texts)[:80]}")
        texts = check_embed_texts(texts)
        self._op_embedder({}, _blob)  # the dimension check, before the (slow) load
        vectors = self.embedding.embed(texts)
        spec, blob = array_blob(vectors, "float32")
        return ok_reply(vectors=spec), blob

    def _recall_text(self, message: dict[str, Any], slot: int | None) -> tuple[bytes, bytes]:
        """Embeds ``texts``, recalls them in this connection's slot (the crowd's batched passes, as
        if the client had sent the vectors) and reads the hits' items: a client's ``recall_text``
        in one round trip instead of three (embed, recall, get). The request words (``k``,
        ``flags``, ``since``, ``until``, ``namespace``, ``where_handle``) are those a client
        writes into its slot; the recall validates them as it validates a client's."""
        from kalos.validation import check_embed_texts

        if slot is None:
            raise InvalidArgument("recall_text: this connection holds no slot (send hello first)")
        texts = message.get("texts")
        if not isinstance(texts, list) or not texts:
            raise InvalidArgument(f"recall_text: texts must be a non-empty list of str, got {str(texts)[:80]}")
        if len(texts) > self.layout.max_batch:
            raise InvalidArgument(f"recall_text: at most {self.layout.max_batch} texts at once (max_batch), got {len(texts)}")
        texts = check_embed_texts(texts)
        k, words = _slot_words(message, self.layout)
        self._op_embedder({}, b"")  # the dimension check, before the (slow) load
        vectors = self.embedding.embed(texts)
        n = len(texts)

        def write(view: Any) -> None:
            view.queries[:n] = vectors
            view.write_request(Op.RECALL, n, k, *words)

        channel = self._sidecar.channel
        # Spin as this sidecar's clients are advised to, and only while they do: while every
        # client and the sweep can have a core (kalos.ipc.channel.ClientChannel.wait).
        spin_s = self.client_spin_us / 1e6 if channel.n_clients < _CORES else 0.0
        try:
            view = channel.recall_for_client(slot, write, timeout_s=settings().control_stall_s, spin_s=spin_s,
                                             stopping=self._stopping)
        except TimeoutError as exc:  # (a TimeoutError here would drop the connection: see _serve_connection)
            raise ServerError(f"recall_text: {exc}") from None
        status = int(view.status[0])
        if status:
            raise error_from_code(status, view.read_message())
        ids = view.ids[:n, :k].copy()
        scores = view.scores[:n, :k].copy()
        # (Only padding or a client's scribbles are negative or not finite: never sent.)
        kept = (ids >= 0) & np.isfinite(scores)
        hits = [[[int(i), float(s)] for i, s in zip(ids[row][kept[row]], scores[row][kept[row]])] for row in range(n)]
        what, advice = "recall_text: the reply", "ask for fewer texts or a smaller k"
        found = self.items.encoded(np.unique(ids[kept]).tolist(), check_floor=_floor_check(what, advice))
        return _encoded_reply(what, advice, hits=encode_value(hits),
                              items=_json_list(body for body in found if body is not None)), b""

    # (A reply is a message, or its encoding already checked for size: _checked_reply.)
    _handlers: dict[str, Callable[["ControlServer", dict[str, Any], bytearray], tuple[dict[str, Any] | bytes, bytes]]] = {
        "embedder": _op_embedder,
        "embed": _op_embed,
        "add": _op_add,
        "delete": _op_delete,
        "get": _op_get,
        "update": _op_update,
        "renew": _op_renew,
        "list": _op_list,
        "count": _op_count,
        "drop_namespace": _op_drop_namespace,
        "stats": _op_stats,
        "compact": _op_compact,
        "where": _op_where,
    }


def _slot_words(message: dict[str, Any], layout: Layout) -> tuple[int, tuple[int, float, float, bytes, int]]:
    """A recall's k and the rest of its slot words (flags, since, until, namespace, where
    handle) from a control message, checked only as far as writing them into the slot needs:
    the recall loop then checks them as it checks any client's."""
    k = message.get("k")
    if type(k) is not int or not 1 <= k <= layout.max_k:
        raise InvalidQuery(f"k={k!r} is out of range: 1 <= k <= {layout.max_k}")
    flags, handle = message.get("flags", 0), message.get("where_handle", 0)
    for label, value in (("flags", flags), ("where_handle", handle)):
        word = REQUEST_DTYPE.fields[label][0]
        if type(value) is not int or not 0 <= value <= np.iinfo(word).max:
            raise InvalidArgument(f"recall_text: {label} must be an unsigned {8 * word.itemsize}-bit integer, got {value!r}")
    bounds = []
    for label in ("since", "until"):
        value = message.get(label, 0.0)
        try:
            bound = float(value) if type(value) in (int, float) else math.nan
        except OverflowError:  # an int past float's range
            bound = math.nan
        if not math.isfinite(bound):
            raise InvalidQuery(f"recall_text: {label} must be a finite number, got {str(value)[:40]}")
        bounds.append(bound)
    namespace = message.get("namespace", "")
    if not isinstance(namespace, str):
        raise InvalidQuery(f"recall_text: namespace must be a str, got {type(namespace).__name__}")
    encoded = namespace.encode("utf-8", "surrogatepass")
    if len(encoded) > NAMESPACE_BYTES:
        raise InvalidQuery(f"recall_text: namespace longer than {NAMESPACE_BYTES} bytes")
    return k, (flags, bounds[0], bounds[1], encoded, handle)


def _checked_reply(what: str, advice: str, *, blob_len: int = 0, floor: int = 0, **fields: Any) -> bytes:
    """``ok_reply(**fields)`` encoded, once: its exact size is checked against the message
    limit before anything is sent (a reply past it is refused, naming ``what`` and ``advice``),
    and the encoding is what send_frame sends. ``floor``, a size the JSON cannot be under (its
    texts' characters), refuses a reply far past the limit before it is encoded at all."""
    _refuse_past_limit(what, advice, floor, blob_len, at_least=True)
    encoded = {name: encode_value(value) for name, value in fields.items()}
    return _encoded_reply(what, advice, blob_len=blob_len, **encoded)


def _encoded_reply(what: str, advice: str, *, blob_len: int = 0, **encoded: bytes) -> bytes:
    """``encoded_ok_reply(**encoded)`` (fields already encoded), its exact size checked as
    :func:`_checked_reply` says."""
    body = encoded_ok_reply(**encoded)
    _refuse_past_limit(what, advice, len(body), blob_len)
    return body


def _floor_check(what: str, advice: str) -> Callable[[int], None]:
    """What refuses a reply whose JSON will be at least a size (ItemCache.encoded's check_floor)."""
    return lambda size: _refuse_past_limit(what, advice, size, 0, at_least=True)


def _json_list(bodies: Iterable[bytes]) -> bytes:
    """A JSON list of values already encoded."""
    return b"[" + b",".join(bodies) + b"]"


def _refuse_past_limit(what: str, advice: str, json_len: int, blob_len: int, *, at_least: bool = False) -> None:
    """InvalidArgument naming ``what`` and ``advice`` if a reply of these sizes (``json_len`` a
    floor when ``at_least``) would pass the message limit."""
    problem = frame_too_large(json_len, blob_len, settings().max_message_bytes, json_at_least=at_least)
    if problem is not None:
        raise InvalidArgument(f"{what} would be {problem}; {advice}")


def _text_chars(items: list[Any]) -> int:
    """The characters of the items' texts: a floor under their reply's JSON."""
    return sum(len(item.text or "") for item in items if item is not None)


def _optional_namespace(value: Any) -> str | None:
    """A namespace name, or None for every namespace."""
    return None if value is None else check_namespace(value)


def _int_list(value: Any, label: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidArgument(f"{label} must be a list of integers")
    if any(not -(2**63) <= v < 2**63 for v in value):
        raise InvalidArgument(f"{label} must fit in int64")
    return value


