"""A client's connection to its sidecar: the hello, and what it hands over.

One :class:`Connection` is the control socket, the sidecar's segment mapped in, this client's
slot channel over it, and the bell (the wake socket). Made by :class:`kalos.client.client.Client`
and :class:`kalos.client.aio.AsyncClient` alike; what they send over it is theirs.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Sequence

from kalos.config import open_runtime_dir, settings
from kalos.errors import ProtocolMismatch, SidecarUnavailable
from kalos.ipc.channel import CROWDED_WAITS, ClientChannel, wake_pair
from kalos.ipc.control import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    raise_for_reply,
    recv_fd,
    recv_frame,
    send_fd,
    send_frame,
)
from kalos.ipc.protocol import Layout
from kalos.ipc.segment import Endpoint, Segment

__all__ = ["Connection"]

#: How often a control operation that waits on the socket checks the sidecar's heartbeat.
_CONTROL_POLL_S = 0.05
#: Heartbeat intervals (the sidecar's, from its hello) a wait lets pass without a stamp before
#: it calls the sidecar dead, whatever the client's timeout: a timeout shorter than this would
#: call a live sidecar dead between two of its stamps.
HEARTBEATS_MISSED = 4


def _said(reply: dict[str, Any], key: str, fits: Callable[[Any], bool],
          kinds: tuple[type, ...] | type = (int, float)) -> Any:
    """The number the sidecar's hello gives as ``key`` if it is one of ``kinds`` (not a bool)
    that ``fits``, else None: a sidecar from before it said, or one that says nonsense."""
    value = reply.get(key)
    return value if isinstance(value, kinds) and not isinstance(value, bool) and fits(value) else None


class Connection:
    """One hello'd connection: control socket, segment, slot channel, bell (the wake socket)."""

    sock: socket.socket | None = None
    segment: Segment | None = None
    channel: ClientChannel | None = None
    wake: socket.socket | None = None  # this client's end of its bell (kalos.ipc.channel.wake_pair)
    layout: Layout
    epoch: int
    max_message_bytes: int = 0
    ops: frozenset[str] = frozenset()  # the hello's optional operations (e.g. "recall_text")

    def __init__(self, endpoint: Endpoint, timeout: float, spin_s: float | None) -> None:
        """Connects to the sidecar of ``endpoint`` and says hello (``spin_s`` None: the sidecar's
        advice). Raises SidecarUnavailable when none answers within ``timeout``, ProtocolMismatch
        when its segment does not match its hello; a failed hello keeps nothing open."""
        directory = None
        try:
            # Checked and opened like the sidecar's (owner, mode, no symlink), and connected
            # through its descriptor: a path swapped after the check cannot redirect the client.
            directory = open_runtime_dir()
            path = directory.path / endpoint.socket_name
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self.sock.settimeout(timeout)
            connect_until = time.monotonic() + timeout
            while True:
                try:
                    self.sock.connect(directory.entry(endpoint.socket_name))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    raise SidecarUnavailable(
                        f"no sidecar named {endpoint.name!r} is running (nothing listens at {path}); "
                        f"start one with: kalos serve --name {endpoint.name}"
                    ) from None
                except BlockingIOError:
                    # A Unix socket answers EAGAIN while the sidecar's listen backlog is full (a
                    # burst of clients, a flood): wait for room within the timeout instead of
                    # escaping as a bare BlockingIOError (tests/reliability/test_hostile.py).
                    if time.monotonic() >= connect_until:
                        raise SidecarUnavailable(
                            f"sidecar {endpoint.name!r} accepted no connection within {timeout:g} s (backlog full)"
                        ) from None
                    time.sleep(0.005)
            directory.close()
            theirs, self.wake = wake_pair()
            try:
                send_frame(self.sock, {"op": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid()})
                send_fd(self.sock, theirs.fileno())
            finally:
                theirs.close()  # (the sidecar holds its own copy once sent)
            reply = raise_for_reply(recv_frame(self.sock, max_bytes=1 << 20)[0])
            source = f"the segment of sidecar {endpoint.name!r}"
            self.segment = Segment.attach(recv_fd(self.sock), source=source)
            self.layout = Layout.read_header(self.segment.buf, source=source)
            expected = (reply["dim"], reply["max_k"], reply["max_batch"], reply["n_slots"])
            if (self.layout.dim, self.layout.max_k, self.layout.max_batch, self.layout.n_slots) != expected:
                raise ProtocolMismatch(f"{source} does not match the sidecar's hello {expected}")
            self.epoch = int(reply["epoch"])
            if spin_s is None:  # the sidecar's advice (longer for a GPU sidecar), else the default
                advised = _said(reply, "client_spin_us", lambda us: 0 <= us <= 1e5)
                spin_s = (settings().client_spin_us if advised is None else advised) / 1e6
            crowded = reply.get("client_crowded")
            if crowded not in CROWDED_WAITS:  # a sidecar from before the advice: nap unless it said not to
                crowded = "sleep" if reply.get("client_naps") is False else "nap"
            beat = _said(reply, "heartbeat_s", lambda s: 0 < s <= 1)
            if beat is not None:  # (a sidecar from before it said: the timeout alone)
                timeout = max(timeout, HEARTBEATS_MISSED * beat)
            self.channel = ClientChannel(
                self.segment, self.layout, int(reply["slot"]), wake=self.wake, control=self.sock,
                epoch=self.epoch, timeout=timeout, spin_s=spin_s, crowded=crowded,
            )
            # The epoch only: the hello's reply has just shown the sidecar alive, while its
            # heartbeat stamp may still be stale (a sidecar resumed after SIGSTOP answers the hello
            # before its heartbeat thread runs again).
            self.channel.check_epoch()
            # Timeout mode from here on: every control operation waits in steps of
            # _CONTROL_POLL_S and checks the sidecar's heartbeat between them (Client._control), so a
            # stopped sidecar cannot hold a send or a receive past the client's timeout.
            self.sock.settimeout(_CONTROL_POLL_S)
            ops = reply.get("ops")
            self.ops = frozenset(op for op in ops if isinstance(op, str)) if isinstance(ops, list) else frozenset()
            limit = _said(reply, "max_message_bytes", lambda n: n > 0, int)
            self.max_message_bytes = settings().max_message_bytes if limit is None else limit
        except (ConnectionClosed, socket.timeout, BrokenPipeError, ConnectionResetError) as exc:
            self.close()
            raise SidecarUnavailable(f"the sidecar did not complete the hello ({type(exc).__name__}: {exc})") from None
        except BaseException:
            self.close()
            raise
        finally:
            if directory is not None:
                directory.close()

    def fits_one_recall_text(self, texts: Sequence[str]) -> bool:
        """Whether this sidecar can recall ``texts`` in one control round trip (op
        ``recall_text``): it names the op, and the texts fit one slot's batch and one message
        (16: a character's most bytes in JSON, as kalos.client.client._SidecarEmbedder's frames
        count them)."""
        return ("recall_text" in self.ops and len(texts) <= self.layout.max_batch
                and sum(map(len, texts)) <= self.max_message_bytes // 16)

    def close(self) -> None:
        """Unmaps the segment (once no view of it is left) and closes the sockets; idempotent."""
        self.channel = None  # drop the slot's numpy views before unmapping
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self.wake is not None:
            self.wake.close()
            self.wake = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __del__(self) -> None:
        # A Client dropped without close() (or an integration's hidden one) would otherwise
        # keep its wake socket and the segment's descriptor, and with them the
        # sidecar's memory of an old segment after a restart, until the process exits.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit, modules may be gone already
            pass
