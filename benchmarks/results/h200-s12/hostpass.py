"""Host cost of one sweep pass (64 pending single recalls), engine stubbed: where the pass's
non-device time goes. Not a benchmark of record; a profiling aid."""
import sys, threading, time, os
import numpy as np
sys.path.insert(0, "src")
from kalos.ipc.channel import Segment, SidecarChannel
from kalos.ipc.protocol import Layout, Op
from kalos.server.cohort import Cohort
from kalos.server.metrics import Metrics
from kalos.server.recall_loop import RecallLoop, FilterCache
from kalos.server.slot_polling import SlotPolling

class StubEngine:
    supports_attached_host = True
    supports_streams = False
    device = "stub"
    def __len__(self): return 1
    def attach_host(self, buf): pass
    def search_attached(self, q, scales, ids, scores, k, flt):
        return np.ones(len(q))
    def search_attached_start(self, q, scales, ids, scores, k, flt):
        result = np.ones(len(q))
        class Done:
            def done(self): return True
            def finish(self): return result
        return Done()
class StubExpirer:
    def expire_due(self): pass
    def near(self): return False

C = int(sys.argv[1]) if len(sys.argv) > 1 else 64
engine = StubEngine()
if "--cuda" in sys.argv:
    from kalos.engine.gpu import TorchEngine as GpuEngine
    precision = "fast" if "--fast" in sys.argv else "exact"
    engine = GpuEngine(1024, capacity=65536, device="cuda", precision=precision)
    rng0 = np.random.default_rng(1)
    for start in range(0, 65536, 8192):
        v = rng0.standard_normal((8192, 1024)).astype(np.float32); v /= np.linalg.norm(v, axis=1, keepdims=True)
        engine.add(np.arange(start, start + 8192), v, np.zeros(8192, np.int32), np.zeros(8192))
    engine.bind_stream()
layout = Layout(64, 1024, 64, 256)
seg = Segment.create("hostpass", layout.size)
layout.write_header(seg.buf, epoch=1, pid=os.getpid())
ch = SidecarChannel(seg, layout, epoch=1)
lock = threading.Lock()
ns = {b"default": 0}
loop = RecallLoop(engine=engine, channel=ch, layout=layout, metrics=Metrics(), cohort=Cohort(64, 0),
                  filters=FilterCache(ns), polling=SlotPolling(lock), expirer=StubExpirer(), state_lock=lock,
                  stopping=threading.Event(), spin_us=50)
loop.attach(seg.buf)
r, w = os.pipe()
for s in range(C):
    ch.activate(s, os.eventfd(0, os.EFD_NONBLOCK))
cols = ch.columns
cols.op[:C] = int(Op.RECALL); cols.k[:C] = 8; cols.n_queries[:C] = 1; cols.flags[:C] = 0
name = b"default"
for s in range(C):
    ch.slots[s].write_namespace(name) if hasattr(ch.slots[s], "write_namespace") else None
cols.namespace_len[:C] = len(name)
cols.namespace[:C] = name
cols.query_row0[:C] = np.random.default_rng(0).standard_normal((C, 1024)).astype(np.float32)

def one_pass(seq):
    cols.req_seq[:C] = seq
    slots, seqs = ch.pending(None)
    loop._answer(slots, seqs, ch.pending_generations)
    loop._land_all()
    assert len(slots) == C

N = 20000 if isinstance(engine, StubEngine) else 3000
for i in range(1, 2000): one_pass(i)
t = time.perf_counter()
for i in range(2000, 2000 + N): one_pass(i)
dt = (time.perf_counter() - t) / N
print(f"C={C} {type(engine).__name__}: pass {dt*1e6:.1f} us")
if "--profile" in sys.argv:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for i in range(30000, 30000 + 5000): one_pass(i)
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
if "--lines" in sys.argv:
    import timeit
    slots = np.arange(C); ks = cols.k[slots]; flags = cols.flags[slots]
    env = dict(np=np, cols=cols, slots=slots, ks=ks, flags=flags, loop=loop, ch=ch)
    for stmt in ["cols.k[slots]", "cols.flags[slots]", "(cols.op[slots] == 1) & (cols.n_queries[slots] == 1)",
                 "(ks >= 1) & (ks <= 64) & ((flags | 3) == 3)", "flags & 1 != 0", "(flags & 1).any()",
                 "cols.namespace[slots]", "np.char.str_len(cols.namespace[slots])", "cols.namespace_len[slots]",
                 "n=cols.namespace[slots]; (n == n[0]).all()", "n=cols.namespace[slots]; n[:1].tolist()",
                 "np.zeros(64, dtype=np.intp)", "loop._query_at[slots]", "cols.n_results[slots] = ks", "cols.status[slots] = 0",
                 "ch.generation[slots]", "cols.req_seq != ch.answered", "ch.pending()", "loop._filters.get((0, b'default', None, None, 0))"]:
        n = 20000
        print(f"{timeit.timeit(stmt, globals=env, number=n)/n*1e6:8.2f} us  {stmt}")
