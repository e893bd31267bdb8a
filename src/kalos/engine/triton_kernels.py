"""Triton kernels of the GPU engine: a fused scan + mask + top-k, a merge, and a final pass.

Importing this module imports Triton; only :mod:`kalos.engine.torch_engine` does, and only
when it is asked for the Triton backend. Under ``TRITON_INTERPRET=1`` (set before Triton is
first imported) the same kernels run on PyTorch CPU tensors, which is how CI checks them.

Keys
----
Every candidate travels as one int64 *key*: the float32 score mapped to an order-preserving
int32 in the high half, ``0x7FFFFFFF - row`` in the low half. Sorting keys descending sorts by
score, ties by lower row first; a key is one register, so top-k is a plain bitonic top-k
(``tl.topk``) on int64. ``SENTINEL`` (int64 min) marks "no row" (masked out, past the end).

Pipeline (per query, all on the device; nothing round-trips through host memory)
----------------------------------------------------------------------------------
1. :func:`scan_topk_kernel` -- a persistent grid of ``P`` programs per query block. Program
   ``p`` streams row blocks ``p, p + P, p + 2P, ...`` (``BLOCK_N`` rows each, ``N`` read from
   the device header so adds need no new launch parameters), scores them against the query
   block held in registers, applies the live/namespace/time masks, and keeps a running top-K
   of keys (block top-K, then a bitonic merge with the running list). Writes ``P * K`` keys.
   v2 (``WRITE_SCORES``): the same loop stores masked float32 scores instead (4 B per row,
   0.1% of the bytes read) and :func:`scores_topk_kernel` takes the top-K of each chunk of
   them, many programs in parallel; the streaming loop then has no barriers at all.
2. :func:`merge_topk_kernel` -- ``(Q, P2)`` programs, each reduces one ``CHUNK`` of keys to
   its top-K: many programs share the merge instead of one program merging thousands.
3. :func:`final_kernel` -- one program per query: top-K of the last level, then either the
   exact outputs (ids or rows, scores) or, for the 16-bit scan, the certified re-score in
   float32 (see ``torch_engine`` for the error bound) with a per-query status word.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "SENTINEL", "HDR_WORDS", "stage_in_kernel", "scan_topk_kernel", "scores_topk_kernel", "merge_topk_kernel",
    "final_kernel",
]

SENTINEL = -(2**63)

#: The header is 16 int64 words: n, nq, k, has_ns, ns, since (f64), until (f64), max row norm
#: (f64), k_out (result columns to write), 7 spare. The gather table follows it: 4 words per
#: query (query offset in float32 elements of SRC, ids offset in int64 elements of RES_I,
#: scores offset in float32 elements of RES_S, scale (f64) applied to the query).
HDR_WORDS = tl.constexpr(16)
TAB = tl.constexpr(16)


@triton.jit
def _pack(score, row):
    """int64 key: order-preserving int32 of the float32 score, then 0x7FFFFFFF - row."""
    bits = score.to(tl.int32, bitcast=True)
    k32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (k32.to(tl.int64) << 32) | (0x7FFFFFFF - row).to(tl.int64)


@triton.jit
def _unpack(key):
    """(score float32, row int64, valid) of keys; SENTINEL gives (-inf, 0, False)."""
    k32 = (key >> 32).to(tl.int32)
    bits = k32 ^ ((k32 >> 31) & 0x7FFFFFFF)
    score = bits.to(tl.float32, bitcast=True)
    row = 0x7FFFFFFF - (key & 0x7FFFFFFF)
    valid = key != -9223372036854775808
    score = tl.where(valid, score, float("-inf"))
    row = tl.where(valid, row, 0)
    return score, row, valid


@triton.jit
def _merge_sorted(a, b):
    """Top-K (sorted descending) of two [R, K] key lists that are each sorted descending."""
    # a descending followed by flip(b) ascending is bitonic; the elementwise max of the two
    # halves holds the K largest and is itself bitonic, so one bitonic merge sorts it.
    c = tl.maximum(a, tl.flip(b, 1))
    return tl.bitonic_merge(c, descending=True)


@triton.jit
def stage_in_kernel(
    HH,  # host header + gather table (int64 words, page-locked: read over the bus)
    HHF,  # the same words as float64
    SRC,  # float32 base the table's query offsets point into (host: staging area or a slot)
    DH,  # device copy of the header + table
    DQ,  # [Qb, D] float32 device queries, scaled
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COPY_Q: tl.constexpr = True,  # False: the queries are already on the device (DQ)
):
    """Grid (Qb,): program j copies query j (scaled, in float64 then rounded, exactly as the
    host's normalisation) and its table row to the device; program 0 also copies the header.

    This replaces a host-to-device memcpy node: a kernel reading page-locked host memory
    directly costs the graph less than a copy-engine node (benchmarks/NOTES-gpu.md).
    """
    j = tl.program_id(0)
    if j == 0:
        w = tl.arange(0, HDR_WORDS)
        tl.store(DH + w, tl.load(HH + w))
    nq = tl.load(HH + 1)
    if j < nq:
        w4 = tl.arange(0, 4)
        row = tl.load(HH + TAB + 4 * j + w4)
        tl.store(DH + TAB + 4 * j + w4, row)
        if COPY_Q:
            q_off = tl.load(HH + TAB + 4 * j)
            scale = tl.load(HHF + TAB + 4 * j + 3)
            for d0 in range(0, D, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                x = tl.load(SRC + q_off + ds, mask=ds < D, other=0.0)
                tl.store(DQ + j.to(tl.int64) * D + ds, (x.to(tl.float64) * scale).to(tl.float32), mask=ds < D)


@triton.jit
def scan_topk_kernel(
    X,  # [cap, D] float32 / float16 / bfloat16 rows
    Qs,  # [Qb, D] float32 queries (staging area)
    HDR,  # int64 header: n, nq, k, has_ns, ns
    HDRF,  # the same header as float64: [5] since, [6] until, [7] max row norm
    LIVE,  # [cap] uint8, 1 = live
    NS,  # [cap] int32 namespace
    TS,  # [cap] float64 created_at
    OUT,  # [Qb, stride_out] int64 keys, or [Qb, stride_out] float32 scores (WRITE_SCORES)
    stride_out,
    D: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HALF: tl.constexpr,  # rows are 16-bit: round the query the same way
    FILTER: tl.constexpr,  # apply namespace / time filters (live is always applied)
    PREC: tl.constexpr = "ieee",  # float32 rows, batched: "ieee" (exact FMA) or "tf32" (certified)
    WRITE_SCORES: tl.constexpr = False,  # store masked scores (-inf) instead of keeping a top-K
):
    # Row blocks on grid axis 0 (up to 2^31 - 1 programs; axes 1 and 2 stop at 65,535, which
    # a one-block-per-program grid passes at 2M rows), query blocks on axis 1.
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1)
    n_progs = tl.num_programs(0)
    n = tl.load(HDR)
    nq = tl.load(HDR + 1)
    if FILTER:
        has_ns = tl.load(HDR + 3)
        want_ns = tl.load(HDR + 4)
        since = tl.load(HDRF + 5)
        until = tl.load(HDRF + 6)
    EVEN_D: tl.constexpr = D % BLOCK_D == 0
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = qs < nq
    if pid_q * BLOCK_Q < nq:
        top = tl.full([BLOCK_Q, K], -9223372036854775808, tl.int64)
        n_blocks = tl.cdiv(n, BLOCK_N)
        blk = pid_n
        # A while loop, not range(): the trip count depends on n, read from the device, and
        # Triton's interpreter cannot take a runtime range bound under NumPy 2.
        while blk < n_blocks:
            rows = blk.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_rng = rows < n
            if BLOCK_Q == 1:
                acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
                for d0 in range(0, D, BLOCK_D):
                    ds = d0 + tl.arange(0, BLOCK_D)
                    # (Loading the query chunk as [1, BLOCK_D] instead made Triton convert the
                    # whole row tile to the query's layout: worse. The [BLOCK_D] vector's own
                    # conversion costs one small shared-memory round trip per chunk.)
                    if EVEN_D:
                        x = tl.load(X + rows[:, None] * D + ds[None, :], mask=in_rng[:, None], other=0.0)
                        qv = tl.load(Qs + pid_q * D + ds)
                    else:
                        x = tl.load(
                            X + rows[:, None] * D + ds[None, :],
                            mask=in_rng[:, None] & (ds < D)[None, :],
                            other=0.0,
                        )
                        qv = tl.load(Qs + pid_q * D + ds, mask=ds < D, other=0.0)
                    if HALF:
                        qv = qv.to(X.dtype.element_ty).to(tl.float32)
                    acc += x.to(tl.float32) * qv[None, :]
                sc1 = tl.sum(acc, axis=1)
                sc = tl.reshape(sc1, [1, BLOCK_N])
            else:
                acc = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
                for d0 in range(0, D, BLOCK_D):
                    ds = d0 + tl.arange(0, BLOCK_D)
                    if EVEN_D:
                        x = tl.load(X + rows[:, None] * D + ds[None, :], mask=in_rng[:, None], other=0.0)
                        qv = tl.load(Qs + qs[:, None] * D + ds[None, :], mask=q_ok[:, None], other=0.0)
                    else:
                        x = tl.load(
                            X + rows[:, None] * D + ds[None, :],
                            mask=in_rng[:, None] & (ds < D)[None, :],
                            other=0.0,
                        )
                        qv = tl.load(
                            Qs + qs[:, None] * D + ds[None, :],
                            mask=q_ok[:, None] & (ds < D)[None, :],
                            other=0.0,
                        )
                    if HALF:
                        acc = tl.dot(qv.to(X.dtype.element_ty), tl.trans(x), acc)
                    else:
                        acc = tl.dot(qv, tl.trans(x), acc, input_precision=PREC)
                sc = acc
            live = tl.load(LIVE + rows, mask=in_rng, other=0)
            ok = in_rng & (live != 0)
            if FILTER:
                nsv = tl.load(NS + rows, mask=in_rng, other=0)
                ts = tl.load(TS + rows, mask=in_rng, other=0.0)
                ok = ok & ((has_ns == 0) | (nsv.to(tl.int64) == want_ns)) & (ts >= since) & (ts < until)
            if WRITE_SCORES:
                # v2: no selection in the streaming loop (its bitonic passes cost block-wide
                # barriers per block); scores_topk_kernel selects afterwards, in parallel.
                if BLOCK_Q == 1:
                    tl.store(OUT + pid_q * stride_out + rows, tl.where(ok, sc1, float("-inf")), mask=in_rng)
                else:
                    offs = qs[:, None].to(tl.int64) * stride_out + rows[None, :]
                    tl.store(OUT + offs, tl.where(ok[None, :], sc, float("-inf")), mask=q_ok[:, None] & in_rng[None, :])
            else:
                keys = tl.where(ok[None, :], _pack(sc, rows[None, :]), -9223372036854775808)
                top = _merge_sorted(top, tl.topk(keys, K))
            blk += n_progs
        if not WRITE_SCORES:
            offs = qs[:, None].to(tl.int64) * stride_out + pid_n * K + tl.arange(0, K)[None, :]
            tl.store(OUT + offs, top, mask=q_ok[:, None])


@triton.jit
def scores_topk_kernel(
    S,  # [Qb, stride_s] float32 scores of rows [row_base, row_base + width); -inf = masked out
    OUT,  # [Qb, stride_out] int64 keys
    HDR,
    stride_s,
    stride_out,
    row_base=0,  # first row S holds (a multiple of CHUNK): the GEMM path scores rows in slices
    width=0,  # rows S holds (0: stride_s)
    LIVE=None,  # with MASK: the live / namespace / time columns and the float64 header
    NS=None,
    TS=None,
    HDRF=None,
    K: tl.constexpr = 8,
    CHUNK: tl.constexpr = 1024,
    MASK: tl.constexpr = False,  # S is unmasked (a GEMM wrote it): apply live (and FILTER) here
    FILTER: tl.constexpr = False,
):
    """Top-K keys of each CHUNK of scores (rows past n give SENTINEL): grid (chunks, Qb)."""
    j = tl.program_id(0)
    q = tl.program_id(1)
    n = tl.load(HDR)
    nq = tl.load(HDR + 1)
    if q < nq:
        local = j.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        rows = row_base + local
        limit = stride_s if width == 0 else width
        ok = (rows < n) & (local < limit)
        sc = tl.load(S + q.to(tl.int64) * stride_s + local, mask=ok, other=float("-inf"))
        if MASK:
            ok = ok & (tl.load(LIVE + rows, mask=ok, other=0) != 0)
            if FILTER:
                has_ns = tl.load(HDR + 3)
                want_ns = tl.load(HDR + 4)
                since = tl.load(HDRF + 5)
                until = tl.load(HDRF + 6)
                nsv = tl.load(NS + rows, mask=ok, other=0)
                ts = tl.load(TS + rows, mask=ok, other=0.0)
                ok = ok & ((has_ns == 0) | (nsv.to(tl.int64) == want_ns)) & (ts >= since) & (ts < until)
        keys = tl.where(ok & (sc > float("-inf")), _pack(sc, rows), -9223372036854775808)
        top = tl.topk(tl.reshape(keys, [1, CHUNK]), K)
        out_chunk = row_base // CHUNK + j
        tl.store(OUT + q.to(tl.int64) * stride_out + out_chunk * K + tl.arange(0, K)[None, :], top)


@triton.jit
def merge_topk_kernel(
    IN,  # [Qb, stride_in] int64 keys
    OUT,  # [Qb, stride_out] int64 keys
    HDR,
    stride_in,
    stride_out,
    count_in,  # keys per query in IN
    K: tl.constexpr,
    CHUNK: tl.constexpr,
):
    j = tl.program_id(0)  # chunks on axis 0 (axis 1 stops at 65,535), queries on axis 1
    q = tl.program_id(1)
    nq = tl.load(HDR + 1)
    if q < nq:
        offs = j * CHUNK + tl.arange(0, CHUNK)
        keys = tl.load(IN + q.to(tl.int64) * stride_in + offs, mask=offs < count_in, other=-9223372036854775808)
        top = tl.topk(tl.reshape(keys, [1, CHUNK]), K)
        tl.store(OUT + q.to(tl.int64) * stride_out + j * K + tl.arange(0, K)[None, :], top)


@triton.jit
def final_kernel(
    IN,  # [Qb, stride_in] int64 keys
    HDR,
    HDRF,
    X32,  # [cap, D] float32 rows (read only when RESCORE)
    Qs,  # [Qb, D] float32 queries
    IDS,  # [cap] int64 store ids (read only when OUT_IDS)
    RES_I,  # int64 base of the results: query q's ids (or rows) go to RES_I + HDR[TAB + 4q + 1]
    RES_S,  # float32 base of the scores: query q's go to RES_S + HDR[TAB + 4q + 2]
    STATUS,  # [Qb] int32: 0 = certified / exact, 1 = certificate failed (re-run exactly)
    stride_in,
    count_in,
    err_a,  # error bound of the 16-bit score: E = err_a*|x|*|q| + err_b*(|x|+|q|) + err_c
    err_b,
    err_c,
    D: tl.constexpr,
    KIN: tl.constexpr,
    KOUT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RESCORE: tl.constexpr,
    OUT_IDS: tl.constexpr,
):
    q = tl.program_id(0)
    nq = tl.load(HDR + 1)
    if q < nq:
        offs = tl.arange(0, CHUNK)
        keys = tl.load(IN + q.to(tl.int64) * stride_in + offs, mask=offs < count_in, other=-9223372036854775808)
        top = tl.topk(tl.reshape(keys, [1, CHUNK]), KIN)
        if RESCORE:
            s16, rows2, valid2 = _unpack(top)
            kq = tl.load(HDR + 2)
            idx = tl.arange(0, KIN)[None, :]
            t_k = tl.max(tl.where(idx == kq - 1, s16, float("-inf")), axis=1)
            n_valid = tl.sum(valid2.to(tl.int32), axis=1)
            t_last = tl.min(tl.where(valid2, s16, float("inf")), axis=1)
            rows = tl.reshape(rows2, [KIN])
            valid = tl.reshape(valid2, [KIN])
            acc = tl.zeros([KIN, BLOCK_D], tl.float32)
            qsq = tl.zeros([BLOCK_D], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                dm = ds < D
                x = tl.load(X32 + rows[:, None] * D + ds[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
                qv = tl.load(Qs + q.to(tl.int64) * D + ds, mask=dm, other=0.0)
                acc += x * qv[None, :]
                qsq += qv * qv
            s32 = tl.sum(acc, axis=1)
            q_norm = tl.sqrt(tl.sum(qsq, axis=0)).to(tl.float64)
            x_norm = tl.load(HDRF + 7)
            err = err_a * x_norm * q_norm + err_b * (x_norm + q_norm) + err_c
            certified = (n_valid < KIN) | (t_last.to(tl.float64) < t_k.to(tl.float64) - 2.0 * err)
            keys32 = tl.where(valid, _pack(s32, rows), -9223372036854775808)
            final = tl.topk(tl.reshape(keys32, [1, KIN]), KOUT)
            tl.store(STATUS + q + tl.arange(0, 1), tl.where(certified, 0, 1).to(tl.int32))
        else:
            final = top
        score, row, valid_out = _unpack(final)
        if OUT_IDS:
            out_i = tl.load(IDS + row, mask=valid_out, other=-1)
        else:
            out_i = row
        # Straight into host memory (page-locked, mapped): the engine's result area or a
        # client's slot. Only the k_out columns asked for: a slot row may be narrower than KOUT.
        cols = tl.arange(0, KOUT)[None, :]
        want = cols < tl.load(HDR + 8)
        tl.store(RES_I + tl.load(HDR + TAB + 4 * q + 1) + cols, out_i, mask=want)
        tl.store(RES_S + tl.load(HDR + TAB + 4 * q + 2) + cols, score, mask=want)
