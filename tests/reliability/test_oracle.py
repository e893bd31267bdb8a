"""The oracles themselves: each must reject every kind of wrong answer the suites look for.

A checker that accepts everything proves nothing (Jepsen tests its checkers too). Each case
builds a tiny history by hand and feeds the recall oracle or the store oracle a correct answer
(accepted) and then a wrong one of each kind (rejected, with the reason).
"""
from __future__ import annotations

import numpy as np
import pytest

from reliability._support import (
    AddOp,
    DeleteOp,
    History,
    ItemTable,
    RecallOp,
    Snapshot,
    StoreRow,
    Workload,
    check_recalls,
    check_row,
)


def _table(n: int = 6, dim: int = 8) -> tuple[ItemTable, np.ndarray]:
    rng = np.random.default_rng(3)
    unit = rng.standard_normal((n, dim))
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    table = ItemTable.static(np.arange(1, n + 1), unit, ["default"] * n)
    return table, unit


def _answer(table: ItemTable, q: np.ndarray, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    idx = table.index_of(np.array(ids, np.int64))
    scores = (table.unit[idx] @ (q / np.linalg.norm(q))).astype(np.float32)
    return np.array(ids, np.int64), scores


def test_recall_oracle_accepts_the_truth_and_rejects_each_kind_of_lie():
    table, unit = _table()
    q = unit[0] + 0.1 * unit[1]
    scores = table.unit @ (q / np.linalg.norm(q))
    order = (np.argsort(-scores) + 1).tolist()
    everything = np.ones(6, bool)
    ok = _answer(table, q, order[:3])
    assert check_row(q, 3, *ok, table, everything, everything) is None
    lies = {
        "skipped the best": _answer(table, q, order[1:4]),
        "wrong order": _answer(table, q, [order[1], order[0], order[2]]),
        "duplicate": _answer(table, q, [order[0], order[0], order[1]]),
        "unknown id": _answer(table, q, order[:2]),
    }
    ids, sc = lies["unknown id"]
    lies["unknown id"] = (np.append(ids, 99), np.append(sc, np.float32(-0.99)))
    ids, sc = _answer(table, q, order[:3])
    lies["score off"] = (ids, sc + np.float32(1e-3))
    lies["padding in the middle"] = (np.array([order[0], -1, order[1]]), np.array([sc[0], -np.inf, sc[1]], np.float32))
    lies["too few"] = _answer(table, q, order[:2])
    for label, (got_ids, got_scores) in lies.items():
        k = 3
        if label == "too few":
            got_ids = np.append(got_ids, -1)
            got_scores = np.append(got_scores, np.float32(-np.inf))
        assert check_row(q, k, got_ids, got_scores, table, everything, everything) is not None, label


def test_recall_oracle_knows_what_may_and_must_be_there():
    table, unit = _table()
    q = unit[2]
    best = 3  # id of unit[2]
    in_store = np.ones(6, bool)
    deleted = in_store.copy()
    deleted[best - 1] = False  # acknowledged deleted before the recall began: not possible
    ids, scores = _answer(table, q, [best])
    assert check_row(q, 1, ids, scores, table, deleted, deleted) is not None  # a deleted item came back
    sure = in_store.copy()
    sure[best - 1] = False  # being added or deleted during the recall: possible, not sure
    others = [i for i in (np.argsort(-(table.unit @ q)) + 1).tolist() if i != best]
    assert check_row(q, 1, ids, scores, table, sure, in_store) is None  # returned: fine
    assert check_row(q, 1, *_answer(table, q, others[:1]), table, sure, in_store) is None  # left out: fine too
    # ...but an item surely present that beats the answer must be there.
    assert check_row(q, 1, *_answer(table, q, others[:1]), table, in_store, in_store) is not None


def test_cross_delivered_answers_are_recognised():
    table, unit = _table()
    q_a, q_b = unit[0], unit[4]
    recalls = []
    for op, (asked, answered_for) in enumerate(((q_a, q_a), (q_b, q_a))):
        order = (np.argsort(-(table.unit @ answered_for)) + 1).tolist()
        ids, scores = _answer(table, answered_for, order[:2])
        recalls.append(RecallOp(0, op, 0.0, 1.0, "ok", asked[None].astype(np.float32), 2, None, [ids], [scores]))
    verdict = check_recalls(table, recalls)
    assert len(verdict.mismatches) == 1 and verdict.cross_delivered == 1


def _snapshot(w: Workload, t: float, items: dict[int, tuple[int, int, int, int]], *, torn: int | None = None,
              meta_of: int | None = None) -> Snapshot:
    rows = {}
    for item_id, (client, op, r, n) in items.items():
        vector = w.unit(client, op, n)[r].tobytes()
        if item_id == torn:
            vector = vector[:-4] + b"\0\0\0\0"
        meta = w.metadata(client, op, r) if item_id != meta_of else {"x": 1}
        rows[item_id] = StoreRow(item_id, w.namespace(client), w.text(client, op, r), meta, vector)
    return Snapshot(t, rows, "ok", f"t={t}")


@pytest.mark.parametrize("fault", ["none", "lost-acked", "half-unacked", "torn", "metadata", "resurrected",
                                   "acked-delete-undone", "foreign", "future-add"])
def test_store_oracle_rejects_every_kind_of_damage(fault):
    w = Workload(1)
    acked = AddOp(0, 1, 0.0, 1.0, True, [1, 2, 3], 3)
    unacked = AddOp(0, 2, 2.0, 9.0, False, None, 2)
    delete = DeleteOp(0, 3, 3.0, 4.0, True, [2])
    later = AddOp(0, 4, 20.0, 21.0, True, [6], 1)
    full = {1: (0, 1, 0, 3), 2: (0, 1, 1, 3), 3: (0, 1, 2, 3), 4: (0, 2, 0, 2), 5: (0, 2, 1, 2)}
    first = {i: v for i, v in full.items() if i != 2}  # after the delete, with the unacked add committed
    second = dict(first)
    kwargs = {}
    if fault == "lost-acked":
        del second[3]
    elif fault == "half-unacked":
        del second[5]
    elif fault == "torn":
        kwargs = {"torn": 1}
    elif fault == "metadata":
        kwargs = {"meta_of": 4}
    elif fault == "resurrected":
        second[2] = full[2]
    elif fault == "acked-delete-undone":
        first[2] = second[2] = full[2]
    elif fault == "foreign":
        second[6] = (0, 4, 0, 1)  # the add of id 6 is invoked only at t=20, after this kill
    elif fault == "future-add":
        second[7] = (5, 1, 0, 1)  # an add nobody made
    snaps = [_snapshot(w, 5.0, first), _snapshot(w, 10.0, second, **kwargs)]
    history = History(w, [acked, unacked, later], [delete], snaps)
    history.check_snapshots()
    if fault == "none":
        assert not history.problems, history.problems
        table = history.item_table()
        assert set(table.ids.tolist()) == {1, 2, 3, 4, 5, 6}
        i = int(table.index_of(np.array([4]))[0])
        assert table.add_eff[i] == 5.0  # unacknowledged, but surely there from the first snapshot on
    else:
        assert history.problems, f"{fault} went unnoticed"
