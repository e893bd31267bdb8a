"""One wake-up for every sleeping client of a pass: a futex on a word of the shared header.

A pass that answers C sleeping clients used to write C eventfds, one system call each from
the sweep's thread, and that loop grew into most of a large crowd's pass. Clients of the
synchronous :class:`kalos.Client` instead sleep in ``FUTEX_WAIT`` on the header's
``wake_seq`` word; the sidecar bumps the word and wakes them all with one ``FUTEX_WAKE``.
Woken clients whose answer is not there yet (a request that missed the pass) look at their
slot and sleep again.

The protocol (the sidecar stores ``resp_seq`` and then loads ``client_sleeping``; the client
loads ``wake_seq``, stores ``client_sleeping``, and then loads ``resp_seq``) is argued in
:mod:`kalos.channel`. Linux only (x86-64 and aarch64 system call numbers); where neither
applies :data:`AVAILABLE` is False and clients ring eventfds as before.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform

__all__ = ["AVAILABLE", "wait", "wake_all"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT = 0  # shared (not FUTEX_PRIVATE_FLAG): the waiters are in other processes
_FUTEX_WAKE = 1
_WAKE_EVERYONE = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)  # CDLL releases the GIL around the call
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):
    _syscall = None

AVAILABLE = _SYS_FUTEX is not None and _syscall is not None and os.name == "posix"


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleeps while the 32-bit word at ``address`` holds ``expected``, at most ``timeout_s``.
    Returns at once if it already differs; a wake-up, a timeout or a signal all just return
    (the caller looks at its slot either way)."""
    whole = int(timeout_s)
    timeout = _Timespec(whole, int((timeout_s - whole) * 1e9))
    result = _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected),
                      ctypes.byref(timeout), None, 0)
    if result == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex wait: {os.strerror(code)}")


def wake_all(address: int) -> int:
    """Wakes every process sleeping on the word at ``address``; returns how many woke."""
    return int(_syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_EVERYONE, None, None, 0))
