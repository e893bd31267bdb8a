"""The asyncio client: :class:`AsyncClient`, the whole :class:`~kalos.client.client.Client` API as coroutines.

Recalls (``recall``, ``recall_many``, ``recall_text``, ``recall_texts``, ``ping``) are native
(but a ``recall_text`` the sidecar embeds: its one control round trip waits in a worker thread):
the request is written into the slot and submitted exactly as the sync client does (its own
validation and request building, :meth:`Client._write_request`), then the answer is waited
for without blocking the event loop for long: a bounded spin on ``resp_seq`` (an answer that
comes within it is read with no system call and no trip through the loop; the spin holds every
other coroutine of the loop, so it is long only while it catches this client's answers and no
other caller of this client is held by it: :data:`DEFAULT_MAX_SPIN_US`, :data:`SHORT_SPIN_US`), then the same
Dekker handshake as :meth:`kalos.ipc.channel.ClientChannel._block` (``client_sleeping = 1``, full
fence, re-read ``resp_seq``) and an await on the wake socket through ``loop.add_reader``. The
slot's control socket is watched the same way, so a sidecar that dies wakes the waiter at
once (:class:`SidecarUnavailable`), and the heartbeat is checked every poll slice, so a hung
one is noticed within ``timeout``, as with :class:`Client`.

Control operations (``add``, ``update``, ``delete``, ``get``, ``list``, ``count``, ``drop_namespace``,
``stats``, ``compact``, ``remember``, and any
method added to :class:`Client` later) are not on the hot path: they run the sync client's own
implementation in a worker thread (``asyncio.to_thread``), with the same arguments (forwarded
as they are) and the same errors.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import math
import os
import time
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np

from kalos.client.client import Client, _register_where, _SidecarEmbedder
from kalos.client.connection import Connection
from kalos.client.results import Hit, Page, Recall, RecallBatch, single_hits
from kalos.client.embed import embed_queries
from kalos.client.requests import (
    TimeLike, check_k, check_same_layout, filter_words, recall_request, where_clause, with_where,
)
from kalos.errors import InvalidArgument, KalosError, SidecarUnavailable, UnknownFilter, error_from_code
from kalos.ipc.channel import SidecarExited
from kalos.ipc.protocol import Layout, Op
from kalos.ipc.sync import full_fence
from kalos.validation import Item, check_embed_texts

__all__ = ["AsyncClient", "DEFAULT_MAX_SPIN_US", "SHORT_SPIN_US"]

#: The longest a request busy-polls its slot on the event loop before it sleeps on the wake
#: socket, while that whole spin catches this client's answers (a lone recall's request or
#: several callers' alike: the rule learns from both). Spinning holds the loop (no other
#: coroutine runs meanwhile), so it stays below the sync client's 1 ms (GPU sidecar);
#: sleeping costs the sidecar's bell and a trip through the loop, which a GPU sidecar's single
#: recalls, answered soon after a shorter spin, would pay every time.
DEFAULT_MAX_SPIN_US = 250.0
#: The spin while the whole one does not catch the answers (a CPU sidecar's, whose search takes
#: longer than the spin it advises its clients; a longer spin would hold the loop for nothing),
#: for a request that would hold other callers of the client (:meth:`AsyncClient._others_wait`),
#: and for a ping.
SHORT_SPIN_US = 50.0
#: Whole spins in a row that the answer outlasted before the spin shortens.
_MISSES_TO_SHORTEN = 3
#: While the spin is short, every this many waits spins the whole budget once, so that answers
#: that came quickly again are seen (a short spin cannot tell "quick" from "slow").
_PROBE_EVERY = 16
#: The queue whose single recalls the task is sending (:meth:`AsyncClient._send_next`), None
#: for any other call: which callers a long spin would hold (:meth:`AsyncClient._others_wait`).
_SENDING: "contextvars.ContextVar[_Queue | None]" = contextvars.ContextVar("kalos_sending", default=None)

_T = TypeVar("_T")
_WAKE = "wake"
_CONTROL = "control"
_PING_REQUEST = (1, 0, 0.0, 0.0, b"")


def _short_spin_s(whole_s: float) -> float:
    """The short spin (:data:`SHORT_SPIN_US`), never more than the whole one ``whole_s``, seconds."""
    return min(whole_s, SHORT_SPIN_US / 1e6)


def _resolve(waiter: asyncio.Future, what: str | None) -> None:
    if not waiter.done():
        waiter.set_result(what)


class _Queued(NamedTuple):
    """A single recall waiting for the slot (:meth:`AsyncClient.recall`)."""

    row: np.ndarray  # [1, dim] float32, checked
    future: asyncio.Future


class _Group(NamedTuple):
    """The recalls of one filter group waiting for the slot, and the filter's arguments."""

    args: tuple[Any, ...]  # kind ("vector" or "text"), k, namespace, since, until, where clause
    waiting: list[_Queued]


@dataclasses.dataclass
class _Queue:
    """The groups of one kind of single recall waiting to be sent together, oldest first, and
    whether a coroutine (or the task it handed over to) is sending them."""

    groups: dict[Any, _Group] = dataclasses.field(default_factory=dict)
    sending: bool = False
    sender: asyncio.Task | None = None
    # The last request answered several callers at once: they are ready to run, and likely to
    # recall again at once (a crowd of agents in one process); until the loop has run them, a
    # long spin would hold them (AsyncClient._others_wait).
    answered_together: bool = False

    @property
    def idle(self) -> bool:
        return not self.sending and not self.groups


def _retrieve(task: asyncio.Future) -> None:
    """Marks a background task's exception as retrieved: whoever awaits it sees it; if nobody
    does (its caller was cancelled), asyncio must not log it as lost."""
    if not task.cancelled():
        task.exception()


class AsyncClient:
    """A connection to the sidecar called ``name`` for asyncio code; an async context manager.

    ``async with AsyncClient("default", timeout=1.0) as memory: hits = await memory.recall(q)``.
    Every method of :class:`Client` is a coroutine here, with the same arguments, results and
    errors. ``timeout`` and the other keyword arguments (``spin_us``, ``embedder``, ...) are
    :class:`Client`'s, passed on as they are. ``max_spin_us`` caps the busy-poll on the event
    loop before a recall's request sleeps (:data:`DEFAULT_MAX_SPIN_US`; 0: never spin). It spins
    :data:`SHORT_SPIN_US` at most while a long spin would hold other callers of this client
    (recalls queued behind it, or callers an answer woke that have not run yet), and after a
    few answers in a row outlasted the whole spin (then every 16th of its waits spins the whole
    again, to see quick answers come back). A call of several requests (a ``recall_many`` larger
    than the sidecar's max_batch) lets the loop run between them.

    Constructing one does not connect: ``async with``, :meth:`connect` or the first call does,
    in a worker thread (the hello is a blocking socket exchange).

    **One slot, one request at a time; concurrent single recalls go together.** The recalls of
    every coroutine of the process go through one slot, queued on an :class:`asyncio.Lock`
    (first come, first served). :meth:`recall` calls that arrive while the slot is busy wait
    in a queue by filter group (k, namespace, time window, ``where``), and the next request
    carries every waiting recall of the oldest group (up to the sidecar's max_batch) as one
    batch: the agents of one process cost the sidecar one engine pass, as the crowd of separate
    processes does (issue 18). The first of the callers that one answer woke lets the loop run
    once before it sends, so that the others join its request (coroutines that recall in a loop
    stay together). A lone recall goes at once, without waiting for company; each
    caller gets its own answer, and a batch that fails on one caller's query (a zero vector,
    say) is sent again one recall at a time, so that each caller hears only of its own error.
    A pool of slots was not chosen: slots are a host-wide resource (``KALOS_SLOTS``) shared with
    every other client, and a waiting coroutine costs nothing while it queues.

    **Two connections.** Control operations run in worker threads on a second, sync
    :class:`Client`, opened on the first one: sharing the recall connection with threads would
    need a thread lock on the event loop's hot path. The recall connection's control socket
    carries only what concerns its slot (a where clause's registration, a ``recall_text`` the
    sidecar recalls in the slot), each with the slot lock held, so while a recall waits any
    readiness of that socket means that the sidecar is gone. A ``recall_text`` the sidecar
    embeds holds the slot, and so this client's other recalls, until its reply: the sidecar
    embeds and recalls in the slot meanwhile.

    **Cancellation.** A recall cancelled while its request is in flight leaves that request's
    sequence number outstanding; the next request on the slot first waits for (and discards)
    its answer before it writes into the slot, so the sidecar never reads a half-rewritten
    request and nobody reads a stale answer (answers are also matched to their exact sequence
    number). A cancelled control operation cannot stop its worker thread: it runs to its end
    (a cancelled ``add`` may still be stored; pass ``request_id`` to retry it safely).

    Use it from one event loop at a time (it rebinds to the running loop, so a second
    ``asyncio.run`` works).
    """

    def __init__(
        self, name: str = "default", timeout: float = 1.0, *, max_spin_us: float = DEFAULT_MAX_SPIN_US,
        **client_kwargs: Any,
    ) -> None:
        if (not isinstance(max_spin_us, (int, float)) or isinstance(max_spin_us, bool)
                or not math.isfinite(max_spin_us) or not max_spin_us >= 0):
            raise InvalidArgument(f"max_spin_us must be a finite number >= 0, got {max_spin_us!r}")
        self.name = name
        self.timeout = timeout
        self._client_kwargs = client_kwargs
        self._max_spin_s = max_spin_us / 1e6
        # The spin on the event loop (_spin_for, _note_spin): short after whole spins in a row
        # that missed their answer, until a probe (every _PROBE_EVERY-th short wait) catches one.
        self._spin_short = False
        self._spin_misses = 0
        self._short_waits = 0
        # Owns the recall slot; touched only on the event loop with the slot lock held.
        self._recaller: Client | None = None
        # Control operations, called in worker threads (the sync Client is thread-safe).
        self._control: Client | None = None
        self._layout: Layout | None = None
        # (connection, seq) of a request submitted and not yet answered (its waiter was cancelled).
        self._outstanding: tuple[Connection, int] | None = None
        # Where clauses registered with the sidecar: canonical JSON -> (its epoch, handle).
        self._where_handles: dict[str, tuple[int, int]] = {}
        # Connections being opened in worker threads, shared by every caller until done.
        self._opening: dict[str, asyncio.Task] = {}
        self._locks_loop: asyncio.AbstractEventLoop | None = None
        self._slot_lock_: asyncio.Lock | None = None
        # Single recalls waiting to be sent together (:meth:`recall`, :meth:`recall_text`), one
        # queue each: a text batch that embeds in a worker thread holds back no recall by vector.
        self._queues: dict[str, _Queue] = {}

    # -- connection ------------------------------------------------------------------------

    def _slot_lock(self) -> asyncio.Lock:
        """The slot's lock, for the running loop (an asyncio.Lock belongs to the first loop
        that waits on it; a later ``asyncio.run`` gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._locks_loop is not loop:
            self._locks_loop = loop
            self._slot_lock_ = asyncio.Lock()
            # What waited on a loop that is gone went with it.
            self._queues = {}
        return self._slot_lock_  # type: ignore[return-value]

    async def _opened(self, key: str, open_: Callable[[], _T]) -> _T:
        """``open_()`` in a worker thread, as one task that every caller shares until it ends.

        Cancelling a caller does not cancel the task (the thread could not be stopped anyway):
        what it opens is kept, and the next caller takes it instead of opening another one.
        """
        loop = asyncio.get_running_loop()
        task = self._opening.get(key)
        if task is not None and task.done() and (task.cancelled() or task.exception() is not None):
            task = None  # it failed while nobody was waiting: try afresh
        elif task is not None and not task.done() and task.get_loop() is not loop:
            task = None  # left running by a loop that is gone (its thread ended with it)
        if task is None:
            task = loop.create_task(asyncio.to_thread(open_))
            task.add_done_callback(_retrieve)
            self._opening[key] = task
        if task.done():
            self._opening.pop(key, None)
            return task.result()
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the task itself, not only this caller, was cancelled
                self._opening.pop(key, None)
            raise
        except BaseException:
            self._opening.pop(key, None)
            raise
        self._opening.pop(key, None)
        return result

    def _open_recaller(self, recaller: Client | None) -> Client:
        """(worker thread) A connected client for the recall slot."""
        if recaller is None:
            return Client(self.name, self.timeout, **self._client_kwargs)
        with recaller._lock:
            recaller._connection()  # reconnects (or, after a fork, drops the parent's slot first)
        return recaller

    async def _slot_connection(self) -> Connection:
        """The recall connection, connected now (slot lock held)."""
        recaller = self._recaller
        if recaller is not None and recaller._conn is not None and recaller._pid == os.getpid():
            return recaller._conn
        recaller = await self._opened("recall", functools.partial(self._open_recaller, recaller))
        if self._recaller is None:
            self._recaller = recaller
            self.timeout = recaller.timeout
        elif recaller is not self._recaller:  # (cannot happen with the lock held; never keep two)
            recaller.close()
            recaller = self._recaller
        conn = recaller._conn
        if conn is None:  # dropped meanwhile by a caller that took the lock first
            return await self._slot_connection()
        if self._outstanding is not None and self._outstanding[0] is not conn:
            self._outstanding = None  # that request died with its connection
        self._layout = conn.layout
        return conn

    def _drop_slot(self) -> None:
        """Closes the recall connection (slot lock held); the next call connects again."""
        if self._recaller is not None:
            self._recaller._drop()
        self._outstanding = None

    async def _control_client(self) -> Client:
        if self._control is None:
            control = await self._opened(
                "control", functools.partial(Client, self.name, self.timeout, **self._client_kwargs)
            )
            if self._control is None:
                self._control = control
            elif control is not self._control:
                control.close()
        return self._control

    async def _in_thread(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """``Client.<method>(*args, **kwargs)`` of the control client, in a worker thread."""
        control = await self._control_client()
        return await asyncio.to_thread(getattr(control, method), *args, **kwargs)

    async def connect(self) -> "AsyncClient":
        """Connects now (else the first call does); SidecarUnavailable if no sidecar answers."""
        async with self._slot_lock():
            await self._slot_connection()
        return self

    async def aclose(self) -> None:
        """Frees this client's slots. The client reconnects if used again."""
        loop = asyncio.get_running_loop()
        async with self._slot_lock():
            for key in ("recall", "control"):
                # A connection still being opened for a caller that was cancelled (or opened
                # and not yet taken): closed too, not left holding a slot.
                task = self._opening.pop(key, None)
                if task is None:
                    continue
                if task.done():
                    if task.cancelled() or task.exception() is not None:
                        continue
                    opened = task.result()
                elif task.get_loop() is loop:
                    try:
                        opened = await asyncio.shield(task)
                    except Exception:  # noqa: BLE001 - nothing was opened
                        continue
                else:
                    continue
                if opened is not self._recaller and opened is not self._control:
                    await asyncio.to_thread(opened.close)
            recaller, self._recaller = self._recaller, None
            self._outstanding = None
            if recaller is not None:
                recaller.close()
        control, self._control = self._control, None
        if control is not None:
            await asyncio.to_thread(control.close)  # waits for its control calls in flight

    close = aclose

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def dim(self) -> int:
        """The store's vector dimension (known once connected)."""
        return self._connected_layout().dim

    @property
    def max_k(self) -> int:
        return self._connected_layout().max_k

    def _connected_layout(self) -> Layout:
        if self._layout is None:
            raise KalosError("AsyncClient has not connected yet: use `async with` or `await client.connect()` first")
        return self._layout

    def __repr__(self) -> str:
        recaller = self._recaller
        state = "connected" if recaller is not None and recaller._conn is not None else "disconnected"
        return f"AsyncClient(name={self.name!r}, {state})"

    def __getattr__(self, name: str) -> Any:
        """A method of :class:`Client` that has no version here yet (added to Client later)
        is a coroutine here too, running the sync method in a worker thread."""
        method = getattr(Client, name, None) if not name.startswith("_") else None
        if not inspect.isfunction(method):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._in_thread(name, *args, **kwargs)

        signature = inspect.signature(method)  # Client's, less self
        call.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])  # type: ignore[attr-defined]
        return call

    # -- recall (shared memory, waited for on the event loop) ------------------------------

    async def recall(
        self, vector: Any, k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Recall:
        """:meth:`Client.recall`: the ``k`` memories most similar to ``vector``, best first.

        Keyword arguments not listed here (added to :meth:`Client.recall` later) are passed to
        the sync client in a worker thread: they work at once, only without the native wait.
        """
        if kwargs:
            return await self._in_thread("recall", vector, k, namespace, since, until, where=where, **kwargs)
        layout = await self._queue_layout()
        clause = where_clause(where)
        # Checked here, in the caller's own task: a bad argument is this caller's error alone.
        rows, k, request = recall_request(vector, k, namespace, since, until, layout, single=True)
        key = ("vector", request, None if clause is None else clause.key)
        return await self._together(rows, key, ("vector", k, namespace, since, until, clause))

    async def _queue_layout(self) -> Layout:
        """The slot's layout, to check a call before it queues (the first call connects, as every
        call does after aclose()); binds the queues to the running loop."""
        self._slot_lock()
        if self._layout is None:
            async with self._slot_lock():
                await self._slot_connection()
        return self._layout  # type: ignore[return-value]

    async def _together(self, row: Any, key: Any, args: tuple[Any, ...]) -> Any:
        """A single recall (a query row, or a text: ``args[0]`` says which) through the queue of
        its group ``key``: sent with the others of that group that wait meanwhile. If nobody is
        sending that kind, this caller sends, group after group, until its own answer is in,
        then hands what is left to a task."""
        queue = self._queues.setdefault(args[0], _Queue())
        future = asyncio.get_running_loop().create_future()
        group = queue.groups.get(key)
        if group is None:
            group = queue.groups[key] = _Group(args, [])
        group.waiting.append(_Queued(row, future))
        if queue.sending:
            return await future
        queue.sending = True
        try:
            if queue.answered_together:
                # One turn of the loop lets the callers that answer woke join this request:
                # sent at once, it would go alone and they in the next, every other request.
                queue.answered_together = False
                await asyncio.sleep(0)
            while not future.done():
                await self._send_next(queue)
        finally:
            if not future.done():  # cancelled: nobody waits for this one any more
                future.cancel()
            self._hand_over(queue)
        return future.result()

    def _hand_over(self, queue: "_Queue") -> None:
        """The sender leaves: a task sends what still waits (nothing: nobody is sending)."""
        if queue.groups:
            queue.sender = asyncio.get_running_loop().create_task(self._send_all(queue))
            queue.sender.add_done_callback(_retrieve)
        else:
            queue.sending, queue.sender = False, None

    async def _send_all(self, queue: "_Queue") -> None:
        try:
            while queue.groups:
                await self._send_next(queue)
        except asyncio.CancelledError:
            # The loop is shutting down: the recalls still queued cannot be sent any more.
            for group in queue.groups.values():
                for waiting in group.waiting:
                    waiting.future.cancel()
            queue.groups.clear()
            raise
        finally:
            queue.sending, queue.sender = False, None

    async def _send_next(self, queue: "_Queue") -> None:
        """One request: the waiting recalls of the oldest group, up to the slot's max_batch."""
        key, group = next(iter(queue.groups.items()))
        del queue.groups[key]
        step = self._layout.max_batch if self._layout is not None else 1
        batch: list[_Queued] = []
        while group.waiting and len(batch) < step:
            waiting = group.waiting.pop(0)
            if not waiting.future.done():  # (its caller was cancelled)
                batch.append(waiting)
        if group.waiting:  # the rest after the other groups (a busy group does not starve them)
            queue.groups[key] = group
        if not batch:
            return
        sending = _SENDING.set(queue)
        try:
            answers = await self._answers(batch, group.args)
        except asyncio.CancelledError:
            # This sender was cancelled: the batch goes first again, for the next one.
            left = [waiting for waiting in batch if not waiting.future.done()]
            if left:
                queued = queue.groups.pop(key, None)
                queue.groups = {key: _Group(group.args, left + (queued.waiting if queued else [])), **queue.groups}
            raise
        except BaseException as exc:
            # Anything else (an OSError of the loop, MemoryError) is the batch's answer: every
            # caller in it hears of it, none is left waiting; the sender goes on with the
            # others' groups (its own caller, if in this batch, hears of it through its future).
            for waiting in batch:
                if not waiting.future.done():
                    waiting.future.set_exception(exc)
            if not isinstance(exc, Exception):  # (KeyboardInterrupt, SystemExit: theirs too)
                raise
            return
        finally:
            _SENDING.reset(sending)
        answered = 0
        for waiting, answer in zip(batch, answers):
            if waiting.future.done():
                continue
            answered += 1
            if isinstance(answer, BaseException):
                waiting.future.set_exception(answer)
            else:
                waiting.future.set_result(answer)
        queue.answered_together = answered > 1

    async def _answers(self, batch: list["_Queued"], args: tuple[Any, ...]) -> list[Any]:
        """Each recall's answer (or its error) from one request (for texts one recall_texts: one
        embedding batch, one recall batch, one fetch), or one request each where the batch
        failed on something that may be one query's fault."""
        kind, k, namespace, since, until, clause = args
        rows = [waiting.row for waiting in batch]

        async def send(rows: list[Any]) -> list[Any]:
            if kind == "text":
                return await self.recall_texts(rows, k, namespace, since, until, where=clause)
            if len(rows) == 1:
                return [await self._recall(rows[0][0], k, namespace, since, until, single=True, where=clause)]
            answers = await self._recall(np.concatenate(rows), k, namespace, since, until, single=False, where=clause)
            return [Recall(hits.ids.copy(), hits.scores.copy()) for hits in answers]

        if len(rows) > 1:
            try:
                return await send(rows)
            except SidecarUnavailable as exc:
                return [exc] * len(rows)
            except KalosError:
                pass  # one at a time below: each caller hears only of its own query's error
        out: list[Any] = []
        for row in rows:
            try:
                out.append((await send([row]))[0])
            except KalosError as exc:
                out.append(exc)
        return out

    async def recall_many(
        self, matrix: Any, k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> RecallBatch:
        """:meth:`Client.recall_many`: one recall per row of ``matrix`` ``[Q, dim]``, in batches of
        the sidecar's max_batch (the slot stays this call's until the last one is answered)."""
        if kwargs:
            return await self._in_thread("recall_many", matrix, k, namespace, since, until, where=where, **kwargs)
        return await self._recall(matrix, k, namespace, since, until, single=False, where=where)

    async def _where_request(self, conn: Connection, request: tuple[Any, ...], clause: Any) -> tuple[Any, ...]:
        """:meth:`Client._where_request`: the clause registered through the control client (in a
        worker thread) on first use with this sidecar."""
        cached = self._where_handles.get(clause.key)
        if cached is None or cached[0] != conn.epoch:
            control = await self._control_client()
            if len(self._where_handles) >= 4096:
                self._where_handles.clear()
            cached = self._where_handles[clause.key] = await asyncio.to_thread(_register_where, control, clause)
        return with_where(request, cached[1])

    async def _recall(
        self, queries: Any, k: int, namespace: str | None, since: Any, until: Any, *, single: bool,
        where: Any = None,
    ) -> Recall | RecallBatch:
        """:meth:`Client._recall` with the wait on the event loop."""
        clause = where_clause(where)
        async with self._slot_lock():
            conn = await self._slot_connection()
            layout = conn.layout
            rows, k, request = recall_request(queries, k, namespace, since, until, layout, single=single)
            plain = request
            if clause is not None:
                request = await self._where_request(conn, plain, clause)
            q = len(rows)
            if not single:
                ids = np.empty((q, k), np.int64)
                scores = np.empty((q, k), np.float32)
            step = layout.max_batch
            start = 0
            retried = where_retried = False
            while start < q:
                stop = min(q, start + step)
                try:
                    await self._round_trip(conn, rows[start:stop], request)
                except UnknownFilter:  # evicted from the sidecar's table: registered again, once
                    if where_retried or clause is None:
                        raise
                    where_retried = True
                    self._where_handles.pop(clause.key, None)
                    request = await self._where_request(conn, plain, clause)
                    continue
                except SidecarUnavailable as exc:
                    # As the sync client: a recall changes nothing, so after the sidecar exited
                    # it is asked again, once, of a sidecar that is back already; a hung one has
                    # used up the timeout, and the caller hears of it.
                    self._drop_slot()
                    if retried or not isinstance(exc, SidecarExited):
                        raise
                    retried = True
                    conn = await self._slot_connection()
                    if clause is not None:  # a new sidecar: its own handles
                        request = await self._where_request(conn, plain, clause)
                    check_same_layout(conn.layout, layout, k)
                    step = conn.layout.max_batch
                    continue
                slot = conn.channel.slot
                if single:
                    return single_hits(conn.channel.hit_ids, conn.channel.hit_scores, k)
                ids[start:stop] = slot.ids[: stop - start, :k]
                scores[start:stop] = slot.scores[: stop - start, :k]
                start = stop
                if start < q:  # (each request may spin: the loop runs between them)
                    await asyncio.sleep(0)
            return RecallBatch(ids, scores)

    async def ping(self) -> None:
        """:meth:`Client.ping`: one bare round trip through the slot (no search)."""
        async with self._slot_lock():
            conn = await self._slot_connection()
            try:
                await self._round_trip(conn, conn.channel.slot.queries[:0], _PING_REQUEST, op=Op.PING)
            except SidecarUnavailable:
                self._drop_slot()
                raise

    async def _round_trip(
        self, conn: Connection, rows: np.ndarray, request: tuple[Any, ...], op: Op = Op.RECALL
    ) -> None:
        """One request through the slot (slot lock held)."""
        if self._outstanding is not None:
            # A cancelled recall's request is still in the sidecar's hands: the slot is not
            # ours to rewrite until it is answered. Its answer is waited for and discarded.
            _, seq = self._outstanding
            await self._wait(conn, seq, learn=False)
            self._outstanding = None
        self._recaller._write_request(conn, rows, request, op)  # type: ignore[union-attr]
        channel = conn.channel
        seq = channel.submit()
        self._outstanding = (conn, seq)
        status = await self._wait(conn, seq, learn=op == Op.RECALL)
        self._outstanding = None
        if status:
            raise error_from_code(status, channel.slot.read_message())

    async def _wait(self, conn: Connection, seq: int, *, learn: bool) -> int:
        """:meth:`ClientChannel.wait` without blocking the loop: the answer's status (0: in the
        slot). ``learn``: the wait is a recall's, whose spin follows and teaches the spin rule
        (:meth:`_spin_for`); a ping's, or a cancelled recall's answer waited for, spins
        :data:`SHORT_SPIN_US` at most and teaches nothing."""
        channel = conn.channel
        slot = channel.slot
        resp_seq = slot.resp_seq
        want = np.uint64(seq)  # (uint64 against uint64: exact past 2**53, and no conversion per look)
        if resp_seq[0] != want:
            whole_s = min(channel.spin_budget_s(), self._max_spin_s)
            spin_s = self._spin_for(whole_s) if learn else _short_spin_s(whole_s)
            if spin_s > 0:
                clock = time.perf_counter
                spin_until = clock() + spin_s
                while resp_seq[0] != want and clock() < spin_until:
                    pass
                if learn and spin_s == whole_s:
                    self._note_spin(caught=resp_seq[0] == want)
            if resp_seq[0] != want:
                await self._sleep(conn, seq)
        full_fence()  # acquire: resp_seq is read before the response fields and result rows
        return int(slot.status[0])

    def _spin_for(self, whole_s: float) -> float:
        """How long this wait spins, of the ``whole_s`` the channel and ``max_spin_us`` allow:
        :data:`SHORT_SPIN_US` at most while a long spin would hold other callers of this client
        (:meth:`_others_wait`); else all of it, unless the spin is short after missed answers
        (:meth:`_note_spin`), when every :data:`_PROBE_EVERY`-th such wait spins all of it."""
        short_s = _short_spin_s(whole_s)
        if whole_s <= 0 or self._others_wait():
            return short_s
        if not self._spin_short:
            return whole_s
        self._short_waits += 1
        return whole_s if self._short_waits % _PROBE_EVERY == 0 else short_s

    def _others_wait(self) -> bool:
        """Whether a long spin on this request would hold other callers of this client: callers
        that the answer before it woke and that have not run since (its sender went on to the
        next request without a turn of the loop), or recalls queued behind it (a vector recall
        request's own queue: text recalls queued first wait for their embedding; for any other
        call, such as a text batch or recall_many, every queue: they all wait for the slot).
        The request's own callers, one or several, are not held: each waits for this answer,
        and a spin that catches it saves the round a wake-up."""
        queue = _SENDING.get()
        if queue is not None and queue.answered_together:
            return True
        own = queue is not None and queue is self._queues.get("vector")
        return any(q.groups for q in ((queue,) if own else self._queues.values()))

    def _note_spin(self, *, caught: bool) -> None:
        """After a wait that spun all it was allowed: a caught answer keeps (or brings back) the
        whole spin; :data:`_MISSES_TO_SHORTEN` missed in a row shorten it. One rule for every
        request of the client, a lone recall's, several callers' or a recall_many's: a client
        whose large requests outlast the spin while its lone ones would not spins short for
        its lone ones too, until a probe catches one."""
        if caught:
            self._spin_short, self._spin_misses = False, 0
        elif not self._others_wait():
            self._spin_misses += 1
            if self._spin_misses >= _MISSES_TO_SHORTEN:
                self._spin_short = True

    @staticmethod
    async def _sleep(conn: Connection, seq: int) -> None:
        """:meth:`ClientChannel._block` on the event loop: the same Dekker handshake, then the
        wake socket (rung by the sidecar) and the control socket (its death) awaited through
        ``loop.add_reader``, in slices after which the heartbeat is checked."""
        loop = asyncio.get_running_loop()
        channel = conn.channel
        slot = channel.slot
        wake_fd, control_fd, slice_s = channel.wake_fd, channel.control_fd, channel.poll_slice_s
        while True:
            if channel.going_to_sleep(seq):
                return
            waiter = loop.create_future()
            loop.add_reader(wake_fd, _resolve, waiter, _WAKE)
            loop.add_reader(control_fd, _resolve, waiter, _CONTROL)
            timer = loop.call_later(slice_s, _resolve, waiter, None)
            try:
                event = await waiter
            finally:  # cancelled too: nothing of this wait stays registered on the loop
                timer.cancel()
                loop.remove_reader(wake_fd)
                loop.remove_reader(control_fd)
                slot.client_sleeping[0] = 0
            if channel.woken(seq, control=event == _CONTROL, rung=event == _WAKE):
                return

    # -- text memories ----------------------------------------------------------------------

    async def embedder(self) -> Any:
        """:attr:`Client.embedder` (a coroutine here: loading the model takes seconds)."""
        control = await self._control_client()
        return await asyncio.to_thread(lambda: control.embedder)

    async def recall_text(
        self, text: str, k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Hit]:
        """:meth:`Client.recall_text`: when the sidecar embeds, its one control round trip in a
        worker thread (the recall connection's slot is the sidecar's meanwhile); with an embedder
        of the client's own, embeds in a worker thread, recalls natively, then fetches the hits'
        texts in one control round trip. Concurrent calls of one group (k, namespace, time window,
        ``where``) go together, as :meth:`recall`'s do: one :meth:`recall_texts` for all of them."""
        if kwargs:
            return await self._in_thread("recall_text", text, k, namespace, since, until, where=where, **kwargs)
        if not isinstance(text, str):
            raise InvalidArgument(f"recall_text takes one str, got {type(text).__name__}; use recall_texts for several")
        layout = await self._queue_layout()
        # Checked here, in the caller's own task: a bad argument is this caller's error alone.
        check_embed_texts([text])
        check_k(k, layout.max_k)
        words = filter_words(namespace, since, until)
        clause = where_clause(where)
        # Concurrent recall_text calls of one group go together: one embedding batch and one
        # recall batch for all of them (the sidecar's model, or this client's, embeds a batch
        # of short texts in little more than one), as concurrent recalls do.
        key = ("text", int(k), words, None if clause is None else clause.key)
        return await self._together(text, key, ("text", int(k), namespace, since, until, clause))

    async def recall_texts(
        self, texts: Sequence[str], k: int = 8, namespace: str | None = "default",
        since: TimeLike | None = None, until: TimeLike | None = None, *, where: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[list[Hit]]:
        """:meth:`Client.recall_texts`: one embedding batch, one recall batch, one fetch (one
        control round trip when the sidecar embeds, as for :class:`Client`)."""
        if kwargs:
            return await self._in_thread("recall_texts", texts, k, namespace, since, until, where=where, **kwargs)
        if isinstance(texts, str):
            raise InvalidArgument("recall_texts takes a sequence of texts; use recall_text for one")
        texts = list(texts)
        if not texts:
            return []
        async with self._slot_lock():
            max_k = (await self._slot_connection()).layout.max_k
        check_k(k, max_k)
        filter_words(namespace, since, until)  # bad filters fail before the (slow) embedding
        clause = where_clause(where)
        embedder = await self.embedder()
        if isinstance(embedder, _SidecarEmbedder):
            async with self._slot_lock():
                conn = await self._slot_connection()
                if conn.fits_one_recall_text(texts):
                    if self._outstanding is not None:  # (a cancelled recall's answer: see _round_trip)
                        await self._wait(conn, self._outstanding[1], learn=False)
                        self._outstanding = None
                    # One round trip in the recall connection's own thread: the sidecar recalls in
                    # its slot meanwhile, so the slot lock is held until the reply, cancelled or not.
                    recaller = self._recaller
                    work = asyncio.ensure_future(asyncio.to_thread(
                        recaller._recall_texts_in_sidecar, texts, int(k), namespace, since, until, clause))
                    try:
                        return await asyncio.shield(work)
                    except asyncio.CancelledError as cancel:
                        # The sidecar recalls in this slot until it replies: the lock stays held
                        # until then, however often this task is cancelled meanwhile.
                        while not work.done():
                            try:
                                await asyncio.wait([work])
                            except asyncio.CancelledError:
                                pass
                        if not work.cancelled():
                            work.exception()  # (retrieved: the caller hears of its cancellation)
                        raise cancel
        vectors = await asyncio.to_thread(embed_queries, embedder, texts)
        batch = await self.recall_many(vectors, k=k, namespace=namespace, since=since, until=until, where=clause)
        hits = [batch[i] for i in range(len(texts))]
        wanted = np.concatenate([h.ids for h in hits])
        items = dict(zip(wanted.tolist(), await self.get(wanted))) if len(wanted) else {}
        return [
            [Hit.from_item(items[i], s) for i, s in hit if items.get(i) is not None]
            for hit in hits
        ]

    async def remember(self, *args: Any, **kwargs: Any) -> np.ndarray:
        """:meth:`Client.remember` (embedding and add) in a worker thread."""
        return await self._in_thread("remember", *args, **kwargs)

    # -- writes and lookups (control socket, the sync implementation in a worker thread) ------

    async def add(self, *args: Any, **kwargs: Any) -> np.ndarray:
        """:meth:`Client.add`: stores memories; their ids once durable and recallable."""
        return await self._in_thread("add", *args, **kwargs)

    async def delete(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`Client.delete`: how many of the ids existed."""
        return await self._in_thread("delete", *args, **kwargs)

    async def get(self, *args: Any, **kwargs: Any) -> list[Item | None]:
        """:meth:`Client.get`: the stored memories (None where absent)."""
        return await self._in_thread("get", *args, **kwargs)

    async def list(self, *args: Any, **kwargs: Any) -> Page:
        """:meth:`Client.list`: one page of memories and the cursor of the next."""
        return await self._in_thread("list", *args, **kwargs)

    async def count(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`Client.count`: how many memories pass the namespace and ``where``."""
        return await self._in_thread("count", *args, **kwargs)

    async def drop_namespace(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`Client.drop_namespace`: how many memories went."""
        return await self._in_thread("drop_namespace", *args, **kwargs)

    async def update(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`Client.update`: changes one memory in place; its id."""
        return await self._in_thread("update", *args, **kwargs)

    async def renew(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`Client.renew`: renews the expiry of the memories of keys that expire; how many."""
        return await self._in_thread("renew", *args, **kwargs)

    async def stats(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """:meth:`Client.stats`: the sidecar's live counts and percentiles."""
        return await self._in_thread("stats", *args, **kwargs)

    async def compact(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`Client.compact`: squeezes deleted rows out of the engine now."""
        return await self._in_thread("compact", *args, **kwargs)
