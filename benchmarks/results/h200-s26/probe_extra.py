# Session 26: exec'd by the session 25 probe's probe_serve.py in the sidecar before `kalos serve`
# (KALOS_PROBE_EXTRA). Adds the connection thread's CPU time per recall_text (what it did not
# spend waiting: for the GIL, a socket, a sleep) to the probe's timers; KALOS_PROBE_SWITCH sets
# the interpreter's switch interval (s); KALOS_PROBE_KWAIT the sweep's longest wait for the
# polling kernel's news (s).
import os as _os, sys as _sys, time as _time
from kalos.server import operations as _ops
if _os.environ.get("KALOS_PROBE_SWITCH"):
    _sys.setswitchinterval(float(_os.environ["KALOS_PROBE_SWITCH"]))
if _os.environ.get("KALOS_PROBE_KWAIT"):
    from kalos.server import recall_loop as _rl
    _rl._KERNEL_WAIT_S = float(_os.environ["KALOS_PROBE_KWAIT"])
_inner = _ops.ControlServer._recall_text


def _recall_text_cpu(self, *a, **k):
    c = _time.thread_time_ns()
    try:
        return _inner(self, *a, **k)
    finally:
        d = _time.thread_time_ns() - c
        with kalos_probe_timers._lock:
            kalos_probe_timers._stats["op recall_text: its thread's CPU time"].append(d)


_ops.ControlServer._recall_text = _recall_text_cpu
