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
0. :func:`stage_in_kernel` -- the header, gather table and queries from page-locked host
   memory to the device; normalises each query (``NORM``) or applies the host's scale.
1. :func:`scan_topk_kernel` -- a persistent grid of ``P`` programs per query block. Program
   ``p`` streams row blocks ``p, p + P, p + 2P, ...`` (``BLOCK_N`` rows each, ``N`` read from
   the device header so adds need no new launch parameters), scores them against the query
   block held in registers, applies the live/namespace/time masks, and keeps a running top-K
   of keys (block top-K, then a bitonic merge with the running list). Writes ``P * K`` keys.
   v2 (``WRITE_SCORES``): the same loop stores masked float32 scores instead (4 B per row,
   0.1% of the bytes read) and :func:`scores_topk_kernel` takes the top-K of each chunk of
   them, many programs in parallel; the streaming loop then has no barriers at all.
   Batches of 16 or more queries are scored by cuBLAS a slice of 65,536 rows at a time
   instead; :func:`group_max_kernel` and :func:`collect_kernel` then keep each slice's top-K
   by a threshold (see the comment above them), without sorting every chunk.
   Fast mode, one query: :func:`int8_scores_kernel` scores the 8-bit copy of the rows on
   the tensor cores, then :func:`scores_rescore_kernel` re-scores each chunk's top-K in
   float32 in the chunk's own program and keeps float32 keys (a certificate per chunk).
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
    "SENTINEL", "HDR_WORDS", "stage_in_kernel", "scan_topk_kernel", "int8_scores_kernel", "scores_topk_kernel",
    "group_max_kernel", "collect_kernel", "merge_topk_kernel", "scores_rescore_kernel", "final_kernel",
    "await_request_kernel",
]

SENTINEL = -(2**63)

#: The header is 16 int64 words: n, nq, k, has_ns, ns, since (f64), until (f64), max row norm
#: (f64), k_out (result columns to write), then for the slot server's graph the slot's word
#: offset, the request's seq and the slot (see await_request_kernel), the 8-bit rows' error
#: per unit of query norm (f64, see int8_scores_kernel), 3 spare. The gather table follows it:
#: 4 words per query (query offset in float32 elements of SRC, ids offset in int64 elements of
#: RES_I, scores offset in float32 elements of RES_S, scale (f64) applied to the query).
HDR_WORDS = tl.constexpr(16)
TAB = tl.constexpr(16)


@triton.jit
def _ordered(score):
    """The float32 ``score`` as an int64 in the same order (the high half of a key)."""
    bits = score.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _pack(score, row):
    """int64 key: order-preserving int32 of the float32 score, then 0x7FFFFFFF - row."""
    return (_ordered(score) << 32) | (0x7FFFFFFF - row).to(tl.int64)


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
def _row_scores(X, q_ptr, rows, in_rng, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                HALF: tl.constexpr):
    """float32 scores of ``BLOCK_N`` rows of X against the query at ``q_ptr`` (masked rows: 0)."""
    EVEN_D: tl.constexpr = D % BLOCK_D == 0
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        # (Loading the query chunk as [1, BLOCK_D] instead made Triton convert the whole row
        # tile to the query's layout: worse. The [BLOCK_D] vector's own conversion costs one
        # small shared-memory round trip per chunk.)
        if EVEN_D:
            x = tl.load(X + rows[:, None] * D + ds[None, :], mask=in_rng[:, None], other=0.0)
            qv = tl.load(q_ptr + ds)
        else:
            x = tl.load(X + rows[:, None] * D + ds[None, :], mask=in_rng[:, None] & (ds < D)[None, :], other=0.0)
            qv = tl.load(q_ptr + ds, mask=ds < D, other=0.0)
        if HALF:
            qv = qv.to(X.dtype.element_ty).to(tl.float32)
        acc += x.to(tl.float32) * qv[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _kth_score(scores, kq, N: tl.constexpr):
    """The kq-th of ``scores`` ([1, N], sorted descending): [1]."""
    return tl.max(tl.where(tl.arange(0, N)[None, :] == kq - 1, scores, float("-inf")), axis=1)


@triton.jit
def _rescore(top, X32, q_ptr, x_norm, err_a, err_b, err_c, err_q, D: tl.constexpr, N: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """The candidates ``top`` ([1, N] keys of 16-bit, tf32 or 8-bit scores) re-scored in
    float32 against the query at ``q_ptr``: ``(s16 [1, N], valid [1, N], keys of the float32
    scores [1, N], E)``, E the bound on |s16 - s32| for this query (see ``torch_engine``):
    ``err_a*|x|*|q| + err_b*(|x| + |q|) + err_c + err_q*|q|``."""
    s16, rows2, valid2 = _unpack(top)
    rows = tl.reshape(rows2, [N])
    valid = tl.reshape(valid2, [N])
    acc = tl.zeros([N, BLOCK_D], tl.float32)
    qsq = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        dm = ds < D
        x = tl.load(X32 + rows[:, None] * D + ds[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        qv = tl.load(q_ptr + ds, mask=dm, other=0.0)
        acc += x * qv[None, :]
        qsq += qv * qv
    q_norm = tl.sqrt(tl.sum(qsq, axis=0)).to(tl.float64)
    err = err_a * x_norm * q_norm + err_b * (x_norm + q_norm) + err_c + err_q * q_norm
    keys32 = tl.where(valid, _pack(tl.sum(acc, axis=1), rows), -9223372036854775808)
    return s16, valid2, tl.reshape(keys32, [1, N]), err


@triton.jit
def _certified_rescore(top, kq, X32, q_ptr, x_norm, err_a, err_b, err_c, D: tl.constexpr, KIN: tl.constexpr,
                       KOUT: tl.constexpr, BLOCK_D: tl.constexpr):
    """The float32 top-KOUT of the KIN candidates ``top`` (keys of 16-bit or tf32 scores,
    sorted), and whether the certificate holds (see ``torch_engine``): ``(keys [1, KOUT],
    certified [1])``. ``kq`` is the k asked for, at most the rows in use."""
    s16, valid2, keys32, err = _rescore(top, X32, q_ptr, x_norm, err_a, err_b, err_c, 0.0, D, KIN, BLOCK_D)
    t_k = _kth_score(s16, kq, KIN)
    n_valid = tl.sum(valid2.to(tl.int32), axis=1)
    t_last = tl.min(tl.where(valid2, s16, float("inf")), axis=1)
    certified = (n_valid < KIN) | (t_last.to(tl.float64) < t_k.to(tl.float64) - 2.0 * err)
    return tl.topk(keys32, KOUT), certified


@triton.jit
def _copy_normalised(src, dst, D: tl.constexpr, BLOCK: tl.constexpr):
    """Copies D float32 values from ``src`` (a slot in page-locked host memory) to ``dst``
    scaled by ``1 / |x|`` (float64, then rounded: what the host's ``row_scales`` gives);
    returns the float64 sum of squares.

    The chunk is a [BLOCK / 128, 128] tile so that each warp reads 512 contiguous bytes: from
    host memory every load instruction is a request over the bus, and scattered 4-byte loads
    made ~1,000 requests of a 4 KiB query (benchmarks/NOTES-gpu.md). The loads are ``.cg``
    (past L1, which could keep a slot's last query; see :func:`_take_request` for why the
    request reaches them complete). A query that fits one chunk stays in registers; a longer
    one goes out raw first and is scaled in place, read from ``src`` once."""
    COLS: tl.constexpr = 128 if BLOCK > 128 else BLOCK
    offs = tl.arange(0, BLOCK // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    if BLOCK >= D:
        x = tl.load(src + offs, mask=offs < D, other=0.0, cache_modifier=".cg").to(tl.float64)
        ssq = tl.sum(tl.sum(x * x, axis=1), axis=0)
        tl.store(dst + offs, (x * (1.0 / tl.sqrt(ssq))).to(tl.float32), mask=offs < D)
    else:
        sq = tl.zeros([BLOCK // COLS, COLS], tl.float64)
        for d0 in tl.static_range(0, D, BLOCK):
            ds = d0 + offs
            x = tl.load(src + ds, mask=ds < D, other=0.0, cache_modifier=".cg")
            tl.store(dst + ds, x, mask=ds < D)
            sq += x.to(tl.float64) * x.to(tl.float64)
        ssq = tl.sum(tl.sum(sq, axis=1), axis=0)
        scale = 1.0 / tl.sqrt(ssq)
        tl.debug_barrier()
        for d0 in tl.static_range(0, D, BLOCK):
            ds = d0 + offs
            x = tl.load(dst + ds, mask=ds < D, other=0.0)
            tl.store(dst + ds, (x.to(tl.float64) * scale).to(tl.float32), mask=ds < D)
    return ssq


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
    NORM: tl.constexpr = False,  # scale by 1/|q| computed here (float64), written back to the table
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
            if NORM:
                ssq = _copy_normalised(SRC + q_off, DQ + j.to(tl.int64) * D, D, BLOCK_D)
                tl.store(HHF + TAB + 4 * j + 3, 1.0 / tl.sqrt(ssq))  # the host checks it: 0, inf, NaN
            else:
                scale = tl.load(HHF + TAB + 4 * j + 3)
                for d0 in range(0, D, BLOCK_D):
                    ds = d0 + tl.arange(0, BLOCK_D)
                    x = tl.load(SRC + q_off + ds, mask=ds < D, other=0.0)
                    tl.store(DQ + j.to(tl.int64) * D + ds, (x.to(tl.float64) * scale).to(tl.float32), mask=ds < D)


@triton.jit
def _filter_words(HDR, HDRF):
    """The filter's header words: (has_ns, ns, since, until, whether a time window is set)."""
    since = tl.load(HDRF + 5)
    until = tl.load(HDRF + 6)
    # (!= 0: Triton's interpreter cannot "&" a mask with an "|" of float comparisons)
    has_time = ((since > float("-inf")) | (until < float("inf"))) != 0
    return tl.load(HDR + 3), tl.load(HDR + 4), since, until, has_time


@triton.jit
def _passes_filter(ok, nsv, ts, has_ns, want_ns, since, until):
    """``ok`` and the row's namespace ``nsv`` and created_at ``ts`` pass the header's filter."""
    return ok & ((has_ns == 0) | (nsv.to(tl.int64) == want_ns)) & (ts >= since) & (ts < until)


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
        has_ns, want_ns, since, until, has_time = _filter_words(HDR, HDRF)
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
            # The mask's columns are loaded before the rows, so that their latency hides behind
            # the rows' (after them they were a round trip more at the end of every program:
            # ~5 us of the single-query scan, 8%; ahead they hold registers, hence the exact
            # scan's 128-register cap in torch_engine.DEFAULT_TUNE). Only the columns a filter
            # uses are read.
            live = tl.load(LIVE + rows, mask=in_rng, other=0)
            if FILTER:
                nsv = tl.load(NS + rows, mask=in_rng & (has_ns != 0), other=0)
                ts = tl.load(TS + rows, mask=in_rng & has_time, other=0.0)
            if BLOCK_Q == 1:
                sc1 = _row_scores(X, Qs + pid_q * D, rows, in_rng, D, BLOCK_N, BLOCK_D, HALF)
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
            ok = in_rng & (live != 0)
            if FILTER:
                ok = _passes_filter(ok, nsv, ts, has_ns, want_ns, since, until)
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
def _query_planes(q, inv_scale, cols):
    """The query chunk ``q`` ([BLOCK_D] float32) in units of its scale (``inv_scale`` = 1 /
    scale) as two int8 planes, ``hi + lo / 256``, in columns 0 and 1 of a [BLOCK_D, 16] tile
    (the tensor cores' narrowest operand; the other columns are 0). ``|t - hi - lo/256| <=
    1/256`` for ``t = q * inv_scale`` in [-127, 127] (see ``torch_engine``)."""
    t = q * inv_scale
    hi = tl.minimum(tl.maximum(tl.floor(t + 0.5), -127.0), 127.0)
    lo = tl.minimum(tl.maximum(tl.floor((t - hi) * 256.0 + 0.5), -127.0), 127.0)
    return tl.where(cols[None, :] == 0, hi[:, None], tl.where(cols[None, :] == 1, lo[:, None], 0.0)).to(tl.int8)


@triton.jit
def int8_scores_kernel(
    X8,  # [cap, D] int8 rows: row i is about SCALE8[i] * X8[i]
    SCALE8,  # [cap] float32
    Qs,  # [Qb, D] float32 query (one: the single-query path)
    HDR,
    HDRF,
    LIVE,
    NS,
    TS,
    OUT,  # [cap] float32 masked scores (-inf: masked out)
    D: tl.constexpr,
    D_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FILTER: tl.constexpr,
):
    """Fast mode's first pass for one query over the 8-bit rows: a row block per program
    (grid: capacity / BLOCK_N), int8 x int8 products on the tensor cores, int32 sums (exact).

    The query is split in-kernel into two int8 planes against its own scale ``s_q = max|q| /
    127``: ``q ~ s_q (hi + lo/256)``, one plane per column of the tensor cores' operand, so
    the 8-bit pass reads a quarter of the float32 bytes while the query keeps ~15 bits. Score =
    ``(sum hi + sum lo / 256) * s_q * SCALE8[row]``; the bound on its distance to the float32
    score is in ``torch_engine``. Masks as in the score-writing scan."""
    blk = tl.program_id(0)
    n = tl.load(HDR)
    rows = blk.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rng = rows < n
    if blk * BLOCK_N < n:
        # (The mask's columns first, as in scan_topk_kernel: their latency hides behind the rows'.)
        live = tl.load(LIVE + rows, mask=in_rng, other=0)
        if FILTER:
            has_ns, want_ns, since, until, has_time = _filter_words(HDR, HDRF)
            nsv = tl.load(NS + rows, mask=in_rng & (has_ns != 0), other=0)
            ts = tl.load(TS + rows, mask=in_rng & has_time, other=0.0)
        scale = tl.load(SCALE8 + rows, mask=in_rng, other=0.0)
        dq = tl.arange(0, D_POW2)
        q_max = tl.max(tl.abs(tl.load(Qs + dq, mask=dq < D, other=0.0)), axis=0)
        s_q = tl.where(q_max > 0, q_max / 127.0, 1.0)
        inv_s = 1.0 / s_q
        cols = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N, 16], tl.int32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            dm = ds < D
            x = tl.load(X8 + rows[:, None] * D + ds[None, :], mask=in_rng[:, None] & dm[None, :], other=0)
            planes = _query_planes(tl.load(Qs + ds, mask=dm, other=0.0), inv_s, cols)
            acc = tl.dot(x, planes, acc, out_dtype=tl.int32)
        hi = tl.sum(tl.where(cols[None, :] == 0, acc, 0), axis=1)
        lo = tl.sum(tl.where(cols[None, :] == 1, acc, 0), axis=1)
        sc = (hi.to(tl.float32) + lo.to(tl.float32) * (1.0 / 256.0)) * s_q * scale
        ok = in_rng & (live != 0)
        if FILTER:
            ok = _passes_filter(ok, nsv, ts, has_ns, want_ns, since, until)
        tl.store(OUT + rows, tl.where(ok, sc, float("-inf")), mask=in_rng)


@triton.jit
def _masked_rows(S, q, local, inside, HDR, stride_s, row_base, width, LIVE, NS, TS, HDRF,
                 MASK: tl.constexpr, FILTER: tl.constexpr):
    """(scores, rows, ok) of query ``q``'s scores at slice offsets ``local`` (where ``inside``):
    ok = a live row that passes the filter (MASK: S came unmasked from a GEMM) and has a
    finite score."""
    n = tl.load(HDR)
    rows = row_base + local
    limit = stride_s if width == 0 else width
    # (The scores' load does not wait for n: rows past it are masked below.)
    sc = tl.load(S + q.to(tl.int64) * stride_s + local, mask=inside & (local < limit), other=float("-inf"))
    ok = inside & (rows < n) & (local < limit)
    sc = tl.where(ok, sc, float("-inf"))
    if MASK:
        ok = ok & (tl.load(LIVE + rows, mask=ok, other=0) != 0)
        if FILTER:
            has_ns, want_ns, since, until, _has_time = _filter_words(HDR, HDRF)
            nsv = tl.load(NS + rows, mask=ok, other=0)
            ts = tl.load(TS + rows, mask=ok, other=0.0)
            ok = _passes_filter(ok, nsv, ts, has_ns, want_ns, since, until)
    return sc, rows, ok & (sc > float("-inf"))


@triton.jit
def _masked_chunk(S, q, j, HDR, stride_s, row_base, width, LIVE, NS, TS, HDRF,
                  CHUNK: tl.constexpr, MASK: tl.constexpr, FILTER: tl.constexpr):
    """:func:`_masked_rows` of chunk ``j``."""
    local = j.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    return _masked_rows(S, q, local, local >= 0, HDR, stride_s, row_base, width, LIVE, NS, TS, HDRF, MASK, FILTER)


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
    out_first=0,  # where in a query's keys chunk 0's go
):
    """Top-K keys of each CHUNK of scores (rows past n give SENTINEL): grid (chunks, Qb)."""
    j = tl.program_id(0)
    q = tl.program_id(1)
    nq = tl.load(HDR + 1)
    # (Loaded before the test of nq, not after it: S holds a row for every program's query.)
    sc, rows, ok = _masked_chunk(S, q, j, HDR, stride_s, row_base, width, LIVE, NS, TS, HDRF, CHUNK, MASK, FILTER)
    if q < nq:
        keys = tl.where(ok, _pack(sc, rows), -9223372036854775808)
        top = tl.topk(tl.reshape(keys, [1, CHUNK]), K)
        tl.store(OUT + q.to(tl.int64) * stride_out + out_first + j * K + tl.arange(0, K)[None, :], top)


@triton.jit
def scores_rescore_kernel(
    S,  # [Qb, stride_s] float32 scores of the 16-bit scan; -inf = masked out
    OUT,  # [Qb, stride_out] int64 keys of float32 scores: KOUT per chunk
    BOUND,  # [Qb] int64: the largest float32 score a row left out may have (_ordered), SENTINEL: none
    HDR,
    HDRF,
    X32,  # [cap, D] float32 rows
    Qs,  # [Qb, D] float32 queries
    stride_s,
    stride_out,
    err_a,  # the 16-bit score's error bound, as in final_kernel
    err_b,
    err_c,
    D: tl.constexpr,
    K: tl.constexpr,  # candidates re-scored per chunk
    KOUT: tl.constexpr,  # keys kept per chunk
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROW_ERR: tl.constexpr = False,  # 8-bit scores: HDRF[12] adds its per-|q| term to the bound
):
    """Fast mode's selection, a chunk per program (grid (chunks, Qb)): the top-K of the
    chunk's 16-bit scores, re-scored in float32 right here, and the KOUT best of those as keys
    of float32 scores, so the final kernel selects among exact scores and re-reads no row.

    The certificate's part: a row of this chunk left out scored at most the K-th candidate's
    16-bit score ``t``, so at most ``t + E`` in float32 (E: the error bound); the largest such
    bound over the chunks goes to BOUND (atomic max) and the final kernel certifies the answer
    when the k-th float32 score beats it. A chunk with fewer than K rows leaves none out."""
    j = tl.program_id(0)
    q = tl.program_id(1)
    nq = tl.load(HDR + 1)
    x_norm = tl.load(HDRF + 7)
    err_q = 0.0
    if ROW_ERR:
        err_q = tl.load(HDRF + 12)
    sc, rows, ok = _masked_chunk(S, q, j, HDR, stride_s, 0, 0, None, None, None, None, CHUNK, False, False)
    if q < nq:
        keys16 = tl.where(ok, _pack(sc, rows), -9223372036854775808)
        top = tl.topk(tl.reshape(keys16, [1, CHUNK]), K)
        s16, valid2, keys32, err = _rescore(top, X32, Qs + q.to(tl.int64) * D, x_norm, err_a, err_b, err_c, err_q,
                                            D, K, BLOCK_D)
        best = tl.topk(keys32, KOUT)
        tl.store(OUT + q.to(tl.int64) * stride_out + j * KOUT + tl.arange(0, KOUT)[None, :], best)
        if tl.sum(valid2.to(tl.int32)) == K:  # rows may have been left out
            t_last = tl.min(tl.where(valid2, s16, float("inf")), axis=1)
            bound = (tl.sum(t_last).to(tl.float64) + err).to(tl.float32)
            # (float64 -> float32 rounds to nearest: one ulp up keeps the bound an upper bound)
            bound_key = _ordered(bound) + 1
            tl.atomic_max(BOUND + q, bound_key)


# -- batches: selection by threshold instead of a top-K per chunk -------------------------------
#
# A bitonic top-K of every chunk of a GEMM's scores costs far more than reading them (measured:
# 259 us of a 443 us batch of 256). Per slice of rows instead: (a) the maximum of every group
# of scores (group_max_kernel, many programs), (b) per query tau = the K-th largest group
# maximum: K groups hold a row scoring at least tau, so the K-th best score is >= tau, and
# (c) every row scoring >= tau, found in the few groups whose maximum reaches tau, is a
# candidate, and the candidates' top-K are the slice's (collect_kernel, one program per
# query): the merge then sees K keys per slice instead of K per chunk. Unless rows tie
# exactly at tau, at most K groups' rows qualify, which the scratch holds; when it cannot
# hold them all the query's overflow word is set: the final kernel fails its certificate
# and the host re-runs the query with the float32 scan.


@triton.jit
def group_max_kernel(
    S, GM, HDR, stride_s, gm_stride, row_base, width, LIVE, NS, TS, HDRF,
    CHUNK: tl.constexpr, GROUPS: tl.constexpr, FILTER: tl.constexpr,
):
    """GM[q, j * GROUPS + g] = max of the eligible scores of group g of chunk j: grid (chunks, Qb)."""
    j = tl.program_id(0)
    q = tl.program_id(1)
    if q < tl.load(HDR + 1):
        sc, rows, ok = _masked_chunk(S, q, j, HDR, stride_s, row_base, width, LIVE, NS, TS, HDRF, CHUNK, True, FILTER)
        best = tl.max(tl.reshape(tl.where(ok, sc, float("-inf")), [GROUPS, CHUNK // GROUPS]), axis=1)
        tl.store(GM + q.to(tl.int64) * gm_stride + j * GROUPS + tl.arange(0, GROUPS), best)


@triton.jit
def collect_kernel(
    S, GM, PICKED, CAND, OVER, OUT, HDR, stride_s, gm_stride, cand_stride, stride_out, out_base, row_base, width,
    LIVE, NS, TS, HDRF,
    K: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr, STEP: tl.constexpr, MERGE: tl.constexpr,
    FILTER: tl.constexpr,
):
    """One program per query (grid (Qb,)): tau = the K-th largest of its NG group maxima; the
    keys of every eligible row scoring >= tau, from the groups whose maximum reaches tau
    (listed in PICKED[q], STEP groups at a time), into CAND[q] (K groups' rows fit unless
    rows tie at tau: OVER[q] = 1 then); their top-K, sorted, to OUT[q, out_base:+K]."""
    q = tl.program_id(0)
    if q < tl.load(HDR + 1):
        best = tl.load(GM + q.to(tl.int64) * gm_stride + tl.arange(0, NG))
        tau = tl.min(tl.topk(tl.reshape(best, [1, NG]), K))
        pick = best >= tau
        n_picked = tl.sum(pick.to(tl.int32), axis=0)
        picked = PICKED + q.to(tl.int64) * gm_stride
        tl.store(picked + tl.cumsum(pick.to(tl.int32), axis=0) - 1, tl.arange(0, NG), mask=pick)
        tl.debug_barrier()  # the list written before any thread reads it back
        cand = CAND + q.to(tl.int64) * cand_stride
        room = K * GROUP
        count = 0
        i = 0
        while i < n_picked:  # (a while: the interpreter cannot take a tensor as a range bound)
            at = i + tl.arange(0, STEP)
            group = tl.load(picked + at, mask=at < n_picked, other=0)
            local = (group.to(tl.int64) * GROUP)[:, None] + tl.arange(0, GROUP)[None, :]
            sc, rows, ok = _masked_rows(S, q, local, (at < n_picked)[:, None], HDR, stride_s, row_base, width, LIVE,
                                        NS, TS, HDRF, True, FILTER)
            take = tl.reshape((ok & (sc >= tau)).to(tl.int32), [STEP * GROUP])
            slot = count + tl.cumsum(take, axis=0) - 1
            tl.store(cand + slot, tl.reshape(_pack(sc, rows), [STEP * GROUP]), mask=(take != 0) & (slot < room))
            count += tl.sum(take, axis=0)
            i += STEP
        if count > room:
            tl.store(OVER + q, 1)
        tl.debug_barrier()  # the candidates written before any thread reads them back
        n_cand = tl.minimum(count, room)
        top = tl.full([1, K], -9223372036854775808, tl.int64)
        b = 0
        while b < n_cand:
            offs = b + tl.arange(0, MERGE)
            keys = tl.load(cand + offs, mask=offs < n_cand, other=-9223372036854775808)
            top = _merge_sorted(top, tl.topk(tl.reshape(keys, [1, MERGE]), K))
            b += MERGE
        tl.store(OUT + q.to(tl.int64) * stride_out + out_base + tl.arange(0, K)[None, :], top)


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
    OVER=None,  # [Qb] int32 with CHECK_OVER: a threshold region overflowed (see collect_kernel)
    CHECK_OVER: tl.constexpr = False,
    # CHUNK_CERT: IN holds float32 keys the chunks re-scored (scores_rescore_kernel), BOUND
    # ([Qb] int64) the largest float32 score a row they left out may have: certified when the
    # k-th score beats it. This kernel resets BOUND for the next search.
    BOUND=None,
    CHUNK_CERT: tl.constexpr = False,
    # PUBLISH: the slot server's graph (await_request_kernel wrote HDR[9..11]: the slot's word
    # offset, the request's seq, the slot). The answer is published in the slot, or, when the
    # certificate fails, nothing is written and the request is handed to the host.
    PUBLISH: tl.constexpr = False,
    SEG=None,  # the shared segment as int64 words (page-locked, mapped)
    DSEEN=None,  # [2, NS] int64 device: seq last answered here / handed, per slot
    HANS=None,  # [NS] int64 host: seq answered, per slot (the sidecar's record)
    HHOF=None,  # [NS] int64 host: seq handed to the host
    HCTL=None,  # int64 host words: [1] answers so far, [7] the GPU's clock (ns) at the last answer
    CTL=None,  # int64 device words: [2] answers so far
    W_STATN: tl.constexpr = 0,
    W_RESP: tl.constexpr = 0,
    NS: tl.constexpr = 1,
    ON_GPU: tl.constexpr = False,
):
    q = tl.program_id(0)
    # The keys and every header word this program needs, loaded at once (the workspace and the
    # header hold a row for every program of the grid): one issued after the selection would
    # be a device-memory round trip more on the answer's path.
    nq = tl.load(HDR + 1)
    offs = tl.arange(0, CHUNK)
    keys = tl.load(IN + q.to(tl.int64) * stride_in + offs, mask=offs < count_in, other=-9223372036854775808)
    k_cols = tl.load(HDR + 8)
    at_i = tl.load(HDR + TAB + 4 * q + 1)
    at_s = tl.load(HDR + TAB + 4 * q + 2)
    if RESCORE or CHUNK_CERT:
        kq = tl.load(HDR + 2)
    if RESCORE:
        x_norm = tl.load(HDRF + 7)
    if CHUNK_CERT:
        bound = tl.load(BOUND + q)
    if PUBLISH:
        slot_w = tl.load(HDR + 9)
        seq = tl.load(HDR + 10)
        slot = tl.load(HDR + 11)
    if q < nq:
        top = tl.topk(tl.reshape(keys, [1, CHUNK]), KIN)
        if RESCORE:
            final, certified = _certified_rescore(
                top, kq, X32, Qs + q.to(tl.int64) * D, x_norm, err_a, err_b, err_c, D, KIN, KOUT, BLOCK_D,
            )
            if CHECK_OVER:
                certified = certified & (tl.load(OVER + q) == 0)
            tl.store(STATUS + q + tl.arange(0, 1), tl.where(certified, 0, 1).to(tl.int32))
        elif CHUNK_CERT:
            final = top
            s_top, _rows, _valid = _unpack(top)
            certified = (bound == -9223372036854775808) | (bound < _ordered(_kth_score(s_top, kq, KIN)))
            tl.store(BOUND + q, -9223372036854775808)
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
        want = cols < k_cols
        good = True
        if PUBLISH:
            if RESCORE or CHUNK_CERT:
                good = tl.sum(certified.to(tl.int32)) > 0
            want = want & good
        tl.store(RES_I + at_i + cols, out_i, mask=want)
        tl.store(RES_S + at_s + cols, score, mask=want)
        if PUBLISH:
            _publish(SEG, DSEEN, HANS, HHOF, HCTL, CTL + 2, slot_w, seq, slot, k_cols, good, W_STATN, W_RESP, NS,
                     ON_GPU)


# -- the slot server: a kernel that polls the slots itself (kalos.engine.slot_server) ---------


@triton.jit
def _fence_system(ON_GPU: tl.constexpr):
    """PTX ``fence.acq_rel.sys``, for observers the host CPU included: after a relaxed load
    that saw a flag, the loads of what it publishes come after it (acquire); before the store
    of a flag, this thread's earlier stores, and those it saw through a barrier, are visible
    first (release). (The interpreter runs one program on the host: nothing to order.)"""
    if ON_GPU:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _publish(SEG, DSEEN, HANS, HHOF, HCTL, ANSWERS, slot_w, seq, slot, k, good, W_STATN: tl.constexpr,
             W_RESP: tl.constexpr, NS: tl.constexpr, ON_GPU: tl.constexpr):
    """With the answer's rows already in the slot (``good``): status 0 and ``n_results`` = k,
    a barrier and a release fence, then ``resp_seq`` (the client reads nothing before it);
    then the answered records (HANS, DSEEN) and the count of answers (ANSWERS, copied to
    HCTL[1]), which no one reads before ``resp_seq``. Otherwise (a failed certificate:
    nothing was written) the request is handed to the host."""
    if good:
        tl.store(SEG + slot_w + W_STATN, k << 32)
        # The barrier orders every thread's stores of the rows before this thread's fence, the
        # release fence all of them before resp_seq (the PTX model's release pattern; one
        # fence, where a system fence before and after the status word cost ~1 us more).
        tl.debug_barrier()
        _fence_system(ON_GPU)
        tl.store(SEG + slot_w + W_RESP, seq)
        tl.store(HCTL + 7, _clock_ns(ON_GPU))  # diagnostics: the answer published
        tl.store(DSEEN + slot, seq)
        tl.store(HANS + slot, seq)
        tl.store(HCTL + 1, tl.atomic_add(ANSWERS, 1) + 1)
    else:
        tl.store(DSEEN + NS + slot, seq)
        tl.store(HHOF + slot, seq)


@triton.jit
def _clock_ns(ON_GPU: tl.constexpr):
    """The GPU's global nanosecond timer (0 under the interpreter, which counts polls instead)."""
    if ON_GPU:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.zeros([], tl.int64)


@triton.jit
def _agree(vals, AGREE, offs, mask):
    """The values of ``vals`` as one writer left them, the same in every warp of the program.

    A small tensor (fewer elements than threads) is replicated in every warp, and each warp
    loads it on its own; a scalar is read by every thread. Values read from memory that
    changes under us (the slots, the host's stop word, the clock) may then differ between
    warps, and warps that decide differently desynchronise the program's barriers (a review
    found this; it can turn into wrong answers and wild addresses). So: store, barrier, reload
    (from L1: the barrier orders the program's own global stores before its loads).
    """
    tl.debug_barrier()  # no warp still reads what an earlier call left in the scratch
    tl.store(AGREE + offs, vals, mask=mask)
    tl.debug_barrier()
    return tl.load(AGREE + offs, mask=mask, other=0)


#: Rows of the namespace table a name may sit in, from its home row on (see name_home).
NS_PROBE = tl.constexpr(8)


@triton.jit
def _name_home(name, name_len, NSMAX: tl.constexpr):
    """The home row of a namespace name (8 int64 words, zero-padded) in the device table, the
    same as ``kalos.engine.slot_server.name_home`` computes on the host: a lookup is one load
    of NS_PROBE rows, not a walk through the table (~1 us of device-memory latency a step)."""
    w = tl.arange(0, 8)
    fold = (name ^ (name >> 32)) & 0xFFFFFFFF
    mult = ((w * 0x9E37 + 0x7F4B) & 0xFFFF) | 1
    h = tl.sum(fold * mult.to(tl.int64), axis=0) + name_len * 0x2545
    return (h ^ (h >> 13) ^ (h >> 29)) & (NSMAX - 1)


@triton.jit
def _word(requests, W: tl.constexpr, REQ_WORDS: tl.constexpr):
    """Word ``W`` of each request: ``requests`` is [slots, REQ_WORDS] int64 words (a request
    as [REQ_WORDS] gives a scalar)."""
    cols = tl.arange(0, REQ_WORDS)
    return tl.sum(tl.where(cols == W, requests, 0), axis=len(requests.shape) - 1)


@triton.jit
def _namespace_id(request, NS_TAB, NS_IDS, last, W_NQF: tl.constexpr, W_NSLEN: tl.constexpr, W_NSB: tl.constexpr,
                  REQ_WORDS: tl.constexpr, NSMAX: tl.constexpr):
    """The namespace a request (its words) asks for: -1 for all namespaces, the id of a name
    the device table holds, or -2 for any other name (the host answers it: its namespace, or
    its error).

    ``last`` ([16] int64, loaded before the poll) is the name found last (NS_IDS[NSMAX:]:
    8 words, length, id; length -1 when none): a request naming it again (every request
    of a client that keeps to one namespace) skips the table's probe, a device-memory round
    trip after the request's words arrive (~1.5 us of the staging, benchmarks/NOTES-gpu.md).
    The host empties it whenever the table changes."""
    want_ns = tl.full([], -1, tl.int64)
    if (_word(request, W_NQF, REQ_WORDS) >> 32) == 0:  # no ALL_NAMESPACES flag: a named request
        w8 = tl.arange(0, 8)
        cols = tl.arange(0, REQ_WORDS)
        name = tl.sum(tl.where(cols[None, :] == (W_NSB + w8)[:, None], request[None, :], 0), axis=1)
        name_len = (_word(request, W_NSLEN, REQ_WORDS) >> 32) & 0xFFFFFFFF
        last_name = tl.sum(tl.where(tl.arange(0, 16)[None, :] == w8[:, None], last[None, :], 0), axis=1)
        if (tl.sum((last_name == name).to(tl.int32)) == 8) & (_word(last, 8, 16) == name_len):
            want_ns = _word(last, 9, 16)
        else:
            probe = (_name_home(name, name_len, NSMAX) + tl.arange(0, NS_PROBE)) & (NSMAX - 1)
            t_id = tl.load(NS_IDS + probe)  # -1: a row not in use
            tab = tl.load(NS_TAB + probe[:, None] * 9 + w8[None, :])
            t_len = tl.load(NS_TAB + probe * 9 + 8)
            same = (tl.sum((tab == name[None, :]).to(tl.int32), axis=1) == 8) & (t_len == name_len)
            want_ns = tl.max(tl.where(same & (t_id >= 0), t_id, -2))
            if want_ns >= 0:
                tl.store(NS_IDS + NSMAX + w8, name)
                tl.store(NS_IDS + NSMAX + 8, name_len)
                tl.store(NS_IDS + NSMAX + 9, want_ns)
    return want_ns


@triton.jit
def _copy_slot_query(SEGF, DQ, at, sl, slot, E_Q: tl.constexpr, D: tl.constexpr, BLOCK_DQ: tl.constexpr):
    """:func:`_copy_normalised` of the query in ``slot`` (``at``: each slot's word offset)."""
    q_at = tl.multiple_of(tl.sum(tl.where(sl == slot, at, 0)) * 2 + E_Q, 4)  # slots and queries are 64-byte aligned
    return _copy_normalised(SEGF + q_at, DQ, D, BLOCK_DQ)


@triton.jit
def _take_request(
    SEG, SEGF, SLOT_AT, DSEEN, HHOF, HCTL, RR, DQ, AGREE, NS_TAB, NS_IDS, n_slots, k_limit, idle,
    op_recall, flags_all, W_REQ: tl.constexpr, W_OPK: tl.constexpr, W_NQF: tl.constexpr, W_NSLEN: tl.constexpr,
    W_NSB: tl.constexpr, REQ_WORDS: tl.constexpr, E_Q: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
    NSMAX: tl.constexpr, BLOCK_DQ: tl.constexpr, ON_GPU: tl.constexpr,
):
    """Polls the slots' ``req_seq`` words until a request this kernel may answer, a stop
    (HCTL[0] != 0) or the idle limit; returns ``(state, slot, seq, k, namespace id)``, state 1
    (serve that request, its query normalised in float64 into DQ) or 2 (exit).

    Served: one query, k <= k_limit, all namespaces or one named in NS_TAB (-1: all), no time
    window, a finite non-zero query. Every other pending request, and every pending one but
    the one taken, is handed to the host (HHOF, and DSEEN[NS + slot] here): the sidecar's
    Python path answers those, batched. RR is the round-robin turn (no slot starves the
    others). Every value the warps decide on goes through :func:`_agree`.

    Reading a request over the bus: the poll's loads (``req_seq`` of the slots in use, the
    stop word) are volatile, each a fresh fetch. Once a ``req_seq`` has moved, an acquire
    fence, then in one round trip every pending slot's whole request (REQ_WORDS words) and
    the query of the slot whose turn it is, with ``.cg`` loads: the client stored both before
    its req_seq (kalos.sync), and ``.cg`` skips L1, which may hold an earlier request of the
    same slot. (Volatile loads there took ~8 us where these take ~2: benchmarks/NOTES-gpu.md,
    2026-12-01.)
    """
    sl = tl.arange(0, NS)
    slot_ok = sl < n_slots
    rw = tl.arange(0, REQ_WORDS)
    # AGREE words: [0, NS) req_seq, [NS, NS * (REQ_WORDS + 1)) the pending requests, then the
    # stop word and the clock
    stop_at = NS * (REQ_WORDS + 1)
    clock_at = stop_at + 1
    quiet_since = _agree(_clock_ns(ON_GPU), AGREE, clock_at, True)
    polls = tl.zeros([], tl.int64)
    state = 0  # 0 polling, 1 serve, 2 exit
    out_pick = tl.full([], -1, tl.int64)
    out_seq = tl.zeros([], tl.int64)
    out_k = tl.zeros([], tl.int64)
    out_ns = tl.full([], -1, tl.int64)
    at = tl.load(SLOT_AT + sl, mask=slot_ok, other=-1)
    here = slot_ok & (at >= 0)
    last_name = tl.load(NS_IDS + NSMAX + tl.arange(0, 16))  # (see _namespace_id)
    while state == 0:
        req_now = tl.load(SEG + at + W_REQ, mask=here, other=0, volatile=True)
        # (The stop word in one lane: a scalar load would be a fetch over the bus per thread.)
        stop_now = tl.load(HCTL + sl * 0, mask=sl == 0, other=0, volatile=True)
        req = _agree(req_now, AGREE, sl, slot_ok)
        seen_a = tl.load(DSEEN + sl, mask=here, other=0)
        seen_h = tl.load(DSEEN + NS + sl, mask=here, other=0)
        pend = here & (req != seen_a) & (req != seen_h)
        if tl.sum(pend.to(tl.int32)) > 0:
            seen_at = _clock_ns(ON_GPU)  # (stored after the staging: the store would wait for the bus)
            start = tl.load(RR)
            turn = (sl - start + NS) % NS
            _fence_system(ON_GPU)  # req_seq, then the request it publishes
            requests = tl.load(SEG + at[:, None] + rw[None, :], mask=pend[:, None] & (rw < W_NSB + 8)[None, :],
                               other=0, cache_modifier=".cg")
            # The query of the pending slot whose turn it is, copied while its words travel
            # (copied again below in the rare case that slot cannot be served here).
            guess = (tl.min(tl.where(pend, turn, NS)) + start) % NS
            ssq = _copy_slot_query(SEGF, DQ, at, sl, guess, E_Q, D, BLOCK_DQ)
            requests = _agree(requests, AGREE, NS + sl[:, None] * REQ_WORDS + rw[None, :], slot_ok[:, None])
            w1 = _word(requests, W_OPK, REQ_WORDS)
            w2 = _word(requests, W_NQF, REQ_WORDS)
            kk = (w1 >> 32) & 0xFFFFFFFF
            fl = (w2 >> 32) & 0xFFFFFFFF
            ok = pend & ((w1 & 0xFFFFFFFF) == op_recall) & ((w2 & 0xFFFFFFFF) == 1)
            ok = ok & (kk >= 1) & (kk <= k_limit) & ((fl == flags_all) | (fl == 0))
            best = tl.min(tl.where(ok, turn, NS))
            pick = tl.where(best < NS, (best + start) % NS, -1)
            give = pend & (sl != pick)
            tl.store(DSEEN + NS + sl, req, mask=give)
            tl.store(HHOF + sl, req, mask=give)
            if pick >= 0:
                if pick != guess:
                    ssq = _copy_slot_query(SEGF, DQ, at, sl, pick, E_Q, D, BLOCK_DQ)
                seq = tl.sum(tl.where(sl == pick, req, 0))
                want_ns = _namespace_id(tl.sum(tl.where(sl[:, None] == pick, requests, 0), axis=0), NS_TAB, NS_IDS,
                                        last_name, W_NQF, W_NSLEN, W_NSB, REQ_WORDS, NSMAX)
                # (Stored whatever the norm; read only if it is finite and non-zero.)
                if (ssq > 0.0) & (ssq < float("inf")) & (want_ns != -2):
                    out_pick = pick
                    out_seq = seq
                    out_k = tl.sum(tl.where(sl == pick, kk, 0))
                    out_ns = want_ns
                    tl.store(RR, (pick + 1) % NS)
                    state = 1
                else:
                    tl.store(DSEEN + NS + pick, seq)
                    tl.store(HHOF + pick, seq)
            tl.store(HCTL + 8, seen_at)  # diagnostics: when a request was first seen
            if state == 0:
                quiet_since = _agree(_clock_ns(ON_GPU), AGREE, clock_at, True)
            polls = polls * 0
        else:
            polls += 1
        if state == 0:
            if tl.max(_agree(stop_now, AGREE, stop_at + sl * 0, sl == 0)) != 0:
                state = 2
            elif ON_GPU:
                # Time alone would count other processes' time slices as idle (the kernel
                # would exit and relaunch under load): also 64 polls in a row.
                if polls > 64:
                    if _agree(_clock_ns(ON_GPU), AGREE, clock_at, True) - quiet_since > idle:
                        state = 2
            elif polls > idle:
                state = 2
    return state, out_pick, out_seq, out_k, out_ns


@triton.jit
def await_request_kernel(
    SEG,  # the shared segment as int64 words (page-locked and mapped: read over the bus)
    SEGF,  # the same memory as float32
    SLOT_AT,  # [NS] int64: word offset of each slot in SEG (-1: no client at start)
    DSEEN,  # [2, NS] int64 device: per slot, the seq last answered here / last handed to the host
    HHOF,  # [NS] int64 page-locked host: seq handed to the host
    HCTL,  # int64 page-locked host words: [0] stop (host writes), [4] 1 once stopped (kernel writes),
    #        [5] the GPU's clock (ns) when this round began to wait, [6] when it staged a request,
    #        [8] when it first saw one
    CTL,  # int64 device words: [0] stopped (every later round does nothing), [1] round-robin turn,
    #       [2] answers
    DH,  # the header + one gather-table row the kernels after this one read (HDR_WORDS + 4 int64)
    DQ,  # [D] float32 device: the request's query, normalised
    AGREE,  # [NS * (REQ_WORDS + 1) + 16] int64 device scratch (_agree)
    NS_TAB,  # [NSMAX, 9] int64: known namespaces' names (8 words, zero-padded) and lengths
    NS_IDS,  # [NSMAX + 16] int64: their ids (>= 0; -1 marks a row not in use), then the name found
    #          last (see _namespace_id)
    n_slots,
    k_limit,  # largest k served
    idle,  # ns without a request before the server stops (interpreter: polls)
    op_recall,
    flags_all,
    W_REQ: tl.constexpr,
    W_OPK: tl.constexpr,
    W_NQF: tl.constexpr,
    W_NSLEN: tl.constexpr,
    W_NSB: tl.constexpr,
    REQ_WORDS: tl.constexpr,  # a request's words, rounded up to a power of two
    E_Q: tl.constexpr,
    E_IDS: tl.constexpr,
    E_SC: tl.constexpr,
    D: tl.constexpr,
    NS: tl.constexpr,
    NSMAX: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """The first node of the slot server's CUDA graph (one program): waits for one request.

    Polls the slots (:func:`_take_request`), stages the request it takes (query in DQ; k,
    namespace, the slot's answer offsets, seq and slot in DH, nq = 1) and exits, so the
    engine's own single-query kernels that follow in the graph scan with the whole GPU, and
    the final kernel publishes the answer in the slot (PUBLISH). On a stop or the idle limit
    it writes nq = 0 (the kernels after it do nothing), marks the server stopped in CTL[0]
    (the rounds already queued behind it do nothing either) and tells the host (HCTL[4]).

    """
    state = 2
    pick = tl.full([], -1, tl.int64)
    seq = tl.zeros([], tl.int64)
    kk = tl.zeros([], tl.int64)
    want_ns = tl.full([], -1, tl.int64)
    if tl.load(CTL, volatile=True) == 0:
        tl.store(HCTL + 5, _clock_ns(ON_GPU))  # phase stamps for diagnostics: waiting since
        state, pick, seq, kk, want_ns = _take_request(
            SEG, SEGF, SLOT_AT, DSEEN, HHOF, HCTL, CTL + 1, DQ, AGREE, NS_TAB, NS_IDS, n_slots, k_limit,
            idle, op_recall, flags_all, W_REQ, W_OPK, W_NQF, W_NSLEN, W_NSB, REQ_WORDS, E_Q, D, NS, NSMAX,
            BLOCK_DQ, ON_GPU,
        )
    if state == 1:
        tl.store(HCTL + 6, _clock_ns(ON_GPU))  # request staged
        slot_w = tl.load(SLOT_AT + pick)
        tl.store(DH + 1, 1)
        tl.store(DH + 2, tl.minimum(kk, tl.load(DH)))
        tl.store(DH + 3, (want_ns >= 0).to(tl.int64))
        tl.store(DH + 4, tl.maximum(want_ns, 0))
        tl.store(DH + 8, kk)
        tl.store(DH + 9, slot_w)
        tl.store(DH + 10, seq)
        tl.store(DH + 11, pick)
        tl.store(DH + TAB + 1, slot_w + E_IDS)
        tl.store(DH + TAB + 2, slot_w * 2 + E_SC)
    else:
        tl.store(DH + 1, 0)
        tl.store(CTL, 1)
        tl.store(HCTL + 4, 1)
