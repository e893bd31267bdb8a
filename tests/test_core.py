"""The sidecar and its clients as real processes.

A sidecar subprocess (``kalos serve``) and client processes (multiprocessing 'spawn'): exact
results against the float64 reference (single and batched recalls, namespaces, time
windows), get/delete/stats, every bad input answered with the right exception while the
sidecar keeps serving, garbage written straight into a slot, kill -9 of the sidecar under
load (clients fail within their timeout, then recover by themselves; acknowledged adds
survive), kill -9 of a client, owner-only permissions, and segments that are not Kalos
segments. Every random test prints its seed (KALOS_TEST_SEED replays it).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import queue as queue_mod
import shutil
import socket
import sqlite3
import stat
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from conftest import (
    DEADLINE_S,
    SidecarPool,
    _seed_value,
    as_nobody,
    in_forked_child,
    run_guarded,
    segment_path,
    short_tempdir,
    unique_name,
    wait_until,
)
from reference import assert_topk_matches, eligible_mask, model_arrays

from kalos import Client
from kalos.errors import (
    DimensionMismatch,
    ErrorCode,
    InvalidArgument,
    InvalidQuery,
    NotAKalosStore,
    ProtocolMismatch,
    SidecarAlreadyRunning,
    SidecarUnavailable,
    StoreLocked,
)
from kalos.ipc.channel import wake_pair
from kalos.ipc.control import PROTOCOL_VERSION, array_blob, recv_fd, recv_frame, send_fd, send_frame
from kalos.ipc.protocol import HEADER_DTYPE, MAGIC, VERSION, Layout, Op, RequestFlag

DIM = 16
MAX_BATCH = 8  # small, so that recall_many splits
MAX_K = 256


# -- one sidecar shared by the read-mostly tests of this module --------------------------------


@dataclass
class Served:
    name: str
    runtime: str
    store: Path
    pool: SidecarPool
    client: Client
    seed: int
    rng: np.random.Generator
    model: dict[int, tuple[np.ndarray, str, float]] = field(default_factory=dict)
    texts: dict[int, str | None] = field(default_factory=dict)
    metadata: dict[int, dict | None] = field(default_factory=dict)

    def add(self, vectors: np.ndarray, namespace: str, created_at: np.ndarray, *, with_text: bool = True) -> np.ndarray:
        n = len(vectors)
        texts = [f"{namespace} memory {i}" for i in range(n)] if with_text else None
        metadata = [{"i": i, "ns": namespace, "tags": ["a", i % 3]} if i % 2 else None for i in range(n)]
        ids = self.client.add(vectors, texts=texts, metadata=metadata, namespace=namespace, created_at=created_at)
        assert ids.dtype == np.int64 and len(ids) == n
        for j, i in enumerate(ids.tolist()):
            self.model[i] = (vectors[j].astype(np.float64), namespace, float(created_at[j]))
            self.texts[i] = texts[j] if texts else None
            self.metadata[i] = metadata[j]
        return ids

    def forget(self, ids: Any) -> None:
        for i in np.asarray(ids).tolist():
            self.model.pop(int(i), None)

    def check(self, client: Client | None = None, *, namespace: str | None = "default", k: int = 10,
              since: float | None = None, until: float | None = None, n_queries: int = 3, context: str = "") -> None:
        """Recalls (single and batch) equal the float64 reference over the current model."""
        client = client or self.client
        ids, vectors, namespaces, created = model_arrays(self.model)
        eligible = eligible_mask(namespaces, created, namespace=namespace, since=since, until=until)
        queries = self.rng.standard_normal((n_queries, DIM)).astype(np.float32)
        for qi, q in enumerate(queries):
            hit = client.recall(q, k=k, namespace=namespace, since=since, until=until)
            assert_topk_matches(hit.ids[None], hit.scores[None], ids, vectors, q, k, eligible, padded=False,
                                context=f"{context} recall {qi} ns={namespace} k={k} since={since} until={until}")
        batch = client.recall_many(queries, k=k, namespace=namespace, since=since, until=until)
        assert_topk_matches(batch.ids, batch.scores, ids, vectors, queries, k, eligible,
                            context=f"{context} recall_many ns={namespace} k={k}")

    def count(self) -> int:
        return int(self.client.stats()["count"])


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    seed = _seed_value()
    print(f"module sidecar data seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    runtime = short_tempdir("k")
    store_dir = short_tempdir("ks")
    pool = SidecarPool()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KALOS_RUNTIME_DIR", runtime)
        name = unique_name("core")
        client = None
        try:
            pool.start(Path(store_dir) / "m.db", name=name, dim=DIM, extra_args=["--max-batch", str(MAX_BATCH)])
            client = Client(name, timeout=5.0)
            rng = np.random.default_rng(seed)
            s = Served(name, runtime, Path(store_dir) / "m.db", pool, client, seed, rng)
            s.add(rng.standard_normal((1500, DIM)).astype(np.float32), "default",
                  rng.integers(1_000, 1_200, size=1500).astype(np.float64))
            s.add(rng.standard_normal((600, DIM)).astype(np.float32), "alpha",
                  rng.uniform(1_000, 1_200, size=600))
            s.add(rng.standard_normal((7, DIM)).astype(np.float32), "beta", np.full(7, 1_100.0), with_text=False)
            yield s
        finally:
            if client is not None:
                client.close()
            pool.cleanup()
            shutil.rmtree(runtime, ignore_errors=True)
            shutil.rmtree(store_dir, ignore_errors=True)


# -- exact results -------------------------------------------------------------------------------


def test_single_and_batch_recalls_equal_the_reference(served):
    for namespace, k in (("default", 1), ("default", 10), ("default", MAX_K), ("alpha", 37), (None, 64),
                         (None, MAX_K), ("beta", 20), ("beta", 7), ("beta", 1)):
        served.check(namespace=namespace, k=k, context="served")


def test_recall_many_larger_than_max_batch_splits_and_stays_exact(served):
    queries = served.rng.standard_normal((MAX_BATCH * 6 + 3, DIM)).astype(np.float32)
    ids, vectors, namespaces, created = model_arrays(served.model)
    for namespace, k in (("default", 9), (None, 3), ("beta", 12)):
        batch = served.client.recall_many(queries, k=k, namespace=namespace)
        assert batch.ids.shape == (len(queries), k) and len(batch) == len(queries)
        eligible = eligible_mask(namespaces, created, namespace=namespace)
        assert_topk_matches(batch.ids, batch.scores, ids, vectors, queries, k, eligible, context=f"split ns={namespace}")
        # Each row agrees with a single recall of the same query (float32 mat-mul and mat-vec
        # may round differently in the last bit, so scores are compared with a tolerance).
        for i in (0, MAX_BATCH - 1, MAX_BATCH, len(queries) - 1):
            single = served.client.recall(queries[i], k=k, namespace=namespace)
            assert len(batch[i]) == len(single)
            np.testing.assert_allclose(batch[i].scores, single.scores, atol=1e-6)
            assert_topk_matches(single.ids[None], single.scores[None], ids, vectors, queries[i], k, eligible,
                                padded=False, context=f"single {i} ns={namespace}")


def test_rare_namespace_pads_batches_and_shortens_single_recalls(served):
    q = served.rng.standard_normal(DIM).astype(np.float32)
    hit = served.client.recall(q, k=20, namespace="beta")
    assert len(hit) == 7
    batch = served.client.recall_many(q[None], k=20, namespace="beta")
    assert (batch.ids[0, 7:] == -1).all() and np.isneginf(batch.scores[0, 7:]).all()
    assert len(batch[0]) == 7
    assert hit.ids.tolist() == batch.ids[0, :7].tolist() and np.isfinite(hit.scores).all()


def test_time_windows_are_applied_during_the_scan(served):
    for since, until in ((1_100, None), (None, 1_010), (1_050, 1_051), (1_000, 1_200), (1_199.5, None),
                         (5_000, None)):
        for namespace in ("default", None, "beta"):
            served.check(namespace=namespace, k=25, since=since, until=until, n_queries=2, context="window")
    # datetimes are accepted too, and mean the same instants.
    since = dt.datetime.fromtimestamp(1_050, tz=dt.timezone.utc)
    until = dt.datetime.fromtimestamp(1_060, tz=dt.timezone.utc)
    q = served.rng.standard_normal(DIM).astype(np.float32)
    a = served.client.recall(q, k=30, since=since, until=until)
    b = served.client.recall(q, k=30, since=1_050, until=1_060)
    assert a.ids.tolist() == b.ids.tolist()


def _recall_worker(name: str, queries: np.ndarray, k: int, namespace: str | None, since: Any, until: Any, out: Any) -> None:
    try:
        with Client(name, timeout=10.0) as client:
            singles = [client.recall(q, k=k, namespace=namespace, since=since, until=until) for q in queries]
            batch = client.recall_many(queries, k=k, namespace=namespace, since=since, until=until)
        out.put(("ok", os.getpid(), [(r.ids, r.scores) for r in singles], batch.ids, batch.scores))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", os.getpid(), f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def test_several_client_processes_get_reference_results(served, children):
    out = children.queue()
    jobs = [("default", 10, None, None), (None, 50, 1_020, 1_150), ("alpha", MAX_K, None, None), ("beta", 9, None, 1_200)]
    queries = {i: served.rng.standard_normal((MAX_BATCH * 2 + 1, DIM)).astype(np.float32) for i in range(len(jobs))}
    procs = {}
    for i, (namespace, k, since, until) in enumerate(jobs):
        p = children.start(_recall_worker, served.name, queries[i], k, namespace, since, until, out)
        procs[p.pid] = i
    served.check(namespace=None, k=5, context="parent, concurrently")
    ids, vectors, namespaces, created = model_arrays(served.model)
    for _ in jobs:
        msg = out.get(timeout=DEADLINE_S)
        assert msg[0] == "ok", msg[2]
        i = procs[msg[1]]
        namespace, k, since, until = jobs[i]
        eligible = eligible_mask(namespaces, created, namespace=namespace, since=since, until=until)
        for qi, (hit_ids, hit_scores) in enumerate(msg[2]):
            assert_topk_matches(hit_ids[None], hit_scores[None], ids, vectors, queries[i][qi], k, eligible,
                                padded=False, context=f"process {i} single {qi}")
        assert_topk_matches(msg[3], msg[4], ids, vectors, queries[i], k, eligible, context=f"process {i} batch")


# -- get / delete / stats ------------------------------------------------------------------------


def test_get_returns_what_was_added_and_none_for_unknown_ids(served):
    known = sorted(served.model)[:3] + [sorted(served.model)[-1]]
    items = served.client.get(known + [10**15, -3])
    assert items[-2:] == [None, None]
    for item_id, item in zip(known, items):
        assert item is not None and item.id == item_id
        vector, namespace, created = served.model[item_id]
        assert item.namespace == namespace and item.created_at == created
        assert item.text == served.texts[item_id] and item.metadata == served.metadata[item_id]
    assert served.client.get([]) == []


def test_stats_reports_counts_namespaces_and_layout(served):
    stats = served.client.stats()
    assert stats["name"] == served.name and stats["dim"] == DIM
    assert stats["count"] == len(served.model)
    expected: dict[str, int] = {}
    for _v, ns, _t in served.model.values():
        expected[ns] = expected.get(ns, 0) + 1
    for ns, n in expected.items():
        assert stats["namespaces"][ns] == n, stats["namespaces"]
    assert stats["max_k"] == MAX_K and stats["max_batch"] == MAX_BATCH
    assert stats["device"] == "cpu" and stats["engine"] == "numpy"
    assert 1 <= stats["clients"] <= stats["slots"]
    assert stats["capacity"] >= stats["count"] and stats["queries"] >= 0
    assert Path(stats["store"]) == served.store.resolve()


def test_deleted_ids_never_come_back(served):
    rng = served.rng
    ids = served.add(rng.standard_normal((300, DIM)).astype(np.float32), "gamma", np.full(300, 1_150.0))
    queries = rng.standard_normal((5, DIM)).astype(np.float32)
    top = served.client.recall_many(queries, k=20, namespace="gamma").ids
    victims = np.unique(top[top >= 0])
    victims = np.concatenate([victims, ids[:10]])
    victims = np.unique(victims)
    before = served.count()
    assert served.client.delete(victims) == len(victims)
    served.forget(victims)
    assert served.client.delete(victims) == 0  # already gone
    assert served.client.delete([10**15]) == 0
    assert served.count() == before - len(victims)
    assert served.client.get(victims[:5]) == [None] * 5
    for namespace in ("gamma", None):
        batch = served.client.recall_many(queries, k=MAX_K, namespace=namespace)
        assert not np.isin(batch.ids, victims).any()
        served.check(namespace=namespace, k=MAX_K, context="after delete")
    removed = served.client.compact()
    assert removed >= 0 and served.client.stats()["tombstones"] == 0
    assert not np.isin(served.client.recall_many(queries, k=MAX_K, namespace=None).ids, victims).any()
    served.check(namespace="gamma", k=40, context="after compact")


# -- bad inputs: the right exception, nothing changed, still serving --------------------------------


def _vecs(n: int, dim: int = DIM, bad_row: int | None = None, bad: float | None = None) -> np.ndarray:
    """``n`` fixed random vectors; row ``bad_row`` gets ``bad`` in one component (all zeros if None)."""
    v = np.random.default_rng(n).standard_normal((n, dim)).astype(np.float32)
    if bad_row is not None:
        if bad is None:
            v[bad_row] = 0.0
        else:
            v[bad_row, 1] = bad
    return v


def _one(value: float | None = None) -> np.ndarray:
    v = np.ones(DIM, np.float32)
    if value is None:
        return np.zeros(DIM, np.float32)
    v[3] = value
    return v


BAD_INPUTS: list[tuple[str, Callable[[Client], Any], type[Exception]]] = [
    ("add-wrong-dim", lambda c: c.add(_vecs(2, DIM + 1)), DimensionMismatch),
    ("add-one-vector-wrong-dim", lambda c: c.add(np.ones(DIM - 1)), DimensionMismatch),
    ("recall-wrong-dim", lambda c: c.recall(np.ones(DIM + 3)), DimensionMismatch),
    ("recall-many-wrong-dim", lambda c: c.recall_many(np.ones((4, DIM - 1))), DimensionMismatch),
    ("add-nan", lambda c: c.add(_vecs(3, bad_row=2, bad=float("nan"))), InvalidArgument),
    ("add-inf", lambda c: c.add(_vecs(3, bad_row=0, bad=float("inf"))), InvalidArgument),
    ("add-zero", lambda c: c.add(_vecs(3, bad_row=1)), InvalidArgument),
    ("add-nan-new-namespace", lambda c: c.add(_vecs(2, bad_row=1, bad=float("nan")), namespace="never-made"),
     InvalidArgument),
    ("recall-nan", lambda c: c.recall(_one(float("nan"))), InvalidQuery),
    ("recall-inf", lambda c: c.recall(_one(float("-inf"))), InvalidQuery),
    ("recall-zero", lambda c: c.recall(_one(None)), InvalidQuery),
    ("recall-many-one-nan-row", lambda c: c.recall_many(np.stack([_one(1.0), _one(float("nan"))])), InvalidQuery),
    ("recall-non-numeric", lambda c: c.recall(["x"] * DIM), InvalidQuery),
    ("recall-matrix-to-recall", lambda c: c.recall(np.ones((2, DIM))), InvalidQuery),
    ("k-zero", lambda c: c.recall(_one(1.0), k=0), InvalidQuery),
    ("k-negative", lambda c: c.recall(_one(1.0), k=-3), InvalidQuery),
    ("k-above-max", lambda c: c.recall(_one(1.0), k=MAX_K + 1), InvalidQuery),
    ("k-float", lambda c: c.recall(_one(1.0), k=2.5), InvalidQuery),
    ("k-bool", lambda c: c.recall(_one(1.0), k=True), InvalidQuery),
    ("recall-many-k-above-max", lambda c: c.recall_many(np.ones((3, DIM)), k=10**6), InvalidQuery),
    ("empty-batch", lambda c: c.recall_many(np.empty((0, DIM), np.float32)), InvalidQuery),
    ("add-empty", lambda c: c.add(np.empty((0, DIM), np.float32)), InvalidArgument),
    # (A namespace that never held a memory is answered with no hits: test_keys.py, issue 22.)
    ("namespace-too-long", lambda c: c.recall(_one(1.0), namespace="x" * 256), InvalidQuery),
    ("namespace-empty", lambda c: c.recall(_one(1.0), namespace=""), InvalidQuery),
    ("texts-too-few", lambda c: c.add(_vecs(3), texts=["a", "b"]), InvalidArgument),
    ("metadata-too-many", lambda c: c.add(_vecs(2), metadata=[{}, {}, {}]), InvalidArgument),
    ("created-at-length", lambda c: c.add(_vecs(3), created_at=[1.0, 2.0]), InvalidArgument),
    ("created-at-nan", lambda c: c.add(_vecs(2), created_at=float("nan")), InvalidArgument),
    ("created-at-str", lambda c: c.add(_vecs(2), created_at="yesterday"), InvalidArgument),
    ("created-at-dict", lambda c: c.add(_vecs(1), created_at={"t": 1}), InvalidArgument),
    ("texts-not-str", lambda c: c.add(_vecs(2), texts=[1, "a"]), InvalidArgument),
    ("metadata-not-dict", lambda c: c.add(_vecs(2), metadata=["x", None]), InvalidArgument),
    ("metadata-object", lambda c: c.add(_vecs(2), metadata=[{"a": object()}, None]), InvalidArgument),
    ("metadata-set", lambda c: c.add(_vecs(1), metadata=[{"a": {1, 2}}]), InvalidArgument),
    ("metadata-nan", lambda c: c.add(_vecs(1), metadata=[{"a": float("nan")}]), InvalidArgument),
    ("add-namespace-empty", lambda c: c.add(_vecs(1), namespace=""), InvalidArgument),
    ("add-namespace-control-char", lambda c: c.add(_vecs(1), namespace="a\x00b"), InvalidArgument),
    ("add-namespace-not-str", lambda c: c.add(_vecs(1), namespace=5), InvalidArgument),
    ("since-not-before-until", lambda c: c.recall(_one(1.0), since=5, until=5), InvalidQuery),
    ("since-nan", lambda c: c.recall(_one(1.0), since=float("nan")), InvalidQuery),
    ("until-str", lambda c: c.recall(_one(1.0), until="yesterday"), InvalidQuery),
    ("delete-floats", lambda c: c.delete([1.5]), InvalidArgument),
    ("get-2d", lambda c: c.get([[1, 2]]), InvalidArgument),
]


@pytest.mark.parametrize("case, call, expected", [pytest.param(*c, id=c[0]) for c in BAD_INPUTS])
def test_bad_input_raises_changes_nothing_and_sidecar_keeps_serving(served, case, call, expected):
    before = served.client.stats()
    with pytest.raises(expected) as info:
        call(served.client)
    assert str(info.value), f"{case}: empty error message"
    after = served.client.stats()
    assert after["count"] == before["count"], f"{case}: the store changed"
    assert after["namespaces"] == before["namespaces"], f"{case}: namespaces changed"
    assert "never-made" not in after["namespaces"]
    served.check(namespace="default", k=8, n_queries=1, context=f"after {case}")
    served.check(namespace=None, k=3, n_queries=1, context=f"after {case}")


def test_tiny_but_nonzero_query_is_normalised_or_refused(served):
    """BUG: sidecar.normalise_rows computes the scale 1/|q| in float64, then casts it to float32.

    For a query whose norm is below ~3e-39 (subnormal float32 components, e.g. 1e-41) the
    scale overflows float32 to inf, the query becomes inf/NaN, and the recall "succeeds" with
    garbage (no hits) instead of the true top-k of that direction or an InvalidQuery.
    """
    direction = served.rng.standard_normal(DIM).astype(np.float32)
    tiny = (direction / np.abs(direction).max() * np.float32(1e-41)).astype(np.float32)
    assert np.all(np.isfinite(tiny)) and np.any(tiny != 0)
    try:
        hit = served.client.recall(tiny, k=10)
    except InvalidQuery:
        return  # refusing it is acceptable
    ids, vectors, namespaces, created = model_arrays(served.model)
    eligible = eligible_mask(namespaces, created, namespace="default")
    assert_topk_matches(hit.ids[None], hit.scores[None], ids, vectors, tiny.astype(np.float64), 10, eligible,
                        padded=False, context="tiny query")


def test_metadata_with_non_string_keys_is_refused_not_rewritten(served):
    """BUG: the client JSON-encodes metadata before the store sees it, so {1: "a"} is silently
    stored as {"1": "a"} although Store._check_json_keys exists to refuse exactly that
    ("such a dict would come back different from what was stored")."""
    meta = {1: "a"}
    try:
        ids = served.client.add(_vecs(1), metadata=[meta], namespace="meta-keys")
    except InvalidArgument:
        return
    served.model[int(ids[0])] = (_vecs(1)[0].astype(np.float64), "meta-keys", served.client.get(ids)[0].created_at)
    assert served.client.get(ids)[0].metadata == meta, "metadata came back different from what was added"


def test_created_at_accepts_a_datetime_like_since_and_until_do(served):
    """BUG: Client.add converts created_at with np.asarray(created_at, dtype=np.float64) without
    a guard, so a datetime (which recall's since/until accept) escapes as a bare TypeError
    instead of being converted (or refused with InvalidArgument)."""
    when = dt.datetime(2001, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc)
    try:
        ids = served.client.add(_vecs(1), namespace="dated", created_at=when)
    except InvalidArgument:
        return  # refusing it clearly is acceptable
    served.model[int(ids[0])] = (_vecs(1)[0].astype(np.float64), "dated", when.timestamp())
    assert served.client.get(ids)[0].created_at == when.timestamp()
    hit = served.client.recall(_vecs(1)[0], k=1, namespace="dated", since=when,
                               until=when + dt.timedelta(seconds=1))
    assert hit.ids.tolist() == [int(ids[0])]


def test_non_ascii_and_longest_namespaces_round_trip(served):
    longest = "n" * 253 + "é"  # 255 UTF-8 bytes: the store's limit
    for namespace in ("café-東京", longest):
        vectors = served.rng.standard_normal((4, DIM)).astype(np.float32)
        ids = served.add(vectors, namespace, np.full(4, 1_100.0))
        assert [item.namespace for item in served.client.get(ids)] == [namespace] * 4
        served.check(namespace=namespace, k=6, context=f"namespace {namespace!r}")
        assert served.client.stats()["namespaces"][namespace] == 4
    with pytest.raises(InvalidArgument):
        served.client.add(_vecs(1), namespace="n" * 256)  # 256 bytes: over the limit
    with pytest.raises(InvalidQuery, match="255 UTF-8 bytes"):  # would fill the slot's 256 bytes: over the store's 255
        served.client.recall(_one(1.0), namespace="n" * 256)


def test_one_client_shared_by_threads(served):
    import threading

    ids, vectors, namespaces, created = model_arrays(served.model)
    eligible = eligible_mask(namespaces, created, namespace="default")
    seeds = np.random.default_rng(served.seed + 7).integers(0, 2**31, size=4)
    failures: list[str] = []

    def work(t: int) -> None:
        rng = np.random.default_rng(int(seeds[t]))
        try:
            for r in range(60):
                q = rng.standard_normal((1 + r % 11, DIM)).astype(np.float32)
                k = 1 + (r * 7 + t) % 40
                batch = served.client.recall_many(q, k=k)
                assert_topk_matches(batch.ids, batch.scores, ids, vectors, q, k, eligible, context=f"thread {t} round {r}")
        except BaseException as exc:  # noqa: BLE001
            failures.append(f"thread {t}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S * 2)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not failures, failures[:3]


def ring(bell: int) -> None:
    """Rings the sidecar as a client does, through its end of the pair (full: rung already)."""
    try:
        os.write(bell, b"\x01")
    except BlockingIOError:
        pass


def test_a_child_forked_while_another_thread_holds_the_client_is_not_stuck(served):
    """Fork while a thread of the parent is inside a call (the client's lock held): the child's
    own calls must work (it inherits the lock held by a thread it does not have)."""
    import gc

    q = served.rng.standard_normal(DIM).astype(np.float32)
    served.client.recall(q, k=3)
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with served.client._lock:  # as a call in flight does
            held.set()
            release.wait(DEADLINE_S)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(DEADLINE_S)
    def release_the_lock() -> None:
        release.set()
        holder.join(DEADLINE_S)

    # (A child stuck on the inherited lock is killed by the helper's alarm, and the test says so.)
    ids = in_forked_child(lambda: served.client.recall(q, k=3).ids.tolist(), meanwhile=release_the_lock)
    assert ids == served.client.recall(q, k=3).ids.tolist()
    gc.collect()


def test_a_client_dropped_without_close_keeps_no_descriptor(served):
    """Clients (and the integrations' hidden ones) that are dropped without close() free their
    descriptors (wake socket, segment, control socket) and their slot."""
    import gc

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    Client(served.name, timeout=10.0).ping()  # anything opened once per process comes first
    gc.collect()
    before, clients = open_fds(), served.client.stats()["clients"]
    for _ in range(10):
        Client(served.name, timeout=10.0).ping()
    gc.collect()
    assert open_fds() == before
    wait_until(lambda: served.client.stats()["clients"] == clients, "the sidecar to free the dropped clients' slots")


def test_a_forked_child_gets_its_own_slot(served):
    """After fork the child must not answer through the parent's slot (both would write req_seq)."""
    q = served.rng.standard_normal((3, DIM)).astype(np.float32)
    served.client.recall(q[0], k=5)  # connected before the fork
    clients_before = served.client.stats()["clients"]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            os.close(read_fd)
            batch = served.client.recall_many(q, k=5)
            clients = served.client.stats()["clients"]
            payload = json.dumps({"ids": batch.ids.tolist(), "scores": batch.scores.tolist(), "clients": clients})
            os.write(write_fd, payload.encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001
            os.write(write_fd, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        chunks = []
        deadline = time.monotonic() + DEADLINE_S
        while True:
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            assert time.monotonic() < deadline
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks))
    assert "error" not in result, result.get("error")
    assert os.waitstatus_to_exitcode(status) == 0
    assert result["clients"] == clients_before + 1, "the child did not take a slot of its own"
    ids, vectors, namespaces, created = model_arrays(served.model)
    eligible = eligible_mask(namespaces, created, namespace="default")
    assert_topk_matches(np.array(result["ids"], np.int64), np.array(result["scores"], np.float32), ids, vectors, q, 5,
                        eligible, context="forked child")
    served.check(namespace="default", k=5, context="parent after fork")  # the parent's slot still works
    wait_until(lambda: served.client.stats()["clients"] == clients_before, "the child's slot to be freed")


# -- the control socket with hand-made (bypassing the client's checks) frames ---------------------------


def _raw(served: Served) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(DEADLINE_S)
    sock.connect(os.path.join(served.runtime, f"{served.name}.sock"))
    return sock


def _ask(sock: socket.socket, message: dict, blob: bytes | memoryview = b"") -> dict:
    send_frame(sock, message, blob)
    reply, _ = recv_frame(sock, max_bytes=1 << 24)
    return reply


def test_raw_control_messages_are_validated_by_the_sidecar(served):
    before = served.count()
    with _raw(served) as sock:
        spec, blob = array_blob(np.ones((1, DIM + 1), np.float32), "float32")
        assert _ask(sock, {"op": "add", "vectors": spec}, blob)["code"] == ErrorCode.DIMENSION_MISMATCH
        bad = np.ones((2, DIM), np.float32)
        bad[1, 0] = np.nan
        spec, blob = array_blob(bad, "float32")
        reply = _ask(sock, {"op": "add", "vectors": spec}, blob)
        assert reply["code"] == ErrorCode.INVALID_ARGUMENT and "NaN" in reply["error"]
        spec, blob = array_blob(np.zeros((1, DIM), np.float32), "float32")
        assert _ask(sock, {"op": "add", "vectors": spec}, blob)["code"] == ErrorCode.INVALID_ARGUMENT
        spec, blob = array_blob(np.ones((1, DIM), np.float32), "float32")
        spec["shape"] = [5, DIM]  # claims more than the blob carries
        assert _ask(sock, {"op": "add", "vectors": spec}, blob)["code"] == ErrorCode.INVALID_ARGUMENT
        spec, blob = array_blob(np.ones((1, DIM), np.float32), "float32")
        for extra in ({"namespace": 5}, {"texts": "abc"}, {"created_at": "x"}, {"metadata": [["not", "a", "dict"]]}):
            reply = _ask(sock, {"op": "add", "vectors": spec, **extra}, blob)
            assert reply["ok"] is False and reply["code"] == ErrorCode.INVALID_ARGUMENT, (extra, reply)
        for message in ({"op": "bogus"}, {"op": 7}, {}, {"op": "delete", "ids": "x"}, {"op": "delete", "ids": [True]},
                        {"op": "get", "ids": [2**64]}, {"op": "get"}):
            reply = _ask(sock, message)
            assert reply["ok"] is False and reply["code"] == ErrorCode.INVALID_ARGUMENT, (message, reply)
        reply = _ask(sock, {"op": "hello", "protocol": PROTOCOL_VERSION + 99})
        assert reply["code"] == ErrorCode.PROTOCOL
        assert _ask(sock, {"op": "stats"})["ok"] is True  # the connection is still in step
    # Framing errors: an error reply, then the connection is dropped.
    with _raw(served) as sock:
        sock.sendall(b"\x05\x00\x00\x00" + b"\x00" * 8 + b"{oops")
        reply, _ = recv_frame(sock, max_bytes=1 << 20)
        assert reply["code"] == ErrorCode.PROTOCOL
        assert sock.recv(1) == b""
    with _raw(served) as sock:
        sock.sendall(b"\xff\xff\xff\x7f" + b"\xff" * 8)  # 2 GiB of JSON announced
        reply, _ = recv_frame(sock, max_bytes=1 << 20)
        assert reply["code"] == ErrorCode.PROTOCOL
        assert sock.recv(1) == b""
    with _raw(served) as sock:
        sock.sendall(b"\x01\x02")  # half a prefix, then gone
    assert served.count() == before
    served.check(namespace="default", k=5, context="after raw control garbage")


# -- garbage written straight into a slot ----------------------------------------------------------


def _rogue_worker(name: str, seed: int, out: Any) -> None:
    """Takes a slot like any client, then writes garbage requests into it through its own mapping."""
    import mmap

    from kalos.ipc.protocol import SlotView

    try:
        rng = np.random.default_rng(seed)
        client = Client(name, timeout=10.0)
        conn = client._conn  # the rogue needs to know which slot and bell are its own
        slot_index = conn.channel.slot.index
        bell = conn.wake.fileno()  # (the rogue rings the sidecar through its own end of the pair)
        path = f"segment of {name}"
        fd = conn.segment.fileno()  # the memfd the hello passed, mapped a second time
        buf = memoryview(mmap.mmap(fd, os.fstat(fd).st_size))
        layout = Layout.read_header(buf, source=path)
        view = SlotView(buf, layout, slot_index)
        seq = int(view.req_seq[0]) + 1_000
        results = []

        def send(case: str, fill: Callable[[], None]) -> None:
            nonlocal seq
            view.request_bytes[:] = 0
            fill()
            seq += 1
            view.req_seq[0] = seq  # the bump that publishes the garbage
            ring(bell)
            deadline = time.monotonic() + DEADLINE_S
            while int(view.resp_seq[0]) != seq:
                if time.monotonic() > deadline:
                    results.append((case, None, "no answer"))
                    return
                time.sleep(0.0005)
            results.append((case, int(view.status[0]), view.read_message()))

        def recall(**fields: Any) -> Callable[[], None]:
            def fill() -> None:
                view.op[0] = Op.RECALL
                view.k[0] = 5
                view.n_queries[0] = 1
                view.queries[:1] = 1.0
                for key, value in fields.items():
                    if key == "queries":
                        view.queries[: len(value)] = value
                    elif key == "namespace":
                        view.namespace[0] = value
                    else:
                        getattr(view, key)[0] = value

            return fill

        def random_fill() -> None:
            view.request_bytes[:] = rng.integers(0, 256, size=len(view.request_bytes), dtype=np.uint8)
            if int(view.op[0]) in (Op.RECALL, Op.PING):
                view.op[0] = int(view.op[0]) | 0x100
            view.queries[:] = rng.standard_normal(view.queries.shape).astype(np.float32)

        for i in range(25):
            send(f"random-{i}", random_fill)
        cases = {
            "op-unknown": recall(op=99),
            "n-zero": recall(n_queries=0),
            "n-above-max-batch": recall(n_queries=layout.max_batch + 1),
            "n-huge": recall(n_queries=2**32 - 1),
            "k-zero": recall(k=0),
            "k-above-max": recall(k=layout.max_k + 1),
            "k-huge": recall(k=2**32 - 1),
            "flags-unknown": recall(flags=0x80),
            "namespace-garbage": recall(namespace=bytes(rng.integers(1, 256, 64, dtype=np.uint8)), namespace_len=500),
            "since-nan": recall(flags=int(RequestFlag.ALL_NAMESPACES | RequestFlag.HAS_SINCE), since=float("nan")),
            "window-empty": recall(flags=int(RequestFlag.ALL_NAMESPACES | RequestFlag.HAS_SINCE | RequestFlag.HAS_UNTIL),
                                   since=10.0, until=5.0),
            "queries-nan": recall(flags=int(RequestFlag.ALL_NAMESPACES), queries=np.full((1, layout.dim), np.nan)),
            "queries-zero": recall(flags=int(RequestFlag.ALL_NAMESPACES), queries=np.zeros((1, layout.dim))),
            "queries-inf": recall(flags=int(RequestFlag.ALL_NAMESPACES), queries=np.full((1, layout.dim), np.inf)),
        }
        for case, fill in cases.items():
            send(case, fill)
        # A well-formed request through the same raw path is answered normally.
        send("valid", recall(flags=int(RequestFlag.ALL_NAMESPACES)))
        results.append(("valid-ids", [int(x) for x in view.ids[0, :5]], ""))
        del view
        out.put(("ok", results))
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def test_garbage_in_a_slot_is_answered_with_an_error_and_others_are_unaffected(served, children):
    out = children.queue()
    errors_before = served.client.stats()["errors"]
    children.start(_rogue_worker, served.name, served.seed, out)
    deadline = time.monotonic() + DEADLINE_S * 2
    rounds = 0
    while True:  # other clients keep getting exact answers while the rogue scribbles
        served.check(namespace=None, k=6, n_queries=1, context=f"during rogue round {rounds}")
        rounds += 1
        try:
            msg = out.get_nowait()
            break
        except queue_mod.Empty:
            assert time.monotonic() < deadline, "the rogue process did not finish"
    assert msg[0] == "ok", msg[1]
    results = {case: (status, message) for case, status, message in msg[1]}
    for case, (status, message) in results.items():
        if case == "valid-ids":
            continue
        assert status is not None, f"{case}: the sidecar never answered"
        if case == "valid":
            assert status == 0, message
        elif case == "namespace-garbage":
            # Not a name a store could hold (not UTF-8, or control bytes): still an error, naming
            # the namespace, though a valid name that holds nothing is answered empty (issue 22).
            assert status == ErrorCode.INVALID_QUERY and "namespace" in message, (case, status, message)
        else:
            assert status == ErrorCode.INVALID_QUERY, (case, status, message)
            assert message, f"{case}: error without a message"
    valid_ids = results["valid-ids"][0]
    assert all(i in served.model for i in valid_ids)
    assert served.client.stats()["errors"] >= errors_before + 25
    served.check(namespace="default", k=MAX_K, context="after rogue")


# -- permissions and foreign segments ------------------------------------------------------------


def test_segment_and_socket_are_owner_only(served):
    seg = f"/proc/self/fd/{served.client._conn.segment.fileno()}"  # the memfd the hello passed
    assert not segment_path(served.name).exists()  # nameless: nothing in /dev/shm to squat or remove
    sock = Path(served.runtime) / f"{served.name}.sock"
    assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert os.stat(seg).st_uid == os.getuid()
    assert stat.S_IMODE(os.stat(served.runtime).st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_control_socket_refuses_another_users_connection(sidecars, store_dir, runtime_dir):
    """Defence in depth: even with the socket and its directory opened up, another uid is refused."""
    name = unique_name("uid")
    sidecars.start(store_dir / "uid.db", name=name, dim=4)
    sock_path = runtime_dir / f"{name}.sock"
    os.chmod(runtime_dir, 0o711)
    os.chmod(sock_path, 0o666)

    def connect_and_ask() -> dict:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(DEADLINE_S)
        sock.connect(str(sock_path))
        try:
            send_frame(sock, {"op": "stats"})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the sidecar may have answered and hung up before we sent anything
        return recv_frame(sock, max_bytes=1 << 20)[0]

    try:
        reply = as_nobody(connect_and_ask)
    finally:
        os.chmod(sock_path, 0o600)
        os.chmod(runtime_dir, 0o700)
    assert reply["ok"] is False and reply["code"] == ErrorCode.PROTOCOL and "uid 65534" in reply["error"], reply
    with Client(name, timeout=10.0) as client:  # the owner is still served
        assert client.stats()["count"] == 0


_FAKE_SEGMENTS: dict[str, int] = {}


@pytest.fixture
def fake_segment() -> Iterator[Callable[[bytes], str]]:
    """Makes a sealed memfd holding ``content`` (what a sidecar would pass); returns its label."""
    import fcntl

    def make(content: bytes) -> str:
        name = f"kalos-fake-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(fd, content)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        _FAKE_SEGMENTS[name] = fd
        return name

    yield make
    while _FAKE_SEGMENTS:
        os.close(_FAKE_SEGMENTS.popitem()[1])


def _good_segment_bytes(layout: Layout) -> bytearray:
    data = bytearray(layout.size)
    layout.write_header(memoryview(data), epoch=3, pid=os.getpid())
    return data


def _attach(name: str) -> Layout:
    from kalos.ipc.segment import Segment

    seg = Segment.attach(os.dup(_FAKE_SEGMENTS[name]), source=f"memfd:{name}")
    try:
        return Layout.read_header(seg.buf, source=seg.source)
    finally:
        seg.close()


def test_foreign_segments_raise_protocol_mismatch_with_a_clear_message(fake_segment):
    layout = Layout(2, 8, 4, 2)
    assert _attach(fake_segment(bytes(_good_segment_bytes(layout)))) == layout

    def patched(**fields: int) -> bytes:
        data = _good_segment_bytes(layout)
        header = np.ndarray((), HEADER_DTYPE, data, 0)
        for key, value in fields.items():
            header[key] = value
        return bytes(data)

    name = fake_segment(patched(magic=int.from_bytes(b"NOTKALOS", "little")))
    with pytest.raises(ProtocolMismatch, match=rf"memfd:{name}: not a Kalos segment \(magic 0x"):
        _attach(name)
    name = fake_segment(patched(version=VERSION + 7))
    with pytest.raises(ProtocolMismatch, match=rf"memfd:{name}: segment protocol version {VERSION + 7}.*upgrade"):
        _attach(name)
    name = fake_segment(patched(slot_size=layout.slot_size * 2))
    with pytest.raises(ProtocolMismatch, match="segment sizes disagree with its header"):
        _attach(name)
    name = fake_segment(patched(header_size=64))
    with pytest.raises(ProtocolMismatch, match="segment sizes disagree with its header"):
        _attach(name)
    name = fake_segment(bytes(_good_segment_bytes(layout))[: layout.size - 4096])  # truncated
    with pytest.raises(ProtocolMismatch, match="needed"):
        _attach(name)
    name = fake_segment(b"KALOS" * 4)  # shorter than a header
    with pytest.raises(ProtocolMismatch, match="too small"):
        _attach(name)
    name = fake_segment(os.urandom(8192))
    with pytest.raises(ProtocolMismatch, match="not a Kalos segment"):
        _attach(name)
    assert MAGIC == int.from_bytes(b"KALOSSHM", "little")


# -- stores that are not Kalos stores, and a second sidecar ---------------------------------------


def _serve_cmd(store: Path, name: str, dim: int = 4) -> list[str]:
    return [sys.executable, "-m", "kalos", "serve", "--store", str(store), "--name", name, "--dim", str(dim),
            "--device", "cpu"]


def test_a_file_that_is_not_a_kalos_store_is_refused_and_left_untouched(runtime_dir, store_dir):
    junk = store_dir / "junk.db"
    junk.write_bytes(os.urandom(10_000))
    other = store_dir / "other.sqlite"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE t (x)")
    db.execute("INSERT INTO t VALUES (1)")
    db.commit()
    db.close()
    text = store_dir / "notes.txt"
    text.write_text("remember the milk\n" * 10)
    for path in (junk, other, text):
        before = path.read_bytes()
        siblings = sorted(p.name for p in store_dir.iterdir())
        name = unique_name("junk")
        result = run_guarded(_serve_cmd(path, name))
        assert result.returncode != 0, f"{path.name}: the sidecar started on a foreign file"
        assert str(path) in result.stderr, f"{path.name}: the message does not name the file: {result.stderr!r}"
        assert "not a Kalos store" in result.stderr
        assert "Traceback" not in result.stderr
        assert path.read_bytes() == before, f"{path.name} was modified"
        assert sorted(p.name for p in store_dir.iterdir()) == siblings, f"{path.name}: files appeared next to it"
        assert not segment_path(name).exists() and not (runtime_dir / f"{name}.sock").exists()
    from kalos.server.sidecar import Sidecar, SidecarConfig

    with pytest.raises(NotAKalosStore, match="not a Kalos store"):
        Sidecar(SidecarConfig(store=junk, name=unique_name("junk"), dim=4, device="cpu"))
    assert not Path(f"{junk}-wal").exists() and not Path(f"{junk}-shm").exists()


def test_a_second_sidecar_on_the_same_name_or_store_is_refused(sidecars, store_dir, runtime_dir):
    from kalos.server.sidecar import Sidecar, SidecarConfig

    name = unique_name("one")
    first = sidecars.start(store_dir / "a.db", name=name, dim=4)
    with Client(name, timeout=10.0) as client:
        ids = client.add(np.eye(4, dtype=np.float32))
        # Same name, other store: SidecarAlreadyRunning, exit 2 with its message.
        result = run_guarded(_serve_cmd(store_dir / "b.db", name))
        assert result.returncode == 2, result.stderr
        assert "already running" in result.stderr and name in result.stderr and "Traceback" not in result.stderr
        with pytest.raises(SidecarAlreadyRunning, match="already running"):
            Sidecar(SidecarConfig(store=store_dir / "c.db", name=name, dim=4, device="cpu"))
        # Same store, other name: StoreLocked.
        other = unique_name("two")
        result = run_guarded(_serve_cmd(store_dir / "a.db", other))
        assert result.returncode == 2, result.stderr
        assert "already open" in result.stderr and str(store_dir / "a.db") in result.stderr
        with pytest.raises(StoreLocked, match="already open"):
            Sidecar(SidecarConfig(store=store_dir / "a.db", name=unique_name("three"), dim=4, device="cpu"))
        assert not segment_path(other).exists()
        # The first sidecar is untouched and still serving.
        assert first.process.poll() is None
        assert (runtime_dir / f"{name}.sock").exists()
        hit = client.recall(np.array([0, 0, 1, 0], np.float32), k=1)
        assert hit.ids.tolist() == [int(ids[2])]
        with Client(name, timeout=10.0) as fresh:
            assert fresh.stats()["count"] == 4


# -- kill -9 of the sidecar under load ---------------------------------------------------------------


def _steady_recaller(name: str, queries: np.ndarray, k: int, timeout: float, restarted: Any, out: Any) -> None:
    pid = os.getpid()
    try:
        client = Client(name, timeout=timeout)
        done = 0
        failure = None
        deadline = time.monotonic() + 3 * DEADLINE_S
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                client.recall(queries[done % len(queries)], k=k)
            except SidecarUnavailable as exc:
                failure = (time.monotonic() - started, str(exc))
                break
            done += 1
            if done == 20:
                out.put(("warm", pid))
        out.put(("failed", pid, failure, done))
        if not restarted.wait(3 * DEADLINE_S):
            out.put(("error", pid, "never told that the sidecar restarted"))
            return
        retries = 0
        deadline = time.monotonic() + DEADLINE_S
        while True:  # the same Client object, no new one
            try:
                hits = [client.recall(q, k=k) for q in queries]
                break
            except SidecarUnavailable as exc:
                retries += 1
                if time.monotonic() > deadline:
                    out.put(("error", pid, f"did not recover: {exc}"))
                    return
                time.sleep(0.05)
        out.put(("recovered", pid, retries, [(h.ids, h.scores) for h in hits]))
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", pid, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _steady_writer(name: str, seed: int, timeout: float, stop: Any, restarted: Any, out: Any) -> None:
    pid = os.getpid()
    try:
        rng = np.random.default_rng(seed)
        client = Client(name, timeout=timeout)
        acked_ids: list[int] = []
        acked_vectors: list[np.ndarray] = []
        failed_sizes: list[int] = []
        after_restart = 0
        rounds = 0
        while not stop.is_set():
            n = (1, 37)[rounds % 2]  # single rows and multi-row transactions
            rounds += 1
            v = rng.standard_normal((n, DIM)).astype(np.float32)
            try:
                ids = client.add(v, texts=[f"w{len(acked_ids) + i}" for i in range(n)], namespace="writer")
            except SidecarUnavailable:
                failed_sizes.append(n)
                restarted.wait(3 * DEADLINE_S)
                time.sleep(0.01)
                continue
            acked_ids.extend(ids.tolist())
            acked_vectors.extend(v)
            if rounds == 6:
                out.put(("warm", pid))
            if restarted.is_set():
                after_restart += 1
                if after_restart == 6:
                    out.put(("writer-resumed", pid))
        out.put(("acked", pid, np.array(acked_ids, np.int64), np.array(acked_vectors), failed_sizes))
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", pid, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _expect(out: Any, kind: str, count: int) -> list[tuple]:
    got = []
    while len(got) < count:
        msg = out.get(timeout=DEADLINE_S * 2)
        assert msg[0] != "error", msg[2]
        assert msg[0] == kind, f"expected {kind!r}, got {msg[:3]}"
        got.append(msg)
    return got


def _expect_each(out: Any, counts: dict[str, int]) -> dict[str, list[tuple]]:
    """:func:`_expect` of several kinds of message, in whatever order they come."""
    got: dict[str, list[tuple]] = {kind: [] for kind in counts}
    while any(len(got[kind]) < n for kind, n in counts.items()):
        msg = out.get(timeout=DEADLINE_S * 2)
        assert msg[0] != "error", msg[2]
        assert msg[0] in got and len(got[msg[0]]) < counts[msg[0]], f"unexpected {msg[:3]}"
        got[msg[0]].append(msg)
    return got


def test_a_sidecar_killed_while_it_sleeps_is_noticed_and_the_next_one_found(sidecars, store_dir, rng):
    """kill -9 while the sidecar sleeps leaves its sleeping word set, so the next request rings
    its bell, whose other end died with it: SidecarUnavailable (it was a bare BrokenPipeError
    that skipped the retry), then the client finds a sidecar that is back by itself."""
    name = unique_name("sleepkill")
    store = store_dir / "s.db"
    proc = sidecars.start(store, name=name, dim=DIM)
    vectors = rng.standard_normal((50, DIM)).astype(np.float32)
    with Client(name, timeout=2.0) as client:
        ids = client.add(vectors)
        q = vectors[3]
        assert client.recall(q, k=1).ids.tolist() == [int(ids[3])]
        header = client._conn.channel.header
        wait_until(lambda: header.sidecar_sleeping[0] == 1, "the sidecar to fall asleep")
        proc.kill()
        proc.process.wait(DEADLINE_S)
        with pytest.raises(SidecarUnavailable):
            client.recall(q, k=1)
        sidecars.start(store, name=name)
        assert client.recall(q, k=1).ids.tolist() == [int(ids[3])]


def test_a_recall_whose_sidecar_exits_is_asked_again_once_on_either_path(sidecars, store_dir, rng, monkeypatch):
    """A recall that finds its sidecar gone (SidecarExited) reconnects and asks once more, then
    lets the caller hear of it: the same for recall's usual call (a float32 vector, which takes
    Client._recall_one) as for the general path (a float64 vector, a time window)."""
    from kalos.ipc.channel import ClientChannel, SidecarExited

    name = unique_name("again")
    sidecars.start(store_dir / "a.db", name=name, dim=DIM)
    vectors = rng.standard_normal((20, DIM)).astype(np.float32)
    with Client(name, timeout=2.0) as client:
        ids = client.add(vectors)
        assert client.recall(vectors[4], k=1).ids.tolist() == [int(ids[4])]
        connects = []
        connect = Client._connect

        def gone(self, seq):
            raise SidecarExited("the sidecar exited (faked)")

        with monkeypatch.context() as patch:
            patch.setattr(Client, "_connect", lambda self: connects.append(1) or connect(self))
            patch.setattr(ClientChannel, "wait", gone)
            for query, window in ((vectors[4], {}), (vectors[4].astype(np.float64), {}),
                                  (vectors[4], {"since": 0.0})):
                with client._lock:
                    client._connection()  # (the case before left it disconnected)
                connects.clear()
                with pytest.raises(SidecarExited):
                    client.recall(query, k=1, **window)
                assert len(connects) == 1, f"{query.dtype} {window}: {len(connects)} reconnects"
        assert client.recall(vectors[4], k=1).ids.tolist() == [int(ids[4])]


def test_a_sidecar_back_with_another_dimension_is_named_alike_on_either_path(sidecars, store_dir, rng,
                                                                            monkeypatch):
    """After an exit, the recall is asked again of the sidecar that answers now; if that one holds
    another dimension, the short path and the general path both say so (SidecarUnavailable "came
    back with another dimension"), not a DimensionMismatch of the caller's query, and neither
    shows the first exit as its cause."""
    from kalos.ipc.channel import ClientChannel, SidecarExited
    from kalos.ipc.segment import Endpoint

    name, other = unique_name("dimx"), unique_name("dimy")
    sidecars.start(store_dir / "x.db", name=name, dim=DIM)
    sidecars.start(store_dir / "y.db", name=other, dim=DIM + 8)
    q = rng.standard_normal(DIM).astype(np.float32)
    for query in (q, q.astype(np.float64)):
        with Client(name, timeout=2.0) as client:
            client.add(rng.standard_normal((4, DIM)).astype(np.float32))
            wait = ClientChannel.wait
            exits = []

            def exits_once(self, seq):
                if not exits:
                    exits.append(seq)
                    raise SidecarExited("the sidecar exited (faked)")
                return wait(self, seq)

            with monkeypatch.context() as patch:
                patch.setattr(ClientChannel, "wait", exits_once)
                client._endpoint = Endpoint(other)  # the sidecar found after the exit
                with pytest.raises(SidecarUnavailable, match="another dimension") as caught:
                    client.recall(query, k=1)
            shown = caught.value.__cause__ or (None if caught.value.__suppress_context__ else caught.value.__context__)
            assert exits and shown is None, query.dtype


def test_the_usual_recall_takes_its_short_path_and_rewrites_what_other_calls_changed(sidecars, store_dir, rng,
                                                                                    monkeypatch):
    """Recall's usual call skips the general path (Client._recall is not called), and the request
    words it keeps from its last call are written again after any other call changed them in the
    slot: a recall in namespace "a" after a recall_many, a where, a ping, a window and a short
    recall in namespace "b" answers from "a"."""
    name = unique_name("short")
    sidecars.start(store_dir / "s.db", name=name, dim=DIM)
    a = rng.standard_normal((30, DIM)).astype(np.float32)
    b = rng.standard_normal((30, DIM)).astype(np.float32)
    with Client(name, timeout=2.0) as client:
        ids_a = client.add(a, namespace="a", metadata=[{"i": i} for i in range(30)])
        client.add(b, namespace="b")
        general = []
        original = Client._recall
        monkeypatch.setattr(Client, "_recall", lambda self, *args, **kw: general.append(args) or original(self, *args, **kw))
        others = {
            "recall_many": lambda: client.recall_many(b[:3], k=2, namespace="b"),
            "where": lambda: client.recall(a[0], k=3, namespace="a", where={"i": {"$gte": 0}}),
            "ping": client.ping,
            "window": lambda: client.recall(b[1], k=2, namespace="b", since=0.0),
            "all namespaces": lambda: client.recall(b[1], k=4, namespace=None),
            "short, in b": lambda: client.recall(b[2], k=5, namespace="b"),
        }
        for label, other in others.items():
            other()
            general.clear()
            hits = client.recall(a[5], k=1, namespace="a")
            assert hits.ids.tolist() == [int(ids_a[5])], f"after {label}"
            assert not general, f"after {label}: the usual call took the general path"


def test_a_vector_from_another_process_takes_the_short_path_and_a_big_endian_one_the_general(
        sidecars, store_dir, rng, monkeypatch):
    """A float32 vector unpickled (as a multiprocessing queue hands it over: its dtype equals
    float32 but is another object) takes recall's short path; a big-endian float32 one (not equal
    to float32) takes the general path; both answer alike."""
    import pickle

    name = unique_name("pickled")
    sidecars.start(store_dir / "p.db", name=name, dim=DIM)
    vectors = rng.standard_normal((20, DIM)).astype(np.float32)
    with Client(name, timeout=2.0) as client:
        ids = client.add(vectors)
        general = []
        original = Client._recall
        monkeypatch.setattr(Client, "_recall", lambda self, *args, **kw: general.append(args) or original(self, *args, **kw))
        unpickled = pickle.loads(pickle.dumps(vectors[6]))
        assert unpickled.dtype is not np.dtype(np.float32), "the case this test is for"
        assert client.recall(unpickled, k=1).ids.tolist() == [int(ids[6])]
        assert not general, "an unpickled float32 vector took the general path"
        big_endian = vectors[6].astype(">f4")
        assert client.recall(big_endian, k=1).ids.tolist() == [int(ids[6])]
        assert len(general) == 1, "a big-endian vector skipped the general path"


def test_single_recall_refuses_what_the_general_path_refuses(sidecars, store_dir, rng):
    """Recall's usual call and the general path check alike: the shortcut is taken only for a
    float32 vector of the store's dimension and an int k in range, and a bad namespace is refused."""
    name = unique_name("refuse")
    sidecars.start(store_dir / "r.db", name=name, dim=DIM)
    vectors = rng.standard_normal((20, DIM)).astype(np.float32)
    with Client(name, timeout=2.0) as client:
        ids = client.add(vectors)
        q = vectors[7]
        with pytest.raises(DimensionMismatch):
            client.recall(q[:-1], k=1)
        for bad_k in (0, client.max_k + 1, True, 1.0):
            with pytest.raises(InvalidQuery):
                client.recall(q, k=bad_k)
        for bad_namespace in ("", "a\x00b", 7):
            with pytest.raises(InvalidQuery):
                client.recall(q, k=1, namespace=bad_namespace)
        with pytest.raises(InvalidQuery):
            client.recall(np.full(DIM, np.nan, np.float32), k=1)
        assert client.recall(q, k=1).ids.tolist() == [int(ids[7])]
        assert client.recall(q, k=np.int64(2)).ids.tolist()[0] == int(ids[7])
        assert client.recall(q.astype(np.float64), k=1).ids.tolist() == [int(ids[7])]


def test_kill9_sidecar_clients_fail_fast_then_recover_and_acked_adds_survive(sidecars, children, store_dir, seed):
    rng = np.random.default_rng(seed)
    name = unique_name("kill")
    store = store_dir / "kill.db"
    timeout = 1.0
    first = sidecars.start(store, name=name, dim=DIM)
    base = rng.standard_normal((2000, DIM)).astype(np.float32)
    with Client(name, timeout=10.0) as loader:
        base_ids = loader.add(base, namespace="default")
    queries = rng.standard_normal((6, DIM)).astype(np.float32)
    k = 12
    out, restarted, stop = children.queue(), children.event(), children.event()
    n_recallers = 3
    for _ in range(n_recallers):
        children.start(_steady_recaller, name, queries, k, timeout, restarted, out)
    children.start(_steady_writer, name, seed + 1, timeout, stop, restarted, out)
    warm = _expect(out, "warm", n_recallers + 1)
    assert len(warm) == n_recallers + 1

    idle = Client(name, timeout=timeout)  # connected, but makes no call across the restart
    first.kill()  # SIGKILL, mid-recall for the spinning clients
    failed = _expect(out, "failed", n_recallers)
    for _kind, pid, failure, done in failed:
        assert failure is not None, f"client {pid} never noticed that the sidecar died"
        elapsed, message = failure
        print(f"client {pid} gave up after {elapsed:.3f} s: {message}")
        assert elapsed < timeout + 5.0, f"client {pid} took {elapsed:.1f} s to give up (timeout {timeout} s)"
        assert message
        assert done >= 20

    second = sidecars.start(store, name=name, dim=DIM)  # same store, same name
    restarted.set()
    # The recallers' recoveries and the writer's resumption race each other: either may come first.
    after = _expect_each(out, {"recovered": n_recallers, "writer-resumed": 1})
    for _kind, pid, retries, hits in after["recovered"]:
        assert retries == 0, f"client {pid} needed {retries} retries after the restart"
        for qi, (hit_ids, hit_scores) in enumerate(hits):
            assert_topk_matches(hit_ids[None], hit_scores[None], base_ids, base, queries[qi], k, padded=False,
                                context=f"client {pid} after restart, query {qi}")
    stop.set()
    msg = out.get(timeout=DEADLINE_S * 2)
    assert msg[0] == "acked", msg
    _kind, _pid, acked_ids, acked_vectors, failed_sizes = msg
    assert len(acked_ids) >= 10
    print(f"writer: {len(acked_ids)} rows acknowledged, failed adds of sizes {failed_sizes}")
    with Client(name, timeout=10.0) as checker:
        items = checker.get(acked_ids)
        missing = [int(i) for i, item in zip(acked_ids, items) if item is None]
        assert not missing, f"{len(missing)} acknowledged adds were lost: {missing[:10]}"
        assert all(item.namespace == "writer" for item in items)
        assert [item.text for item in items] == [f"w{i}" for i in range(len(acked_ids))]
        count = checker.stats()["count"]
        # An add in flight at the kill either committed whole or not at all; nothing acknowledged is lost.
        extra = count - len(base_ids) - len(acked_ids)
        assert extra == 0 or extra in failed_sizes, f"{extra} unacknowledged rows (failed adds: {failed_sizes})"
        picks = np.linspace(0, len(acked_ids) - 1, 20).astype(int)
        found = checker.recall_many(acked_vectors[picks], k=1, namespace="writer")
        assert found.ids[:, 0].tolist() == acked_ids[picks].tolist()
        assert checker.get(base_ids[:3])[0] is not None
    # A client that was idle across the restart recovers by itself too. Documented behaviour
    # (kalos/client/client.py): its first call may still raise SidecarUnavailable, the next one reconnects.
    spurious = 0
    for attempt in range(2):
        try:
            assert idle.stats()["count"] >= len(base_ids)
            hit = idle.recall(queries[0], k=k)
            break
        except SidecarUnavailable as exc:
            spurious += 1
            print(f"idle client, call {attempt} after the restart: {exc}")
    else:
        raise AssertionError("an idle client did not recover on its second call after the restart")
    assert_topk_matches(hit.ids[None], hit.scores[None], base_ids, base, queries[0], k, padded=False,
                        context="idle client after restart")
    idle.close()
    assert second.process.poll() is None


def test_a_stopped_sidecar_is_noticed_by_its_heartbeat_and_clients_recover(sidecars, store_dir, seed):
    rng = np.random.default_rng(seed)
    name = unique_name("stop")
    proc = sidecars.start(store_dir / "stop.db", name=name, dim=DIM)
    data = rng.standard_normal((500, DIM)).astype(np.float32)
    timeout = 1.0
    client = Client(name, timeout=timeout)
    try:
        ids = client.add(data)
        q = rng.standard_normal(DIM).astype(np.float32)
        client.recall(q, k=3)
        os.kill(proc.pid, 19)  # SIGSTOP: alive (socket open) but hung
        try:
            for call in (lambda: client.recall(q, k=3), lambda: client.stats(), lambda: client.recall(q, k=3)):
                started = time.monotonic()
                with pytest.raises(SidecarUnavailable) as info:
                    call()
                elapsed = time.monotonic() - started
                print(f"hung sidecar noticed after {elapsed:.2f} s: {info.value}")
                assert elapsed < timeout + 5.0, f"took {elapsed:.1f} s with timeout {timeout} s"
        finally:
            os.kill(proc.pid, 18)  # SIGCONT
        hit = wait_until(lambda: _try_recall(client, q, 7), "the resumed sidecar to answer")
        assert_topk_matches(hit.ids[None], hit.scores[None], ids, data, q, 7, padded=False, context="after SIGCONT")
        assert client.stats()["count"] == 500
    finally:
        client.close()


def test_a_timeout_shorter_than_the_heartbeat_interval_does_not_call_a_live_sidecar_dead(
        sidecars, store_dir, seed, monkeypatch):
    """The sidecar shows life only at each heartbeat stamp: a client whose timeout is shorter than
    the interval between two must still wait them out (the hello says how long one is), not call
    the sidecar dead in every gap (issue 18's review: a 0.03 s timeout failed every wait)."""
    rng = np.random.default_rng(seed)
    monkeypatch.setenv("KALOS_HEARTBEAT_S", "0.5")  # (the sidecar's; it inherits the environment)
    name = unique_name("beat")
    sidecars.start(store_dir / "beat.db", name=name, dim=DIM)
    with Client(name, timeout=0.05) as client:
        client.add(rng.standard_normal((20, DIM)).astype(np.float32))
        channel = client._conn.channel
        # What every wait of a recall or a control operation asks between its polls, over three
        # gaps between stamps, each 10x the client's timeout.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            channel.check_alive()
            time.sleep(0.01)
        assert len(client.recall(rng.standard_normal(DIM).astype(np.float32), k=3).ids) == 3


def _try_recall(client: Client, q: np.ndarray, k: int) -> Any:
    try:
        return client.recall(q, k=k)
    except SidecarUnavailable:
        return None


# -- kill -9 of a client -----------------------------------------------------------------------------


def _victim(name: str, queries: np.ndarray, out: Any) -> None:
    try:
        client = Client(name, timeout=10.0)
        done = 0
        while True:
            client.recall_many(queries, k=7)
            done += 1
            if done == 10:
                out.put(("warm", os.getpid()))
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", os.getpid(), f"{type(exc).__name__}: {exc}"))


def _healthy(name: str, ids: np.ndarray, vectors: np.ndarray, seed: int, stop: Any, out: Any) -> None:
    try:
        rng = np.random.default_rng(seed)
        client = Client(name, timeout=10.0)
        done = 0
        while not stop.is_set():
            q = rng.standard_normal((3, DIM)).astype(np.float32)
            batch = client.recall_many(q, k=9)
            assert_topk_matches(batch.ids, batch.scores, ids, vectors, q, 9, context=f"healthy round {done}")
            done += 1
            if done == 10:
                out.put(("warm", os.getpid()))
        out.put(("done", os.getpid(), done))
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", os.getpid(), f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def test_a_client_killed_mid_request_frees_its_slot_and_disturbs_no_one(sidecars, children, store_dir, seed):
    rng = np.random.default_rng(seed)
    name = unique_name("victim")
    sidecars.start(store_dir / "v.db", name=name, dim=DIM, extra_args=["--slots", "3"])
    data = rng.standard_normal((3000, DIM)).astype(np.float32)
    with Client(name, timeout=10.0) as observer:
        ids = observer.add(data)
        out, stop = children.queue(), children.event()
        victim = children.start(_victim, name, rng.standard_normal((MAX_BATCH, DIM)).astype(np.float32), out)
        healthy = children.start(_healthy, name, ids, data, seed + 1, stop, out)
        warm = [out.get(timeout=DEADLINE_S * 2) for _ in range(2)]
        assert all(m[0] == "warm" for m in warm), warm
        assert observer.stats()["clients"] == 3
        # Every slot is taken: a fourth client is refused with a clear message.
        with pytest.raises(InvalidArgument, match="slots are in use"):
            Client(name, timeout=10.0)
        os.kill(victim.pid, 9)
        victim.join(timeout=DEADLINE_S)
        wait_until(lambda: observer.stats()["clients"] == 2, "the dead client's slot to be freed")
        with Client(name, timeout=10.0) as newcomer:  # ...and the slot is usable again
            q = rng.standard_normal(DIM).astype(np.float32)
            hit = newcomer.recall(q, k=5)
            assert_topk_matches(hit.ids[None], hit.scores[None], ids, data, q, 5, padded=False, context="newcomer")
            assert observer.stats()["clients"] == 3
        stop.set()
        msg = out.get(timeout=DEADLINE_S * 2)
        assert msg[0] == "done", msg
        assert msg[2] >= 10
        healthy.join(timeout=DEADLINE_S)
        wait_until(lambda: observer.stats()["clients"] == 1, "the healthy client's slot to be freed")


def test_a_cpu_sidecar_without_the_native_scores_says_what_it_costs(tmp_path, runtime_dir, monkeypatch, caplog):
    """Where kalos.engine._dots could not be built, a CPU sidecar still serves (BLAS scores its
    passes) and says at start what that costs and how to get the native scores (not only doctor)."""
    import logging

    from kalos.engine import numpy_engine
    from kalos.server.sidecar import Sidecar, SidecarConfig

    monkeypatch.setattr(numpy_engine, "_dots", None)
    name = unique_name("nodots")
    with caplog.at_level(logging.WARNING, logger="kalos.server.sidecar"):
        sidecar = Sidecar(SidecarConfig(store=tmp_path / f"{name}.db", name=name, dim=4, device="cpu"))
    try:
        said = [r.getMessage() for r in caplog.records if "_dots was not built" in r.getMessage()]
        assert len(said) == 1 and "slower" in said[0] and "C compiler" in said[0]
    finally:
        sidecar.close()


def test_clients_spin_as_the_sidecar_advises_unless_told(runtime_dir, tmp_path, monkeypatch):
    """A GPU sidecar answers in ~100-200 us: its clients poll up to 1 ms before sleeping (a
    wake-up costs tens of us); a CPU sidecar's keep the default; spin_us / the env var win.
    Crowded clients of a GPU sidecar whose sweep answers nap, a CPU sidecar's sleep at once
    (client_crowded; the GPU's polling's spin yielding: crowded_wait)."""
    import threading

    from kalos.config import settings
    from kalos.engine import NumpyEngine
    from kalos.server.sidecar import GPU_CLIENT_SPIN_US, Sidecar, SidecarConfig, crowded_wait

    class LooksLikeAGpu(NumpyEngine):
        device = "cuda:0"

    def spin_of(client: Client) -> float:
        return client._conn.channel._spin_s

    assert (crowded_wait(False, False), crowded_wait(True, False), crowded_wait(True, True)) == ("sleep", "nap", "yield")
    for engine_cls, advised, crowded in ((NumpyEngine, settings().client_spin_us, "sleep"),
                                         (LooksLikeAGpu, GPU_CLIENT_SPIN_US, "nap")):
        name = unique_name()
        sidecar = Sidecar(SidecarConfig(store=tmp_path / f"{name}.db", name=name, dim=4, slots=4),
                          engine_factory=lambda _device, dim, cap, cls=engine_cls: cls(dim, capacity=cap))
        thread = threading.Thread(target=sidecar.serve_forever, daemon=True)
        thread.start()
        try:
            with Client(name) as client:
                assert spin_of(client) == pytest.approx(advised / 1e6)
                assert client._conn.channel._crowded == crowded
            # A client from before client_crowded reads client_naps: the same advice.
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(str(sidecar.endpoint.socket_path))
                ours, theirs = wake_pair()
                send_frame(raw, {"op": "hello", "protocol": PROTOCOL_VERSION})
                send_fd(raw, theirs.fileno())
                theirs.close()
                reply = recv_frame(raw, max_bytes=1 << 20)[0]
                os.close(recv_fd(raw))
                ours.close()
                assert reply["client_crowded"] == crowded and reply["client_naps"] == (crowded != "sleep")
            # "yield" is advised only while the GPU polls (the sweep answers once it failed).
            sidecar._control.client_crowded = "yield"
            with Client(name) as client:
                assert client._conn.channel._crowded == "nap"
            sidecar._control.client_crowded = crowded
            with Client(name) as client:
                client.add(np.eye(4, dtype=np.float32))
                assert client.recall(np.ones(4, np.float32), k=2).ids.shape == (2,)
            with Client(name, spin_us=5) as client:
                assert spin_of(client) == pytest.approx(5e-6)
            # A hello whose advice is not one of the waits (or, from an older sidecar, absent:
            # the same path): the clients nap as they did before the advice existed.
            sidecar._control.client_crowded = "naps"
            with Client(name) as client:
                assert client._conn.channel._crowded == "nap"
            sidecar._control.client_crowded = crowded
            monkeypatch.setenv("KALOS_CLIENT_SPIN_US", "7")
            settings.cache_clear()  # settings are read once per process
            try:
                with Client(name) as client:
                    assert spin_of(client) == pytest.approx(7e-6)
            finally:
                monkeypatch.delenv("KALOS_CLIENT_SPIN_US")
                settings.cache_clear()
        finally:
            sidecar.stop()
            thread.join(timeout=30)
