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
import json
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kalos
from conftest import DEADLINE_S, NOBODY, as_nobody, unique_name, wait_until
from kalos import Client
from kalos.channel import Segment
from kalos.control import PROTOCOL_VERSION, ok_reply, recv_frame, send_fd, send_frame
from kalos.errors import ErrorCode, ProtocolMismatch, SidecarUnavailable
from kalos.protocol import HEADER_DTYPE, MAGIC, VERSION, Layout
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
        seg = Path(f"/dev/shm/kalos-{os.getuid()}-{name}")
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
    seg = f"/dev/shm/kalos-{os.getuid()}-{name}"
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


def _write_segment(name: str, layout: Layout, *, size: int | None = None, **overrides: int) -> Path:
    path = Path("/dev/shm") / name
    total = layout.size if size is None else size
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, total)
        if total >= HEADER_DTYPE.itemsize:
            header = np.zeros((), HEADER_DTYPE)
            scratch = bytearray(HEADER_DTYPE.itemsize)
            layout.write_header(memoryview(scratch), epoch=7, pid=os.getpid())
            header = np.frombuffer(scratch, HEADER_DTYPE)[0].copy()
            for field, value in overrides.items():
                header[field] = value
            os.pwrite(fd, header.tobytes(), 0)
    finally:
        os.close(fd)
    return path


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
    """Answers one hello like a sidecar would, naming ``segment``: what Client() then attaches to."""

    def __init__(self, path: Path, segment: str, layout: Layout) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.doorbell = os.eventfd(0, os.EFD_NONBLOCK)
        self.segment, self.layout = segment, layout
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from kalos.control import recv_fd

        conn, _ = self.listener.accept()
        with conn:
            recv_frame(conn, max_bytes=1 << 20)
            os.close(recv_fd(conn))
            lay = self.layout
            send_frame(conn, ok_reply(slot=0, segment=self.segment, epoch=7, dim=lay.dim, max_k=lay.max_k,
                                      max_batch=lay.max_batch, n_slots=lay.n_slots))
            send_fd(conn, self.doorbell)
            conn.recv(1)  # until the client hangs up

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=DEADLINE_S)
        os.close(self.doorbell)


@pytest.mark.parametrize("case", sorted(CASES))
def test_attaching_to_a_wrong_segment_is_a_clear_protocol_mismatch(runtime_dir, case):
    overrides, size, words = CASES[case]
    layout = Layout(2, DIM, 4, 2)
    name = unique_name("seg")
    seg_name = f"kalos-{os.getuid()}-{name}"
    total = None if size is None else (layout.size + size if size < 0 else size)
    path = _write_segment(seg_name, layout, size=total, **overrides)
    try:
        with pytest.raises(ProtocolMismatch, match=words) as direct:
            segment = Segment(seg_name)
            try:
                Layout.read_header(segment.buf, source=str(segment.path))
            finally:
                segment.close()
        assert str(path) in str(direct.value)
        fake = _FakeSidecar(runtime_dir / f"{name}.sock", seg_name, layout)
        try:
            started = time.monotonic()
            with pytest.raises(ProtocolMismatch, match=words) as via_client:
                Client(name, timeout=5.0)
            assert time.monotonic() - started < 5.0 + 30.0
            assert str(path) in str(via_client.value)
        finally:
            fake.close()
    finally:
        path.unlink()
    print(f"RELIABILITY security-attach-{case.replace(' ', '-')}: {via_client.value}")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a segment to another user")
def test_a_segment_of_another_owner_is_refused(runtime_dir):
    layout = Layout(2, DIM, 4, 2)
    seg_name = f"kalos-{os.getuid()}-{unique_name('own')}"
    path = _write_segment(seg_name, layout)
    try:
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(ProtocolMismatch, match=f"belongs to uid {NOBODY}"):
            Segment(seg_name)
    finally:
        path.unlink()


def test_a_client_without_a_sidecar_fails_fast_with_sidecar_unavailable(runtime_dir):
    started = time.monotonic()
    with pytest.raises(SidecarUnavailable, match="no sidecar"):
        Client(unique_name("none"), timeout=1.0)
    assert time.monotonic() - started < 1.0 + 30.0
