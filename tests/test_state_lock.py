"""The sidecar's state lock (kalos.server.state_lock): a writer waiting for it goes before the
sweep's next pass, and it is a plain lock otherwise."""
from __future__ import annotations

import threading
import time

import pytest

from kalos.server.state_lock import StateLock


def _wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def test_a_waiting_writer_goes_before_the_sweeps_next_pass():
    lock = StateLock()
    lock.writers_first_s = 30.0  # (however slow this machine: the writer's turn comes first)
    order: list[str] = []
    lock.acquire()  # the sweep's current pass
    writer = threading.Thread(target=lambda: (lock.acquire(), order.append("writer"), lock.release()))
    writer.start()
    _wait_until(lambda: lock.waiting == 1, "the writer waits")

    def next_pass() -> None:
        with lock.for_sweep():
            order.append("sweep")

    sweep = threading.Thread(target=next_pass)
    sweep.start()
    time.sleep(0.05)  # the next pass is ready too, and must not take the lock first
    assert order == []
    lock.release()
    writer.join(10)
    sweep.join(10)
    assert order == ["writer", "sweep"]
    assert lock.waiting == 0 and not lock.locked()


def test_writers_are_served_while_the_sweep_takes_the_lock_back_to_back():
    lock = StateLock()
    stop = threading.Event()
    passes = [0]

    def sweep() -> None:
        while not stop.is_set():
            with lock.for_sweep():
                passes[0] += 1
                deadline = time.perf_counter() + 50e-6
                while time.perf_counter() < deadline:  # a pass's work, holding the GIL
                    pass

    thread = threading.Thread(target=sweep)
    thread.start()
    try:
        _wait_until(lambda: passes[0] > 10, "the sweep runs")
        for _ in range(50):
            assert lock.acquire(timeout=10), "a writer starved behind the sweep"
            lock.release()
        before = passes[0]
        _wait_until(lambda: passes[0] > before, "the sweep runs again after the writers")
    finally:
        stop.set()
        thread.join(10)


def test_is_a_plain_lock_without_waiters():
    lock = StateLock()
    assert lock.acquire(blocking=False) and lock.locked()
    assert not lock.acquire(blocking=False)
    assert not lock.acquire(timeout=0.01)
    with pytest.raises(ValueError, match="timeout"):
        lock.acquire(blocking=False, timeout=1.0)
    lock.release()
    with lock:
        assert lock.locked()
    with lock.for_sweep():
        assert lock.locked()
    assert not lock.locked() and lock.waiting == 0
