"""Session 26: the graphed embedder's time on this host, step by step, in process (no sidecar),
and variants of its replay: the H2D and D2H copies captured into the graph, the stream set once
per thread instead of a stream context per call, a leaner input fill. Then the host's plain
Python speed (to compare with the 2-vCPU VM). Prints a table of p50 us.

    PYTHONPATH=.snap/model:src python3 benchmarks/results/h200-s26/inproc.py [--device cuda]
"""
import argparse, json, sys, time

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--rounds", type=int, default=600)
args = parser.parse_args()


def p50(fn, rounds=args.rounds, warm=50):
    for _ in range(warm):
        fn()
    t = []
    for _ in range(rounds):
        a = time.perf_counter(); fn(); t.append(time.perf_counter() - a)
    return np.median(t) * 1e6


rows = []
# -- plain Python speed ------------------------------------------------------------------
reply = {"ok": True, "hits": [[[int(i), float(i) / 7] for i in range(8)]],
         "items": [{"id": i, "namespace": "pydoc", "text": "x" * 700 + " \u00e9", "metadata": {"a": i}, "created_at": 1.5e9,
                    "key": None, "updated_at": None, "expires_at": None} for i in range(8)]}
rows.append(("python: sum(range(10000))", p50(lambda: sum(range(10000)))))
rows.append(("python: json.dumps of a recall_text reply (8 items of 700 chars)", p50(lambda: json.dumps(reply, separators=(",", ":")))))
body = json.dumps(reply).encode()
rows.append(("python: json.loads of it", p50(lambda: json.loads(body))))

if args.device == "cpu":
    for label, v in rows:
        print(f"{v:9.1f}  {label}")
    sys.exit()

import torch
from kalos.server import sidecar_embed as se
from kalos.server.embed_graphs import GraphedEmbedder
from kalos.tools.corpus import QUESTIONS

t0 = time.perf_counter()
g = GraphedEmbedder(se._model_path(), args.device, kernels="triton")
print(f"loaded in {time.perf_counter() - t0:.1f} s; buckets {len(g.buckets)}", flush=True)
q = QUESTIONS[0]
enc = g.tokenizer.encode(q)
n_tok = len(enc.ids)
b = g._bucket(1, 16 if n_tok <= 16 else 32)
s = g._stream
print(f"question of {n_tok} tokens, bucket {b.texts} x {b.tokens}")


def fill():
    host = b.host.numpy()
    host[0] = g._pad_id
    host[1] = 0
    host[2] = 0
    host[1, :, 0] = 1
    e = g.tokenizer.encode(q)
    n = len(e.ids)
    host[0, 0, :n] = e.ids
    host[1, 0, :n] = e.attention_mask
    host[2, 0, :n] = e.type_ids


host_np = b.host.numpy()


def lean_fill():
    ids = g.tokenizer.encode(q).ids
    n = len(ids)
    host_np[0, 0, :n] = ids
    host_np[0, 0, n:] = g._pad_id
    host_np[1, 0, :n] = 1
    host_np[1, 0, n:] = 0


def ctx():
    with torch.cuda.stream(s):
        pass


def h2d():
    with torch.cuda.stream(s):
        b.device_in.copy_(b.host, non_blocking=True)
    s.synchronize()


def replay_sync():
    with torch.cuda.stream(s):
        b.graph.replay()
    s.synchronize()


start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def device_time():
    with torch.cuda.stream(s):
        start.record(s); b.graph.replay(); end.record(s)
    s.synchronize()
    return start.elapsed_time(end) * 1e3


dev = [device_time() for _ in range(300)]
rows.append(("graph replay, device time (events)", float(np.median(dev))))
rows.append(("tokenize (tokenizer.encode)", p50(lambda: g.tokenizer.encode(q))))
rows.append(("fill as embed() does (incl. tokenize)", p50(fill)))
rows.append(("lean fill (incl. tokenize)", p50(lean_fill)))
rows.append(("torch.cuda.stream context enter+exit", p50(ctx)))
rows.append(("H2D copy_ + sync", p50(h2d)))
rows.append(("replay + sync", p50(replay_sync)))
rows.append(("_run (H2D, replay, D2H, sync, numpy copy)", p50(lambda: g._run(b, 1))))
rows.append(("embed([q]) as on main", p50(lambda: g.embed([q]))))
reference = g.embed([q])[0].copy()

# Variant: the copies captured in the graph; the stream as a context, or set once.
graph2 = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph2, pool=g._pool, stream=s, capture_error_mode="thread_local"):
        b.device_in.copy_(b.host, non_blocking=True)
        out2 = g._forward(b.device_in)
        b.host_out.copy_(out2, non_blocking=True)
    s.synchronize()

    def run_captured_ctx():
        with torch.cuda.stream(s):
            graph2.replay()
        s.synchronize()
        return b.host_out[:1].numpy().copy()

    def run_captured_set():
        graph2.replay()
        s.synchronize()
        return b.host_out[:1].numpy().copy()

    def embed_v(run, filler):
        filler()
        return run()

    lean_fill(); v1 = run_captured_ctx()[0]
    rows.append(("captured copies: replay in stream context + sync + copy", p50(run_captured_ctx)))
    rows.append(("  + lean fill (an embed)", p50(lambda: embed_v(run_captured_ctx, lean_fill))))
    torch.cuda.set_stream(s)
    v2 = run_captured_set()[0]
    rows.append(("captured copies, stream set once: replay + sync + copy", p50(run_captured_set)))
    rows.append(("  + lean fill (an embed)", p50(lambda: embed_v(run_captured_set, lean_fill))))
    torch.cuda.set_stream(torch.cuda.default_stream())
    print(f"captured variants against embed(): max |diff| {np.abs(v1 - reference).max():.2e}, {np.abs(v2 - reference).max():.2e}")
    # A second question through the captured graph: the copy reads the host buffer at replay.
    q2 = QUESTIONS[5]
    ids = g.tokenizer.encode(q2).ids
    host_np[0, 0, :len(ids)] = ids; host_np[0, 0, len(ids):] = g._pad_id
    host_np[1, 0, :len(ids)] = 1; host_np[1, 0, len(ids):] = 0
    v3 = run_captured_ctx()[0]
    print(f"second question: max |diff| against embed() {np.abs(v3 - g.embed([q2])[0]).max():.2e}")
except Exception as exc:  # noqa: BLE001
    print(f"captured copies: {type(exc).__name__}: {exc}")

print("\np50 us (in process, one short question)")
for label, v in rows:
    print(f"{v:9.1f}  {label}")
