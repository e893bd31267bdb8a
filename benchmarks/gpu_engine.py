"""GPU engine: correctness on the device, then timings of every variant; a table last.

Run on the device machine (one H200):

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_engine.py --out $OUT

What it does, in one process:
1. ceilings: device-to-device copy bandwidth (bytes read + written).
2. correctness at N = 65,536, D = 1024 (tombstones, namespace / time filters, k = 8 and 256,
   Q = 1 and a batch, a cluster of near-duplicates that forces the fast path's fallback):
   Triton exact and fast vs a float64 reference on the GPU and vs NumpyEngine (same ids).
3. a small tile sweep for Q = 1 (exact and fast) and the batch kernels.
4. timings, N = 65,536 and 1,048,576 at D = 1024, k = 8, Q = 1 / 8 / 64 / 256:
   torch topk(q @ M.T) eager and CUDA graph, the engine's graph (exact, fast) by CUDA events
   (device time per search, queries rotated, L2 flushed between searches), and the engine's
   end-to-end search_into latency from pinned host memory (host clock, includes the sync).
Everything goes to $OUT/results.jsonl and $OUT/log.txt; the table is printed last.

``--dry`` runs the correctness part at a tiny size on whatever device there is (CPU: the
torch backend, or Triton's interpreter when TRITON_INTERPRET=1), to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from kalos.engine import Filter, NumpyEngine
from kalos.engine.gpu import ScanConfig, TorchEngine

RESULTS: list[dict] = []
LOG = None


def log(*a) -> None:
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    if LOG:
        LOG.write(line + "\n")
        LOG.flush()


def record(**kw) -> None:
    RESULTS.append(kw)
    log(json.dumps(kw))


# -- data ---------------------------------------------------------------------------------------


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x.double(), dim=-1, keepdim=True).float()


def build(n: int, dim: int, dev, seed: int, precision="fast", cluster: int = 0, **kw):
    """An engine with n random unit rows (ids 7 + 3 * row), namespaces 0..3, created_at 0..1000."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, dim, device=dev, generator=g)
    if cluster:  # near-duplicates of one direction: many 16-bit scores within the error bound
        base = torch.randn(1, dim, device=dev, generator=g)
        x[:cluster] = base + 1e-4 * torch.randn(cluster, dim, device=dev, generator=g)
    x = unit(x)
    rng = np.random.default_rng(seed)
    ids = 7 + 3 * np.arange(n, dtype=np.int64)
    ns = rng.integers(0, 4, n).astype(np.int32)
    ts = rng.uniform(0, 1000, n)
    eng = TorchEngine(dim, capacity=1024, device=str(dev), precision=precision, **kw)
    step = 262144
    xh = x.cpu().numpy()
    for s in range(0, n, step):
        eng.add(ids[s : s + step], xh[s : s + step], ns[s : s + step], ts[s : s + step])
    return eng, x, ids, ns, ts, xh


def reference(x: torch.Tensor, live: np.ndarray, ns, ts, q: torch.Tensor, k: int, flt: Filter):
    """float64 top-k on the device: (rows [Q, k], scores [Q, k] float64)."""
    dev = x.device
    ok = torch.from_numpy(live.copy()).to(dev)
    if flt.namespace is not None:
        ok &= torch.from_numpy(ns == flt.namespace).to(dev)
    if flt.since is not None:
        ok &= torch.from_numpy(ts >= flt.since).to(dev)
    if flt.until is not None:
        ok &= torch.from_numpy(ts < flt.until).to(dev)
    s = torch.empty(len(q), len(x), dtype=torch.float64, device=dev)
    step = 16384
    for a in range(0, len(x), step):
        s[:, a : a + step] = q.double() @ x[a : a + step].double().T
    s[:, ~ok] = -torch.inf
    v, r = s.topk(min(k, len(x)), dim=1)
    return r.cpu().numpy(), v.cpu().numpy()


def compare(ids_got, sc_got, ref_rows, ref_sc, ids_of_row, tol=2e-6) -> dict:
    """Mismatches beyond ties: an id in one top-k and not the other, with a score gap > tol."""
    bad = 0
    max_err = 0.0
    for i in range(len(ids_got)):
        want = set(ids_of_row[ref_rows[i][np.isfinite(ref_sc[i])]].tolist())
        got_ids = ids_got[i]
        got = set(got_ids[got_ids >= 0].tolist())
        kth = ref_sc[i][np.isfinite(ref_sc[i])].min() if np.isfinite(ref_sc[i]).any() else -np.inf
        for extra in got ^ want:
            j = np.flatnonzero(got_ids == extra)
            if len(j):  # returned but not in the reference: fine if tied with the k-th
                if not abs(float(sc_got[i][j[0]]) - kth) <= tol:
                    bad += 1
            else:
                r = np.flatnonzero(ids_of_row[ref_rows[i]] == extra)
                if not abs(float(ref_sc[i][r[0]]) - kth) <= tol:
                    bad += 1
        fin = np.isfinite(sc_got[i]) & (got_ids >= 0)
        if fin.any():
            ref_map = dict(zip(ids_of_row[ref_rows[i]].tolist(), ref_sc[i].tolist()))
            errs = [abs(float(s) - ref_map[int(d)]) for d, s in zip(got_ids[fin], sc_got[i][fin]) if int(d) in ref_map]
            if errs:
                max_err = max(max_err, max(errs))
        if len(got) != len(want):
            bad += 1
    return {"mismatch": bad, "max_score_err": max_err}


# -- timing -------------------------------------------------------------------------------------


class Flusher:
    def __init__(self, dev) -> None:
        self.buf = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def time_events(fn, iters: int, stream, prep=None, flush=None) -> tuple[float, float]:
    """Device time per call (us): events around each call, calls queued back to back."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(3):
        if prep:
            prep(i)
        fn()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for i in range(iters):
            if prep:
                prep(i)
            if flush:
                flush()
            starts[i].record(stream)
            fn()
            ends[i].record(stream)
    torch.cuda.synchronize()
    t = np.array([s.elapsed_time(e) * 1000 for s, e in zip(starts, ends)])
    return float(np.median(t)), float(np.percentile(t, 99))


def time_host(fn, iters: int, prep=None) -> tuple[float, float]:
    for i in range(3):
        if prep:
            prep(i)
        fn()
    t = []
    for i in range(iters):
        if prep:
            prep(i)
        a = time.perf_counter()
        fn()
        t.append((time.perf_counter() - a) * 1e6)
    return float(np.median(t)), float(np.percentile(t, 99))


def copy_bandwidth(dev) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    sec = e0.elapsed_time(e1) / 1000 / 10
    del a, b
    return 2 * (1 << 30) / sec / 1e12


# -- the parts ----------------------------------------------------------------------------------


V2 = {"scores_max_q": 256, "exact_batch_scan": "tf32"}  # every batch through v2 / tf32


def correctness(dev, n: int, dim: int, seed: int, tune: dict | None = None) -> bool:
    log(f"== correctness N={n} D={dim} seed={seed} tune={tune}")
    eng, x, ids, ns, ts, xh = build(n, dim, dev, seed, cluster=min(64, n // 4))
    eng.retune(tune)
    rng = np.random.default_rng(seed + 1)
    dead = rng.choice(n, size=max(1, n // 100), replace=False)
    eng.delete(ids[dead])
    live = np.ones(n, bool)
    live[dead] = False
    ne = NumpyEngine(dim, capacity=n)
    ne.add(ids, xh, ns, ts)
    ne.delete(ids[dead])
    g = torch.Generator(device=dev).manual_seed(seed + 2)
    qr = unit(torch.randn(6, dim, device=dev, generator=g))
    near = unit(x[torch.randint(0, n, (5,), device=dev, generator=g)] + 0.05 * torch.randn(5, dim, device=dev, generator=g))
    clus = unit(x[:2] + 1e-3 * torch.randn(2, dim, device=dev, generator=g))  # forces the fallback
    q = torch.cat([qr, near, clus])
    ok_all = True
    for flt in (Filter(), Filter(namespace=2), Filter(since=100.0, until=600.0)):
        for k in (8, 256):
            rr, rs = reference(x, live, ns, ts, q, k, flt)
            ne_ids, _ = ne.search(q.cpu().numpy(), k, flt)
            for prec in ("exact", "fast"):
                for batched in (False, True):
                    fb0 = eng.stats["fallbacks"]
                    if batched:
                        oi = torch.full((len(q), k), -99, dtype=torch.int64, pin_memory=dev.type == "cuda")
                        os_ = torch.full((len(q), k), np.nan, dtype=torch.float32, pin_memory=dev.type == "cuda")
                        eng.search_into(q, k, flt, out_ids=oi, out_scores=os_, precision=prec)
                        got_i, got_s = oi.numpy(), os_.numpy()
                    else:
                        gi, gs = [], []
                        for j in range(len(q)):
                            oi = torch.full((1, k), -99, dtype=torch.int64)
                            os_ = torch.full((1, k), np.nan, dtype=torch.float32)
                            eng.search_into(q[j : j + 1].cpu(), k, flt, out_ids=oi, out_scores=os_, precision=prec)
                            gi.append(oi.numpy()[0])
                            gs.append(os_.numpy()[0])
                        got_i, got_s = np.array(gi), np.array(gs)
                    c = compare(got_i, got_s, rr, rs, ids)
                    unwritten = int((got_i == -99).sum() + np.isnan(got_s).sum())
                    ne_same = int((got_i == ne_ids).all(axis=1).sum())
                    ok = c["mismatch"] == 0 and unwritten == 0 and c["max_score_err"] < 1e-5
                    ok_all &= ok
                    record(part="correctness", n=n, tune=str(tune), flt=str(flt), k=k, precision=prec, batched=batched,
                           fallbacks=eng.stats["fallbacks"] - fb0, unwritten=unwritten,
                           same_as_numpy=f"{ne_same}/{len(q)}", ok=ok, **c)
    # growth, compaction and adds after capture: the graphs must see the new rows
    extra = unit(torch.randn(3000, dim, device=dev, generator=g)).cpu().numpy()
    eng.add(10**9 + np.arange(3000), extra, 1, 5.0)
    eng.delete(ids[: n // 2])
    eng.compact()
    q2 = torch.from_numpy(extra[:4]).to(dev)
    oi = torch.empty((4, 8), dtype=torch.int64)
    os_ = torch.empty((4, 8), dtype=torch.float32)
    for prec in ("exact", "fast"):
        eng.search_into(q2, 8, out_ids=oi, out_scores=os_, precision=prec)
        ok = bool((oi[:, 0].numpy() == 10**9 + np.arange(4)).all())
        ok_all &= ok
        record(part="correctness", case="after add+delete+compact", tune=str(tune), precision=prec, ok=ok,
               top1=oi[:, 0].tolist())
    del eng
    return ok_all


def timing(dev, n: int, dim: int, k: int, batches, iters: int) -> None:
    log(f"== timing N={n} D={dim} k={k}")
    torch.cuda.empty_cache()
    m0 = torch.cuda.memory_allocated(dev)
    eng, x, ids, *_ = build(n, dim, dev, seed=11)
    del x
    torch.cuda.empty_cache()
    mem = torch.cuda.memory_allocated(dev) - m0
    record(part="memory", n=n, dim=dim, allocated_mib=mem / 2**20, fp32_matrix_mib=n * dim * 4 / 2**20,
           fp16_matrix_mib=n * dim * 2 / 2**20, engine_vector_bytes_mib=eng.columns.nbytes() / 2**20)
    M = eng.columns.x32[:n]
    M16 = eng.columns.x16[:n]
    stream = eng.stream
    flush = Flusher(dev)
    rot = 8
    for qn in batches:
        qsets = [unit(torch.randn(qn, dim, device=dev)) for _ in range(rot)]
        qpin = [t.cpu().pin_memory() for t in qsets]
        qbuf = torch.empty(qn, dim, device=dev)

        def prep(i, qsets=qsets, qbuf=qbuf):
            qbuf.copy_(qsets[i % rot])

        it = iters if n <= 65536 else max(20, iters // 8)
        if qn >= 64 and n > 65536:
            it = max(10, it // 4)
        # torch baselines (float32; TF32 off by default for matmul)
        for name, mat in (("torch_eager_fp32", M), ("torch_eager_fp16", M16)):
            def fn(mat=mat):
                torch.topk(qbuf.to(mat.dtype) @ mat.T, k, dim=1)
            p50, p99 = time_events(fn, it, stream, prep, flush)
            record(part="timing", n=n, q=qn, variant=name, p50_us=p50, p99_us=p99)
        with torch.cuda.stream(stream):
            torch.topk(qbuf @ M.T, k, dim=1)
        stream.synchronize()
        gph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gph, stream=stream):
            torch.topk(qbuf @ M.T, k, dim=1)
        p50, p99 = time_events(gph.replay, it, stream, prep, flush)
        record(part="timing", n=n, q=qn, variant="torch_graph_fp32", p50_us=p50, p99_us=p99)
        del gph
        # the engine: graph replays (device time) and search_into end to end
        oi = torch.empty((qn, k), dtype=torch.int64, pin_memory=True)
        os_ = torch.empty((qn, k), dtype=torch.float32, pin_memory=True)
        h_q = eng.staging.h_q
        for prec in ("exact", "fast"):
            eng.search_into(qpin[0], k, out_ids=oi, out_scores=os_, precision=prec)  # compile + capture
            graph = graph_of(eng, prec, qn, k)
            hq = [t.numpy() for t in qpin]

            def prep_h(i, hq=hq):
                h_q[:qn] = hq[i % rot]  # racy with the queued copies; harmless for timing

            p50, p99 = time_events(graph.replay, it, stream, prep_h, flush)
            plan = eng.plan(qn, k, prec)
            record(part="timing", n=n, q=qn, variant=f"engine_graph_{prec}", p50_us=p50, p99_us=p99,
                   progs=plan.progs, levels=len(plan.levels), cfg=str(plan.cfg))
            fb0 = eng.stats["fallbacks"]

            def call(prec=prec):
                eng.search_into(qpin[call.i % rot], k, out_ids=oi, out_scores=os_, precision=prec)
                call.i += 1

            call.i = 0
            p50, p99 = time_host(call, it)
            record(part="timing", n=n, q=qn, variant=f"engine_e2e_{prec}", p50_us=p50, p99_us=p99,
                   fallbacks=eng.stats["fallbacks"] - fb0)
        # v2 (score-writing scan + parallel chunk top-k) and the tf32 certified exact batch
        for label, tune, precs in (("v2", {"scores_max_q": 256}, ("exact", "fast")),
                                   ("tf32", {"exact_batch_scan": "tf32"}, ("exact",) if qn > 1 else ())):
            eng.retune(tune)
            for prec in precs:
                try:
                    eng.search_into(qpin[0], k, out_ids=oi, out_scores=os_, precision=prec)
                except Exception as e:  # report, go on with the rest
                    record(part="timing", n=n, q=qn, variant=f"engine_graph_{prec}_{label}", error=repr(e)[:300])
                    continue
                hq = [t.numpy() for t in qpin]

                def prep_h(i, hq=hq):
                    h_q[:qn] = hq[i % rot]

                p50, p99 = time_events(eng.graph_of(qn, k, prec).replay, it, stream, prep_h, flush)
                record(part="timing", n=n, q=qn, variant=f"engine_graph_{prec}_{label}", p50_us=p50, p99_us=p99)
            eng.retune({"scores_max_q": 0, "exact_batch_scan": "ieee"})
    del eng, M, M16
    torch.cuda.empty_cache()


def graph_of(eng, prec: str, qn: int, k: int):
    """The CUDA graph a search of qn unit host queries (no filter) replays."""
    return eng.graph_of(qn, k, prec)


def sweep(dev, n: int, dim: int, k: int, iters: int) -> None:
    log(f"== sweep N={n} D={dim} k={k}")
    eng, *_ = build(n, dim, dev, seed=13)
    flush = Flusher(dev)
    for qn in (1, 64):
        qpin = [unit(torch.randn(qn, dim, device=dev)).cpu().pin_memory() for _ in range(8)]
        sweep_tiles(eng, qn, k, qpin, iters, eng.stream, flush)
    del eng
    torch.cuda.empty_cache()


SWEEP = {
    (False, False): [(16, 256, 4, 1), (8, 512, 4, 1), (32, 128, 4, 1)],
    (True, False): [(32, 256, 4, 1), (32, 128, 4, 1), (64, 128, 4, 1)],
    (False, True): [(64, 64, 16, 4, 3), (64, 32, 32, 4, 3)],
    (True, True): [(64, 64, 64, 4, 3), (128, 64, 64, 8, 3)],
}


def sweep_tiles(eng, qn, k, qpin, it, stream, flush) -> None:
    batched = qn > 1
    h_q = eng.staging.h_q
    hq = [t.numpy() for t in qpin]
    oi = torch.empty((qn, k), dtype=torch.int64, pin_memory=True)
    os_ = torch.empty((qn, k), dtype=torch.float32, pin_memory=True)
    default = eng.tuning
    for fast in (False, True):
        prec = "fast" if fast else "exact"
        for tile in SWEEP[(fast, batched)]:
            first = tile == SWEEP[(fast, batched)][0]
            for progs in (0, -8) if (first and not batched) else (0,):
                if batched:
                    bn, bd, bq, w, st = tile
                else:
                    (bn, bd, w, st), bq = tile, 1
                cfg = ScanConfig(block_n=bn, block_d=bd, block_q=bq, warps=w, stages=st, progs=progs)
                for final_max in (2048, 8192) if (first and not batched and progs == 0) else (2048,):
                    eng.retune({(fast, batched): cfg, "final_max": final_max})
                    try:
                        eng.search_into(qpin[0], k, out_ids=oi, out_scores=os_, precision=prec)
                    except Exception as e:  # a tile that does not compile or fit: report, go on
                        record(part="sweep", q=qn, precision=prec, cfg=str(cfg), error=repr(e)[:200])
                        continue
                    graph = graph_of(eng, prec, qn, k)

                    def prep_h(i):
                        h_q[:qn] = hq[i % len(hq)]

                    p50, p99 = time_events(graph.replay, it, stream, prep_h, flush)
                    plan = eng.plan(qn, k, prec)
                    record(part="sweep", n=eng.rows.size, q=qn, precision=prec, cfg=str(cfg), final_max=final_max,
                           progs=plan.progs, levels=len(plan.levels), p50_us=p50, p99_us=p99)
    eng.retune(default)


def table() -> None:
    rows = [r for r in RESULTS if r.get("part") == "timing"]
    log("\n== table (device time per search unless e2e; us) ==")
    variants = []
    for r in rows:
        if r["variant"] not in variants:
            variants.append(r["variant"])
    keys = sorted({(r["n"], r["q"]) for r in rows})
    log(f"{'N':>8} {'Q':>4} " + " ".join(f"{v[:22]:>22}" for v in variants))
    for n, q in keys:
        cells = []
        for v in variants:
            hit = [r for r in rows if r["n"] == n and r["q"] == q and r["variant"] == v]
            cells.append(f"{hit[0]['p50_us']:>10.1f}/{hit[0]['p99_us']:<11.1f}" if hit else f"{'-':>22}")
        log(f"{n:>8} {q:>4} " + " ".join(cells))
    log("(cells: p50/p99)")
    sw = [r for r in RESULTS if r.get("part") == "sweep" and "p50_us" in r]
    if sw:
        log("\n== sweep ==")
        for r in sorted(sw, key=lambda r: (r["q"], r["precision"], r["p50_us"])):  # noqa: B007
            log(f"q={r['q']:>3} {r['precision']:>5} p50={r['p50_us']:8.1f} p99={r['p99_us']:8.1f} progs={r['progs']:>5} "
                f"levels={r['levels']} final_max={r['final_max']} {r['cfg']}")
    bad = [r for r in RESULTS if r.get("part") == "correctness" and not r.get("ok")]
    log(f"\ncorrectness: {'ALL OK' if not bad else f'{len(bad)} FAILED'}")
    for r in bad:
        log("  FAILED", json.dumps(r))


def main() -> int:
    global LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), metavar="DIR",
                    help="folder for results.jsonl and log.txt, made if missing "
                    "(default: $OUT, else the current folder)")
    ap.add_argument("--dry", action="store_true",
                    help="only the correctness part, at N=400, D=48, on the CPU (to check the script itself)")
    ap.add_argument("--iters", type=int, default=200,
                    help="timed searches per line and sweep tile (fewer above N=65,536) (default: %(default)s)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    ap.add_argument("--sizes", default="65536,1048576",
                    help="row counts N of the timings, comma-separated (D=1024, k=8) (default: %(default)s)")
    ap.add_argument("--batches", default="1,8,64,256",
                    help="queries per search (Q) of the timings, comma-separated (default: %(default)s)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    LOG = open(os.path.join(args.out, "log.txt"), "w")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry else "cpu")
    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, sms=p.multi_processor_count, mem_gib=p.total_memory / 2**30)
    record(part="env", **info)
    try:
        if args.dry:
            ok = correctness(dev, 400, 48, seed=5)
            ok &= correctness(dev, 400, 48, seed=6, tune=V2)
            table()
            return 0 if ok else 1
        record(part="ceiling", copy_tb_s=copy_bandwidth(dev))
        ok = correctness(dev, 65536, 1024, seed=1)
        ok &= correctness(dev, 65536, 1024, seed=2, tune=V2)
        for n in [int(s) for s in args.sizes.split(",")]:
            timing(dev, n, 1024, 8, [int(b) for b in args.batches.split(",")], args.iters)
            table()
        if not args.no_sweep:
            sweep(dev, 65536, 1024, 8, args.iters)
    finally:
        with open(os.path.join(args.out, "results.jsonl"), "w") as f:
            for r in RESULTS:
                f.write(json.dumps(r) + "\n")
    table()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
