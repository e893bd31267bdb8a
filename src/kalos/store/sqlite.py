"""The durable store: one SQLite file (WAL) that is the source of truth for every memory.

Here: the rows, their transactions, the schema and its migrations. The file around them (its
header, its atomic creation, the checks before SQLite opens it, the writer's lock) is
:mod:`kalos.store.sqlite_file`, the record of acknowledged writes :mod:`kalos.store.ack`, and the
input checks every side shares :mod:`kalos.validation`.

The sidecar is the only writer. It loads every row into an engine at start
(:meth:`Store.iter_rows`) and afterwards writes each add/delete here first; an add is
acknowledged only once its transaction has committed, so kill -9 at any moment loses nothing
that was acknowledged and never leaves half an item.

Schema (version 1)::

    meta        key TEXT PRIMARY KEY, value NOT NULL
                  format         'kalos-store'
                  schema_version 1
                  dim            vector length, fixed at creation
                  created_at     unix seconds of creation
                  write_seq      committed write transactions (added by the first writable open)
    namespaces  id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE
                  'default' (id 1) is created with the store; others by the first add naming them
    items       id INTEGER PRIMARY KEY AUTOINCREMENT   never reused, even after deleting the max id
                namespace_id INTEGER NOT NULL REFERENCES namespaces(id)
                created_at REAL NOT NULL               unix seconds
                text TEXT                               NULL: none
                metadata TEXT                           compact JSON object, NULL: none
                key TEXT                                the caller's id (NULL: none), unique per namespace
                updated_at REAL                         unix seconds of the last upsert, NULL: never
                expires_at REAL                         unix seconds after which it is gone (ttl), NULL: never
                vector BLOB NOT NULL                    dim little-endian float32, CHECKed length
    items_by_namespace  index on items(namespace_id): counts without reading the vectors
    items_by_key        UNIQUE index on items(namespace_id, key) WHERE key IS NOT NULL
    items_by_expiry     index on items(expires_at) WHERE expires_at IS NOT NULL
    requests    seq INTEGER PRIMARY KEY, request_id TEXT UNIQUE, first_id, n, ids
                  the last REQUEST_WINDOW adds' client request ids (created by the first
                  writable open): a retried add finds its ids instead of adding twice; ``ids``
                  (int64 blob) holds an upsert's ids, which need not be one consecutive range

``key``, ``updated_at`` and ``expires_at`` (issue 22) are added by the first writable open of a store made
before them (``ALTER TABLE ... ADD COLUMN``, so they follow ``vector`` there; a new store has
them before it). The schema version stays 1: a Kalos that predates keys still reads and writes
such a store correctly, it just does not see the keys.

The header's ``application_id`` is ``0x4B4C4F53`` ("KLOS"), which lets :meth:`Store.open`
reject someone else's SQLite file from its first 100 bytes, without letting SQLite touch it.
Vectors are the last column so that reading the small columns never follows the overflow
pages the 4 KiB blobs live in.

Files next to the store: ``<db>-wal`` and ``<db>-shm`` (SQLite's, created 0600 like the db), and
``<db>-ack`` (ours, 0600): ``write_seq`` and the highest id as of the last acknowledged write,
fdatasync'ed after every commit, so that a store whose -wal was lost after a crash is refused
instead of served without the writes it acknowledged (:mod:`kalos.store.ack`).
Readonly opens also create those two if they are missing (SQLite needs them to read a WAL
database); they never change the db file itself.

Locking: a writable open holds an exclusive ``flock`` on the db file until :meth:`Store.close`,
so a second sidecar on the same store fails at once with :class:`StoreLocked` instead of
interleaving writes. Readonly opens take no lock.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import numbers
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import numpy as np

from kalos.errors import DimensionMismatch, InvalidArgument, NotAKalosStore, StoreError, UnknownKey
from kalos.store import ack, sqlite_file
from kalos.store.changes import ChangeLog
from kalos.store.sqlite_file import APPLICATION_ID
from kalos.validation import (
    DEFAULT_NAMESPACE,
    MAX_ID,
    UNSET,
    Item,
    Update,
    check_add,
    check_dim,
    check_ids,
    check_keys,
    check_list_args,
    check_namespace,
    check_request_id,
    encode_metadata,
    expiry_column,
    keys_for_lookup,
)

__all__ = ["Store", "ItemRow", "FORMAT_NAME", "SCHEMA_VERSION", "APPLICATION_ID", "REQUEST_WINDOW"]

FORMAT_NAME = "kalos-store"
SCHEMA_VERSION = 1

log = logging.getLogger("kalos.store.sqlite")

# A writer waits this long for SQLite's own locks. Only a foreign tool writing to the file
# (the flock keeps other sidecars out) or a long checkpoint can make it wait at all.
_BUSY_TIMEOUT_MS = 5000
# After a checkpoint SQLite truncates the WAL back to this size, so one big import does not
# leave a WAL of the same size on disk for the rest of the sidecar's life.
_WAL_SIZE_LIMIT = 64 << 20
_MMAP_BYTES = 1 << 40
# Ids per statement in get/delete: under SQLite's historic 999-variable limit.
_IDS_PER_QUERY = 500
_MAX_NAMESPACE_ID = (1 << 31) - 1  # engines keep namespace ids as int32
# Partial: unkeyed items (NULL key, today's adds) are not in it and cost nothing.
# Partial too: only the rows that expire, in expiry order, for the sweeper and the sidecar's load.
_EXPIRY_INDEX = "CREATE INDEX IF NOT EXISTS items_by_expiry ON items (expires_at) WHERE expires_at IS NOT NULL"
_KEY_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS items_by_key ON items (namespace_id, key) WHERE key IS NOT NULL"


# -- validation helpers (everything is checked before a transaction starts) ----------------


def _merged_metadata(update: Update, stored: str | None) -> str | None:
    """The JSON text to store for ``update``'s metadata, given the stored JSON text."""
    if not update.merge:
        return encode_metadata([update.metadata], 1)[0]
    merged = {} if stored is None else json.loads(stored)
    if not isinstance(merged, dict):  # a foreign tool wrote a non-object: replaced, not merged
        merged = {}
    merged.update(update.metadata)
    return encode_metadata([merged], 1)[0]


def _update_columns(update: Update, stored_metadata: str | None, now: float) -> list[tuple[str, Any]]:
    """``(column, value)`` of what ``update`` writes, as both stores name their columns:
    ``updated_at``, then only what it carries (text, metadata merged or replaced, the float32
    bytes of the vector, the expiry ``now`` + ttl or none)."""
    columns: list[tuple[str, Any]] = [("updated_at", now)]
    if update.ttl is not UNSET:
        columns.append(("expires_at", None if update.ttl is None else now + update.ttl))
    if update.text is not UNSET:
        columns.append(("text", update.text))
    if update.metadata is not UNSET:
        columns.append(("metadata", _merged_metadata(update, stored_metadata)))
    if update.vector is not None:
        columns.append(("vector", np.ascontiguousarray(update.vector, dtype="<f4").tobytes()))
    return columns


def _wrap(e: sqlite3.Error, what: str, path: Path) -> StoreError:
    return StoreError(f"store {path}: {what} failed: {e}")


#: Recent add request ids a store remembers (the client's retry after a broken connection
#: finds its add here instead of adding it twice).
REQUEST_WINDOW = 10_000


# -- the store -------------------------------------------------------------------------------



class ItemRow(NamedTuple):
    """One item as both stores read it (``_item_columns``): :class:`~kalos.validation.Item`'s
    fields but the vector, with the metadata as its stored JSON text (None: none), as the store
    returned them (a timestamp may be an int)."""

    id: int
    namespace: str
    text: str | None
    metadata: str | None
    created_at: float
    key: str | None
    updated_at: float | None
    expires_at: float | None


class Store:
    """A Kalos store file. Open with :meth:`Store.open`; use as a context manager or call close().

    Thread-safe: one lock serialises every use of the connection. Not fork-safe: open it in
    the process that uses it.
    """

    # Class-level defaults so close() and repr() work on an instance whose open() failed halfway.
    path: Path = Path()
    dim: int = 0
    readonly: bool = True
    _conn: sqlite3.Connection | None = None
    _file_key: sqlite_file.FileKey | None = None
    _holds_flock: bool = False
    _closed: bool = True
    _ack: ack.AckFile | None = None
    _write_seq: int = 0
    _last_id: int = 0
    _keyed: bool = True
    _expiring: bool = True  # expires_at exists (False only on a readonly open of an unmigrated store)
    _changing: set[int] | None = None  # the rows the open write transaction named (see _note_changed)

    def __init__(self) -> None:
        # Private: Store.open() builds instances, so a half-open store is never handed out.
        self._lock = threading.Lock()
        self._changes = ChangeLog()  # (see revision and changed_since)

    @property
    def revision(self) -> int | None:
        """Grows with every committed write that changed rows (an add leaves it: it inserts rows
        under new ids and overwrites none, and what reads an absent id does not keep it as
        absent). A writable open is the rows' only writer, so a copy of an item read while the
        revision was r is the stored item while it is still r (kalos.server.item_cache). None
        where another process may write: a readonly open (and every PostgresStore, whose rows
        other hosts change); and once closed (what reads it then hears that from the store)."""
        return None if self.readonly or self._closed else self._changes.revision

    def changed_since(self, revision: int) -> frozenset[int] | None:
        """The ids of the rows that the writes after ``revision`` changed (up to the current
        :attr:`revision`), or None where that cannot be told (:class:`kalos.store.changes.ChangeLog`).
        Never waits for a write in progress."""
        return self._changes.since(revision)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("readonly" if self.readonly else "writer")
        return f"Store({str(self.path)!r}, dim={self.dim}, {state})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike, *, dim: int | None = None, readonly: bool = False) -> "Store":
        """Opens the store at ``path``, creating it (with dimension ``dim``) if it is missing.

        An existing file is checked without being modified: :class:`NotAKalosStore` if it is
        not a Kalos store, :class:`StoreError` for a newer schema, :class:`DimensionMismatch`
        if ``dim`` is given and differs. A writable open fails with :class:`StoreLocked` while
        another writer (any process) has the store open. ``readonly`` opens never create a
        store, never write and take no lock.
        """
        # The real path: the sidecar reports it and tools compare it, and SQLite names the
        # -wal and -shm files after the symlink's target anyway.
        path = Path(os.path.realpath(os.fspath(path)))
        if dim is not None:
            dim = check_dim(dim)
        if not os.path.lexists(path):
            if readonly:
                raise InvalidArgument(f"store {path} does not exist (a readonly open cannot create it)")
            if dim is None:
                raise InvalidArgument(f"store {path} does not exist; pass dim to create it")
            if os.path.isdir(path.parent):
                sqlite_file.check_directory(path.parent)
            sqlite_file.create(path, functools.partial(_build_schema, dim=dim))
        store = cls()
        try:
            store._open_existing(path, dim, readonly)
        except BaseException:
            store.close()
            raise
        return store

    def _open_existing(self, path: Path, dim: int | None, readonly: bool) -> None:
        self.path = path
        self.readonly = readonly
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise StoreError(f"store {path} vanished while being opened (or is a dangling symlink)") from None
        except OSError as e:
            raise StoreError(f"store {path} cannot be opened: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise NotAKalosStore(f"{path} is not a Kalos store: not a regular file")
        if st.st_size == 0:
            raise NotAKalosStore(f"{path} is not a Kalos store: it is an empty (0-byte) file")
        # Before anything lets SQLite near the file: it would adopt -wal/-shm files planted by
        # another user and write every new memory into them (issue 19, item 5).
        sqlite_file.check_directory(path.parent)

        # Identify the file before locking it: someone else's file that is flock'ed by its own
        # application must be reported as "not a Kalos store", not as "locked".
        self._file_key, fd = sqlite_file.acquire(path, st)
        sqlite_file.check_header(fd, path)
        sqlite_file.prepare_side_files(path, st.st_uid)  # a Kalos store: now, before SQLite's first open (_read_meta)
        self.dim = self._read_meta(dim)
        if not readonly:
            sqlite_file.lock_writer(self._file_key, path, st)
            self._holds_flock = True

        mode = "ro" if readonly else "rw"
        try:
            conn = sqlite3.connect(
                f"file:{quote(str(path))}?mode={mode}",
                uri=True,
                isolation_level=None,  # autocommit; every transaction is an explicit BEGIN
                check_same_thread=False,  # self._lock serialises the threads instead
                timeout=_BUSY_TIMEOUT_MS / 1000,
            )
        except sqlite3.Error as e:
            raise _wrap(e, "open", path) from None
        self._conn = conn
        self._closed = False
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA foreign_keys = ON")
            # FULL: the WAL is fsynced at every commit, so an acknowledged add survives a power
            # cut too, not only kill -9 (NORMAL would only survive the latter).
            conn.execute("PRAGMA synchronous = FULL")
            # Read the db file through a mapping instead of one pread per page: loading the
            # engine (iter_rows) gets about twice as fast. SQLite caps it at its compiled limit.
            conn.execute(f"PRAGMA mmap_size = {_MMAP_BYTES}")
            if readonly:
                conn.execute("PRAGMA query_only = ON")
            else:
                got = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(got).lower() != "wal":
                    raise StoreError(f"store {path}: cannot use WAL journal mode here (got {got!r})")
                conn.execute(f"PRAGMA journal_size_limit = {_WAL_SIZE_LIMIT}")
            # The path could have been replaced between the checks above and this connection.
            now = os.stat(path)
            if (now.st_dev, now.st_ino) != self._file_key:
                raise StoreError(f"store {path} was replaced by another file while being opened")
            if not readonly:
                self._open_ack(conn)
            # A readonly open of a store no writer has migrated yet has no key columns: its
            # items simply have no keys (see _item_columns).
            columns = {r[1] for r in conn.execute("PRAGMA table_info(items)")}
            self._keyed = "key" in columns
            self._expiring = "expires_at" in columns
        except sqlite3.Error as e:
            raise _wrap(e, "open", path) from None

    def _written_state(self, conn: sqlite3.Connection) -> tuple[float, int, int]:
        """``(created_at, write_seq, highest id ever)`` of the store as SQLite reads it now."""
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('created_at', 'write_seq')"))
        seq_row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'items'").fetchone()
        top = conn.execute("SELECT max(id) FROM items").fetchone()[0]
        return float(meta.get("created_at", 0.0)), int(meta.get("write_seq", 0)), max(seq_row[0] if seq_row else 0, top or 0)

    def _open_ack(self, conn: sqlite3.Connection) -> None:
        """Checks the store against its acknowledged-writes record (StoreError if writes are
        missing), then keeps the record open to update it after every commit."""
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('write_seq', 0)")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS requests (seq INTEGER PRIMARY KEY, request_id TEXT NOT NULL UNIQUE,"
            " first_id INTEGER NOT NULL, n INTEGER NOT NULL, ids BLOB)"
        )
        self._migrate_keys(conn)
        created, seq, last_id = self._written_state(conn)
        record = ack.AckFile(self.path, created)
        try:
            record.check(seq, last_id)
        except BaseException:
            record.close()
            raise
        self._ack = record
        self._write_seq, self._last_id = seq, last_id
        self._ack.write(seq, last_id)

    @staticmethod
    def _migrate_keys(conn: sqlite3.Connection) -> None:
        """Gives a store made before caller keys (issue 22) its key columns, in one transaction:
        a crash leaves the store as it was or migrated, never half of it. Existing items keep
        no key and no updated_at (NULL), which is what they would have got as unkeyed adds."""
        items = {r[1] for r in conn.execute("PRAGMA table_info(items)")}
        requests = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
        if {"key", "updated_at", "expires_at"} <= items and "ids" in requests:
            conn.execute(_KEY_INDEX)  # IF NOT EXISTS: a no-op on every store but a damaged one
            conn.execute(_EXPIRY_INDEX)
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            if "key" not in items:
                conn.execute("ALTER TABLE items ADD COLUMN key TEXT")
            if "updated_at" not in items:
                conn.execute("ALTER TABLE items ADD COLUMN updated_at REAL")
            if "expires_at" not in items:
                conn.execute("ALTER TABLE items ADD COLUMN expires_at REAL")
            if "ids" not in requests:
                conn.execute("ALTER TABLE requests ADD COLUMN ids BLOB")
            conn.execute(_KEY_INDEX)
            conn.execute(_EXPIRY_INDEX)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        log.info("store: added the columns of issue 22 (key, updated_at, expires_at)")

    def _item_columns(self) -> str:
        # The SELECT list of an item's read, in ItemRow's order.
        keyed = "i.key, i.updated_at" if self._keyed else "NULL, NULL"
        expiry = "i.expires_at" if self._expiring else "NULL"
        return f"i.id, n.name, i.text, i.metadata, i.created_at, {keyed}, {expiry}"

    @staticmethod
    def _item(row: tuple) -> Item:
        """The Item of a row that _item_columns selected (an ItemRow's fields, in its order)."""
        item_id, name, text, meta, created, key, updated, expires = row
        return Item(id=item_id, namespace=name, text=text, metadata=None if meta is None else json.loads(meta),
                    created_at=float(created), key=key, updated_at=None if updated is None else float(updated),
                    expires_at=None if expires is None else float(expires))

    def lost_writes(self) -> str | None:
        """Why this store lacks writes its <db>-ack record says were acknowledged, or None.

        A writable open refuses such a store outright; this is for readonly opens (doctor).
        """
        # The record first: it is written after each commit, so a commit made between the two
        # reads (a sidecar serving meanwhile) can only make the store look ahead, never behind.
        record = ack.read_ack(self.path)
        with self._lock:
            conn = self._connection()
            try:
                created, seq, last_id = self._written_state(conn)
            except sqlite3.Error as e:
                raise _wrap(e, "lost_writes", self.path) from None
        return ack.lost_writes(self.path, record, created, seq, last_id)

    def checkpoint(self) -> bool:
        """Copies the WAL into the db file and truncates it (True if it completed).

        Until a checkpoint, acknowledged writes live in the -wal file only; the sidecar calls
        this once writes pause (settings().checkpoint_idle_s).
        """
        with self._lock:
            conn = self._connection(write=True)
            try:
                busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as e:
                raise _wrap(e, "checkpoint", self.path) from None
        return busy == 0

    def _read_meta(self, dim: int | None) -> int:
        path = self.path
        try:
            ro = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, timeout=_BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as e:
            raise _wrap(e, "open", path) from None
        try:
            try:
                tables = {r[0] for r in ro.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                meta = dict(ro.execute("SELECT key, value FROM meta")) if "meta" in tables else None
            except sqlite3.Error as e:
                # The header already says "Kalos store", so this is damage or an I/O problem.
                raise StoreError(f"store {path} cannot be read: {e}") from None
        finally:
            ro.close()
        if meta is None:
            raise NotAKalosStore(f"{path} is not a Kalos store: an SQLite database without a Kalos meta table")
        if meta.get("format") != FORMAT_NAME:
            raise NotAKalosStore(
                f"{path} is not a Kalos store: meta format is {meta.get('format')!r}, not {FORMAT_NAME!r}"
            )
        version = meta.get("schema_version")
        if not isinstance(version, int) or version < 1:
            raise StoreError(f"store {path} is damaged: schema_version {version!r} in its meta table")
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"store {path} has schema version {version}; this Kalos reads up to {SCHEMA_VERSION}"
                " (upgrade Kalos to open it)"
            )
        missing = {"namespaces", "items"} - tables
        if missing:
            raise StoreError(f"store {path} is damaged: missing tables {sorted(missing)}")
        meta_dim = meta.get("dim")
        if not isinstance(meta_dim, int) or meta_dim < 1:
            raise StoreError(f"store {path} is damaged: dim {meta_dim!r} in its meta table")
        if dim is not None and dim != meta_dim:
            raise DimensionMismatch(f"store {path} has dimension {meta_dim}, but dim={dim} was asked for")
        return meta_dim

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connection and releases the writer lock. Idempotent."""
        with self._lock:
            conn, self._conn = self._conn, None
            key, self._file_key = self._file_key, None
            self._closed = True
            # The connection first: the shared descriptor may be closed in sqlite_file.release,
            # and SQLite's locks must be gone (or still covered by other Stores) by then.
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass  # nothing is pending (every write is committed or rolled back)
            if self._ack is not None:
                self._ack.close()
                self._ack = None
            if key is not None:
                sqlite_file.release(key, writer=self._holds_flock)
                self._holds_flock = False

    def _connection(self, *, write: bool = False) -> sqlite3.Connection:
        # Called with self._lock held.
        if self._conn is None:
            raise StoreError(f"store {self.path} is closed")
        if write and self.readonly:
            raise StoreError(f"store {self.path} is open readonly")
        return self._conn

    # -- writes ----------------------------------------------------------------------------

    def add(
        self,
        vectors: np.ndarray,
        *,
        namespace: str,
        texts: Sequence[str | None] | None = None,
        metadata: Sequence[dict | None] | None = None,
        created_at: float | np.ndarray | None = None,
        request_id: str | None = None,
        expires_at: np.ndarray | None = None,
    ) -> tuple[np.ndarray, int, np.ndarray]:
        """Adds ``n`` items in one transaction; returns ``(ids int64[n], namespace_id, created_at float64[n])``.
        ``expires_at`` (float64 unix seconds ``[n]``, NaN: never; None: nothing expires) is when
        each item is gone: get, list and count skip it from that moment on.

        ``vectors`` are stored bit-exactly as little-endian float32 (the caller normalises).
        Returns only after the commit is on disk. Any bad input raises before anything is
        written (InvalidArgument / DimensionMismatch naming the offending index).
        ``request_id`` is remembered with the add (the last REQUEST_WINDOW of them), so that a
        retry can find it with :meth:`find_request` instead of adding it again.
        """
        request_id = check_request_id(request_id)
        vecs, ns, text_col, meta_col, times = check_add(vectors, self.dim, namespace, texts, metadata, created_at)
        n = len(vecs)
        expiry_col = expiry_column(expires_at, n)
        if expires_at is not None and not self._expiring:
            raise StoreError(f"store {self.path} has no expires_at column (open it writable once to migrate it)")

        row_bytes = 4 * self.dim
        # One buffer, sliced per row: no per-row copy before SQLite copies the blob.
        blob = memoryview(vecs.reshape(-1).view(np.uint8))
        time_col = times.tolist()

        # IMMEDIATE (in _write_transaction) takes the write lock at once, so the ids computed
        # below cannot be taken by anyone else before the insert.
        with self._write_transaction("add", new_rows_only=True) as conn:
            ns_id = self._namespace_id(conn, ns)
            # AUTOINCREMENT semantics by hand (executemany cannot report the ids it
            # assigned): the next id is above both the live max and the high-water mark
            # in sqlite_sequence. Inserting explicit ids advances sqlite_sequence too.
            seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'items'").fetchone()
            top = conn.execute("SELECT max(id) FROM items").fetchone()[0]
            start = max(seq[0] if seq else 0, top or 0) + 1
            if start + n - 1 > MAX_ID:
                raise StoreError(f"store {self.path}: item ids are exhausted")
            ids = range(start, start + n)
            if expires_at is None:
                conn.executemany(
                    "INSERT INTO items (id, namespace_id, created_at, text, metadata, vector)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        (ids[i], ns_id, time_col[i], text_col[i], meta_col[i], blob[i * row_bytes : (i + 1) * row_bytes])
                        for i in range(n)
                    ),
                )
            else:
                conn.executemany(
                    "INSERT INTO items (id, namespace_id, created_at, text, metadata, expires_at, vector)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        (ids[i], ns_id, time_col[i], text_col[i], meta_col[i], expiry_col[i],
                         blob[i * row_bytes : (i + 1) * row_bytes])
                        for i in range(n)
                    ),
                )
            if request_id is not None:
                conn.execute("INSERT INTO requests (request_id, first_id, n) VALUES (?, ?, ?)", (request_id, start, n))
                conn.execute("DELETE FROM requests WHERE seq <= (SELECT max(seq) FROM requests) - ?", (REQUEST_WINDOW,))
            self._last_id = max(self._last_id, start + n - 1)
        return np.arange(start, start + n, dtype=np.int64), ns_id, times

    def find_request(self, request_id: str) -> np.ndarray | None:
        """The ids of the add made with ``request_id`` (one of the last REQUEST_WINDOW), or None."""
        request_id = check_request_id(request_id)
        with self._lock:
            conn = self._connection(write=True)
            try:
                row = conn.execute("SELECT first_id, n, ids FROM requests WHERE request_id = ?", (request_id,)).fetchone()
            except sqlite3.Error as e:
                raise _wrap(e, "find_request", self.path) from None
        if row is None:
            return None
        if row[2] is not None:  # an upsert: its ids, in the order of its keys
            return np.frombuffer(row[2], dtype="<i8").astype(np.int64)
        return np.arange(row[0], row[0] + row[1], dtype=np.int64)

    def upsert(
        self,
        vectors: np.ndarray,
        *,
        keys: Sequence[str],
        namespace: str,
        texts: Sequence[str | None] | None = None,
        metadata: Sequence[dict | None] | None = None,
        created_at: float | np.ndarray | None = None,
        request_id: str | None = None,
        expires_at: np.ndarray | None = None,
    ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
        """Adds or replaces ``n`` keyed items in one transaction.

        Returns ``(ids int64[n], namespace_id, created_at float64[n], replaced bool[n])``. A
        key already in ``namespace`` keeps its item id and its ``created_at``; its vector, text
        and metadata are replaced and ``updated_at`` set to now (same id: the sidecar swaps the
        engine's row for that id, and an id a caller holds keeps naming the same memory). A new
        key gets a new id, like :meth:`add`. Keys in other namespaces are other items. Bad
        input (a duplicate key in the call too) raises before anything is written.

        ``expires_at`` as for :meth:`add`: the call's expiry replaces the stored one (None: the
        items never expire). A key whose item has expired (and awaits the sweep) is a new
        memory under the same id: ``created_at`` is the call's, ``updated_at`` none.
        """
        request_id = check_request_id(request_id)
        vecs, ns, text_col, meta_col, times = check_add(vectors, self.dim, namespace, texts, metadata, created_at)
        n = len(vecs)
        key_col = check_keys(keys, n)
        expiry_col = expiry_column(expires_at, n)
        if not self._expiring:
            raise StoreError(f"store {self.path} has no expires_at column (open it writable once to migrate it)")
        if not self._keyed:
            raise StoreError(f"store {self.path} has no key columns (open it writable once to migrate it)")
        row_bytes = 4 * self.dim
        blob = memoryview(vecs.reshape(-1).view(np.uint8))
        now = time.time()
        with self._write_transaction("upsert") as conn:
            ns_id = self._namespace_id(conn, ns)
            existing: dict[str, tuple[int, float]] = {}
            expired: set[str] = set()
            for start in range(0, n, _IDS_PER_QUERY):
                chunk = key_col[start : start + _IDS_PER_QUERY]
                for key, item_id, created, expiry in conn.execute(
                    "SELECT key, id, created_at, expires_at FROM items WHERE namespace_id = ?"
                    f" AND key IN ({','.join('?' * len(chunk))})", (ns_id, *chunk),
                ):
                    existing[key] = (item_id, created)
                    if expiry is not None and expiry <= now:
                        expired.add(key)
            replaced = np.fromiter((key in existing for key in key_col), dtype=bool, count=n)
            fresh = int(n - replaced.sum())
            seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'items'").fetchone()
            top = conn.execute("SELECT max(id) FROM items").fetchone()[0]
            first = max(seq[0] if seq else 0, top or 0) + 1
            if first + fresh - 1 > MAX_ID:
                raise StoreError(f"store {self.path}: item ids are exhausted")
            ids = np.empty(n, dtype=np.int64)
            out_times = times.copy()
            next_id = first
            inserts, updates = [], []
            for i, key in enumerate(key_col):
                vector = blob[i * row_bytes : (i + 1) * row_bytes]
                if replaced[i]:
                    ids[i], out_times[i] = existing[key]
                    if key in expired:  # gone already: a new memory, under the id its key had
                        out_times[i] = times[i]
                        updates.append((text_col[i], meta_col[i], vector, None, expiry_col[i], float(times[i]), int(ids[i])))
                    else:
                        updates.append((text_col[i], meta_col[i], vector, now, expiry_col[i], out_times[i], int(ids[i])))
                else:
                    ids[i] = next_id
                    next_id += 1
                    inserts.append((int(ids[i]), ns_id, float(times[i]), text_col[i], meta_col[i], key, expiry_col[i],
                                    vector))
            self._note_changed(u[-1] for u in updates)  # (the inserts are new rows)
            if updates:
                conn.executemany("UPDATE items SET text = ?, metadata = ?, vector = ?, updated_at = ?, expires_at = ?,"
                                 " created_at = ? WHERE id = ?", updates)
            if inserts:
                conn.executemany(
                    "INSERT INTO items (id, namespace_id, created_at, text, metadata, key, expires_at, vector)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", inserts,
                )
            if request_id is not None:
                conn.execute("INSERT INTO requests (request_id, first_id, n, ids) VALUES (?, ?, ?, ?)",
                             (request_id, int(ids[0]), n, ids.astype("<i8").tobytes()))
                conn.execute("DELETE FROM requests WHERE seq <= (SELECT max(seq) FROM requests) - ?", (REQUEST_WINDOW,))
            self._last_id = max(self._last_id, next_id - 1)
        return ids, ns_id, out_times, replaced

    def ids_of_keys(self, keys: Sequence[str], namespace: str) -> list[int | None]:
        """The item id of each key in ``namespace`` (None where the key is not there)."""
        wanted = keys_for_lookup(keys)
        key_list = list(dict.fromkeys(wanted))  # each key looked up once
        ns = check_namespace(namespace)
        found: dict[str, int] = {}
        now = time.time()
        with self._lock:
            conn = self._connection()
            if not self._keyed:
                return [None] * len(wanted)
            try:
                for start in range(0, len(key_list), _IDS_PER_QUERY):
                    chunk = key_list[start : start + _IDS_PER_QUERY]
                    found.update(conn.execute(
                        "SELECT i.key, i.id FROM items AS i JOIN namespaces AS n ON n.id = i.namespace_id"
                        f" WHERE n.name = ? AND i.key IN ({','.join('?' * len(chunk))}){self._live_clause('i')}",
                        (ns, *chunk, *self._live_params(now)),
                    ))
            except sqlite3.Error as e:
                raise _wrap(e, "ids_of_keys", self.path) from None
        return [found.get(key) for key in wanted]

    def get_keys(self, keys: Sequence[str], namespace: str) -> list[Item | None]:
        """The items of ``keys`` in ``namespace``, aligned with them: None where a key is absent."""
        ids = self.ids_of_keys(keys, namespace)
        items = self.get([i for i in ids if i is not None])
        by_id = {item.id: item for item in items if item is not None}
        return [None if i is None else by_id.get(i) for i in ids]

    def delete_keys(self, keys: Sequence[str], namespace: str, *, expired_out: list[int] | None = None) -> np.ndarray:
        """Deletes the items of ``keys`` in ``namespace`` in one transaction; returns their ids.
        Keys not in ``namespace`` (absent, or only in another namespace) are ignored.
        ``expired_out``: gets the ids among them that had expired already (see :meth:`delete`)."""
        key_list = list(dict.fromkeys(keys_for_lookup(keys)))
        ns = check_namespace(namespace)
        if not key_list:  # no transaction (and no write_seq) for nothing, as delete([])
            with self._lock:
                self._connection(write=True)
            return np.empty(0, dtype=np.int64)
        found: list[int] = []
        with self._write_transaction("delete_keys") as conn:
            if not self._keyed:
                return np.empty(0, dtype=np.int64)
            for start in range(0, len(key_list), _IDS_PER_QUERY):
                chunk = key_list[start : start + _IDS_PER_QUERY]
                ids = [r[0] for r in conn.execute(
                    "SELECT i.id FROM items AS i JOIN namespaces AS n ON n.id = i.namespace_id"
                    f" WHERE n.name = ? AND i.key IN ({','.join('?' * len(chunk))})", (ns, *chunk),
                )]
                if ids:
                    self._note_expired(conn, ids, expired_out)
                    self._note_changed(ids)
                    conn.execute(f"DELETE FROM items WHERE id IN ({','.join('?' * len(ids))})", ids)
                found += ids
        return np.sort(np.asarray(found, dtype=np.int64))

    def renew(self, keys: Sequence[str], namespace: str, ttl: float) -> tuple[np.ndarray, int | None]:
        """Renews the expiry of the items of ``keys`` in ``namespace`` that expire (now + ``ttl``
        seconds, ``ttl`` > 0 checked by the caller) in one transaction: items that never expire,
        and absent or expired keys, are left as they are. Returns the renewed ids (ascending)
        and the namespace's id (None if it does not exist). ``updated_at`` is kept: the item
        did not change."""
        key_list = list(dict.fromkeys(keys_for_lookup(keys)))
        ns = check_namespace(namespace)
        found: list[int] = []
        with self._write_transaction("renew") as conn:
            row = conn.execute("SELECT id FROM namespaces WHERE name = ?", (ns,)).fetchone()
            if row is None or not self._keyed or not self._expiring or not key_list:
                return np.empty(0, dtype=np.int64), None if row is None else int(row[0])
            now = time.time()
            for start in range(0, len(key_list), _IDS_PER_QUERY):
                chunk = key_list[start : start + _IDS_PER_QUERY]
                ids = [r[0] for r in conn.execute(
                    f"SELECT id FROM items WHERE namespace_id = ? AND key IN ({','.join('?' * len(chunk))})"
                    " AND expires_at > ?", (row[0], *chunk, now))]
                if ids:
                    self._note_changed(ids)
                    conn.execute(f"UPDATE items SET expires_at = ? WHERE id IN ({','.join('?' * len(ids))})",
                                 (now + ttl, *ids))
                found += ids
        return np.sort(np.asarray(found, dtype=np.int64)), int(row[0])

    def update(self, change: Update) -> tuple[int, int, float]:
        """Applies one checked :class:`Update` (:func:`check_update`) in one transaction; returns
        ``(id, namespace_id, created_at)`` of the item. Only what was given changes;
        ``updated_at`` is set to now. :class:`UnknownKey` (nothing written) when no live item
        has that key in that namespace, or that id. The caller normalises ``change.vector``.
        """
        if change.key is not None and not self._keyed:
            raise StoreError(f"store {self.path} has no key columns (open it writable once to migrate it)")
        with self._write_transaction("update") as conn:
            now = time.time()  # (after the lock's wait: the live check and the new expiry use it)
            if change.key is not None:
                row = conn.execute(
                    "SELECT i.id, i.namespace_id, i.created_at, i.metadata FROM items AS i JOIN namespaces AS n"
                    " ON n.id = i.namespace_id WHERE n.name = ? AND i.key = ?" + self._live_clause("i"),
                    (change.namespace, change.key, *self._live_params(now)),
                ).fetchone()
            else:
                row = conn.execute(
                    "SELECT id, namespace_id, created_at, metadata FROM items WHERE id = ?" + self._live_clause(None),
                    (change.id, *self._live_params(now)),
                ).fetchone()
            if row is None:
                raise UnknownKey(f"update: no memory has {change.describe()}")
            item_id, ns_id, created, stored_meta = row
            columns = _update_columns(change, stored_meta, now)
            self._note_changed((item_id,))
            conn.execute(f"UPDATE items SET {', '.join(f'{c} = ?' for c, _ in columns)} WHERE id = ?",
                         (*[v for _, v in columns], item_id))
        return int(item_id), int(ns_id), float(created)

    def delete_expired(self, now: float | None = None) -> np.ndarray:
        """Deletes every item whose ``expires_at`` is at or before ``now`` (default: the clock) in
        one transaction; returns their ids (int64, ascending). No transaction when none is due."""
        now = time.time() if now is None else float(now)
        with self._lock:
            conn = self._connection(write=True)
            if not self._expiring:
                return np.empty(0, dtype=np.int64)
            try:
                due = conn.execute("SELECT 1 FROM items WHERE expires_at <= ? LIMIT 1", (now,)).fetchone()
            except sqlite3.Error as e:
                raise _wrap(e, "delete_expired", self.path) from None
        if due is None:
            return np.empty(0, dtype=np.int64)
        with self._write_transaction("delete_expired") as conn:
            ids = [r[0] for r in conn.execute("SELECT id FROM items WHERE expires_at <= ?", (now,))]
            self._note_changed(ids)  # (the same rows as the DELETE's: one transaction)
            conn.execute("DELETE FROM items WHERE expires_at <= ?", (now,))
        return np.sort(np.asarray(ids, dtype=np.int64))

    def expiries(self, ids: Sequence[int] | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64, expires_at float64)`` of the items that expire (of ``ids``, or of all)."""
        with self._lock:
            conn = self._connection()
            if not self._expiring:
                return np.empty(0, np.int64), np.empty(0)
            try:
                if ids is None:
                    rows = conn.execute("SELECT id, expires_at FROM items WHERE expires_at IS NOT NULL").fetchall()
                else:
                    rows = []
                    for chunk in _chunks(np.unique(check_ids(ids, "expiries"))):
                        rows += conn.execute(f"SELECT id, expires_at FROM items WHERE id IN ({','.join('?' * len(chunk))})"
                                             " AND expires_at IS NOT NULL", chunk).fetchall()
            except sqlite3.Error as e:
                raise _wrap(e, "expiries", self.path) from None
        return (np.fromiter((r[0] for r in rows), np.int64, len(rows)),
                np.fromiter((r[1] for r in rows), np.float64, len(rows)))

    def list_items(self, *, namespace: str | None = None, where: Any = None, limit: int = 100,
                   after: int = 0) -> tuple[list[Item], int | None]:
        """One page of live items in id order: those with id > ``after`` in ``namespace`` (None:
        every namespace) whose metadata passes ``where`` (a :class:`kalos.where.Where`; None: all),
        at most ``limit``. Returns ``(items, next_after)``; ``next_after`` is None on the last page.

        Paging by id is stable under concurrent writes: an item present throughout is on exactly
        one page (an upsert keeps its id), items added meanwhile come on later pages or not at all.
        """
        ns, limit, after = check_list_args(namespace, limit, after)
        now = time.time()
        out: list[Item] = []
        with self._lock:
            conn = self._connection()
            try:
                ns_clause: tuple[str, tuple] = ("", ())
                if ns is not None:
                    row = conn.execute("SELECT id FROM namespaces WHERE name = ?", (ns,)).fetchone()
                    if row is None:
                        return [], None
                    ns_clause = (" AND i.namespace_id = ?", (row[0],))
                # Without a filter, one query answers; with one, rows are read a chunk at a time
                # until the page is full (a selective filter reads further, never more than once).
                chunk = limit + 1 if where is None else max(limit + 1, 1024)
                while len(out) <= limit:
                    rows = conn.execute(
                        f"SELECT {self._item_columns()} FROM items AS i JOIN namespaces AS n ON n.id = i.namespace_id"
                        f" WHERE i.id > ?{ns_clause[0]}{self._live_clause('i')} ORDER BY i.id LIMIT ?",
                        (after, *ns_clause[1], *self._live_params(now), chunk),
                    ).fetchall()
                    for row in rows:
                        item = self._item(row)
                        if where is None or where.matches(item.metadata):
                            out.append(item)
                            if len(out) > limit:
                                break
                    if len(rows) < chunk:
                        break
                    after = rows[-1][0]
            except sqlite3.Error as e:
                raise _wrap(e, "list", self.path) from None
        if len(out) > limit:
            return out[:limit], out[limit - 1].id
        return out, None

    def count_items(self, *, namespace: str | None = None, where: Any = None) -> int:
        """Live items in ``namespace`` (None: all) whose metadata passes ``where`` (None: all)."""
        ns = None if namespace is None else check_namespace(namespace)
        now = time.time()
        with self._lock:
            conn = self._connection()
            try:
                return len(self._matching(conn, ns, where, now)) if where is not None else int(conn.execute(
                    "SELECT count(*) FROM items AS i WHERE 1" + self._namespace_clause(ns) + self._live_clause("i"),
                    (*(() if ns is None else (ns,)), *self._live_params(now)),
                ).fetchone()[0])
            except sqlite3.Error as e:
                raise _wrap(e, "count", self.path) from None

    def delete_where(self, *, namespace: str | None, where: Any = None,
                     expired_out: list[int] | None = None) -> np.ndarray:
        """Deletes, in one transaction, every item of ``namespace`` (None: of all) whose metadata
        passes ``where`` (None: every item); returns their ids (int64, ascending). The rows are
        chosen and deleted inside the transaction: a crash leaves all of them or none.
        ``expired_out``: gets the ids among them that had expired already (see :meth:`delete`)."""
        ns = None if namespace is None else check_namespace(namespace)
        with self._write_transaction("delete_where") as conn:
            if where is None:
                ids = [r[0] for r in conn.execute(
                    "SELECT i.id FROM items AS i WHERE 1" + self._namespace_clause(ns), () if ns is None else (ns,))]
            else:
                ids = self._matching(conn, ns, where, None)
            self._note_changed(ids)
            for chunk in _chunks(np.asarray(ids, dtype=np.int64)):
                self._note_expired(conn, chunk, expired_out)
                conn.execute(f"DELETE FROM items WHERE id IN ({','.join('?' * len(chunk))})", chunk)
        return np.sort(np.asarray(ids, dtype=np.int64))

    def _note_expired(self, conn: sqlite3.Connection, ids: Sequence[int], expired_out: list[int] | None) -> None:
        """Appends to ``expired_out`` (when given) which of ``ids`` have expired by now: rows that
        get, list and count no longer show, though the expirer has not deleted them yet."""
        if expired_out is None or not self._expiring or not len(ids):
            return
        expired_out += [r[0] for r in conn.execute(
            f"SELECT id FROM items WHERE id IN ({','.join('?' * len(ids))}) AND expires_at <= ?",
            (*[int(i) for i in ids], time.time()))]

    @staticmethod
    def _namespace_clause(ns: str | None) -> str:
        return "" if ns is None else " AND i.namespace_id = (SELECT id FROM namespaces WHERE name = ?)"

    def _matching(self, conn: sqlite3.Connection, ns: str | None, where: Any, now: float | None) -> list[int]:
        """Ids of the items of ``ns`` (None: all) whose metadata passes ``where``; live ones only
        unless ``now`` is None. Reads the small columns only (metadata is before the vector)."""
        live = "" if now is None else self._live_clause("i")
        params = (*(() if ns is None else (ns,)), *(() if now is None else self._live_params(now)))
        found = []
        for item_id, meta in conn.execute(
            "SELECT i.id, i.metadata FROM items AS i WHERE 1" + self._namespace_clause(ns) + live, params,
        ):
            if where.matches(None if meta is None else json.loads(meta)):
                found.append(item_id)
        return found

    def _live_clause(self, alias: str | None) -> str:
        """`` AND <not expired>`` for a query over items (empty on a store without expiries)."""
        if not self._expiring:
            return ""
        column = f"{alias}.expires_at" if alias else "expires_at"
        return f" AND ({column} IS NULL OR {column} > ?)"

    def _live_params(self, now: float) -> tuple[float, ...]:
        return (now,) if self._expiring else ()

    @contextlib.contextmanager
    def _write_transaction(self, what: str, *, new_rows_only: bool = False) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction under the store's lock: committed if the body returns,
        rolled back on any exception (KeyboardInterrupt too: no transaction is left open).
        Once committed, if the body changed rows, :attr:`revision` grows and the rows it named
        (:meth:`_note_changed`) are recorded, unless ``new_rows_only`` (it only inserted rows
        under new ids)."""
        with self._lock:
            conn = self._connection(write=True)
            try:
                conn.execute("BEGIN IMMEDIATE")
                last_id = self._last_id
                changes = conn.total_changes
                changed = committing = False
                self._changing = None
                try:
                    yield conn
                    changed = conn.total_changes != changes
                    # Every write transaction counts itself, so <db>-ack can tell a store that
                    # lost commits (kalos.store.ack).
                    conn.execute("UPDATE meta SET value = value + 1 WHERE key = 'write_seq'")
                    committing = True
                    conn.execute("COMMIT")
                except BaseException:
                    changed, self._changing = True, None  # (not known until the rollback is done)
                    self._last_id = last_id
                    rolled_back = conn.in_transaction
                    if rolled_back:
                        conn.execute("ROLLBACK")
                    # Rolled back: nothing changed. A COMMIT that failed with no transaction left
                    # may have committed.
                    changed = committing and not rolled_back
                    raise
                finally:
                    if changed and not new_rows_only:  # (under the lock: no get reads the rows between)
                        self._changes.record(self._changing)
            except sqlite3.Error as e:
                raise _wrap(e, what, self.path) from None
            self._write_seq += 1
            try:
                self._ack.write(self._write_seq, self._last_id)
            except OSError as e:
                # Committed and durable in SQLite, so the write stands (an error now would say
                # "nothing stored" of a stored write); only the record lags, which can hide a
                # later loss but never reports one that did not happen.
                log.warning("store %s: %s committed, but %s could not be updated: %s",
                            self.path, what, self._ack.path, e.strerror)

    def _note_changed(self, ids: Iterable[int]) -> None:
        """Inside a write transaction: ``ids`` are rows it changes. A transaction must name every
        row it changes or none (then it counts as changing them all: :meth:`changed_since`)."""
        named = {int(i) for i in ids}
        self._changing = named if self._changing is None else self._changing | named

    def _namespace_id(self, conn: sqlite3.Connection, name: str) -> int:
        # Inside the add's transaction: a new namespace exists only if its items do.
        row = conn.execute("SELECT id FROM namespaces WHERE name = ?", (name,)).fetchone()
        if row is not None:
            return int(row[0])
        cur = conn.execute("INSERT INTO namespaces (name) VALUES (?)", (name,))
        ns_id = int(cur.lastrowid)
        if ns_id > _MAX_NAMESPACE_ID:
            raise StoreError(f"store {self.path}: namespace ids are exhausted")
        return ns_id

    def delete(self, ids: Sequence[int] | np.ndarray, *, expired_out: list[int] | None = None) -> np.ndarray:
        """Deletes items in one transaction; returns the ids actually deleted (int64, ascending).

        Unknown (or already deleted) ids are ignored. ``expired_out`` (a list) gets the ids among
        them that had expired already: gone for get, list and count, though not yet deleted by
        the expirer, so a caller counting what it deleted leaves them out.
        """
        wanted = np.unique(check_ids(ids, "delete"))
        if len(wanted) == 0:
            with self._lock:
                self._connection(write=True)  # a closed or read-only store still says so
            return np.empty(0, dtype=np.int64)
        found: list[int] = []
        with self._write_transaction("delete") as conn:
            for chunk in _chunks(wanted):
                marks = ",".join("?" * len(chunk))
                # SELECT then DELETE rather than DELETE ... RETURNING, which needs SQLite 3.35;
                # the IMMEDIATE transaction makes the pair atomic.
                found += [r[0] for r in conn.execute(f"SELECT id FROM items WHERE id IN ({marks})", chunk)]
                self._note_changed(chunk)
                self._note_expired(conn, chunk, expired_out)
                conn.execute(f"DELETE FROM items WHERE id IN ({marks})", chunk)
        return np.sort(np.asarray(found, dtype=np.int64))

    def undo_add(self, ids: Sequence[int] | np.ndarray, request_id: str | None = None) -> None:
        """Deletes the rows of an add and forgets its request id, in one transaction.

        The sidecar's way back when the engine fails an add that has committed: the client is
        told the add failed, so nothing of it may stay (a retry would store it twice).
        """
        wanted = np.unique(check_ids(ids, "undo_add"))
        request_id = check_request_id(request_id)
        with self._write_transaction("undo_add") as conn:
            self._note_changed(wanted)
            for chunk in _chunks(wanted):
                conn.execute(f"DELETE FROM items WHERE id IN ({','.join('?' * len(chunk))})", chunk)
            if request_id is not None:
                conn.execute("DELETE FROM requests WHERE request_id = ?", (request_id,))

    # -- reads -----------------------------------------------------------------------------

    def get(self, ids: Sequence[int] | np.ndarray) -> list[Item | None]:
        """The items of ``ids``, aligned with them: None where an id is absent."""
        return [None if row is None else self._item(row) for row in self.get_rows(ids)]

    def get_rows(self, ids: Sequence[int] | np.ndarray) -> list[ItemRow | None]:
        """:meth:`get`'s items as the store holds them (:class:`ItemRow`: the metadata still its
        JSON text), for what only passes them on (kalos.server.item_cache encodes a reply's
        items from them without building Items)."""
        wanted = check_ids(ids, "get")
        unique = np.unique(wanted)
        found: dict[int, ItemRow] = {}
        now = time.time()  # an expired item is absent from that moment, before the sweep deletes it
        with self._lock:
            conn = self._connection()
            try:
                for chunk in _chunks(unique):
                    marks = ",".join("?" * len(chunk))
                    rows = conn.execute(
                        f"SELECT {self._item_columns()}"
                        " FROM items AS i JOIN namespaces AS n ON n.id = i.namespace_id"
                        f" WHERE i.id IN ({marks}){self._live_clause('i')}",
                        (*chunk, *self._live_params(now)),
                    ).fetchall()
                    for row in rows:
                        found[row[0]] = ItemRow._make(row)
            except sqlite3.Error as e:
                raise _wrap(e, "get", self.path) from None
        return [found.get(i) for i in wanted.tolist()]

    def vectors(self, ids: Sequence[int] | np.ndarray) -> dict[int, np.ndarray]:
        """The stored (normalised float32) vectors of those ``ids`` that exist: id -> ``[dim]``."""
        unique = np.unique(check_ids(ids, "vectors"))
        found: dict[int, np.ndarray] = {}
        with self._lock:
            conn = self._connection()
            try:
                for chunk in _chunks(unique):
                    for item_id, blob in conn.execute(
                        f"SELECT id, vector FROM items WHERE id IN ({','.join('?' * len(chunk))})", chunk
                    ):
                        found[item_id] = np.frombuffer(blob, dtype="<f4").astype(np.float32)
            except sqlite3.Error as e:
                raise _wrap(e, "vectors", self.path) from None
        return found

    def namespaces(self) -> dict[str, int]:
        """Every namespace ever used (and "default"): name -> namespace id."""
        with self._lock:
            conn = self._connection()
            try:
                return dict(conn.execute("SELECT name, id FROM namespaces ORDER BY id"))
            except sqlite3.Error as e:
                raise _wrap(e, "namespaces", self.path) from None

    def namespace_counts(self) -> dict[str, int]:
        """Live items per namespace, for every namespace (0 for an emptied one); expired items,
        even those the sweep has not deleted yet, are not counted."""
        now = time.time()
        with self._lock:
            conn = self._connection()
            try:
                names = dict(conn.execute("SELECT id, name FROM namespaces ORDER BY id"))
                # Grouping over items_by_namespace reads the index only, never the vectors (the
                # rows too only on a store with expiries).
                counts = dict(conn.execute("SELECT namespace_id, count(*) FROM items AS i WHERE 1"
                                           + self._live_clause("i") + " GROUP BY namespace_id", self._live_params(now)))
            except sqlite3.Error as e:
                raise _wrap(e, "namespace_counts", self.path) from None
        return {name: int(counts.get(ns_id, 0)) for ns_id, name in names.items()}

    def count(self) -> int:
        """Live items in the store."""
        with self._lock:
            conn = self._connection()
            try:
                return int(conn.execute("SELECT count(*) FROM items").fetchone()[0])
            except sqlite3.Error as e:
                raise _wrap(e, "count", self.path) from None

    def iter_rows(self, batch: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Every item in id order, ``batch`` at a time, for loading an engine.

        Yields ``(ids int64[b], vectors float32[b, dim], namespace_ids int32[b], created_at
        float64[b])``; the vectors are a fresh writable array per batch. Each batch is read in
        its own short transaction (the lock is not held across a yield), so writes made while
        iterating may or may not be seen: load before accepting writes.
        """
        # Checked here, not in the generator, so a bad call fails at the call.
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
            raise InvalidArgument(f"batch must be an integer >= 1, got {batch!r}")
        with self._lock:
            self._connection()
        return self._iter_rows(int(batch))

    def _iter_rows(self, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        row_bytes = 4 * self.dim
        query = "SELECT id, namespace_id, created_at, vector FROM items WHERE id > ? ORDER BY id LIMIT ?"
        for rows in self._pages(query, batch, "iter_rows"):
            n = len(rows)
            ids, ns_ids, times, blobs = zip(*rows)
            # One C-level join into a writable buffer, then a zero-copy view: no per-row work.
            # The table's CHECK keeps every blob at dim floats; the length test catches a file
            # whose schema was altered behind our back.
            try:
                buf = bytearray().join(blobs)
            except TypeError:
                buf = bytearray()
            if len(buf) != n * row_bytes:
                bad = next(i for i, b in zip(ids, blobs) if not isinstance(b, bytes) or len(b) != row_bytes)
                raise StoreError(f"store {self.path} is damaged: item {bad} has no {self.dim}-float vector")
            yield (
                np.fromiter(ids, dtype=np.int64, count=n),
                np.frombuffer(buf, dtype="<f4").reshape(n, self.dim),
                np.fromiter(ns_ids, dtype=np.int32, count=n),
                np.fromiter(times, dtype=np.float64, count=n),
            )

    def _pages(self, query: str, batch: int, what: str) -> Iterator[list[tuple]]:
        """The rows of ``query`` (its parameters: the last id seen, ``batch``) page by page, each
        page in its own short transaction. Keyset paging (ids start at 1) costs O(batch) per page
        however deep it is."""
        after = 0
        while True:
            with self._lock:
                conn = self._connection()
                try:
                    rows = conn.execute(query, (after, batch)).fetchall()
                except sqlite3.Error as e:
                    raise _wrap(e, what, self.path) from None
            if not rows:
                return
            yield rows
            after = rows[-1][0]

    def iter_metadata(self, batch: int = 65536) -> Iterator[tuple[np.ndarray, list[dict]]]:
        """The metadata of every item that has some, in id order, ``batch`` at a time:
        ``(ids int64[b], [dict] * b)``. The sidecar indexes it for ``where`` filters at start
        (each batch in its own short transaction, as :meth:`iter_rows`)."""
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
            raise InvalidArgument(f"batch must be an integer >= 1, got {batch!r}")
        with self._lock:
            self._connection()
        return self._iter_metadata(int(batch))

    def _iter_metadata(self, batch: int) -> Iterator[tuple[np.ndarray, list[dict]]]:
        query = "SELECT id, metadata FROM items WHERE id > ? AND metadata IS NOT NULL ORDER BY id LIMIT ?"
        for rows in self._pages(query, batch, "iter_metadata"):
            yield np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)), [json.loads(r[1]) for r in rows]

    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check``: "ok", or its findings one per line."""
        with self._lock:
            conn = self._connection()
            try:
                return "\n".join(str(r[0]) for r in conn.execute("PRAGMA integrity_check"))
            except sqlite3.Error as e:
                raise _wrap(e, "integrity_check", self.path) from None

    def size_bytes(self) -> int:
        """Bytes on disk: the db file plus its WAL."""
        total = 0
        for p in (self.path, Path(f"{self.path}-wal")):
            try:
                total += os.stat(p).st_size
            except FileNotFoundError:
                pass
        return total


def _chunks(ids: np.ndarray) -> Iterator[list[int]]:
    values = ids.tolist()
    for i in range(0, len(values), _IDS_PER_QUERY):
        yield values[i : i + _IDS_PER_QUERY]


# -- the schema of a new store --------------------------------------------------------------


def _build_schema(tmp: Path, *, dim: int) -> None:
    """The schema of version 1 (the module's docstring) in the empty file ``tmp``, as WAL."""
    conn = sqlite3.connect(str(tmp), isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("BEGIN")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY NOT NULL, value NOT NULL)")
        conn.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [("format", FORMAT_NAME), ("schema_version", SCHEMA_VERSION), ("dim", dim), ("created_at", time.time())],
        )
        conn.execute("CREATE TABLE namespaces (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)")
        conn.execute("INSERT INTO namespaces (id, name) VALUES (1, ?)", (DEFAULT_NAMESPACE,))
        # The vector length is part of the table, so even a foreign tool cannot write a row
        # the engine could not load.
        conn.execute(
            "CREATE TABLE items ("
            " id INTEGER PRIMARY KEY AUTOINCREMENT,"
            " namespace_id INTEGER NOT NULL REFERENCES namespaces(id),"
            " created_at REAL NOT NULL,"
            " text TEXT,"
            " metadata TEXT,"
            " key TEXT,"
            " updated_at REAL,"
            " expires_at REAL,"
            f" vector BLOB NOT NULL CHECK (typeof(vector) = 'blob' AND length(vector) = {4 * dim}))"
        )
        conn.execute("CREATE INDEX items_by_namespace ON items (namespace_id)")
        conn.execute(_KEY_INDEX)
        conn.execute(_EXPIRY_INDEX)
        conn.execute("COMMIT")
        # Switched last (it cannot run inside a transaction); closing the last connection
        # checkpoints and removes the temp file's -wal, so the file is complete on its own.
        got = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(got).lower() != "wal":
            raise StoreError(f"cannot create store: WAL journal mode unavailable (got {got!r})")
    finally:
        conn.close()
