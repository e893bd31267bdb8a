"""Issue 19, items 13 and 14: memory a client can make the sidecar spend, and input that got through.

* Item 13: ``get([id] * 100)`` of an item with a 1 MiB text raised the sidecar's peak RSS by
  108 MiB (a copy per repeat); connections that announce a 200 MB frame and go silent cost
  ~1 MiB each, with no cap on connections and no timeout. Replies are bounded (repeats are
  refused; Client.get sends each id once), buffers grow with the bytes that arrive, half-sent
  frames and hello-less idle connections are dropped, connections beyond the slots plus
  KALOS_SPARE_CONNECTIONS are refused, and a client that holds a slot may idle for ever.
* Item 14: each bad input gets an error that names the value, and nothing changes.

Memory is measured with the sidecar's peak RSS (VmHWM), which a freed reply cannot hide.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time

import numpy as np
import pytest
from conftest import DEADLINE_S, unique_name

from kalos import Client, InvalidArgument, InvalidQuery
from kalos.config import settings
from kalos.errors import ErrorCode
from kalos.ipc.control import PROTOCOL_VERSION, recv_frame, send_fd, send_frame
from reliability._support import ask, raw_connection, tracebacks

DIM = 8
_PREFIX = struct.Struct("<IQ")


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def _connect(runtime_dir, name: str) -> socket.socket:
    """A raw connection, waiting while the listen backlog is full (a flood outruns accept())."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return raw_connection(runtime_dir, name)
        except BlockingIOError:
            assert time.monotonic() < deadline, "the sidecar accepted nothing for DEADLINE_S"
            time.sleep(0.01)


# -- item 13 --------------------------------------------------------------------------------------------


def test_get_of_repeated_ids_does_not_amplify(sidecars, store_dir, runtime_dir):
    name = unique_name("amp")
    proc = sidecars.start(store_dir / "a.db", name=name, dim=DIM)
    text = "x" * (1 << 20)
    with Client(name, timeout=10.0) as client:
        (item,) = client.add(np.ones((1, DIM), np.float32), texts=[text]).tolist()
        client.get([item])  # the reply path for one copy is warm
        before = _peak_rss(proc.pid)
        with raw_connection(runtime_dir, name) as s:
            reply = ask(s, {"op": "get", "ids": [item] * 100})
        grown = _peak_rss(proc.pid) - before
        assert reply["ok"] is False and reply["code"] == ErrorCode.INVALID_ARGUMENT, reply
        assert f"id {item} appears 100 times" in reply["error"], reply
        print(f"RELIABILITY get-amplification: peak RSS grew {grown / 2**20:.1f} MiB for get([id] * 100) of 1 MiB")
        assert grown < 32 << 20, f"the sidecar's peak RSS grew by {grown >> 20} MiB for get([id] * 100) of 1 MiB"
        # The client's get of repeats still answers every position (each id travels once).
        items = client.get([item] * 100 + [10**9])
        assert len(items) == 101 and items[-1] is None and all(i.text == text for i in items[:100])
    assert not tracebacks(proc.log())


def test_silent_and_half_sent_connections_are_bounded_and_dropped(sidecars, store_dir, runtime_dir, monkeypatch):
    monkeypatch.setenv("KALOS_CONTROL_STALL_S", "2")
    monkeypatch.setenv("KALOS_CONTROL_IDLE_S", "2")
    monkeypatch.setenv("KALOS_SPARE_CONNECTIONS", "64")
    name = unique_name("silent")
    proc = sidecars.start(store_dir / "s.db", name=name, dim=DIM, extra_args=["--slots", "8"])
    idle_client = Client(name, timeout=5.0)  # holds a slot and then idles past every timeout below
    idle_client.add(np.eye(DIM, dtype=np.float32))
    before = _peak_rss(proc.pid)
    body = json.dumps({"op": "add", "vectors": {"dtype": "float32", "shape": [1, DIM]}}).encode()
    half_sent = []
    refused = 0
    for _ in range(150):  # each announces a 200 MB blob and sends none of it
        s = _connect(runtime_dir, name)
        try:
            s.sendall(_PREFIX.pack(len(body), 200 << 20) + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed already: its refusal is still there to read
        half_sent.append(s)
    # Beyond 8 slots + 64 spare connections the sidecar refuses at once, with a reason.
    for s in half_sent:
        s.settimeout(0.2)
        try:
            data = s.recv(1 << 16)
        except socket.timeout:
            continue
        if data:
            assert b"control connections open" in data, data
            if not refused:
                print(f"RELIABILITY silent-connections refusal: {data[12:].decode()}")
            refused += 1
    assert refused >= 150 - 72, f"only {refused} of 150 connections were refused"
    grown = _peak_rss(proc.pid) - before
    print(f"RELIABILITY silent-connections: {refused} of 150 refused; peak RSS grew {grown / 2**20:.1f} MiB")
    assert grown < 40 << 20, f"the sidecar's peak RSS grew by {grown >> 20} MiB for 150 silent 200 MB frames"

    # The half-sent frames are dropped after KALOS_CONTROL_STALL_S.
    for s in half_sent:
        s.settimeout(DEADLINE_S)
        while True:
            try:
                if s.recv(1 << 16) == b"":
                    break
            except ConnectionResetError:
                break
        s.close()
    # Below the cap again: a connection that never says hello and idles past
    # KALOS_CONTROL_IDLE_S is dropped, and so is a hello whose wake-up fd never follows.
    silent = raw_connection(runtime_dir, name)
    no_fd = raw_connection(runtime_dir, name)
    send_frame(no_fd, {"op": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid()})
    for s in (silent, no_fd):
        s.settimeout(DEADLINE_S)
        assert s.recv(1) == b"", "a connection without a slot, silent or mid-hello, was not dropped"
        s.close()

    # The client that held its slot all along still works, and new clients get in.
    assert idle_client.recall(np.eye(DIM, dtype=np.float32)[2], k=1).ids[0] == 3
    assert idle_client.add(np.ones((1, DIM), np.float32)).tolist() == [DIM + 1]
    with Client(name, timeout=5.0) as fresh:
        assert fresh.stats()["count"] == DIM + 1
        assert fresh.stats()["clients"] == 2
    idle_client.close()
    assert not tracebacks(proc.log())


# -- item 14 --------------------------------------------------------------------------------------------


@pytest.fixture
def served(sidecars, store_dir):
    name = unique_name("input")
    proc = sidecars.start(store_dir / "i.db", name=name, dim=DIM)
    client = Client(name, timeout=10.0)
    client.add(np.eye(DIM, dtype=np.float32), namespace="ns")
    yield name, proc, client
    client.close()
    assert not tracebacks(proc.log())


def _unchanged(client: Client) -> None:
    stats = client.stats()
    assert stats["count"] == DIM and stats["namespaces"] == {"default": 0, "ns": DIM}, stats


def test_recall_refuses_what_add_refuses(served):
    _name, _proc, client = served
    q = np.eye(DIM)[0]
    for bad, what in ((q + 1j, "complex"), ([str(v) for v in q], "<U"), (q.astype(bool), "bool"),
                      ([True] + [False] * (DIM - 1), "bool")):
        with pytest.raises(InvalidQuery, match="not a numeric array") as refused:
            client.recall(bad, namespace="ns")
        assert what in str(refused.value), refused.value
        with pytest.raises(InvalidQuery, match="not a numeric array"):
            client.recall_many(np.asarray([bad, bad]), namespace="ns")
    assert client.recall(q, k=1, namespace="ns").ids[0] == 1


def test_add_refuses_unordered_texts(served):
    _name, _proc, client = served
    two = np.eye(DIM, dtype=np.float32)[:2]
    for texts, kind in (({"a", "b"}, "set"), (frozenset({"a", "b"}), "frozenset"), ({"a": 1, "b": 2}, "dict")):
        with pytest.raises(InvalidArgument, match=f"ordered sequence .* got {kind}"):
            client.add(two, texts=texts, namespace="ns")
    _unchanged(client)


def test_namespaces_with_surrogates_or_invisible_controls_are_refused(served):
    _name, _proc, client = served
    one = np.ones((1, DIM), np.float32)
    with pytest.raises(InvalidQuery, match="lone surrogate"):
        client.recall(one[0], namespace="bad\udc80")
    with pytest.raises(InvalidArgument, match="lone surrogate"):
        client.add(one, namespace="bad\udc80")
    for ch in ("\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069",
               "\u200e", "\u200f", "\u061c", "\u200b", "\ufeff", "\u2028", "\u2029", "\x1b", "\x85"):
        with pytest.raises(InvalidArgument, match=f"U\\+{ord(ch):04X}"):
            client.add(one, namespace=f"evil{ch}gpj")
    _unchanged(client)


def test_timeouts_must_be_finite_positive_numbers(served):
    name, _proc, _client = served
    for bad in (float("inf"), float("nan"), -1.0, 0, True, "1"):
        with pytest.raises(InvalidArgument, match="timeout must be a positive finite number"):
            Client(name, timeout=bad)  # type: ignore[arg-type]


def test_ids_beyond_int64_are_refused(served, runtime_dir):
    name, _proc, client = served
    for call in (client.get, client.delete):
        for bad in ([2**63], [np.uint64(2**63)], np.array([2**64 - 1], np.uint64), [2**64]):
            with pytest.raises(InvalidArgument):
                call(bad)
    with raw_connection(runtime_dir, name) as s:
        reply = ask(s, {"op": "delete", "ids": [2**63]})
    assert reply["ok"] is False and reply["code"] == ErrorCode.INVALID_ARGUMENT, reply
    _unchanged(client)


def test_a_hello_with_protocol_true_is_refused(served, runtime_dir):
    name, _proc, client = served
    clients = client.stats()["clients"]
    with raw_connection(runtime_dir, name) as s:
        wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            send_frame(s, {"op": "hello", "protocol": True, "pid": os.getpid()})
            send_fd(s, wake)
            reply, _ = recv_frame(s, max_bytes=1 << 20)
        finally:
            os.close(wake)
    assert reply["ok"] is False and reply["code"] == ErrorCode.PROTOCOL, reply
    assert "True" in reply["error"] and str(PROTOCOL_VERSION) in reply["error"], reply
    assert client.stats()["clients"] == clients


def test_an_add_over_the_message_limit_is_refused_before_sending(sidecars, store_dir, monkeypatch):
    monkeypatch.setenv("KALOS_MAX_MESSAGE_BYTES", str(1 << 20))
    name = unique_name("limit")
    proc = sidecars.start(store_dir / "m.db", name=name, dim=DIM)
    monkeypatch.delenv("KALOS_MAX_MESSAGE_BYTES")
    settings.cache_clear()  # this process's own limit stays the default: the sidecar's counts
    try:
        with Client(name, timeout=10.0) as client:
            rows = (1 << 20) // (4 * DIM) + 1
            with pytest.raises(InvalidArgument) as refused:
                client.add(np.ones((rows, DIM), np.float32))
            message = str(refused.value)
            assert f"too large: {rows * 4 * DIM} bytes > limit {1 << 20} (KALOS_MAX_MESSAGE_BYTES)" in message
            with pytest.raises(InvalidArgument, match=r"KALOS_MAX_MESSAGE_BYTES\), in its JSON"):
                client.add(np.ones((1, DIM), np.float32), texts=["y" * (1 << 20)])
            # Nothing was sent: the same connection goes on.
            assert client.add(np.ones((2, DIM), np.float32)).tolist() == [1, 2]
            # Replies past the sidecar's limit are refused by name: at once when their texts alone
            # pass it, else once encoded, with the encoding's exact size (JSON writes "é" in 6
            # bytes); smaller replies of the same items go through.
            big = [int(client.add(np.ones((1, DIM), np.float32), texts=[c * 600_000])[0]) for c in "zw"]
            wide = [int(client.add(np.ones((1, DIM), np.float32), texts=[c * 150_000])[0]) for c in "éè"]
            with pytest.raises(InvalidArgument, match=r"get: the reply would be too large: at least 1200000 bytes > "
                                                      r"limit 1048576 .*in its JSON.*ask for fewer ids at a time"):
                client.get(big)
            with pytest.raises(InvalidArgument, match=r"get: the reply would be too large: 18\d{5} bytes > limit "
                                                      r"1048576 .*ask for fewer ids at a time"):
                client.get(wide)
            with pytest.raises(InvalidArgument, match=r"get: the reply would be too large: at least 1200000 bytes"):
                client.get(big, with_vectors=True)
            with pytest.raises(InvalidArgument, match=r"list: the page would be too large.*ask for a smaller limit"):
                client.list(limit=10)
            assert [item.text[:1] for item in client.get(big[:1]) + client.get(wide[:1])] == ["z", "é"]
            assert [len(item.text or "") for item in client.list(limit=3).items] == [0, 0, 600_000]
    finally:
        settings.cache_clear()
    assert not tracebacks(proc.log())
