import asyncio, os, sys, tempfile, time, collections
import numpy as np
from kalos import AsyncClient, Client
from kalos.server.launcher import SidecarProcess
from kalos.client import aio
DIM = int(os.environ.get("DIM", 384)); N = int(os.environ.get("N", 50000))
C = int(sys.argv[1]); PER = int(sys.argv[2])
tmp = tempfile.mkdtemp(dir="/tmp"); name = f"acount-{os.getpid()}"
side = SidecarProcess(os.path.join(tmp, "s.db"), name=name, dim=DIM, device="cpu")
rng = np.random.default_rng(0)
with Client(name, timeout=30) as c:
    m = rng.standard_normal((N, DIM)).astype(np.float32)
    for s in range(0, N, 5000): c.add(m[s:s+5000])
qs = rng.standard_normal((256, DIM)).astype(np.float32)
stats = collections.Counter(); T = []
async def main():
    async with AsyncClient(name, timeout=10.0) as client:
        plan, note = client._spin_for, client._note_spin
        def planned(w):
            s = plan(w); stats[f"spin {w*1e6:.0f}->{s*1e6:.0f}"] += 1; T.append((time.perf_counter(), s)); return s
        def noting(*, caught):
            stats[f"caught {caught}"] += 1; note(caught=caught)
        client._spin_for, client._note_spin = planned, noting
        await asyncio.gather(*(client.recall(q, k=8) for q in qs[:C]))
        async def one(i):
            for j in range(PER):
                await client.recall(qs[(i * PER + j) % 256], k=8)
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(C)))
        dt = time.perf_counter() - t
        gaps = np.diff([t for t, _ in T]) * 1e3
        kinds = [s for _, s in T][:-1]
        for w in sorted(set(kinds)):
            g = gaps[np.array(kinds) == w]; print(f"  after spin {w*1e6:.0f}: n={len(g)} median gap {np.median(g):.2f} ms max {g.max():.2f}")
        print("  first 40 gaps", np.round(gaps[:40], 1).tolist())
        print(f"C={C}: {C*PER/dt:,.0f} recalls/s", dict(stats))
try:
    asyncio.run(main())
finally:
    side.stop()
