"""Filtered recall (``where=``) beside unfiltered, in one run: p50 / p99 and exactness.

    PYTHONPATH=src python3 benchmarks/filtered_recall.py --device cpu --n 65536 --dim 384
    PYTHONPATH=src python3 benchmarks/filtered_recall.py --device cuda --n 65536 --dim 1024

Rows carry metadata ``{"half": bool, "bucket": 0..99, "serial": i}``; the clauses select 50%
(``{"half": true}``), 1% (``{"bucket": 7}``) and one row (``{"serial": ...}``) of them. Each
case is timed twice: in process (the engine ``--device`` makes: NumPy on "cpu", the GPU engine
on "cuda"; its search with the Filter) and end to end (``Client.recall`` against a ``kalos
serve --device DEVICE`` sidecar on a fresh store), single recalls one after another, k = 8, in
alternating blocks so that a busy machine skews every case alike. "1%, mask cold" drops the
engine's cached masks before every search (what the first recall after a write pays: the clause
evaluated over the metadata index). Every answer of the first 50 recalls per case is checked
against a float64 brute force over the matching rows ("exact": how many were).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np

from kalos import Client
from kalos.engine import Filter, make_engine
from kalos.server.launcher import SidecarProcess
from kalos.where import compile_where

BLOCKS = 3
WARMUP = 30
CHECKED = 50


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return (x / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)).astype(np.float32)


def _cases(n: int, rng: np.random.Generator) -> dict[str, dict | None]:
    return {
        "unfiltered": None,
        "50%": {"half": True},
        "1%": {"bucket": 7},
        "1 row": {"serial": int(rng.integers(n))},
        "1%, mask cold": {"bucket": 7},
    }


def _exact(ids: np.ndarray, matrix64: np.ndarray, query: np.ndarray, eligible: np.ndarray, k: int) -> bool:
    """``ids`` is the float64 top-k of the eligible rows (ties within 1e-6 allowed)."""
    scores = matrix64 @ query.astype(np.float64)
    scores[~eligible] = -np.inf
    m = min(k, int(eligible.sum()))
    got = ids[ids >= 0]
    if len(got) != m:
        return False
    if m == 0:
        return True
    kth = np.sort(scores)[::-1][m - 1]
    return bool(np.all(scores[got] >= kth - 1e-6) and len(set(got.tolist())) == m)


def _time(cases: dict[str, dict | None], search: Callable[[str, int], np.ndarray], eligible: dict[str, np.ndarray],
          matrix64: np.ndarray, queries: np.ndarray, k: int, recalls: int) -> dict[str, tuple[list[float], int]]:
    samples: dict[str, list[float]] = {name: [] for name in cases}
    exact = {name: 0 for name in cases}
    for name in cases:  # warm: compiled passes, cached masks
        for i in range(WARMUP):
            search(name, i)
        for i in range(CHECKED):
            exact[name] += _exact(search(name, i), matrix64, queries[i % len(queries)], eligible[name], k)
    per_block = max(1, recalls // BLOCKS)
    clock = time.perf_counter
    for block in range(BLOCKS):
        for name in cases:
            out = samples[name]
            for j in range(per_block):
                i = block * per_block + j
                t = clock()
                search(name, i)
                out.append(clock() - t)
    return {name: (samples[name], exact[name]) for name in cases}


def _print(title: str, results: dict[str, tuple[list[float], int]], matching: dict[str, int]) -> None:
    base = float(np.percentile(results["unfiltered"][0], 50))
    print(f"\n{title}")
    print(f"  {'case':<16} {'rows passing':>12} {'p50 us':>9} {'p99 us':>9} {'p50 / unfiltered':>17} {'exact':>7}")
    for name, (samples, exact) in results.items():
        a = np.asarray(samples) * 1e6
        p50 = float(np.percentile(a, 50))
        print(f"  {name:<16} {matching[name]:>12,} {p50:>9.1f} {np.percentile(a, 99):>9.1f} "
              f"{p50 / (base * 1e6):>16.3g}x {exact:>3}/{CHECKED}")


def _in_process(args: argparse.Namespace, matrix: np.ndarray, metadata: list[dict], cases: dict, wheres: dict,
                eligible: dict, matching: dict, matrix64: np.ndarray, queries: np.ndarray) -> None:
    n, dim, k = len(matrix), matrix.shape[1], args.k
    engine = make_engine(args.device, dim, capacity=n, precision=args.precision)
    engine.add(np.arange(n, dtype=np.int64), matrix, np.zeros(n, np.int32), np.zeros(n), metadata)
    filters = {name: Filter(where=w) for name, w in wheres.items()}
    rows = getattr(engine, "rows", None)

    def search(name: str, i: int) -> np.ndarray:
        if name.endswith("mask cold") and rows is not None:
            rows._masks.clear()
        return engine.search(queries[i % len(queries)][None], k, filters[name])[0][0]

    results = _time(cases, search, eligible, matrix64, queries, k, args.recalls)
    _print(f"in process: {engine.name} on {engine.device}, {n:,} x {dim}, k={k}", results, matching)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=65536,
                        help="rows (random unit vectors with metadata) (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=384, help="their dimension (default: %(default)s)")
    parser.add_argument("-k", type=int, default=8, help="k of every recall (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (the engine and the sidecar's --device)")
    parser.add_argument("--precision", default="exact", help="the GPU engine's precision (exact or fast)")
    parser.add_argument("--recalls", type=int, default=1500, help="timed recalls per case and side")
    parser.add_argument("--no-e2e", action="store_true", help="time the engine in process only")
    args = parser.parse_args()
    rng = np.random.default_rng(7)
    n, dim, k = args.n, args.dim, args.k
    matrix = _unit(rng, n, dim)
    matrix64 = matrix.astype(np.float64)
    halves = rng.random(n) < 0.5
    buckets = rng.integers(0, 100, n)
    metadata = [{"half": bool(h), "bucket": int(b), "serial": i} for i, (h, b) in enumerate(zip(halves, buckets))]
    queries = _unit(rng, 512, dim)
    cases = _cases(n, rng)
    wheres = {name: None if c is None else compile_where(c) for name, c in cases.items()}
    eligible = {name: np.ones(n, bool) if w is None else np.array([w.matches(m) for m in metadata])
                for name, w in wheres.items()}
    matching = {name: int(e.sum()) for name, e in eligible.items()}

    _in_process(args, matrix, metadata, cases, wheres, eligible, matching, matrix64, queries)
    if args.no_e2e:
        return 0
    tmp = tempfile.mkdtemp(prefix="kfr", dir="/tmp")
    os.chmod(tmp, 0o700)
    os.environ.setdefault("KALOS_RUNTIME_DIR", tmp)
    name = f"filtered-bench-{os.getpid()}"
    extra = ["--precision", args.precision] if args.device != "cpu" else []
    sidecar = SidecarProcess(os.path.join(tmp, "store.db"), name=name, dim=dim, device=args.device, extra_args=extra)
    try:
        with Client(name, timeout=30.0) as client:
            stored = np.concatenate([
                client.add(matrix[s : s + 8192], metadata=metadata[s : s + 8192]) for s in range(0, n, 8192)
            ])
            index_of = {int(i): j for j, i in enumerate(stored.tolist())}
            cold: dict[str, Any] = {"i": 0}

            def end_to_end(case: str, i: int) -> np.ndarray:
                if case.endswith("mask cold"):
                    # A clause never seen before: registered, then evaluated over the index.
                    cold["i"] += 1
                    where = {"bucket": 7, "serial": {"$ne": -cold["i"]}}
                else:
                    where = cases[case]
                hits = client.recall(queries[i % len(queries)], k=k, namespace="default", where=where)
                return np.array([index_of[int(h)] for h in hits.ids], dtype=np.int64)

            results = _time(cases, end_to_end, eligible, matrix64, queries, k, args.recalls)
        _print(f"end to end: Client.recall -> kalos serve --device {args.device}, {n:,} x {dim}, k={k} "
               f"({os.cpu_count()} cores); 'mask cold' = a new clause per recall (control round trip included)",
               results, matching)
    finally:
        sidecar.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
