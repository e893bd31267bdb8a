"""The GPU's polling of the slots (``--gpu-polling``), as the rest of the sidecar sees it.

The polling kernel (kalos.engine.gpu.slot_server) answers single recalls by itself and knows
nothing of writes or expiries. So every part of the sidecar that changes the engine (the
control operations, the expirer, the lifecycle) stops it first, and the recall loop starts it
again on the next request. Clients coming and going need no stop: the kernel polls every slot
the channel marks in use, and a new client gets a slot no round of the kernel can still write
into (:meth:`SlotPolling.admit`). They share one :class:`SlotPolling`: one place says how the
kernel is stopped, started and given up after a fault, and none of them needs to know the
others.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any

import numpy as np

from kalos.ipc import sync
from kalos.ipc.channel import SidecarChannel
from kalos.server.state_lock import StateLock

__all__ = ["SlotPolling"]

# The sidecar's one logger, whichever of its modules logs.
log = logging.getLogger("kalos.server.sidecar")


class SlotPolling:
    """The polling kernel of one sidecar, shared by everything that must stop it.

    ``server`` is the kernel (a SlotGraphServer), or None: no GPU polling here, or a fault
    turned it off for good. Every method but :meth:`admit` and :meth:`release` expects the
    sidecar's ``_state_lock`` held; :meth:`admit` takes it only when it must stop the kernel.
    """

    def __init__(self, state_lock: StateLock) -> None:
        self.server: Any = None
        self.channel: SidecarChannel | None = None  # whose answers a pause wakes (set with the server)
        self._state_lock = state_lock

    def install(self, server: Any, channel: SidecarChannel) -> None:
        """Starts using ``server`` (warmed up, its answered words adopted by ``channel``); the
        channel mirrors its slot table into the server's in-use words from now on, and hands
        out only slots that the server's taken words say no round holds."""
        channel.adopt_kernel_words(server.in_use, server.taken)
        self.server = server
        self.channel = channel

    def pause(self) -> None:
        """Stops the GPU's polling before the engine changes (or a slot changes hands that a
        round may still write into); the sweep starts it again on the next request."""
        server = self.server
        if server is None:
            return
        try:
            server.stop()
        except Exception:  # a kernel fault: keep serving through the sweep alone
            self.failed("failed")
        channel = self.channel
        if channel is not None:
            channel.wake_answered()  # its last answers' clients may be asleep

    def close(self) -> None:
        """Stops the polling for good (before the segment it reads is unpinned)."""
        self.pause()
        self.server = None

    def failed(self, what: str) -> None:
        """Turns GPU polling off for good after a fault; the sweep serves every request."""
        log.exception("the GPU slot server %s; recalls go through the sweep from now on", what)
        self.server = None

    def running(self) -> bool:
        """Whether the kernel is polling now (False without one, or after a fault)."""
        server = self.server
        if server is None:
            return False
        try:
            return server.running()
        except Exception:  # a kernel fault, or programs that could not all be resident
            self.failed("failed")
            return False

    def kernel_words(self) -> np.ndarray | None:
        """A copy of the words the kernel writes for the host (None without a kernel): what
        :meth:`wait_for_kernel` compares them with."""
        server = self.server
        return None if server is None else server.host_words.copy()

    def wait_for_kernel(self, seen: np.ndarray | None, timeout_s: float) -> None:
        """Waits until the kernel writes a word other than in ``seen`` (from :meth:`kernel_words`:
        a round began, took requests, handed one over, answered or stopped) or ``timeout_s``, the
        GIL released (kalos.ipc._fence.spin_changed), yielding the core between looks. A loop of
        plain yields would hand the GIL back to itself before a waiting control thread (an
        embed, a get) woke, which then waited for the interpreter's switch interval (5 ms) at
        each of its GIL releases. Once the kernel has stopped, one yield: the rounds still queued
        write nothing more, and the sweep must see the next request as soon as they end. Without
        the extension, or the words, one yield too. (Needs no lock: a kernel replaced meanwhile
        is looked at once more.)"""
        server = self.server
        if (server is None or seen is None or sync.spin_changed is None or len(seen) != len(server.host_words)
                or server.stopped):
            os.sched_yield()
            return
        sync.spin_changed(server.host_words, seen, int(timeout_s * 1e9))

    def start(self, namespaces: dict[bytes, int]) -> None:
        """Launches the resident kernel once traffic has arrived; it exits by itself after the
        sidecar's spin window without a request."""
        server, channel = self.server, self.channel
        if server is None:
            return
        try:
            channel.wake_answered()  # answers of its previous run, seen before it exited
            server.set_namespaces(namespaces)
            server.start(channel.active)
        except Exception:
            self.failed("failed to start")

    def admit(self, channel: SidecarChannel, wake: socket.socket) -> int | None:
        """A slot for a new client whose wake socket is ``wake`` (None: every slot is in use).

        Without GPU polling, the first free slot, under the channel's lock alone (microseconds,
        never a search). With it, the first free slot whose last request was answered and that
        no round of the kernel holds (its taken word), as fast: the kernel may keep running,
        since none of its rounds can write into that slot.
        Only when every free slot still holds an unanswered request (a client that died
        waiting) is the kernel stopped first (the next request starts it again)."""
        if self.server is None:
            return channel.take_slot(wake)
        slot = channel.take_slot(wake, quiet_only=True)
        if slot is not None or channel.free_slot() is None:
            return slot
        with self._state_lock:
            self.pause()
            return channel.take_slot(wake)

    @staticmethod
    def release(channel: SidecarChannel, slot: int) -> None:
        """Frees ``slot`` (its client left). The kernel stops polling it at its next look; an
        answer of a round in flight lands in a slot nobody reads, and :meth:`admit` hands the
        slot out again only once that answer is in."""
        channel.deactivate(slot)
