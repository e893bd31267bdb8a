"""The Kalos sidecar's lifecycle: one process that owns the store, the engine and the shared segment.

This module builds the sidecar's state in order, starts its threads, and takes everything down
again in ``close`` (safe after a half-finished constructor); the work itself is done by the
collaborators it wires together, each in a module of its own so that the hot path stays small
and visibly apart from setup:

  * the recall loop (kalos.server.recall_loop), run by the thread that calls
    :meth:`Sidecar.serve_forever`: finds every pending recall in the slots, answers them as
    one engine pass per filter, publishes the answers;
  * the control socket (kalos.server.operations): the acceptor, and one thread per control
    connection: hello (slot assignment), add, delete, get, stats... A connection's slot is
    freed when the connection closes, which the kernel does for a client that dies;
  * the expirer (kalos.server.expirer): tombstones rows whose ``ttl`` ran out when no recall
    pass did it first, and deletes expired rows from the store;
  * the GPU's polling of the slots, which every writer stops first (kalos.server.slot_polling).

Threads of its own: the heartbeat stamps the segment header every ``heartbeat_interval_s`` (and
binds the control socket again if its name was removed); the checkpointer (SQLite stores)
copies the WAL into the db file once writes pause; a shared store's change follower applies
other sidecars' writes (:meth:`Sidecar._apply_followed`).

``_state_lock`` serialises the engine (and the GPU's polling) between the sweep and the
writers; ``_write_lock`` serialises writers so that the store and the engine see adds and
deletes in the same order (a delete can never overtake the add it deletes). The slot table
has its own lock in the channel, held for microseconds (never across a search), so a client
connects while a crowd is hot.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import secrets
import signal
import socket
import stat
import threading
import time
from typing import Any, Callable

import numpy as np

from kalos.config import DEFAULT_GPU_WINDOW_US, GPU_POLLING, RuntimeDir, open_runtime_dir, settings
from kalos.engine import Engine, make_engine, numpy_engine
from kalos.errors import InvalidArgument, KalosError, SidecarAlreadyRunning
from kalos.ipc.channel import SidecarChannel
from kalos.ipc.control import peer_credentials
from kalos.ipc.protocol import Layout
from kalos.ipc.segment import Endpoint, Segment
from kalos.server.cohort import Cohort
from kalos.server.expirer import Expirer
from kalos.server.metrics import Metrics
from kalos.server.operations import ControlServer
from kalos.server.filters import FilterCache
from kalos.server.recall_loop import RecallLoop
from kalos.server.slot_polling import SlotPolling
from kalos.server.state_lock import StateLock
from kalos.store.spec import StoreSpec, open_store
from kalos.store.sqlite import Store
from kalos.validation import bad_vector_rows

__all__ = ["SidecarConfig", "Sidecar"]

# The sidecar's one logger, whichever of its modules logs.
log = logging.getLogger("kalos.server.sidecar")
_SOCKET_CHECK_S = 1.0  # how often the heartbeat checks that the control socket's name is still ours

#: How long the clients of a GPU sidecar busy-poll for an answer before sleeping (advised in
#: the hello reply; a client's own spin_us or KALOS_CLIENT_SPIN_US wins).
GPU_CLIENT_SPIN_US = 1000.0


def crowded_wait(on_gpu: bool, gpu_polling: bool) -> str:
    """How this sidecar's clients wait once they outnumber the cores twice over (advised in the
    hello reply; kalos.ipc.channel.CROWDED_WAITS). Where the GPU's polling answers, no host
    thread needs the cores the clients spin on, and spinners that yield see their answers
    sooner than nappers, whose 100 us naps scatter a crowd's next requests over several rounds.
    Where the sweep answers on a GPU (passes of ~100 us), the wake-ups it would write at the end
    of each would cost it more than naps cost the clients. A CPU sidecar's passes take
    milliseconds on the very cores the clients run on, and a client waking every 100 us
    preempts the threads the pass runs on: its clients sleep until they are woken.
    (BENCHMARKS.md, the crowd: each measured.)"""
    if not on_gpu:
        return "sleep"
    return "yield" if gpu_polling else "nap"


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
    # (kalos.engine.gpu.slot_server): "graph" (a CUDA graph that waits for requests, then scans
    # with the whole GPU, a crowd's in one batch: the default, faster at every crowd size), or
    # "off" (the sweep answers everything: fewer of a co-located LLM's GPU time slices taken).
    # BENCHMARKS.md has both measured. gpu_window_us: how long the polling kernel, once a
    # request is pending, waits for the rest of the clients before its pass.
    gpu_polling: str = "graph"
    gpu_window_us: float = DEFAULT_GPU_WINDOW_US
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
        if not 0 <= self.gpu_window_us <= 10_000:
            raise InvalidArgument(f"gpu_window_us must be in [0, 10000] microseconds, got {self.gpu_window_us}")
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
        pid, uid, _gid = peer_credentials(probe)
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
        self._state_lock = StateLock()
        self._write_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.listener: socket.socket | None = None  # the control socket (bound again if its name goes)
        self.segment: Segment | None = None
        self.channel: SidecarChannel | None = None  # the slots' channel over the segment
        self._seed: Any = None
        self.store: Store | None = None  # or a PostgresStore
        self._follower: Any = None  # follows a shared (PostgreSQL) store's change log
        # The GPU's polling of the slots (kalos.engine.gpu.slot_server), stopped by every writer.
        self._polling = SlotPolling(self._state_lock)
        self._expirer: Expirer | None = None
        self._recall_loop: RecallLoop | None = None
        self._control: ControlServer | None = None
        self.quarantined: list[int] = []  # ids of stored items with damaged vectors (not served)
        self._wrote = threading.Event()  # set by every write: the checkpointer waits for a pause
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
            # TTL (issue 22): the schedule and its side effects, shared by every writer and the sweep.
            self._expirer = Expirer(engine=self.engine, store=self.store, polling=self._polling,
                                    state_lock=self._state_lock, write_lock=self._write_lock,
                                    wrote=self._wrote, stopping=self._stopping)
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
            self._expirer.note(*self.store.expiries())
            self._expirer.expire_due()  # rows that expired while no sidecar ran are never served
            if shared:
                self._follower = self.store.follower(rows.mark, apply=self._apply_followed, lock=self._write_lock)
            self.load_seconds = time.perf_counter() - started
            # A GPU sidecar's answer often comes after the CPU default's spin: a client that slept
            # then would pay a wake-up on most recalls, so its clients spin longer. Clients that
            # set their own spin_us keep it.
            on_gpu = str(self.engine.device).startswith("cuda")
            if isinstance(self.engine, numpy_engine.NumpyEngine) and not numpy_engine.native_scores():
                # (Otherwise silent: a crowd's passes would just be slower, and only doctor says why.)
                log.warning("%s; %s", numpy_engine.NATIVE_SCORES_MISSING, numpy_engine.NATIVE_SCORES_FIX)
            self.client_spin_us = GPU_CLIENT_SPIN_US if on_gpu else settings().client_spin_us
            # Name -> id of every namespace (the writers and the follower add to it in place).
            self._namespaces = {name.encode(): ns for name, ns in self.store.namespaces().items()}
            # The engine filter of each request's words, and the where clauses registered for them.
            self._filter_cache = FilterCache(self._namespaces)
            from kalos.server.sidecar_embed import EmbedService

            self.embedding = EmbedService(config.embed, config.embed_runtime, str(self.engine.device))
            self.layout = Layout(config.slots, self.store.dim, config.max_k, config.max_batch)
            self.segment = Segment.create(self.endpoint.segment_name, self.layout.size)
            self.layout.write_header(self.segment.buf, epoch=self.epoch, pid=os.getpid())
            self.channel = SidecarChannel(self.segment, self.layout, epoch=self.epoch)
            self.channel.stamp_heartbeat()
            self.cohort = Cohort(self.layout.n_slots, config.gather_us / 1e6)
            self._recall_loop = RecallLoop(
                engine=self.engine, channel=self.channel, layout=self.layout, metrics=self.metrics,
                cohort=self.cohort, filters=self._filter_cache, polling=self._polling, expirer=self._expirer,
                state_lock=self._state_lock, stopping=self._stopping, spin_us=config.spin_us,
            )
            # A GPU engine reads the queries in the slots and writes the answers into them.
            if config.zero_copy:
                self._recall_loop.attach(self.segment.buf)
            if self.zero_copy and str(self.engine.device).startswith("cuda"):
                try:
                    self._recall_loop.warm()
                except Exception as exc:  # noqa: BLE001 - an optimisation: the passes compile on first use
                    log.warning("warming the GPU's crowd passes failed (%s); each compiles on first use", exc)
            server = self._make_slot_server()
            if server is not None:
                self._polling.install(server, self.channel)
            self.client_crowded = crowded_wait(on_gpu, server is not None)
            self.channel.stamp_heartbeat()  # compiling the slot server's kernel may take seconds
            self.listener = self._listen(self._rundir, self.endpoint.socket_name)
            self._socket_id = self._socket_identity()
            if config.seed_compat:
                from kalos.server.seed_compat import SeedCompatServer

                self._seed = SeedCompatServer(
                    search=self._recall_loop.search_all, dim=self.store.dim, spin_us=config.spin_us, log=log,
                    shm_name=config.seed_compat_shm,
                )
            self._control = ControlServer(
                self, name=config.name, endpoint=self.endpoint, epoch=self.epoch, layout=self.layout,
                engine=self.engine, store=self.store, metrics=self.metrics, cohort=self.cohort,
                embedding=self.embedding, seed=self._seed, quarantined=self.quarantined,
                namespaces=self._namespaces, filters=self._filter_cache, polling=self._polling,
                expirer=self._expirer, state_lock=self._state_lock, write_lock=self._write_lock,
                wrote=self._wrote, stopping=self._stopping, client_spin_us=self.client_spin_us,
                client_crowded=self.client_crowded,
                start_thread=self._start_thread,
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

    @property
    def zero_copy(self) -> bool:
        """Whether the engine reads the queries in the slots and writes the answers into them."""
        return self._recall_loop is not None and self._recall_loop.zero_copy

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

            server = SlotGraphServer(self.engine, self.layout, self.channel.answered, idle_s=self.config.spin_us / 1e6,
                                     batch=self.config.max_batch, window_s=self.config.gpu_window_us / 1e6)
            server.warm()
        except Exception as exc:  # noqa: BLE001 - the sweep's own path still serves everything
            log.warning("GPU polling off: the slot server could not be set up (%s)", exc)
            return None
        self.channel.adopt_answered(server.answered)
        return server

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
        self._start_thread(self._control.accept, "kalos-accept")
        if settings().checkpoint_idle_s > 0 and callable(getattr(self.store, "checkpoint", None)):
            self._start_thread(self._checkpointer, "kalos-checkpoint")
        self._start_thread(self._expirer.run, "kalos-expire")
        if self.embedding.mode == "start":
            self.embedding.start()
        if self._follower is not None:
            self._follower.start()
        if self._seed is not None:
            self._seed.start()
        try:
            self._recall_loop.run()
        finally:
            self.close()

    def stop(self) -> None:
        """Asks the sidecar to shut down (safe from signal handlers and other threads)."""
        self._stopping.set()
        self._wrote.set()  # wakes the checkpointer, which then sees _stopping
        channel = getattr(self, "channel", None)
        if channel is not None and not channel.closed:
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
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.endpoint.socket_name, dir_fd=self._rundir.fd)
            except FileNotFoundError:
                pass
        for conn in list(self._control.connections if self._control is not None else ()):
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
                self._polling.close()  # it reads the segment: stop it before unpinning
                self.channel.close()
                if self._recall_loop is not None:
                    self._recall_loop.detach()  # unpin before the segment is unmapped
            self.channel = None
        if self.segment is not None:
            self.segment.close()  # nameless: it is gone once the last client unmaps it
            self.segment = None
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
        kalos.store.ack). Checkpointing at every pause bounds that to the writes of
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
        old, self.listener = self.listener, listener
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

    # -- a shared store's change follower ------------------------------------------------

    def _apply_followed(self, batch: Any) -> None:
        """Applies changes other sidecars made to a shared store (called by the follower with
        ``_write_lock`` held, as an add over the control socket holds it): a thread of the
        lifecycle's, not a control operation, since no client asked for it."""
        from kalos.store.follow import apply_to_engine

        written = [c.ids for c in batch.changes if c.op != "delete" and len(c.ids)]
        touched = np.unique(np.concatenate(written)) if written else np.empty(0, np.int64)
        # Their expiries as the store has them now (a later change in the log may move them
        # again; it is applied after this one).
        expiring, expires_at = self.store.expiries(touched) if len(touched) else (touched, np.empty(0))
        expirer = self._expirer
        with self._state_lock:
            self._polling.pause()
            apply_to_engine(self.engine, self._namespaces, batch)
            for change in batch.changes:
                if change.op == "delete":
                    expirer.schedule.forget(change.ids)
            # Written rows expire only if the store says so (an upsert may have dropped a ttl).
            expirer.schedule.forget(touched)
            expirer.note(expiring, expires_at)
            expirer.expire_due()  # a replayed row that has expired meanwhile goes again at once

