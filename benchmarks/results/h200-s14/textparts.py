"""Where a recall_text's time goes on a GPU sidecar with the graphed embedder: the pieces in
process (tokenizer, graph replay, GraphedEmbedder.embed, EmbedService.embed), then the phases of
Client.recall_text against a sidecar (the embed op, the recall, the get), each p50/p99 in us.
A profiling aid (session 14), not a benchmark of record.

    PYTHONPATH=.snap/model:src python3 benchmarks/results/h200-s14/textparts.py"""
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kalos import Client
from kalos.server.embed_graphs import GraphedEmbedder
from kalos.server.launcher import SidecarProcess
from kalos.server.sidecar_embed import EmbedService, _model_path
from kalos.tools.corpus import QUESTIONS


def pct(samples):
    return "p50 %7.1f  p99 %7.1f us" % tuple(np.percentile(np.array(samples) * 1e6, [50, 99]))


def timed(fn, n=400):
    for i in range(20):
        fn(QUESTIONS[i % len(QUESTIONS)])
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        t = time.perf_counter()
        fn(q)
        out.append(time.perf_counter() - t)
    return out


g = GraphedEmbedder(_model_path(), "cuda")
print("buckets at load", g.buckets)
print("tokenizer.encode_batch([q])     ", pct(timed(lambda q: g.tokenizer.encode_batch([q]))))
b = g._bucket(1, 16)
stream = g._stream


def replay(_q):
    with torch.cuda.stream(stream):
        b.graph.replay()
    stream.synchronize()


print("graph (1,16) replay + sync      ", pct(timed(replay)))
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
dev = []
for _ in range(200):
    with torch.cuda.stream(stream):
        start.record(stream)
        b.graph.replay()
        end.record(stream)
    end.synchronize()
    dev.append(start.elapsed_time(end) / 1e3)
print("graph (1,16) device time        ", pct(dev))
print("GraphedEmbedder.embed([q])      ", pct(timed(lambda q: g.embed([q]))))
service = EmbedService("start", "graphs", "cuda")
service._embedder = g
print("EmbedService.embed([q])         ", pct(timed(lambda q: service.embed([q]))))
service.close()
del g, service

tmp = Path(tempfile.mkdtemp(prefix="ktp", dir="/tmp"))
os.environ["KALOS_RUNTIME_DIR"] = str(tmp / "run")
sc = SidecarProcess(tmp / "tp.db", name="textparts", dim=384, device="cuda",
                    extra_args=["--embed", "start", "--embed-runtime", "graphs"], ready_timeout=300)
try:
    with Client("textparts", timeout=120) as c:
        emb = c.embedder
        rng = np.random.default_rng(0)
        for s in range(0, 65536, 8192):
            v = rng.standard_normal((8192, 384)).astype(np.float32)
            c.add(v / np.linalg.norm(v, axis=1, keepdims=True), texts=[f"filler {i}" for i in range(s, s + 8192)])
        phases = {"embed op": [], "recall_many": [], "get": [], "hits": [], "whole": []}
        from kalos.client.client import Hit
        for i in range(420):
            q = QUESTIONS[i % len(QUESTIONS)]
            t0 = time.perf_counter()
            vec = emb.embed([q])
            t1 = time.perf_counter()
            batch = c.recall_many(vec, k=8)
            t2 = time.perf_counter()
            hit = batch[0]
            items = dict(zip(hit.ids.tolist(), c.get(hit.ids)))
            t3 = time.perf_counter()
            [Hit.from_item(items[j], s) for j, s in hit if items.get(j) is not None]
            t4 = time.perf_counter()
            if i >= 20:
                for name, d in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                    phases[name].append(d)
        for name, samples in phases.items():
            print(f"recall_text phase {name:12s}", pct(samples))
        print("Client.recall_text              ", pct(timed(lambda q: c.recall_text(q, k=8))))
        print("embed op alone, back to back    ", pct(timed(lambda q: emb.embed([q]))))
finally:
    sc.stop(timeout=20)
