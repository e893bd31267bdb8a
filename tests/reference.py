"""The float64 brute-force reference every exactness test compares against, and the comparison.

``reference_topk`` scores every eligible row in float64 (vectors and queries normalised in
float64) and returns the top-k ids and scores, padded with id -1 / score -inf like the
engines. ``assert_topk_matches`` checks an engine's (or the sidecar's) answer against the
float64 scores without demanding a particular order among exact or near ties:

* the number of hits is ``min(k, eligible rows)`` and the tail is padding (-1, -inf);
* no id twice, every id eligible (right namespace, time window, not deleted);
* each returned score is the float64 score of that id (within ``score_tol``);
* scores are non-increasing;
* every returned id scores at least the reference k-th best minus ``tie_tol``, and every
  eligible id that scores more than the k-th best plus ``tie_tol`` was returned. So ids may
  differ from the reference only among rows whose float64 scores are within ``tie_tol`` of
  the k-th best (ties and near-ties).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

MISSING_ID = -1
TIE_TOL = 1e-6
SCORE_TOL = 1e-5


def unit64(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit norm in float64 (a 1-D input is treated as one row)."""
    a = np.atleast_2d(np.asarray(x, dtype=np.float64))
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def reference_scores(vectors: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Float64 cosine scores ``[Q, N]``."""
    if len(vectors) == 0:
        return np.zeros((len(np.atleast_2d(queries)), 0))
    return unit64(queries) @ unit64(vectors).T


def reference_topk(
    ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray, k: int, eligible: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ``(ids[Q, k] int64, scores[Q, k] float64)`` over the rows where ``eligible`` holds."""
    ids = np.asarray(ids, dtype=np.int64)
    scores = reference_scores(vectors, queries)
    q = len(scores)
    if eligible is not None:
        scores = np.where(np.asarray(eligible, dtype=bool)[None, :], scores, -np.inf)
    out_ids = np.full((q, k), MISSING_ID, np.int64)
    out_scores = np.full((q, k), -np.inf)
    if scores.shape[1]:
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(scores, order, axis=1)
        m = order.shape[1]
        out_ids[:, :m] = np.where(np.isfinite(top), ids[order], MISSING_ID)
        out_scores[:, :m] = top
    return out_ids, out_scores


def _eligible_scores(ids: np.ndarray, scores_row: np.ndarray, eligible: np.ndarray | None) -> dict[int, float]:
    keep = np.ones(len(ids), bool) if eligible is None else np.asarray(eligible, dtype=bool)
    return dict(zip(ids[keep].tolist(), scores_row[keep].tolist()))


def assert_topk_matches(
    got_ids: np.ndarray,
    got_scores: np.ndarray,
    ids: np.ndarray,
    vectors: np.ndarray,
    queries: np.ndarray,
    k: int,
    eligible: np.ndarray | None = None,
    *,
    tie_tol: float = TIE_TOL,
    score_tol: float = SCORE_TOL,
    padded: bool = True,
    context: str = "",
) -> None:
    """Asserts that ``got_*`` (``[Q, k]``, or ``[Q, <=k]`` when ``padded`` is False) is a top-k.

    ``ids``/``vectors``/``eligible`` describe every row the searcher holds (deleted rows may
    simply be left out of ``ids`` or marked not eligible).
    """
    ids = np.asarray(ids, dtype=np.int64)
    queries = np.atleast_2d(np.asarray(queries))
    got_ids = np.atleast_2d(np.asarray(got_ids))
    got_scores = np.atleast_2d(np.asarray(got_scores))
    assert got_ids.shape == got_scores.shape, f"{context}: ids {got_ids.shape} vs scores {got_scores.shape}"
    assert len(got_ids) == len(queries), f"{context}: {len(got_ids)} result rows for {len(queries)} queries"
    if padded:
        assert got_ids.shape[1] == k, f"{context}: result width {got_ids.shape[1]}, expected k={k}"
    assert got_ids.dtype == np.int64, f"{context}: ids dtype {got_ids.dtype}"
    all_scores = reference_scores(vectors, queries)
    n_eligible = len(ids) if eligible is None else int(np.count_nonzero(eligible))
    expected = min(k, n_eligible)
    for qi in range(len(queries)):
        where = f"{context} query {qi}"
        row_ids = got_ids[qi]
        row_scores = got_scores[qi].astype(np.float64)
        valid = row_ids != MISSING_ID
        n = int(valid.sum())
        assert n == expected, f"{where}: {n} hits, expected min(k={k}, eligible={n_eligible}) = {expected}"
        assert valid[:n].all(), f"{where}: padding (-1) before real hits: {row_ids.tolist()}"
        if padded:
            assert np.all(row_scores[n:] == -np.inf), f"{where}: padding scores are not -inf: {row_scores[n:]}"
        hits, hit_scores = row_ids[:n], row_scores[:n]
        assert len(set(hits.tolist())) == n, f"{where}: an id came back twice: {hits.tolist()}"
        truth = _eligible_scores(ids, all_scores[qi], eligible)
        foreign = [int(i) for i in hits if int(i) not in truth]
        assert not foreign, f"{where}: ids {foreign[:10]} are not eligible (deleted, other namespace/time, or unknown)"
        if n == 0:
            continue
        assert np.all(np.isfinite(hit_scores)), f"{where}: non-finite score among hits: {hit_scores}"
        assert np.all(np.diff(hit_scores) <= 0), f"{where}: scores not sorted best first: {hit_scores}"
        ref = np.array([truth[int(i)] for i in hits])
        worst = float(np.max(np.abs(ref - hit_scores)))
        assert worst <= score_tol, f"{where}: a returned score is off its float64 value by {worst:.3g}"
        ranked = np.sort(np.fromiter(truth.values(), dtype=np.float64))[::-1]
        kth = ranked[expected - 1]
        low = [(int(i), s) for i, s in zip(hits, ref) if s < kth - tie_tol]
        assert not low, f"{where}: ids {low[:5]} score below the k-th best {kth:.9f} (not a tie)"
        returned = set(hits.tolist())
        missing = [(i, s) for i, s in truth.items() if s > kth + tie_tol and i not in returned]
        assert not missing, f"{where}: ids {missing[:5]} beat the k-th best {kth:.9f} but were not returned"


def eligible_mask(
    namespaces: Sequence[object] | np.ndarray,
    created_at: np.ndarray,
    *,
    namespace: object | None = None,
    since: float | None = None,
    until: float | None = None,
    alive: np.ndarray | None = None,
) -> np.ndarray:
    """Rows a search with these filters may return: namespace (None: all), created_at in [since, until)."""
    created_at = np.asarray(created_at, dtype=np.float64)
    mask = np.ones(len(created_at), bool) if alive is None else np.asarray(alive, dtype=bool).copy()
    if namespace is not None:
        mask &= np.asarray([ns == namespace for ns in namespaces], dtype=bool)
    if since is not None:
        mask &= created_at >= since
    if until is not None:
        mask &= created_at < until
    return mask


def model_arrays(model: Mapping[int, tuple]) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
    """``(ids, vectors, namespaces, created_at)`` of a dict model ``id -> (vector, namespace, created_at)``."""
    keys = sorted(model)
    ids = np.asarray(keys, dtype=np.int64)
    if not keys:
        return ids, np.zeros((0, 1)), [], np.zeros(0)
    vectors = np.stack([np.asarray(model[i][0], dtype=np.float64) for i in keys])
    namespaces = [model[i][1] for i in keys]
    created = np.asarray([model[i][2] for i in keys], dtype=np.float64)
    return ids, vectors, namespaces, created


def assert_same_answers(
    got_ids: np.ndarray,
    got_scores: np.ndarray,
    want_ids: np.ndarray,
    want_scores: np.ndarray,
    *,
    tie_tol: float = TIE_TOL,
    score_tol: float = SCORE_TOL,
    context: str = "",
) -> None:
    """Asserts that two searchers' answers (``[Q, k]``) are the same up to the order of near
    ties: scores within ``score_tol`` position by position, and ids equal position by position
    except where the two answers order rows whose scores are within ``tie_tol`` otherwise (a
    pass of several queries sums its products in another order than one query alone)."""
    got_ids, want_ids = np.atleast_2d(got_ids), np.atleast_2d(want_ids)
    got_scores = np.atleast_2d(got_scores).astype(np.float64)
    want_scores = np.atleast_2d(want_scores).astype(np.float64)
    assert got_ids.shape == want_ids.shape, f"{context}: shapes {got_ids.shape} against {want_ids.shape}"
    np.testing.assert_allclose(got_scores, want_scores, rtol=score_tol, atol=tie_tol, err_msg=context)
    for qi in range(len(got_ids)):
        if (want_ids[qi] == MISSING_ID).any():  # (every eligible row returned: the same rows)
            assert set(got_ids[qi].tolist()) == set(want_ids[qi].tolist()), f"{context} query {qi}: other rows"
        placed = {int(i): s for i, s in zip(want_ids[qi], want_scores[qi])}
        last = want_scores[qi][np.isfinite(want_scores[qi])].min(initial=np.inf)
        for pos in np.flatnonzero(got_ids[qi] != want_ids[qi]):
            item, here = int(got_ids[qi][pos]), want_scores[qi][pos]
            # The row is in the other answer at a tied score, or (a tie at the k-th place) in
            # neither at a score tied with the other answer's last.
            theirs = placed.get(item, last)
            assert abs(theirs - here) <= tie_tol, (
                f"{context} query {qi} place {pos}: id {item} against {int(want_ids[qi][pos])}, "
                f"scores {theirs} and {here} are no tie")
