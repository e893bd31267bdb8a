"""The acknowledged-writes record's file (kalos.store.ack): its two slots, its checks."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kalos.errors import StoreError
from kalos.store.ack import RECORD, SLOT_BYTES, AckFile, AckRecord, ack_path, lost_writes, read_ack


def test_the_latest_whole_slot_counts(tmp_path: Path) -> None:
    store = tmp_path / "m.db"
    record = AckFile(store, created=1.5)
    try:
        assert read_ack(store) is None  # created empty: no record yet
        record.write(3, 30)
        record.write(4, 41)  # the other slot
        assert read_ack(store) == AckRecord(1.5, 4, 41)
        record.write(5, 50)  # back in the first slot
        assert read_ack(store) == AckRecord(1.5, 5, 50)
    finally:
        record.close()
    # The newer slot torn by a crash mid-write (its CRC no longer matches): the older one counts.
    with open(ack_path(store), "r+b") as f:
        f.seek(RECORD.size - 3)
        f.write(b"\xff\xff\xff")
    assert read_ack(store) == AckRecord(1.5, 4, 41)
    # Both torn, or bytes of another format: no record.
    with open(ack_path(store), "r+b") as f:
        f.seek(SLOT_BYTES + 2)
        f.write(b"XX")
    assert read_ack(store) is None


def test_check_names_the_missing_writes(tmp_path: Path) -> None:
    store = tmp_path / "m.db"
    record = AckFile(store, created=7.0)
    try:
        record.write(20, 2000)
        record.check(20, 2000)  # all there
        record.check(21, 2100)  # ahead (a commit between the record's read and the store's)
        with pytest.raises(StoreError, match=r"lost acknowledged writes.*20 committed writes.*ids up to 2,000.*writes 1 to 20"):
            record.check(0, 0)
    finally:
        record.close()
    # A record of another store once at this path (another created_at) is no evidence.
    assert lost_writes(store, AckRecord(6.0, 20, 2000), 7.0, 0, 0) is None


def test_a_planted_symlink_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "m.db"
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, ack_path(store))
    with pytest.raises(StoreError, match="record of acknowledged writes"):
        AckFile(store, created=1.0)
    assert target.read_bytes() == b""
