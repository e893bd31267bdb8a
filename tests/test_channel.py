"""The segment layout and the slot channel, exercised in one process.

The "sidecar" is a thread driving a real SidecarChannel over a real /dev/shm segment; each
"client" maps the segment a second time (as another process would) and drives a
ClientChannel. Covered: the layout arithmetic and header round trip, thousands of sequenced
requests with no lost or cross-delivered answer (spinning, sleeping and mixed waiters, a
sidecar that sleeps on its doorbell), and liveness: a stopped heartbeat, an epoch change and
a closed control socket each raise SidecarUnavailable instead of hanging.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
import stat
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import run_guarded

from kalos.errors import InvalidArgument, ProtocolMismatch, SidecarUnavailable
from kalos.ipc.channel import ClientChannel, SidecarChannel, wake_pair
from kalos.ipc.protocol import (
    HEADER_DTYPE,
    MAGIC,
    MESSAGE_BYTES,
    NAMESPACE_BYTES,
    REQUEST_DTYPE,
    RESPONSE_DTYPE,
    VERSION,
    SEQ_COUNTER_BITS,
    Layout,
    SlotColumns,
    SlotView,
    rest_seq,
)
from kalos.ipc.segment import Endpoint, Segment

DEADLINE_S = 60.0  # hang guard only
PAGE = mmap.PAGESIZE

# -- layout -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(n_slots=st.integers(1, 64), dim=st.integers(1, 4096), max_k=st.integers(1, 1024), max_batch=st.integers(1, 256))
def test_layout_offsets_are_aligned_and_disjoint(n_slots, dim, max_k, max_batch):
    layout = Layout(n_slots, dim, max_k, max_batch)
    assert layout.header_size % PAGE == 0 and layout.header_size >= HEADER_DTYPE.itemsize
    assert layout.slot_size % PAGE == 0
    offsets = [layout.request_offset, layout.response_offset, layout.queries_offset, layout.ids_offset,
               layout.scores_offset]
    assert all(o % 64 == 0 for o in offsets), offsets
    ends = [
        layout.request_offset + REQUEST_DTYPE.itemsize,
        layout.response_offset + RESPONSE_DTYPE.itemsize,
        layout.queries_offset + 4 * max_batch * dim,
        layout.ids_offset + 8 * max_batch * max_k,
        layout.scores_offset + 4 * max_batch * max_k,
    ]
    for end, next_start in zip(ends, offsets[1:]):
        assert end <= next_start, "areas overlap"
    assert ends[-1] <= layout.slot_size
    # The request and response lines never share a cache line.
    assert layout.response_offset >= 64 and layout.request_offset + REQUEST_DTYPE.itemsize <= layout.response_offset
    for slot in range(n_slots):
        assert layout.slot_offset(slot) == layout.header_size + slot * layout.slot_size
        assert layout.slot_offset(slot) % PAGE == 0
    assert layout.size == layout.header_size + n_slots * layout.slot_size


def test_slot_offset_out_of_range_is_a_protocol_error():
    layout = Layout(2, 4, 2, 1)
    for bad in (-1, 2, 100):
        with pytest.raises(ProtocolMismatch, match="outside"):
            layout.slot_offset(bad)


@settings(max_examples=50, deadline=None)
@given(n_slots=st.integers(1, 8), dim=st.integers(1, 300), max_k=st.integers(1, 300), max_batch=st.integers(1, 20),
       epoch=st.integers(1, 2**63 - 1), pid=st.integers(1, 2**31 - 1))
def test_header_round_trip(n_slots, dim, max_k, max_batch, epoch, pid):
    layout = Layout(n_slots, dim, max_k, max_batch)
    buf = memoryview(bytearray(layout.size))
    layout.write_header(buf, epoch=epoch, pid=pid)
    assert Layout.read_header(buf, source="test") == layout
    header = np.ndarray((), HEADER_DTYPE, buf, 0)
    assert int(header["magic"]) == MAGIC and int(header["version"]) == VERSION
    assert int(header["epoch"]) == epoch and int(header["sidecar_pid"]) == pid


def test_read_header_rejects_wrong_magic_version_sizes_and_short_buffers():
    layout = Layout(3, 16, 8, 4)

    def fresh() -> tuple[memoryview, np.ndarray]:
        buf = memoryview(bytearray(layout.size))
        layout.write_header(buf, epoch=5, pid=1)
        return buf, np.ndarray((), HEADER_DTYPE, buf, 0)

    buf, header = fresh()
    header["magic"] = 0x1234
    with pytest.raises(ProtocolMismatch, match=r"SRC: not a Kalos segment \(magic 0x1234"):
        Layout.read_header(buf, source="SRC")
    buf, header = fresh()
    header["version"] = VERSION + 1
    with pytest.raises(ProtocolMismatch, match=f"SRC: segment protocol version {VERSION + 1}"):
        Layout.read_header(buf, source="SRC")
    buf, header = fresh()
    header["slot_size"] = layout.slot_size + PAGE
    with pytest.raises(ProtocolMismatch, match="SRC: segment sizes disagree"):
        Layout.read_header(buf, source="SRC")
    buf, header = fresh()
    header["dim"] = 4096  # the declared slot size no longer follows from the declared numbers
    with pytest.raises(ProtocolMismatch, match="sizes disagree"):
        Layout.read_header(buf, source="SRC")
    buf, _ = fresh()
    with pytest.raises(ProtocolMismatch, match="sizes disagree"):
        Layout.read_header(buf[: layout.size - 1], source="SRC")
    with pytest.raises(ProtocolMismatch, match="too small"):
        Layout.read_header(buf[:64], source="SRC")


def test_slot_views_stay_inside_their_slot_and_messages_round_trip():
    layout = Layout(3, 5, 4, 2)
    buf = memoryview(bytearray(layout.size))
    layout.write_header(buf, epoch=1, pid=1)
    views = [SlotView(buf, layout, i) for i in range(3)]
    views[1].queries[:] = 1.0
    views[1].ids[:] = -1
    views[1].scores[:] = np.inf
    views[1].request_bytes[:] = 0xFF
    views[1].response_bytes[:] = 0xFF
    for other in (views[0], views[2]):
        assert not other.request_bytes.any() and not other.response_bytes.any()
        assert not other.queries.any() and not other.ids.any() and not other.scores.any()
    assert Layout.read_header(buf, source="t") == layout  # the header is untouched too
    views[1].reset()
    assert not views[1].request_bytes.any() and not views[1].response_bytes.any()
    views[0].write_message("é" * 500)
    assert len(views[0].read_message().encode()) <= MESSAGE_BYTES
    views[0].write_message("bad k")
    assert views[0].read_message() == "bad k"
    views[2].namespace[0] = b"ns"
    views[2].namespace_len[0] = 1000  # garbage length: clipped, never read past the field
    assert views[2].read_namespace() == b"ns"
    assert len(views[2].read_namespace()) <= NAMESPACE_BYTES
    columns = SlotColumns(buf, layout)
    views[2].req_seq[0] = 77
    assert columns.req_seq.tolist() == [0, 0, 77]


# -- segments ---------------------------------------------------------------------------------------


@pytest.fixture
def shm_name() -> Iterator[str]:
    yield f"kalos-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def _attach_copy(seg: Segment) -> Segment:
    """A second mapping of ``seg``, as a client gets it: its own descriptor, passed in the hello."""
    return Segment.attach(os.dup(seg.fileno()), source="the test's segment")


def test_segment_is_a_sealed_memfd_with_its_pages_reserved(shm_name):
    seg = Segment.create(shm_name, 3 * PAGE)
    try:
        st = os.fstat(seg.fileno())
        assert stat.S_IMODE(st.st_mode) & 0o077 == 0 and st.st_uid == os.getuid()
        assert os.readlink(f"/proc/self/fd/{seg.fileno()}") == f"/memfd:{shm_name} (deleted)"
        assert not os.path.exists(f"/dev/shm/{shm_name}")  # nameless: nothing to squat or unlink
        assert st.st_blocks * 512 >= 3 * PAGE, "the pages were not reserved at creation"
        assert len(seg.buf) == 3 * PAGE and seg.created
        other = _attach_copy(seg)
        assert not other.created and len(other.buf) == 3 * PAGE
        other.buf[10] = 42
        assert seg.buf[10] == 42
        # Issue 19, item 12: whoever holds the segment can no longer resize it, so nobody's
        # mapping can fault (SIGBUS) on a page past a new end.
        for size in (0, PAGE, 4 * PAGE):
            with pytest.raises(PermissionError):
                os.ftruncate(other.fileno(), size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(other.fileno(), fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        seg.buf[-1] = 7  # the last page is still there
        other.close()
        other.close()  # idempotent
    finally:
        seg.close()


def test_a_view_that_outlives_its_segment_stays_readable(tmp_path):
    """A NumPy view of the segment that outlives Segment.close() (a traceback's frame holding a
    slot's words, formatted with its locals after the sidecar died) keeps the pages mapped.
    close() used to unmap by force, which NumPy's views do not stop: reading one killed the
    process with SIGSEGV. (In a child process, so that a crash fails this test alone.)"""
    script = tmp_path / "outlive.py"
    script.write_text(
        "import numpy as np\n"
        "from kalos.ipc.segment import Segment\n"
        "seg = Segment.create('kalos-test-outlive', 4096)\n"
        "view = np.ndarray((4,), np.uint64, seg.buf, 64)\n"
        "view[:] = 7\n"
        "seg.close()\n"
        "seg.close()\n"
        "print(int(view.sum()))\n"
    )
    result = run_guarded([sys.executable, str(script)])
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.strip() == "28"


def test_attaching_refuses_an_unsealed_file(tmp_path):
    """A file anyone holding it may truncate would kill this client with SIGBUS: refused."""
    fd = os.memfd_create("kalos-test-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, PAGE)
    with pytest.raises(ProtocolMismatch, match="not sealed against resizing"):
        Segment.attach(fd, source="SRC")
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, PAGE)
    with pytest.raises(ProtocolMismatch, match="SRC is not sealed"):
        Segment.attach(plain, source="SRC")


def test_attaching_to_an_empty_segment_is_a_kalos_error():
    """A 0-byte segment (a sidecar killed between creating and sizing it) is a ProtocolMismatch,
    not the bare ValueError of mmap ("cannot mmap an empty file")."""
    fd = os.memfd_create("kalos-test-empty", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    with pytest.raises(ProtocolMismatch, match="too small"):
        Segment.attach(fd, source="SRC")


def test_endpoint_names_are_validated(runtime_dir):
    for bad in ("", "a/b", "../x", "x" * 65, "-lead", "sp ace"):
        with pytest.raises(InvalidArgument):
            Endpoint(bad)
    ep = Endpoint("ok_name.1-2")
    assert ep.socket_path.parent == runtime_dir and ep.segment_name == f"kalos-{os.getuid()}-ok_name.1-2"


# -- the channel in one process --------------------------------------------------------------------


class Harness:
    """A segment, a SidecarChannel driven by a thread, and ClientChannels on a second mapping."""

    def __init__(self, name: str, *, n_slots: int = 4, dim: int = 4, max_k: int = 4, max_batch: int = 2,
                 epoch: int = 0x5EED) -> None:
        self.layout = Layout(n_slots, dim, max_k, max_batch)
        self.epoch = epoch
        self.segment = Segment.create(name, self.layout.size)
        self.layout.write_header(self.segment.buf, epoch=epoch, pid=os.getpid())
        self.side = SidecarChannel(self.segment, self.layout, epoch=epoch)
        self.side.stamp_heartbeat()
        self.client_segment = _attach_copy(self.segment)  # a second mapping, as another process has
        self.clients: list[ClientChannel] = []
        self._socks: list[socket.socket] = []
        self.peers: list[socket.socket] = []
        self.stop = threading.Event()
        self.beat = threading.Event()
        self.beat.set()
        self.answer = threading.Event()
        self.answer.set()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def add_client(self, *, timeout: float = 30.0, spin_s: float = 0.0, crowded: str = "nap") -> ClientChannel:
        slot = len(self.clients)
        theirs, wake = wake_pair()
        self._socks.append(wake)
        self.side.activate(slot, theirs)  # the sidecar closes its end when the slot is freed
        ours, theirs = socket.socketpair()
        self._socks.append(ours)
        self.peers.append(theirs)
        channel = ClientChannel(
            self.client_segment, self.layout, slot, wake=wake,
            control=ours, epoch=self.epoch, timeout=timeout, spin_s=spin_s, crowded=crowded,
        )
        self.clients.append(channel)
        return channel

    def serve(self, *, sleep_when_idle: bool, sleep_timeout_s: float = 30.0,
              on_request: Callable[[int, int], None] | None = None) -> None:
        """Starts the sidecar thread (echo server) and a heartbeat thread."""

        def heartbeat() -> None:
            while not self.stop.wait(0.01):
                if self.beat.is_set():
                    self.side.stamp_heartbeat()

        def sweep() -> None:
            try:
                while not self.stop.is_set():
                    if not self.answer.is_set():
                        self.stop.wait(0.005)
                        continue
                    slots, seqs = self.side.pending()
                    if len(slots):
                        for slot, seq in zip(slots.tolist(), seqs.tolist()):
                            if on_request is not None:
                                on_request(slot, seq)
                            view = self.side.slots[slot]
                            n = int(view.n_queries[0])
                            for row in range(n):
                                view.ids[row, 0] = int(view.queries[row, 0])  # the request's token
                                view.ids[row, 1] = slot
                                view.ids[row, 2] = seq
                                view.scores[row, 0] = view.queries[row, 1]
                            view.n_results[0] = n
                            view.status[0] = 0
                        self.side.publish(slots, seqs)
                    elif sleep_when_idle:
                        self.side.sleep(timeout_s=sleep_timeout_s)
                    else:
                        time.sleep(0)
            except BaseException as exc:  # surfaced by close()
                self.errors.append(exc)

        for target, name in ((heartbeat, "heartbeat"), (sweep, "sweep")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        self.stop.set()
        if not self.side.closed:
            self.side.ring()
        for thread in self.threads:
            thread.join(timeout=DEADLINE_S)
        self.clients.clear()
        self.side.close()
        for sock in self._socks + self.peers:
            sock.close()
        self.client_segment.close()
        self.segment.close()
        if self.errors:
            raise self.errors[0]


@pytest.fixture
def harness(shm_name) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(**kwargs) -> Harness:
        h = Harness(shm_name, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@contextmanager
def fast_thread_switches() -> Iterator[None]:
    """A spinning waiter holds the GIL for a whole switch interval; make that short."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_clients(h: Harness, n_requests: int, *, tokens_base: int = 1) -> list[float]:
    """Each client thread sends ``n_requests`` sequenced requests; returns the worst wait seen."""
    failures: list[str] = []
    worst: list[float] = []

    def client_thread(ci: int, channel: ClientChannel) -> None:
        slot = channel.slot
        longest = 0.0
        try:
            for r in range(n_requests):
                token = tokens_base + ci * 1_000_000 + r  # exact in float32 (< 2**24)
                rows = 1 + (r % h.layout.max_batch)
                slot.op[0] = 1
                slot.n_queries[0] = rows
                for row in range(rows):
                    slot.queries[row, 0] = token + row
                    slot.queries[row, 1] = ci
                started = time.monotonic()
                seq = channel.submit()
                status = channel.wait(seq)
                longest = max(longest, time.monotonic() - started)
                if status != 0 or int(slot.n_results[0]) != rows:
                    failures.append(f"client {ci} request {r}: status {status} n {int(slot.n_results[0])}")
                    return
                for row in range(rows):
                    got = (int(slot.ids[row, 0]), int(slot.ids[row, 1]), int(slot.ids[row, 2]), float(slot.scores[row, 0]))
                    if got != (token + row, slot.index, seq, float(ci)):
                        failures.append(f"client {ci} request {r} row {row}: got {got}, expected "
                                        f"{(token + row, slot.index, seq, float(ci))}")
                        return
                if int(slot.resp_seq[0]) != seq:
                    failures.append(f"client {ci}: resp_seq moved past {seq} to {int(slot.resp_seq[0])}")
                    return
        except BaseException as exc:
            failures.append(f"client {ci} raised {type(exc).__name__}: {exc}")
        finally:
            worst.append(longest)

    threads = [threading.Thread(target=client_thread, args=(i, c), daemon=True) for i, c in enumerate(h.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE_S * 3)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert not failures, failures[:5]
    return worst


def test_thousands_of_requests_spinning_and_sleeping_clients(harness):
    h = harness(n_slots=6, max_batch=3)
    for spin in (50e-6, 0.0, 200e-6, 0.0, 20e-6, 0.0):
        h.add_client(spin_s=spin)
    h.serve(sleep_when_idle=False)
    with fast_thread_switches():
        run_clients(h, 1500)


def test_sleeping_sidecar_and_sleeping_clients_lose_no_wakeup(harness):
    """Both sides always sleep; a lost doorbell would stall a request for the sidecar's 30 s nap."""
    h = harness(n_slots=3, max_batch=2)
    for _ in range(3):
        h.add_client(spin_s=0.0)
    h.serve(sleep_when_idle=True, sleep_timeout_s=30.0)
    with fast_thread_switches():
        worst = run_clients(h, 700)
    # Generous liveness bound, not a performance assertion: a lost wake-up costs >= 30 s.
    assert max(worst) < 20.0, f"a request waited {max(worst):.1f} s: a doorbell was lost"


def test_napping_clients_need_no_wake_up_and_fall_back_to_sleep(harness):
    """Past two clients per core a client naps (timed sleeps, polling resp_seq) instead of
    announcing a sleep: an answer inside the nap window reaches it with no wake-up at all, and
    one that comes later reaches it through the announced sleep and the sidecar's ring."""
    h = harness(n_slots=3, max_batch=2)
    for _ in range(3):
        h.add_client(spin_s=0.0)
    rings: list[int] = []
    ring = h.side._ring
    late = set(range(5, 700, 50))  # these requests are answered past the nap window

    def counting_ring(slots):
        rings.extend(int(s) for s in slots)
        ring(slots)

    def on_request(slot: int, seq: int) -> None:
        h.side.header.clients[0] = 1_000_000  # what the clients read: far more than the cores
        if seq & ((1 << SEQ_COUNTER_BITS) - 1) in late:  # (the client's count: kalos.ipc.protocol.rest_seq)
            time.sleep(ClientChannel.NAP_WINDOW_S * 3)

    h.side._ring = counting_ring
    h.side.header.clients[0] = 1_000_000
    h.serve(sleep_when_idle=False, on_request=on_request)
    worst = run_clients(h, 700)
    assert max(worst) < 20.0
    # Sleeping clients would cost a ring for nearly every one of the 2,100 requests; napping
    # ones only for answers later than the window: the late ones, and others that the GIL of
    # this one-process harness delays (each late answer holds up its whole pass).
    assert 0 < len(rings) < 3 * 700 // 4, len(rings)


def test_crowded_clients_told_not_to_nap_sleep_at_once_and_lose_no_wake_up(harness, monkeypatch):
    """A CPU sidecar's clients (crowded "sleep"), past two per core, neither spin nor nap: each
    announces its sleep at once and is woken by the sidecar's ring; no answer is lost."""
    naps = []
    monkeypatch.setattr(ClientChannel, "_nap", lambda self, seq: naps.append(seq) or False)
    h = harness(n_slots=3, max_batch=2)
    for _ in range(3):
        h.add_client(spin_s=0.05, crowded="sleep")
    rings: list[int] = []
    ring = h.side._ring

    def counting_ring(slots):
        rings.extend(int(s) for s in slots)
        ring(slots)

    def on_request(slot: int, seq: int) -> None:
        h.side.header.clients[0] = 1_000_000  # what the clients read: far more than the cores
        time.sleep(0.0005)  # (a CPU pass: long enough for the client to be asleep)

    h.side._ring = counting_ring
    h.side.header.clients[0] = 1_000_000
    h.serve(sleep_when_idle=False, on_request=on_request)
    with fast_thread_switches():
        worst = run_clients(h, 300)
    assert max(worst) < 20.0
    assert not naps, "a client told not to nap napped"
    assert len(rings) > 900 // 2, len(rings)  # sleepers: a ring for most of the 900 answers


def test_clients_past_the_cores_spin_yielding_and_need_no_wake_up(harness, monkeypatch):
    """Between one client per core and two, a waiting client spins as before but yields its core
    at every look: an answer inside its spin budget needs no wake-up, and an answer later than
    the budget still arrives through the announced sleep and the ring."""
    yields = []
    real_yield = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: (yields.append(1), real_yield())[1])
    h = harness(n_slots=3, max_batch=2)
    cores = len(os.sched_getaffinity(0))
    mid = cores + 1  # past cores - 1 clients, not past 2 * cores
    for _ in range(3):
        h.add_client(spin_s=0.05)
    rings: list[int] = []
    ring = h.side._ring
    late = set(range(5, 300, 50))  # answered past the spin budget

    def counting_ring(slots):
        rings.extend(int(s) for s in slots)
        ring(slots)

    def on_request(slot: int, seq: int) -> None:
        h.side.header.clients[0] = mid
        if seq & ((1 << SEQ_COUNTER_BITS) - 1) in late:  # (the client's count: kalos.ipc.protocol.rest_seq)
            time.sleep(0.1)

    h.side._ring = counting_ring
    h.side.header.clients[0] = mid
    h.serve(sleep_when_idle=False, on_request=on_request)
    worst = run_clients(h, 300)
    assert max(worst) < 20.0
    assert yields, "a client past the cores spun without yielding"
    # Sleepers would cost a ring for nearly all 900 requests; yielding spinners only for the
    # answers later than their budget (each late answer holds up its whole pass).
    assert 0 < len(rings) < 900 // 4, len(rings)


def test_wait_policy_by_clients_per_core(harness):
    """Up to cores - 1 clients spin and keep their core; up to two per core they spin yielding
    it (AsyncClient does not spin then); past that they wait as the sidecar advised: nap, then
    sleep (a sweep on a GPU), sleep at once (a CPU sidecar), or go on spinning and yielding
    (the GPU's polling). An advice that is not one of those is refused."""
    h = harness(n_slots=4)
    channel = h.add_client(spin_s=0.25)
    sleeper = h.add_client(spin_s=0.25, crowded="sleep")
    yielder = h.add_client(spin_s=0.25, crowded="yield")
    cores = len(os.sched_getaffinity(0))
    for clients in (1, cores - 1, cores, 2 * cores):
        assert sleeper._budgets(clients) == channel._budgets(clients) == yielder._budgets(clients)
    assert sleeper._budgets(2 * cores + 1) == (0.0, False, False)
    assert yielder._budgets(2 * cores + 1) == yielder._budgets(1000) == (0.25, False, True)
    with pytest.raises(InvalidArgument, match="crowded must be one of yield, nap, sleep"):
        h.add_client(crowded="naps")
    assert channel._budgets(1) == (0.25, False, False)
    assert channel._budgets(cores - 1) == (0.25, False, False)
    assert channel._budgets(cores) == (0.25, False, True)
    assert channel._budgets(2 * cores) == (0.25, False, True)
    assert channel._budgets(2 * cores + 1) == (0.0, True, False)
    h.side.header.clients[0] = 1
    assert channel.spin_budget_s() == 0.25
    h.side.header.clients[0] = 2 * cores
    assert channel.spin_budget_s() == 0.0


def test_single_client_ping_pong_with_pauses(harness):
    """The sidecar falls asleep between requests (pauses), so every request must ring it."""
    h = harness(n_slots=1)
    channel = h.add_client(spin_s=0.0)
    h.serve(sleep_when_idle=True, sleep_timeout_s=30.0)
    slot = channel.slot
    for r in range(40):
        if r % 4 == 0:
            time.sleep(0.02)
        slot.n_queries[0] = 1
        slot.queries[0, 0] = 100 + r
        started = time.monotonic()
        status = channel.wait(channel.submit())
        assert time.monotonic() - started < 20.0, "a doorbell was lost"
        assert status == 0 and int(slot.ids[0, 0]) == 100 + r


def test_error_status_and_message_reach_the_client(harness):
    h = harness(n_slots=1)
    channel = h.add_client(spin_s=0.0)
    # Answer with an error by hand (no sweep thread): publish a status and message.
    slot = channel.slot
    seq = channel.submit()
    ready, seqs = h.side.pending()
    assert ready.tolist() == [0] and seqs.tolist() == [seq]
    view = h.side.slots[0]
    view.write_message("k=0 is out of range")
    view.status[0] = 2
    view.n_results[0] = 0
    h.side.publish(ready, seqs)
    status = channel.wait(seq)
    assert (status, int(slot.n_results[0]), slot.read_message()) == (2, 0, "k=0 is out of range")
    assert h.side.pending()[0].tolist() == []  # answered once, not again
    slot.resp_seq[0] = 12345  # a client scribbling on the sidecar's word changes nothing
    assert h.side.pending()[0].tolist() == []


def test_stopped_heartbeat_raises_sidecar_unavailable(harness):
    h = harness(n_slots=1)
    timeout = 0.3
    channel = h.add_client(timeout=timeout, spin_s=0.0)
    h.serve(sleep_when_idle=False)
    channel.slot.n_queries[0] = 1
    assert channel.wait(channel.submit()) == 0  # alive first
    h.answer.clear()  # hung: no answers...
    h.beat.clear()  # ...and no heartbeat
    started = time.monotonic()
    with pytest.raises(SidecarUnavailable, match="heartbeat"):
        channel.wait(channel.submit())
    assert time.monotonic() - started < timeout + 10.0


def test_slow_but_live_sidecar_is_waited_for(harness):
    h = harness(n_slots=1)
    channel = h.add_client(timeout=0.5, spin_s=0.0)
    h.serve(sleep_when_idle=False)
    h.answer.clear()  # slow: no answer for a while, but the heartbeat goes on
    channel.slot.n_queries[0] = 1
    channel.slot.queries[0, 0] = 9
    seq = channel.submit()
    timer = threading.Timer(1.5, h.answer.set)
    timer.start()
    try:
        status = channel.wait(seq)
    finally:
        timer.cancel()
    assert status == 0 and int(channel.slot.ids[0, 0]) == 9


def test_epoch_change_raises_sidecar_unavailable(harness):
    h = harness(n_slots=2)
    channel = h.add_client(timeout=5.0, spin_s=0.0)
    h.serve(sleep_when_idle=False)
    channel.slot.n_queries[0] = 1
    assert channel.wait(channel.submit()) == 0
    h.answer.clear()
    h.side.header.epoch[0] = h.epoch + 2  # a new sidecar took the segment over
    with pytest.raises(SidecarUnavailable, match="restarted"):
        channel.wait(channel.submit())
    with pytest.raises(SidecarUnavailable, match="restarted"):
        channel.check_alive()


def test_closed_control_socket_raises_sidecar_unavailable_at_once(harness):
    h = harness(n_slots=1)
    channel = h.add_client(timeout=30.0, spin_s=0.0)
    h.serve(sleep_when_idle=False)
    h.answer.clear()
    channel.slot.n_queries[0] = 1
    seq = channel.submit()
    threading.Timer(0.1, h.peers[0].close).start()  # the kernel closes it when the sidecar dies
    started = time.monotonic()
    with pytest.raises(SidecarUnavailable, match="closed the connection"):
        channel.wait(seq)
    assert time.monotonic() - started < 30.0, "should not have waited for the heartbeat timeout"


def test_deactivated_slot_is_not_swept_and_is_reset_for_the_next_owner(harness):
    h = harness(n_slots=2)
    channel = h.add_client(spin_s=0.0)
    channel.slot.n_queries[0] = 1
    seq = channel.submit()
    assert h.side.pending()[0].tolist() == [0]
    h.side.deactivate(0)  # the client died mid-request
    assert h.side.pending()[0].tolist() == []
    assert h.side.free_slot() == 0
    h.side.activate(0, wake_pair()[0])
    # At rest: the new generation's numbers, none of which the previous client could have used.
    rest = rest_seq(int(h.side.generation[0]))
    assert int(h.side.slots[0].req_seq[0]) == rest == int(h.side.slots[0].resp_seq[0]) == int(h.side.answered[0])
    assert seq == rest_seq(1) + 1 and rest > seq and rest & ((1 << SEQ_COUNTER_BITS) - 1) == 0
    assert h.side.pending()[0].tolist() == []


def test_a_slot_that_changed_hands_thousands_of_times_still_waits_for_its_own_answer(harness):
    # Past 4,096 hand-overs the rest seqs exceed 2**53, where a float no longer tells a number
    # from the next: a wait that compared through one would take the slot at rest for answered.
    h = harness(n_slots=1)
    h.side.generation[0] = 8192
    channel = h.add_client(timeout=0.5, spin_s=0.0)
    rest = int(channel.slot.resp_seq[0])
    channel.slot.n_queries[0] = 1
    seq = channel.submit()
    assert seq == rest + 1 and float(seq) == float(rest)
    with pytest.raises(SidecarUnavailable):  # nobody answers: no heartbeat, and no early return
        channel.wait(seq)
    h.side.stamp_heartbeat()
    h.side.publish(*h.side.pending(), h.side.pending_generations)
    assert channel.wait(seq) == 0


def test_a_client_rings_through_its_own_bell_and_a_closed_bell_is_no_longer_watched(harness):
    """A client's ring (a byte on its end of the pair) wakes the sleeping sidecar; once the
    client closes its end, the sidecar's end reads EOF for ever, so the sidecar stops waiting on
    it (or its every sleep would return at once, a core burnt), and the slot stays the client's."""
    h = harness(n_slots=2)
    theirs, ours_sock = wake_pair()
    ours = ours_sock.detach()
    h.side.activate(0, theirs)
    woke = threading.Event()

    def sleeper() -> None:
        h.side.sleep(DEADLINE_S)
        woke.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while h.side.header.sidecar_sleeping[0] != 1:  # until the sidecar sleeps
        assert time.monotonic() < deadline
        time.sleep(0.001)
    os.write(ours, b"\x01")
    assert woke.wait(DEADLINE_S), "a client's ring did not wake the sidecar"
    thread.join(DEADLINE_S)
    assert theirs.fileno() in h.side._bell_socks
    os.close(ours)
    h.side.sleep(DEADLINE_S)  # returns at once: EOF on the bell
    assert theirs.fileno() not in h.side._bell_socks, "a closed bell is still watched"
    assert h.side.active[0]
    h.side.deactivate(0)  # (its close must not trip over the bell that is no longer watched)
    assert theirs.fileno() == -1


def test_a_slot_changes_hands_at_rest_and_only_once_its_last_request_is_answered(harness):
    h = harness(n_slots=3)
    first = h.add_client(spin_s=0.0)
    first.slot.n_queries[0] = 1
    seq = first.submit()
    h.side.deactivate(0)  # the client died mid-request: the request stays unanswered
    def wake() -> socket.socket:  # (the channel closes a slot's wake socket when it is freed)
        return wake_pair()[0]

    # A GPU kernel may still hold that request: only a quiet slot is handed out meanwhile.
    assert h.side.take_slot(wake(), quiet_only=True) == 1
    h.side.deactivate(1)
    assert h.side.take_slot(wake(), quiet_only=True) == 1  # slot 1 never had a request
    h.side.publish(np.array([0]), np.array([seq], np.uint64))  # the late answer lands
    h.side.deactivate(1)
    assert h.side.take_slot(wake(), quiet_only=True) == 0
    # The newcomer counts on from the rest seq: its numbers are never the previous client's.
    assert int(h.side.slots[0].req_seq[0]) == rest_seq(int(h.side.generation[0])) > seq
    assert h.side.pending()[0].tolist() == []


def test_an_answer_is_not_published_to_a_slot_that_changed_hands_during_its_pass(harness):
    """A pass reads a request, its client leaves and another takes the slot before the pass
    publishes: the new client must not see the old client's answer as its own (issue 18)."""
    h = harness(n_slots=1)
    channel = h.add_client(spin_s=0.0)
    channel.slot.n_queries[0] = 1
    seq = channel.submit()
    slots, seqs = h.side.pending()
    generations = h.side.pending_generations
    assert slots.tolist() == [0] and seqs.tolist() == [seq]
    h.side.deactivate(0)  # the client died mid-request
    h.side.activate(0, wake_pair()[0])  # a new client got the slot
    rest = int(h.side.slots[0].resp_seq[0])
    newcomer_seq = rest + 1
    h.side.slots[0].req_seq[0] = newcomer_seq  # and sent its first request
    h.side.publish(slots, seqs, generations)
    assert int(h.side.slots[0].resp_seq[0]) == rest, "the old pass answered the newcomer's request"
    assert h.side.pending()[0].tolist() == [0], "the newcomer's request is still to be answered"
    h.side.publish(*h.side.pending(), h.side.pending_generations)
    assert int(h.side.slots[0].resp_seq[0]) == newcomer_seq


def test_the_sweeps_spin_sees_free_requests_only_and_releases_the_gil():
    """kalos.ipc._fence.spin_pending: True once a slot that is active and not busy holds an
    unanswered request; False at its timeout otherwise; and the GIL is free while it looks."""
    from kalos.ipc.sync import spin_pending

    if spin_pending is None:
        pytest.skip("the native extension is not built here (the sweep then spins in Python)")
    n = 8
    words = np.zeros((n, 4), np.uint64)
    req_seq = words[:, 1]  # strided, as the slots' column is
    answered = np.zeros(n, np.uint64)
    active = np.zeros(n, bool)
    busy = np.zeros(n, bool)
    assert spin_pending(req_seq, answered, active, busy, 1_000_000) is False
    req_seq[3] = 5  # a request in a slot nobody holds: not pending
    assert spin_pending(req_seq, answered, active, busy, 1_000_000) is False
    active[3] = True
    busy[3] = True  # its pass is in flight already
    assert spin_pending(req_seq, answered, active, busy, 1_000_000) is False
    busy[3] = False
    assert spin_pending(req_seq, answered, active, busy, 10_000_000_000) is True
    answered[3] = 5
    assert spin_pending(req_seq, answered, active, busy, 1_000_000) is False

    # A request that arrives while it looks ends the look. Storing it takes the GIL: held by
    # the look, the store would wait for its 30 s timeout, and the look would answer False.
    seen: list[bool] = []
    looker = threading.Thread(target=lambda: seen.append(spin_pending(req_seq, answered, active, busy, 30_000_000_000)))
    looker.start()
    time.sleep(0.2)
    req_seq[3] = 6
    looker.join(DEADLINE_S)
    assert seen == [True]

    for bad in ((req_seq, answered[:4], active, busy), (req_seq, answered, active.astype(np.int32), busy),
                (req_seq, answered.astype(np.uint32), active, busy)):
        with pytest.raises(ValueError, match="req_seq|answered|active|busy"):
            spin_pending(*bad, 1)


def test_the_sweeps_wait_for_a_kernels_word_ends_at_a_change_and_releases_the_gil():
    """kalos.ipc._fence.spin_changed: True once a word differs from what was seen; False at its
    timeout otherwise; and the GIL is free while it looks (the sweep's wait while the GPU polls)."""
    from kalos.ipc.sync import spin_changed

    if spin_changed is None:
        pytest.skip("the native extension is not built here (the sweep then yields its core)")
    host = np.zeros(12, np.int64)
    words = host[::2]  # strided: any 1-d view of 8-byte words
    seen = words.copy()
    assert spin_changed(words, seen, 1_000_000) is False
    seen[4] = -1
    assert spin_changed(words, seen, 10_000_000_000) is True
    seen[4] = 0

    # A word written while it looks ends the look. Writing it takes the GIL: held by the look,
    # the write would wait for its 30 s timeout, and the look would answer False.
    said: list[bool] = []
    looker = threading.Thread(target=lambda: said.append(spin_changed(words, seen, 30_000_000_000)))
    looker.start()
    time.sleep(0.2)
    host[6] = 1 << 62  # words[3]
    looker.join(DEADLINE_S)
    assert said == [True]

    misaligned = np.frombuffer(bytearray(8 * len(seen) + 1), np.int64, count=len(seen), offset=1)
    for bad in ((words, seen[:3]), (words.astype(np.int32), seen), (words, [0] * len(seen)), (misaligned, seen)):
        with pytest.raises((ValueError, TypeError), match="words|seen|bytes-like"):
            spin_changed(*bad, 1)


def test_the_sweep_waits_for_the_kernels_news_without_the_gil(monkeypatch):
    """SlotPolling.wait_for_kernel: returns once the kernel writes a host word (a round began,
    answered...) with the GIL free meanwhile, at its timeout otherwise; after one yield once the
    kernel has stopped (its queued rounds write nothing more), and with no kernel, no words seen
    or no native helper."""
    import types

    from kalos.ipc import sync
    from kalos.server.slot_polling import SlotPolling
    from kalos.server.state_lock import StateLock

    polling = SlotPolling(StateLock())
    assert polling.kernel_words() is None
    started = time.perf_counter()
    polling.wait_for_kernel(None, 30.0)  # (no kernel)
    assert time.perf_counter() - started < 10.0, "no kernel: one yield, not the 30 s timeout"
    polling.server = types.SimpleNamespace(host_words=np.zeros(40, np.int64), stopped=False)
    seen = polling.kernel_words()
    assert seen is not None and seen is not polling.server.host_words
    if sync.spin_changed is not None:
        started = time.perf_counter()
        polling.wait_for_kernel(seen, 0.05)
        assert time.perf_counter() - started >= 0.05, "nothing was written: it waits its timeout"
        threading.Timer(0.2, lambda: polling.server.host_words.__setitem__(33, 7)).start()
        started = time.perf_counter()
        polling.wait_for_kernel(seen, 30.0)
        assert time.perf_counter() - started < 10.0, "the kernel's word ended the wait, not the timeout"
        seen = polling.kernel_words()
    polling.server.stopped = True
    started = time.perf_counter()
    polling.wait_for_kernel(seen, 30.0)
    assert time.perf_counter() - started < 10.0, "a stopped kernel: one yield, not the timeout"
    polling.server.stopped = False
    monkeypatch.setattr(sync, "spin_changed", None)
    started = time.perf_counter()
    polling.wait_for_kernel(seen, 30.0)
    assert time.perf_counter() - started < 10.0, "no native helper: one yield, not the timeout"


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_pending_and_publish_natively_as_in_numpy(shm_name, monkeypatch, native):
    """The sweep's pending() and publish() find, publish and wake exactly what the words say,
    with the native helpers (kalos.ipc.sync) and without them: random slot states, then each
    state's expected answer worked out here, slot by slot."""
    from kalos.ipc import sync

    if native and sync.pending_slots is None:
        pytest.skip("the native extension is not built here")
    if not native:
        for name in ("pending_slots", "publish_slots", "same_rows"):
            monkeypatch.setattr(sync, name, None)
    layout = Layout(24, 4, 4, 2)
    segment = Segment.create(shm_name, layout.size)
    layout.write_header(segment.buf, epoch=1, pid=os.getpid())
    side = SidecarChannel(segment, layout, epoch=1)
    try:
        rng = np.random.default_rng(7)
        wake_fds = []
        for slot in range(layout.n_slots):
            theirs, ours = wake_pair()
            wake_fds.append(ours.detach())
            side.activate(slot, theirs)
        cols = side.columns
        for _round in range(40):
            active = rng.random(layout.n_slots) < 0.8
            side.active[:] = active
            cols.req_seq[:] = rng.integers(1, 4, layout.n_slots).astype(np.uint64)
            side.answered[:] = rng.integers(1, 4, layout.n_slots).astype(np.uint64)
            busy = rng.random(layout.n_slots) < 0.2
            expected = [s for s in range(layout.n_slots)
                        if active[s] and not busy[s] and cols.req_seq[s] != side.answered[s]]
            everyone = [s for s in range(layout.n_slots) if active[s] and cols.req_seq[s] != side.answered[s]]
            assert side.pending()[0].tolist() == everyone
            slots, seqs = side.pending(None, busy)
            assert slots.tolist() == expected, (slots.tolist(), expected)
            assert slots.dtype == np.int64, slots.dtype
            assert seqs.tolist() == cols.req_seq[expected].tolist() and seqs.dtype == np.uint64
            assert side.pending_generations.tolist() == side.generation[expected].tolist()
            if len(slots) < 2:
                continue
            generations = side.pending_generations.copy()
            moved = slots[rng.random(len(slots)) < 0.25]  # clients that left while the pass ran
            side.generation[moved] += 1
            cols.client_sleeping[:] = rng.random(layout.n_slots) < 0.5
            before = cols.resp_seq.copy()
            for fd in wake_fds:  # drain earlier rounds' wake-ups
                try:
                    os.read(fd, 4096)
                except BlockingIOError:
                    pass
            side.publish(slots, seqs, generations)
            kept = [s for s in slots.tolist() if s not in moved.tolist()]
            want = before.copy()
            want[kept] = cols.req_seq[kept]
            assert cols.resp_seq.tolist() == want.tolist()
            assert side.answered[kept].tolist() == cols.req_seq[kept].tolist()
            assert side._woken[kept].tolist() == cols.req_seq[kept].tolist()
            skipped = [s for s in slots.tolist() if s in moved.tolist()]
            assert (cols.resp_seq[skipped] == before[skipped]).all()
            rung = []
            for s, fd in enumerate(wake_fds):
                try:
                    os.read(fd, 4096)
                    rung.append(s)
                except BlockingIOError:
                    pass
            assert rung == [s for s in kept if cols.client_sleeping[s]]
        # Two crowds' words: alike (the row every slot holds comes back), then one slot's
        # namespace bytes differ.
        from kalos.server.recall_loop import _alike_row

        alike = np.array([3, 5, 9], np.int64)
        cols.kind[alike] = [1, 8, 1, 0]
        cols.namespace[alike] = b"team"
        kind, words = np.empty(4, np.uint32), np.empty(cols.namespace_words.shape[1], np.uint64)
        assert _alike_row(cols.kind, alike, kind).tolist() == [1, 8, 1, 0]
        assert _alike_row(cols.namespace_words, alike, words).tobytes().rstrip(b"\x00") == b"team"
        cols.namespace[9] = b"teal"
        assert _alike_row(cols.namespace_words, alike, words) is None
        assert _alike_row(cols.kind, alike[:1], kind).tolist() == [1, 8, 1, 0]
        cols.kind[3] = [1, 7, 1, 0]
        assert _alike_row(cols.kind, alike, kind) is None
    finally:
        side.close()  # (the segment stays mapped: a failed assertion's report reads these views)
    if native:  # what the helpers refuse, by name, before touching anything
        with pytest.raises(ValueError, match="outside"):
            sync.same_rows(np.zeros(4, np.uint64), np.array([4], np.int64))
        with pytest.raises(ValueError, match="a row's 8 bytes"):
            sync.same_rows(np.zeros(4, np.uint64), np.array([1], np.int64), np.zeros(1, np.uint32))
        with pytest.raises(ValueError, match="uint64"):  # raw integer bits into floats: refused
            sync.pending_slots(np.zeros(4, np.uint64), np.zeros(4, np.uint64), np.zeros(4, bool), np.zeros(4, bool),
                               np.zeros(4, np.int64), np.zeros(4, np.float64))
        frozen = np.zeros(4, np.uint64)
        frozen.flags.writeable = False
        with pytest.raises((ValueError, BufferError), match="writable|read-only|not writable"):
            sync.publish_slots(np.array([1], np.int64), np.ones(1, np.uint64), None, np.zeros(4, np.uint64),
                               frozen, np.zeros(4, np.uint64), np.zeros(4, np.uint64), np.zeros(4, np.uint32),
                               np.zeros(4, np.int64))
        assert not frozen.any()
        with pytest.raises(ValueError, match="int64"):
            sync.same_rows(np.zeros(4, np.uint64), np.array([1], np.int32))
        with pytest.raises(ValueError, match="one item per slot"):
            sync.pending_slots(np.zeros(4, np.uint64), np.zeros(3, np.uint64), np.zeros(4, bool), np.zeros(4, bool),
                               np.zeros(4, np.int64), np.zeros(4, np.uint64))
        with pytest.raises(ValueError, match="outside"):
            sync.publish_slots(np.array([-1], np.int64), np.zeros(1, np.uint64), None, np.zeros(4, np.uint64),
                               np.zeros(4, np.uint64), np.zeros(4, np.uint64), np.zeros(4, np.uint64),
                               np.zeros(4, np.uint32), np.zeros(4, np.int64))
