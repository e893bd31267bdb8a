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
import weakref
from typing import Callable

from kalos.client.aio import AsyncClient

__all__ = ["LoopClients"]


class LoopClients:
    """``clients.get()``: the AsyncClient of the running loop, made by ``make()`` on first use.

    A loop's client is closed when the loop is garbage-collected, or at the next ``get()`` from
    any loop once that loop is closed (``asyncio.run`` closes its loop on return), so that a
    finished loop does not keep holding slots, which are a host-wide resource.
    """

    def __init__(self, make: Callable[[], AsyncClient]) -> None:
        self._make = make
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            aclient = self._by_loop.get(loop)
            if aclient is not None:
                return aclient
            closed = [old for old in self._by_loop if old.is_closed()]
            stale = [self._by_loop.pop(old) for old in closed]
            aclient = self._by_loop[loop] = self._make()
            weakref.finalize(loop, _close_now, aclient)
        for old_client in stale:
            _close_now(old_client)
        return aclient

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_loop)


def _close_now(aclient: AsyncClient) -> None:
    """Frees the slots of an AsyncClient whose loop is gone. ``aclose`` needs a running loop,
    and that loop is closed: its connections are plain sync Clients, closed directly (no call
    can be in flight on them, since their loop no longer runs)."""
    for name in ("_recaller", "_control"):
        client = getattr(aclient, name, None)
        if client is not None:
            client.close()
