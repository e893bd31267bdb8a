"""Probe (session 30): what reading b queries from the slots (page-locked host memory, the
sidecar's mmap registered with CUDA) costs the device, by how the read is spread: the
engine's stage_in_kernel as the slot server launches it (one program a query), the same copy
split over S programs a query, and the copy engine (one memcpy over the slots' whole span).
    PYTHONPATH=src python3 benchmarks/results/h100-s30/stage_probe.py
"""
import mmap

import numpy as np
import torch
import triton
import triton.language as tl

from kalos.engine.gpu import TorchEngine
from kalos.engine.gpu.layout import TABLE, HDR_WORDS, TAB_WORDS, kernel_constants
from kalos.ipc.protocol import Layout


@triton.jit
def split_copy(SRC, OFFS, DQ, D: tl.constexpr, PIECE: tl.constexpr):
    j = tl.program_id(0)
    s = tl.program_id(1)
    COLS: tl.constexpr = 128 if PIECE > 128 else PIECE
    offs = tl.arange(0, PIECE // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :] + s * PIECE
    q_off = tl.load(OFFS + j)
    x = tl.load(SRC + q_off + offs, cache_modifier=".cg")
    tl.store(DQ + j.to(tl.int64) * D + offs, x)


def median_us(fn, reps=300):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(20):
        fn()
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1e3 for a, b in ev]))


def main():
    dim, slots = 1024, 64
    eng = TorchEngine(dim, device="cuda", backend="triton")
    eng.add(np.arange(16, dtype=np.int64), np.random.default_rng(0).standard_normal((16, dim)).astype(np.float32),
            np.zeros(16, np.int32), np.zeros(16))
    layout = Layout(slots, dim, 16, 1)
    buf = mmap.mmap(-1, layout.size)
    eng.attach_host(buf)
    att = eng.attached
    src = att.f32
    host = np.frombuffer(buf, np.float32)
    host[:] = np.random.default_rng(1).standard_normal(host.size).astype(np.float32)
    q_at = np.array([(layout.slot_offset(s) + layout.queries_offset) // 4 for s in range(slots)], np.int64)
    print(f"slot size {layout.slot_size} B, queries at +{layout.queries_offset} B, span {layout.size} B")
    dq = torch.zeros((slots, dim), dtype=torch.float32, device="cuda")
    dh = torch.zeros(HDR_WORDS + TAB_WORDS * slots, dtype=torch.int64, device="cuda")
    tk = eng.kernels
    rows = []
    for b in (1, 16, 64):
        take = np.sort(np.random.default_rng(b).choice(slots, b, replace=False))
        tab = np.zeros((slots, TAB_WORDS), np.int64)
        tab[:b, TABLE.query_at] = q_at[take]
        dh_np = np.concatenate([np.zeros(HDR_WORDS, np.int64), tab.ravel()])
        dh_np[kernel_constants()["H_NQ"]] = b
        dh.copy_(torch.from_numpy(dh_np))
        dhf = dh.view(torch.float64)
        stage = lambda: tk.stage_in_kernel[(b,)](dh, dhf, src, dh, dq, D=dim, BLOCK_D=1024, COPY_Q=True, NORM=True,
                                                 COPY_META=False, num_warps=4)
        want = host[q_at[take][:, None] + np.arange(dim)[None, :]]
        stage(); torch.cuda.synchronize()
        got = dq[:b].cpu().numpy()
        ok = np.allclose(got, want / np.linalg.norm(want.astype(np.float64), axis=1, keepdims=True), atol=1e-6)
        rows.append((b, "stage_in_kernel (now)", median_us(stage), ok))
        offs_t = torch.from_numpy(q_at[take]).cuda()
        for s in (1, 2, 4, 8):
            for w in (1, 4):
                fn = lambda s=s, w=w: split_copy[(b, s)](src, offs_t, dq, D=dim, PIECE=dim // s, num_warps=w)
                fn(); torch.cuda.synchronize()
                ok = np.array_equal(dq[:b].cpu().numpy(), want)
                rows.append((b, f"split {s} a query, {w} warps", median_us(fn), ok))
        lo = int(q_at[take].min()) * 4
        hi = int(q_at[take].max()) * 4 + dim * 4
        span = att.host.tensor[lo:hi]
        dspan = torch.empty(hi - lo, dtype=torch.uint8, device="cuda")
        rows.append((b, f"copy engine, the span {hi - lo} B", median_us(lambda: dspan.copy_(span, non_blocking=True)), True))
    print(f"\n{'b':>3} {'read':40s} {'us':>8}  ok")
    for b, name, us, ok in rows:
        print(f"{b:3d} {name:40s} {us:8.2f}  {ok}")


main()
