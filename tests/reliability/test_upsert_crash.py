"""kill -9 of the sidecar during a stream of upserts (issue 22): after every restart each key
holds exactly one version, old or new, never both and never neither, and never one older than
the last acknowledged.

Workload: one writer process upserts random subsets of KEYS keys of one namespace, every call
to a new version v (a call's keys all get v). The vector of (key, v) is a function of the seed,
and the text names it (``<key>@v<v>``), so a stored row proves which version it is and that
its vector is that version's (not the other's, not half of each). Fault: SIGKILL of the
sidecar after a random 0.05-0.8 s, several times; the store is read (readonly) while it is
dead. Oracle per snapshot and key: exactly one row; text and vector of one version v, with
last acknowledged version (before the kill) <= v <= last attempted version. After the last
restart, each key's row is what the engine serves: a recall of its vector returns its id first
with score 1, and no other id of the namespace is there.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
from conftest import DEADLINE_S, _seed_value, unique_name, wait_until

from kalos import Client
from kalos.store.sqlite import Store
from reliability._support import kill_cycles, tracebacks

DIM = 8
KEYS = 24
NAMESPACE = "upserts"
TIMEOUT = 1.0


def _vector(seed: int, key: int, version: int) -> np.ndarray:
    v = np.random.default_rng([seed, key, version]).standard_normal(DIM)
    return (v / np.linalg.norm(v)).astype(np.float32)


def _upserter(name: str, seed: int, stop: Any, progress: Any, out: Any) -> None:
    """Upserts until ``stop``; reports ``(version, keys, t0, t1, acknowledged)`` per call."""
    records: list[tuple[int, list[int], float, float, bool]] = []
    rng = np.random.default_rng([seed, 1])
    try:
        client = Client(name, timeout=TIMEOUT)
        version = 0
        while not stop.is_set():
            version += 1
            keys = sorted(rng.choice(KEYS, size=int(rng.integers(1, 9)), replace=False).tolist())
            vectors = np.stack([_vector(seed, k, version) for k in keys])
            t0 = time.monotonic()
            try:
                client.add(vectors, keys=[f"k{k}" for k in keys], texts=[f"k{k}@v{version}" for k in keys],
                           namespace=NAMESPACE)
                ok = True
            except Exception:  # noqa: BLE001 - SidecarUnavailable while the sidecar is down: judged below
                ok = False
            t1 = time.monotonic()
            records.append((version, keys, t0, t1, ok))
            if ok:
                progress.value = t1
            else:
                time.sleep(0.02)  # down: do not spin on connect()
        client.close()
        out.put(("log", records))
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", repr(exc)))


def _rows(path: Any) -> dict[str, list[tuple[str, np.ndarray]]]:
    """key -> [(text, unit vector)] of every row in NAMESPACE, read readonly."""
    with Store.open(path, readonly=True) as store:
        assert store.integrity_check() == "ok"
        vectors = {}
        for ids, vecs, _ns, _created in store.iter_rows():
            vectors.update(zip(ids.tolist(), vecs.copy()))
        items = store.get(list(vectors))
    rows: dict[str, list[tuple[str, np.ndarray]]] = {}
    for item in items:
        if item is not None and item.namespace == NAMESPACE:
            rows.setdefault(item.key, []).append((item.text, vectors[item.id]))
    return rows


def _check(rows: dict[str, list[tuple[str, np.ndarray]]], records: list[tuple], seed: int, t_kill: float,
           label: str) -> list[str]:
    problems = []
    acked: dict[int, int] = {}  # key -> last version acknowledged before t_kill
    tried: dict[int, int] = {}  # key -> last version invoked before t_kill
    for version, keys, t0, t1, ok in records:
        for k in keys:
            if t0 < t_kill:
                tried[k] = max(tried.get(k, 0), version)
            if ok and t1 < t_kill:
                acked[k] = max(acked.get(k, 0), version)
    for k in range(KEYS):
        got = rows.get(f"k{k}", [])
        if k not in tried:
            if got:
                problems.append(f"{label}: k{k} was never written before the kill but has rows {[t for t, _ in got]}")
            continue
        if len(got) != 1:
            if got or k in acked:
                problems.append(f"{label}: k{k} has {len(got)} rows (versions {[t for t, _ in got]}), expected exactly one")
            continue
        text, vector = got[0]
        version = int(text.split("@v")[1])
        if not acked.get(k, 0) <= version <= tried[k]:
            problems.append(f"{label}: k{k} holds v{version}; acknowledged v{acked.get(k, 0)}, last tried v{tried[k]}")
        if not np.allclose(vector, _vector(seed, k, version), atol=1e-6):
            problems.append(f"{label}: k{k}'s vector is not that of its text's version v{version} (half an upsert)")
    return problems


def test_kill9_during_upserts_leaves_each_key_exactly_one_version(sidecars, children, store_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    rng = np.random.default_rng(seed)
    kills = scale(4, 40)
    name = unique_name("upcrash")
    store = store_dir / "upcrash.db"
    procs = [sidecars.start(store, name=name, dim=DIM)]

    stop = children.event()
    out = children.queue()
    progress = children.ctx.Value("d", 0.0, lock=False)
    children.start(_upserter, name, seed, stop, progress, out)
    started = time.monotonic()
    wait_until(lambda: progress.value > started, "the first acknowledged upsert", timeout=DEADLINE_S * 2)
    kill_times, snapshots = kill_cycles(sidecars, store, name, procs, rng, kills, progress, _rows, "upsert")
    time.sleep(0.2)
    stop.set()
    kind, records = out.get(timeout=DEADLINE_S * 2)
    assert kind == "log", records
    acked_calls = sum(1 for r in records if r[4])
    assert acked_calls > kills, f"only {acked_calls} upserts acknowledged: the test exercised too little"

    problems = []
    for i, (t_kill, rows) in enumerate(zip(kill_times, snapshots)):
        problems += _check(rows, records, seed, t_kill, f"after kill {i + 1}")
    assert not problems, "\n".join(problems[:20])

    # What the last sidecar serves is what its store holds: one row per key, the stored version.
    final = _rows(store)
    assert not _check(final, records, seed, time.monotonic(), "at the end")
    with Client(name, timeout=30.0) as observer:
        keys = sorted(final)
        assert observer.stats()["namespaces"][NAMESPACE] == len(keys)
        items = observer.get(keys=keys, namespace=NAMESPACE)
        for key, item in zip(keys, items):
            (text, vector), = final[key]
            assert item.text == text
            hit = observer.recall(vector, k=2, namespace=NAMESPACE)
            assert hit.ids[0] == item.id and abs(float(hit.scores[0]) - 1.0) < 1e-5, (key, hit)
            if len(hit) > 1:  # the runner-up is another key's row, never an old version of this one
                assert float(hit.scores[1]) < 1.0 - 1e-4, (key, hit)
    for i, proc in enumerate(procs):
        found = tracebacks(proc.log())
        assert not found, f"sidecar incarnation {i}: {found[0]}"
    print(f"RELIABILITY upsert crash: kills={kills} upserts={len(records)} acknowledged={acked_calls}")
