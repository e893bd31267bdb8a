"""GPU kernels that serve the sidecar's slots by themselves: no Python on the recall path.

Why. Through the sidecar's sweep a single recall costs about as much Python (finding the
request, validating it, the launch, the wait, publishing) as GPU work, and beside another
process that keeps the GPU busy the launch also waits for a time slice (figures:
``docs/gpu-kernels.md``, BENCHMARKS.md). Here a kernel polls the slots' ``req_seq`` words in
the page-locked segment, and the answer and ``resp_seq`` are written into the slot, which the
client is spinning on.

:class:`SlotGraphServer` (``serve --gpu-polling graph``, the default on a GPU) does it
with CUDA graphs whose first kernel (one program) waits for requests and stages them; the
engine's own kernels follow (the scan over the whole GPU, the selection, the final kernel,
which publishes each answer in its slot). The sweep keeps a few replays queued. Only one
program spins while waiting, so the sweep's own work (handed-over requests) runs beside it at
full speed. (A ``resident`` mode, one kernel on every SM, was removed: the graph server beat
every figure it recorded, BENCHMARKS.md.)

Rounds. While one request at a time is pending a round takes one and runs the single-query
kernels (:func:`~kalos.engine.gpu.kernels.poll.await_request_kernel`). With more, a round is
a batch (:func:`~kalos.engine.gpu.kernels.poll.await_requests_kernel`): once a request is
pending the kernel waits ``window_s`` for the others, longer while more keep coming (each
within ``gap_s`` of the last, up to ``window_max_s``), no longer once as many have asked as
the recent rounds found, or every connected client), then takes every pending request of the
first one's k, whatever their namespaces and windows, up to the round's size: a crowd of C
agents is one pass over the rows, not C. Each size is its own graph, captured at
:meth:`SlotGraphServer.warm`. The size follows demand: each round reports how many servable
requests it found pending; the host queues the next rounds at the power of two that holds
them (at once when that grows, after ``resize_s`` of smaller rounds when it shrinks).

k buckets. A round's kernels are built for a k bucket (the columns of the selection and the
final kernel), and a round at the bucket of 8 costs less than at 16 (docs/gpu-kernels.md, two
k buckets). Rounds start at the bucket of ``SMALL_K`` (Client.recall's default); a request
past it (up to ``max_k``) is handed to the host and reported (the host control word
``k_wanted``); at its next look (:meth:`SlotGraphServer.running`) the host stops the rounds
queued at the smaller bucket (a round that handed a request over goes on waiting) and serves
with the larger from then on, until ``k_resize_s`` passes without such a request (across the
server's stops and starts: a sidecar whose clients ask for such k off and on keeps serving
them on the GPU).

Clients coming and going. The kernels poll every slot, and the channel mirrors which have a
client into page-locked words (:attr:`SlotGraphServer.in_use`) that each poll reads, so a new
client is served without a restart. A slot changes hands at rest (``kalos.ipc.protocol``:
its generation in the sequence numbers' high bits), so the kernels' record of what they
answered in it never matches the new client's requests; and the sidecar hands out, while
the kernels run, only a slot whose last request was answered and that no round holds
(:attr:`SlotGraphServer.taken`, which the kernels keep): none of their rounds can still
write into it.

What it serves. A single query (``n_queries == 1``) with ``k <= max_k``, all namespaces or one
named, a created_at window or none, and a query that is finite and non-zero. A round's requests
share k; their namespaces and windows may all differ (each query's are in its gather-table row,
``kalos.engine.gpu.layout``): agents each keep their own namespace, and those asking for "the last
hour" each send their own window. Anything else (batches, where clauses, larger k, a name the
namespace table does not hold, bad input, a window the host would refuse) is *handed* to the host:
the kernel records its ``req_seq`` in ``handed``, and the sidecar's sweep answers it through the
engine's ordinary (batched) path (with its error, for bad input). A round leaves the servable
requests it does not take (beyond its size, or of another k) pending for the next round. Fast
mode re-scores its candidates in float32 and hands the request over when the certificate fails.

Ownership of a slot's answer. A request is the kernel's when the kernel took it, the host's
when it is in ``handed``: the two never answer the same one. ``answered`` is the sidecar's own
record of answered sequence numbers (the channel adopts it), written by the kernel for its
answers and by the sweep for the host's.

Lifetime. ``start`` launches on the server's own high-priority stream; the server stops by
itself after ``idle_s`` without a request (a kernel spinning forever would take GPU time from
the LLM next to it), or when ``stop`` asks. The sidecar stops it before anything changes the
engine (adds, deletes, compaction), and before a new client takes a slot whose previous
client left a request unanswered; it starts it again on the next request.

On PyTorch's CPU device (tests, under ``TRITON_INTERPRET=1``) the rounds run synchronously:
``start`` returns after the server has served what was pending and polled ``idle_polls`` more
times.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time

import numpy as np
import torch

from kalos.engine.base import Filter
from kalos.engine.gpu.buffers import NO_BOUND
from kalos.engine.gpu.engine import TorchEngine
from kalos.engine.gpu.layout import (
    CTL_WORDS,
    DEVICE_CONTROL,
    HCTL_WORDS,
    HDR_WORDS,
    HOST_CONTROL,
    NAME_ENTRY,
    TAB_WORDS,
)
from kalos.engine.gpu.pipeline import GemmScratch, SplitBuffers
from kalos.engine.gpu.planner import STAGE_SPLIT_MAX, Plan, k_bucket, next_pow2
from kalos.errors import InvalidArgument
from kalos.ipc.protocol import NAMESPACE_BYTES, Layout, Op, RequestFlag, SlotWords

__all__ = ["SlotGraphServer", "DEFAULT_MAX_K", "SMALL_K", "DEFAULT_BATCH", "DEFAULT_WINDOW_S", "DEFAULT_GAP_S",
           "DEFAULT_WINDOW_MAX_S", "waiting_warps"]

log = logging.getLogger(__name__)

#: Largest k the kernel serves itself (larger ones go to the host path).
DEFAULT_MAX_K = 16
#: The k that rounds serve in their smaller k bucket (Client.recall's default): past it, up to
#: max_k, rounds of the larger bucket serve, queued once such a request shows up.
SMALL_K = 8
#: Most requests one round takes.
DEFAULT_BATCH = 64
#: How long a round, once a request is pending, waits for the rest of the crowd.
DEFAULT_WINDOW_S = 20e-6
#: Past the window, how long a round goes on waiting for the next request of a crowd that keeps
#: coming, and the most it waits in all (from its first request). More clients than cores come
#: back from one round over tens of microseconds: without it, a crowd of 64 on 16 cores
#: settled into two cohorts of about 32, each round's waiting on the other's (BENCHMARKS.md).
DEFAULT_GAP_S = 10e-6
DEFAULT_WINDOW_MAX_S = 80e-6
#: How long the rounds must find fewer requests before they are queued smaller.
DEFAULT_RESIZE_S = 2e-3
#: How long rounds keep the larger k bucket after the last request that needed it: a switch
#: down costs the next such request a trip to the host, a round kept up a few microseconds.
DEFAULT_K_RESIZE_S = 1.0


@dataclasses.dataclass
class _Round:
    """A round of ``qb`` requests at one k bucket: what it scans, its plan, workspace and graph.

    Every round owns its buffers: a graph keeps the addresses it was captured with, so a
    buffer shared between rounds and grown for a larger one would leave the smaller one's
    graph pointing at freed memory. (The one exception: the rounds of one size at the two k
    buckets share ``ws_s``, whose size does not depend on k; see :meth:`SlotGraphServer._round_for`.)"""

    qb: int
    kind: str
    plan: Plan
    ws_a: torch.Tensor
    ws_b: torch.Tensor
    ws_s: torch.Tensor
    bound: torch.Tensor
    split: SplitBuffers  # the final kernel's split re-score's
    scratch: GemmScratch | None  # (a round's that selects by threshold, or a GEMM round's)
    graph: "torch.cuda.CUDAGraph | None" = None

_NAME_ROWS = 1024  # rows of the device's namespace table (a power of two)
_NAME_PROBE = 8  # rows a name may sit in, from its home row on (kernels.poll.NS_PROBE)
_NAME_WORDS = 8  # int64 words of a name the kernels compare (names of up to 64 bytes; longer: the host)


def name_home(words: np.ndarray, length: int, rows: int = _NAME_ROWS) -> int:
    """The home row of a namespace name in the device table: ``words`` are its NAMESPACE_BYTES
    bytes, zero-padded, as 8 int64 words. The kernels compute the same (``_name_home``)."""
    fold = (words.astype(np.int64) ^ (words.astype(np.int64) >> 32)) & 0xFFFFFFFF
    mult = ((np.arange(8, dtype=np.int64) * 0x9E37 + 0x7F4B) & 0xFFFF) | 1
    h = int((fold * mult).sum()) + int(length) * 0x2545
    return (h ^ (h >> 13) ^ (h >> 29)) & (rows - 1)


def waiting_warps(ns: int) -> int:
    """The waiting kernels' warps for ``ns`` slots (a power of two): one per 32 slots, 1 to 8.

    Their per-slot tensors ([ns] words, and [ns, request words] while a request is read) are
    spread over the program's threads: with one warp past 32 slots they outgrow the registers,
    and the spills to local memory made every round slower (``ptxas -v``: 2.4 KB of stack at
    128 slots and one warp, none at 4; BENCHMARKS.md, the crowd: how it works)."""
    return max(1, min(8, ns // 32))


class SlotGraphServer:
    """Serves single recalls from the slots with CUDA graphs that start by waiting for them.

    A round's graph: a waiting kernel (one program polls the slots and stages what it takes:
    :func:`~kalos.engine.gpu.kernels.poll.await_request_kernel`, one request, for a single
    client; :func:`~kalos.engine.gpu.kernels.poll.await_requests_kernel`, a crowd's requests of
    one k, then the stage-in of their queries), then the engine's own kernels for that many
    queries (the scan over the whole GPU, the selection, the final kernel, which publishes each
    answer in its slot). :meth:`start` picks the first round from the clients connected
    (:meth:`bucket`), the demand the later ones. :meth:`running`, which the sidecar's sweep
    calls on every pass, keeps ``depth`` replays queued on the server's stream, so the next
    round's waiting kernel is already on the GPU when a request lands and no Python runs
    between the client's ``req_seq`` and its answer. (Not a thread of its own: it would wait for the GIL behind the
    spinning sweep, up to the interpreter's switch interval.) Only one program spins while it
    waits: the sweep's kernels (handed-over work) run beside it at full speed.

    ``engine``: a Triton-backend :class:`TorchEngine` with the segment attached
    (:meth:`~TorchEngine.attach_host`). ``layout``: the segment's layout. ``answered``: the
    channel's current record of answered sequence numbers (copied into page-locked memory,
    which the channel then adopts). ``idle_s``: how long the waiting kernel polls without a
    request before the server stops. ``max_k``: largest k served (rounded up to a power of
    two). ``depth``: replays queued ahead. ``warps``: the waiting kernels' (default: by the
    slot count, :func:`waiting_warps`). ``batch``: most
    requests a round takes (rounded down to a power of two). ``window_s``: how long a batch
    round, once a request is pending, waits for the other connected clients'; ``gap_s`` (at
    most the window), then, how long it waits for the next one while they keep coming, up to
    ``window_max_s`` from the first (on the CPU device: ``window_polls`` polls, then one poll
    without a new request, four windows at most). ``resize_s``: how long the rounds must find fewer requests before
    smaller ones are queued; ``k_resize_s``: how long they keep the larger k bucket after the
    last request past the smaller. On PyTorch's CPU device (tests) :meth:`start` runs rounds
    synchronously, without a graph, until the waiting kernel stops (``idle_polls`` polls
    without a request); those keep the first round's size.
    """

    def __init__(self, engine: TorchEngine, layout: Layout, answered: np.ndarray, *, idle_s: float = 0.002,
                 max_k: int = DEFAULT_MAX_K, depth: int = 3, idle_polls: int = 2, warps: int | None = None,
                 batch: int = DEFAULT_BATCH, window_s: float = DEFAULT_WINDOW_S, window_polls: int = 2,
                 gap_s: float = DEFAULT_GAP_S, window_max_s: float = DEFAULT_WINDOW_MAX_S,
                 resize_s: float = DEFAULT_RESIZE_S, k_resize_s: float = DEFAULT_K_RESIZE_S) -> None:
        if batch < 1:
            raise InvalidArgument(f"batch must be >= 1, got {batch}")
        if min(window_s, window_polls, gap_s, window_max_s, resize_s, k_resize_s) < 0:
            raise InvalidArgument("window_s, window_polls, gap_s, window_max_s, resize_s and k_resize_s must be >= 0")
        if depth < 1:
            raise InvalidArgument(f"depth must be >= 1, got {depth}")
        if warps is not None and warps not in (1, 2, 4, 8):
            raise InvalidArgument(f"warps must be 1, 2, 4 or 8, got {warps}")
        if engine.backend != "triton" or engine.attached is None:
            raise InvalidArgument("the slot server needs the Triton engine with the segment attached (attach_host)")
        if not 1 <= max_k <= 256:
            raise InvalidArgument(f"max_k must be in [1, 256], got {max_k}")
        if idle_s < 0 or idle_polls < 0:
            raise InvalidArgument("idle_s and idle_polls must be >= 0")
        if len(answered) != layout.n_slots:
            raise InvalidArgument(f"answered has {len(answered)} entries for {layout.n_slots} slots")
        self.depth = int(depth)
        self.engine = engine
        self.layout = layout
        self.words = SlotWords.of(layout)
        if NAMESPACE_BYTES < 8 * _NAME_WORDS:
            raise AssertionError("the kernels read a namespace's first 8 int64 words from the slot")
        self.on_gpu = engine.on_gpu
        #: The k buckets of the rounds, smallest first: SMALL_K's, and the largest k served's
        #: (max_k, at most the slots' k) if larger.
        top = min(max_k, layout.max_k)
        self.kouts = tuple(sorted({k_bucket(min(SMALL_K, top)), k_bucket(top)}))
        self.idle_s = float(idle_s)
        self.idle_polls = int(idle_polls)
        self.window_s = float(window_s)
        self.window_polls = int(window_polls)
        self.gap_s = min(float(gap_s), self.window_s)  # (no window: a round takes what is pending at once)
        self.window_max_s = max(float(window_max_s), self.window_s)
        self.resize_s = float(resize_s)
        self.k_resize_s = float(k_resize_s)
        self.ns = next_pow2(layout.n_slots)
        self.warps = waiting_warps(self.ns) if warps is None else int(warps)
        #: The largest round: a power of two, at most ``batch`` and the slot count's.
        self.max_bucket = min(1 << (int(batch).bit_length() - 1), self.ns)
        dev = engine.torch_device

        # Page-locked host words the kernels write and the sweep reads (and the reverse).
        self._host = torch.zeros(4 * self.ns + HCTL_WORDS, dtype=torch.int64, pin_memory=self.on_gpu)
        host = self._host.numpy()
        #: Sequence number answered, per slot: the channel's record (the kernels write it too).
        self.answered = host[: layout.n_slots].view(np.uint64)
        #: Sequence number the kernels handed to the host, per slot.
        self.handed = host[self.ns : self.ns + layout.n_slots].view(np.uint64)
        #: 1 where a slot has a client (the channel mirrors its table here; every poll reads it).
        self.in_use = host[2 * self.ns : 2 * self.ns + layout.n_slots]
        #: The seq a round took from each slot, 0 once its answer is out (or it went to the host):
        #: a slot is handed to a new client only at 0 (the client's own words could lie).
        self.taken = host[3 * self.ns : 3 * self.ns + layout.n_slots]
        # The host control words (HOST_CONTROL_DTYPE, kalos.engine.gpu.layout).
        self._hctl = host[4 * self.ns :]
        self.answered[:] = answered
        self._t_answered = self._host[: self.ns]
        self._t_handed = self._host[self.ns : 2 * self.ns]
        self._t_in_use = self._host[2 * self.ns : 3 * self.ns]
        self._t_taken = self._host[3 * self.ns : 4 * self.ns]
        self._t_hctl = self._host[4 * self.ns :]
        #: Every word above: what the kernels write there is their news (a round began, took
        #: requests, handed one over, answered, stopped), which the sweep waits for.
        self.host_words = host

        base = np.array([layout.slot_offset(s) for s in range(layout.n_slots)], np.int64)
        self._slot_words = base // 8
        self._slot_at = torch.full((self.ns,), -1, dtype=torch.int64, device=dev)
        self._seen = torch.zeros((2, self.ns), dtype=torch.int64, device=dev)
        self._dq = torch.zeros(self.max_bucket * engine.dim, dtype=torch.float32, device=dev)
        # The kernels read a request's words as one tile, its namespace's 8 words included.
        self._req_words = next_pow2(self.words.ns_bytes + _NAME_WORDS)
        self._agree = torch.zeros(self.ns * (self._req_words + 2) + 16, dtype=torch.int64, device=dev)
        if getattr(engine.kernels.NS_PROBE, "value", engine.kernels.NS_PROBE) != _NAME_PROBE:
            raise AssertionError("the kernels and the host disagree on the namespace table's probe")
        self._ns_tab = torch.zeros((_NAME_ROWS, 9), dtype=torch.int64, device=dev)
        # The ids, then the name entry the kernels found last (NAME_ENTRY_DTYPE: _namespace_id),
        # then each slot's last (_namespace_ids); a length of -1 is none.
        self._ns_ids = torch.full((_NAME_ROWS + NAME_ENTRY.words * (1 + self.ns),), -1, dtype=torch.int64,
                                  device=dev)
        self._names: dict[bytes, int] = {}
        self._stream = torch.cuda.Stream(device=dev, priority=-100) if self.on_gpu else None
        self.launches = 0
        #: Rounds queued (the CPU device: run) since the server was made; with :attr:`served`, the
        #: requests a round took on average. (It counts the last few queued before a stop or an
        #: idle end too, which then take none: a crowd's thousands of rounds hide them.)
        self.rounds = 0

        # The header and a table row per request of the largest round.
        self._dh = torch.zeros(HDR_WORDS + TAB_WORDS * self.max_bucket, dtype=torch.int64, device=dev)
        self._ctl = torch.zeros(CTL_WORDS, dtype=torch.int64, device=dev)  # DEVICE_CONTROL_DTYPE
        self._status = torch.zeros(self.max_bucket, dtype=torch.int32, device=dev)
        # A split stage-in's sums of squares and arrival counts (Tuning.stage_split).
        self._stage_parts = torch.zeros((self.max_bucket, STAGE_SPLIT_MAX), dtype=torch.float64, device=dev)
        self._stage_arrived = torch.zeros(self.max_bucket, dtype=torch.int32, device=dev)
        self._rounds: dict[tuple[int, int], _Round] = {}  # per (bucket, k bucket): plan, workspace, graph
        self._bucket = 1  # the round queued next: start() chooses it, then the demand (_follow_demand)
        self._kout = self.kouts[0]  # its k bucket: the smaller at first, then the demand (_follow_k)
        self._kout_ok = self.kout  # the largest k bucket whose rounds could be captured
        self._k_seen_at = -float("inf")  # when a request past the smaller k bucket was last reported
        self._follow = True  # (False: start() was told the round)
        self._largest_ok = self.max_bucket  # below the smallest round whose capture failed
        self._peak = 0  # most the rounds found since the period began
        self._period_began = 0.0
        self._built_for: tuple | None = None
        self._queued: collections.deque = collections.deque()  # an event per replay not yet done
        # Between start() and stop() (or a round's report that it stopped): only then
        # does running() queue rounds. A stop() that finds every round done must end it too.
        self._serving = False
        self._ran = False  # rounds were launched since the last stop()

    @property
    def kout(self) -> int:
        """The largest k bucket: the rounds that serve every k the server serves."""
        return self.kouts[-1]

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._stream) if self.on_gpu else contextlib.nullcontext()

    def _request_constexprs(self) -> dict:
        """Where the kernels find a slot's fields (kalos.ipc.protocol.SlotWords)."""
        w = self.words
        return dict(W_REQ=w.req_seq, W_OPK=w.op_k, W_NQF=w.nq_flags, W_SINCE=w.since, W_UNTIL=w.until,
                    W_NSLEN=w.ns_len, W_NSB=w.ns_bytes, REQ_WORDS=self._req_words,
                    F_SINCE=int(RequestFlag.HAS_SINCE), F_UNTIL=int(RequestFlag.HAS_UNTIL), E_Q=w.queries,
                    D=self.engine.dim, NS=self.ns, NSMAX=_NAME_ROWS,
                    BLOCK_DQ=min(2048, next_pow2(self.engine.dim)), ON_GPU=self.on_gpu)

    def _rows_to_serve(self) -> int:
        """Rows in use (0: nothing to serve), the engine's pending search finished; refuses a
        start while running."""
        if self.running():
            raise InvalidArgument("the slot server is already running")
        n = self.engine.rows.size
        if n:
            self.engine.settle()
        return n

    def _load_slots(self) -> None:
        """Where the slots are, and what was answered or handed already in each."""
        slot_at = np.zeros(self.ns, np.int64)
        slot_at[: self.layout.n_slots] = self._slot_words
        seen = np.zeros((2, self.ns), np.int64)
        seen[0, : self.layout.n_slots] = self.answered.view(np.int64)
        seen[1, : self.layout.n_slots] = self.handed.view(np.int64)
        with self._on_stream():
            self._slot_at.copy_(torch.from_numpy(slot_at))
            self._seen.copy_(torch.from_numpy(seen))

    def warm(self) -> None:
        """Compiles and captures every round now (a launch that exits at once), not on the
        first request: a compile in the middle of serving would stall every client. If the
        rounds of the larger k bucket cannot be captured (the GPU's memory, say), the smaller
        bucket's serve alone, and requests past it go to the host."""
        try:
            for kout in self.kouts:
                try:
                    qb = 1
                    while qb <= self.max_bucket:
                        if not self.start(np.zeros(self.layout.n_slots, bool), exit_at_once=True, bucket=qb,
                                          kout=kout):
                            return  # nothing to scan yet
                        self.stop()
                        qb *= 2
                except Exception as exc:  # noqa: BLE001 - the smaller bucket's rounds still serve
                    if kout == self.kouts[0]:
                        raise
                    log.warning("capturing the GPU's rounds for k <= %d failed (%s); requests for k > %d go to the "
                                "host", kout, exc, self.kouts[0])
                    self._kout_ok = self.kouts[0]
                    self._reset_after_failed_capture()
        finally:
            self._kout = self.kouts[0]  # (serving starts at the smaller k bucket)

    def set_namespaces(self, names: dict[bytes, int]) -> None:
        """The namespaces (UTF-8 name -> id) a request may name (call while stopped). Each goes
        to the first free row of the device table from its home row (:func:`name_home`) on;
        one that finds none of its ``_NAME_PROBE`` rows free (rare below a few hundred names),
        and one longer than 64 bytes, stays with the host: requests naming it are handed over."""
        if names == self._names:
            return
        if any(ns_id < 0 for ns_id in names.values()):
            raise InvalidArgument("namespace ids must be >= 0 (-1 marks an unused row of the table)")
        tab = np.zeros((_NAME_ROWS, 9), np.int64)
        ids = np.full(len(self._ns_ids), -1, np.int64)  # (the names found last, the slots' too: none)
        for name, ns_id in names.items():
            if len(name) > 8 * _NAME_WORDS:
                # The kernels compare the first 8 words and the length: a longer name is never in
                # the table, so no request (its length is over 64 too) matches a row, and the host
                # answers every request naming one.
                continue
            words = np.frombuffer(name.ljust(8 * _NAME_WORDS, b"\0"), np.int64)
            home = name_home(words, len(name))
            for step in range(_NAME_PROBE):
                row = (home + step) % _NAME_ROWS
                if ids[row] < 0:
                    tab[row, :8] = words
                    tab[row, 8] = len(name)
                    ids[row] = ns_id
                    break
        with self._on_stream():
            self._ns_tab.copy_(torch.from_numpy(tab))
            self._ns_ids.copy_(torch.from_numpy(ids))
        self._names = dict(names)

    @property
    def served(self) -> int:
        """Requests the kernels have answered, over all launches: exact once stopped; while
        running, a lower bound (a round's programs store their counts in any order)."""
        return int(self._hctl[HOST_CONTROL.answers])

    def stamps(self) -> tuple[int, int, int, int]:
        """The GPU's clock (ns) when the latest round began to wait, first saw a request, staged
        it, and published its answer (diagnostics: ``benchmarks/diagnostics.py``)."""
        h, c = self._hctl, HOST_CONTROL
        return int(h[c.t_wait]), int(h[c.t_seen]), int(h[c.t_staged]), int(h[c.t_published])

    def _columns(self) -> tuple:
        eng = self.engine
        return (eng.rows.capacity, eng.attached.host.tensor.data_ptr(),
                *(None if t is None else t.data_ptr() for t in eng.columns.tensors()))

    def _build(self) -> None:
        """Forgets every round's plan, scratch and graph: the engine's columns changed
        (capacity, addresses)."""
        self._rounds = {}
        self._built_for = self._columns()

    def bucket(self, clients: int) -> int:
        """The round that serves ``clients`` requests at once: 1 (the single-query kernels) for
        one, else the power of two that holds them all, at most ``max_bucket``."""
        return 1 if clients <= 1 else min(next_pow2(clients), self._largest_ok)

    def _follow_demand(self) -> None:
        """Sizes the rounds queued from now by what the latest rounds found pending: larger at
        once, smaller only after ``resize_s`` in which no round found more (a crowd's rounds
        vary; a graph too large waits its window for clients that are not asking)."""
        now = time.perf_counter()
        self._follow_k(now)
        demand = int(self._hctl[HOST_CONTROL.demand])
        self._peak = max(self._peak, demand)
        if demand <= self._hctl[HOST_CONTROL.expect] and now - self._period_began < self.resize_s:
            return
        if self._peak > 0:
            self._set_expect(self._peak)
        self._peak = 0
        self._period_began = now

    def _kout_for(self, k: int) -> int:
        """The k bucket of the rounds that serve ``k`` (reports never exceed the largest), at
        most the largest whose rounds could be captured."""
        return min(next((b for b in self.kouts if b >= k), self.kout), self._kout_ok)

    def _wants_larger_k(self) -> bool:
        """Whether a round reported a request that only rounds of a larger k bucket than the
        queued ones serve."""
        wanted = int(self._hctl[HOST_CONTROL.k_wanted])
        return wanted > 0 and self._kout_for(wanted) > self._kout

    def _follow_k(self, now: float) -> None:
        """The k bucket of the rounds queued from now: the larger at once when a round reported
        a request past the smaller (it handed it to the host), the smaller again after
        ``k_resize_s`` without one. (The word is read, then cleared: a report stored in between
        is lost, and the next such request reports again.)"""
        wanted = int(self._hctl[HOST_CONTROL.k_wanted])
        if wanted:
            self._hctl[HOST_CONTROL.k_wanted] = 0
            self._k_seen_at = now
            self._kout = max(self._kout, self._kout_for(wanted))
        elif self._kout != self.kouts[0] and now - self._k_seen_at >= self.k_resize_s:
            self._kout = self.kouts[0]

    def _set_expect(self, expect: int) -> None:
        """The expect word (most servable requests a round found lately), and the round that holds them."""
        self._hctl[HOST_CONTROL.expect] = expect
        self._bucket = self.bucket(expect)

    def _round_for(self, qb: int, kout: int) -> "_Round":
        """The plan and scratch of a round of ``qb`` requests at k bucket ``kout`` (made on first use)."""
        held = self._rounds.get((qb, kout))
        if held is None:
            eng = self.engine
            kind = eng.scan_kind(qb, kout, eng.precision)
            plan = eng.pipeline.plan(kind, qb, kout)
            scores = max(1, eng.rows.capacity * qb if plan.score_chunk and not plan.gemm_rows else 0)
            dev = eng.torch_device
            # The round of the same size at the other k bucket lends its scores (capacity x qb
            # floats: the largest buffer), never replaced while its graph lives: rounds run one
            # at a time on the server's stream. (Not the GEMM scratch: its selection buffers
            # grow with k, which would leave the other graph pointing at freed memory.)
            sibling = next((r for (size, _k), r in self._rounds.items() if size == qb), None)
            with self._on_stream():
                held = _Round(
                    qb, kind, plan,
                    torch.empty(plan.ws_keys * qb, dtype=torch.int64, device=dev),
                    torch.empty(plan.ws_keys * qb, dtype=torch.int64, device=dev),
                    sibling.ws_s if sibling is not None and sibling.ws_s.numel() == scores
                    else torch.empty(scores, dtype=torch.float32, device=dev),
                    torch.full((qb,), NO_BOUND, dtype=torch.int64, device=dev),  # (the final kernel resets it)
                    eng.pipeline.new_split_buffers(qb),
                    eng.pipeline.new_scratch(qb) if plan.threshold or plan.gemm_rows else None,
                )
            self._rounds[(qb, kout)] = held
        return held

    def _round(self, qb: int, kout: int) -> None:
        """One round's kernels on the current stream: wait for requests, scan, select, answer.

        A graph keeps the launch arguments it was captured with: what may change between
        starts (the rows in use, the largest row norm, the namespace table) is read from device
        memory instead; ``idle_s``, the gathering's times and the engine's tuning are those of the capture."""
        eng = self.engine
        att = eng.attached
        w = self.words
        rnd = self._round_for(qb, kout)
        idle = int(self.idle_s * 1e9) if self.on_gpu else self.idle_polls
        dh, dhf, dq = self._dh, self._dh.view(torch.float64), self._dq.view(self.max_bucket, eng.dim)
        max_k = self.layout.max_k
        k_limits = (min(kout, max_k), min(self.kouts[0], max_k), min(self.kout, max_k))  # its, reported past, most
        if qb == 1:
            eng.kernels.await_request_kernel[(1,)](
                att.i64, att.f32, self._slot_at, self._t_in_use, self._t_taken, self._seen, self._t_handed,
                self._t_hctl, self._ctl, dh, self._dq, self._agree, self._ns_tab, self._ns_ids, self.layout.n_slots,
                *k_limits, idle, int(Op.RECALL), int(RequestFlag.ALL_NAMESPACES), **self._request_constexprs(),
                E_IDS=w.ids, E_SC=w.scores, num_warps=self.warps,
            )
        else:
            if self.on_gpu:
                window, gap, window_max = (int(s * 1e9) for s in (self.window_s, self.gap_s, self.window_max_s))
            else:  # (polls: the window's, one quiet poll (none with no window), four windows at most)
                window, gap, window_max = self.window_polls, min(1, self.window_polls), 4 * self.window_polls
            constexprs = self._request_constexprs()
            del constexprs["D"], constexprs["BLOCK_DQ"]
            eng.kernels.await_requests_kernel[(1,)](
                att.i64, self._slot_at, self._t_in_use, self._t_taken, self._seen, self._t_handed, self._t_hctl,
                self._ctl, dh, self._agree, self._ns_tab, self._ns_ids, self.layout.n_slots, *k_limits, idle, window,
                gap, window_max, int(Op.RECALL), int(RequestFlag.ALL_NAMESPACES), **constexprs, E_IDS=w.ids, E_SC=w.scores,
                QB=qb,
                num_warps=self.warps,
            )
            # The queries, straight from the slots the table names, normalised (the scale
            # written back to the table: the final kernel hands a bad query to the host).
            split = eng.tuning.stage_split
            if split > 1:
                piece = max(1, next_pow2(eng.dim) // split)
                eng.kernels.stage_queries_kernel[(qb, split)](
                    dh, dhf, att.f32, dq, self._stage_parts, self._stage_arrived, D=eng.dim, PIECE=piece,
                    SPLIT=split, num_warps=4)
            else:
                eng.kernels.stage_in_kernel[(qb,)](dh, dhf, att.f32, dh, dq, D=eng.dim,
                                                   BLOCK_D=min(1024, next_pow2(eng.dim)), COPY_Q=True, NORM=True,
                                                   COPY_META=False, num_warps=4)
        pipe, plan = eng.pipeline, rnd.plan
        over = None
        if plan.gemm_rows:
            slices = -(-eng.rows.capacity // plan.gemm_rows)  # (rows may grow up to the capacity)
            stride = plan.ws_keys
            over = pipe.gemm_scores(rnd.kind, qb, plan, slices, rnd.ws_a, stride, eng.columns.live, True, dh, dhf,
                                    dq, scratch=rnd.scratch)
        else:
            stride, over = pipe.scan_keys(rnd.kind, plan, qb, dh, dhf, dq, eng.columns.live, True, rnd.ws_a,
                                          rnd.ws_s, rnd.bound, scratch=rnd.scratch)
        pipe.select_final(
            rnd.kind, plan, qb, rnd.ws_a, rnd.ws_b, stride, dh, dhf, dq, att.i64, att.f32, self._status,
            True, over=over, bound=rnd.bound, split=rnd.split,
            publish=dict(PUBLISH=True, SEG=att.i64, DSEEN=self._seen, HANS=self._t_answered, HHOF=self._t_handed,
                         HTAKEN=self._t_taken, HCTL=self._t_hctl, CTL=self._ctl, W_STATN=w.status_n, W_RESP=w.resp_seq, NS=self.ns,
                         ON_GPU=self.on_gpu),
        )

    def running(self) -> bool:
        """Whether rounds are queued or running; tops the queue up to ``depth`` rounds unless
        a round reported the server stopped (a stop, or ``idle_s`` without a request)."""
        queued = self._queued
        while queued and queued[0].query():
            queued.popleft()
        if self._serving and self._hctl[HOST_CONTROL.stopped] == 0:
            if self._follow and self._wants_larger_k():
                # The queued rounds would hand every such request to the host (a round that
                # hands one over goes on waiting): they are stopped, and serving starts again
                # at the larger bucket (start() reads the report).
                self.stop()
                return self.start(self.in_use)
            if len(queued) < self.depth:
                if self._follow:
                    serving = self._bucket, self._kout
                    self._follow_demand()
                    self._ensure_graph(self._bucket, self._kout, serving)
                queued.extend(self._enqueue_rounds(self.depth - len(queued)))
        elif not queued:
            self._serving = False
        return bool(queued)

    def _needs_capture(self, qb: int, kout: int) -> bool:
        """Whether the round of ``qb`` requests at k bucket ``kout`` has no graph (on the GPU; the
        CPU runs rounds eagerly)."""
        held = self._rounds.get((qb, kout))
        return self.on_gpu and (held is None or held.graph is None)

    def _ensure_graph(self, qb: int, kout: int, serving: tuple[int, int]) -> None:
        """Captures the round of ``qb`` requests at k bucket ``kout`` if the demand asks for one
        not captured since the engine's columns last changed (warm() captured every round; a change of the
        columns forgets them, and start() captures only its own): the queued rounds are
        drained first, so that the capture's eager round runs alone, then serving goes on.
        If the capture fails (memory for a larger round, say), serving goes on with the round
        ``serving`` (requests, k bucket; captured: it was being replayed), no round as large
        (or of as large a k bucket) is asked for again, and a smaller one that failed ends this
        run's following of the demand."""
        if not self._needs_capture(qb, kout):
            return
        self.stop()
        try:
            self._capture(qb, kout)
        except Exception:  # noqa: BLE001 - the rounds captured already still serve
            log.exception("capturing the GPU's round of %d requests at k <= %d failed; serving with rounds of %d "
                          "at k <= %d", qb, kout, *serving)
            if qb > serving[0]:
                self._largest_ok = max(1, qb // 2)
            elif kout > serving[1]:
                self._kout_ok = serving[1]
            else:
                self._follow = False
            self._bucket, self._kout = serving
            self._reset_after_failed_capture()
        self._serving = True
        self._ran = True

    def _reset_after_failed_capture(self) -> None:
        """The drained rounds and a failed capture's eager round may have stopped the server and
        left a request taken: nothing runs now, so both are reset (as a start would)."""
        self.taken[:] = 0
        self._hctl[HOST_CONTROL.stopped] = 0
        with self._on_stream():
            self._ctl[DEVICE_CONTROL.stopped] = 0

    def _enqueue_rounds(self, count: int) -> list:
        """Replays the graph ``count`` times on the server's stream; an event per replay."""
        events = []
        with self._on_stream():  # replay() launches on the current stream
            graph = self._rounds[(self._bucket, self._kout)].graph
            for _ in range(count):
                graph.replay()
                done = torch.cuda.Event()
                done.record(self._stream)
                events.append(done)
        self.rounds += count
        return events

    def start(self, active: np.ndarray, *, exit_at_once: bool = False, bucket: int | None = None,
              kout: int | None = None) -> bool:
        """Starts serving the slots, with rounds that first hold every client in ``active``
        (those connected now), at the k bucket the last run ended with (the smaller one at
        first), and then follow demand; ``bucket`` fixes the round instead (at k bucket
        ``kout``, by default the largest). False when there is nothing to serve (no rows). Call
        only while it is not running. Which slots are polled is :attr:`in_use`'s (the channel
        keeps it)."""
        n = self._rows_to_serve()
        if n == 0:
            return False
        eng = self.engine
        if self._built_for != self._columns():
            self._build()
        clients = int(np.count_nonzero(active))
        qb = self.bucket(clients) if bucket is None else int(bucket)
        if qb != 1 and (qb < 1 or qb > self.max_bucket or qb & (qb - 1)):
            raise InvalidArgument(f"bucket must be 1 or a power of two up to {self.max_bucket}, got {bucket}")
        if kout is not None and kout not in self.kouts:
            raise InvalidArgument(f"kout must be one of the k buckets {self.kouts}, got {kout}")
        self._set_expect(clients)
        self._bucket = qb
        if kout is not None:  # (held from now: as if such a request had just been reported)
            self._hctl[HOST_CONTROL.k_wanted] = 0
            self._kout, self._k_seen_at = int(kout), time.perf_counter()
        elif bucket is None:  # (a request past the smaller k bucket since the last look: the larger)
            self._follow_k(time.perf_counter())
        else:  # a fixed round serves every k up to the largest bucket: none is reported
            self._hctl[HOST_CONTROL.k_wanted] = 0
            self._kout = self.kout
        self._follow = bucket is None
        self._peak = 0
        self._hctl[HOST_CONTROL.demand] = 0
        self._period_began = time.perf_counter()
        self.taken[:] = 0  # (nothing runs: a round that failed midway may have left one set)
        self._load_slots()
        header = np.zeros(HDR_WORDS, np.int64)
        eng.fill_header(n, 0, 0, Filter(), header)  # rows and the certificate's norm: the waiting
        # kernels fill in the requests' words (windows: each query's own, in its table row)
        self._hctl[HOST_CONTROL.stop] = 1 if exit_at_once else 0
        self._hctl[HOST_CONTROL.stopped] = 0
        with self._on_stream():
            self._dh[:HDR_WORDS].copy_(torch.from_numpy(header))
            self._ctl[DEVICE_CONTROL.stopped] = 0
        self.launches += 1
        self._ran = True
        if not self.on_gpu:  # the interpreter: rounds one after another until the server stops
            self._serve_now()
            return True
        if self._round_for(qb, self._kout).graph is None:
            self._capture(qb, self._kout)
        self._serving = True
        self.running()
        return True

    def _serve_now(self) -> None:
        """Rounds one after another, synchronously, until one stops (the CPU device)."""
        while self._hctl[HOST_CONTROL.stopped] == 0:
            self._round(self._bucket, self._kout)
            self.rounds += 1

    def _capture(self, qb: int, kout: int) -> None:
        """Compiles the kernels with one eager round (the stop word set: it serves at most what
        is already pending, then stops), then captures a round into the round's graph."""
        hctl, stop_at = self._hctl, HOST_CONTROL.stop
        stop = hctl[stop_at]
        hctl[stop_at] = 1
        try:
            with self._on_stream():
                self._round(qb, kout)
            self._stream.synchronize()
            with self._on_stream():
                self._ctl[DEVICE_CONTROL.stopped] = 0
            hctl[HOST_CONTROL.stopped] = 0
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                self._round(qb, kout)
            self._stream.synchronize()
        finally:
            hctl[stop_at] = stop
        self._rounds[(qb, kout)].graph = graph

    @property
    def stopped(self) -> bool:
        """Whether a round found the server stopped (a stop, or ``idle_s`` without a request):
        the rounds still queued do nothing, and write nothing more."""
        return bool(self._hctl[HOST_CONTROL.stopped])

    def stop(self) -> None:
        """Asks the waiting round to stop and waits for every queued round (a round with a
        request in hand finishes it). Nothing is queued again until :meth:`start`, which
        reloads what may have changed meanwhile (the rows, the answered records); only a
        capture for the demand (:meth:`_ensure_graph`) stops and goes on by itself."""
        self._serving = False
        if self._queued:
            self._hctl[HOST_CONTROL.stop] = 1
            try:
                while self._queued:
                    self._queued.popleft().synchronize()
            finally:
                self._hctl[HOST_CONTROL.stop] = 0
        # A round's programs publish their answers in any order, each storing its own count in
        # the host's word: the device's count is the whole one (read once per run).
        if self._ran:
            self._ran = False
            with self._on_stream():
                self._hctl[HOST_CONTROL.answers] = int(self._ctl[DEVICE_CONTROL.answers])
