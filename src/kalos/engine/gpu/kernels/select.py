"""Stage 2, the selections: masked scores (or keys) reduced to each query's candidate keys.

* :func:`scores_topk_kernel` -- the top-K keys of every chunk of scores, many programs in
  parallel (the score-writing scan's selection; also a GEMM slice's narrow tail).
* :func:`scores_rescore_kernel` -- fast mode, one query: each chunk's top-K re-scored in
  float32 in the chunk's own program, with the chunk's part of the certificate.
* :func:`group_max_kernel`, :func:`collect_kernel` -- a slice's top-K by threshold (see the
  comment above them); a batch's score-writing scan may write the group maxima itself.
* :func:`merge_topk_kernel` -- ``(Q, P2)`` programs, each reduces one ``CHUNK`` of keys to
  its top-K: many programs share a merge level instead of one program merging thousands.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kalos.engine.gpu.kernels.common import (
    H_MAX_NORM,
    H_N,
    H_NQ,
    H_ROW_ERR8,
    _filter_words,
    _merge_sorted,
    _ordered,
    _pack,
    _passes_filter,
    _query_filters,
    _rescore,
)


@triton.jit
def _slice_limit(stride_s, width):
    """The slice offsets a scores row holds: its ``width`` (0: the whole row, ``stride_s``)."""
    return stride_s if width == 0 else width


@triton.jit
def _eligible(local, inside, HDR, row_base, limit, LIVE, NS, TS, HDRF, MASK: tl.constexpr, FILTER: tl.constexpr):
    """(rows, ok, nsv, ts) of the slice offsets ``local`` (where ``inside``, below ``limit``): ok
    = a row in use and, with MASK (the scores came unmasked from a GEMM), live; nsv and ts: the
    rows' namespace and created_at where a query of the batch filters by them (else 0), for
    :func:`_in_query_filter`. Only the columns the header's filter uses are read."""
    n = tl.load(HDR + H_N)
    rows = row_base + local
    ok = inside & (rows < n) & (local < limit)
    nsv = tl.zeros(local.shape, tl.int32)
    ts = tl.zeros(local.shape, tl.float64)
    if MASK:
        ok = ok & (tl.load(LIVE + rows, mask=ok, other=0) != 0)
        if FILTER:
            has_ns, has_time = _filter_words(HDR, HDRF)
            nsv = tl.load(NS + rows, mask=ok & has_ns, other=0)
            ts = tl.load(TS + rows, mask=ok & has_time, other=0.0)
    return rows, ok, nsv, ts


@triton.jit
def _in_query_filter(ok, nsv, ts, q, HDR, HDRF, MASK: tl.constexpr, FILTER: tl.constexpr):
    """``ok`` (from :func:`_eligible`) and, with MASK and FILTER, in query ``q``'s namespace
    and time window."""
    if MASK:
        if FILTER:
            want_ns, since, until = _query_filters(HDR, HDRF, q + tl.arange(0, 1), True)
            ok = _passes_filter(ok, nsv, ts, want_ns, since, until)
    return ok


@triton.jit
def _masked_rows(S, q, local, inside, HDR, stride_s, row_base, width, LIVE, NS, TS, HDRF,
                 MASK: tl.constexpr, FILTER: tl.constexpr):
    """(scores, rows, ok) of query ``q``'s scores at slice offsets ``local`` (where ``inside``):
    ok = :func:`_eligible` for ``q`` and a finite score."""
    limit = _slice_limit(stride_s, width)
    # (The scores' load does not wait for the masks: rows they leave out are masked below.)
    sc = tl.load(S + q.to(tl.int64) * stride_s + local, mask=inside & (local < limit), other=float("-inf"))
    rows, ok, nsv, ts = _eligible(local, inside, HDR, row_base, limit, LIVE, NS, TS, HDRF, MASK, FILTER)
    ok = _in_query_filter(ok, nsv, ts, q, HDR, HDRF, MASK, FILTER)
    sc = tl.where(ok, sc, float("-inf"))
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
    nq = tl.load(HDR + H_NQ)
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
    ROW_ERR: tl.constexpr = False,  # 8-bit scores: the header's row_err8 adds its per-|q| term to the bound
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
    nq = tl.load(HDR + H_NQ)
    x_norm = tl.load(HDRF + H_MAX_NORM)
    err_q = 0.0
    if ROW_ERR:
        err_q = tl.load(HDRF + H_ROW_ERR8)
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
# A bitonic top-K of every chunk of a GEMM's scores costs far more than reading them (most of
# a large batch's time, docs/gpu-kernels.md). Per slice of rows instead: (a) the maximum of every group
# of scores (group_max_kernel, many programs; or scan_topk_kernel's GROUP_MAX, when a block of
# the scan is a group), (b) per query tau = the K-th largest group
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
    CHUNK: tl.constexpr, GROUPS: tl.constexpr, FILTER: tl.constexpr, QB: tl.constexpr,
):
    """GM[q, j * GROUPS + g] = max of the eligible scores of group g of chunk j: grid (chunks,
    cdiv(Qb, QB)). A program reads its chunk's mask columns once for its QB queries (each
    query then its own filter): read per query, the columns (live, namespace,
    created_at: up to 13 bytes a row) cost more than the scores (4)."""
    j = tl.program_id(0)
    q0 = tl.program_id(1) * QB
    nq = tl.load(HDR + H_NQ)
    if q0 < nq:
        local = j.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        limit = _slice_limit(stride_s, width)
        _rows, ok, nsv, ts = _eligible(local, local >= 0, HDR, row_base, limit, LIVE, NS, TS, HDRF, True, FILTER)
        groups = j * GROUPS + tl.arange(0, GROUPS)
        for i in tl.static_range(QB):  # (unrolled: every query's load in flight at once)
            q = (q0 + i).to(tl.int64)
            ok_q = _in_query_filter(ok, nsv, ts, q, HDR, HDRF, True, FILTER)
            sc = tl.load(S + q * stride_s + local, mask=ok_q & (q < nq), other=float("-inf"))
            sc = tl.where(sc > float("-inf"), sc, float("-inf"))  # (a NaN is no maximum)
            best = tl.max(tl.reshape(sc, [GROUPS, CHUNK // GROUPS]), axis=1)
            tl.store(GM + q * gm_stride + groups, best, mask=(q < nq) & (groups >= 0))


@triton.jit
def collect_kernel(
    S, GM, PICKED, CAND, OVER, OUT, HDR, stride_s, gm_stride, cand_stride, stride_out, out_base, row_base, width,
    LIVE, NS, TS, HDRF,
    K: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr, STEP: tl.constexpr, MERGE: tl.constexpr,
    FILTER: tl.constexpr, MASK: tl.constexpr = True,
):
    """One program per query (grid (Qb,)): tau = the K-th largest of its NG group maxima; the
    keys of every eligible row scoring >= tau, from the groups whose maximum reaches tau
    (listed in PICKED[q], STEP groups at a time), into CAND[q] (K groups' rows fit unless
    rows tie at tau: OVER[q] = 1 then); their top-K, sorted, to OUT[q, out_base:+K]. MASK:
    the scores are a GEMM's, unmasked (the scan's came masked: -inf, and are not masked again)."""
    q = tl.program_id(0)
    if q < tl.load(HDR + H_NQ):
        best = tl.load(GM + q.to(tl.int64) * gm_stride + tl.arange(0, NG))
        tau = tl.min(tl.topk(tl.reshape(best, [1, NG]), K))
        # (A group with no eligible row has maximum -inf: with tau at -inf, fewer groups than K
        # held one, and walking every group of the slice would find nothing more.)
        pick = (best >= tau) & (best > float("-inf"))
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
                                        NS, TS, HDRF, MASK, FILTER)
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
    nq = tl.load(HDR + H_NQ)
    if q < nq:
        offs = j * CHUNK + tl.arange(0, CHUNK)
        keys = tl.load(IN + q.to(tl.int64) * stride_in + offs, mask=offs < count_in, other=-9223372036854775808)
        top = tl.topk(tl.reshape(keys, [1, CHUNK]), K)
        tl.store(OUT + q.to(tl.int64) * stride_out + j * K + tl.arange(0, K)[None, :], top)
