"""Session 14: where the sweep's CPU per pass goes inside TorchEngine._queue_pass (a copy of
its body with a clock between the steps), and what Python's garbage collector costs the pass
(collector on, frozen after warm-up, off). A profiling aid.

    PYTHONPATH=src python3 benchmarks/results/h200-s14/hostpass2.py 16"""
import gc
import sys
import time

import numpy as np

sys.argv = [sys.argv[0], sys.argv[1] if len(sys.argv) > 1 else "16"]
sys.path.insert(0, "benchmarks/results/h200-s13")
import torch  # noqa: E402

import hostpass as hp  # noqa: E402  (builds the engine, the segment, the loop; runs its own timing)
from kalos.engine.gpu import engine as engine_mod  # noqa: E402

steps: dict[str, list] = {}
ns = time.perf_counter_ns


def queue_pass(self, nq, k, flt, device_norms, side, scales, query_at, ids_at, scores_at):
    t = [ns()]
    st = self.stagings[side]
    key, certified = self._launch_plan(nq, k, flt, device_norms, side)
    t.append(ns())
    self.fill_header(self.rows.size, nq, k, flt, staging=st)
    t.append(ns())
    self.stats["searches"] += nq
    self._run(key, None, wait=False)
    t.append(ns())
    event = self._side_events[side]
    if event is None:
        event = self._side_events[side] = torch.cuda.Event()
    event.record(self._stream)
    t.append(ns())
    flight = engine_mod.AttachedPass(side, event)

    def finish():
        if flight in self._flights:
            self._flights.remove(flight)
        event.synchronize()
        return st.scales(nq)

    flight.bind(finish)
    self._flights.append(flight)
    t.append(ns())
    for name, a, b in zip(("launch plan", "fill_header", "_run (graph replay)", "event record", "AttachedPass+bind"),
                          t, t[1:]):
        steps.setdefault(name, []).append((b - a) / 1e3)
    return flight


engine_mod.TorchEngine._queue_pass = queue_pass
cpu = time.thread_time


def measure(label):
    hp.launch.clear()
    hp.landing.clear()
    steps.clear()
    for i in range(measure.seq, measure.seq + 3000):
        hp.one_pass(i)
    measure.seq += 3000
    print(f"{label:28s} read+queue {np.median(hp.launch) * 1e6:6.1f} us (p90 {np.percentile(hp.launch, 90) * 1e6:6.1f}),"
          f" land+publish {np.median(hp.landing) * 1e6:6.1f} us (p90 {np.percentile(hp.landing, 90) * 1e6:6.1f})")


measure.seq = 10_000
measure("collector on")
print("  inside _queue_pass (wall, p50 us): " + ", ".join(f"{k} {np.median(v):.1f}" for k, v in steps.items()))
gc.freeze()
measure("collector on, frozen")
gc.disable()
measure("collector off")
gc.enable()
measure("collector on again")
