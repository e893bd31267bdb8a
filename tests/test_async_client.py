"""kalos.AsyncClient against real CPU sidecars.

Answers equal the float64 top-k (single, batched past max_batch, filtered, on the spin path and
on the sleep path); 64 concurrent coroutines of one process each get their own answer; the
event loop keeps running while a recall waits on a stopped (SIGSTOP) sidecar; a recall
cancelled in flight leaves the slot usable and its answer is never read by the next one;
SidecarUnavailable when the sidecar is killed or hangs, and recovery once one is back; every
control operation works as the sync Client's does, with the same errors; arguments the async
client does not know are passed through to the sync client. No timing assertions: deadlines
only turn a hang into a failure. Every random test prints its seed (KALOS_TEST_SEED replays it).
"""
from __future__ import annotations

import asyncio
import gc
import inspect
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import numpy as np
import pytest
from conftest import DEADLINE_S, SidecarPool, _seed_value, short_tempdir, unique_name, wait_until
from reference import assert_topk_matches, eligible_mask, model_arrays

import kalos
from kalos import AsyncClient, Client, Recall, RecallBatch
from kalos.errors import DimensionMismatch, InvalidArgument, InvalidQuery, SidecarUnavailable

DIM = 16
MAX_BATCH = 8  # small, so that recall_many splits into several round trips


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    """Runs ``scenario()`` in a fresh event loop; fails on a hang and on anything the loop
    reports (a callback that raised, a task whose exception was never retrieved, ...)."""
    reported: list[dict[str, Any]] = []

    async def main() -> Any:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        result = await asyncio.wait_for(scenario(), DEADLINE_S)
        gc.collect()  # lost task exceptions are reported when the task is collected
        await asyncio.sleep(0)
        return result

    result = asyncio.run(main())
    assert not reported, f"the event loop reported: {reported}"
    return result


class Model:
    """What the sidecar holds, in float64, for the reference."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[np.ndarray, str, float]] = {}

    def record(self, ids: np.ndarray, vectors: np.ndarray, namespace: str, created_at: np.ndarray) -> None:
        for j, i in enumerate(ids.tolist()):
            self.rows[i] = (vectors[j].astype(np.float64), namespace, float(created_at[j]))

    def check(self, got: Recall | RecallBatch, queries: np.ndarray, k: int, *, namespace: str | None = "default",
              since: float | None = None, until: float | None = None, context: str = "") -> None:
        ids, vectors, namespaces, created = model_arrays(self.rows)
        eligible = eligible_mask(namespaces, created, namespace=namespace, since=since, until=until)
        if isinstance(got, Recall):
            assert_topk_matches(got.ids[None], got.scores[None], ids, vectors, queries, k, eligible, padded=False,
                                context=context)
        else:
            assert_topk_matches(got.ids, got.scores, ids, vectors, queries, k, eligible, context=context)


class Served:
    def __init__(self, name: str, pool: SidecarPool, store: Path, rng: np.random.Generator) -> None:
        self.name, self.pool, self.store, self.rng = name, pool, store, rng
        self.model = Model()
        self.proc = pool.start(store, name=name, dim=DIM, extra_args=["--max-batch", str(MAX_BATCH)])

    def fill(self) -> None:
        with Client(self.name, timeout=10.0) as client:
            for namespace, n in (("default", 1200), ("alpha", 300), ("beta", 5)):
                vectors = self.rng.standard_normal((n, DIM)).astype(np.float32)
                created = self.rng.uniform(1_000, 1_200, size=n)
                ids = client.add(vectors, namespace=namespace, created_at=created)
                self.model.record(ids, vectors, namespace, created)

    def queries(self, n: int) -> np.ndarray:
        return self.rng.standard_normal((n, DIM)).astype(np.float32)

    @property
    def pid(self) -> int:
        return self.proc.pid


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """One filled sidecar for the tests that only recall (each leaves it running)."""
    seed = _seed_value()
    print(f"module sidecar data seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    runtime, store_dir = short_tempdir("k"), short_tempdir("ks")
    pool = SidecarPool()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KALOS_RUNTIME_DIR", runtime)
        try:
            s = Served(unique_name("aio"), pool, Path(store_dir) / "m.db", np.random.default_rng(seed))
            s.fill()
            yield s
        finally:
            pool.cleanup()
            shutil.rmtree(runtime, ignore_errors=True)
            shutil.rmtree(store_dir, ignore_errors=True)


@pytest.fixture
def fresh(sidecars: SidecarPool, store_dir: Path, rng: np.random.Generator) -> Served:
    """A sidecar of this test's own (to kill, stop, or write to)."""
    s = Served(unique_name("aio"), sidecars, store_dir / "m.db", rng)
    s.fill()
    return s


def stopped(pid: int) -> "_Stopped":
    return _Stopped(pid)


class _Stopped:
    """SIGSTOPs a sidecar for a ``with`` block; SIGCONT on the way out, whatever happens."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> "_Stopped":
        os.kill(self.pid, signal.SIGSTOP)
        # Stopped for sure before the block runs (the signal takes effect when it is scheduled).
        wait_until(lambda: Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt",
                   "the sidecar to stop", interval=0.001)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


async def eventually(predicate: Callable[[], Any], what: str) -> None:
    """Polls ``predicate`` while the loop runs; fails after DEADLINE_S (a hang guard)."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def until_sleeping(client: AsyncClient, task: asyncio.Task) -> None:
    """Lets the loop run until ``task``'s recall sleeps on its doorbell (the sidecar is stopped,
    so it can only get there); fails if the task ends instead."""
    slot = None
    while slot is None or not slot.client_sleeping[0]:
        assert not task.done(), f"the recall ended while the sidecar was stopped: {task!r}"
        await asyncio.sleep(0.001)
        conn = client._recaller._conn if client._recaller is not None else None
        slot = conn.channel.slot if conn is not None else None


# -- exact answers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_spin_us", [0.0, 50.0, 5000.0], ids=["sleep-path", "short-spin", "long-spin"])
def test_recalls_equal_the_float64_reference(served: Served, max_spin_us: float) -> None:
    cases = [("default", 1, None, None), ("default", 10, None, None), ("alpha", 37, None, None),
             (None, 64, None, None), ("beta", 20, None, None), ("default", 25, 1_050.0, 1_120.0),
             (None, 9, 1_150.0, None)]

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=10.0, max_spin_us=max_spin_us) as client:
            assert client.dim == DIM
            await client.ping()
            for namespace, k, since, until in cases:
                where = f"ns={namespace} k={k} since={since} until={until} spin={max_spin_us}"
                for q in served.queries(3):
                    hit = await client.recall(q, k=k, namespace=namespace, since=since, until=until)
                    assert isinstance(hit, Recall)
                    served.model.check(hit, q, k, namespace=namespace, since=since, until=until, context=where)
                queries = served.queries(MAX_BATCH * 3 + 2)  # four round trips through the slot
                batch = await client.recall_many(queries, k=k, namespace=namespace, since=since, until=until)
                assert isinstance(batch, RecallBatch) and batch.ids.shape == (len(queries), k)
                served.model.check(batch, queries, k, namespace=namespace, since=since, until=until,
                                   context=f"batch {where}")
            # The sync client answers the same.
            q = served.queries(1)[0]
            with Client(served.name, timeout=10.0) as sync:
                want = sync.recall(q, k=12, namespace=None)
            got = await client.recall(q, k=12, namespace=None)
            assert got.ids.tolist() == want.ids.tolist()
            np.testing.assert_array_equal(got.scores, want.scores)

    run(scenario)


def test_bad_input_raises_what_the_sync_client_raises(served: Served) -> None:
    q = served.queries(1)[0]
    bad = [
        (dict(vector=q, k=0), InvalidQuery), (dict(vector=q, k=10**6), InvalidQuery),
        (dict(vector=q, k=True), InvalidQuery), (dict(vector=q[:5]), DimensionMismatch),
        (dict(vector=np.stack([q, q])), InvalidQuery), (dict(vector=["a"] * DIM), InvalidQuery),
        (dict(vector=q, namespace=""), InvalidQuery), (dict(vector=q, namespace=3), InvalidQuery),
        (dict(vector=q, since=5.0, until=4.0), InvalidQuery), (dict(vector=q, since=float("nan")), InvalidQuery),
        (dict(vector=np.zeros(DIM, np.float32)), InvalidQuery),  # refused by the sidecar, through the slot
    ]

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=10.0) as client:
            with Client(served.name, timeout=10.0) as sync:
                for kwargs, error in bad:
                    with pytest.raises(error) as want:
                        sync.recall(**kwargs)
                    with pytest.raises(error) as got:
                        await client.recall(**kwargs)
                    assert str(got.value) == str(want.value), kwargs
                with pytest.raises(InvalidQuery):
                    await client.recall_many(np.empty((0, DIM), np.float32))
            # After every refusal the slot still answers right.
            hit = await client.recall(q, k=5)
            served.model.check(hit, q, 5, context="after bad input")

    run(scenario)
    with pytest.raises(InvalidArgument):
        AsyncClient(served.name, max_spin_us=-1)
    with pytest.raises(InvalidArgument):  # the sync client's own check, on connecting
        run(lambda: AsyncClient(served.name, timeout=0).connect())


def test_the_spin_shortens_after_missed_answers_and_a_probe_brings_it_back() -> None:
    """The spin rule by itself: the whole budget while it catches the answers; SHORT_SPIN_US after
    _MISSES_TO_SHORTEN whole spins in a row missed theirs (fewer do not), with every
    _PROBE_EVERY-th wait spinning the whole again; a caught probe brings the whole spin back, a
    missed one does not; never more than the budget, none at 0; while a long spin would hold
    other callers (recalls queued behind the request: in its own queue for a vector recall
    request, in any queue for another call; callers the last answer woke that have not run),
    the short spin, and misses do not count; the request's own callers, one or several, do not."""
    from kalos.client.aio import _MISSES_TO_SHORTEN, _PROBE_EVERY, _SENDING, SHORT_SPIN_US, _Group, _Queue

    whole, short = 250e-6, SHORT_SPIN_US / 1e6
    client = AsyncClient("unused")
    assert client._spin_for(whole) == whole
    for _ in range(_MISSES_TO_SHORTEN - 1):
        client._note_spin(caught=False)
    client._note_spin(caught=True)  # a catch in between: the count starts again
    for _ in range(_MISSES_TO_SHORTEN - 1):
        client._note_spin(caught=False)
    assert client._spin_for(whole) == whole, "fewer misses in a row than the rule's do not shorten it"
    client._note_spin(caught=False)
    plan = [client._spin_for(whole) for _ in range(2 * _PROBE_EVERY)]
    assert plan.count(whole) == 2 and plan.count(short) == 2 * _PROBE_EVERY - 2, plan
    assert plan[_PROBE_EVERY - 1] == whole, "the probe is every _PROBE_EVERY-th short wait"
    client._note_spin(caught=False)  # a missed probe: still short
    assert client._spin_for(whole) == short
    client._note_spin(caught=True)  # a caught probe
    assert client._spin_for(whole) == whole
    assert client._spin_for(20e-6) == 20e-6 and client._spin_for(0.0) == 0.0
    vectors = client._queues.setdefault("vector", _Queue())
    texts = client._queues.setdefault("text", _Queue())
    group = _Group(("vector", 8, "default", None, None, None), [])
    for sending, queued, woken, others_wait in (
        (vectors, vectors, False, True),  # a caller queued behind the request
        (vectors, texts, False, False),  # a text recall queued waits for its embedding, not this
        (texts, vectors, False, True),  # a text batch holds the slot that a vector recall waits for
        (None, texts, False, True),  # a call that is no queue's (recall_many): every queue waits
        (vectors, None, True, True),  # callers the last answer woke that have not run since
        (vectors, None, False, False),  # the request's callers alone, however many
    ):
        if queued is not None:
            queued.groups["key"] = group
        vectors.answered_together = woken
        token = _SENDING.set(sending)
        try:
            assert client._others_wait() is others_wait, (sending, queued)
            assert client._spin_for(whole) == (short if others_wait else whole), (sending, queued)
            for _ in range(2 * _MISSES_TO_SHORTEN):
                client._note_spin(caught=False)
            if not others_wait:
                client._note_spin(caught=True)  # (what the misses above did, undone)
        finally:
            _SENDING.reset(token)
            vectors.groups.clear()
            texts.groups.clear()
            vectors.answered_together = False
        assert client._spin_for(whole) == whole, f"misses while others waited counted: {sending} {queued}"


def test_recalls_wait_by_the_spin_rule_and_several_callers_spin_by_it_too(served: Served, rng) -> None:
    """On real recalls: a wait that finds no answer yet spins by the rule, with the whole spin
    the smaller of the channel's budget and max_spin_us, and reports what that whole spin did:
    caught (an answer within a long spin) or missed (the sidecar stopped); a ping teaches the
    rule nothing; a request with several callers in it spins by the rule as a lone one does
    (nobody queues behind it); a recall_many of several requests lets the loop run between them."""
    q = rng.standard_normal(DIM).astype(np.float32)
    queries = rng.standard_normal((8, DIM)).astype(np.float32)
    asked: list[tuple[float, float]] = []  # (whole budget, the spin planned)
    asked_in: list[int] = []  # each of those waits': the callers in its request (0: no queue's)
    noted: list[bool] = []
    requests: list[tuple[int, bool]] = []  # (callers in it, whether a long spin would hold others)

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=10.0, max_spin_us=200_000.0) as recaller:
            channel = (await recaller._slot_connection()).channel
            plan, note, answers = recaller._spin_for, recaller._note_spin, recaller._answers

            def planned(whole_s: float) -> float:
                asked.append((whole_s, plan(whole_s)))
                asked_in.append(callers[0])
                return asked[-1][1]

            def noting(*, caught: bool) -> None:
                noted.append(caught)
                note(caught=caught)

            callers = [0]

            async def counted(batch: list[Any], args: tuple[Any, ...]) -> list[Any]:
                requests.append((len(batch), recaller._others_wait()))
                callers[0] = len(batch)
                try:
                    return await answers(batch, args)
                finally:
                    callers[0] = 0

            recaller._spin_for, recaller._note_spin = planned, noting  # type: ignore[method-assign]
            recaller._answers = counted  # type: ignore[method-assign]
            for budget_s, whole_s in ((0.2, 0.2), (100e-6, 100e-6)):  # (the channel's, the whole spin)
                channel.spin_budget_s = lambda: budget_s  # type: ignore[method-assign]
                asked.clear()
                noted.clear()
                for _ in range(200):  # (an answer already in at the first look asks nothing)
                    served.model.check(await recaller.recall(q, k=3), q, 3, context="lone")
                    if asked:
                        break
                assert asked and all(whole == whole_s for whole, _ in asked), (budget_s, asked)
                if budget_s == 0.2:
                    assert noted and all(noted), f"answers within a 0.2 s spin noted as missed: {noted}"

            async def recall_across_a_stop(context: str) -> None:
                """A recall whose answer outlasts its spin: the sidecar is stopped until it sleeps."""
                with stopped(served.pid):
                    late = asyncio.ensure_future(recaller.recall(q, k=3))
                    await until_sleeping(recaller, late)
                served.model.check(await late, q, 3, context=context)

            channel.spin_budget_s = lambda: 0.002  # type: ignore[method-assign]
            recaller._spin_short, recaller._spin_misses = False, 0
            noted.clear()
            await recall_across_a_stop("a whole spin missed")
            assert noted == [False], f"a whole spin the answer outlasted: {noted}"
            recaller._spin_short, recaller._short_waits = True, 0
            noted.clear()
            await recall_across_a_stop("a short spin missed")
            assert noted == [] and recaller._spin_short, f"a short spin taught the rule: {noted}"
            await recaller.ping()
            assert noted == [], "a ping taught the rule"

            several = len(queries) - 1
            for _ in range(20):  # (until the several callers' answer is not in at its first look)
                requests.clear()
                asked.clear()
                asked_in.clear()
                recaller._spin_short, recaller._spin_misses = False, 0
                with stopped(served.pid):  # the first request waits in the slot while the rest queue
                    first = asyncio.ensure_future(recaller.recall(queries[0], k=3))
                    await until_sleeping(recaller, first)
                    rest = [asyncio.ensure_future(recaller.recall(row, k=3)) for row in queries[1:]]
                    await asyncio.sleep(0.01)
                hits = await asyncio.gather(first, *rest)
                for row, hit in zip(queries, hits):
                    served.model.check(hit, row, 3, context="several callers")
                assert requests == [(1, False), (several, False)], requests
                if several in asked_in:
                    break
            # Each wait planned the whole spin: the lone first (its one miss, across the stop,
            # shortens nothing) and the several callers' request after it, which nobody queues behind.
            assert several in asked_in, f"the several callers' answer was always in at the first look: {asked_in}"
            assert all(planned == whole == 0.002 for whole, planned in asked), list(zip(asked_in, asked))

            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            seen: list[int] = []  # the ticks at each request

            async def at_once(conn: Any, rows: np.ndarray, request: Any, op: Any = None) -> None:
                seen.append(ticks)  # (answered at once, as a spin that catches its answer: no suspension)

            beat = asyncio.get_running_loop().create_task(ticker())
            await asyncio.sleep(0)
            recaller._round_trip = at_once  # type: ignore[method-assign]
            many = rng.standard_normal((3 * recaller._layout.max_batch, DIM)).astype(np.float32)
            await recaller.recall_many(many, k=3)
            beat.cancel()
            assert len(seen) == 3 and seen[0] < seen[1] < seen[2], f"the loop did not run between requests: {seen}"

    run(scenario)


def test_sixty_four_concurrent_coroutines_each_get_their_own_answer(served: Served) -> None:
    jobs = []
    for i in range(64):
        namespace = ("default", "alpha", None, "beta")[i % 4]
        jobs.append((i, namespace, 1 + (i * 7) % 40, "many" if i % 5 == 0 else "one"))
    queries = {i: served.queries(MAX_BATCH + 3 if kind == "many" else 1) for i, _, _, kind in jobs}

    async def one(client: AsyncClient, i: int, namespace: str | None, k: int, kind: str) -> tuple[int, Any]:
        await asyncio.sleep(0)  # all start before any finishes
        for _ in range(3):  # several rounds each, so that the queue on the slot stays long
            if kind == "many":
                got = await client.recall_many(queries[i], k=k, namespace=namespace)
            else:
                got = await client.recall(queries[i][0], k=k, namespace=namespace)
            served.model.check(got, queries[i] if kind == "many" else queries[i][0], k, namespace=namespace,
                               context=f"coroutine {i} ns={namespace} k={k}")
            await client.ping()
        return i, got

    async def scenario() -> None:
        for max_spin_us in (0.0, 50.0):
            async with AsyncClient(served.name, timeout=10.0, max_spin_us=max_spin_us) as client:
                results = await asyncio.gather(*(one(client, *job) for job in jobs))
                assert sorted(i for i, _ in results) == list(range(64))

    run(scenario)


def counting_requests(client: AsyncClient) -> list[int]:
    """The rows of each request this client's recalls send through its slot, in order."""
    rows: list[int] = []
    recall = client._recall

    async def counted(queries: Any, *args: Any, single: bool, **kwargs: Any) -> Any:
        rows.append(1 if single else len(queries))
        return await recall(queries, *args, single=single, **kwargs)

    client._recall = counted  # type: ignore[method-assign]
    return rows


def test_concurrent_single_recalls_go_to_the_sidecar_together(served: Served) -> None:
    """While the slot is busy, the single recalls of one filter group queue, and each request
    then carries up to max_batch of them; each caller still gets its own answer. Other groups
    (namespace, k) go in requests of their own; a lone recall goes at once."""
    queries = served.queries(21)

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=30.0, max_spin_us=0.0) as client:
            rows = counting_requests(client)
            hit = await client.recall(queries[0], k=5)
            served.model.check(hit, queries[0], 5, context="alone")
            assert rows == [1]
            rows.clear()
            with stopped(served.pid):  # the first request waits in the slot while the rest queue
                first = asyncio.ensure_future(client.recall(queries[0], k=5))
                await until_sleeping(client, first)
                same = [asyncio.ensure_future(client.recall(q, k=5)) for q in queries[1:18]]
                other_ns = [asyncio.ensure_future(client.recall(q, k=5, namespace="alpha")) for q in queries[18:20]]
                other_k = asyncio.ensure_future(client.recall(queries[20], k=9))
                await asyncio.sleep(0.01)
                assert not any(t.done() for t in [first, *same, *other_ns, other_k])
            served.model.check(await first, queries[0], 5, context="the first")
            for i, task in enumerate(same, 1):
                served.model.check(await task, queries[i], 5, context=f"queued {i}")
            for i, task in enumerate(other_ns, 18):
                served.model.check(await task, queries[i], 5, namespace="alpha", context=f"alpha {i}")
            served.model.check(await other_k, queries[20], 9, context="k=9")
            # The first alone, then the 17 of its group in batches of max_batch, the two of
            # "alpha" together, the k=9 one alone: 6 requests for 21 recalls.
            assert rows[0] == 1 and sorted(rows[1:]) == sorted([MAX_BATCH, MAX_BATCH, 1, 2, 1]), rows

    run(scenario)


def test_callers_answered_together_recall_again_together(served: Served) -> None:
    """Coroutines that recall in a loop (agents of one process): once a request has answered
    them together, the next request carries them all again, not the first woken alone and the
    rest after it."""
    queries = served.queries(8)

    async def agent(client: AsyncClient, i: int) -> None:
        for turn in range(5):
            served.model.check(await client.recall(queries[i], k=4), queries[i], 4, context=f"agent {i} turn {turn}")

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=30.0, max_spin_us=0.0) as client:
            await client.recall(queries[0], k=4)  # (connected before the agents start)
            rows = counting_requests(client)
            with stopped(served.pid):  # the first request waits in the slot while the rest queue
                agents = [asyncio.ensure_future(agent(client, i)) for i in range(len(queries))]
                await until_sleeping(client, agents[0])
            await asyncio.gather(*agents)
            # The first agent goes alone, the seven others queue behind it and the first joins
            # them; from then on all eight go together, the first's last turn done one earlier.
            assert rows == [1, 8, 8, 8, 8, 7], rows

    run(scenario)


def test_a_bad_query_in_a_batch_fails_only_its_own_caller(served: Served) -> None:
    """A query the sidecar refuses (a zero vector) queued with good ones: the batch is sent
    again one recall at a time, the bad one's caller gets the sidecar's error, the others their
    answers."""
    queries = served.queries(6)
    zero = np.zeros(DIM, np.float32)

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=30.0, max_spin_us=0.0) as client:
            with Client(served.name, timeout=10.0) as sync:
                with pytest.raises(InvalidQuery) as want:
                    sync.recall(zero)
            rows = counting_requests(client)
            with stopped(served.pid):
                first = asyncio.ensure_future(client.recall(queries[0]))
                await until_sleeping(client, first)
                tasks = [asyncio.ensure_future(client.recall(q)) for q in queries[1:3]]
                bad = asyncio.ensure_future(client.recall(zero))
                tasks += [asyncio.ensure_future(client.recall(q)) for q in queries[3:]]
                await asyncio.sleep(0.01)
            served.model.check(await first, queries[0], 8, context="the first")
            for i, task in enumerate(tasks, 1):
                served.model.check(await task, queries[i], 8, context=f"beside a bad query {i}")
            with pytest.raises(InvalidQuery) as got:
                await bad
            assert str(got.value) == str(want.value)
            assert rows == [1, 6, 1, 1, 1, 1, 1, 1], rows  # the batch of 6 refused, then each alone

    run(scenario)


def test_a_cancelled_sender_hands_the_queue_over(served: Served) -> None:
    """The coroutine sending the queued recalls is cancelled while its request is in flight,
    and a queued one too: every other caller still gets its answer, the slot stays right."""
    queries = served.queries(12)

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=30.0, max_spin_us=0.0) as client:
            with stopped(served.pid):
                sender = asyncio.ensure_future(client.recall(queries[0], k=3))
                await until_sleeping(client, sender)
                queued = [asyncio.ensure_future(client.recall(q, k=3)) for q in queries[1:]]
                await asyncio.sleep(0.005)
                sender.cancel()
                queued[4].cancel()
                with pytest.raises(asyncio.CancelledError):
                    await sender
                with pytest.raises(asyncio.CancelledError):
                    await queued[4]
            for i, task in enumerate(queued, 1):
                if i != 5:
                    served.model.check(await task, queries[i], 3, context=f"queued {i}")
            hit = await client.recall(queries[0], k=4)
            served.model.check(hit, queries[0], 4, context="after the hand-over")
            assert all(queue.idle for queue in client._queues.values())

    run(scenario)


def test_a_batch_that_fails_unexpectedly_fails_every_caller_in_it(served: Served) -> None:
    """Whatever a batch's request raises (here an OSError injected into the slot's round trip),
    every caller in the batch hears of it: none is left waiting, and the client goes on."""
    queries = served.queries(6)

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=30.0, max_spin_us=0.0) as client:
            round_trip = client._round_trip

            async def broken(conn: Any, rows: np.ndarray, *args: Any, **kwargs: Any) -> Any:
                if len(rows) > 1:
                    raise BrokenPipeError("injected")
                return await round_trip(conn, rows, *args, **kwargs)

            client._round_trip = broken  # type: ignore[method-assign]
            with stopped(served.pid):
                first = asyncio.ensure_future(client.recall(queries[0]))
                await until_sleeping(client, first)
                rest = [asyncio.ensure_future(client.recall(q)) for q in queries[1:]]
                await asyncio.sleep(0.01)
            served.model.check(await first, queries[0], 8, context="the first, alone")
            results = await asyncio.gather(*rest, return_exceptions=True)
            assert all(isinstance(r, BrokenPipeError) for r in results), results
            client._round_trip = round_trip  # type: ignore[method-assign]
            served.model.check(await client.recall(queries[1]), queries[1], 8, context="afterwards")
            assert all(queue.idle for queue in client._queues.values())

    run(scenario)


def test_a_text_batch_embedding_in_a_thread_holds_back_no_recall_by_vector(served: Served) -> None:
    """Concurrent recall_text calls with an embedder of the client's own embed in a worker
    thread, off the slot: recalls by vector meanwhile are sent and answered (each kind has its
    queue), and the texts' answers come once the embedding is done."""
    import threading

    from kalos.client.embed import CallableEmbedder

    gate = threading.Event()
    rng = np.random.default_rng(7)

    def slow(texts: list[str]) -> np.ndarray:  # waits for the test, then embeds at random
        assert gate.wait(DEADLINE_S)
        return rng.standard_normal((len(texts), DIM)).astype(np.float32)

    q = served.queries(1)[0]

    async def scenario() -> None:
        embedder = CallableEmbedder(slow, dim=DIM)
        async with AsyncClient(served.name, timeout=30.0, embedder=embedder) as client:
            texts = [asyncio.ensure_future(client.recall_text(f"question {i}", k=3)) for i in range(4)]
            for _ in range(5):
                await asyncio.sleep(0.01)
            served.model.check(await client.recall(q, k=5), q, 5, context="beside an embedding text batch")
            assert not any(t.done() for t in texts)
            gate.set()
            for hits in await asyncio.gather(*texts):
                assert len(hits) == 3

    run(scenario)


def test_one_client_serves_several_event_loops_in_turn(served: Served) -> None:
    client = AsyncClient(served.name, timeout=10.0)
    q = served.queries(1)[0]
    try:
        for round_ in range(3):  # a second asyncio.run must not find the first loop's lock
            hit = run(lambda: client.recall(q, k=4))
            served.model.check(hit, q, 4, context=f"loop {round_}")
    finally:
        run(client.aclose)


# -- the event loop while recalls wait -----------------------------------------------------------------


def test_the_event_loop_keeps_running_while_a_recall_waits(served: Served) -> None:
    q = served.queries(1)[0]

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=30.0) as client:
            await client.ping()
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.002)
                    ticks += 1

            ticking = asyncio.ensure_future(ticker())
            with stopped(served.pid):  # no answer can come while it is stopped
                task = asyncio.ensure_future(client.recall(q, k=6))
                await until_sleeping(client, task)
                seen = ticks
                while ticks < seen + 20:  # the ticker goes on while the recall waits
                    assert not task.done()
                    await asyncio.sleep(0.001)
                # A second recall queues behind the first one without blocking the loop either.
                second = asyncio.ensure_future(client.recall(q, k=3))
                seen = ticks
                while ticks < seen + 5:
                    await asyncio.sleep(0.001)
                assert not task.done() and not second.done()
            hit, hit2 = await task, await second
            ticking.cancel()
            served.model.check(hit, q, 6, context="after the stop")
            served.model.check(hit2, q, 3, context="queued behind it")

    run(scenario)


# -- cancellation ------------------------------------------------------------------------------------


def test_a_recall_cancelled_in_flight_leaves_the_slot_usable(served: Served) -> None:
    qa, qb, qc = served.queries(3)

    async def cancelled_recall(client: AsyncClient, q: np.ndarray, k: int) -> None:
        task = asyncio.ensure_future(client.recall(q, k=k, namespace=None))
        await until_sleeping(client, task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        channel = client._recaller._conn.channel
        loop = asyncio.get_running_loop()
        # Nothing of the cancelled wait stays behind: no reader on the loop, no sleeping flag.
        assert not loop.remove_reader(channel.wake_fd) and not loop.remove_reader(channel.control_fd)
        assert channel.slot.client_sleeping[0] == 0

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=30.0) as client:
            # Cancelled while the sidecar is stopped; the next recall comes after it answered.
            with stopped(served.pid):
                await cancelled_recall(client, qa, 2)
            await asyncio.sleep(0.05)
            hit = await client.recall(qb, k=7)
            served.model.check(hit, qb, 7, context="after a cancelled recall")
            # The next recall comes while the cancelled one is still unanswered.
            with stopped(served.pid):
                await cancelled_recall(client, qa, 2)
                nxt = asyncio.ensure_future(client.recall(qb, k=9, namespace="alpha"))
                for _ in range(10):
                    await asyncio.sleep(0.002)
                assert not nxt.done()
            hit = await nxt
            served.model.check(hit, qb, 9, namespace="alpha", context="submitted behind a cancelled recall")
            # A batch of several round trips, cancelled in its first.
            with stopped(served.pid):
                many = asyncio.ensure_future(client.recall_many(served.queries(MAX_BATCH * 4), k=5))
                await until_sleeping(client, many)
                many.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await many
            batch = await client.recall_many(np.stack([qc] * (MAX_BATCH + 1)), k=11, namespace=None)
            served.model.check(batch, np.stack([qc] * (MAX_BATCH + 1)), 11, namespace=None,
                               context="after a cancelled batch")

    run(scenario)


def test_recalls_cancelled_at_random_points_never_disturb_the_others(served: Served) -> None:
    rng = served.rng

    async def scenario() -> None:
        async with AsyncClient(served.name, timeout=10.0, max_spin_us=0.0) as client:
            for round_ in range(150):
                victims = [asyncio.ensure_future(client.recall(q, k=int(rng.integers(1, 30)), namespace=None))
                           for q in served.queries(int(rng.integers(1, 4)))]
                checked_q = served.queries(1)[0]
                k = int(rng.integers(1, 30))
                checked = asyncio.ensure_future(client.recall(checked_q, k=k))
                for _ in range(int(rng.integers(0, 4))):
                    await asyncio.sleep(0)
                if rng.random() < 0.3:
                    await asyncio.sleep(float(rng.uniform(0, 0.002)))
                for victim in victims:
                    victim.cancel()
                hit = await checked
                served.model.check(hit, checked_q, k, context=f"round {round_}")
                for victim in victims:  # each one either finished (right) or was cancelled
                    if not victim.cancelled():
                        victim.result()

    run(scenario)


# -- a sidecar that dies or hangs ------------------------------------------------------------------------


def test_a_killed_sidecar_raises_sidecar_unavailable_and_a_new_one_is_found(fresh: Served) -> None:
    q = fresh.queries(1)[0]

    async def scenario() -> None:
        async with AsyncClient(fresh.name, timeout=2.0) as client:
            served_before = await client.recall(q, k=5)
            fresh.model.check(served_before, q, 5, context="before the kill")
            # Killed while a recall waits for it.
            with stopped(fresh.pid):
                task = asyncio.ensure_future(client.recall(q, k=5))
                await until_sleeping(client, task)
                fresh.proc.kill()
            with pytest.raises(SidecarUnavailable):
                await task
            # None running: every call says so, recalls and control operations alike.
            for call in (lambda: client.recall(q), lambda: client.ping(), lambda: client.stats()):
                with pytest.raises(SidecarUnavailable):
                    await call()
            # A new sidecar on the same store: the client finds it by itself.
            fresh.proc = fresh.pool.start(fresh.store, name=fresh.name, extra_args=["--max-batch", str(MAX_BATCH)])
            hit = await client.recall(q, k=5)
            fresh.model.check(hit, q, 5, context="after the restart")
            assert (await client.stats())["count"] == len(fresh.model.rows)

    run(scenario)


def test_a_hung_sidecar_raises_sidecar_unavailable_then_serves_again(fresh: Served) -> None:
    q = fresh.queries(1)[0]

    async def scenario() -> None:
        async with AsyncClient(fresh.name, timeout=0.5) as client:
            await client.ping()
            await client.stats()
            with stopped(fresh.pid):  # longer than the timeout: its heartbeat goes stale
                with pytest.raises(SidecarUnavailable, match="heartbeat"):
                    await client.recall(q, k=3)
                with pytest.raises(SidecarUnavailable):  # a control operation too (in its thread)
                    await client.stats()
            hit = await client.recall(q, k=3)
            fresh.model.check(hit, q, 3, context="after the hang")
            assert (await client.stats())["count"] == len(fresh.model.rows)

    run(scenario)


# -- control operations ------------------------------------------------------------------------------------


def _embed(texts: list[str]) -> np.ndarray:
    """A deterministic stand-in embedder: a vector seeded by each text."""
    return np.stack([np.random.default_rng(abs(hash(t)) % (1 << 32)).standard_normal(DIM) for t in texts]).astype(np.float32)


def test_every_control_operation_works_as_the_sync_clients(fresh: Served) -> None:
    rng = fresh.rng

    async def scenario() -> None:
        async with AsyncClient(fresh.name, timeout=10.0, embedder=_embed) as client, \
                AsyncClient(fresh.name, timeout=10.0) as plain:
            sync = Client(fresh.name, timeout=10.0, embedder=_embed)
            try:
                vectors = rng.standard_normal((20, DIM)).astype(np.float32)
                texts = [f"memory {i}" for i in range(20)]
                metadata = [{"i": i} for i in range(20)]
                created = np.full(20, 1_100.0)
                ids = await client.add(vectors, texts, metadata=metadata, namespace="gamma",
                                       created_at=created.tolist(), request_id="req-async-1")
                fresh.model.record(ids, vectors, "gamma", created)
                assert ids.dtype == np.int64 and len(ids) == 20
                # The same request id stores nothing twice (the sync client's retry contract).
                again = await client.add(vectors, texts, metadata=metadata, namespace="gamma",
                                         created_at=created.tolist(), request_id="req-async-1")
                assert again.tolist() == ids.tolist()
                hit = await client.recall(vectors[3], k=4, namespace="gamma")
                assert int(hit.ids[0]) == int(ids[3])
                fresh.model.check(hit, vectors[3], 4, namespace="gamma", context="after add")

                wanted = [int(ids[0]), 10**12, int(ids[5]), int(ids[0])]
                got = await client.get(wanted)
                assert got == sync.get(wanted)
                assert got[1] is None and got[0] == got[3]
                assert got[0].text == "memory 0" and got[2].metadata == {"i": 5} and got[2].namespace == "gamma"

                stats = await client.stats()
                assert stats["count"] == len(fresh.model.rows) == sync.stats()["count"]
                assert stats["namespaces"]["gamma"] == 20

                assert await client.delete(ids[:5].tolist() + [10**12]) == 5
                for i in ids[:5].tolist():
                    fresh.model.rows.pop(i)
                assert await client.delete(ids[:5]) == 0
                assert (await client.get(ids[:1]))[0] is None
                assert isinstance(await client.compact(), int)
                hit = await client.recall(vectors[7], k=20, namespace="gamma")
                fresh.model.check(hit, vectors[7], 20, namespace="gamma", context="after delete and compact")

                # Text memories: embedding in a worker thread, recall through the slot.
                notes = ["window seats", "vegetarian meals", "late check-out"]
                note_ids = await client.remember(notes, namespace="notes", metadata=[{"n": i} for i in range(3)])
                for i, note in enumerate(notes):
                    hits = await client.recall_text(note, k=2, namespace="notes")
                    assert hits == sync.recall_text(note, k=2, namespace="notes")
                    assert hits[0].id == int(note_ids[i]) and hits[0].text == note and hits[0].metadata == {"n": i}
                both = await client.recall_texts(notes[:2], k=1, namespace="notes")
                assert [h[0].id for h in both] == note_ids[:2].tolist()
                assert await client.recall_texts([]) == []
                assert (await client.embedder()).dim == DIM

                # Errors are the sync client's, message for message.
                count = (await plain.stats())["count"]
                failing = [
                    ("add", (vectors[:, :5],), {}), ("add", (vectors,), {"texts": ["one"]}),
                    ("add", (vectors,), {"metadata": [{1: object()}] * 20}), ("add", (vectors,), {"namespace": ""}),
                    ("add", (vectors,), {"request_id": 5}), ("get", ([1.5],), {}), ("delete", ([[1, 2]],), {}),
                    ("add", (vectors,), {"no_such_argument": 1}), ("stats", (), {"no_such_argument": 1}),
                    ("recall_text", (["a", "b"],), {}), ("recall_texts", ("a",), {}),
                    ("recall_texts", (["a"],), {"k": 0}), ("remember", ([],), {}),
                ]
                for method, args, kwargs in failing:
                    with pytest.raises(Exception) as want:
                        getattr(sync, method)(*args, **kwargs)
                    with pytest.raises(type(want.value)) as got_exc:
                        await getattr(client, method)(*args, **kwargs)
                    assert str(got_exc.value) == str(want.value), (method, kwargs)
                with pytest.raises(DimensionMismatch):
                    await plain.add(vectors[:, :5])
                assert (await plain.stats())["count"] == count  # nothing half-added
            finally:
                sync.close()

    run(scenario)


def test_the_whole_client_api_is_there_as_coroutines(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    public = [n for n, f in inspect.getmembers(Client, inspect.isfunction) if not n.startswith("_")]
    properties = [n for n, p in inspect.getmembers(Client, lambda m: isinstance(m, property))]
    client = AsyncClient(served.name, timeout=10.0)
    for name in public:
        assert inspect.iscoroutinefunction(getattr(client, name)), name
    for name in properties:
        assert hasattr(AsyncClient, name), name
    assert kalos.AsyncClient is AsyncClient and "AsyncClient" in kalos.__all__
    with pytest.raises(AttributeError):
        client.no_such_method  # noqa: B018

    # A method added to Client later is a coroutine here at once (in a worker thread)...
    def count_plus(self: Client, n: int, *, times: int = 1) -> int:
        return self.stats()["count"] * times + n

    monkeypatch.setattr(Client, "count_plus", count_plus, raising=False)
    # ...and so is a keyword argument added to a recall: passed to the sync client as it is.
    sync_recall = Client.recall

    def recall_with_tag(self: Client, *args: Any, tag: str | None = None, **kwargs: Any) -> Any:
        return tag, sync_recall(self, *args, **kwargs)

    monkeypatch.setattr(Client, "recall", recall_with_tag)
    q = served.queries(1)[0]

    async def scenario() -> None:
        async with client:
            assert await client.count_plus(3, times=2) == 2 * len(served.model.rows) + 3
            tag, hit = await client.recall(q, k=5, tag="passed")
            assert tag == "passed"
            served.model.check(hit, q, 5, context="passed through")
            native = await client.recall(q, k=5)  # without it: the native path (not the patched method)
            assert isinstance(native, Recall) and native.ids.tolist() == hit.ids.tolist()

    run(scenario)


def test_aclose_frees_the_slots_and_a_closed_client_reconnects(served: Served) -> None:
    q = served.queries(1)[0]

    async def scenario() -> None:
        with Client(served.name, timeout=10.0) as observer:
            base = observer.stats()["clients"]
            client = AsyncClient(served.name, timeout=10.0)
            assert "disconnected" in repr(client)
            with pytest.raises(Exception, match="not connected"):
                client.dim  # noqa: B018
            async with client:
                await client.recall(q)
                assert observer.stats()["clients"] == base + 1  # recall slot only, until a control op
                await client.stats()
                assert observer.stats()["clients"] == base + 2
                assert "connected" in repr(client)
            await eventually(lambda: observer.stats()["clients"] == base, "both slots to be freed")
            hit = await client.recall(q, k=3)  # used again: connects again
            served.model.check(hit, q, 3, context="after aclose")
            await client.close()
            await eventually(lambda: observer.stats()["clients"] == base, "the slot to be freed again")

            # A connect cancelled while its worker thread opens the connection: the next call
            # takes that connection (one slot, not two), and aclose frees it.
            for then_close in (False, True):
                other = AsyncClient(served.name, timeout=10.0)
                connecting = asyncio.ensure_future(other.connect())
                await asyncio.sleep(0)  # the thread has started
                connecting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await connecting
                if not then_close:
                    hit = await other.recall(q, k=3)
                    served.model.check(hit, q, 3, context="after a cancelled connect")
                    assert observer.stats()["clients"] == base + 1
                await other.aclose()
                await eventually(lambda: observer.stats()["clients"] == base, "the cancelled connect's slot to go")

    run(scenario)
