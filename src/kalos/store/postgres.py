"""PostgreSQL as the store of record: one database shared by the sidecars of several hosts.

Length: one job (the store's whole surface in PostgreSQL's dialect, plus its change log);
what it shares with :mod:`kalos.store.sqlite` is the surface, not the SQL.

``kalos serve --store postgresql://user:password@host:port/db`` serves a :class:`PostgresStore`
instead of the embedded SQLite :class:`kalos.store.sqlite.Store`. The public surface is the same
(open, add, upsert, update, delete, delete_keys, delete_where, delete_expired, get, get_keys,
list_items, count_items, expiries, namespaces, namespace_counts, count, iter_rows,
integrity_check, size_bytes, close), so the sidecar, ``kalos doctor`` and ``kalos stats`` use either. What is
new is that other sidecars write to the same database: every add and delete also appends to
a change log, and each sidecar follows that log (:mod:`kalos.store.follow`) to keep its engine equal
to the database.

Schema (version 1; tables are unqualified, so the connection's ``search_path`` picks the
PostgreSQL schema: ``?options=-csearch_path%3Dmine`` in the URL keeps a store in ``mine``)::

    kalos_meta        key text PRIMARY KEY, value text     format, schema_version, dim, created_at
    kalos_namespaces  id integer PRIMARY KEY, name text UNIQUE      'default' is id 1
    kalos_items       id bigint PRIMARY KEY                          from sequence kalos_item_ids:
                                                                     never reused
                      namespace_id integer REFERENCES kalos_namespaces
                      created_at double precision                    unix seconds
                      text text, metadata text                       metadata: the compact JSON text
                                                                     (not jsonb, which would reorder keys)
                      vector bytea CHECK (length = 4 * dim)          little-endian float32, bit-exact
                      embedding vector(dim)                          only where pgvector was installable
                                                                     at creation: the fallback search
                      key text, updated_at double precision          the caller's id (UNIQUE per namespace,
                                                                     kalos_items_by_key) and the last upsert
                      expires_at double precision                    the ttl's end (NULL: never;
                                                                     kalos_items_by_expiry)
    kalos_changes     seq bigint PRIMARY KEY, op 'add'|'delete'|'upsert'|'update', ids bigint[], at timestamptz

Keys (issue 22): a store made before them gets ``key``, ``updated_at``, the key index and the
'upsert' op at the first writable open (one transaction under the writer lock). An upsert is
one transaction like an add: new keys get new ids, existing keys keep theirs and have their
row updated, and ONE 'upsert' entry lists every id of the call, so that a follower swaps each
row in one engine step (tombstone + add under its state lock): a recall on another host sees
the old version or the new, never both or neither. Every sidecar on a store must run a Kalos
that knows 'upsert' before keys are used: an older follower read any op but 'add' as a delete.
An update (one row, in place) is one 'update' entry, which followers apply like an upsert; a
delete by ``where``, a dropped namespace and the expiry sweep are 'delete' entries. The
``expires_at`` column, its index and the 'update' op are added at the first writable open of
a store made before them, in the same migration.

The change log and its ordering. A follower remembers the highest ``seq`` it applied (its
mark) and reads ``seq > mark``. That is only correct if no row with a lower seq can become
visible after a row with a higher one - the classic gap: with a plain sequence, writer A takes
seq 7, writer B takes seq 8 and commits first, a follower reads 8 and moves its mark past 7,
which A then commits and nobody ever reads. Here every writing transaction first takes one
transaction-scoped advisory lock (``pg_advisory_xact_lock``) and only then computes
``seq = max(seq) + 1``. PostgreSQL releases transaction locks only after the commit is visible
to every new snapshot, so the next writer's seq is assigned after the previous writer's row is
visible: seq order is commit order, and every snapshot sees a prefix of the log. The lock
serialises Kalos writers on one database (each add is one short transaction), which is the
price of that guarantee. Writers that bypass Kalos are not in the log and are not followed.

``pg_notify`` in the same transaction wakes the followers at commit; it is only a wake-up
(notifications are lost while a listener is disconnected), the follower always reads the
table and also polls it every few seconds.

Durability: an add or delete returns only after its COMMIT has returned, so it is on disk by
PostgreSQL's ``synchronous_commit`` setting (on by default). A connection lost before COMMIT
was sent rolls the transaction back; the operation is retried once on a fresh connection. A
connection lost *during* COMMIT leaves the outcome unknown: the caller gets StoreError, and if
the write did commit, every sidecar (this one too) still applies it from the change log.

Passwords: :attr:`PostgresStore.path` is the URL with its password replaced by ``***``, and
every message this module produces is scrubbed of the password (:func:`mask_url`, :func:`redact`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import numpy as np

from kalos.errors import DimensionMismatch, InvalidArgument, NotAKalosStore, StoreError, UnknownKey
from kalos.store.follow import ChangeFollower
from kalos.store.sqlite import FORMAT_NAME, SCHEMA_VERSION, ItemRow, Store, _update_columns
from kalos.validation import (
    DEFAULT_NAMESPACE,
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
    check_vectors,
    expiry_column,
    keys_for_lookup,
)

try:  # the optional 'postgres' extra; only this module needs it
    import psycopg
except ImportError:  # pragma: no cover - exercised where psycopg is missing
    psycopg = None  # type: ignore[assignment]

__all__ = [
    "PostgresStore",
    "RowSnapshot",
    "Change",
    "ChangeBatch",
    "CHANNEL",
    "is_postgres_url",
    "mask_url",
    "redact",
    "connect",
    "fetch_changes",
]

log = logging.getLogger("kalos.store.postgres")

CHANNEL = "kalos_changes"  # NOTIFY channel; the payload (the seq) is informational only
# One key for every Kalos writer of a database: serialises writers so that seq order is
# commit order (see the module docstring), and schema creation.
_WRITER_LOCK = 0x4B4C4F53_0000_0001
_CONNECT_TIMEOUT_S = 10
_IDS_PER_QUERY = 10000  # ids per = ANY(array) parameter in get
_KEY_INDEX = ("CREATE UNIQUE INDEX IF NOT EXISTS kalos_items_by_key ON kalos_items (namespace_id, key)"
              " WHERE key IS NOT NULL")
_EXPIRY_INDEX = ("CREATE INDEX IF NOT EXISTS kalos_items_by_expiry ON kalos_items (expires_at)"
                 " WHERE expires_at IS NOT NULL")
_OP_CHECK = "CHECK (op IN ('add', 'delete', 'upsert', 'update'))"


def is_postgres_url(spec: Any) -> bool:
    """True when ``spec`` names a PostgreSQL store (a postgresql:// or postgres:// URL)."""
    return isinstance(spec, str) and spec.split("://", 1)[0].lower() in ("postgresql", "postgres") and "://" in spec


def _password(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.password:
        return unquote(parts.password)
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "password" and value:
            return value
    return None


def mask_url(url: str) -> str:
    """``url`` with its password (in the userinfo or a ``password=`` parameter) shown as ``***``."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            if ":" in userinfo:
                userinfo = userinfo.split(":", 1)[0] + ":***"
            netloc = f"{userinfo}@{host}"
        query = parts.query
        if query:
            pairs = [(k, "***" if k == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)]
            query = urlencode(pairs, safe="*/:%")
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "postgresql://(unparsable URL)"


def redact(message: str, url: str) -> str:
    """``message`` without the password of ``url`` (also URL-quoted) anywhere in it."""
    secret = _password(url)
    if secret:
        for form in {secret, quote(secret, safe="")}:
            message = message.replace(form, "***")
    return message


def _require_psycopg() -> None:
    if psycopg is None:
        raise StoreError(
            "a postgresql:// store needs the PostgreSQL driver: pip install 'kalos-recall[postgres]' (psycopg 3)"
        )


def connect(url: str, *, autocommit: bool = True, follower: bool = False) -> "psycopg.Connection":
    """A psycopg connection to ``url``; StoreError (password masked) if it cannot be made.

    ``follower`` connections also get TCP keepalives, so a server that vanished without
    closing the socket (a host that lost power) is noticed within seconds.
    """
    _require_psycopg()
    given = psycopg.conninfo.conninfo_to_dict(url)
    extra: dict[str, Any] = {"application_name": given.get("application_name", "kalos")}
    if "connect_timeout" not in given:
        extra["connect_timeout"] = _CONNECT_TIMEOUT_S
    if follower:
        extra.update(keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3)
    try:
        return psycopg.connect(url, autocommit=autocommit, **extra)
    except psycopg.Error as e:
        raise StoreError(f"cannot connect to {mask_url(url)}: {redact(str(e).strip(), url)}") from None


# -- reading rows in bulk: binary COPY parsed by numpy ----------------------------------------
#
# PostgreSQL's binary COPY sends each row as int16 field count, then per field an int32 length
# and the value (big-endian). Every column the loader reads is fixed-size and NOT NULL, so each
# row has the same length and a whole batch of rows is one numpy structured array: no per-row
# Python work, and the vector bytes (stored little-endian) are the engine's float32 as they are.

_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"


def _row_dtype(dim: int) -> np.dtype:
    return np.dtype([
        ("nfields", ">i2"), ("len_id", ">i4"), ("id", ">i8"), ("len_ns", ">i4"), ("ns", ">i4"),
        ("len_t", ">i4"), ("t", ">f8"), ("len_v", ">i4"), ("v", "<f4", (dim,)),
    ])


def _decode_rows(buf: bytes | bytearray | memoryview, dim: int, what: str) -> tuple[np.ndarray, ...]:
    rec = np.frombuffer(buf, dtype=_row_dtype(dim))
    ok = (rec["nfields"] == 4) & (rec["len_id"] == 8) & (rec["len_ns"] == 4) & (rec["len_t"] == 8) \
        & (rec["len_v"] == 4 * dim)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise StoreError(f"store {what} is damaged: a row (near item {int(rec['id'][bad])}) has no {dim}-float vector")
    return (
        rec["id"].astype(np.int64),
        # Always a copy (np.array, not ascontiguousarray, which returns a one-row field view as
        # it is): the caller keeps it, and the buffer under ``rec`` is reused for the next rows.
        np.array(rec["v"], dtype=np.float32, order="C", copy=True),
        rec["ns"].astype(np.int32),
        rec["t"].astype(np.float64),
    )


def _copy_batches(cur: Any, query: str, params: Sequence[Any] | None, dim: int, batch: int,
                  what: str) -> Iterator[tuple[np.ndarray, ...]]:
    """Rows of ``query`` (id, namespace_id, created_at, vector) ``batch`` at a time."""
    size = _row_dtype(dim).itemsize
    want = batch * size
    buf = bytearray()
    header_done = False
    with cur.copy(f"COPY ({query}) TO STDOUT (FORMAT binary)", params) as copy:
        for block in copy:  # one block per CopyData message (about one row)
            buf += block
            if not header_done:
                if len(buf) < 19:
                    continue
                if bytes(buf[:11]) != _COPY_SIGNATURE:
                    raise StoreError(f"store {what}: unexpected COPY stream from the server")
                ext = int.from_bytes(buf[15:19], "big")
                if len(buf) < 19 + ext:
                    continue
                del buf[: 19 + ext]
                header_done = True
            if len(buf) >= want:
                yield _decode_rows(memoryview(buf)[:want], dim, what)
                del buf[:want]
    # What is left: whole rows, then the trailer (int16 -1).
    if len(buf) < 2 or bytes(buf[-2:]) != b"\xff\xff" or (len(buf) - 2) % size:
        raise StoreError(f"store {what}: truncated COPY stream from the server")
    for start in range(0, len(buf) - 2, want):
        yield _decode_rows(memoryview(buf)[start : min(start + want, len(buf) - 2)], dim, what)


@dataclasses.dataclass(frozen=True)
class Change:
    """One change-log entry. For an add, the arrays hold the items still present at the read."""

    seq: int
    op: str  # "add" | "delete" | "upsert" (replace the rows of these ids, add the new ones) | "update" (as upsert)
    ids: np.ndarray  # int64: the ids the entry names (delete) or the present subset (add, upsert)
    vectors: np.ndarray | None = None  # float32 [n, dim] (add)
    namespace_ids: np.ndarray | None = None  # int32 [n] (add)
    created_at: np.ndarray | None = None  # float64 [n] (add)
    metadata: list | None = None  # [dict | None] * n (add): what where filters read


@dataclasses.dataclass(frozen=True)
class ChangeBatch:
    changes: list[Change]
    namespaces: dict[str, int]  # every namespace, read in the same snapshot
    mark: int  # the highest seq in ``changes`` (or the caller's mark when empty)


#: The change-log ops whose ids' rows a follower reads (and adds, or swaps in).
_READS_ROWS = ("add", "upsert", "update")


def fetch_changes(conn: "psycopg.Connection", dim: int, after: int, limit: int = 1000) -> ChangeBatch:
    """Up to ``limit`` changes with ``seq > after``, read in ONE repeatable-read snapshot together
    with the items they add and the namespace table. ``conn`` must not be in autocommit mode.

    An added item that is absent in the snapshot was deleted later; that delete is in the log
    after this entry, so leaving the item out loses nothing.
    """
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    with conn.transaction():
        with conn.cursor() as cur:
            cur.execute("SELECT seq, op, ids FROM kalos_changes WHERE seq > %s ORDER BY seq LIMIT %s", (after, limit))
            entries = cur.fetchall()
            if not entries:
                return ChangeBatch([], {}, after)
            added = [i for seq, op, ids in entries if op in _READS_ROWS for i in ids]
            present: dict[int, int] = {}
            arrays: tuple[np.ndarray, ...] = (np.empty(0, np.int64),) * 4
            if added:
                parts = list(_copy_batches(
                    cur, "SELECT id, namespace_id, created_at, vector FROM kalos_items WHERE id = ANY(%s)",
                    (added,), dim, max(1, len(added)), "change log",
                ))
                if parts:
                    arrays = tuple(np.concatenate(col) for col in zip(*parts))
                    present = {int(i): row for row, i in enumerate(arrays[0].tolist())}
                cur.execute("SELECT id, metadata FROM kalos_items WHERE id = ANY(%s) AND metadata IS NOT NULL",
                            (added,))
                meta_of = {int(i): json.loads(m) for i, m in cur.fetchall()}
            else:
                meta_of = {}
            cur.execute("SELECT name, id FROM kalos_namespaces")
            namespaces = dict(cur.fetchall())
    changes: list[Change] = []
    for seq, op, ids in entries:
        if op == "delete":
            changes.append(Change(int(seq), "delete", np.asarray(ids, dtype=np.int64)))
            continue
        if op not in _READS_ROWS:
            raise StoreError(f"change log entry {seq} has op {op!r}, which this Kalos does not know (upgrade it)")
        # An upserted id absent here was deleted later: that delete follows in the log.
        rows = np.asarray([present[i] for i in ids if i in present], dtype=np.int64)
        ids_arr, vecs, ns, times = arrays
        changes.append(Change(int(seq), op, ids_arr[rows], vecs[rows], ns[rows], times[rows],
                              [meta_of.get(i) for i in ids_arr[rows].tolist()]))
    return ChangeBatch(changes, namespaces, int(entries[-1][0]))


class RowSnapshot:
    """Every item plus the change-log mark, from ONE repeatable-read snapshot (see
    :meth:`PostgresStore.snapshot_rows`). Iterate once; the transaction ends with the iteration."""

    def __init__(self, conn: "psycopg.Connection", mark: int, batches: Iterator[tuple[np.ndarray, ...]]) -> None:
        self.mark = mark
        self._conn = conn
        self._batches = batches

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        try:
            yield from self._batches
        finally:
            self._conn.close()  # read-only: nothing to commit


class ChangeLog:
    """A database's change log as a :class:`kalos.store.follow.ChangeFollower` reads it: connections
    (the follower's, which never retry a lost server in place), :func:`fetch_changes`, the
    NOTIFY channel, and messages with the password masked."""

    channel = CHANNEL

    def __init__(self, url: str, dim: int) -> None:
        self._url = url
        self.dim = dim
        self.where = mask_url(url)

    def connect(self, *, autocommit: bool = True) -> "psycopg.Connection":
        return connect(self._url, autocommit=autocommit, follower=True)

    def fetch(self, conn: "psycopg.Connection", after: int, limit: int) -> ChangeBatch:
        return fetch_changes(conn, self.dim, after, limit=limit)

    def redact(self, message: str) -> str:
        return redact(message, self._url)


# -- the store -----------------------------------------------------------------------------------


class PostgresStore:
    """A Kalos store in a PostgreSQL database. Open with :meth:`PostgresStore.open`.

    Thread-safe (one lock serialises the connection), like :class:`kalos.store.sqlite.Store`. Unlike
    it, many writers (sidecars on other hosts) may have the same store open: there is no
    single-writer lock, and :attr:`shared` tells the sidecar to follow the change log.
    """

    shared = True  # other sidecars write here too: load with snapshot_rows, then follow
    path: str = ""  # the URL with the password masked: what every message and stats show
    dim: int = 0
    readonly: bool = True
    has_vector: bool = False  # the pgvector column exists (server-side fallback search)
    _keyed: bool = True  # key/updated_at exist (False only on a readonly open of an unmigrated store)
    _expiring: bool = True  # expires_at exists (False only on a readonly open of an unmigrated store)
    _conn: Any = None
    #: As :attr:`kalos.store.sqlite.Store.revision`: None, since other hosts change the rows.
    revision: int | None = None

    @staticmethod
    def changed_since(revision: int) -> frozenset[int] | None:
        """As :meth:`kalos.store.sqlite.Store.changed_since`: None, since other hosts change the rows."""
        return None

    def __init__(self) -> None:
        # Private: PostgresStore.open() builds instances.
        self._lock = threading.Lock()
        self._url = ""

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else ("readonly" if self.readonly else "writer")
        return f"PostgresStore({self.path!r}, dim={self.dim}, {state})"

    def __enter__(self) -> "PostgresStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, what: str, e: BaseException) -> StoreError:
        return StoreError(f"store {self.path}: {what} failed: {redact(str(e).strip(), self._url)}")

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, url: str, *, dim: int | None = None, readonly: bool = False) -> "PostgresStore":
        """Opens the Kalos store in the database at ``url``, creating its tables (with dimension
        ``dim``) on first use. Errors as :meth:`kalos.store.sqlite.Store.open`: NotAKalosStore,
        StoreError for a newer schema, DimensionMismatch when ``dim`` differs from the store's.
        ``readonly`` opens never create anything and refuse every write.
        """
        if not is_postgres_url(url):
            raise InvalidArgument(f"not a PostgreSQL URL (postgresql://...): {mask_url(str(url))}")
        if dim is not None:
            dim = check_dim(dim)
        store = cls()
        store._url = url
        store.path = mask_url(url)
        store.readonly = readonly
        try:
            store._conn = connect(url)
            if readonly:
                store._conn.execute("SET default_transaction_read_only = on")
            store._open_schema(dim)
        except BaseException:
            store.close()
            raise
        return store

    def _open_schema(self, dim: int | None) -> None:
        conn = self._conn
        try:
            exists = conn.execute("SELECT to_regclass('kalos_meta') IS NOT NULL").fetchone()[0]
            if not exists:
                if self.readonly:
                    raise InvalidArgument(f"{self.path} holds no Kalos store (a readonly open cannot create it)")
                if dim is None:
                    raise InvalidArgument(f"{self.path} holds no Kalos store yet; pass dim to create it")
                self._create_schema(dim)
            meta = dict(conn.execute("SELECT key, value FROM kalos_meta").fetchall())
            tables = {r[0] for r in conn.execute(
                "SELECT c.relname FROM pg_class c WHERE c.relname LIKE 'kalos%%' AND pg_table_is_visible(c.oid)"
            )}
            self.has_vector = bool(conn.execute(
                "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass('kalos_items')"
                " AND attname = 'embedding' AND NOT attisdropped"
            ).fetchone()[0])
            self._keyed = self._has_key_columns()
        except psycopg.Error as e:
            raise self._error("open", e) from None
        if meta.get("format") != FORMAT_NAME:
            raise NotAKalosStore(f"{self.path}: table kalos_meta is not a Kalos store's (format {meta.get('format')!r})")
        try:
            version = int(meta.get("schema_version", ""))
            meta_dim = int(meta.get("dim", ""))
        except ValueError:
            raise StoreError(f"store {self.path} is damaged: meta schema_version/dim unreadable: {meta}") from None
        if version > SCHEMA_VERSION:
            raise StoreError(f"store {self.path} has schema version {version}; this Kalos reads up to "
                             f"{SCHEMA_VERSION} (upgrade Kalos to open it)")
        missing = {"kalos_namespaces", "kalos_items", "kalos_changes", "kalos_item_ids"} - tables
        if missing:
            raise StoreError(f"store {self.path} is damaged: missing {sorted(missing)}")
        if meta_dim < 1:
            raise StoreError(f"store {self.path} is damaged: dim {meta_dim} in its meta table")
        if dim is not None and dim != meta_dim:
            raise DimensionMismatch(f"store {self.path} has dimension {meta_dim}, but dim={dim} was asked for")
        self.dim = meta_dim
        try:
            behind = not self._keyed or self._lacks_issue22()
        except psycopg.Error as e:
            raise self._error("open", e) from None
        if behind and not self.readonly:  # a store made before keys (or expiries), checked above: migrate it
            try:
                self._migrate_keys()
            except psycopg.Error as e:
                raise self._error("open (adding the key columns)", e) from None
            self._keyed = True
        self._expiring = self._has_column("expires_at")

    def _has_key_columns(self) -> bool:
        return self._conn.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass('kalos_items')"
            " AND attname IN ('key', 'updated_at') AND NOT attisdropped"
        ).fetchone()[0] == 2

    def _has_column(self, name: str) -> bool:
        return bool(self._conn.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass('kalos_items')"
            " AND attname = %s AND NOT attisdropped", (name,)).fetchone()[0])

    def _lacks_issue22(self) -> bool:
        """True for a store without the expires_at column or the 'update' op (made before them)."""
        check = self._conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = to_regclass('kalos_changes')"
            " AND conname = 'kalos_changes_op_check'").fetchone()
        return not self._has_column("expires_at") or check is None or "'update'" not in check[0]

    def _migrate_keys(self) -> None:
        """Gives a store made before keys (issue 22) its key and expiry columns, indexes and the
        'upsert' and 'update' ops, in one transaction under the writer lock (two sidecars
        migrating at once: the second finds it done)."""
        conn = self._conn
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITER_LOCK,))
            if self._has_key_columns() and not self._lacks_issue22():
                return
            conn.execute("ALTER TABLE kalos_items ADD COLUMN IF NOT EXISTS key text,"
                         " ADD COLUMN IF NOT EXISTS updated_at double precision,"
                         " ADD COLUMN IF NOT EXISTS expires_at double precision")
            conn.execute(_KEY_INDEX)
            conn.execute(_EXPIRY_INDEX)
            conn.execute("ALTER TABLE kalos_changes DROP CONSTRAINT IF EXISTS kalos_changes_op_check,"
                         f" ADD CONSTRAINT kalos_changes_op_check {_OP_CHECK}")
        log.info("store %s: added the key columns of issue 22 (key, updated_at)", self.path)

    def _create_schema(self, dim: int) -> None:
        conn = self._conn
        with conn.transaction():
            # Two sidecars creating the store at once: the second waits here, then finds it.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITER_LOCK,))
            if conn.execute("SELECT to_regclass('kalos_meta') IS NOT NULL").fetchone()[0]:
                return
            has_vector = False
            try:
                with conn.transaction():  # a savepoint: its failure leaves the rest intact
                    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
                has_vector = True
            except psycopg.Error as e:
                log.info("pgvector is not available on %s (%s): the server-side fallback search is off",
                         self.path, redact(str(e).strip(), self._url))
            conn.execute("CREATE TABLE kalos_meta (key text PRIMARY KEY, value text NOT NULL)")
            conn.execute(
                "INSERT INTO kalos_meta (key, value) VALUES ('format', %s), ('schema_version', %s), ('dim', %s),"
                " ('created_at', %s)", (FORMAT_NAME, str(SCHEMA_VERSION), str(dim), repr(time.time())),
            )
            conn.execute("CREATE TABLE kalos_namespaces (id integer PRIMARY KEY, name text NOT NULL UNIQUE)")
            conn.execute("INSERT INTO kalos_namespaces (id, name) VALUES (1, %s)", (DEFAULT_NAMESPACE,))
            conn.execute("CREATE SEQUENCE kalos_item_ids")
            conn.execute(
                "CREATE TABLE kalos_items ("
                " id bigint PRIMARY KEY,"
                " namespace_id integer NOT NULL REFERENCES kalos_namespaces (id),"
                " created_at double precision NOT NULL,"
                " text text,"
                " metadata text,"
                " key text,"
                " updated_at double precision,"
                " expires_at double precision,"
                f" vector bytea NOT NULL CHECK (length(vector) = {4 * dim})"
                + (f", embedding vector({dim})" if has_vector else "") + ")"
            )
            conn.execute("CREATE INDEX kalos_items_by_namespace ON kalos_items (namespace_id)")
            conn.execute(_KEY_INDEX)
            conn.execute(_EXPIRY_INDEX)
            conn.execute(
                "CREATE TABLE kalos_changes ("
                " seq bigint PRIMARY KEY,"
                f" op text NOT NULL CONSTRAINT kalos_changes_op_check {_OP_CHECK},"
                " ids bigint[] NOT NULL,"
                " at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connection. Idempotent."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _connection(self, *, write: bool = False) -> Any:
        # Called with self._lock held. A connection found broken (the server restarted) is
        # replaced here, so one outage costs at most the operation that discovered it.
        if self._conn is None:
            raise StoreError(f"store {self.path} is closed")
        if write and self.readonly:
            raise StoreError(f"store {self.path} is open readonly")
        if self._conn.broken or self._conn.closed:
            log.warning("store %s: connection lost; reconnecting", self.path)
            self._conn = connect(self._url)
            if self.readonly:
                self._conn.execute("SET default_transaction_read_only = on")
        return self._conn

    def _run(self, what: str, body: Callable[[Any], Any], *, write: bool = False) -> Any:
        """``body(conn)`` in one transaction (a write takes the writer lock first), committed
        when it returns. A connection that breaks before COMMIT is sent (so the transaction
        is certainly rolled back) is replaced and the whole transaction retried once."""
        with self._lock:
            for attempt in (0, 1):
                conn = self._connection(write=write)
                committing = False
                try:
                    with conn.transaction():
                        if write:
                            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITER_LOCK,))
                        result = body(conn)
                        committing = True
                    return result
                except psycopg.OperationalError as e:
                    if attempt == 0 and not committing and conn.broken:
                        continue
                    if committing:
                        raise StoreError(f"store {self.path}: {what}: the connection failed during COMMIT, "
                                         f"so the outcome is unknown ({redact(str(e).strip(), self._url)}); "
                                         "if it committed, every sidecar applies it from the change log") from None
                    raise self._error(what, e) from None
                except psycopg.Error as e:
                    raise self._error(what, e) from None
        raise AssertionError("unreachable")

    # -- writes ------------------------------------------------------------------------------

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
        """As :meth:`kalos.store.sqlite.Store.add`: ``(ids int64[n], namespace_id, created_at float64[n])``,
        returned after COMMIT. Bad input raises before anything is sent to the server.
        ``request_id`` is remembered with the add (for a day), for :meth:`find_request`."""
        request_id = check_request_id(request_id)
        vecs, ns, text_col, meta_col, times = check_add(vectors, self.dim, namespace, texts, metadata, created_at)
        n = len(vecs)
        for col in (text_col, meta_col):  # PostgreSQL text cannot hold NUL; SQLite can
            for i, t in enumerate(col):
                if t is not None and "\x00" in t:
                    raise InvalidArgument(f"texts[{i}] / metadata[{i}] contains a NUL character, "
                                          "which PostgreSQL text cannot store")
        blobs = [vecs[i].tobytes() for i in range(n)]
        embeddings = [_vector_literal(v) for v in vecs] if self.has_vector else None
        expiry_col = expiry_column(expires_at, n)
        if expires_at is not None and not self._expiring:
            raise StoreError(f"store {self.path} has no expires_at column (open it writable once to migrate it)")

        def body(conn: Any) -> tuple[np.ndarray, int]:
            ns_id = _namespace_id(conn, ns)
            ids = [r[0] for r in conn.execute(
                "SELECT nextval('kalos_item_ids') FROM generate_series(1, %s)", (n,)).fetchall()]
            columns = ("id, namespace_id, created_at, text, metadata, vector" + (", expires_at" if expires_at is not None else "")
                       + (", embedding" if embeddings else ""))
            with conn.cursor() as cur, cur.copy(f"COPY kalos_items ({columns}) FROM STDIN") as copy:
                for i in range(n):
                    row = (ids[i], ns_id, float(times[i]), text_col[i], meta_col[i], blobs[i])
                    if expires_at is not None:
                        row += (expiry_col[i],)
                    copy.write_row(row + (embeddings[i],) if embeddings else row)
            _log_change(conn, "add", ids)
            if request_id is not None:
                _ensure_requests(conn)
                conn.execute("INSERT INTO kalos_requests (request_id, ids) VALUES (%s, %s)", (request_id, ids))
                conn.execute("DELETE FROM kalos_requests WHERE at < now() - interval '1 day'")
            return np.asarray(ids, dtype=np.int64), ns_id

        ids, ns_id = self._run("add", body, write=True)
        return ids, ns_id, times

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
        """As :meth:`kalos.store.sqlite.Store.upsert`: one transaction, one 'upsert' change-log entry
        naming every id of the call (the followers swap those rows)."""
        request_id = check_request_id(request_id)
        vecs, ns, text_col, meta_col, times = check_add(vectors, self.dim, namespace, texts, metadata, created_at)
        n = len(vecs)
        key_col = check_keys(keys, n)
        for col in (text_col, meta_col, key_col):  # PostgreSQL text cannot hold NUL; SQLite can
            for i, t in enumerate(col):
                if t is not None and "\x00" in t:
                    raise InvalidArgument(f"texts[{i}] / metadata[{i}] / keys[{i}] contains a NUL character, "
                                          "which PostgreSQL text cannot store")
        if not self._keyed:
            raise StoreError(f"store {self.path} has no key columns (open it writable once to migrate it)")
        blobs = [vecs[i].tobytes() for i in range(n)]
        embeddings = [_vector_literal(v) for v in vecs] if self.has_vector else None
        expiry_col = expiry_column(expires_at, n)
        if not self._expiring:
            raise StoreError(f"store {self.path} has no expires_at column (open it writable once to migrate it)")
        now = time.time()

        def body(conn: Any) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
            ns_id = _namespace_id(conn, ns)
            existing, expired = {}, set()
            for key, item_id, created, expiry in conn.execute(
                    "SELECT key, id, created_at, expires_at FROM kalos_items WHERE namespace_id = %s AND key = ANY(%s)",
                    (ns_id, key_col)).fetchall():
                existing[key] = (item_id, created)
                if expiry is not None and expiry <= now:
                    expired.add(key)
            replaced = np.fromiter((k in existing for k in key_col), dtype=bool, count=n)
            fresh = [r[0] for r in conn.execute(
                "SELECT nextval('kalos_item_ids') FROM generate_series(1, %s)", (int(n - replaced.sum()),)).fetchall()]
            ids = np.empty(n, dtype=np.int64)
            out_times = times.copy()
            inserts, updates = [], []
            for i, key in enumerate(key_col):
                if replaced[i]:
                    ids[i], out_times[i] = existing[key]
                    if key in expired:  # gone already: a new memory, under the id its key had
                        out_times[i] = times[i]
                    row = (text_col[i], meta_col[i], blobs[i], None if key in expired else now, expiry_col[i],
                           float(out_times[i]))
                    updates.append(row + ((embeddings[i],) if embeddings else ()) + (int(ids[i]),))
                else:
                    ids[i] = fresh.pop(0)
                    row = (int(ids[i]), ns_id, float(times[i]), text_col[i], meta_col[i], key, blobs[i], expiry_col[i])
                    inserts.append(row + ((embeddings[i],) if embeddings else ()))
            if updates:
                with conn.cursor() as cur:
                    cur.executemany(
                        "UPDATE kalos_items SET text = %s, metadata = %s, vector = %s, updated_at = %s, expires_at = %s,"
                        " created_at = %s" + (", embedding = %s" if embeddings else "") + " WHERE id = %s", updates)
            if inserts:
                columns = ("id, namespace_id, created_at, text, metadata, key, vector, expires_at"
                           + (", embedding" if embeddings else ""))
                with conn.cursor() as cur, cur.copy(f"COPY kalos_items ({columns}) FROM STDIN") as copy:
                    for row in inserts:
                        copy.write_row(row)
            _log_change(conn, "upsert", ids.tolist())
            if request_id is not None:
                _ensure_requests(conn)
                conn.execute("INSERT INTO kalos_requests (request_id, ids) VALUES (%s, %s)", (request_id, ids.tolist()))
                conn.execute("DELETE FROM kalos_requests WHERE at < now() - interval '1 day'")
            return ids, ns_id, out_times, replaced

        return self._run("upsert", body, write=True)

    def update(self, change: Update) -> tuple[int, int, float]:
        """As :meth:`kalos.store.sqlite.Store.update`: one transaction and one 'update' change-log entry
        naming the id (a follower swaps the row in, as for an upsert)."""
        if change.key is not None and not self._keyed:
            raise StoreError(f"store {self.path} has no key columns (open it writable once to migrate it)")
        for label, value in (("text", change.text), ("key", change.key)):
            if isinstance(value, str) and "\x00" in value:
                raise InvalidArgument(f"update: {label} contains a NUL character, which PostgreSQL text cannot store")
        if change.metadata is not UNSET and "\x00" in json.dumps(change.metadata):
            raise InvalidArgument("update: metadata contains a NUL character, which PostgreSQL text cannot store")
        def body(conn: Any) -> tuple[int, int, float]:
            now = time.time()  # (in the transaction, which may wait and be retried)
            live, live_params = self._live_clause("i"), self._live_params(now)
            if change.key is not None:
                row = conn.execute(
                    "SELECT i.id, i.namespace_id, i.created_at, i.metadata FROM kalos_items AS i JOIN kalos_namespaces"
                    " AS n ON n.id = i.namespace_id WHERE n.name = %s AND i.key = %s" + live + " FOR UPDATE OF i",
                    (change.namespace, change.key, *live_params)).fetchone()
            else:
                row = conn.execute(
                    "SELECT i.id, i.namespace_id, i.created_at, i.metadata FROM kalos_items AS i WHERE i.id = %s"
                    + live + " FOR UPDATE", (change.id, *live_params)).fetchone()
            if row is None:
                raise UnknownKey(f"update: no memory has {change.describe()}")
            item_id, ns_id, created, stored_meta = row
            columns = _update_columns(change, stored_meta, now)
            sets, params = [f"{c} = %s" for c, _ in columns], [v for _, v in columns]
            if change.vector is not None and self.has_vector:
                sets.append("embedding = %s::vector")
                params.append(_vector_literal(np.ascontiguousarray(change.vector, dtype="<f4")))
            conn.execute(f"UPDATE kalos_items SET {', '.join(sets)} WHERE id = %s", (*params, item_id))
            _log_change(conn, "update", [int(item_id)])
            return int(item_id), int(ns_id), float(created)

        return self._run("update", body, write=True)

    def delete_expired(self, now: float | None = None) -> np.ndarray:
        """As :meth:`kalos.store.sqlite.Store.delete_expired`: one transaction and one 'delete' change-log
        entry (every sidecar on the store sweeps; a row is deleted, and logged, once)."""
        now = time.time() if now is None else float(now)
        if not self._expiring:
            return np.empty(0, dtype=np.int64)
        due = self._run("delete_expired", lambda conn: conn.execute(
            "SELECT 1 FROM kalos_items WHERE expires_at <= %s LIMIT 1", (now,)).fetchone())
        if due is None:
            return np.empty(0, dtype=np.int64)

        def body(conn: Any) -> np.ndarray:
            ids = [r[0] for r in conn.execute(
                "DELETE FROM kalos_items WHERE expires_at <= %s RETURNING id", (now,)).fetchall()]
            if ids:
                _log_change(conn, "delete", sorted(ids))
            return np.sort(np.asarray(ids, dtype=np.int64))

        return self._run("delete_expired", body, write=True)

    def expiries(self, ids: Sequence[int] | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`kalos.store.sqlite.Store.expiries`."""
        if not self._expiring:
            return np.empty(0, np.int64), np.empty(0)
        if ids is None:
            rows = self._run("expiries", lambda conn: conn.execute(
                "SELECT id, expires_at FROM kalos_items WHERE expires_at IS NOT NULL").fetchall())
        else:
            wanted = np.unique(check_ids(ids, "expiries")).tolist()
            rows = self._run("expiries", lambda conn: conn.execute(
                "SELECT id, expires_at FROM kalos_items WHERE id = ANY(%s) AND expires_at IS NOT NULL",
                (wanted,)).fetchall()) if wanted else []
        return (np.fromiter((r[0] for r in rows), np.int64, len(rows)),
                np.fromiter((r[1] for r in rows), np.float64, len(rows)))

    def list_items(self, *, namespace: str | None = None, where: Any = None, limit: int = 100,
                   after: int = 0) -> tuple[list[Item], int | None]:
        """As :meth:`kalos.store.sqlite.Store.list_items` (one transaction per page)."""
        ns, limit, after = check_list_args(namespace, limit, after)
        now = time.time()

        def body(conn: Any) -> list[Item]:
            out: list[Item] = []
            cursor = after
            ns_clause, ns_params = ("", ()) if ns is None else (
                " AND i.namespace_id = (SELECT id FROM kalos_namespaces WHERE name = %s)", (ns,))
            chunk = limit + 1 if where is None else max(limit + 1, 1024)
            while len(out) <= limit:
                rows = conn.execute(
                    f"SELECT {self._item_columns()} FROM kalos_items AS i JOIN kalos_namespaces AS n"
                    f" ON n.id = i.namespace_id WHERE i.id > %s{ns_clause}{self._live_clause('i')} ORDER BY i.id LIMIT %s",
                    (cursor, *ns_params, *self._live_params(now), chunk)).fetchall()
                for row in rows:
                    item = Store._item(row)
                    if where is None or where.matches(item.metadata):
                        out.append(item)
                        if len(out) > limit:
                            break
                if len(rows) < chunk:
                    break
                cursor = rows[-1][0]
            return out

        out = self._run("list", body)
        if len(out) > limit:
            return out[:limit], out[limit - 1].id
        return out, None

    def count_items(self, *, namespace: str | None = None, where: Any = None) -> int:
        """As :meth:`kalos.store.sqlite.Store.count_items`."""
        ns = None if namespace is None else check_namespace(namespace)
        now = time.time()

        def body(conn: Any) -> int:
            if where is not None:
                return len(self._matching(conn, ns, where, now))
            return int(conn.execute(
                "SELECT count(*) FROM kalos_items AS i WHERE true" + _namespace_clause(ns) + self._live_clause("i"),
                (*(() if ns is None else (ns,)), *self._live_params(now))).fetchone()[0])

        return self._run("count", body)

    def delete_where(self, *, namespace: str | None, where: Any = None,
                     expired_out: list[int] | None = None) -> np.ndarray:
        """As :meth:`kalos.store.sqlite.Store.delete_where`: one transaction, one 'delete' change-log
        entry (the followers drop the rows)."""
        ns = None if namespace is None else check_namespace(namespace)

        def body(conn: Any) -> np.ndarray:
            if where is None:
                ids = [r[0] for r in conn.execute(
                    "SELECT i.id FROM kalos_items AS i WHERE true" + _namespace_clause(ns) + " FOR UPDATE",
                    () if ns is None else (ns,)).fetchall()]
            else:
                ids = self._matching(conn, ns, where, None)
            if not ids:
                return np.empty(0, dtype=np.int64)
            rows = conn.execute(f"DELETE FROM kalos_items WHERE id = ANY(%s) RETURNING id, {self._expiry_column()}",
                                (ids,)).fetchall()
            return self._deleted(conn, rows, expired_out)

        return self._run("delete_where", body, write=True)

    def _matching(self, conn: Any, ns: str | None, where: Any, now: float | None) -> list[int]:
        live = "" if now is None else self._live_clause("i")
        params = (*(() if ns is None else (ns,)), *(() if now is None else self._live_params(now)))
        return [item_id for item_id, meta in conn.execute(
            "SELECT i.id, i.metadata FROM kalos_items AS i WHERE true" + _namespace_clause(ns) + live, params)
            if where.matches(None if meta is None else json.loads(meta))]

    def _live_clause(self, alias: str | None) -> str:
        """`` AND <not expired>`` for a query over kalos_items (empty on a store without expiries)."""
        if not self._expiring:
            return ""
        column = f"{alias}.expires_at" if alias else "expires_at"
        return f" AND ({column} IS NULL OR {column} > %s)"

    def _live_params(self, now: float) -> tuple[float, ...]:
        return (now,) if self._expiring else ()

    def renew(self, keys: Sequence[str], namespace: str, ttl: float) -> tuple[np.ndarray, int | None]:
        """As :meth:`kalos.store.sqlite.Store.renew` (logged as an update: followers read the rows'
        expiries again)."""
        wanted = list(dict.fromkeys(keys_for_lookup(keys)))
        ns = check_namespace(namespace)

        def body(conn: Any) -> tuple[np.ndarray, int | None]:
            row = conn.execute("SELECT id FROM kalos_namespaces WHERE name = %s", (ns,)).fetchone()
            if row is None or not self._keyed or not self._expiring or not wanted:
                return np.empty(0, dtype=np.int64), None if row is None else int(row[0])
            now = time.time()
            ids = [r[0] for r in conn.execute(
                "UPDATE kalos_items SET expires_at = %s WHERE namespace_id = %s AND key = ANY(%s)"
                " AND expires_at > %s RETURNING id", (now + ttl, row[0], wanted, now)).fetchall()]
            if ids:
                _log_change(conn, "update", sorted(int(i) for i in ids))
            return np.sort(np.asarray(ids, dtype=np.int64)), int(row[0])

        return self._run("renew", body, write=True)

    def delete_keys(self, keys: Sequence[str], namespace: str, *, expired_out: list[int] | None = None) -> np.ndarray:
        """As :meth:`kalos.store.sqlite.Store.delete_keys` (logged as a delete: followers drop the rows)."""
        wanted = list(dict.fromkeys(keys_for_lookup(keys)))
        ns = check_namespace(namespace)
        if not wanted or not self._keyed:
            with self._lock:
                self._connection(write=True)
            return np.empty(0, dtype=np.int64)

        def body(conn: Any) -> np.ndarray:
            rows = conn.execute(
                "DELETE FROM kalos_items AS i USING kalos_namespaces AS n WHERE n.id = i.namespace_id"
                f" AND n.name = %s AND i.key = ANY(%s) RETURNING i.id, {self._expiry_column('i.')}",
                (ns, wanted)).fetchall()
            return self._deleted(conn, rows, expired_out)

        return self._run("delete_keys", body, write=True)

    def find_request(self, request_id: str) -> np.ndarray | None:
        """The ids of the add made with ``request_id`` (within the last day), or None."""
        request_id = check_request_id(request_id)

        def body(conn: Any) -> np.ndarray | None:
            if not conn.execute("SELECT to_regclass('kalos_requests') IS NOT NULL").fetchone()[0]:
                return None
            row = conn.execute("SELECT ids FROM kalos_requests WHERE request_id = %s", (request_id,)).fetchone()
            return None if row is None else np.asarray(row[0], dtype=np.int64)

        return self._run("find_request", body, write=True)

    def undo_add(self, ids: Sequence[int] | np.ndarray, request_id: str | None = None) -> None:
        """As :meth:`kalos.store.sqlite.Store.undo_add` (followers see the rows deleted)."""
        wanted = np.unique(check_ids(ids, "undo_add")).tolist()
        request_id = check_request_id(request_id)

        def body(conn: Any) -> None:
            found = [r[0] for r in conn.execute(
                "DELETE FROM kalos_items WHERE id = ANY(%s) RETURNING id", (wanted,)).fetchall()]
            if found:
                _log_change(conn, "delete", sorted(found))
            if request_id is not None and conn.execute("SELECT to_regclass('kalos_requests') IS NOT NULL").fetchone()[0]:
                conn.execute("DELETE FROM kalos_requests WHERE request_id = %s", (request_id,))

        self._run("undo_add", body, write=True)

    def delete(self, ids: Sequence[int] | np.ndarray, *, expired_out: list[int] | None = None) -> np.ndarray:
        """Deletes items in one transaction; returns the ids actually deleted (int64, ascending);
        ``expired_out`` as :meth:`kalos.store.sqlite.Store.delete`."""
        wanted = np.unique(check_ids(ids, "delete"))
        if len(wanted) == 0:
            with self._lock:
                self._connection(write=True)  # a closed or read-only store still says so
            return np.empty(0, dtype=np.int64)

        def body(conn: Any) -> np.ndarray:
            rows = conn.execute(
                f"DELETE FROM kalos_items WHERE id = ANY(%s) RETURNING id, {self._expiry_column()}",
                (wanted.tolist(),)).fetchall()
            return self._deleted(conn, rows, expired_out)

        return self._run("delete", body, write=True)

    def _expiry_column(self, alias: str = "") -> str:
        """The expiry column (of table ``alias``) for a select list; NULL where there is none."""
        return f"{alias}expires_at" if self._expiring else "NULL"

    @staticmethod
    def _deleted(conn: Any, rows: list[tuple[int, Any]], expired_out: list[int] | None) -> np.ndarray:
        """The ids of ``rows`` (id, expires_at) a delete returned, logged for the followers; those
        already expired go to ``expired_out`` when given."""
        found = [r[0] for r in rows]
        if found:
            _log_change(conn, "delete", sorted(found))
        if expired_out is not None:
            now = time.time()
            expired_out += [r[0] for r in rows if r[1] is not None and r[1] <= now]
        return np.sort(np.asarray(found, dtype=np.int64))

    # -- reads -------------------------------------------------------------------------------

    def get(self, ids: Sequence[int] | np.ndarray) -> list[Item | None]:
        """The items of ``ids``, aligned with them: None where an id is absent."""
        return [None if row is None else Store._item(row) for row in self.get_rows(ids)]

    def get_rows(self, ids: Sequence[int] | np.ndarray) -> list[ItemRow | None]:
        """As :meth:`kalos.store.sqlite.Store.get_rows`."""
        wanted = check_ids(ids, "get")
        unique = np.unique(wanted).tolist()
        now = time.time()  # an expired item is absent from that moment, before the sweep deletes it

        def body(conn: Any) -> dict[int, ItemRow]:
            found: dict[int, ItemRow] = {}
            for start in range(0, len(unique), _IDS_PER_QUERY):
                for row in conn.execute(
                    f"SELECT {self._item_columns()} FROM kalos_items AS i"
                    f" JOIN kalos_namespaces AS n ON n.id = i.namespace_id WHERE i.id = ANY(%s){self._live_clause('i')}",
                    (unique[start : start + _IDS_PER_QUERY], *self._live_params(now)),
                ):
                    found[row[0]] = ItemRow._make(row)
            return found

        found = self._run("get", body) if unique else {}
        return [found.get(i) for i in wanted.tolist()]

    def vectors(self, ids: Sequence[int] | np.ndarray) -> dict[int, np.ndarray]:
        """The stored (normalised float32) vectors of those ``ids`` that exist: id -> ``[dim]``."""
        unique = np.unique(check_ids(ids, "vectors")).tolist()

        def body(conn: Any) -> dict[int, np.ndarray]:
            found: dict[int, np.ndarray] = {}
            for start in range(0, len(unique), _IDS_PER_QUERY):
                for item_id, blob in conn.execute(
                    "SELECT id, vector FROM kalos_items WHERE id = ANY(%s)", (unique[start : start + _IDS_PER_QUERY],),
                ):
                    found[item_id] = np.frombuffer(bytes(blob), dtype="<f4").astype(np.float32)
            return found

        return self._run("vectors", body) if unique else {}

    def _item_columns(self) -> str:
        keyed = "i.key, i.updated_at" if self._keyed else "NULL, NULL"
        return f"i.id, n.name, i.text, i.metadata, i.created_at, {keyed}, {self._expiry_column('i.')}"

    def ids_of_keys(self, keys: Sequence[str], namespace: str) -> list[int | None]:
        """As :meth:`kalos.store.sqlite.Store.ids_of_keys`."""
        wanted = keys_for_lookup(keys)
        ns = check_namespace(namespace)
        if not wanted or not self._keyed:
            with self._lock:
                self._connection()
            return [None] * len(wanted)

        now = time.time()

        def body(conn: Any) -> dict[str, int]:
            return dict(conn.execute(
                "SELECT i.key, i.id FROM kalos_items AS i JOIN kalos_namespaces AS n ON n.id = i.namespace_id"
                f" WHERE n.name = %s AND i.key = ANY(%s){self._live_clause('i')}",
                (ns, list(dict.fromkeys(wanted)), *self._live_params(now))).fetchall())

        found = self._run("ids_of_keys", body)
        return [found.get(k) for k in wanted]

    def get_keys(self, keys: Sequence[str], namespace: str) -> list[Item | None]:
        """As :meth:`kalos.store.sqlite.Store.get_keys`."""
        ids = self.ids_of_keys(keys, namespace)
        present = [i for i in ids if i is not None]
        by_id = {item.id: item for item in self.get(present) if item is not None} if present else {}
        return [None if i is None else by_id.get(i) for i in ids]

    def namespaces(self) -> dict[str, int]:
        """Every namespace ever used (and "default"): name -> namespace id."""
        return self._run("namespaces", lambda conn: dict(
            conn.execute("SELECT name, id FROM kalos_namespaces ORDER BY id").fetchall()))

    def namespace_counts(self) -> dict[str, int]:
        """Live items per namespace, for every namespace (0 for an emptied one); expired items,
        even those the sweep has not deleted yet, are not counted."""
        live, params = self._live_clause("i"), self._live_params(time.time())
        return self._run("namespace_counts", lambda conn: {name: int(c) for name, c in conn.execute(
            "SELECT n.name, count(i.id) FROM kalos_namespaces AS n LEFT JOIN kalos_items AS i"
            " ON i.namespace_id = n.id" + live + " GROUP BY n.id, n.name ORDER BY n.id", params).fetchall()})

    def count(self) -> int:
        """Live items in the store."""
        return int(self._run("count", lambda conn: conn.execute("SELECT count(*) FROM kalos_items").fetchone()[0]))

    def change_mark(self) -> int:
        """The highest change-log seq committed so far (0 for none)."""
        return int(self._run("change_mark", lambda conn: conn.execute(
            "SELECT coalesce(max(seq), 0) FROM kalos_changes").fetchone()[0]))

    def snapshot_rows(self, batch: int = 65536) -> RowSnapshot:
        """Every item, ``batch`` at a time (in storage order, not id order), AND the change-log
        mark, both from one repeatable-read snapshot on a connection of its own.

        Loading the rows and then following the log from ``.mark`` therefore neither misses a
        change committed during the load nor applies one twice. The rows stream through a
        binary COPY: one batch of rows is in memory at a time besides what the caller keeps.
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidArgument(f"batch must be an integer >= 1, got {batch!r}")
        with self._lock:
            self._connection()
        conn = connect(self._url, autocommit=False)
        try:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.read_only = True
            cur = conn.cursor()
            # The first statement fixes the snapshot; the COPY below reads the same one.
            mark = int(cur.execute("SELECT coalesce(max(seq), 0) FROM kalos_changes").fetchone()[0])
        except psycopg.Error as e:
            conn.close()
            raise self._error("load", e) from None
        except BaseException:
            conn.close()
            raise

        def batches() -> Iterator[tuple[np.ndarray, ...]]:
            try:
                yield from _copy_batches(cur, "SELECT id, namespace_id, created_at, vector FROM kalos_items",
                                         None, self.dim, batch, self.path)
            except psycopg.Error as e:
                raise self._error("load", e) from None

        return RowSnapshot(conn, mark, batches())

    def iter_rows(self, batch: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Every item ``batch`` at a time as ``(ids, vectors, namespace_ids, created_at)``, from one
        consistent snapshot (in storage order, not id order)."""
        return iter(self.snapshot_rows(batch))

    def iter_metadata(self, batch: int = 65536) -> Iterator[tuple[np.ndarray, list[dict]]]:
        """The metadata of every item that has some, in id order, ``batch`` at a time:
        ``(ids int64[b], [dict] * b)``, for the sidecar's ``where`` index. Read after the rows'
        snapshot, so a change made in between may show here already; the follower replays
        it from the log anyway (its rows carry their metadata), which ends in the same state."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidArgument(f"batch must be an integer >= 1, got {batch!r}")

        def pages() -> Iterator[tuple[np.ndarray, list[dict]]]:
            after = 0
            while True:
                rows = self._run("iter_metadata", lambda conn: conn.execute(
                    "SELECT id, metadata FROM kalos_items WHERE id > %s AND metadata IS NOT NULL ORDER BY id LIMIT %s",
                    (after, batch),
                ).fetchall())
                if not rows:
                    return
                yield np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)), [json.loads(r[1]) for r in rows]
                after = int(rows[-1][0])

        return pages()

    def follower(self, mark: int, *, apply: Callable[[ChangeBatch], None],
                 lock: Any = None, poll_interval_s: float = 2.0) -> Any:
        """A :class:`kalos.store.follow.ChangeFollower` of this store's change log from ``mark`` (not started)."""
        return ChangeFollower(ChangeLog(self._url, self.dim), mark, apply=apply, lock=lock,
                              poll_interval_s=poll_interval_s)

    def search(self, query: np.ndarray, k: int, namespace: str | None = None) -> list[tuple[int, float]]:
        """Server-side exact cosine top-k with pgvector, for when no sidecar runs: ``[(id, score)]``
        best first. StoreError if the store was created without pgvector."""
        if not self.has_vector:
            raise StoreError(
                f"store {self.path}: the server-side search needs the pgvector extension, which was not "
                "installable when this store was created (install postgresql-NN-pgvector, or use a sidecar)"
            )
        q = check_vectors(np.asarray(query, dtype=np.float32).reshape(1, -1), self.dim)[0]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidArgument(f"k must be an integer >= 1, got {k!r}")
        literal = _vector_literal(q)
        where, params = "", [literal]
        if namespace is not None:
            where = " WHERE namespace_id = (SELECT id FROM kalos_namespaces WHERE name = %s)"
            params.append(check_namespace(namespace))
        sql = ("SELECT id, 1 - (embedding <=> %s::vector) AS score FROM kalos_items" + where +
               " ORDER BY embedding <=> %s::vector, id LIMIT %s")
        rows = self._run("search", lambda conn: conn.execute(sql, (*params, literal, k)).fetchall())
        return [(int(i), float(s)) for i, s in rows]

    def integrity_check(self) -> str:
        """"ok", or what is wrong (one finding per line): vectors of the wrong length, items in
        no namespace, a change log behind the item ids."""
        def body(conn: Any) -> str:
            problems = []
            bad = conn.execute("SELECT count(*) FROM kalos_items WHERE length(vector) <> %s",
                               (4 * self.dim,)).fetchone()[0]
            if bad:
                problems.append(f"{bad} items have no {self.dim}-float vector")
            orphans = conn.execute("SELECT count(*) FROM kalos_items i WHERE NOT EXISTS"
                                   " (SELECT 1 FROM kalos_namespaces n WHERE n.id = i.namespace_id)").fetchone()[0]
            if orphans:
                problems.append(f"{orphans} items belong to no namespace")
            return "\n".join(problems) or "ok"

        return self._run("integrity_check", body)

    def size_bytes(self) -> int:
        """Bytes the store's tables and indexes take in the database."""
        return int(self._run("size_bytes", lambda conn: conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(to_regclass(t))), 0) FROM unnest(%s::text[]) AS t",
            (["kalos_meta", "kalos_namespaces", "kalos_items", "kalos_changes"],)).fetchone()[0]))

    def server_info(self) -> dict[str, Any]:
        """Server version, pgvector availability and the change-log mark (for doctor)."""
        def body(conn: Any) -> dict[str, Any]:
            version = conn.execute("SHOW server_version").fetchone()[0]
            vector = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
            mark, changes = conn.execute("SELECT coalesce(max(seq), 0), count(*) FROM kalos_changes").fetchone()
            return {"server_version": version, "pgvector": vector[0] if vector else None,
                    "change_mark": int(mark), "changes": int(changes), "fallback_search": self.has_vector}

        return self._run("server_info", body)


def _vector_literal(v: np.ndarray) -> str:
    # repr() of the float64 that equals each float32 exactly: parsed back to the same float32.
    return "[" + ",".join(map(repr, v.astype(np.float64).tolist())) + "]"


def _namespace_id(conn: Any, name: str) -> int:
    # Inside the add's transaction, under the writer lock: a new namespace exists only if its
    # items do, and max(id) + 1 cannot race with another Kalos writer.
    row = conn.execute("SELECT id FROM kalos_namespaces WHERE name = %s", (name,)).fetchone()
    if row is not None:
        return int(row[0])
    ns_id = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM kalos_namespaces").fetchone()[0]
    if ns_id > (1 << 31) - 1:
        raise StoreError("namespace ids are exhausted")
    conn.execute("INSERT INTO kalos_namespaces (id, name) VALUES (%s, %s)", (ns_id, name))
    return int(ns_id)


def _namespace_clause(ns: str | None) -> str:
    return "" if ns is None else " AND i.namespace_id = (SELECT id FROM kalos_namespaces WHERE name = %s)"


def _ensure_requests(conn: Any) -> None:
    """The table of recent add request ids (created by the first add that carries one; stores
    made before it existed get it then)."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS kalos_requests (request_id text PRIMARY KEY, ids bigint[] NOT NULL,"
        " at timestamptz NOT NULL DEFAULT now())"
    )


def _log_change(conn: Any, op: str, ids: list[int]) -> None:
    # Under the writer lock taken at the start of this transaction: max(seq) + 1 is assigned
    # after every earlier writer's commit is visible, so seq order is commit order (module
    # docstring). The NOTIFY is delivered at COMMIT, and not at all on rollback.
    seq = conn.execute(
        "INSERT INTO kalos_changes (seq, op, ids) SELECT coalesce(max(seq), 0) + 1, %s, %s FROM kalos_changes"
        " RETURNING seq", (op, ids)).fetchone()[0]
    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(seq)))
