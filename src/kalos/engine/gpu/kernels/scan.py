"""Stage 1, the scans: every row block scored against the queries, masked (live, namespace,
time), and either reduced to a running top-K of keys (the fused scan) or written out as
masked float32 scores for a selection stage (:mod:`kalos.engine.gpu.kernels.select`).

* :func:`scan_topk_kernel` -- a persistent grid of ``P`` programs per query block. Program
  ``p`` streams row blocks ``p, p + P, p + 2P, ...`` (``BLOCK_N`` rows each, ``N`` read from
  the device header so adds need no new launch parameters), scores them against the query
  block held in registers, applies the masks, and keeps a running top-K of keys (block
  top-K, then a bitonic merge with the running list): ``P * K`` keys per query. With
  ``WRITE_SCORES`` the same loop stores masked scores instead (4 bytes a row) and the
  streaming loop has no barrier at all.
* :func:`int8_scores_kernel` -- fast mode, one query: the 8-bit copy of the rows on the
  tensor cores, the query split into two int8 planes (error bound:
  :mod:`kalos.engine.gpu.bounds`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kalos.engine.gpu.kernels.common import (
    H_N,
    H_NQ,
    _filter_words,
    _merge_sorted,
    _pack,
    _passes_filter,
    _query_filters,
)


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
def _batch_chunk(X, Qs, qs, q_ok, rows, in_rng, ds, D: tl.constexpr, EVEN_D: tl.constexpr):
    """Columns ``ds`` of a batch's row tile ([BLOCK_N, BLOCK_D]) and of its queries
    ([BLOCK_Q, BLOCK_D]); masked rows, queries and columns past D: 0."""
    if EVEN_D:
        x = tl.load(X + rows[:, None] * D + ds[None, :], mask=in_rng[:, None], other=0.0)
        qv = tl.load(Qs + qs[:, None] * D + ds[None, :], mask=q_ok[:, None], other=0.0)
    else:
        x = tl.load(X + rows[:, None] * D + ds[None, :], mask=in_rng[:, None] & (ds < D)[None, :], other=0.0)
        qv = tl.load(Qs + qs[:, None] * D + ds[None, :], mask=q_ok[:, None] & (ds < D)[None, :], other=0.0)
    return x, qv


@triton.jit
def _batch_row_scores(X, Qs, qs, q_ok, rows, in_rng, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr):
    """float32 scores of ``BLOCK_N`` rows of X against ``BLOCK_Q`` queries ([BLOCK_Q, BLOCK_N];
    masked rows and queries: 0) by plain FMA, no tensor cores: :func:`_row_scores` for a few
    queries. Each row tile is loaded once and multiplied by every query, element by element,
    into a [BLOCK_Q, BLOCK_N, BLOCK_D] accumulator summed once at the end, so a pass of a few
    queries reads the rows once, as a single query's does, and needs no certified re-score.
    (tl.dot in "ieee" precision is the same arithmetic through the tensor-core lowering's
    layouts, several times slower.) Off by default (``Tuning.exact_fma_max_q``): on an H200 the
    FMA itself costs more than the tf32 scan and its re-score from a few queries on
    (BENCHMARKS.md, the crowd's "tried and dropped")."""
    EVEN_D: tl.constexpr = D % BLOCK_D == 0
    acc = tl.zeros([BLOCK_Q, BLOCK_N, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        x, qv = _batch_chunk(X, Qs, qs, q_ok, rows, in_rng, d0 + tl.arange(0, BLOCK_D), D, EVEN_D)
        acc += x.to(tl.float32)[None, :, :] * qv[:, None, :]
    return tl.sum(acc, axis=2)


@triton.jit
def scan_topk_kernel(
    X,  # [cap, D] float32 / float16 / bfloat16 rows
    Qs,  # [Qb, D] float32 queries (staging area)
    HDR,  # int64 staging header (kalos.engine.gpu.layout)
    HDRF,  # the same header as float64
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
    PREC: tl.constexpr = "ieee",  # float32 rows, batched: "fma" (exact, _batch_row_scores), "ieee" (exact,
    #                               tl.dot) or "tf32" (tensor cores, certified)
    WRITE_SCORES: tl.constexpr = False,  # store masked scores (-inf) instead of keeping a top-K
    # With WRITE_SCORES and BLOCK_Q > 1: also each row block's maximum score per query into
    # GM[q, block] (a block being a group of the threshold selection, kernels.select), for
    # every block of the capacity (stride_out rows; those past n: -inf).
    GM=None,
    gm_stride=0,
    GROUP_MAX: tl.constexpr = False,
):
    tl.static_assert(not GROUP_MAX or (WRITE_SCORES and BLOCK_Q > 1), "group maxima come from a batch's scores")
    # Row blocks on grid axis 0 (up to 2^31 - 1 programs; axes 1 and 2 stop at 65,535, which
    # a one-block-per-program grid passes at 2M rows), query blocks on axis 1.
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1)
    n_progs = tl.num_programs(0)
    n = tl.load(HDR + H_N)
    nq = tl.load(HDR + H_NQ)
    EVEN_D: tl.constexpr = D % BLOCK_D == 0
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = qs < nq
    if FILTER:
        has_ns, has_time = _filter_words(HDR, HDRF)
        want_ns, since, until = _query_filters(HDR, HDRF, qs, q_ok)  # [BLOCK_Q]: a slot server's each its own
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
            # the rows' (after them they were a round trip more at the end of every program;
            # ahead they hold registers, hence the exact scan's 128-register cap in
            # planner.Tuning). Only the columns a filter uses are read.
            live = tl.load(LIVE + rows, mask=in_rng, other=0)
            if FILTER:
                nsv = tl.load(NS + rows, mask=in_rng & has_ns, other=0)
                ts = tl.load(TS + rows, mask=in_rng & has_time, other=0.0)
            if BLOCK_Q == 1:
                sc1 = _row_scores(X, Qs + pid_q * D, rows, in_rng, D, BLOCK_N, BLOCK_D, HALF)
                sc = tl.reshape(sc1, [1, BLOCK_N])
            elif PREC == "fma":
                sc = _batch_row_scores(X, Qs, qs, q_ok, rows, in_rng, D, BLOCK_N, BLOCK_D, BLOCK_Q)
            else:
                acc = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
                for d0 in range(0, D, BLOCK_D):
                    x, qv = _batch_chunk(X, Qs, qs, q_ok, rows, in_rng, d0 + tl.arange(0, BLOCK_D), D, EVEN_D)
                    if HALF:
                        acc = tl.dot(qv.to(X.dtype.element_ty), tl.trans(x), acc)
                    else:
                        acc = tl.dot(qv, tl.trans(x), acc, input_precision=PREC)
                sc = acc
            ok = in_rng & (live != 0)
            if FILTER:  # [BLOCK_Q, BLOCK_N]: each query's filter
                ok = _passes_filter(ok[None, :], nsv[None, :], ts[None, :], want_ns[:, None], since[:, None],
                                    until[:, None])
            else:
                ok = ok[None, :]
            if WRITE_SCORES:
                # v2: no selection in the streaming loop (its bitonic passes cost block-wide
                # barriers per block); scores_topk_kernel selects afterwards, in parallel.
                if BLOCK_Q == 1:
                    tl.store(OUT + pid_q * stride_out + rows, tl.where(tl.reshape(ok, [BLOCK_N]), sc1, float("-inf")),
                             mask=in_rng)
                else:
                    offs = qs[:, None].to(tl.int64) * stride_out + rows[None, :]
                    masked = tl.where(ok, sc, float("-inf"))
                    tl.store(OUT + offs, masked, mask=q_ok[:, None] & in_rng[None, :])
                    if GROUP_MAX:
                        tl.store(GM + qs.to(tl.int64) * gm_stride + blk, tl.max(masked, axis=1), mask=q_ok)
            else:
                keys = tl.where(ok, _pack(sc, rows[None, :]), -9223372036854775808)
                top = _merge_sorted(top, tl.topk(keys, K))
            blk += n_progs
        if GROUP_MAX:  # (the blocks past n: no stale maximum of an earlier pass is left there)
            while blk < tl.cdiv(stride_out, BLOCK_N):
                tl.store(GM + qs.to(tl.int64) * gm_stride + blk, tl.full([BLOCK_Q], float("-inf"), tl.float32),
                         mask=q_ok)
                blk += n_progs
        if not WRITE_SCORES:
            offs = qs[:, None].to(tl.int64) * stride_out + pid_n * K + tl.arange(0, K)[None, :]
            tl.store(OUT + offs, top, mask=q_ok[:, None])


@triton.jit
def _query_planes(q, inv_scale, cols):
    """The query chunk ``q`` ([BLOCK_D] float32) in units of its scale (``inv_scale`` = 1 /
    scale) as two int8 planes, ``hi + lo / 256``, in columns 0 and 1 of a [BLOCK_D, 16] tile
    (the tensor cores' narrowest operand; the other columns are 0). ``|t - hi - lo/256| <=
    1/256`` for ``t = q * inv_scale`` in [-127, 127] (see :mod:`kalos.engine.gpu.bounds`)."""
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
    score is in :mod:`kalos.engine.gpu.bounds`. Masks as in the score-writing scan."""
    blk = tl.program_id(0)
    n = tl.load(HDR + H_N)
    rows = blk.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rng = rows < n
    if blk * BLOCK_N < n:
        # (The mask's columns first, as in scan_topk_kernel: their latency hides behind the rows'.)
        live = tl.load(LIVE + rows, mask=in_rng, other=0)
        if FILTER:
            has_ns, has_time = _filter_words(HDR, HDRF)
            want_ns, since, until = _query_filters(HDR, HDRF, tl.arange(0, 1), True)
            nsv = tl.load(NS + rows, mask=in_rng & has_ns, other=0)
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
            ok = _passes_filter(ok, nsv, ts, want_ns, since, until)
        tl.store(OUT + rows, tl.where(ok, sc, float("-inf")), mask=in_rng)
