"""The GPU engine at the crowd's pass sizes: Q = 1..64 queries per search, in process.

A crowd of C agents sending single recalls becomes passes of 2 to 64 queries. A pass reads
the rows once, so it should cost close to one scan, not Q single queries. This times
``TorchEngine.search`` (host clock, p50 / p99, the H2D of the queries and the D2H of the
answers included) for each Q and each tuning variant named below, checks every answer's
ids against a float64 brute force, and prints a table with ``torch.topk(Q @ M.T)`` beside it.

    PYTHONPATH=src python3 benchmarks/small_batch.py --n 65536 --dim 1024 --qs 1,2,4,8,16,32,64
    PYTHONPATH=src python3 benchmarks/small_batch.py --device cpu --numpy --precisions '' --dim 384

With --numpy the CPU engine is timed twice at each Q, alternating: as built ("dots": passes of
2 to 64 queries scored by kalos.engine._dots) and with BLAS alone ("blas": the engine as it is
where the extension could not be built).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kalos.engine.gpu import TorchEngine
from kalos.engine.gpu.planner import ScanConfig

VARIANTS = {
    "default": {},
    "gemm>=2": {"gemm_min_q": 2},
    "v2 scan<=64": {"scores_max_q": 64, "gemm_min_q": 65},
    "v1 scan": {"scores_max_q": 0, "gemm_min_q": 65},
    # Exact batches of a few queries by FMA (planner.Tuning.exact_fma_max_q) against tf32 + re-score.
    "no fma": {"exact_fma_max_q": 0},  # (the default since session 16)
    "fma<=16": {"exact_fma_max_q": 16},
    "fma<=32": {"exact_fma_max_q": 32},
    # (block_n, block_d, block_q = 8, warps): rows x queries per tile, the row chunk, warps.
    "fma n8": {"exact_fma_max_q": 32, "scores_f32_fma": ScanConfig(8, 64, 8, 4, 1)},
    "fma n32": {"exact_fma_max_q": 32, "scores_f32_fma": ScanConfig(32, 64, 8, 4, 1)},
    "fma d128": {"exact_fma_max_q": 32, "scores_f32_fma": ScanConfig(16, 128, 8, 4, 1)},
    "fma d32": {"exact_fma_max_q": 32, "scores_f32_fma": ScanConfig(16, 32, 8, 4, 1)},
    "fma w8": {"exact_fma_max_q": 32, "scores_f32_fma": ScanConfig(32, 64, 8, 8, 1)},
    "fma r128": {"exact_fma_max_q": 32, "scores_f32_fma": ScanConfig(16, 64, 8, 4, 1, maxnreg=128)},
}


def _times(fn, repeats: int) -> np.ndarray:
    for i in range(10):
        fn(i)
    out = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        out[i] = time.perf_counter() - t0
    return out * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536, help="rows (random unit vectors) (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    ap.add_argument("-k", type=int, default=8, help="k of every search (default: %(default)s)")
    ap.add_argument("--qs", default="1,2,4,8,16,32,64",
                    help="queries per search (Q), comma-separated, each 1 to 512 (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=200,
                    help="timed searches per line, after 10 untimed; the CPU engine's: a twentieth, at least 5 "
                    "(default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="the GPU engine's tuning variants (VARIANTS in this script), comma-separated "
                    "(default: all: %(default)s)")
    ap.add_argument("--precisions", default="exact,fast",
                    help="the GPU engine's precisions, comma-separated: exact, fast; '' times no GPU engine "
                    "(default: %(default)s)")
    ap.add_argument("--device", default="cuda",
                    help="torch device of the baseline and the GPU engine: cuda, cuda:N or cpu (default: %(default)s)")
    ap.add_argument("--numpy", action="store_true", help="also time the CPU engine (NumpyEngine) at each Q")
    args = ap.parse_args()
    qs = [int(q) for q in args.qs.split(",")]
    rng = np.random.default_rng(7)
    m = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    queries = rng.standard_normal((512, args.dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    s64 = queries.astype(np.float64) @ m.astype(np.float64).T
    ref = [set(np.argsort(-row)[: args.k].tolist()) for row in s64]
    del s64
    table = []
    dev = torch.device(args.device)
    md = torch.from_numpy(m).to(dev)
    pinned = torch.from_numpy(queries)
    pinned = pinned.pin_memory() if dev.type == "cuda" else pinned
    for q in qs:  # baseline: cuBLAS float32 + torch.topk, host clock

        def base(i: int, q: int = q) -> None:
            lo = (i * q) % (512 - q + 1)
            qd = pinned[lo : lo + q].to(dev, non_blocking=True)
            torch.topk(qd @ md.T, args.k, dim=1).indices.cpu()

        t = _times(base, args.repeats)
        table.append(("torch mm+topk f32", "-", q, np.percentile(t, 50), np.percentile(t, 99), 0))
    del md
    if args.numpy:
        from kalos.engine import numpy_engine

        cpu = numpy_engine.NumpyEngine(args.dim, capacity=args.n)
        cpu.add(np.arange(args.n, dtype=np.int64), m, np.ones(args.n, np.int32), np.zeros(args.n))
        built = numpy_engine._dots
        variants = {"dots": built, "blas": None} if built is not None else {"blas": None}
        for q in qs:
            for name, dots in variants.items():
                numpy_engine._dots = dots
                ids, _ = cpu.search(queries[:q], args.k)
                wrong = sum(set(ids[j].tolist()) != ref[j] for j in range(q))

                def run_cpu(i: int, q: int = q) -> None:
                    lo = (i * q) % (512 - q + 1)
                    cpu.search(queries[lo : lo + q], args.k)

                t = _times(run_cpu, max(5, args.repeats // 20))
                table.append(("numpy engine", name, q, np.percentile(t, 50), np.percentile(t, 99), wrong))
                print(table[-1], flush=True)
        numpy_engine._dots = built
        del cpu
    for precision in filter(None, args.precisions.split(",")):
        for name in args.variants.split(","):
            eng = TorchEngine(args.dim, capacity=args.n, device=args.device, precision=precision, tune=VARIANTS[name])
            eng.add(np.arange(args.n, dtype=np.int64), m, np.int32(1), 0.0)
            for q in qs:
                wrong = 0
                for lo in range(0, 512 - q + 1, max(q, 16)):
                    ids, _ = eng.search(queries[lo : lo + q], args.k)
                    wrong += sum(set(ids[j].tolist()) != ref[lo + j] for j in range(q))

                def run(i: int, q: int = q) -> None:
                    lo = (i * q) % (512 - q + 1)
                    eng.search(queries[lo : lo + q], args.k)

                t = _times(run, args.repeats)
                table.append((f"engine {precision}", name, q, np.percentile(t, 50), np.percentile(t, 99), wrong))
                print(table[-1], flush=True)
            del eng
            torch.cuda.empty_cache()
    print(f"\nN={args.n:,} x {args.dim}, k={args.k}, host clock per search (us)")
    print(f"{'path':<20} {'variant':<14} {'Q':>3} {'p50':>9} {'p99':>9} {'wrong':>5} {'us/query':>9}")
    for path, var, q, p50, p99, wrong in table:
        print(f"{path:<20} {var:<14} {q:>3} {p50:>9.1f} {p99:>9.1f} {wrong:>5} {p50 / q:>9.1f}")


if __name__ == "__main__":
    main()
