# Session 27: recall_text in process on the VM with a stand-in embedder (a CPU sidecar, N rows):
#   PYTHONPATH=<tree>/src N=2000 R=4000 OPENBLAS_NUM_THREADS=1 python3 benchmarks/results/h200-s27/rt_vm.py
# recall_text's Python cost without a model: a CPU sidecar in-process, a fake embedder.
import os, sys, threading, time, tempfile, hashlib
import numpy as np
import kalos.server.sidecar_embed as se
class Fake:
    name="fake"; dim=384
    def embed(self, texts):
        out=np.empty((len(texts),384),np.float32)
        for i,t in enumerate(texts):
            r=np.random.default_rng(int.from_bytes(hashlib.blake2b(t.encode(),digest_size=8).digest(),'little'))
            v=r.standard_normal(384).astype(np.float32); out[i]=v/np.linalg.norm(v)
        return out
se.load_embedder=lambda *a,**k: Fake()
from kalos import Client
from kalos.server.sidecar import Sidecar, SidecarConfig
os.environ.setdefault("KALOS_RUNTIME_DIR", tempfile.mkdtemp())
tmp=tempfile.mkdtemp()
cfg=SidecarConfig(store=os.path.join(tmp,"m.db"), name="prof", dim=384, device="cpu", embed="start")
sc=Sidecar(cfg); th=threading.Thread(target=sc.serve_forever,daemon=True); th.start()
N=int(os.environ.get("N","20000"))
with Client("prof", timeout=60) as c:
    texts=[f"memory {i}: the user said something about topic {i%97} at the meeting" for i in range(N)]
    for s in range(0,N,2000):
        c.remember(texts[s:s+2000], metadata=[{"user":"u1","i":i} for i in range(s,min(N,s+2000))])
    qs=[f"what did the user say about topic {i}?" for i in range(97)]
    for q in qs[:20]: c.recall_text(q,k=8)
    ts=[]
    t0=time.process_time()
    for i in range(int(os.environ.get("R","2000"))):
        a=time.perf_counter_ns(); c.recall_text(qs[i%97],k=8); ts.append(time.perf_counter_ns()-a)
    cpu=time.process_time()-t0
    ts=np.array(ts)/1e3
    print(f"recall_text p50 {np.percentile(ts,50):.1f} us p90 {np.percentile(ts,90):.1f}; process CPU per call {cpu/len(ts)*1e6:.1f} us")
sc.stop() if hasattr(sc,"stop") else None
