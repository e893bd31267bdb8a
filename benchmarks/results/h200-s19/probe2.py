"""Session 19 probe 2, in process on one H200 (65,536 x 1024, k = 8): the engine's graph for
batches of 2-64 queries under tunings of the selection and final stages (fewer warps for the
final kernel, merge chunk, final_max): graph p50 (device, CUDA events) and each kernel's time
(profiler). A table last.

    PYTHONPATH=src:benchmarks python3 benchmarks/results/h200-s19/probe2.py
"""
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from diagnostics import build
from gpu_engine import Flusher, time_events

VARIANTS = {
    "default": {},
    "final 8192/4w": {"final_tile": 8192, "final_warps": 4},
    "final 4096/4w": {"final_tile": 4096, "final_warps": 4},
    "final 4096/2w": {"final_tile": 4096, "final_warps": 2},
    "final 2048/2w": {"final_tile": 2048, "final_warps": 2},
    "final_max 256": {"final_max": 256},
    "final_max 4096": {"final_max": 4096},
    "merge 512": {"merge_chunk": 512},
    "merge 2048": {"merge_chunk": 2048},
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
    ref = torch.topk(s64, 8, dim=1).indices.cpu().numpy()
    del s64
    for name, tune in VARIANTS.items():
        eng.retune(tune)
        for nq in (2, 8, 16, 64):
            try:
                ids, _ = eng.search(q[:nq], 8)
                wrong = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, ref))
                graph = eng.graph_of(nq, 8, precision)
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
                print("fail", precision, name, nq, repr(e)[:300], flush=True)
                continue
            kern = " ".join(f"{k}={v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 1.0)
            rows.append((precision, name, nq, p50, wrong, kern))
            print(rows[-1], flush=True)
    del eng
    torch.cuda.empty_cache()
print("\n== table: graph p50 us by Q (wrong answers), kernels")
for r in rows:
    print(f"{r[0]:5} {r[1]:15} Q={r[2]:2} {r[3]:6.1f} w{r[4]}  {r[5]}")
