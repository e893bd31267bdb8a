"""A crowd of client processes sending single recalls at once (issue 18), on the CPU.

Timing stays in ``kalos bench --crowd``; this checks what must hold under that load: every
client connects, every answer is the float64 top-k of its own query (an answer delivered to
the wrong slot would be another query's), and a client connecting and disconnecting in a loop
meanwhile always gets a slot. Two crowds: a mixed one (recalls in one namespace, in all, and
with a time window, so each pass holds several filter groups), and agents each recalling in a
namespace of its own (the rows spread over 64 namespaces), each answer its namespace's top-k.
And a crowd beside writers: processes adding one memory at a time meanwhile, the store growing
past the engine's capacity on the first add.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import unique_name

from kalos.client.client import Client
from kalos.store.sqlite import Store
from kalos.tools.crowd import WRITES_NAMESPACE, _one_crowd, _passes, _store_rows, _unit, _wrong_answers


def _crowd_store(store_dir: Path, rng: np.random.Generator, n: int, k: int, scopes: str) -> tuple[Path, str]:
    """A store of ``n`` random 64-dimensional unit rows laid out for ``scopes``, and the crowd's
    data file (64 queries and their float64 references)."""
    dim = 64
    store_path = store_dir / "crowd.db"
    data = str(store_dir / "queries.npz")
    with Store.open(store_path, dim=dim) as store:
        _store_rows(store, _unit(rng, n, dim), _unit(rng, 64, dim), k, scopes, data)
    return store_path, data


@pytest.mark.parametrize("scopes", ["mixed", "agents"])
def test_a_crowd_of_sixteen_processes_gets_every_answer_right(sidecars, store_dir, rng, scopes):
    n, k = 4096, 8
    store_path, data = _crowd_store(store_dir, rng, n, k, scopes)
    name = unique_name("crowd")
    sidecars.start(store_path, name=name, extra_args=["--slots", "24"])
    queries_before, passes_before, *_ = _passes(name)
    row = _one_crowd(name, data, k, clients=16, seconds=3.0, scopes=scopes)
    queries_after, passes_after, *_ = _passes(name)
    assert row["complete"], row["first_error"]  # all 16 were in before the crowd started
    assert row["failed_connects"] == 0, row["first_error"]
    assert row["errors"] == 0, row["first_error"]
    assert row["wrong"] == 0 and row["checked"] == row["recalls"] > 0
    assert row["fewest_by_one_client"] >= 1  # every client was answered, none starved
    # Concurrent single recalls are gathered: passes hold more than one query on average.
    assert (queries_after - queries_before) / (passes_after - passes_before) > 1.0
    assert row["late_connects"] >= 5 and row["late_connect_failures"] == 0, row["first_error"]


def test_a_crowd_beside_writers_gets_every_answer_right_and_every_add_stored(sidecars, store_dir, rng):
    """Agents that remember between recalls: 8 recalling processes in namespace "default" beside 3
    adding one memory at a time in a namespace of their own. Every recall is still the float64
    top-k of the rows it may see (the adds change the engine under the crowd, and the first one
    grows its capacity: 4,096 rows fill it), every add is acknowledged, and each acknowledged
    add is in the store afterwards."""
    n, k = 4096, 8
    store_path, data = _crowd_store(store_dir, rng, n, k, "default")
    name = unique_name("crowd")
    sidecars.start(store_path, name=name, extra_args=["--slots", "16"])
    with Client(name) as client:
        capacity = client.stats()["capacity"]
    row = _one_crowd(name, data, k, clients=8, seconds=3.0, writers=3, seed=7)
    assert row["complete"], row["first_error"]
    assert row["failed_connects"] == row["errors"] == row["write_errors"] == 0, row["first_error"]
    assert row["wrong"] == 0 and row["checked"] == row["recalls"] > 0
    assert row["fewest_by_one_client"] >= 1
    assert row["writes"] >= 3, row  # (each writer's first add at least, on the slowest machine)
    with Client(name) as client:
        assert client.count(namespace=WRITES_NAMESPACE) == row["writes"]
        assert client.count(namespace="default") == n
        assert client.stats()["capacity"] > capacity == n


def test_the_crowds_checker_tells_a_wrong_answer(rng):
    """The crowd checks its answers after the timed loop (_wrong_answers): the ids as a set (a tie
    may order them either way), the scores in order to 1e-4; a short answer is wrong."""
    ref_ids = np.stack([rng.permutation(100)[:8] for _ in range(5)])[None]  # [group, query, k]
    ref_scores = np.sort(rng.random((1, 5, 8)), axis=2)[:, :, ::-1]
    asked = np.array([3, 0, 3, 4])
    ids, scores = ref_ids[0][asked].copy(), ref_scores[0][asked].astype(np.float32)
    assert _wrong_answers(asked, ids, scores, ref_ids[0], ref_scores[0]) == 0
    ids[1, [2, 5]] = ids[1, [5, 2]]  # two tied hits swapped: still right
    assert _wrong_answers(asked, ids, scores, ref_ids[0], ref_scores[0]) == 0
    ids[0, 7] = 1000  # a memory not in the top-k
    scores[2, 3] += 2e-4  # a score off
    ids[3, 7], scores[3, 7] = -1, -np.inf  # a short answer, padded
    assert _wrong_answers(asked, ids, scores, ref_ids[0], ref_scores[0]) == 3
    scores[1, 0] = np.nan
    assert _wrong_answers(asked, ids, scores, ref_ids[0], ref_scores[0]) == 4
