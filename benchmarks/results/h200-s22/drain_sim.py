"""The sweep while a (fake) GPU kernel polls, on a CPU: the kernel stops by itself (idle_s),
writing its stopped word; its queued rounds then drain (writing no host word); a client's
request arrives meanwhile. Prints how long the request waits for its answer (the real
RecallLoop, SidecarChannel and SlotPolling; the FakeEngine and FakeKernel of
tests/test_recall_loop.py, whose new_loop() builds them).

Written by session 22's reviewer to show that candidate-watch.patch, before its mend, left such
a request waiting up to the 1 ms of its wait. Run from the repository root against a tree made
by make_trees.sh: ``PYTHONPATH=.snap/trees/n-watch/src python3
benchmarks/results/h200-s22/drain_sim.py [drain_s [arrive_s]]`` (defaults 200e-6 and 300e-6;
the tree's tests/ beside its src/ are used).
"""
import sys
import threading
import time
from pathlib import Path

import numpy as np

import kalos

sys.path.insert(0, str(Path(kalos.__file__).resolve().parents[2] / "tests"))
from test_recall_loop import FakeKernel, _submit, new_loop  # noqa: E402

DRAIN_S = float(sys.argv[1]) if len(sys.argv) > 1 else 200e-6
ARRIVE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 300e-6

loop, segment = new_loop(spin_us=20000)
channel = loop.channel
published: list[float] = []
_publish = channel.publish


def publish_timed(*args, **kwargs):
    out = _publish(*args, **kwargs)
    published.append(time.perf_counter())
    return out


channel.publish = publish_timed
waits = []
for trial in range(40):
    kernel = FakeKernel(loop.layout.n_slots)
    loop._polling.install(kernel, channel)
    loop._stopping.clear()
    thread = threading.Thread(target=loop.run)
    thread.start()
    time.sleep(0.005)
    kernel.stop_by_itself(DRAIN_S)
    time.sleep(ARRIVE_S)
    started = time.perf_counter()
    _submit(loop, [trial % loop.layout.n_slots])
    time.sleep(0.02)
    waits.append((published[-1] if published else float("inf")) - started)
    published.clear()
    loop._stopping.set()
    thread.join()
w = np.array(waits) * 1e6
print(f"drain {DRAIN_S * 1e6:.0f} us, request at +{ARRIVE_S * 1e6:.0f} us: wait for the answer p50 {np.median(w):.0f} us, "
      f"max {w.max():.0f} us")
channel.close()
segment.close()
