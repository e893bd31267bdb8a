"""The GPU engine (kalos.engine.gpu) against a float64 brute force and NumpyEngine.

Runs without a GPU: the engine on PyTorch's CPU device with the plain torch backend, and the
Triton kernels themselves under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton is first imported; the interpreter is slow, so those tests use a few hundred rows).
Tests marked ``cuda`` need a real GPU and are skipped without one. Every test that draws
random data prints its seed (set KALOS_TEST_SEED to replay one).
"""
from __future__ import annotations

import dataclasses

import math
import mmap
import os
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

HAVE_CUDA = torch.cuda.is_available()
if not HAVE_CUDA and "triton" not in sys.modules:
    from conftest import import_interpreted

    import_interpreted("kalos.engine.gpu.kernels")

from kalos.engine import Filter, NumpyEngine  # noqa: E402
from kalos.engine.base import as_unit_rows  # noqa: E402
from kalos.engine.gpu import (  # noqa: E402
    MAX_K,
    ScanConfig,
    TorchEngine,
    fast_error_terms,
    int8_error_terms,
    register_host_buffer,
)
from kalos.engine.gpu.bounds import quantize_rows  # noqa: E402
from kalos.engine.gpu.engine import load_kernels  # noqa: E402
from kalos.engine.gpu.layout import HDR_WORDS, HEADER, HEADER_DTYPE, check_kernel_layout, kernel_constants  # noqa: E402
from kalos.engine.gpu.planner import DEFAULT_TUNING, SPLIT_MAX_CANDIDATES, fast_candidates, next_pow2  # noqa: E402
from kalos.errors import InvalidArgument, InvalidQuery  # noqa: E402
from kalos.validation import normalise_rows, row_scales  # noqa: E402

HAVE_INTERPRETER = not HAVE_CUDA and load_kernels(require_interpreter=True) is not None


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """Triton's interpreter also reads TRITON_INTERPRET while it runs: set it per test only."""
    if HAVE_INTERPRETER:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
needs_interpreter = pytest.mark.skipif(
    not HAVE_INTERPRETER, reason="needs triton with TRITON_INTERPRET=1 set before triton's first import"
)
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("KALOS_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{request.node.name}: seed {seed}")
    return np.random.default_rng(seed)


# -- helpers ----------------------------------------------------------------------------------


class Mirror:
    """The same rows in a TorchEngine, a NumpyEngine and a float64 copy for brute force."""

    def __init__(self, engine: TorchEngine, rng: np.random.Generator) -> None:
        self.engine = engine
        self.numpy = NumpyEngine(engine.dim, capacity=4)
        self.rng = rng
        self.vec: dict[int, np.ndarray] = {}
        self.ns: dict[int, int] = {}
        self.ts: dict[int, float] = {}
        self.next_id = 1000

    def add(self, n: int, vectors: np.ndarray | None = None) -> np.ndarray:
        d = self.engine.dim
        v = as_unit_rows(self.rng.standard_normal((n, d)) if vectors is None else vectors)
        ids = self.next_id + 7 * np.arange(n, dtype=np.int64)  # ids far from row numbers
        self.next_id += 7 * n
        ns = self.rng.integers(0, 3, n).astype(np.int32)
        ts = self.rng.uniform(0, 100, n)
        for e in (self.engine, self.numpy):
            e.add(ids, v, ns, ts)
        for i, row, a, b in zip(ids.tolist(), v, ns.tolist(), ts.tolist()):
            self.vec[i], self.ns[i], self.ts[i] = row, a, b
        return ids

    def delete(self, ids) -> None:
        for e in (self.engine, self.numpy):
            e.delete(np.asarray(ids))
        for i in np.asarray(ids).tolist():
            self.vec.pop(i, None)

    def reference(self, queries: np.ndarray, flt: Filter):
        """float64 brute force: per query, (ids, scores) of every eligible row, best first."""
        ids = np.array(
            [
                i
                for i in self.vec
                if (flt.namespace is None or self.ns[i] == flt.namespace)
                and (flt.since is None or self.ts[i] >= flt.since)
                and (flt.until is None or self.ts[i] < flt.until)
            ],
            dtype=np.int64,
        )
        if len(ids) == 0:
            return [(np.empty(0, np.int64), np.empty(0))] * len(queries)
        mat = np.stack([self.vec[i] for i in ids]).astype(np.float64)
        s = queries.astype(np.float64) @ mat.T
        out = []
        for row in s:
            order = np.argsort(-row, kind="stable")
            out.append((ids[order], row[order]))
        return out

    def check(self, queries: np.ndarray, k: int, flt: Filter = Filter(), *, same_as_numpy=True, precision=None):
        if precision is None:
            got_ids, got_sc = self.engine.search(queries, k, flt)
        else:
            got_ids = torch.full((len(queries), k), -99, dtype=torch.int64)
            got_sc = torch.full((len(queries), k), float("nan"))
            self.engine.search_into(queries, k, flt, out_ids=got_ids, out_scores=got_sc, precision=precision)
            got_ids, got_sc = got_ids.numpy(), got_sc.numpy()
        assert got_ids.shape == (len(queries), k) and got_sc.shape == (len(queries), k)
        assert got_ids.dtype == np.int64 and got_sc.dtype == np.float32
        for qi, (ref_ids, ref_sc) in enumerate(self.reference(queries, flt)):
            assert_topk(got_ids[qi], got_sc[qi], ref_ids, ref_sc, k)
        if same_as_numpy:
            np_ids, np_sc = self.numpy.search(queries, k, flt)
            for qi in range(len(queries)):
                if not np.array_equal(np_ids[qi], got_ids[qi]):  # only ties may be ordered otherwise
                    assert np.allclose(np_sc[qi], got_sc[qi], rtol=0, atol=1e-6), (np_ids[qi], got_ids[qi])
        return got_ids, got_sc


def assert_topk(got_ids, got_sc, ref_ids, ref_sc, k, tie=2e-6) -> None:
    """``got`` is a top-k of the eligible rows ``ref`` (all of them, float64, best first):
    the same rows up to ties with the k-th score, scores within 1e-5, padding -1 / -inf."""
    m = min(k, len(ref_ids))
    assert (got_ids[m:] == -1).all() and np.isneginf(got_sc[m:]).all(), "padding must be -1 / -inf"
    gi, gs = got_ids[:m], got_sc[:m].astype(np.float64)
    assert (gi >= 0).all(), f"expected {m} results, got {gi}"
    assert len(set(gi.tolist())) == m, "duplicate ids"
    assert (np.diff(gs) <= 1e-6).all(), "scores must be best first"
    if m == 0:
        return
    ref_map = dict(zip(ref_ids.tolist(), ref_sc.tolist()))
    kth = ref_sc[m - 1]
    for i, s in zip(gi.tolist(), gs.tolist()):
        assert i in ref_map, f"id {i} is not an eligible row"
        assert abs(s - ref_map[i]) < 1e-5, f"score of id {i}: {s} vs float64 {ref_map[i]}"
        assert ref_map[i] >= kth - tie, f"id {i} (score {ref_map[i]}) is not in the top {k}; k-th is {kth}"
    for i in set(ref_ids[:m].tolist()) - set(gi.tolist()):
        assert abs(ref_map[i] - kth) <= tie, f"id {i} (score {ref_map[i]}) missing; k-th is {kth}"


def unit_queries(rng, q: int, d: int) -> np.ndarray:
    return as_unit_rows(rng.standard_normal((q, d)))


def torch_engine(dim, **kw) -> TorchEngine:
    kw.setdefault("device", "cpu")
    kw.setdefault("backend", "torch")
    return TorchEngine(dim, **kw)


FILTERS = [Filter(), Filter(namespace=1), Filter(since=20.0, until=70.0), Filter(namespace=2, since=50.0)]


# -- the plain torch backend on the CPU device --------------------------------------------------


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dim", [8, 384, 768, 1024])
def test_matches_reference_and_numpy(rng, precision, dim):
    m = Mirror(torch_engine(dim, precision=precision, capacity=16), rng)
    ids = m.add(1500)
    m.delete(rng.choice(ids, 200, replace=False))
    q = unit_queries(rng, 4, dim)
    for flt in FILTERS:
        for k in (1, 10, 256):
            m.check(q, k, flt)


def test_dim_4096_and_k_256(rng):
    for precision in ("exact", "fast"):
        m = Mirror(torch_engine(4096, precision=precision), rng)
        m.add(400)
        m.check(unit_queries(rng, 3, 4096), 256, Filter(namespace=0))
        m.check(unit_queries(rng, 2, 4096), 7)


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_growth_deletes_and_compaction(rng, precision):
    eng = torch_engine(32, precision=precision, capacity=4)
    m = Mirror(eng, rng)
    q = unit_queries(rng, 3, 32)
    batches = [m.add(n) for n in (1, 3, 60, 700, 2000)]
    assert eng.capacity >= 2764
    m.check(q, 12)
    everything = np.concatenate(batches)
    m.delete(everything[:1400])  # > 1024 and > 25%: compacts inside delete
    assert eng.tombstones == 0 and len(eng) == 2764 - 1400
    m.check(q, 12, Filter(namespace=2))
    m.delete(everything[1400:1500])  # tombstones only
    assert eng.tombstones == 100
    m.check(q, 12)
    eng.compact()
    assert eng.tombstones == 0
    m.add(50)
    m.check(q, 12)
    m.check(q, 40, Filter(since=10.0, until=60.0))


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_k_larger_than_live_and_empty(rng, precision):
    eng = torch_engine(16, precision=precision)
    q = unit_queries(rng, 2, 16)
    ids, sc = eng.search(q, 5)
    assert (ids == -1).all() and np.isneginf(sc).all()
    m = Mirror(eng, rng)
    added = m.add(6)
    m.delete(added[:4])
    got, _ = m.check(q, 10)
    assert (got[:, 2:] == -1).all()
    m.check(q, 3, Filter(namespace=7))  # nothing passes: all padding


def test_fast_mode_falls_back_on_near_duplicates(rng):
    """A cluster of rows closer together than the 16-bit error: the certificate fails."""
    d = 64
    eng = torch_engine(d, precision="fast")
    m = Mirror(eng, rng)
    m.add(500)
    base = rng.standard_normal(d)
    m.add(100, base + 1e-5 * rng.standard_normal((100, d)))
    q = as_unit_rows(base[None, :] + 1e-4 * rng.standard_normal((2, d)))
    m.check(q, 5, same_as_numpy=False)  # near-ties: NumpyEngine's order may differ
    assert eng.stats["fallbacks"] >= 1


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("dim", [3, 384, 1024, 4096])
def test_error_bound_holds(rng, half, dim):
    """|score(16-bit copies, float32 sums) - score(float64)| <= E, also with tiny components."""
    a, b, c = fast_error_terms(dim, half)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[half]
    x = rng.standard_normal((400, dim))
    x[:100] *= np.exp(rng.uniform(-30, 0, (100, dim)))  # many subnormal float16 components
    x = as_unit_rows(x)
    q = as_unit_rows(rng.standard_normal((8, dim)))
    s16 = torch.from_numpy(q).to(dt).float() @ torch.from_numpy(x).to(dt).float().T
    s64 = q.astype(np.float64) @ x.astype(np.float64).T
    xn = np.linalg.norm(x.astype(np.float64), axis=1).max()
    qn = np.linalg.norm(q.astype(np.float64), axis=1)[:, None]
    bound = a * xn * qn + b * (xn + qn) + c
    assert (np.abs(s16.double().numpy() - s64) <= bound).all()


def test_search_into_host_tensors(rng):
    m = Mirror(torch_engine(24, precision="fast"), rng)
    m.add(300)
    q = unit_queries(rng, 3, 24)
    out_i = torch.full((5, 9), -99, dtype=torch.int64)
    out_s = torch.full((5, 9), 7.0)
    m.engine.search_into(torch.from_numpy(q), 4, Filter(namespace=1), out_ids=out_i, out_scores=out_s)
    ref = m.reference(q, Filter(namespace=1))
    for i in range(3):
        assert_topk(out_i[i, :4].numpy(), out_s[i, :4].numpy(), *ref[i], 4)
    assert (out_i[3:] == -99).all() and (out_i[:, 4:] == -99).all() and (out_s[:, 4:] == 7.0).all()
    # exact on a fast engine, numpy queries
    m.check(q, 6, precision="exact")


def test_search_into_rejects_bad_input_without_writing(rng):
    eng = torch_engine(8)
    Mirror(eng, rng).add(20)
    q = torch.from_numpy(unit_queries(rng, 2, 8))
    oi = torch.full((2, 4), -99, dtype=torch.int64)
    os_ = torch.zeros((2, 4))
    bad_calls = [
        dict(queries=q[:, :7], k=4),
        dict(queries=q.double(), k=4),
        dict(queries=q, k=0),
        dict(queries=q, k=MAX_K + 1),
        dict(queries=q, k=5),  # outputs too small
        dict(queries=q, k=4, out_ids=oi.int()),
        dict(queries=q, k=4, precision="sloppy"),
        dict(queries=[[0.0] * 8], k=4),
    ]
    for call in bad_calls:
        kw = dict(out_ids=oi, out_scores=os_)
        kw.update(call)
        with pytest.raises(InvalidArgument):
            eng.search_into(kw.pop("queries"), kw.pop("k"), **kw)
        assert (oi == -99).all() and (os_ == 0).all()


def test_bad_arguments():
    with pytest.raises(InvalidArgument):
        TorchEngine(8, device="cpu", precision="half")
    with pytest.raises(InvalidArgument):
        TorchEngine(8, device="tpu")
    with pytest.raises(InvalidArgument):
        TorchEngine(8, device="cpu", half="float8")
    with pytest.raises(InvalidArgument):
        TorchEngine(0, device="cpu")
    if not HAVE_CUDA:
        with pytest.raises(InvalidArgument):
            TorchEngine(8, device="cuda")
    eng = torch_engine(8)
    with pytest.raises(InvalidQuery):
        eng.search(np.zeros((1, 9), np.float32), 3)
    with pytest.raises(InvalidQuery):
        eng.search(np.zeros((1, 8), np.float32), 0)
    with pytest.raises(InvalidArgument):
        eng.search_into(np.zeros((1, 8), np.float32), 1, out_ids=torch.zeros((1, 1), dtype=torch.int64),
                        out_scores=torch.zeros((1, 1)), precision="fast")  # no 16-bit copy


def test_base_search_hook_with_mask(rng):
    """The Engine._search contract: rows (not ids), masked rows only with score -inf."""
    eng = torch_engine(16)
    m = Mirror(eng, rng)
    m.add(50)
    q = unit_queries(rng, 2, 16)
    mask = np.zeros(50, bool)
    mask[[3, 9, 40]] = True
    rows, sc = eng._search(q, 5, mask)
    assert rows.shape == (2, 5)
    for r, s in zip(rows, sc):
        assert set(r[:3].tolist()) == {3, 9, 40} and np.isfinite(s[:3]).all() and np.isneginf(s[3:]).all()


def test_memory_bytes():
    eng = torch_engine(100, precision="fast", capacity=64)
    assert eng.memory_bytes() >= 64 * 100 * (4 + 2)


def test_register_host_buffer_without_pinning():
    with mmap.mmap(-1, 4096) as mm:
        buf = register_host_buffer(mm, pin=HAVE_CUDA)
        assert buf.pinned == HAVE_CUDA
        view = buf.view(64, torch.float32, (4, 8))
        view[1, 2] = 3.5
        assert np.frombuffer(mm, np.float32, count=1, offset=64 + 4 * 10)[0] == 3.5
        with pytest.raises(InvalidArgument):
            buf.view(4090, torch.float32, (4,))
        buf.unregister()
        buf.unregister()  # idempotent
        del view
    with pytest.raises(InvalidArgument):
        register_host_buffer(bytes(16))


# -- the Triton kernels, under the interpreter -------------------------------------------------


def triton_engine(dim, **kw) -> TorchEngine:
    return TorchEngine(dim, device="cpu", backend="triton", **kw)


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_triton_one_query_and_batch(rng, precision):
    m = Mirror(triton_engine(40, precision=precision, capacity=8), rng)  # 40: not a multiple of the tile
    ids = m.add(260)
    m.delete(ids[::9])
    q = unit_queries(rng, 3, 40)
    m.check(q[:1], 8, Filter(namespace=1, since=10.0, until=90.0))
    m.check(q, 5)
    # A namespace id no row has, -1 included (kalos.server.filters.NOTHING's): no hits, alone or
    # in a batch (the kernels' "all namespaces" is another value, layout.NS_ALL).
    m.check(q[:1], 4, Filter(namespace=-1))
    m.check(q, 4, Filter(namespace=-1))


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_triton_v2_scores_scan_and_tf32_batches(rng, precision):
    """v2: the scan writes scores and a chunked top-k selects; exact batches scan in tf32
    and re-score (certified) in float32. Also across a resize (the v2 grid follows capacity)."""
    eng = triton_engine(40, precision=precision, capacity=8)
    eng.retune({"scores_max_q": 8, "exact_batch_scan": "tf32", "score_chunk": 64})
    assert eng.plan(1, 6).score_chunk and eng.plan(3, 5).score_chunk
    m = Mirror(eng, rng)
    ids = m.add(200)
    m.delete(ids[::7])
    q = unit_queries(rng, 3, 40)
    m.check(q[:1], 6, Filter(namespace=2))
    m.check(q, 5)
    m.add(150)  # grows the capacity: plans and workspaces follow
    m.check(q, 5, Filter(since=30.0))


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_triton_split_final_rescore(rng, precision):
    """The final kernel's certified re-score split over several programs per query
    (final_split_rows): the last program to arrive answers. Batches whose plans keep different
    numbers of candidates run one after another (they share the arrival counts), with a filter
    too; the float64 answer every time, and the counts back at zero after each search. One
    program per query (0) answers the same."""
    eng = triton_engine(40, precision=precision, capacity=8)
    eng.retune({"score_chunk": 64, "final_split_rows": 4})
    assert eng.plan(3, 8).final_split == fast_candidates(8) // 4
    assert eng.plan(3, 16).final_split == fast_candidates(16) // 4
    m = Mirror(eng, rng)
    ids = m.add(300)
    m.delete(ids[::5])
    q = unit_queries(rng, 5, 40)
    for k in (8, 3, 16, 8):
        m.check(q, k)
        assert not eng.pipeline.split_buffers.arrived.any()
    m.check(q[:2], 5, Filter(namespace=1))
    eng.retune({"gemm_min_q": 2})  # the GEMM path: threshold selection, its overflow word checked too
    assert eng.plan(3, 8).gemm_rows and eng.plan(3, 8).final_split > 1
    m.check(q, 8)
    assert not eng.pipeline.split_buffers.arrived.any()
    # Near-duplicates: certificates fail under the split too, and the float32 scan answers.
    base = rng.standard_normal(40)
    m.add(60, base + 1e-5 * rng.standard_normal((60, 40)))
    before = eng.stats["fallbacks"]
    near = np.concatenate([as_unit_rows(base[None, :] + 1e-4 * rng.standard_normal((1, 40))), q[:2]])
    m.check(near, 8, same_as_numpy=False)
    assert eng.stats["fallbacks"] > before
    assert not eng.pipeline.split_buffers.arrived.any()
    eng.retune({"final_split_rows": 0})
    assert eng.plan(3, 8).final_split == 1
    m.check(q, 8)


@needs_interpreter
def test_split_plans(rng):
    """Which plans split the final kernel's re-score: batches whose certified re-score keeps
    at most SPLIT_MAX_CANDIDATES candidates, in programs of final_split_rows (rounded up to a
    power of two); never a single query, the exact float32 scan, or a split of one."""
    eng = triton_engine(40, precision="fast", capacity=8)
    assert eng.plan(4, 8).final_split == fast_candidates(8) // 8
    assert eng.plan(1, 8).final_split == 1  # (a single query's chunks re-score their own)
    assert eng.plan(4, 32).final_split == 1  # KF 128: not split
    assert fast_candidates(32) > SPLIT_MAX_CANDIDATES >= fast_candidates(16)
    eng.retune({"final_split_rows": 6})
    assert eng.plan(4, 8).final_split == fast_candidates(8) // 8
    eng.retune({"final_split_rows": fast_candidates(8)})
    assert eng.plan(4, 8).final_split == 1
    exact = triton_engine(40, precision="exact", capacity=8)
    assert exact.scan_kind(4, 8, "exact") == "tf32" and exact.plan(4, 8).final_split > 1
    assert exact.plan(4, 2000).final_split == 1  # (k past the 16-bit paths: the float32 scan)


@needs_interpreter
def test_split_buffers_hold_a_batch_rounded_up(rng):
    """A batch runs in the power of two that holds it: an engine whose max_batch is not one
    still answers a full batch (the split buffers hold the rounded-up batch)."""
    eng = triton_engine(40, precision="exact", capacity=8, max_batch=3)
    m = Mirror(eng, rng)
    m.add(200)
    m.check(unit_queries(rng, 3, 40), 8)


@needs_interpreter
@pytest.mark.parametrize("dim", [40, 64])
def test_triton_small_exact_batches_by_fma(rng, dim):
    """Exact batches of a few queries (a crowd's pass) scan the float32 rows by FMA, each row
    tile read once for all of them, with no certified re-score: the float64 answer, filters
    included, at every bucket up to exact_fma_max_q (40: a dimension the tile does not divide)."""
    eng = triton_engine(dim, precision="exact", capacity=8)
    assert not eng.plan(2, 8).fma and eng.scan_kind(2, 8, "exact") == "tf32"  # off by default
    eng.retune({"score_chunk": 64, "exact_fma_max_q": 8})
    for q in (2, 3, 5, 8):
        assert eng.scan_kind(q, 8, "exact") == "f32" and eng.plan(q, 8).fma
    assert eng.scan_kind(9, 8, "exact") == "tf32" and not eng.plan(9, 8).fma
    assert not eng.plan(1, 8).fma and not eng.plan(4, 8, "fast").fma
    m = Mirror(eng, rng)
    ids = m.add(200)
    m.delete(ids[::5])
    q = unit_queries(rng, 8, dim)
    m.check(q[:2], 8)
    m.check(q[:3], 5, Filter(namespace=1))
    m.check(q, 8, Filter(since=20.0, until=80.0))
    eng.retune({"exact_fma_max_q": 16})
    m.check(unit_queries(rng, 13, dim), 6)


@needs_interpreter
def test_triton_merge_levels_and_large_k(rng):
    eng = triton_engine(32, precision="exact")
    # the v1 fused scan (scores_max_q 0), forced into two merge levels
    eng.retune({"final_max": 1, "merge_chunk": 16, "cpu_progs": 4, "scores_max_q": 0})
    m = Mirror(eng, rng)
    m.add(300)
    plan = eng.plan(1, 8)
    assert len(plan.levels) >= 1
    q = unit_queries(rng, 1, 32)
    m.check(q, 8)
    eng.retune({"final_max": 2048, "cpu_progs": 2})
    m.check(q, 200, Filter(namespace=0))  # k > eligible rows: padding


@needs_interpreter
def test_triton_growth_compaction_and_fallback(rng):
    d = 32
    eng = triton_engine(d, precision="fast", capacity=4)
    m = Mirror(eng, rng)
    first = m.add(100)
    base = rng.standard_normal(d)
    m.add(60, base + 1e-5 * rng.standard_normal((60, d)))  # near-duplicates: forces the fallback
    m.delete(first[:50])
    eng.compact()
    assert eng.tombstones == 0
    q = np.concatenate([as_unit_rows(base[None, :] + 1e-4 * rng.standard_normal((1, d))), unit_queries(rng, 1, d)])
    m.check(q, 4, same_as_numpy=False)
    assert eng.stats["fallbacks"] >= 1


def int8_scores(x32: torch.Tensor, q: np.ndarray) -> tuple[np.ndarray, float]:
    """int8_scores_kernel's scores of the rows ``x32`` for one query (no masks), and the
    largest residual norm of their 8-bit copy."""
    tk = load_kernels(require_interpreter=not HAVE_CUDA)
    n, dim = x32.shape
    dev = x32.device
    codes, scale, resid = quantize_rows(x32)
    hdr = torch.zeros(HDR_WORDS, dtype=torch.int64, device=dev)
    hdr[HEADER.n], hdr[HEADER.nq] = n, 1
    out = torch.empty(n, dtype=torch.float32, device=dev)
    live = torch.ones(n, dtype=torch.uint8, device=dev)
    block_d = max(32, min(128, next_pow2(dim)))
    tk.int8_scores_kernel[(-(-n // 64),)](
        codes, scale, torch.from_numpy(q.astype(np.float32)).to(dev), hdr, hdr.view(torch.float64), live,
        live, live, out, D=dim, D_POW2=next_pow2(dim), BLOCK_N=64, BLOCK_D=block_d, FILTER=False,
    )
    return out.cpu().numpy().astype(np.float64), resid


@pytest.mark.skipif(not (HAVE_INTERPRETER or HAVE_CUDA), reason="needs the Triton interpreter or a CUDA GPU")
def test_kernels_and_host_agree_on_the_header_layout():
    """Every word offset the kernels use is the host's declaration (kalos.engine.gpu.layout), the
    loader's check refuses kernels that disagree, and the host writes each field where the
    declaration puts it."""
    tk = load_kernels(require_interpreter=not HAVE_CUDA)
    consts = kernel_constants()
    assert {"H_N", "H_ROW_ERR8", "T_SCALE", "T_SEQ", "HCTL_STOPPED", "CTL_TURN"} <= set(consts)
    assert {name: getattr(tk.common, name).value for name in consts} == consts
    check_kernel_layout(tk.common)
    off_by_one = types.SimpleNamespace(**{name: tk.common.__dict__[name] for name in consts})
    off_by_one.T_SEQ = consts["T_SEQ"] + 1
    with pytest.raises(AssertionError, match="T_SEQ"):
        check_kernel_layout(off_by_one)
    eng = TorchEngine(8, device="cpu", backend="triton", precision="fast")
    eng.columns.max_norm, eng.columns.max_resid8 = 1.25, 0.5
    eng.fill_header(100, 3, 7, Filter(namespace=4, since=-2.5, until=9.0))
    h = np.frombuffer(eng.staging.h_hdr.tobytes(), HEADER_DTYPE)[0]
    assert (h["n"], h["nq"], h["k"], h["has_ns"], h["ns"], h["k_out"]) == (100, 3, 7, 1, 4, 7)
    assert (h["since"], h["until"], h["max_norm"]) == (-2.5, 9.0, 1.25)
    assert h["row_err8"] == 0.5 * int8_error_terms(8)[1]


@pytest.mark.skipif(not (HAVE_INTERPRETER or HAVE_CUDA), reason="needs the Triton interpreter or a CUDA GPU")
@pytest.mark.parametrize("dim", [3, 40, 384, 1024])
def test_int8_error_bound_holds(rng, dim):
    """|score(8-bit rows, two-plane query) - score(float64)| <= A|x||q| + R r |q|, on rows with
    tiny components and with one large one (a coarse grid), and for a query along a row's
    rounding error, where that error adds up instead of averaging out (without the R term
    the bound fails there)."""
    x = rng.standard_normal((300, dim))
    x[:60] *= np.exp(rng.uniform(-30, 0, (60, dim)))
    x[60:90, 0] *= 40.0
    x32 = torch.from_numpy(as_unit_rows(x)).to("cuda" if HAVE_CUDA else "cpu")
    codes, scale, _ = quantize_rows(x32)
    err_rows = (x32.double() - codes.double() * scale.double()[:, None]).cpu().numpy()
    queries = [unit_queries(rng, 1, dim)[0], as_unit_rows(err_rows[70:71])[0], as_unit_rows(err_rows[5:6])[0]]
    spiky = rng.standard_normal(dim)
    spiky[0] = 30.0
    queries.append(as_unit_rows(spiky[None, :])[0])
    a_term, r_term = int8_error_terms(dim)
    x64 = x32.double().cpu().numpy()
    a = np.linalg.norm(x64, axis=1).max()
    worst = 0.0
    for q in queries:
        s8, resid = int8_scores(x32, q)
        s64 = x64 @ q.astype(np.float32).astype(np.float64)
        b = np.linalg.norm(q.astype(np.float32).astype(np.float64))
        err = np.abs(s8 - s64)
        assert (err <= a_term * a * b + r_term * resid * b).all(), (err.max(), a_term, resid)
        worst = max(worst, err.max() / (a_term * a * b))
    if dim >= 40:
        assert worst > 1.0  # the query along a rounding error needs the R term


@needs_interpreter
def test_single_query_scans_the_8bit_copy_and_falls_back_on_near_ties(rng):
    """One query in fast mode scans the 8-bit rows. Rows whose scores differ by far less than
    the 8-bit error: the chunk's certificate must fail (without the rows' error term in the
    bound it would pass with the wrong rows) and the exact scan answers."""
    d = 32
    eng = triton_engine(d, precision="fast", capacity=4)
    assert eng.plan(1, 8).rescore_k and eng.scan_kind(1, 8, "fast") == "i8"
    m = Mirror(eng, rng)
    m.add(300)
    base = as_unit_rows(rng.standard_normal((1, d)))[0]
    m.add(40, base + 0.004 * rng.standard_normal((40, d)))
    # An ordinary query, orthogonal to the cluster (a random one sometimes lands near it, and then
    # its fallback is right): certified.
    ordinary = unit_queries(rng, 1, d)[0]
    ordinary = as_unit_rows((ordinary - (ordinary @ base) * base)[None, :])
    m.check(ordinary, 8)
    assert eng.stats["fallbacks"] == 0
    for _ in range(3):
        m.check(as_unit_rows(base[None, :] + 1e-4 * rng.standard_normal((1, d))), 8, same_as_numpy=False)
    assert eng.stats["fallbacks"] == 3
    eng.fill_header(1, 1, 1, Filter())
    assert eng.staging.h_hdrf[HEADER.row_err8] == eng.columns.max_resid8 * int8_error_terms(d)[1] > 0


@needs_interpreter
def test_single_scan_f16_holds_no_8bit_copy(rng):
    eight = triton_engine(24, precision="fast", capacity=64)
    sixteen = triton_engine(24, precision="fast", capacity=64, tune={"single_scan": "f16"})
    assert eight.memory_bytes() - sixteen.memory_bytes() == 64 * (24 + 4)
    assert sixteen.scan_kind(1, 8, "fast") == "f16"
    m = Mirror(sixteen, rng)
    m.add(100)
    m.check(unit_queries(rng, 1, 24), 5)
    with pytest.raises(InvalidArgument, match="single_scan"):
        triton_engine(24, precision="fast", tune={"single_scan": "int4"})


def test_a_tile_tuned_as_a_mapping_becomes_a_scan_config():
    """A benchmark's JSON variant names a tile by its fields; a field that is no tile's is refused."""
    tuned = DEFAULT_TUNING.replace({"scores_f16_batch": {"block_n": 64, "block_d": 64, "block_q": 64, "warps": 8,
                                                         "stages": 3}})
    assert tuned.scores_f16_batch == ScanConfig(block_n=64, block_d=64, block_q=64, warps=8, stages=3)
    assert tuned.scores_f32_batch == DEFAULT_TUNING.scores_f32_batch
    with pytest.raises(InvalidArgument, match="scores_f16_batch: no tile field 'block_rows'; missing block_n, "
                                              "block_d, block_q, warps, stages"):
        DEFAULT_TUNING.replace({"scores_f16_batch": {"block_rows": 64}})
    with pytest.raises(InvalidArgument, match=r"block_n='64', warps=4.0 must be integers"):
        DEFAULT_TUNING.replace({"scores_f16_batch": {"block_n": "64", "block_d": 64, "block_q": 16, "warps": 4.0,
                                                     "stages": 3}})
    with pytest.raises(InvalidArgument, match="tune gemm_min_q is not a tile"):
        DEFAULT_TUNING.replace({"gemm_min_q": {"block_n": 64}})
    with pytest.raises(InvalidArgument, match="unknown tuning key 'scores_f16_batches'"):
        DEFAULT_TUNING.replace({"scores_f16_batches": {"block_n": 64}})


# -- searching in place in an attached host buffer (the sidecar's zero-copy path) ----------------


def attached_case(m: Mirror, rng, nq: int, k: int, dim: int):
    """Queries of random length at scattered offsets of a buffer, and where their answers go."""
    buf = bytearray(8 * (64 + nq * (dim + 2 * k + 16)))
    f32 = np.frombuffer(buf, np.float32)
    query_at = 16 + np.arange(nq, dtype=np.int64) * (dim + 8)
    ids_at = (len(buf) // 8) - (np.arange(nq, dtype=np.int64) + 1) * (k + 1)  # from the end, int64 units
    scores_at = query_at[-1] + dim + 4 + np.arange(nq, dtype=np.int64) * (k + 1)
    raw = rng.standard_normal((nq, dim)) * rng.uniform(0.01, 100, (nq, 1))
    for j in range(nq):
        f32[query_at[j] : query_at[j] + dim] = raw[j]
    rows = np.stack([f32[a : a + dim] for a in query_at])
    scales = row_scales(rows, what="query", error=InvalidQuery)
    unit = normalise_rows(rows.copy(), what="query", error=InvalidQuery)
    return buf, query_at, scales, ids_at, scores_at, unit


def read_attached(buf, ids_at, scores_at, k):
    i64, f32 = np.frombuffer(buf, np.int64), np.frombuffer(buf, np.float32)
    return (np.stack([i64[a : a + k] for a in ids_at]), np.stack([f32[a : a + k] for a in scores_at]))


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=needs_interpreter),
])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_search_attached_reads_and_writes_the_buffer(rng, backend, precision):
    """search_attached == search of the host-normalised queries, bit for bit, and == the
    float64 reference; answers land exactly where the offsets say, nothing else changes."""
    d = 40
    eng = TorchEngine(d, device="cpu", backend=backend, precision=precision, capacity=8)
    m = Mirror(eng, rng)
    ids = m.add(230)
    m.delete(ids[::11])
    for nq, k, flt in ((1, 8, Filter()), (3, 5, Filter(namespace=1, since=10.0)), (2, 300, Filter(namespace=2))):
        buf, query_at, scales, ids_at, scores_at, unit = attached_case(m, rng, nq, k, d)
        before = bytes(buf)
        eng.attach_host(buf)
        try:
            eng.search_attached(query_at, scales, ids_at, scores_at, k, flt)
        finally:
            eng.detach_host()
        got_ids, got_sc = read_attached(buf, ids_at, scores_at, k)
        want_ids, want_sc = eng.search(unit, k, flt)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_sc, want_sc)
        for qi, (ref_ids, ref_sc) in enumerate(m.reference(unit, flt)):
            assert_topk(got_ids[qi], got_sc[qi], ref_ids, ref_sc, k)
        # Every byte outside the answer areas is as it was.
        touched = np.zeros(len(buf), bool)
        for a in ids_at:
            touched[8 * a : 8 * (a + k)] = True
        for a in scores_at:
            touched[4 * a : 4 * (a + k)] = True
        same = np.frombuffer(before, np.uint8) == np.frombuffer(bytes(buf), np.uint8)
        assert same[~touched].all()


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=needs_interpreter),
])
def test_search_attached_normalises_on_the_device(rng, backend):
    """scales=None: the engine computes 1/|q| in float64 itself (the sidecar's batches). The
    scales it returns equal the host's row_scales, the answers equal those of host-scaled
    queries bit for bit, and a query with no direction (zeros, a NaN) comes back with a
    scale that says so while the others in its batch are answered."""
    d = 40
    eng = TorchEngine(d, device="cpu", backend=backend, precision="exact", capacity=8)
    eng.retune({"gemm_min_q": 2})  # the batch goes through the GEMM path's kernels too
    m = Mirror(eng, rng)
    m.add(230)
    buf, query_at, scales, ids_at, scores_at, unit = attached_case(m, rng, 5, 6, d)
    f32 = np.frombuffer(buf, np.float32)
    f32[query_at[1] : query_at[1] + d] = 0.0
    f32[query_at[3] + 7] = np.nan
    eng.attach_host(buf)
    try:
        got_scales = eng.search_attached(query_at, None, ids_at, scores_at, 6)
    finally:
        eng.detach_host()
    good = np.array([0, 2, 4])
    np.testing.assert_allclose(got_scales[good], scales[good], rtol=1e-14)
    assert not (np.isfinite(got_scales[1]) and got_scales[1] > 0)
    assert not (np.isfinite(got_scales[3]) and got_scales[3] > 0)
    got_ids, got_sc = read_attached(buf, ids_at, scores_at, 6)
    want_ids, want_sc = eng.search(unit[good], 6)
    np.testing.assert_array_equal(got_ids[good], want_ids)
    np.testing.assert_array_equal(got_sc[good], want_sc)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interpreter),
                                    pytest.param("cuda", marks=[cuda, needs_cuda])])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_passes_in_flight_answer_as_search_attached_does(rng, precision, device):
    """search_attached_start: up to two passes in flight (a third finishes the oldest first),
    on staging areas of their own, each answering exactly what search_attached answers, the
    float64 reference too; in fast mode a pass whose certificate fails (near-duplicates) is
    re-run while the other pass is still in flight, and both stay right; a write (an add)
    finishes the passes in flight first, so they answer from the rows before it."""
    d, k = 32, 6
    eng = TorchEngine(d, device=device, backend="triton", precision=precision, capacity=8)
    m = Mirror(eng, rng)
    m.add(150)
    base = rng.standard_normal(d)
    m.add(40, base + 1e-5 * rng.standard_normal((40, d)))  # where fast mode's certificate fails
    cases = [attached_case(m, rng, nq, k, d) for nq in (3, 2, 4)]
    near = cases[1][0]  # the second pass asks next to the near-duplicates
    f32 = np.frombuffer(near, np.float32)
    f32[cases[1][1][0] : cases[1][1][0] + d] = base + 1e-4 * rng.standard_normal(d)
    buf = mmap.mmap(-1, sum(len(c[0]) for c in cases))  # page-aligned, as the sidecar's segment
    offsets, at = [], 0
    for case in cases:  # the three cases side by side in one attached buffer
        buf[at : at + len(case[0])] = case[0]
        offsets.append(at)
        at += len(case[0])
    eng.attach_host(buf)
    try:
        passes, wanted = [], []
        for case, off in zip(cases, offsets):
            _buf, query_at, _scales, ids_at, scores_at, _unit = case
            query_at, ids_at, scores_at = query_at + off // 4, ids_at + off // 8, scores_at + off // 4
            rows = np.stack([np.frombuffer(buf, np.float32)[a : a + d] for a in query_at])
            unit = normalise_rows(rows.astype(np.float32), what="query", error=InvalidQuery)
            wanted.append((ids_at, scores_at, unit))
            passes.append(eng.search_attached_start(query_at, None, ids_at, scores_at, k))
            assert len(eng._flights) <= 2
        assert [p.side for p in passes] == [0, 1, 0]
        for p, (ids_at, scores_at, unit) in zip(passes, wanted):
            scales = p.finish()
            assert p.done() and (np.isfinite(scales) & (scales > 0)).all()
            got_ids, got_sc = read_attached(buf, ids_at, scores_at, k)
            for qi, (ref_ids, ref_sc) in enumerate(m.reference(unit, Filter())):
                assert_topk(got_ids[qi], got_sc[qi], ref_ids, ref_sc, k)
        if precision == "fast":
            assert eng.stats["fallbacks"] >= 1
        # A write finishes the pass in flight first: its answer is the one from before the add.
        ids_at, scores_at, unit = wanted[0]
        before = read_attached(buf, ids_at, scores_at, k)
        query_at = cases[0][1] + offsets[0] // 4
        pending = eng.search_attached_start(query_at, None, ids_at, scores_at, k)
        m.add(5, np.repeat(unit[:1], 5, axis=0))  # rows that would be every query 0's best
        assert not eng._flights
        pending.finish()
        np.testing.assert_array_equal(read_attached(buf, ids_at, scores_at, k)[0], before[0])
    finally:
        eng.detach_host()


def places_buffer(n_places: int, dim: int, k_max: int):
    """A page-aligned buffer holding ``n_places`` single queries and their answer areas, as the
    sidecar's slots do: (buffer, query_at, ids_at, scores_at)."""
    stride = dim + 3 * k_max + 16  # float32 elements per place
    buf = mmap.mmap(-1, 4 * (n_places * stride + 16))
    base = np.arange(n_places, dtype=np.int64) * stride
    query_at = base + 4
    scores_at = query_at + dim
    ids_at = (scores_at + k_max + 2) // 2  # int64 elements: past the scores, 8-byte aligned
    return buf, query_at, ids_at, scores_at


def fill_places(buf, query_at: np.ndarray, raw: np.ndarray) -> None:
    """Writes query ``j`` (``raw[j]`` as float32, of any length) at float32 element
    ``query_at[j]`` of ``buf``."""
    f32 = np.frombuffer(buf, np.float32)
    for at, row in zip(query_at.tolist(), raw):
        f32[at : at + len(row)] = row


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interpreter),
                                    pytest.param("cuda", marks=[cuda, needs_cuda])])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_places_answer_as_the_float64_reference(rng, precision, device):
    """search_places_start: passes that name declared places by index answer each place's query
    as the float64 reference does (queries of any length, normalised on the device), two in
    flight on their own staging areas; a query with no direction comes back with an unusable
    scale; more places than a batch holds go through search_attached_start (at once) and are
    right too, under a namespace filter; in fast mode a failed certificate is re-run from the
    places."""
    d, k, k_max, n_places = 32, 6, 8, 7
    eng = TorchEngine(d, device=device, backend="triton", precision=precision, capacity=8, max_batch=4)
    m = Mirror(eng, rng)
    m.add(150)
    base = rng.standard_normal(d)
    m.add(40, base + 1e-5 * rng.standard_normal((40, d)))  # where fast mode's certificate fails
    buf, query_at, ids_at, scores_at = places_buffer(n_places, d, k_max)
    raw = rng.standard_normal((n_places, d)) * rng.uniform(0.01, 100, (n_places, 1))
    raw[2] = 50 * (base + 1e-4 * rng.standard_normal(d))  # next to the near-duplicates
    raw[5] = 0.0  # no direction
    fill_places(buf, query_at, raw)
    unit = as_unit_rows(np.where(np.abs(raw).sum(axis=1, keepdims=True) > 0, raw, 1.0))
    eng.attach_host(buf)
    try:
        with pytest.raises(InvalidArgument, match="attach_places"):
            eng.search_places_start(np.array([0]), k)
        eng.attach_places(query_at, ids_at, scores_at, k_max)
        with pytest.raises(InvalidQuery, match="k="):
            eng.search_places_start(np.array([0]), k_max + 1)
        before = bytes(buf)
        for bad_k in (0, 2.0, True):
            with pytest.raises(InvalidQuery):
                eng.search_places_start(np.array([0]), bad_k)
        for bad in (np.array([-1]), np.array([0, n_places]), np.array([0.0]), np.array([[0]]), [0]):
            with pytest.raises(InvalidArgument, match="places"):
                eng.search_places_start(bad, k)
        assert bytes(buf) == before  # a refused pass writes nothing
        batches = [np.array([0, 2, 5]), np.array([1, 3]), np.array([4, 6, 0, 2]), np.array([6, 5, 4, 3, 2, 1])]
        passes = []
        for places, k_as in zip(batches[:3], (k, np.int64(k), np.int32(k))):  # (any integer k)
            passes.append(eng.search_places_start(places, k_as))
            assert len(eng._flights) <= 2
        assert [p.side for p in passes] == [0, 1, 0]
        # Then more places than a batch holds: searched at once, in batches, under a namespace.
        flts = [Filter()] * 3 + [Filter(namespace=1)]
        for i, (places, flt) in enumerate(zip(batches, flts)):
            queued = passes[i] if i < 3 else eng.search_places_start(places, k, flt)
            scales = queued.finish()
            assert queued.done()
            usable = np.isfinite(scales) & (scales > 0)
            assert usable.tolist() == [p != 5 for p in places.tolist()]
            got_ids, got_sc = read_attached(buf, ids_at[places], scores_at[places], k)
            for row, place in enumerate(places.tolist()):
                if place != 5:
                    (ref_ids, ref_sc), = m.reference(unit[place : place + 1], flt)
                    assert_topk(got_ids[row], got_sc[row], ref_ids, ref_sc, k)
            if i == 2 and precision == "fast":  # re-run from the places of a queued pass
                assert eng.stats["fallbacks"] >= 1
        with pytest.raises(InvalidArgument, match="outside"):
            eng.attach_places(query_at, ids_at, scores_at + len(buf) // 4, k_max)  # (float32 elements)
    finally:
        eng.detach_host()
    with pytest.raises(InvalidArgument, match="attach_places"):  # detached: the places went too
        eng.search_places_start(np.array([0]), k)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interpreter),
                                    pytest.param("cuda", marks=[cuda, needs_cuda])])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_places_each_in_its_own_namespace_answer_as_the_float64_reference(rng, precision, device):
    """search_places_start with ``namespaces``: one pass in which each place's query keeps to
    its own namespace (-1: all of them), under the filter's time window, answered as the float64
    reference of that namespace; the same for more places than a batch holds (searched at once,
    namespace by namespace); in fast mode a failed certificate is re-run in each query's own
    namespace; a namespace given twice, or namespaces of the wrong shape, are refused, nothing
    written."""
    d, k, k_max, n_places = 32, 6, 8, 11
    eng = TorchEngine(d, device=device, backend="triton", precision=precision, capacity=8, max_batch=8)
    m = Mirror(eng, rng)
    m.add(220)
    base = rng.standard_normal(d)
    # Where fast mode's certificate fails: more near-duplicates in each namespace than it keeps.
    m.add(150, base + 1e-5 * rng.standard_normal((150, d)))
    buf, query_at, ids_at, scores_at = places_buffer(n_places, d, k_max)
    raw = rng.standard_normal((n_places, d))
    raw[1] = base + 1e-4 * rng.standard_normal(d)  # next to the near-duplicates
    raw[4] = base + 1e-4 * rng.standard_normal(d)
    fill_places(buf, query_at, raw)
    unit = as_unit_rows(raw)
    eng.attach_host(buf)
    try:
        eng.attach_places(query_at, ids_at, scores_at, k_max)
        places = np.array([0, 1, 2, 3, 4, 5, 6])
        namespaces = np.array([0, 1, 2, -1, 2, 0, 1, 1, -1, 0, 2])  # (of every place)
        before = bytes(buf)
        own = namespaces[places]
        for bad, flt in ((own, Filter(namespace=1)), (own[:3], Filter()), (own.astype(float), Filter()),
                         (list(own), Filter()), (own.astype(np.uint64), Filter()), (np.where(own < 0, -2, own), Filter()),
                         (np.where(own == 2, 2**31, own), Filter())):
            with pytest.raises(InvalidArgument, match="namespace"):
                eng.search_places_start(places, k, flt, namespaces=bad)
        assert bytes(buf) == before
        i64 = np.frombuffer(buf, np.int64)
        window = Filter(since=10.0, until=90.0)
        fallbacks = eng.stats["fallbacks"]
        for flt, chosen in ((Filter(), places), (window, places), (Filter(), np.array([9, 5, 4])),
                            (window, np.array([1, 6, 7])),  # (all in namespace 1)
                            (Filter(), np.array([4])), (window, np.array([3]))):  # (one place: a pass of one)
            own = namespaces[chosen]
            for at in ids_at[chosen]:
                i64[at : at + k] = -7  # (no answer left from an earlier pass passes for this one's)
            scales = eng.search_places_start(chosen, k, flt, namespaces=own).finish()
            assert (np.isfinite(scales) & (scales > 0)).all()
            got_ids, got_sc = read_attached(buf, ids_at[chosen], scores_at[chosen], k)
            for row, (place, ns_id) in enumerate(zip(chosen.tolist(), own.tolist())):
                mine = dataclasses.replace(flt, namespace=None if ns_id < 0 else ns_id)
                (ref_ids, ref_sc), = m.reference(unit[place : place + 1], mine)
                assert_topk(got_ids[row], got_sc[row], ref_ids, ref_sc, k)
        if precision == "fast":
            assert eng.stats["fallbacks"] > fallbacks
        # More places than a batch holds: at once, namespace by namespace.
        many = np.arange(n_places)[::-1].copy()
        own = namespaces[many]
        for at in ids_at[many]:
            i64[at : at + k] = -7
        eng.search_places_start(many, k, window, namespaces=own).finish()
        got_ids, got_sc = read_attached(buf, ids_at[many], scores_at[many], k)
        for row, (place, ns_id) in enumerate(zip(many.tolist(), own.tolist())):
            mine = dataclasses.replace(window, namespace=None if ns_id < 0 else ns_id)
            (ref_ids, ref_sc), = m.reference(unit[place : place + 1], mine)
            assert_topk(got_ids[row], got_sc[row], ref_ids, ref_sc, k)
    finally:
        eng.detach_host()


@needs_interpreter
def test_a_compaction_finishes_the_pass_in_flight_before_the_rows_move(rng):
    """A writer (here a compaction) while a fast pass whose certificate fails is in flight: the
    pass, its float32 re-run included, is finished against the rows as they were, so its
    answers are the reference's (run after the compaction, the re-run found no rows)."""
    d, k = 32, 6
    eng = triton_engine(d, precision="fast", capacity=8)
    m = Mirror(eng, rng)
    early = m.add(150)
    base = rng.standard_normal(d)
    m.add(40, base + 1e-5 * rng.standard_normal((40, d)))  # the certificate fails near these
    m.delete(early[:120])  # tombstones (below the automatic compaction's threshold)
    case, query_at, _scales, ids_at, scores_at, _unit = attached_case(m, rng, 2, k, d)
    f32 = np.frombuffer(case, np.float32)
    for at in query_at:
        f32[at : at + d] = base + 1e-4 * rng.standard_normal(d)
    buf = mmap.mmap(-1, len(case))
    buf[:] = case
    rows = np.stack([np.frombuffer(buf, np.float32)[at : at + d] for at in query_at])
    unit = normalise_rows(rows.astype(np.float32), what="query", error=InvalidQuery)
    eng.attach_host(buf)
    try:
        queued = eng.search_attached_start(query_at, None, ids_at, scores_at, k)
        eng.compact()
        queued.finish()
        assert eng.stats["fallbacks"] >= 1
        got_ids, got_sc = read_attached(buf, ids_at, scores_at, k)
        for qi, (ref_ids, ref_sc) in enumerate(m.reference(unit, Filter())):
            assert_topk(got_ids[qi], got_sc[qi], ref_ids, ref_sc, k)
    finally:
        eng.detach_host()


@needs_interpreter
def test_search_attached_fast_fallback(rng):
    d = 32
    eng = triton_engine(d, precision="fast", capacity=4)
    m = Mirror(eng, rng)
    m.add(100)
    base = rng.standard_normal(d)
    m.add(60, base + 1e-5 * rng.standard_normal((60, d)))  # near-duplicates: the certificate fails
    buf = bytearray(4096)
    f32 = np.frombuffer(buf, np.float32)
    f32[:d] = base + 1e-4 * rng.standard_normal(d)
    unit = as_unit_rows(f32[None, :d].astype(np.float64))
    scale = np.array([1.0 / np.sqrt(np.dot(f32[:d], f32[:d]))])
    eng.attach_host(buf)
    eng.search_attached(np.array([0]), scale, np.array([100]), np.array([400]), 4)
    eng.detach_host()
    assert eng.stats["fallbacks"] >= 1
    got_ids, got_sc = read_attached(buf, [100], [400], 4)
    (ref_ids, ref_sc), = m.reference(unit, Filter())
    assert_topk(got_ids[0], got_sc[0], ref_ids, ref_sc, 4)


def test_search_attached_rejects_bad_input_without_writing(rng):
    d = 16
    eng = torch_engine(d)
    Mirror(eng, rng).add(50)
    buf = bytearray(1024)
    np.frombuffer(buf, np.float32)[:d] = 1.0
    with pytest.raises(InvalidArgument, match="attach_host"):
        eng.search_attached([0], [0.25], [64], [200], 4)
    eng.attach_host(buf)
    before = bytes(buf)
    for args, err in (
        (([0], [0.25], [127], [200], 4), "ids_at points outside"),     # 127 + 4 > 1024 / 8
        (([250], [0.25], [64], [200], 4), "query_at points outside"),  # 250 + 16 > 256
        (([0], [0.25], [64], [-1], 4), "scores_at points outside"),
        (([0], [0.25, 1.0], [64], [200], 4), "one entry per query"),
    ):
        with pytest.raises(InvalidArgument, match=err):
            eng.search_attached(*args)
    with pytest.raises(InvalidQuery, match="finite"):
        eng.search_attached([0], [np.nan], [64], [200], 4)
    with pytest.raises(InvalidQuery, match="k must be"):
        eng.search_attached([0], [0.25], [64], [200], 0)
    assert bytes(buf) == before
    eng.detach_host()
    eng.detach_host()  # idempotent


@needs_interpreter
def test_sidecar_answers_in_place_with_the_triton_engine(rng, runtime_dir, tmp_path):
    """The whole zero-copy path through a real client: the sidecar hands the engine offsets
    into its shared segment, the kernels read the queries there and write the answers there."""
    sidecar_in_place(rng, tmp_path, device="cpu", precision="exact")


def sidecar_in_place(rng, tmp_path, *, device: str, precision: str) -> None:
    import threading

    from kalos import Client
    from kalos.server.sidecar import Sidecar, SidecarConfig

    d = 24 if device == "cpu" else 1024
    name = f"zc-{precision}-{os.getpid()}"  # the per-user name lock: parallel test workers must not collide
    config = SidecarConfig(store=tmp_path / "m.db", name=name, dim=d, slots=4, max_k=16, max_batch=8)
    sidecar = Sidecar(config, engine_factory=lambda _dev, dim, cap: TorchEngine(
        dim, device=device, backend="triton", capacity=cap, precision=precision))
    assert sidecar.zero_copy
    thread = threading.Thread(target=sidecar.serve_forever, daemon=True)
    thread.start()
    try:
        with Client(name, timeout=60) as client:
            vectors = rng.standard_normal((120, d)).astype(np.float32)
            ids = client.add(vectors[:80], namespace="a")
            ids = np.concatenate([ids, client.add(vectors[80:], namespace="b")])
            unit = as_unit_rows(vectors.astype(np.float64))
            queries = (rng.standard_normal((3, d)) * 7).astype(np.float32)
            qunit = as_unit_rows(queries.astype(np.float64))
            bad = queries.copy()
            bad[1, 3] = np.nan  # a batch is normalised on the device: the host still names the row
            with pytest.raises(InvalidQuery, match="query 1 contains NaN"):
                client.recall_many(bad, k=5)
            for namespace, members in (("a", slice(0, 80)), (None, slice(0, 120))):
                ref = qunit @ unit[members].T
                one = client.recall(queries[0], k=16, namespace=namespace)
                many = client.recall_many(queries, k=5, namespace=namespace)
                for qi, (got_ids, got_sc, k) in enumerate(
                    [(one.ids, one.scores, 16)] + [(many[i].ids, many[i].scores, 5) for i in range(3)]
                ):
                    row = ref[0 if qi == 0 else qi - 1]
                    order = np.argsort(-row, kind="stable")
                    assert_topk(got_ids, got_sc, ids[members][order], row[order], k)
    finally:
        sidecar.stop()
        thread.join(timeout=30)
    assert not sidecar.zero_copy  # detached before the segment was unmapped


# -- a real GPU ------------------------------------------------------------------------------


@cuda
@needs_cuda
@pytest.mark.parametrize("tune", [None, {"scores_max_q": 256, "exact_batch_scan": "tf32"}], ids=["v1", "v2-tf32"])
@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dim", [384, 1024])
def test_cuda_matches_reference(rng, precision, dim, tune):
    m = Mirror(TorchEngine(dim, device="cuda", precision=precision, capacity=1024, tune=tune), rng)
    ids = m.add(20000)
    m.delete(rng.choice(ids, 500, replace=False))
    q = unit_queries(rng, 5, dim)
    for flt in FILTERS[:3]:
        for k in (1, 8, 256):
            m.check(q[:1], k, flt)
            m.check(q, k, flt)
    big = unit_queries(rng, 40, dim)  # a batch of 40: scored by cuBLAS (gemm_min_q), not the scan
    m.check(big, 8, FILTERS[1])
    m.add(3000)  # after graphs were captured: adds must be seen (n lives on the device)
    m.check(q, 8)
    m.check(big, 16)
    assert m.engine.stats["graph_captures"] >= 1


@cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_cuda_sidecar_answers_in_place(rng, runtime_dir, tmp_path, precision):
    """The segment in /dev/shm registered with cudaHostRegister; kernels read and write it."""
    sidecar_in_place(rng, tmp_path, device="cuda", precision=precision)


@cuda
@needs_cuda
def test_cuda_search_into_registered_shared_memory(rng):
    d = 256
    m = Mirror(TorchEngine(d, device="cuda", precision="fast"), rng)
    m.add(5000)
    q = unit_queries(rng, 4, d)
    with mmap.mmap(-1, 1 << 16) as mm, register_host_buffer(mm) as buf:
        assert buf.pinned
        qv = buf.view(0, torch.float32, (4, d))
        oi = buf.view(8192, torch.int64, (4, 16))
        os_ = buf.view(8192 + 4 * 16 * 8, torch.float32, (4, 16))
        assert qv.is_pinned()
        qv.copy_(torch.from_numpy(q))
        m.engine.search_into(qv, 16, out_ids=oi, out_scores=os_)
        ref = m.reference(q, Filter())
        for i in range(4):
            assert_topk(oi[i].numpy(), os_[i].numpy(), *ref[i], 16)
        del qv, oi, os_


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_triton_gemm_batches(rng, precision):
    """Batches scored by a matmul a slice of rows at a time (cuBLAS on a GPU; emulated here),
    masked and reduced by scores_topk_kernel, then the certified re-score: same answers.
    Few rows in the last slice, and slices past the live rows left out (then re-captured)."""
    eng = triton_engine(40, precision=precision, capacity=8)
    eng.retune({"gemm_min_q": 2, "gemm_rows": 128, "score_chunk": 64})
    m = Mirror(eng, rng)
    ids = m.add(300)
    m.delete(ids[::7])
    assert eng.plan(3, 5).gemm_rows == 128
    q = unit_queries(rng, 3, 40)
    m.check(q, 5)
    m.check(q, 9, Filter(namespace=1, since=10.0))
    m.add(200)  # more slices now hold rows
    m.check(q, 5, Filter(until=60.0))
    m.check(q[:1], 5)  # one query: the scan path, unchanged


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_triton_gemm_threshold_selection(rng, precision):
    """Whole GEMM slices select by threshold (group maxima, tau, every row >= tau): the same
    answers as the float64 reference, with filters (tau at -inf when few rows pass) and a
    narrower last slice (per-chunk top-K). Then 300 exact ties inside one slice fill the
    candidate scratch (32 groups x 4 rows) before rows that beat them are collected: the
    overflow word must send the query to the float32 scan (without it the certificate
    passes on the wrong rows)."""
    d = 24
    eng = triton_engine(d, precision=precision, capacity=700)
    eng.retune({"gemm_min_q": 2, "gemm_rows": 512, "score_chunk": 64})
    assert eng.plan(3, 8).threshold and eng.plan(3, 5).threshold and not eng.plan(3, 200).threshold
    m = Mirror(eng, rng)
    q = unit_queries(rng, 2, d)
    other = rng.standard_normal((1, d))
    other = as_unit_rows(other - (other @ q[0]) * q[:1])  # orthogonal to q[0]
    m.add(10, q[0] + 0.05 * rng.standard_normal((10, d)))  # rows 0-9: scores ~0.99 for q[0]
    dup = 0.9 * q[:1] + math.sqrt(1 - 0.81) * other
    m.add(300, np.repeat(dup, 300, axis=0))  # all 0.9 for q[0]
    m.add(10, q[0] + 0.05 * rng.standard_normal((10, d)))  # rows 310-319: collected after the scratch is full
    ids = m.add(800)  # capacity 1400: slices of 512, 512 and 376 rows, all in use
    m.delete(ids[::11])
    assert eng.rows.capacity == 1400
    before = eng.stats["fallbacks"]
    m.check(q, 8, same_as_numpy=False)  # ties: NumPy may order the tied rows otherwise
    assert eng.stats["fallbacks"] > before, "the overflowed query must be re-run by the float32 scan"
    # Queries orthogonal to the 300 tied rows: ties near the top would rightly fail the
    # certificate (it happened for 1 seed in ~30: a random query ranking them in its top 8).
    fresh = unit_queries(rng, 2, d)
    fresh = as_unit_rows(fresh - (fresh @ dup[0])[:, None] * dup / (dup[0] @ dup[0]))
    before = eng.stats["fallbacks"]
    m.check(fresh, 8, Filter(namespace=2, since=50.0))  # ~1/6 of the rows pass
    m.check(fresh, 6, Filter(since=0.0, until=1.0))  # ~1% pass: fewer groups than keys, tau = -inf
    # 11 queries: group_max_kernel's programs take 8 queries each, the second block part-full.
    # (The 300 tied rows score far below the ~50 other groups' maxima, so that tau cannot be
    # their tie; filtered, fewer groups pass and for some seeds it would be.)
    crowd = unit_queries(rng, 11, d)
    crowd = crowd - (crowd @ dup[0])[:, None] * dup / (dup[0] @ dup[0])
    crowd = as_unit_rows(as_unit_rows(crowd) - 0.8 * dup)
    m.check(crowd, 8)
    # k = 16: K = 64, whose threshold selection needs slices of 1,024 rows here (score chunks
    # of 128, groups of 8); 64 of the 128 groups reach tau, which collect_kernel walks in two
    # steps.
    eng.retune({"gemm_min_q": 2, "gemm_rows": 1024, "score_chunk": 64})
    plan = eng.plan(16, 16)
    assert plan.threshold and plan.k1 == 64 and plan.slice_rows == 1024 and plan.score_chunk == 128
    m.check(crowd, 16)
    assert eng.stats["fallbacks"] == before, "random queries are answered by the threshold path itself"


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_triton_scan_threshold_selection(rng, precision):
    """A batch's score-writing scan that selects by threshold (Tuning.scan_threshold_min_q):
    the scan itself writes each row block's maximum (a block being a group), then slices
    select as a GEMM's do. The same answers as the float64 reference, with deleted rows,
    filters, a narrower last slice and groups past n; 600 exact ties in one slice overflow the
    candidate scratch (32 groups x 16 rows), which must send the query to the float32 scan."""
    d = 24
    tile = ScanConfig(block_n=16, block_d=16, block_q=16, warps=4, stages=1)
    tuning = {"gemm_min_q": 64, "scores_max_q": 32, "scan_threshold_min_q": 2, "gemm_rows": 1024,
              "score_chunk": 256, "cpu_block_n": 16, "scores_f32_batch": tile, "scores_f16_batch": tile}
    # Random rows: slices of 1,024 rows and a narrower last one, groups past n in a whole slice.
    eng = triton_engine(d, precision=precision, capacity=2200)
    eng.retune(tuning)
    plan = eng.plan(3, 8)
    assert plan.threshold and not plan.gemm_rows and plan.slice_rows == 1024 and plan.cfg.block_n == 16
    assert not eng.plan(1, 8).threshold, "a single query keeps its own path"
    m = Mirror(eng, rng)
    m.delete(m.add(1500)[::7])
    crowd = unit_queries(rng, 11, d)
    m.check(crowd, 8)
    m.check(crowd, 8, Filter(namespace=2, since=20.0))
    m.check(crowd, 6, Filter(since=0.0, until=1.0))  # ~1% pass: fewer groups than keys, tau = -inf
    assert eng.stats["fallbacks"] == 0, "random queries are answered by the threshold path itself"
    # Ties: 600 rows alike in the first slice fill the candidate scratch before rows that beat
    # them are collected.
    eng = triton_engine(d, precision=precision, capacity=1100)
    eng.retune(tuning)
    m = Mirror(eng, rng)
    q = unit_queries(rng, 2, d)
    other = rng.standard_normal((1, d))
    other = as_unit_rows(other - (other @ q[0]) * q[:1])  # orthogonal to q[0]
    m.add(10, q[0] + 0.05 * rng.standard_normal((10, d)))  # scores ~0.99 for q[0]
    dup = 0.9 * q[:1] + math.sqrt(1 - 0.81) * other
    m.add(600, np.repeat(dup, 600, axis=0))  # all 0.9 for q[0]
    m.add(10, q[0] + 0.05 * rng.standard_normal((10, d)))  # collected after the scratch is full
    m.check(q, 8, same_as_numpy=False)
    assert eng.stats["fallbacks"] > 0, "the overflowed query must be re-run by the float32 scan"


@cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_cuda_more_row_blocks_than_a_grid_axis_holds(rng, precision):
    """2.2M rows: the one-block-per-program scan launches 68,750 programs, more than CUDA's
    65,535 limit of grid axes 1 and 2 (the bug this pins: the scan failed with 'invalid
    argument' above 2M rows). The batch half checks the GEMM path at this size (its grids
    stay under the limit)."""
    d, n = 16, 2_200_000
    x = as_unit_rows(rng.standard_normal((n, d)))
    eng = TorchEngine(d, device="cuda", precision=precision, capacity=n)
    eng.add(np.arange(n, dtype=np.int64), x, np.zeros(n, np.int32), np.zeros(n))
    q = unit_queries(rng, 20, d)
    ids, scores = eng.search(q[:1], 8)
    ids_b, scores_b = eng.search(q, 8)
    ref = q.astype(np.float64) @ x.astype(np.float64).T
    for qi, (got_i, got_s) in enumerate([(ids[0], scores[0])] + list(zip(ids_b, scores_b))):
        row = ref[0 if qi == 0 else qi - 1]
        order = np.argpartition(-row, 100)[:100]  # the best 100 hold the top 8 and its ties
        order = order[np.argsort(-row[order], kind="stable")]
        assert_topk(got_i, got_s, order, row[order], 8)


@needs_interpreter
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_search_attached_gemm_batches_beyond_max_batch(rng, precision):
    """Zero-copy with the GEMM batch path and more queries than max_batch (split in rounds)."""
    d = 40
    eng = TorchEngine(d, device="cpu", backend="triton", precision=precision, capacity=8, max_batch=4)
    eng.retune({"gemm_min_q": 2, "gemm_rows": 128, "score_chunk": 64})
    m = Mirror(eng, rng)
    m.add(300)
    flt = Filter(namespace=1, since=10.0)
    buf, query_at, scales, ids_at, scores_at, unit = attached_case(m, rng, 7, 6, d)
    eng.attach_host(buf)
    eng.search_attached(query_at, scales, ids_at, scores_at, 6, flt)
    eng.detach_host()
    got_ids, got_sc = read_attached(buf, ids_at, scores_at, 6)
    for qi, (ref_ids, ref_sc) in enumerate(m.reference(unit, flt)):
        assert_topk(got_ids[qi], got_sc[qi], ref_ids, ref_sc, 6)


@needs_interpreter
def test_search_start_answers_cannot_be_mixed_up(rng):
    """A search (or an add) before the waiter of search_start is called finishes the started
    search first; its waiter still returns its own answer (the review's reproducer)."""
    d = 24
    eng = triton_engine(d, capacity=8)
    m = Mirror(eng, rng)
    m.add(120)
    q = unit_queries(rng, 2, d)
    wait = eng.search_start(q[:1], 4)
    other_ids, _ = eng.search(q[1:], 4)
    ids, scores = wait()
    (ref_ids, ref_sc), = m.reference(q[:1], Filter())
    assert_topk(ids[0], scores[0], ref_ids, ref_sc, 4)
    assert not np.array_equal(ids, other_ids)
    wait = eng.search_start(q[:1], 4)
    m.add(5)  # an add in between: the started search is finished first, on the old rows
    assert_topk(wait()[0][0], wait()[1][0], ref_ids, ref_sc, 4)


def test_sidecar_refuses_a_max_k_the_gpu_engine_cannot_serve(runtime_dir, tmp_path):
    from kalos.server.sidecar import Sidecar, SidecarConfig

    config = SidecarConfig(store=tmp_path / "m.db", name="mk", dim=8, slots=2, max_k=MAX_K + 1)
    with pytest.raises(InvalidArgument, match=f"--max-k {MAX_K}"):
        Sidecar(config, engine_factory=lambda _d, dim, cap: torch_engine(dim, capacity=cap))
    # Nothing is left behind: the same name starts at once with a max_k it can serve.
    ok = Sidecar(SidecarConfig(store=tmp_path / "m.db", name="mk", dim=8, slots=2, max_k=MAX_K),
                 engine_factory=lambda _d, dim, cap: torch_engine(dim, capacity=cap))
    ok.close()
