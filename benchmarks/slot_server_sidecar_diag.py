"""Debug: a sidecar (in this process) with the resident slot server, a client thread, and what
the kernel did with the client's single recalls, for a few segment layouts."""
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kalos import Client
from kalos.engine.torch_engine import TorchEngine
from kalos.sidecar import Sidecar, SidecarConfig
from kalos.store import Store

n, d = 65536, 1024
rng = np.random.default_rng(0)
x = rng.standard_normal((n, d), dtype=np.float32)
tmp = Path(tempfile.mkdtemp())
with Store.open(tmp / "m.db", dim=d) as s:
    for lo in range(0, n, 16384):
        s.add(x[lo:lo + 16384] / np.linalg.norm(x[lo:lo + 16384], axis=1, keepdims=True), namespace="default")
for slots, max_batch, max_k, first_batch in [(8, 8, 32, False), (32, 256, 64, False), (32, 256, 64, True), (32, 8, 64, True)]:
    name = f"dbg{slots}-{max_batch}-{int(first_batch)}"
    cfg = SidecarConfig(store=tmp / "m.db", name=name, dim=d, slots=slots, max_k=max_k, max_batch=max_batch)
    sc = Sidecar(cfg, engine_factory=lambda _d, dim, cap: TorchEngine(dim, device="cuda", capacity=cap))
    th = threading.Thread(target=sc.serve_forever, daemon=True)
    th.start()
    srv = sc._slot_server
    with Client(name, timeout=30) as c:
        if first_batch:
            c.recall_many(x[:512], k=8)
        lat = []
        for i in range(300):
            t = time.perf_counter()
            c.recall(x[i], k=8)
            lat.append(time.perf_counter() - t)
        st = c.stats()
        print(name, "polled", st["gpu_polled"], "sweep", st["queries"], "p50 us", round(np.median(lat) * 1e6, 1),
              "running", srv.running(), "launches", srv.launches, "programs", srv.programs,
              "not_resident", srv.not_resident, "answered", srv.answered[:3], "handed", srv.handed[:3],
              "hctl", srv._hctl.tolist(), "seen", srv._seen[:, :3].tolist(), flush=True)
    sc.stop()
    th.join(timeout=30)
