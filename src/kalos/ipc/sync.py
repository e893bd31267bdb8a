"""Memory ordering between the processes that share a Kalos segment.

Python has no memory model: nothing in the language promises that a store made by one
statement is visible to another process before a store made by the next statement. The
channel needs two orderings, and this module is where both come from.

1. Publication (payload before sequence number). A writer fills a slot's payload, then
   stores the slot's sequence number; a reader loads the sequence number, then the payload.
   The writer calls :func:`full_fence` between its payload and its sequence store (release),
   the reader calls it between its sequence load and its payload loads (acquire).

   * x86-64 (TSO): stores are not reordered with older stores and loads are not reordered
     with older loads, so the hardware already gives release/acquire; the fence's job there
     is to stop the compiler, and every Python statement is an opaque C call anyway.
   * aarch64 (Grace Hopper hosts): stores and loads may be reordered freely, so the DMB that
     the fence emits is what makes the payload visible before the sequence number.

   Each sequence number is an aligned 8-byte word written and read by single NumPy element
   accesses, which both architectures perform as single-copy-atomic 8-byte accesses, so a
   reader never sees a torn sequence number.

2. Sleeping flags (store then load, Dekker style). A waiter stores ``sleeping = 1`` and then
   re-reads the sequence number before it blocks; the waker stores the sequence number and
   then reads ``sleeping`` to decide whether to ring the doorbell. Store-to-load reordering
   is allowed on *both* x86-64 and aarch64, so without a full fence on both sides each could
   read the other's old value and the wake-up would be lost. :func:`full_fence` is that fence.

The fence comes from ``kalos.ipc._fence`` (a ten-line C extension built at install). Where it
could not be built, x86-64 falls back to acquiring and releasing a lock: CPython's lock is a
pthread mutex or semaphore whose acquire is a ``lock``-prefixed read-modify-write, and every
locked instruction is a full barrier on x86-64. That argument does not hold on aarch64
(vLLM learnt this the hard way, vllm#35104), so there the extension is required.
"""
from __future__ import annotations

import platform
import threading
from typing import Callable

from kalos.errors import KalosError

__all__ = ["full_fence", "FENCE_IMPLEMENTATION", "pending_slots", "publish_slots", "same_rows", "spin_changed",
           "spin_pending"]


def _lock_fence_factory() -> Callable[[], None]:
    lock = threading.Lock()
    acquire, release = lock.acquire, lock.release

    def lock_fence() -> None:
        acquire()
        release()

    return lock_fence


try:
    from kalos.ipc._fence import full as full_fence  # type: ignore[attr-defined]

    FENCE_IMPLEMENTATION = "native"
except ImportError:  # pragma: no cover - depends on how the package was built
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KalosError(
            "kalos.ipc._fence (the native memory fence) is missing and this is a "
            f"{platform.machine()} machine, where no pure-Python fence is correct; "
            "reinstall kalos with a C compiler available (pip install --force-reinstall kalos-recall, or '.' from a checkout)"
        ) from None
    full_fence = _lock_fence_factory()
    FENCE_IMPLEMENTATION = "lock (x86-64 fallback)"


# The sweep's native helpers (see _fence.c): its waits for a request or for a GPU kernel's word
# with the GIL released, and its per-pass reads and writes of the slots' words. None without
# the extension, where the sweep does the same in Python and NumPy; each by its own name, so
# that an extension built from an older _fence.c keeps the helpers it has.
try:
    from kalos.ipc import _fence as _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on how the package was built
    _native = None
pending_slots = getattr(_native, "pending_slots", None)
publish_slots = getattr(_native, "publish_slots", None)
same_rows = getattr(_native, "same_rows", None)
spin_changed = getattr(_native, "spin_changed", None)
spin_pending = getattr(_native, "spin_pending", None)
