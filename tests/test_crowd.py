"""A crowd of client processes sending single recalls at once (issue 18), on the CPU.

Timing stays in ``kalos bench --crowd``; this checks what must hold under that load: every
client connects, every answer is the float64 top-k of its own query (an answer delivered to
the wrong slot would be another query's), and a client connecting and disconnecting in a loop
meanwhile always gets a slot. The crowd is mixed: recalls in one namespace, in all, and with a
time window, so each pass holds several filter groups.
"""
from __future__ import annotations

import numpy as np
from conftest import unique_name

from kalos.store.sqlite import Store
from kalos.tools.crowd import _one_crowd, _passes, _reference, _unit


def test_a_crowd_of_sixteen_processes_gets_every_answer_right(sidecars, store_dir, rng):
    n, dim, k = 4096, 64, 8
    matrix = _unit(rng, n, dim)
    queries = _unit(rng, 64, dim)
    store_path = store_dir / "crowd.db"
    with Store.open(store_path, dim=dim) as store:
        ids, _, _ = store.add(matrix, namespace="default")
    ref_ids, ref_scores = _reference(matrix, queries, ids, k)
    name = unique_name("crowd")
    sidecars.start(store_path, name=name, extra_args=["--slots", "24"])
    queries_before, passes_before, *_ = _passes(name)
    data = str(store_dir / "queries.npz")
    np.savez(data, queries=queries, ref_ids=ref_ids, ref_scores=ref_scores)
    row = _one_crowd(name, data, k, clients=16, seconds=3.0, scopes="mixed")
    queries_after, passes_after, *_ = _passes(name)
    assert row["complete"], row["first_error"]  # all 16 were in before the crowd started
    assert row["failed_connects"] == 0, row["first_error"]
    assert row["errors"] == 0, row["first_error"]
    assert row["wrong"] == 0
    assert row["fewest_by_one_client"] >= 1  # every client was answered, none starved
    # Concurrent single recalls are gathered: passes hold more than one query on average.
    assert (queries_after - queries_before) / (passes_after - passes_before) > 1.0
    assert row["late_connects"] >= 5 and row["late_connect_failures"] == 0, row["first_error"]
