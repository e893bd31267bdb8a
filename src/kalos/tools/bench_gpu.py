"""``kalos bench --device cuda``: the GPU engine against in-process PyTorch, side by side.

For each N (at ``--dim``, ``-k``) one run measures, in this order and on the same data:

* the baselines, in this process: ``topk(M @ q)`` eager, and the same captured in a CUDA graph;
* the Kalos engine in this process (``TorchEngine.search``), exact and fast, batch 1 and the
  ``--batches`` sizes, with the GPU memory it holds against the bytes of the matrix;
* Kalos end to end: a sidecar process on a store holding the same rows, and this process as
  its client through shared memory: batch 1 p50/p99 and ``recall_many`` throughput per batch;
* aggregate throughput: ``--clients CxB`` client processes, each sending batches of B queries
  back to back for a few seconds (the sidecar gathers what is pending into one pass);
* batch-1 end to end again while another process keeps the GPU busy with bf16 matrix products.

Every latency is wall-clock per call on the host (what a caller waits for), p50/p99 over all
samples. The floor next to each row is the bytes one scan must read over the copy bandwidth
measured at the start of the run.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kalos.client.client import Client
from kalos.config import GPU_POLLING
from kalos.engine import Filter
from kalos.errors import InvalidArgument
from kalos.server.launcher import SidecarProcess
from kalos.store.sqlite import Store
from kalos.tools.timing import percentiles, time_calls

__all__ = ["run_gpu_bench"]

# A stand-in for the LLM: bf16 GEMMs back to back. It prints its rate alone (TFLOP/s over one
# second), then "busy"; SIGUSR1 marks the start of the recalls, SIGTERM prints its rate since.
_LOAD_SCRIPT = """
import signal, sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
flop = 2 * 8192 ** 3 * 8
done, mark = 0, None
def batch():
    global done
    for _ in range(8):
        c = a @ b
    torch.cuda.synchronize()
    done += 1
batch()
t0, n0 = time.monotonic(), done
while time.monotonic() < t0 + 1.0:
    batch()
print("alone", (done - n0) * flop / (time.monotonic() - t0) / 1e12, flush=True)
def on_mark(*_):
    global mark
    mark = (time.monotonic(), done)
def on_term(*_):
    t, n = mark or (t0, n0)
    print("shared", (done - n) * flop / (time.monotonic() - t) / 1e12, flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_mark)
signal.signal(signal.SIGTERM, on_term)
print("busy", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    batch()
"""


def _copy_bandwidth(torch: Any, device: Any) -> float:
    """Bytes read + written per second by a large device-to-device copy (the floor's ceiling)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    stop.record()
    stop.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / 10
    del src, dst
    return 2 * (1 << 30) / seconds


def _row(rows: list[dict[str, Any]], path: str, n: int, batch: int, samples: list[float], floor_us: float | None,
         **extra: Any) -> None:
    p = percentiles(samples)
    rows.append({"path": path, "N": n, "batch": batch, **p, "recalls_per_s": batch / (p["p50_us"] / 1e6),
                 "floor_us": floor_us, **extra})
    print(f"  {path:<46} N={n:>9,} batch={batch:>3}  p50 {p['p50_us']:>9.1f} us  p99 {p['p99_us']:>9.1f} us"
          + (f"  floor {floor_us:.0f} us" if floor_us else ""), flush=True)


def check_gpu_device(device: str) -> None:
    """InvalidArgument unless ``device`` is one CUDA device that PyTorch sees, in the words
    ``kalos serve --device`` uses (the suite measures one GPU; a CPU-only torch has no
    ``torch.cuda`` to set a device on)."""
    from kalos.engine import cuda_available

    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise InvalidArgument(f"the GPU suite measures one device, cuda or cuda:N; got --device {device!r}")
    try:
        import torch
    except ImportError:
        raise InvalidArgument(f"device {device!r} needs PyTorch with CUDA (pip install 'kalos-recall[gpu]')") from None
    if not cuda_available():
        raise InvalidArgument(f"device {device!r}: PyTorch sees no CUDA device")
    if device != "cuda" and int(device[5:]) >= torch.cuda.device_count():
        raise InvalidArgument(f"device {device!r}: PyTorch sees {torch.cuda.device_count()} CUDA device(s)")


def run_gpu_bench(args: argparse.Namespace) -> int:
    check_gpu_device(args.device)
    import torch

    from kalos.engine.gpu import TorchEngine

    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    torch.cuda.set_device(device)
    dim, k = args.dim, args.k
    batches = [int(b) for b in args.batches.split(",")]
    sizes = [int(n) for n in args.gpu_sizes.split(",")]
    modes = [m for m in args.gpu_polling.split(",") if m]
    if any(m not in GPU_POLLING or m == "off" for m in modes):
        raise InvalidArgument(f"--gpu-polling takes {', '.join(GPU_POLLING[1:])} (comma-separated), got {args.gpu_polling!r}")
    bandwidth = _copy_bandwidth(torch, device)
    info = {
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "copy_bandwidth_TBps": round(bandwidth / 1e12, 3), "dim": dim, "k": k, "cpus": os.cpu_count(),
    }
    print(f"kalos bench on {info['gpu']}, torch {info['torch']}, measured copy bandwidth "
          f"{info['copy_bandwidth_TBps']} TB/s (read + write); dim {dim}, k {k}", flush=True)
    rows: list[dict[str, Any]] = []
    name = f"bench-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="kalos-gpu-bench-") as tmp:
        for n in sizes:
            floor32 = n * dim * 4 / bandwidth * 1e6
            floor16 = n * dim * 2 / bandwidth * 1e6
            gen = torch.Generator(device=device).manual_seed(n)
            matrix_d = torch.randn(n, dim, device=device, generator=gen)
            matrix_d /= matrix_d.norm(dim=1, keepdim=True)
            # Enough queries that every batch (taken at offsets 0-255) is whole.
            queries_d = torch.randn(max(512, 256 + max(batches)), dim, device=device, generator=gen)
            queries_d /= queries_d.norm(dim=1, keepdim=True)
            matrix, queries = matrix_d.cpu().numpy(), queries_d.cpu().numpy()
            print(f"N = {n:,}: matrix {matrix.nbytes / 2**20:,.0f} MiB float32", flush=True)
            _baselines(torch, rows, matrix_d, queries, k, n, floor32, args.repeats)
            del matrix_d, queries_d
            torch.cuda.empty_cache()
            reference = _in_process_engines(torch, TorchEngine, rows, matrix, queries, args, n, floor32, floor16,
                                            batches, device)
            store = Path(tmp) / f"store-{n}.db"
            started = time.perf_counter()
            with Store.open(store, dim=dim) as s:
                for lo in range(0, n, 65536):
                    s.add(matrix[lo : lo + 65536], namespace="default")
            print(f"  (store of {n:,} rows written in {time.perf_counter() - started:.1f} s)", flush=True)
            for precision in args.gpu_precisions.split(","):
                _end_to_end(torch, rows, store, name, device, precision, matrix, queries, reference, args, n,
                            floor32 if precision == "exact" else floor16, batches, under_load=(n == sizes[0]))
            for mode in modes:
                for precision in args.gpu_precisions.split(","):
                    _end_to_end(torch, rows, store, name, device, precision, matrix, queries, reference, args, n,
                                floor32 if precision == "exact" else floor16, [1, 64], under_load=(n == sizes[0]),
                                polling=mode)
            if args.gpu_host_copies:
                _end_to_end(torch, rows, store, name, device, "exact", matrix, queries, reference, args, n,
                            floor32, [1], under_load=False, zero_copy=False)
            store.unlink()

    print("\nsummary (wall-clock per call on the host; floor = bytes of one scan / measured copy bandwidth)")
    print(f"{'path':<46} {'N':>9} {'batch':>5} {'p50 us':>9} {'p99 us':>9} {'recalls/s':>11} {'floor us':>8}")
    for r in rows:
        floor = f"{r['floor_us']:.0f}" if r["floor_us"] else "-"
        print(f"{r['path']:<46} {r['N']:>9,} {r['batch']:>5} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} "
              f"{r['recalls_per_s']:>11,.0f} {floor:>8}")
    for r in rows:
        if "reserved_bytes" in r:
            print(f"GPU memory reserved after {r['path']} up to batch {r['batch']}, N={r['N']:,}: "
                  f"{r['reserved_bytes'] / 2**20:,.0f} MiB (the rows and every batch's scratch)")
        if "gpu_bytes" in r:
            print(f"GPU memory, {r['path']}, N={r['N']:,}: {r['gpu_bytes'] / 2**20:,.0f} MiB "
                  f"for a {r['matrix_bytes'] / 2**20:,.0f} MiB float32 matrix ({r['gpu_bytes'] / r['matrix_bytes']:.3f}x)")
    if args.json is not None:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    return 0


def _baselines(torch: Any, rows: list, matrix_d: Any, queries: np.ndarray, k: int, n: int, floor: float,
               repeats: int) -> None:
    pinned = torch.from_numpy(queries).pin_memory()
    q_dev = torch.empty(matrix_d.shape[1], device=matrix_d.device)

    def eager(i: int) -> Any:
        q = pinned[i % len(pinned)].to(matrix_d.device, non_blocking=True)
        top = torch.topk(matrix_d @ q, k)
        return top.indices.cpu()  # synchronises: the caller has its answer

    _row(rows, "torch topk(M @ q), eager, in-process", n, 1, time_calls(eager, repeats, 50), floor)
    stream = torch.cuda.Stream()
    out_i = torch.empty(k, dtype=torch.int64).pin_memory()
    with torch.cuda.stream(stream):
        for _ in range(3):
            torch.topk(matrix_d @ q_dev, k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            top = torch.topk(matrix_d @ q_dev, k)
    torch.cuda.synchronize()

    def replay(i: int) -> Any:
        with torch.cuda.stream(stream):
            q_dev.copy_(pinned[i % len(pinned)], non_blocking=True)
            graph.replay()
            out_i.copy_(top.indices, non_blocking=True)
        stream.synchronize()
        return out_i

    _row(rows, "torch topk(M @ q), CUDA graph, in-process", n, 1, time_calls(replay, repeats, 50), floor)
    del graph


def _in_process_engines(torch: Any, engine_cls: Any, rows: list, matrix: np.ndarray, queries: np.ndarray,
                        args: argparse.Namespace, n: int, floor32: float, floor16: float, batches: list[int],
                        device: Any) -> np.ndarray:
    """Kalos's engine in this process; returns its exact top-k of every query (the e2e check)."""
    reference = None
    for precision in ("exact", "fast"):
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        reserved_before = torch.cuda.memory_reserved(device)
        engine = engine_cls(args.dim, capacity=n, device=str(device), precision=precision)
        engine.add(np.arange(n, dtype=np.int64), matrix, np.int32(1), 0.0)
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - before
        floor = floor32 if precision == "exact" else floor16
        ids, _ = engine.search(queries, args.k)
        if precision == "exact":
            reference = ids
        else:
            agree = float(np.mean([len(set(a) & set(b)) / args.k for a, b in zip(ids, reference)]))
            print(f"  fast vs exact top-{args.k} agreement over {len(queries)} queries: {agree:.6f}", flush=True)
        _row(rows, f"Kalos engine {precision}, in-process", n, 1,
             time_calls(lambda i: engine.search(queries[i % 512 : i % 512 + 1], args.k), args.repeats, 50), floor,
             gpu_bytes=held, matrix_bytes=matrix.nbytes)
        half = Filter(since=0.0, until=0.5)  # a time window that every row passes: the masked scan's cost
        _row(rows, f"Kalos engine {precision}, in-process, time filter", n, 1,
             time_calls(lambda i: engine.search(queries[i % 512 : i % 512 + 1], args.k, half), args.repeats, 50),
             floor)
        for b in batches:
            if b > 1:
                _row(rows, f"Kalos engine {precision}, in-process", n, b,
                     time_calls(lambda i: engine.search(queries[(i * b) % 256 : (i * b) % 256 + b], args.k),
                                max(20, args.repeats // b), 5), floor)
        torch.cuda.synchronize(device)
        # What the batches left reserved (graphs' scratch included), beside what the rows hold.
        rows[-1]["reserved_bytes"] = torch.cuda.memory_reserved(device) - reserved_before
        rows[-1]["matrix_bytes"] = matrix.nbytes
        del engine
        torch.cuda.empty_cache()
    return reference


def _end_to_end(torch: Any, rows: list, store: Path, name: str, device: Any, precision: str, matrix: np.ndarray,
                queries: np.ndarray, reference: np.ndarray, args: argparse.Namespace, n: int, floor: float,
                batches: list[int], *, under_load: bool, zero_copy: bool = True, polling: str = "") -> None:
    crowds = _crowds(args) if not polling and zero_copy else []
    max_batch = max(batches + [b for _c, b in crowds])
    extra = ["--precision", precision, "--max-batch", str(max_batch)] + ([] if zero_copy else ["--no-zero-copy"])
    extra += ["--slots", str(max([32] + [c + 2 for c, _b in crowds]))]
    extra += ["--gpu-polling", polling or "off"]  # (the main rows: the sweep; polling's are asked for)
    with SidecarProcess(store, name=name, device=str(device), extra_args=extra, ready_timeout=600) as sidecar, \
            Client(name) as client:
        print(f"  {sidecar.ready_line}", flush=True)
        got = client.recall_many(queries, k=args.k).ids - 1  # store ids start at 1
        agree = float(np.mean([len(set(a) & set(b)) / args.k for a, b in zip(got, reference)]))
        print(f"  end to end ({precision}) vs in-process exact top-{args.k}: agreement {agree:.6f}", flush=True)
        how = ", host copies" if not zero_copy else f", --gpu-polling {polling or 'off'}"
        path = f"Kalos end to end {precision} (client process{how})"
        _row(rows, path, n, 1, time_calls(lambda i: client.recall(queries[i % 512], k=args.k), args.repeats, 100),
             floor, agreement=agree)
        for b in batches:
            if b > 1:
                _row(rows, path, n, b,
                     time_calls(lambda i: client.recall_many(queries[(i * b) % 256 : (i * b) % 256 + b], k=args.k),
                                max(20, args.repeats // b), 5), floor)
        for clients, b in crowds:
            _aggregate(rows, path, name, queries, args.k, n, floor, clients, b)
        stats = client.stats()
        rows[-1]["engine_bytes"] = stats["engine_bytes"]
        print(f"  recalls answered by the GPU's polling kernel: {stats.get('gpu_polled', 0):,}; "
              f"by the sweep: {stats['queries']:,}", flush=True)
        print(f"  sidecar-side service time per batch (all rows above): p50 {stats['service_p50_us']} us, "
              f"p99 {stats['service_p99_us']} us", flush=True)
        if under_load:
            hog = subprocess.Popen([sys.executable, "-c", _LOAD_SCRIPT, "60"], stdout=subprocess.PIPE, text=True,
                                   env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(device.index or 0)))
            try:
                alone = hog.stdout.readline().split()
                if hog.stdout.readline().strip() == "busy":
                    time.sleep(0.5)
                    hog.send_signal(signal.SIGUSR1)
                    samples = time_calls(lambda i: client.recall(queries[i % 512], k=args.k), args.repeats, 100)
                    hog.terminate()
                    shared = hog.stdout.readline().split()
                    tflops = (float(alone[1]), float(shared[1])) if alone and shared else (None, None)
                    _row(rows, f"{path}, GPU busy with bf16 GEMMs", n, 1, samples, floor,
                         gemm_tflops_alone=tflops[0], gemm_tflops_during=tflops[1])
                    print(f"  the GEMM process: {tflops[0]:.0f} TFLOP/s alone, {tflops[1]:.0f} during these recalls"
                          if tflops[0] else "  (the GEMM process's rate was not read)", flush=True)
            finally:
                hog.kill()
                hog.wait()


def _crowds(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``--clients`` as (clients, batch) pairs."""
    crowds = []
    for spec in filter(None, (part.strip() for part in args.clients.split(","))):
        clients, _, batch = spec.partition("x")
        if not (clients.isdigit() and batch.isdigit() and int(clients) > 0 and int(batch) > 0):
            raise SystemExit(f"--clients: {spec!r} is not CxB (e.g. 8x64)")
        crowds.append((int(clients), int(batch)))
    return crowds


def _aggregate(rows: list, path: str, name: str, queries: np.ndarray, k: int, n: int, floor: float, clients: int,
               batch: int, seconds: float = 3.0) -> None:
    """Recalls per second answered to ``clients`` processes that each send ``batch`` queries
    per call, back to back, for ``seconds``; latency percentiles are per call."""
    start = time.time() + 2.0 + 0.2 * clients  # every process connected and warm before it
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(clients) as pool:
        results = pool.starmap(_client_loop, [(name, queries, batch, k, start, seconds, c) for c in range(clients)])
    total = sum(r[0] for r in results)
    elapsed = max(r[2] for r in results) - start
    samples = [s for r in results for s in r[1]]
    p = percentiles(samples)
    rate = total / elapsed
    rows.append({"path": f"{path}, {clients} clients", "N": n, "batch": batch, **p, "recalls_per_s": rate,
                 "floor_us": floor, "clients": clients, "seconds": elapsed})
    print(f"  {clients} clients x batch {batch}: {rate:,.0f} recalls/s aggregate over {elapsed:.2f} s; per call "
          f"p50 {p['p50_us']:.1f} us, p99 {p['p99_us']:.1f} us", flush=True)


def _client_loop(name: str, queries: np.ndarray, batch: int, k: int, start: float, seconds: float,
                 index: int) -> tuple[int, list[float], float]:
    """One client process of :func:`_aggregate`: (recalls, per-call seconds, end time)."""
    with Client(name) as client:
        offset = (index * 37) % len(queries)
        client.recall_many(queries[:batch], k=k)  # connected and warm
        while time.time() < start:
            time.sleep(0.0005)
        end = start + seconds
        samples, done, clock = [], 0, time.perf_counter
        while time.time() < end:
            lo = (offset + done) % (len(queries) - batch + 1)
            began = clock()
            client.recall_many(queries[lo : lo + batch], k=k)
            samples.append(clock() - began)
            done += batch
        return done, samples, time.time()
