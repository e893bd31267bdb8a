"""The sweep's CPU per pass of C pending single recalls, with the real GPU engine and no clients:
what the host spends reading the slots, queueing the pass and landing it (the GPU's time left
out), and a cProfile of it by own time. A profiling aid, not a benchmark of record.

    PYTHONPATH=src python3 benchmarks/results/h200-s13/hostpass.py 16 [--profile]"""
import os
import sys
import threading
import time

import numpy as np

from kalos.engine.gpu import TorchEngine
from kalos.ipc.channel import Segment, SidecarChannel
from kalos.ipc.protocol import Layout, Op
from kalos.server.cohort import Cohort
from kalos.server.metrics import Metrics
from kalos.server.recall_loop import FilterCache, RecallLoop
from kalos.server.slot_polling import SlotPolling


class NoExpiry:
    def expire_due(self):
        pass

    def near(self):
        return False


C = int(sys.argv[1])
engine = TorchEngine(1024, capacity=65536, device="cuda", precision="exact")
rng = np.random.default_rng(1)
for start in range(0, 65536, 8192):
    v = rng.standard_normal((8192, 1024)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    engine.add(np.arange(start, start + 8192), v, np.zeros(8192, np.int32), np.zeros(8192))
engine.bind_stream()
layout = Layout(128, 1024, 64, 256)
seg = Segment.create("hostpass", layout.size)
layout.write_header(seg.buf, epoch=1, pid=os.getpid())
ch = SidecarChannel(seg, layout, epoch=1)
lock = threading.Lock()
loop = RecallLoop(engine=engine, channel=ch, layout=layout, metrics=Metrics(), cohort=Cohort(128, 0),
                  filters=FilterCache({b"default": 0}), polling=SlotPolling(lock), expirer=NoExpiry(),
                  state_lock=lock, stopping=threading.Event(), spin_us=50)
loop.attach(seg.buf)
for s in range(C):
    ch.activate(s, os.eventfd(0, os.EFD_NONBLOCK))
cols = ch.columns
cols.op[:C] = int(Op.RECALL)
cols.k[:C] = 8
cols.n_queries[:C] = 1
cols.flags[:C] = 0
cols.namespace[:C] = b"default"
cols.namespace_len[:C] = 7
cols.query_row0[:C] = rng.standard_normal((C, 1024)).astype(np.float32)
import torch  # noqa: E402

cpu = time.thread_time
launch, landing = [], []


def one_pass(seq):
    cols.req_seq[:C] = seq
    c0 = cpu()
    slots, seqs = ch.pending(None)
    loop._answer(slots, seqs, ch.pending_generations)
    c1 = cpu()
    engine.stream.synchronize()
    c2 = cpu()
    loop._land_all()
    c3 = cpu()
    launch.append(c1 - c0)
    landing.append(c3 - c2)
    assert len(slots) == C and int(cols.resp_seq[0]) == seq


for i in range(1, 500):
    one_pass(i)
launch.clear()
landing.clear()
for i in range(500, 3500):
    one_pass(i)
print(f"C={C}: CPU per pass: read+queue {np.median(launch)*1e6:.1f} us, land+publish {np.median(landing)*1e6:.1f} us")
if "--profile" in sys.argv:
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for i in range(5000, 7000):
        one_pass(i)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
if "--ops" in sys.argv:
    def per(fn, n=3000):
        fn()
        t = cpu()
        for _ in range(n):
            fn()
        return (cpu() - t) / n * 1e6
    ev = torch.cuda.Event()
    graph = next(iter(engine._graphs.values()))
    stream = engine.stream
    print(f"Event() {per(torch.cuda.Event):.2f} us; record {per(ev.record):.2f}; "
          f"record(stream) {per(lambda: ev.record(stream)):.2f}; query {per(ev.query):.2f}; "
          f"replay {per(graph.replay, 300):.2f}")
