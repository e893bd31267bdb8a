import os, sys, time, tempfile
from pathlib import Path
import numpy as np
from kalos.server.launcher import SidecarProcess
from kalos import Client
tmp = Path(tempfile.mkdtemp(prefix="tt"))
os.environ["KALOS_RUNTIME_DIR"] = str(tmp / "run")
os.environ["KALOS_TRACE_OUT"] = str(tmp / "trace.txt")
dev = sys.argv[1]
sc = SidecarProcess(tmp / "g.db", name="tt", dim=384, device=dev, extra_args=["--embed", "start"] + (["--embed-runtime", "graphs"] if dev != "cpu" else []), ready_timeout=300)
qs = ["How do I open a file for writing?", "What is a decorator?", "When does Alice celebrate her birthday?"]
try:
    with Client("tt", timeout=120) as c:
        emb = c.embedder
        c.remember([f"memory {i} about things" for i in range(2000)])
        def t(fn, n=300):
            out = []
            for i in range(n):
                s = time.perf_counter(); fn(qs[i % 3]); out.append(time.perf_counter() - s)
            return np.round(np.percentile(out, [50, 99]) * 1e6)
        print("recall_text op:", t(lambda q: c.recall_text(q)))
        print("embed op:", t(lambda q: emb.embed([q])))
finally:
    sc.stop(timeout=20)
print(open(tmp / "trace.txt").read())
