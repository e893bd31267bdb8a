"""A SQLite store's file: the header that makes it one, its atomic creation (the schema it is
created with is :mod:`kalos.store.sqlite`'s), the checks of its directory and side files before
SQLite opens them, and this process's one shared descriptor per store file with the writer's
flock.

The rows and transactions are :class:`kalos.store.sqlite.Store`'s; this module is what the file
system must guarantee around them (issue 19: planted -wal/-shm files, replaced files, a second
writer).
"""
from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
import stat
import tempfile
import threading
from pathlib import Path
from typing import Callable

from kalos.errors import NotAKalosStore, StoreError, StoreLocked

__all__ = [
    "APPLICATION_ID", "FileKey",
    "acquire", "lock_writer", "release", "check_header", "check_directory", "prepare_side_files", "create",
]

APPLICATION_ID = 0x4B4C4F53  # b"KLOS"

_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100
_APPLICATION_ID_OFFSET = 68

#: A store file's identity in this process: (st_dev, st_ino).
FileKey = tuple[int, int]


# -- the per-process table of store files --------------------------------------------------
#
# SQLite locks with POSIX fcntl locks, and POSIX drops *all* of a process's fcntl locks on a
# file as soon as the process closes *any* descriptor of that file (SQLite's docs list this
# as a way to corrupt a database). So Kalos never closes a descriptor of a store file
# while a Store of this process may still have it open through SQLite: each file (device,
# inode) gets one shared descriptor, used for the header read and the flock, and closed only
# when the last Store of this process on that file closes. The same table also tells a second
# writer in this process that the flock is already ours (flock would happily grant it again
# on the shared descriptor).


class _FileRef:
    """This process's one descriptor of a store file, its references, whether a Store of this
    process holds its writer's flock, and descriptors of the file opened by chance (a path
    replaced by it while being opened), kept until the last reference goes."""

    __slots__ = ("fd", "refs", "writer", "extra_fds")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 0
        self.writer = False
        self.extra_fds: list[int] = []


_files: dict[FileKey, _FileRef] = {}
_files_lock = threading.Lock()


def release(key: FileKey, *, writer: bool) -> None:
    """One reference to the file ``key`` fewer (and its flock released if ``writer``); the
    descriptor is closed with the last one."""
    with _files_lock:
        ref = _files.get(key)
        if ref is None:
            return
        if writer and ref.writer:
            ref.writer = False
            fcntl.flock(ref.fd, fcntl.LOCK_UN)
        ref.refs -= 1
        if ref.refs <= 0:
            del _files[key]
            for fd in (ref.fd, *ref.extra_fds):
                os.close(fd)


def _lock_holder(st: os.stat_result) -> int | None:
    """The pid that holds a flock on the file, from /proc/locks (Linux); None if unknown."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:  # not the store file: closing it is harmless
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; waiters have a "->" field.
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[2] != "->" and parts[5] == wanted:
                    pid = int(parts[4])
                    return pid if pid > 0 else None  # 0: the holder is in another pid namespace
    except (OSError, ValueError):
        pass
    return None


def acquire(path: Path, st: os.stat_result) -> tuple[FileKey, int]:
    """One more reference to this process's shared descriptor of the store file at ``path``
    (``st``: its stat): its key (for :func:`lock_writer` and :func:`release`) and the descriptor."""
    key = (st.st_dev, st.st_ino)
    with _files_lock:
        ref = _files.get(key)
        if ref is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise StoreError(f"store {path} cannot be opened: {e.strerror}") from None
            fst = os.fstat(fd)
            if (fst.st_dev, fst.st_ino) != key:
                other = _files.get((fst.st_dev, fst.st_ino))
                if other is None:
                    os.close(fd)  # a different file, which no Store of ours has open
                else:
                    # A store file another Store of ours has open: closing this descriptor
                    # would drop its locks, so it stays open until that file's last Store closes.
                    other.extra_fds.append(fd)
                raise StoreError(f"store {path} was replaced by another file while being opened")
            ref = _files[key] = _FileRef(fd)
        ref.refs += 1
        return key, ref.fd


def lock_writer(key: FileKey, path: Path, st: os.stat_result) -> None:
    """Takes the writer's flock of an acquired store file; StoreLocked, naming the holder, if
    another process or another Store of this one writes there."""
    with _files_lock:
        ref = _files[key]
        if ref.writer:
            # flock would grant the lock again on the shared descriptor, so the table is
            # what knows that a Store of this process already writes here.
            raise StoreLocked(f"store {path} is already open for writing in this process (pid {os.getpid()})")
        try:
            fcntl.flock(ref.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _lock_holder(st)
            who = f"pid {pid}" if pid is not None else "another process"
            raise StoreLocked(f"store {path} is already open by another sidecar ({who})") from None
        ref.writer = True


def check_header(fd: int, path: Path) -> None:
    """NotAKalosStore unless the file (``fd``, an acquired descriptor) starts as a Kalos store:
    an SQLite header with our application_id. Nothing else reads the file first."""
    # Read through the shared descriptor: opening and closing another one would drop SQLite's
    # locks on this file held by other Stores of this process.
    header = os.pread(fd, _HEADER_BYTES, 0)
    if len(header) < _HEADER_BYTES or not header.startswith(_SQLITE_MAGIC):
        raise NotAKalosStore(f"{path} is not a Kalos store: not an SQLite database")
    app_id = int.from_bytes(header[_APPLICATION_ID_OFFSET : _APPLICATION_ID_OFFSET + 4], "big")
    if app_id != APPLICATION_ID:
        # Someone else's database: stop before SQLite opens it, which could create -wal
        # and -shm files next to it.
        raise NotAKalosStore(
            f"{path} is not a Kalos store: an SQLite database of another application"
            f" (application_id {app_id:#010x})"
        )


# -- creation ----------------------------------------------------------------------------------


def _make_dirs(directory: Path) -> None:
    # Path.mkdir(parents=True) gives the parents the default mode; every directory created
    # here holds memories, so each one is 0700.
    missing: list[Path] = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # created concurrently by someone else: theirs to set up
        except OSError as e:
            raise StoreError(f"cannot create directory {d}: {e.strerror}") from None


def check_directory(directory: Path) -> None:
    """Refuses a store directory in which another user can rename or replace our files.

    In a group- or other-writable directory without the sticky bit, anyone with write access
    can replace the db or its -wal/-shm between our checks and SQLite's opens. A sticky one
    (like /tmp) is allowed: there nobody may remove or rename another user's files, and
    :func:`prepare_side_files` makes sure that -wal and -shm are ours.
    """
    try:
        st = os.stat(directory)
    except OSError as e:
        raise StoreError(f"store directory {directory} cannot be examined: {e.strerror}") from None
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise StoreError(
            f"store directory {directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}, uid "
            f"{st.st_uid}, not sticky): anyone there could replace the store or its -wal/-shm files and read or "
            f"change your memories; move the store to a directory only you can write, or `chmod go-w {directory}`"
        )


def prepare_side_files(path: Path, db_owner: int) -> None:
    """Makes sure ``<db>-wal`` and ``<db>-shm`` are this user's, mode 0600, before SQLite opens
    them: each missing one is created here, exclusively and without following a symlink;
    each existing one must be a regular file of this uid (or of the db file's owner, whom the
    store belongs to anyway: root inspecting a user's store), with no group or other
    permissions and one link. SQLite opens them without O_EXCL, so in a shared directory it would adopt
    files another user planted (0666) after a clean stop removed ours, and write the new text
    of every memory where he reads it."""
    uid = os.getuid()
    for suffix in ("-wal", "-shm"):
        side = f"{path}{suffix}"
        try:
            fd = os.open(side, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            pass
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                continue  # a read-only place: SQLite cannot create it either (a readonly open)
            raise StoreError(f"cannot create {side}: {e.strerror}") from None
        else:
            os.close(fd)  # empty: SQLite takes an empty -wal as no WAL, and sizes -shm itself
            continue
        st = os.lstat(side)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (uid, db_owner) or st.st_mode & 0o077 or st.st_nlink != 1:
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else f"mode {stat.S_IMODE(st.st_mode):04o}"
            raise StoreError(
                f"{side} is not this user's own file (uid {st.st_uid}, {kind}, {st.st_nlink} link(s); this is uid "
                f"{uid}): SQLite would write your memories into it, where its owner can read them; remove it (as its "
                f"owner or root) once no sidecar uses the store, and keep stores in a directory only you can write"
            )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create(path: Path, build: Callable[[Path], None]) -> None:
    """Creates an empty store at ``path``, atomically: it appears complete or not at all.
    ``build`` writes the schema into the new file (a temporary name, published once whole)."""
    for suffix in ("-wal", "-journal"):
        # SQLite would replay a leftover journal of a deleted store into the new one.
        if os.path.lexists(f"{path}{suffix}"):
            raise StoreError(
                f"store {path} does not exist but {path}{suffix} does (left over from a deleted"
                " store?); move it away before creating a new store there"
            )
    _make_dirs(path.parent)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".creating", dir=path.parent)  # 0600
    except OSError as e:
        raise StoreError(f"cannot create store {path}: {e.strerror}") from None
    os.close(fd)  # nothing else has this new inode open yet, so closing drops no one's locks
    tmp = Path(tmp_name)
    try:
        build(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _publish(tmp, path)
        _fsync_dir(path.parent)
    except sqlite3.Error as e:
        raise StoreError(f"cannot create store {path}: {e}") from None
    except OSError as e:
        raise StoreError(f"cannot create store {path}: {e}") from None
    finally:
        for leftover in (tmp, Path(f"{tmp}-journal"), Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass


def _publish(tmp: Path, path: Path) -> None:
    # link() rather than replace(): it fails if the path exists, so two processes creating the
    # same store at once cannot clobber each other; the loser then opens the winner's store.
    try:
        os.link(tmp, path)
    except FileExistsError:
        return
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A filesystem without hard links: replace, which is atomic but not exclusive.
        if not os.path.lexists(path):
            os.replace(tmp, path)
