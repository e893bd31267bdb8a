"""Session 14 probe: per-call wall time of the pieces of a sidecar's op "recall_text" / "embed"
(imported where this folder is on the path; acts in a sidecar when KALOS_TRACE_OUT is set):
medians written at exit. A profiling aid, not kept as a benchmark."""
import atexit
import os
import sys
import time

_OUT = os.environ.get("KALOS_TRACE_OUT")


def _install() -> None:
    import numpy as np

    import kalos.ipc.control as control
    import kalos.server.operations as ops
    import kalos.server.sidecar_embed as se
    import kalos.server.embed_graphs as eg

    times: dict[str, list] = {}

    def wrap(owner, name, label):
        real = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                times.setdefault(label, []).append(time.perf_counter() - t)
        setattr(owner, name, timed)

    handlers = ops.ControlServer._handlers

    class _Holder:
        pass
    for op in [op for op in ("recall_text", "embed", "get") if op in handlers]:
        holder = _Holder()
        holder.fn = handlers[op]
        wrap(holder, "fn", f"op {op} (handler)")
        handlers[op] = holder.fn
    import dataclasses
    wrap(ops, "_item_fields", "_item_fields")
    from kalos.server.recall_loop import FilterCache
    wrap(FilterCache, "filter_for", "filter_for")
    from kalos.server.expirer import Expirer
    wrap(Expirer, "expire_due", "expire_due")
    from kalos.server.slot_polling import SlotPolling
    wrap(SlotPolling, "pause", "polling.pause")
    wrap(ops.ControlServer, "_op_embedder", "op embedder (dim check)")
    wrap(se.EmbedService, "embed", "EmbedService.embed")
    wrap(eg.GraphedEmbedder, "embed", "GraphedEmbedder.embed")
    wrap(eg.GraphedEmbedder, "_run", "GraphedEmbedder._run (copy in, replay, copy out)")
    wrap(control, "send_frame", "send_frame")
    wrap(control, "encode_message", "encode_message")
    ops.send_frame = control.send_frame
    real_search = None
    try:
        from kalos.engine.gpu.engine import TorchEngine
        wrap(TorchEngine, "search", "engine.search")
    except ImportError:
        pass
    from kalos.store.sqlite import Store
    wrap(Store, "get", "store.get")
    real_recv = control.recv_frame

    def recv_frame(sock, **kw):  # from the first byte's arrival is unknowable; body parse only
        out = real_recv(sock, **kw)
        times.setdefault("recv_frame returned", []).append(time.perf_counter())
        return out
    ops.recv_frame = recv_frame

    def dump():
        with open(_OUT, "w") as f:
            for label, vals in times.items():
                if label == "recv_frame returned":
                    continue
                v = np.array(vals[20:] or vals) * 1e6
                f.write(f"{label:50s} n={len(vals):5d} p50 {np.median(v):8.1f} us  p90 {np.percentile(v, 90):8.1f}\n")
    atexit.register(dump)


if _OUT and "serve" in sys.orig_argv and "kalos" in sys.orig_argv:
    _install()
