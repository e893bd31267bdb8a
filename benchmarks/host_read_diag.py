"""How fast a GPU kernel reads a request that the CPU has just written into page-locked host
memory, and whether each kind of load returns what the CPU wrote (not a stale copy).

The slot servers poll a slot's ``req_seq`` over the bus, then read the request's words, its
namespace and its query. The words measured ~8 us after ``req_seq`` was seen where the 4 KiB
query took 2 us (benchmarks/NOTES-gpu.md, 2026-12-01). This script isolates that pattern: one
program (one warp) polls word 0 of a host page; the host writes the request words, the query
area and, last, word 0; the kernel stamps the GPU clock when it sees word 0, when the words
arrive and when the query arrives, checks every value, and acknowledges. Each variant is one
launch of ``--rounds`` requests.

Run on the device machine, from the repo root:

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/host_read_diag.py --json $OUT/host_read.json

Variants (``words:query[:fence]``): how the words and the query are loaded: ``volatile``
(``ld.volatile``), ``cv`` (``ld.global.cv``), ``cg`` (``ld.global.cg``: past L1), ``plain``
(``ld.global``), ``poll`` (words only: read in the same load as word 0, no second read);
``fence``: a ``fence.sc.sys`` between seeing word 0 and reading the words; ``shm``: the page is
a /dev/shm mapping registered with cudaHostRegister (as the sidecar's segment), not
``pin_memory``.
"""
from __future__ import annotations

import argparse
import json
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import triton
import triton.language as tl

from kalos.engine.torch_engine import register_host_buffer
from kalos.sync import full_fence

MODES = {"volatile": 0, "cv": 1, "cg": 2, "plain": 3, "poll": 4}
W_ACK, W_STARTED, Q_AT, Q_WORDS = 16, 17, 64, 512  # int64 word offsets in the host page
W_ACK_C, W_STARTED_C, Q_AT_C, Q_WORDS_C = (tl.constexpr(v) for v in (W_ACK, W_STARTED, Q_AT, Q_WORDS))


@triton.jit
def _clock_after(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,l", [x.to(tl.int64)],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _load(ptr, MODE: tl.constexpr):
    if MODE == 0:
        return tl.load(ptr, volatile=True)
    elif MODE == 1:
        return tl.inline_asm_elementwise("ld.global.cv.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                         is_pure=False, pack=1)
    elif MODE == 2:
        return tl.load(ptr, cache_modifier=".cg")
    else:
        return tl.load(ptr)


@triton.jit
def probe_kernel(H, OUT, rounds, WORDS: tl.constexpr, QUERY: tl.constexpr, FENCE: tl.constexpr):
    w4 = tl.arange(0, 4)
    qo = Q_AT_C + tl.arange(0, 4)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(H + W_STARTED_C, 1)
    tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    for r in range(1, rounds + 1):
        words = tl.zeros([4], tl.int64)
        seen = tl.zeros([], tl.int64)
        while seen != r:
            if WORDS == 4:
                words = tl.load(H + w4, volatile=True)
                seen = tl.sum(tl.where(w4 == 0, words, 0))
            else:
                seen = tl.load(H, volatile=True)
        t0 = _clock_after(seen)
        if FENCE:
            tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
        if WORDS != 4:
            words = _load(H + w4, WORDS)
        w1 = tl.sum(tl.where(w4 == 1, words, 0))
        w2 = tl.sum(tl.where(w4 == 2, words, 0))
        t1 = _clock_after(w1 + w2)
        q = _load(H + qo, QUERY)
        qsum = tl.sum(tl.sum(q, axis=1), axis=0)
        t2 = _clock_after(qsum)
        good = (w1 == r * 10 + 1) & (w2 == r * 10 + 2)
        qgood = qsum == r * Q_WORDS_C
        tl.store(OUT + r * 4 + w4, tl.where(w4 == 0, t1 - t0, tl.where(w4 == 1, t2 - t1,
                 tl.where(w4 == 2, good.to(tl.int64), qgood.to(tl.int64)))))
        tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(H + W_ACK_C, r)



def run_variant(spec: str, rounds: int) -> dict:
    parts = spec.split(":")
    words, query, fence, shm = MODES[parts[0]], MODES[parts[1]], "fence" in parts[2:], "shm" in parts[2:]
    if query == 4:
        raise SystemExit(f"{spec}: the query cannot be read in the poll")
    nbytes = (Q_AT + Q_WORDS) * 8
    if shm:  # like the sidecar's segment: a /dev/shm mapping page-locked with cudaHostRegister
        segment = shared_memory.SharedMemory(create=True, size=nbytes)
        registered = register_host_buffer(segment.buf)
        page = registered.tensor.view(torch.int64)
        page.zero_()
    else:
        page = torch.zeros(Q_AT + Q_WORDS, dtype=torch.int64).pin_memory()
    h = page.numpy()
    out = torch.zeros((rounds + 1) * 4, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        probe_kernel[(1,)](page, out, rounds, WORDS=words, QUERY=query, FENCE=fence, num_warps=1)
    deadline = time.monotonic() + 10
    while h[W_STARTED] == 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"{spec}: the kernel never started")
    host_rt = []
    for r in range(1, rounds + 1):
        h[Q_AT:Q_AT + Q_WORDS] = r
        h[1], h[2] = r * 10 + 1, r * 10 + 2
        full_fence()
        t = time.perf_counter_ns()
        h[0] = r
        while h[W_ACK] != r:
            if time.perf_counter_ns() - t > 1e9:
                raise SystemExit(f"{spec}: round {r} never acknowledged")
        host_rt.append((time.perf_counter_ns() - t) / 1e3)
        t = time.perf_counter_ns()
        while time.perf_counter_ns() - t < 30_000:  # the next request 30 us later
            pass
    stream.synchronize()
    if shm:
        del page, h
        registered.unregister()
        segment.unlink()
        try:
            segment.close()
        except BufferError:  # a view still exported; the mapping goes with the process
            pass
    o = out.view(rounds + 1, 4)[1:].cpu().numpy()
    skip = 10  # first rounds: clocks ramping, code paths warming
    return {
        "variant": spec,
        "words_us_p50": float(np.median(o[skip:, 0])) / 1e3,
        "query_us_p50": float(np.median(o[skip:, 1])) / 1e3,
        "words_us_p99": float(np.percentile(o[skip:, 0], 99)) / 1e3,
        "host_round_trip_us_p50": float(np.median(host_rt[skip:])),
        "stale_words": int(rounds - o[:, 2].sum()),
        "stale_query": int(rounds - o[:, 3].sum()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--variants", default="volatile:cg:fence,volatile:cg,cv:cg,cg:cg,plain:plain,poll:cg,"
                                          "poll:volatile,volatile:volatile,volatile:cg:fence:shm,cv:cg:shm,plain:plain:shm,poll:cg:shm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.variants.split(","):
        row = run_variant(spec, args.rounds)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nvariant               words p50  p99   query p50  host rt p50  stale w/q")
    for r in rows:
        print(f"{r['variant']:20s} {r['words_us_p50']:8.2f} {r['words_us_p99']:6.2f} {r['query_us_p50']:9.2f} "
              f"{r['host_round_trip_us_p50']:11.2f}   {r['stale_words']}/{r['stale_query']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
