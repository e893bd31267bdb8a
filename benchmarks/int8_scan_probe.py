"""How fast can one query scan an 8-bit copy of the rows? Kernel variants side by side.

Each variant writes the float32 scores of every row for one query (the single-query "scores"
scan of the engine, without masks), so they compare like for like with the 16-bit scan the
fast mode uses now:

* ``f16 ew``   -- 16-bit rows, elementwise multiply-add in float32 (the engine's scan today);
* ``i8 cvt``   -- int8 rows converted to float32 by the compiler (I2F), times a per-row scale;
* ``i8 magic`` -- int8 rows read as int32 words, each byte turned into a float32 by OR-ing it
  into the mantissa of 2^23 (integer ops instead of I2F);
* ``i8 dot``   -- int8 rows times the query split into two int8 planes (hi + lo/256) on the
  tensor cores (int32 accumulation, exact), padded to 16 columns.

Every variant's scores are checked against a float64 product of the same rounded rows. Time:
the median over ``--rounds`` of a CUDA graph of ``--launches`` launches, per launch. Floor:
bytes read / ``--bandwidth``.

    python3 benchmarks/int8_scan_probe.py --n 65536 --dim 1024
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def ew_scan_kernel(X, SCALE, Q, OUT, N, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SCALED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(X + rows[:, None].to(tl.int64) * D + ds[None, :], mask=ok[:, None], other=0)
        acc += x.to(tl.float32) * tl.load(Q + ds)[None, :]
    s = tl.sum(acc, axis=1)
    if SCALED:
        s = s * tl.load(SCALE + rows, mask=ok, other=0.0)
    tl.store(OUT + rows, s, mask=ok)


@triton.jit
def magic_scan_kernel(XW, SCALE, Q, OUT, N, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    W: tl.constexpr = D // 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for m0 in range(0, W, BLOCK_W):
        ms = m0 + tl.arange(0, BLOCK_W)
        w = tl.load(XW + rows[:, None].to(tl.int64) * W + ms[None, :], mask=ok[:, None], other=0)
        u = w ^ -2139062144  # 0x80808080: every byte c + 128, in 0..255
        for b in tl.static_range(4):
            f = (((u >> (8 * b)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            acc += f * tl.load(Q + 4 * ms + b)[None, :]
    s = tl.sum(acc, axis=1) * tl.load(SCALE + rows, mask=ok, other=0.0)
    tl.store(OUT + rows, s, mask=ok)


@triton.jit
def dot_scan_kernel(X, SCALE, QB, QSCALE, OUT, N, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    cols = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.int32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(X + rows[:, None].to(tl.int64) * D + ds[None, :], mask=ok[:, None], other=0)
        qb = tl.load(QB + cols[None, :] * D + ds[:, None])
        acc = tl.dot(x, qb, acc, out_dtype=tl.int32)
    hi = tl.sum(tl.where(cols[None, :] == 0, acc, 0), axis=1)
    lo = tl.sum(tl.where(cols[None, :] == 1, acc, 0), axis=1)
    s = (hi.to(tl.float32) + lo.to(tl.float32) * (1.0 / 256)) * tl.load(QSCALE)
    s = s * tl.load(SCALE + rows, mask=ok, other=0.0)
    tl.store(OUT + rows, s, mask=ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    return torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


def query_planes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = q.abs().max().clamp_min(1e-30) / 127.0
    t = q.double() / s.double()
    hi = torch.round(t).clamp(-127, 127)
    lo = torch.round((t - hi) * 256).clamp(-127, 127)
    planes = torch.zeros((16, q.numel()), dtype=torch.int8, device=q.device)
    planes[0], planes[1] = hi.to(torch.int8), lo.to(torch.int8)
    return planes, s.float().reshape(1)


def time_graph(fn, launches: int, rounds: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        g.capture_begin()
        for _ in range(launches):
            fn()
        g.capture_end()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / launches)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--launches", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s for the floor column")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args()
    n, d = args.n, args.dim
    torch.manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(n, d, device="cuda"), dim=1)
    q = torch.nn.functional.normalize(torch.randn(d, device="cuda"), dim=0)
    x16 = x.half()
    x8, scale = quantize_rows(x)
    planes, qscale = query_planes(q)
    out = torch.empty(n, device="cuda")
    ref16 = (x16.double() @ q.double()).float()
    ref8 = ((x8.double() * scale.double()[:, None]) @ q.double()).float()
    resid = (x.double() - x8.double() * scale.double()[:, None]).norm(dim=1)
    print(f"int8 residual norm: max {resid.max().item():.3e} median {resid.median().item():.3e}")

    variants = []
    for bn, bd, w in [(32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8)]:
        variants.append((f"f16 ew {bn}x{bd} w{w}", 2, ref16,
                         lambda bn=bn, bd=bd, w=w: ew_scan_kernel[(triton.cdiv(n, bn),)](
                             x16, scale, q, out, n, D=d, BLOCK_N=bn, BLOCK_D=bd, SCALED=False, num_warps=w)))
    for bn, bd, w in [(32, 128, 4), (32, 256, 4), (64, 256, 4), (64, 256, 8), (128, 128, 8), (32, 512, 4)]:
        variants.append((f"i8 cvt {bn}x{bd} w{w}", 1, ref8,
                         lambda bn=bn, bd=bd, w=w: ew_scan_kernel[(triton.cdiv(n, bn),)](
                             x8, scale, q, out, n, D=d, BLOCK_N=bn, BLOCK_D=bd, SCALED=True, num_warps=w)))
    xw = x8.view(torch.int32)
    for bn, bw, w in [(32, 32, 4), (32, 64, 4), (64, 64, 8), (16, 64, 4)]:
        variants.append((f"i8 magic {bn}x{4 * bw} w{w}", 1, ref8,
                         lambda bn=bn, bw=bw, w=w: magic_scan_kernel[(triton.cdiv(n, bn),)](
                             xw, scale, q, out, n, D=d, BLOCK_N=bn, BLOCK_W=bw, num_warps=w)))
    for bn, bd, w, st in [(64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 256, 4, 4),
                          (128, 128, 4, 4)]:
        variants.append((f"i8 dot {bn}x{bd} w{w} s{st}", 1, ref8,
                         lambda bn=bn, bd=bd, w=w, st=st: dot_scan_kernel[(triton.cdiv(n, bn),)](
                             x8, scale, planes, qscale, out, n, D=d, BLOCK_N=bn, BLOCK_D=bd, num_warps=w,
                             num_stages=st)))
    rows = []
    for name, elem, ref, fn in variants:
        try:
            fn()
            torch.cuda.synchronize()
            err = (out - ref).abs().max().item()
            us = time_graph(fn, args.launches, args.rounds)
        except Exception as exc:  # a tile the compiler refuses: report, go on
            print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        floor = n * d * elem / args.bandwidth * 1e6
        rows.append({"variant": name, "us": round(us, 2), "floor_us": round(floor, 2), "max_err": err})
        print(f"{name:28s} {us:7.2f} us  floor {floor:6.2f}  max|err| {err:.2e}", flush=True)
    base = torch.empty(n, device="cuda", dtype=torch.float16)
    q16 = q.half()
    us = time_graph(lambda: torch.mv(x16, q16, out=base), args.launches, args.rounds)
    rows.append({"variant": "torch.mv f16", "us": round(us, 2), "floor_us": round(n * d * 2 / args.bandwidth * 1e6, 2)})
    print(f"{'torch.mv f16':28s} {us:7.2f} us")
    print("\nvariant                        us   floor")
    for r in sorted(rows, key=lambda r: r["us"]):
        print(f"{r['variant']:28s} {r['us']:7.2f} {r['floor_us']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": n, "dim": d, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
