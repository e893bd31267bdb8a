"""``Store.vectors`` / ``PostgresStore.vectors`` (what ``Client.get(..., with_vectors=True)`` reads):
the stored float32 bits of the ids that exist, the same from both stores as ``iter_rows`` loads them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pg_server import find_bin_dir
from test_pg_store import pg, url  # noqa: F401 (fixtures: a throwaway server, a fresh database)

from kalos.store.sqlite import Store

DIM = 12


def _check(store, rng: np.random.Generator) -> None:
    vecs = rng.standard_normal((30, DIM)).astype(np.float32)
    ids, *_ = store.add(vecs, namespace="a")
    store.delete([int(ids[3])])
    loaded = {int(i): v.copy() for batch_ids, batch_vecs, _n, _t in store.iter_rows(batch=7)
              for i, v in zip(batch_ids, batch_vecs)}
    probe = [int(ids[0]), int(ids[3]), 10**9, int(ids[29]), int(ids[0])]
    got = store.vectors(probe)
    assert sorted(got) == sorted({int(ids[0]), int(ids[29])})
    for i, v in got.items():
        assert v.dtype == np.float32 and v.shape == (DIM,) and v.tobytes() == loaded[i].tobytes()
    assert store.vectors([]) == {}


def test_sqlite_store_vectors(store_dir: Path, rng: np.random.Generator) -> None:
    with Store.open(store_dir / "v.db", dim=DIM) as store:
        _check(store, rng)


@pytest.mark.skipif(find_bin_dir() is None, reason="PostgreSQL's server binaries are not installed (.ci/run installs them)")
def test_postgres_store_vectors(url: str, rng: np.random.Generator) -> None:  # noqa: F811
    from kalos.store.postgres import PostgresStore

    with PostgresStore.open(url, dim=DIM) as store:
        _check(store, rng)
