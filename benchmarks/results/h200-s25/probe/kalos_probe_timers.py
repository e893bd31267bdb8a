"""Timers inside a sidecar process for the session 25 recall_text probe: wraps the functions a
recall_text passes through and writes their durations (p50/p90/mean/count, us) on command.
Commands arrive as a file (KALOS_PROBE_DIR/cmd): "reset", or "dump NAME" (to NAME.json)."""
import collections, functools, json, os, threading, time

_stats = collections.defaultdict(list)
_lock = threading.Lock()


def _wrap(owner, attr, label):
    original = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            d = time.perf_counter_ns() - t
            with _lock:
                _stats[label].append(d)
    setattr(owner, attr, timed)
    return original


def install():
    from kalos.ipc import channel
    from kalos.server import embed_graphs, operations, sidecar_embed
    from kalos.store import sqlite
    _wrap(operations.ControlServer, "_recall_text", "op recall_text")
    for op in ("get", "embed", "embedder"):
        h = operations.ControlServer._handlers[op]
        box = type("B", (), {op: staticmethod(h)})
        _wrap(box, op, f"op {op}")
        operations.ControlServer._handlers[op] = getattr(box, op)
    _wrap(sidecar_embed.EmbedService, "embed", "EmbedService.embed")
    _wrap(embed_graphs.GraphedEmbedder, "embed", "GraphedEmbedder.embed")
    _wrap(embed_graphs.GraphedEmbedder, "_run", "GraphedEmbedder._run (H2D, replay, D2H, sync)")
    _wrap(channel.SidecarChannel, "recall_for_client", "recall_for_client")
    _wrap(sqlite.Store, "get", "Store.get")
    # From a frame read to its reply sent, per connection thread.
    local = threading.local()
    recv, send = operations.recv_frame, operations.send_frame

    def recv_frame(*a, **k):
        out = recv(*a, **k)
        local.t = time.perf_counter_ns()
        return out

    def send_frame(*a, **k):
        t1 = time.perf_counter_ns()
        try:
            return send(*a, **k)
        finally:
            t2 = time.perf_counter_ns()
            with _lock:
                _stats["send_frame"].append(t2 - t1)
                if getattr(local, "t", None):
                    _stats["frame read -> reply sent"].append(t2 - local.t)
    operations.recv_frame, operations.send_frame = recv_frame, send_frame
    threading.Thread(target=_commands, daemon=True, name="probe-timers").start()


def _commands():
    folder = os.environ["KALOS_PROBE_DIR"]
    path = os.path.join(folder, "cmd")
    while True:
        time.sleep(0.05)
        try:
            with open(path) as f:
                cmd = f.read().split()
            os.unlink(path)
        except FileNotFoundError:
            continue
        with _lock:
            if cmd[0] == "reset":
                _stats.clear()
            elif cmd[0] == "dump":
                out = {}
                for label, v in _stats.items():
                    a = sorted(v)
                    out[label] = dict(n=len(a), p50=a[len(a) // 2] / 1e3, p90=a[int(len(a) * 0.9)] / 1e3,
                                      mean=sum(a) / len(a) / 1e3)
                with open(os.path.join(folder, cmd[1] + ".json.tmp"), "w") as f:
                    json.dump(out, f)
                os.replace(os.path.join(folder, cmd[1] + ".json.tmp"), os.path.join(folder, cmd[1] + ".json"))
