"""Suite 5 — security: owner-only files, other users kept out, no unpickling, bounded lengths, strict attach.

* The segment, the control socket and the store files are 0600, the runtime directory 0700.
* A process of another uid (root forks and drops to uid 65534; skipped when not root) can
  neither open/map the segment nor connect; with the socket opened up on purpose, the sidecar
  still refuses it by SO_PEERCRED, never hands it a slot, and survives foreign peers that hang
  up at once (the acceptor must not die: everyone else would be locked out).
* Nothing in the package unpickles: an AST scan finds no pickle/marshal/shelve/dill/
  cloudpickle/joblib import, no eval/exec/compile/__import__ call, and no np.load without
  allow_pickle=False or torch.load without weights_only=True.
* Every length is bounded before allocation: prefixes announcing 2^60 blob bytes or 4 GiB of
  JSON are refused with PROTOCOL and the connection dropped; prefixes announcing up to the
  limit (1 GiB) and then sending nothing cost the sidecar no memory beyond what arrives.
* Attaching to a segment with a wrong magic, version, sizes, length, or owner fails with a
  ProtocolMismatch that says which, directly and through Client() against a fake sidecar.
"""
from __future__ import annotations

import ast
import fcntl
import json
import os
import pwd
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from conftest import DEADLINE_S, NOBODY, as_nobody, short_tempdir, unique_name, wait_until

import kalos
from kalos import Client
from kalos.errors import ErrorCode, ProtocolMismatch, SidecarUnavailable
from kalos.ipc.control import PROTOCOL_VERSION, ok_reply, recv_frame, send_fd, send_frame
from kalos.ipc.protocol import HEADER_DTYPE, MAGIC, VERSION, Layout
from kalos.ipc.segment import Segment
from kalos.server.launcher import SidecarProcess
from reliability._support import raw_connection, rss_bytes, tracebacks

DIM = 8
_PREFIX = struct.Struct("<IQ")


def _start(sidecars: Any, store_dir: Path) -> tuple[str, Any, Client]:
    name = unique_name("sec")
    proc = sidecars.start(store_dir / "s.db", name=name, dim=DIM)
    client = Client(name, timeout=30.0)
    client.add(np.random.default_rng(0).standard_normal((50, DIM)).astype(np.float32))
    return name, proc, client


def test_segment_socket_and_store_are_owner_only(sidecars, store_dir, runtime_dir):
    name, proc, client = _start(sidecars, store_dir)
    try:
        seg = Path(f"/proc/self/fd/{client._conn.segment.fileno()}")  # the memfd the hello passed
        sock = runtime_dir / f"{name}.sock"
        checked = {}
        for path in (seg, sock, store_dir / "s.db", store_dir / "s.db-wal", store_dir / "s.db-shm"):
            st = os.stat(path)
            assert st.st_uid == os.getuid(), path
            checked[path.name] = oct(stat.S_IMODE(st.st_mode))
            assert stat.S_IMODE(st.st_mode) == 0o600, f"{path} is {stat.S_IMODE(st.st_mode):o}, not 600"
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
    finally:
        client.close()
    print(f"RELIABILITY security-modes: {checked} runtime_dir=0o700")


def _attempt(fn: Any) -> str:
    try:
        fn()
    except OSError as exc:
        return type(exc).__name__
    return "succeeded"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_uid_can_neither_map_nor_connect(sidecars, store_dir, runtime_dir):
    name, proc, client = _start(sidecars, store_dir)
    # The segment is a memfd: the only way to it by name is the sidecar's /proc/<pid>/fd entry.
    seg = next(f"/proc/{proc.pid}/fd/{fd}" for fd in os.listdir(f"/proc/{proc.pid}/fd")
               if os.readlink(f"/proc/{proc.pid}/fd/{fd}").startswith(f"/memfd:kalos-{os.getuid()}-{name}"))
    sock_path = str(runtime_dir / f"{name}.sock")
    try:
        def locked_out() -> dict:
            def connect() -> None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(sock_path)
                finally:
                    s.close()
            return {"open_rw": _attempt(lambda: os.close(os.open(seg, os.O_RDWR))),
                    "open_ro": _attempt(lambda: os.close(os.open(seg, os.O_RDONLY))),
                    "connect": _attempt(connect)}

        result = as_nobody(locked_out)
        assert result == {"open_rw": "PermissionError", "open_ro": "PermissionError", "connect": "PermissionError"}, result

        # Defence in depth: open the directory and the socket up; the sidecar checks the peer's uid.
        os.chmod(runtime_dir, 0o711)
        os.chmod(sock_path, 0o666)
        clients_before = client.stats()["clients"]

        def refused() -> dict:
            replies = []
            for attempt in range(3):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(DEADLINE_S)
                s.connect(sock_path)
                try:
                    if attempt:  # ask for a slot as well; the sidecar closes without reading it
                        send_frame(s, {"op": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid()})
                        send_fd(s, os.eventfd(0))
                    reply, _ = recv_frame(s, max_bytes=1 << 20)
                    closed = s.recv(1) == b""
                except (BrokenPipeError, ConnectionResetError):
                    # Unread data in the sidecar's buffer when it closed: the kernel resets the
                    # connection, which may overtake the refusal. Refused all the same.
                    reply, closed = {"ok": False, "code": int(ErrorCode.PROTOCOL), "error": "uid (reset)"}, True
                s.close()
                replies += [reply, {"closed": closed}]
            hangups = 0
            for _ in range(20):  # connect and hang up at once: the refusal's send then fails
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(sock_path)
                s.close()
                hangups += 1
            return {"replies": replies, "hangups": hangups}

        result = as_nobody(refused)
        for reply in result["replies"][0::2]:
            assert reply["ok"] is False and reply["code"] == ErrorCode.PROTOCOL and "uid" in reply["error"], reply
        assert all(r["closed"] for r in result["replies"][1::2])
        # The acceptor survived the hang-ups: new clients of the owner still get in.
        os.chmod(runtime_dir, 0o700)  # Client() insists on an owner-only runtime directory
        time.sleep(0.2)
        with Client(name, timeout=30.0) as fresh:
            assert fresh.stats()["count"] == 50
            assert len(fresh.recall(np.ones(DIM, np.float32), k=3)) == 3
        # No foreign attempt holds a slot (the fresh client's is freed once the sidecar sees it close).
        wait_until(lambda: client.stats()["clients"] == clients_before, "the slots to be back to the owner's", timeout=30)
    finally:
        os.chmod(runtime_dir, 0o700)
        if os.path.exists(sock_path):
            os.chmod(sock_path, 0o600)
        client.close()
    found = tracebacks(proc.log())
    assert not found, found[0]
    print(f"RELIABILITY security-uid: locked_out=open_rw,open_ro,connect refused_by_peercred=3 "
          f"hangups_survived={result['hangups']}")


# -- no unpickling ----------------------------------------------------------------------------------

_FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
_FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_nothing_in_the_package_unpickles_or_evaluates():
    root = Path(kalos.__file__).resolve().parent
    findings, files = [], 0
    for path in sorted(root.rglob("*.py")):
        files += 1
        tree = ast.parse(path.read_text(), filename=str(path))
        where = lambda node: f"{path.relative_to(root.parent)}:{node.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                findings += [f"{where(node)} imports {a.name}" for a in node.names
                             if a.name.split(".")[0] in _FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _FORBIDDEN_MODULES:
                findings.append(f"{where(node)} imports from {node.module}")
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in _FORBIDDEN_CALLS:
                    findings.append(f"{where(node)} calls {func.id}()")
                if isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name):
                    kwargs = {k.arg: k.value for k in node.keywords}
                    if func.value.id in ("np", "numpy"):
                        safe = kwargs.get("allow_pickle")
                        if not (isinstance(safe, ast.Constant) and safe.value is False):
                            findings.append(f"{where(node)} calls {func.value.id}.load without allow_pickle=False")
                    elif func.value.id == "torch":
                        safe = kwargs.get("weights_only")
                        if not (isinstance(safe, ast.Constant) and safe.value is True):
                            findings.append(f"{where(node)} calls torch.load without weights_only=True")
                    elif func.value.id == "yaml":
                        findings.append(f"{where(node)} calls yaml.load")
    assert files > 10
    assert not findings, findings
    print(f"RELIABILITY security-no-pickle: files_scanned={files} findings=0")


# -- bounded lengths --------------------------------------------------------------------------------


def test_oversized_and_unsent_lengths_allocate_nothing(sidecars, store_dir, runtime_dir):
    name, proc, client = _start(sidecars, store_dir)
    try:
        rss0 = rss_bytes(proc.pid)
        refused = 0
        for json_len, blob_len in ((2, 2**60), (2**32 - 1, 0), (2**32 - 1, 2**64 - 1), (16, (1 << 30) + 1),
                                   ((1 << 28) + 1, 0)):
            with raw_connection(runtime_dir, name) as s:
                s.sendall(_PREFIX.pack(json_len, blob_len))  # the prefix alone is refused
                reply, _ = recv_frame(s, max_bytes=1 << 20)
                assert reply["ok"] is False and reply["code"] == ErrorCode.PROTOCOL, reply
                assert "exceeds" in reply["error"], reply
                assert s.recv(1) == b"", "the connection stays open after a framing error"
                refused += 1
        # Within the limit (1 GiB) but never sent: memory must follow the bytes that arrive.
        body = json.dumps({"op": "add", "vectors": {"dtype": "float32", "shape": [1, DIM]}}).encode()
        held = []
        for _ in range(2):
            s = raw_connection(runtime_dir, name)
            s.sendall(_PREFIX.pack(len(body), (1 << 30) - 1) + body + b"\0" * 4096)
            held.append(s)
        time.sleep(0.5)  # the connection threads are now waiting for the rest of the blob
        assert client.stats()["count"] == 50
        grown = rss_bytes(proc.pid) - rss0
        for s in held:
            s.close()
        assert grown < 256 << 20, f"the sidecar grew by {grown >> 20} MiB for 2 announced-but-unsent 1 GiB blobs"
        with raw_connection(runtime_dir, name) as s:  # the sidecar is still in step with everyone
            send_frame(s, {"op": "stats"})
            assert recv_frame(s, max_bytes=1 << 20)[0]["ok"] is True
        assert proc.process.poll() is None
    finally:
        client.close()
    found = tracebacks(proc.log())
    assert not found, found[0]
    print(f"RELIABILITY security-lengths: oversized_prefixes_refused={refused} "
          f"unsent_1GiB_blobs=2 rss_growth_MiB={grown >> 20}")


# -- strict attach -----------------------------------------------------------------------------------


def _write_segment(layout: Layout, *, size: int | None = None, **overrides: int) -> int:
    """A sealed memfd holding a segment header with ``overrides``: what a (fake) sidecar passes."""
    total = layout.size if size is None else size
    fd = os.memfd_create("kalos-test-wrong", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, total)
    if total >= HEADER_DTYPE.itemsize:
        scratch = bytearray(HEADER_DTYPE.itemsize)
        layout.write_header(memoryview(scratch), epoch=7, pid=os.getpid())
        header = np.frombuffer(scratch, HEADER_DTYPE)[0].copy()
        for field, value in overrides.items():
            header[field] = value
        os.pwrite(fd, header.tobytes(), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


CASES = {
    "magic": ({"magic": int.from_bytes(b"NOTKALOS", "little")}, None, "not a Kalos segment"),
    "version": ({"version": VERSION + 1}, None, "protocol version"),
    "header size": ({"header_size": 64}, None, "sizes disagree"),
    "slot size": ({"slot_size": 4096 * 3 + 64}, None, "sizes disagree"),
    "slots beyond the file": ({"n_slots": 1 << 20}, None, "sizes disagree"),
    "truncated file": ({}, -4096, "sizes disagree"),
    "shorter than a header": ({}, 40, "too small"),
}


class _FakeSidecar:
    """Answers one hello like a sidecar would, passing ``segment`` (a descriptor): what Client()
    then attaches to."""

    def __init__(self, path: Path, segment: int, layout: Layout) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.segment, self.layout = segment, layout
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from kalos.ipc.control import recv_fd

        conn, _ = self.listener.accept()
        with conn:
            recv_frame(conn, max_bytes=1 << 20)
            os.close(recv_fd(conn))
            lay = self.layout
            send_frame(conn, ok_reply(slot=0, segment="fake", epoch=7, dim=lay.dim, max_k=lay.max_k,
                                      max_batch=lay.max_batch, n_slots=lay.n_slots))
            send_fd(conn, self.segment)
            conn.recv(1)  # until the client hangs up

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=DEADLINE_S)


@pytest.mark.parametrize("case", sorted(CASES))
def test_attaching_to_a_wrong_segment_is_a_clear_protocol_mismatch(runtime_dir, case):
    overrides, size, words = CASES[case]
    layout = Layout(2, DIM, 4, 2)
    name = unique_name("seg")
    total = None if size is None else (layout.size + size if size < 0 else size)
    fd = _write_segment(layout, size=total, **overrides)
    try:
        with pytest.raises(ProtocolMismatch, match=words) as direct:
            segment = Segment.attach(os.dup(fd), source="SRC")
            try:
                Layout.read_header(segment.buf, source=segment.source)
            finally:
                segment.close()
        assert "SRC" in str(direct.value)
        fake = _FakeSidecar(runtime_dir / f"{name}.sock", fd, layout)
        try:
            started = time.monotonic()
            with pytest.raises(ProtocolMismatch, match=words) as via_client:
                Client(name, timeout=5.0)
            assert time.monotonic() - started < 5.0 + 30.0
            assert f"segment of sidecar {name!r}" in str(via_client.value)
        finally:
            fake.close()
    finally:
        os.close(fd)
    print(f"RELIABILITY security-attach-{case.replace(' ', '-')}: {via_client.value}")


def test_a_client_refuses_a_segment_that_is_not_sealed(runtime_dir):
    """A segment that anyone holding it may truncate would kill the client with SIGBUS at its
    next access (issue 19, items 2 and 12): a client must never be killed by the library it
    imported, so it refuses to map one."""
    layout = Layout(2, DIM, 4, 2)
    name = unique_name("seal")
    fd = os.memfd_create("kalos-test-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, layout.size)
    scratch = bytearray(layout.header_size)
    layout.write_header(memoryview(scratch), epoch=7, pid=os.getpid())
    os.pwrite(fd, bytes(scratch), 0)
    fake = _FakeSidecar(runtime_dir / f"{name}.sock", fd, layout)
    try:
        with pytest.raises(ProtocolMismatch, match="not sealed against resizing"):
            Client(name, timeout=5.0)
    finally:
        fake.close()
        os.close(fd)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a segment to another user")
def test_a_segment_of_another_owner_is_refused(runtime_dir):
    layout = Layout(2, DIM, 4, 2)
    fd = _write_segment(layout)
    try:
        os.fchown(fd, NOBODY, NOBODY)
        with pytest.raises(ProtocolMismatch, match=f"belongs to uid {NOBODY}"):
            Segment.attach(os.dup(fd), source="SRC")
    finally:
        os.close(fd)


def test_a_client_without_a_sidecar_fails_fast_with_sidecar_unavailable(runtime_dir):
    started = time.monotonic()
    with pytest.raises(SidecarUnavailable, match="no sidecar"):
        Client(unique_name("none"), timeout=1.0)
    assert time.monotonic() - started < 1.0 + 30.0


# -- issue 19: files, directories and segments attacked by another user -----------------------------
#
# The attacker is uid NOBODY (a child process that dropped to it); where the victim must not be
# root (root may unlink anything, so some attacks only bite an ordinary user), the victim is a
# user made for the test with useradd and removed after it.

_NEEDS_ROOT = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
_SRC = str(Path(kalos.__file__).resolve().parent.parent)  # the kalos under test, for children


class _AsUser:
    """``target(channel, *args)`` in a forked child running as uid/gid (the interpreter's own
    path may be unreadable to other users, so no exec). ``channel`` has ``say(text)`` (a line
    to the parent) and ``hear()`` (a line from it); the return value comes back by :meth:`result`."""

    def __init__(self, uid: int, gid: int, target: Any, *args: Any, env: dict[str, str] | None = None) -> None:
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(up_r)
                os.close(down_w)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                os.environ.update(env or {})
                channel = _Channel(down_r, up_w)
                channel.say(json.dumps({"result": target(channel, *args)}))
                code = 0
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                os.write(up_w, (json.dumps({"child_error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
            finally:
                os._exit(code)
        os.close(up_w)
        os.close(down_r)
        self._channel = _Channel(up_r, down_w)

    def hear(self, timeout: float = DEADLINE_S) -> str:
        line = self._channel.hear(timeout)
        if line.startswith('{"child_error"'):
            raise AssertionError(json.loads(line)["child_error"])
        return line

    def say(self, text: str) -> None:
        self._channel.say(text)

    def result(self) -> Any:
        while True:
            line = self.hear()
            if line.startswith('{"result"'):
                self.wait()
                return json.loads(line)["result"]
            if not line:
                raise AssertionError("the child ended without a result")

    def wait(self) -> None:
        os.waitpid(self.pid, 0)
        self._channel.close()
        self._channel = None

    def kill(self) -> None:
        if self._channel is None:
            return  # it ended already (result())
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait()


class _Channel:
    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._read = os.fdopen(read_fd, "r")
        self._write = write_fd

    def say(self, text: str) -> None:
        os.write(self._write, (text + "\n").encode())

    def hear(self, timeout: float = DEADLINE_S) -> str:
        ready, _, _ = select.select([self._read], [], [], timeout)
        assert ready, "the child said nothing in time"
        return self._read.readline().strip()

    def close(self) -> None:
        self._read.close()
        os.close(self._write)


@pytest.fixture(scope="module")
def victim_user() -> Iterator[tuple[int, int]]:
    """(uid, gid) of an ordinary user made for these tests (useradd), removed afterwards."""
    if os.getuid() != 0:
        pytest.skip("needs root to create a second user (useradd)")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not installed: cannot create a second user")
    name = f"kv{uuid.uuid4().hex[:10]}"
    made = subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd could not create a user here: {made.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _own_dir(uid: int, gid: int, mode: int = 0o700) -> Path:
    path = Path(short_tempdir("kv"))
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


# A victim that starts a sidecar in-process, adds and recalls through a Client, and stops it;
# prints one JSON line. argv: store path, sidecar name.
_VICTIM = r"""
import json, sys, threading, numpy as np
from kalos import Client
from kalos.server.sidecar import Sidecar, SidecarConfig
sidecar = Sidecar(SidecarConfig(store=sys.argv[1], name=sys.argv[2], dim=8, device="cpu"))
thread = threading.Thread(target=sidecar.serve_forever)
thread.start()
try:
    with Client(sys.argv[2], timeout=10.0) as client:
        client.add(np.eye(8, dtype=np.float32))
        hits = client.recall(np.ones(8, np.float32), k=3)
finally:
    sidecar.stop()
    thread.join()
print(json.dumps({"hits": len(hits)}))
"""


def _victim(_channel: Any, store: str, name: str) -> dict:
    """What _VICTIM does, in a forked child (see _AsUser)."""
    from kalos.server.sidecar import Sidecar, SidecarConfig

    sidecar = Sidecar(SidecarConfig(store=store, name=name, dim=8, device="cpu"))
    thread = threading.Thread(target=sidecar.serve_forever)
    thread.start()
    try:
        with Client(name, timeout=10.0) as client:
            client.add(np.eye(8, dtype=np.float32))
            hits = client.recall(np.ones(8, np.float32), k=3)
    finally:
        sidecar.stop()
        thread.join()
    return {"hits": len(hits)}


def _flip(channel: Any, runtime: str, legit: str, evil: str, lock: str, target: str) -> None:
    os.symlink(target, os.path.join(evil, lock))
    os.symlink(legit, runtime)
    channel.say("ready")
    while True:  # flip the victim's runtime path between his directory and ours, as fast as we can
        for side, where in ((".a", legit), (".b", evil)):
            os.symlink(where, runtime + side)
            os.rename(runtime + side, runtime)


@_NEEDS_ROOT
def test_a_runtime_dir_flipped_by_another_user_truncates_nothing(store_dir):
    """Issue 19, item 1 (critical). Another user owns the runtime path (a symlink in sticky /tmp)
    and flips it between a 0700 directory of the victim, which passes a check that follows
    symlinks, and one of his own holding ``<name>.lock`` -> the victim's precious file. Before the
    fix the lock file was then opened through the flipped path, truncated and overwritten with a
    pid (the victim's memories.db, or for root any file). Now the runtime directory is opened once
    with O_NOFOLLOW and checked on its descriptor: the symlink is refused, the file is untouched."""
    name = unique_name("flip")
    victim_files = Path(short_tempdir("kvf"))  # root's, 0700
    precious = victim_files / "memories.db"
    precious.write_bytes(b"precious memories\n" * 100)
    legit = Path(short_tempdir("kvl"))  # root's, 0700: what the check sees
    evil = _own_dir(NOBODY, NOBODY, 0o755)
    runtime = Path(f"/tmp/kflip-{uuid.uuid4().hex[:10]}")
    flipper = _AsUser(NOBODY, NOBODY, _flip, str(runtime), str(legit), str(evil), f"{name}.lock", str(precious))
    env_before = os.environ.get("KALOS_RUNTIME_DIR")
    refusals: list[str] = []
    starts = 0
    try:
        assert flipper.hear() == "ready"
        os.environ["KALOS_RUNTIME_DIR"] = str(runtime)
        from kalos.server.sidecar import Sidecar, SidecarConfig

        deadline = time.monotonic() + 20.0
        while starts < 300 and time.monotonic() < deadline and precious.read_bytes().startswith(b"precious"):
            starts += 1
            try:
                sidecar = Sidecar(SidecarConfig(store=store_dir / "s.db", name=name, dim=DIM, device="cpu"))
            except kalos.KalosError as exc:
                refusals.append(str(exc))
                continue
            sidecar.close()
        content = precious.read_bytes()
    finally:
        if env_before is None:
            os.environ.pop("KALOS_RUNTIME_DIR", None)
        else:
            os.environ["KALOS_RUNTIME_DIR"] = env_before
        flipper.kill()
        for leftover in (runtime, Path(f"{runtime}.a"), Path(f"{runtime}.b")):
            if os.path.lexists(leftover):
                leftover.unlink()
        for d in (victim_files, legit, evil):
            shutil.rmtree(d, ignore_errors=True)
    assert content == b"precious memories\n" * 100, f"the victim's file was overwritten after {starts} starts: {content[:40]!r}"
    assert refusals and all("symlink" in r for r in refusals), refusals[:3]
    print(f"RELIABILITY security-flip: starts={starts} refused={len(refusals)} target_untouched=1 "
          f"message={refusals[0][:160]!r}")


def test_a_symlinked_lock_file_is_never_followed_or_truncated(runtime_dir, store_dir):
    """Item 1, deterministic half: a ``<name>.lock`` that is a symlink (whoever made it) is refused;
    before the fix it was opened O_CREAT|O_RDWR through the link and the target truncated."""
    name = unique_name("lnk")
    precious = store_dir / "precious"
    precious.write_bytes(b"keep me\n" * 10)
    os.symlink(precious, runtime_dir / f"{name}.lock")
    from kalos.server.sidecar import Sidecar, SidecarConfig

    with pytest.raises(kalos.KalosError, match="symlink"):
        Sidecar(SidecarConfig(store=store_dir / "s.db", name=name, dim=DIM, device="cpu"))
    assert precious.read_bytes() == b"keep me\n" * 10
    # A runtime directory that is itself a symlink (to a 0700 directory of ours) is refused too.
    link = Path(f"/tmp/klink-{uuid.uuid4().hex[:10]}")
    os.symlink(runtime_dir, link)
    try:
        os.environ["KALOS_RUNTIME_DIR"] = str(link)  # runtime_dir's monkeypatch restores it
        with pytest.raises(kalos.KalosError, match="is a symlink"):
            Sidecar(SidecarConfig(store=store_dir / "s.db", name=name, dim=DIM, device="cpu"))
        with pytest.raises(kalos.KalosError, match="is a symlink"):
            Client(name, timeout=1.0)
    finally:
        link.unlink()


def test_a_lock_file_of_foreign_content_is_not_overwritten(runtime_dir, store_dir):
    """Never truncate or rewrite a file we did not create: an existing lock file must hold a pid."""
    name = unique_name("own")
    lock = runtime_dir / f"{name}.lock"
    lock.write_bytes(b"not a lock file, somebody's data\n")
    from kalos.server.sidecar import Sidecar, SidecarConfig

    with pytest.raises(kalos.KalosError, match="not a Kalos lock file"):
        Sidecar(SidecarConfig(store=store_dir / "s.db", name=name, dim=DIM, device="cpu"))
    assert lock.read_bytes() == b"not a lock file, somebody's data\n"


def _in_private_shm(code: str, *args: str, shm_size: str = "256k") -> dict:
    """Runs ``code`` (which prints one JSON line) in a private mount namespace whose /dev/shm is
    a small tmpfs that another user has filled to the last byte; returns {rc, out, err}."""
    script = (f"mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm && "
              f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups "
              "sh -c 'cat /dev/zero > /dev/shm/filler 2>/dev/null; true' && "
              'exec "$0" -c "$@"')
    env = dict(os.environ, PYTHONPATH=_SRC)
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, code,
                           *args], capture_output=True, text=True, timeout=DEADLINE_S * 2, env=env)
    return {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr}


def _can_unshare() -> bool:
    if os.getuid() != 0 or shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


_NEEDS_MOUNT_NS = pytest.mark.skipif(not _can_unshare(), reason="needs root, unshare and setpriv for a private "
                                     "mount namespace with a small /dev/shm")


@_NEEDS_MOUNT_NS
def test_a_full_dev_shm_kills_neither_sidecar_nor_client(store_dir, runtime_dir):
    """Issue 19, item 2. Another user fills /dev/shm. Before the fix the segment there was only
    ftruncate'd, and the sidecar died of SIGBUS writing its header (and a client at its first
    touch of an unbacked page). Now the segment is a memfd, charged to no /dev/shm limit, its
    pages reserved at creation: the sidecar serves, the client recalls."""
    result = _in_private_shm(r"""
import os, sys
st = os.statvfs("/dev/shm")
assert st.f_bavail == 0, "the filler did not fill /dev/shm"
""" + _VICTIM, str(store_dir / "s.db"), unique_name("full"))
    assert result["rc"] == 0, f"exit {result['rc']} (-7 is SIGBUS): {result['err'][-2000:]}"
    assert json.loads(result["out"].strip().splitlines()[-1]) == {"hits": 3}
    print(f"RELIABILITY security-shm-full: rc={result['rc']} recall_hits=3")


@_NEEDS_MOUNT_NS
def test_a_full_dev_shm_is_a_clear_error_for_the_seed_segment(store_dir):
    """Item 2 for the seed protocol's named segment, which must live in /dev/shm: Kalos reserves
    its pages when it creates it, so a full /dev/shm is a logged error naming the remedy, and
    the sidecar keeps serving (before: SIGBUS at the first write of the segment's magic)."""
    result = _in_private_shm(r"""
import json, logging, sys, time
import numpy as np
from kalos.server.seed_compat import SeedCompatServer
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
log = logging.getLogger("seed-test")
log.addHandler(Keep())
search = lambda q, k: (np.full((1, k), -1, np.int64), np.full((1, k), -np.inf, np.float32))
server = SeedCompatServer(search=search, dim=8, log=log, shm_name="/kalos_full_test")
server.start()
time.sleep(1.0)
server.stop()
print(json.dumps({"last_error": server.stats["last_error"], "log": records}))
""")
    assert result["rc"] == 0, f"exit {result['rc']} (-7 is SIGBUS): {result['err'][-2000:]}"
    report = json.loads(result["out"].strip().splitlines()[-1])
    assert "cannot reserve" in report["last_error"] and "free space in /dev/shm" in report["last_error"], report


@_NEEDS_ROOT
def test_a_squatted_segment_name_does_not_stop_the_sidecar(victim_user):
    """Issue 19, item 3. The segment's name was predictable (/dev/shm/kalos-<uid>-<name>); another
    user who created it first (a file, or a symlink) stopped the victim's sidecar from ever
    starting, with a raw PermissionError traceback. The segment has no name now: the victim
    starts and serves, and nothing of the squatter's is followed or touched."""
    uid, gid = victim_user
    name = unique_name("squat")
    squat_file = Path(f"/dev/shm/kalos-{uid}-{name}")
    squat_link = Path(f"/dev/shm/kalos-{uid}-{name}.lock")
    def squat(_channel: Any) -> None:
        fd = os.open(squat_file, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.write(fd, b"squatter")
        os.close(fd)
        os.symlink("/dev/null", squat_link)

    _AsUser(NOBODY, NOBODY, squat).result()
    runtime, stores = _own_dir(uid, gid), _own_dir(uid, gid)
    try:
        result = _AsUser(uid, gid, _victim, str(stores / "s.db"), name, env={"KALOS_RUNTIME_DIR": str(runtime)}).result()
        assert result == {"hits": 3}
        assert squat_file.read_bytes() == b"squatter" and os.stat(squat_file).st_uid == NOBODY
        assert os.readlink(squat_link) == "/dev/null"
    finally:
        squat_file.unlink(missing_ok=True)
        squat_link.unlink(missing_ok=True)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(stores, ignore_errors=True)
    print("RELIABILITY security-squat-segment: victim_started=1 recall_hits=3 squatter_untouched=1")


@_NEEDS_ROOT
def test_a_squatted_name_lock_names_the_squatter_and_the_remedy(runtime_dir, store_dir):
    """Items 3 and 6: the per-user name lock is an abstract socket, which any user can bind
    first. The sidecar then refuses with the squatter's uid and pid and what to do."""
    name = unique_name("lock")
    def hold(channel: Any, address: str) -> None:
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.bind(address)
        held.listen(1)
        channel.say("ready")
        channel.hear(timeout=120)

    squatter = _AsUser(NOBODY, NOBODY, hold, f"\0kalos-{os.getuid()}-{name}")
    try:
        assert squatter.hear() == "ready"
        from kalos.server.sidecar import Sidecar, SidecarConfig

        with pytest.raises(kalos.SidecarAlreadyRunning) as refused:
            Sidecar(SidecarConfig(store=store_dir / "s.db", name=name, dim=DIM, device="cpu"))
        message = str(refused.value)
        assert f"uid {NOBODY} (pid {squatter.pid})" in message and "another --name" in message, message
    finally:
        squatter.kill()
    print(f"RELIABILITY security-squat-lock: {message}")


def _seed_attacker(channel: Any, path: str, dim: int) -> None:
    """Another user's article client: a 0666 segment, then (on "go") one request; says whether
    Kalos answered it within 3 s."""
    import mmap as _mmap

    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    os.fchmod(fd, 0o666)
    os.ftruncate(fd, 4256)
    mm = _mmap.mmap(fd, 4256)
    struct.pack_into("=IIII", mm, 0, 0x4B414C4F, 1, 0, 0)
    channel.say("ready")
    channel.hear()
    struct.pack_into(f"={dim}f", mm, 32, *([1.0] * dim))
    struct.pack_into("=II", mm, 8, 7, dim)  # request_id, query_dim
    struct.pack_into("=I", mm, 20, 1)  # ready
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and struct.unpack_from("=I", mm, 24)[0] != 1:
        time.sleep(0.001)
    channel.say("answered" if struct.unpack_from("=I", mm, 24)[0] == 1 else "silence")


@_NEEDS_ROOT
def test_a_seed_segment_of_another_user_is_refused(store_dir):
    """Issue 19, item 4. With --seed-compat, Kalos attached to a segment another user created
    (mode 0666): he then read the top-8 ids and scores over all of the victim's memories. Now a
    seed segment of another uid, or writable by others, is refused (start fails, saying why),
    and a request planted there is never answered."""
    from kalos.errors import InvalidArgument
    from kalos.server.seed_compat import SeedCompatServer

    shm = f"/kalos_seed_{uuid.uuid4().hex[:10]}"
    path = f"/dev/shm{shm}"
    attacker = _AsUser(NOBODY, NOBODY, _seed_attacker, path, DIM)
    started = False
    outcome = "not asked"
    try:
        assert attacker.hear() == "ready"
        server = SeedCompatServer(search=lambda q, k: (np.arange(k, dtype=np.int64)[None, :],
                                                       np.ones((1, k), np.float32)), dim=DIM, shm_name=shm)
        error = ""
        try:
            server.start()
            started = True
        except InvalidArgument as exc:
            error = str(exc)
        attacker.say("go")  # the attacker's request, answered only by a server that started
        outcome = attacker.hear(timeout=DEADLINE_S)
    finally:
        attacker.kill()
        if started:
            server.stop()
        os.unlink(path)
    assert not started and outcome == "silence", f"Kalos served a seed segment another user owns and can write ({outcome})"
    assert f"belongs to uid {NOBODY}" in error and "remove it" in error, error
    print(f"RELIABILITY security-seed-foreign: refused={error[:160]!r}")


@_NEEDS_ROOT
def test_a_seed_segment_replaced_by_another_user_is_never_answered(store_dir):
    """Item 4, later: Kalos created its 0600 segment; it is unlinked and another user plants his
    own 0666 one with a request in it. Kalos must not adopt it (before: it re-attached and
    answered the attacker's request with the victim's top-8)."""
    from kalos.server.seed_compat import SeedCompatServer

    shm = f"/kalos_seed_{uuid.uuid4().hex[:10]}"
    path = f"/dev/shm{shm}"
    server = SeedCompatServer(search=lambda q, k: (np.arange(k, dtype=np.int64)[None, :],
                                                   np.ones((1, k), np.float32)), dim=DIM, shm_name=shm)
    server.start()
    try:
        wait_until(lambda: os.path.exists(path) and server.stats["attaches"] >= 1, "Kalos's own seed segment")
        os.unlink(path)  # (systemd-logind's RemoveIPC does this at logout)
        attacker = _AsUser(NOBODY, NOBODY, _seed_attacker, path, DIM)
        try:
            assert attacker.hear() == "ready"
            time.sleep(0.5)  # the idle server notices the replaced inode within 100 ms
            attacker.say("go")
            outcome = attacker.hear()
        finally:
            attacker.kill()
        assert outcome == "silence", "Kalos answered a request in another user's segment"
        assert f"belongs to uid {NOBODY}" in str(server.stats["last_error"]), server.stats
    finally:
        server.stop()
        if os.path.exists(path):
            os.unlink(path)
    print(f"RELIABILITY security-seed-replaced: answered=0 last_error={server.stats['last_error'][:120]!r}")


def test_a_seed_segment_truncated_under_the_sidecar_is_survived(sidecars, store_dir):
    """Item 4 (and 12 for the seed segment): the seed client truncates the segment (the same
    user may). Before the fix the sidecar had it mapped and died of SIGBUS at its next sweep;
    now it never maps it: it notices, waits for the client to size it again, and serves."""
    import mmap as _mmap

    shm = f"/kalos_seed_{uuid.uuid4().hex[:10]}"
    path = f"/dev/shm{shm}"
    name = unique_name("seedtr")
    proc = sidecars.start(store_dir / "s.db", name=name, dim=DIM, extra_args=["--seed-compat", "--seed-compat-shm", shm])
    try:
        with Client(name, timeout=30.0) as client:
            client.add(np.eye(DIM, dtype=np.float32))
        wait_until(lambda: os.path.exists(path) and os.path.getsize(path) == 4256, "the seed segment")
        for size in (0, 100, 4096):
            os.truncate(path, size)
            time.sleep(0.4)  # the server's idle checks (every 100 ms) and spin loop run meanwhile
            assert proc.process.poll() is None, f"the sidecar died (exit {proc.process.returncode}) after a truncation to {size}"
        # The client sizes it again and initialises it, as the article's client does on restart.
        fd = os.open(path, os.O_RDWR)
        os.ftruncate(fd, 4256)
        mm = _mmap.mmap(fd, 4256)
        os.close(fd)
        struct.pack_into("=II", mm, 0, 0x4B414C4F, 1)
        struct.pack_into(f"={DIM}f", mm, 32, *([0.0] * (DIM - 1) + [1.0]))
        struct.pack_into("=II", mm, 8, 5, DIM)
        struct.pack_into("=I", mm, 20, 1)
        wait_until(lambda: struct.unpack_from("=I", mm, 24)[0] == 1, "the answer after the resize")
        assert struct.unpack_from("=I", mm, 28)[0] == 8
        mm.close()
        assert proc.process.poll() is None
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print("RELIABILITY security-seed-truncated: truncations=3 sidecar_alive=1 answered_after_resize=1")


@_NEEDS_ROOT
@pytest.mark.parametrize("sticky", [True, False], ids=["sticky-dir", "open-dir"])
def test_wal_and_shm_planted_by_another_user_are_refused(sticky):
    """Issue 19, item 5. A store in a shared writable directory: after a clean stop SQLite
    removes -wal and -shm; another user plants 0666 files in their place, SQLite adopted them, and
    he read the victim's new memories from the WAL. Now a directory others can write without the
    sticky bit is refused outright, and in a sticky one (/tmp-like) the -wal/-shm must be this
    user's own 0600 files (Kalos creates them itself before SQLite opens the store)."""
    from kalos.errors import StoreError
    from kalos.store.sqlite import Store

    shared = Path(short_tempdir("ksh"))
    os.chmod(shared, 0o1777 if sticky else 0o777)
    db = shared / "s.db"
    try:
        os.chmod(shared, 0o700)  # the victim made the store while the directory was private
        with Store.open(db, dim=DIM) as store:
            store.add(np.eye(DIM, dtype=np.float32), namespace="default", texts=["old"] * DIM)
        assert not os.path.exists(f"{db}-wal"), "SQLite kept the -wal after a clean close"
        os.chmod(shared, 0o1777 if sticky else 0o777)
        def plant(channel: Any) -> bool:
            held = []
            for suffix in ("-wal", "-shm"):
                fd = os.open(f"{db}{suffix}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
                os.fchmod(fd, 0o666)
                held.append(fd)
            channel.say("planted")
            channel.hear()
            # His own file, open all along: SQLite's unlink at close does not take it from him.
            return b"the victim" in os.pread(held[0], 1 << 20, 0)

        attacker = _AsUser(NOBODY, NOBODY, plant)
        try:
            assert attacker.hear() == "planted"
            error = ""
            try:
                with Store.open(db, dim=DIM) as store:
                    store.add(np.eye(DIM, dtype=np.float32)[:1], namespace="default", texts=["the victim's secret"])
            except StoreError as exc:
                error = str(exc)
            attacker.say("read")
            leaked = attacker.result()
        finally:
            attacker.kill()
        assert leaked is False, "another user read the victim's new memory from the WAL he planted"
        if sticky:
            assert f"uid {NOBODY}" in error and "mode 0666" in error and "remove it" in error, error
        else:
            assert "writable by other users" in error and "chmod go-w" in error, error
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    print(f"RELIABILITY security-wal-{'sticky' if sticky else 'open'}: refused={error[:140]!r}")


def test_one_sidecar_per_name_whatever_the_runtime_directory(sidecars, store_dir, runtime_dir):
    """Issue 19, item 6. The same name under two runtime directories (XDG_RUNTIME_DIR set in a
    shell, not under cron): both started before, the second took over the first's segment name,
    and the first's clean stop unlinked the second's segment. Now the second is refused, naming
    the first's pid, whatever its runtime directory."""
    name = unique_name("two")
    first = sidecars.start(store_dir / "a.db", name=name, dim=DIM)
    other_runtime = short_tempdir("k2")
    env = dict(os.environ, KALOS_RUNTIME_DIR=other_runtime)
    try:
        second = None
        try:
            second = SidecarProcess(store_dir / "b.db", name=name, dim=DIM, env=env, ready_timeout=60)
        except SidecarUnavailable as exc:
            refusal = str(exc)
        if second is not None:  # before the fix: it started; the first's stop then broke it
            first.stop()
            os.environ["KALOS_RUNTIME_DIR"] = other_runtime
            try:
                with Client(name, timeout=5.0) as client:
                    client.recall(np.ones(DIM, np.float32), k=1)
            finally:
                os.environ["KALOS_RUNTIME_DIR"] = str(runtime_dir)
                second.stop()
            raise AssertionError("a second sidecar of the same name and user started in another runtime directory")
        assert f"already running (pid {first.pid})" in refusal, refusal
        with Client(name, timeout=10.0) as client:  # the first is unharmed
            assert len(client.recall(np.ones(DIM, np.float32), k=1)) == 0
    finally:
        shutil.rmtree(other_runtime, ignore_errors=True)
    print(f"RELIABILITY security-two-runtime-dirs: second_refused=1 ({refusal[-160:]!r})")


def test_removing_dev_shm_breaks_no_new_client(sidecars, store_dir, runtime_dir):
    """Issue 19, item 11. ``rm /dev/shm/*`` (or systemd-logind's RemoveIPC=yes at logout) removed
    the segment's name: existing clients kept working and every new client failed forever. The
    segment has no name now; new clients get it from the hello."""
    name, proc, client = _start(sidecars, store_dir)
    try:
        removed = [p for p in Path("/dev/shm").glob(f"kalos-{os.getuid()}-{name}*")]
        for path in removed:  # what RemoveIPC does to this user's files there
            path.unlink()
        for _ in range(3):
            with Client(name, timeout=10.0) as fresh:
                assert len(fresh.recall(np.ones(DIM, np.float32), k=3)) == 3
        assert len(client.recall(np.ones(DIM, np.float32), k=3)) == 3
    finally:
        client.close()
    print(f"RELIABILITY security-rm-dev-shm: names_removed={len(removed)} new_clients_ok=3")


def test_a_client_truncating_the_segment_cannot_kill_the_sidecar(sidecars, store_dir):
    """Issue 19, item 12. A client (same user) that truncates the segment killed the sidecar
    with SIGBUS at its next write of the header. The segment is sealed against resizing now:
    the truncation fails, and the sidecar and every other client carry on."""
    name, proc, client = _start(sidecars, store_dir)
    fd = client._conn.segment._fd  # the client holds the segment, as any client does
    attempts = {}
    for size in (0, 4096, 1 << 30):
        try:
            os.ftruncate(fd, size)
            attempts[size] = "succeeded"
        except OSError as exc:
            attempts[size] = type(exc).__name__
        time.sleep(0.2)  # several heartbeats: each writes the header page
        assert proc.process.poll() is None, f"the sidecar died (exit {proc.process.returncode}) after ftruncate({size})"
    try:
        with Client(name, timeout=10.0) as other:
            assert len(other.recall(np.ones(DIM, np.float32), k=3)) == 3
        assert len(client.recall(np.ones(DIM, np.float32), k=3)) == 3
    finally:
        client.close()
    assert set(attempts.values()) == {"PermissionError"}, attempts
    print(f"RELIABILITY security-truncate: {attempts} sidecar_alive=1")


@pytest.mark.parametrize("removed", ["socket", "runtime-dir"])
def test_a_removed_control_socket_is_bound_again(sidecars, store_dir, runtime_dir, removed):
    """Item 11, the control socket: ``rm`` of it, or systemd-logind removing the whole runtime
    directory at logout (RemoveIPC), left new clients unable to connect until a restart. The
    sidecar now notices within a second, says so loudly in its log, and binds it again."""
    name, proc, client = _start(sidecars, store_dir)
    try:
        if removed == "socket":
            (runtime_dir / f"{name}.sock").unlink()
        else:
            shutil.rmtree(runtime_dir)
        fresh = wait_until(lambda: _try_client(name), "a new client to get in again", timeout=DEADLINE_S)
        with fresh:
            assert len(fresh.recall(np.ones(DIM, np.float32), k=3)) == 3
        assert len(client.recall(np.ones(DIM, np.float32), k=3)) == 3  # the old one never noticed
        assert stat.S_IMODE(os.stat(runtime_dir / f"{name}.sock").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
    finally:
        client.close()
    log_text = proc.log()
    assert "was removed or replaced" in log_text and "bound again" in log_text, log_text[-2000:]
    assert not tracebacks(log_text)
    print(f"RELIABILITY security-rm-socket-{removed}: rebound=1 new_client_ok=1")


def _try_client(name: str) -> Client | None:
    try:
        return Client(name, timeout=2.0)
    except SidecarUnavailable:
        return None
