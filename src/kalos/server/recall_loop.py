"""The recall loop: the sweep that finds every pending recall in the slots and answers it.

This is the hot path, where tens of microseconds per pass matter, so it is kept apart from
setup and from the control socket: one object whose collaborators (channel, engine, cohort,
filter cache, expirer, GPU polling) are bound once as its attributes, so that a pass pays one
attribute hop to reach any of them, and nothing here is decided per query that could be
decided once. The filters a request's words describe come from the filter cache
(:mod:`kalos.server.filters`), bound here once: the loop reads it on every request, the control
operations register where clauses into it.

The loop runs in the thread that called ``Sidecar.serve_forever`` and holds the sidecar's
``_state_lock`` for each pass (the writers take it to change the engine), never the channel's
slot-table lock across a search.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from kalos.engine import Engine, Filter
from kalos.errors import InvalidQuery, KalosError, ServerError
from kalos.ipc import sync
from kalos.ipc.channel import SidecarChannel
from kalos.ipc.protocol import Layout, Op, RequestFlag, SlotView
from kalos.server.cohort import Cohort
from kalos.server.expirer import Expirer
from kalos.server.filters import NOTHING as _NOTHING
from kalos.server.filters import FilterCache, FilterKey
from kalos.server.metrics import Metrics
from kalos.server.slot_polling import SlotPolling
from kalos.server.state_lock import StateLock
from kalos.validation import row_scales

__all__ = ["RecallLoop"]

# The sidecar's one logger, whichever of its modules logs.
log = logging.getLogger("kalos.server.sidecar")
# Plain ints: IntFlag arithmetic costs microseconds, and these are tested on every request.
_ALL_NAMESPACES = int(RequestFlag.ALL_NAMESPACES)
_HAS_SINCE = int(RequestFlag.HAS_SINCE)
_HAS_UNTIL = int(RequestFlag.HAS_UNTIL)
_HAS_WHERE = int(RequestFlag.HAS_WHERE)
_KNOWN_FLAGS = _ALL_NAMESPACES | _HAS_SINCE | _HAS_UNTIL | _HAS_WHERE
# The flags a single recall may carry and still take the columns' path (_answer_singles).
_SINGLE_FLAGS = _ALL_NAMESPACES | _HAS_WHERE
_RECALL = int(Op.RECALL)
_PING = int(Op.PING)
# The longest the idle sweep looks at the slots before it checks again whether it must stop
# (a long --spin-us is looked through in slices of this).
_LOOK_S = 0.005
# While the GPU polls the slots, the longest the sweep waits for the kernel's news before it
# looks anyway (expiries, a stop).
_KERNEL_WAIT_S = 0.001

_NO_FILTER = Filter()
_NO_ROWS = np.empty((0, 0), np.float32)
_NO_SCALES = np.empty(0, np.float64)


def _alike_row(column: np.ndarray, slots: np.ndarray, scratch: np.ndarray) -> np.ndarray | None:
    """The row of ``column`` (a SlotColumns view) that every one of ``slots`` holds, read once
    (into ``scratch``, one row of the column's dtype), or None when they differ: natively
    (kalos.ipc.sync.same_rows), else one comparison of bytes objects (an elementwise NumPy
    comparison and its reduction cost several times more on the few hundred words a crowd's pass
    reads). Read once, so that a client rewriting its words meanwhile cannot make the row returned
    differ from the rows compared (and its k or flags apply to the others' requests)."""
    if sync.same_rows is not None:
        return scratch if sync.same_rows(column, slots, scratch) else None
    rows = column[slots]  # a fresh C-ordered copy
    raw = rows.tobytes()
    if raw != raw[: rows.nbytes // len(rows)] * len(rows):
        return None
    scratch[:] = rows[0]
    return scratch


def _search_failed(exc: Exception) -> ServerError:
    """What a client hears of an engine failure (a bug, logged where it was caught)."""
    return ServerError(f"search failed: {type(exc).__name__}: {exc}")


def _pick(generations: np.ndarray | None, at: np.ndarray) -> np.ndarray | None:
    """The slots' generations at ``at`` (None: the channel checks none)."""
    return None if generations is None else generations[at]


@dataclasses.dataclass(slots=True)
class _Flight:
    """A crowd's pass queued on the GPU: what publishing its answers needs once it lands."""

    slots: np.ndarray
    seqs: np.ndarray
    generations: np.ndarray | None
    ks: np.ndarray
    search: Any  # the engine's AttachedPass: done(), finish() -> scales
    started: float


@dataclasses.dataclass(slots=True)
class _Deferred:
    """One filter group's search in a mixed pass, run with the others' in one engine call
    (:meth:`Engine.search_groups`): its normalised queries, k, filter, what writes the answers
    into the slots (returning how many to count) and what answers every member with an error."""

    queries: np.ndarray
    k: int
    flt: Filter
    # Returns the queries to count now: a single recall group's that were answered; 0 for
    # requests read slot by slot, which _answer_each counted as it read them.
    deliver: Callable[[np.ndarray, np.ndarray], int]
    fail: Callable[[Exception], None]


class RecallLoop:
    """Answers the recalls in the slots until the sidecar stops: :meth:`run`.

    Each pass finds every pending request (one per client at most), answers them as one engine
    pass per filter (single recalls are read from the slots' columns at once, so 64 waiting
    agents cost one pass, not 64), and publishes the answers.

    With a GPU engine that reads the slots (zero copy), a crowd's pass is queued on the GPU and
    the sweep goes on: it gathers the next crowd and queues its pass behind the first, then
    publishes each as it lands. The host's share of a pass (reading the slots, launching,
    publishing) then overlaps the device's, instead of adding to it.
    """

    def __init__(self, *, engine: Engine, channel: SidecarChannel, layout: Layout, metrics: Metrics,
                 cohort: Cohort, filters: FilterCache, polling: SlotPolling, expirer: Expirer,
                 state_lock: StateLock, stopping: threading.Event, spin_us: float) -> None:
        self.engine = engine
        self.channel = channel
        self.layout = layout
        self.metrics = metrics
        self.cohort = cohort
        # Bound once: the pass reads them at one attribute's cost, as it read them off the sidecar.
        self._filter = filters.get
        self._namespaces = filters.namespaces
        self._polling = polling
        self._expire_due = expirer.expire_due
        self._expiry_near = expirer.near
        self._state_lock = state_lock
        self._stopping = stopping
        self._spin_s = spin_us / 1e6
        self.zero_copy = False  # the engine reads the queries in the slots: attach()
        self._flights: collections.deque[_Flight] = collections.deque()  # queued passes, oldest first
        self._in_flight = np.zeros(layout.n_slots, dtype=bool)  # their slots (not pending again)
        # The namespace each slot named last (its bytes and length words) and its id: -1 none yet.
        columns = channel.columns
        self._slot_name = np.zeros(layout.n_slots, columns.namespace.dtype)
        self._slot_name_len = np.zeros(layout.n_slots, columns.namespace_len.dtype)
        self._slot_namespace = np.full(layout.n_slots, -1, np.int64)
        # One row of each column _uniform_key compares across a crowd's slots, read into these.
        self._alike = {name: np.empty(getattr(columns, name).shape[1:] or (1,), getattr(columns, name).dtype)
                       for name in ("kind", "where_handle", "namespace_words", "namespace_len")}
        # The k of every slot of a uniform crowd (_uniform_key), sliced from one array per k:
        # read-only views, made once instead of an array per pass.
        self._k_columns = [np.full(layout.n_slots, k, np.uint32) for k in range(layout.max_k + 1)]
        for column in self._k_columns:
            column.flags.writeable = False

    # -- zero copy -----------------------------------------------------------------------

    def attach(self, buffer: Any) -> bool:
        """Lets a GPU engine read the queries in the slots of ``buffer`` (the segment) and write
        the answers into them; whether it does now."""
        self.zero_copy = False
        if not self.engine.supports_attached_host:
            return False
        layout = self.layout
        base = np.array([layout.slot_offset(s) for s in range(layout.n_slots)], np.int64)
        # Element offsets (float32 queries and scores, int64 ids) of each slot's row 0.
        self._query_at = (base + layout.queries_offset) // 4
        self._ids_at = (base + layout.ids_offset) // 8
        self._scores_at = (base + layout.scores_offset) // 4
        try:
            self.engine.attach_host(buffer)
            # A crowd's pass then names its slots, each checked once here (search_places_start).
            self.engine.attach_places(self._query_at, self._ids_at, self._scores_at, layout.max_k)
        except Exception as exc:  # noqa: BLE001 - serving through host copies still works
            log.warning("zero-copy off: the GPU engine could not attach the shared segment (%s)", exc)
            self.engine.detach_host()
            return False
        self.zero_copy = True
        return True

    def detach(self) -> None:
        """Unpins the segment (``_state_lock`` held, the GPU's polling stopped), before it is unmapped."""
        self._land_all()
        if self.zero_copy:
            self.engine.detach_host()
            self.zero_copy = False

    def warm(self) -> None:
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
                if q > 1:  # a crowd's passes queued two deep: each staging area's kind of pass
                    passes = [self.engine.search_attached_start(self._query_at[:q], None, self._ids_at[:q],
                                                                self._scores_at[:q], k, flt) for _ in range(2)]
                    for queued in passes:
                        queued.finish()
            self.channel.stamp_heartbeat()
        self.channel.columns.query_row0[:] = 0

    # -- the sweep -----------------------------------------------------------------------

    def run(self) -> None:
        """Sweeps the slots in this thread until the sidecar stops."""
        channel = self.channel
        streams = self.engine.supports_streams
        if streams:
            self.engine.bind_stream()  # this thread's GPU work all goes to the engine's stream
        try:
            self._sweep_until_stopped(channel)
        finally:
            with self._state_lock:
                self._land_all()  # the clients of passes in flight get their answers
            if streams:
                self.engine.unbind_stream()

    def _sweep_until_stopped(self, channel: SidecarChannel) -> None:
        spin_s = self._spin_s
        cohort = self.cohort
        polling = self._polling
        clock = time.perf_counter
        last_work = clock()
        while not self._stopping.is_set():
            with self._state_lock.for_sweep():  # (a writer waiting now goes first)
                server = polling.server
                # (Before this look: what the kernel writes during it ends the wait after it.)
                kernel_seen = polling.kernel_words()
                # While the GPU polls, it answers single recalls itself; the sweep takes what it
                # hands over, and wakes the clients of its answers that slept.
                serving = polling.running()
                if serving and self._expiry_near():  # (the kernel would serve a row past its expiry)
                    polling.pause()
                    serving = False
                flights = self._flights
                if flights:
                    self._land_ready()
                busy = self._in_flight if flights else None
                slots, seqs = channel.pending(server.handed if serving else None, busy)
                if len(slots) and not serving:
                    # With a pass in flight, gathering stops once it lands: the GPU would idle.
                    slots, seqs = cohort.gather(slots, seqs, lambda: channel.pending(None, busy), channel.requested,
                                                channel.active, stop=flights[0].search.done if flights else None)
                    if flights:
                        self._land_ready()  # (what landed meanwhile is published before the next launch)
                if len(slots):
                    self._answer(slots, seqs, channel.pending_generations)
                if serving:
                    channel.wake_answered()
                elif polling.server is not None and len(slots) and not self._expiry_near():
                    polling.start(self._namespaces)
            if len(slots):
                last_work = clock()
            elif flights:
                # A pass in flight: look again soon to land it, the core to the clients meanwhile.
                last_work = clock()
                os.sched_yield()
            elif serving:
                # The GPU answering by itself: look again once it has news (top up its rounds,
                # take what it hands over, wake its answers' sleepers), without the GIL meanwhile.
                last_work = clock()
                polling.wait_for_kernel(kernel_seen, _KERNEL_WAIT_S)
            elif clock() - last_work < spin_s:
                # Hot: watch the slots until the spin window ends, with the GIL released, so
                # that a control thread (a hello, an embed, a get) runs at once instead of after
                # the interpreter's 5 ms switch interval.
                channel.spin_for_request(min(last_work + spin_s - clock(), _LOOK_S), self._in_flight)
            else:
                channel.sleep(timeout_s=0.5)
                last_work = clock() - spin_s  # spin again only once a request has arrived

    def search_all(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Search over every namespace (the seed-compat protocol has no filters)."""
        with self._state_lock:
            self._expire_due()
            return self.engine.search(queries, k, Filter())

    # -- answering -----------------------------------------------------------------------

    def _answer(self, slots: np.ndarray, seqs: np.ndarray, generations: np.ndarray | None = None) -> None:
        """Answers the requests in ``slots`` (all of them, errors included), then publishes;
        or queues their pass on the GPU, published when it lands (:meth:`_land_ready`).

        Single recalls (one query, all namespaces or one, no time window: what an agent sends)
        are read from the slots' columns in a few NumPy calls and searched as one batch per
        namespace (on a zero-copy GPU engine without GPU polling, one queued batch whatever their
        namespaces: :meth:`_queue_singles`), so a pass costs about the same whether 1 or 64 clients are
        waiting. Anything else (batches, time windows, pings, malformed requests) is read slot
        by slot.
        """
        self._expire_due()
        started = time.perf_counter()
        if len(slots) > 1:
            uniform = self._uniform_key(slots)
            if uniform is not None:
                if self._answer_uniform(slots, seqs, generations, started, *uniform):
                    return
            elif self.zero_copy and self._polling.server is None:
                slots, seqs, generations = self._queue_singles(slots, seqs, generations, started)
                if not len(slots):
                    return
        self._land_all()  # (this pass is answered here and now: those queued before it first)
        if len(slots) == 1:  # one client: scalar reads cost less than the columns' NumPy calls
            n_queries = self._searching(self._answer_each, slots)
        else:
            n_queries = self._searching(self._answer_mixed, slots)
        self._publish(slots, seqs, generations, n_queries, started)

    def _publish(self, slots: np.ndarray, seqs: np.ndarray, generations: np.ndarray | None, n_queries: int,
                 started: float) -> None:
        self.channel.publish(slots, seqs, generations)
        self.cohort.answered(slots)
        if n_queries:
            self.metrics.record(n_queries, time.perf_counter() - started)

    def _uniform_key(self, slots: np.ndarray) -> tuple[FilterKey, np.ndarray] | None:
        """The usual crowd: when every slot holds the same kind of single recall (op, k, flags,
        where handle and namespace alike, told in a few comparisons of whole words), the key of
        their filter and their k; None when the slots differ (:meth:`_answer_mixed`)."""
        columns = self.channel.columns
        scratch = self._alike
        kind = _alike_row(columns.kind, slots, scratch["kind"])  # (op, k, n_queries, flags)
        if kind is None:
            return None
        op, k, n_queries, flags = kind.tolist()
        if op != _RECALL or n_queries != 1 or not 1 <= k <= self.layout.max_k or flags & ~_SINGLE_FLAGS:
            return None
        handle = 0
        if flags & _HAS_WHERE:
            handles = _alike_row(columns.where_handle, slots, scratch["where_handle"])
            if handles is None:
                return None
            handle = int(handles[0])
        name = b""
        if not flags & _ALL_NAMESPACES:
            words = _alike_row(columns.namespace_words, slots, scratch["namespace_words"])
            if words is None:
                return None
            lengths = _alike_row(columns.namespace_len, slots, scratch["namespace_len"])
            if lengths is None:
                return None
            name = words.tobytes().rstrip(b"\x00")  # (as the namespace column reads it)
            if len(name) != int(lengths[0]):
                return None  # a length word that disagrees with the bytes: read as each slot says
        return (flags, name, None, None, handle), self._k_columns[k][: len(slots)]

    def _answer_uniform(self, slots: np.ndarray, seqs: np.ndarray, generations: np.ndarray | None, started: float,
                        key: FilterKey, ks: np.ndarray) -> bool:
        """Answers a crowd of one kind (:meth:`_uniform_key`) as one group, or queues its pass
        on the GPU (zero copy, no GPU polling, no where clause); False, nothing answered, when
        passes are in flight and this one cannot be queued behind them."""
        try:
            flt = self._filter(key)
        except KalosError as exc:
            self._answer_errors(slots, exc)
            self._publish(slots, seqs, generations, 0, started)
            return True
        if flt is _NOTHING:
            self._publish(slots, seqs, generations, self._answer_nothing(slots, ks), started)
            return True
        if self.zero_copy and self._polling.server is None and flt.where is None:
            self._queue_places(slots, seqs, generations, ks, started, int(ks[0]), flt)
            return True
        if self._flights:
            return False
        self._publish(slots, seqs, generations, self._searching(self._answer_group, slots, ks, flt), started)
        return True

    def _single_recalls(self, slots: np.ndarray, allowed_flags: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The k and flags of ``slots``, read once, and which of them are single recalls (one
        query, a k in range) that carry no flag but ``allowed_flags``."""
        columns = self.channel.columns
        ks = columns.k[slots]
        flags = columns.flags[slots]
        single = ((columns.op[slots] == _RECALL) & (columns.n_queries[slots] == 1) & (ks >= 1)
                  & (ks <= self.layout.max_k) & ((flags | allowed_flags) == allowed_flags))
        return ks, flags, single

    def _queue_singles(self, slots: np.ndarray, seqs: np.ndarray, generations: np.ndarray | None,
                       started: float) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Queues one GPU pass (zero copy, no GPU polling) for the single recalls of a crowd
        that differ in namespace and k (agents that each keep their own memories): each query
        is searched in its own namespace (``search_places_start``'s ``namespaces``), where the
        mixed path would scan the rows once per namespace. A namespace that holds nothing, or a
        malformed name (its error), is answered at once. Returns the rest of the crowd (other
        requests, where clauses, time windows, a name whose length word disagrees with its
        bytes) for the mixed path."""
        columns = self.channel.columns
        ks, flags, plain = self._single_recalls(slots, _ALL_NAMESPACES)
        ns_ids = np.full(len(slots), -1, np.int64)  # (all namespaces)
        now = np.zeros(len(slots), dtype=bool)  # answered here: a namespace that holds nothing, or an error
        answered_now = 0
        named = np.flatnonzero(plain & ((flags & _ALL_NAMESPACES) == 0))
        if len(named):
            at = slots[named]
            names = columns.namespace[at]  # bytes, trailing NULs dropped: read once
            # The name each slot named last and its id: agents keep to their own namespace, and
            # an id, once given, is the name's for the sidecar's life.
            known = ((self._slot_namespace[at] >= 0) & (self._slot_name[at] == names)
                     & (self._slot_name_len[at] == columns.namespace_len[at]))
            ns_ids[named[known]] = self._slot_namespace[at[known]]
            resolved: dict[bytes, Filter | KalosError] = {}  # this pass's names not remembered
            nothing: list[int] = []
            for i in np.flatnonzero(~known).tolist():
                slot, name, member = int(at[i]), bytes(names[i]), int(named[i])
                if len(name) != int(columns.namespace_len[slot]):
                    plain[member] = False  # a length word that disagrees with the bytes: read as the slot says
                    continue
                flt = resolved.get(name)
                if flt is None:
                    try:
                        flt = self._filter((0, name, None, None, 0))
                    except KalosError as exc:  # a malformed name
                        flt = exc
                    resolved[name] = flt
                if isinstance(flt, KalosError):
                    self._answer_error(self.channel.slots[slot], flt)
                    now[member] = True
                elif flt is _NOTHING:
                    nothing.append(member)
                else:
                    ns_ids[member] = flt.namespace
                    self._slot_name[slot], self._slot_name_len[slot] = name, len(name)
                    self._slot_namespace[slot] = flt.namespace
            if nothing:
                now[nothing] = True
                answered_now += self._answer_nothing(slots[nothing], ks[nothing])
        if now.any():
            done = np.flatnonzero(now)
            self._publish(slots[done], seqs[done], _pick(generations, done), answered_now, started)
        queued = np.flatnonzero(plain & ~now)
        if len(queued):
            self._queue_places(slots[queued], seqs[queued], _pick(generations, queued), ks[queued], started,
                               int(ks[queued].max()), _NO_FILTER, ns_ids[queued])
        rest = np.flatnonzero(~plain)
        return slots[rest], seqs[rest], _pick(generations, rest)

    def _queue_places(self, slots: np.ndarray, seqs: np.ndarray, generations: np.ndarray | None, ks: np.ndarray,
                      started: float, k: int, flt: Filter, namespaces: np.ndarray | None = None) -> None:
        """Queues the GPU pass of the single recalls in ``slots`` (``search_places_start``),
        published when it lands; a pass the engine refuses answers each client with the error."""
        try:
            search = self.engine.search_places_start(slots, k, flt, namespaces=namespaces)
        except Exception as exc:  # a bug, not the caller's fault: report it, keep serving
            log.exception("engine search failed")
            self._answer_errors(slots, _search_failed(exc))
            self._publish(slots, seqs, generations, 0, started)
            return
        self._in_flight[slots] = True
        self._flights.append(_Flight(slots, seqs, generations, ks, search, started))

    # -- passes in flight ----------------------------------------------------------------

    def _land(self, flight: "_Flight") -> None:
        """Completes and publishes the answers of a pass that was in flight."""
        slots, ks = flight.slots, flight.ks
        columns = self.channel.columns
        try:
            scales = flight.search.finish()
        except Exception as exc:  # a bug, not the caller's fault: report it, keep serving
            log.exception("engine search failed")
            self._answer_errors(slots, _search_failed(exc))
            answered = 0
        else:
            usable = np.isfinite(scales) & (scales > 0)
            good, good_ks = slots, ks
            if not usable.all():
                self._refuse_queries(slots[~usable], columns.query_row0[slots[~usable]])
                good, good_ks = slots[usable], ks[usable]
            columns.n_results[good] = good_ks
            columns.status[good] = 0
            answered = len(good)
        self._in_flight[slots] = False
        self._publish(slots, flight.seqs, flight.generations, answered, flight.started)

    def _land_ready(self) -> None:
        """Publishes the passes in flight that the GPU has finished, oldest first."""
        flights = self._flights
        while flights and flights[0].search.done():
            self._land(flights.popleft())

    def _land_all(self) -> None:
        """Waits for every pass in flight and publishes it."""
        flights = self._flights
        while flights:
            self._land(flights.popleft())

    def _searching(self, answer: Callable[..., int], *args: Any) -> int:
        """``answer(*args, deferred)``, then the searches it left: a zero-copy engine's are run as
        they are read (``deferred`` None); a host engine's groups (namespaces, time windows, where
        clauses) are left in ``deferred`` and run in one engine call (:meth:`_run_deferred`),
        which reads the rows once for all of them where it can. Returns the queries answered."""
        if self.zero_copy:
            return answer(*args, None)
        deferred: list[_Deferred] = []
        n_queries = answer(*args, deferred)
        return (n_queries + self._run_deferred(deferred)) if deferred else n_queries

    def _answer_mixed(self, slots: np.ndarray, deferred: list[_Deferred] | None) -> int:
        """Requests of several kinds: single recalls grouped (:meth:`_answer_singles`), the rest
        read slot by slot (``deferred``: see :meth:`_searching`)."""
        ks, flags, single = self._single_recalls(slots, _SINGLE_FLAGS)
        n_queries = self._answer_singles(slots[single], ks[single], flags[single], deferred) if single.any() else 0
        if not single.all():
            n_queries += self._answer_each(slots[~single], deferred)
        return n_queries

    def _run_deferred(self, deferred: list[_Deferred]) -> int:
        """Runs the pass's deferred searches in one engine call and delivers each group's
        answers; returns what they count. Whatever fails (the call, or one group's answers)
        fails only the groups it concerns, as when each group was searched alone."""
        try:
            answers = self.engine.search_groups([(d.queries, d.k, d.flt) for d in deferred])
            if len(answers) != len(deferred):
                raise ServerError(f"the engine answered {len(answers)} groups of {len(deferred)}")
        except Exception as exc:  # a bug, not the caller's fault: each group alone, so that it fails alone
            if len(deferred) == 1:
                log.exception("engine search failed")
                deferred[0].fail(exc)
                return 0
            log.exception("engine search of a pass's groups failed; searching them one by one")
            answers = [None] * len(deferred)
        counted = 0
        for d, answer in zip(deferred, answers):
            try:
                ids, scores = answer if answer is not None else self.engine.search(d.queries, d.k, d.flt)
                counted += d.deliver(ids, scores)
            except Exception as exc:  # a bug, not the caller's fault: report it, keep serving
                log.exception("engine search failed")
                d.fail(exc)
        return counted

    def _answer_singles(self, slots: np.ndarray, ks: np.ndarray, flags: np.ndarray,
                        deferred: list[_Deferred] | None, handle: int | None = None) -> int:
        """Single recalls grouped by where clause (``handle``: the one of these slots) and
        namespace, one engine pass per group (``deferred``: see :meth:`_searching`); returns how
        many were answered."""
        columns = self.channel.columns
        if handle is None:
            with_where = (flags & _HAS_WHERE) != 0
            if with_where.any():  # one group per where handle, each grouped by namespace below
                answered = 0
                where_at = np.flatnonzero(with_where)
                handles = columns.where_handle[slots[where_at]]
                for h in np.unique(handles).tolist():
                    sub = where_at[handles == h]
                    answered += self._answer_singles(slots[sub], ks[sub], flags[sub], deferred, int(h))
                if not with_where.all():
                    plain = ~with_where
                    answered += self._answer_singles(slots[plain], ks[plain], flags[plain], deferred)
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
                    groups.append((slots[everywhere], ks[everywhere], self._filter(key)))
                except KalosError as exc:
                    self._answer_errors(slots[everywhere], exc)
        named, named_ks = slots[~everywhere], ks[~everywhere]
        if len(named):
            names = columns.namespace[named]  # bytes, trailing NULs dropped
            odd = columns.namespace_len[named] != np.char.str_len(names)
            if odd.any():  # a length word that disagrees with the bytes: read as the slot says
                answered += self._answer_each(named[odd], deferred)
                named, named_ks, names = named[~odd], named_ks[~odd], names[~odd]
            if not len(names):
                unique, inverse = names, np.zeros(0, dtype=np.intp)
            elif (names == names[0]).all():  # the usual crowd: one namespace, no sort needed
                unique, inverse = names[:1], np.zeros(len(names), dtype=np.intp)
            else:
                unique, inverse = np.unique(names, return_inverse=True)
            for group, name in enumerate(unique.tolist()):
                members = inverse == group
                try:
                    flt = self._filter((wflags, name, None, None, wkey))
                except KalosError as exc:
                    self._answer_errors(named[members], exc)
                    continue
                if flt is _NOTHING:
                    answered += self._answer_nothing(named[members], named_ks[members])
                    continue
                groups.append((named[members], named_ks[members], flt))
        for members, member_ks, flt in groups:
            answered += self._answer_group(members, member_ks, flt, deferred)
        return answered

    def _answer_group(self, slots: np.ndarray, ks: np.ndarray, flt: Filter, deferred: list[_Deferred] | None) -> int:
        """The single recalls of ``slots`` (one filter): searched now on a zero-copy engine, else
        left in ``deferred`` (:meth:`_searching`); returns how many were answered now."""
        if deferred is None:
            return self._search_group(slots, ks, flt)
        self._defer_group(slots, ks, flt, deferred)
        return 0

    def _defer_group(self, slots: np.ndarray, ks: np.ndarray, flt: Filter, deferred: list[_Deferred]) -> None:
        """A host engine's search of the single recalls of ``slots`` (one filter), left in
        ``deferred`` (the queries with no direction are answered now, with their error)."""
        slots, ks, batch = self._single_queries(slots, ks)
        if not len(slots):
            return
        columns = self.channel.columns
        k_max = int(ks.max())

        def deliver(ids: np.ndarray, scores: np.ndarray) -> int:
            columns.ids_row0[slots, :k_max] = ids
            columns.scores_row0[slots, :k_max] = scores
            columns.n_results[slots] = ks
            columns.status[slots] = 0
            return len(slots)

        def fail(exc: Exception) -> None:
            self._answer_errors(slots, _search_failed(exc))

        deferred.append(_Deferred(batch, k_max, flt, deliver, fail))

    def _search_group(self, slots: np.ndarray, ks: np.ndarray, flt: Filter) -> int:
        """A zero-copy engine's search of the single recalls of ``slots`` (one filter) in one
        pass, their answers completed; returns how many were answered (the rest got their error)."""
        try:
            slots, ks = self._search_singles(slots, ks, flt)
        except Exception as exc:  # a bug, not the caller's fault: report it, keep serving
            log.exception("engine search failed")
            self._answer_errors(slots, _search_failed(exc))
            return 0
        columns = self.channel.columns
        columns.n_results[slots] = ks
        columns.status[slots] = 0
        return len(slots)

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
        """One pass over the rows for the single queries in ``slots``, the engine reading them
        from the slots and writing the answers there (zero copy). Returns the slots answered
        and their k (the rest got an error: no direction)."""
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
        # One query: its scale from here, the rows straight from its slot.
        slots, ks, _rows, scales = self._single_rows(slots, ks)
        if len(slots):
            slot = int(slots[0])
            self.engine.search_attached(
                self._query_at[slot : slot + 1], scales, self._ids_at[slot : slot + 1],
                self._scores_at[slot : slot + 1], k_max, flt,
            )
        return slots, ks

    def _single_rows(self, slots: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The slots whose query has a direction, their k, their queries (a copy: what the
        clients wrote, read once) and the queries' scales (float64, as row_scales: the same
        unit row alone or batched); the others get their error."""
        rows = self.channel.columns.query_row0[slots]
        with np.errstate(over="ignore", invalid="ignore"):
            squared = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
        usable = np.isfinite(squared) & (squared > 0)
        if not usable.all():
            self._refuse_queries(slots[~usable], rows[~usable])
            slots, ks, rows, squared = slots[usable], ks[usable], rows[usable], squared[usable]
        return slots, ks, rows, 1.0 / np.sqrt(squared)

    def _single_queries(self, slots: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_single_rows`' slots and k, and their queries as unit float32 rows."""
        slots, ks, rows, scales = self._single_rows(slots, ks)
        return slots, ks, (rows * scales[:, None]).astype(np.float32)

    def _refuse_queries(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Answers each of ``slots`` with the reason its query has no direction."""
        for index, row in zip(slots.tolist(), rows):
            reason = "contains NaN or infinity" if not np.all(np.isfinite(row)) else "is all zeros"
            self._answer_error(self.channel.slots[index],
                               InvalidQuery(f"query 0 {reason}; it has no direction to compare by cosine"))

    def _answer_each(self, slots: np.ndarray, deferred: list[_Deferred] | None) -> int:
        """Requests read slot by slot (batches, time windows, pings, bad words), grouped by
        filter (``deferred``: see :meth:`_searching`); returns the queries answered."""
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
            if deferred is not None:
                deferred.append(self._deferred_copied(members, k_max, flt))
                continue
            try:
                members = self._search_in_place(members, k_max, flt)
            except Exception as exc:  # a bug, not the caller's fault: report it, keep serving
                log.exception("engine search failed")
                self._fail_members(members, exc)
                continue
            self._complete_members(members)
        return n_queries

    def _fail_members(self, members: list, exc: Exception) -> None:
        for view, *_ in members:
            self._answer_error(view, _search_failed(exc))

    @staticmethod
    def _complete_members(members: list) -> None:
        for view, k, _rows, _scales in members:
            view.n_results[0] = k
            view.status[0] = 0

    @staticmethod
    def _copied_batch(members: list) -> np.ndarray:
        """The members' queries, normalised, as one float32 batch."""
        if len(members) == 1:
            _view, _k, rows, scales = members[0]
            batch = rows * scales[:, None]
        else:
            batch = np.concatenate([rows * scales[:, None] for _v, _k, rows, scales in members])
        return batch.astype(np.float32, copy=False)

    @staticmethod
    def _copy_answers(members: list, ids: np.ndarray, scores: np.ndarray) -> None:
        row = 0
        for view, k, rows, _scales in members:
            n = len(rows)
            view.ids[:n, :k] = ids[row : row + n, :k]
            view.scores[:n, :k] = scores[row : row + n, :k]
            row += n

    def _deferred_copied(self, members: list, k_max: int, flt: Filter) -> _Deferred:
        """A host engine's search of the requests read slot by slot (``members``, one filter):
        normalised copies of their queries, the answers copied into their slots; left for
        :meth:`_run_deferred` (their queries were counted when read)."""

        def deliver(ids: np.ndarray, scores: np.ndarray) -> int:
            self._copy_answers(members, ids, scores)
            self._complete_members(members)
            return 0

        return _Deferred(self._copied_batch(members), k_max, flt, deliver, lambda exc: self._fail_members(members, exc))

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

    def _answer_errors(self, slots: np.ndarray, exc: KalosError) -> None:
        """Answers each of ``slots`` with ``exc`` (the caller publishes them)."""
        for index in slots.tolist():
            self._answer_error(self.channel.slots[index], exc)

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
        flt = self._filter(key)
        rows = view.queries[:n]
        if n > 1 and self.zero_copy:
            return op, k, flt, rows, _NO_SCALES  # the GPU engine normalises batches (_search_in_place)
        return op, k, flt, rows, row_scales(rows, what="query", error=InvalidQuery)
