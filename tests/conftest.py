"""Shared fixtures: a private runtime dir per test, sidecar and child-process bookkeeping, seeds.

Conventions (see also tests/reference.py):

* every test that starts a sidecar or a client gets its own ``KALOS_RUNTIME_DIR`` (a short
  directory under /tmp: Unix socket paths must stay under 108 bytes) and a unique sidecar
  name, so tests run beside other people's tests on the same machine;
* every process a test starts is killed (SIGKILL if SIGTERM did not end it) when the test
  ends, and the sidecar's /dev/shm segment is removed, whatever the test's outcome;
* random tests print their seed; ``KALOS_TEST_SEED=<n>`` replays one;
* no timing assertions: deadlines only turn a hang into a failure.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import numpy as np
import pytest

from kalos.server.launcher import SidecarProcess

DEADLINE_S = 60.0  # a hang guard, never a performance assertion


def import_interpreted(*modules: str) -> None:
    """Imports ``modules`` (Triton kernels, or triton itself) with ``TRITON_INTERPRET=1``: for
    tests without a CUDA GPU, which run the kernels under Triton's interpreter. @triton.jit reads
    the variable when it decorates, and triton.language decorates its own functions (tl.sum)
    when triton is first imported, so it must be set for those imports; it is put back after, so
    that child processes other tests start do not inherit it. A module that cannot be imported
    is left out: the tests that need it skip."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def short_tempdir(prefix: str = "k") -> str:
    """A fresh 0700 directory directly under /tmp (short enough for Unix socket paths)."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(path, 0o700)
    return path


def unique_name(tag: str = "t") -> str:
    return f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def segment_path(name: str) -> Path:
    return Path("/dev/shm") / f"kalos-{os.getuid()}-{name}"


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE_S, interval: float = 0.01) -> Any:
    """Polls ``predicate`` until it returns something truthy; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


NOBODY = 65534  # the unprivileged uid/gid the cross-user tests drop to


def run_guarded(cmd: list[str], timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to completion; a hang becomes an AssertionError (killed after ``timeout``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The whole session it leads: a child that inherited the pipes (a crowd's client) would
        # otherwise keep communicate() waiting for their end.
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} hung (killed after {timeout} s); stderr: {err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def in_forked_child(action: Callable[[], Any], *, prepare: Callable[[], None] = lambda: None,
                    meanwhile: Callable[[], None] = lambda: None) -> Any:
    """Runs ``action()`` in a forked child, after ``prepare()`` there; returns its JSON-able
    result. ``meanwhile()`` runs in the parent right after the fork. An exception in the child
    fails the calling test with the child's message; a child that hangs is killed by its alarm
    at DEADLINE_S, and says so (a hang guard, not a timing assertion)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_fd)
            signal.alarm(int(DEADLINE_S))
            prepare()
            os.write(write_fd, json.dumps({"result": action()}).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write_fd, json.dumps({"child_error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        meanwhile()
        with os.fdopen(read_fd, "rb") as pipe:
            data = pipe.read()
    finally:
        _, status = os.waitpid(pid, 0)
    assert data, f"the forked child hung or died (wait status {status})"
    reply = json.loads(data)
    assert "child_error" not in reply, reply["child_error"]
    return reply["result"]


def _become_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def as_nobody(action: Callable[[], Any]) -> Any:
    """Runs ``action()`` in a forked child with uid/gid NOBODY; returns its JSON-able result.

    An exception in the child fails the calling test with the child's message.
    """
    return in_forked_child(action, prepare=_become_nobody)


def _seed_value() -> int:
    return int(os.environ.get("KALOS_TEST_SEED", random.randrange(2**32)))


@pytest.fixture
def seed() -> int:
    value = _seed_value()
    print(f"random seed: {value} (replay with KALOS_TEST_SEED={value})")
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's own KALOS_RUNTIME_DIR (inherited by every child process it starts)."""
    path = short_tempdir("k")
    monkeypatch.setenv("KALOS_RUNTIME_DIR", path)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store_dir() -> Iterator[Path]:
    path = short_tempdir("ks")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


class SidecarPool:
    """Starts sidecars for one test and guarantees that none outlives it."""

    def __init__(self) -> None:
        self.started: list[SidecarProcess] = []
        self.names: set[str] = set()

    def start(self, store: str | os.PathLike[str], *, name: str, dim: int | None = None,
              extra_args: list[str] | tuple[str, ...] = (), ready_timeout: float = 120.0) -> SidecarProcess:
        self.names.add(name)
        proc = SidecarProcess(store, name=name, dim=dim, device="cpu", extra_args=list(extra_args),
                              ready_timeout=ready_timeout)
        self.started.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.started:
            try:
                proc.stop(timeout=10)
            finally:
                if proc.process.poll() is None:
                    proc.kill()
        for name in self.names:
            try:
                segment_path(name).unlink()
            except FileNotFoundError:
                pass


@pytest.fixture
def sidecars(runtime_dir: Path) -> Iterator[SidecarPool]:
    pool = SidecarPool()
    try:
        yield pool
    finally:
        pool.cleanup()


class ChildPool:
    """multiprocessing 'spawn' children of one test; every one is killed when the test ends."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.children: list[Any] = []

    def start(self, target: Callable[..., Any], *args: Any) -> Any:
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.children.append(proc)
        return proc

    def queue(self) -> Any:
        return self.ctx.Queue()

    def event(self) -> Any:
        return self.ctx.Event()

    def cleanup(self) -> None:
        for proc in self.children:
            if proc.is_alive():
                proc.join(timeout=5)
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.join(timeout=10)


@pytest.fixture
def children() -> Iterator[ChildPool]:
    pool = ChildPool()
    try:
        yield pool
    finally:
        pool.cleanup()


# -- reliability suites (tests/reliability): the --long switch --------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long", action="store_true", default=False,
        help="run the long versions of the reliability suites (tests/reliability): more kills, "
             "more clients, more fuzz examples; what RELIABILITY.md's numbers come from",
    )


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under ``pytest --long``."""
    return bool(request.config.getoption("--long"))


@pytest.fixture(scope="session")
def scale(long_run: bool) -> Callable[[Any, Any], Any]:
    """``scale(short, long)``: the CI value, or the --long one."""
    return lambda short, long: long if long_run else short


def in_two_event_loops(step: Callable[[int], Awaitable[Any]], rounds: int) -> list[str]:
    """``step(i)`` (a coroutine) ``rounds`` times in each of two threads, each thread running its
    own event loop by asyncio.run at the same time; returns the errors. A thread still running
    at DEADLINE_S is a hang (a hang guard, not a timing assertion)."""
    errors: list[str] = []
    started = threading.Barrier(2)

    def worker(offset: int) -> None:
        async def run() -> None:
            started.wait()
            for r in range(rounds):
                try:
                    await step(offset + r)
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    errors.append(f"{type(exc).__name__}: {exc}")
        asyncio.run(run())

    threads = [threading.Thread(target=worker, args=(k * 7,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "an async call hung with two event loops"
    return errors
