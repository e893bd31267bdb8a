"""kalos.integrations._loops.LoopClients: one AsyncClient per running event loop, for the
integrations' async methods; a closed loop's client is closed and dropped, and nothing keeps a
finished loop alive."""
from __future__ import annotations

import asyncio
import gc
import weakref

from kalos.integrations._loops import LoopClients


class FakeSync:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeAsync:
    """What LoopClients closes of an AsyncClient (its two sync connections), holding its loop as
    a real one does (through its lock and tasks)."""

    def __init__(self) -> None:
        self._recaller, self._control = FakeSync(), FakeSync()
        self.loop = asyncio.get_running_loop()


def test_one_client_per_loop_and_finished_loops_go():
    clients = LoopClients(FakeAsync)  # type: ignore[arg-type]

    async def two_gets() -> tuple[object, object, weakref.ref]:
        return clients.get(), clients.get(), weakref.ref(asyncio.get_running_loop())

    first, again, first_loop = asyncio.run(two_gets())
    assert first is again and len(clients) == 1
    second, _, _ = asyncio.run(two_gets())
    assert second is not first
    assert first._recaller.closed and first._control.closed  # the closed loop's client went
    assert len(clients) == 1 and not second._recaller.closed
    del first, again
    gc.collect()
    assert first_loop() is None, "a finished loop is kept alive"
    clients.close()
    assert second._recaller.closed and len(clients) == 0
