"""Session 14, run 3: (1) the graphed MiniLM's device time per bucket, eager kernels against
inductor-compiled ones captured the same way (a probe: is fusing worth it?); (2) recall_text
through op "recall_text" against the three round trips, same sidecar. A profiling aid.

    PYTHONPATH=.snap/model:src python3 benchmarks/results/h200-s14/textparts2.py"""
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kalos import Client
from kalos.server.embed_graphs import GraphedEmbedder
from kalos.server.launcher import SidecarProcess
from kalos.server.sidecar_embed import _model_path
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


def device_time(graph, stream, n=200):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(n):
        with torch.cuda.stream(stream):
            start.record(stream)
            graph.replay()
            end.record(stream)
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


g = GraphedEmbedder(_model_path(), "cuda")
stream = g._stream
texts = list(QUESTIONS[:16])
for shape in ((1, 16), (1, 32), (8, 32), (32, 64)):
    b = g._bucket(*shape)
    print(f"eager kernels, graph {shape}: device", pct(device_time(b.graph, stream)))
reference = g.embed(texts)

try:
    import torch._inductor.config as inductor_config  # noqa: F401
    t = time.perf_counter()
    compiled = torch.compile(g._forward, dynamic=False)
    for shape in ((1, 16), (1, 32), (8, 32), (32, 64)):
        inp = torch.zeros((3, *shape), dtype=torch.int64, device="cuda")
        inp[1, :, 0] = 1
        s0 = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(3):
                compiled(inp)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, stream=stream):
            out = compiled(inp)
        print(f"inductor, graph {shape}: compile+capture {time.perf_counter() - s0:.1f} s; device",
              pct(device_time(graph, stream)))
        if shape == (1, 16):  # the same vectors? one text at a time through the compiled graph
            vecs = []
            for text in texts:
                e = g.tokenizer.encode(text)
                inp.zero_()
                inp[1, :, 0] = 1
                n = min(len(e.ids), 16)
                inp[0, 0, :n] = torch.tensor(e.ids[:n])
                inp[1, 0, :n] = 1
                with torch.cuda.stream(stream):
                    graph.replay()
                stream.synchronize()
                vecs.append(out[0].float().cpu().numpy().copy())
            vecs = np.array(vecs, np.float64)
            ok = [len(g.tokenizer.encode(t).ids) <= 16 for t in texts]
            cos = (vecs * reference).sum(1) / np.linalg.norm(vecs, axis=1) / np.linalg.norm(reference, axis=1)
            print(f"inductor (1,16) against the eager graphs: min cosine {cos[ok].min():.7f} over {sum(ok)} texts")
    print(f"inductor total {time.perf_counter() - t:.1f} s")
except Exception as exc:  # noqa: BLE001 - a probe
    print("inductor failed:", type(exc).__name__, str(exc)[:300])
del g

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
        c.remember(list(QUESTIONS))
        for _ in range(2):
            print("recall_text, op recall_text      ", pct(timed(lambda q: c.recall_text(q, k=8))))
            emb.text_op = False
            print("recall_text, three round trips   ", pct(timed(lambda q: c.recall_text(q, k=8))))
            emb.text_op = True
        print("embed op alone, back to back      ", pct(timed(lambda q: emb.embed([q]))))
        print("get of 8 alone                    ", pct(timed(lambda q: c.get([1, 2, 3, 4, 5, 6, 7, 8]))))
        print("ping op                           ", pct(timed(lambda q: c._control({"op": "count"}))))
finally:
    sc.stop(timeout=20)
