"""Where the time of one Q=1 search goes on the device, and which scan tile is fastest.

Run on the device machine (one H200), from the repo root:

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_diag.py --out $OUT

Parts (each prints as it goes; a short table last):
1. ceilings: device copy bandwidth, a read-only reduction (``x.sum()``), cuBLAS ``mv``;
2. the engine's graph for Q=1, k=8 (exact and fast): device time by CUDA events, and the
   per-kernel / per-copy durations inside it from the PyTorch profiler (CUPTI);
3. the v2 score-writing scan kernel alone over a sweep of tiles (device time, GB/s);
4. a Triton kernel reading from and writing to page-locked host memory (the zero-copy path):
   correctness and device time;
5. host-side costs of one ``search`` call: wall time against device time.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from gpu_engine import Flusher, time_events  # benchmarks/: the script's own folder is on sys.path
from kalos.engine.torch_engine import TorchEngine

OUT_ROWS: list[dict] = []


def emit(**kw) -> None:
    OUT_ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def build(n: int, dim: int, precision: str, max_batch: int = 256) -> TorchEngine:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(n, dim, device="cuda", generator=g)
    x /= torch.linalg.vector_norm(x, dim=1, keepdim=True)
    eng = TorchEngine(dim, capacity=n, device="cuda", precision=precision, max_batch=max_batch)
    xh = x.cpu().numpy()
    ids = np.arange(n, dtype=np.int64)
    eng.add(ids, xh, np.zeros(n, np.int32), np.zeros(n))
    return eng


def ceilings(n: int, dim: int, stream, flush) -> None:
    x = torch.randn(n, dim, device="cuda")
    q = torch.randn(dim, device="cuda")
    nbytes = x.numel() * 4
    for name, fn in (("read_sum", lambda: x.sum()), ("cublas_mv", lambda: torch.mv(x, q)),
                     ("copy", lambda: x.clone())):
        p50, p99 = time_events(fn, 100, stream, flush=flush)
        moved = nbytes * (2 if name == "copy" else 1)
        emit(part="ceiling", what=name, n=n, p50_us=p50, p99_us=p99, tb_s=moved / (p50 * 1e-6) / 1e12)


def check_batch(eng: TorchEngine, nq: int) -> dict:
    """The batch's top-8 against a float64 reference on the device: rows that differ beyond ties."""
    q = np.random.default_rng(nq).standard_normal((nq, eng.dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    ids, scores = eng.search(q, 8)
    n = eng.rows.size
    ref = torch.from_numpy(q).to("cuda", torch.float64) @ eng._x32[:n].to(torch.float64).T
    top = torch.topk(ref, 8, dim=1).values[:, -1].cpu().numpy()
    got = ref.gather(1, torch.from_numpy(ids).cuda()).cpu().numpy()
    wrong = int(((got < top[:, None] - 1e-6)).any(axis=1).sum())
    return {"wrong_queries": wrong, "max_score_err": float(np.abs(got - scores).max()),
            "fallbacks": int(eng.stats["fallbacks"])}


def profile_graph(eng: TorchEngine, precision: str, stream, flush, nq: int = 1) -> None:
    dim = eng.dim
    q = np.random.default_rng(1).standard_normal((nq, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    eng.search(q, 8)  # compile + capture
    kind = "f16" if precision == "fast" else ("tf32" if nq > 1 else "f32")
    from kalos.engine import Filter

    key = eng._key(kind, nq, 8, Filter(), True, True, False)
    graph = eng._graphs[key]
    p50, p99 = time_events(graph.replay, 200, stream, flush=flush)
    emit(part="graph", precision=precision, q=nq, n=eng.rows.size, p50_us=p50, p99_us=p99, key=str(key))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(ev.name[:70], [0, 0.0])
            r[0] += 1
            r[1] += ev.device_time
    for name, (count, total) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        emit(part="graph_kernel", precision=precision, q=nq, name=name, count=count / 30,
             avg_us=total / max(count, 1), per_search_us=total / 30)
    if nq > 1:
        return
    # host side of one search: wall vs device
    t = []
    for _ in range(300):
        a = time.perf_counter()
        eng.search(q, 8)
        t.append((time.perf_counter() - a) * 1e6)
    emit(part="host_search", precision=precision, p50_us=float(np.median(t)), p99_us=float(np.percentile(t, 99)))
    t = []
    for _ in range(300):
        a = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.replay()
        b = time.perf_counter()
        stream.synchronize()
        t.append(((b - a) * 1e6, (time.perf_counter() - b) * 1e6))
    t = np.array(t)
    emit(part="host_replay", precision=precision, launch_p50_us=float(np.median(t[:, 0])),
         sync_p50_us=float(np.median(t[:, 1])))


def sweep_scan(eng: TorchEngine, half: bool, stream, flush) -> None:
    tk = eng._tk
    n, dim = eng.rows.size, eng.dim
    x = eng._x16 if half else eng._x32
    cap = eng.rows.capacity
    scores = torch.empty(cap, dtype=torch.float32, device="cuda")
    q = torch.randn(1, dim, device="cuda")
    eng._h_hdr[:] = 0
    eng._h_hdr[0] = n
    eng._h_hdr[1] = 1
    eng._d_hdr[: len(eng._h_hdr)].copy_(torch.from_numpy(eng._h_hdr))
    eng._d_q[:1].copy_(q)
    nbytes = n * dim * x.element_size()
    tiles = [(32, 128, 4), (16, 256, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 8), (16, 1024, 8),
             (32, 256, 8), (64, 128, 8), (64, 64, 4), (4, 1024, 4), (4, 512, 2), (8, 256, 2),
             (16, 128, 2), (32, 64, 2), (2, 1024, 2), (128, 64, 8)]
    for bn, bd, w in tiles:
        def fn(bn=bn, bd=bd, w=w):
            tk.scan_topk_kernel[(-(-cap // bn), 1)](
                x, eng._d_q, eng._d_hdr, eng._d_hdrf, eng._live, eng._ns, eng._ts, scores, cap,
                D=dim, K=8, BLOCK_N=bn, BLOCK_D=bd, BLOCK_Q=1, HALF=half, FILTER=False, PREC="ieee",
                WRITE_SCORES=True, num_warps=w, num_stages=1,
            )
        try:
            p50, p99 = time_events(fn, 100, stream, flush=flush)
        except Exception as e:  # noqa: BLE001
            emit(part="scan_tile", half=half, tile=[bn, bd, w], error=repr(e)[:200])
            continue
        emit(part="scan_tile", half=half, tile=[bn, bd, w], p50_us=p50, p99_us=p99, tb_s=nbytes / (p50 * 1e-6) / 1e12)


def host_pointer_check(stream) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(SRC, DST, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n) * 2.0, mask=offs < n)

    n = 1024
    src = torch.randn(n).pin_memory()
    dst_dev = torch.empty(n, device="cuda")
    dst_host = torch.zeros(n).pin_memory()
    try:
        copy_kernel[(1,)](src, dst_dev, n, BLOCK=1024)
        torch.cuda.synchronize()
        ok_in = bool(torch.equal(dst_dev.cpu(), src * 2))
        copy_kernel[(1,)](dst_dev, dst_host, n, BLOCK=1024)
        torch.cuda.synchronize()
        ok_out = bool(torch.equal(dst_host, src * 4))
        p_in = time_events(lambda: copy_kernel[(1,)](src, dst_dev, n, BLOCK=1024), 200, stream)
        p_out = time_events(lambda: copy_kernel[(1,)](dst_dev, dst_host, n, BLOCK=1024), 200, stream)
        p_memcpy = time_events(lambda: dst_dev.copy_(src, non_blocking=True), 200, stream)
        emit(part="host_pointer", read_ok=ok_in, write_ok=ok_out, kernel_read_p50_us=p_in[0],
             kernel_write_p50_us=p_out[0], memcpy_h2d_p50_us=p_memcpy[0])
    except Exception as e:  # noqa: BLE001
        emit(part="host_pointer", error=repr(e)[:300])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batches", default="", help="only profile the graphs of these batch sizes (e.g. 64,256)")
    ap.add_argument("--final-tiles", action="store_true",
                    help="only time the fast Q=1 graph for several final-kernel tiles (single_final_tile, single_final_warps)")
    args = ap.parse_args()
    stream = torch.cuda.Stream(priority=-100)
    flush = Flusher(torch.device("cuda"))  # zeroes 256 MiB: L2 holds none of the matrix
    if args.final_tiles:
        from kalos.engine import Filter

        eng = build(args.n, args.dim, "fast")
        q = np.random.default_rng(1).standard_normal((1, args.dim)).astype(np.float32)
        q /= np.linalg.norm(q)
        for tile, warps in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16)):
            eng.retune({"single_final_tile": tile, "single_final_warps": warps})
            eng.search(q, 8)
            graph = eng._graphs[eng._key("f16", 1, 8, Filter(), True, True, False)]
            p50, p99 = time_events(graph.replay, 300, eng.stream, flush=flush)
            emit(part="final_tile", tile=tile, warps=warps, p50_us=p50, p99_us=p99)
        return 0
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
        for precision in ("exact", "fast"):
            eng = build(args.n, args.dim, precision, max_batch=max(batches))
            for threshold in (True, False):
                eng.retune({"threshold_select": threshold})
                for nq in batches:
                    emit(part="select", precision=precision, q=nq, threshold=threshold,
                         **check_batch(eng, nq))
                    profile_graph(eng, precision, eng.stream, flush, nq)
            del eng
            torch.cuda.empty_cache()
        print("\n== summary ==")
        for r in OUT_ROWS:
            if r["part"] in ("select", "graph") or (r["part"] == "graph_kernel" and r["per_search_us"] > 2):
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k != "key"})
        return 0
    ceilings(args.n, args.dim, stream, flush)
    ceilings(1 << 20, args.dim, stream, flush)
    host_pointer_check(stream)
    for precision in ("exact", "fast"):
        eng = build(args.n, args.dim, precision)
        profile_graph(eng, precision, eng.stream, flush)
        sweep_scan(eng, precision == "fast", eng.stream, flush)
        del eng
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "diag.jsonl"), "w") as f:
        for r in OUT_ROWS:
            f.write(json.dumps(r) + "\n")
    print("\n== summary ==")
    for r in OUT_ROWS:
        if r["part"] in ("ceiling", "graph", "graph_kernel", "host_search", "host_replay", "host_pointer"):
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
    for r in sorted((r for r in OUT_ROWS if r["part"] == "scan_tile" and "p50_us" in r),
                    key=lambda r: (r["half"], r["p50_us"])):
        print(f"scan half={r['half']!s:5} tile={r['tile']} p50={r['p50_us']:.1f} p99={r['p99_us']:.1f} {r['tb_s']:.2f} TB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
