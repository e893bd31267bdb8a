# Session 28: a reply's items, in process on the VM (a CPU sidecar in this process, a stand-in
# embedder, N rows of short texts with metadata, keyed). Per call p50 / p90 us and the process's
# CPU per call, for recall_text (k = 8, questions that repeat), get of 8 ids and get of 8 keys.
#   PYTHONPATH=<tree>/src N=2000 R=3000 OPENBLAS_NUM_THREADS=1 KALOS_ITEM_CACHE_BYTES=<bytes> \
#       python3 benchmarks/results/cpu-s28/reads_vm.py
import hashlib, os, tempfile, threading, time
import numpy as np
import kalos.server.sidecar_embed as se

class StandIn:
    name = "stand-in"; dim = 384
    def embed(self, texts):
        out = np.empty((len(texts), 384), np.float32)
        for i, t in enumerate(texts):
            r = np.random.default_rng(int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little"))
            v = r.standard_normal(384).astype(np.float32); out[i] = v / np.linalg.norm(v)
        return out

se.load_embedder = lambda *a, **k: StandIn()
from kalos import Client
from kalos.server.sidecar import Sidecar, SidecarConfig
os.environ.setdefault("KALOS_RUNTIME_DIR", tempfile.mkdtemp())
tmp = tempfile.mkdtemp()
sidecar = Sidecar(SidecarConfig(store=os.path.join(tmp, "m.db"), name="reads", dim=384, device="cpu", embed="start"))
threading.Thread(target=sidecar.serve_forever, daemon=True).start()
N, R = int(os.environ.get("N", "2000")), int(os.environ.get("R", "3000"))
rng = np.random.default_rng(0)
with Client("reads", timeout=60) as c:
    texts = [f"memory {i}: the user said something about topic {i % 97} at the meeting" for i in range(N)]
    keys = [f"key-{i}" for i in range(N)]
    for s in range(0, N, 2000):
        c.remember(texts[s:s + 2000], keys=keys[s:s + 2000], metadata=[{"user": "u1", "i": i} for i in range(s, min(N, s + 2000))])
    questions = [f"what did the user say about topic {i}?" for i in range(97)]
    ids = [int(item.id) for item in c.get(keys=keys)]
    picks = [rng.choice(N, 8, replace=False) for _ in range(97)]
    calls = {
        "recall_text": lambda i: c.recall_text(questions[i % 97], k=8),
        "get 8 ids": lambda i: c.get(ids=[ids[j] for j in picks[i % 97]]),
        "get 8 keys": lambda i: c.get(keys=[keys[j] for j in picks[i % 97]]),
    }
    for what, call in calls.items():
        for i in range(200):
            call(i)
        times = []
        cpu = time.process_time()
        for i in range(R):
            start = time.perf_counter_ns(); call(i); times.append(time.perf_counter_ns() - start)
        cpu = (time.process_time() - cpu) / R * 1e6
        times = np.array(times) / 1e3
        print(f"{what:12s} p50 {np.percentile(times, 50):7.1f} us  p90 {np.percentile(times, 90):7.1f}  CPU/call {cpu:7.1f} us")
