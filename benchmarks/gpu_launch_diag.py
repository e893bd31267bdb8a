"""What one CUDA-graph replay costs the host, and what memcpy nodes cost the device.

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_launch_diag.py

Graphs of tiny work (so the device time is mostly launch and gaps): 1 kernel; 5 kernels;
H2D copy + kernel + D2H copy; a Triton kernel that reads and writes page-locked host memory
directly instead of the copies; and the engine's own Q=1 graph. For each: host time of
``replay()`` (with and without a ``torch.cuda.stream`` context), host time to completion,
and device time by CUDA events.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _scale(SRC, DST, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n) * 2.0, mask=offs < n)


def host_costs(name: str, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, iters: int = 500) -> None:
    ctx, bare, done = [], [], []
    for _ in range(20):
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
    for _ in range(iters):
        a = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.replay()
        b = time.perf_counter()
        stream.synchronize()
        ctx.append((b - a) * 1e6)
    torch.cuda.set_stream(stream)
    for _ in range(iters):
        a = time.perf_counter()
        graph.replay()
        b = time.perf_counter()
        stream.synchronize()
        c = time.perf_counter()
        bare.append((b - a) * 1e6)
        done.append((c - a) * 1e6)
    torch.cuda.set_stream(torch.cuda.default_stream())
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    with torch.cuda.stream(stream):
        for i in range(iters):
            starts[i].record(stream)
            graph.replay()
            ends[i].record(stream)
    torch.cuda.synchronize()
    dev = [s.elapsed_time(e) * 1000 for s, e in zip(starts, ends)]
    print(f"{name:38s} replay-in-ctx {np.median(ctx):6.1f}  replay-bare {np.median(bare):6.1f}  "
          f"to-done {np.median(done):6.1f} (p99 {np.percentile(done, 99):6.1f})  device {np.median(dev):6.1f} us",
          flush=True)


def capture(fn, stream) -> torch.cuda.CUDAGraph:
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


def main() -> None:
    stream = torch.cuda.Stream(priority=-100)
    a = torch.randn(1024, device="cuda")
    b = torch.empty_like(a)
    h_in = torch.randn(1024).pin_memory()
    h_out = torch.empty(1024).pin_memory()
    t0 = time.perf_counter()
    for _ in range(200):
        _scale[(1,)](a, b, 1024, BLOCK=1024)
    torch.cuda.synchronize()
    print(f"triton eager launch (host, per call) {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
    t0 = time.perf_counter()
    for _ in range(200):
        torch.mul(a, 2.0, out=b)
    torch.cuda.synchronize()
    print(f"torch eager launch (host, per call) {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
    host_costs("1 torch kernel", capture(lambda: torch.mul(a, 2.0, out=b), stream), stream)
    host_costs("5 torch kernels", capture(lambda: [torch.mul(a, 2.0, out=b) for _ in range(5)], stream), stream)
    host_costs("1 triton kernel", capture(lambda: _scale[(1,)](a, b, 1024, BLOCK=1024), stream), stream)
    host_costs("5 triton kernels", capture(lambda: [_scale[(1,)](a, b, 1024, BLOCK=1024) for _ in range(5)], stream), stream)

    def copies():
        a.copy_(h_in, non_blocking=True)
        _scale[(1,)](a, b, 1024, BLOCK=1024)
        h_out.copy_(b, non_blocking=True)

    host_costs("H2D + triton + D2H", capture(copies, stream), stream)

    def mapped():
        _scale[(1,)](h_in, a, 1024, BLOCK=1024)
        _scale[(1,)](a, b, 1024, BLOCK=1024)
        _scale[(1,)](b, h_out, 1024, BLOCK=1024)

    host_costs("triton reads/writes pinned host", capture(mapped, stream), stream)
    ok = torch.equal(h_out, h_in * 8)
    print("mapped result correct:", ok)

    from kalos.engine.torch_engine import TorchEngine

    n, dim = 65536, 1024
    x = torch.randn(n, dim, device="cuda")
    x /= torch.linalg.vector_norm(x, dim=1, keepdim=True)
    eng = TorchEngine(dim, capacity=n, device="cuda")
    eng.add(np.arange(n, dtype=np.int64), x.cpu().numpy(), np.zeros(n, np.int32), np.zeros(n))
    q = x[:1].cpu().numpy()
    eng.search(q, 8)
    graph = next(iter(eng._graphs.values()))
    host_costs("engine Q=1 exact graph (65,536 x 1024)", graph, eng.stream)
    t = []
    for _ in range(500):
        s = time.perf_counter()
        eng.search(q, 8)
        t.append((time.perf_counter() - s) * 1e6)
    print(f"engine.search host p50 {np.median(t):.1f} us")


if __name__ == "__main__":
    main()
