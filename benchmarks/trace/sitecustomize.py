"""Timeline of a sidecar's sweep under a crowd, for ``benchmarks/sweep_trace.py`` (imported by
every Python process whose path holds this folder; it acts only where ``KALOS_TRACE_OUT`` is set
and the process is a sidecar).

Per pass: when its requests were read (and the sweep thread's CPU time from there to the
queueing, and over the landing), when its GPU work was queued, the device time it took
(CUDA events around it on the engine's stream), when the sweep saw it land and when its answers
were published. Per request: how long after its previous answer the client's next request was
first seen by the sweep (the client's turnaround, naps included).
"""
import atexit
import os
import sys
import time

_OUT = os.environ.get("KALOS_TRACE_OUT")


def _install() -> None:
    import numpy as np

    import kalos.ipc.channel as channel_mod
    import kalos.server.recall_loop as loop_mod

    try:
        from kalos.engine.gpu import engine as engine_mod
    except ImportError:  # no torch here: the turnaround alone is traced
        engine_mod = None

    clock = time.perf_counter
    cpu = time.thread_time
    # [t_read, t_queued, q, start_event, end_event, t_landed, t_published, queue_cpu, land_cpu]
    passes: list = []
    turnaround: list = []
    published_at = np.zeros(4096)
    seen_seq = np.zeros(4096, np.uint64)
    current = {}

    real_pending = channel_mod.SidecarChannel.pending

    def pending(self, handed=None, busy=None):
        slots, seqs = real_pending(self, handed, busy)
        if len(slots):
            now = clock()
            fresh = seen_seq[slots] != seqs
            if fresh.any():
                s = slots[fresh]
                seen_seq[s] = seqs[fresh]
                was = published_at[s]
                ok = was > 0
                turnaround.extend((now - was[ok]).tolist())
        return slots, seqs

    real_publish = channel_mod.SidecarChannel.publish

    def publish(self, slots, seqs, generations=None):
        real_publish(self, slots, seqs, generations)
        if len(slots):
            published_at[slots] = clock()

    real_answer = loop_mod.RecallLoop._answer

    def answer(self, slots, seqs, generations=None):
        current["read"] = clock()
        current["read_cpu"] = cpu()
        current["q"] = len(slots)
        return real_answer(self, slots, seqs, generations)

    def timed(real_start):
        def start(self, first, *args, **kwargs):
            import torch

            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record(self._stream)
            flight = real_start(self, first, *args, **kwargs)
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record(self._stream)
            rec = [current.get("read", 0.0), clock(), len(first), ev0, ev1, 0.0, 0.0,
                   cpu() - current.get("read_cpu", 0.0), 0.0]
            passes.append(rec)
            current["flight_" + str(id(flight))] = rec
            return flight

        return start

    real_land = loop_mod.RecallLoop._land

    def land(self, flight):
        rec = current.pop("flight_" + str(id(flight.search)), None)
        t, c = clock(), cpu()
        real_land(self, flight)
        if rec is not None:
            rec[5] = t
            rec[6] = clock()
            rec[8] = cpu() - c

    def dump() -> None:
        rows = []
        for read, queued, q, ev0, ev1, landed, published, launch_cpu, land_cpu in passes:
            if not landed:
                continue
            try:
                device_ms = ev0.elapsed_time(ev1)
            except Exception:  # noqa: BLE001
                device_ms = float("nan")
            rows.append((read, queued, q, device_ms * 1e-3, landed, published, launch_cpu, land_cpu))
        np.savez(_OUT, passes=np.array(rows, dtype=np.float64).reshape(-1, 8),
                 turnaround=np.array(turnaround, dtype=np.float64))

    channel_mod.SidecarChannel.pending = pending
    channel_mod.SidecarChannel.publish = publish
    loop_mod.RecallLoop._answer = answer
    if engine_mod is not None:
        engine_mod.TorchEngine.search_attached_start = timed(engine_mod.TorchEngine.search_attached_start)
        if hasattr(engine_mod.TorchEngine, "search_places_start"):  # (the trees before it have none)
            engine_mod.TorchEngine.search_places_start = timed(engine_mod.TorchEngine.search_places_start)
    loop_mod.RecallLoop._land = land
    atexit.register(dump)


if _OUT:
    import importlib.abc
    import importlib.machinery

    class _After(importlib.abc.MetaPathFinder):
        """Installs the trace once kalos.server.recall_loop has been imported."""

        def find_spec(self, name, path, target=None):
            if name != "kalos.server.sidecar":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            loader = spec.loader
            real_exec = loader.exec_module

            def exec_module(module):
                real_exec(module)
                _install()

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _After())
