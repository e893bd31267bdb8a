"""What every stage's kernels share: the key encoding, the header's word offsets, the
filter tests, the float32 re-score and its certificate, the query copy, fences and clocks.

Keys
----
Every candidate travels as one int64 *key*: the float32 score mapped to an order-preserving
int32 in the high half, ``0x7FFFFFFF - row`` in the low half. Sorting keys descending sorts by
score, ties by lower row first; a key is one register, so top-k is a plain bitonic top-k
(``tl.topk``) on int64. ``SENTINEL`` (int64 min) marks "no row" (masked out, past the end).

Word offsets
------------
The header, gather table and control words are declared in :mod:`kalos.engine.gpu.layout`;
the ``H_*``, ``T_*``, ``HCTL_*`` and ``CTL_*`` constexprs here are made from that declaration
(and checked against it again by the loader, :func:`~kalos.engine.gpu.layout.check_kernel_layout`).
Gather table row ``j`` starts at word ``HDR_WORDS + TAB_WORDS * j``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kalos.engine.gpu.layout import kernel_constants

SENTINEL = -(2**63)

_C = kernel_constants()
HDR_WORDS = tl.constexpr(_C["HDR_WORDS"])
TAB_WORDS = tl.constexpr(_C["TAB_WORDS"])
NE_WORDS = tl.constexpr(_C["NE_WORDS"])
NE_NAME = tl.constexpr(_C["NE_NAME"])
NE_LENGTH = tl.constexpr(_C["NE_LENGTH"])
NE_ID = tl.constexpr(_C["NE_ID"])
H_N = tl.constexpr(_C["H_N"])
H_NQ = tl.constexpr(_C["H_NQ"])
H_K = tl.constexpr(_C["H_K"])
H_HAS_NS = tl.constexpr(_C["H_HAS_NS"])
H_NS = tl.constexpr(_C["H_NS"])
H_SINCE = tl.constexpr(_C["H_SINCE"])
H_UNTIL = tl.constexpr(_C["H_UNTIL"])
H_MAX_NORM = tl.constexpr(_C["H_MAX_NORM"])
H_K_OUT = tl.constexpr(_C["H_K_OUT"])
H_ROW_ERR8 = tl.constexpr(_C["H_ROW_ERR8"])
H_OWN_FILTERS = tl.constexpr(_C["H_OWN_FILTERS"])
T_QUERY_AT = tl.constexpr(_C["T_QUERY_AT"])
T_IDS_AT = tl.constexpr(_C["T_IDS_AT"])
T_SCORES_AT = tl.constexpr(_C["T_SCORES_AT"])
T_SCALE = tl.constexpr(_C["T_SCALE"])
T_SLOT_WORD = tl.constexpr(_C["T_SLOT_WORD"])
T_SEQ = tl.constexpr(_C["T_SEQ"])
T_SLOT = tl.constexpr(_C["T_SLOT"])
T_SINCE = tl.constexpr(_C["T_SINCE"])
T_UNTIL = tl.constexpr(_C["T_UNTIL"])
T_NS = tl.constexpr(_C["T_NS"])
OWN_WINDOWS = tl.constexpr(_C["OWN_WINDOWS"])
OWN_NAMESPACES = tl.constexpr(_C["OWN_NAMESPACES"])
NS_ALL = tl.constexpr(_C["NS_ALL"])
HCTL_STOP = tl.constexpr(_C["HCTL_STOP"])
HCTL_ANSWERS = tl.constexpr(_C["HCTL_ANSWERS"])
HCTL_STOPPED = tl.constexpr(_C["HCTL_STOPPED"])
HCTL_DEMAND = tl.constexpr(_C["HCTL_DEMAND"])
HCTL_EXPECT = tl.constexpr(_C["HCTL_EXPECT"])
HCTL_T_WAIT = tl.constexpr(_C["HCTL_T_WAIT"])
HCTL_T_STAGED = tl.constexpr(_C["HCTL_T_STAGED"])
HCTL_T_PUBLISHED = tl.constexpr(_C["HCTL_T_PUBLISHED"])
HCTL_T_SEEN = tl.constexpr(_C["HCTL_T_SEEN"])
HCTL_K_WANTED = tl.constexpr(_C["HCTL_K_WANTED"])
CTL_STOPPED = tl.constexpr(_C["CTL_STOPPED"])
CTL_TURN = tl.constexpr(_C["CTL_TURN"])
CTL_ANSWERS = tl.constexpr(_C["CTL_ANSWERS"])
del _C

__all__ = [  # the layout's offsets (the loader checks them) and the empty key
    "SENTINEL", "HDR_WORDS", "TAB_WORDS", "H_N", "H_NQ", "H_K", "H_HAS_NS", "H_NS", "H_SINCE", "H_UNTIL",
    "H_MAX_NORM", "H_K_OUT", "H_ROW_ERR8", "H_OWN_FILTERS", "T_QUERY_AT", "T_IDS_AT", "T_SCORES_AT", "T_SCALE",
    "T_SLOT_WORD", "T_SEQ", "T_SLOT", "T_SINCE", "T_UNTIL", "T_NS", "OWN_WINDOWS", "OWN_NAMESPACES", "NS_ALL",
    "HCTL_STOP", "HCTL_ANSWERS", "HCTL_STOPPED",
    "HCTL_DEMAND", "HCTL_EXPECT",
    "HCTL_T_WAIT", "HCTL_T_STAGED", "HCTL_T_PUBLISHED", "HCTL_T_SEEN", "HCTL_K_WANTED", "CTL_STOPPED", "CTL_TURN", "CTL_ANSWERS",
]

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
def _kth_score(scores, kq, N: tl.constexpr):
    """The kq-th of ``scores`` ([1, N], sorted descending): [1]."""
    return tl.max(tl.where(tl.arange(0, N)[None, :] == kq - 1, scores, float("-inf")), axis=1)


@triton.jit
def _rescore(top, X32, q_ptr, x_norm, err_a, err_b, err_c, err_q, D: tl.constexpr, N: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """The candidates ``top`` ([1, N] keys of 16-bit, tf32 or 8-bit scores) re-scored in
    float32 against the query at ``q_ptr``: ``(s16 [1, N], valid [1, N], keys of the float32
    scores [1, N], E)``, E the bound on |s16 - s32| for this query (see :mod:`kalos.engine.gpu.bounds`):
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
    sorted), and whether the certificate holds (see :mod:`kalos.engine.gpu.bounds`): ``(keys [1, KOUT],
    certified [1])``. ``kq`` is the k asked for, at most the rows in use."""
    _s16, _valid2, keys32, err = _rescore(top, X32, q_ptr, x_norm, err_a, err_b, err_c, 0.0, D, KIN, BLOCK_D)
    return tl.topk(keys32, KOUT), _certificate(top, kq, err, KIN)


@triton.jit
def _certificate(top, kq, err, KIN: tl.constexpr):
    """Whether the float32 top-kq lies among the KIN candidates ``top`` ([1, KIN] keys of
    16-bit or tf32 scores, sorted), ``err`` the bound on a score's error: none left out can
    beat the kq-th (see :mod:`kalos.engine.gpu.bounds`). [1]"""
    s16, _rows, valid2 = _unpack(top)
    t_k = _kth_score(s16, kq, KIN)
    n_valid = tl.sum(valid2.to(tl.int32), axis=1)
    t_last = tl.min(tl.where(valid2, s16, float("inf")), axis=1)
    return (n_valid < KIN) | (t_last.to(tl.float64) < t_k.to(tl.float64) - 2.0 * err)


@triton.jit
def _copy_normalised(src, dst, D: tl.constexpr, BLOCK: tl.constexpr):
    """Copies D float32 values from ``src`` (a slot in page-locked host memory) to ``dst``
    scaled by ``1 / |x|`` (float64, then rounded: what the host's ``row_scales`` gives);
    returns the float64 sum of squares.

    The chunk is a [BLOCK / 128, 128] tile so that each warp reads 512 contiguous bytes: from
    host memory every load instruction is a request over the bus, and scattered 4-byte loads
    made ~1,000 requests of a 4 KiB query (docs/gpu-kernels.md). The loads are ``.cg``
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
def _windowed(since, until):
    """Whether a created_at window ``[since, until)`` bounds anything (-inf / inf: no bound)."""
    return (since > float("-inf")) | (until < float("inf"))


@triton.jit
def _filter_words(HDR, HDRF):
    """Whether a query of the batch has a namespace, and one a time window: the header's, or
    each query's own (the header's own_filters bits, :func:`_query_filters`). The rows'
    namespace and created_at columns are read only then."""
    since = tl.load(HDRF + H_SINCE)
    until = tl.load(HDRF + H_UNTIL)
    own = tl.load(HDR + H_OWN_FILTERS)
    # (!= 0: Triton's interpreter cannot "&" a mask with an "|" of float comparisons)
    has_time = (_windowed(since, until) != 0) | ((own & OWN_WINDOWS) != 0)
    return (tl.load(HDR + H_HAS_NS) != 0) | ((own & OWN_NAMESPACES) != 0), has_time


@triton.jit
def _query_filters(HDR, HDRF, qs, q_ok):
    """The namespace id (NS_ALL: any) and created_at window ``[since, until)`` of the queries
    ``qs`` (a tensor of their indices; ``q_ok``: which are in the batch): the header's for
    all, or where its own_filters bits say so each query's own, from its gather-table row."""
    own = tl.load(HDR + H_OWN_FILTERS)
    own_ns = (own & OWN_NAMESPACES) != 0
    own_w = (own & OWN_WINDOWS) != 0
    tab = HDR_WORDS + TAB_WORDS * qs.to(tl.int64)
    ns = tl.load(HDR + tab + T_NS, mask=q_ok & own_ns, other=NS_ALL)
    since = tl.load(HDRF + tab + T_SINCE, mask=q_ok & own_w, other=0.0)
    until = tl.load(HDRF + tab + T_UNTIL, mask=q_ok & own_w, other=0.0)
    header_ns = tl.where(tl.load(HDR + H_HAS_NS) != 0, tl.load(HDR + H_NS), NS_ALL)
    return (tl.where(own_ns, ns, header_ns), tl.where(own_w, since, tl.load(HDRF + H_SINCE)),
            tl.where(own_w, until, tl.load(HDRF + H_UNTIL)))


@triton.jit
def _passes_filter(ok, nsv, ts, want_ns, since, until):
    """``ok`` and the row's namespace ``nsv`` is ``want_ns`` (NS_ALL: any) and its created_at
    ``ts`` is in ``[since, until)`` (broadcast: rows against queries)."""
    return ok & ((want_ns == NS_ALL) | (nsv.to(tl.int64) == want_ns)) & (ts >= since) & (ts < until)


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
def _clock_ns(ON_GPU: tl.constexpr):
    """The GPU's global nanosecond timer (0 under the interpreter, which counts polls instead)."""
    if ON_GPU:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.zeros([], tl.int64)
