"""The GPU engine: rows resident in device memory, a fused Triton scan + mask + top-k.

Importing this module imports PyTorch (and Triton when the Triton backend is used); kalos
core never imports it unless a GPU engine is asked for. The engine is the
:class:`~kalos.engine.base.Engine` interface over the parts of this package: the rows on the
device (:mod:`~kalos.engine.gpu.columns`), the page-locked staging area and attached host
buffers (:mod:`~kalos.engine.gpu.buffers`, words declared in :mod:`~kalos.engine.gpu.layout`),
the planner and its tuning (:mod:`~kalos.engine.gpu.planner`), the Triton stages
(:mod:`~kalos.engine.gpu.pipeline`, kernels in :mod:`~kalos.engine.gpu.kernels`), the plain
PyTorch path (:mod:`~kalos.engine.gpu.torch_path`) and the searches in place in an attached
buffer with their passes in flight (:mod:`~kalos.engine.gpu.attached`, a base of
:class:`TorchEngine`). What it keeps itself: argument checks, batching, the CUDA graphs and
fallbacks when a certificate fails.

One search (Triton backend)
---------------------------
A header (rows in use ``n``, query count, ``k``, filter, the certificates' terms) and the
queries sit in a page-locked staging area at a fixed address; the stage-in kernel reads them
over the bus, then the scan, the merge levels and the final kernel run, and the final kernel
writes status, ids and scores straight into page-locked host memory. On CUDA all of it is
captured once per (mode, batch bucket, k bucket, filter kind) in a CUDA graph and replayed;
because ``n`` travels in the header, adds and deletes need no re-capture. A resize moves the
matrix, so it drops the graphs (captured again on next use). Fast mode's answers are exact
by certificate (:mod:`kalos.engine.gpu.bounds`); a query whose certificate fails is re-run
with the float32 scan.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Mapping

import numpy as np
import torch

from kalos.engine.base import MISSING_ID, Engine, Filter
from kalos.engine.gpu.attached import AttachedPass, AttachedSearches
from kalos.engine.gpu.bounds import fast_error_terms, int8_error_terms
from kalos.engine.gpu.buffers import Staging, fill_header
from kalos.engine.gpu.columns import DeviceColumns
from kalos.engine.gpu.layout import check_kernel_layout
from kalos.engine.gpu.pipeline import Pipeline
from kalos.engine.gpu.planner import (
    DEFAULT_TUNING,
    MAX_FAST_K,
    MAX_K,
    Plan,
    Planner,
    Tuning,
    fast_candidates,
    k_bucket,
    next_pow2,
)
from kalos.engine.gpu.torch_path import RowSink, TorchPath
from kalos.errors import InvalidArgument, InvalidQuery

__all__ = ["AttachedPass", "TorchEngine", "load_kernels"]

_NO_FILTER = Filter()
_HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def load_kernels(require_interpreter: bool):
    """The kernel package (the offsets its stages share checked against
    :mod:`kalos.engine.gpu.layout`), or
    None when Triton is missing (or, with ``require_interpreter``, not interpreting)."""
    try:
        from kalos.engine.gpu import kernels as tk
    except ImportError:
        return None
    check_kernel_layout(tk.common)
    if require_interpreter:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tk.scan_topk_kernel, InterpretedFunction):
            return None
    return tk


class TorchEngine(AttachedSearches, Engine):
    """Exact top-k over rows in device memory (CUDA, or PyTorch's CPU device for tests).

    All arguments are keyword-only except ``dim``.

    ``device``: "cuda", "cuda:N" or "cpu". ``precision``: "exact" scans float32; "fast" scans
    a 16-bit copy (``half``: "float16" or "bfloat16") and re-scores a certified candidate set
    in float32 (same answer, :mod:`kalos.engine.gpu.bounds`). ``backend``: "triton" (the fused
    kernels; on the CPU device only under ``TRITON_INTERPRET=1``), "torch" (``matmul`` +
    ``topk``), or "auto". ``max_batch``: most queries per kernel launch (larger batches are
    split; a GEMM batch holds ``max_batch x 65,536`` float32 scores while it runs: 256 MiB at
    the default 1,024). ``graphs``: capture CUDA graphs (CUDA only). ``tune``: a
    :class:`~kalos.engine.gpu.planner.Tuning`, or overrides of its defaults as a mapping
    (benchmarks; :meth:`Tuning.replace`).
    """

    name = "torch"
    #: Largest k a search may ask for (the sidecar refuses a larger --max-k at start).
    max_k = MAX_K
    supports_search_start = True
    supports_attached_host = True
    supports_streams = True

    def __init__(
        self,
        dim: int,
        *,
        capacity: int = 1024,
        device: str = "cuda",
        precision: str = "exact",
        half: str = "float16",
        backend: str = "auto",
        max_batch: int = 1024,
        graphs: bool = True,
        tune: dict | None = None,
    ) -> None:
        super().__init__(dim, capacity=capacity)
        if precision not in ("exact", "fast"):
            raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
        if half not in _HALF_DTYPES:
            raise InvalidArgument(f"half must be 'float16' or 'bfloat16', got {half!r}")
        if max_batch < 1:
            raise InvalidArgument(f"max_batch must be >= 1, got {max_batch}")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgument(f"unknown device {device!r}: {e}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidArgument(f"device {device!r}: PyTorch sees no CUDA device")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise InvalidArgument(f"device {device!r}: PyTorch sees {torch.cuda.device_count()} CUDA device(s)")
        elif dev.type != "cpu":
            raise InvalidArgument(f"device {device!r}: use cuda, cuda:N or cpu")
        self.torch_device = dev
        self.device = str(dev)
        self.precision = precision
        self.half = half
        self.max_batch = int(max_batch)
        self.on_gpu = dev.type == "cuda"
        if backend not in ("auto", "triton", "torch"):
            raise InvalidArgument(f"backend must be auto, triton or torch, got {backend!r}")
        tk = None
        if backend in ("auto", "triton"):
            tk = load_kernels(require_interpreter=not self.on_gpu)
            if tk is None and backend == "triton":
                raise InvalidArgument(
                    "the Triton backend needs triton installed and, on the CPU device, "
                    "TRITON_INTERPRET=1 set before triton is first imported"
                )
        self.kernels = tk
        self.backend = "triton" if tk is not None else "torch"
        self.name = f"torch-{self.backend}-{precision}"
        # The slot server runs the Triton kernels, on CUDA (the interpreter serves tests only).
        self.supports_gpu_polling = self.backend == "triton" and self.on_gpu
        self._graphs_enabled = bool(graphs) and self.on_gpu
        tuning = tune if isinstance(tune, Tuning) else DEFAULT_TUNING.replace(tune)
        int8 = precision == "fast" and tk is not None and tuning.single_scan == "int8"
        i8_a, self._i8_r = int8_error_terms(dim)
        errors = {"f16": fast_error_terms(dim, half), "tf32": fast_error_terms(dim, "tf32"), "f32": (0.0, 0.0, 0.0),
                  "i8": (i8_a, 0.0, 1e-12)}
        self.stats = {"searches": 0, "fallbacks": 0, "graph_captures": 0}

        props = None
        if self.on_gpu:
            # The highest priority PyTorch offers (out-of-range values are clamped to it).
            self._stream = torch.cuda.Stream(device=dev, priority=-100)
            props = torch.cuda.get_device_properties(dev)
            sms = props.multi_processor_count
        else:
            self._stream = None
            sms = 1
        self._graphs: dict = {}
        self._uncapturable: set = set()  # graph keys whose capture failed: launched eagerly
        self._bound = threading.local()  # .stream: this thread runs on the engine's stream
        # The waiter of a search_start not yet awaited: every other use of the staging areas
        # (searches, adds, deletes, compaction) first finishes it (settle).
        self._pending: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
        # (host mask, its device copy) of the last ``where`` filter searched: _where_live.
        self._where_dev: tuple[np.ndarray, torch.Tensor] | None = None
        self._graph_pool = None
        self._init_attached()  # the attached buffer, its places and the passes in flight
        #: The rows on the device (:class:`~kalos.engine.gpu.columns.DeviceColumns`).
        self.columns = DeviceColumns(dim, self.rows.capacity, dev, half=_HALF_DTYPES[half] if precision == "fast"
                                     else None, int8=int8)
        #: The page-locked staging area (:class:`~kalos.engine.gpu.buffers.Staging`).
        self.staging = Staging(self.max_batch, dim, dev, pin=self.on_gpu)
        # A second one for a pass queued while another is in flight (search_attached_start);
        # the rest of the engine uses the first only.
        self.stagings = (self.staging, Staging(self.max_batch, dim, dev, pin=self.on_gpu) if tk is not None else None)
        pipeline: Pipeline  # (made below: the planner asks it about compiled kernels)
        #: Launch plans (:class:`~kalos.engine.gpu.planner.Planner`).
        self.planner = Planner(dim, self.on_gpu, sms, occupancy=lambda *a: pipeline.programs_per_sm(*a),
                               gemm_ok=lambda kind: pipeline.gemm_ok(kind), tuning=tuning)
        #: The Triton stages (:class:`~kalos.engine.gpu.pipeline.Pipeline`; with the torch backend
        #: only its planning helpers are used).
        self.pipeline = pipeline = Pipeline(
            tk, self.columns, self.stagings, self.planner, dim=dim, device=dev, max_batch=self.max_batch,
            half=_HALF_DTYPES[half], errors=errors, attached=lambda: self._attached, on_stream=self.on_stream,
            on_realloc=self._drop_graphs, props=props,
        )
        #: The error-bound terms per scan kind (:mod:`kalos.engine.gpu.bounds`).
        self.error_terms = errors
        self._torch = TorchPath(self.columns, self.rows, on_stream=self.on_stream, errors=errors, stats=self.stats)
        if self._stream is not None:
            # The columns and staging areas above were filled (ids -1, scales 1, ...) on the
            # caller's stream; the engine's own stream, which does not wait for it by itself,
            # orders every later use after those fills.
            self._stream.wait_stream(torch.cuda.current_stream(dev))

    # -- storage ------------------------------------------------------------------------------

    def on_stream(self) -> contextlib.AbstractContextManager:
        """A context in which PyTorch work runs on the engine's stream (a no-op on the CPU)."""
        return torch.cuda.stream(self._stream) if self.on_gpu else contextlib.nullcontext()

    @property
    def tuning(self) -> Tuning:
        """The tuning table in use (:meth:`retune` replaces entries)."""
        return self.planner.tuning

    def settle(self) -> None:
        """Finishes the searches that search_start and search_attached_start queued (their
        waiters then return the kept answers; a queued pass's failure is kept for its owner,
        not raised to whoever settles it)."""
        if self._pending is not None:
            self._pending()
        while self._flights:
            self._flights[0].finish_quietly()

    # Every change of the rows finishes the passes in flight first: a fallback re-run while
    # settling must see the rows, the header's count and the device matrix as they were.
    def add(self, *args, **kwargs) -> None:
        self.settle()
        super().add(*args, **kwargs)

    def reserve(self, extra: int) -> None:
        self.settle()
        super().reserve(extra)

    def delete(self, ids: np.ndarray) -> int:
        self.settle()
        return super().delete(ids)

    def compact(self) -> None:
        self.settle()
        super().compact()

    def _resize(self, capacity: int) -> None:
        self.settle()
        with self.on_stream():
            self.columns.resize(capacity, self.rows.size)
        self._drop_graphs()
        self.planner.clear()  # a score-writing plan's grid and workspace follow the capacity

    def _write(self, rows: slice, vectors: np.ndarray) -> None:
        self.settle()
        with self.on_stream():
            self.columns.write(rows, vectors, self.rows)

    def _tombstoned(self, rows: np.ndarray) -> None:
        self.settle()
        with self.on_stream():
            self.columns.tombstone(rows)

    def _compacted(self, keep: np.ndarray) -> None:
        self.settle()
        with self.on_stream():
            self.columns.compact(keep, self.rows)

    def _vector_bytes(self) -> int:
        return self.columns.nbytes()

    # -- searching ------------------------------------------------------------------------------

    def search(self, queries: np.ndarray, k: int, flt: Filter = Filter()) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by cosine: ``(ids[Q, k] int64, scores[Q, k] float32)``, best first, padded -1/-inf."""
        queries = self._host_queries(queries, k)
        nq = len(queries)
        ids = np.full((nq, k), MISSING_ID, np.int64)
        scores = np.full((nq, k), -np.inf, np.float32)
        if nq == 0 or self.rows.size == 0:
            return ids, scores
        flt, live = self._where_live(self.rows.simplify(flt))
        self._search_rows(queries, k, flt, ids, scores, want_ids=True, live=live)
        return ids, scores

    def _where_live(self, flt: Filter) -> tuple[Filter, torch.Tensor | None]:
        """A filter with a ``where`` clause as the row mask the scan reads in place of the live
        column (namespace, time and where folded in by ``RowTable.mask``, which caches it until
        a write), and no filter words; other filters as they are, with no mask."""
        if flt.where is None:
            return flt, None
        mask = self.rows.mask(flt)
        cached = self._where_dev
        if cached is None or cached[0] is not mask:
            cap = self.rows.capacity
            # One device buffer per capacity, rewritten for each new mask: the CUDA graphs of
            # where-filtered passes replay its address (_run). A new capacity dropped every
            # graph already (_resize).
            live = cached[1] if cached is not None and cached[1].numel() == cap else None
            host = np.zeros(cap, dtype=np.uint8)
            host[: len(mask)] = mask
            with self.on_stream():  # ordered after any pass that read the previous mask
                if live is None:
                    # (Made on this stream too: a fill on another one could land after the copy,
                    # and the first scan would then see no row; it did in a CUDA test.)
                    live = torch.empty(cap, dtype=torch.uint8, device=self.torch_device)
                live.copy_(torch.from_numpy(host))
            self._where_dev = cached = (mask, live)
        return _NO_FILTER, cached[1]

    def search_start(self, queries: np.ndarray, k: int, flt: Filter = Filter()) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """Starts :meth:`search` and returns the function that waits for its answer.

        With the Triton backend on CUDA a batch of up to ``max_batch`` queries is queued on
        the engine's stream and the call returns at once, so that several engines (the shards
        of :class:`~kalos.engine.sharded.ShardedEngine`, one per GPU) scan at the same time.
        Otherwise the search runs here and the function returns its result. Anything else
        this engine is asked to do before the function is called finishes the search first
        (the function then returns the kept answer), so answers can never be mixed up.
        """
        queries = self._host_queries(queries, k)
        nq = len(queries)
        if self.backend != "triton" or nq == 0 or nq > self.max_batch or self.rows.size == 0:
            result = self.search(queries, k, flt)
            return lambda: result
        flt, live = self._where_live(self.rows.simplify(flt))
        kind = self.scan_kind(nq, k, self.precision)
        self.stats["searches"] += nq
        self._triton_start(queries, k, flt, True, kind, live)

        answer: list[tuple[np.ndarray, np.ndarray]] = []

        def finish() -> tuple[np.ndarray, np.ndarray]:
            if not answer:
                self._pending = None  # first: a failure below must not leave it pending
                ids = np.empty((nq, k), np.int64)
                scores = np.empty((nq, k), np.float32)
                self._triton_finish(queries, k, flt, ids, scores, True, kind, live)
                answer.append((ids, scores))
            return answer[0]

        self._pending = finish
        return finish

    def search_into(
        self,
        queries,
        k: int,
        flt: Filter = Filter(),
        *,
        out_ids: torch.Tensor,
        out_scores: torch.Tensor,
        precision: str | None = None,
    ) -> None:
        """Top-k of ``queries`` written into ``out_ids[:Q, :k]`` (int64) and ``out_scores``
        (float32), best first, padded with -1 / -inf.

        ``queries``: ``[Q, dim]`` float32 unit rows, a host tensor (pinned or not, e.g. a
        view of a registered shared-memory slot), a tensor on this engine's device, or a
        NumPy array. The outputs may be host tensors (pinned or not) or device tensors.
        Work runs on the engine's own high-priority stream; only that stream is synchronised.
        Nothing is written when an argument is rejected.
        """
        if isinstance(queries, np.ndarray):
            if queries.dtype != np.float32:
                raise InvalidQuery(f"queries must be float32, got {queries.dtype}")
            q_np = queries
        elif isinstance(queries, torch.Tensor):
            if queries.dtype != torch.float32:
                raise InvalidQuery(f"queries must be float32, got {queries.dtype}")
            q_np = queries.detach().numpy() if queries.device.type == "cpu" else None
        else:
            raise InvalidQuery(f"queries must be a torch.Tensor or numpy array, got {type(queries).__name__}")
        shape = tuple(queries.shape)
        if len(shape) != 2 or shape[1] != self.dim:
            raise InvalidQuery(f"expected queries of shape (Q, {self.dim}), got {shape}")
        self._check_k(k)
        nq = shape[0]
        for name, t, dt in (("out_ids", out_ids, torch.int64), ("out_scores", out_scores, torch.float32)):
            if not isinstance(t, torch.Tensor) or t.dtype != dt or t.dim() != 2:
                raise InvalidArgument(f"{name} must be a 2-d {dt} tensor")
            if t.shape[0] < nq or t.shape[1] < k:
                raise InvalidArgument(f"{name} of shape {tuple(t.shape)} cannot hold ({nq}, {k}) results")
        if q_np is None and queries.device != self.torch_device:
            raise InvalidQuery(f"queries on {queries.device}, engine on {self.torch_device}")
        if precision not in (None, "exact", "fast"):
            raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
        if precision == "fast" and self.columns.x16 is None:
            raise InvalidArgument("precision='fast' needs an engine built with precision='fast'")
        if nq == 0:
            return
        self.settle()
        host_out = out_ids.device.type == "cpu" and out_scores.device.type == "cpu"
        if host_out:
            ids_np, sc_np = out_ids.numpy(), out_scores.numpy()
        else:
            ids_np = np.empty((nq, k), np.int64)
            sc_np = np.empty((nq, k), np.float32)
        if self.rows.size == 0:
            ids_np[:nq, :k] = MISSING_ID
            sc_np[:nq, :k] = -np.inf
        else:
            src = q_np if q_np is not None else queries.detach()
            flt, live = self._where_live(self.rows.simplify(flt))
            self._search_rows(src, k, flt, ids_np, sc_np, want_ids=True, precision=precision, live=live)
        if not host_out:
            with self.on_stream():
                out_ids[:nq, :k].copy_(torch.from_numpy(ids_np[:nq, :k]))
                out_scores[:nq, :k].copy_(torch.from_numpy(sc_np[:nq, :k]))
            if self.on_gpu:
                self._stream.synchronize()

    def _search(self, queries: np.ndarray, k: int, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The base-class hook (row numbers, host mask): an eager scan with the mask as the live column."""
        self.settle()
        n = self.rows.size
        nq = len(queries)
        rows = np.zeros((nq, k), np.int64)
        scores = np.full((nq, k), -np.inf, np.float32)
        live = None
        if mask is not None:
            # Made and filled on the engine's stream, which the search then runs on: on another
            # stream its fill and copy would be unordered with the scan that reads them.
            with self.on_stream():
                live = torch.zeros(self.rows.capacity, dtype=torch.uint8, device=self.torch_device)
                live[:n].copy_(torch.from_numpy(mask.view(np.uint8)))
        self._search_rows(queries, k, Filter(), rows, scores, want_ids=False, live=live)
        return rows, scores

    def _host_queries(self, queries, k: int) -> np.ndarray:
        """``queries`` as a float32 ``[Q, dim]`` host array after checking them and ``k``; a
        search that search_start left pending is finished first."""
        if isinstance(queries, torch.Tensor):
            queries = queries.detach().to("cpu", torch.float32).numpy()
        queries = np.asarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise InvalidQuery(f"expected queries of shape (Q, {self.dim}), got {queries.shape}")
        self._check_k(k)
        self.settle()
        return queries

    def _check_k(self, k: int) -> None:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise InvalidQuery(f"k must be an integer, got {type(k).__name__}")
        if k < 1 or k > MAX_K:
            raise InvalidQuery(f"k must be in [1, {MAX_K}], got {k}")

    def _search_rows(self, queries, k, flt, out_i, out_s, *, want_ids, precision=None, live=None) -> None:
        """Fills ``out_i[:Q, :k]``, ``out_s[:Q, :k]`` (ids or rows), splitting into batches."""
        precision = precision or self.precision
        if precision not in ("exact", "fast"):
            raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
        fast = precision == "fast" and k <= MAX_FAST_K
        if fast and self.columns.x16 is None:
            raise InvalidArgument("precision='fast' needs an engine built with precision='fast'")
        nq = len(queries)
        self.stats["searches"] += nq
        for s in range(0, nq, self.max_batch):
            e = min(nq, s + self.max_batch)
            if self.backend == "triton":
                kind = self.scan_kind(e - s, k, precision)
                self._triton_batch(queries[s:e], k, flt, out_i[s:e], out_s[s:e], want_ids, kind, live)
            else:
                self._torch.batch(queries[s:e], k, flt, out_i[s:e], out_s[s:e], want_ids, fast, live)

    # -- the Triton pipeline (the stages: kalos.engine.gpu.pipeline) ----------------------------

    def fill_header(self, n: int, nq: int, k: int, flt: Filter, hdr: np.ndarray | None = None, *,
                    staging: Staging | None = None) -> None:
        """Writes a staging header for ``n`` rows, ``nq`` queries, ``k`` and ``flt``, with the
        engine's certificate terms: the header of ``staging`` (None: the engine's first), or
        ``hdr`` (int64 words of another header, the slot server's)."""
        st = staging or self.staging
        hdrf = st.h_hdrf if hdr is None else hdr.view(np.float64)
        fill_header(st.h_hdr if hdr is None else hdr, hdrf, n, nq, k, flt, self.columns.max_norm,
                    self.columns.max_resid8 * self._i8_r)

    def _triton_batch(self, queries, k, flt, out_i, out_s, want_ids, kind, live) -> None:
        self._triton_start(queries, k, flt, want_ids, kind, live)
        self._triton_finish(queries, k, flt, out_i, out_s, want_ids, kind, live)

    def _triton_start(self, queries, k, flt, want_ids, kind, live) -> None:
        """Stages the batch and queues its work on the engine's stream (no wait)."""
        nq = len(queries)
        self.fill_header(self.rows.size, nq, k, flt)
        self.staging.own_table(nq)
        host_q = isinstance(queries, np.ndarray)
        if host_q:
            self.staging.h_q[:nq] = queries
        else:
            with self.on_stream():
                self.staging.d_q[:nq].copy_(queries, non_blocking=True)
        self._run(self._key(kind, nq, k, not flt.is_trivial, want_ids, host_q, False), live, wait=False)

    def _triton_finish(self, queries, k, flt, out_i, out_s, want_ids, kind, live) -> None:
        """Waits for the batch :meth:`_triton_start` queued; copies its results out."""
        if self.on_gpu:
            self._stream.synchronize()
        nq = len(queries)
        n = self.rows.size
        bad = np.flatnonzero(self.staging.r_status[:nq]) if kind != "f32" and n > fast_candidates(k) else ()
        out_i[:nq, :k] = self.staging.r_ids[:nq, :k]
        out_s[:nq, :k] = self.staging.r_scores[:nq, :k]
        if len(bad):
            self.stats["fallbacks"] += len(bad)
            redo = queries[bad] if isinstance(queries, np.ndarray) else queries[torch.from_numpy(bad).to(queries.device)]
            self._triton_batch(redo, k, flt, RowSink(out_i, bad), RowSink(out_s, bad), want_ids, "f32", live)

    def _key(self, kind: str, nq: int, k: int, filtered: bool, want_ids: bool, host_q: bool, attached: bool,
             device_norms: bool = False, side: int = 0) -> tuple:
        """The graph key of a batch: what its launches depend on (attached last: detach_host);
        ``filtered``: whether its queries have a namespace or window (the header's or their own)."""
        qb, kp = next_pow2(nq), k_bucket(k)
        plan = self.pipeline.plan(kind, qb, kp)
        slices = -(-self.rows.size // plan.gemm_rows) if plan.gemm_rows else 0
        return (kind, qb, kp, filtered, want_ids, host_q, slices, device_norms, side, attached)

    def _run(self, key, live, *, wait: bool = True) -> None:
        """Replays the graph of ``key`` (capturing it on first use), or launches eagerly; waits
        for it unless ``wait`` is False."""
        # A where filter's mask lives in one buffer (_where_live): its passes have graphs of their own.
        where = live is not None and self._where_dev is not None and live is self._where_dev[1]
        if where:
            key = ("where", *key)  # (attached stays last: detach_host)
        use_graph = self._graphs_enabled and (live is None or where) and key not in self._uncapturable
        entry = self._graphs.get(key) if use_graph else None
        if entry is not None:
            if getattr(self._bound, "stream", False):
                entry.replay()  # the engine's stream is already this thread's current stream
            else:
                with self.on_stream():  # (costly in Python on the hot path: see bind_stream)
                    entry.replay()
        else:
            self.pipeline.run(key[1:] if where else key, live)
            if use_graph:
                try:
                    self._capture(key, live)
                except Exception as e:  # noqa: BLE001 - eager launches still work; say why once
                    # Only this kind of pass runs eagerly from now on: one pass that cannot be
                    # captured must not cost every other kind its graph.
                    self._uncapturable.add(key)
                    self.stats["graph_error"] = f"{key}: {e!r}"[:400]
                    if not self._graphs:
                        self._graph_pool = None  # a pool with no live graph may not be captured into
        if wait and self.on_gpu:
            self._stream.synchronize()

    def _capture(self, key, live: torch.Tensor | None = None) -> None:
        """Captures the pass of ``key`` (``("where", *key)``: reading the where buffer ``live``)."""
        graph = torch.cuda.CUDAGraph()
        self._stream.synchronize()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # One memory pool for every graph: they replay one at a time on this stream, and what
        # they allocate (a GEMM batch's scores: up to max_batch x 65,536 floats) dies inside
        # each replay, so one graph's scratch may be another's.
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=self._stream, capture_error_mode="thread_local"):
            self.pipeline.run(key[1:] if key[0] == "where" else key, live)
        self._graphs[key] = graph
        self.stats["graph_captures"] += 1

    def _drop_graphs(self) -> None:
        self._launch_plans.clear()
        self._graphs.clear()
        self._uncapturable.clear()
        self._graph_pool = None  # a pool id with no live graph may not be captured into again

    def retune(self, tune: Tuning | Mapping | None = None) -> None:
        """Replaces the tuning table (a :class:`Tuning`) or entries of it (a mapping, see
        :meth:`Tuning.replace`; benchmarks); drops plans and graphs."""
        tuning = tune if isinstance(tune, Tuning) else self.planner.tuning.replace(tune)
        self.planner.retune(tuning)
        self.pipeline.clear()
        self._drop_graphs()

    @property
    def stream(self) -> "torch.cuda.Stream | None":
        """The engine's CUDA stream (None on the CPU device)."""
        return self._stream

    def graph_of(self, nq: int, k: int, precision: str | None = None) -> "torch.cuda.CUDAGraph | None":
        """The CUDA graph that a search of ``nq`` host queries (no filter) replays, None until
        one ran: benchmarks time a replay alone."""
        kind = self.scan_kind(nq, k, precision or self.precision)
        return self._graphs.get(self._key(kind, nq, k, False, True, True, False))

    def plan(self, q: int, k: int, precision: str | None = None) -> Plan:
        """The launch plan (tiles, programs, merge levels) a batch of q queries would use."""
        kind = self.scan_kind(q, k, precision or self.precision)
        return self.planner.plan(kind, next_pow2(q), k_bucket(k), self.rows.capacity)

    def scan_kind(self, nq: int, k: int, precision: str) -> str:
        """What a batch of ``nq`` queries scans (:meth:`Planner.scan_kind`)."""
        return self.planner.scan_kind(nq, k, precision, has_int8=self.columns.x8 is not None,
                                      capacity=self.rows.capacity)
