"""The control socket's wire format: length-prefixed JSON plus an optional binary blob.

Everything that is not a recall travels here (hello, add, delete, get, stats): writes are off
the hot path, and the sidecar is the store's only writer. A frame is::

    u32 json_len | u64 blob_len | json_len bytes of UTF-8 JSON (an object) | blob_len bytes

Vectors and ids travel in the blob as little-endian float32 / int64 with their shape in the
JSON, so no message is ever unpickled and every length is bounded before anything is
allocated. A reply is ``{"ok": true, ...}`` or ``{"ok": false, "code": <ErrorCode>, "error": msg}``.

File descriptors (a client's end of its bell, the segment) ride on a one-byte
message of their own, sent right after the frame they belong to, so that a plain ``recv`` of a
frame never swallows them.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Callable

import numpy as np

from kalos.errors import ErrorCode, InvalidArgument, KalosError, ProtocolMismatch, error_from_code

__all__ = [
    "PROTOCOL_VERSION",
    "ConnectionClosed",
    "Waiter",
    "send_frame",
    "encode_message",
    "encode_value",
    "encoded_ok_reply",
    "frame_too_large",
    "recv_frame",
    "send_fd",
    "recv_fd",
    "peer_credentials",
    "ok_reply",
    "error_reply",
    "raise_for_reply",
    "array_blob",
    "blob_array",
]

# 2: the hello reply passes the segment's descriptor (a sealed memfd) after the doorbell's,
# instead of naming a file in /dev/shm (issue 19). 3: the client's wake descriptor in the hello
# is one end of a Unix socket pair, not an eventfd, and the client rings the sidecar through it
# instead of a doorbell eventfd that every client shared (kalos.ipc.channel says why).
PROTOCOL_VERSION = 3
_PREFIX = struct.Struct("<IQ")
_MAX_JSON_BYTES = 1 << 28


class ConnectionClosed(Exception):
    """The peer closed the socket (cleanly or by dying)."""


#: Called by :func:`send_frame` and :func:`recv_frame` each time a socket in
#: timeout mode timed out with nothing moved: ``on_wait(started, idle_s)``, where ``started``
#: says whether any byte of the frame has moved yet and ``idle_s`` how long nothing has. It
#: returns to keep waiting or raises to give up. Without it a timeout propagates (TimeoutError).
Waiter = Callable[[bool, float], None]


def send_frame(
    sock: socket.socket, message: dict[str, Any] | bytes, blob: bytes | memoryview = b"", *,
    on_wait: Waiter | None = None,
) -> None:
    """Sends one frame: ``message`` (a dict, or its :func:`encode_message` already made, as a
    sender that checked the encoded size passes it) and ``blob``."""
    body = message if isinstance(message, bytes) else encode_message(message)
    head = _PREFIX.pack(len(body), len(blob)) + body
    if len(blob) and len(blob) <= _JOINED_BLOB_BYTES:
        # One send, so the peer wakes once: a second send for the blob cost each small reply (an
        # embedding, ids) a wake-up of the reader, and its sender the switch back.
        head, blob = head + bytes(blob), b""
    if on_wait is None:
        sock.sendall(head)
        if len(blob):
            sock.sendall(blob)
        return
    # send() in a loop rather than sendall(): sendall() that times out does not say how much it
    # sent, and a peer that stopped reading (SIGSTOP) must not hold the caller past its deadline.
    _send_all(sock, head, on_wait)
    if len(blob):
        _send_all(sock, blob, on_wait)


def _send_all(sock: socket.socket, data: bytes | memoryview, on_wait: Waiter) -> None:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    sent, total = 0, len(view)
    idle_since = time.monotonic()
    while sent < total:
        try:
            sent += sock.send(view[sent:])
            idle_since = time.monotonic()
        except TimeoutError:
            on_wait(True, time.monotonic() - idle_since)


#: Blobs up to this size travel in the same send as their frame's JSON (a copy of the blob);
#: larger ones in a send of their own, uncopied.
_JOINED_BLOB_BYTES = 1 << 16

# The first buffer of a frame: small, because a peer may announce a large frame and then send
# nothing; the buffer grows (doubling) only as bytes actually arrive.
_FIRST_CHUNK = 1 << 16


def _recv_exact(sock: socket.socket, n: int, on_wait: Waiter | None = None, started: bool = True) -> bytearray:
    # The buffer grows (doubling) with the bytes that actually arrive, not with the length the
    # peer announced: bytearray(n) zero-fills, so a 12-byte prefix promising 1 GiB, then
    # silence, cost the sidecar 1 GiB per connection (tests/reliability/test_security.py), and a
    # first chunk of 1 MiB still cost 1 MiB per silent connection (test_hostile.py, issue 19).
    buf = bytearray(min(n, _FIRST_CHUNK))
    got = 0
    idle_since = time.monotonic()
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n, 2 * len(buf)) - len(buf)))
        view = memoryview(buf)[got:]
        try:
            chunk = sock.recv_into(view)
        except TimeoutError:
            if on_wait is None:
                raise
            on_wait(started or got > 0, time.monotonic() - idle_since)
            continue
        finally:
            view.release()  # no export may outlive the call: extend() above needs the buffer free
        if chunk == 0:
            raise ConnectionClosed("peer closed the connection")
        got += chunk
        idle_since = time.monotonic()
    return buf


def encode_message(message: dict[str, Any]) -> bytes:
    """The JSON body :func:`send_frame` sends for ``message``."""
    return encode_value(message)


def encode_value(value: Any) -> bytes:
    """A JSON value encoded as :func:`encode_message` encodes it inside a message."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def encoded_ok_reply(**encoded: bytes) -> bytes:
    """The body of ``ok_reply(**fields)``, its fields given already encoded (:func:`encode_value`):
    parts kept encoded (kalos.server.item_cache) are joined, not encoded again."""
    return b'{"ok":true' + b"".join(b',"%s":%s' % (name.encode(), value) for name, value in encoded.items()) + b"}"


def frame_too_large(json_len: int, blob_len: int, max_bytes: int, *, json_at_least: bool = False) -> str | None:
    """Why a frame of these sizes exceeds the limit, or None if it does not.

    The sender checks this before sending (a sidecar that refuses a frame hangs up, and the
    sender then saw only "Broken pipe"), the receiver before reading the body.
    ``json_at_least``: ``json_len`` is a floor (a reply not yet encoded), and is said so.
    """
    if json_len > min(max_bytes, _MAX_JSON_BYTES):
        which = "KALOS_MAX_MESSAGE_BYTES" if max_bytes <= _MAX_JSON_BYTES else "the fixed limit of the JSON part"
        return (f"too large: {'at least ' if json_at_least else ''}{json_len} bytes > limit "
                f"{min(max_bytes, _MAX_JSON_BYTES)} ({which}), in its JSON (texts, metadata)")
    if blob_len > max_bytes:
        return f"too large: {blob_len} bytes > limit {max_bytes} (KALOS_MAX_MESSAGE_BYTES), in its vectors or ids"
    return None


def recv_frame(
    sock: socket.socket, *, max_bytes: int, on_wait: Waiter | None = None,
) -> tuple[dict[str, Any], bytearray]:
    """One frame; raises ProtocolMismatch for malformed frames, ConnectionClosed at EOF."""
    json_len, blob_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size, on_wait, started=False))
    problem = frame_too_large(json_len, blob_len, max_bytes)
    if problem is not None:
        raise ProtocolMismatch(f"control message exceeds the limit: {problem}")
    raw = _recv_exact(sock, json_len, on_wait)
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and UnicodeDecodeError, and also the integer of more
        # than 4300 digits that json refuses; RecursionError is JSON nested ~1000 deep. Either
        # would otherwise kill the connection's thread with a traceback (tests/reliability/test_hostile.py).
        raise ProtocolMismatch(f"control message is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(message, dict):
        raise ProtocolMismatch(f"control message must be a JSON object, got {type(message).__name__}")
    blob = _recv_exact(sock, blob_len, on_wait) if blob_len else bytearray()
    return message, blob


def send_fd(sock: socket.socket, fd: int) -> None:
    socket.send_fds(sock, [b"F"], [fd])


def recv_fd(sock: socket.socket) -> int:
    data, fds, _flags, _addr = socket.recv_fds(sock, 1, 1, socket.MSG_CMSG_CLOEXEC)  # (no child inherits it)
    if not data:
        raise ConnectionClosed("peer closed the connection before passing a file descriptor")
    if data != b"F" or len(fds) != 1:
        for fd in fds:
            socket.close(fd)
        raise ProtocolMismatch("expected a file descriptor from the peer")
    return fds[0]


_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


def ok_reply(**fields: Any) -> dict[str, Any]:
    return {"ok": True, **fields}


def error_reply(exc: BaseException) -> dict[str, Any]:
    code = exc.code if isinstance(exc, KalosError) else ErrorCode.INTERNAL
    return {"ok": False, "code": int(code), "error": str(exc) or type(exc).__name__}


def raise_for_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply itself if it is a success, else the matching Kalos exception."""
    if reply.get("ok") is True:
        return reply
    raise error_from_code(int(reply.get("code", ErrorCode.INTERNAL)), str(reply.get("error", "unknown error")))


def array_blob(array: np.ndarray, dtype: str) -> tuple[dict[str, Any], memoryview]:
    """The JSON description and bytes of an array sent in a frame's blob."""
    arr = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<"))
    if arr.size == 0:  # (memoryview refuses to cast a shape with a zero: a get found none of its ids)
        return {"dtype": dtype, "shape": list(arr.shape)}, memoryview(b"")
    return {"dtype": dtype, "shape": list(arr.shape)}, memoryview(arr).cast("B")


def blob_array(spec: Any, blob: bytearray, *, offset: int = 0) -> tuple[np.ndarray, int]:
    """The array a frame's blob carries at ``offset`` per ``spec``; returns it and the next offset."""
    if not isinstance(spec, dict) or spec.get("dtype") not in ("float32", "int64"):
        raise InvalidArgument(f"bad array description {spec!r}: dtype must be float32 or int64")
    shape = spec.get("shape")
    # Each dimension below 2**31 (no blob holds more rows) and the byte count in Python ints:
    # np.prod in int64 wrapped shapes like [2**61, 8] around to 0 bytes, and numpy then failed
    # with a ValueError that reached the client as an INTERNAL error (tests/reliability/test_hostile.py).
    if not isinstance(shape, list) or not 1 <= len(shape) <= 2 or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape
    ):
        raise InvalidArgument(f"bad array shape {str(shape)[:100]}")
    dtype = np.dtype(spec["dtype"]).newbyteorder("<")
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if offset + nbytes > len(blob):
        raise InvalidArgument(f"array of shape {shape} needs {nbytes} bytes, the message carries {len(blob) - offset}")
    array = np.frombuffer(blob, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=False), offset + nbytes
