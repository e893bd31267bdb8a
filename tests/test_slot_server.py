"""The slot server (kalos.engine.gpu.slot_server.SlotGraphServer): GPU kernels that answer
recalls from the shared segment by themselves.

Without a GPU the rounds run under Triton's interpreter, synchronously: ``start`` serves
what is pending, polls a few more times and returns. Those tests check its answers against
a float64 brute force and the engine's own search, and that it hands over to the host
everything it must not answer. Tests marked ``cuda`` run the real CUDA graph, alone and
inside a sidecar with several clients, adds and deletes.
"""
from __future__ import annotations

import collections
import math
import mmap
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")

# The interpreter setup (TRITON_INTERPRET for the first import of triton, per-test env), the
# seeded rng and the markers are test_torch_engine's, as in test_sharded.
from reference import assert_topk_matches  # noqa: E402
from test_torch_engine import HAVE_CUDA, _interpreter_env, needs_interpreter, rng  # noqa: E402,F401

from kalos.engine.gpu import ScanConfig, TorchEngine  # noqa: E402
from kalos.engine.gpu.layout import HOST_CONTROL  # noqa: E402
from kalos.engine.gpu.slot_server import (  # noqa: E402
    _NAME_PROBE,
    DEFAULT_GAP_S,
    DEFAULT_WINDOW_MAX_S,
    SMALL_K,
    SlotGraphServer,
    name_home,
    waiting_warps,
)
from kalos.errors import InvalidArgument  # noqa: E402
from kalos.ipc.protocol import Layout, Op, RequestFlag, SlotView, rest_seq  # noqa: E402

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
RECALL, PING, ALL = int(Op.RECALL), int(Op.PING), int(RequestFlag.ALL_NAMESPACES)
SINCE, UNTIL = int(RequestFlag.HAS_SINCE), int(RequestFlag.HAS_UNTIL)


class Rig:
    """An engine with rows, a segment with slots, the engine attached to it, and a server."""

    def __init__(self, rng, *, precision="exact", dim=32, n=200, slots=4, device="cpu", max_k=32,
                 server=SlotGraphServer, bucket=None, server_max_k=None, **server_args) -> None:
        self.rng = rng
        self.bucket = bucket  # the round start() runs (None: the one for the clients present)
        self.engine = TorchEngine(dim, device=device, backend="triton", precision=precision)
        self.vectors = rng.standard_normal((n, dim)).astype(np.float32)
        if precision == "fast":  # near-duplicates: some certificates fail, and those go to the host
            self.vectors[n // 2 :] = self.vectors[: n - n // 2] + 1e-4 * rng.standard_normal((n - n // 2, dim))
        self.ids = np.arange(5000, 5000 + n, dtype=np.int64)
        unit = (self.vectors / np.linalg.norm(self.vectors.astype(np.float64), axis=1, keepdims=True)).astype(np.float32)
        self.namespaces = rng.integers(0, 2, n).astype(np.int32)  # ids 0 ("a") and 1 ("b")
        self.created = 1_700_000_000.0 + 60.0 * rng.permutation(n)  # a minute apart (epoch seconds)
        self.engine.add(self.ids, unit, self.namespaces, self.created)
        self.dead = self.ids[rng.choice(n, n // 10, replace=False)]
        self.engine.delete(self.dead)
        self.live = ~np.isin(self.ids, self.dead)
        self.layout = Layout(slots, dim, max_k, 2)
        self.buf = mmap.mmap(-1, self.layout.size)
        self.engine.attach_host(self.buf)
        self.views = [SlotView(memoryview(self.buf), self.layout, s) for s in range(slots)]
        # Every slot at rest, as the channel hands it out (kalos.ipc.protocol.rest_seq).
        self.seqs = np.full(slots, rest_seq(1), np.int64)
        for view in self.views:
            view.req_seq[0] = view.resp_seq[0] = rest_seq(1)
        if server_max_k is not None:  # (max_k is the slots': the layout's)
            server_args["max_k"] = server_max_k
        self.server = server(self.engine, self.layout, self.seqs.astype(np.uint64), **server_args)
        self.server.set_namespaces({b"a": 0, b"b": 1})
        # Which slots have a client: the server's in-use words themselves (the channel's mirror).
        self.active = self.server.in_use
        self.active[:] = 1

    def submit(self, slot, query, k, *, op=RECALL, n_queries=1, flags=ALL, namespace=b"", since=0.0,
               until=0.0) -> int:
        """A request in ``slot`` (its window's bounds count only with the flags HAS_SINCE / HAS_UNTIL)."""
        view = self.views[slot]
        view.since[0], view.until[0] = since, until
        view.namespace[0] = namespace
        view.namespace_len[0] = len(namespace)
        view.op[0], view.k[0], view.n_queries[0], view.flags[0] = op, k, n_queries, flags
        view.queries[: len(np.atleast_2d(query))] = np.atleast_2d(query)
        self.seqs[slot] += 1
        view.req_seq[0] = self.seqs[slot]
        return int(self.seqs[slot])

    def serve(self) -> bool:
        """Starts the server: on the CPU device its rounds run until it stops (idle)."""
        return self.server.start(self.active, bucket=self.bucket)

    def close(self) -> None:
        self.server.stop()
        self.engine.detach_host()


@pytest.fixture
def make_rig(rng):
    """Builds rigs on this test's rng; closes them (server stopped, segment detached) after it."""
    rigs: list[Rig] = []

    def make(**kwargs) -> Rig:
        rigs.append(Rig(rng, **kwargs))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


ROUNDS = pytest.mark.parametrize("bucket", [1, 4], ids=["single round", "batch round"])


@needs_interpreter
@ROUNDS
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_answers_single_recalls_like_the_float64_reference(make_rig, rng, precision, bucket):
    rig = make_rig(precision=precision, bucket=bucket)
    answered = handed = 0
    for round_ in range(6):
        slot = round_ % 4
        k = int(rng.choice([1, 3, 8, 16]))
        query = (rng.standard_normal(rig.engine.dim) * rng.uniform(0.1, 10)).astype(np.float32)
        ns = [None, b"a", b"b"][round_ % 3]
        seq = rig.submit(slot, query, k, flags=ALL if ns is None else 0, namespace=ns or b"")
        eligible = rig.live & (True if ns is None else rig.namespaces == (0 if ns == b"a" else 1))
        rig.serve()
        view = rig.views[slot]
        if int(view.resp_seq[0]) == seq:
            answered += 1
            assert (int(view.status[0]), int(view.n_results[0])) == (0, k)
            assert int(rig.server.answered[slot]) == seq
            assert_topk_matches(view.ids[:1, :k], view.scores[:1, :k], rig.ids, rig.vectors, query[None], k,
                                eligible, context=f"{precision} k={k} namespace={ns}")
        else:  # fast mode: a failed certificate hands the request to the host
            assert precision == "fast" and int(rig.server.handed[slot]) == seq
            handed += 1
    assert rig.server.served == answered
    assert answered >= (6 if precision == "exact" else 1)


@needs_interpreter
@ROUNDS
def test_hands_over_what_it_must_not_answer(make_rig, rng, bucket):
    rig = make_rig(bucket=bucket)
    dim = rig.engine.dim
    q = rng.standard_normal(dim).astype(np.float32)
    cases = {
        "k above max_k": dict(query=q, k=17),
        "k = 0": dict(query=q, k=0),
        "a batch": dict(query=np.stack([q, q]), k=4, n_queries=2),
        "an unknown namespace": dict(query=q, k=4, flags=0, namespace=b"c"),
        "a namespace that only starts like a known one": dict(query=q, k=4, flags=0, namespace=b"ab"),
        "a NaN since": dict(query=q, k=4, flags=ALL | SINCE, since=math.nan),
        "a NaN until in a namespace": dict(query=q, k=4, flags=UNTIL, namespace=b"a", until=math.nan),
        "since = -inf": dict(query=q, k=4, flags=ALL | SINCE, since=-math.inf),
        "until = inf": dict(query=q, k=4, flags=ALL | UNTIL, until=math.inf),
        "since = inf": dict(query=q, k=4, flags=ALL | SINCE, since=math.inf),
        "an empty window": dict(query=q, k=4, flags=ALL | SINCE | UNTIL, since=5.0, until=5.0),
        "a reversed window": dict(query=q, k=4, flags=ALL | SINCE | UNTIL, since=6.0, until=5.0),
        "a window and a where clause": dict(query=q, k=4, flags=ALL | SINCE | int(RequestFlag.HAS_WHERE), since=1.0),
        "an unknown flag": dict(query=q, k=4, flags=ALL | 64),
        "a where clause": dict(query=q, k=4, flags=ALL | int(RequestFlag.HAS_WHERE)),
        "a where clause in a namespace": dict(query=q, k=4, flags=int(RequestFlag.HAS_WHERE), namespace=b"a"),
        "a zero query": dict(query=q * 0, k=4),
        "a NaN query": dict(query=np.full(dim, np.nan, np.float32), k=4),
        "an infinite query": dict(query=np.full(dim, np.inf, np.float32), k=4),
        "a ping": dict(query=q, k=4, op=PING),
        "an unknown op": dict(query=q, k=4, op=99),
    }
    for label, case in cases.items():
        before = bytes(rig.views[0].ids[0].tobytes())
        seq = rig.submit(0, **case)
        rig.serve()
        view = rig.views[0]
        assert int(rig.server.handed[0]) == seq, label
        assert int(view.resp_seq[0]) != seq and int(rig.server.answered[0]) != seq, label
        assert view.ids[0].tobytes() == before, f"{label}: the slot's answer area was written"
    assert rig.server.served == 0


@needs_interpreter
def test_serves_the_next_slot_with_its_own_query_when_the_one_in_turn_is_handed_over(make_rig, rng):
    # The kernel copies the query of the pending slot whose turn it is while the requests'
    # words travel; when that slot cannot be served here, the other slot's query must be used.
    rig = make_rig(bucket=1)
    q0, q1 = (rng.standard_normal(rig.engine.dim).astype(np.float32) for _ in range(2))
    first = rig.submit(0, q0, 17)  # slot 0 has the first turn; k above max_k: handed over
    second = rig.submit(1, q1, 4, flags=0, namespace=b"b")
    rig.serve()
    assert int(rig.server.handed[0]) == first
    view = rig.views[1]
    assert int(view.resp_seq[0]) == second and int(view.n_results[0]) == 4
    assert_topk_matches(view.ids[:1, :4], view.scores[:1, :4], rig.ids, rig.vectors, q1[None], 4,
                        rig.live & (rig.namespaces == 1), context="slot 1, namespace b")


@needs_interpreter
@ROUNDS
def test_namespace_table_resolves_names_that_share_a_home_row_and_hands_over_those_without_one(make_rig, rng, bucket):
    # The kernel looks a name up in the _NAME_PROBE rows from its home row on (one load): names
    # sharing a home sit in the rows after it, and one that finds its window full stays with
    # the host. Names here are chosen to collide; the rows' namespace ids are 0 ("a") and 1.
    rig = make_rig()
    homes = collections.defaultdict(list)
    i = 0
    while not any(len(v) > _NAME_PROBE for v in homes.values()):
        name = f"tenant-{i}".encode()
        homes[name_home(np.frombuffer(name.ljust(64, b"\0"), np.int64), len(name))].append(name)
        i += 1
    crowd = next(v for v in homes.values() if len(v) > _NAME_PROBE)[: _NAME_PROBE + 1]
    rig.bucket = bucket
    # Ids alternate 0/1, so a name resolved to a neighbour's row gives the wrong rows back.
    table = {b"a": 0, b"b": 1, **{name: j % 2 for j, name in enumerate(crowd)}}
    rig.server.set_namespaces(table)
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    for j, name in enumerate(crowd):
        seq = rig.submit(0, q, 4, flags=0, namespace=name)
        rig.serve()
        view = rig.views[0]
        if j < _NAME_PROBE:
            assert int(view.resp_seq[0]) == seq, f"{name!r} (row {j} of its window) was not answered"
            assert_topk_matches(view.ids[:1, :4], view.scores[:1, :4], rig.ids, rig.vectors, q[None], 4,
                                rig.live & (rig.namespaces == j % 2), context=name.decode())
        else:
            assert int(rig.server.handed[0]) == seq, f"{name!r} found no row but was not handed over"


@needs_interpreter
@ROUNDS
def test_a_namespace_renamed_in_the_table_is_not_answered_from_the_names_found_before(make_rig, rng, bucket):
    # The kernels remember the name they resolved last, and a batch round each slot's (a request
    # naming it again skips the table's probe); a new table must make them forget both. Between
    # the first two rounds the table stays and each slot of the batch asks in the other name.
    rig = make_rig()
    rig.bucket = bucket
    slots = [0] if bucket == 1 else [0, 1, 2, 3]
    q = rng.standard_normal((len(slots), rig.engine.dim)).astype(np.float32)
    for turn, table in enumerate(({b"a": 0, b"b": 1}, {b"a": 0, b"b": 1}, {b"a": 1, b"b": 0})):
        rig.server.set_namespaces(table)
        names = [(b"a", b"b")[(s + turn) % 2] if bucket > 1 else b"a" for s in slots]
        seqs = [rig.submit(s, q[s], 4, flags=0, namespace=names[s]) for s in slots]
        rig.serve()
        for s in slots:
            view = rig.views[s]
            assert int(view.resp_seq[0]) == seqs[s]
            assert_topk_matches(view.ids[:1, :4], view.scores[:1, :4], rig.ids, rig.vectors, q[s][None], 4,
                                rig.live & (rig.namespaces == table[names[s]]),
                                context=f"slot {s}: {names[s]!r} is namespace {table[names[s]]}")


@needs_interpreter
def test_never_writes_past_a_slots_max_k(make_rig, rng):
    # A segment made for k <= 4: the kernel (built for k <= 16) must hand k = 8 to the host,
    # whose error names the limit, instead of writing 8 ids into a row of 4.
    rig = make_rig(max_k=4)
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    scores_before = rig.views[0].scores[0].tobytes()
    seq = rig.submit(0, q, 8)
    rig.serve()
    assert int(rig.server.handed[0]) == seq and int(rig.views[0].resp_seq[0]) != seq
    assert rig.views[0].scores[0].tobytes() == scores_before
    seq = rig.submit(0, q, 4)
    rig.serve()
    assert int(rig.views[0].resp_seq[0]) == seq and int(rig.views[0].n_results[0]) == 4


@needs_interpreter
def test_single_rounds_take_one_request_each_round_robin_and_leave_the_rest_pending(make_rig, rng):
    rig = make_rig(server=QueuedGraphServer, bucket=1, depth=1)
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    seqs = {s: rig.submit(s, q, 4) for s in (1, 2, 3)}
    assert rig.serve()
    order = []
    for _ in range(3):  # a round each, in turn: none handed over to the host
        rig.server.step()
        rig.server.running()
        order += [s for s, seq in seqs.items() if int(rig.views[s].resp_seq[0]) == seq and s not in order]
        assert not any(int(rig.server.handed[s]) == seq for s, seq in seqs.items())
    assert sorted(order) == [1, 2, 3]
    # The next round starts after the slot served last: the tie goes on in turn.
    seqs = {s: rig.submit(s, q, 4) for s in (1, 2, 3)}
    rig.server.step()
    winner = [s for s, seq in seqs.items() if int(rig.views[s].resp_seq[0]) == seq]
    assert winner == [order[-1] % 3 + 1]


def _answered(rig, slot, seq) -> bool:
    return int(rig.views[slot].resp_seq[0]) == seq


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_batch_round_answers_a_crowd_in_one_pass_and_keeps_another_kind_for_the_next(make_rig, rng, precision):
    # Six clients; four ask for k = 4 in all namespaces, two for k = 3 in namespace "b". One
    # round (one step of the queued server) answers the first kind in turn, all of them,
    # each in its own slot with its own query; the other kind stays pending, untouched, and
    # the next round answers it.
    rig = make_rig(precision=precision, slots=6, server=QueuedGraphServer, depth=1, window_polls=0)
    queries = rng.standard_normal((6, rig.engine.dim)).astype(np.float32) * rng.uniform(0.5, 5, (6, 1)).astype(np.float32)
    kinds = [(4, None), (3, b"b"), (4, None), (4, None), (3, b"b"), (4, None)]
    seqs = [rig.submit(s, queries[s], k, flags=ALL if ns is None else 0, namespace=ns or b"")
            for s, (k, ns) in enumerate(kinds)]
    server = rig.server
    assert server.start(rig.active) and len(server.gpu) == 1
    server.step()
    first = [s for s in range(6) if _answered(rig, s, seqs[s])]
    handed = [s for s in range(6) if int(server.handed[s]) == seqs[s]]
    if precision == "exact":
        assert first == [0, 2, 3, 5] and handed == []
    else:  # a failed certificate goes to the host, never to a wrong answer
        assert set(first) | set(handed) == {0, 2, 3, 5}
    for s in (1, 4):
        assert not _answered(rig, s, seqs[s]) and int(server.handed[s]) != seqs[s]
    server.running()  # (queues the next round)
    server.step()
    for s in range(6):
        k, ns = kinds[s]
        if not _answered(rig, s, seqs[s]):
            assert precision == "fast" and int(server.handed[s]) == seqs[s], f"slot {s} neither answered nor handed"
            continue
        view = rig.views[s]
        assert (int(view.status[0]), int(view.n_results[0])) == (0, k)
        eligible = rig.live & (True if ns is None else rig.namespaces == 1)
        assert_topk_matches(view.ids[:1, :k], view.scores[:1, :k], rig.ids, rig.vectors, queries[s][None], k,
                            eligible, context=f"{precision} slot {s} k={k} namespace={ns}")
    server.stop()
    assert server.served == sum(_answered(rig, s, seqs[s]) for s in range(6))


def _window_request(rig, window) -> tuple[dict, np.ndarray]:
    """The request words of ``window`` -- ``(since, until)`` in all namespaces or ``(since,
    until, name)`` in namespace "a" or "b", a bound of None being open; or "a" / "b": that
    namespace, no window -- and the rows it lets through (live too)."""
    if isinstance(window, bytes):
        window = (None, None, window)
    since, until, *name = window
    inside = rig.live.copy()
    if name:
        flags, words = 0, dict(namespace=name[0])
        inside &= rig.namespaces == (0 if name[0] == b"a" else 1)
    else:
        flags, words = ALL, {}
    if since is not None:
        flags |= SINCE
        inside &= rig.created >= since
    if until is not None:
        flags |= UNTIL
        inside &= rig.created < until
    return dict(flags=flags, since=since or 0.0, until=until or 0.0, **words), inside


def _live_times(rig) -> np.ndarray:
    """The live rows' created_at, sorted: a window's bounds at these are rows it must (since)
    or must not (until) hold."""
    return np.sort(rig.created[rig.live])


@needs_interpreter
@ROUNDS
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_answers_recalls_each_in_its_own_time_window(make_rig, rng, precision, bucket):
    # Agents ask for their own windows ("since an hour ago", "before yesterday"): the GPU
    # serves them, each query masked by its own [since, until), the bounds at rows' exact
    # created_at (since inclusive, until exclusive), one window holding fewer rows than k and
    # one holding none. Exact answers them all; fast answers or hands over (certificate).
    # (t[7], t[9]) holds exactly the rows at t[7] and t[8]; one window is in namespace "a".
    rig = make_rig(precision=precision, slots=8, bucket=bucket)
    t = _live_times(rig)
    windows = [(None, None), (t[50], None), (None, t[120]), (t[30], t[40]), (t[7], t[9]),
               (t[-1] + 1.0, None), (t[60], t[90], b"a"), (None, t[5])]
    queries = rng.standard_normal((8, rig.engine.dim)).astype(np.float32)
    seqs, inside = [], []
    for s, window in enumerate(windows):
        words, rows = _window_request(rig, window)
        seqs.append(rig.submit(s, queries[s], 8, **words))
        inside.append(rows)
    rig.serve()
    answered = 0
    for s, window in enumerate(windows):
        if not _answered(rig, s, seqs[s]):
            assert precision == "fast" and int(rig.server.handed[s]) == seqs[s], f"window {window}: not served"
            continue
        answered += 1
        view = rig.views[s]
        assert (int(view.status[0]), int(view.n_results[0])) == (0, 8)
        assert_topk_matches(view.ids[:1, :8], view.scores[:1, :8], rig.ids, rig.vectors, queries[s][None], 8,
                            inside[s], context=f"{precision} window {window} ({inside[s].sum()} rows)")
    assert rig.server.served == answered
    assert answered >= (8 if precision == "exact" else 1)


@needs_interpreter
def test_batch_round_takes_requests_with_different_filters_as_one_kind(make_rig, rng):
    # Neither windows nor namespaces split a crowd: requests of one k are one round, each
    # query answered under its own namespace and window.
    rig = make_rig(slots=7, server=QueuedGraphServer, depth=1, window_polls=0)
    t = _live_times(rig)
    windows = [(t[10], None), (t[5], t[120], b"a"), (None, None), b"a", (t[20], t[150]), (None, t[90], b"a"), b"b"]
    queries = rng.standard_normal((7, rig.engine.dim)).astype(np.float32)
    requests = [_window_request(rig, w) for w in windows]
    seqs = [rig.submit(s, queries[s], 4, **words) for s, (words, _rows) in enumerate(requests)]
    server = rig.server
    assert server.start(rig.active) and len(server.gpu) == 1
    server.step()
    assert [s for s in range(7) if _answered(rig, s, seqs[s])] == list(range(7))
    for s, (_words, rows) in enumerate(requests):
        view = rig.views[s]
        assert int(server.handed[s]) != seqs[s]
        assert_topk_matches(view.ids[:1, :4], view.scores[:1, :4], rig.ids, rig.vectors, queries[s][None], 4,
                            rows, context=f"slot {s} window {windows[s]}")
    server.stop()


@needs_interpreter
@ROUNDS
def test_a_round_after_one_with_windows_reads_no_window_left_behind(make_rig, rng, bucket):
    # The table rows a round of narrow windows filled are the next round's rows too: that
    # round's open requests (beside one with a window of its own in a batch) answer from
    # every row, not from the window left in their row (no start between the two rounds).
    slots = bucket
    rig = make_rig(slots=slots, server=QueuedGraphServer, depth=1, window_polls=0)
    t = _live_times(rig)
    server = rig.server
    assert server.start(rig.active)
    for windows in ([(t[7], t[9])] * slots, [(None, None)] * slots if slots == 1 else
                    [(t[30], t[60])] + [(None, None)] * (slots - 1)):
        queries = rng.standard_normal((slots, rig.engine.dim)).astype(np.float32)
        requests = [_window_request(rig, w) for w in windows]
        seqs = [rig.submit(s, queries[s], 8, **words) for s, (words, _rows) in enumerate(requests)]
        server.step()
        server.running()
        for s, (_words, rows) in enumerate(requests):
            view = rig.views[s]
            assert _answered(rig, s, seqs[s]), f"window {windows[s]}: slot {s} not answered"
            assert_topk_matches(view.ids[:1, :8], view.scores[:1, :8], rig.ids, rig.vectors, queries[s][None], 8,
                                rows, context=f"window {windows[s]} slot {s}")
    server.stop()


@needs_interpreter
def test_batch_round_of_several_namespaces_hands_over_an_unknown_one_and_leaves_none_behind(make_rig, rng):
    # One round: requests in "a", "b", all namespaces, "a" with a window, and a name the table
    # does not hold, which goes to the host while the others are answered, each in its own
    # namespace. The next round (no start between) reuses the table rows: its requests in all
    # namespaces, beside one in "b", answer from every row, not from a namespace left there.
    rig = make_rig(slots=5, server=QueuedGraphServer, depth=1, window_polls=0)
    t = _live_times(rig)
    server = rig.server
    assert server.start(rig.active)
    for windows in ([b"a", b"b", (None, None), (t[20], t[150], b"a"), b"zz"],
                    [(None, None), (None, None), b"b", (None, None), (None, None)]):
        queries = rng.standard_normal((5, rig.engine.dim)).astype(np.float32)
        requests = [_window_request(rig, w) if w != b"zz" else (dict(flags=0, namespace=b"zz"), None)
                    for w in windows]
        seqs = [rig.submit(s, queries[s], 8, **words) for s, (words, _rows) in enumerate(requests)]
        server.step()
        server.running()
        for s, (_words, rows) in enumerate(requests):
            if rows is None:
                assert int(server.handed[s]) == seqs[s] and not _answered(rig, s, seqs[s])
                continue
            view = rig.views[s]
            assert _answered(rig, s, seqs[s]), f"{windows[s]}: slot {s} not answered"
            assert_topk_matches(view.ids[:1, :8], view.scores[:1, :8], rig.ids, rig.vectors, queries[s][None], 8,
                                rows, context=f"{windows[s]} slot {s}")
    server.stop()


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_batch_round_with_a_split_final_kernel_answers_and_leaves_its_counts_at_zero(make_rig, rng, precision):
    """At the server's default k bucket (16) a batch round splits its final kernel's re-score
    over several programs per request, the last to arrive publishing the answer: every request
    is answered as the float64 reference says (fast: or handed to the host), and the round's
    arrival counts are back at zero for the next replay of its graph."""
    rig = make_rig(precision=precision, slots=4, max_k=16, bucket=4)
    queries = rng.standard_normal((4, rig.engine.dim)).astype(np.float32)
    for _ in range(2):  # (a second round of the same graph finds its counts at zero)
        seqs = [rig.submit(s, queries[s], 8, flags=ALL) for s in range(4)]
        rig.serve()
        held = rig.server._rounds[(4, rig.server.kout)]
        assert held.plan.final_split > 1
        for s in range(4):
            if not _answered(rig, s, seqs[s]):
                assert precision == "fast" and int(rig.server.handed[s]) == seqs[s], f"slot {s} neither answered nor handed"
                continue
            view = rig.views[s]
            assert (int(view.status[0]), int(view.n_results[0])) == (0, 8)
            assert_topk_matches(view.ids[:1, :8], view.scores[:1, :8], rig.ids, rig.vectors, queries[s][None], 8,
                                rig.live, context=f"{precision} slot {s}")
        assert not held.split.arrived.any()
        queries = queries[::-1].copy()
    # The rounds run are counted (a round of 4 takes at most 4): what stats report as gpu_rounds.
    assert rig.server.rounds >= 2 and rig.server.served <= 4 * rig.server.rounds


@needs_interpreter
@pytest.mark.parametrize("split", [2, 4])
def test_batch_round_with_a_split_stage_in_answers_and_leaves_its_counts_at_zero(make_rig, rng, split):
    """Tuning.stage_split: each query of a batch round is read from its slot by several
    programs, the last to arrive scaling it to unit length. Queries of every length, in a
    dimension that is no multiple of a program's part (40: parts of 32 or 16 floats), are
    answered as the float64 reference says, twice (the second round finds the counts at zero)."""
    rig = make_rig(dim=40, slots=4, bucket=4)
    rig.engine.retune({"stage_split": split})
    for _ in range(2):
        queries = (rng.standard_normal((4, 40)) * rng.uniform(0.01, 100, (4, 1))).astype(np.float32)
        seqs = [rig.submit(s, queries[s], 8, flags=ALL) for s in range(4)]
        rig.serve()
        for s in range(4):
            assert _answered(rig, s, seqs[s]), f"slot {s} not answered"
            view = rig.views[s]
            assert (int(view.status[0]), int(view.n_results[0])) == (0, 8)
            assert_topk_matches(view.ids[:1, :8], view.scores[:1, :8], rig.ids, rig.vectors, queries[s][None], 8,
                                rig.live, context=f"split {split} slot {s}")
        assert not rig.server._stage_arrived.any()
        # The split kernel ran: each query's programs filed their parts' sums of squares.
        parts = rig.server._stage_parts.view(-1)[: 4 * split].view(4, split).sum(dim=1).numpy()
        norms = (queries.astype(np.float64) ** 2).sum(axis=1)
        np.testing.assert_allclose(np.sort(parts), np.sort(norms), rtol=1e-12)


@needs_interpreter
@pytest.mark.parametrize("scores_by", ["scan", "gemm"])
def test_batch_round_selecting_by_threshold_answers_with_empty_groups_and_slices(make_rig, rng, scores_by):
    """A batch round that selects whole slices by threshold, its scores and group maxima
    written by the scan or its scores by a GEMM (the maxima then by group_max_kernel; scaled
    down: 16-row groups, slices of 1,024 rows), with a capacity past the rows in use: groups
    and a whole slice with no row (maxima -inf, tau -inf there). Answers as the float64
    reference says, in a namespace, across all of them, each query in its own window, and each
    in its own namespace."""
    rig = make_rig(n=1100, slots=4, bucket=4, max_k=8)  # (the k bucket of 8: 32 candidates)
    tile = ScanConfig(block_n=16, block_d=16, block_q=16, warps=4, stages=1)
    rig.engine.retune({"gemm_min_q": 64 if scores_by == "scan" else 2, "scan_threshold_min_q": 2, "gemm_rows": 1024,
                       "score_chunk": 256, "cpu_block_n": 16, "scores_f32_batch": tile})
    rig.engine.reserve(2000)
    assert rig.engine.rows.capacity >= 3072 and rig.engine.rows.size == 1100
    t = _live_times(rig)
    crowds = {"all": [(None, None)] * 4, "a": [b"a"] * 4,
              "windows": [(t[100], None), (None, t[700]), (t[900], t[-1] + 1.0), (t[5], t[30])],
              "namespaces": [b"a", b"b", (t[100], t[600], b"a"), (None, None)]}
    for label, windows in crowds.items():
        queries = rng.standard_normal((4, rig.engine.dim)).astype(np.float32)
        requests = [_window_request(rig, w) for w in windows]
        seqs = [rig.submit(s, queries[s], 8, **words) for s, (words, _rows) in enumerate(requests)]
        rig.serve()
        plans = [r.plan for (size, _k), r in rig.server._rounds.items() if size == 4]
        assert plans and all(p.threshold and bool(p.gemm_rows) == (scores_by == "gemm") for p in plans)
        for s, (_words, eligible) in enumerate(requests):
            assert _answered(rig, s, seqs[s]), f"{label}: slot {s} not answered"
            view = rig.views[s]
            assert_topk_matches(view.ids[:1, :8], view.scores[:1, :8], rig.ids, rig.vectors, queries[s][None], 8,
                                eligible, context=f"{scores_by} {label} slot {s}")


@needs_interpreter
def test_batch_round_takes_at_most_its_size_in_turn_order_from_where_the_last_one_stopped(make_rig, rng):
    rig = make_rig(slots=8, server=QueuedGraphServer, depth=1, window_polls=0, batch=4)
    server = rig.server
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    assert server.start(rig.active) and server._bucket == 4

    def round_of(slots: list[int]) -> set[int]:
        seqs = {s: rig.submit(s, q, 4) for s in slots}
        server.running()
        server.step()
        return {s for s, seq in seqs.items() if _answered(rig, s, seq)}, seqs

    taken, seqs = round_of([0, 1, 2, 3, 4, 5])
    assert taken == {0, 1, 2, 3}
    pending = {4: seqs[4], 5: seqs[5]}
    seqs = {s: rig.submit(s, q, 4) for s in (0, 1)}
    server.running()
    server.step()  # the turn starts after slot 3: 4, 5, then 0, 1
    assert all(_answered(rig, s, seq) for s, seq in {**pending, **seqs}.items())
    taken, seqs = round_of([2, 3, 4, 6, 7])  # the turn starts after slot 1
    assert taken == {2, 3, 4, 6}
    server.running()
    server.step()
    assert _answered(rig, 7, seqs[7])


@needs_interpreter
def test_batch_round_turns_to_a_kind_left_behind_even_when_the_other_kind_always_fits(make_rig, rng):
    # Seven clients ask for k = 4, one (slot 2) for k = 3; the k = 4 crowd fits in every round
    # and asks again at once. The next round must start at slot 2, or it waits for ever (it is
    # not the host's either: nothing hands it over).
    rig = make_rig(slots=8, server=QueuedGraphServer, depth=1, window_polls=0)
    server = rig.server
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    assert server.start(rig.active) and server._bucket == 8
    lone = rig.submit(2, q, 3)
    for _ in range(2):
        crowd = {s: rig.submit(s, q, 4) for s in (0, 1, 3, 4, 5, 6, 7)}
        server.running()
        server.step()
        if _answered(rig, 2, lone):
            break
        assert all(_answered(rig, s, seq) for s, seq in crowd.items())
    assert _answered(rig, 2, lone), "the lone request of another kind was never taken"
    assert int(rig.views[2].n_results[0]) == 3


@needs_interpreter
def test_batch_round_takes_a_named_crowd_whatever_its_clients_sleeping_flags(make_rig, rng):
    # The word that holds a request's namespace length holds the client's sleeping flag too,
    # which a waiting client sets: requests for the same namespace stay one kind.
    rig = make_rig(server=QueuedGraphServer, depth=1, window_polls=0)
    queries = rng.standard_normal((4, rig.engine.dim)).astype(np.float32)
    seqs = [rig.submit(s, queries[s], 4, flags=0, namespace=b"a") for s in range(4)]
    rig.views[1].client_sleeping[0] = 1
    rig.views[3].client_sleeping[0] = 1
    assert rig.server.start(rig.active)
    rig.server.step()
    for s in range(4):
        assert _answered(rig, s, seqs[s]), f"slot {s} was left for another round"
        view = rig.views[s]
        assert_topk_matches(view.ids[:1, :4], view.scores[:1, :4], rig.ids, rig.vectors, queries[s][None], 4,
                            rig.live & (rig.namespaces == 0), context=f"slot {s}")


@needs_interpreter
def test_batch_round_hands_over_bad_requests_and_answers_the_rest(make_rig, rng):
    # One crowd: good queries beside a zero query, a NaN query, k above the server's limit and
    # a batch. The bad ones go to the host (nothing written in their slots), the good ones
    # are answered right, in the same round.
    rig = make_rig(slots=8, bucket=8)
    dim = rig.engine.dim
    good = rng.standard_normal((4, dim)).astype(np.float32)
    bad = {
        1: dict(query=np.zeros(dim, np.float32), k=4),
        3: dict(query=np.full(dim, np.nan, np.float32), k=4),
        5: dict(query=good[0], k=33),
        7: dict(query=np.stack([good[0], good[1]]), k=4, n_queries=2),
    }
    before = {s: rig.views[s].ids[0].tobytes() for s in bad}
    seqs = {}
    for s in range(8):
        seqs[s] = rig.submit(s, **bad[s]) if s in bad else rig.submit(s, good[s // 2], 4)
    rig.serve()
    for s in range(8):
        if s in bad:
            assert int(rig.server.handed[s]) == seqs[s] and not _answered(rig, s, seqs[s]), s
            assert rig.views[s].ids[0].tobytes() == before[s], f"slot {s}: the answer area was written"
        else:
            view = rig.views[s]
            assert _answered(rig, s, seqs[s]) and int(view.n_results[0]) == 4
            assert_topk_matches(view.ids[:1, :4], view.scores[:1, :4], rig.ids, rig.vectors, good[s // 2][None], 4,
                                rig.live, context=f"slot {s}")
    assert rig.server.served == 4


@needs_interpreter
def test_batch_round_waits_its_window_for_clients_that_have_not_asked(make_rig, rng):
    # Four clients, one asks: the round waits window_polls polls for the others, then
    # answers the one; with a window of 0 it answers at once.
    for polls in (0, 3):
        rig = make_rig(window_polls=polls, idle_polls=0)
        q = rng.standard_normal(rig.engine.dim).astype(np.float32)
        seq = rig.submit(2, q, 4)
        assert rig.server.bucket(4) == 4
        rig.serve()
        assert _answered(rig, 2, seq), f"window of {polls} polls"
        assert_topk_matches(rig.views[2].ids[:1, :4], rig.views[2].scores[:1, :4], rig.ids, rig.vectors, q[None], 4,
                            rig.live, context=f"window of {polls} polls")


def test_rounds_are_chosen_by_the_clients_present(make_rig):
    rig = make_rig(slots=8, batch=4)
    server = rig.server
    assert [server.bucket(n) for n in (0, 1, 2, 3, 4, 5, 8)] == [1, 1, 2, 4, 4, 4, 4]
    assert SlotGraphServer(rig.engine, rig.layout, np.zeros(8, np.uint64), batch=6).max_bucket == 4
    with pytest.raises(InvalidArgument, match="bucket"):
        server.start(rig.active, bucket=3)
    with pytest.raises(InvalidArgument, match="bucket"):
        server.start(rig.active, bucket=8)
    with pytest.raises(InvalidArgument, match="batch"):
        SlotGraphServer(rig.engine, rig.layout, np.zeros(8, np.uint64), batch=0)


@needs_interpreter
def test_ignores_slots_without_a_client_and_answered_requests(make_rig, rng):
    rig = make_rig()
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    seq = rig.submit(2, q, 4)
    rig.active[2] = False
    rig.serve()
    assert int(rig.views[2].resp_seq[0]) != seq and int(rig.server.handed[2]) != seq
    rig.active[2] = True
    rig.server.answered[2] = seq  # the host answered it already
    rig.serve()
    assert int(rig.views[2].resp_seq[0]) != seq and int(rig.server.handed[2]) != seq
    rig.server.warm()  # exits at once: serves nothing
    assert rig.server.served == 0


@needs_interpreter
def test_needs_the_triton_engine_with_the_segment_attached(rng):
    engine = TorchEngine(16, device="cpu", backend="triton")
    layout = Layout(2, 16, 8, 1)
    with pytest.raises(InvalidArgument, match="attach_host"):
        SlotGraphServer(engine, layout, np.zeros(2, np.uint64))
    buf = mmap.mmap(-1, layout.size)
    engine.attach_host(buf)
    try:
        with pytest.raises(InvalidArgument, match="max_k"):
            SlotGraphServer(engine, layout, np.zeros(2, np.uint64), max_k=0)
        with pytest.raises(InvalidArgument, match="entries"):
            SlotGraphServer(engine, layout, np.zeros(3, np.uint64))
        for bad in ("window_s", "gap_s", "window_max_s", "resize_s"):
            with pytest.raises(InvalidArgument, match="window_s, window_polls, gap_s, window_max_s, resize_s and k_resize_s"):
                SlotGraphServer(engine, layout, np.zeros(2, np.uint64), **{bad: -1e-6})
        # --gpu-window-us 0 takes what is pending at once: no gap to wait for either.
        assert SlotGraphServer(engine, layout, np.zeros(2, np.uint64), window_s=0).gap_s == 0
        server = SlotGraphServer(engine, layout, np.zeros(2, np.uint64))
        assert (server.gap_s, server.window_max_s) == (DEFAULT_GAP_S, DEFAULT_WINDOW_MAX_S)
        assert server.start(np.ones(2, bool)) is False  # no rows: nothing to serve
        with pytest.raises(InvalidArgument, match="namespace ids"):
            server.set_namespaces({b"x": -1})
    finally:
        engine.detach_host()


class _DeferredRound:
    """A replay queued on the fake GPU of :class:`QueuedGraphServer`: it runs when its turn comes."""

    def __init__(self, server: "QueuedGraphServer", bucket: int, kout: int) -> None:
        self.server = server
        self.bucket, self.kout = bucket, kout  # the graph replayed: the round size and k bucket queued then
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        while not self.done:
            self.server.step()


class QueuedGraphServer(SlotGraphServer):
    """The graph server's host side (start, running, stop) as on a GPU, on the CPU: a replay
    queues a round that the test runs later (``step``, like the GPU reaching it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gpu: collections.deque = collections.deque()

    def _serve_now(self) -> None:  # queue rounds, as start() does on a GPU
        self._serving = True
        self.running()

    def _enqueue_rounds(self, count: int) -> list:
        rounds = [_DeferredRound(self, self._bucket, self._kout) for _ in range(count)]
        self.gpu.extend(rounds)
        return rounds

    def step(self) -> None:
        """The oldest queued round runs (it waits for a request up to idle_polls polls)."""
        job = self.gpu.popleft()
        self._round(job.bucket, job.kout)
        job.done = True


@needs_interpreter
def test_graph_server_queues_rounds_until_stopped_and_reloads_on_start(make_rig, rng):
    rig = make_rig(server=QueuedGraphServer, depth=3)
    server = rig.server
    rig.active[3] = False  # no client in slot 3 yet
    assert server.start(rig.active) and server.running() and len(server.gpu) == 3
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    for _ in range(3):  # the sweep is busy elsewhere: each queued round takes one request
        seq = rig.submit(0, q, 4)
        server.step()
        assert int(rig.views[0].resp_seq[0]) == seq
    server.running()  # tops the queue up again
    for _ in range(3):
        seq = rig.submit(0, q, 4)
        server.step()
    # Stopped after rounds that all served (none saw the stop word): nothing may be queued
    # again before start(), which loads what changed meanwhile.
    server.stop()
    assert not server.running() and not server.gpu
    rig.active[3] = True  # a new client
    unit = (q / np.linalg.norm(q.astype(np.float64))).astype(np.float32)
    rig.engine.add(np.array([9999]), unit[None], np.zeros(1, np.int32), np.zeros(1))  # a row added meanwhile
    assert server.start(rig.active)
    seq = rig.submit(3, q, 4)
    server.step()
    assert int(rig.views[3].resp_seq[0]) == seq and int(rig.views[3].ids[0, 0]) == 9999
    # With no requests the waiting round stops by itself (idle_polls); the queue drains.
    while server.running():
        server.step()
    assert int(server._hctl[HOST_CONTROL.stopped]) == 1 and server.served == 7


@needs_interpreter
def test_clients_come_and_go_while_the_rounds_run(make_rig, rng):
    # No restart when a slot changes hands: each poll reads which slots have a client, and a
    # slot handed out at rest (a new generation's seq) is never taken for its previous
    # client's numbers, whatever the kernels recorded for those.
    rig = make_rig(server=QueuedGraphServer, depth=1, window_polls=0)
    server, views = rig.server, rig.views
    rig.active[3] = 0  # no client in slot 3
    assert server.start(rig.active, bucket=4)
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)

    def one_round(asking: list[int]) -> list[int]:
        """Submits in ``asking``, runs the queued round; the slots it answered."""
        seqs = {slot: rig.submit(slot, q, 4) for slot in asking}
        server.step()
        server.running()
        return [slot for slot, seq in seqs.items() if int(views[slot].resp_seq[0]) == seq]

    assert one_round([0, 3]) == [0]  # slot 3's request: nobody holds the slot, so ignored
    assert int(server.handed[3]) != int(rig.seqs[3])
    # Slot 0's client leaves and a new one takes it at rest; slot 3 gets its first client.
    for slot, generation in ((0, 3), (3, 2)):
        views[slot].req_seq[0] = views[slot].resp_seq[0] = rig.seqs[slot] = rest_seq(generation)
        rig.active[slot] = 1
    assert one_round([1]) == [1]  # the two at rest: no request of theirs is taken or handed over
    assert int(server.handed[0]) != rest_seq(3) and int(server.handed[3]) != rest_seq(2)
    assert one_round([0, 3]) == [0, 3] and int(rig.seqs[0]) == rest_seq(3) + 1
    for slot in (0, 3):
        assert_topk_matches(views[slot].ids[:1, :4], views[slot].scores[:1, :4], rig.ids, rig.vectors, q[None], 4,
                            rig.live, context=f"slot {slot}")
    assert not server.taken.any()  # every answer is out: no round holds a slot
    # A client that leaves with a request pending: that request is no longer polled.
    left = rig.submit(2, q, 4)
    rig.active[2] = 0
    assert one_round([1]) == [1] and int(views[2].resp_seq[0]) != left and int(server.handed[2]) != left
    assert server.served == 5
    # Why the rest seqs: a newcomer in slot 1 whose count met the number the kernels last
    # answered there (as one counting from 0 again would) is taken for answered: never served.
    views[1].resp_seq[0] = 0
    rig.seqs[1] -= 1
    one_round([1])
    assert server.served == 5 and int(views[1].resp_seq[0]) == 0 and int(server.handed[1]) != int(rig.seqs[1])


@needs_interpreter
@ROUNDS
def test_a_round_marks_the_slots_it_takes_until_their_answers_are_out(make_rig, rng, monkeypatch, bucket):
    # The host hands a slot to a new client only where taken is 0: the waiting kernel sets it
    # for every request it takes, and only the final kernel, once the answer is out, clears it.
    rig = make_rig(server=QueuedGraphServer, depth=1, bucket=bucket, window_polls=0)
    server = rig.server
    assert rig.serve()
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    asking = [1, 2] if bucket > 1 else [2]
    seqs = {slot: rig.submit(slot, q, 4) for slot in asking}
    pipeline = rig.engine.pipeline
    with monkeypatch.context() as patch:  # a round cut off before its final kernel
        patch.setattr(pipeline, "select_final", lambda *args, **kwargs: None)
        server.step()
    assert {slot: int(server.taken[slot]) for slot in asking} == seqs and not server.taken[[0, 3]].any()
    assert all(int(rig.views[slot].resp_seq[0]) != seq for slot, seq in seqs.items())
    server.running()
    server.step()  # (the requests are still pending: the kernels recorded no answer)
    assert all(int(rig.views[slot].resp_seq[0]) == seq for slot, seq in seqs.items())
    assert not server.taken.any()


class FailingCaptureServer(QueuedGraphServer):
    """A graph server whose rounds of ``fail_at`` requests and more cannot be captured (the
    GPU's memory, say); ``captured`` the rounds that have a graph."""

    def __init__(self, *args, fail_at: int, captured: set, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at, self.captured, self.captures = fail_at, set(captured), []

    def _needs_capture(self, qb: int, kout: int) -> bool:
        return qb not in self.captured

    def _capture(self, qb: int, kout: int) -> None:
        self.captures.append(qb)
        if qb >= self.fail_at:
            raise RuntimeError("CUDA out of memory (a test's)")
        self.captured.add(qb)


@needs_interpreter
def test_a_round_the_demand_asks_for_that_cannot_be_captured_leaves_serving_on(make_rig, rng):
    rig = make_rig(server=FailingCaptureServer, fail_at=8, captured={1, 2}, slots=8, depth=1, resize_s=0.0,
                   window_polls=0)
    server = rig.server
    two = np.zeros(8, np.int64)
    two[:2] = 1
    assert server.start(two) and server._bucket == 2  # (every slot has a client: in_use)
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    seqs = {slot: rig.submit(slot, q, 4) for slot in range(5)}
    server.step()  # a round of 2 finds 5: the host asks for 8, whose capture fails
    assert server.running() and server.captures == [8] and server._bucket == 2
    assert int(server._hctl[HOST_CONTROL.stopped]) == 0 and not server.taken.any()
    for _ in range(2):  # serving goes on with the rounds it has
        server.step()
        server.running()
    assert all(int(rig.views[slot].resp_seq[0]) == seq for slot, seq in seqs.items())
    # A crowd of 5 again: a round of 4 is asked for (captured now), never 8 again.
    seqs = {slot: rig.submit(slot, q, 4) for slot in range(5)}
    server.step()
    server.running()
    assert server.captures == [8, 4] and server._bucket == 4 and server.bucket(8) == 4
    server.step()
    assert all(int(rig.views[slot].resp_seq[0]) == seq for slot, seq in seqs.items())


@needs_interpreter
def test_rounds_follow_demand(make_rig, rng):
    # Queued rounds are sized by the servable requests the latest ones found: larger at once,
    # smaller once a resize period found no more.
    rig = make_rig(server=QueuedGraphServer, slots=8, depth=1, resize_s=0.0, window_polls=0)
    server = rig.server
    assert server.start(rig.active) and server._bucket == 8 and server.gpu[-1].bucket == 8
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)

    def one_round(slots: list[int]) -> list[int]:
        seqs = [rig.submit(s, q, 4) for s in slots]
        server.step()
        server.running()  # (the sweep's look: sizes and queues the next round)
        return [s for s, seq in zip(slots, seqs) if int(rig.views[s].resp_seq[0]) == seq]

    assert one_round([1, 5]) == [1, 5] and server._bucket == 2 and server.gpu[-1].bucket == 2
    # Five ask: the round of 2 takes two; the next is queued for five at once, and takes the rest.
    five = [0, 2, 3, 4, 6]
    assert len(one_round(five)) == 2 and server._bucket == 8 and server.gpu[-1].bucket == 8
    server.step()
    assert all(int(rig.views[s].resp_seq[0]) == int(rig.seqs[s]) for s in five)
    server.running()
    assert server._bucket == 4  # (3 found; with resize_s = 0 every look ends a period)
    server.resize_s = 3600.0  # fewer from now on, within one period: the size stays
    assert one_round([7]) == [7] and server._bucket == 4
    server.resize_s = 0.0
    assert one_round([7]) == [7] and server._bucket == 1 and server.gpu[-1].bucket == 1
    # The single round takes one and leaves the others pending; it reports them: batches again.
    served = one_round([0, 1, 2])
    assert len(served) == 1 and server._bucket == 4 and server.gpu[-1].bucket == 4
    assert not any(int(server.handed[s]) == int(rig.seqs[s]) for s in (0, 1, 2))
    server.step()
    assert all(int(rig.views[s].resp_seq[0]) == int(rig.seqs[s]) for s in (0, 1, 2))


@needs_interpreter
@pytest.mark.parametrize("bucket_clients", [1, 4], ids=["single rounds", "batch rounds"])
def test_rounds_take_the_larger_k_bucket_when_a_request_needs_it(make_rig, rng, bucket_clients):
    # Rounds start at the k bucket of SMALL_K. A request past it is handed to the host (the
    # round's kernels are built for fewer columns) and reported; the rounds queued next are of
    # the larger bucket and answer such requests themselves, as the float64 reference says;
    # once k_resize_s passes without one, the rounds go back to the smaller bucket.
    rig = make_rig(server=QueuedGraphServer, slots=4, max_k=16, depth=1, window_polls=0, resize_s=3600.0,
                   k_resize_s=3600.0)
    server = rig.server
    assert server.kouts == (SMALL_K, 16)
    rig.active[bucket_clients:] = 0
    assert server.start(rig.active) and server.gpu[-1].kout == SMALL_K
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)

    def one_round(k: int) -> int:
        seq = rig.submit(0, q, k)
        server.step()
        server.running()  # (the sweep's look: the next round's size and k bucket)
        return seq

    seq = one_round(SMALL_K)
    assert _answered(rig, 0, seq) and server.gpu[-1].kout == SMALL_K
    seq = rig.submit(0, q, 16)
    server.step()
    assert int(server.handed[0]) == seq and not _answered(rig, 0, seq)
    assert not server.running()  # (the round handed it over, found no other, and went idle: stopped)
    assert int(server._hctl[HOST_CONTROL.k_wanted]) == 16
    # The next start (the sidecar's, at the next request) reads the report: the larger bucket.
    assert server.start(rig.active) and server.gpu[-1].kout == 16
    assert int(server._hctl[HOST_CONTROL.k_wanted]) == 0  # (read and cleared)
    for k in (16, 12, 3):  # the larger bucket serves every k up to it
        seq = one_round(k)
        assert _answered(rig, 0, seq) and server.gpu[-1].kout == 16, f"k={k}"
        view = rig.views[0]
        assert (int(view.status[0]), int(view.n_results[0])) == (0, k)
        assert_topk_matches(view.ids[:1, :k], view.scores[:1, :k], rig.ids, rig.vectors, q[None], k, rig.live,
                            context=f"k={k} at the larger bucket")
    server.stop()  # a stop and a start keep it
    assert server.start(rig.active) and server.gpu[-1].kout == 16
    server.k_resize_s = 0.0
    seq = one_round(4)
    assert _answered(rig, 0, seq) and server.gpu[-1].kout == SMALL_K
    # A report while rounds of the smaller bucket are queued (a round that handed a request over
    # goes on waiting for others): the sweep's next look drains them and queues the larger.
    server.k_resize_s = 3600.0
    queued = server.gpu[-1]
    server._hctl[HOST_CONTROL.k_wanted] = 12
    assert server.running() and queued.done and server.gpu[-1].kout == 16
    seq = one_round(12)
    assert _answered(rig, 0, seq) and int(rig.views[0].n_results[0]) == 12


def test_warm_serves_with_the_smaller_k_bucket_when_the_larger_cannot_be_captured(make_rig, monkeypatch, caplog):
    # The larger bucket's rounds fail to capture (the GPU's memory, say): the server serves
    # with the smaller bucket's, a report of a larger k no longer switches the rounds (such
    # requests go to the host), and a failure of the smaller bucket's is raised.
    rig = make_rig(max_k=16)
    server = rig.server
    real_start = server.start

    def start(active, *, kout=None, **kwargs):
        if kout == fail_at:
            raise RuntimeError("CUDA out of memory (a test's)")
        return real_start(active, kout=kout, **kwargs)

    monkeypatch.setattr(server, "start", start)
    fail_at = 16
    server.warm()
    assert server._kout_ok == SMALL_K and server._kout == SMALL_K
    assert any("requests for k > 8 go to the host" in r.getMessage() for r in caplog.records)
    server._hctl[HOST_CONTROL.k_wanted] = 16
    assert not server._wants_larger_k()
    server._follow_k(0.0)
    assert server._kout == SMALL_K
    fail_at = SMALL_K
    with pytest.raises(RuntimeError, match="out of memory"):
        server.warm()

def test_k_buckets_of_the_rounds(make_rig):
    assert make_rig(max_k=16).server.kouts == (8, 16)
    assert make_rig(max_k=8).server.kouts == (8,)
    assert make_rig(max_k=3).server.kouts == (4,)
    # Past 16: a reported k goes to the bucket the server has that serves it (8 or 32), never to
    # one it did not capture (16).
    wide = make_rig(max_k=32, server_max_k=32).server
    assert wide.kouts == (8, 32)
    for reported, bucket in ((12, 32), (32, 32), (5, 8)):
        wide._kout = wide.kouts[0]
        wide._hctl[HOST_CONTROL.k_wanted] = reported
        wide._follow_k(0.0)
        assert wide._kout == bucket and int(wide._hctl[HOST_CONTROL.k_wanted]) == 0, reported
    rig = make_rig(max_k=16)
    with pytest.raises(InvalidArgument, match=r"kout must be one of the k buckets \(8, 16\), got 4"):
        rig.server.start(rig.active, bucket=1, kout=4)


@needs_interpreter
def test_fast_hands_over_what_its_certificate_cannot_prove(make_rig, rng):
    # 80 rows whose scores differ by 1e-6, far below float16's resolution: the 16-bit scan
    # ties them all and keeps the lowest rows, while the best ones are the highest. The k-th
    # kept score is not 2E above the last kept one, so the certificate must fail and the
    # request go to the host (certifying against the top-1 score instead would pass, with
    # the wrong rows).
    rig = make_rig(precision="fast")
    d = rig.engine.dim
    q = np.zeros(d, np.float32)
    q[0] = 1.0
    rows = np.zeros((81, d))
    rows[0, :2] = 0.95, math.sqrt(1 - 0.95**2)  # one clear best row
    for i in range(1, 81):
        other = rng.standard_normal(d - 1)
        s = 0.7 + i * 1e-6
        rows[i, 0] = s
        rows[i, 1:] = math.sqrt(1 - s * s) * other / np.linalg.norm(other)
    ids = np.arange(20000, 20081)
    rig.engine.add(ids, rows.astype(np.float32), np.zeros(81, np.int32), np.zeros(81))
    seq = rig.submit(1, q, 8)
    rig.serve()
    assert int(rig.server.handed[1]) == seq and int(rig.views[1].resp_seq[0]) != seq
    assert int(rig.server.taken[1]) == 0  # (handed over by the final kernel: no longer the round's)


def test_waiting_kernels_take_a_warp_per_32_slots_by_default(make_rig):
    """One warp up to 32 slots, then one per 32, at most 8: past 32 slots one warp's registers
    cannot hold the per-slot words (they spilled); a server told its warps keeps them."""
    assert [waiting_warps(ns) for ns in (1, 8, 32, 64, 128, 256, 1024)] == [1, 1, 1, 2, 4, 8, 8]
    assert make_rig(slots=40).server.warps == 2
    assert make_rig(slots=4).server.warps == 1
    assert make_rig(slots=40, warps=1).server.warps == 1
    with pytest.raises(InvalidArgument, match="warps must be 1, 2, 4 or 8"):
        make_rig(slots=4, warps=3)


def test_gpu_polling_modes_are_checked(tmp_path, capsys):
    from kalos.server.sidecar import SidecarConfig
    from kalos.tools.cli import _build_parser as build_parser

    with pytest.raises(InvalidArgument, match="gpu_polling must be one of off, graph, got 'on'"):
        SidecarConfig(store=tmp_path / "m.db", name="x", gpu_polling="on")
    for bad in (-1.0, 20_000.0):
        with pytest.raises(InvalidArgument, match="gpu_window_us must be in"):
            SidecarConfig(store=tmp_path / "m.db", name="x", gpu_window_us=bad)
    parser = build_parser()
    assert parser.parse_args(["serve"]).gpu_polling == "graph"  # (the default: BENCHMARKS.md, "The crowd")
    assert parser.parse_args(["serve", "--gpu-polling", "off"]).gpu_polling == "off"
    assert parser.parse_args(["serve"]).gpu_window_us == SidecarConfig(store=tmp_path / "m.db").gpu_window_us
    assert parser.parse_args(["serve", "--gpu-window-us", "5"]).gpu_window_us == 5.0
    assert parser.parse_args(["serve", "--gpu-polling"]).gpu_polling == "graph"
    assert parser.parse_args(["serve", "--gpu-polling", "graph"]).gpu_polling == "graph"
    for gone in ("resident", "yes"):  # (the resident mode was removed)
        capsys.readouterr()
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--gpu-polling", gone])
        err = capsys.readouterr().err
        assert f"invalid choice: '{gone}'" in err and "off" in err and "graph" in err, err


# -- a real GPU ------------------------------------------------------------------------------


@cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_cuda_server_answers_while_running(make_rig, rng, precision):
    rig = make_rig(precision=precision, dim=384, n=20000, slots=8, device="cuda", idle_s=5.0)
    # Compiled (the graph captured) before the namespaces are known, as in a sidecar: what a
    # launch argument held then must not decide how named requests are served later.
    rig.server.set_namespaces({})
    rig.server.warm()
    rig.server.set_namespaces({b"a": 0, b"b": 1})
    rig.serve()
    assert rig.server.running()
    answered, handed_k = 0, []
    for i in range(200):
        slot = i % 8
        k = int(rng.integers(1, 17))
        query = rng.standard_normal(rig.engine.dim).astype(np.float32)
        ns = [None, b"a", b"b"][i % 3]
        flags, window = ALL if ns is None else 0, {}
        eligible = rig.live & (True if ns is None else rig.namespaces == (0 if ns == b"a" else 1))
        if i % 4 == 3:  # a window of its own (every fourth: in a namespace or in all)
            since, until = np.sort(rng.choice(rig.created, 2, replace=False))
            flags, window = flags | SINCE | UNTIL, dict(since=since, until=until)
            eligible &= (rig.created >= since) & (rig.created < until)
        seq = rig.submit(slot, query, k, flags=flags, namespace=ns or b"", **window)
        view = rig.views[slot]
        while int(view.resp_seq[0]) != seq and int(rig.server.handed[slot]) != seq:
            assert rig.server.running(), "the kernel exited while a request was pending"
        assert rig.server.running()  # (the sweep's look after each: it reads the rounds' reports)
        if int(view.resp_seq[0]) == seq:
            answered += 1
            assert_topk_matches(view.ids[:1, :k], view.scores[:1, :k], rig.ids, rig.vectors, query[None], k,
                                eligible, context=f"request {i} namespace {ns} window {window}")
        else:
            handed_k.append(k)
    if precision == "exact":
        # Rounds start at the smaller k bucket: the first request past it goes to the host, and
        # the look after it queues the larger (one more may meet the old round if the report
        # reached the host after the hand-over).
        assert all(k > SMALL_K for k in handed_k) and len(handed_k) <= 2, handed_k
    assert answered >= (200 - len(handed_k) if precision == "exact" else 150)
    rig.server.stop()
    assert not rig.server.running() and rig.server.served == answered


@cuda
@needs_cuda
@pytest.mark.parametrize("precision, slots", [("exact", 40), ("fast", 40), ("exact", 128)])
def test_cuda_batch_rounds_of_every_size_answer_a_crowd(make_rig, rng, precision, slots):
    # Every round captured at warm() (the single one, the score-writing scans, the GEMM ones),
    # then crowds of several sizes, each served by its own round's graph, smaller after larger:
    # a buffer that one round's capture outgrew and another's graph still used would fault.
    # 40 slots: waiting kernels of 2 warps; 128: of 4 (their warps agree on every value read).
    # Each size's second crowd asks in namespaces "a", "b" and all, mixed; its third with
    # windows, each client its own (some open), some of them in a namespace too.
    rig = make_rig(precision=precision, dim=256, n=20000, slots=slots, device="cuda", idle_s=5.0)
    assert rig.server.warps == waiting_warps(rig.server.ns) == (2 if slots == 40 else 4)
    rig.server.warm()
    t = _live_times(rig)
    answered = 0
    for crowd in (40, 2, 17, 5, 33, 1):
        rig.active[:] = False
        rig.active[:crowd] = True
        for turn in range(3):
            k = int(rng.integers(1, 17))
            # (held: each size's own graph, at the k bucket that serves k; both are captured)
            kout = min(b for b in rig.server.kouts if b >= k)
            rig.server.start(rig.active, bucket=rig.server.bucket(crowd), kout=kout)
            assert rig.server.running()
            queries = rng.standard_normal((crowd, rig.engine.dim)).astype(np.float32)
            ends = np.sort(rng.integers(0, len(t), (crowd, 2)), axis=1)
            names = [(), (b"a",), (b"b",)]
            if turn == 0:
                windows = [(None, None)] * crowd
            elif turn == 1:
                windows = [(None, None, *names[s % 3]) for s in range(crowd)]
            else:
                windows = [((None, None) if s % 4 == 0 else (t[a], None) if s % 4 == 1 else (None, t[b])
                            if s % 4 == 2 else (t[a], t[b] + 1.0)) + names[s % 3] for s, (a, b) in enumerate(ends)]
            requests = [_window_request(rig, w) for w in windows]
            seqs = [rig.submit(s, queries[s], k, **requests[s][0]) for s in range(crowd)]
            for s in range(crowd):
                view = rig.views[s]
                while int(view.resp_seq[0]) != seqs[s] and int(rig.server.handed[s]) != seqs[s]:
                    assert rig.server.running(), f"the kernel exited while slot {s}'s request was pending"
                if int(view.resp_seq[0]) == seqs[s]:
                    answered += 1
                    assert_topk_matches(view.ids[:1, :k], view.scores[:1, :k], rig.ids, rig.vectors,
                                        queries[s][None], k, requests[s][1],
                                        context=f"crowd {crowd} slot {s} window {windows[s]}")
                else:
                    assert precision == "fast", f"crowd {crowd}: slot {s} handed over in exact mode"
            rig.server.stop()
    total = 3 * (40 + 2 + 17 + 5 + 33 + 1)
    assert answered >= (total if precision == "exact" else total * 3 // 4)
    assert rig.server.served == answered


@cuda
@needs_cuda
def test_cuda_sidecar_with_gpu_polling_under_clients_adds_and_deletes(rng, runtime_dir, tmp_path):
    from kalos import Client
    from kalos.server.sidecar import Sidecar, SidecarConfig

    d = 256
    config = SidecarConfig(store=tmp_path / "m.db", name="gp", dim=d, slots=8, max_k=32, max_batch=8, gpu_polling="graph")
    sidecar = Sidecar(config, engine_factory=lambda _dev, dim, cap: TorchEngine(dim, device="cuda", capacity=cap))
    assert sidecar._polling.server is not None
    thread = threading.Thread(target=sidecar.serve_forever, daemon=True)
    thread.start()
    failures: list[str] = []
    try:
        with Client("gp", timeout=60) as admin:
            vectors = rng.standard_normal((3000, d)).astype(np.float32)
            ids = admin.add(vectors, namespace="a")
            model = {int(i): v for i, v in zip(ids, vectors)}
            lock = threading.Lock()
            version = [0]  # bumped by every write: a recall that overlapped one is not checked

            def snapshot() -> tuple[int, np.ndarray, np.ndarray]:
                with lock:
                    keys = np.array(sorted(model))
                    return version[0], keys, np.stack([model[i] for i in keys])

            def worker(seed: int) -> None:
                r = np.random.default_rng(seed)
                try:
                    with Client("gp", timeout=60) as client:
                        for _ in range(300):
                            q = r.standard_normal(d).astype(np.float32)
                            k = int(r.choice([1, 5, 8, 16, 32]))
                            ns = "a" if r.random() < 0.2 else None
                            before, keys, vecs = snapshot()
                            got = client.recall(q, k=k, namespace=ns)
                            if version[0] == before:
                                assert_topk_matches(got.ids[None], got.scores[None], keys, vecs, q[None], k,
                                                    padded=False, context=f"k={k} ns={ns}")
                                checked.append(1)
                except Exception as exc:  # noqa: BLE001 - reported below
                    failures.append(repr(exc))

            checked: list[int] = []
            threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
            for t in threads:
                t.start()
            for step in range(20):  # writes while the clients recall
                time.sleep(0.05)
                new = rng.standard_normal((50, d)).astype(np.float32)
                with lock:
                    version[0] += 1
                    for i, v in zip(admin.add(new, namespace="a"), new):
                        model[int(i)] = v
                    gone = rng.choice(sorted(model), 20, replace=False)
                    admin.delete([int(i) for i in gone])
                    for i in gone:
                        del model[int(i)]
                    version[0] += 1
            for t in threads:
                t.join(timeout=600)
            stats = admin.stats()
        assert not failures, failures[:3]
        assert len(checked) > 300
        assert stats["gpu_polled"] > 0 and stats["errors"] == 0
        assert 0 < stats["gpu_rounds"] and stats["gpu_polled"] <= stats["gpu_rounds"] * 64
    finally:
        sidecar.stop()
        thread.join(timeout=30)
