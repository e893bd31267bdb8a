"""The Kalos sidecar: one process that owns the store, the engine and the shared segment.

Length: this module still does several jobs (lifecycle, the control operations, the recall loop
and its filter cache, expiry, the embedder's glue); splitting them into modules of the server
package is the restructuring's remaining step, not a design choice.

Threads:
  * the sweep (the thread that calls :meth:`Sidecar.serve_forever`): finds every pending
    recall in the slots, answers them as one engine pass per filter (single recalls are read
    from the slots' columns at once, so 64 waiting agents cost one pass, not 64), publishes
    the answers;
  * the acceptor, and one thread per control connection: hello (slot assignment), add,
    delete, get, stats. A connection's slot is freed when the connection closes, which
    the kernel does for a client that dies;
  * the heartbeat: stamps the segment header every ``heartbeat_interval_s``;
  * the checkpointer (SQLite stores): copies the WAL into the db file once writes pause;
  * the expirer: tombstones rows whose ``ttl`` ran out when no recall pass did it first, and
    deletes expired rows from the store (see ``_expire_due``).

Control connections are bounded: at most ``slots + spare_connections`` at once; one stuck
mid-frame, or one without a slot that stays silent, is dropped (``control_stall_s``,
``control_idle_s``); one that holds a slot may idle between requests for ever.

``_state_lock`` serialises the engine (and the GPU's polling) between the sweep and the
writers; ``_write_lock`` serialises writers so that the store and the engine see adds and
deletes in the same order (a delete can never overtake the add it deletes). The slot table
has its own lock in the channel, held for microseconds (never across a search), so a client
connects while a crowd is hot.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import stat
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from kalos.config import GPU_POLLING, RuntimeDir, open_runtime_dir, settings
from kalos.engine import Engine, Filter, make_engine
from kalos.errors import (
    DimensionMismatch,
    InvalidArgument,
    InvalidQuery,
    KalosError,
    ProtocolMismatch,
    ServerError,
    SidecarAlreadyRunning,
    UnknownFilter,
)
from kalos.ipc.channel import Endpoint, Segment, SidecarChannel
from kalos.ipc.control import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    array_blob,
    blob_array,
    error_reply,
    ok_reply,
    recv_fd,
    recv_frame,
    send_fd,
    send_frame,
)
from kalos.ipc.protocol import Layout, Op, RequestFlag, SlotView
from kalos.server.cohort import Cohort
from kalos.server.expiry import ExpirySchedule
from kalos.server.metrics import Metrics
from kalos.store.spec import StoreSpec, open_store
from kalos.store.sqlite import Store
from kalos.validation import (
    UNSET,
    bad_vector_rows,
    check_keys,
    check_namespace,
    check_request_id,
    check_ttl,
    check_update,
    check_vectors,
    normalise_rows,
    row_scales,
)
from kalos.where import Where, compile_where

__all__ = ["SidecarConfig", "Sidecar"]

log = logging.getLogger("kalos.server.sidecar")
_PEERCRED = struct.Struct("3i")
_SOCKET_CHECK_S = 1.0  # how often the heartbeat checks that the control socket's name is still ours
# Plain ints: IntFlag arithmetic costs microseconds, and these are tested on every request.
_ALL_NAMESPACES = int(RequestFlag.ALL_NAMESPACES)
_HAS_SINCE = int(RequestFlag.HAS_SINCE)
_HAS_UNTIL = int(RequestFlag.HAS_UNTIL)
_HAS_WHERE = int(RequestFlag.HAS_WHERE)
_KNOWN_FLAGS = _ALL_NAMESPACES | _HAS_SINCE | _HAS_UNTIL | _HAS_WHERE
# The flags a single recall may carry and still take the columns' path (_answer_singles).
_SINGLE_FLAGS = _ALL_NAMESPACES | _HAS_WHERE
# Registered where clauses a sidecar keeps (op "where"); the oldest registration goes first.
_MAX_WHERE_HANDLES = 4096
_RECALL = int(Op.RECALL)
_PING = int(Op.PING)
# How often a control connection's thread wakes from a silent socket to check its deadlines.
_CONTROL_POLL_S = 1.0


#: How long the clients of a GPU sidecar busy-poll for an answer before sleeping (advised in
#: the hello reply; a client's own spin_us or KALOS_CLIENT_SPIN_US wins).
GPU_CLIENT_SPIN_US = 1000.0

#: The expirer's longest sleep (it also wakes for each next expiry), and how often at most it
#: deletes expired rows from the store (recall, get and list skip them from their expiry on).
_EXPIRY_POLL_S = 0.5
_EXPIRY_STORE_S = 1.0
#: How long before a row's expiry the GPU's polling kernel is stopped (and not started again until
#: it has passed): the kernel knows nothing of expiries, the sweep tombstones each row in the first
#: pass at or after its ``expires_at``. The lead covers the sweep's own delay between two looks.
_EXPIRY_LEAD_S = 0.05

_NO_FILTER = Filter()
# The filter of a namespace that never held a memory (issue 22): answered with no hits, without
# a search. Compared by identity, and never cached in _filters, so that the namespace's first
# add (or a follower's) is seen by the next recall.
_NOTHING = Filter(namespace=-1)
_NO_ROWS = np.empty((0, 0), np.float32)
_NO_SCALES = np.empty(0, np.float64)


@dataclasses.dataclass(frozen=True)
class SidecarConfig:
    store: StoreSpec  # a SQLite file path, or a postgresql:// URL (kalos.store.spec)
    name: str = "default"
    dim: int | None = None
    device: str = "auto"
    precision: str = "exact"
    slots: int = dataclasses.field(default_factory=lambda: settings().slots)
    max_k: int = dataclasses.field(default_factory=lambda: settings().max_k)
    max_batch: int = dataclasses.field(default_factory=lambda: settings().max_batch)
    spin_us: float = dataclasses.field(default_factory=lambda: settings().sidecar_spin_us)
    gather_us: float = dataclasses.field(default_factory=lambda: settings().sidecar_gather_us)
    heartbeat_interval_s: float = dataclasses.field(default_factory=lambda: settings().heartbeat_interval_s)
    seed_compat: bool = False
    seed_compat_shm: str = "/kalos_recall_shm"
    # A GPU engine reads queries from the slots and writes answers into them in place (the
    # segment page-locked with cudaHostRegister); False: through host copies (benchmarks).
    zero_copy: bool = True
    # With zero copy, a GPU kernel polls the slots and answers single recalls by itself
    # (kalos.engine.gpu.slot_server): "graph" (a CUDA graph that waits for a request, then scans
    # with the whole GPU), "resident" (one kernel resident on every SM), or "off" (the sweep
    # answers everything). BENCHMARKS.md has both measured beside the sweep.
    gpu_polling: str = "off"
    # The text embedder clients without their own use (kalos.server.sidecar_embed): loaded at the
    # first text ("lazy"), in the background at start ("start"), or never ("off"); on
    # "auto" (ONNX on a CPU sidecar, sentence-transformers on a GPU one), "onnx" or "torch".
    embed: str = "lazy"
    embed_runtime: str = "auto"

    def __post_init__(self) -> None:
        for field, low, high in (("slots", 1, 4096), ("max_k", 1, 65536), ("max_batch", 1, 65536)):
            value = getattr(self, field)
            if not isinstance(value, int) or not low <= value <= high:
                raise InvalidArgument(f"{field} must be an integer in [{low}, {high}], got {value!r}")
        if self.spin_us < 0:
            raise InvalidArgument(f"spin_us must be >= 0, got {self.spin_us}")
        if not 0 <= self.gather_us <= 10_000:
            raise InvalidArgument(f"gather_us must be in [0, 10000] microseconds, got {self.gather_us}")
        if self.gpu_polling not in GPU_POLLING:
            raise InvalidArgument(f"gpu_polling must be one of {', '.join(GPU_POLLING)}, got {self.gpu_polling!r}")
        if not 0 < self.heartbeat_interval_s <= 1:
            raise InvalidArgument(f"heartbeat interval must be in (0, 1] s, got {self.heartbeat_interval_s}")
        from kalos.server.sidecar_embed import EMBED_MODES, EMBED_RUNTIMES

        if self.embed not in EMBED_MODES:
            raise InvalidArgument(f"embed must be one of {', '.join(EMBED_MODES)}, got {self.embed!r}")
        if self.embed_runtime not in EMBED_RUNTIMES:
            raise InvalidArgument(f"embed_runtime must be one of {', '.join(EMBED_RUNTIMES)}, got {self.embed_runtime!r}")


class _UserNameLock:
    """One sidecar per name and user, whatever its runtime directory (issue 19, item 6).

    A listening socket bound in the abstract namespace, ``@kalos-<uid>-<name>``: the kernel
    releases it when the process dies (no stale file), and a second sidecar learns who holds
    it from SO_PEERCRED (uid and pid) by connecting to it. It is never accepted from. Any
    user can bind any abstract name, so a squatter is named in the refusal, with the remedy.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        address = endpoint.user_lock_address
        shown = "@" + address[1:]
        try:
            self._sock.bind(address)
            self._sock.listen(1)
        except OSError as exc:
            self.release()
            if exc.errno != errno.EADDRINUSE:
                raise
            pid, uid = _holder(address)
            if uid == os.getuid():
                raise SidecarAlreadyRunning(
                    f"a sidecar named {endpoint.name!r} is already running (pid {pid}) for this user, "
                    f"maybe with another runtime directory; stop it, or use another --name"
                ) from None
            if uid is None:
                raise SidecarAlreadyRunning(
                    f"the name lock {shown} of sidecar {endpoint.name!r} is held by a process that does "
                    f"not answer (not a Kalos sidecar: another user may be squatting it); find it with "
                    f"`ss -xlp | grep {shown[1:]}`, or use another --name"
                ) from None
            raise SidecarAlreadyRunning(
                f"the name lock {shown} of sidecar {endpoint.name!r} is held by uid {uid} (pid {pid}), "
                f"not by this user (uid {os.getuid()}): another user is squatting the name; use another "
                f"--name, or ask an administrator to stop pid {pid}"
            ) from None

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _holder(address: str) -> tuple[int | None, int | None]:
    """(pid, uid) of the process listening at an abstract address, or (None, None)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(address)
        pid, uid, _gid = _PEERCRED.unpack(probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        return pid, uid
    except OSError:
        return None, None  # bound but not listening, or a full backlog
    finally:
        probe.close()


_LOCK_RECORD = 21  # "pid" left-aligned in 20 characters and a newline: rewritten in place


class _NameLock:
    """An exclusive flock on ``<runtime>/<name>.lock``: one sidecar per name and directory.

    The file is opened relative to the checked runtime directory's descriptor, never through
    a symlink, and only a lock file of ours is written to: a file we did not create is never
    truncated (a symlinked lock file once let another user have the victim's own files
    truncated: issue 19, item 1). The file is never unlinked (unlinking a lock file races with
    the next locker); the pid written into it only serves the error message of a second sidecar.
    """

    def __init__(self, directory: RuntimeDir, name: str) -> None:
        lock_name = f"{name}.lock"
        shown = directory.path / lock_name
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(lock_name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=directory.fd)
            created = True
        except FileExistsError:
            try:
                self._fd = os.open(lock_name, flags, dir_fd=directory.fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise InvalidArgument(f"{shown} is a symlink; Kalos follows none there: remove it") from None
                raise
            created = False
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
                raise InvalidArgument(
                    f"{shown} is not a lock file of this user's (uid {st.st_uid}, {st.st_nlink} links, "
                    f"mode {st.st_mode:o}); remove it"
                )
            if not created:
                old = os.pread(self._fd, 64, 0)
                if len(old) > _LOCK_RECORD or old.strip(b" \n") and not old.strip(b" \n").isdigit():
                    raise InvalidArgument(f"{shown} is not a Kalos lock file (it holds {old[:32]!r}); remove it")
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise SidecarAlreadyRunning(f"a sidecar named {name!r} is already running (pid {holder})") from None
        except BaseException:
            self.release()
            raise
        # Rewritten in place, fixed width: no truncation, and nothing of a longer record is left.
        os.pwrite(self._fd, f"{os.getpid():<{_LOCK_RECORD - 1}}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Sidecar:
    """Serves one store to the clients of one host. Construct, then :meth:`serve_forever`."""

    def __init__(self, config: SidecarConfig, *, engine_factory: Callable[[str, int, int], Engine] | None = None) -> None:
        self.config = config
        self.endpoint = Endpoint(config.name)
        self.epoch = secrets.randbits(63) | 1
        self.metrics = Metrics()
        self._stopping = threading.Event()
        self._state_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()
        self._refused_connections = 0
        self._listener: socket.socket | None = None
        self._segment: Segment | None = None
        self._seed: Any = None
        self.store: Store | None = None  # or a PostgresStore
        self._follower: Any = None  # follows a shared (PostgreSQL) store's change log
        self.zero_copy = False
        self._slot_server: Any = None  # kalos.engine.gpu.slot_server.SlotGraphServer, when the GPU polls
        self.quarantined: list[int] = []  # ids of stored items with damaged vectors (not served)
        self._wrote = threading.Event()  # set by every write: the checkpointer waits for a pause
        self._expiry = ExpirySchedule()  # TTL (issue 22), under _state_lock
        self._expiry_wake = threading.Event()  # an earlier expiry was noted: the expirer re-plans
        # Rows may have expired in the store while these differ (they do at start): _expire_due
        # counts each round that tombstoned rows, the expirer the rounds it swept from the store.
        self._expiry_rounds = 1
        self._swept_rounds = 0
        self._user_lock: _UserNameLock | None = None
        self._name_lock: _NameLock | None = None
        # Resolved and checked once; the lock file and the socket are made relative to it.
        self._rundir = open_runtime_dir()
        try:
            self._user_lock = _UserNameLock(self.endpoint)
            self._name_lock = _NameLock(self._rundir, config.name)
            self.store = open_store(config.store, dim=config.dim)
            started = time.perf_counter()
            factory = engine_factory or (
                lambda device, dim, capacity: make_engine(device, dim, capacity=capacity, precision=config.precision)
            )
            self.engine = factory(config.device, self.store.dim, max(1024, self.store.count()))
            engine_max_k = self.engine.max_k
            if engine_max_k is not None and config.max_k > engine_max_k:
                raise InvalidArgument(
                    f"max_k {config.max_k} exceeds what the {self.engine.name} engine serves ({engine_max_k}); "
                    f"start with --max-k {engine_max_k} or less"
                )
            # A shared store (PostgreSQL) is written by other sidecars too: load the rows and the
            # change-log mark from one snapshot, then follow the log from that mark.
            shared = getattr(self.store, "shared", False)
            rows = self.store.snapshot_rows() if shared else self.store.iter_rows()
            for ids, vectors, namespace_ids, created_at in rows:
                bad = bad_vector_rows(vectors)
                if len(bad):
                    # Not finite unit rows: damage (a flipped exponent bit scored 4e36 and won
                    # half of all recalls; a NaN won every one: issue 19). Kept in the store for
                    # get() and for repair, never loaded into the engine; stats and doctor list them.
                    self.quarantined.extend(ids[bad].tolist())
                    keep = np.ones(len(ids), dtype=bool)
                    keep[bad] = False
                    ids, vectors, namespace_ids, created_at = ids[keep], vectors[keep], namespace_ids[keep], created_at[keep]
                self.engine.add(ids, vectors, namespace_ids, created_at)
            # The metadata where filters read, indexed beside the rows (kalos.where.MetaColumns).
            for meta_ids, metas in self.store.iter_metadata():
                self.engine.set_metadata(meta_ids, metas)
            if self.quarantined:
                log.warning(
                    "quarantined %d stored item(s) whose vectors are not finite unit vectors (damaged), e.g. ids %s; "
                    "they are not served: delete them, or re-add them from their source (kalos doctor lists them)",
                    len(self.quarantined), self.quarantined[:10],
                )
            self._note_expiries(*self.store.expiries())
            self._expire_due()  # rows that expired while no sidecar ran are never served
            if shared:
                self._follower = self.store.follower(rows.mark, apply=self._apply_followed, lock=self._write_lock)
            self.load_seconds = time.perf_counter() - started
            # A GPU answers in about 100-200 us: a client that slept after the default 100 us
            # of polling paid a wake-up (~40 us on the H200 host, benchmarks/profile_e2e.py).
            # Clients that set their own spin_us keep it.
            self.client_spin_us = (
                GPU_CLIENT_SPIN_US if str(self.engine.device).startswith("cuda") else settings().client_spin_us
            )
            self._namespaces = {name.encode(): ns for name, ns in self.store.namespaces().items()}
            # (flags, namespace, since, until, where handle) of a request -> its engine filter.
            self._filters: dict[tuple[int, bytes, float | None, float | None, int], Filter] = {}
            # Where clauses registered over the control socket (op "where"): handle -> clause and
            # canonical JSON -> handle, oldest first (the table is bounded: _MAX_WHERE_HANDLES).
            # Handles are never reused and start at random, so a stale handle (evicted, or from
            # before a restart) is refused as unknown, never read as another clause.
            self._wheres: dict[int, Where] = {}
            self._where_handles: collections.OrderedDict[str, int] = collections.OrderedDict()
            self._next_where_handle = secrets.randbits(48) | 1
            self._where_lock = threading.Lock()
            from kalos.server.sidecar_embed import EmbedService

            self.embedding = EmbedService(config.embed, config.embed_runtime, str(self.engine.device))
            self.layout = Layout(config.slots, self.store.dim, config.max_k, config.max_batch)
            self._segment = Segment.create(self.endpoint.segment_name, self.layout.size)
            self.layout.write_header(self._segment.buf, epoch=self.epoch, pid=os.getpid())
            self.channel = SidecarChannel(self._segment, self.layout, epoch=self.epoch)
            self.channel.stamp_heartbeat()
            self.cohort = Cohort(self.layout.n_slots, config.gather_us / 1e6)
            self.zero_copy = self._attach_segment()
            if self.zero_copy and str(self.engine.device).startswith("cuda"):
                try:
                    self._warm_crowd_passes()
                except Exception as exc:  # noqa: BLE001 - an optimisation: the passes compile on first use
                    log.warning("warming the GPU's crowd passes failed (%s); each compiles on first use", exc)
            self._slot_server = self._make_slot_server()
            self.channel.stamp_heartbeat()  # compiling the slot server's kernel may take seconds
            self._listener = self._listen(self._rundir, self.endpoint.socket_name)
            self._socket_id = self._socket_identity()
            if config.seed_compat:
                from kalos.server.seed_compat import SeedCompatServer

                self._seed = SeedCompatServer(
                    search=self._search_all, dim=self.store.dim, spin_us=config.spin_us, log=log,
                    shm_name=config.seed_compat_shm,
                )
        except BaseException:
            self.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------

    @staticmethod
    def _listen(directory: RuntimeDir, name: str) -> socket.socket:
        try:
            st = os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise InvalidArgument(f"{directory.path / name} exists and is not a socket; remove it")
            # Left behind by a sidecar that was killed; the name locks are ours.
            os.unlink(name, dir_fd=directory.fd)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            listener.bind(directory.entry(name))  # inside the checked directory itself
        finally:
            os.umask(old_umask)
        listener.listen(64)
        return listener

    def _attach_segment(self) -> bool:
        """Lets a GPU engine read the queries in the slots and write the answers into them."""
        if not self.engine.supports_attached_host or not self.config.zero_copy:
            return False
        try:
            self.engine.attach_host(self._segment.buf)
        except Exception as exc:  # noqa: BLE001 - serving through host copies still works
            log.warning("zero-copy off: the GPU engine could not attach the shared segment (%s)", exc)
            return False
        layout = self.layout
        base = np.array([layout.slot_offset(s) for s in range(layout.n_slots)], np.int64)
        # Element offsets (float32 queries and scores, int64 ids) of each slot's row 0.
        self._query_at = (base + layout.queries_offset) // 4
        self._ids_at = (base + layout.ids_offset) // 8
        self._scores_at = (base + layout.scores_offset) // 4
        return True

    def _warm_crowd_passes(self) -> None:
        """Runs one pass of every size a crowd of single recalls can form (1, 2, 4, ... up to the
        slot count), with and without a filter, before the first client connects: the GPU
        engine compiles and captures each kind of pass on first use, which takes seconds that
        would otherwise stall every waiting client (and the heartbeat) in the middle of a crowd."""
        if not len(self.engine):
            return  # nothing to scan yet: the first passes compile on first use
        layout = self.layout
        rng = np.random.default_rng(0)
        queries = rng.standard_normal((layout.n_slots, layout.dim)).astype(np.float32)
        self.channel.columns.query_row0[:] = queries
        k = min(8, layout.max_k)
        sizes, q = [], 1
        while q <= layout.n_slots:
            sizes.append(q)
            q *= 2
        if sizes[-1] < layout.n_slots:
            sizes.append(layout.n_slots)
        for flt in (_NO_FILTER, Filter(since=-1e300)):
            for q in sizes:
                scales = 1.0 / np.linalg.norm(queries[:1].astype(np.float64), axis=1) if q == 1 else None
                self.engine.search_attached(self._query_at[:q], scales, self._ids_at[:q], self._scores_at[:q], k, flt)
            self.channel.stamp_heartbeat()
        self.channel.columns.query_row0[:] = 0

    def _make_slot_server(self) -> Any:
        """The GPU slot server (--gpu-polling) that answers single recalls from the slots (CUDA, Triton,
        zero copy), warmed up; None when off or not possible here."""
        mode = self.config.gpu_polling
        if not (self.zero_copy and mode != "off" and str(self.engine.device).startswith("cuda")):
            return None
        if not self.engine.supports_gpu_polling:
            return None
        try:
            from kalos.engine.gpu.slot_server import SlotGraphServer

            server = SlotGraphServer(self.engine, self.layout, self.channel.answered, idle_s=self.config.spin_us / 1e6)
            server.warm()
        except Exception as exc:  # noqa: BLE001 - the sweep's own path still serves everything
            log.warning("GPU polling off: the slot server could not be set up (%s)", exc)
            return None
        self.channel.adopt_answered(server.answered)
        return server

    def _pause_slot_server(self) -> None:
        """Stops the GPU's polling before the engine or the slots change (``_state_lock``
        held); the sweep starts it again on the next request."""
        server = self._slot_server
        if server is None:
            return
        try:
            server.stop()
        except Exception:  # a kernel fault: keep serving through the sweep alone
            self._slot_server_failed("failed")
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.wake_answered()  # its last answers' clients may be asleep

    def _slot_server_failed(self, what: str) -> None:
        """Turns GPU polling off for good after a fault; the sweep serves every request."""
        log.exception("the GPU slot server %s; recalls go through the sweep from now on", what)
        self._slot_server = None

    def ready_message(self) -> str:
        return (
            f"kalos sidecar {self.config.name!r} ready: {len(self.engine):,} memories (dim {self.store.dim}) "
            f"on {self.engine.device} ({self.engine.name}), loaded in {self.load_seconds:.2f} s; "
            f"store {self.store.path}; socket {self._rundir.path / self.endpoint.socket_name}"
            + (f"; seed-compat segment {self.config.seed_compat_shm}" if self._seed is not None else "")
            + (f"; {len(self.quarantined):,} damaged item(s) quarantined (see the log)" if self.quarantined else "")
        )

    def stop_on_signals(self) -> None:
        """SIGINT and SIGTERM stop the sidecar cleanly (call from the main thread, before serving)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda _sig, _frame: self.stop())

    def serve_forever(self) -> None:
        """Runs the sweep in this thread until :meth:`stop`, then releases everything."""
        self.channel.stamp_heartbeat()
        self._start_thread(self._heartbeat, "kalos-heartbeat")
        self._start_thread(self._accept, "kalos-accept")
        if settings().checkpoint_idle_s > 0 and callable(getattr(self.store, "checkpoint", None)):
            self._start_thread(self._checkpointer, "kalos-checkpoint")
        self._start_thread(self._expirer, "kalos-expire")
        if self.embedding.mode == "start":
            self.embedding.start()
        if self._follower is not None:
            self._follower.start()
        if self._seed is not None:
            self._seed.start()
        try:
            self._sweep()
        finally:
            self.close()

    def stop(self) -> None:
        """Asks the sidecar to shut down (safe from signal handlers and other threads)."""
        self._stopping.set()
        self._wrote.set()  # wakes the checkpointer, which then sees _stopping
        channel = getattr(self, "channel", None)
        if channel is not None and channel.doorbell_fd >= 0:
            channel.ring()

    def close(self) -> None:
        """Releases everything; clients see their connection close and reconnect later."""
        self._stopping.set()
        self._wrote.set()
        if getattr(self, "embedding", None) is not None:
            self.embedding.close()
        if self._follower is not None:
            self._follower.stop()
        if self._seed is not None:
            self._seed.stop()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.endpoint.socket_name, dir_fd=self._rundir.fd)
            except FileNotFoundError:
                pass
        for conn in list(self._connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._threads.clear()
        if getattr(self, "channel", None) is not None:
            with self._state_lock:
                self._pause_slot_server()  # it reads the segment: stop it before unpinning
                self._slot_server = None
                self.channel.close()
                if self.zero_copy:
                    self.engine.detach_host()  # unpin before the segment is unmapped
                    self.zero_copy = False
            self.channel = None
        if self._segment is not None:
            self._segment.close()  # nameless: it is gone once the last client unmaps it
            self._segment = None
        if self.store is not None:
            self.store.close()
            self.store = None
        for lock in (self._name_lock, self._user_lock):
            if lock is not None:
                lock.release()
        self._rundir.close()

    def _start_thread(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        # Finished connection threads are dropped here: the list grew by one per connection
        # for the sidecar's lifetime.
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _checkpointer(self) -> None:
        """Checkpoints the store's WAL once writes pause for ``checkpoint_idle_s``.

        Until a checkpoint, acknowledged writes live only in the -wal file; with it deleted or
        damaged after a crash they are gone (the store then refuses to open, see
        kalos.store.sqlite._record_ack). Checkpointing at every pause bounds that to the writes of
        the last burst, at no cost to a burst itself.
        """
        idle_s = settings().checkpoint_idle_s
        while True:
            self._wrote.wait()  # no timeout: an idle sidecar wakes for nothing (stop() sets it)
            if self._stopping.is_set():
                return
            while True:  # wait for a pause: idle_s without a write
                self._wrote.clear()
                if self._stopping.wait(idle_s):
                    return
                if not self._wrote.is_set():
                    break
            try:
                with self._write_lock:
                    if self.store is not None:
                        self.store.checkpoint()
            except Exception as exc:  # noqa: BLE001 - the next pause tries again
                log.warning("checkpointing the store's WAL failed (%s); trying again after the next writes", exc)

    def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_check = time.monotonic() + _SOCKET_CHECK_S
        while not self._stopping.wait(interval):
            self.channel.stamp_heartbeat()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _SOCKET_CHECK_S
                try:
                    self._check_socket()
                except Exception:  # noqa: BLE001 - the heartbeat must go on whatever this meets
                    log.exception("checking the control socket failed")

    def _check_socket(self) -> None:
        """Binds the control socket again when its name was removed (``rm``, or systemd-logind's
        RemoveIPC=yes removing the runtime directory at logout: issue 19, item 11). Connected
        clients never notice (their connections and the segment need no name); new clients
        could not connect at all until the sidecar was restarted."""
        name = self.endpoint.socket_name
        if self._stopping.is_set():
            return  # close() removes it on purpose
        try:
            st = os.stat(name, dir_fd=self._rundir.fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self._socket_id:
                return
        except FileNotFoundError:
            pass
        shown = self._rundir.path / name
        log.error("the control socket %s was removed or replaced (rm, or systemd-logind RemoveIPC=yes at logout): "
                  "new clients could not connect; binding it again", shown)
        try:
            directory = self._rundir
            if os.fstat(directory.fd).st_nlink == 0:  # the directory itself is gone: make it anew
                directory = open_runtime_dir()
            listener = self._listen(directory, name)
        except (OSError, KalosError) as exc:
            log.error("cannot bind the control socket %s again (%s): new clients cannot connect; restart the "
                      "sidecar (with systemd-logind, `loginctl enable-linger` keeps the runtime directory)", shown, exc)
            return
        if self._stopping.is_set():  # close() ran meanwhile: leave nothing behind
            listener.close()
            os.unlink(name, dir_fd=directory.fd)
            return
        if directory is not self._rundir:
            self._rundir.close()
            self._rundir = directory
        self._socket_id = self._socket_identity()
        old, self._listener = self._listener, listener
        if old is not None:
            try:
                old.shutdown(socket.SHUT_RDWR)  # wakes the acceptor, which takes the new listener
            except OSError:
                pass
            old.close()
        log.warning("control socket %s bound again; new clients can connect", self._rundir.path / name)

    def _socket_identity(self) -> tuple[int, int]:
        st = os.stat(self.endpoint.socket_name, dir_fd=self._rundir.fd, follow_symlinks=False)
        return st.st_dev, st.st_ino

    # -- the recall path ---------------------------------------------------------------

    def _sweep(self) -> None:
        channel = self.channel
        streams = self.engine.supports_streams
        if streams:
            self.engine.bind_stream()  # this thread's GPU work all goes to the engine's stream
        try:
            self._sweep_until_stopped(channel)
        finally:
            if streams:
                self.engine.unbind_stream()

    def _sweep_until_stopped(self, channel: SidecarChannel) -> None:
        spin_s = self.config.spin_us / 1e6
        cohort = self.cohort
        clock = time.perf_counter
        last_work = clock()
        while not self._stopping.is_set():
            with self._state_lock:
                server = self._slot_server
                # While the GPU polls, it answers single recalls itself; the sweep takes what it
                # hands over, and wakes the clients of its answers that slept.
                serving = server is not None and self._slot_server_running(server)
                if serving and self._expiry_near():  # (the kernel would serve a row past its expiry)
                    self._pause_slot_server()
                    serving = False
                slots, seqs = channel.pending(server.handed if serving else None)
                if len(slots) and not serving:
                    slots, seqs = cohort.gather(slots, seqs, channel.pending, channel.requested, channel.active)
                if len(slots):
                    self._answer(slots, seqs, channel.pending_generations)
                    cohort.answered(slots)
                if serving:
                    channel.wake_answered()
                elif self._slot_server is not None and len(slots) and not self._expiry_near():
                    self._start_slot_server(self._slot_server)
            if len(slots) or serving:
                last_work = clock()
            elif clock() - last_work < spin_s:
                # Hot: keep sweeping, but hand the GIL to a waiting control thread at once
                # instead of after the interpreter's 5 ms switch interval. sched_yield, not
                # time.sleep(0): a timed sleep may be stretched by the kernel's timer slack.
                os.sched_yield()
            else:
                channel.sleep(timeout_s=0.5)
                last_work = clock() - spin_s  # spin again only once a request has arrived

    def _change_slots(self, change: Callable[[], Any]) -> Any:
        """Runs a change of the slot table. Without GPU polling it takes the channel's lock alone
        (microseconds, never a search). The polling kernel watches the slots in use at its
        launch and writes answers into them by itself: it is stopped first, so a slot never
        changes hands under it (the next request starts it again)."""
        if self._slot_server is None:
            return change()
        with self._state_lock:
            self._pause_slot_server()
            result = change()
            server = self._slot_server
            if server is not None:
                for slot in range(self.layout.n_slots):
                    server.forget(slot)
            return result

    def _slot_server_running(self, server: Any) -> bool:
        try:
            return server.running()
        except Exception:  # a kernel fault, or programs that could not all be resident
            self._slot_server_failed("failed")
            return False

    def _start_slot_server(self, server: Any) -> None:
        """Launches the resident kernel once traffic has arrived (``_state_lock`` held); it
        exits by itself after the sidecar's spin window without a request."""
        channel = self.channel
        try:
            channel.wake_answered()  # answers of its previous run, seen before it exited
            server.set_namespaces(self._namespaces)
            server.start(channel.active)
        except Exception:
            self._slot_server_failed("failed to start")

    def _answer(self, slots: np.ndarray, seqs: np.ndarray, generations: np.ndarray | None = None) -> None:
        """Answers the requests in ``slots`` (all of them, errors included), then publishes.

        Single recalls (one query, all namespaces or one, no time window: what an agent sends)
        are read from the slots' columns in a few NumPy calls and searched as one batch per
        namespace, so a pass costs about the same whether 1 or 64 clients are waiting. Anything
        else (batches, time windows, pings, malformed requests) is read slot by slot.
        """
        self._expire_due()
        started = time.perf_counter()
        if len(slots) == 1:  # one client: scalar reads cost less than the columns' NumPy calls
            n_queries = self._answer_each(slots)
        else:
            columns = self.channel.columns
            ks = columns.k[slots]
            flags = columns.flags[slots]
            single = (columns.op[slots] == _RECALL) & (columns.n_queries[slots] == 1)
            single &= (ks >= 1) & (ks <= self.layout.max_k) & ((flags | _SINGLE_FLAGS) == _SINGLE_FLAGS)
            n_queries = self._answer_singles(slots[single], ks[single], flags[single]) if single.any() else 0
            if not single.all():
                n_queries += self._answer_each(slots[~single])
        self.channel.publish(slots, seqs, generations)
        if n_queries:
            self.metrics.record(n_queries, time.perf_counter() - started)

    def _answer_singles(self, slots: np.ndarray, ks: np.ndarray, flags: np.ndarray, handle: int | None = None) -> int:
        """Single recalls grouped by where clause (``handle``: the one of these slots) and
        namespace, one engine pass per group; returns how many."""
        columns = self.channel.columns
        if handle is None:
            with_where = (flags & _HAS_WHERE) != 0
            if with_where.any():  # one group per where handle, each grouped by namespace below
                answered = 0
                where_at = np.flatnonzero(with_where)
                handles = columns.where_handle[slots[where_at]]
                for h in np.unique(handles).tolist():
                    sub = where_at[handles == h]
                    answered += self._answer_singles(slots[sub], ks[sub], flags[sub], int(h))
                if not with_where.all():
                    plain = ~with_where
                    answered += self._answer_singles(slots[plain], ks[plain], flags[plain])
                return answered
        wflags, wkey = (0, 0) if handle is None else (_HAS_WHERE, handle)
        everywhere = (flags & _ALL_NAMESPACES) != 0
        groups: list[tuple[np.ndarray, np.ndarray, Filter]] = []
        answered = 0
        if everywhere.any():
            if handle is None:
                groups.append((slots[everywhere], ks[everywhere], _NO_FILTER))
            else:
                key = (_ALL_NAMESPACES | _HAS_WHERE, b"", None, None, handle)
                try:
                    groups.append((slots[everywhere], ks[everywhere], self._filters.get(key) or self._filter_for(*key)))
                except KalosError as exc:
                    for index in slots[everywhere].tolist():
                        self._answer_error(self.channel.slots[index], exc)
        named, named_ks = slots[~everywhere], ks[~everywhere]
        if len(named):
            names = columns.namespace[named]  # bytes, trailing NULs dropped
            odd = columns.namespace_len[named] != np.char.str_len(names)
            if odd.any():  # a length word that disagrees with the bytes: read as the slot says
                answered += self._answer_each(named[odd])
                named, named_ks, names = named[~odd], named_ks[~odd], names[~odd]
            if (names == names[0]).all():  # the usual crowd: one namespace, no sort needed
                unique, inverse = names[:1], np.zeros(len(names), dtype=np.intp)
            else:
                unique, inverse = np.unique(names, return_inverse=True)
            for group, name in enumerate(unique.tolist()):
                members = inverse == group
                flt = self._filters.get((wflags, name, None, None, wkey))
                if flt is None:
                    try:
                        flt = self._filter_for(wflags, name, None, None, wkey)
                    except KalosError as exc:
                        for index in named[members].tolist():
                            self._answer_error(self.channel.slots[index], exc)
                        continue
                if flt is _NOTHING:
                    answered += self._answer_nothing(named[members], named_ks[members])
                    continue
                groups.append((named[members], named_ks[members], flt))
        for members, member_ks, flt in groups:
            try:
                members, member_ks = self._search_singles(members, member_ks, flt)
            except Exception as exc:  # a bug, not the caller's fault: report it, keep serving
                log.exception("engine search failed")
                for index in members.tolist():
                    self._answer_error(self.channel.slots[index], ServerError(f"search failed: {type(exc).__name__}: {exc}"))
                continue
            columns.n_results[members] = member_ks
            columns.status[members] = 0
            answered += len(members)
        return answered

    def _answer_nothing(self, slots: np.ndarray, ks: np.ndarray) -> int:
        """Answers single recalls in a namespace that holds nothing: no search, every one of the
        k results padding (id -1, score -inf), as for a filter that no row passes."""
        columns = self.channel.columns
        columns.ids_row0[slots] = -1
        columns.scores_row0[slots] = -np.inf
        columns.n_results[slots] = ks
        columns.status[slots] = 0
        return len(slots)

    def _search_singles(self, slots: np.ndarray, ks: np.ndarray, flt: Filter) -> tuple[np.ndarray, np.ndarray]:
        """One pass over the rows for the single queries in ``slots``; the answers go into the
        slots. Returns the slots answered and their k (the rest got an error: no direction)."""
        columns = self.channel.columns
        k_max = int(ks.max())
        if self.zero_copy and len(slots) > 1:
            # The GPU reads each query from its slot, normalises it and writes the answer back.
            scales = self.engine.search_attached(
                self._query_at[slots], None, self._ids_at[slots], self._scores_at[slots], k_max, flt
            )
            usable = np.isfinite(scales) & (scales > 0)
            if not usable.all():
                self._refuse_queries(slots[~usable], columns.query_row0[slots[~usable]])
                return slots[usable], ks[usable]
            return slots, ks
        rows = columns.query_row0[slots]  # a copy: what the clients wrote, read once
        with np.errstate(over="ignore", invalid="ignore"):
            squared = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
        usable = np.isfinite(squared) & (squared > 0)
        if not usable.all():
            self._refuse_queries(slots[~usable], rows[~usable])
            slots, ks, rows, squared = slots[usable], ks[usable], rows[usable], squared[usable]
            if not len(slots):
                return slots, ks
        scales = 1.0 / np.sqrt(squared)  # float64, as row_scales: the same unit row alone or batched
        if self.zero_copy:  # one query: its scale from here, the rows straight from its slot
            slot = int(slots[0])
            self.engine.search_attached(
                self._query_at[slot : slot + 1], scales, self._ids_at[slot : slot + 1],
                self._scores_at[slot : slot + 1], k_max, flt,
            )
            return slots, ks
        ids, scores = self.engine.search((rows * scales[:, None]).astype(np.float32), k_max, flt)
        columns.ids_row0[slots, :k_max] = ids
        columns.scores_row0[slots, :k_max] = scores
        return slots, ks

    def _refuse_queries(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Answers each of ``slots`` with the reason its query has no direction."""
        for index, row in zip(slots.tolist(), rows):
            reason = "contains NaN or infinity" if not np.all(np.isfinite(row)) else "is all zeros"
            self._answer_error(self.channel.slots[index],
                               InvalidQuery(f"query 0 {reason}; it has no direction to compare by cosine"))

    def _answer_each(self, slots: np.ndarray) -> int:
        """Requests read slot by slot (batches, time windows, pings, bad words), grouped by
        filter; returns the queries answered."""
        groups: dict[Filter, list[tuple[SlotView, int, np.ndarray, np.ndarray]]] = {}
        n_queries = 0
        for index in slots.tolist():
            view = self.channel.slots[index]
            try:
                op, k, flt, rows, scales = self._read_request(view)
            except KalosError as exc:
                self._answer_error(view, exc)
                continue
            except Exception as exc:  # whatever a slot holds must not take the sweep down
                log.exception("unexpected failure reading slot %d", index)
                self._answer_error(view, ServerError(f"could not read the request: {type(exc).__name__}: {exc}"))
                continue
            if op == _PING:
                view.status[0] = 0
                view.n_results[0] = 0
                continue
            if flt is _NOTHING:  # a namespace that holds nothing: every query 0 hits, no search
                view.ids[: len(rows), :k] = -1  # recall_many returns these as its padding rows
                view.scores[: len(rows), :k] = -np.inf
                view.n_results[0] = k  # k results, all padding: as for a filter no row passes
                view.status[0] = 0
                n_queries += len(rows)
                continue
            groups.setdefault(flt, []).append((view, k, rows, scales))
            n_queries += len(rows)
        for flt, members in groups.items():
            k_max = max(member[1] for member in members)
            try:
                if self.zero_copy:
                    members = self._search_in_place(members, k_max, flt)
                else:
                    self._search_copied(members, k_max, flt)
            except Exception as exc:  # a bug, not the caller's fault: report it, keep serving
                log.exception("engine search failed")
                for view, *_ in members:
                    self._answer_error(view, ServerError(f"search failed: {type(exc).__name__}: {exc}"))
                continue
            for view, k, _rows, _scales in members:
                view.n_results[0] = k
                view.status[0] = 0
        return n_queries

    def _search_copied(self, members: list, k_max: int, flt: Filter) -> None:
        """Normalised copies of the queries to the engine; its answers copied into the slots."""
        if len(members) == 1:
            _view, _k, rows, scales = members[0]
            batch = rows * scales[:, None]
        else:
            batch = np.concatenate([rows * scales[:, None] for _v, _k, rows, scales in members])
        batch = batch.astype(np.float32, copy=False)
        ids, scores = self.engine.search(batch, k_max, flt)
        row = 0
        for view, k, rows, _scales in members:
            n = len(rows)
            view.ids[:n, :k] = ids[row : row + n, :k]
            view.scores[:n, :k] = scores[row : row + n, :k]
            row += n

    def _search_in_place(self, members: list, k_max: int, flt: Filter) -> list:
        """The GPU engine reads each query from its slot and writes the answer into it.
        Returns the members answered; the others got their error (a query with no direction)."""
        dim, max_k = self.layout.dim, self.layout.max_k
        if len(members) == 1 and len(members[0][2]) == 1:
            # The common single recall: slices of the per-slot offsets, no arange/concatenate
            # (a few microseconds of NumPy calls on the hot path).
            slot = members[0][0].index
            self.engine.search_attached(
                self._query_at[slot : slot + 1], members[0][3], self._ids_at[slot : slot + 1],
                self._scores_at[slot : slot + 1], k_max, flt,
            )
            return members
        query_at, ids_at, scores_at = [], [], []
        for view, _k, rows, _scales in members:
            r = np.arange(len(rows), dtype=np.int64)
            query_at.append(self._query_at[view.index] + r * dim)
            ids_at.append(self._ids_at[view.index] + r * max_k)
            scores_at.append(self._scores_at[view.index] + r * max_k)
        # Batches are normalised on the device (_read_request left their scales out): on the
        # host, the float64 pass over every query took 31% of this thread at batch 256 (py-spy).
        scales = self.engine.search_attached(
            np.concatenate(query_at), None, np.concatenate(ids_at), np.concatenate(scores_at), k_max, flt
        )
        usable = np.isfinite(scales) & (scales > 0)
        if usable.all():
            return members
        answered, row = [], 0
        for member in members:
            view, _k, rows, _scales = member
            row += len(rows)
            if usable[row - len(rows) : row].all():
                answered.append(member)
                continue
            try:
                row_scales(rows, what="query", error=InvalidQuery)  # names the row and the reason
            except InvalidQuery as exc:
                self._answer_error(view, exc)
            else:  # (both sum the squares in float64: they agree unless a bug makes them differ)
                self._answer_error(view, InvalidQuery("a query has no direction to compare by cosine"))
        return answered

    def _answer_error(self, view: SlotView, exc: KalosError) -> None:
        self.metrics.record_error()
        view.n_results[0] = 0
        view.write_message(str(exc))
        view.status[0] = int(exc.code)

    def _read_request(self, view: SlotView) -> tuple[int, int, Filter, np.ndarray, np.ndarray]:
        """Validates one slot's request: ``(op, k, filter, query rows, their scales)``.

        The rows are the slot's own memory, not a copy (the client waits, untouching, until
        the answer is published; one that rewrites its slot meanwhile can only spoil its own
        answer, since the offsets are the sidecar's); ``scales`` (float64) normalise them, or
        are left empty for a batch that the GPU engine normalises itself (zero-copy).
        """
        layout = self.layout
        op = int(view.op[0])
        if op == _PING:
            return op, 0, _NO_FILTER, _NO_ROWS, _NO_SCALES
        if op != _RECALL:
            raise InvalidQuery(f"unknown operation code {op}")
        n, k, flags = int(view.n_queries[0]), int(view.k[0]), int(view.flags[0])
        if not 1 <= n <= layout.max_batch:
            raise InvalidQuery(f"batch of {n} queries: a request carries 1 to {layout.max_batch}")
        if not 1 <= k <= layout.max_k:
            raise InvalidQuery(f"k={k} is out of range: 1 <= k <= {layout.max_k}")
        if flags & ~_KNOWN_FLAGS:
            raise InvalidQuery(f"unknown request flags {flags & ~_KNOWN_FLAGS:#x}")
        key = (flags, view.read_namespace() if not flags & _ALL_NAMESPACES else b"",
               float(view.since[0]) if flags & _HAS_SINCE else None,
               float(view.until[0]) if flags & _HAS_UNTIL else None,
               int(view.where_handle[0]) if flags & _HAS_WHERE else 0)
        flt = self._filters.get(key)
        if flt is None:
            flt = self._filter_for(*key)
        rows = view.queries[:n]
        if n > 1 and self.zero_copy:
            return op, k, flt, rows, _NO_SCALES  # the GPU engine normalises batches (_search_in_place)
        return op, k, flt, rows, row_scales(rows, what="query", error=InvalidQuery)

    def _filter_for(self, flags: int, namespace_bytes: bytes, since: float | None, until: float | None,
                    where_handle: int = 0) -> Filter:
        """The engine filter a request's words describe (validated, then cached)."""
        where = None
        if flags & _HAS_WHERE:
            where = self._wheres.get(where_handle)
            if where is None:
                raise UnknownFilter(
                    f"where handle {where_handle} is not registered with this sidecar (it restarted, or the "
                    "handle was evicted): register the clause again"
                )
        namespace = None
        if not flags & _ALL_NAMESPACES:
            namespace = self._namespaces.get(namespace_bytes)
            if namespace is None:
                # A name no add ever used: a valid one holds nothing yet (a new user's first
                # recall), so it is answered with no hits (issue 22); a malformed one is still
                # the caller's error, named.
                try:
                    check_namespace(namespace_bytes.decode("utf-8"))
                except UnicodeDecodeError:
                    shown = namespace_bytes.decode("utf-8", "replace")
                    raise InvalidQuery(f"namespace {shown!r} is not valid UTF-8") from None
                except InvalidArgument as exc:  # too long, control characters: a bad query
                    raise InvalidQuery(str(exc)) from None
        for label, value in (("since", since), ("until", until)):
            if value is not None and not np.isfinite(value):
                raise InvalidQuery(f"{label} must be a finite time, got {value}")
        if since is not None and until is not None and since >= until:
            raise InvalidQuery(f"empty time range: since={since} is not before until={until}")
        if not flags & _ALL_NAMESPACES and namespace is None:
            return _NOTHING
        if len(self._filters) >= 1024:  # clients sweeping time windows: keep the cache bounded
            self._filters.clear()
        flt = Filter(namespace, since, until, where)
        self._filters[(flags, namespace_bytes, since, until, where_handle)] = flt
        return flt

    # -- expiry (TTL) ------------------------------------------------------------------

    def _note_expiries(self, ids: np.ndarray, expires_at: np.ndarray | None) -> None:
        """Records when the rows of ``ids`` expire (NaN or None: never; ``_state_lock`` held, or
        before serving). A row whose expiry is already past is tombstoned by the next
        :meth:`_expire_due`, before any recall."""
        if self._expiry.note(ids, expires_at):
            self._expiry_wake.set()

    def _expiry_near(self) -> bool:
        """Whether a row expires within ``_EXPIRY_LEAD_S`` (``_state_lock`` held): the sweep keeps
        the GPU's polling kernel off until then (rows deleted or re-timed since do not count)."""
        earliest = self._expiry.earliest()
        return earliest is not None and earliest - time.time() < _EXPIRY_LEAD_S

    def _expire_due(self) -> None:
        """Tombstones in the engine every row whose expiry has come (``_state_lock`` held). Called
        before each answering pass, so no recall returns a row after its ``expires_at``; the
        cost when nothing is due is one look at the schedule's top. The expirer thread deletes
        the rows from the store afterwards (get and list skip them meanwhile)."""
        due = self._expiry.due(time.time())
        if due:
            self._pause_slot_server()
            self.engine.delete(np.asarray(due, dtype=np.int64))
            self._expiry_rounds += 1
            self._expiry_wake.set()

    def _expirer(self) -> None:
        """Tombstones rows when they expire while no recall comes (the GPU's polling is kept off
        around an expiry by the sweep: :meth:`_expiry_near`), and deletes expired rows from the
        store, durably, at most once per ``_EXPIRY_STORE_S``."""
        next_store = 0.0
        while not self._stopping.is_set():
            with self._state_lock:
                self._expire_due()
                top = self._expiry.earliest()
            now = time.time()
            if self._swept_rounds != self._expiry_rounds and now >= next_store:
                next_store = now + _EXPIRY_STORE_S
                rounds = self._expiry_rounds  # read first: a round counted meanwhile is swept next time
                try:
                    self._delete_expired_rows()
                    self._swept_rounds = rounds
                except Exception as exc:  # noqa: BLE001 - the next round tries again; get/list skip them meanwhile
                    log.warning("deleting expired memories from the store failed (%s); trying again", exc)
            waits = [_EXPIRY_POLL_S]
            if top is not None:
                waits.append(top - now)
            if self._swept_rounds != self._expiry_rounds:
                waits.append(next_store - now)
            self._expiry_wake.wait(max(0.0, min(waits)))
            self._expiry_wake.clear()

    def _delete_expired_rows(self) -> None:
        with self._write_lock:
            deleted = self.store.delete_expired(time.time())
            if len(deleted):
                with self._state_lock:
                    self._pause_slot_server()
                    self.engine.delete(deleted)  # rows the heap did not know of (a follower's, say)
                    self._expiry.forget(deleted)
                self._wrote.set()

    def _search_all(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Search over every namespace (the seed-compat protocol has no filters)."""
        with self._state_lock:
            self._expire_due()
            return self.engine.search(queries, k, Filter())

    # -- the control path ----------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopping.is_set():
            listener = self._listener
            if listener is None:
                return  # closed by close()
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return  # listener closed by close()
                if listener is not self._listener:
                    continue  # _check_socket bound a new one

                # Out of file descriptors (EMFILE: a flood of connections) or an aborted peer.
                # Returning here stopped all accepting for the sidecar's lifetime, even after the
                # flood was gone (tests/reliability/test_hostile.py): wait a little, then go on.
                log.warning("accepting a control connection failed (%s); retrying", exc)
                time.sleep(0.05)
                continue
            pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
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
            if len(self._connections) >= limit:
                # Each connection costs a thread and its buffers: 300 that announced 200 MB
                # frames and went silent cost ~1 MiB each, without limit (issue 19). Slot
                # holders fit below the limit by construction; the spare ones time out.
                self._refused_connections += 1
                if self._refused_connections in (1, 10, 100) or self._refused_connections % 1000 == 0:
                    log.warning("refused control connection %d of pid %d: %d connections are open (limit %d)",
                                self._refused_connections, pid, len(self._connections), limit)
                try:
                    conn.settimeout(0.1)
                    send_frame(conn, error_reply(InvalidArgument(
                        f"sidecar {self.config.name!r} has {len(self._connections)} control connections open, its "
                        f"limit ({self.layout.n_slots} slots + KALOS_SPARE_CONNECTIONS={settings().spare_connections}); "
                        f"try again later"
                    )))
                except OSError:
                    pass
                finally:
                    conn.close()
                continue
            self._connections.add(conn)
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
            channel = self.channel
            if slot is not None and channel is not None:
                self._change_slots(lambda: channel.deactivate(slot))
            self._connections.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket, message: dict[str, Any]) -> int | None:
        # type() is int: True == 1 in Python, and "protocol": true is not a version (issue 19).
        if type(message.get("protocol")) is not int or message.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"client speaks control protocol {message.get('protocol')!r}, this sidecar {PROTOCOL_VERSION}"
            )
        wake_fd = recv_fd(conn)
        slot = self._change_slots(lambda: self.channel.take_slot(wake_fd))
        if slot is not None:
            self.cohort.forget(slot)  # a new client: quick until it shows otherwise
        if slot is None:
            os.close(wake_fd)
            raise InvalidArgument(f"all {self.layout.n_slots} slots are in use; restart the sidecar with more --slots")
        try:
            send_frame(conn, ok_reply(
                slot=slot, segment=self.endpoint.segment_name, epoch=self.epoch, dim=self.layout.dim,
                max_k=self.layout.max_k, max_batch=self.layout.max_batch, n_slots=self.layout.n_slots,
                client_spin_us=self.client_spin_us, max_message_bytes=settings().max_message_bytes,
            ))
            send_fd(conn, self.channel.doorbell_fd)
            send_fd(conn, self._segment.fileno())  # the segment has no name: protocol 2
        except BaseException:
            # The client hung up before it learnt its slot (it died mid-hello). The caller never
            # receives the slot number, so its cleanup cannot free it: free it here, or the slot
            # leaks for the sidecar's lifetime (found by tests/reliability/test_client_death.py).
            self._change_slots(lambda: self.channel.deactivate(slot))
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
            # Room in the engine first: an allocation that fails (MemoryError, CUDA out of
            # memory) then fails an add that stored nothing. After the commit it left rows that
            # recall could not see, and a retry stored them twice (issue 19).
            with self._state_lock:
                self._pause_slot_server()
                self.engine.reserve(len(unit))
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
                    self._pause_slot_server()
                    self.engine.add(ids, unit, np.int32(namespace_id), created_at, message.get("metadata"))
                    self._namespaces[namespace.encode()] = namespace_id
                    self._note_expiries(ids, expires_at)
            except BaseException as exc:
                self._undo_add(ids, request_id, exc)
                raise
            self._wrote.set()
        spec, out = array_blob(ids, "int64")
        return ok_reply(ids=spec), out

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
                self._pause_slot_server()
                if replaced.any():
                    self.engine.delete(ids[replaced])
                self.engine.add(ids, unit, np.int32(namespace_id), created_at, message.get("metadata"))
                self._namespaces[namespace.encode()] = namespace_id
                # The call's expiry replaces the stored one (None: these rows never expire).
                self._note_expiries(ids, expires_at)
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
                self._pause_slot_server()
                self.engine.delete(ids)
                self._expiry.forget(ids)
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

    def _apply_followed(self, batch: Any) -> None:
        """Applies changes other sidecars made to a shared store (called by the follower with
        ``_write_lock`` held, like _op_add)."""
        from kalos.store.follow import apply_to_engine

        written = [c.ids for c in batch.changes if c.op != "delete" and len(c.ids)]
        touched = np.unique(np.concatenate(written)) if written else np.empty(0, np.int64)
        # Their expiries as the store has them now (a later change in the log may move them
        # again; it is applied after this one).
        expiring, expires_at = self.store.expiries(touched) if len(touched) else (touched, np.empty(0))
        with self._state_lock:
            self._pause_slot_server()
            apply_to_engine(self.engine, self._namespaces, batch)
            for change in batch.changes:
                if change.op == "delete":
                    self._expiry.forget(change.ids)
            # Written rows expire only if the store says so (an upsert may have dropped a ttl).
            self._expiry.forget(touched)
            self._note_expiries(expiring, expires_at)
            self._expire_due()  # a replayed row that has expired meanwhile goes again at once

    def _op_delete(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Deletes by ``keys`` (in ``namespace``), by ``ids``, or by ``where`` (in ``namespace``,
        None: every namespace; one store transaction, so a crash leaves all of them or none)."""
        keys, where = message.get("keys"), message.get("where")
        if sum(value is not None for value in (keys, message.get("ids"), where)) > 1:
            raise InvalidArgument("delete: give keys, ids or where (exactly one)")
        if keys is not None:
            namespace = check_namespace(message.get("namespace", "default"))
            delete = lambda: self.store.delete_keys(keys, namespace)  # noqa: E731
        elif where is not None:
            clause = compile_where(where)
            namespace = _optional_namespace(message.get("namespace", "default"))
            delete = lambda: self.store.delete_where(namespace=namespace, where=clause)  # noqa: E731
        else:
            ids = _int_list(message.get("ids"), "ids")
            delete = lambda: self.store.delete(ids)  # noqa: E731
        return ok_reply(deleted=len(self._delete_committed(delete))), b""

    def _delete_committed(self, delete: Callable[[], np.ndarray]) -> np.ndarray:
        """Runs a store delete, then tombstones what it deleted in the engine (``_write_lock``
        keeps the two in the store's order); returns the ids deleted."""
        with self._write_lock:
            deleted = delete()
            with self._state_lock:
                self._pause_slot_server()
                self.engine.delete(deleted)
                self._expiry.forget(deleted)
            self._wrote.set()
        return deleted

    def _op_drop_namespace(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Deletes every memory of one namespace (one transaction). The name stays registered
        with its id, so no other namespace can ever take that id (an engine row or a follower's
        map that still names it could then leak one namespace's memories into another's)."""
        namespace = check_namespace(message.get("namespace"))
        deleted = self._delete_committed(lambda: self.store.delete_where(namespace=namespace, where=None))
        return ok_reply(deleted=len(deleted)), b""

    def _op_list(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """One page of items in id order after ``after``: ``items`` and ``next`` (the id to page
        on from, None on the last page)."""
        where = message.get("where")
        items, after = self.store.list_items(
            namespace=_optional_namespace(message.get("namespace")),
            where=None if where is None else compile_where(where),
            limit=message.get("limit", 100), after=message.get("after", 0),
        )
        size = sum(len(item.text or "") + len(json.dumps(item.metadata)) for item in items)
        limit = settings().max_message_bytes
        if size > limit:
            raise InvalidArgument(f"list: the page would be too large: about {size} bytes > limit {limit} "
                                  f"(KALOS_MAX_MESSAGE_BYTES); ask for a smaller limit")
        return ok_reply(items=[dataclasses.asdict(item) for item in items], next=after), b""

    def _op_count(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        where = message.get("where")
        count = self.store.count_items(namespace=_optional_namespace(message.get("namespace")),
                                       where=None if where is None else compile_where(where))
        return ok_reply(count=count), b""

    def _op_update(self, message: dict[str, Any], blob: bytearray) -> tuple[dict[str, Any], bytes]:
        """Changes what the message carries of one memory (``text``, ``metadata``, a vector in the
        blob; a field absent from the message is kept). A new vector replaces the engine's row
        under one ``_state_lock`` hold, after the store's commit, as an upsert does: a recall
        sees the old vector or the new, never both or neither."""
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
            vector=vector, merge=message.get("merge", False),
        )
        if change.vector is not None:
            unit = normalise_rows(change.vector[None].copy(), what="vector", error=InvalidArgument)
            change = dataclasses.replace(change, vector=unit[0])
        with self._write_lock:
            if change.vector is not None:
                with self._state_lock:  # room first, as an add: an allocation failure stores nothing
                    self._pause_slot_server()
                    self.engine.reserve(1)
            item_id, namespace_id, created_at = self.store.update(change)
            indexed = None
            if change.vector is not None or change.metadata is not UNSET:
                # What where filters see from now on: the stored metadata (merged or replaced).
                stored = self.store.get([item_id])[0]
                indexed = [stored.metadata if stored is not None else None]
                if change.vector is None:
                    with self._state_lock:
                        self._pause_slot_server()
                        self.engine.set_metadata(np.array([item_id], dtype=np.int64), indexed)
            if change.vector is not None:
                try:
                    with self._state_lock:
                        self._pause_slot_server()
                        ids = np.array([item_id], dtype=np.int64)
                        self.engine.delete(ids)
                        self.engine.add(ids, unit, np.int32(namespace_id), np.array([created_at]), indexed)
                    if item_id in self.quarantined:  # a damaged vector replaced: served again
                        self.quarantined.remove(item_id)
                except BaseException as exc:
                    log.exception("update of id %d committed but the engine failed", item_id)
                    raise ServerError(
                        f"update of id {item_id} committed but the engine failed ({type(exc).__name__}: {exc}): "
                        "the new vector is stored and is served after the sidecar restarts"
                    ) from exc
            self._wrote.set()
        return ok_reply(id=item_id), b""

    def _op_get(self, message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
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
        if keys is not None:
            items = self.store.get_keys(keys, check_namespace(message.get("namespace", "default")))
        else:
            items = self.store.get(wanted)
        with_vectors = message.get("with_vectors", False)
        if not isinstance(with_vectors, bool):
            raise InvalidArgument(f"get: with_vectors must be true or false, got {with_vectors!r}")
        size = sum(len(item.text or "") + len(json.dumps(item.metadata)) for item in items if item is not None)
        if with_vectors:
            size += 4 * self.store.dim * sum(item is not None for item in items)
        limit = settings().max_message_bytes
        if size > limit:
            raise InvalidArgument(f"get: the reply would be too large: about {size} bytes > limit {limit} "
                                  f"(KALOS_MAX_MESSAGE_BYTES); ask for fewer ids at a time")
        if not with_vectors:
            return ok_reply(items=[_item_fields(item) for item in items]), b""
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
        return ok_reply(items=[_item_fields(item) for item in items],
                        vectors=spec), blob

    def _op_stats(self, _message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        with self._state_lock:
            engine = {
                "count": len(self.engine), "capacity": self.engine.capacity, "tombstones": self.engine.tombstones,
                "device": self.engine.device, "engine": self.engine.name, "engine_bytes": self.engine.memory_bytes(),
                "clients": int(self.channel.active.sum()),
                # Single recalls the GPU's polling answered by itself (not in "queries").
                "gpu_polled": self._slot_server.served if self._slot_server is not None else 0,
                # The engine's own counters (searches, fallbacks, graph captures and errors).
                "engine_stats": {key: value for key, value in getattr(self.engine, "stats", {}).items()
                                 if isinstance(value, (int, float, str))},
                **self.cohort.stats(),
            }
        return ok_reply(
            name=self.config.name, pid=os.getpid(), epoch=self.epoch, dim=self.store.dim,
            store=str(self.store.path), store_bytes=self.store.size_bytes(),
            namespaces=self.store.namespace_counts(), slots=self.layout.n_slots, max_k=self.layout.max_k,
            max_batch=self.layout.max_batch, **engine, **self.metrics.snapshot(),
            seed_compat=self._seed.stats if self._seed is not None else None,
            quarantined=len(self.quarantined), quarantined_ids=self.quarantined[:100],
        ), b""

    def _op_compact(self, _message: dict[str, Any], _blob: bytearray) -> tuple[dict[str, Any], bytes]:
        with self._write_lock, self._state_lock:
            self._pause_slot_server()
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
        with self._where_lock:
            handle = self._where_handles.get(where.key)
            if handle is not None:
                self._where_handles.move_to_end(where.key)
            else:
                handle = self._next_where_handle
                self._next_where_handle += 1
                self._wheres[handle] = where
                self._where_handles[where.key] = handle
                while len(self._where_handles) > _MAX_WHERE_HANDLES:
                    _key, old = self._where_handles.popitem(last=False)
                    del self._wheres[old]
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
                f"embedder {info['name']} makes {info['dim']}-dimensional vectors but sidecar {self.config.name!r} "
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

    _handlers: dict[str, Callable[["Sidecar", dict[str, Any], bytearray], tuple[dict[str, Any], bytes]]] = {
        "embedder": _op_embedder,
        "embed": _op_embed,
        "add": _op_add,
        "delete": _op_delete,
        "get": _op_get,
        "update": _op_update,
        "list": _op_list,
        "count": _op_count,
        "drop_namespace": _op_drop_namespace,
        "stats": _op_stats,
        "compact": _op_compact,
        "where": _op_where,
    }


def _optional_namespace(value: Any) -> str | None:
    """A namespace name, or None for every namespace."""
    return None if value is None else check_namespace(value)


def _int_list(value: Any, label: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidArgument(f"{label} must be a list of integers")
    if any(not -(2**63) <= v < 2**63 for v in value):
        raise InvalidArgument(f"{label} must fit in int64")
    return value


def _item_fields(item: Any) -> dict[str, Any] | None:
    """An Item of a get's reply as JSON fields; its vector travels in the blob, never here (a
    client from before ``Item.vector`` builds ``Item(**fields)`` and knows no such field)."""
    if item is None:
        return None
    fields = dataclasses.asdict(item)
    fields.pop("vector", None)
    return fields
