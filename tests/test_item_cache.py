"""The sidecar's cache of items for get and recall_text replies (kalos.server.item_cache): what it
returns is what the store holds now, after every kind of write, and it stays within its bytes."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from conftest import SidecarPool, short_tempdir, unique_name, wait_until

from kalos import Client
from kalos.errors import InvalidArgument, UnknownKey
from kalos.ipc.control import encode_value
from kalos.server import item_cache
from kalos.server.item_cache import ItemCache, item_fields
from kalos.store.changes import ChangeLog
from kalos.store.sqlite import ItemRow, Store
from kalos.validation import Item, check_update, encode_metadata
from kalos.where import compile_where

DIM = 8


class FakeStore:
    """The part of a store the cache reads: get_rows() (counted), revision and changed_since()."""

    def __init__(self, items: dict[int, Item], revision: int | None = 0) -> None:
        self.items = items
        self.revision = revision
        self.log: list[tuple[int, frozenset[int] | None]] = []
        self.reads: list[list[int]] = []
        self.during_read = lambda: None

    def commit(self, changed: set[int] | None = None) -> None:
        """A write committed that changed ``changed`` (None: rows it did not name)."""
        self.revision += 1
        self.log.append((self.revision, None if changed is None else frozenset(changed)))

    def changed_since(self, revision: int) -> frozenset[int] | None:
        later = [ids for at, ids in self.log if at > revision]
        return None if any(ids is None for ids in later) else frozenset().union(*later)

    def get_rows(self, ids: Any) -> list[ItemRow | None]:
        self.reads.append(list(ids))
        read = [row_of(self.items.get(int(i))) for i in ids]
        self.during_read()  # (what happens after the read, before the caller goes on)
        return read


def row_of(item: Item | None) -> ItemRow | None:
    """The row a store reads for ``item``: its metadata as the stores write it."""
    if item is None:
        return None
    (metadata,) = encode_metadata([item.metadata], 1)
    return ItemRow(item.id, item.namespace, item.text, metadata, item.created_at, item.key, item.updated_at,
                   item.expires_at)


def reply_value(item: Item | None) -> Any:
    """What a reply's JSON of ``item`` decodes to."""
    return json.loads(encode_value(item_fields(item)))


def make_item(item_id: int, text: str = "", expires_at: float | None = None) -> Item:
    return Item(id=item_id, namespace="n", text=text or f"text {item_id}", metadata={"i": item_id, "s": "é\n"},
                created_at=1.5, expires_at=expires_at)


def no_floor(_size: int) -> None:
    pass


@pytest.fixture
def sidecar_client(sidecars: SidecarPool) -> Iterator[tuple[Client, Path]]:
    """A client of a fresh CPU sidecar (dimension DIM) and the path of its store."""
    store_dir = short_tempdir("ic")
    try:
        path = Path(store_dir) / "m.db"
        name = unique_name("ic")
        sidecar = sidecars.start(path, name=name, dim=DIM)
        with Client(name, timeout=5.0) as client:
            yield client, path
        sidecar.stop(timeout=10)  # (before its store goes)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def test_items_are_read_once_and_encoded_as_a_reply_encodes_them():
    store = FakeStore({i: make_item(i) for i in range(5)})
    cache = ItemCache(store, 1 << 20)
    first = cache.encoded([3, 1, 9], check_floor=no_floor)
    assert [None if body is None else json.loads(body) for body in first] == [
        reply_value(store.items[3]), reply_value(store.items[1]), None]
    assert cache.encoded([1, 3], check_floor=no_floor) == [first[1], first[0]]
    assert store.reads == [[3, 1, 9]], "the second call found both in the cache"
    # An absent id is not remembered as absent: the store is asked again (it may be added since).
    cache.encoded([9], check_floor=no_floor)
    assert store.reads[-1] == [9]
    assert cache.stats() | {"bytes": 0} == {"entries": 2, "bytes": 0, "max_bytes": 1 << 20, "hits": 2, "misses": 4}


def test_a_moved_revision_empties_the_cache():
    store = FakeStore({1: make_item(1, "old")})
    cache = ItemCache(store, 1 << 20)
    cache.encoded([1], check_floor=no_floor)
    store.items[1] = make_item(1, "new")
    store.commit()
    (body,) = cache.encoded([1], check_floor=no_floor)
    assert json.loads(body)["text"] == "new" and len(store.reads) == 2


def test_a_write_drops_the_items_it_changed_and_keeps_the_rest():
    store = FakeStore({i: make_item(i, "old") for i in range(1, 5)})
    cache = ItemCache(store, 1 << 20)
    cache.encoded([1, 2, 3, 4], check_floor=no_floor)
    store.items[2] = make_item(2, "new")
    del store.items[3]
    store.commit({2, 3})
    got = cache.encoded([1, 2, 3, 4], check_floor=no_floor)
    assert [None if body is None else json.loads(body)["text"] for body in got] == ["old", "new", None, "old"]
    assert store.reads[-1] == [2, 3], "only the changed rows read again"
    store.commit(None)  # (a write that named no rows: everything goes)
    cache.encoded([1, 4], check_floor=no_floor)
    assert store.reads[-1] == [1, 4]


def test_an_item_read_before_a_write_is_not_kept_under_the_revision_after_it():
    # The narrowest window: this call read item 1 and found the revision unchanged after its
    # read; then, before it keeps the item, the write commits and another call moves the cache
    # to the new revision (dropping 1). The old row must not be kept under it.
    store = FakeStore({1: make_item(1, "old"), 2: make_item(2)})
    cache = ItemCache(store, 1 << 20)
    inner = cache._lock

    class RaceAtTheKeep:
        entered = 0

        def __enter__(self) -> None:
            RaceAtTheKeep.entered += 1
            if RaceAtTheKeep.entered == 2:  # (the first entry is the call's look, the second its keep)
                store.items[1] = make_item(1, "new")
                store.commit({1})
                cache.encoded([2], check_floor=no_floor)  # (another call's look)
            inner.__enter__()

        def __exit__(self, *exc: object) -> None:
            inner.__exit__(*exc)

    cache._lock = RaceAtTheKeep()  # type: ignore[assignment]
    assert json.loads(cache.encoded([1], check_floor=no_floor)[0])["text"] == "old"  # (read before the write)
    assert RaceAtTheKeep.entered >= 3, "the other call looked"
    assert json.loads(cache.encoded([1], check_floor=no_floor)[0])["text"] == "new"


def test_a_reply_is_one_state_of_the_store_when_a_write_commits_during_it():
    # 1 is cached; while 2 is read, a write deletes both: the reply says neither, as one read
    # of the store would, not 1 from before the write and 2 from after it.
    store = FakeStore({1: make_item(1), 2: make_item(2)})
    cache = ItemCache(store, 1 << 20)
    cache.encoded([1], check_floor=no_floor)

    def delete_both() -> None:
        store.during_read = lambda: None
        del store.items[1], store.items[2]
        store.commit({1, 2})

    store.during_read = delete_both
    assert cache.encoded([1, 2], check_floor=no_floor) == [None, None]
    assert store.reads[-1] == [1, 2], "read again, all of them at once"
    assert cache.encoded([1], check_floor=no_floor) == [None] and store.reads[-1] == [1], "not from the cache"


def test_a_store_without_a_revision_is_read_every_time():
    store = FakeStore({1: make_item(1)}, revision=None)
    cache = ItemCache(store, 1 << 20)
    for _ in range(3):
        cache.encoded([1], check_floor=no_floor)
    assert len(store.reads) == 3 and cache.stats()["entries"] == 0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def test_an_expired_item_is_absent_without_a_read(monkeypatch):
    clock = Clock(1000.0)
    monkeypatch.setattr(item_cache, "time", clock)
    store = FakeStore({1: make_item(1, expires_at=1060.0), 2: make_item(2)})
    cache = ItemCache(store, 1 << 20)
    assert None not in cache.encoded([1, 2], check_floor=no_floor)
    clock.now = 1059.999
    assert None not in cache.encoded([1, 2], check_floor=no_floor)
    clock.now = 1060.0  # (the store's live clause is expires_at > now: gone at that instant)
    assert cache.encoded([1, 2], check_floor=no_floor)[0] is None
    assert len(store.reads) == 1 and cache.stats()["entries"] == 1


def test_the_cache_keeps_at_most_its_bytes_least_recently_used_out():
    store = FakeStore({i: make_item(i, "x" * 200) for i in range(10, 100)})  # (ids of two digits: one size)
    size = len(item_cache.encode_item_row(row_of(store.items[10]))) + item_cache._ENTRY_OVERHEAD
    cache = ItemCache(store, 10 * size)
    cache.encoded(list(range(10, 20)), check_floor=no_floor)
    cache.encoded([10], check_floor=no_floor)  # (10 is now the most recently used)
    cache.encoded([20, 21], check_floor=no_floor)
    stats = cache.stats()
    assert stats["entries"] == 10 and stats["bytes"] == 10 * size
    store.reads.clear()
    cache.encoded([10, 13], check_floor=no_floor)
    assert store.reads == [], "10 was kept"
    cache.encoded([11], check_floor=no_floor)
    assert store.reads == [[11]], "11, the least recently used, went first"


def test_an_item_past_an_eighth_of_the_cache_is_served_not_kept():
    store = FakeStore({1: make_item(1, "y" * 5000), 2: make_item(2)})
    cache = ItemCache(store, 8 * 1000)
    assert json.loads(cache.encoded([1, 2], check_floor=no_floor)[0])["text"] == "y" * 5000
    assert cache.stats()["entries"] == 1


def test_the_floor_is_checked_before_anything_is_encoded(monkeypatch):
    store = FakeStore({1: make_item(1, "z" * 1000), 2: make_item(2, "w" * 10)})
    cache = ItemCache(store, 1 << 20)
    cache.encoded([2], check_floor=no_floor)
    cached = len(item_cache.encode_item_row(row_of(store.items[2])))
    floors: list[int] = []

    def refuse(size: int) -> None:
        floors.append(size)
        raise InvalidArgument("too large")

    monkeypatch.setattr(item_cache, "encode_item_row", lambda row: pytest.fail("encoded before the floor check"))
    with pytest.raises(InvalidArgument):
        cache.encoded([1, 2], check_floor=refuse)
    assert floors == [1000 + cached], "what is cached, and the texts of the rest"


def test_an_item_row_encodes_to_what_its_item_encodes_to(tmp_path, rng):
    """encode_item_row against encode_value(item_fields(item)), field for field and in order, on
    stored rows of every kind: without text or metadata, keyed, upserted (updated_at), expiring,
    texts and metadata with quotes, escapes, controls and non-ASCII; get_rows aligned with the
    ids asked for, None where absent."""
    texts = [None, "", 'quote " backslash \\ tab \t newline \n', "é 東京 🎉", "\x00 \x1f \x7f \u2028"]
    metadata = [None, {}, {"a": [1, 2.5, None, True, "\""], "é": {"東京": -0.0}}, {"big": 10**20, "tiny": 1e-300},
                {"s": "\x00\u2028"}]
    with Store.open(tmp_path / "m.db", dim=DIM) as store:
        plain = store.add(rng.standard_normal((5, DIM)).astype(np.float32), namespace="ns é", texts=texts,
                          metadata=metadata)[0].tolist()
        keyed = store.upsert(rng.standard_normal((2, DIM)).astype(np.float32), keys=["k 1", "k\"2"], namespace="n",
                             texts=["x", None], metadata=[{"v": 1}, None],
                             expires_at=np.array([time.time() + 600, np.nan]))[0].tolist()
        store.upsert(rng.standard_normal((1, DIM)).astype(np.float32), keys=["k 1"], namespace="n", texts=["y"])
        ids = [*plain, *keyed, 10**9]
        rows, items = store.get_rows(ids), store.get(ids)
        assert rows[-1] is None and items[-1] is None and all(row is not None for row in rows[:-1])
        assert [row.id for row in rows[:-1]] == ids[:-1]
        for row, item in zip(rows[:-1], items[:-1]):
            value = json.loads(item_cache.encode_item_row(row))
            assert value == reply_value(item) and list(value) == list(item_fields(item)), item
        assert items[5].updated_at is not None and items[6].expires_at is None


def _refuse_constant(name: str) -> None:
    raise ValueError(name)


@pytest.mark.parametrize("row", [
    ItemRow(1, "n", "t", '{"a": NaN}', 1.0, None, None, None),
    ItemRow(2, "n", "t", '{"a": [Infinity]}', 1.0, None, None, None),
    ItemRow(3, "n", "t", '{"a": -Infinity}', 1.0, None, None, None),
    ItemRow(4, "n", "t", '{"a": 1e400}', 1.0, None, None, None),
    ItemRow(5, "n", "t", b'{"i": 9, "s": "\xc3\xa9"}', 1.0, None, None, None),
    ItemRow(6, "n", "t", b"\xff{}", 1.0, None, None, None),
    ItemRow(18, "n", "t", b'\xef\xbb\xbf{"a": 1}', 1.0, None, None, None),
    ItemRow(19, "n", "t", '{"a": "\u00e9"}'.encode("utf-16"), 1.0, None, None, None),
    ItemRow(7, "n", "t", "  [1, 2.5, null]  ", 7, None, 8, 9),
    ItemRow(8, "n", "t", '{"d": 1, "d": 2}', 1.0, None, None, None),
    ItemRow(9, "n", "t", "[" * 5000 + "]" * 5000, 1.0, None, None, None),
    ItemRow(10, "n", b"bytes text", None, 1.0, None, None, None),
    ItemRow(11, "n", "t", None, 10**400, None, None, None),
    ItemRow(12, "n", "t", None, "1_0", None, None, "12.5"),
    ItemRow(13, "n", "t", None, float("inf"), None, None, None),
    ItemRow(14, "n", "t", None, 1.0, None, None, "soon"),
    ItemRow(15, "n", "t", None, True, "k", None, None),
    ItemRow(16, "n\ud800", "\u2028\x00", '{"\u00e9": "\ud800"}', 1.0, "\U0001f389", 2.5, None),
    ItemRow(17, "n", "t", '{"\\u00e9": "\\ud800 \\u2028 \\n"}', 1.0, None, None, None),
])
def test_a_row_another_tool_wrote_encodes_as_its_item_would_or_is_refused_by_name(row):
    """Rows Kalos never writes (metadata with NaN or out-of-range numbers, a BLOB, nesting past
    the parser's depth; timestamps as ints, text or booleans; lone surrogates): the reply's JSON
    decodes to what the Item's encoding did, is strict JSON, or the row is a StoreError naming
    the item where the Item's encoding failed too."""
    from kalos.errors import StoreError

    try:
        expected = json.loads(encode_value(item_fields(Store._item(row))))
    except Exception:  # (the old path refused it: so must the new one, by name)
        with pytest.raises(StoreError, match=f"item {row.id}: "):
            item_cache.encode_item_row(row)
        return
    body = item_cache.encode_item_row(row)
    assert json.loads(body, parse_constant=_refuse_constant) == expected


def test_an_expiry_the_store_holds_as_text_is_kept_as_a_number():
    store = FakeStore({})
    store.get_rows = lambda ids: [ItemRow(1, "n", "t", None, 1.0, None, None, "9999999999") for _ in ids]
    cache = ItemCache(store, 1 << 20)
    first = cache.encoded([1], check_floor=no_floor)
    assert cache.encoded([1], check_floor=no_floor) == first and cache.stats()["hits"] == 1


def test_a_row_another_tool_garbled_is_refused_by_name_and_the_rest_still_read(sidecar_client, rng):
    import sqlite3

    from kalos.errors import StoreError

    client, path = sidecar_client
    ids = client.add(rng.standard_normal((3, DIM)).astype(np.float32), texts=["a", "b", "c"],
                     metadata=[{"i": 0}, {"i": 1}, {"i": 2}]).tolist()
    foreign = sqlite3.connect(path, timeout=5.0)
    with foreign:
        foreign.execute("UPDATE items SET metadata = '{not json' WHERE id = ?", (ids[0],))
        foreign.execute("UPDATE items SET created_at = 'yesterday' WHERE id = ?", (ids[1],))
    foreign.close()
    with pytest.raises(StoreError, match=f"item {ids[0]}: its stored metadata is not JSON"):
        client.get(ids=[ids[0], ids[2]])
    with pytest.raises(StoreError, match=f"item {ids[1]}: its stored created_at is not a finite number"):
        client.get(ids=[ids[1]])
    (item,) = client.get(ids=[ids[2]])
    assert item.text == "c" and item.metadata == {"i": 2}


def test_get_by_key_reads_its_items_through_the_cache_and_follows_the_key(sidecar_client, rng):
    client, _ = sidecar_client

    def vector() -> np.ndarray:
        return rng.standard_normal((1, DIM)).astype(np.float32)

    client.add(np.vstack([vector(), vector()]), texts=["a0", "b0"], namespace="n", keys=["a", "b"])
    client.add(vector(), texts=["elsewhere"], namespace="m", keys=["a"])

    def texts(*keys: str, namespace: str = "n") -> list[str | None]:
        return [None if item is None else item.text for item in client.get(keys=list(keys), namespace=namespace)]

    assert texts("a", "b", "z") == ["a0", "b0", None]
    hits = client.stats()["item_cache"]["hits"]
    assert texts("b", "a") == ["b0", "a0"] and client.stats()["item_cache"]["hits"] == hits + 2
    assert texts("a", namespace="m") == ["elsewhere"]
    client.add(vector(), texts=["a1"], namespace="n", keys=["a"])  # (an upsert)
    assert texts("a", "b") == ["a1", "b0"]
    client.delete(keys=["a"], namespace="n")
    assert texts("a", "b") == [None, "b0"]
    client.add(vector(), texts=["a2"], namespace="n", keys=["a"])  # (the key again, a new id)
    assert texts("a", "b") == ["a2", "b0"]
    item = client.get(keys=["a"], namespace="n")[0]
    assert item.key == "a" and item.namespace == "n"


def test_an_item_read_while_a_write_commits_is_not_kept_though_the_cache_is_behind():
    # The cache is at revision 0 and so is this reader; the write commits during its read
    # (items 1 and 2). What it read may be after the write: kept under 0, a later reader that
    # found 1 here and 2 old in the cache would send a pair the store never held.
    store = FakeStore({1: make_item(1, "old"), 2: make_item(2, "old")})
    cache = ItemCache(store, 1 << 20)

    def write() -> None:
        store.during_read = lambda: None
        store.items[1], store.items[2] = make_item(1, "new"), make_item(2, "new")
        store.commit({1, 2})

    store.during_read = write
    cache.encoded([1], check_floor=no_floor)
    assert cache.stats()["entries"] == 0


def test_an_expired_item_replaced_under_its_id_is_read_again(tmp_path, rng):
    with Store.open(tmp_path / "m.db", dim=DIM) as store:
        cache = ItemCache(store, 1 << 20)
        (item,) = store.upsert(rng.standard_normal((1, DIM)).astype(np.float32), keys=["k"], namespace="n",
                               texts=["first"], expires_at=np.array([time.time() + 0.05]))[0]
        assert json.loads(cache.encoded([int(item)], check_floor=no_floor)[0])["text"] == "first"
        time.sleep(0.1)
        store.upsert(rng.standard_normal((1, DIM)).astype(np.float32), keys=["k"], namespace="n", texts=["second"])
        assert json.loads(cache.encoded([int(item)], check_floor=no_floor)[0])["text"] == "second"


def test_the_change_log_keeps_its_bounds_and_says_when_it_cannot_tell():
    log = ChangeLog(max_writes=4, max_ids=10, max_ids_per_write=5)
    log.record({1, 2})
    log.record({3})
    assert log.since(0) == {1, 2, 3} and log.since(1) == {3} and log.since(2) == frozenset()
    log.record(set(range(100, 106)))  # (more than a write names: every row)
    assert log.since(2) is None and log.since(3) == frozenset()
    for i in range(4):
        log.record({10 + i, 20 + i})
    assert log.revision == 7 and log.since(3) == {10, 11, 12, 13, 20, 21, 22, 23}
    assert log.since(2) is None, "the oldest entries went to keep 4 writes"
    log.record({30, 31, 32, 33, 34})  # (ids past 10 in all: the oldest go)
    assert log.since(5) == {12, 13, 22, 23, 30, 31, 32, 33, 34} and log.since(4) is None


def test_store_revision_grows_with_each_write_that_changes_rows_and_names_them(tmp_path, rng):
    path = tmp_path / "m.db"
    with Store.open(path, dim=DIM) as store:

        def vectors(n: int) -> np.ndarray:
            return rng.standard_normal((n, DIM)).astype(np.float32)

        def writes(write: Any, changed: Any = (), *, grows: bool = True) -> Any:
            """The write moves the revision (or not), and changed_since names exactly ``changed``."""
            before = store.revision
            out = write()
            assert store.revision == before + grows, write
            assert store.changed_since(before) == frozenset(int(i) for i in changed), write
            return out

        ids = writes(lambda: store.add(vectors(4), namespace="n", texts=["a", "b", "c", "d"]), grows=False)[0]
        k = writes(lambda: store.upsert(vectors(2), keys=["k1", "k2"], namespace="n", texts=["x", "y"]))[0]  # (new rows)
        writes(lambda: store.upsert(vectors(2), keys=["k1", "k3"], namespace="n", texts=["x2", "z"]), [k[0]])
        writes(lambda: store.update(check_update("k1", DIM, namespace="n", text="x3")), [k[0]])
        (t,) = writes(lambda: store.upsert(vectors(1), keys=["t"], namespace="n",
                                           expires_at=np.array([time.time() + 60])))[0]
        writes(lambda: store.renew(["t", "k2"], "n", 600.0), [t])  # (k2 never expires: not renewed)
        writes(lambda: store.renew(["nobody"], "n", 600.0), grows=False)
        writes(lambda: store.delete_keys(["k2"], namespace="n"), [k[1]])
        writes(lambda: store.delete([int(ids[0]), 10**9]), [ids[0], 10**9])  # (an absent id named: harmless)
        writes(lambda: store.delete([10**9]), grows=False)
        writes(lambda: store.delete_where(namespace="n", where=compile_where({"absent": 1})), grows=False)
        rest = [item.id for item in store.list_items(namespace="n", limit=1000)[0]]
        assert len(rest) == 6  # (b, c, d, k1, k3, t)
        writes(lambda: store.delete_where(namespace="n", where=None), rest)
        added = store.add(vectors(1), namespace="m", texts=["g"])[0]
        writes(lambda: store.undo_add(added), added)
        (soon,) = store.add(vectors(1), namespace="m", expires_at=np.array([time.time() + 0.01]))[0]
        writes(lambda: store.delete_expired(time.time() + 1.0), [soon])
        writes(lambda: store.delete_expired(time.time() + 1.0), grows=False)  # (nothing due: no transaction)

        # An upsert of a key whose item expired: a new memory under the same id, named.
        (old,) = store.upsert(vectors(1), keys=["brief"], namespace="n", texts=["brief"],
                              expires_at=np.array([time.time() + 0.05]))[0]
        time.sleep(0.1)
        writes(lambda: store.upsert(vectors(1), keys=["brief"], namespace="n", texts=["again"]), [old])
        # A write that failed and was rolled back changed nothing.
        before = store.revision
        with pytest.raises(UnknownKey):
            store.update(check_update("nobody", DIM, namespace="n", text="x"))
        assert store.revision == before

        # A write of more rows than the log names, or one past what it holds: cannot tell (None).
        start = store.revision
        many = store.add(vectors(5000), namespace="big")[0]
        store.delete(many)
        assert store.changed_since(start) is None
        start = store.revision
        (one,) = store.add(vectors(1), namespace="m", texts=["h"])[0]
        for i in range(store._changes.max_writes + 1):
            store.update(check_update(int(one), DIM, text=f"h{i}"))
        assert store.changed_since(start) is None
        assert store.changed_since(store.revision - 1) == frozenset([int(one)])

        readonly = Store.open(path, readonly=True)
        try:
            assert readonly.revision is None, "another process writes what a readonly open reads"
        finally:
            readonly.close()
    assert store.revision is None, "closed: a cache in front of it must read it (and hear it is closed)"


def test_get_through_the_sidecar_sees_every_kind_of_write(sidecar_client, rng):
    client, _ = sidecar_client
    keys = ["a", "b", "c", "d", "e", "f", "g"]
    vectors = rng.standard_normal((len(keys), DIM)).astype(np.float32)
    ids = client.add(vectors, texts=[f"{k}0" for k in keys], namespace="n", keys=keys,
                     metadata=[{"g": i % 2} for i in range(len(keys))],
                     ttl=[None, None, 600.0, None, None, None, None]).tolist()
    by_key = dict(zip(keys, ids))

    def texts() -> dict[str, str | None]:
        return {k: None if item is None else item.text for k, item in zip(keys, client.get(ids=ids))}

    def after(write: Any, **changed: str | None) -> int:
        """A get fills the cache; the write; the next get says what changed, and only that.
        Returns how many items that get read from the store."""
        expected = texts()
        hits = client.stats()["item_cache"]["hits"]
        assert texts() == expected and client.stats()["item_cache"]["hits"] > hits, "served from the cache"
        write()
        expected.update(changed)
        misses = client.stats()["item_cache"]["misses"]
        assert texts() == expected, write
        return client.stats()["item_cache"]["misses"] - misses

    read = after(lambda: client.update("a", namespace="n", text="a1", metadata={"v": 1}), a="a1")
    assert read == 1, "the other items stayed in the cache"
    assert client.get(ids=[by_key["a"]])[0].metadata == {"v": 1}
    after(lambda: client.add(vectors[1:2], texts=["b1"], namespace="n", keys=["b"]), b="b1")  # upsert, in place
    before = client.get(ids=[by_key["c"]])[0].expires_at
    after(lambda: client.renew(["c"], 3600.0, namespace="n"))
    assert client.get(ids=[by_key["c"]])[0].expires_at > before + 1000
    after(lambda: client.delete(ids=[by_key["d"]]), d=None)
    after(lambda: client.delete(keys=["e"], namespace="n"), e=None)
    after(lambda: client.delete(namespace="n", where={"g": 1}), f=None)  # (b lost its g to the upsert)
    client.add(vectors[:1], texts=["short-lived"], namespace="t", ttl=0.5)
    short = int(client.list(namespace="t").items[0].id)
    assert client.get(ids=[short])[0].text == "short-lived"
    wait_until(lambda: client.get(ids=[short])[0] is None, "the short-lived memory expired")
    after(lambda: client.drop_namespace("n"), a=None, b=None, c=None, g=None)


def test_get_and_list_replies_carry_the_same_item_fields_and_no_vector(sidecar_client, rng):
    """get by id, by key and list name the same fields: Item's but its vector (a client from
    before Item.vector builds Item(**fields) and knows no such field)."""
    client, _ = sidecar_client
    (item_id,) = client.add(rng.standard_normal((1, DIM)).astype(np.float32), texts=["t"], namespace="n",
                            keys=["k"], metadata=[{"m": 1}]).tolist()
    expected = list(item_fields(client.get(ids=[item_id])[0]))  # (item_fields leaves the vector out)
    by_id, _ = client._control({"op": "get", "ids": [item_id]})
    by_key, _ = client._control({"op": "get", "keys": ["k"], "namespace": "n"})
    page, _ = client._control({"op": "list", "namespace": "n"})
    for reply in (by_id, by_key, page):
        assert [list(fields) for fields in reply["items"]] == [expected]


def test_readers_beside_writers_never_read_an_item_older_than_its_last_committed_write(tmp_path, rng):
    """Writer threads rewrite items (text "v<n>", n growing per item) while reader threads read
    them through the cache: every item a reader gets is at least the version committed before
    its call began, and none is left stale at the end."""
    import threading

    with Store.open(tmp_path / "m.db", dim=DIM) as store:
        cache = ItemCache(store, 1 << 20)
        ids = [int(i) for i in store.add(rng.standard_normal((12, DIM)).astype(np.float32), namespace="n",
                                         texts=["v0"] * 12)[0]]
        committed = {i: 0 for i in ids}
        lock = threading.Lock()
        stop = threading.Event()
        problems: list[str] = []

        def writer(mine: list[int]) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                item = mine[n % len(mine)]
                with lock:  # (the version is committed, then known to have been)
                    store.update(check_update(item, DIM, text=f"v{n}"))
                    committed[item] = n

        def reader(seed: int) -> None:
            pick = np.random.default_rng(seed)
            while not stop.is_set():
                wanted = [int(i) for i in pick.choice(ids, size=4, replace=False)]
                with lock:
                    floor = {i: committed[i] for i in wanted}
                for item, body in zip(wanted, cache.encoded(wanted, check_floor=no_floor)):
                    version = int(json.loads(body)["text"][1:])
                    if version < floor[item]:
                        problems.append(f"item {item}: v{version} after v{floor[item]} was committed")

        threads = [threading.Thread(target=writer, args=(ids[:6],)), threading.Thread(target=writer, args=(ids[6:],))]
        threads += [threading.Thread(target=reader, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        stop.set()
        for thread in threads:
            thread.join()
        assert not problems, problems[:5]
        assert cache.stats()["hits"] > 0
        for item in ids:
            assert [json.loads(body) for body in cache.encoded([item], check_floor=no_floor)] == [
                reply_value(store.get([item])[0])]
