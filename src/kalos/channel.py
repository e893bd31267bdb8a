"""The shared-memory channel: segments, slots, sequence numbers, waiting and liveness.

Roles. The sidecar creates the segment (mode 0600) and is the only process that unlinks
it; a client attaches to the segment named in the sidecar's hello reply and uses only the
slot it was given. In a slot the client owns ``req_seq`` and the request fields, the sidecar
owns ``resp_seq`` and the response fields, so every word has one writer.

Waiting. Each side spins on the other's sequence number for a configurable window while
traffic is hot (no system call on the hot path), then announces that it is going to sleep in
a ``*_sleeping`` word and blocks in ``poll`` on an eventfd doorbell. The other side rings the
doorbell only when it sees that word set, after a full fence (see :mod:`kalos.sync` for why
the fence is needed on both sides). A client's poll also watches its control socket: when
the sidecar dies the kernel closes that socket and the client wakes at once; a sidecar that
hangs is noticed through its heartbeat stamp going stale.
"""
from __future__ import annotations

import mmap
import os
import re
import select
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kalos.config import runtime_dir
from kalos.errors import InvalidArgument, ProtocolMismatch, SidecarUnavailable
from kalos.protocol import HEADER_DTYPE, HeaderView, Layout, SlotColumns, SlotView
from kalos.sync import full_fence

__all__ = ["Endpoint", "Segment", "ClientChannel", "SidecarChannel", "SidecarExited"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SHM_DIR = Path("/dev/shm")
_NO_SEQS = np.empty(0, dtype=np.uint64)


@dataclass(frozen=True)
class Endpoint:
    """Where the sidecar called ``name`` listens: control socket, lock file, segment."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidArgument(
                f"sidecar name {self.name!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )

    @property
    def socket_path(self) -> Path:
        return runtime_dir() / f"{self.name}.sock"

    @property
    def lock_path(self) -> Path:
        return runtime_dir() / f"{self.name}.lock"

    @property
    def segment_name(self) -> str:
        return f"kalos-{os.getuid()}-{self.name}"


class Segment:
    """A mapped POSIX shared-memory segment (``/dev/shm/<name>``)."""

    # Class-level defaults keep close() safe after a constructor that failed half-way.
    _fd = -1
    _mmap: mmap.mmap | None = None
    buf: memoryview | None = None

    def __init__(self, name: str, *, create_size: int | None = None) -> None:
        self.name = name
        self.path = _SHM_DIR / name
        self.created = create_size is not None
        try:
            if create_size is not None:
                try:
                    self.path.unlink()  # a segment left behind by a sidecar that was killed
                except FileNotFoundError:
                    pass
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.fchmod(self._fd, 0o600)
                os.ftruncate(self._fd, create_size)
                size = create_size
            else:
                try:
                    self._fd = os.open(self.path, os.O_RDWR)
                except FileNotFoundError:
                    raise SidecarUnavailable(f"shared-memory segment {self.path} does not exist") from None
                st = os.fstat(self._fd)
                if st.st_uid != os.getuid():
                    raise ProtocolMismatch(f"{self.path} belongs to uid {st.st_uid}, not to this user")
                size = st.st_size
                if size < HEADER_DTYPE.itemsize:
                    raise ProtocolMismatch(f"{self.path} holds {size} bytes: too small for a Kalos segment header")
            self._mmap = mmap.mmap(self._fd, size)
            self.buf = memoryview(self._mmap)
        except BaseException:
            self.close()
            if create_size is not None:
                self.unlink()
            raise

    def close(self) -> None:
        """Unmaps; views into the segment must be dropped first (else the mmap stays open)."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # numpy views still alive; the mapping goes when they do
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Removes the name (creator only, once); live mappings stay valid until closed."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class SidecarExited(SidecarUnavailable):
    """The sidecar's end of the control socket closed: it exited or was killed (not merely slow)."""


class ClientChannel:
    """A client's end of one slot: submit a request, wait for its answer."""

    def __init__(
        self,
        segment: Segment,
        layout: Layout,
        slot: int,
        *,
        doorbell_fd: int,
        wake_fd: int,
        control: socket.socket,
        epoch: int,
        timeout: float,
        spin_s: float,
    ) -> None:
        self.layout = layout
        self.header = HeaderView(segment.buf)
        self.slot = SlotView(segment.buf, layout, slot)
        self._doorbell_fd = doorbell_fd
        self._wake_fd = wake_fd
        self._epoch = epoch
        self._timeout_ns = int(timeout * 1e9)
        self._spin_s = spin_s
        self._seq = int(self.slot.req_seq[0])
        self._poller = select.poll()
        self._poller.register(wake_fd, select.POLLIN)
        self._poller.register(control, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._control_fd = control.fileno()
        # Poll in slices so that a hung (not dead) sidecar is noticed by its stale heartbeat.
        self._slice_ms = max(1, min(100, int(timeout * 1000) // 4))

    def submit(self) -> int:
        """Publishes the request already written into the slot; returns its sequence number."""
        slot = self.slot
        seq = self._seq + 1
        self._seq = seq
        full_fence()  # release: the request fields and query rows are visible before req_seq
        slot.req_seq[0] = seq
        full_fence()  # store req_seq, then load sidecar_sleeping (Dekker, see kalos.sync)
        if self.header.sidecar_sleeping[0]:
            try:
                os.eventfd_write(self._doorbell_fd, 1)
            except BlockingIOError:
                # The doorbell's counter is at its maximum (any client can write to it): it is
                # rung already, so the sidecar wakes; raising here would fail an honest recall
                # (tests/reliability/test_hostile.py, the doorbell saturation case).
                pass
        return seq

    def wait(self, seq: int) -> int:
        """Blocks until the response to ``seq`` is in the slot, then returns its status (0: the
        answer is in the slot; else an error code, the slot's message says more);
        SidecarUnavailable if none comes."""
        slot = self.slot
        resp_seq = slot.resp_seq
        clock = time.perf_counter
        spin_until = clock() + self._spin_s
        while resp_seq[0] != seq:
            if clock() >= spin_until:
                self._block(seq)
                break
        full_fence()  # acquire: resp_seq is read before the response fields and result rows
        return int(slot.status[0])

    def _block(self, seq: int) -> None:
        slot = self.slot
        while True:
            slot.client_sleeping[0] = 1
            full_fence()  # store client_sleeping, then load resp_seq (Dekker, see kalos.sync)
            if slot.resp_seq[0] == seq:
                slot.client_sleeping[0] = 0
                return
            events = self._poller.poll(self._slice_ms)
            slot.client_sleeping[0] = 0
            for fd, _event in events:
                if fd == self._control_fd:
                    raise SidecarExited("the sidecar closed the connection (it exited or was killed)")
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
            if slot.resp_seq[0] == seq:
                return
            self.check_alive()

    def check_alive(self) -> None:
        if int(self.header.epoch[0]) != self._epoch:
            raise SidecarUnavailable("the sidecar restarted while this request was in flight")
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
        self._columns = SlotColumns(segment.buf, layout)
        # What the sidecar last answered per slot: its own copy, never re-read from shared
        # memory, so a client scribbling on resp_seq cannot make the sidecar skip or repeat.
        self.answered = np.zeros(layout.n_slots, dtype=np.uint64)
        # What was answered when sleepers were last checked (answers the GPU writes by itself,
        # kalos.engine.slot_server, are seen here and their sleeping clients woken).
        self._woken = np.zeros(layout.n_slots, dtype=np.uint64)
        self.active = np.zeros(layout.n_slots, dtype=bool)
        self.wake_fds: list[int] = [-1] * layout.n_slots
        self.doorbell_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoch = epoch

    def stamp_heartbeat(self) -> None:
        self.header.heartbeat_ns[0] = time.monotonic_ns()

    def activate(self, slot: int, wake_fd: int) -> None:
        # The client chose this fd: make it non-blocking, or a blocking pipe or a saturated
        # blocking eventfd would stall the sweep for everyone in publish() (test_hostile.py).
        os.set_blocking(wake_fd, False)
        self.slots[slot].reset()
        self.answered[slot] = 0
        self._woken[slot] = 0
        self.wake_fds[slot] = wake_fd
        self.active[slot] = True

    def deactivate(self, slot: int) -> None:
        self.active[slot] = False
        fd, self.wake_fds[slot] = self.wake_fds[slot], -1
        if fd >= 0:
            os.close(fd)

    def free_slot(self) -> int | None:
        free = np.flatnonzero(~self.active)
        return int(free[0]) if len(free) else None

    def adopt_answered(self, answered: np.ndarray) -> None:
        """Keeps the record of answered sequence numbers in ``answered`` from now on (memory a
        GPU kernel that answers requests by itself also writes); the current record is copied."""
        if answered.shape != self.answered.shape or answered.dtype != self.answered.dtype:
            raise InvalidArgument(f"answered must be {self.answered.dtype}[{len(self.answered)}]")
        answered[:] = self.answered
        self.answered = answered

    def pending(self, handed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Slots with an unanswered request, and the req_seq seen for each; with ``handed``
        (while a GPU kernel serves the slots), only requests it handed to the host."""
        req_seq = self._columns.req_seq
        mine = (req_seq != self.answered) & self.active
        if handed is not None:
            mine &= req_seq == handed
        ready = np.flatnonzero(mine)
        if not len(ready):
            return ready, _NO_SEQS
        # An honest client does not touch its slot while its request is pending, so reading
        # req_seq a second time here yields the value compared above.
        seqs = req_seq[ready]
        full_fence()  # acquire: req_seq was read before the request fields and rows
        return ready, seqs

    def publish(self, slots: np.ndarray, seqs: np.ndarray) -> None:
        """Makes the answers already written into ``slots`` visible, waking sleepers."""
        full_fence()  # release: response fields and result rows before resp_seq
        for slot, seq in zip(slots.tolist(), seqs.tolist()):
            self.slots[slot].resp_seq[0] = seq
            self.answered[slot] = seq
            self._woken[slot] = seq
        full_fence()  # store resp_seq, then load client_sleeping (Dekker, see kalos.sync)
        self._wake(slots)

    def wake_answered(self) -> None:
        """Wakes the sleeping clients of answers written by someone else (a GPU kernel that
        stores ``resp_seq`` itself, then ``answered``)."""
        fresh = np.flatnonzero(self.answered != self._woken)
        if len(fresh):
            self._woken[fresh] = self.answered[fresh]
            full_fence()  # load answered (after its resp_seq), then load client_sleeping
            self._wake(fresh)

    def _wake(self, slots: np.ndarray) -> None:
        sleeping = self._columns.client_sleeping[slots]
        for slot in slots[sleeping != 0].tolist():
            fd = self.wake_fds[slot]
            if fd >= 0:
                try:
                    os.eventfd_write(fd, 1)
                except OSError:
                    # A wake fd that refuses the write (saturated, read-only, a full pipe) costs
                    # only its own client's wake-up; it must not take the sweep down (test_hostile.py).
                    pass

    def sleep(self, timeout_s: float, extra_fds: tuple[int, ...] = ()) -> None:
        """Blocks until a client rings the doorbell (or ``timeout_s``), unless work is pending."""
        self.header.sidecar_sleeping[0] = 1
        full_fence()  # store sidecar_sleeping, then load every req_seq (Dekker, see kalos.sync)
        try:
            if len(self.pending()[0]):
                return
            ready, _, _ = select.select([self.doorbell_fd, *extra_fds], [], [], timeout_s)
            if self.doorbell_fd in ready:
                try:
                    os.eventfd_read(self.doorbell_fd)
                except BlockingIOError:
                    pass
        finally:
            self.header.sidecar_sleeping[0] = 0

    def ring(self) -> None:
        """Wakes the sweep (used to stop the sidecar or to apply a slot change promptly)."""
        try:
            os.eventfd_write(self.doorbell_fd, 1)
        except BlockingIOError:
            pass  # saturated by a client: rung already

    def close(self) -> None:
        for slot in range(self.layout.n_slots):
            self.deactivate(slot)
        if self.doorbell_fd >= 0:
            os.close(self.doorbell_fd)
            self.doorbell_fd = -1
        self.slots = []
