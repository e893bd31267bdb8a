"""The framework adapters side by side with the frameworks' own local defaults, on one CPU sidecar.

    PYTHONPATH=src python3 benchmarks/frameworks.py [--memories 2000] [--dim 384] [--steps 300] [--seed 1]

1. A LangGraph agent-style loop: each step one ``store.search(namespace, query=..., limit=4)``
   then one ``store.put`` of a new memory, in a namespace that already holds ``--memories``
   items (``fields=["text"]``; the same deterministic embedding on both sides, so the
   embedding's cost is equal), through :class:`KalosStore` and through LangGraph's
   ``InMemoryStore``. PostgresStore is not timed (no PostgreSQL server on this machine).
2. mem0's vector store ``search`` (top 5, ``filters={"user_id": ...}``, one user of ten) through
   the Kalos provider and through mem0's default local provider (Qdrant, local mode in a temp
   dir), on the same random vectors; both answers are checked against a float64 brute force.

Per-operation p50 / p99 of the search and of the put, seeded, the baseline printed beside.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

os.environ.setdefault("MEM0_TELEMETRY", "False")

from kalos.server.launcher import SidecarProcess  # noqa: E402


def stats(samples: list[float]) -> str:
    a = np.asarray(samples) * 1e6
    return f"p50 {np.percentile(a, 50):9.1f} us   p99 {np.percentile(a, 99):9.1f} us"


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def langgraph_loop(name: str, args: argparse.Namespace) -> None:
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langgraph.store.base import PutOp
    from langgraph.store.memory import InMemoryStore

    from kalos.integrations.langgraph import KalosStore

    index = {"dims": args.dim, "embed": DeterministicFakeEmbedding(size=args.dim), "fields": ["text"]}
    rng = np.random.default_rng(args.seed)
    words = [f"w{i}" for i in range(500)]

    def text() -> str:
        return " ".join(rng.choice(words, 8))

    ns = ("users", "u1", "memories")
    print(f"LangGraph loop: search(query, limit=4) then put, {args.memories} memories, dim {args.dim}, {args.steps} steps")
    for label, store in (("KalosStore", KalosStore(name, index=index, prefix=f"bench{uuid.uuid4().hex[:8]}")),
                         ("InMemoryStore", InMemoryStore(index=index))):
        for start in range(0, args.memories, 500):
            store.batch([PutOp(ns, f"m{i}", {"text": text()})
                         for i in range(start, min(args.memories, start + 500))])
        searches, puts = [], []
        for step in range(args.steps):
            query = text()
            searches.append(timed(lambda: store.search(ns, query=query, limit=4)))
            value = {"text": text()}
            puts.append(timed(lambda: store.put(ns, f"new{step}", value)))
        print(f"  {label:14s} search {stats(searches)}   put {stats(puts)}")


def mem0_search(name: str, args: argparse.Namespace) -> None:
    from mem0.configs.vector_stores.qdrant import QdrantConfig
    from mem0.vector_stores.qdrant import Qdrant

    from kalos.integrations.mem0 import KalosMem0

    rng = np.random.default_rng(args.seed + 1)
    n = args.memories
    vectors = rng.standard_normal((n, args.dim)).astype(np.float32)
    users = [f"user{i}" for i in rng.integers(0, 10, n)]
    ids = [str(uuid.uuid4()) for _ in range(n)]
    payloads = [{"user_id": u, "data": f"memory {i}", "hash": str(i)} for i, u in enumerate(users)]
    queries = rng.standard_normal((args.steps, args.dim)).astype(np.float32)
    unit = vectors.astype(np.float64) / np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
    qdir = tempfile.mkdtemp(prefix="kbq")
    try:
        config = QdrantConfig(collection_name="bench", embedding_model_dims=args.dim, path=qdir, on_disk=False)
        qdrant = Qdrant(**config.model_dump())
        kalos = KalosMem0(collection_name=f"bench{uuid.uuid4().hex[:8]}", embedding_model_dims=args.dim, sidecar=name,
                          timeout=10.0)
        print(f"mem0 vector store search: top 5 of one user's memories (of {n}, ten users), dim {args.dim}, "
              f"{args.steps} searches")
        for label, store in (("kalos", kalos), ("qdrant (local)", qdrant)):
            for start in range(0, n, 500):
                store.insert(vectors[start : start + 500].tolist(), payloads[start : start + 500], ids[start : start + 500])
            samples, exact = [], 0
            for j, q in enumerate(queries):
                user = f"user{j % 10}"
                out: list[Any] = []
                samples.append(timed(lambda: out.extend(store.search("", q.tolist(), top_k=5, filters={"user_id": user}))))
                rows = [i for i, u in enumerate(users) if u == user]
                scores = unit[rows] @ (q / np.linalg.norm(q))
                want = [ids[rows[i]] for i in np.argsort(-scores)[:5]]
                exact += [str(o.id) for o in out] == want
            print(f"  {label:14s} {stats(samples)}   exact top-5 {exact}/{len(queries)}")
    finally:
        shutil.rmtree(qdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="kbf")
    os.environ["KALOS_RUNTIME_DIR"] = runtime
    store_dir = tempfile.mkdtemp(prefix="kbfs")
    name = f"bench-{os.getpid()}"
    sidecar = SidecarProcess(Path(store_dir) / "bench.db", name=name, dim=args.dim, device="cpu")
    try:
        langgraph_loop(name, args)
        mem0_search(name, args)
    finally:
        sidecar.stop(timeout=10)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
