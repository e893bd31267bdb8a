"""``kalos demo``: a sidecar on the default store, demo memories, an agent-style recall loop."""
from __future__ import annotations

import argparse
import time

import numpy as np

from kalos.bench import percentiles
from kalos.client import Client
from kalos.config import default_store_path
from kalos.errors import SidecarUnavailable
from kalos.launcher import SidecarProcess

__all__ = ["run_demo"]

NAMESPACE = "kalos-demo"
DEFAULT_DIM = 384  # all-MiniLM-L6-v2's dimension, so the default store suits text memories too
_TOPICS = ["billing", "deployment", "user preferences", "travel plans", "code review", "incident", "meeting notes",
           "shopping list", "research", "health"]


def _memories(n: int, dim: int) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Deterministic demo memories: clusters around one centroid per topic."""
    rng = np.random.default_rng(7)
    centroids = rng.standard_normal((len(_TOPICS), dim)).astype(np.float32)
    topic = rng.integers(0, len(_TOPICS), n)
    vectors = centroids[topic] + 0.8 * rng.standard_normal((n, dim)).astype(np.float32)
    texts = [f"memory {i}: a note about {_TOPICS[t]}" for i, t in enumerate(topic)]
    return vectors, texts, topic


def run_demo(args: argparse.Namespace) -> int:
    sidecar = None
    try:
        try:
            client = Client(args.name)
            print(f"using the running sidecar {args.name!r}")
        except SidecarUnavailable:
            store = args.store or default_store_path()
            print(f"no sidecar {args.name!r} is running: starting one on {store}")
            sidecar = SidecarProcess(store, name=args.name, dim=None if store.exists() else DEFAULT_DIM,
                                     device=args.device)
            print(sidecar.ready_line)
            client = Client(args.name)
        with client:
            return _agent_loop(client, args.memories, args.recalls)
    finally:
        if sidecar is not None:
            sidecar.stop()
            print(f"stopped the demo's sidecar; the memories stay in the store")


def _agent_loop(client: Client, n: int, recalls: int) -> int:
    dim = client.dim
    vectors, texts, _topic = _memories(n, dim)
    have = client.stats()["namespaces"].get(NAMESPACE, 0)
    if have < n:
        started = time.perf_counter()
        chunk = 4096
        for start in range(have - have % chunk, n, chunk):
            stop = min(n, start + chunk)
            client.add(vectors[start:stop], texts=texts[start:stop],
                       metadata=[{"demo_index": i} for i in range(start, stop)], namespace=NAMESPACE)
        print(f"added {n - have:,} demo memories (dim {dim}) in {time.perf_counter() - started:.2f} s")
    else:
        print(f"the store already holds the {have:,} demo memories")

    rng = np.random.default_rng()
    targets = rng.integers(0, n, recalls)
    # An agent recalls with a paraphrase of what it once stored: the memory plus noise.
    queries = vectors[targets] + 0.5 * rng.standard_normal((recalls, dim)).astype(np.float32)
    for q in queries[:50]:  # warm-up
        client.recall(q, k=8, namespace=NAMESPACE)
    samples, top1 = [], []
    clock = time.perf_counter
    for q in queries:
        start = clock()
        hits = client.recall(q, k=8, namespace=NAMESPACE)
        samples.append(clock() - start)
        top1.append(int(hits.ids[0]))
    found = client.get(top1)
    correct = sum(item is not None and item.metadata["demo_index"] == int(t) for item, t in zip(found, targets))

    print("\nwhat the agent recalled (3 of its recalls):")
    for q, t in zip(queries[:3], targets[:3]):
        hits = client.recall(q, k=3, namespace=NAMESPACE)
        print(f"  looking for: {texts[t]}")
        for item, (_id, score) in zip(client.get(hits.ids), hits):
            print(f"    {score:.3f}  {item.text if item else '?'}")
    p = percentiles(samples)
    lat = np.asarray(samples) * 1e6
    print(f"\n{recalls:,} recalls (k=8, {n:,} memories, dim {dim}): p50 {p['p50_us']:.1f} us, "
          f"p99 {p['p99_us']:.1f} us, p99.9 {np.percentile(lat, 99.9):.1f} us, mean {lat.mean():.1f} us")
    print(f"the remembered memory came back first in {correct:,} of {recalls:,} recalls")
    return 0
