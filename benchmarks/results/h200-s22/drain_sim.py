"""The sweep while a (fake) GPU kernel polls, on a CPU: the kernel stops by itself (idle_s),
writing its stopped word; its queued rounds then drain (writing no host word); a client's
request arrives meanwhile. Prints how long the request waits for its answer (the real
RecallLoop, SidecarChannel and SlotPolling; the FakeEngine of tests/test_recall_loop.py).

Written by session 22's reviewer to show that candidate-watch.patch, before its mend, left such
a request waiting up to the 1 ms of its wait. Run from the repository root against a tree:
``PYTHONPATH=.snap/trees/n-watch/src python3 benchmarks/results/h200-s22/drain_sim.py [drain_s
[arrive_s]]`` (defaults 200e-6 and 300e-6; the tree's tests/ beside its src/ are used).
"""
import os, sys, threading, time
from pathlib import Path
import numpy as np
import kalos
sys.path.insert(0, str(Path(kalos.__file__).resolve().parents[2] / "tests"))
from conftest import unique_name
from test_recall_loop import FakeEngine, NoExpiry, DIM, K, _submit
from kalos.ipc.channel import Segment, SidecarChannel
from kalos.ipc.protocol import Layout
from kalos.server.cohort import Cohort
from kalos.server.metrics import Metrics
from kalos.server.filters import FilterCache
from kalos.server.recall_loop import RecallLoop
from kalos.server.slot_polling import SlotPolling
from kalos.server.state_lock import StateLock

DRAIN_S = float(sys.argv[1]) if len(sys.argv) > 1 else 200e-6
ARRIVE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 300e-6

class FakeKernel:
    def __init__(self, n):
        self.ns = 8
        self.host_words = np.zeros(4 * self.ns + 11, np.int64)
        self.handed = self.host_words[self.ns:self.ns + n].view(np.uint64)
        self.in_use = self.host_words[2*self.ns:2*self.ns+n]
        self.taken = self.host_words[3*self.ns:3*self.ns+n]
        self.drain_until = None
        self.starts = 0
    @property
    def stopped(self):
        return bool(self.host_words[4 * self.ns + 4])
    def running(self):
        return self.drain_until is None or time.perf_counter() < self.drain_until
    def idle_stop(self):  # the kernel's own stop: its stopped word, then the queue drains silently
        self.host_words[4*self.ns + 4] = 1
        self.drain_until = time.perf_counter() + DRAIN_S
    def set_namespaces(self, ns): pass
    def start(self, active): self.starts += 1
    def stop(self): pass

layout = Layout(8, DIM, 16, 4)
segment = Segment.create(unique_name("sim"), layout.size)
layout.write_header(segment.buf, epoch=1, pid=os.getpid())
channel = SidecarChannel(segment, layout, epoch=1)
engine = FakeEngine()
lock = StateLock()
polling = SlotPolling(lock)
loop = RecallLoop(engine=engine, channel=channel, layout=layout, metrics=Metrics(), cohort=Cohort(8, 0),
                  filters=FilterCache({b"default": 0}), polling=polling, expirer=NoExpiry(),
                  state_lock=lock, stopping=threading.Event(), spin_us=20000)
engine.loop = loop
assert loop.attach(segment.buf)
for slot in range(layout.n_slots):
    channel.activate(slot, os.eventfd(0, os.EFD_NONBLOCK))
waits = []
published = []
_orig = channel.publish
def _pub(*a, **k):
    r = _orig(*a, **k); published.append(time.perf_counter()); return r
channel.publish = _pub
for trial in range(40):
    kernel = FakeKernel(layout.n_slots)
    polling.server, polling.channel = kernel, channel
    loop._stopping.clear()
    t = threading.Thread(target=loop.run); t.start()
    time.sleep(0.005)
    kernel.idle_stop()
    time.sleep(ARRIVE_S)
    t0 = time.perf_counter()
    _submit(loop, [trial % 8])
    slot = trial % 8
    time.sleep(0.02)
    waits.append((published[-1] if published else float('inf')) - t0)
    published.clear()
    loop._stopping.set(); t.join()
w = np.array(waits) * 1e6
print(f"drain {DRAIN_S*1e6:.0f} us, request at +{ARRIVE_S*1e6:.0f} us: wait for the answer p50 {np.median(w):.0f} us, max {w.max():.0f} us")
channel.close(); segment.close()
