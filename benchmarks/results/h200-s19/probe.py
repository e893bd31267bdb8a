"""Session 19 probe, in process on one H200 (65,536 x 1024): (1) the score-writing Triton scan
for batches of 16-64 queries (tf32 and fp16 rows, several tiles) against cuBLAS's GEMM, device
time of the scoring alone; (2) the engine's graph and its final kernel for batches of 2-64
under wider final-kernel tiles (final_tile, final_warps). Prints a table last.

    PYTHONPATH=src:benchmarks python3 benchmarks/results/h200-s19/probe.py
"""
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from diagnostics import build
from gpu_engine import Flusher, time_events

rows = []
n, dim = 65536, 1024
flush = Flusher(torch.device("cuda"))
eng = build(n, dim, "fast", max_batch=64)
st, cols, tk = eng.stagings[0], eng.columns, eng.kernels
rng = np.random.default_rng(5)
q = rng.standard_normal((64, dim)).astype(np.float32)
q /= np.linalg.norm(q, axis=1, keepdims=True)
eng.search(q, 8)  # stages 64 queries and a header with nq = 64 on staging side 0
hdr, hdrf, dq = st.d_hdr, st.d_hdrf, st.d_q
out = torch.empty((64, n), dtype=torch.float32, device="cuda")
stream = eng.stream
for Q in (16, 32, 64):
    qd = dq[:Q]
    q16 = qd.to(cols.x16.dtype)

    def mm32():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.mm(qd, cols.x32[:n].T)

    def mm16():
        torch.mm(q16, cols.x16[:n].T, out_dtype=torch.float32)

    for name, fn in (("cublas tf32", mm32), ("cublas f16", mm16)):
        p50, _ = time_events(fn, 100, stream, flush=flush)
        rows.append((f"scan Q={Q}", name, p50)); print(rows[-1], flush=True)
    for half in (False, True):
        x = cols.x16 if half else cols.x32
        for bn, bd, bq, w, s in ((64, 64, Q, 4, 3), (128, 64, Q, 4, 3), (64, 32, Q, 4, 4), (128, 32, Q, 8, 3),
                                 (64, 128, Q, 4, 2), (32, 64, Q, 4, 3), (64, 64, 16, 4, 3)):
            grid = (-(-n // bn), -(-Q // bq))

            def fn():
                tk.scan_topk_kernel[grid](x, dq, hdr, hdrf, cols.live, cols.ns, cols.ts, out, n, WRITE_SCORES=True,
                                          D=dim, K=64, BLOCK_N=bn, BLOCK_D=bd, BLOCK_Q=bq, HALF=half, FILTER=False,
                                          PREC="tf32", num_warps=w, num_stages=s)
            try:
                with torch.cuda.stream(stream):
                    fn()
                torch.cuda.synchronize()
                ref = (qd.double() @ cols.x32[:n].double().T)
                err = float((out[:Q] - ref).abs().max())
                p50, _ = time_events(fn, 100, stream, flush=flush)
            except Exception as e:  # noqa: BLE001 (a tile that does not compile: report it)
                print("fail", Q, half, bn, bd, bq, w, s, repr(e)[:200], flush=True)
                continue
            name = f"{'f16' if half else 'tf32'} n{bn} d{bd} q{bq} w{w} s{s} err {err:.1e}"
            rows.append((f"scan Q={Q}", name, p50)); print(rows[-1], flush=True)
del eng
torch.cuda.empty_cache()


def final_us(eng, nq, precision):
    qq = q[:nq]
    eng.search(qq, 8)
    graph = eng.graph_of(nq, 8, precision)
    p50, _ = time_events(graph.replay, 200, eng.stream, flush=flush)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            with torch.cuda.stream(eng.stream):
                graph.replay()
        torch.cuda.synchronize()
    fin = [ev.device_time for ev in prof.events()
           if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith("final_kernel")]
    return p50, float(np.median(fin)) if fin else float("nan")


for precision in ("exact", "fast"):
    eng = build(n, dim, precision, max_batch=64)
    for tile, warps in ((8192, 8), (16384, 16), (32768, 32)):
        eng.retune({"final_tile": tile, "final_warps": warps})
        for nq in (2, 8, 16, 64):
            try:
                g, f = final_us(eng, nq, precision)
            except Exception as e:  # noqa: BLE001
                print("fail", precision, tile, warps, nq, repr(e)[:200], flush=True)
                continue
            rows.append((f"final {precision} Q={nq}", f"tile {tile} warps {warps}", g, f)); print(rows[-1], flush=True)
    del eng
    torch.cuda.empty_cache()

print("\n== table (device us p50; final rows: graph, final kernel)")
for r in rows:
    print(f"{r[0]:18} {r[1]:44} " + " ".join(f"{v:7.1f}" for v in r[2:]))
