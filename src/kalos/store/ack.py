"""The acknowledged-writes record of a SQLite store: ``<db>-ack``, its byte layout and its checks.

SQLite keeps every commit since the last checkpoint in the -wal file only. If that file is
deleted, or damaged (its checksums then end the replay at the damage), after a crash, SQLite
opens what the db file holds without a word: the review's sidecar started with 0 of 20,000
acknowledged rows, and integrity_check said ok (issue 19). So every commit also bumps a counter
(``write_seq``) in the store's meta table, and after the commit, before the write is
acknowledged, the counter and the highest id are written here, a separate small file
(fdatasync'ed). A store whose counter or ids fall short of its record has lost acknowledged
writes (:func:`lost_writes`).

Layout: two slots at offsets 0 and :data:`SLOT_BYTES`, written alternately (a write torn by a
crash leaves the other one whole), each one :data:`RECORD` (44 bytes) followed by the CRC-32 of
its bytes (4 bytes, little endian); the slot with the larger ``write_seq`` and a good CRC counts.
"""
from __future__ import annotations

import os
import stat
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from kalos.errors import StoreError

__all__ = ["AckRecord", "AckFile", "RECORD", "SLOT_BYTES", "ack_path", "read_ack", "lost_writes"]

#: One slot's record: magic, version, the store's created_at, write_seq, the highest id, the
#: time of the write (little endian, no padding).
RECORD = struct.Struct("<8sIdQqd")
MAGIC = b"KALOSACK"
VERSION = 1
SLOT_BYTES = 512


@dataclass(frozen=True)
class AckRecord:
    """What ``<db>-ack`` says was acknowledged: ``write_seq`` commits, ids up to ``last_id``."""

    store_created: float
    write_seq: int
    last_id: int


def ack_path(path: str | os.PathLike) -> Path:
    """The acknowledged-writes record of the store at ``path``."""
    return Path(f"{os.fspath(path)}-ack")


def _read(fd: int) -> AckRecord | None:
    best: AckRecord | None = None
    for slot in range(2):
        raw = os.pread(fd, SLOT_BYTES, slot * SLOT_BYTES)
        size = RECORD.size
        if len(raw) < size + 4 or zlib.crc32(raw[:size]) != int.from_bytes(raw[size : size + 4], "little"):
            continue  # never written, or torn by a crash mid-write: the other copy counts
        magic, version, created, seq, last_id, _at = RECORD.unpack(raw[:size])
        if magic != MAGIC or version != VERSION:
            continue
        if best is None or seq > best.write_seq:
            best = AckRecord(created, seq, last_id)
    return best


def read_ack(path: str | os.PathLike) -> AckRecord | None:
    """The record of the store at ``path`` (None if there is none), read without creating anything."""
    try:
        fd = os.open(ack_path(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read(fd)
    finally:
        os.close(fd)


def lost_writes(path: Path, record: AckRecord | None, created: float, seq: int, last_id: int) -> str | None:
    """Why the store at ``path`` (created at ``created``, holding ``seq`` commits and ids up to
    ``last_id``) lacks writes ``record`` says were acknowledged, or None."""
    if record is None or record.store_created != created:
        return None  # no record yet, or one left over from another store at this path
    if record.write_seq <= seq and record.last_id <= last_id:
        return None
    return (
        f"store {path} has lost acknowledged writes: {ack_path(path)} records {record.write_seq:,} committed "
        f"writes (item ids up to {record.last_id:,}), but the store holds only {seq:,} (ids up to {last_id:,}): "
        f"writes {seq + 1:,} to {record.write_seq:,} are missing, probably because its -wal file was deleted or "
        f"damaged after a crash. Restore the store (and its -wal) from a backup; or, to serve what is left, "
        f"move {ack_path(path)} away and start again"
    )


class AckFile:
    """The record of a store open for writing, kept open to be rewritten after every commit."""

    def __init__(self, store_path: Path, created: float) -> None:
        """Opens (creates, 0600) the record of the store at ``store_path`` (StoreError if it
        cannot, or if it is not a regular file of this uid: never written through a symlink or
        someone else's file). ``created``: the store's created_at, written in every record."""
        self.path = ack_path(store_path)
        self._store_path = store_path
        self._created = created
        self._next_slot = 0
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StoreError(
                f"store {store_path}: cannot open its record of acknowledged writes {self.path}: {e.strerror}"
            ) from None
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise StoreError(f"store {store_path}: {self.path} is not a regular file of uid {os.getuid()}; move it away")
        except BaseException:
            self.close()
            raise

    def check(self, seq: int, last_id: int) -> None:
        """StoreError if the store, holding ``seq`` commits and ids up to ``last_id``, lacks
        writes this record says were acknowledged."""
        problem = lost_writes(self._store_path, _read(self._fd), self._created, seq, last_id)
        if problem is not None:
            raise StoreError(problem)

    def write(self, seq: int, last_id: int) -> None:
        """Records ``seq`` commits and ids up to ``last_id`` and syncs it (after a commit; OSError
        if the write or the sync fails)."""
        body = RECORD.pack(MAGIC, VERSION, self._created, seq, last_id, time.time())
        os.pwrite(self._fd, body + zlib.crc32(body).to_bytes(4, "little"), self._next_slot * SLOT_BYTES)
        os.fdatasync(self._fd)
        self._next_slot ^= 1

    def close(self) -> None:
        """Closes the record (not a store file: closing it drops none of SQLite's locks). Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
