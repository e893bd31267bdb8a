"""Stage 3, the final kernel: per query, the top-K of the last merge level, the answer written
straight into host memory (the engine's result area, or a client's slot).

For the 16-bit and tf32 scans it re-scores the candidates in float32 and certifies them
(``RESCORE``); after the chunks' own re-score it checks the chunks' bound (``CHUNK_CERT``);
in the slot server's graph it publishes the answer in the slot (``PUBLISH``, :func:`_publish`).
The error bounds and why they certify: :mod:`kalos.engine.gpu.bounds`.

The re-score reads KIN random rows. One program reading them a tile at a time waited a
memory round trip per tile, and that chain was most of a batch's final step, so with
``SPLIT`` > 1 each query has SPLIT programs: each re-scores KIN / SPLIT candidates in one
tile and files their float32 keys in ``RESCORED``, and the last to arrive (a count per query
in ``ARRIVED``, acquire-release) selects, certifies and answers for the query.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kalos.engine.gpu.kernels.common import (
    CTL_ANSWERS,
    H_K,
    H_K_OUT,
    H_MAX_NORM,
    H_NQ,
    HCTL_ANSWERS,
    HCTL_T_PUBLISHED,
    HDR_WORDS,
    T_IDS_AT,
    T_SCALE,
    T_SCORES_AT,
    T_SEQ,
    T_SLOT,
    T_SLOT_WORD,
    TAB_WORDS,
    _certificate,
    _certified_rescore,
    _clock_ns,
    _fence_system,
    _kth_score,
    _ordered,
    _rescore,
    _unpack,
)


@triton.jit
def final_kernel(
    IN,  # [Qb, stride_in] int64 keys
    HDR,
    HDRF,
    X32,  # [cap, D] float32 rows (read only when RESCORE)
    Qs,  # [Qb, D] float32 queries
    IDS,  # [cap] int64 store ids (read only when OUT_IDS)
    RES_I,  # int64 base of the results: query q's ids (or rows) go to RES_I + the table's ids_at
    RES_S,  # float32 base of the scores: query q's go to RES_S + the table's scores_at
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
    # PUBLISH: the slot server's graph (its waiting kernel wrote each table row's slot_word,
    # seq and slot). Each answer is published in its slot, or, when the certificate fails or
    # the query's scale is not finite and positive (a zero, NaN or infinite query, which the
    # stage-in found), nothing is written and the request is handed to the host.
    PUBLISH: tl.constexpr = False,
    SEG=None,  # the shared segment as int64 words (page-locked, mapped)
    DSEEN=None,  # [2, NS] int64 device: seq last answered here / handed, per slot
    HANS=None,  # [NS] int64 host: seq answered, per slot (the sidecar's record)
    HHOF=None,  # [NS] int64 host: seq handed to the host
    HTAKEN=None,  # [NS] int64 host: the seq a round took from each slot; cleared here once it is out
    HCTL=None,  # the host control words (kalos.engine.gpu.layout): answers, t_published
    CTL=None,  # the device control words: answers
    W_STATN: tl.constexpr = 0,
    W_RESP: tl.constexpr = 0,
    NS: tl.constexpr = 1,
    ON_GPU: tl.constexpr = False,
    # SPLIT (with RESCORE): programs per query on grid axis 1, each re-scoring KIN / SPLIT
    # candidates; RESCORED ([Qb, KIN] int64): their float32 keys; ARRIVED ([Qb] int32): how
    # many of a query's programs filed theirs (zero between searches: the last one resets it).
    SPLIT: tl.constexpr = 1,
    RESCORED=None,
    ARRIVED=None,
):
    tl.static_assert(SPLIT == 1 or RESCORE, "only a re-score is split: the other paths answer in every program")
    tl.static_assert(KIN % SPLIT == 0, "each program of a split re-scores as many candidates")
    q = tl.program_id(0)
    part = tl.program_id(1)
    # The keys and every header word this program needs, loaded at once (the workspace and the
    # header hold a row for every program of the grid): one issued after the selection would
    # be a device-memory round trip more on the answer's path.
    nq = tl.load(HDR + H_NQ)
    offs = tl.arange(0, CHUNK)
    keys = tl.load(IN + q.to(tl.int64) * stride_in + offs, mask=offs < count_in, other=-9223372036854775808)
    k_cols = tl.load(HDR + H_K_OUT)
    tab = HDR_WORDS + TAB_WORDS * q  # this query's gather-table row
    at_i = tl.load(HDR + tab + T_IDS_AT)
    at_s = tl.load(HDR + tab + T_SCORES_AT)
    if RESCORE or CHUNK_CERT:
        kq = tl.load(HDR + H_K)
    if RESCORE:
        x_norm = tl.load(HDRF + H_MAX_NORM)
    if CHUNK_CERT:
        bound = tl.load(BOUND + q)
    if PUBLISH:
        slot_w = tl.load(HDR + tab + T_SLOT_WORD)
        seq = tl.load(HDR + tab + T_SEQ)
        slot = tl.load(HDR + tab + T_SLOT)
        scale = tl.load(HDRF + tab + T_SCALE + tl.arange(0, 1))  # (a tile: the interpreter's scalars do not mix)
    if q < nq:
        top = tl.topk(tl.reshape(keys, [1, CHUNK]), KIN)
        last = True  # this program answers for the query
        if RESCORE and SPLIT > 1:
            final, certified, last = _split_rescore(
                top, part, kq, X32, Qs + q.to(tl.int64) * D, x_norm, err_a, err_b, err_c,
                RESCORED + q.to(tl.int64) * KIN, ARRIVED + q, D, KIN, KOUT, BLOCK_D, SPLIT,
            )
        elif RESCORE:
            final, certified = _certified_rescore(
                top, kq, X32, Qs + q.to(tl.int64) * D, x_norm, err_a, err_b, err_c, D, KIN, KOUT, BLOCK_D,
            )
        if RESCORE:
            if CHECK_OVER:
                certified = certified & (tl.load(OVER + q) == 0)
        elif CHUNK_CERT:
            final = top
            s_top, _rows, _valid = _unpack(top)
            certified = (bound == -9223372036854775808) | (bound < _ordered(_kth_score(s_top, kq, KIN)))
            tl.store(BOUND + q, -9223372036854775808)
        else:
            final = top
        if last:
            if RESCORE or CHUNK_CERT:
                tl.store(STATUS + q + tl.arange(0, 1), tl.where(certified, 0, 1).to(tl.int32))
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
                good = tl.sum(((scale > 0.0) & (scale < float("inf"))).to(tl.int32)) > 0  # (False for NaN too)
                if RESCORE or CHUNK_CERT:
                    good = good & (tl.sum(certified.to(tl.int32)) > 0)
                want = want & good
            tl.store(RES_I + at_i + cols, out_i, mask=want)
            tl.store(RES_S + at_s + cols, score, mask=want)
            if PUBLISH:
                _publish(SEG, DSEEN, HANS, HHOF, HTAKEN, HCTL, CTL + CTL_ANSWERS, slot_w, seq, slot, k_cols, good,
                         W_STATN, W_RESP, NS, ON_GPU)


@triton.jit
def _split_rescore(top, part, kq, X32, q_ptr, x_norm, err_a, err_b, err_c, RESCORED, ARRIVED, D: tl.constexpr,
                   KIN: tl.constexpr, KOUT: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr):
    """Program ``part`` of a query's SPLIT: re-scores candidates [part * R, (part + 1) * R) of
    ``top`` (R = KIN / SPLIT) in float32 and files their keys in ``RESCORED`` (the query's KIN
    keys), then counts itself in ``ARRIVED`` (the query's word); ``(keys [1, KOUT], certified
    [1], last)``, where only the last program to arrive (``last``) holds every program's keys,
    hence the answer."""
    R: tl.constexpr = KIN // SPLIT
    # (This program's R candidates: row ``part`` of the sorted list seen as [SPLIT, R].)
    mine = tl.sum(tl.where(tl.arange(0, SPLIT)[:, None] == part, tl.reshape(top, [SPLIT, R]), 0), axis=0)
    _s16, _valid, keys32, err = _rescore(tl.reshape(mine, [1, R]), X32, q_ptr, x_norm, err_a, err_b, err_c, 0.0,
                                         D, R, BLOCK_D)
    tl.store(RESCORED + part * R + tl.arange(0, R)[None, :], keys32)
    # Every thread's keys stored before the count moves (the barrier, then the atomic's
    # release); the last arrival's acquire makes the other programs' keys visible to its loads.
    tl.debug_barrier()
    arrived = tl.atomic_add(ARRIVED, 1, sem="acq_rel")
    last = arrived == SPLIT - 1
    # Every program loads and selects (this form is the one measured; only the last one's
    # result is used, the others' may read keys not filed yet). .cg: from L2, where the other
    # programs' stores are (L1 is not coherent across SMs).
    every = tl.load(RESCORED + tl.arange(0, KIN)[None, :], cache_modifier=".cg")
    if last:
        tl.store(ARRIVED, 0)  # for the next search (a graph replays this word)
    return tl.topk(every, KOUT), _certificate(top, kq, err, KIN), last


@triton.jit
def _publish(SEG, DSEEN, HANS, HHOF, HTAKEN, HCTL, ANSWERS, slot_w, seq, slot, k, good, W_STATN: tl.constexpr,
             W_RESP: tl.constexpr, NS: tl.constexpr, ON_GPU: tl.constexpr):
    """With the answer's rows already in the slot (``good``): status 0 and ``n_results`` = k,
    a barrier and a release fence, then ``resp_seq`` (the client reads nothing before it);
    then the answered records (HANS, DSEEN) and the count of answers (ANSWERS, copied to
    the host's answers word), which no one reads before ``resp_seq``. Otherwise (a failed certificate,
    or a query that is zero, NaN or infinite: nothing was written) the request is handed to the host.
    Either way the slot's taken word is cleared last: no write of this round's reaches the slot
    after it (the host hands a slot to a new client only once it reads 0 there)."""
    if good:
        tl.store(SEG + slot_w + W_STATN, k << 32)
        # The barrier orders every thread's stores of the rows before this thread's fence, the
        # release fence all of them before resp_seq (the PTX model's release pattern: one
        # fence suffices, a system fence before the status word too would only add latency).
        tl.debug_barrier()
        _fence_system(ON_GPU)
        tl.store(SEG + slot_w + W_RESP, seq)
        tl.store(HCTL + HCTL_T_PUBLISHED, _clock_ns(ON_GPU))  # diagnostics: the answer published
        tl.store(DSEEN + slot, seq)
        tl.store(HANS + slot, seq)
        tl.store(HCTL + HCTL_ANSWERS, tl.atomic_add(ANSWERS, 1) + 1)
    else:
        tl.store(DSEEN + NS + slot, seq)
        tl.store(HHOF + slot, seq)
    tl.store(HTAKEN + slot, 0)
