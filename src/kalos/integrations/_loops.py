"""One :class:`kalos.AsyncClient` per running event loop, for the integrations' async methods.

An AsyncClient queues its recalls on an ``asyncio.Lock`` and futures of the loop that made
them, so it serves one loop at a time: two threads each running ``asyncio.run`` over one
shared AsyncClient hung. LangChain and LangGraph objects are commonly shared that way (a
store built once, used by several worker threads), so the integrations keep one AsyncClient
per loop instead, each with its own slots.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

from kalos.client.aio import AsyncClient

__all__ = ["LoopClients"]


class LoopClients:
    """``clients.get()``: the AsyncClient of the running loop, made by ``make()`` on first use.

    A loop's client is closed at the next ``get()`` from any loop once that loop is closed
    (``asyncio.run`` closes its loop on return), so that a finished loop does not keep holding
    slots, which are a host-wide resource; :meth:`close` closes them all. (Not by a finalizer
    of the loop: the client holds its loop, through its lock and tasks, so the loop would never
    be collected, and each finalizer would pin a loop for the life of the process.)
    """

    def __init__(self, make: Callable[[], AsyncClient]) -> None:
        self._make = make
        self._by_loop: dict[asyncio.AbstractEventLoop, AsyncClient] = {}
        self._lock = threading.Lock()

    def get(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            aclient = self._by_loop.get(loop)
            if aclient is not None:
                return aclient
            stale = [self._by_loop.pop(old) for old in [old for old in self._by_loop if old.is_closed()]]
            aclient = self._by_loop[loop] = self._make()
        for old_client in stale:
            _close_now(old_client)
        return aclient

    def close(self) -> None:
        """Closes every loop's client (their slots go back to the sidecar)."""
        with self._lock:
            clients, self._by_loop = list(self._by_loop.values()), {}
        for aclient in clients:
            _close_now(aclient)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_loop)


def _close_now(aclient: AsyncClient) -> None:
    """Frees the slots of an AsyncClient whose loop is gone (or not running here). ``aclose``
    needs that loop running: its connections are plain sync Clients, closed directly (no call
    can be in flight on them, since their loop no longer runs)."""
    for name in ("_recaller", "_control"):
        client = getattr(aclient, name, None)
        if client is not None:
            client.close()
