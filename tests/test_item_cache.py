"""The sidecar's cache of items for get and recall_text replies (kalos.server.item_cache): what it
returns is what the store holds now, after every kind of write, and it stays within its bytes."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SidecarPool, short_tempdir, unique_name

from kalos import Client
from kalos.errors import InvalidArgument
from kalos.ipc.control import encode_value
from kalos.server import item_cache
from kalos.server.item_cache import ItemCache, item_fields
from kalos.store.sqlite import Store
from kalos.validation import Item

DIM = 8


class FakeStore:
    """The part of a store the cache reads: get() (counted) and revision."""

    def __init__(self, items: dict[int, Item], revision: int | None = 0) -> None:
        self.items = items
        self.revision = revision
        self.reads: list[list[int]] = []
        self.during_read = lambda: None

    def get(self, ids: Any) -> list[Item | None]:
        self.reads.append(list(ids))
        self.during_read()
        return [self.items.get(int(i)) for i in ids]


def make_item(item_id: int, text: str = "", expires_at: float | None = None) -> Item:
    return Item(id=item_id, namespace="n", text=text or f"text {item_id}", metadata={"i": item_id, "s": "é\n"},
                created_at=1.5, expires_at=expires_at)


def no_floor(_size: int) -> None:
    pass


def test_items_are_read_once_and_encoded_as_a_reply_encodes_them():
    store = FakeStore({i: make_item(i) for i in range(5)})
    cache = ItemCache(store, 1 << 20)
    first = cache.encoded([3, 1, 9], check_floor=no_floor)
    assert first == [encode_value(item_fields(store.items[3])), encode_value(item_fields(store.items[1])), None]
    assert json.loads(first[0]) == {**item_fields(store.items[3])}
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
    store.revision = 1
    (body,) = cache.encoded([1], check_floor=no_floor)
    assert json.loads(body)["text"] == "new" and len(store.reads) == 2


def test_an_item_read_while_a_write_committed_is_not_kept():
    store = FakeStore({1: make_item(1, "old")})
    cache = ItemCache(store, 1 << 20)

    def write_commits() -> None:  # the read saw the old row; the write then committed
        store.revision += 1
        store.during_read = lambda: None

    store.during_read = write_commits
    assert json.loads(cache.encoded([1], check_floor=no_floor)[0])["text"] == "old"
    store.items[1] = make_item(1, "new")
    assert json.loads(cache.encoded([1], check_floor=no_floor)[0])["text"] == "new"
    assert cache.stats()["entries"] == 1


def test_a_store_without_a_revision_is_read_every_time():
    store = FakeStore({1: make_item(1)}, revision=None)
    cache = ItemCache(store, 1 << 20)
    for _ in range(3):
        cache.encoded([1], check_floor=no_floor)
    assert len(store.reads) == 3 and cache.stats()["entries"] == 0


def test_an_expired_item_is_absent_without_a_read(monkeypatch):
    now = time.time()
    store = FakeStore({1: make_item(1, expires_at=now + 60), 2: make_item(2)})
    cache = ItemCache(store, 1 << 20)
    assert None not in cache.encoded([1, 2], check_floor=no_floor)
    monkeypatch.setattr(item_cache.time, "time", lambda: now + 61)
    assert cache.encoded([1, 2], check_floor=no_floor)[0] is None
    assert len(store.reads) == 1 and cache.stats()["entries"] == 1


def test_the_cache_keeps_at_most_its_bytes_least_recently_used_out():
    store = FakeStore({i: make_item(i, "x" * 200) for i in range(10, 100)})  # (ids of two digits: one size)
    size = len(encode_value(item_fields(store.items[10]))) + item_cache._ENTRY_OVERHEAD
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
    cached = len(encode_value(item_fields(store.items[2])))
    floors: list[int] = []

    def refuse(size: int) -> None:
        floors.append(size)
        raise InvalidArgument("too large")

    monkeypatch.setattr(item_cache, "encode_value", lambda value: pytest.fail("encoded before the floor check"))
    with pytest.raises(InvalidArgument):
        cache.encoded([1, 2], check_floor=refuse)
    assert floors == [1000 + cached], "what is cached, and the texts of the rest"


def test_store_revision_grows_with_changes_and_not_with_adds(tmp_path, rng):
    path = tmp_path / "m.db"
    with Store.open(path, dim=DIM) as store:
        vectors = rng.standard_normal((4, DIM)).astype(np.float32)
        ids, *_ = store.add(vectors, namespace="n", texts=["a", "b", "c", "d"])
        assert store.revision == 0
        readonly = Store.open(path, readonly=True)
        try:
            assert readonly.revision is None, "another process writes what a readonly open reads"
        finally:
            readonly.close()
        store.delete([int(ids[0])])
        assert store.revision == 1
        store.delete_expired()  # (nothing due: no transaction)
        assert store.revision == 1


def test_get_through_the_sidecar_sees_every_kind_of_write(sidecars: SidecarPool, rng):
    store_dir = short_tempdir("ic")
    name = unique_name("ic")
    try:
        sidecars.start(Path(store_dir) / "m.db", name=name, dim=DIM)
        with Client(name, timeout=5.0) as client:
            vectors = rng.standard_normal((5, DIM)).astype(np.float32)
            ids = client.add(vectors, texts=["a0", "b0", "c0", "d0", "e0"], namespace="n",
                             keys=["a", "b", "c", "d", "e"], ttl=[None, None, 600.0, None, None]).tolist()
            a, b, c, d, e = ids

            def texts() -> list[str | None]:
                return [None if item is None else item.text for item in client.get(ids=ids)]

            assert texts() == ["a0", "b0", "c0", "d0", "e0"]
            assert texts() == ["a0", "b0", "c0", "d0", "e0"]
            assert client.stats()["item_cache"]["hits"] >= 5, "the second get was served from the cache"
            client.update("a", namespace="n", text="a1", metadata={"v": 1})
            client.add(vectors[1:2], texts=["b1"], namespace="n", keys=["b"])  # an upsert of b, in place
            assert texts() == ["a1", "b1", "c0", "d0", "e0"]
            assert client.get(ids=[a])[0].metadata == {"v": 1}
            before = client.get(ids=[c])[0].expires_at
            client.renew(["c"], 3600.0, namespace="n")
            assert client.get(ids=[c])[0].expires_at > before + 1000
            client.delete(ids=[d])
            assert texts() == ["a1", "b1", "c0", None, "e0"]
            client.drop_namespace("n")
            assert texts() == [None] * 5
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
