"""The where= clause compiler: validation messages, canonical keys, one-row semantics, and the
column index's vectorised mask against the one-row evaluator on generated clauses and rows."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kalos.errors import InvalidArgument, KalosError
from kalos.where import MetaColumns, Where, compile_where

KEYS = ["user_id", "year", "score", "flag", "tag"]
SCALARS = st.one_of(
    st.sampled_from(["alice", "bob", "carol", ""]),
    st.integers(-3, 3),
    st.sampled_from([0.5, -1.5, 2.0, 1e300]),
    st.booleans(),
)
NUMBERS = st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.5, 2.0]))


def field_clause():
    key = st.sampled_from(KEYS)
    op = st.one_of(
        st.tuples(st.sampled_from(["$eq", "$ne"]), SCALARS),
        st.tuples(st.sampled_from(["$gt", "$gte", "$lt", "$lte"]), NUMBERS),
        st.tuples(st.sampled_from(["$in", "$nin"]), st.lists(SCALARS, max_size=4)),
        st.tuples(st.just("$exists"), st.booleans()),
    )
    implicit = st.builds(lambda k, v: {k: v}, key, SCALARS)
    explicit = st.builds(lambda k, ops: {k: dict(ops)}, key, st.lists(op, min_size=1, max_size=3))
    return st.one_of(implicit, explicit)


CLAUSES = st.recursive(
    field_clause(),
    lambda inner: st.one_of(
        st.builds(lambda xs: {"$and": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"$or": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda x: {"$not": x}, inner),
        st.builds(lambda a, b: {**a, **b}, inner, inner),
    ),
    max_leaves=8,
)
METADATA = st.one_of(
    st.none(),
    st.dictionaries(st.sampled_from(KEYS + ["other"]), st.one_of(SCALARS, st.none(), st.just([1, 2])), max_size=5),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clause=CLAUSES, rows=st.lists(METADATA, min_size=1, max_size=12), dense_at=st.sampled_from([1, 3, 10**9]))
def test_mask_agrees_with_matches(clause, rows, dense_at):
    where = compile_where(clause)
    cols = MetaColumns(len(rows))
    cols._dense_at = lambda: dense_at  # dense columns, some of each, or none (the default here)
    cols.write(slice(0, len(rows)), rows)
    mask = where.mask(cols, len(rows))
    assert mask.dtype == bool and mask.shape == (len(rows),)
    assert mask.tolist() == [where.matches(m) for m in rows], where.key


@settings(max_examples=200, deadline=None)
@given(clause=CLAUSES, seed=st.integers(0, 2**32 - 1))
def test_key_ignores_dict_order_and_roundtrips(clause, seed):
    rng = random.Random(seed)

    def shuffled(x):
        if isinstance(x, dict):
            items = list(x.items())
            rng.shuffle(items)
            return {k: shuffled(v) for k, v in items}
        if isinstance(x, list):
            return [shuffled(v) for v in x]
        return x

    a, b = compile_where(clause), compile_where(shuffled(clause))
    assert a.key == b.key and a == b and hash(a) == hash(b)
    again = Where.from_json(a.key)  # the canonical form compiles to itself
    assert again == a and again.key == a.key
    assert compile_where(a) is a


def test_semantics_of_missing_keys_and_types():
    rows = [
        {"user_id": "alice", "year": 2021, "flag": True},
        {"user_id": "bob", "year": 2019.5},
        {"year": "2022"},  # a string, not a number
        {"flag": 1},  # a number, not a boolean
        {"user_id": None},
        None,
    ]

    def hits(clause):
        w = compile_where(clause)
        return [i for i, m in enumerate(rows) if w.matches(m)]

    assert hits({"user_id": "alice"}) == [0]
    assert hits({"user_id": {"$ne": "alice"}}) == [1, 2, 3, 4, 5]  # missing keys pass $ne
    assert hits({"user_id": {"$nin": ["alice", "bob"]}}) == [2, 3, 4, 5]
    assert hits({"user_id": {"$exists": True}}) == [0, 1, 4]  # null exists
    assert hits({"user_id": {"$exists": False}}) == [2, 3, 5]
    assert hits({"year": {"$gte": 2020}}) == [0]  # "2022" is not a number: false, no error
    assert hits({"year": {"$lt": 2020}}) == [1]
    assert hits({"year": {"$gt": 2000, "$lt": 2020}}) == [1]
    assert hits({"flag": True}) == [0]  # the number 1 is not True
    assert hits({"flag": 1}) == [3]
    assert hits({"flag": {"$in": [True, 1]}}) == [0, 3]
    assert hits({"$or": [{"user_id": "bob"}, {"flag": True}]}) == [0, 1]
    assert hits({"$not": {"year": {"$exists": True}}}) == [3, 4, 5]
    assert hits({"user_id": {"$in": []}}) == []
    assert hits({"user_id": {"$nin": []}}) == [0, 1, 2, 3, 4, 5]
    assert hits({}) == [0, 1, 2, 3, 4, 5]
    assert hits({"year": 2021.0}) == [0]  # numbers compare as float64


def test_canonical_key_and_helpers():
    w = compile_where({"year": {"$lt": 2030, "$gte": 2020}, "user_id": "alice"})
    assert w.key == '{"$and":[{"user_id":{"$eq":"alice"}},{"year":{"$gte":2020}},{"year":{"$lt":2030}}]}'
    assert w.fields == {"user_id", "year"}
    assert json.loads(w.key) == w.to_dict()
    assert compile_where({}).is_trivial and not w.is_trivial
    assert compile_where({"a": 1}) != compile_where({"a": True})  # a boolean is not a number
    assert compile_where({"a": "x"}).key == '{"a":{"$eq":"x"}}'
    hash(w)
    with pytest.raises(Exception):
        w.key = "x"  # immutable


@pytest.mark.parametrize(
    "clause, message",
    [
        ({"user_id": {"$regex": "a.*"}}, "where: unknown operator '$regex' at user_id"),
        ({"$nor": [{"a": 1}]}, "where: unknown operator '$nor' at where"),
        ({"$eq": 1}, "where: unknown operator '$eq' at where (field operators go inside a key"),
        ({"a": object()}, "where: value at a must be a string, number or boolean, got object"),
        ({"a": None}, "where: value at a must be a string, number or boolean, got NoneType"),
        ({"a": [1, 2]}, "where: value at a must be a string, number or boolean, got list"),
        ({"a": float("nan")}, "where: nan at a is not a JSON number"),
        ({"a": {"$eq": float("inf")}}, "where: inf at a is not a JSON number"),
        ({"a": 10**400}, "where: number out of range at a"),
        ({"a": {"$gt": "x"}}, "where: $gt takes a number at a, got 'x'"),
        ({"a": {"$lte": True}}, "where: $lte takes a number at a, got True"),
        ({"a": {"$in": "abc"}}, "where: $in takes a list at a, got str"),
        ({"a": {"$nin": [1, {}]}}, "where: value at a.$nin[1] must be a string, number or boolean, got dict"),
        ({"a": {"$exists": 1}}, "where: $exists takes true or false at a, got 1"),
        ({"a": {}}, "where: no operator at a"),
        ({"a": {"b": 1}}, "where: expected an operator at a, got 'b' (only top-level metadata keys"),
        ({"$and": []}, "where: $and takes a non-empty list of clauses at $and"),
        ({"$or": {"a": 1}}, "where: $or takes a non-empty list of clauses at $or"),
        ({"$or": [{"a": 1}, 3]}, "where: $or takes clauses (dicts) at $or[1], got int"),
        ({"$and": [{"b": {"$regex": 1}}]}, "where: unknown operator '$regex' at $and[0].b"),
        ({"$not": [{"a": 1}]}, "where: $not takes a clause (a dict) at $not, got list"),
        ({1: "a"}, "where: keys must be strings, got 1"),
        ({"": 1}, "where: an empty metadata key"),
        ([{"a": 1}], "where must be a dict of metadata conditions, got list"),
        ("user_id=alice", "where must be a dict of metadata conditions, got str"),
    ],
)
def test_errors_name_the_bad_part(clause, message):
    with pytest.raises(InvalidArgument) as err:
        compile_where(clause)
    assert isinstance(err.value, KalosError)
    assert str(err.value).startswith(message), str(err.value)


def test_depth_and_size_limits():
    deep: dict = {"a": 1}
    for _ in range(40):
        deep = {"$not": deep}
    with pytest.raises(InvalidArgument, match="nested deeper"):
        compile_where(deep)
    with pytest.raises(InvalidArgument, match="longer than"):
        compile_where({"a": {"$in": ["x" * 100] * 1000}})
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        Where.from_json("{user_id: 1}")
    with pytest.raises(InvalidArgument, match="where must be a dict"):
        Where.from_json("[1]")


@pytest.mark.parametrize("dense_at", [None, 4], ids=["sparse", "dense"])
def test_columns_follow_writes_compaction_and_growth(monkeypatch, dense_at):
    if dense_at is not None:  # keys held by 4 rows or more get dense columns
        monkeypatch.setattr(MetaColumns, "_dense_at", lambda self: dense_at)
    rng = np.random.default_rng(7)
    print("seed 7")
    n = 300
    metas = [
        {"user_id": f"u{rng.integers(5)}", "year": int(rng.integers(2015, 2025))} if rng.random() < 0.9 else None
        for _ in range(n)
    ]
    cols = MetaColumns(16)
    for s in range(0, n, 50):  # appended in batches, growing like a RowTable
        while cols.capacity < s + 50:
            cols.resize(cols.capacity * 2)
        cols.write(slice(s, s + 50), metas[s : s + 50])
    where = compile_where({"$or": [{"user_id": "u1"}, {"year": {"$gte": 2023}}]})
    assert (cols._cols["user_id"].tag is not None) == (dense_at is not None)
    assert where.mask(cols, n).tolist() == [where.matches(m) for m in metas]
    changed = rng.choice(n, 40, replace=False)
    for r in changed.tolist():  # in-place metadata changes (update / upsert in place)
        metas[r] = {"user_id": "u1"} if r % 2 else {"tag": "x"}
    cols.write(changed, [metas[r] for r in changed.tolist()])
    assert where.mask(cols, n).tolist() == [where.matches(m) for m in metas]
    keep = np.sort(rng.choice(n, 120, replace=False))
    cols.compact(keep)
    kept = [metas[i] for i in keep.tolist()]
    assert where.mask(cols, len(keep)).tolist() == [where.matches(m) for m in kept]
    assert compile_where({"tag": {"$exists": False}}).mask(cols, len(keep)).tolist() == [
        not (m and "tag" in m) for m in kept
    ]
    assert cols.row(0) == {k: float(v) if isinstance(v, int) else v for k, v in (kept[0] or {}).items()}


def test_the_clients_memo_tells_equal_looking_clauses_apart():
    from kalos.client.requests import where_clause

    one, true, one_f = where_clause({"a": 1}), where_clause({"a": True}), where_clause({"a": 1.0})
    assert one.key == '{"a":{"$eq":1}}' and true.key == '{"a":{"$eq":true}}' and one_f.key == '{"a":{"$eq":1.0}}'
    assert where_clause({"a": 1}) is one  # remembered
    assert where_clause({}) is None and where_clause(None) is None
    with pytest.raises(InvalidArgument, match="keys must be strings"):
        where_clause({1: "a", "b": 2})
    with pytest.raises(InvalidArgument, match="unknown operator"):
        where_clause({"a": {"$regex": "x"}})
    with pytest.raises(InvalidArgument, match="unknown operator"):
        where_clause({"a": {"$regex": "x"}})  # a refused clause is not remembered


@pytest.mark.parametrize("dense_at", [None, 4], ids=["sparse", "dense"])
def test_compaction_forgets_the_keys_and_strings_of_rows_that_are_gone(monkeypatch, dense_at):
    """Memories that come and go with one-off keys or values (a run id, a session): once their
    rows are compacted away, their columns and interned strings go too (they were kept for
    ever, and every in-place write walked every column ever made). What stays answers as before."""
    if dense_at is not None:
        monkeypatch.setattr(MetaColumns, "_dense_at", lambda self: dense_at)
    cols = MetaColumns(64)
    kept_meta = [{"user": f"u{i % 3}", "year": 2020 + i} for i in range(8)]
    cols.write(slice(0, 8), kept_meta)
    size = 8
    for round_ in range(20):
        churn = [{"user": f"run-{round_}-{i}", f"once-{round_}-{i}": i} for i in range(8)]
        cols.write(slice(size, size + 8), churn)
        cols.compact(np.arange(8))  # the churn is deleted and compacted away
        size = 8
    assert sorted(cols.keys) == ["user", "year"]
    assert sorted(cols._cols["user"].codes) == ["u0", "u1", "u2"]
    for clause in ({"user": "u1"}, {"user": {"$in": ["u0", "u2"]}}, {"year": {"$gte": 2024}},
                   {"user": {"$ne": "u0"}}, {"once-3-1": {"$exists": True}}):
        where = compile_where(clause)
        assert where.mask(cols, 8).tolist() == [where.matches(m) for m in kept_meta], clause
    assert [cols.row(r) for r in range(8)] == [{"user": m["user"], "year": float(m["year"])} for m in kept_meta]
    grown = cols.nbytes()
    cols.write(slice(8, 16), [{"user": f"extra-{i}"} for i in range(8)])
    assert cols.nbytes() > grown  # interned strings count
