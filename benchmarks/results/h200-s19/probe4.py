"""Session 19 probe 4, in process on one H200 (65,536 x 1024): the final kernel's certified
re-score split over several programs per query (Tuning.final_split_rows candidates each) against
one program per query (0), batches of 2-64, k = 8 and 16. Graph p50 (device, CUDA events), each
kernel's time (profiler), wrong answers against a float64 top-k. A table last.

    PYTHONPATH=src:benchmarks python3 benchmarks/results/h200-s19/probe4.py
"""
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from diagnostics import build
from gpu_engine import Flusher, time_events
from kalos.engine.gpu.planner import DEFAULT_TUNING

VARIANTS = {
    "one program": {"final_split_rows": 0},
    "split 8 rows": {"final_split_rows": 8},
    "split 4 rows": {"final_split_rows": 4},
    "split 16 rows": {"final_split_rows": 16},
}
n, dim = 65536, 1024
flush = Flusher(torch.device("cuda"))
rng = np.random.default_rng(5)
q = rng.standard_normal((64, dim)).astype(np.float32)
q /= np.linalg.norm(q, axis=1, keepdims=True)
rows = []
for precision in ("exact", "fast"):
    eng = build(n, dim, precision, max_batch=64)
    s64 = torch.from_numpy(q).cuda().double() @ eng.columns.x32[:n].double().T
    ref = {k: torch.topk(s64, k, dim=1).indices.cpu().numpy() for k in (8, 16)}
    del s64
    for name, tune in VARIANTS.items():
        eng.retune(DEFAULT_TUNING.replace(tune))
        for k in (8, 16):
            for nq in (2, 8, 16, 64):
                try:
                    ids, _ = eng.search(q[:nq], k)
                    wrong = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, ref[k]))
                    graph = eng.graph_of(nq, k, precision)
                    p50, _ = time_events(graph.replay, 200, eng.stream, flush=flush)
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            with torch.cuda.stream(eng.stream):
                                graph.replay()
                        torch.cuda.synchronize()
                    per = {}
                    for ev in prof.events():
                        if ev.device_type == torch.autograd.DeviceType.CUDA:
                            per[ev.name[:14]] = per.get(ev.name[:14], 0.0) + ev.device_time / 20
                except Exception as e:  # noqa: BLE001 (a variant that fails: report it, go on)
                    print("fail", precision, name, k, nq, repr(e)[:300], flush=True)
                    continue
                kern = " ".join(f"{a}={v:.1f}" for a, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 1.0)
                rows.append((precision, name, k, nq, p50, wrong, eng.stats["fallbacks"], kern))
                print(rows[-1], flush=True)
    del eng
    torch.cuda.empty_cache()
print("\n== table: graph p50 us (wrong answers, fallbacks so far), kernels")
for r in rows:
    print(f"{r[0]:5} {r[1]:20} k={r[2]:2} Q={r[3]:2} {r[4]:6.1f} w{r[5]} f{r[6]}  {r[7]}")
