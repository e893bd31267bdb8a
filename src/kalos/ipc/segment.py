"""Where a sidecar lives: its endpoint (the names of its control socket, its locks and its
shared segment) and the shared segment itself (an anonymous, sealed memory file).

The channel over the segment (sequence numbers, waiting, liveness) is :mod:`kalos.ipc.channel`;
the segment's byte layout is :mod:`kalos.ipc.protocol`.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kalos.config import runtime_dir
from kalos.errors import InvalidArgument, ProtocolMismatch
from kalos.ipc.protocol import HEADER_DTYPE

__all__ = ["Endpoint", "Segment"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Endpoint:
    """Where the sidecar called ``name`` listens: its control socket and lock file (in the
    runtime directory) and its per-user name lock (an abstract Unix socket)."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidArgument(
                f"sidecar name {self.name!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )

    @property
    def socket_name(self) -> str:
        return f"{self.name}.sock"

    @property
    def lock_name(self) -> str:
        return f"{self.name}.lock"

    @property
    def socket_path(self) -> Path:
        """For messages and tools; connect and bind through :meth:`RuntimeDir.entry`."""
        return runtime_dir() / self.socket_name

    @property
    def user_lock_address(self) -> str:
        """The abstract-namespace socket that makes ``name`` one sidecar per user, whatever
        the runtime directory (issue 19, item 6); it vanishes with the process holding it."""
        return f"\0kalos-{os.getuid()}-{self.name}"

    @property
    def segment_name(self) -> str:
        """The segment's label (a memfd has no path; ``/proc/<pid>/fd`` shows the label)."""
        return f"kalos-{os.getuid()}-{self.name}"


# The segment cannot change size once made: a process holding it (any client of the same
# user) can then neither shrink it (every later access past the new end would raise SIGBUS
# in the sidecar and in every client: issue 19, item 12) nor grow it; F_SEAL_SEAL stops
# anyone from adding more seals (F_SEAL_WRITE would stop the sidecar's own writes).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_NEEDED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class Segment:
    """The mapped shared segment: an anonymous, sealed memory file (``memfd_create``).

    The sidecar creates it (:meth:`create`) and passes its descriptor to each client in the
    hello (SCM_RIGHTS); a client maps that descriptor (:meth:`attach`). Having no name in
    /dev/shm, it cannot be squatted, replaced, unlinked (``rm /dev/shm/*``, logind's
    RemoveIPC) or opened by another user, and it is charged to no /dev/shm size limit
    (issue 19, items 2, 3, 6, 11). Its pages are reserved at creation, so a write into it
    never faults for want of memory later.
    """

    # Class-level defaults keep close() safe after a constructor that failed half-way.
    _fd = -1
    _mmap: mmap.mmap | None = None
    buf: memoryview | None = None

    def __init__(self, fd: int, *, source: str, created: bool) -> None:
        """Maps ``fd`` (owned by the new Segment from now on); use :meth:`create` or :meth:`attach`."""
        self._fd = fd
        self.source = source
        self.created = created
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ProtocolMismatch(f"{source} is not a shared-memory file")
            if st.st_uid != os.getuid():
                raise ProtocolMismatch(f"{source} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & _NEEDED_SEALS != _NEEDED_SEALS:
                # An unsealed file can be truncated under our mapping by whoever holds it, and
                # this process would then die of SIGBUS: a library must not kill its importer.
                raise ProtocolMismatch(
                    f"{source} is not sealed against resizing (seals {seals:#x}): a process could "
                    "truncate it and kill this one with SIGBUS; is the sidecar a Kalos sidecar?"
                )
            size = st.st_size
            if size < HEADER_DTYPE.itemsize:
                raise ProtocolMismatch(f"{source} holds {size} bytes: too small for a Kalos segment header")
            if st.st_blocks * 512 < size:
                _reserve(fd, size, source)  # pages were freed (a hole punched): take them back now
            self._mmap = mmap.mmap(fd, size)
            self.buf = memoryview(self._mmap)
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, label: str, size: int) -> "Segment":
        """A new segment of ``size`` bytes, its pages reserved and its size sealed."""
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # A memfd is born 0777; only processes that may ptrace this one reach it through
            # /proc/<pid>/fd, but owner-only costs nothing and survives a leaked descriptor.
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            _reserve(fd, size, f"segment {label}")
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, source=f"segment {label} (memfd)", created=True)

    @classmethod
    def attach(cls, fd: int, *, source: str) -> "Segment":
        """Maps the segment a sidecar passed (the Segment owns ``fd`` from now on)."""
        return cls(fd, source=source, created=False)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Lets go of the mapping: it is unmapped once no view into it is left (at once when
        the caller dropped its views first, as the sidecar and the client do).

        Not unmapped here by force: a NumPy array made on ``buf`` keeps the memoryview alive
        but holds no export of it, so ``release()`` and ``mmap.close()`` would both succeed and
        leave a view that outlived its owner (a traceback's frame, a caller's reference)
        pointing at unmapped memory: reading it killed the process with SIGSEGV."""
        self.buf = None
        self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _reserve(fd: int, size: int, what: str) -> None:
    """Allocates every page of ``fd`` now: out of memory is then this clear error, here,
    instead of SIGBUS at the first touch of a page (issue 19, item 2)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot reserve {size:,} bytes of shared memory for {what}: {exc.strerror}; free memory, "
            "or serve with fewer --slots or a smaller --max-batch"
        ) from None
