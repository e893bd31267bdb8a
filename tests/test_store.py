"""Tests of kalos.store.sqlite: round trips, validation that changes nothing, foreign files left
untouched, writer exclusivity across threads and processes, and kill -9 crash safety."""
from __future__ import annotations

import fcntl
import functools
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kalos.store.sqlite as store_mod
import kalos.store.sqlite_file as store_file
from kalos.engine.base import as_unit_rows
from kalos.errors import DimensionMismatch, InvalidArgument, NotAKalosStore, StoreError, StoreLocked
from kalos.store.sqlite import APPLICATION_ID, Store
from kalos.validation import Item

SRC = Path(__file__).resolve().parents[1] / "src"
DIM = 8


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    return as_unit_rows(rng.standard_normal((n, dim)))


def bits(a: np.ndarray) -> np.ndarray:
    """The float32 bit patterns, so comparisons are bit-exact (and -0.0 != 0.0)."""
    return np.ascontiguousarray(a, dtype="<f4").view("<u4")


def all_rows(s: Store, batch: int = 65536) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    parts = list(s.iter_rows(batch))
    if not parts:
        return np.empty(0, np.int64), np.empty((0, s.dim), np.float32), np.empty(0, np.int32), np.empty(0)
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))  # type: ignore[return-value]


def run_python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True, **kw)


@pytest.fixture
def store(tmp_path: Path):
    s = Store.open(tmp_path / "m.db", dim=DIM)
    yield s
    s.close()


# -- creation and round trip ----------------------------------------------------------------


def test_round_trip_is_exact(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    n = 257
    vectors = unit(rng, n, 64)
    texts = [None if i % 5 == 0 else f"memory {i} ✓ " + "x" * int(rng.integers(0, 3000)) for i in range(n)]
    texts[1] = ""
    metadata = [None if i % 7 == 0 else {"i": i, "tags": ["a", "ü"], "nested": {"f": float(rng.random())}} for i in range(n)]
    metadata[2] = {}
    created = rng.uniform(1e9, 2e9, n)
    with Store.open(tmp_path / "m.db", dim=64) as s:
        ids, ns_id, got_created = s.add(vectors, namespace="notes", texts=texts, metadata=metadata, created_at=created)
        assert ids.dtype == np.int64 and list(ids) == list(range(1, n + 1))
        assert got_created.dtype == np.float64 and np.array_equal(got_created, created)
        assert s.namespaces() == {"default": 1, "notes": ns_id}
        items = s.get(ids)
        for i, item in enumerate(items):
            assert item == Item(int(ids[i]), "notes", texts[i], metadata[i], float(created[i]))
        r_ids, r_vecs, r_ns, r_created = all_rows(s)
        assert np.array_equal(r_ids, ids)
        assert np.array_equal(bits(r_vecs), bits(vectors))
        assert r_vecs.dtype == np.float32 and r_vecs.shape == (n, 64) and r_vecs.flags.writeable
        assert r_ns.dtype == np.int32 and set(r_ns.tolist()) == {ns_id}
        assert np.array_equal(r_created, created)
        assert s.count() == n
        assert s.namespace_counts() == {"default": 0, "notes": n}
        assert s.integrity_check() == "ok"
        assert s.size_bytes() > 0


def test_reopen_preserves_everything(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    path = tmp_path / "m.db"
    with Store.open(path, dim=DIM) as s:
        a = s.add(unit(rng, 5), namespace="a", texts=list("abcde"), metadata=[{"k": i} for i in range(5)])
        b = s.add(unit(rng, 3), namespace="b", created_at=123.5)
        s.delete([a[0][1]])
        before = (s.namespaces(), s.namespace_counts(), s.get(range(1, 10)), all_rows(s))
    with Store.open(path) as s:  # no dim needed for an existing store
        assert s.dim == DIM
        after = (s.namespaces(), s.namespace_counts(), s.get(range(1, 10)), all_rows(s))
    assert before[:3] == after[:3]
    for x, y in zip(before[3], after[3]):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert [it.created_at for it in after[2][5:8]] == [123.5] * 3 and list(b[0]) == [6, 7, 8]


def test_created_at_defaults_to_now_and_broadcasts(store: Store) -> None:
    rng = np.random.default_rng(2)
    t0 = time.time()
    _, _, c = store.add(unit(rng, 3), namespace="n")
    assert c.shape == (3,) and len(set(c.tolist())) == 1 and t0 - 1 <= c[0] <= time.time() + 1
    _, _, c = store.add(unit(rng, 2), namespace="n", created_at=np.float32(7))
    assert c.tolist() == [7.0, 7.0]


def test_vectors_are_converted_to_little_endian_float32(store: Store) -> None:
    v = unit(np.random.default_rng(3), 4)
    ids, _, _ = store.add(v.astype(">f4"), namespace="n")
    ids2, _, _ = store.add(v.astype(np.float64), namespace="n")
    _, vecs, _, _ = all_rows(store)
    assert np.array_equal(bits(vecs[:4]), bits(v)) and np.array_equal(bits(vecs[4:]), bits(v))


def test_new_files_are_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = tmp_path / "a" / "b" / "m.db"
        with Store.open(path, dim=DIM) as s:
            s.add(unit(np.random.default_rng(4), 2), namespace="n")
            for d in (tmp_path / "a", tmp_path / "a" / "b"):
                assert os.stat(d).st_mode & 0o777 == 0o700
            for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-ack")):
                assert os.stat(f).st_mode & 0o777 == 0o600, f
    finally:
        os.umask(old)
    # No temp file of the atomic creation is left behind; the record of acknowledged writes stays.
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.db", "m.db-ack"]


def test_store_is_in_wal_mode_with_kalos_header(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    Store.open(path, dim=DIM).close()
    header = path.read_bytes()[:100]
    assert header[18:20] == b"\x02\x02"  # WAL read/write versions
    assert int.from_bytes(header[68:72], "big") == APPLICATION_ID


def test_missing_path_needs_dim_and_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.db"
    with pytest.raises(InvalidArgument, match="does not exist; pass dim to create it"):
        Store.open(path)
    with pytest.raises(InvalidArgument, match="readonly"):
        Store.open(path, dim=DIM, readonly=True)
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(InvalidArgument, match="dim"):
            Store.open(path, dim=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "sub").exists()


def test_a_path_replaced_by_a_store_we_hold_keeps_its_descriptor(tmp_path: Path) -> None:
    # The path turns out to be another store file this process holds open (renamed over it
    # between the stat and the open): the descriptor just opened on that file must not be
    # closed before that Store closes, since closing any descriptor of a file drops every
    # fcntl lock SQLite holds on it in this process.
    held_path, other_path = tmp_path / "held.db", tmp_path / "other.db"
    Store.open(other_path, dim=DIM).close()
    with Store.open(held_path, dim=DIM) as held:
        stale = os.stat(other_path)  # what the opener saw before the path changed
        with pytest.raises(StoreError, match="replaced by another file"):
            store_file.acquire(held_path, stale)
        (ref,) = [ref for key, ref in store_file._files.items() if key == held._file_key]
        (kept,) = ref.extra_fds
        assert os.fstat(kept).st_ino == os.stat(held_path).st_ino
        key = held._file_key
        held.add(unit(np.random.default_rng(3), 2), namespace="default")  # still writes
    with pytest.raises(OSError):
        os.fstat(kept)  # closed with the file's last Store
    assert key not in store_file._files


def test_creation_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(tmp: Path, path: Path) -> None:
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(store_file, "_publish", crash)
    with pytest.raises(StoreError, match="simulated"):
        Store.open(tmp_path / "m.db", dim=DIM)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_creation_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process creates the store (and writes to it) while we are building ours: ours
    # must not replace theirs; we open theirs instead (or refuse it if its dim differs).
    real_build = store_mod._build_schema
    vec = unit(np.random.default_rng(5), 1)

    racing = []

    def build_and_lose(tmp: Path, dim: int) -> None:
        real_build(tmp, dim=dim)
        if racing:
            return  # the rival's own creation
        racing.append(True)
        try:
            with Store.open(tmp.parent / "m.db", dim=DIM) as other:
                other.add(vec, namespace="theirs")
        finally:
            racing.clear()

    monkeypatch.setattr(store_mod, "_build_schema", build_and_lose)
    with Store.open(tmp_path / "m.db", dim=DIM) as s:
        assert s.namespace_counts()["theirs"] == 1
    (tmp_path / "m.db").unlink()
    with pytest.raises(DimensionMismatch, match=f"dimension {DIM}.*dim={DIM + 1}"):
        Store.open(tmp_path / "m.db", dim=DIM + 1)
    monkeypatch.setattr(store_mod, "_build_schema", real_build)
    with Store.open(tmp_path / "m.db") as s:
        assert s.dim == DIM and s.count() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.db", "m.db-ack"]


def test_leftover_wal_of_a_deleted_store_refuses_creation(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    wal = Path(f"{path}-wal")
    wal.write_bytes(b"old wal frames")
    with pytest.raises(StoreError, match="left over"):
        Store.open(path, dim=DIM)
    assert not path.exists() and wal.read_bytes() == b"old wal frames"


# -- files that are not (this) Kalos store -------------------------------------------------


def _sqlite_file(path: Path, *statements: str, wal: bool = False) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    if wal:
        conn.execute("PRAGMA journal_mode = WAL")
    for sql in statements:
        conn.execute(sql)
    conn.close()


def _make_foreign(kind: str, path: Path) -> None:
    if kind == "random":
        path.write_bytes(np.random.default_rng(6).bytes(8192))
    elif kind == "text":
        path.write_text("these are my notes, not a database\n" * 50)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "sqlite-other-app":
        _sqlite_file(path, "CREATE TABLE t (x)", "INSERT INTO t VALUES (1)")
    elif kind == "sqlite-other-app-wal":
        _sqlite_file(path, "CREATE TABLE t (x)", "INSERT INTO t VALUES (1)", wal=True)
    elif kind == "sqlite-kalos-id-no-meta":
        _sqlite_file(path, f"PRAGMA application_id = {APPLICATION_ID}", "CREATE TABLE t (x)")
    elif kind == "sqlite-wrong-format":
        _sqlite_file(
            path,
            f"PRAGMA application_id = {APPLICATION_ID}",
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value)",
            "INSERT INTO meta VALUES ('format', 'something-else'), ('schema_version', 1), ('dim', 8)",
        )
    elif kind == "truncated-header":
        path.write_bytes(b"SQLite format 3\x00" + b"\x00" * 20)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["random", "text", "empty", "sqlite-other-app", "sqlite-other-app-wal", "sqlite-kalos-id-no-meta",
     "sqlite-wrong-format", "truncated-header"],
)
@pytest.mark.parametrize("readonly", [False, True])
def test_foreign_files_are_refused_and_untouched(tmp_path: Path, kind: str, readonly: bool) -> None:
    path = tmp_path / "m.db"
    _make_foreign(kind, path)
    before = path.read_bytes()
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(NotAKalosStore, match=re.escape(str(path.resolve()))):
        Store.open(path, dim=DIM, readonly=readonly)
    assert path.read_bytes() == before
    if kind != "sqlite-wrong-format" and kind != "sqlite-kalos-id-no-meta":
        # SQLite never opened it (those two claim Kalos's application id, so SQLite reads them).
        assert sorted(p.name for p in tmp_path.iterdir()) == listing
    # The failed open left no lock behind.
    Store.open(tmp_path / "ok.db", dim=DIM).close()


def test_directory_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(NotAKalosStore, match="not a regular file"):
        Store.open(tmp_path, dim=DIM)


def _set_meta(path: Path, key: str, value: object) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("UPDATE meta SET value = ? WHERE key = ?", (value, key))
    conn.close()  # last connection: the WAL is checkpointed and removed


def test_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    Store.open(path, dim=DIM).close()
    _set_meta(path, "schema_version", 2)
    before = path.read_bytes()
    for readonly in (False, True):
        with pytest.raises(StoreError, match="schema version 2") as e:
            Store.open(path, readonly=readonly)
        assert not isinstance(e.value, NotAKalosStore)
    assert path.read_bytes() == before


def test_dim_mismatch_on_open_names_both_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store.open(path, dim=DIM) as s:
        s.add(unit(np.random.default_rng(7), 3), namespace="n")
    before = path.read_bytes()
    with pytest.raises(DimensionMismatch, match=rf"dimension {DIM}.*dim=16"):
        Store.open(path, dim=16)
    assert path.read_bytes() == before
    with Store.open(path, dim=DIM) as s:
        assert s.count() == 3


# -- validation: every bad input raises and changes nothing ---------------------------------

_rng = np.random.default_rng(8)
_good = unit(_rng, 3)


def _with_row(i: int, value: float) -> np.ndarray:
    v = _good.astype(np.float64)
    v[i] = value
    return v


BAD_ADDS = [
    ("1-D", dict(vectors=_good[0]), InvalidArgument, r"2-D.*v\[None, :\]"),
    ("3-D", dict(vectors=_good[None]), InvalidArgument, "2-D"),
    ("wrong dim", dict(vectors=unit(_rng, 3, DIM + 1)), DimensionMismatch, rf"dimension {DIM + 1}.*{DIM}"),
    ("no rows", dict(vectors=np.empty((0, DIM), np.float32)), InvalidArgument, "at least one"),
    ("nan", dict(vectors=_with_row(2, np.nan)), InvalidArgument, r"vectors\[2\].*NaN"),
    ("inf", dict(vectors=_with_row(1, -np.inf)), InvalidArgument, r"vectors\[1\]"),
    ("float32 overflow", dict(vectors=_with_row(1, 1e39)), InvalidArgument, r"vectors\[1\]"),
    ("zero row", dict(vectors=_with_row(1, 0.0)), InvalidArgument, r"vectors\[1\].*zeros"),
    ("strings", dict(vectors=np.full((3, DIM), "1.0")), InvalidArgument, "numeric"),
    ("bools", dict(vectors=np.ones((3, DIM), bool)), InvalidArgument, "numeric"),
    ("ragged", dict(vectors=[[1.0] * DIM, [1.0]]), InvalidArgument, "vectors"),
    ("texts length", dict(texts=["a", "b"]), InvalidArgument, "texts has 2 entries for 3"),
    ("texts a str", dict(texts="abc"), InvalidArgument, "sequence"),
    ("texts bytes item", dict(texts=["a", b"b", None]), InvalidArgument, r"texts\[1\]"),
    ("texts surrogate", dict(texts=["a", None, "\udc80"]), InvalidArgument, r"texts\[2\]"),
    ("metadata length", dict(metadata=[None] * 4), InvalidArgument, "metadata has 4 entries for 3"),
    ("metadata a dict", dict(metadata={"a": 1}), InvalidArgument, "sequence"),
    ("metadata list item", dict(metadata=[None, [1, 2], None]), InvalidArgument, r"metadata\[1\].*dict"),
    ("metadata set", dict(metadata=[None, None, {"s": {1}}]), InvalidArgument, r"metadata\[2\].*JSON"),
    ("metadata nan", dict(metadata=[{"x": float("nan")}, None, None]), InvalidArgument, r"metadata\[0\]"),
    ("metadata int key", dict(metadata=[None, {"a": {1: "x"}}, None]), InvalidArgument, r"metadata\[1\].*key 1"),
    ("metadata numpy", dict(metadata=[None, {"x": np.float32(1)}, None]), InvalidArgument, r"metadata\[1\]"),
    ("namespace empty", dict(namespace=""), InvalidArgument, "empty"),
    ("namespace None", dict(namespace=None), InvalidArgument, "str"),
    ("namespace long", dict(namespace="é" * 128), InvalidArgument, "256 UTF-8 bytes"),
    ("namespace NUL", dict(namespace="a\x00b"), InvalidArgument, "U\\+0000"),
    ("namespace newline", dict(namespace="a\nb"), InvalidArgument, "U\\+000A"),
    ("namespace C1", dict(namespace="a\x85"), InvalidArgument, "U\\+0085"),
    ("namespace surrogate", dict(namespace="a\ud800"), InvalidArgument, "surrogate"),
    ("created_at nan", dict(created_at=float("nan")), InvalidArgument, r"created_at\[0\]"),
    ("created_at inf item", dict(created_at=np.array([1.0, np.inf, 2.0])), InvalidArgument, r"created_at\[1\]"),
    ("created_at length", dict(created_at=[1.0, 2.0]), InvalidArgument, r"shape \(3,\)"),
    ("created_at str", dict(created_at="yesterday"), InvalidArgument, "created_at"),
]


@pytest.mark.parametrize("case", BAD_ADDS, ids=[c[0] for c in BAD_ADDS])
def test_bad_add_changes_nothing(store: Store, case) -> None:
    _, overrides, exc, match = case
    rng = np.random.default_rng(9)
    store.add(unit(rng, 2), namespace="existing")
    before = (store.count(), store.namespaces(), store.namespace_counts(), store.size_bytes())
    kwargs = dict(vectors=_good, namespace="fresh-namespace")
    kwargs.update(overrides)
    vectors = kwargs.pop("vectors")
    with pytest.raises(exc, match=match):
        store.add(vectors, **kwargs)
    assert (store.count(), store.namespaces(), store.namespace_counts(), store.size_bytes()) == before
    # No id was consumed either.
    ids, _, _ = store.add(unit(rng, 1), namespace="existing")
    assert list(ids) == [3]


def test_namespace_edge_values_are_accepted(store: Store) -> None:
    rng = np.random.default_rng(10)
    for name in ("a" * 255, "é" * 127 + "a", "日本語 with spaces", "x/y:z"):
        _, ns_id, _ = store.add(unit(rng, 1), namespace=name)
        assert store.namespaces()[name] == ns_id


def test_new_namespace_is_created_with_its_items(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # A failure inside the transaction (here: a constraint on the insert) rolls the new
    # namespace back together with the items.
    rng = np.random.default_rng(11)
    conn = store._conn
    conn.execute(f"CREATE TRIGGER boom BEFORE INSERT ON items WHEN NEW.text = 'boom' BEGIN SELECT RAISE(ABORT, 'boom'); END")
    with pytest.raises(StoreError, match="boom"):
        store.add(unit(rng, 2), namespace="brand-new", texts=["ok", "boom"])
    assert "brand-new" not in store.namespaces() and store.count() == 0
    ids, _, _ = store.add(unit(rng, 1), namespace="brand-new")
    assert list(ids) == [1]


# -- delete, get, ids ---------------------------------------------------------------------------


def test_delete_returns_what_was_deleted(store: Store) -> None:
    ids, _, _ = store.add(unit(np.random.default_rng(12), 6), namespace="n")
    got = store.delete([ids[4], 999, ids[1], ids[1], -5])
    assert got.dtype == np.int64 and got.tolist() == [int(ids[1]), int(ids[4])]
    assert store.delete(np.array([ids[1]], dtype=np.uint64)).tolist() == []
    assert store.delete([]).tolist() == []
    assert store.count() == 4 and store.namespace_counts()["n"] == 4
    for bad in ([1.5], ["1"], "12", [[1, 2]], [2**70]):
        with pytest.raises(InvalidArgument):
            store.delete(bad)
    assert store.count() == 4


def test_get_is_aligned_with_ids(store: Store) -> None:
    ids, _, _ = store.add(unit(np.random.default_rng(13), 3), namespace="n", texts=["a", "b", "c"])
    got = store.get([ids[2], 12345, ids[0], ids[2]])
    assert [g.text if g else None for g in got] == ["c", None, "a", "c"]
    assert store.get([]) == []
    assert len(store.get(np.arange(1, 1200))) == 1199  # more ids than one statement takes


def test_ids_are_never_reused(tmp_path: Path) -> None:
    rng = np.random.default_rng(14)
    path = tmp_path / "m.db"
    with Store.open(path, dim=DIM) as s:
        ids, _, _ = s.add(unit(rng, 3), namespace="n")
        assert s.delete([ids[-1]]).tolist() == [3]
        assert s.add(unit(rng, 1), namespace="n")[0].tolist() == [4]
        s.delete([1, 2, 4])
        assert s.count() == 0
    with Store.open(path) as s:
        assert s.add(unit(rng, 2), namespace="n")[0].tolist() == [5, 6]
        s.delete([6])
    with Store.open(path) as s:
        assert s.add(unit(rng, 1), namespace="n")[0].tolist() == [7]


def test_iter_rows_in_id_order_after_deletes(store: Store) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    vectors, created = {}, {}
    for ns in ("a", "b", "a", "c"):
        v = unit(rng, int(rng.integers(1, 40)))
        ids, ns_id, c = store.add(v, namespace=ns, created_at=rng.uniform(0, 1e9, len(v)))
        vectors.update(zip(ids.tolist(), v))
        created.update(zip(ids.tolist(), c.tolist()))
    gone = rng.choice(list(vectors), size=len(vectors) // 3, replace=False)
    store.delete(gone)
    for i in gone.tolist():
        del vectors[i]
    ns_of = {i: it.namespace for i, it in zip(vectors, store.get(list(vectors)))}
    names = {v: k for k, v in store.namespaces().items()}
    for batch in (1, 7, 65536):
        r_ids, r_vecs, r_ns, r_created = all_rows(store, batch)
        assert r_ids.tolist() == sorted(vectors)
        assert np.array_equal(bits(r_vecs), bits(np.stack([vectors[i] for i in r_ids.tolist()])))
        assert [names[n] for n in r_ns.tolist()] == [ns_of[i] for i in r_ids.tolist()]
        assert r_created.tolist() == [created[i] for i in r_ids.tolist()]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgument, match="batch"):
            store.iter_rows(bad)


def test_iter_rows_of_empty_store(store: Store) -> None:
    assert list(store.iter_rows()) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(st.none() | st.text(), min_size=1, max_size=5),
    data=st.data(),
)
def test_texts_and_metadata_round_trip(store: Store, texts, data) -> None:
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=8,
    )
    metadata = data.draw(
        st.lists(st.none() | st.dictionaries(st.text(), json_values, max_size=4), min_size=len(texts), max_size=len(texts))
    )
    v = unit(np.random.default_rng(len(texts)), len(texts))
    ids, _, _ = store.add(v, namespace="h", texts=texts, metadata=metadata)
    got = store.get(ids)
    assert [g.text for g in got] == texts
    assert [g.metadata for g in got] == metadata


# -- lifecycle, locking, threads -----------------------------------------------------------------


def test_close_is_idempotent_and_closed_store_refuses_work(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "m.db", dim=DIM)
    s.close()
    s.close()
    assert "closed" in repr(s)
    for call in (s.count, s.namespaces, lambda: s.get([1]), lambda: s.delete([1]), s.integrity_check,
                 lambda: s.add(_good, namespace="n"), lambda: s.iter_rows()):
        with pytest.raises(StoreError, match="closed"):
            call()
    with Store.open(tmp_path / "m.db") as s2:  # the lock went with close()
        assert s2.count() == 0


def test_second_writer_in_process_is_locked_out(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    rng = np.random.default_rng(15)
    with Store.open(path, dim=DIM) as s:
        with pytest.raises(StoreLocked, match=rf"already open.*pid {os.getpid()}"):
            Store.open(path)
        # The failed attempt must not have dropped our locks: the first writer still works
        # and another process is still locked out.
        s.add(unit(rng, 2), namespace="n")
        p = run_python(
            """
            import sys
            from kalos.store.sqlite import Store
            from kalos.errors import StoreLocked
            try:
                Store.open(sys.argv[1])
            except StoreLocked as e:
                print("locked:", e)
            else:
                print("opened")
            """,
            str(path),
            stdout=subprocess.PIPE,
        )
        out, _ = p.communicate(timeout=60)
        assert out.startswith("locked:") and f"pid {os.getpid()}" in out, out
    with Store.open(path) as s:
        assert s.count() == 2


def test_writer_in_another_process_locks_us_out_and_readonly_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store.open(path, dim=DIM) as s:
        s.add(unit(np.random.default_rng(16), 3), namespace="n")
    p = run_python(
        """
        import sys
        import numpy as np
        from kalos.store.sqlite import Store
        s = Store.open(sys.argv[1])
        print("holding", flush=True)
        sys.stdin.readline()
        s.add(np.ones((2, s.dim), np.float32), namespace="child")
        print("added", flush=True)
        sys.stdin.readline()
        s.close()
        """,
        str(path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert p.stdout.readline().strip() == "holding"
        with pytest.raises(StoreLocked, match=rf"already open by another sidecar \(pid {p.pid}\)"):
            Store.open(path)
        with Store.open(path, readonly=True) as ro:
            assert ro.count() == 3 and ro.readonly
            with pytest.raises(StoreError, match="readonly"):
                ro.add(_good, namespace="n")
            with pytest.raises(StoreError, match="readonly"):
                ro.delete([1])
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "added"
            assert ro.count() == 5 and ro.namespace_counts()["child"] == 2  # sees new commits
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
    with Store.open(path) as s:
        assert s.count() == 5


def test_readonly_open_never_writes_the_db(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store.open(path, dim=DIM) as s:
        s.add(unit(np.random.default_rng(17), 3), namespace="n")
    before = path.read_bytes()
    with Store.open(path, readonly=True) as ro, Store.open(path, readonly=True) as ro2:
        assert ro.count() == ro2.count() == 3 and len(list(ro.iter_rows())) == 1
        assert ro.lost_writes() is None and ro.integrity_check() == "ok"
        # A write through SQLite would sit in the WAL until a checkpoint (at the last close).
        assert Path(f"{path}-wal").stat().st_size == 0
    assert path.read_bytes() == before  # opened, read, checked and closed: not a byte changed
    with Store.open(path, readonly=True) as ro:
        with Store.open(path) as w:  # readonly opens take no lock
            w.add(unit(np.random.default_rng(18), 1), namespace="n")
            assert ro.count() == 4
    assert Store.open(path, readonly=True).count() == 4


def test_readonly_close_keeps_the_writers_lock(tmp_path: Path) -> None:
    # The per-process descriptor table: closing a readonly Store of the same file must not
    # release the writer's flock (or SQLite's POSIX locks).
    path = tmp_path / "m.db"
    Store.open(path, dim=DIM).close()
    ro = Store.open(path, readonly=True)
    w = Store.open(path)
    ro.close()
    with pytest.raises(StoreLocked):
        Store.open(path)
    w.close()
    Store.open(path).close()


def test_concurrent_threads(store: Store) -> None:
    errors: list[BaseException] = []
    got: list[np.ndarray] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                ids, _, _ = store.add(unit(rng, int(rng.integers(1, 5))), namespace=f"t{seed % 2}")
                got.append(ids)
                store.get(ids)
                store.count()
                if rng.random() < 0.3:
                    store.delete(ids[:1])
                    got.append(-ids[:1])
                list(store.iter_rows(3))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    added = np.concatenate([g for g in got if (g > 0).all()])
    deleted = -np.concatenate([g for g in got if (g < 0).all()] or [np.empty(0, np.int64)])
    assert len(np.unique(added)) == len(added)
    assert store.count() == len(added) - len(deleted)
    assert store.integrity_check() == "ok"


# -- crash safety ---------------------------------------------------------------------------------

CRASH_DIM = 64
CRASH_CHILD = f"""
import json, sys
import numpy as np
from kalos.engine.base import as_unit_rows
from kalos.store.sqlite import Store

path, seed = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(seed)
store = Store.open(path, dim={CRASH_DIM})
print("ready", flush=True)
batch = 0
while True:
    n = int(rng.choice([1, 3, 50, 800, 3000]))
    tag = seed * 1_000_000 + batch
    vectors = as_unit_rows(np.random.default_rng(tag).standard_normal((n, {CRASH_DIM})))
    ids, _, _ = store.add(
        vectors,
        namespace=f"ns{{batch % 3}}",
        texts=[f"{{tag}}:{{j}}" for j in range(n)],
        metadata=[{{"tag": tag, "j": j, "n": n}} for j in range(n)],
        created_at=float(tag),
    )
    print(json.dumps([tag, int(ids[0]), n]), flush=True)
    if rng.random() < 0.2:  # deletes too, so recovery also replays deletes
        store.delete(ids[: n // 2])
        print(json.dumps(["deleted", int(ids[0]), n // 2]), flush=True)
    batch += 1
"""


@functools.lru_cache(maxsize=None)
def _expected_vectors(tag: int, n: int) -> np.ndarray:
    return as_unit_rows(np.random.default_rng(tag).standard_normal((n, CRASH_DIM)))


def test_kill_9_loses_nothing_acknowledged(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    print(f"crash test seed={seed}")
    rng = random.Random(seed)
    path = tmp_path / "crash.db"
    acked: dict[int, tuple[int, int, int]] = {}  # id -> (tag, j, n)
    deleted: set[int] = set()
    batches: dict[int, tuple[int, int]] = {}  # tag -> (first id, n), of every batch ever seen
    for round_ in range(10):
        child_seed = rng.randrange(1 << 20)
        p = run_python(CRASH_CHILD, str(path), str(child_seed), stdout=subprocess.PIPE)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(p.stdout))  # keep the pipe drained
        reader.start()
        deadline = time.monotonic() + 60
        while not lines and time.monotonic() < deadline:  # started: its store is open
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        reader.join()
        assert lines and lines[0] == "ready\n", f"round {round_}: child did not start"
        for line in lines[1:]:
            if not line.endswith("\n"):
                continue  # cut off by the kill: not an acknowledgement we can trust
            rec = json.loads(line)
            if rec[0] == "deleted":
                deleted.update(range(rec[1], rec[1] + rec[2]))
            else:
                tag, first, n = rec
                acked.update((first + j, (tag, j, n)) for j in range(n))

        with Store.open(path) as s:
            assert s.integrity_check() == "ok", f"seed={seed} round {round_}"
            ids, vecs, _, created = all_rows(s)
            present = set(ids.tolist())
            # Every item present is complete: vector, text, metadata and time all match what
            # the child wrote for it.
            for row, item in enumerate(s.get(ids)):
                assert item is not None and item.metadata is not None, f"seed={seed}: incomplete item {ids[row]}"
                tag, j, n = item.metadata["tag"], item.metadata["j"], item.metadata["n"]
                assert item.text == f"{tag}:{j}" and created[row] == float(tag), f"seed={seed}"
                assert np.array_equal(bits(vecs[row]), bits(_expected_vectors(tag, n)[j])), f"seed={seed}"
                batches.setdefault(tag, (item.id - j, n))
        for tag, (first, n) in batches.items():
            rows = [first + k in present for k in range(n)]
            half = n // 2
            # Adds are all-or-nothing and so are deletes (of a batch's first half): the only
            # holes allowed are an entire first half. Acknowledged rows are all present unless
            # their delete was acknowledged; an unacknowledged delete may have happened.
            assert all(rows[half:]), f"seed={seed}: batch {tag} lost {rows.count(False)} of {n} rows"
            assert all(rows[:half]) or not any(rows[:half]), f"seed={seed}: batch {tag} torn ({rows.count(False)} of {n} missing)"
            if first in deleted:
                assert not any(rows[:half]), f"seed={seed}: deleted rows of batch {tag} came back"
        for item_id, (tag, j, n) in acked.items():
            # Missing is fine only when deleted: acknowledged, or an unacknowledged delete of
            # its batch's first half (which the loop above checked is whole).
            assert item_id in present or item_id in deleted or (j < n // 2 and tag in batches), (
                f"seed={seed} round {round_}: acknowledged id {item_id} lost"
            )
    assert acked, "the child never acknowledged anything"


def test_symlinked_store_reports_its_real_path(tmp_path: Path) -> None:
    real = tmp_path / "real" / "m.db"
    with Store.open(real, dim=DIM) as s:
        s.add(_good, namespace="n")
    link = tmp_path / "link.db"
    link.symlink_to(real)
    with Store.open(link) as s:
        assert s.path == real.resolve() and s.count() == 3


def test_foreign_file_locked_by_its_owner_is_reported_as_foreign(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    _make_foreign("sqlite-other-app", path)
    with open(path, "rb") as f:  # its own application holds an flock on it
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(NotAKalosStore):
            Store.open(path)
