"""where= inside the scan: every engine's filtered top-k against the float64 reference with the
filter applied (tests/reference.py), on generated clauses of every selectivity (half the rows,
1%, exactly one row, none), with writes between searches (the cached masks must follow them);
then end to end through a real sidecar and the clients.

The engines: NumPy, the GPU engine's torch backend on PyTorch's CPU device, its Triton kernels
under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton's first import as in
tests/test_torch_engine.py), and a sharded engine of two CPU shards. Every test that draws random
data prints its seed (``KALOS_TEST_SEED`` replays one).
"""
from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import pytest
from reference import assert_topk_matches

try:
    import torch
except ImportError:  # the torch engines' tests skip
    torch = None

HAVE_CUDA = torch is not None and torch.cuda.is_available()
if torch is not None and not HAVE_CUDA and "triton" not in sys.modules:
    from conftest import import_interpreted

    import_interpreted("triton")  # (the kernels' @triton.jit then sees the variable)

from kalos.engine import Filter, NumpyEngine, ShardedEngine  # noqa: E402
from kalos.engine.base import as_unit_rows  # noqa: E402
from kalos.errors import InvalidArgument  # noqa: E402
from kalos.where import compile_where  # noqa: E402


def _interpreter_works() -> bool:
    """Whether the Triton backend runs on the CPU device here (triton installed, interpreting)."""
    if torch is None or HAVE_CUDA:
        return False
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        te.TorchEngine(4, device="cpu", backend="triton")
        return True
    except InvalidArgument:
        return False
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


if torch is not None:
    from kalos.engine import gpu as te  # noqa: E402
HAVE_INTERPRETER = _interpreter_works()

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
needs_interpreter = pytest.mark.skipif(
    not HAVE_INTERPRETER, reason="needs triton with TRITON_INTERPRET=1 set before triton's first import"
)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    if HAVE_INTERPRETER:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


USERS = [f"u{i}" for i in range(10)]
USER_WEIGHTS = np.array([0.5, 0.2, 0.1, 0.05, 0.05, 0.04, 0.03, 0.02, 0.007, 0.003])


def random_metadata(rng: np.random.Generator, n: int, start: int = 0) -> list[dict | None]:
    """Metadata of n rows: users of skewed frequency (u9: 0.3%), years, scores, flags, a key
    present on 70% of rows, strings where numbers usually are, rows with none; ``serial``
    names exactly one row."""
    out: list[dict | None] = []
    for j in range(n):
        if rng.random() < 0.05:
            out.append(None)
            continue
        m: dict = {
            "user_id": str(rng.choice(USERS, p=USER_WEIGHTS)),
            "year": int(rng.integers(2000, 2025)),
            "score": float(np.round(rng.random(), 3)),
            "flag": bool(rng.random() < 0.3),
            "serial": start + j,
        }
        if rng.random() < 0.7:
            m["tag"] = str(rng.choice(["a", "b", "c"]))
        if rng.random() < 0.05:
            m["year"] = str(m["year"])  # a string: no numeric comparison may match it
        out.append(m)
    return out


def random_clause(rng: random.Random, depth: int = 0) -> dict:
    """A clause of every operator and combinator, mixed."""
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        op = rng.choice(["$and", "$or"])
        return {op: [random_clause(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if depth < 2 and roll < 0.32:
        return {"$not": random_clause(rng, depth + 1)}
    key = rng.choice(["user_id", "year", "score", "flag", "tag", "missing"])
    if key in ("user_id", "tag", "missing"):
        values = USERS if key == "user_id" else ["a", "b", "c"]
        op = rng.choice(["implicit", "$eq", "$ne", "$in", "$nin", "$exists"])
        if op == "implicit":
            return {key: rng.choice(values)}
        if op in ("$in", "$nin"):
            return {key: {op: rng.sample(values, rng.randint(0, 3))}}
        if op == "$exists":
            return {key: {op: rng.random() < 0.5}}
        return {key: {op: rng.choice(values)}}
    if key == "flag":
        return {key: {rng.choice(["$eq", "$ne"]): rng.random() < 0.5}}
    value = rng.randint(2000, 2025) if key == "year" else round(rng.random(), 2)
    ops = rng.sample(["$gt", "$gte", "$lt", "$lte", "$eq", "$ne"], rng.randint(1, 2))
    return {key: {op: value for op in ops}}


def selective_clauses(metas: list[dict | None], rng: np.random.Generator) -> list[dict]:
    """Clauses of known selectivity over ``metas``: about half, about 1%, exactly 1 row, none."""
    years = sorted(m["year"] for m in metas if m and isinstance(m["year"], int))
    one = next(m["serial"] for m in metas[len(metas) // 3 :] if m)
    return [
        {"year": {"$gte": years[len(years) // 2]}},  # ~50%
        {"$and": [{"user_id": {"$in": ["u8", "u9"]}}, {"flag": {"$ne": True}}]},  # ~1% (0.7%)
        {"serial": one},  # exactly one row
        {"serial": int(one), "user_id": "nobody"},  # none
    ]


class Model:
    """What an engine holds, in float64 with Python-evaluated metadata: the reference side."""

    def __init__(self, engine, rng: np.random.Generator, dim: int) -> None:
        self.engine, self.rng, self.dim = engine, rng, dim
        self.vec: dict[int, np.ndarray] = {}
        self.ns: dict[int, int] = {}
        self.meta: dict[int, dict | None] = {}
        self.next_id = 1

    def add(self, n: int, namespaces: int = 3) -> np.ndarray:
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        vecs = as_unit_rows(self.rng.standard_normal((n, self.dim)))
        ns = self.rng.integers(0, namespaces, n).astype(np.int32)
        metas = random_metadata(self.rng, n, start=int(ids[0]))
        self.engine.add(ids, vecs, ns, np.zeros(n), metas)
        for i, v, s, m in zip(ids.tolist(), vecs, ns.tolist(), metas):
            self.vec[i], self.ns[i], self.meta[i] = v, s, m
        return ids

    def delete(self, ids) -> None:
        self.engine.delete(np.asarray(ids, dtype=np.int64))
        for i in np.asarray(ids).tolist():
            self.vec.pop(i, None)

    def set_metadata(self, ids, metas) -> None:
        self.engine.set_metadata(np.asarray(ids, dtype=np.int64), metas)
        for i, m in zip(np.asarray(ids).tolist(), metas):
            if i in self.vec:
                self.meta[i] = m

    def check(self, queries: np.ndarray, k: int, clause: dict | None, namespace: int | None = None) -> int:
        where = None if clause is None else compile_where(clause)
        got_ids, got_scores = self.engine.search(queries, k, Filter(namespace=namespace, where=where))
        ids = np.array(sorted(self.vec), dtype=np.int64)
        vectors = np.stack([self.vec[i] for i in ids.tolist()])
        eligible = np.array(
            [(namespace is None or self.ns[i] == namespace) and (where is None or where.matches(self.meta[i]))
             for i in ids.tolist()],
            dtype=bool,
        )
        assert_topk_matches(got_ids, got_scores, ids, vectors, queries, k, eligible,
                            context=f"{self.engine.name} where={clause} namespace={namespace}")
        ids_where = np.sort(self.engine.ids_where(Filter(namespace=namespace, where=where)))
        assert ids_where.tolist() == ids[eligible].tolist()
        return int(eligible.sum())


def numpy_engine(dim: int):
    return NumpyEngine(dim, capacity=16)


def torch_cpu_engine(dim: int):
    return te.TorchEngine(dim, device="cpu", backend="torch", capacity=16)


def triton_engine(dim: int, precision: str = "exact"):
    return te.TorchEngine(dim, device="cpu", backend="triton", capacity=16, precision=precision)


def sharded_engine(dim: int):
    return ShardedEngine([te.TorchEngine(dim, device="cpu", backend="torch", capacity=16) for _ in range(2)])


# (engine, rows, queries per search, generated clauses): the interpreter runs single queries
# (its batched passes cost seconds each) over fewer rows.
ENGINES = [
    pytest.param(numpy_engine, 1500, 3, 12, id="numpy"),
    pytest.param(torch_cpu_engine, 1500, 3, 12, id="torch-cpu", marks=needs_torch),
    pytest.param(sharded_engine, 1500, 3, 12, id="sharded-torch-cpu", marks=needs_torch),
    pytest.param(triton_engine, 200, 1, 2, id="triton-interpreter", marks=needs_interpreter),
]


@pytest.mark.parametrize("make, n, nq, n_clauses", ENGINES)
def test_filtered_topk_matches_the_reference(make, n, nq, n_clauses, seed, rng):
    dim = 24
    model = Model(make(dim), rng, dim)
    first = model.add(n)
    clause_rng = random.Random(seed)
    queries = as_unit_rows(rng.standard_normal((nq, dim)))
    clauses = selective_clauses([model.meta[i] for i in first.tolist()], rng)
    clauses += [random_clause(clause_rng) for _ in range(n_clauses)]
    counts = [model.check(queries, 8, clause) for clause in clauses]
    assert counts[2] == 1 and counts[3] == 0  # the exactly-one and the no-row clauses
    assert counts[0] > n // 3 and counts[1] < n // 20 and (counts[1] > 0 or n < 1000)  # ~50%, ~0.7%
    model.check(queries, 1, clauses[1])
    model.check(queries[:1], 8, clauses[0], namespace=1)
    model.check(queries[:1], 8, {"user_id": "u0"}, namespace=2)

    # Writes between searches: each must reach the cached masks.
    again = clauses[:3] + [{"user_id": "u9"}, {"tag": {"$exists": False}}][: 2 if nq > 1 else 1]
    for clause in again:
        model.check(queries, 8, clause)
    added = model.add(40)
    model.set_metadata(added[:5], [{"user_id": "u9", "serial": -1}] * 5)  # now match u9
    for clause in again:
        model.check(queries, 8, clause)
    u9 = [i for i, m in model.meta.items() if i in model.vec and m and m.get("user_id") == "u9"]
    model.delete(u9[: len(u9) // 2])
    model.set_metadata(first[:30], [None] * 30)  # metadata cleared: only $ne / $nin / $exists false
    for clause in again + [{"user_id": {"$ne": "u0"}}]:
        model.check(queries, 8, clause)
    model.delete(first[30 : n // 2])
    model.engine.compact()
    for clause in again:
        model.check(queries, 8, clause)


@pytest.mark.parametrize("make", [
    pytest.param(numpy_engine, id="numpy"),
    pytest.param(torch_cpu_engine, id="torch-cpu", marks=needs_torch),
])
def test_one_matching_row_of_65536_and_none(make, rng):
    dim, n = 8, 65536
    engine = make(dim)
    vecs = as_unit_rows(rng.standard_normal((n, dim)))
    ids = np.arange(1, n + 1, dtype=np.int64)
    needle = int(rng.integers(n))
    metas = [{"user_id": "crowd"}] * n
    metas[needle] = {"user_id": "needle"}
    engine.add(ids, vecs, np.zeros(n, np.int32), np.zeros(n), metas)
    queries = as_unit_rows(rng.standard_normal((2, dim)))
    got_ids, got_scores = engine.search(queries, 8, Filter(where=compile_where({"user_id": "needle"})))
    assert got_ids[:, 0].tolist() == [needle + 1] * 2 and (got_ids[:, 1:] == -1).all()
    assert np.isneginf(got_scores[:, 1:]).all()
    expect = (queries.astype(np.float64) @ vecs[needle].astype(np.float64))
    assert np.allclose(got_scores[:, 0], expect, atol=1e-5)
    got_ids, got_scores = engine.search(queries, 8, Filter(where=compile_where({"user_id": "nobody"})))
    assert (got_ids == -1).all() and np.isneginf(got_scores).all()


@pytest.mark.parametrize("cache_bytes", [0, 64 << 20])
def test_numpy_row_list_for_selective_masks(rng, monkeypatch, cache_bytes):
    """A mask passing few rows is scanned as a row list (gathered or not); a denser one with
    the bias; both the same top-k, for single queries and batches, k above and below the count."""
    import kalos.engine.numpy_engine as numpy_engine

    monkeypatch.setattr(numpy_engine, "_ROW_LIST_CACHE_BYTES", cache_bytes)
    dim = 12
    model = Model(NumpyEngine(dim), rng, dim)
    model.add(2000)
    for clause in ({"user_id": "u9"}, {"user_id": {"$in": ["u7", "u8", "u9"]}}, {"user_id": "u0"}):
        for nq in (1, 4):
            queries = as_unit_rows(rng.standard_normal((nq, dim)))
            for k in (1, 8, 300):
                model.check(queries, k, clause)


@needs_interpreter
def test_triton_search_paths_take_the_where_mask(rng):
    """search_start (a batch), search_into (fast precision too) and search_attached on the kernels."""
    dim, n, k = 16, 150, 5
    for precision in ("exact", "fast"):
        eng = triton_engine(dim, precision=precision)
        model = Model(eng, rng, dim)
        model.add(n)
        where = compile_where({"user_id": {"$in": ["u1", "u2"]}})
        ids = np.array(sorted(model.vec), dtype=np.int64)
        vectors = np.stack([model.vec[i] for i in ids.tolist()])
        eligible = np.array([where.matches(model.meta[i]) for i in ids.tolist()])
        if precision == "exact":  # (a batched pass costs seconds under the interpreter: one)
            batch = as_unit_rows(rng.standard_normal((2, dim)))
            got = eng.search_start(batch, k, Filter(where=where))()
            assert_topk_matches(*got, ids, vectors, batch, k, eligible, context="search_start")
        queries = as_unit_rows(rng.standard_normal((1, dim)))
        out_i = torch.full((len(queries), k), -9, dtype=torch.int64)
        out_s = torch.zeros((len(queries), k), dtype=torch.float32)
        eng.search_into(queries, k, Filter(where=where), out_ids=out_i, out_scores=out_s)
        assert_topk_matches(out_i.numpy(), out_s.numpy(), ids, vectors, queries, k, eligible, context="search_into")
        buf = np.zeros(4096, np.float32)
        buf[: queries.size] = queries.reshape(-1)
        eng.attach_host(memoryview(buf).cast("B"))
        try:
            nq = len(queries)
            query_at = np.array([0, dim])[:nq]
            ids_at = np.array([512, 512 + k])[:nq]  # int64 elements: bytes 4096.. of the buffer
            scores_at = np.array([3000, 3000 + k])[:nq]
            eng.search_attached(query_at, None, ids_at, scores_at, k, Filter(where=where))
            got_ids = buf.view(np.int64)[ids_at[:, None] + np.arange(k)]
            got_scores = buf[scores_at[:, None] + np.arange(k)]
            assert_topk_matches(got_ids, got_scores, ids, vectors, queries, k, eligible, context="search_attached")
        finally:
            eng.detach_host()


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_cuda_where_passes_replay_their_graphs_and_follow_writes(rng, precision):
    """On a GPU a where-filtered pass is captured once and replayed (its mask in one buffer that
    each new mask rewrites): answers stay exact through writes that change the mask."""
    dim = 64
    eng = te.TorchEngine(dim, device="cuda", precision=precision, capacity=4096)
    model = Model(eng, rng, dim)
    model.add(3000)
    queries = as_unit_rows(rng.standard_normal((1, dim)))
    clauses = [{"user_id": "u0"}, {"user_id": "u9"}, {"serial": 1500}, {"user_id": "nobody"}]
    for clause in clauses:
        model.check(queries, 8, clause)
    captured = eng.stats["graph_captures"]
    for _ in range(3):
        for clause in clauses:  # the same passes again: replays, not captures
            model.check(queries, 8, clause)
    assert eng.stats["graph_captures"] == captured
    model.set_metadata(np.arange(1, 40), [{"user_id": "u9"}] * 39)
    model.delete(np.arange(40, 80))
    for clause in clauses:
        model.check(queries, 8, clause)
        model.check(as_unit_rows(rng.standard_normal((4, dim))), 8, clause)


def test_add_rejects_metadata_of_the_wrong_length(rng):
    eng = NumpyEngine(4)
    with pytest.raises(InvalidArgument, match="2 metadata entries for 3 rows"):
        eng.add(np.arange(3), as_unit_rows(rng.standard_normal((3, 4))), 0, 0.0, [{}, {}])
    assert len(eng) == 0


# -- through a sidecar --------------------------------------------------------------------------

from conftest import DEADLINE_S, run_guarded, short_tempdir, unique_name  # noqa: E402

from kalos import AsyncClient, Client, UnknownFilter  # noqa: E402
from kalos.errors import ErrorCode  # noqa: E402
from kalos.ipc.control import array_blob  # noqa: E402
from kalos.ipc.protocol import RequestFlag  # noqa: E402
from kalos.server.sidecar import Sidecar, SidecarConfig  # noqa: E402

SIDECAR_DIM = 16


class Served:
    """A sidecar's memories as the reference sees them: id -> (vector, namespace, metadata)."""

    def __init__(self, client: Client, rng: np.random.Generator) -> None:
        self.client, self.rng = client, rng
        self.rows: dict[int, tuple[np.ndarray, str, dict | None]] = {}

    def add(self, metas: list[dict | None], namespace: str = "default", keys: list[str] | None = None) -> np.ndarray:
        vectors = self.rng.standard_normal((len(metas), SIDECAR_DIM)).astype(np.float32)
        ids = self.client.add(vectors, metadata=metas, namespace=namespace, keys=keys)
        for i, v, m in zip(ids.tolist(), vectors, metas):
            self.rows[i] = (v.astype(np.float64), namespace, m)
        return ids

    def delete(self, ids: list[int]) -> None:
        assert self.client.delete(ids=ids) == len(ids)
        for i in ids:
            del self.rows[i]

    def check(self, clause: dict | None, namespace: str | None = "default", k: int = 8, many: bool = False) -> int:
        where = None if clause is None else compile_where(clause)
        ids = np.array(sorted(self.rows), dtype=np.int64)
        vectors = np.stack([self.rows[i][0] for i in ids.tolist()])
        eligible = np.array([(namespace is None or self.rows[i][1] == namespace)
                             and (where is None or where.matches(self.rows[i][2])) for i in ids.tolist()])
        context = f"where={clause} namespace={namespace}"
        if many:
            queries = self.rng.standard_normal((3, SIDECAR_DIM)).astype(np.float32)
            got = self.client.recall_many(queries, k=k, namespace=namespace, where=clause)
            assert_topk_matches(got.ids, got.scores, ids, vectors, queries, k, eligible, context=context)
        else:
            query = self.rng.standard_normal(SIDECAR_DIM).astype(np.float32)
            hits = self.client.recall(query, k=k, namespace=namespace, where=clause)
            assert_topk_matches(hits.ids, hits.scores, ids, vectors, query[None], k, eligible, padded=False,
                                context=context)
        return int(eligible.sum())


@pytest.fixture
def served(sidecars, store_dir, rng):
    name = unique_name("wh")
    sidecars.start(store_dir / "w.db", name=name, dim=SIDECAR_DIM)
    with Client(name, timeout=DEADLINE_S) as client:
        yield Served(client, rng)


def test_recall_where_through_the_sidecar_with_writes_between(served, seed, rng):
    metas = random_metadata(rng, 600)
    first = served.add(metas[:500])
    served.add(metas[500:], namespace="other")
    clause_rng = random.Random(seed)
    clauses = selective_clauses(metas[:500], rng) + [random_clause(clause_rng) for _ in range(8)]
    counts = [served.check(c) for c in clauses]
    assert counts[2] == 1 and counts[3] == 0
    for c in clauses[:4]:
        served.check(c, many=True)
        served.check(c, namespace=None)
        served.check(c, namespace="never-used")  # a namespace that holds nothing: no hits
    served.check({}, namespace="other")  # {} is no filter

    probe = {"user_id": "fresh"}
    assert served.check(probe) == 0
    added = served.add([{"user_id": "fresh", "year": 2024}])  # a matching row: seen at once
    assert served.check(probe) == 1
    served.delete(added.tolist())
    assert served.check(probe) == 0
    keyed = served.add([{"user_id": "keyed"}], keys=["k1"])
    assert served.check({"user_id": "keyed"}) == 1
    again = served.add([{"user_id": "fresh"}], keys=["k1"])  # an upsert that changes the metadata
    assert again.tolist() == keyed.tolist()
    assert served.check({"user_id": "keyed"}) == 0 and served.check(probe) == 1
    if hasattr(served.client, "update"):
        target = int(first[0])
        served.client.update(target, metadata={"user_id": "updated"})
        vector, namespace, _ = served.rows[target]
        served.rows[target] = (vector, namespace, {"user_id": "updated"})
        assert served.check({"user_id": "updated"}) == 1
        served.client.update(target, metadata={"extra": 1}, merge=True)
        served.rows[target] = (vector, namespace, {"user_id": "updated", "extra": 1})
        assert served.check({"extra": 1, "user_id": "updated"}) == 1
        new_vector = rng.standard_normal(SIDECAR_DIM).astype(np.float32)
        served.client.update(target, vector=new_vector)  # the row swapped: its metadata stays indexed
        served.rows[target] = (new_vector.astype(np.float64), namespace, {"user_id": "updated", "extra": 1})
        assert served.check({"extra": 1}) == 1
    for c in clauses[:4]:
        served.check(c)


def test_bad_where_changes_nothing(served, rng):
    served.add(random_metadata(rng, 20))
    client = served.client
    before = client.stats()["count"]
    q = rng.standard_normal(SIDECAR_DIM).astype(np.float32)
    for bad, message in [
        ({"user_id": {"$regex": "a"}}, "unknown operator '$regex' at user_id"),
        ({"user_id": object()}, "must be a string, number or boolean"),
        (["user_id"], "where must be a dict"),
        ("user_id", "where must be a dict"),
    ]:
        for call in (lambda: client.recall(q, where=bad), lambda: client.recall_many(q[None], where=bad)):
            with pytest.raises(InvalidArgument, match=message.replace("$", r"\$").replace("(", r"\(")):
                call()
    # The sidecar checks the clause again (a client of another language, or a hand-made frame).
    for text in ('{"a": {"$regex": 1}}', "not json", '["a"]', '{"a": NaN}'):
        with pytest.raises(InvalidArgument):
            client._control({"op": "where", "where": text})
    with pytest.raises(InvalidArgument, match="JSON text"):
        client._control({"op": "where", "where": {"a": 1}})
    assert client.stats()["count"] == before
    served.check({"flag": True})  # still serving


def test_async_client_recall_where(served, rng):
    served.add(random_metadata(rng, 200))
    ids = np.array(sorted(served.rows), dtype=np.int64)
    vectors = np.stack([served.rows[i][0] for i in ids.tolist()])
    clause = {"user_id": {"$in": ["u1", "u2"]}, "year": {"$gte": 2010}}
    where = compile_where(clause)
    eligible = np.array([where.matches(served.rows[i][2]) for i in ids.tolist()])
    queries = rng.standard_normal((2, SIDECAR_DIM)).astype(np.float32)

    async def main():
        async with AsyncClient(served.client.name, timeout=DEADLINE_S) as aclient:
            one = await aclient.recall(queries[0], k=6, where=clause)
            many = await aclient.recall_many(queries, k=6, where=clause)
            again = await aclient.recall(queries[1], k=6, where=clause)  # the handle cached
            return one, many, again

    import asyncio

    one, many, again = asyncio.run(main())
    assert_topk_matches(one.ids, one.scores, ids, vectors, queries[:1], 6, eligible, padded=False)
    assert_topk_matches(many.ids, many.scores, ids, vectors, queries, 6, eligible)
    assert_topk_matches(again.ids, again.scores, ids, vectors, queries[1:], 6, eligible, padded=False)


def test_the_sweep_groups_single_recalls_by_where_and_refuses_unknown_handles(runtime_dir, rng):
    """Several single recalls in one pass (the columns' path): every (where, namespace) group
    gets its own filtered answer; a handle never registered, and an evicted one, are refused
    with UNKNOWN_FILTER, the others still answered."""
    directory = short_tempdir("wsw")
    name = unique_name("wsw")
    sidecar = Sidecar(SidecarConfig(store=os.path.join(directory, "s.db"), name=name, dim=SIDECAR_DIM,
                                    device="cpu", slots=8))
    try:
        n = 400
        vectors = as_unit_rows(rng.standard_normal((n, SIDECAR_DIM)))
        metas = random_metadata(rng, n)
        namespaces = ["a" if i % 2 else "b" for i in range(n)]
        ids = {}
        for ns in ("a", "b"):
            rows = [i for i in range(n) if namespaces[i] == ns]
            spec, blob = array_blob(vectors[rows], "float32")
            reply, out = sidecar._control._op_add({"vectors": spec, "namespace": ns, "metadata": [metas[i] for i in rows]},
                                         bytearray(blob))
            ids.update(zip(np.frombuffer(out, np.int64).tolist(), rows))
        clauses = [{"user_id": "u0"}, {"year": {"$lt": 2010}}, {"serial": 7}]
        handles = [sidecar._control._op_where({"where": json.dumps(c)}, bytearray())[0]["handle"] for c in clauses]
        assert sidecar._control._op_where({"where": json.dumps(clauses[0])}, bytearray())[0]["handle"] == handles[0]
        # (where index, namespace): None = no where / every namespace; "bogus" = an unknown handle.
        requests = [(0, "a"), (0, "b"), (1, None), (1, "a"), (None, "a"), (None, None), (2, None), ("bogus", "b")]
        channel = sidecar.channel
        queries = as_unit_rows(rng.standard_normal((len(requests), SIDECAR_DIM)))
        k = 5
        for slot, (w, ns) in enumerate(requests):
            view = channel.slots[slot]
            view.op[0], view.k[0], view.n_queries[0] = 1, k, 1
            flags = int(RequestFlag.ALL_NAMESPACES) if ns is None else 0
            if w is not None:
                flags |= int(RequestFlag.HAS_WHERE)
                view.where_handle[0] = 12345 if w == "bogus" else handles[w]
            view.flags[0] = flags
            encoded = (ns or "").encode()
            view.namespace[0], view.namespace_len[0] = encoded, len(encoded)
            view.queries[0] = queries[slot]
        slots = np.arange(len(requests))
        sidecar._recall_loop._answer(slots, np.ones(len(requests), np.uint64))
        all_ids = np.array(sorted(ids), dtype=np.int64)
        all_vectors = vectors[[ids[i] for i in all_ids.tolist()]]
        for slot, (w, ns) in enumerate(requests):
            view = channel.slots[slot]
            if w == "bogus":
                assert int(view.status[0]) == ErrorCode.UNKNOWN_FILTER, view.read_message()
                assert "where handle 12345 is not registered" in view.read_message()
                continue
            assert int(view.status[0]) == 0, view.read_message()
            where = None if w is None else compile_where(clauses[w])
            eligible = np.array([(ns is None or namespaces[ids[i]] == ns)
                                 and (where is None or where.matches(metas[ids[i]])) for i in all_ids.tolist()])
            assert_topk_matches(view.ids[:1, :k], view.scores[:1, :k], all_ids, all_vectors, queries[slot : slot + 1],
                                k, eligible, context=f"slot {slot}: where {w} namespace {ns}")
        # The rows a where selects, for count / scoped delete: the same index.
        got = sidecar._control._rows_where("a", compile_where(clauses[0]))
        want = sorted(i for i in ids if namespaces[ids[i]] == "a" and compile_where(clauses[0]).matches(metas[ids[i]]))
        assert got.tolist() == want
        assert sidecar._control._rows_where("never-used", None).tolist() == []
        assert len(sidecar._control._rows_where(None, None)) == n
        # An evicted handle is refused, never read as another clause.
        import kalos.server.filters as filters

        old = handles[0]
        for j in range(filters._MAX_WHERE_HANDLES + 1):
            sidecar._control._op_where({"where": json.dumps({"filler": j})}, bytearray())
        with pytest.raises(UnknownFilter):
            sidecar._filter_cache.filter_for(int(RequestFlag.HAS_WHERE | RequestFlag.ALL_NAMESPACES), b"", None, None, old + 10**9)
        assert old not in sidecar._filter_cache.wheres
    finally:
        sidecar.close()


def test_cli_recall_where(sidecars, store_dir, rng):
    name = unique_name("whcli")
    sidecars.start(store_dir / "c.db", name=name, dim=4)
    with Client(name, timeout=DEADLINE_S) as client:
        ids = client.add(as_unit_rows(rng.standard_normal((3, 4))), texts=["x", "y", "z"],
                         metadata=[{"user_id": "alice"}, {"user_id": "bob"}, None])
    query = ",".join(str(v) for v in rng.standard_normal(4).tolist())
    out = run_guarded([sys.executable, "-m", "kalos", "recall", "--name", name, "--vector", query, "-k", "3",
                       "--where", '{"user_id": "bob"}', "--json"])
    assert out.returncode == 0, out.stderr
    hits = json.loads(out.stdout)
    assert [h["id"] for h in hits] == [int(ids[1])]
    bad = run_guarded([sys.executable, "-m", "kalos", "recall", "--name", name, "--vector", query,
                       "--where", '{"user_id": {"$regex": "b"}}'])
    assert bad.returncode != 0 and "unknown operator '$regex' at user_id" in bad.stderr
    bad = run_guarded([sys.executable, "-m", "kalos", "recall", "--name", name, "--vector", query,
                       "--where", "{user_id: bob}"])
    assert bad.returncode != 0 and "not valid JSON" in bad.stderr


# -- a shared PostgreSQL store: the index loaded at start, followers applying metadata ------------


def _pg_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("psycopg") is None:
        return False
    from pg_server import find_bin_dir

    return find_bin_dir() is not None


@pytest.fixture(scope="module")
def pg_url():
    if not _pg_available():
        pytest.skip("needs psycopg and PostgreSQL's server binaries (initdb, pg_ctl)")
    from pg_server import PgServer

    try:
        server = PgServer().init().start()
    except KeyError:
        pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
    try:
        yield server.url(server.create_database())
    finally:
        server.destroy()


def test_where_on_a_postgres_store_loads_and_follows_metadata(pg_url, sidecars, rng):
    from conftest import wait_until

    from kalos.store.postgres import PostgresStore

    dim = 8
    rows: dict[int, tuple[np.ndarray, dict | None]] = {}
    with PostgresStore.open(pg_url, dim=dim) as store:
        vectors = as_unit_rows(rng.standard_normal((60, dim)))
        metas = [{"user_id": f"u{i % 3}", "n": i} if i % 10 else None for i in range(60)]
        ids, _, _ = store.add(vectors, namespace="default", metadata=metas)
        rows.update(zip(ids.tolist(), zip(vectors.astype(np.float64), metas)))
    name_a, name_b = unique_name("pga"), unique_name("pgb")
    sidecars.start(pg_url, name=name_a)
    sidecars.start(pg_url, name=name_b)
    query = rng.standard_normal(dim).astype(np.float32)

    def answer(client: Client, clause: dict) -> list[int]:
        return sorted(client.recall(query, k=50, where=clause).ids.tolist())

    def expected(clause: dict) -> list[int]:
        where = compile_where(clause)
        return sorted(i for i, (_, m) in rows.items() if where.matches(m))

    with Client(name_a, timeout=DEADLINE_S) as a, Client(name_b, timeout=DEADLINE_S) as b:
        for clause in ({"user_id": "u1"}, {"n": {"$gte": 30}}, {"user_id": {"$exists": False}}):
            assert answer(a, clause) == expected(clause)  # indexed when the sidecars loaded
            assert answer(b, clause) == expected(clause)
        new = as_unit_rows(rng.standard_normal((3, dim)))
        added = a.add(new, metadata=[{"user_id": "late"}] * 3)
        rows.update(zip(added.tolist(), zip(new.astype(np.float64), [{"user_id": "late"}] * 3)))
        wait_until(lambda: answer(b, {"user_id": "late"}) == sorted(added.tolist()), "B to index A's adds")
        if hasattr(a, "update"):
            a.update(int(added[0]), metadata={"user_id": "moved"})
            wait_until(lambda: answer(b, {"user_id": "moved"}) == [int(added[0])], "B to index A's update")
            assert answer(b, {"user_id": "late"}) == sorted(added[1:].tolist())


def test_a_crowd_of_one_kind_of_recall_is_answered_as_one_group_and_odd_slots_fall_back(runtime_dir, rng):
    """The sweep's shortcut for a crowd whose slots all hold the same kind of single recall
    (RecallLoop._answer_uniform): it answers them as one group when op, k, flags, where handle
    and namespace agree, and leaves any pass where one slot differs (or a length word disagrees
    with its bytes) to the general path; every answer matches the float64 reference either way."""
    directory = short_tempdir("wsu")
    sidecar = Sidecar(SidecarConfig(store=os.path.join(directory, "s.db"), name=unique_name("wsu"), dim=SIDECAR_DIM,
                                    device="cpu", slots=8))
    try:
        n = 300
        vectors = as_unit_rows(rng.standard_normal((n, SIDECAR_DIM)))
        metas = random_metadata(rng, n)
        namespaces = ["a" if i % 3 else "b" for i in range(n)]
        ids = {}
        for ns in ("a", "b"):
            rows = [i for i in range(n) if namespaces[i] == ns]
            spec, blob = array_blob(vectors[rows], "float32")
            _reply, out = sidecar._control._op_add(
                {"vectors": spec, "namespace": ns, "metadata": [metas[i] for i in rows]}, bytearray(blob))
            ids.update(zip(np.frombuffer(out, np.int64).tolist(), rows))
        clause = {"year": {"$lt": 2010}}
        handle = sidecar._control._op_where({"where": json.dumps(clause)}, bytearray())[0]["handle"]
        loop, channel = sidecar._recall_loop, sidecar.channel
        mixed_passes = []
        general = loop._answer_mixed
        loop._answer_mixed = lambda slots, deferred: mixed_passes.append(len(slots)) or general(slots, deferred)
        all_ids = np.array(sorted(ids), dtype=np.int64)
        all_vectors = vectors[[ids[i] for i in all_ids.tolist()]]
        n_slots = sidecar.layout.n_slots

        def answer(requests: list[dict]) -> list:
            """Writes one single recall per slot (namespace None: every namespace), runs one pass."""
            queries = as_unit_rows(rng.standard_normal((len(requests), SIDECAR_DIM)))
            for slot, request in enumerate(requests):
                view = channel.slots[slot]
                ns = request.get("namespace", "a")
                flags = int(RequestFlag.ALL_NAMESPACES) if ns is None else 0
                if request.get("where") is not None:
                    flags |= int(RequestFlag.HAS_WHERE)
                    view.where_handle[0] = request["where"]
                view.op[0], view.k[0], view.n_queries[0], view.flags[0] = 1, request.get("k", 5), 1, flags
                raw = request.get("raw", (ns or "").encode())
                view.namespace[0], view.namespace_len[0] = raw, request.get("length", len((ns or "").encode()))
                view.queries[0] = queries[slot]
            loop._answer(np.arange(len(requests)), np.ones(len(requests), np.uint64))
            return [(channel.slots[s], queries[s : s + 1]) for s in range(len(requests))]

        def check(requests: list[dict], results: list) -> None:
            for slot, (request, (view, query)) in enumerate(zip(requests, results)):
                assert int(view.status[0]) == 0, (slot, view.read_message())
                k, ns, w = request.get("k", 5), request.get("namespace", "a"), request.get("where")
                where = None if w is None else compile_where(clause)
                eligible = np.array([(ns is None or namespaces[ids[i]] == ns) and (where is None or where.matches(metas[ids[i]]))
                                     for i in all_ids.tolist()])
                assert int(view.n_results[0]) == k
                assert_topk_matches(view.ids[:1, :k], view.scores[:1, :k], all_ids, all_vectors, query, k, eligible,
                                    context=f"slot {slot}: {request}")

        for uniform in ({}, {"namespace": "b", "k": 7}, {"namespace": None}, {"where": handle},
                        {"namespace": None, "where": handle}):
            requests = [dict(uniform) for _ in range(n_slots)]
            check(requests, answer(requests))
            assert not mixed_passes, f"{uniform}: a crowd of one kind took the general path"
        # One slot apart (its k, its namespace, a tail of bytes past its length word, a length
        # word that disagrees with the bytes of every slot): the general path, still right.
        for odd in ({"k": 3}, {"namespace": "b"}, {"raw": b"a\0tail", "length": 1}, {"namespace": None}):
            requests = [{} for _ in range(n_slots - 1)] + [odd]
            check(requests, answer(requests))
            assert mixed_passes.pop() == n_slots, odd
        requests = [{"raw": b"a\0tail", "length": 1} for _ in range(n_slots)]
        check(requests, answer(requests))
        assert mixed_passes.pop() == n_slots
        # A namespace nothing was added to: every answer k padding rows, no search.
        for view, _query in answer([{"namespace": "never-used"} for _ in range(n_slots)]):
            assert int(view.status[0]) == 0 and int(view.n_results[0]) == 5
            assert view.ids[0, :5].tolist() == [-1] * 5 and np.isneginf(view.scores[0, :5]).all()
        # An unknown where handle, or a k out of range, in every slot: each slot gets the error.
        for bad, code in (({"where": 12345}, ErrorCode.UNKNOWN_FILTER), ({"k": 0}, ErrorCode.INVALID_QUERY)):
            for view, _query in answer([dict(bad) for _ in range(n_slots)]):
                assert int(view.status[0]) == code, view.read_message()
        assert not mixed_passes or mixed_passes == [n_slots]  # (k=0 is not a single recall: the general path)
    finally:
        sidecar.close()
