"""kalos.server.recall_loop's passes in flight: a crowd's pass queued on the GPU is published
only when it lands, its slots are not read again meanwhile, passes land oldest first, and a
request that cannot be queued lands every pass before it is answered. The engine is a fake
whose queued passes finish when the test says (the GPU engine's own passes in flight:
tests/test_torch_engine.py); the channel, the columns and the loop are the real ones."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from conftest import unique_name

from kalos.engine import Filter
from kalos.errors import ErrorCode, InvalidArgument
from kalos.ipc.channel import SidecarChannel, wake_pair
from kalos.ipc.protocol import Layout, Op, RequestFlag, rest_seq
from kalos.ipc.segment import Segment
from kalos.server.cohort import Cohort
from kalos.server.metrics import Metrics
from kalos.server.filters import FilterCache
from kalos.server.recall_loop import RecallLoop
from kalos.server.slot_polling import SlotPolling
from kalos.server.state_lock import StateLock

DIM, K = 8, 4


class FakePass:
    def __init__(self, engine: "FakeEngine", slots: np.ndarray, scales: np.ndarray) -> None:
        self.engine, self.slots, self.scales = engine, slots, scales
        self.landed = False  # the test sets it: the GPU finished
        self.fail = False

    def done(self) -> bool:
        return self.landed

    def finish(self) -> np.ndarray:
        self.engine.log.append("land")
        if self.fail:
            raise RuntimeError("the kernel faulted")
        self.engine.write_answers(self.slots)
        return self.scales


class FakeEngine:
    """Answers slot s with ids s*100 + 0..k-1; queued passes wait for the test."""

    supports_attached_host = True
    supports_streams = False
    device = "fake"

    def __init__(self) -> None:
        self.loop: RecallLoop | None = None
        self.passes: list[FakePass] = []
        self.synchronous = 0
        self.log: list[str] = []  # "queue", "land", "search": what ran, in order
        self.directionless: set[int] = set()

    def __len__(self) -> int:
        return 1

    def attach_host(self, buffer) -> None:
        self.attached = True

    def detach_host(self) -> None:
        self.attached = False

    def _slots(self, ids_at: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.loop._ids_at, ids_at)

    def write_answers(self, slots: np.ndarray) -> None:
        columns = self.loop.channel.columns
        columns.ids_row0[slots, :K] = slots[:, None] * 100 + np.arange(K)
        columns.scores_row0[slots, :K] = 0.5

    def _scales(self, slots: np.ndarray) -> np.ndarray:
        return np.array([np.nan if s in self.directionless else 1.0 for s in slots.tolist()])

    def search_attached(self, query_at, scales, ids_at, scores_at, k, flt=Filter()) -> np.ndarray:
        slots = self._slots(np.asarray(ids_at))
        self.synchronous += 1
        self.log.append("search")
        self.write_answers(slots)
        return self._scales(slots) if scales is None else np.asarray(scales, dtype=np.float64)

    def search_attached_start(self, query_at, scales, ids_at, scores_at, k, flt=Filter()) -> FakePass:
        slots = self._slots(np.asarray(ids_at))
        queued = FakePass(self, slots, self._scales(slots))
        self.log.append("queue")
        self.passes.append(queued)
        return queued

    def attach_places(self, query_at, ids_at, scores_at, k_max) -> None:
        # One place per slot, in slot order: row 0 of each slot's queries, ids and scores.
        layout = self.loop.layout
        base = np.array([layout.slot_offset(s) for s in range(layout.n_slots)])
        assert np.array_equal(query_at, (base + layout.queries_offset) // 4)
        assert np.array_equal(ids_at, (base + layout.ids_offset) // 8)
        assert np.array_equal(scores_at, (base + layout.scores_offset) // 4)
        assert k_max == layout.max_k
        self.places_attached = True

    def search_places_start(self, places, k, flt=Filter(), namespaces=None) -> FakePass:
        queued = self.search_attached_start(None, None, self.loop._ids_at[places], None, k, flt)
        queued.k, queued.flt, queued.namespaces = k, flt, namespaces
        return queued


class NoExpiry:
    def expire_due(self) -> None:
        pass

    def near(self) -> bool:
        return False


def new_loop(spin_us: float = 0) -> tuple[RecallLoop, Segment]:
    """A real RecallLoop over a real channel of 8 slots, every one with a client, and a
    FakeEngine; close its channel, then the segment, when done."""
    layout = Layout(8, DIM, 16, 4)
    segment = Segment.create(unique_name("rl"), layout.size)
    layout.write_header(segment.buf, epoch=1, pid=os.getpid())
    channel = SidecarChannel(segment, layout, epoch=1)
    engine = FakeEngine()
    lock = StateLock()
    recall_loop = RecallLoop(engine=engine, channel=channel, layout=layout, metrics=Metrics(), cohort=Cohort(8, 0),
                             filters=FilterCache({b"default": 0}), polling=SlotPolling(lock), expirer=NoExpiry(),
                             state_lock=lock, stopping=threading.Event(), spin_us=spin_us)
    engine.loop = recall_loop
    assert recall_loop.attach(segment.buf)
    for slot in range(layout.n_slots):
        channel.activate(slot, wake_pair()[0])
    return recall_loop, segment


@pytest.fixture
def loop():
    recall_loop, segment = new_loop()
    yield recall_loop
    recall_loop.channel.close()
    segment.close()


def _submit(loop: RecallLoop, slots, *, n_queries: int = 1, namespaces=None, k: int = K) -> None:
    """Single recalls (or batches) from ``slots``, one more request each: in namespace "default",
    or each in its entry of ``namespaces`` (None: all namespaces)."""
    rng = np.random.default_rng(0)
    for at, slot in enumerate(slots):
        view = loop.channel.slots[slot]
        name = b"default" if namespaces is None else namespaces[at]
        flags = int(RequestFlag.ALL_NAMESPACES) if name is None else 0
        view.op[0], view.k[0], view.n_queries[0], view.flags[0] = int(Op.RECALL), k, n_queries, flags
        view.namespace[0], view.namespace_len[0] = name or b"", len(name or b"")
        view.queries[:n_queries] = rng.standard_normal((n_queries, DIM))
        view.req_seq[0] = int(view.req_seq[0]) + 1


def _sweep(loop: RecallLoop) -> np.ndarray:
    """One look of the sweep: land what is done, answer or queue what is pending."""
    channel = loop.channel
    if loop._flights:
        loop._land_ready()
    slots, seqs = channel.pending(None, loop._in_flight if loop._flights else None)
    if len(slots):
        loop._answer(slots, seqs, channel.pending_generations)
    return slots


def _published(loop: RecallLoop, slots) -> bool:
    columns = loop.channel.columns
    return bool((columns.resp_seq[slots] == columns.req_seq[slots]).all())


def test_a_crowd_pass_is_published_when_it_lands_and_its_slots_are_not_read_again(loop):
    engine = loop.engine
    _submit(loop, [0, 1, 2])
    assert _sweep(loop).tolist() == [0, 1, 2]
    assert len(engine.passes) == 1 and engine.synchronous == 0
    assert not _published(loop, [0, 1, 2])
    assert _sweep(loop).tolist() == []  # in flight: not pending again, not published
    _submit(loop, [3, 4])  # the next crowd is queued behind it
    assert _sweep(loop).tolist() == [3, 4]
    assert len(engine.passes) == 2
    engine.passes[1].landed = True  # the younger pass is done, the older is not: neither lands
    _sweep(loop)
    assert not _published(loop, [0, 1, 2, 3, 4])
    engine.passes[0].landed = True
    _sweep(loop)
    assert _published(loop, [0, 1, 2, 3, 4]) and not loop._flights and not loop._in_flight.any()
    columns = loop.channel.columns
    for slot in range(5):
        assert int(columns.status[slot]) == 0 and int(columns.n_results[slot]) == K
        assert columns.ids_row0[slot, :K].tolist() == [slot * 100 + j for j in range(K)]
    assert loop.metrics.queries == 5


def test_a_request_that_cannot_be_queued_lands_every_pass_first(loop):
    engine = loop.engine
    _submit(loop, [0, 1])
    _sweep(loop)
    _submit(loop, [5], n_queries=3)  # a batch: answered here and now, after the pass in flight
    assert _sweep(loop).tolist() == [5]
    assert _published(loop, [0, 1, 5]) and not loop._flights
    assert engine.synchronous == 1


def test_a_failed_pass_answers_each_of_its_clients_with_an_error_and_the_sweep_goes_on(loop):
    engine = loop.engine
    _submit(loop, [0, 1, 2])
    _sweep(loop)
    engine.passes[0].fail = True
    engine.passes[0].landed = True
    _sweep(loop)
    columns = loop.channel.columns
    assert _published(loop, [0, 1, 2])
    assert all(int(columns.status[s]) == ErrorCode.INTERNAL for s in (0, 1, 2))
    assert "the kernel faulted" in loop.channel.slots[0].read_message()
    _submit(loop, [0, 1])
    _sweep(loop)
    engine.passes[1].landed = True
    _sweep(loop)
    assert _published(loop, [0, 1]) and int(columns.status[0]) == 0


def test_a_query_with_no_direction_gets_its_error_and_the_rest_their_answers(loop):
    engine = loop.engine
    engine.directionless = {1}
    _submit(loop, [0, 1, 2])
    _sweep(loop)
    engine.passes[0].landed = True
    _sweep(loop)
    columns = loop.channel.columns
    assert int(columns.status[1]) == ErrorCode.INVALID_QUERY
    assert "no direction" in loop.channel.slots[1].read_message()
    assert int(columns.status[0]) == int(columns.status[2]) == 0


def test_a_client_that_left_while_its_pass_flew_is_not_published_to(loop):
    engine, channel = loop.engine, loop.channel
    _submit(loop, [0, 1])
    _sweep(loop)
    channel.deactivate(1)
    channel.activate(1, wake_pair()[0])  # a new client in the slot
    engine.passes[0].landed = True
    _sweep(loop)
    assert _published(loop, [0])
    # The newcomer sees no answer it did not ask for: its slot is still at rest.
    assert int(channel.columns.resp_seq[1]) == rest_seq(int(channel.generation[1]))


def test_stopping_the_sweep_lands_the_passes_in_flight(loop):
    _submit(loop, [0, 1])
    _sweep(loop)
    loop._stopping.set()
    loop.run()  # returns at once (stopping), landing what flies
    assert _published(loop, [0, 1]) and not loop._flights


def test_where_clauses_and_time_windows_are_never_queued(loop):
    """(A where clause's mask, a time window: searched here, through the engine's other paths.)"""
    from kalos.where import compile_where

    engine, channel = loop.engine, loop.channel
    handle = loop._filter.__self__.register(compile_where({"user": "u1"}))
    _submit(loop, [0, 1])
    for slot in (0, 1):
        channel.slots[slot].flags[0] = int(RequestFlag.HAS_WHERE)
        channel.slots[slot].where_handle[0] = handle
    _sweep(loop)
    _submit(loop, [2, 3])
    for slot in (2, 3):
        channel.slots[slot].flags[0] = int(RequestFlag.HAS_SINCE)
        channel.slots[slot].since[0] = 0.0
    _sweep(loop)
    assert not engine.passes and engine.synchronous == 2  # one pass per filter
    assert _published(loop, [0, 1, 2, 3])
    assert all(int(channel.columns.status[s]) == 0 for s in range(4))


def test_agents_in_namespaces_of_their_own_share_one_queued_pass(loop):
    """A crowd of single recalls that differ in their namespaces (and k) is one pass, each query
    in its own namespace's id (-1: all); a namespace that holds nothing is answered at once with
    no hits; what else the crowd holds (a time window, a where clause, a name whose length word
    disagrees with its bytes) is answered by the mixed path, after the pass."""
    from kalos.where import compile_where

    engine, channel = loop.engine, loop.channel
    columns = channel.columns
    loop._namespaces.update({b"agent-a": 1, b"agent-b": 2})
    channel.deactivate(4)
    channel.activate(4, wake_pair()[0])  # (a generation of its own: answers go by each slot's)
    _submit(loop, [0], namespaces=[b"agent-a"], k=2)
    _submit(loop, [1, 2, 3], namespaces=[b"agent-b", None, b"agent-a"])
    _submit(loop, [4], namespaces=[b"agent-new"], k=2)  # a new agent: nothing stored yet
    _submit(loop, [5], namespaces=[b"default"], k=3)
    assert _sweep(loop).tolist() == [0, 1, 2, 3, 4, 5]
    assert len(engine.passes) == 1 and engine.synchronous == 0
    queued = engine.passes[0]
    assert queued.slots.tolist() == [0, 1, 2, 3, 5] and queued.k == K and queued.flt == Filter()
    assert queued.namespaces.tolist() == [1, 2, -1, 1, 0]
    assert _published(loop, [4]) and not _published(loop, [0, 1, 2, 3, 5])
    assert int(columns.status[4]) == 0 and int(columns.n_results[4]) == 2 and columns.ids_row0[4, :2].tolist() == [-1, -1]
    queued.landed = True
    _sweep(loop)
    assert _published(loop, [0, 1, 2, 3, 5]) and not loop._flights
    assert [int(columns.n_results[s]) for s in (0, 1, 2, 3, 5)] == [2, K, K, K, 3]
    assert all(int(columns.status[s]) == 0 for s in (0, 1, 2, 3, 5))
    # Slots that change namespace, or name a namespace new since: each query in its new one
    # (the name each slot named last is remembered, never trusted past a change).
    loop._namespaces[b"agent-new"] = 3
    _submit(loop, [0, 1, 3, 4], namespaces=[b"agent-b", b"agent-a", b"agent-a", b"agent-new"])
    _sweep(loop)
    assert len(engine.passes) == 2 and engine.passes[1].namespaces.tolist() == [2, 1, 1, 3]
    engine.passes[1].landed = True
    _sweep(loop)
    assert _published(loop, [0, 1, 3, 4]) and all(int(columns.status[s]) == 0 for s in (0, 1, 3, 4))
    assert loop.metrics.queries == 10  # each answered once: 6, then 4
    # A time window and a where clause in the crowd: searched here, one pass per filter, after
    # the agents' pass (queued, then landed first).
    handle = loop._filter.__self__.register(compile_where({"user": "u1"}))
    _submit(loop, [0, 1, 2, 3], namespaces=[b"agent-a", b"agent-b", b"agent-b", b"agent-a"])
    channel.slots[1].flags[0] = int(RequestFlag.HAS_SINCE)
    channel.slots[1].since[0] = 0.0
    channel.slots[2].flags[0] = int(RequestFlag.HAS_WHERE)
    channel.slots[2].where_handle[0] = handle
    engine.log.clear()
    _sweep(loop)
    assert len(engine.passes) == 3 and engine.passes[2].slots.tolist() == [0, 3]
    assert engine.passes[2].namespaces.tolist() == [1, 1] and engine.synchronous == 2
    assert engine.log == ["queue", "land", "search", "search"]
    assert _published(loop, [0, 1, 2, 3]) and not loop._flights and loop.metrics.queries == 14
    assert all(int(columns.status[s]) == 0 for s in range(4))
    # A length word that disagrees with the name's bytes, in a slot that named that name
    # before: read as the slot says ("age", which holds nothing), the others still one pass.
    _submit(loop, [0, 1, 3], namespaces=[b"agent-a", b"agent-b", b"agent-a"])
    channel.slots[3].namespace_len[0] = 3
    _sweep(loop)
    assert len(engine.passes) == 4 and engine.passes[3].slots.tolist() == [0, 1]
    assert engine.synchronous == 2 and _published(loop, [3]) and not loop._flights
    assert int(columns.status[3]) == 0 and columns.ids_row0[3, :K].tolist() == [-1] * K
    # A name that is no UTF-8 gets its error at once; the others still share one pass.
    _submit(loop, [2, 3, 6], namespaces=[b"agent-a", b"\xff\xfe", b"agent-b"])
    _sweep(loop)
    assert len(engine.passes) == 5 and engine.passes[4].namespaces.tolist() == [1, 2]
    assert _published(loop, [3]) and not _published(loop, [2, 6])
    assert int(columns.status[3]) == ErrorCode.INVALID_QUERY and "UTF-8" in channel.slots[3].read_message()
    engine.passes[4].landed = True
    _sweep(loop)
    assert _published(loop, [2, 6]) and int(columns.status[2]) == int(columns.status[6]) == 0
    # The same bad name again (and twice in one pass): its error each time, never remembered.
    _submit(loop, [3, 5], namespaces=[b"\xff\xfe", b"\xff\xfe"])
    _sweep(loop)
    assert _published(loop, [3, 5]) and len(engine.passes) == 5
    assert int(columns.status[3]) == int(columns.status[5]) == ErrorCode.INVALID_QUERY
    # A client that left while the pass flew, between slots answered at once: the others get
    # their answers, the newcomer none.
    _submit(loop, [0, 1, 2, 3], namespaces=[b"agent-a", b"agent-e", b"agent-b", b"agent-a"])
    _sweep(loop)
    assert engine.passes[5].slots.tolist() == [0, 2, 3] and _published(loop, [1])
    channel.deactivate(2)
    channel.activate(2, wake_pair()[0])
    engine.passes[5].landed = True
    _sweep(loop)
    assert _published(loop, [0, 3]) and int(columns.resp_seq[2]) == rest_seq(int(channel.generation[2]))
    # Every agent new: all answered at once, nothing queued.
    _submit(loop, [0, 1], namespaces=[b"agent-c", b"agent-d"])
    _sweep(loop)
    assert len(engine.passes) == 6 and _published(loop, [0, 1])


def test_the_sweep_thread_keeps_a_pass_in_flight_apart_and_publishes_it_when_it_lands(loop):
    """The real sweep (its own thread): a crowd's pass stays in flight while the GPU (the test)
    holds it; the sweep neither queues its slots again nor sleeps meanwhile, and publishes
    the answers as soon as the pass lands."""
    from conftest import wait_until

    engine = loop.engine
    # The crowd is in place before the sweep's first look: a look in the middle of _submit would
    # see part of it, queue that part and answer the rest synchronously, landing the pass first.
    _submit(loop, [0, 1, 2])
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        loop.channel.ring()  # as a client's ring does when the sweep sleeps
        wait_until(lambda: engine.passes, "the crowd's pass to be queued", timeout=5)
        time.sleep(0.7)  # longer than the sweep's sleep timeout: it would have slept and looked again
        assert len(engine.passes) == 1, "slots in flight were read and queued again"
        assert not _published(loop, [0, 1, 2])
        landed_at = time.perf_counter()
        engine.passes[0].landed = True
        wait_until(lambda: _published(loop, [0, 1, 2]), "the landed pass's answers", timeout=5, interval=0.0005)
        assert time.perf_counter() - landed_at < 0.2, "the sweep slept with a pass in flight"
    finally:
        loop._stopping.set()
        loop.channel.ring()
        thread.join(5)
    assert not thread.is_alive()


class FakeKernel:
    """The GPU's polling as the sweep sees it (kalos.engine.gpu.slot_server.SlotGraphServer):
    serving until the test stops it; then its queued rounds drain for ``drain_s``."""

    def __init__(self, n_slots: int) -> None:
        # The words it writes for the host, as the real one's: handed, in use, taken, stopped.
        self.host_words = np.zeros(3 * n_slots + 1, np.int64)
        self.handed = self.host_words[:n_slots].view(np.uint64)  # the seqs the kernel handed to the host
        self.in_use = self.host_words[n_slots: 2 * n_slots]
        self.taken = self.host_words[2 * n_slots: 3 * n_slots]
        self.drained_at: float | None = None
        self.starts = 0

    @property
    def stopped(self) -> bool:
        return bool(self.host_words[-1])

    def running(self) -> bool:
        return self.drained_at is None or time.perf_counter() < self.drained_at

    def stop_by_itself(self, drain_s: float) -> None:  # (idle_s without a request)
        self.host_words[-1] = 1  # (its queued rounds then write nothing more)
        self.drained_at = time.perf_counter() + drain_s

    def set_namespaces(self, namespaces) -> None:
        pass

    def start(self, active) -> None:
        self.starts += 1
        self.host_words[-1] = 0
        self.drained_at = None

    def stop(self) -> None:
        self.host_words[-1] = 1
        self.drained_at = 0.0


def test_while_the_gpu_polls_the_sweep_answers_what_it_hands_over_and_after_it_stops_the_rest(loop):
    """The real sweep (its own thread) beside a GPU kernel that serves the slots: it answers the
    requests the kernel hands over, leaves the kernel's own alone, and once the kernel has
    stopped by itself and its queued rounds have drained, answers what is pending and starts
    the kernel again."""
    from conftest import wait_until

    kernel = FakeKernel(loop.layout.n_slots)
    loop._polling.install(kernel, loop.channel)
    loop._polling.start({"default": 0})
    assert kernel.starts == 1
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        _submit(loop, [0, 1])
        kernel.handed[0] = loop.channel.columns.req_seq[0]  # the kernel hands slot 0's request over
        wait_until(lambda: _published(loop, [0]), "the handed-over request's answer", timeout=5)
        time.sleep(0.3)
        assert not _published(loop, [1]), "the sweep answered a request the GPU serves"
        kernel.stop_by_itself(drain_s=0.05)
        wait_until(lambda: _published(loop, [1]), "the request pending once the kernel stopped", timeout=5)
        wait_until(lambda: kernel.starts == 2, "the kernel started again", timeout=5)
    finally:
        loop._stopping.set()
        loop.channel.ring()
        thread.join(5)
    assert not thread.is_alive()


def test_an_engine_that_refuses_the_places_is_detached_and_zero_copy_is_off(loop):
    """attach() with an engine that takes the segment but refuses the slots' places: the engine
    gives the segment back and the loop answers through host copies (zero copy off)."""
    engine = loop.engine

    def refuse(*_args) -> None:
        raise InvalidArgument("no places here")

    engine.attach_places = refuse
    assert not loop.attach(bytearray(4096))
    assert engine.attached is False and loop.zero_copy is False


def _mixed_pass(rng, engine_hook=None):
    """A RecallLoop over a NumPy engine (a host engine: no zero copy) with 8 slots whose single
    recalls mix namespace "default", namespace "other", every namespace and a time window, all
    pending; ``engine_hook(engine)`` may wrap the engine's methods first. Returns the loop, the
    queries, each slot's scope (for the reference), the rows and a closer."""
    from kalos.engine import NumpyEngine, as_unit_rows

    layout = Layout(8, DIM, 16, 4)
    segment = Segment.create(unique_name("rl"), layout.size)
    layout.write_header(segment.buf, epoch=1, pid=os.getpid())
    channel = SidecarChannel(segment, layout, epoch=1)
    engine = NumpyEngine(DIM, capacity=4096)
    n = 3000
    raw = rng.standard_normal((n, DIM)).astype(np.float32)
    ids = np.arange(100, 100 + n, dtype=np.int64)
    namespaces = rng.integers(0, 2, n).astype(np.int32)  # "default" (0) and "other" (1)
    created = rng.uniform(0, 100, n)
    engine.add(ids, as_unit_rows(raw), namespaces, created)
    if engine_hook is not None:
        engine_hook(engine)
    lock = StateLock()
    recall_loop = RecallLoop(engine=engine, channel=channel, layout=layout, metrics=Metrics(), cohort=Cohort(8, 0),
                             filters=FilterCache({b"default": 0, b"other": 1}), polling=SlotPolling(lock),
                             expirer=NoExpiry(), state_lock=lock, stopping=threading.Event(), spin_us=0)
    assert not recall_loop.attach(segment.buf)  # a host engine: no zero copy
    for slot in range(layout.n_slots):
        channel.activate(slot, wake_pair()[0])
    _submit(recall_loop, range(8))
    scopes = {}
    for slot in range(8):
        view = channel.slots[slot]
        kind = slot % 4
        if kind == 1:
            view.namespace[0], view.namespace_len[0] = b"other", 5
            scopes[slot] = dict(namespace=1)
        elif kind == 2:
            view.flags[0] = int(RequestFlag.ALL_NAMESPACES)
            scopes[slot] = {}
        elif kind == 3:
            view.flags[0] = int(RequestFlag.HAS_SINCE | RequestFlag.HAS_UNTIL)
            view.since[0], view.until[0] = 25.0, 75.0
            scopes[slot] = dict(namespace=0, since=25.0, until=75.0)
        else:
            scopes[slot] = dict(namespace=0)
    queries = [np.array(channel.slots[s].queries[0]) for s in range(8)]

    def close() -> None:
        channel.close()
        segment.close()

    return recall_loop, queries, scopes, (ids, raw, namespaces, created), close


def _check_answers(recall_loop, queries, scopes, data, slots) -> None:
    from reference import assert_topk_matches, eligible_mask

    ids, raw, namespaces, created = data
    for slot in slots:
        view = recall_loop.channel.slots[slot]
        assert int(view.status[0]) == 0, slot
        eligible = eligible_mask(namespaces, created, **scopes[slot])
        assert_topk_matches(view.ids[:1, :K], view.scores[:1, :K], ids, raw, queries[slot][None], K, eligible,
                            context=f"slot {slot} {scopes[slot]}")


def test_a_host_engines_mixed_pass_is_one_engine_call_and_every_answer_is_right():
    """A CPU sidecar's pass with namespaces, all namespaces and time windows mixed: its groups go
    to the engine in one search_groups call (the NumPy engine scores them in one read of the
    rows); each answer equals the float64 reference under its own filter, and each counts."""
    calls = []

    def spy(engine):
        real = engine.search_groups
        engine.search_groups = lambda groups: (calls.append(len(groups)), real(groups))[1]

    recall_loop, queries, scopes, data, close = _mixed_pass(np.random.default_rng(5), spy)
    try:
        assert len(_sweep(recall_loop)) == 8
        assert calls == [4]  # default, other, every namespace, the time window: one engine call
        assert _published(recall_loop, list(range(8)))
        _check_answers(recall_loop, queries, scopes, data, range(8))
        assert recall_loop.metrics.queries == 8 and recall_loop.metrics.errors == 0
    finally:
        close()


@pytest.mark.parametrize("failure", ["the call", "one group's answer"])
def test_a_failure_in_a_mixed_pass_fails_only_the_groups_it_concerns(failure):
    """The engine's call for the pass's groups raises (each group is then searched alone, and
    only the time window's search fails), or its answer for one group does not fit the slots:
    those clients get an error, every other client its answer, and the sweep goes on."""

    def break_it(engine):
        real_groups, real_search = engine.search_groups, engine.search
        if failure == "the call":
            def groups(groups):
                raise RuntimeError("injected: the groups' call")

            def search(q, k, flt=Filter()):
                if flt.since is not None:
                    raise RuntimeError("injected: the time window's search")
                return real_search(q, k, flt)

            engine.search_groups, engine.search = groups, search
        else:
            def groups(groups):
                answers = real_groups(groups)
                return [(ids[:, :-1], scores[:, :-1]) if flt.since is not None else (ids, scores)
                        for (_q, _k, flt), (ids, scores) in zip(groups, answers)]

            engine.search_groups = groups

    recall_loop, queries, scopes, data, close = _mixed_pass(np.random.default_rng(6), break_it)
    try:
        assert len(_sweep(recall_loop)) == 8
        assert _published(recall_loop, list(range(8)))
        windows = [slot for slot in range(8) if slot % 4 == 3]
        for slot in windows:
            assert int(recall_loop.channel.slots[slot].status[0]) != 0, slot
        _check_answers(recall_loop, queries, scopes, data, [s for s in range(8) if s not in windows])
        assert recall_loop.metrics.errors == len(windows)
    finally:
        close()


def test_a_failed_search_errs_once_and_leaves_a_refused_query_its_own_error():
    """A pass of one filter on a host engine whose search fails: the client whose query had no
    direction keeps that error (it is not answered a second time), every other client gets the
    search's, and each error counts once."""

    def fail(engine):
        def search(q, k, flt=Filter()):
            raise RuntimeError("injected: the search")

        engine.search = search

    recall_loop, _queries, _scopes, _data, close = _mixed_pass(np.random.default_rng(7), fail)
    try:
        channel = recall_loop.channel
        for slot in range(8):  # one kind for all: namespace "default", the uniform pass
            view = channel.slots[slot]
            view.flags[0] = 0
            view.namespace[0], view.namespace_len[0] = b"default", 7
        channel.slots[2].queries[0] = 0.0  # no direction
        assert len(_sweep(recall_loop)) == 8
        assert _published(recall_loop, list(range(8)))
        assert int(channel.slots[2].status[0]) == ErrorCode.INVALID_QUERY
        assert "no direction" in channel.slots[2].read_message()
        for slot in (0, 1, 3, 4, 5, 6, 7):
            assert int(channel.slots[slot].status[0]) == ErrorCode.INTERNAL, slot
            assert "injected: the search" in channel.slots[slot].read_message()
        assert recall_loop.metrics.errors == 8
    finally:
        close()
