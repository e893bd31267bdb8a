"""Searches in place in an attached host buffer, and the passes of them in flight.

:class:`AttachedSearches` is the part of :class:`~kalos.engine.gpu.engine.TorchEngine` (one of
its bases) that reads queries from a page-locked host buffer, the sidecar's shared segment, and
writes their answers back into it with no host copy: :meth:`TorchEngine.search_attached`, its
queued form :meth:`TorchEngine.search_attached_start` with the handle :class:`AttachedPass`, and
the sweep's crowds (:meth:`TorchEngine.attach_places`, :meth:`TorchEngine.search_places_start`).
The engine keeps its own searches, the staging areas, the CUDA graphs and ``settle``.

Passes in flight
----------------
:meth:`TorchEngine.search_attached_start` queues a search in place and returns at once, so
that the sidecar's sweep prepares (and queues) the next crowd's pass while the GPU runs this
one: the host's share of a pass then hides behind the device's. Two such passes may be in
flight, each with a staging area of its own (the host words the kernels read at run time and
the status words they write); the device-side buffers are shared, which stream order makes
safe. Any other use of the engine finishes them first (:meth:`TorchEngine.settle`). The
sweep's crowds take :meth:`TorchEngine.search_places_start`: the slots' offsets are declared
once (:meth:`TorchEngine.attach_places`) and a pass names its slots, so that the host's share
of a pass (checks, table, header, launch) stays below the device's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

import numpy as np
import torch

from kalos.engine.base import NAMESPACE_DTYPE, Filter
from kalos.engine.gpu.buffers import AttachedHost, HostBuffer, fill_table, register_host_buffer
from kalos.engine.gpu.layout import HEADER, NS_ALL, OWN_NAMESPACES, TAB_WORDS, TABLE
from kalos.engine.gpu.planner import fast_candidates
from kalos.engine.gpu.torch_path import RowSink
from kalos.errors import InvalidArgument, InvalidQuery

__all__ = ["AttachedPass", "AttachedSearches"]

#: The largest namespace id a row can hold (the row table's namespace column).
_NAMESPACE_ID_MAX = np.iinfo(NAMESPACE_DTYPE).max


def _with_namespace(flt: Filter, ns_id: int) -> Filter:
    """``flt`` (which names no namespace) in namespace ``ns_id`` (-1: all of them)."""
    return flt if ns_id < 0 else dataclasses.replace(flt, namespace=ns_id)


def _each_namespace(namespaces: np.ndarray, flt: Filter) -> Iterator[tuple[np.ndarray, Filter]]:
    """(members, filter) per namespace id in ``namespaces`` (-1: all namespaces): the indices of
    its queries, and ``flt`` (which names no namespace) in it. For queries in namespaces of
    their own that one pass cannot take: they are searched namespace by namespace."""
    unique, inverse = np.unique(namespaces, return_inverse=True)
    for at, ns_id in enumerate(unique.tolist()):
        yield np.flatnonzero(inverse == at), _with_namespace(flt, ns_id)


class AttachedPass:
    """A search in place queued by :meth:`TorchEngine.search_attached_start`."""

    __slots__ = ("side", "_event", "_finish", "_scales", "_error")

    def __init__(self, side: int, event: "torch.cuda.Event | None") -> None:
        self.side = side  # the staging area it holds while in flight
        self._event = event
        self._finish: Callable[[], np.ndarray] | None = None
        self._scales: np.ndarray | None = None
        self._error: BaseException | None = None

    @classmethod
    def finished(cls, scales: np.ndarray) -> "AttachedPass":
        """A pass that ran already (its search could not be queued)."""
        done = cls(-1, None)
        done._scales = scales
        return done

    def bind(self, finish: Callable[[], np.ndarray]) -> None:
        self._finish = finish

    def done(self) -> bool:
        """Whether :meth:`finish` would return without waiting for the GPU."""
        return self._scales is not None or self._error is not None or self._event is None or self._event.query()

    def finish(self) -> np.ndarray:
        """Waits for the answers to be in the buffer (fallbacks included); returns the scales
        applied (the caller checks them as for :meth:`TorchEngine.search_attached`). A failure
        is raised here, to each call, never to another pass's owner."""
        self.finish_quietly()
        if self._error is not None:
            raise self._error
        return self._scales

    def finish_quietly(self) -> None:
        """:meth:`finish` with the failure kept for the owner (the engine settling its passes)."""
        if self._scales is None and self._error is None:
            try:
                self._scales = self._finish()
            except Exception as exc:  # noqa: BLE001 - kept: its owner's finish() raises it
                self._error = exc


class AttachedSearches:
    """The searches in place of :class:`~kalos.engine.gpu.engine.TorchEngine`, a base of it
    (not an engine of its own).

    Its state, made by :meth:`_init_attached`: the buffer (``_attached``), the places
    (``_places``, ``_places_k``), the passes in flight (``_flights``, oldest first), a CUDA
    event per staging side (``_side_events``) and the launch plans (``_launch_plans``). The
    engine reads ``_flights`` (``settle`` finishes them) and ``_attached`` (the pipeline's
    stage-in), and drops ``_launch_plans`` with its graphs.

    What it takes of the engine: ``dim``, ``rows``, ``max_batch``, ``backend``, ``precision``,
    ``on_gpu``, ``torch_device``, ``stats``, ``stagings`` (the second None without the Triton
    kernels), ``_stream``, ``_bound``, ``_pending`` and ``_graphs``; ``settle``, ``search``,
    ``fill_header``, ``scan_kind``, ``_check_k``, ``_key``, ``_run`` and ``_triton_batch``.
    """

    def _init_attached(self) -> None:
        self._attached: AttachedHost | None = None  # see attach_host
        # attach_places: a gather-table row per place (query, ids, scores; scale NaN: the
        # device normalises), checked once, and the largest k their answers hold.
        self._places: np.ndarray | None = None
        self._places_k = 0
        self._flights: list[AttachedPass] = []  # search_attached_start's passes, oldest first
        # One CUDA event per staging side, recorded again by each pass that takes the side (a
        # side is taken only once the pass that held it finished: search_attached_start).
        self._side_events: list = [None, None]
        # (nq, k, filtered, device norms, side, rows in use, capacity) -> (graph key, certified):
        # what a queued pass's launch derives from its shape, derived once (_launch_plan).
        self._launch_plans: dict[tuple, tuple] = {}

    @property
    def attached(self) -> AttachedHost | None:
        """The buffer :meth:`attach_host` attached (None: none)."""
        return self._attached

    def bind_stream(self) -> None:
        """Makes the engine's stream the calling thread's current CUDA stream, for good.

        Searches from a bound thread replay their graphs without entering a
        ``torch.cuda.stream`` context, whose Python costs a visible part of a single recall
        (docs/gpu-kernels.md). For a thread that does nothing else on the GPU: the
        sidecar's sweep. A no-op on the CPU device.
        """
        if self.on_gpu:
            torch.cuda.set_stream(self._stream)
            self._bound.stream = True  # thread-local: dies with the thread

    def unbind_stream(self) -> None:
        """Undoes :meth:`bind_stream` for the calling thread (its current stream: the default)."""
        if getattr(self._bound, "stream", False):
            self._bound.stream = False
            torch.cuda.set_stream(torch.cuda.default_stream(self.torch_device))

    def attach_host(self, buffer) -> HostBuffer:
        """Page-locks ``buffer`` (an mmap, say) so that :meth:`search_attached` reads queries
        from it and writes results into it with no intermediate host copy.

        Replaces an earlier attachment. Call :meth:`detach_host` before the buffer is closed.
        """
        self.detach_host()
        hb = register_host_buffer(buffer, pin=self.on_gpu)
        self._attached = AttachedHost.of(hb)
        return hb

    def detach_host(self) -> None:
        """Forgets the attached buffer (its graphs too) and unpins it; idempotent."""
        if self._attached is None:
            return
        self.settle()  # passes in flight read and write the buffer, and their fallbacks search it
        if self.on_gpu:
            # The whole device, not only the engine's stream: a kernel on another stream (the
            # slot server's) may read the buffer too.
            torch.cuda.synchronize(self.torch_device)
        self._graphs = {key: g for key, g in self._graphs.items() if not key[-1]}
        host = self._attached.host
        self._attached = None
        self._places = None
        host.unregister()

    def search_attached(
        self,
        query_at: np.ndarray,
        scales: np.ndarray | None,
        ids_at: np.ndarray,
        scores_at: np.ndarray,
        k: int,
        flt: Filter = Filter(),
    ) -> np.ndarray:
        """Top-k of queries that live in the attached buffer, written back into it.

        Query ``j`` is the ``dim`` float32 values at float32 element ``query_at[j]`` of the
        buffer, multiplied by ``scales[j]`` in float64 and rounded (exactly what
        ``normalise_rows`` does on the host). Its ``k`` ids go to int64 element ``ids_at[j]``
        and its scores to float32 element ``scores_at[j]``, best first, padded -1 / -inf.
        With the Triton backend on CUDA the query travels from the buffer to the GPU and the
        results back into the buffer with no host copy; otherwise the same answer is computed
        through :meth:`search`. Nothing is written when an argument is rejected.

        ``scales=None`` computes ``1 / |query|`` in float64 on the device instead (a batch
        spares the host a float64 pass over every query). Returns the scales applied; the
        caller checks them when it passed None: a query whose scale is zero, infinite or NaN
        (all zeros, or NaN / inf values) has no direction, and its answer is unspecified.
        """
        return self._attached_now(*self._attached_args(query_at, scales, ids_at, scores_at, k), k, flt)

    def _attached_now(self, query_at, scales, ids_at, scores_at, device_norms: bool, k: int, flt: Filter) -> np.ndarray:
        """search_attached of checked arguments (:meth:`_attached_args`), waited for."""
        nq = len(query_at)
        if nq == 0:
            return scales
        self.settle()
        n = self.rows.size
        # A where filter's mask replaces the live column, which the attached passes (and their
        # graphs) do not take: those queries are gathered and searched through search().
        if self.backend != "triton" or n == 0 or flt.where is not None:
            if device_norms:  # no kernel here: the same float64 scales on the host
                rows = self._attached.f32_np[query_at[:, None] + np.arange(self.dim)]
                with np.errstate(divide="ignore", invalid="ignore"):
                    scales = 1.0 / np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))
            good = np.flatnonzero(np.isfinite(scales) & (scales > 0)) if device_norms else np.arange(nq)
            ids, scores = self.search(self._gather(query_at[good], scales[good]), k, flt)
            self._scatter(ids, scores, ids_at[good], scores_at[good], k)
            return scales
        flt = self.rows.simplify(flt)
        for s in range(0, nq, self.max_batch):
            e = min(nq, s + self.max_batch)
            batch = query_at[s:e], scales[s:e], ids_at[s:e], scores_at[s:e]
            scales[s:e] = self._attached_launch(*batch, k, flt, device_norms, 0).finish()
        return scales

    def search_attached_start(
        self,
        query_at: np.ndarray,
        scales: np.ndarray | None,
        ids_at: np.ndarray,
        scores_at: np.ndarray,
        k: int,
        flt: Filter = Filter(),
    ) -> "AttachedPass":
        """:meth:`search_attached`, queued: returns its pass at once, whose ``finish()`` waits
        for the answers to be in the buffer and returns the scales (``done()`` says whether it
        would wait). Up to two passes are in flight at a time (a third waits for the oldest);
        anything else the engine is asked meanwhile finishes them first. Where the search
        cannot be queued (no Triton on CUDA, a where filter, more than ``max_batch`` queries,
        no rows) it runs here, and the pass returned is done. Arguments are checked here."""
        query_at, scales, ids_at, scores_at, device_norms = self._attached_args(query_at, scales, ids_at, scores_at, k)
        nq = len(query_at)
        if not self._queueable(nq, flt):
            return AttachedPass.finished(self._attached_now(query_at, scales, ids_at, scores_at, device_norms, k, flt))
        return self._attached_launch(query_at, scales, ids_at, scores_at, k, self.rows.simplify(flt), device_norms,
                                     self._free_side())

    def attach_places(self, query_at: np.ndarray, ids_at: np.ndarray, scores_at: np.ndarray, k_max: int) -> None:
        """Declares, once, where single queries live in the attached buffer and where their
        answers go: place ``j`` is the query at float32 element ``query_at[j]``, its ids at
        int64 element ``ids_at[j]`` and its scores at float32 element ``scores_at[j]`` (up to
        ``k_max`` of each), as for :meth:`search_attached`. Checked here, so that
        :meth:`search_places_start` names places by index and checks only the indices and ``k``
        per pass (the sidecar's slots, one place each). Replaces earlier places; detach_host
        forgets them."""
        if self._attached is None:
            raise InvalidArgument("attach_places needs a buffer: call attach_host first")
        self._check_k(k_max)
        query_at, _scales, ids_at, scores_at, _device = self._attached_args(query_at, None, ids_at, scores_at, k_max)
        table = np.empty((len(query_at), TAB_WORDS), np.int64)
        fill_table(table, query_at, ids_at, scores_at, np.nan)  # (NaN: the stage-in kernel normalises)
        self._places, self._places_k = table, int(k_max)

    def search_places_start(self, places: np.ndarray, k: int, flt: Filter = Filter(),
                            namespaces: np.ndarray | None = None) -> "AttachedPass":
        """:meth:`search_attached_start` of the single queries at ``places`` (a 1-d integer array
        of indices of the places :meth:`attach_places` declared), normalised on the device:
        the sweep's pass of a crowd, which checks only that ``k`` and the indices are in range.
        The pass's ``finish()`` returns the scales applied, as search_attached_start's does.

        ``namespaces`` (signed integers, one per place: an engine namespace id, a filter's
        ``namespace``, or -1 for all namespaces) gives each query a namespace of its own, in
        place of ``flt``'s (which must then name none): a crowd of agents that each keep their
        own memories is one pass over the rows, not one per namespace."""
        table = self._places
        if table is None:
            raise InvalidArgument("search_places_start needs attach_places first")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= self._places_k:
            self._check_k(k)  # (names a k that is no integer, or out of [1, MAX_K])
            raise InvalidQuery(f"k={k} is more than the places hold ({self._places_k})")
        k = int(k)
        if not (isinstance(places, np.ndarray) and places.ndim == 1 and places.dtype.kind in "iu"):
            raise InvalidArgument("places must be a 1-d integer array of place indices")
        nq = len(places)
        if nq:
            lo, hi = (int(places[0]),) * 2 if nq == 1 else (int(places.min()), int(places.max()))
            if lo < 0 or hi >= len(table):
                raise InvalidArgument(f"places must be in [0, {len(table)}): got {lo}..{hi}")
        if namespaces is not None:
            if flt.namespace is not None:
                raise InvalidArgument("give each place's namespace or the filter's, not both")
            if not (isinstance(namespaces, np.ndarray) and namespaces.shape == places.shape
                    and namespaces.dtype.kind == "i"):
                raise InvalidArgument("namespaces must be a 1-d signed integer array, one id per place")
            if nq and not ((namespaces == -1) | ((namespaces >= 0) & (namespaces <= _NAMESPACE_ID_MAX))).all():
                raise InvalidArgument(f"namespace ids must be -1 (all) or in [0, {_NAMESPACE_ID_MAX}]")
            if nq and (namespaces == namespaces[0]).all():  # one namespace: the header's, as without
                flt = _with_namespace(flt, int(namespaces[0]))
                namespaces = None
            else:
                namespaces = namespaces.astype(np.int64)  # (a copy too)
        rows = table[places]  # (a copy: the caller may reuse its array while the pass flies)
        if not self._queueable(nq, flt):
            if namespaces is None:
                return self.search_attached_start(rows[:, TABLE.query_at], None, rows[:, TABLE.ids_at],
                                                  rows[:, TABLE.scores_at], k, flt)
            scales = np.empty(nq)
            for members, ns_flt in _each_namespace(namespaces, flt):
                at = rows[members]
                scales[members] = self.search_attached(at[:, TABLE.query_at], None, at[:, TABLE.ids_at],
                                                       at[:, TABLE.scores_at], k, ns_flt)
            return AttachedPass.finished(scales)
        side = self._free_side()
        if namespaces is not None:
            rows[:, TABLE.ns] = np.where(namespaces >= 0, namespaces, NS_ALL)
        self.stagings[side].h_tab[:nq] = rows
        return self._queue_pass(nq, k, self.rows.simplify(flt), True, side, None, rows[:, TABLE.query_at],
                                rows[:, TABLE.ids_at], rows[:, TABLE.scores_at], namespaces)

    def _queueable(self, nq: int, flt: Filter) -> bool:
        """Whether a pass of ``nq`` attached queries under ``flt`` can be queued (two staging
        areas, rows to scan, no where mask); else it runs at once."""
        return (self.stagings[1] is not None and 0 < nq <= self.max_batch and self.rows.size > 0
                and flt.where is None)

    def _free_side(self) -> int:
        """The staging side a new queued pass takes: the one no unfinished pass holds (with two
        in flight, the oldest is finished first)."""
        if self._pending is not None:
            self._pending()  # search_start's pass uses the first staging
        if len(self._flights) == 2:
            self._flights[0].finish_quietly()
        return 1 - self._flights[0].side if self._flights else 0

    def _attached_args(self, query_at, scales, ids_at, scores_at, k: int) -> tuple:
        """search_attached's arguments checked: int64 offsets inside the buffer, float64 scales
        (NaN for ``None``: the device computes them), and whether it does."""
        if self._attached is None:
            raise InvalidArgument("search_attached needs a buffer: call attach_host first")
        self._check_k(k)
        f32, i64 = self._attached.f32_np, self._attached.i64_np
        query_at, ids_at, scores_at = (np.asarray(a, dtype=np.int64) for a in (query_at, ids_at, scores_at))
        nq = len(query_at)
        device_norms = scales is None
        scales = np.full(nq, np.nan) if device_norms else np.asarray(scales, dtype=np.float64)
        if not (len(scales) == len(ids_at) == len(scores_at) == nq):
            raise InvalidArgument("query_at, scales, ids_at and scores_at must have one entry per query")
        if nq == 0:
            return query_at, scales, ids_at, scores_at, device_norms
        for name, at, width, size in (("query_at", query_at, self.dim, len(f32)), ("ids_at", ids_at, k, len(i64)),
                                      ("scores_at", scores_at, k, len(f32))):
            # (Python ints for the common single query: a NumPy reduction costs more than it.)
            lo, hi = (int(at[0]),) * 2 if nq == 1 else (int(at.min()), int(at.max()))
            if lo < 0 or hi + width > size:
                raise InvalidArgument(f"{name} points outside the attached buffer")
        if not device_norms and not (math.isfinite(float(scales[0])) if nq == 1 else np.isfinite(scales).all()):
            raise InvalidQuery("query scales must be finite")
        return query_at, scales, ids_at, scores_at, device_norms

    def _attached_launch(self, query_at, scales, ids_at, scores_at, k: int, flt: Filter, device_norms: bool,
                         side: int) -> "AttachedPass":
        """Queues one batch of at most ``max_batch`` attached queries on staging ``side``
        (``flt`` simplified, no where); its pass is in flight until finished."""
        nq = len(query_at)
        self.stagings[side].set_table(nq, query_at, ids_at, scores_at, scales)
        return self._queue_pass(nq, k, flt, device_norms, side, scales, query_at, ids_at, scores_at)

    def _launch_plan(self, nq: int, k: int, filtered: bool, device_norms: bool, side: int) -> tuple[tuple, bool]:
        """(graph key, certified) of a queued pass of ``nq`` attached queries on staging
        ``side``, derived once per shape and rows in use (the plans and graphs a key names
        go with a retune, and so do these)."""
        n = self.rows.size
        shape = (nq, k, filtered, device_norms, side, n, self.rows.capacity)
        plan = self._launch_plans.get(shape)
        if plan is None:
            if len(self._launch_plans) > 256:  # the rows in use change with every add
                self._launch_plans.clear()
            kind = self.scan_kind(nq, k, self.precision)
            key = self._key(kind, nq, k, filtered, True, True, True, device_norms, side)
            plan = self._launch_plans[shape] = (key, kind != "f32" and n > fast_candidates(k))
        return plan

    def _queue_pass(self, nq: int, k: int, flt: Filter, device_norms: bool, side: int, scales,
                    query_at: np.ndarray, ids_at: np.ndarray, scores_at: np.ndarray,
                    namespaces: np.ndarray | None = None) -> "AttachedPass":
        """Queues the pass whose gather table staging ``side`` holds already (with each query's
        namespace where ``namespaces`` is given); ``scales``: the host's (None with
        ``device_norms``); ``query_at``, ``ids_at``, ``scores_at`` and ``namespaces``: the
        table's again, which only a fallback re-run reads."""
        st = self.stagings[side]
        key, certified = self._launch_plan(nq, k, not flt.is_trivial or namespaces is not None, device_norms, side)
        self.fill_header(self.rows.size, nq, k, flt, staging=st)
        if namespaces is not None:
            st.h_hdr[HEADER.own_filters] = OWN_NAMESPACES
        self.stats["searches"] += nq
        self._run(key, None, wait=False)
        event = None
        if self.on_gpu:
            event = self._side_events[side]
            if event is None:
                event = self._side_events[side] = torch.cuda.Event()
            event.record(self._stream)
        flight = AttachedPass(side, event)

        def finish() -> np.ndarray:
            if flight in self._flights:  # first: a failure below must not leave it in flight
                self._flights.remove(flight)
            if event is not None:
                event.synchronize()
            got = st.scales(nq) if device_norms else scales
            if not certified:
                return got
            status = st.r_status[:nq]
            if not status.any():
                return got
            failed = status != 0
            if device_norms:  # a query with no direction has no answer to certify
                failed &= np.isfinite(got) & (got > 0)
            bad = np.flatnonzero(failed)
            if len(bad):  # the certificate failed: redo those queries with the float32 scan
                self.settle()  # (the other pass in flight may hold the first staging, which the scan uses)
                self.stats["fallbacks"] += len(bad)
                queries = self._gather(query_at[bad], got[bad])
                ids = np.empty((len(bad), k), np.int64)
                scores = np.empty((len(bad), k), np.float32)
                if namespaces is None:
                    self._triton_batch(queries, k, flt, ids, scores, True, "f32", None)
                else:
                    for members, ns_flt in _each_namespace(namespaces[bad], flt):
                        self._triton_batch(queries[members], k, ns_flt, RowSink(ids, members), RowSink(scores, members),
                                           True, "f32", None)
                self._scatter(ids, scores, ids_at[bad], scores_at[bad], k)
            return got

        flight.bind(finish)
        self._flights.append(flight)
        return flight

    def _gather(self, query_at: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Queries of the attached buffer, normalised on the host (the paths without kernels)."""
        rows = self._attached.f32_np[query_at[:, None] + np.arange(self.dim)]
        return (rows * scales[:, None]).astype(np.float32)

    def _scatter(self, ids: np.ndarray, scores: np.ndarray, ids_at: np.ndarray, scores_at: np.ndarray, k: int) -> None:
        cols = np.arange(k)
        self._attached.i64_np[ids_at[:, None] + cols] = ids[:, :k]
        self._attached.f32_np[scores_at[:, None] + cols] = scores[:, :k]
