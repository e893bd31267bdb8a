"""A crowd of client processes sending single recalls at once (issue 18), on the CPU.

Timing stays in ``kalos bench --crowd``; this checks what must hold under that load: every
client connects, every answer is the float64 top-k of its own query (an answer delivered to
the wrong slot would be another query's), and a client connecting and disconnecting in a loop
meanwhile always gets a slot. Two crowds: a mixed one (recalls in one namespace, in all, and
with a time window, so each pass holds several filter groups), and agents each recalling in a
namespace of its own (the rows spread over 64 namespaces), each answer its namespace's top-k.
"""
from __future__ import annotations

import pytest
from conftest import unique_name

from kalos.store.sqlite import Store
from kalos.tools.crowd import _one_crowd, _passes, _store_rows, _unit


@pytest.mark.parametrize("scopes", ["mixed", "agents"])
def test_a_crowd_of_sixteen_processes_gets_every_answer_right(sidecars, store_dir, rng, scopes):
    n, dim, k = 4096, 64, 8
    matrix = _unit(rng, n, dim)
    queries = _unit(rng, 64, dim)
    store_path = store_dir / "crowd.db"
    data = str(store_dir / "queries.npz")
    with Store.open(store_path, dim=dim) as store:
        _store_rows(store, matrix, queries, k, scopes, data)
    name = unique_name("crowd")
    sidecars.start(store_path, name=name, extra_args=["--slots", "24"])
    queries_before, passes_before, *_ = _passes(name)
    row = _one_crowd(name, data, k, clients=16, seconds=3.0, scopes=scopes)
    queries_after, passes_after, *_ = _passes(name)
    assert row["complete"], row["first_error"]  # all 16 were in before the crowd started
    assert row["failed_connects"] == 0, row["first_error"]
    assert row["errors"] == 0, row["first_error"]
    assert row["wrong"] == 0
    assert row["fewest_by_one_client"] >= 1  # every client was answered, none starved
    # Concurrent single recalls are gathered: passes hold more than one query on average.
    assert (queries_after - queries_before) / (passes_after - passes_before) > 1.0
    assert row["late_connects"] >= 5 and row["late_connect_failures"] == 0, row["first_error"]
