import sys, time, tempfile, numpy as np, threading
sys.path.insert(0, "src")  # run from the repository root: .venv/bin/python benchmarks/results/cpu-s42/add_alone.py
from kalos.server.launcher import SidecarProcess
from kalos.store.sqlite import Store
from kalos.client.client import Client
dim = 384
with tempfile.TemporaryDirectory() as tmp:
    p = f"{tmp}/s.db"
    with Store.open(p, dim=dim) as st:
        st.add(np.random.default_rng(0).standard_normal((4096, dim)).astype(np.float32), namespace="default")
    with SidecarProcess(p, name="addlat", device="cpu") as sc:
        for writers in (1, 8):
            times = []
            def w(i):
                rng = np.random.default_rng(i)
                with Client("addlat") as c:
                    for _ in range(40):
                        v = rng.standard_normal((1, dim)).astype(np.float32)
                        t = time.perf_counter(); c.add(v, namespace="w"); times.append(time.perf_counter() - t)
            t0 = time.perf_counter()
            th = [threading.Thread(target=w, args=(i,)) for i in range(writers)]
            [x.start() for x in th]; [x.join() for x in th]
            el = time.perf_counter() - t0
            a = np.array(times) * 1e3
            print(f"writers {writers}: {len(a)/el:.0f} adds/s, p50 {np.percentile(a,50):.2f} ms, p99 {np.percentile(a,99):.2f}")
