import asyncio, os, sys, tempfile, time, shutil
import numpy as np
sys.path.insert(0, "benchmarks")
from async_client import SidecarProcess, crowd, reference_ids
from kalos import Client
tmp = tempfile.mkdtemp(prefix="kab", dir="/tmp")
name = f"prof-{os.getpid()}"
side = SidecarProcess(os.path.join(tmp, "store.db"), name=name, dim=384, device="cpu")
try:
    rng = np.random.default_rng(0)
    m = rng.standard_normal((1000, 384)).astype(np.float32)
    with Client(name, timeout=30) as c:
        c.add(m)
    qs = rng.standard_normal((256, 384)).astype(np.float32)
    want = reference_ids(m, qs, 8)
    C = int(os.environ.get("C", "16"))
    lat, rate, req, wrong = crowd(name, qs, want, C, int(os.environ.get("N", "4000")) // C)
    print(f"C={C} p50 {np.median(lat)*1e6:.1f} us rate {rate:,.0f}/s {len(lat)/req:.1f} a request wrong {wrong}")
finally:
    side.stop(); shutil.rmtree(tmp, ignore_errors=True)
