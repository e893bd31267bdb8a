"""One card against several: N rows (default 16,777,216 x 1024 float32, 64 GiB) in one
TorchEngine on cuda:0, then split over the listed devices in a ShardedEngine.

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/sharded_gpu.py --devices cuda:0,cuda:1

For each layout: p50/p99 of one recall (Q=1, k=8, host wall clock around ``search``, queries
rotated) and of a batch of 64 (aggregate recalls/s = 64 / p50), with the floor beside each
figure: bytes of one scan / (measured copy bandwidth of one card x cards). The sharded
answers are checked against the one-card answers (same ids, ties aside). Rows are random
unit vectors generated on the GPU and added through the engine's public ``add`` in batches.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kalos.engine import make_engine
from kalos.engine.gpu import TorchEngine


def copy_bandwidth(device: str) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * (1 << 30) * 10 / (time.perf_counter() - t0)


def fill(engine, n: int, dim: int, seed: int, chunk: int = 1 << 20) -> float:
    started = time.perf_counter()
    gen = torch.Generator(device="cuda:0").manual_seed(seed)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        x = torch.randn(m, dim, device="cuda:0", generator=gen)
        x /= torch.linalg.vector_norm(x, dim=1, keepdim=True)
        engine.add(np.arange(lo + 1, lo + m + 1, dtype=np.int64), x.cpu().numpy(), np.zeros(m, np.int32), np.zeros(m))
        del x
    return time.perf_counter() - started


def timed(fn, iters: int) -> tuple[float, float]:
    for _ in range(3):
        fn(0)
    t = []
    for i in range(iters):
        a = time.perf_counter()
        fn(i)
        t.append((time.perf_counter() - a) * 1e6)
    return float(np.median(t)), float(np.percentile(t, 99))


def measure(label: str, engine, queries: np.ndarray, k: int, iters: int, floor_us: float, rows: list) -> list:
    answers = [engine.search(queries[i : i + 1], k)[0][0] for i in range(16)]
    p50, p99 = timed(lambda i: engine.search(queries[i % 256 : i % 256 + 1], k), iters)
    rows.append(dict(layout=label, batch=1, p50_us=p50, p99_us=p99, recalls_per_s=1e6 / p50, floor_us=floor_us))
    print(json.dumps(rows[-1]), flush=True)
    p50, p99 = timed(lambda i: engine.search(queries[(i % 4) * 64 : (i % 4) * 64 + 64], k), max(10, iters // 10))
    rows.append(dict(layout=label, batch=64, p50_us=p50, p99_us=p99, recalls_per_s=64e6 / p50, floor_us=floor_us))
    print(json.dumps(rows[-1]), flush=True)
    return answers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 24, help="rows (random unit vectors, float32) (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    ap.add_argument("-k", type=int, default=8, help="k of every search (default: %(default)s)")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="the sharded layout (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=200,
                    help="timed single-query searches per layout; batches of 64: a tenth, at least 10 "
                    "(default: %(default)s)")
    ap.add_argument("--skip-single", action="store_true", help="only the sharded layout")
    args = ap.parse_args()
    n, dim, k = args.n, args.dim, args.k
    bandwidth = copy_bandwidth("cuda:0")
    cards = len(set(args.devices.split(",")))
    nbytes = n * dim * 4
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; copy bandwidth {bandwidth / 1e12:.3f} TB/s "
          f"per card; N={n:,} x {dim} float32 = {nbytes / 2**30:.1f} GiB; sharded layout {args.devices}", flush=True)
    gen = np.random.default_rng(7)
    queries = gen.standard_normal((256, dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    rows: list = []
    single = None
    if not args.skip_single:
        engine = TorchEngine(dim, capacity=n, device="cuda:0")
        print(f"one card: filled in {fill(engine, n, dim, seed=1):.1f} s", flush=True)
        single = measure("one card (cuda:0)", engine, queries, k, args.iters, nbytes / bandwidth * 1e6, rows)
        del engine
        torch.cuda.empty_cache()
    engine = make_engine(args.devices, dim, capacity=n)
    print(f"sharded {args.devices}: filled in {fill(engine, n, dim, seed=1):.1f} s; rows per shard "
          f"{engine.shard_sizes()}", flush=True)
    sharded = measure(f"sharded ({args.devices})", engine, queries, k, args.iters, nbytes / (bandwidth * cards) * 1e6,
                      rows)
    if single is not None:
        same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(single, sharded))
        print(f"sharded top-{k} == one-card top-{k} on {same}/{len(single)} queries", flush=True)
    print(f"\n{'layout':<32} {'batch':>5} {'p50 us':>10} {'p99 us':>10} {'recalls/s':>11} {'floor us':>9}")
    for r in rows:
        print(f"{r['layout']:<32} {r['batch']:>5} {r['p50_us']:>10.1f} {r['p99_us']:>10.1f} "
              f"{r['recalls_per_s']:>11,.0f} {r['floor_us']:>9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
