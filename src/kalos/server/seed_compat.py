"""Serves the seed article's ``recall_shm_t`` protocol unchanged (``kalos serve --seed-compat``).

Teams that followed the seed article (seed/kalos-article.txt, sections 4.1 and 4.4) have C
clients that talk to one POSIX shared-memory segment with a ready/done handshake. This module
answers those clients from a Kalos store without a line of theirs changing. It is
self-contained: it owns the segment's bytes, the handshake and the wait strategy; the sidecar
hands it a ``search`` callable (which takes the sidecar's engine lock) and starts it.

The segment (``/dev/shm/kalos_recall_shm`` by default), byte for byte the article's struct,
native byte order, no padding; :data:`SEED_LAYOUT` declares it once and every offset below is
derived from it (a test checks them against ``offsetof`` from a C compiler)::

    offset  size  field            written by
         0     4  magic            client (0x4B414C4F "KALO"); Kalos only when it created the segment
         4     4  version          client (1); Kalos only when it created the segment
         8     4  request_id       client
        12     4  query_dim        client
        16     4  memory_count     client (once, at init) -- ignored by Kalos, see below
        20     4  ready            client sets 1; Kalos clears it to 0
        24     4  done             Kalos sets 1; client clears it to 0
        28     4  result_count     Kalos
        32  4096  query[1024]      client (float32)
      4128    64  result_ids[16]   Kalos (int32)
      4192    64  result_scores[16] Kalos (float32)
      4256        end (sizeof(recall_shm_t))

Decisions (what the article leaves open, and what Kalos does):

* **Handshake.** The client writes query, query_dim and request_id, stores ``ready = 1`` and
  spins until ``done == 1``; it reads the results and stores ``done = 0``. Kalos, on seeing
  ``ready == 1``: reads the request, stores ``ready = 0``, writes the results, and only then
  stores ``done = 1``. The article's sidecar stored ``done = 1`` *before* ``ready = 0``, so a
  fast client could raise ``ready`` for its next request in between and have it erased; with
  ``ready`` cleared first, the client's next ``ready = 1`` is necessarily later and survives.
* **Answer.** Top-8 by cosine over all live memories of the store (``result_count = 8``, fewer
  when the store holds fewer). The query is copied out of the segment once, checked and
  normalised here (float64 norm), then handed to ``search`` as unit float32 ``[1, dim]``.
  Entries ``result_count .. 15`` are always id ``-1``, score ``-inf``.
* **Errors** never crash the server and never leave the client waiting: ``ready`` not 0/1,
  magic != 0x4B414C4F, version != 1, query_dim != the store's dimension (this covers 0,
  > 1024 and garbage), a NaN/inf/all-zero query, or ``search`` raising -> ``done = 1`` with
  ``result_count = 0``, ``stats["errors"] += 1``, ``stats["last_error"]`` set and a logged
  error (rate-limited to one line per kind per second, with a count of what was suppressed,
  so a broken client cannot flood the log). The magic and version are *required*: the
  article's client writes them right after its memset and before any request, so a zero or
  wrong magic means a client that is not speaking this protocol (or is mid-restart).
* **memory_count** is the client's guess of the store size (the article writes 65536 once at
  init, and its sidecar trusted it as the scan length). Kalos never uses it for the search,
  never bounds anything by it and never writes it: it is the client's word, written only at
  init, so a live count written there would be stale by the next add and would race the
  client's own init store. Kalos writes only ready, done, result_count, result_ids and
  result_scores (plus magic and version once, into a segment it created). Each new value is
  logged at INFO, so an operator can see what the client believes.
* **Ids beyond int32.** Store ids are int64; the protocol's result_ids are int32. An id
  outside ``[0, 2**31 - 1]`` cannot be written without becoming *another* id (truncation) or a
  sentinel inside ``result_count`` (a C client indexing an array by it would read out of
  bounds). Such items are therefore *invisible* to seed clients: Kalos widens the search
  (k = 8, 64, 512, 4096) until it has 8 representable ids or the store is exhausted, answers
  the best 8 representable ones, counts the hidden ones in ``stats["hidden_ids"]`` and logs a
  warning (rate-limited). Past k = 4096 it answers what it has (result_count < 8).
* **Permissions.** A segment the client created keeps the client's mode (the article asks for
  0666, minus the client's umask); Kalos never chmods it. Kalos serves only a segment that its
  own uid owns and that group and others cannot write (0644 and 0600 are fine): another user
  who could write it would read every answer and could shrink it (issue 19, item 4). Such a
  segment makes ``start`` fail, and one that appears later is refused (logged, retried) and
  never touched; a symlink is never followed. A segment readable by others is warned about.
* **No mapping.** Kalos reads and writes the segment with ``pread``/``pwrite`` on its
  descriptor and never maps it: a client may truncate the file at any moment, and a mapped page
  past the new end would kill the whole sidecar with SIGBUS. A short read means "shrunk": the
  request is dropped and Kalos re-attaches once the segment is full-size again. When Kalos
  creates the segment, or attaches to a client's, it reserves its pages (``posix_fallocate``),
  so a full /dev/shm is a clear error at creation, not a SIGBUS in the client later. When Kalos creates the segment it is
  exactly 0600 (owner only): a seed client must then run as the same uid, or create the
  segment itself first.
* **Lifecycle.** Either side may start first. At start (and whenever the segment must be
  found again) Kalos opens an existing segment, waiting -- not failing -- while it is shorter
  than 4256 bytes (the client is between O_CREAT and ftruncate); if there is none it creates
  it (0600, sized, version then magic written). A client that restarts re-zeroes the same
  segment (O_CREAT on an existing file, memset): nothing to do. A client that unlinks and
  recreates it gets a new inode: while idle, Kalos stats the path every 100 ms and re-attaches
  when the inode changed, the file vanished (then Kalos creates a fresh one) or shrank.
  :meth:`SeedCompatServer.stop` never unlinks anything -- not the client's segment, and not
  one Kalos created either, because an article client opens the segment once and keeps its
  mapping: the next sidecar must find the same segment. Use :func:`unlink_segment` to clean up.
* **A client that dies mid-request and restarts** can re-zero the segment while Kalos is
  still searching for the dead request; publishing ``done = 1`` then would be read by the new
  client as its own answer (or make it wait forever for ``done == 0``). Just before publishing,
  Kalos re-reads ready, request_id and magic; if any changed, the stale answer is dropped
  (``stats["stale_dropped"]``). The protocol carries no epoch and echoes no request id, so a
  window of a few loads remains; it is inherent to the article's layout.

Waiting: the article's client never rings a doorbell, so Kalos must poll. After each request
it spins on ``ready`` for ``spin_us`` (default 2 ms; each sweep calls ``sched_yield``, which
also releases the GIL so the sidecar's other threads keep running), then sleeps between sweeps
with a back-off that doubles from 50 us to 1 ms, and to 2 ms once idle for a second. While hot,
a request is picked up within a sweep (microseconds) at the price of one busy core for
``spin_us`` after every request. After idle, a request waits for the current sleep to end:
at most ~1.1 ms in the first second (an agent's burst of recalls), ~2.2 ms after that; every
wake-up costs CPU, so halving the pick-up doubles the idle cost. The long-idle sleep is 2 ms and
not 1 ms because on a loaded small host a bare 1 ms sleep loop alone takes a visible share of a
core. The pick-up and idle figures: BENCHMARKS.md, "Seed compatibility".
"""
from __future__ import annotations

import logging
import math
import os
import stat
import struct
import threading
import time
from typing import Callable

import numpy as np

from kalos.engine.base import MISSING_ID
from kalos.errors import InvalidArgument, KalosError
from kalos.ipc.sync import full_fence

__all__ = [
    "SEED_LAYOUT",
    "SEGMENT_SIZE",
    "MAGIC",
    "VERSION",
    "MAX_QUERY_DIM",
    "MAX_RESULT_ITEMS",
    "TOP_K",
    "DEFAULT_SHM_NAME",
    "SearchFn",
    "SeedCompatServer",
    "segment_path",
    "unlink_segment",
]

#: ``search(query float32[1, dim] unit-norm, k) -> (ids int64[1, k], scores float32[1, k])``,
#: best first, padded with id -1 / score -inf.
SearchFn = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]

MAGIC = 0x4B414C4F  # "KALO"
VERSION = 1
MAX_QUERY_DIM = 1024
MAX_RESULT_ITEMS = 16
TOP_K = 8  # the article's sidecar answers top-8
DEFAULT_SHM_NAME = "/kalos_recall_shm"

#: The article's ``recall_shm_t``, declared once. Native byte order ("="), no padding
#: (``align=False``, and every field is naturally aligned anyway).
SEED_LAYOUT = np.dtype(
    [
        ("magic", "=u4"),
        ("version", "=u4"),
        ("request_id", "=u4"),
        ("query_dim", "=u4"),
        ("memory_count", "=u4"),
        ("ready", "=u4"),
        ("done", "=u4"),
        ("result_count", "=u4"),
        ("query", "=f4", (MAX_QUERY_DIM,)),
        ("result_ids", "=i4", (MAX_RESULT_ITEMS,)),
        ("result_scores", "=f4", (MAX_RESULT_ITEMS,)),
    ],
    align=False,
)
SEGMENT_SIZE = SEED_LAYOUT.itemsize
OFFSETS: dict[str, int] = {name: SEED_LAYOUT.fields[name][1] for name in SEED_LAYOUT.names}

# The eight uint32 header words are read and written one at a time, with pread/pwrite of
# 4 aligned bytes (see _Words). Their indices, in words from the start:
_HEADER_FIELDS = ("magic", "version", "request_id", "query_dim", "memory_count", "ready", "done", "result_count")
_W = {name: OFFSETS[name] // 4 for name in _HEADER_FIELDS}
_MAGIC, _VERSION, _REQUEST_ID, _QUERY_DIM = _W["magic"], _W["version"], _W["request_id"], _W["query_dim"]
_MEMORY_COUNT, _READY, _DONE, _RESULT_COUNT = _W["memory_count"], _W["ready"], _W["done"], _W["result_count"]

_INT32_MAX = 2**31 - 1
_WIDEN_K = (TOP_K, 64, 512, 4096)  # search widths tried when ids beyond int32 are hidden
_SLEEP_MIN_S = 50e-6  # first idle sleep; doubles up to _SLEEP_MAX_S
_SLEEP_MAX_S = 1e-3  # longest sleep in the first _DEEP_IDLE_S of idle: pick-up <= ~1.1 ms
_DEEP_IDLE_S = 1.0  # after this long without a request...
_DEEP_SLEEP_S = 2e-3  # ...sleeps grow to this: half the wake-ups, pick-up <= ~2.1 ms
_IDLE_CHECK_S = 0.1  # how often an idle server stats the path for a replaced segment
_ATTACH_POLL_S = 1e-3  # while waiting for the client's ftruncate (or a permission fix)
_LOG_INTERVAL_S = 1.0  # at most one log line per kind per second
_SHM_DIR = "/dev/shm"
_REFUSAL_REMEDY = (
    "Kalos serves only a segment that this user owns and that no one else can write; remove it "
    "(as its owner or root) and let Kalos create it, or create it as this user with mode 0600"
)


def segment_path(shm_name: str) -> str:
    """The file behind a POSIX shared-memory name on Linux (``/x`` -> ``/dev/shm/x``)."""
    if (
        not isinstance(shm_name, str)
        or len(shm_name) < 2
        or not shm_name.startswith("/")
        or "/" in shm_name[1:]
        or "\0" in shm_name
        or len(shm_name) > 255
        or shm_name in ("/.", "/..")
    ):
        raise InvalidArgument(
            f"shared-memory name {shm_name!r} must be '/' followed by 1-254 characters with no '/' "
            "(like the article's /kalos_recall_shm)"
        )
    return os.path.join(_SHM_DIR, shm_name[1:])


def unlink_segment(shm_name: str = DEFAULT_SHM_NAME) -> bool:
    """Removes the named segment (what ``shm_unlink`` does); True if there was one."""
    try:
        os.unlink(segment_path(shm_name))
    except FileNotFoundError:
        return False
    return True


class _Throttle:
    """Rate-limited logging: at most one record per key per interval, counting the rest."""

    def __init__(self, log: logging.Logger, interval_s: float = _LOG_INTERVAL_S) -> None:
        self._log = log
        self._interval = interval_s
        self._state: dict[str, tuple[float, int]] = {}

    def __call__(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        last, suppressed = self._state.get(key, (-math.inf, 0))
        if now - last < self._interval:
            self._state[key] = (last, suppressed + 1)
            return
        self._state[key] = (now, 0)
        if suppressed:
            msg += " (%d similar suppressed in the last %.0f s)"
            args = (*args, suppressed, now - last)
        self._log.log(level, msg, *args, exc_info=exc_info)


class _SegmentShrank(Exception):
    """The segment is shorter than the protocol's struct now (a client truncated it)."""


class _Words:
    """The eight header words, each read with one ``pread`` and written with one ``pwrite``.

    The segment is never mapped: a client can truncate a file it shares with us at any time,
    and a mapped page past the new end would kill the whole sidecar with SIGBUS at its next
    access (issue 19, item 4). A read past the end is just short, and says so. A 4-byte
    aligned copy by the kernel (``copy_to_user``/``copy_from_user``) is done in aligned
    machine words on x86-64 and aarch64; the flags (ready, done) only ever change their low
    byte, so even a byte-wise copy could not tear them.
    """

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __getitem__(self, index: int) -> int:
        data = os.pread(self._fd, 4, 4 * index)
        if len(data) != 4:
            raise _SegmentShrank()
        return _U32.unpack(data)[0]

    def __setitem__(self, index: int, value: int) -> None:
        os.pwrite(self._fd, _U32.pack(value), 4 * index)


_U32 = struct.Struct("=I")


class _Segment:
    """One open descriptor of the segment. Only this class reads or writes it (never mapped)."""

    fd = -1
    words: _Words | None = None

    def __init__(self, fd: int, *, created: bool) -> None:
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)
        self.created = created
        self.mode = stat.S_IMODE(st.st_mode)
        self.fd = os.dup(fd)  # the caller closes its own
        self.words = _Words(self.fd)

    def read_query(self, dim: int) -> np.ndarray:
        """The first ``dim`` floats of the query: one copy out of the segment (a snapshot)."""
        data = os.pread(self.fd, 4 * dim, OFFSETS["query"])
        if len(data) != 4 * dim:
            raise _SegmentShrank()
        return np.frombuffer(data, np.float32)

    def write_results(self, ids: np.ndarray, scores: np.ndarray) -> None:
        # result_ids and result_scores are adjacent in the struct: one write for both.
        os.pwrite(self.fd, ids.tobytes() + scores.tobytes(), OFFSETS["result_ids"])

    def close(self) -> None:
        """Closes the descriptor. Safe to repeat."""
        self.words = None
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _foreign(st: os.stat_result) -> str | None:
    """Why a segment of this ``stat`` must not be served, or None.

    One of another uid, or writable by group or others, can be written by another user: he
    reads every answer (the top-8 ids and scores over all memories) and controls the requests
    (issue 19, item 4). A readable-by-others segment (the article's 0666 minus a 022 umask) is
    the client's choice and is only warned about.
    """
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users write it"
    return None


class SeedCompatServer:
    """Answers the article's ``recall_shm_t`` clients from a Kalos search function.

    All arguments must be named. ``search`` is called from the server's own thread with a
    checked, unit-norm ``float32[1, dim]`` query; it must do its own locking. ``stats`` is a
    dict of counters (requests, served, errors, last_error, hidden_ids, stale_dropped,
    attaches, ...) written by the server thread and safe to read from any thread.
    """

    _thread: threading.Thread | None = None
    _segment: _Segment | None = None

    def __init__(
        self,
        *,
        search: SearchFn,
        dim: int,
        spin_us: float = 2000.0,
        log: logging.Logger | None = None,
        shm_name: str = DEFAULT_SHM_NAME,
    ) -> None:
        if not callable(search):
            raise InvalidArgument(f"search must be callable, got {type(search).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not 1 <= dim <= MAX_QUERY_DIM:
            raise InvalidArgument(
                f"dim={dim!r}: the seed protocol carries queries of 1..{MAX_QUERY_DIM} floats, "
                "so a store of this dimension cannot be served through it"
            )
        spin_us = float(spin_us)
        if not math.isfinite(spin_us) or spin_us < 0:
            raise InvalidArgument(f"spin_us={spin_us!r} must be a finite number >= 0")
        if not os.path.isdir(_SHM_DIR):
            raise InvalidArgument(f"seed compat needs POSIX shared memory under {_SHM_DIR} (Linux)")
        self.shm_name = shm_name
        self.path = segment_path(shm_name)
        self.dim = int(dim)
        self.spin_s = spin_us * 1e-6
        self._search = search
        self._log = log or logging.getLogger("kalos.server.seed_compat")
        self._throttled = _Throttle(self._log)
        self._running = False
        self._stop_event = threading.Event()
        self._lock = threading.Lock()  # start/stop
        self._seen_memory_count: int | None = None
        # Results are built here, then copied into the segment in one go.
        self._out_ids = np.full(MAX_RESULT_ITEMS, MISSING_ID, np.int32)
        self._out_scores = np.full(MAX_RESULT_ITEMS, -np.inf, np.float32)
        self.stats: dict[str, object] = {
            "requests": 0,  # every raised ready flag picked up
            "served": 0,  # answered with results (result_count may still be < 8)
            "errors": 0,  # answered with result_count = 0 because the request was bad
            "last_error": None,
            "hidden_ids": 0,  # items skipped because their id does not fit in int32
            "stale_dropped": 0,  # answers not published because the client restarted meanwhile
            "internal_errors": 0,  # unexpected exceptions in the server loop (a bug)
            "attaches": 0,
            "shrunk": 0,  # the segment was truncated under a request (answer dropped, re-attached)
            "segment_created": False,  # whether the current segment was created by Kalos
        }

    def __repr__(self) -> str:
        state = "running" if self._running else "stopped"
        return f"SeedCompatServer({self.shm_name!r}, dim={self.dim}, {state})"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the background thread. An existing segment this uid cannot write is an error."""
        with self._lock:
            if self._thread is not None:
                raise InvalidArgument(f"{self!r} was already started")
            try:
                st = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                why = _foreign(st) if stat.S_ISREG(st.st_mode) else "it is not a regular file (a symlink?)"
                if why is not None:
                    raise InvalidArgument(f"{self.path} exists and {why}: {_REFUSAL_REMEDY}")
                if not os.access(self.path, os.R_OK | os.W_OK):
                    raise InvalidArgument(
                        f"{self.path} exists (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}) "
                        f"and uid {os.getuid()} cannot read and write it; run kalos as that user "
                        "or remove the segment"
                    )
            self._running = True
            self._thread = threading.Thread(target=self._run, name=f"kalos-seed-compat{self.shm_name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops and joins the thread and unmaps the segment. Never unlinks. Idempotent."""
        with self._lock:
            self._running = False
            self._stop_event.set()
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join()
            self._close_segment()

    def __enter__(self) -> SeedCompatServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close_segment(self) -> None:
        seg, self._segment = self._segment, None
        if seg is not None:
            try:
                seg.close()
            except BufferError:  # a view escaped; the GC unmaps it later
                self._log.warning("seed compat: %s still has views; left for the garbage collector", self.path)

    # -- setup: finding the segment (not the hot path) -------------------------------------

    def _attach(self) -> _Segment | None:
        """Opens the segment, or creates it; waits while it is too short. None when stopping."""
        while self._running:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                seg = self._create()
                if seg is not None:
                    return seg
                continue  # the client created it in between: open that one
            except OSError as e:  # EACCES, ELOOP (a symlink), ...
                self.stats["last_error"] = f"cannot open {self.path}: {e}"
                self._note_error("attach", f"cannot open {self.path}: {e}; retrying")
                self._stop_event.wait(100 * _ATTACH_POLL_S)
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    self.stats["last_error"] = f"{self.path} is not a regular file"
                    self._note_error("attach", f"{self.path} is not a shared-memory segment; retrying")
                    self._stop_event.wait(100 * _ATTACH_POLL_S)
                    continue
                why = _foreign(st)
                if why is not None:
                    # Never served, never mapped: it is another user's to read and to shrink.
                    self.stats["last_error"] = f"refused {self.path}: {why}"
                    self._note_error("foreign", f"refusing {self.path}: {why}: {_REFUSAL_REMEDY}")
                    self._stop_event.wait(1000 * _ATTACH_POLL_S)
                    continue
                if st.st_size < SEGMENT_SIZE:
                    # The client is between shm_open(O_CREAT) and ftruncate: wait for it.
                    self._throttled(
                        logging.INFO, "short",
                        "seed compat: %s is %d bytes, waiting for the client to size it to %d",
                        self.path, st.st_size, SEGMENT_SIZE,
                    )
                    self._stop_event.wait(_ATTACH_POLL_S)
                    continue
                if st.st_mode & 0o044:
                    self._throttled(
                        logging.WARNING, "readable",
                        "seed compat: %s (mode %04o) is readable by other users: they can read every "
                        "query and answer; create it with mode 0600", self.path, stat.S_IMODE(st.st_mode),
                    )
                try:
                    # The client's file is sparse: reserve its pages, so that a full /dev/shm is
                    # not a SIGBUS in the client at its next touch (ours cannot fault: no mapping).
                    os.posix_fallocate(fd, 0, SEGMENT_SIZE)
                except OSError as e:
                    self._throttled(logging.WARNING, "reserve", "seed compat: cannot reserve %s: %s", self.path, e)
                seg = _Segment(fd, created=False)
            finally:
                os.close(fd)  # the segment keeps its own descriptor
            self._log.info("seed compat: attached to the existing %s (mode %04o, left as is)", self.path, seg.mode)
            return seg
        return None

    def _create(self) -> _Segment | None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            return None
        try:
            os.fchmod(fd, 0o600)  # exactly owner-only, whatever the umask
            os.ftruncate(fd, SEGMENT_SIZE)
            try:
                # Pages reserved now: a full /dev/shm is this clear error, not a SIGBUS in the
                # article's client when it touches the page (issue 19, item 2).
                os.posix_fallocate(fd, 0, SEGMENT_SIZE)
            except OSError as e:
                raise InvalidArgument(
                    f"cannot reserve {SEGMENT_SIZE} bytes for {self.path}: {e.strerror}; free space in {_SHM_DIR}"
                ) from None
            seg = _Segment(fd, created=True)
        except BaseException:
            os.close(fd)
            unlink_segment(self.shm_name)  # our own half-made segment
            raise
        os.close(fd)
        seg.words[_VERSION] = VERSION
        full_fence()  # a reader that sees the magic sees the version
        seg.words[_MAGIC] = MAGIC
        self._log.info("seed compat: created %s (mode 0600, %d bytes)", self.path, SEGMENT_SIZE)
        return seg

    def _segment_replaced(self, seg: _Segment) -> bool:
        """True when the path no longer names a full-size copy of the mapped segment."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            self._log.info("seed compat: %s was unlinked; creating or finding a new one", self.path)
            return True
        if (st.st_dev, st.st_ino) != seg.identity:
            self._log.info("seed compat: %s was recreated (new inode); re-attaching", self.path)
            return True
        if st.st_size < SEGMENT_SIZE:
            # Reads past the new end come back short: let go and wait for a resize.
            self._log.warning("seed compat: %s shrank to %d bytes; re-attaching", self.path, st.st_size)
            return True
        return False

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            try:
                seg = self._attach()
                if seg is None:
                    break
                self._segment = seg
                self.stats["attaches"] += 1
                self.stats["segment_created"] = seg.created
                self._serve(seg)
            except _SegmentShrank:
                self.stats["shrunk"] += 1
                self._throttled(logging.WARNING, "shrunk", "seed compat: %s shrank below %d bytes during a request; "
                                "re-attaching", self.path, SEGMENT_SIZE)
            except KalosError as e:  # a condition with its own message (a full /dev/shm): no traceback
                self.stats["last_error"] = str(e)
                self._note_error("setup", f"{e}; retrying")
                self._stop_event.wait(1.0)
            except Exception as e:  # never let the thread die: log, back off, re-attach
                self.stats["internal_errors"] += 1
                self.stats["last_error"] = f"internal: {e!r}"
                self._throttled(logging.ERROR, "internal", "seed compat: unexpected error, re-attaching to %s",
                                self.path, exc_info=True)
                self._stop_event.wait(0.1)
            finally:
                seg = None
                self._close_segment()

    def _serve(self, seg: _Segment) -> None:
        """Sweeps ``ready`` until stopped or the segment is replaced: spin while hot, then sleep."""
        words = seg.words
        spin_s = self.spin_s
        monotonic, sched_yield, sleep = time.monotonic, os.sched_yield, time.sleep
        last_request = monotonic()
        next_check = last_request + _IDLE_CHECK_S
        sleep_s = _SLEEP_MIN_S
        while self._running:
            if words[_READY] != 0:
                self._serve_one(seg)
                last_request = monotonic()
                sleep_s = _SLEEP_MIN_S
                continue
            now = monotonic()
            if now - last_request < spin_s:
                sched_yield()  # hot: sweep again at once (this also lets other threads have the GIL)
                continue
            if now >= next_check:
                if self._segment_replaced(seg):
                    return
                next_check = now + _IDLE_CHECK_S
            sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _SLEEP_MAX_S if now - last_request < _DEEP_IDLE_S else _DEEP_SLEEP_S)

    def _serve_one(self, seg: _Segment) -> None:
        words = seg.words
        ready = words[_READY]
        # Acquire. The client stored query, query_dim and request_id before its release-store
        # of ready = 1. On x86-64 (TSO) loads are not reordered with older loads, so once we
        # have seen ready the payload loads below see the client's data; on aarch64 loads may
        # be reordered, and the fence (DMB ISH) between the ready load and the payload loads is
        # what forbids reading a query older than the flag.
        full_fence()
        request_id = words[_REQUEST_ID]
        magic = words[_MAGIC]
        version = words[_VERSION]
        query_dim = words[_QUERY_DIM]
        memory_count = words[_MEMORY_COUNT]
        # Clear ready before anything else is written (the fix of the article's lost request).
        words[_READY] = 0
        self.stats["requests"] += 1

        # Entries TOP_K.. of the buffers are -1 / -inf forever; _top_k writes all of 0..TOP_K-1.
        out_ids, out_scores = self._out_ids, self._out_scores
        count = 0
        kind, error = self._check(ready, magic, version, query_dim)
        if error is None:
            # The only read of the query: one copy out of the segment (a consistent snapshot).
            kind, error, unit = _unit_query(seg.read_query(query_dim))
            if unit is not None:
                try:
                    count = self._top_k(unit, out_ids, out_scores)
                except Exception as e:
                    kind, error = "search", f"search failed: {e!r}"
        if error is not None:
            count = 0
            out_ids.fill(MISSING_ID)
            out_scores.fill(-np.inf)
            message = f"request_id={request_id}: {error}"
            self.stats["errors"] += 1
            self.stats["last_error"] = message
            self._note_error(kind, message + "; answered result_count=0")
        else:
            self.stats["served"] += 1
            if memory_count != self._seen_memory_count:
                self._seen_memory_count = memory_count
                self._throttled(
                    logging.INFO, "memory_count",
                    "seed compat: the client says memory_count=%d; Kalos ignores it and searches all "
                    "live memories of the store", memory_count,
                )

        seg.write_results(out_ids, out_scores)
        words[_RESULT_COUNT] = count
        # Release. ready = 0 and the results must be visible before done = 1: the client reads
        # the results only after it sees done == 1 (acquire), and raises ready for its next
        # request only after that. On x86-64 (TSO) stores are not reordered with older stores;
        # on aarch64 they can be, and this fence (DMB ISH) orders both the ready = 0 store and
        # the result stores before the done store. Because our ready = 0 is then visible before
        # the client can see done = 1, its next ready = 1 comes later in the coherence order of
        # that word and cannot be overwritten by ours: no request is lost.
        full_fence()
        # A client that died mid-request and restarted has re-zeroed the segment (magic 0 or
        # request_id changed) or already raised ready for a new request: this answer is not
        # its answer. Drop it rather than publish a done = 1 it would misread or wait on.
        if words[_READY] != 0 or words[_REQUEST_ID] != request_id or words[_MAGIC] != magic:
            self.stats["stale_dropped"] += 1
            self._throttled(
                logging.WARNING, "stale",
                "seed compat: the client re-initialised %s during request_id=%d; answer dropped",
                self.path, request_id,
            )
            return
        words[_DONE] = 1

    def _check(self, ready: int, magic: int, version: int, query_dim: int) -> tuple[str, str | None]:
        """(kind, message) of what is wrong with a request's header; message None when nothing."""
        if ready != 1:
            return "ready", f"ready={ready:#x} (the client must store 1)"
        if magic != MAGIC:
            return "magic", f"magic={magic:#010x}, expected {MAGIC:#010x} (segment not initialised by a seed client?)"
        if version != VERSION:
            return "version", f"version={version}, expected {VERSION}"
        if query_dim != self.dim:
            return "query_dim", f"query_dim={query_dim}, but the store holds {self.dim}-dimensional memories"
        return "", None

    def _top_k(self, unit: np.ndarray, out_ids: np.ndarray, out_scores: np.ndarray) -> int:
        """Best TOP_K representable ids into ``out_*[:TOP_K]``; returns how many (see "Ids beyond int32")."""
        ids, scores = self._checked_search(unit, TOP_K)
        id_list = ids.tolist()
        # The common case, in plain Python (eight numbers): all eight present and representable.
        if min(id_list) >= 0 and max(id_list) <= _INT32_MAX and math.isfinite(sum(scores.tolist())):
            out_ids[:TOP_K] = id_list
            out_scores[:TOP_K] = scores
            return TOP_K
        for k in _WIDEN_K:
            if k != TOP_K:
                ids, scores = self._checked_search(unit, k)
            present = (ids != MISSING_ID) & np.isfinite(scores)
            fits = present & (ids >= 0) & (ids <= _INT32_MAX)
            hidden = present & ~fits
            exhausted = not present.all()  # padding: the store holds fewer than k live items
            if np.count_nonzero(fits) >= TOP_K or exhausted or not hidden.any():
                break
        keep = np.flatnonzero(fits)[:TOP_K]
        count = len(keep)
        out_ids[:count] = ids[keep]
        out_scores[:count] = scores[keep]
        out_ids[count:TOP_K] = MISSING_ID
        out_scores[count:TOP_K] = -np.inf
        hidden_total = int(np.count_nonzero(hidden))
        if hidden_total:
            self.stats["hidden_ids"] += hidden_total
            self._throttled(
                logging.WARNING, "hidden",
                "seed compat: %d item(s) among the best have ids outside int32 (e.g. %d) and are not "
                "reported to seed clients", hidden_total, int(ids[hidden][0]),
            )
        return count

    def _checked_search(self, unit: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``search`` with its results converted once: (int64[k], float32[k])."""
        ids, scores = self._search(unit, k)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        scores = np.asarray(scores, dtype=np.float32).reshape(-1)
        if ids.shape != (k,) or scores.shape != (k,):
            raise ValueError(f"search returned shapes {ids.shape} and {scores.shape}, expected ({k},) each")
        return ids, scores

    def _note_error(self, kind: str, message: str) -> None:
        self._throttled(logging.ERROR, kind, "seed compat: %s", message)


def _unit_query(query32: np.ndarray) -> tuple[str, str | None, np.ndarray | None]:
    """(kind, error, None) for a bad float32 query, else ("", None, unit float32 [1, dim]).

    The norm is taken in float64: no float32 value overflows or underflows when squared there.
    """
    if not np.isfinite(query32).all():  # checked before widening: a NaN would warn in the cast
        return "query", "query holds NaN or infinity", None
    query = query32.astype(np.float64)
    norm = math.sqrt(float(query @ query))
    if norm == 0.0:
        return "query", "query is the zero vector", None
    query *= 1.0 / norm
    return "", None, query.astype(np.float32)[None, :]
