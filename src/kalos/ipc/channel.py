"""The shared-memory channel over the segment (:mod:`kalos.ipc.segment`): slots, sequence
numbers, waiting and liveness.

Roles. The sidecar creates the segment (an anonymous memory file, sealed against resizing)
and passes its descriptor to each client in the hello reply; a client maps it and uses only
the slot it was given. In a slot the client owns ``req_seq`` and the request fields, the sidecar
owns ``resp_seq`` and the response fields, so every word has one writer at a time. (The one
hand-over: while a client waits for the reply of a control operation that recalls for it, op
``recall_text``, the sidecar writes that recall into the client's slot as the client would,
:meth:`SidecarChannel.recall_for_client`; the client re-reads ``req_seq`` after the reply.)

Waiting. Each side spins on the other's sequence number for a configurable window while
traffic is hot (no system call on the hot path), then announces that it is going to sleep in
a ``*_sleeping`` word and blocks in ``poll``. The other side rings only when it sees that word
set, after a full fence (see :mod:`kalos.ipc.sync` for why the fence is needed on both sides).
Each client rings, and is rung, through a socket pair of its own: it made the pair and passed
one end in its hello (:func:`wake_socket`); a byte it writes wakes the sidecar, which waits on
every client's end at once (epoll), and a byte the sidecar writes with ``MSG_DONTWAIT`` wakes
the client. No descriptor is shared between clients, and no flag a client sets on its own can
make the sidecar block: with eventfds (one doorbell that every client wrote, one wake fd a
client chose), a client could clear ``O_NONBLOCK`` on the shared file, saturate it and freeze
the sweep for everyone, or eat the doorbell's rings and stall it. A client keeps its core while
spinning only while every client can have one; past that it yields its core at every look; past
two clients per core it waits as the sidecar advises (:data:`CROWDED_WAITS`). A client's poll also
watches its control socket: when the sidecar dies the kernel closes that socket and the client
wakes at once; a sidecar that hangs is noticed through its heartbeat stamp going stale.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Callable

import numpy as np

from kalos.errors import InvalidArgument, SidecarUnavailable
from kalos.ipc import sync
from kalos.ipc.control import ConnectionClosed
from kalos.ipc.protocol import HeaderView, Layout, SlotColumns, SlotView, rest_seq
from kalos.ipc.segment import Segment
from kalos.ipc.sync import full_fence

__all__ = ["ClientChannel", "SidecarChannel", "SidecarExited", "wake_pair", "wake_socket",
           "CROWDED_WAITS"]

#: How a client waits for an answer once the clients outnumber the cores twice over (the sidecar
#: advises one in the hello): "yield" spins yielding its core at every look, as between one
#: and two clients per core; "nap" polls between timed sleeps of ClientChannel.NAP_S for up to
#: NAP_WINDOW_S, then sleeps; "sleep" sleeps at once until the sidecar rings. Each ends in the
#: announced sleep once its budget is spent.
CROWDED_WAITS = ("yield", "nap", "sleep")

_RING = b"\x01"
#: Flags of every write and read on a bell: never block, whatever flags the other side set on
#: the file; never raise SIGPIPE (a process that restored its default would die of a dead peer).
_BELL_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_GONE = "the sidecar closed the connection (it exited or was killed)"


def wake_pair() -> tuple[socket.socket, socket.socket]:
    """A client's bell: ``(the end to pass to the sidecar in the hello, the end the client
    keeps: written to ring the sidecar, polled to be woken)``, a connected pair of Unix stream
    sockets, the client's end non-blocking."""
    theirs, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    return theirs, ours


def wake_socket(fd: int) -> socket.socket:
    """The descriptor a client passed in its hello, as the socket the sidecar rings it by and
    hears it ring on; the descriptor is closed and InvalidArgument raised unless it is an
    unnamed Unix stream socket (one end of a socket pair): used with ``MSG_DONTWAIT``, it can
    never block the sidecar, and an unnamed one cannot carry the sidecar's writes to some other
    process's listening socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        os.close(fd)
        raise InvalidArgument(f"the hello's wake descriptor is not a socket ({exc.strerror}); "
                              "pass one end of a socket pair (kalos.ipc.channel.wake_pair)") from None
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or sock.getpeername():
            raise InvalidArgument("the hello's wake descriptor must be one end of a Unix stream socket pair "
                                  "(kalos.ipc.channel.wake_pair)")
    except OSError as exc:  # not connected
        sock.close()
        raise InvalidArgument(f"the hello's wake socket is not connected ({exc.strerror})") from None
    except BaseException:
        sock.close()
        raise
    return sock
_NO_SEQS = np.empty(0, dtype=np.uint64)
_NO_SLOTS = np.empty(0, dtype=np.int64)


class SidecarExited(SidecarUnavailable):
    """The sidecar's end of the control socket closed: it exited or was killed (not merely slow)."""


def _publish_request(header: HeaderView, slot: SlotView, seq: int) -> bool:
    """Numbers the request already written into ``slot`` ``seq`` (its words and rows visible
    first), then says whether the sidecar sleeps and must be rung (Dekker, see
    :mod:`kalos.ipc.sync`): a client's submit, and the sidecar's for a client (op recall_text)."""
    full_fence()  # release: the request fields and query rows are visible before req_seq
    slot.req_seq[0] = seq
    full_fence()  # store req_seq, then load sidecar_sleeping
    return bool(header.sidecar_sleeping[0])


class ClientChannel:
    """A client's end of one slot: submit a request, wait for its answer."""

    NAP_S = 100e-6
    NAP_WINDOW_S = 2e-3

    def __init__(
        self,
        segment: Segment,
        layout: Layout,
        slot: int,
        *,
        wake: socket.socket,
        control: socket.socket,
        epoch: int,
        timeout: float,
        spin_s: float,
        crowded: str = "nap",
    ) -> None:
        if crowded not in CROWDED_WAITS:
            raise InvalidArgument(f"crowded must be one of {', '.join(CROWDED_WAITS)}, got {crowded!r}")
        self.layout = layout
        self.header = HeaderView(segment.buf)
        self.slot = SlotView(segment.buf, layout, slot)
        # The slot's first query row and row of hits, viewed once: a single recall's.
        self.query_row = self.slot.queries[0]
        self.hit_ids = self.slot.ids[0]
        self.hit_scores = self.slot.scores[0]
        self._wake = wake
        self._wake_fd = wake.fileno()
        self._epoch = epoch
        self._timeout_ns = int(timeout * 1e9)
        self._spin_s = spin_s
        self._crowded = crowded
        # Spinning alone pays only while every waiting client and the sidecar's sweep have a
        # core. Past that, up to two clients per core, a spinner yields its core at every look
        # (the sweep and the clients it answered run first), which beat sleeping on the card
        # (issue 18; BENCHMARKS.md). Past two per core the sidecar advises (``crowded``, see
        # kalos.server.sidecar.crowded_wait): where the GPU's polling answers, yielding spinners
        # see their answers soonest; where the sweep answers on the GPU, the wake-ups it would
        # write at the end of each pass cost it more than naps cost the clients, and spinners
        # would take the cores it runs on; a CPU sidecar's clients sleep at once.
        # (Every connected client counts, idle ones too: on the safe side.)
        cores = len(os.sched_getaffinity(0))
        self._spin_clients = cores - 1
        self._nap_clients = 2 * cores
        self._seq = int(self.slot.req_seq[0])
        self._poller = select.poll()
        self._poller.register(self._wake_fd, select.POLLIN)
        self._poller.register(control, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._control_fd = control.fileno()
        # Poll in slices so that a hung (not dead) sidecar is noticed by its stale heartbeat.
        self._slice_ms = max(1, min(100, int(timeout * 1000) // 4))

    def submit(self) -> int:
        """Publishes the request already written into the slot; returns its sequence number."""
        slot = self.slot
        seq = self._seq + 1
        self._seq = seq
        if _publish_request(self.header, slot, seq):
            try:
                self._wake.send(_RING, _BELL_FLAGS)  # the sidecar hears it on its end of the pair
            except BlockingIOError:
                pass  # the sidecar has not read the earlier rings yet: rung already
            except (BrokenPipeError, ConnectionResetError):
                # The sidecar's end is closed: it died (kill -9 leaves its sleeping word set)
                # or stopped. Its clients retry once on a sidecar that is back (SidecarExited).
                raise SidecarExited(_GONE) from None
        return seq

    def resync(self) -> None:
        """Takes the slot's sequence number as this client's own again, after the sidecar
        submitted a request in the slot for it (op ``recall_text``). A request the sidecar gave
        up waiting for is still in the slot: its answer is waited for here (SidecarUnavailable
        if none comes), as the slot is not this client's to rewrite before."""
        self._seq = int(self.slot.req_seq[0])
        if int(self.slot.resp_seq[0]) != self._seq:
            self.wait(self._seq)

    def wait(self, seq: int) -> int:
        """Blocks until the response to ``seq`` is in the slot, then returns its status (0: the
        answer is in the slot; else an error code, the slot's message says more);
        SidecarUnavailable if none comes."""
        slot = self.slot
        resp_seq = slot.resp_seq
        clock = time.perf_counter
        spin_s, nap, give_way = self._budgets(int(self.header.clients[0]))
        spin_until = clock() + spin_s
        want = np.uint64(seq)  # (uint64 against uint64: exact past 2**53, and no conversion per look)
        while resp_seq[0] != want:
            if clock() >= spin_until:
                if not (nap and self._nap(seq)):
                    self._block(seq)
                break
            if give_way:
                os.sched_yield()
        full_fence()  # acquire: resp_seq is read before the response fields and result rows
        return int(slot.status[0])

    def _nap(self, seq: int) -> bool:
        """Polls ``resp_seq`` between short timed sleeps (``NAP_S``) for up to ``NAP_WINDOW_S``;
        True once ``seq`` is answered. Used while clients outnumber the cores twice over, when
        the sidecar says to (``crowded`` "nap": a sweep's short passes on a GPU): a napping client is woken
        by its own core's timer, not by the sidecar, whose wake-ups are written one after
        another at the end of each pass, several microseconds each, so that with many sleepers
        they took a third of the sweep (issue 18; BENCHMARKS.md)."""
        resp_seq = self.slot.resp_seq
        until = time.perf_counter() + self.NAP_WINDOW_S
        want = np.uint64(seq)
        while resp_seq[0] != want:
            if time.perf_counter() >= until:
                return False
            time.sleep(self.NAP_S)
        return True

    def _block(self, seq: int) -> None:
        slot = self.slot
        while True:
            if self.going_to_sleep(seq):
                return
            events = self._poller.poll(self._slice_ms)
            slot.client_sleeping[0] = 0
            fds = {fd for fd, _event in events}
            if self.woken(seq, control=self._control_fd in fds, rung=self._wake_fd in fds):
                return

    def woken(self, seq: int, *, control: bool, rung: bool) -> bool:
        """After a sleep (``client_sleeping`` cleared): True once ``seq`` is answered; else
        SidecarExited when the sidecar's end of the control socket (``control``) or of the bell
        read end of file, and a check of its heartbeat. ``rung``: the bell was readable, and is
        drained. An answer published before the sidecar went is the answer."""
        gone = control
        if rung and not gone:
            try:
                heard = self._wake.recv(4096, _BELL_FLAGS)
            except BlockingIOError:
                heard = _RING  # (read by nobody else: a spurious wake-up)
            except ConnectionResetError:
                heard = b""
            gone = not heard
        if int(self.slot.resp_seq[0]) == seq:
            return True
        if gone:
            raise SidecarExited(_GONE)
        self.check_alive()
        return False

    def going_to_sleep(self, seq: int) -> bool:
        """Announces a sleep in ``client_sleeping``, then looks at ``resp_seq`` once more (Dekker:
        the sidecar stores resp_seq, then loads this word). True: ``seq`` is answered already
        (the word is cleared again); False: sleep, and clear the word on waking."""
        slot = self.slot
        slot.client_sleeping[0] = 1
        full_fence()  # store client_sleeping, then load resp_seq (Dekker, see kalos.ipc.sync)
        if int(slot.resp_seq[0]) == seq:
            slot.client_sleeping[0] = 0
            return True
        return False

    # -- for kalos.client.aio.AsyncClient, which waits with the same protocol as _block but on its
    # -- event loop (loop.add_reader on these descriptors) instead of in poll().

    @property
    def wake_fd(self) -> int:
        """The socket the sidecar rings when it answers while ``client_sleeping`` is set."""
        return self._wake_fd

    @property
    def control_fd(self) -> int:
        """The control socket's descriptor: readable (EOF) when the sidecar exits."""
        return self._control_fd

    @property
    def poll_slice_s(self) -> float:
        """How long one sleep lasts before the heartbeat is checked again."""
        return self._slice_ms / 1000

    def spin_budget_s(self) -> float:
        """How long a plain spin (one that keeps its core) pays right now: none once as many
        clients as cores are connected (one core is the sidecar's). (AsyncClient spins only
        then: past the cores it waits on its event loop at once, as a spin would hold the loop
        and take a core the crowd needs.)"""
        spin_s, _nap, give_way = self._budgets(int(self.header.clients[0]))
        return 0.0 if give_way else spin_s

    def _budgets(self, clients: int) -> tuple[float, bool, bool]:
        """How a wait goes with ``clients`` connected: how long it spins, whether it then
        naps (:meth:`_nap`) before it announces its sleep, and whether it yields its core at
        each look while it spins."""
        if clients <= self._spin_clients:
            return self._spin_s, False, False
        if clients <= self._nap_clients or self._crowded == "yield":
            return self._spin_s, False, True
        return 0.0, self._crowded == "nap", False

    def check_epoch(self) -> None:
        """SidecarUnavailable unless the segment is still the one this client's sidecar made."""
        if int(self.header.epoch[0]) != self._epoch:
            raise SidecarUnavailable("the sidecar restarted while this request was in flight")

    def check_alive(self) -> None:
        self.check_epoch()
        age_ns = time.monotonic_ns() - int(self.header.heartbeat_ns[0])
        if age_ns > self._timeout_ns:
            raise SidecarUnavailable(
                f"the sidecar has not shown a heartbeat for {age_ns / 1e9:.2f} s (timeout {self._timeout_ns / 1e9:g} s)"
            )


class SidecarChannel:
    """The sidecar's end of every slot: find pending requests, publish answers, sleep and wake."""

    def __init__(self, segment: Segment, layout: Layout, *, epoch: int) -> None:
        self.layout = layout
        self.header = HeaderView(segment.buf)
        self.slots = [SlotView(segment.buf, layout, i) for i in range(layout.n_slots)]
        self.columns = SlotColumns(segment.buf, layout)
        # What the sidecar last answered per slot: its own copy, never re-read from shared
        # memory, so a client scribbling on resp_seq cannot make the sidecar skip or repeat.
        self.answered = np.zeros(layout.n_slots, dtype=np.uint64)
        # What was answered when sleepers were last checked (answers the GPU writes by itself,
        # kalos.engine.gpu.slot_server, are seen here and their sleeping clients woken).
        self._woken = np.zeros(layout.n_slots, dtype=np.uint64)
        self.active = np.zeros(layout.n_slots, dtype=bool)
        self.wake_socks: list[socket.socket | None] = [None] * layout.n_slots
        # Set by a ring of the slot while the sidecar itself waits in it (recall_for_client).
        self._rung: list[threading.Event | None] = [None] * layout.n_slots
        # Bumped each time a slot changes hands: a pass publishes only to the clients whose
        # requests it read (one that left meanwhile may have been replaced by a new client).
        self.generation = np.zeros(layout.n_slots, dtype=np.uint64)
        self.n_clients = 0  # slots in use: the sidecar's own count (header.clients is advice to clients)
        # A GPU kernel's copy of ``active``, and the seqs its rounds hold (adopt_kernel_words).
        self.in_use: np.ndarray | None = None
        self.taken: np.ndarray | None = None
        self.pending_generations = np.zeros(0, dtype=np.uint64)
        # Scratch of the native pending() and publish() (kalos.ipc.sync): slots found, their
        # req_seq, the sleepers to wake; and "no slot busy".
        self._found = np.empty(layout.n_slots, dtype=np.int64)
        self._found_seqs = np.empty(layout.n_slots, dtype=np.uint64)
        self._sleepers = np.empty(layout.n_slots, dtype=np.int64)
        self._none_busy = np.zeros(layout.n_slots, dtype=bool)
        # Held briefly by the slot table's changes, by pending() and by publishing, never across
        # a search. It also covers the wake sockets: a closed number may be reused at once by
        # another file (a control socket), which a late write would then corrupt.
        self._lock = threading.Lock()
        # What the sleeping sweep waits on: every client's end of its pair (a client rings by
        # writing to its own end), and the sidecar's own bell (ring()), which no client holds.
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._bell, select.EPOLLIN)
        self._bell_socks: dict[int, socket.socket] = {}
        self.epoch = epoch

    def stamp_heartbeat(self) -> None:
        self.header.heartbeat_ns[0] = time.monotonic_ns()

    def take_slot(self, wake: socket.socket, *, quiet_only: bool = False) -> int | None:
        """Activates the first free slot for a client whose wake socket is ``wake``; None when all
        are in use. With ``quiet_only``, only a free slot whose last request was answered (or
        that never had one) and that no GPU round holds: a kernel that took a request of the
        slot's previous client and has not answered it yet would write that answer into the
        new client's rows. (``req_seq`` alone would not do: the previous client may have
        written it back to its last answered number.)"""
        with self._lock:
            free = ~self.active
            if quiet_only:
                free &= self.columns.req_seq == self.answered
                if self.taken is not None:
                    free &= self.taken == 0
            free = np.flatnonzero(free)
            if not len(free):
                return None
            slot = int(free[0])
            self._activate(slot, wake)
            return slot

    def activate(self, slot: int, wake: socket.socket) -> None:
        with self._lock:
            self._activate(slot, wake)

    def _activate(self, slot: int, wake: socket.socket) -> None:
        self.generation[slot] += 1
        view = self.slots[slot]
        view.reset()
        rest = np.uint64(rest_seq(self.generation[slot]))
        view.resp_seq[0] = rest
        view.req_seq[0] = rest  # the client starts counting from here
        self.answered[slot] = rest
        self._woken[slot] = rest
        self._epoll.register(wake.fileno(), select.EPOLLIN)  # (first: a failure leaves no table entry)
        self.wake_socks[slot] = wake
        self._bell_socks[wake.fileno()] = wake
        self.active[slot] = True
        if self.in_use is not None:
            self.in_use[slot] = 1  # (after the rest seqs: a GPU kernel polls it from now on)
        self.n_clients = int(self.active.sum())
        self.header.clients[0] = self.n_clients

    def deactivate(self, slot: int) -> None:
        with self._lock:
            self.active[slot] = False
            if self.in_use is not None:
                self.in_use[slot] = 0
            self.generation[slot] += 1
            self.n_clients = int(self.active.sum())
            self.header.clients[0] = self.n_clients
            wake, self.wake_socks[slot] = self.wake_socks[slot], None
            if wake is not None:
                self._unwatch(wake)
        if wake is not None:
            wake.close()  # out of the table first: no wake-up can reach the number once reused

    def _unwatch(self, bell: socket.socket) -> None:  # (self._lock held)
        """Stops waiting on a client's bell. Before its close: the client may hold a copy of this
        end, which keeps the file open, and epoll would go on reporting it under a number that
        the next socket of the sidecar reuses."""
        if self._bell_socks.pop(bell.fileno(), None) is not None:
            try:
                self._epoll.unregister(bell.fileno())
            except (OSError, ValueError):  # the channel closed already (a late control thread at exit)
                pass

    def free_slot(self) -> int | None:
        free = np.flatnonzero(~self.active)
        return int(free[0]) if len(free) else None

    def adopt_kernel_words(self, in_use: np.ndarray, taken: np.ndarray) -> None:
        """From now on a GPU kernel serves the slots too: mirrors which slots have a client into
        ``in_use`` (1 or 0 per slot, words the kernel polls) under the same lock as the slot
        table, and hands a slot out with ``quiet_only`` only where ``taken`` (the seq a round of
        the kernel holds, 0 once its answer is out) is 0."""
        for name, words in (("in_use", in_use), ("taken", taken)):
            if len(words) != self.layout.n_slots:
                raise InvalidArgument(f"{name} must have {self.layout.n_slots} entries, got {len(words)}")
        with self._lock:
            in_use[:] = self.active
            self.in_use = in_use
            self.taken = taken

    def adopt_answered(self, answered: np.ndarray) -> None:
        """Keeps the record of answered sequence numbers in ``answered`` from now on (memory a
        GPU kernel that answers requests by itself also writes); the current record is copied."""
        if answered.shape != self.answered.shape or answered.dtype != self.answered.dtype:
            raise InvalidArgument(f"answered must be {self.answered.dtype}[{len(self.answered)}]")
        answered[:] = self.answered
        self.answered = answered

    def pending(self, handed: np.ndarray | None = None, busy: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Slots with an unanswered request, and the req_seq seen for each; with ``handed``
        (while a GPU kernel serves the slots), only requests it handed to the host; with
        ``busy`` (a mask of slots whose requests are being answered already), not those."""
        req_seq = self.columns.req_seq
        if handed is None and sync.pending_slots is not None:
            with self._lock:
                n = sync.pending_slots(req_seq, self.answered, self.active, self._none_busy if busy is None else busy,
                                       self._found, self._found_seqs)  # (its fence is the acquire below's)
                if not n:
                    return _NO_SLOTS, _NO_SEQS
                ready, seqs = self._found[:n].copy(), self._found_seqs[:n].copy()
                self.pending_generations = self.generation[ready]
            return ready, seqs
        with self._lock:
            mine = (req_seq != self.answered) & self.active
            if handed is not None:
                mine &= req_seq == handed
            if busy is not None:
                mine &= ~busy
            ready = np.flatnonzero(mine)
            if not len(ready):
                return ready, _NO_SEQS
            # An honest client does not touch its slot while its request is pending, so reading
            # req_seq a second time here yields the value compared above.
            seqs = req_seq[ready]
            self.pending_generations = self.generation[ready]  # for publish(..., generations=)
        full_fence()  # acquire: req_seq was read before the request fields and rows
        return ready, seqs

    def spin_for_request(self, timeout_s: float, busy: np.ndarray) -> None:
        """Spins until a request may be pending in a slot that is not ``busy`` (a bool mask),
        or ``timeout_s``: a hint, :meth:`pending` reads the requests. The looks run without the
        GIL (kalos.ipc._fence.spin_pending), so that a control thread (a hello, a get) runs at
        once instead of after the interpreter's switch interval; without the extension, one
        yield of the core."""
        if sync.spin_pending is None:
            os.sched_yield()
            return
        sync.spin_pending(self.columns.req_seq, self.answered, self.active, busy, int(timeout_s * 1e9))

    #: How long :meth:`recall_for_client` waits for a slot to be quiet before refusing: a GPU
    #: kernel's round publishes an answer before it releases the slot (``taken``).
    QUIET_WAIT_S = 5e-3

    def recall_for_client(self, slot: int, write: Callable[[SlotView], None], *, timeout_s: float, spin_s: float,
                          stopping: threading.Event) -> SlotView:
        """Submits a request in ``slot`` for its client, who waits on its control socket meanwhile
        (op ``recall_text``): ``write`` fills the request's words and rows, then the request is
        submitted as a client submits it and answered by the sweep or the GPU like any other, in
        the same batched passes. Returns the slot once the answer is in (read it before the
        control reply goes out). Waits on the sidecar's own record of answers (``answered``),
        not on words the client could scribble on. Spins (yielding its core) for ``spin_s``, then
        sleeps as a client sleeps, woken by the publisher.

        InvalidArgument if the slot is not active, holds a request in flight (after
        ``QUIET_WAIT_S``), or its client rewrites ``req_seq`` meanwhile; TimeoutError after
        ``timeout_s`` without an answer (the request stays in the slot: its client waits for
        the answer before it uses the slot again, :meth:`ClientChannel.resync`);
        ConnectionClosed once ``stopping`` is set or the slot changed hands."""
        view = self.slots[slot]
        clock = time.monotonic
        quiet_until = clock() + self.QUIET_WAIT_S
        while True:
            with self._lock:
                if not self.active[slot]:
                    raise InvalidArgument(f"slot {slot} has no client")
                answered = int(self.answered[slot])
                in_flight = int(view.req_seq[0]) != answered or (self.taken is not None and int(self.taken[slot]) != 0)
                generation = int(self.generation[slot])
            if not in_flight:
                break
            if clock() >= quiet_until:
                raise InvalidArgument("this connection's slot has a recall in flight; wait for its answer first")
            os.sched_yield()
        write(view)
        seq = answered + 1
        if _publish_request(self.header, view, seq):
            self.ring()
        rung = threading.Event()
        with self._lock:
            self._rung[slot] = rung
        try:
            self._wait_answered(slot, seq, generation, rung, timeout_s, spin_s, stopping)
        finally:
            with self._lock:
                self._rung[slot] = None
        full_fence()  # acquire: the answer was recorded before its fields and rows are read
        return view

    def _wait_answered(self, slot: int, seq: int, generation: int, rung: threading.Event, timeout_s: float,
                       spin_s: float, stopping: threading.Event) -> None:
        """:meth:`recall_for_client`'s wait: spins, then sleeps on ``rung``, which the
        publisher sets where it would wake the slot's client (the client's own wake socket is
        rung too; the client drains it at its next wait)."""
        view = self.slots[slot]
        clock = time.monotonic
        started = clock()
        deadline = started + timeout_s
        while int(self.answered[slot]) != seq:
            now = clock()
            if stopping.is_set() or int(self.generation[slot]) != generation:
                raise ConnectionClosed("the sidecar is stopping")
            if int(view.req_seq[0]) != seq:
                raise InvalidArgument("the client rewrote its slot's request while the sidecar recalled in it")
            if now >= deadline:
                raise TimeoutError(f"no answer in {timeout_s:g} s to the recall made for the client of slot {slot}")
            if now - started < spin_s:
                os.sched_yield()
                continue
            # Sleep as a client sleeps: the publisher rings the slot when it sees this word.
            view.client_sleeping[0] = 1
            full_fence()  # store client_sleeping, then load answered (Dekker, see kalos.ipc.sync)
            if int(self.answered[slot]) != seq:
                rung.wait(max(1e-3, min(10e-3, deadline - now)))
            view.client_sleeping[0] = 0
            rung.clear()

    def requested(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` hold an unanswered request (a peek: :meth:`pending` reads them)."""
        return self.columns.req_seq[slots] != self.answered[slots]

    def publish(self, slots: np.ndarray, seqs: np.ndarray, generations: np.ndarray | None = None) -> None:
        """Makes the answers already written into ``slots`` visible, waking sleepers; with
        ``generations`` (``pending_generations`` when the requests were read), only to slots
        still held by the same client."""
        if not len(slots):
            return
        full_fence()  # release: response fields and result rows before resp_seq
        if len(slots) == 1:
            self._publish_one(int(slots[0]), int(seqs[0]), None if generations is None else int(generations[0]))
            return
        if sync.publish_slots is not None:
            with self._lock:
                woke = sync.publish_slots(slots, seqs, generations, self.generation, self.columns.resp_seq, self.answered,
                                          self._woken, self.columns.client_sleeping, self._sleepers)
                if woke:
                    self._ring(self._sleepers[:woke].tolist())
            return
        with self._lock:
            if generations is not None:
                same = self.generation[slots] == generations
                if not same.all():  # a client left (and maybe another came) while its pass ran
                    slots, seqs = slots[same], seqs[same]
            self.columns.resp_seq[slots] = seqs  # one aligned 8-byte store per slot, in order
            self.answered[slots] = seqs
            self._woken[slots] = seqs
            full_fence()  # store resp_seq, then load client_sleeping (Dekker, see kalos.ipc.sync)
            self._wake(slots)

    def _publish_one(self, slot: int, seq: int, generation: int | None) -> None:
        """:meth:`publish` of one slot with scalar stores (the fence before it is done)."""
        with self._lock:
            if generation is not None and int(self.generation[slot]) != generation:
                return  # the client left (and maybe another came) while its pass ran
            self.slots[slot].resp_seq[0] = seq
            self.answered[slot] = seq
            self._woken[slot] = seq
            full_fence()  # store resp_seq, then load client_sleeping (Dekker, see kalos.ipc.sync)
            if self.slots[slot].client_sleeping[0]:
                self._ring([slot])

    def wake_answered(self) -> None:
        """Wakes the sleeping clients of answers written by someone else (a GPU kernel that
        stores ``resp_seq`` itself, then ``answered``)."""
        fresh = np.flatnonzero(self.answered != self._woken)
        if len(fresh):
            self._woken[fresh] = self.answered[fresh]
            full_fence()  # load answered (after its resp_seq), then load client_sleeping
            with self._lock:
                self._wake(fresh)

    def _wake(self, slots: np.ndarray) -> None:  # (self._lock held)
        sleeping = slots[self.columns.client_sleeping[slots] != 0]
        if len(sleeping):
            self._ring(sleeping)

    def _ring(self, slots: np.ndarray | list[int]) -> None:  # (self._lock held)
        for slot in (slots.tolist() if isinstance(slots, np.ndarray) else slots):
            wake = self.wake_socks[slot]
            if wake is not None:
                try:
                    wake.send(_RING, _BELL_FLAGS)
                except OSError:
                    # A wake socket that refuses the write (full: its client never drains it;
                    # closed at the other end) costs only its own client's wake-up; it must not
                    # take the sweep down (test_hostile.py).
                    pass
            rung = self._rung[slot]
            if rung is not None:
                rung.set()

    def sleep(self, timeout_s: float) -> None:
        """Blocks until a client rings (or :meth:`ring`, or ``timeout_s``), unless work is pending."""
        self.header.sidecar_sleeping[0] = 1
        full_fence()  # store sidecar_sleeping, then load every req_seq (Dekker, see kalos.ipc.sync)
        try:
            if len(self.pending()[0]):
                return
            for fd, _events in self._epoll.poll(timeout_s):
                self._hear(fd)
        finally:
            self.header.sidecar_sleeping[0] = 0

    def _hear(self, fd: int) -> None:
        """Drains the bell ``fd`` that woke :meth:`sleep` (the sidecar's own, or a client's)."""
        if fd == self._bell:
            try:
                os.eventfd_read(fd)
            except BlockingIOError:
                pass
            return
        with self._lock:  # (a slot freed meanwhile: its number may be another file's now)
            bell = self._bell_socks.get(fd)
            if bell is None:
                return
            try:
                heard = bell.recv(4096, _BELL_FLAGS)  # the rings so far (never blocks)
            except BlockingIOError:
                return
            except OSError:
                heard = b""
            if not heard:
                # The client closed its end (or broke it): it cannot ring any more, and an end at
                # EOF would wake this wait at once for ever. Its requests are still seen at the
                # sweep's next look; its slot is freed when its control connection goes.
                self._unwatch(bell)

    @property
    def closed(self) -> bool:
        return self._bell < 0

    def ring(self) -> None:
        """Wakes the sweep (used to stop the sidecar or to apply a slot change promptly)."""
        try:
            os.eventfd_write(self._bell, 1)
        except OSError:
            pass  # saturated (rung already), or closed: the sidecar is stopping

    def close(self) -> None:
        for slot in range(self.layout.n_slots):
            self.deactivate(slot)
        if self._bell >= 0:
            self._epoll.close()
            os.close(self._bell)
            self._bell = -1
        self.slots = []

