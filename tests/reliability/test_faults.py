"""Issue 19, items 7-10: faults of the same user (kill -9 and damaged files, an engine that fails
after the commit, a connection cut off mid-add, a stopped sidecar).

* Item 7: kill -9, then the store's -wal deleted or one byte of it flipped. SQLite then opens
  what the db file holds without a word (the review's sidecar started with 0 of 20,000
  acknowledged rows, and doctor said "integrity ok"). The restart must refuse, naming what is
  missing; doctor must flag it; and an idle sidecar checkpoints, so a WAL lost after a pause
  costs nothing.
* Item 8: a vector damaged on disk (one flipped exponent bit, a NaN) must never be served.
* Item 9: an add whose engine allocation (or write) fails after the store committed must leave
  nothing stored; an add whose reply is lost is retried by the client without a duplicate; an
  add that a stopped sidecar commits after the client gave up can be retried with its request id.
* Item 10: a 30 MB add to a SIGSTOPped sidecar fails within its timeout.

No timing assertions: every wait has a hang guard (DEADLINE_S, or 2 x timeout + 10 s).
"""
from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from conftest import DEADLINE_S, unique_name, wait_until

from kalos import Client, InvalidArgument, ServerError, SidecarUnavailable
from kalos.engine import NumpyEngine
from kalos.ipc.control import ConnectionClosed
from kalos.server.operations import ControlServer
from kalos.server.sidecar import Sidecar, SidecarConfig
from kalos.store.sqlite import Store
from kalos.tools.doctor import PROBLEM, check_store
from kalos.validation import normalise_rows

DIM = 16


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    return normalise_rows(rng.standard_normal((n, DIM)).astype(np.float32), what="v", error=InvalidArgument)


def ack_path(path: Path) -> Path:
    """The store's record of acknowledged writes (kalos.store.ack.ack_path), spelt out."""
    return Path(f"{path}-ack")


def _count(path: Path) -> int:
    with Store.open(path, readonly=True) as store:
        return store.count()


def _in_thread(call: Any, guard_s: float) -> Any:
    """``call()`` in a thread; its result or exception, or AssertionError if it hangs past ``guard_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(guard_s)
    if thread.is_alive():
        return AssertionError(f"the call hung for more than {guard_s} s")
    return box.get("error", box.get("value"))


# -- item 7: a lost or damaged WAL --------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["wal deleted", "wal byte flipped"])
def test_acknowledged_rows_lost_with_the_wal_are_detected(sidecars, store_dir, monkeypatch, rng, damage):
    monkeypatch.setenv("KALOS_CHECKPOINT_IDLE_S", "0")  # no idle checkpoint: the rows stay in the WAL
    name = unique_name("wal")
    path = store_dir / "w.db"
    proc = sidecars.start(path, name=name, dim=DIM)
    acknowledged = 0
    with Client(name, timeout=10.0) as client:
        for _ in range(20):
            acknowledged += len(client.add(_unit(rng, 100), texts=[f"t{i}" for i in range(100)]))
    proc.kill()  # kill -9: no clean close, so nothing checkpoints the WAL
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 0
    if damage == "wal deleted":
        wal.unlink()
    else:
        with open(wal, "r+b") as f:
            f.seek(wal.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    lost = acknowledged - _count(path)
    assert lost > 0, "the damage should have cost rows (the test's premise)"
    print(f"RELIABILITY lost-wal ({damage}): {lost:,} of {acknowledged:,} acknowledged rows gone from the store")

    # The restart refuses, naming what is missing and the way out.
    with pytest.raises(SidecarUnavailable) as refused:
        sidecars.start(path, name=name, dim=DIM)
    message = str(refused.value)
    print(f"RELIABILITY lost-wal ({damage}) refusal: {message[message.find('store '):][:400]}")
    assert "lost acknowledged writes" in message and f"ids up to {acknowledged:,}" in message, message
    assert str(ack_path(path)) in message, message
    # Doctor flags it (SQLite's own integrity check passes such a store).
    findings, _dim = check_store(path)
    assert any(f.status == PROBLEM and "lost acknowledged writes" in f.message for f in findings), findings
    # The remedy it names works: with the record moved away, what is left is served.
    os.rename(ack_path(path), f"{ack_path(path)}.moved")
    sidecars.start(path, name=name, dim=DIM)
    with Client(name, timeout=10.0) as client:
        assert client.stats()["count"] == acknowledged - lost


def test_an_idle_sidecar_checkpoints_so_a_lost_wal_costs_nothing(sidecars, store_dir, monkeypatch, rng):
    monkeypatch.setenv("KALOS_CHECKPOINT_IDLE_S", "0.2")
    name = unique_name("ckpt")
    path = store_dir / "c.db"
    proc = sidecars.start(path, name=name, dim=DIM)
    with Client(name, timeout=10.0) as client:
        for _ in range(10):
            client.add(_unit(rng, 100))
    wal = Path(f"{path}-wal")
    # The writes paused: the sidecar copies the WAL into the db file and truncates it.
    wait_until(lambda: wal.exists() and wal.stat().st_size == 0, "the idle checkpoint", timeout=20)
    proc.kill()
    wal.unlink()
    sidecars.start(path, name=name, dim=DIM)
    with Client(name, timeout=10.0) as client:
        assert client.stats()["count"] == 1000


# -- item 8: damaged vectors ----------------------------------------------------------------------


def test_damaged_vectors_are_quarantined_never_served(sidecars, store_dir, rng):
    name = unique_name("bad")
    path = store_dir / "b.db"
    proc = sidecars.start(path, name=name, dim=DIM)
    units = _unit(rng, 500)
    with Client(name, timeout=10.0) as client:
        ids = client.add(units)
    proc.stop()
    flipped, nan = int(ids[10]), int(ids[20])
    db = sqlite3.connect(path)
    for item_id, damage in ((flipped, "exponent"), (nan, "nan")):
        vector = np.frombuffer(db.execute("SELECT vector FROM items WHERE id = ?", (item_id,)).fetchone()[0], "<f4").copy()
        if damage == "exponent":
            bits = vector.view("<u4")
            bits[0] ^= 1 << 30  # one bit of the exponent: a component of about 1e37
        else:
            vector[0] = np.nan
        db.execute("UPDATE items SET vector = ? WHERE id = ?", (vector.tobytes(), item_id))
    db.commit()
    db.close()

    proc = sidecars.start(path, name=name, dim=DIM)
    assert "2 damaged item(s) quarantined" in proc.ready_line, proc.ready_line
    good = np.ones(len(ids), dtype=bool)
    good[[10, 20]] = False
    with Client(name, timeout=10.0) as client:
        stats = client.stats()
        assert stats["count"] == 498 and stats["quarantined"] == 2
        assert sorted(stats["quarantined_ids"]) == sorted([flipped, nan])
        assert client.get([flipped])[0] is not None  # kept in the store, only not served
        for q in _unit(rng, 200):
            hits = client.recall(q, k=5)
            assert flipped not in hits.ids and nan not in hits.ids
            assert hits.ids[0] == ids[good][int(np.argmax(units[good] @ q))]
    log = proc.log()
    assert "quarantined 2 stored item(s)" in log and str(flipped) in log
    findings, _dim = check_store(path)
    problem = [f for f in findings if f.status == PROBLEM and "damaged vectors" in f.message]
    assert problem and str(flipped) in problem[0].message and str(nan) in problem[0].message, findings


# -- item 9: an add that fails after its commit; a lost reply ------------------------------------------


class _FaultyEngine(NumpyEngine):
    """A NumPy engine whose growth (allocation) or row write fails on demand."""

    fail_resize = False
    fail_write = False

    def _resize(self, capacity: int) -> None:
        if self.fail_resize:
            raise MemoryError(f"injected: cannot allocate {capacity} rows")
        super()._resize(capacity)

    def _write(self, rows: slice, vectors: np.ndarray) -> None:
        if self.fail_write:
            raise RuntimeError("injected: the engine failed to write the rows")
        super()._write(rows, vectors)


class _InProcess:
    """A sidecar served by a thread of the test process, with a faulty engine."""

    def __init__(self, path: Path, name: str) -> None:
        self.engines: list[_FaultyEngine] = []

        def factory(_device: str, dim: int, capacity: int) -> _FaultyEngine:
            engine = _FaultyEngine(dim, capacity=capacity)
            self.engines.append(engine)
            return engine

        self.sidecar = Sidecar(SidecarConfig(store=path, name=name, dim=DIM, slots=4), engine_factory=factory)
        self.thread = threading.Thread(target=self.sidecar.serve_forever, daemon=True)
        self.thread.start()

    @property
    def engine(self) -> _FaultyEngine:
        return self.engines[-1]

    def stop(self) -> None:
        self.sidecar.stop()
        self.thread.join(timeout=DEADLINE_S)
        assert not self.thread.is_alive()


@pytest.fixture
def in_process(runtime_dir: Path, store_dir: Path) -> Iterator[Any]:
    started: list[_InProcess] = []

    def start(path: Path, name: str) -> _InProcess:
        served = _InProcess(path, name)
        started.append(served)
        return served

    yield start
    for served in started:
        if served.thread.is_alive():
            served.stop()


@pytest.mark.parametrize("fault", ["allocation", "write"])
def test_an_add_the_engine_fails_stores_nothing(in_process, store_dir, rng, fault):
    name = unique_name("alloc")
    path = store_dir / "a.db"
    served = in_process(path, name)
    with Client(name, timeout=10.0) as client:
        first = client.add(_unit(rng, 100))
        # 1,000 more rows outgrow the engine's 1,024: the allocation happens in this add.
        setattr(served.engine, f"fail_{'resize' if fault == 'allocation' else 'write'}", True)
        batch = _unit(rng, 1000)
        with pytest.raises((ServerError, MemoryError)) as failed:
            client.add(batch)
        assert "injected" in str(failed.value)
        assert client.stats()["count"] == 100
        assert client.stats()["namespaces"]["default"] == 100  # the store holds nothing of it
        served.engine.fail_resize = served.engine.fail_write = False
        second = client.add(batch)  # the caller's retry stores it once
        assert client.stats()["namespaces"]["default"] == 1100
        hit = client.recall(batch[7], k=1)
        assert hit.ids[0] == second[7]
    served.stop()
    assert _count(path) == 1100
    restarted = in_process(path, unique_name("alloc"))
    assert len(restarted.engine) == 1100 and first[0] in restarted.engine


def test_an_add_whose_reply_is_lost_is_retried_without_a_duplicate(in_process, store_dir, rng, monkeypatch):
    name = unique_name("lost")
    path = store_dir / "l.db"
    in_process(path, name)
    real_add = ControlServer._handlers["add"]
    calls: list[int] = []

    def add_then_hang_up(control: ControlServer, message: dict, blob: bytearray) -> Any:
        reply = real_add(control, message, blob)  # committed and in the engine
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionClosed("injected: the connection broke before the reply")
        return reply

    monkeypatch.setitem(ControlServer._handlers, "add", add_then_hang_up)
    vectors = _unit(rng, 50)
    with Client(name, timeout=10.0) as client:
        ids = client.add(vectors)
        assert len(calls) == 2  # the client sent it again, with the same request id
        assert client.stats()["count"] == 50 and client.stats()["namespaces"]["default"] == 50
        assert client.recall(vectors[3], k=1).ids[0] == ids[3]


# -- items 9 and 10: a stopped sidecar ------------------------------------------------------------


def test_a_stopped_sidecar_fails_a_large_add_within_the_timeout_and_a_retry_stores_once(sidecars, store_dir, rng):
    name = unique_name("stop")
    path = store_dir / "s.db"
    proc = sidecars.start(path, name=name, dim=DIM)
    timeout = 1.0
    # Both connected (hello done) before the stop: the adds then go out on live connections.
    client, other = Client(name, timeout=timeout), Client(name, timeout=timeout)
    big = np.ones((500_000, DIM), np.float32)  # 32 MB: far more than the socket buffers hold
    small = _unit(rng, 100)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # Item 10: fails within the timeout (the guard: 2 x timeout + 10 s), as SidecarUnavailable.
        started = time.monotonic()
        outcome = _in_thread(lambda: client.add(big), 2 * timeout + 10)
        print(f"RELIABILITY stopped-sidecar: the 32 MB add failed after {time.monotonic() - started:.2f} s "
              f"(timeout {timeout:g} s): {outcome}")
        assert isinstance(outcome, SidecarUnavailable), outcome
        # A small add fits in the socket buffer: the stopped sidecar will commit it on SIGCONT.
        outcome = _in_thread(lambda: other.add(small), 2 * timeout + 10)
        assert isinstance(outcome, SidecarUnavailable), outcome
        request_id = getattr(outcome, "request_id", None)
        assert request_id and request_id in str(outcome), outcome
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # Item 9: the retry with the request id stores it at most once, whether the original
    # committed first or not.
    ids = client.add(small, request_id=request_id)
    wait_until(lambda: client.stats()["namespaces"]["default"] >= 100, "the add")
    assert client.add(small, request_id=request_id).tolist() == ids.tolist()
    assert client.stats()["namespaces"]["default"] == 100  # the 32 MB add, cut off, stored nothing
    other.close()
    client.close()
    proc.stop()
    assert _count(path) == 100


# -- the acknowledged-writes record itself ---------------------------------------------------------


def test_the_ack_record_refuses_an_older_copy_and_nothing_else(store_dir, rng):
    """No false alarm (a store deleted and made again at the same path, a torn record, a clean
    close), and an older copy of the store put back (a backup restored) is refused."""
    from kalos.errors import StoreError

    path = store_dir / "r.db"
    with Store.open(path, dim=DIM) as store:
        store.add(_unit(rng, 5), namespace="default")
    backup = store_dir / "backup.db"
    backup.write_bytes(path.read_bytes())  # closed cleanly: the db file holds everything
    backup.chmod(0o600)  # as the store's own (SQLite gives its -wal the db file's mode)
    with Store.open(path) as store:
        store.add(_unit(rng, 5), namespace="default")
        store.delete([1])
    with Store.open(path) as store:  # reopened: not refused
        assert store.count() == 9
    current = store_dir / "current.db"
    current.write_bytes(path.read_bytes())
    current.chmod(0o600)
    # The backup put back: it lacks two acknowledged writes.
    os.replace(backup, path)
    with pytest.raises(StoreError, match="lost acknowledged writes.*holds only 1 "):
        Store.open(path)
    with Store.open(path, readonly=True) as store:
        assert "lost acknowledged writes" in store.lost_writes()
    # The current copy back, and one of the record's two copies torn: the other one counts.
    os.replace(current, path)
    with open(ack_path(path), "r+b") as f:
        f.write(b"\xff" * 64)
    with Store.open(path) as store:
        assert store.count() == 9 and store.lost_writes() is None
    # The store deleted and created again at the same path: the old record is not its own.
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        p.unlink(missing_ok=True)
    with Store.open(path, dim=DIM) as store:
        assert store.count() == 0 and store.lost_writes() is None
