"""NumpyEngine against the float64 brute-force reference (tests/reference.py).

Random data of several shapes, filters applied inside the scan, deletes (tombstones),
compaction (automatic and explicit), capacity growth from one row, store ids that are
large and non-contiguous, and a hypothesis property test of random add/delete/search/compact
sequences against a dict model. Every random test prints its seed.
"""
from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import assert_same_answers, assert_topk_matches, eligible_mask, model_arrays, reference_topk

import kalos.engine.base as engine_base
from kalos.engine import MISSING_ID, Filter, NumpyEngine, as_unit_rows, make_engine
from kalos.errors import InvalidArgument, InvalidQuery


def random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unique, non-contiguous, large int64 ids (store ids are never row numbers)."""
    ids = rng.choice(2**62, size=n * 2 + 8, replace=False)[:n] + 2**40
    return ids.astype(np.int64)


def filled(rng: np.random.Generator, n: int, dim: int, *, capacity: int = 1024, namespaces=None, created_at=None):
    raw = rng.standard_normal((n, dim)).astype(np.float32)
    ids = random_ids(rng, n)
    ns = np.zeros(n, np.int32) if namespaces is None else np.asarray(namespaces, np.int32)
    t = np.zeros(n) if created_at is None else np.asarray(created_at, np.float64)
    engine = NumpyEngine(dim, capacity=capacity)
    engine.add(ids, as_unit_rows(raw), ns, t)
    return engine, ids, raw, ns, t


def queries_for(rng: np.random.Generator, q: int, dim: int) -> np.ndarray:
    return as_unit_rows(rng.standard_normal((q, dim)))


def check(engine, queries, k, flt, ids, raw, eligible=None, *, context=""):
    """Searches the whole batch and each query alone (the engine may take another path for one
    query); every answer must equal the float64 reference. Returns the batch answer."""
    got_ids, got_scores = engine.search(queries, k, flt)
    assert got_ids.shape == (len(queries), k) and got_scores.shape == (len(queries), k)
    assert got_ids.dtype == np.int64 and got_scores.dtype == np.float32
    assert_topk_matches(got_ids, got_scores, ids, raw, queries, k, eligible, context=f"{context} batch")
    for qi in range(min(len(queries), 3)):
        one_ids, one_scores = engine.search(queries[qi : qi + 1], k, flt)
        assert one_ids.shape == (1, k)
        assert_topk_matches(one_ids, one_scores, ids, raw, queries[qi : qi + 1], k, eligible,
                            context=f"{context} single query {qi}")
    return got_ids, got_scores


# -- exactness on fresh random data -------------------------------------------------------


@pytest.mark.parametrize(
    "n, dim, q, k",
    [
        (1, 4, 3, 1),
        (1, 4, 2, 5),        # k > live count
        (10, 8, 5, 16),      # k > live count
        (257, 3, 7, 256),    # k = 256, barely below n
        (200, 32, 4, 256),   # k = 256 > n
        (1000, 64, 20, 10),
        (3000, 128, 8, 256),
        (5000, 16, 10, 1),
        (2048, 768, 3, 8),
    ],
)
def test_matches_float64_reference(rng, n, dim, q, k):
    engine, ids, raw, _ns, _t = filled(rng, n, dim)
    queries = queries_for(rng, q, dim)
    got_ids, got_scores = check(engine, queries, k, Filter(), ids, raw, context=f"n={n} dim={dim} k={k}")
    assert len(engine) == n


def test_exact_ties_are_tolerated_and_complete(rng):
    """Many duplicate vectors: every tie group is cut consistently, no id twice."""
    dim = 4
    base = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    raw = base[rng.integers(0, len(base), size=300)]
    ids = random_ids(rng, len(raw))
    engine = NumpyEngine(dim)
    engine.add(ids, as_unit_rows(raw), np.zeros(len(raw), np.int32), np.zeros(len(raw)))
    queries = as_unit_rows(np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0.3, 0.2, 0.1, 0.9]], np.float32))
    for k in (1, 7, 75, 256):
        got_ids, got_scores = check(engine, queries, k, Filter(), ids, raw, context=f"ties k={k}")


def test_empty_engine_pads_everything():
    engine = NumpyEngine(8)
    ids, scores = engine.search(as_unit_rows(np.ones((2, 8))), 5)
    assert ids.shape == (2, 5) and np.all(ids == MISSING_ID)
    assert np.all(scores == -np.inf)


def test_make_engine_cpu_is_numpy():
    engine = make_engine("cpu", 6, capacity=3)
    assert isinstance(engine, NumpyEngine) and engine.dim == 6 and engine.device == "cpu"
    with pytest.raises(InvalidArgument, match="unknown device"):
        make_engine("tpu", 6)


# -- filters inside the scan ------------------------------------------------------------------


def test_rare_namespace_returns_all_of_its_rows_not_a_truncated_list(rng):
    n, dim = 4000, 32
    ns = np.full(n, 1, np.int32)
    rare = rng.choice(n, size=5, replace=False)
    ns[rare] = 7
    few = rng.choice(np.setdiff1d(np.arange(n), rare), size=30, replace=False)
    ns[few] = 9
    engine, ids, raw, ns, t = filled(rng, n, dim, namespaces=ns)
    queries = queries_for(rng, 6, dim)
    for namespace, k in ((7, 10), (7, 5), (7, 1), (9, 10), (9, 30), (9, 64), (1, 10), (3, 4)):
        check(engine, queries, k, Filter(namespace=namespace), ids, raw, ns == namespace, context=f"ns={namespace} k={k}")
    # The rare namespace's own top-k are not the global top-k: the filter works inside the scan.
    got_ids, _ = engine.search(queries, 5, Filter(namespace=7))
    assert set(got_ids[0].tolist()) == set(ids[rare].tolist())


def test_time_window_filters_with_inclusive_since_and_exclusive_until(rng):
    n, dim = 3000, 24
    created = rng.integers(1_000, 1_100, size=n).astype(np.float64)  # many equal stamps
    engine, ids, raw, ns, t = filled(rng, n, dim, created_at=created)
    queries = queries_for(rng, 5, dim)
    windows = [(1_050, None), (None, 1_003), (1_020, 1_021), (1_099, 1_100), (1_000, 1_001), (2_000, None),
               (None, 1_000), (1_010.5, 1_060.25)]
    for since, until in windows:
        for k in (1, 8, 100):
            eligible = eligible_mask(ns, t, since=since, until=until)
            check(engine, queries, k, Filter(None, since, until), ids, raw, eligible,
                  context=f"since={since} until={until} k={k}")
    # since is inclusive, until exclusive.
    exact = created == 1_020
    got_ids, _ = engine.search(queries, 256, Filter(None, 1_020, 1_021))
    valid = got_ids[0][got_ids[0] != MISSING_ID]
    assert set(valid.tolist()) == set(ids[exact].tolist())


def test_namespace_and_time_together_after_deletes(rng):
    n, dim = 2500, 16
    ns = rng.integers(1, 4, size=n).astype(np.int32)
    created = rng.uniform(0, 100, size=n)
    engine, ids, raw, ns, t = filled(rng, n, dim, namespaces=ns, created_at=created)
    queries = queries_for(rng, 4, dim)
    dead = rng.choice(n, size=400, replace=False)
    assert engine.delete(ids[dead]) == 400
    alive = np.ones(n, bool)
    alive[dead] = False
    for namespace, since, until, k in ((2, 10, 60, 12), (3, None, 5, 50), (1, 99, None, 3), (2, 0, 100, 256)):
        eligible = eligible_mask(ns, t, namespace=namespace, since=since, until=until, alive=alive)
        check(engine, queries, k, Filter(namespace, since, until), ids, raw, eligible,
              context=f"ns={namespace} since={since} until={until} k={k}")


# -- deletes, tombstones, compaction ------------------------------------------------------------


def test_deleted_ids_never_come_back_and_counts_are_right(rng):
    n, dim = 600, 12
    engine, ids, raw, _ns, _t = filled(rng, n, dim)
    queries = queries_for(rng, 8, dim)
    top, _ = engine.search(queries, 5)
    victims = np.unique(top[top != MISSING_ID])
    assert engine.delete(victims) == len(victims)
    assert engine.delete(victims) == 0  # already gone
    assert engine.delete(np.array([12345, -7], np.int64)) == 0  # never existed
    assert len(engine) == n - len(victims)
    assert engine.tombstones == len(victims)
    for v in victims:
        assert int(v) not in engine
    alive = ~np.isin(ids, victims)
    for k in (5, 50, 600):
        got_ids, got_scores = check(engine, queries, k, Filter(), ids, raw, alive, context=f"after delete k={k}")
        assert not np.isin(got_ids, victims).any()


def test_delete_everything_then_search_and_add_again(rng):
    engine, ids, raw, _ns, _t = filled(rng, 50, 8)
    assert engine.delete(ids) == 50
    got_ids, got_scores = engine.search(queries_for(rng, 2, 8), 10)
    assert np.all(got_ids == MISSING_ID) and np.all(got_scores == -np.inf)
    engine.compact()
    assert len(engine) == 0 and engine.tombstones == 0
    new_raw = rng.standard_normal((3, 8)).astype(np.float32)
    new_ids = np.array([2**63 - 1, 5, 2**62], np.int64)
    engine.add(new_ids, as_unit_rows(new_raw), np.zeros(3, np.int32), np.zeros(3))
    q = queries_for(rng, 2, 8)
    got_ids, got_scores = check(engine, q, 4, Filter(), new_ids, new_raw, context="re-add after emptying")


def test_automatic_compaction_keeps_results_and_ids(rng):
    n, dim = 4000, 16
    engine, ids, raw, ns, t = filled(rng, n, dim)
    queries = queries_for(rng, 6, dim)
    # Below the threshold (>= 1024 tombstones and > 25 % of rows) nothing is compacted...
    first = rng.choice(n, size=1000, replace=False)
    engine.delete(ids[first])
    assert engine.tombstones == 1000
    # ...past it, the delete compacts by itself.
    rest = rng.choice(np.setdiff1d(np.arange(n), first), size=500, replace=False)
    engine.delete(ids[rest])
    assert engine.tombstones == 0, "1500 of 4000 rows dead: the delete should have compacted"
    assert len(engine) == n - 1500
    alive = np.ones(n, bool)
    alive[first] = alive[rest] = False
    for k in (1, 10, 256):
        got_ids, got_scores = check(engine, queries, k, Filter(), ids, raw, alive, context=f"after auto-compact k={k}")
    # The id -> row map was rebuilt: deleting a survivor after compaction hits the right row.
    survivor = ids[np.flatnonzero(alive)[0]]
    assert engine.delete([survivor]) == 1
    alive[np.flatnonzero(ids == survivor)] = False
    got_ids, got_scores = check(engine, queries, 20, Filter(), ids, raw, alive, context="delete after compact")


def test_explicit_compaction_with_filters_and_later_adds(rng):
    n, dim = 900, 10
    ns = rng.integers(0, 3, size=n).astype(np.int32)
    created = rng.uniform(0, 10, size=n)
    engine, ids, raw, ns, t = filled(rng, n, dim, namespaces=ns, created_at=created)
    queries = queries_for(rng, 4, dim)
    dead = rng.choice(n, size=300, replace=False)
    engine.delete(ids[dead])
    assert engine.tombstones == 300  # below the automatic threshold
    flt = Filter(1, 2.0, 8.0)
    before = engine.search(queries, 15, flt)  # also warms the mask cache, which must not survive compaction
    engine.compact()
    assert engine.tombstones == 0 and len(engine) == n - 300
    after = engine.search(queries, 15, flt)
    alive = np.ones(n, bool)
    alive[dead] = False
    eligible = eligible_mask(ns, t, namespace=1, since=2.0, until=8.0, alive=alive)
    for label, (got_ids, got_scores) in (("before", before), ("after", after)):
        assert_topk_matches(got_ids, got_scores, ids, raw, queries, 15, eligible, context=f"{label} compact")
    # Adds after a compaction land in fresh rows and are found.
    extra_raw = rng.standard_normal((50, dim)).astype(np.float32)
    extra_ids = random_ids(rng, 50) + 1  # odd offset: disjoint in practice from the first batch
    extra_ids = np.setdiff1d(extra_ids, ids)[:50]
    extra_raw = extra_raw[: len(extra_ids)]
    engine.add(extra_ids, as_unit_rows(extra_raw), np.full(len(extra_ids), 1, np.int32), np.full(len(extra_ids), 5.0))
    all_ids = np.concatenate([ids, extra_ids])
    all_raw = np.concatenate([raw, extra_raw])
    all_ns = np.concatenate([ns, np.full(len(extra_ids), 1)])
    all_t = np.concatenate([t, np.full(len(extra_ids), 5.0)])
    all_alive = np.concatenate([alive, np.ones(len(extra_ids), bool)])
    eligible = eligible_mask(all_ns, all_t, namespace=1, since=2.0, until=8.0, alive=all_alive)
    check(engine, queries, 40, flt, all_ids, all_raw, eligible, context="adds after compact")


# -- capacity and ids ----------------------------------------------------------------------------


def test_capacity_grows_from_one(rng):
    dim = 6
    engine = NumpyEngine(dim, capacity=1)
    assert engine.capacity == 1
    ids, raws = [], []
    sizes = [1] * 20 + [3, 7, 1, 64, 2, 200, 5]
    next_id = 10**12
    queries = queries_for(rng, 3, dim)
    for step, size in enumerate(sizes):
        raw = rng.standard_normal((size, dim)).astype(np.float32)
        new = np.arange(next_id, next_id + 7 * size, 7, dtype=np.int64)  # non-contiguous
        next_id += 7 * size + 11
        engine.add(new, as_unit_rows(raw), np.zeros(size, np.int32), np.zeros(size))
        ids.append(new)
        raws.append(raw)
        assert engine.capacity >= len(engine) == sum(len(i) for i in ids)
        if step % 5 == 0 or step == len(sizes) - 1:
            all_ids, all_raw = np.concatenate(ids), np.concatenate(raws)
            for k in (1, 4, 256):
                got_ids, got_scores = check(engine, queries, k, Filter(), all_ids, all_raw, context=f"growth step {step}")
    # Doubling, not +1 per add: a few hundred rows take a handful of resizes.
    assert engine.capacity < 4 * len(engine)


def test_extreme_int64_ids_round_trip(rng):
    dim = 5
    ids = np.array([2**63 - 1, 1, 2**62 + 3, 10**18, 2**31, 2**32 + 1, 999_999_999_999], np.int64)
    raw = rng.standard_normal((len(ids), dim)).astype(np.float32)
    engine = NumpyEngine(dim, capacity=2)
    engine.add(ids, as_unit_rows(raw), np.zeros(len(ids), np.int32), np.zeros(len(ids)))
    q = as_unit_rows(raw)  # each vector's own best match is itself
    got_ids, got_scores = check(engine, q, len(ids), Filter(), ids, raw, context="extreme ids")
    assert got_ids[:, 0].tolist() == ids.tolist()
    assert engine.delete([2**63 - 1]) == 1 and (2**63 - 1) not in engine


# -- misuse fails loudly ----------------------------------------------------------------------------


def test_bad_shapes_and_k_raise():
    engine = NumpyEngine(4)
    with pytest.raises(InvalidArgument):
        engine.add(np.array([1, 2]), np.ones((3, 4), np.float32), 0, 0.0)
    with pytest.raises(InvalidArgument):
        engine.add(np.array([1]), np.ones((1, 5), np.float32), 0, 0.0)
    engine.add(np.array([1, 2]), as_unit_rows(np.eye(4)[:2]), 0, 0.0)
    with pytest.raises(InvalidQuery):
        engine.search(np.ones((1, 3), np.float32), 1)
    with pytest.raises(InvalidQuery):
        engine.search(np.ones(4, np.float32), 1)
    with pytest.raises(InvalidQuery):
        engine.search(as_unit_rows(np.ones((1, 4))), 0)
    with pytest.raises(InvalidArgument):
        NumpyEngine(0)
    assert len(engine) == 2


def test_duplicate_ids_are_refused_and_change_nothing(rng):
    engine = NumpyEngine(4)
    engine.add(np.array([10, 20, 30]), as_unit_rows(rng.standard_normal((3, 4))), 0, 0.0)
    with pytest.raises(InvalidArgument, match="duplicate"):
        engine.add(np.array([40, 40]), as_unit_rows(rng.standard_normal((2, 4))), 0, 0.0)
    with pytest.raises(InvalidArgument, match="already present"):
        engine.add(np.array([50, 20]), as_unit_rows(rng.standard_normal((2, 4))), 0, 0.0)
    assert len(engine) == 3 and 40 not in engine and 50 not in engine


def test_id_already_present_is_refused_beyond_the_first_thousand_of_an_add(rng):
    """BUG: RowTable.check_new_ids only looks at ids[:1000] for clashes.

    An add of more than 1000 rows whose 1001st id is already present is accepted: the old row
    stays live under the same id, so the id can come back twice in one result.
    """
    dim = 4
    engine = NumpyEngine(dim)
    engine.add(np.array([5_000], np.int64), as_unit_rows(np.ones((1, dim))), 0, 0.0)
    new_ids = np.arange(10_000, 11_500, dtype=np.int64)
    new_ids[1200] = 5_000  # clashes with the live row
    with pytest.raises(InvalidArgument, match="already present"):
        engine.add(new_ids, as_unit_rows(rng.standard_normal((len(new_ids), dim))), 0, 0.0)
    assert len(engine) == 1


# -- property test: random operation sequences vs a dict model ---------------------------------

_OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 9), st.integers(0, 2), st.integers(0, 4)),
    st.tuples(st.just("delete"), st.lists(st.integers(0, 10_000), min_size=1, max_size=6)),
    st.tuples(st.just("search"), st.integers(1, 40), st.sampled_from([None, 0, 1, 2, 5]),
              st.sampled_from([None, 1, 2]), st.sampled_from([None, 3, 4])),
    st.tuples(st.just("compact")),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, min_size=1, max_size=40), data_seed=st.integers(0, 2**32 - 1),
       capacity=st.integers(1, 8), grid=st.booleans())
def test_random_operation_sequences_match_a_dict_model(ops, data_seed, capacity, grid):
    """Hypothesis reports the failing example (ops, data_seed) itself; replay with @reproduce_failure."""
    dim = 3
    rng = np.random.default_rng(data_seed)
    # A small compaction threshold so that random sequences exercise automatic compaction.
    with mock.patch.object(engine_base, "_COMPACT_MIN_TOMBSTONES", 3):
        engine = NumpyEngine(dim, capacity=capacity)
        model: dict[int, tuple[np.ndarray, int, float]] = {}
        next_id = 7
        for op in ops:
            if op[0] == "add":
                _, n, namespace, stamp = op
                if grid:  # small integer grid: many exact ties
                    raw = rng.integers(-1, 2, size=(n, dim)).astype(np.float32)
                    raw[~raw.any(axis=1), 0] = 1.0
                else:
                    raw = rng.standard_normal((n, dim)).astype(np.float32)
                new = np.arange(next_id, next_id + 3 * n, 3, dtype=np.int64) * 1_000_003
                next_id += 3 * n + 1
                engine.add(new, as_unit_rows(raw), np.int32(namespace), float(stamp))
                for i, v in zip(new.tolist(), raw):
                    model[i] = (v, namespace, float(stamp))
            elif op[0] == "delete":
                known = sorted(model)
                victims = [known[j % len(known)] for j in op[1]] if known else []
                victims.append(123)  # never an id
                expected = len(set(victims) & set(model))
                assert engine.delete(np.array(victims, np.int64)) == expected
                for v in victims:
                    model.pop(v, None)
            elif op[0] == "compact":
                engine.compact()
                assert engine.tombstones == 0
            else:
                _, k, namespace, since, until = op
                ids, vectors, namespaces, created = model_arrays(model)
                q = as_unit_rows(rng.standard_normal((2, dim)))
                eligible = eligible_mask(namespaces, created, namespace=namespace, since=since, until=until)
                check(engine, q, k, Filter(namespace, since, until), ids, vectors, eligible if len(ids) else None,
                      context=f"op {op}")
            assert len(engine) == len(model)
            assert engine.capacity >= engine.rows.size
            for i in list(model)[:5]:
                assert i in engine


def test_reference_helper_agrees_with_itself(rng):
    """The reference is the yardstick: check that it accepts its own answer and rejects a wrong one."""
    ids = random_ids(rng, 50)
    raw = rng.standard_normal((50, 8))
    q = rng.standard_normal((3, 8))
    ref_ids, ref_scores = reference_topk(ids, raw, q, 5)
    assert_topk_matches(ref_ids, ref_scores.astype(np.float32), ids, raw, q, 5)
    wrong = ref_ids.copy()
    wrong[0, 0] = ref_ids[0, 0] + 1 if ref_ids[0, 0] + 1 not in ids else ref_ids[0, 0] + 3
    with pytest.raises(AssertionError):
        assert_topk_matches(wrong, ref_scores.astype(np.float32), ids, raw, q, 5)
    swapped = ref_ids.copy()
    swapped[0, 4] = ids[~np.isin(ids, ref_ids[0])][0]  # a real id that is not in the top 5
    with pytest.raises(AssertionError):
        assert_topk_matches(swapped, ref_scores.astype(np.float32), ids, raw, q, 5, score_tol=10.0)


# -- passes of a few queries: kalos.engine._dots ------------------------------------------

from kalos.engine import numpy_engine  # noqa: E402

_dots = numpy_engine._dots
needs_dots = pytest.mark.skipif(_dots is None, reason="kalos.engine._dots was not built (no C compiler)")


def test_the_native_scores_are_built_where_a_compiler_is():
    """The project's own install builds kalos.engine._dots (setup.py) wherever a C compiler
    exists, CI included: a build that failed there must not leave its tests skipped unseen."""
    import shutil
    import sysconfig

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the engine runs on BLAS alone")
    assert _dots is not None, "a C compiler exists but kalos.engine._dots was not built: pip install -e . again"


@needs_dots
@pytest.mark.parametrize("dim", [1, 3, 15, 16, 17, 33, 100, 384])
def test_dots_kernel_matches_float64_every_shape_and_range(rng, dim):
    """Every tile shape of the kernel (whole tiles of 2 rows x 4 queries, the odd row, the
    queries past the last whole tile, dimensions past the last 16 lanes), over sub-ranges
    of rows: the scores equal float64's, and nothing outside [lo, hi) is written."""
    for n in (1, 2, 7, 64):
        rows = rng.standard_normal((n, dim)).astype(np.float32)
        for nq in range(1, 10):
            queries = rng.standard_normal((nq, dim)).astype(np.float32)
            want = queries.astype(np.float64) @ rows.astype(np.float64).T
            tolerance = 1e-5 * (1 + np.abs(queries).astype(np.float64) @ np.abs(rows).astype(np.float64).T)
            for lo, hi in {(0, n), (1 if n > 1 else 0, n), (0, n - 1), (n // 3, n - n // 3)}:
                out = np.full((nq, n), np.nan, np.float32)
                _dots.scores(rows, queries, out, lo, hi)
                inside = out[:, lo:hi]
                assert np.all(np.abs(inside - want[:, lo:hi]) <= tolerance[:, lo:hi]), (dim, n, nq, lo, hi)
                assert np.isnan(out[:, :lo]).all() and np.isnan(out[:, hi:]).all(), (dim, n, nq, lo, hi)


@needs_dots
def test_dots_refuses_bad_buffers_and_writes_nothing():
    rows = np.ones((6, 8), np.float32)
    queries = np.ones((4, 8), np.float32)
    out = np.full((4, 6), -1.0, np.float32)
    bad = [
        ((rows.astype(np.float64), queries, out, 0, 6), "rows must be a C-contiguous 2-d float32"),
        ((rows[:, ::2], queries[:, ::2], out, 0, 6), "rows must be a C-contiguous"),
        ((rows, queries.reshape(-1), out, 0, 6), "queries must be a C-contiguous 2-d float32"),
        ((rows, np.ones((4, 4), np.float32), out, 0, 6), "queries have 4 dimensions, rows 8"),
        ((rows, queries, out[:3], 0, 6), "out has 3 rows for 4 queries"),
        ((rows, queries, out[:, :5], 0, 5), "out must be a writable C-contiguous"),
        ((rows, queries, out, 0, 7), r"rows \[0, 7\) are not within the 6 rows"),
        ((rows, queries, out, 4, 2), r"rows \[4, 2\) are not within"),
        ((rows, queries, out, -1, 2), r"rows \[-1, 2\) are not within"),
        ((rows, queries, out[:, :5].copy(), 0, 6), r"and the 5 columns of out"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            _dots.scores(*args)
    assert (out == -1.0).all()
    readonly = out.copy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writable C-contiguous"):
        _dots.scores(rows, queries, readonly, 0, 6)


@needs_dots
@pytest.mark.parametrize("q", [2, 3, 5, 8, 13, 64, 65])
def test_passes_of_a_few_queries_match_float64_through_dots_and_blas(rng, monkeypatch, q):
    """The engine's pass of 2-64 queries through _dots, the rows cut into many slices (odd
    boundaries), with and without a filter, equals float64, and so does the BLAS path the
    engine takes without the extension; 65 queries take BLAS either way."""
    helpers, _cores = numpy_engine._slice_helpers()
    monkeypatch.setattr(numpy_engine, "_slice_helpers", lambda: (helpers, 7))  # as if on 7 cores:
    monkeypatch.setattr(numpy_engine, "_DOTS_MIN_SLICE", 97)  # 7 slices of the small engine's rows
    n, dim, k = 1001, 24, 8
    namespaces = rng.integers(0, 3, n)
    engine, ids, raw, ns, t = filled(rng, n, dim, namespaces=namespaces)
    queries = queries_for(rng, q, dim)
    used = []
    real = numpy_engine._dots.scores
    monkeypatch.setattr(numpy_engine._dots, "scores", lambda *a: (used.append(a[3:]), real(*a))[1])
    in_one = eligible_mask(ns, t, namespace=1)  # a third of the rows: scored, then masked
    for flt, eligible in ((Filter(), None), (Filter(namespace=1), in_one)):
        check(engine, queries, k, flt, ids, raw, eligible, context=f"dots q={q} {flt}")
    if q <= numpy_engine._DOTS_MAX_Q:
        starts = sorted({lo for lo, _hi in used})
        assert len(starts) == 7 and all(lo % 2 == 0 for lo in starts), starts  # whole tiles of rows
    else:
        assert not used
    monkeypatch.setattr(numpy_engine, "_dots", None)
    for flt, eligible in ((Filter(), None), (Filter(namespace=1), in_one)):
        check(engine, queries, k, flt, ids, raw, eligible, context=f"blas q={q} {flt}")


@needs_dots
def test_a_pass_after_the_helper_threads_are_gone_is_scored_by_the_caller(rng, monkeypatch):
    """At interpreter shutdown the pool takes no work: the calling thread scores every slice."""
    from concurrent.futures import ThreadPoolExecutor

    gone = ThreadPoolExecutor(1)
    gone.shutdown()
    monkeypatch.setattr(numpy_engine, "_slice_helpers", lambda: (gone, 4))
    monkeypatch.setattr(numpy_engine, "_DOTS_MIN_SLICE", 50)
    engine, ids, raw, _ns, _t = filled(rng, 400, 12)
    check(engine, queries_for(rng, 6, 12), 5, Filter(), ids, raw, context="pool shut down")


def test_the_scoring_threads_follow_the_blas_thread_limits(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    for name in numpy_engine._THREAD_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert numpy_engine._threads() == cores
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert numpy_engine._threads() == 1
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "many")  # not a count: ignored
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 5))  # more than the cores: the cores
    assert numpy_engine._threads() == cores


_GUARDED_CALLS = r"""
import ctypes, mmap, sys
import numpy as np
from kalos.engine import _dots

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
held = []

def fenced(shape, flush_end):
    # float32 array with a no-access page right before and right after it, placed against one
    size = int(np.prod(shape)) * 4
    pages = -(-size // PAGE)
    m = mmap.mmap(-1, (pages + 2) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mprotect(base, PAGE, 0) == 0 and libc.mprotect(base + (pages + 1) * PAGE, PAGE, 0) == 0
    start = PAGE + (pages * PAGE - size if flush_end else 0)
    held.append(m)
    return np.frombuffer(m, np.float32, int(np.prod(shape)), start).reshape(shape)

rng = np.random.default_rng(int(sys.argv[1]))
for _ in range(600):
    dim = int(rng.choice([1, 3, 15, 16, 17, 33, 64, 65, 129, 385]))
    n, nq = int(rng.integers(1, 30)), int(rng.integers(1, 11))
    lo = int(rng.integers(0, n + 1)); hi = int(rng.integers(lo, n + 1))
    flush_end = bool(rng.integers(0, 2))
    rows, queries = fenced((n, dim), flush_end), fenced((nq, dim), flush_end)
    rows[...] = rng.standard_normal((n, dim)); queries[...] = rng.standard_normal((nq, dim))
    out = fenced((nq, n), flush_end)
    out[...] = np.nan
    _dots.scores(rows, queries, out, lo, hi)
    want = queries.astype(np.float64) @ rows.astype(np.float64).T
    assert np.allclose(out[:, lo:hi], want[:, lo:hi], rtol=1e-4, atol=1e-4), (dim, n, nq, lo, hi)
    assert np.isnan(out[:, :lo]).all() and np.isnan(out[:, hi:]).all(), (dim, n, nq, lo, hi)
    held.clear()
print("fenced calls ok")
"""


@needs_dots
def test_dots_reads_and_writes_nothing_outside_its_arrays(seed):
    """Every array placed against a no-access page (before or after it): a load or a store past
    either end faults, in a child process, so that the fault fails this test instead of the run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _GUARDED_CALLS, str(seed)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "fenced calls ok" in done.stdout, (done.returncode, done.stdout, done.stderr)


@needs_dots
def test_groups_with_their_own_filters_and_k_equal_their_searches_one_by_one(rng, monkeypatch):
    """search_groups: the groups that scan every row are scored in one _dots call, each then
    selected under its own filter; a row-list filter (selective) and an empty group are searched
    alone; every answer equals search()'s for the group and float64's."""
    n, dim = 3000, 24
    namespaces = rng.integers(0, 3, n)
    namespaces[:40] = 7  # a rare namespace: a row list
    created = rng.uniform(0, 100, n)
    engine, ids, raw, ns, t = filled(rng, n, dim, namespaces=namespaces, created_at=created)
    groups = [
        (queries_for(rng, 3, dim), 8, Filter()),
        (queries_for(rng, 2, dim), 5, Filter(namespace=1)),
        (queries_for(rng, 1, dim), 16, Filter(since=20.0, until=70.0)),
        (queries_for(rng, 2, dim), 4, Filter(namespace=7)),  # selective: a row list
        (np.zeros((0, dim), np.float32), 3, Filter(namespace=2)),
        (queries_for(rng, 1, dim), n + 5, Filter(namespace=2)),  # k past the rows: padded
    ]
    scored = []
    real = numpy_engine.NumpyEngine._dot_scores
    monkeypatch.setattr(numpy_engine.NumpyEngine, "_dot_scores",
                        lambda self, v, q: (scored.append(len(q)), real(self, v, q))[1])
    answers = engine.search_groups(groups)
    assert scored == [3 + 2 + 1 + 1]  # one pass for the four groups that scan every row
    for (queries, k, flt), (got_ids, got_scores) in zip(groups, answers):
        want_ids, want_scores = engine.search(queries, k, flt)
        assert got_ids.shape == want_ids.shape == (len(queries), k)
        assert_same_answers(got_ids, got_scores, want_ids, want_scores, context=f"group {flt}")
        if len(queries) and k <= n:
            eligible = eligible_mask(ns, t, namespace=flt.namespace, since=flt.since, until=flt.until)
            assert_topk_matches(got_ids, got_scores, ids, raw, queries, k, eligible, context=f"group {flt}")
    # More queries than one _dots pass takes: each group on its own, the same answers.
    big = [(queries_for(rng, 40, dim), 8, Filter()), (queries_for(rng, 40, dim), 8, Filter(namespace=1))]
    for (queries, k, flt), (got_ids, _s) in zip(big, engine.search_groups(big)):
        np.testing.assert_array_equal(got_ids, engine.search(queries, k, flt)[0])


@pytest.mark.parametrize("budget_rows", [0, 300, 10_000])
def test_row_lists_of_many_namespaces_in_turn_stay_right_within_their_budget(rng, monkeypatch, budget_rows):
    """Agents each in a namespace of its own ask in turn, one of them between every other:
    each namespace's row list is cached (up to _ROW_LISTS, the least recently used dropped
    first, so the frequent one stays; gathered while the rows gathered stay within
    _ROW_LIST_CACHE_BYTES) and answers equal float64's; adds, deletes and a compaction make
    new row lists."""
    n, dim, spaces = 4000, 16, 40  # 100 rows a namespace: selective
    monkeypatch.setattr(numpy_engine, "_ROW_LIST_CACHE_BYTES", budget_rows * dim * 4)
    monkeypatch.setattr(numpy_engine, "_ROW_LISTS", 24)
    engine, ids, raw, ns, t = filled(rng, n, dim, namespaces=np.arange(n) % spaces)
    for turn in range(3):
        for space in range(1, spaces):
            for asked in (space, 0):  # namespace 0 between every other
                queries = queries_for(rng, 1 + asked % 3, dim)
                check(engine, queries, 8, Filter(namespace=asked), ids, raw, ns == asked,
                      context=f"turn {turn} ns {asked}")
            lists = engine._row_lists
            assert id(engine.rows.mask(Filter(namespace=0))) in lists  # (the most recently used)
            # After the writes the old masks' lists are let go, not kept until they age out.
            assert len(lists) == min(space + 1, 24)
            gathered = sum(selected[1].nbytes for _ref, selected in lists.values()
                           if selected is not None and selected[1] is not None)
            assert gathered == engine._gathered_bytes <= budget_rows * dim * 4
        if turn == 0:  # new rows in every namespace, and some deleted: no row list may be reused
            more_raw = rng.standard_normal((400, dim)).astype(np.float32)
            more_ids = random_ids(rng, 400) + 2**50
            engine.add(more_ids, as_unit_rows(more_raw), np.arange(400, dtype=np.int32) % spaces, np.zeros(400))
            gone = ids[::7]
            engine.delete(gone)
            keep = ~np.isin(ids, gone)
            ids, raw = np.concatenate([ids[keep], more_ids]), np.concatenate([raw[keep], more_raw])
            ns, t = np.concatenate([ns[keep], np.arange(400) % spaces]), np.zeros(len(ids))
        elif turn == 1:  # the rows move: a list of the old row numbers would point elsewhere
            engine.compact()
            assert engine.rows.size == len(ids)
    if budget_rows >= 100:
        assert engine._gathered_bytes > 0  # (the budget held some: the gathered path was taken)


def test_a_row_list_left_ungathered_is_gathered_once_the_bytes_allow(rng, monkeypatch):
    n, dim = 3000, 8
    monkeypatch.setattr(numpy_engine, "_ROW_LIST_CACHE_BYTES", 2 * 100 * dim * 4)  # two lists of 100 rows
    monkeypatch.setattr(numpy_engine, "_ROW_LISTS", 3)
    created = np.arange(n, dtype=np.float64)
    engine, ids, raw, ns, t = filled(rng, n, dim, namespaces=np.arange(n) % 30, created_at=created)
    for space in (0, 1, 2):  # 0 and 1 gathered; 2 not: the bytes are full
        check(engine, queries_for(rng, 2, dim), 5, Filter(namespace=space), ids, raw, ns == space)
    late = engine._row_lists[id(engine.rows.mask(Filter(namespace=2)))][1]
    assert late[1] is None
    # A filter that is no row list (most rows pass) takes the oldest's place: 0's bytes are free.
    check(engine, queries_for(rng, 2, dim), 5, Filter(since=10.0), ids, raw, t >= 10.0)
    assert id(engine.rows.mask(Filter(namespace=0))) not in engine._row_lists
    check(engine, queries_for(rng, 2, dim), 5, Filter(namespace=2), ids, raw, ns == 2)
    rows, gathered = engine._row_lists[id(engine.rows.mask(Filter(namespace=2)))][1]
    np.testing.assert_array_equal(gathered, engine._vectors[rows])
    assert engine._gathered_bytes == 2 * 100 * dim * 4


def test_row_lists_go_with_the_masks_the_rows_drop(rng, monkeypatch):
    monkeypatch.setattr(engine_base, "MASKS_KEPT", 4)
    monkeypatch.setattr(numpy_engine, "_ROW_LISTS", 24)
    engine, ids, raw, ns, t = filled(rng, 2000, 8, namespaces=np.arange(2000) % 20)
    for space in range(12):
        check(engine, queries_for(rng, 1, 8), 5, Filter(namespace=space), ids, raw, ns == space)
        # The rows keep 4 masks; the lists of those they dropped go at the next miss (this one).
        assert len(engine._row_lists) == min(space + 1, 4)
        assert all(ref() is not None for ref, _selected in engine._row_lists.values())
