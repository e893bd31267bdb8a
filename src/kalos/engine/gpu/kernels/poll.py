"""The slot server's waiting kernels (:class:`kalos.engine.gpu.slot_server.SlotGraphServer`):
one program polls the slots' ``req_seq`` words in the page-locked segment and stages what the
engine's kernels that follow in the graph answer: one request for the single-query kernels
(:func:`await_request_kernel`), or a crowd's requests of one k as a batch, whatever their
namespaces and time windows (:func:`await_requests_kernel`). Both hand over to the host only what the kernels must not
answer; the rest waits for the next round. Also the namespace table's lookup.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kalos.engine.gpu.kernels.common import (
    CTL_STOPPED,
    CTL_TURN,
    HCTL_DEMAND,
    HCTL_EXPECT,
    HCTL_K_WANTED,
    H_HAS_NS,
    H_K,
    H_K_OUT,
    H_N,
    H_NQ,
    H_NS,
    H_OWN_FILTERS,
    NS_ALL,
    OWN_NAMESPACES,
    OWN_WINDOWS,
    HCTL_STOP,
    HCTL_STOPPED,
    HCTL_T_SEEN,
    HCTL_T_STAGED,
    HCTL_T_WAIT,
    HDR_WORDS,
    NE_ID,
    NE_LENGTH,
    NE_NAME,
    NE_WORDS,
    T_IDS_AT,
    T_QUERY_AT,
    T_SCALE,
    T_SCORES_AT,
    T_SEQ,
    T_SLOT,
    T_NS,
    T_SINCE,
    T_SLOT_WORD,
    T_UNTIL,
    TAB_WORDS,
    _clock_ns,
    _copy_normalised,
    _fence_system,
    _windowed,
)
from kalos.ipc.protocol import SEQ_COUNTER_BITS

#: The client's count in a sequence number (kalos.ipc.protocol): 0 there is a slot at rest.
SEQ_COUNTER = tl.constexpr((1 << SEQ_COUNTER_BITS) - 1)


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
    """The home row of a namespace name (8 int64 words, zero-padded; or [slots, 8], a name a
    slot) in the device table, the same as ``kalos.engine.gpu.slot_server.name_home`` computes
    on the host: a lookup is one load of NS_PROBE rows, not a walk through the table (a
    device-memory round trip a step)."""
    w = tl.arange(0, 8)
    fold = (name ^ (name >> 32)) & 0xFFFFFFFF
    mult = ((w * 0x9E37 + 0x7F4B) & 0xFFFF) | 1
    h = tl.sum(fold * mult.to(tl.int64), axis=len(name.shape) - 1) + name_len * 0x2545
    return (h ^ (h >> 13) ^ (h >> 29)) & (NSMAX - 1)


@triton.jit
def _word(requests, W: tl.constexpr, REQ_WORDS: tl.constexpr):
    """Word ``W`` of each request: ``requests`` is [slots, REQ_WORDS] int64 words (a request
    as [REQ_WORDS] gives a scalar)."""
    cols = tl.arange(0, REQ_WORDS)
    return tl.sum(tl.where(cols == W, requests, 0), axis=len(requests.shape) - 1)


@triton.jit
def _named(request, flags_all, W_NQF: tl.constexpr, REQ_WORDS: tl.constexpr):
    """Whether a request (its words, [REQ_WORDS]; or [slots, REQ_WORDS]) names a namespace: no
    ALL_NAMESPACES flag."""
    return ((_word(request, W_NQF, REQ_WORDS) >> 32) & flags_all) == 0


@triton.jit
def _namespace_id(request, NS_TAB, NS_IDS, last, flags_all, W_NQF: tl.constexpr, W_NSLEN: tl.constexpr,
                  W_NSB: tl.constexpr, REQ_WORDS: tl.constexpr, NSMAX: tl.constexpr):
    """The namespace a request (its words) asks for: -1 for all namespaces, the id of a name
    the device table holds, or -2 for any other name (the host answers it: its namespace, or
    its error).

    ``last`` ([NE_WORDS] int64, loaded before the poll) is the name found last (NS_IDS[NSMAX:],
    a name entry: kalos.engine.gpu.layout.NAME_ENTRY_DTYPE; length -1 when none): a request naming it again (every request
    of a client that keeps to one namespace) skips the table's probe, a device-memory round
    trip after the request's words arrive (docs/gpu-kernels.md).
    The host empties it whenever the table changes."""
    want_ns = tl.full([], -1, tl.int64)
    if _named(request, flags_all, W_NQF, REQ_WORDS):
        w8 = tl.arange(0, 8)
        cols = tl.arange(0, REQ_WORDS)
        name = tl.sum(tl.where(cols[None, :] == (W_NSB + w8)[:, None], request[None, :], 0), axis=1)
        name_len = (_word(request, W_NSLEN, REQ_WORDS) >> 32) & 0xFFFFFFFF
        last_name = tl.sum(tl.where(tl.arange(0, NE_WORDS)[None, :] == w8[:, None] + NE_NAME, last[None, :], 0),
                           axis=1)
        if (tl.sum((last_name == name).to(tl.int32)) == 8) & (_word(last, NE_LENGTH, NE_WORDS) == name_len):
            want_ns = _word(last, NE_ID, NE_WORDS)
        else:
            probe = (_name_home(name, name_len, NSMAX) + tl.arange(0, NS_PROBE)) & (NSMAX - 1)
            t_id = tl.load(NS_IDS + probe)  # -1: a row not in use
            tab = tl.load(NS_TAB + probe[:, None] * 9 + w8[None, :])
            t_len = tl.load(NS_TAB + probe * 9 + 8)
            same = (tl.sum((tab == name[None, :]).to(tl.int32), axis=1) == 8) & (t_len == name_len)
            want_ns = tl.max(tl.where(same & (t_id >= 0), t_id, -2))
            if want_ns >= 0:
                tl.store(NS_IDS + NSMAX + NE_NAME + w8, name)
                tl.store(NS_IDS + NSMAX + NE_LENGTH, name_len)
                tl.store(NS_IDS + NSMAX + NE_ID, want_ns)
    return want_ns


@triton.jit
def _namespace_ids(names, name_len, named, last, NS_TAB, NS_IDS, NSMAX: tl.constexpr):
    """:func:`_namespace_id` for every slot at once (``names``: [slots, 8] words, ``name_len``,
    ``named``: the requests that name one; ``last``: as there): -1 for all namespaces, the id of
    a name the device table holds, -2 for any other. A request naming the name found last, or
    the one its own slot named before (a name entry a slot after the one found last; agents
    keep to their own namespace), skips the table; every other name's NS_PROBE rows
    are read, one row of all of them at a time, and it becomes its slot's."""
    w8 = tl.arange(0, 8)
    slots = tl.arange(0, names.shape[0])
    last_name = tl.sum(tl.where(tl.arange(0, NE_WORDS)[None, :] == w8[:, None] + NE_NAME, last[None, :], 0), axis=1)
    hit = (named & (tl.sum((names == last_name[None, :]).to(tl.int32), axis=1) == 8)
           & (name_len == _word(last, NE_LENGTH, NE_WORDS)))
    found = tl.where(hit, _word(last, NE_ID, NE_WORDS), -2)
    own = NS_IDS + NSMAX + NE_WORDS + slots * NE_WORDS
    asked = named & ~hit
    own_name = tl.load(own[:, None] + NE_NAME + w8[None, :], mask=asked[:, None], other=0)
    own_len = tl.load(own + NE_LENGTH, mask=asked, other=-1)  # -1: none yet, or the table changed
    own_hit = asked & (tl.sum((own_name == names).to(tl.int32), axis=1) == 8) & (own_len == name_len)
    found = tl.where(own_hit, tl.load(own + NE_ID, mask=own_hit, other=-2), found)
    miss = asked & ~own_hit
    if tl.sum(miss.to(tl.int32)) > 0:
        home = _name_home(names, name_len, NSMAX)
        for p in range(NS_PROBE):  # (a loop, not unrolled: the waiting kernel's registers are few)
            row = (home + p) & (NSMAX - 1)
            t_id = tl.load(NS_IDS + row, mask=miss, other=-1)  # -1: a row not in use
            tab = tl.load(NS_TAB + row[:, None] * 9 + w8[None, :], mask=miss[:, None], other=0)
            t_len = tl.load(NS_TAB + row * 9 + 8, mask=miss, other=-1)
            same = miss & (tl.sum((tab == names).to(tl.int32), axis=1) == 8) & (t_len == name_len) & (t_id >= 0)
            found = tl.where(same, t_id, found)
        got = miss & (found >= 0)
        tl.store(own[:, None] + NE_NAME + w8[None, :], names, mask=got[:, None])
        tl.store(own + NE_LENGTH, name_len, mask=got)
        tl.store(own + NE_ID, found, mask=got)
        if tl.sum(got.to(tl.int32)) > 0:  # the name found in the lowest slot, for the rounds after
            pick = tl.min(tl.where(got, slots, names.shape[0]))
            tl.store(NS_IDS + NSMAX + NE_NAME + w8, tl.sum(tl.where((slots == pick)[:, None], names, 0), axis=0))
            tl.store(NS_IDS + NSMAX + NE_LENGTH, tl.sum(tl.where(slots == pick, name_len, 0)))
            tl.store(NS_IDS + NSMAX + NE_ID, tl.sum(tl.where(slots == pick, found, 0)))
    return tl.where(named, found, -1)


@triton.jit
def _copy_slot_query(SEGF, DQ, at, sl, slot, E_Q: tl.constexpr, D: tl.constexpr, BLOCK_DQ: tl.constexpr):
    """:func:`_copy_normalised` of the query in ``slot`` (``at``: each slot's word offset)."""
    q_at = tl.multiple_of(tl.sum(tl.where(sl == slot, at, 0)) * 2 + E_Q, 4)  # slots and queries are 64-byte aligned
    return _copy_normalised(SEGF + q_at, DQ, D, BLOCK_DQ)


@triton.jit
def _poll_slots(SEG, at, IN_USE, HCTL, DSEEN, AGREE, use_at, sl, slot_ok, W_REQ: tl.constexpr, NS: tl.constexpr):
    """One look at the slots: their ``req_seq`` words and the host's words saying which have a
    client (volatile: a fresh fetch over the bus each, all in flight at once), as every warp
    agrees on them; which are pending (a slot with a client whose ``req_seq`` was neither
    answered here nor handed over and counts a request: a slot changes hands at rest, with a
    count of 0, and the rest seqs keep one client's numbers apart from the slot's previous
    client's, so a slot that changed hands since the launch needs no reload); how many slots
    have a client; and the host's stop and expect words in lanes 0 and 1 (for :func:`_agree`
    at the caller's turn)."""
    req_now = tl.load(SEG + at + W_REQ, mask=slot_ok, other=0, volatile=True)
    use_now = tl.load(IN_USE + sl, mask=slot_ok, other=0, volatile=True)
    # (The host's words in one lane each: a scalar load would be a fetch over the bus per thread.)
    host_now = tl.load(HCTL + tl.where(sl == 0, HCTL_STOP, HCTL_EXPECT), mask=sl < 2, other=0, volatile=True)
    req = _agree(req_now, AGREE, sl, slot_ok)
    here = _agree(use_now, AGREE, use_at + sl, slot_ok) != 0
    seen_a = tl.load(DSEEN + sl, mask=slot_ok, other=0)
    seen_h = tl.load(DSEEN + NS + sl, mask=slot_ok, other=0)
    pend = here & ((req & SEQ_COUNTER) != 0) & (req != seen_a) & (req != seen_h)
    return req, pend, tl.sum(here.to(tl.int32)), host_now


@triton.jit
def _request_windows(requests, flags_all, W_NQF: tl.constexpr, W_SINCE: tl.constexpr, W_UNTIL: tl.constexpr,
                     REQ_WORDS: tl.constexpr, F_SINCE: tl.constexpr, F_UNTIL: tl.constexpr):
    """Each request's created_at window ``[since, until)`` (-inf / inf where it sets no bound)
    and whether its filter is one the kernels serve: all namespaces or one named, a window
    whose bounds are finite and in order, nothing else (a where clause). The host answers the
    others, with its error where the window is not finite or empty (as it would have)."""
    fl = (_word(requests, W_NQF, REQ_WORDS) >> 32) & 0xFFFFFFFF
    has_since = (fl & F_SINCE) != 0
    has_until = (fl & F_UNTIL) != 0
    since = tl.where(has_since, _word(requests, W_SINCE, REQ_WORDS).to(tl.float64, bitcast=True), float("-inf"))
    until = tl.where(has_until, _word(requests, W_UNTIL, REQ_WORDS).to(tl.float64, bitcast=True), float("inf"))
    # (since < until is False where either is NaN; the infinite bounds a client may not send
    # are named one by one.)
    served = ((fl & ~(flags_all | F_SINCE | F_UNTIL)) == 0) & (since < until)
    served = served & ~(has_since & (since == float("-inf"))) & ~(has_until & (until == float("inf")))
    return since, until, served


@triton.jit
def _servable(requests, pend, op_recall, k_limit, flags_all, W_OPK: tl.constexpr, W_NQF: tl.constexpr,
              W_SINCE: tl.constexpr, W_UNTIL: tl.constexpr, REQ_WORDS: tl.constexpr, F_SINCE: tl.constexpr,
              F_UNTIL: tl.constexpr):
    """Which pending requests (their words, [slots, REQ_WORDS]) the kernels may answer: a
    recall of one query, 1 <= k <= k_limit, all namespaces or one named, a time window or
    none (:func:`_request_windows`; the namespace and the query are checked later); each
    one's k and window; and which are such recalls whatever their k."""
    w1 = _word(requests, W_OPK, REQ_WORDS)
    w2 = _word(requests, W_NQF, REQ_WORDS)
    kk = (w1 >> 32) & 0xFFFFFFFF
    since, until, filter_ok = _request_windows(requests, flags_all, W_NQF, W_SINCE, W_UNTIL, REQ_WORDS, F_SINCE,
                                               F_UNTIL)
    recall = pend & ((w1 & 0xFFFFFFFF) == op_recall) & ((w2 & 0xFFFFFFFF) == 1) & (kk >= 1) & filter_ok
    return recall & (kk <= k_limit), kk, recall, since, until


@triton.jit
def _report_k_wanted(HCTL, recall, kk, k_report, k_most):
    """Tells the host the largest k among the pending single recalls (``recall``, ``kk``:
    from :func:`_servable`) that the server serves (``k_most``) when it is past ``k_report``
    (the smallest k bucket): a round of a smaller bucket hands those to the host, which then
    queues rounds of the bucket that serves them. (No store otherwise: a round of small k
    writes nothing over the bus.)"""
    k_wanted = tl.max(tl.where(recall & (kk <= k_most), kk, 0))
    if k_wanted > k_report:
        tl.store(HCTL + HCTL_K_WANTED, k_wanted)


@triton.jit
def _time_to_exit(host_now, polls, quiet_since, idle, may_idle, AGREE, stop_at, clock_at, sl, ON_GPU: tl.constexpr):
    """Whether the polling ends: the host's stop word (lane 0 of ``host_now``, from :func:`_poll_slots`),
    or, when ``may_idle``, ``idle`` ns without a request since ``quiet_since`` (the interpreter:
    ``idle`` polls). Time alone would count other processes' time slices as idle (the kernel
    would exit and relaunch under load): also 64 polls in a row."""
    stop = tl.max(_agree(host_now, AGREE, stop_at + sl * 0, sl == 0)) != 0
    idle_out = polls < 0  # (False, as the type the branches give it)
    if may_idle:
        if ON_GPU:
            if polls > 64:
                idle_out = _agree(_clock_ns(ON_GPU), AGREE, clock_at, True) - quiet_since > idle
        else:
            idle_out = polls > idle
    return stop | idle_out


@triton.jit
def _take_request(
    SEG, SEGF, SLOT_AT, IN_USE, TAKEN, DSEEN, HHOF, HCTL, RR, DQ, AGREE, NS_TAB, NS_IDS, n_slots, k_limit, k_report,
    k_most, idle, op_recall, flags_all, W_REQ: tl.constexpr, W_OPK: tl.constexpr, W_NQF: tl.constexpr,
    W_SINCE: tl.constexpr, W_UNTIL: tl.constexpr, W_NSLEN: tl.constexpr,
    W_NSB: tl.constexpr, REQ_WORDS: tl.constexpr, F_SINCE: tl.constexpr, F_UNTIL: tl.constexpr, E_Q: tl.constexpr,
    D: tl.constexpr, NS: tl.constexpr, NSMAX: tl.constexpr, BLOCK_DQ: tl.constexpr, ON_GPU: tl.constexpr,
):
    """Polls the slots' ``req_seq`` words until a request this kernel may answer, a stop
    (the host's stop word) or the idle limit; returns ``(state, slot, seq, k, namespace id,
    sum of squares, since, until)``, state 1 (serve that request, its query normalised in
    float64 into DQ) or 2 (exit).

    Served: one query, k <= k_limit, all namespaces or one named in NS_TAB (-1: all), a time
    window or none (:func:`_request_windows`), a finite non-zero query. Every other pending
    request is handed to the host (HHOF, and DSEEN[NS + slot] here): the sidecar's Python path
    answers those, batched. The servable ones not taken stay pending for the next round (the
    host, seeing them counted in HCTL's demand word, queues batch rounds next). RR is the
    round-robin turn (no slot starves the others). Every value the warps decide on goes through
    :func:`_agree`.

    Reading a request over the bus: the poll's loads (every slot's ``req_seq``, the host's
    in-use words, the stop word) are volatile, each a fresh fetch. Once a ``req_seq`` has moved, an acquire
    fence, then in one round trip every pending slot's whole request (REQ_WORDS words) and
    the query of the slot whose turn it is, with ``.cg`` loads: the client stored both before
    its req_seq (kalos.ipc.sync), and ``.cg`` skips L1, which may hold an earlier request of the
    same slot. (Volatile loads there cost several times as long: docs/gpu-kernels.md.)
    """
    sl = tl.arange(0, NS)
    slot_ok = sl < n_slots
    rw = tl.arange(0, REQ_WORDS)
    # AGREE words: [0, NS) req_seq, [NS, NS * (REQ_WORDS + 1)) the pending requests, then the
    # stop word, the clock and (batch rounds) the expect word, then from 16 words on the in-use words
    stop_at = NS * (REQ_WORDS + 1)
    clock_at = stop_at + 1
    use_at = stop_at + 16
    quiet_since = _agree(_clock_ns(ON_GPU), AGREE, clock_at, True)
    polls = tl.zeros([], tl.int64)
    state = 0  # 0 polling, 1 serve, 2 exit
    out_pick = tl.full([], -1, tl.int64)
    out_seq = tl.zeros([], tl.int64)
    out_k = tl.zeros([], tl.int64)
    out_ns = tl.full([], -1, tl.int64)
    out_ssq = tl.zeros([], tl.float64)
    out_since = tl.zeros([], tl.float64)
    out_until = tl.zeros([], tl.float64)
    at = tl.load(SLOT_AT + sl, mask=slot_ok, other=0)
    last_name = tl.load(NS_IDS + NSMAX + tl.arange(0, NE_WORDS))  # (see _namespace_id)
    while state == 0:
        req, pend, _n_use, host_now = _poll_slots(SEG, at, IN_USE, HCTL, DSEEN, AGREE, use_at, sl, slot_ok, W_REQ,
                                                  NS)
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
            ok, kk, recall, since, until = _servable(requests, pend, op_recall, k_limit, flags_all, W_OPK, W_NQF,
                                                     W_SINCE, W_UNTIL, REQ_WORDS, F_SINCE, F_UNTIL)
            tl.store(HCTL + HCTL_DEMAND, tl.sum(ok.to(tl.int64)))  # (the host sizes the rounds it queues by it)
            _report_k_wanted(HCTL, recall, kk, k_report, k_most)
            best = tl.min(tl.where(ok, turn, NS))
            pick = tl.where(best < NS, (best + start) % NS, -1)
            give = pend & ~ok
            tl.store(DSEEN + NS + sl, req, mask=give)
            tl.store(HHOF + sl, req, mask=give)
            if pick >= 0:
                if pick != guess:
                    ssq = _copy_slot_query(SEGF, DQ, at, sl, pick, E_Q, D, BLOCK_DQ)
                seq = tl.sum(tl.where(sl == pick, req, 0))
                want_ns = _namespace_id(tl.sum(tl.where(sl[:, None] == pick, requests, 0), axis=0), NS_TAB, NS_IDS,
                                        last_name, flags_all, W_NQF, W_NSLEN, W_NSB, REQ_WORDS, NSMAX)
                # (Stored whatever the norm; read only if it is finite and non-zero.)
                if (ssq > 0.0) & (ssq < float("inf")) & (want_ns != -2):
                    out_pick = pick
                    out_seq = seq
                    out_k = tl.sum(tl.where(sl == pick, kk, 0))
                    out_ns = want_ns
                    out_ssq = ssq
                    out_since = tl.sum(tl.where(sl == pick, since, 0.0))
                    out_until = tl.sum(tl.where(sl == pick, until, 0.0))
                    tl.store(RR, (pick + 1) % NS)
                    tl.store(TAKEN + pick, seq)  # (the final kernel clears it once the answer is out)
                    state = 1
                else:
                    tl.store(DSEEN + NS + pick, seq)
                    tl.store(HHOF + pick, seq)
            tl.store(HCTL + HCTL_T_SEEN, seen_at)  # diagnostics: when a request was first seen
            if state == 0:
                quiet_since = _agree(_clock_ns(ON_GPU), AGREE, clock_at, True)
            polls = polls * 0
        else:
            polls += 1
        if state == 0:
            if _time_to_exit(host_now, polls, quiet_since, idle, polls >= 0, AGREE, stop_at, clock_at, sl, ON_GPU):
                state = 2
    return state, out_pick, out_seq, out_k, out_ns, out_ssq, out_since, out_until


@triton.jit
def await_request_kernel(
    SEG,  # the shared segment as int64 words (page-locked and mapped: read over the bus)
    SEGF,  # the same memory as float32
    SLOT_AT,  # [NS] int64: word offset of each slot in SEG
    IN_USE,  # [NS] int64 page-locked host: 1 where a slot has a client (the host's, read at every poll)
    TAKEN,  # [NS] int64 page-locked host: the seq a round took from a slot, until its answer is out (0)
    DSEEN,  # [2, NS] int64 device: per slot, the seq last answered here / last handed to the host
    HHOF,  # [NS] int64 page-locked host: seq handed to the host
    HCTL,  # the host control words (HOST_CONTROL_DTYPE, kalos.engine.gpu.layout): stop, stopped, stamps
    CTL,  # the device control words (DEVICE_CONTROL_DTYPE): stopped, turn, answers
    DH,  # the header + one gather-table row the kernels after this one read (HDR_WORDS + TAB_WORDS)
    DQ,  # [D] float32 device: the request's query, normalised
    AGREE,  # [NS * (REQ_WORDS + 2) + 16] int64 device scratch (_agree)
    NS_TAB,  # [NSMAX, 9] int64: known namespaces' names (8 words, zero-padded) and lengths
    NS_IDS,  # [NSMAX + NE_WORDS * (1 + NS)] int64: their ids (>= 0; -1 marks a row not in use),
    #          then the name entry found last (see _namespace_id), then each slot's (_namespace_ids)
    n_slots,
    k_limit,  # largest k this round serves (its k bucket's; larger ones go to the host)
    k_report,  # a pending single recall with a larger k is reported in HCTL's k_wanted
    k_most,  # largest k the server's rounds serve (of its largest k bucket)
    idle,  # ns without a request before the server stops (interpreter: polls)
    op_recall,
    flags_all,
    W_REQ: tl.constexpr,
    W_OPK: tl.constexpr,
    W_NQF: tl.constexpr,
    W_SINCE: tl.constexpr,
    W_UNTIL: tl.constexpr,
    W_NSLEN: tl.constexpr,
    W_NSB: tl.constexpr,
    REQ_WORDS: tl.constexpr,  # a request's words, rounded up to a power of two
    F_SINCE: tl.constexpr,  # the request flags of a window's bounds (kalos.ipc.protocol.RequestFlag)
    F_UNTIL: tl.constexpr,
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
    namespace, window, the slot's answer offsets, seq and slot in DH, nq = 1) and exits, so the
    engine's own single-query kernels that follow in the graph scan with the whole GPU, and
    the final kernel publishes the answer in the slot (PUBLISH). On a stop or the idle limit
    it writes nq = 0 (the kernels after it do nothing), marks the server stopped (CTL's stopped)
    (the rounds already queued behind it do nothing either) and tells the host (HCTL's stopped).

    """
    state = 2
    pick = tl.full([], -1, tl.int64)
    seq = tl.zeros([], tl.int64)
    kk = tl.zeros([], tl.int64)
    want_ns = tl.full([], -1, tl.int64)
    ssq = tl.zeros([], tl.float64)
    since = tl.zeros([], tl.float64)
    until = tl.zeros([], tl.float64)
    if tl.load(CTL + CTL_STOPPED, volatile=True) == 0:
        tl.store(HCTL + HCTL_T_WAIT, _clock_ns(ON_GPU))  # phase stamps for diagnostics: waiting since
        state, pick, seq, kk, want_ns, ssq, since, until = _take_request(
            SEG, SEGF, SLOT_AT, IN_USE, TAKEN, DSEEN, HHOF, HCTL, CTL + CTL_TURN, DQ, AGREE, NS_TAB, NS_IDS, n_slots, k_limit,
            k_report, k_most,
            idle, op_recall, flags_all, W_REQ, W_OPK, W_NQF, W_SINCE, W_UNTIL, W_NSLEN, W_NSB, REQ_WORDS, F_SINCE,
            F_UNTIL, E_Q, D, NS, NSMAX, BLOCK_DQ, ON_GPU,
        )
    if state == 1:
        tl.store(HCTL + HCTL_T_STAGED, _clock_ns(ON_GPU))  # request staged
        slot_w = tl.load(SLOT_AT + pick)
        tl.store(DH + H_NQ, 1)
        tl.store(DH + H_K, tl.minimum(kk, tl.load(DH + H_N)))
        tl.store(DH + H_HAS_NS, (want_ns >= 0).to(tl.int64))
        tl.store(DH + H_NS, tl.maximum(want_ns, 0))
        tl.store(DH + H_K_OUT, kk)
        tl.store(DH + H_OWN_FILTERS, tl.where(_windowed(since, until), OWN_WINDOWS, 0).to(tl.int64))
        tl.store(DH + HDR_WORDS + T_SINCE, since.to(tl.int64, bitcast=True))
        tl.store(DH + HDR_WORDS + T_UNTIL, until.to(tl.int64, bitcast=True))
        tl.store(DH + HDR_WORDS + T_NS, tl.where(want_ns >= 0, want_ns, NS_ALL))
        tl.store(DH + HDR_WORDS + T_IDS_AT, slot_w + E_IDS)
        tl.store(DH + HDR_WORDS + T_SCORES_AT, slot_w * 2 + E_SC)
        tl.store(DH + HDR_WORDS + T_SCALE, (1.0 / tl.sqrt(ssq)).to(tl.int64, bitcast=True))
        tl.store(DH + HDR_WORDS + T_SLOT_WORD, slot_w)
        tl.store(DH + HDR_WORDS + T_SEQ, seq)
        tl.store(DH + HDR_WORDS + T_SLOT, pick)
    else:
        tl.store(DH + H_NQ, 0)
        tl.store(CTL + CTL_STOPPED, 1)
        tl.store(HCTL + HCTL_STOPPED, 1)


@triton.jit
def _stage_batch(DH, RR, TAKEN, same, ok, turn, start, sl, at, req, first, ns_ids, since, until,
                 W_OPK: tl.constexpr, REQ_WORDS: tl.constexpr, E_Q: tl.constexpr, E_IDS: tl.constexpr,
                 E_SC: tl.constexpr, NS: tl.constexpr, QB: tl.constexpr):
    """Stages the requests of one k (``same``) as a batch, up to QB in turn order: a
    gather-table row each (where its query is, where its answer goes, its filter: ``ns_ids``
    (-1: all namespaces), ``since``, ``until`` per slot), the header's count and k, its
    namespace when the round has one, the own_filters bits (the table's windows where a
    request has one, the table's namespaces where the round has several), and the next
    round's turn (RR)."""
    # Row of each in the batch: its place in turn order among its kind (turn order is slot
    # order rotated to start at the turn's slot).
    same_i = same.to(tl.int32)
    before = tl.cumsum(same_i, axis=0) - same_i  # of its kind, in lower slots
    ahead = tl.sum(tl.where(sl < start, same_i, 0))  # of its kind, before the turn
    rank = tl.where(sl >= start, before - ahead, before + tl.sum(same_i) - ahead)
    take = same & (rank < QB)
    row = DH + HDR_WORDS + TAB_WORDS * rank.to(tl.int64)
    tl.store(row + T_QUERY_AT, at * 2 + E_Q, mask=take)
    tl.store(row + T_IDS_AT, at + E_IDS, mask=take)
    tl.store(row + T_SCORES_AT, at * 2 + E_SC, mask=take)
    tl.store(row + T_SLOT_WORD, at, mask=take)
    tl.store(row + T_SEQ, req, mask=take)
    tl.store(row + T_SLOT, sl.to(tl.int64), mask=take)
    tl.store(row + T_SINCE, since.to(tl.int64, bitcast=True), mask=take)
    tl.store(row + T_UNTIL, until.to(tl.int64, bitcast=True), mask=take)
    tl.store(row + T_NS, tl.where(ns_ids >= 0, ns_ids, NS_ALL), mask=take)
    tl.store(TAKEN + sl, req, mask=take)  # (the final kernel clears each once its answer is out)
    k = (_word(first, W_OPK, REQ_WORDS) >> 32) & 0xFFFFFFFF
    tl.store(DH + H_NQ, tl.sum(take.to(tl.int64)))
    tl.store(DH + H_K, tl.minimum(k, tl.load(DH + H_N)))
    # One namespace for the whole round (the usual crowd) goes to the header: the kernels then
    # read no table row's namespace; several, to the table rows (own_filters).
    lo = tl.min(tl.where(take, ns_ids, 1 << 40))
    hi = tl.max(tl.where(take, ns_ids, -(1 << 40)))
    tl.store(DH + H_HAS_NS, ((lo == hi) & (lo >= 0)).to(tl.int64))
    tl.store(DH + H_NS, tl.where(lo == hi, tl.maximum(lo, 0), 0))
    tl.store(DH + H_K_OUT, k)
    windowed = tl.max((take & _windowed(since, until)).to(tl.int32))
    own = tl.where(windowed > 0, OWN_WINDOWS, 0) | tl.where(lo != hi, OWN_NAMESPACES, 0)
    tl.store(DH + H_OWN_FILTERS, own.to(tl.int64))
    # The next turn: the first request left for another round (of another kind, or past QB),
    # so none waits behind a kind that always fits; else after the last one taken.
    left = tl.min(tl.where(ok & ~take, turn, NS))
    after = tl.where(left < NS, left, tl.max(tl.where(take, turn, 0)) + 1)
    tl.store(RR, (after + start) % NS)


@triton.jit
def _idle_again(first_seen, AGREE, clock_at, ON_GPU: tl.constexpr):
    """(first_seen, waited, quiet_since) once nothing is being gathered: idle from now."""
    return first_seen * 0 - 1, first_seen * 0, _agree(_clock_ns(ON_GPU), AGREE, clock_at, True)


@triton.jit
def _take_requests(
    SEG, SLOT_AT, IN_USE, TAKEN, DSEEN, HHOF, HCTL, RR, DH, AGREE, NS_TAB, NS_IDS, n_slots, k_limit, k_report, k_most,
    idle, window, gap, window_max, op_recall, flags_all, W_REQ: tl.constexpr, W_OPK: tl.constexpr, W_NQF: tl.constexpr,
    W_SINCE: tl.constexpr, W_UNTIL: tl.constexpr, W_NSLEN: tl.constexpr,
    W_NSB: tl.constexpr, REQ_WORDS: tl.constexpr, F_SINCE: tl.constexpr, F_UNTIL: tl.constexpr, E_Q: tl.constexpr,
    E_IDS: tl.constexpr, E_SC: tl.constexpr, NS: tl.constexpr, NSMAX: tl.constexpr, QB: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """:func:`_take_request` for a crowd: polls until requests are pending, gathers them, and
    stages up to QB of one kind as one batch; returns the state (1 serve, 2 exit).

    Gathering: once a request is pending, the poll goes on until every slot in use has one (at most
    QB, and at most the host's ``expect`` word: how many the recent rounds found, so that connected
    clients that are not asking hold no round), or ``window`` has passed since the first and none
    came for ``gap``, or ``window_max`` has passed (ns; the interpreter counts polls): clients
    answered by the same pass and asking again a few microseconds apart share the next, and while a
    crowd's requests keep coming (more clients than cores come back over tens of microseconds) the
    round waits for them rather than leave them to a round of their own, which would cost the GPU
    nearly as much. Then, in one round trip, every pending request's words (as in
    :func:`_take_request`, the same fence and ``.cg`` loads). Those the kernels must not answer are
    handed to the host at once. Of the others, the first in round-robin turn picks the batch's kind
    (k: one header serves the batch; each query's namespace and window are its own, in its table row)
    and the pending requests of that kind join it in turn order, up to QB; the rest stay pending for
    the next round, whose turn begins at the first of them (else after the last one taken: a kind
    that always fits would otherwise keep the turn from another). A table row per request says where
    its query is (the stage-in kernel that follows copies and normalises it, and writes its scale:
    the final kernel hands a zero, NaN or infinite query to the host) and where its answer goes.
    """
    sl = tl.arange(0, NS)
    slot_ok = sl < n_slots
    rw = tl.arange(0, REQ_WORDS)
    stop_at = NS * (REQ_WORDS + 1)
    clock_at = stop_at + 1
    quiet_since = _agree(_clock_ns(ON_GPU), AGREE, clock_at, True)
    first_seen = tl.full([], -1, tl.int64)
    polls = tl.zeros([], tl.int64)
    waited = tl.zeros([], tl.int64)
    quiet = tl.zeros([], tl.int64)
    last_arrival = tl.zeros([], tl.int64)
    last_pend = tl.zeros([], tl.int32)
    state = 0
    expect_at = clock_at + 1
    use_at = stop_at + 16
    at = tl.load(SLOT_AT + sl, mask=slot_ok, other=0)
    last_name = tl.load(NS_IDS + NSMAX + tl.arange(0, NE_WORDS))  # (see _namespace_id)
    while state == 0:
        req, pend, n_use, host_now = _poll_slots(SEG, at, IN_USE, HCTL, DSEEN, AGREE, use_at, sl, slot_ok, W_REQ, NS)
        n_pend = tl.sum(pend.to(tl.int32))
        if n_pend > 0:
            # Enough: every client, at most QB, at most what the host expects (0: no estimate).
            expect = tl.max(_agree(host_now, AGREE, expect_at + sl * 0, sl == 1))
            enough = tl.minimum(n_use.to(tl.int64), QB)
            if expect > 0:
                enough = tl.minimum(enough, expect)
            now = _agree(_clock_ns(ON_GPU), AGREE, clock_at, True)
            if first_seen < 0:
                first_seen = now
            arrived = n_pend > last_pend
            if arrived:
                last_arrival = now
                quiet = quiet * 0
            last_pend = n_pend
            if ON_GPU:
                waited = now - first_seen
                quiet = now - last_arrival
            else:  # (polls: a poll that saw a new request leaves quiet at 0)
                waited += 1
                quiet += tl.where(arrived, 0, 1).to(tl.int64)
            polls = polls * 0
            if (n_pend >= enough) | ((waited >= window) & (quiet >= gap)) | (waited >= window_max):
                tl.store(HCTL + HCTL_T_SEEN, first_seen)  # diagnostics: when a request was first seen
                start = tl.load(RR)
                turn = (sl - start + NS) % NS
                _fence_system(ON_GPU)  # req_seq, then the request it publishes
                requests = tl.load(SEG + at[:, None] + rw[None, :], mask=pend[:, None] & (rw < W_NSB + 8)[None, :],
                                   other=0, cache_modifier=".cg")
                requests = _agree(requests, AGREE, NS + sl[:, None] * REQ_WORDS + rw[None, :], slot_ok[:, None])
                ok, kk, recall, since, until = _servable(requests, pend, op_recall, k_limit, flags_all, W_OPK,
                                                         W_NQF, W_SINCE, W_UNTIL, REQ_WORDS, F_SINCE, F_UNTIL)
                tl.store(HCTL + HCTL_DEMAND, tl.sum(ok.to(tl.int64)))  # (the host sizes the rounds it queues by it)
                _report_k_wanted(HCTL, recall, kk, k_report, k_most)
                # Each request's namespace, every name looked up at once (the names' words from the
                # agreed copy of the requests); a name the table does not hold goes to the host,
                # which answers with its namespace or its error.
                names = tl.load(AGREE + NS + sl[:, None] * REQ_WORDS + (W_NSB + tl.arange(0, 8))[None, :],
                                mask=slot_ok[:, None], other=0)
                named = ok & _named(requests, flags_all, W_NQF, REQ_WORDS)
                ns_ids = _namespace_ids(names, (_word(requests, W_NSLEN, REQ_WORDS) >> 32) & 0xFFFFFFFF, named,
                                        last_name, NS_TAB, NS_IDS, NSMAX)
                give = pend & (~ok | (ns_ids == -2))
                ok = ok & ~give
                tl.store(DSEEN + NS + sl, req, mask=give)
                tl.store(HHOF + sl, req, mask=give)
                best = tl.min(tl.where(ok, turn, NS))
                if best < NS:
                    # A round takes the requests of the first one's k (one header serves the
                    # batch), whatever their namespaces and windows: each query's are its own.
                    pick = (best + start) % NS
                    first = tl.sum(tl.where(sl[:, None] == pick, requests, 0), axis=0)
                    same = ok & (_word(requests, W_OPK, REQ_WORDS) == _word(first, W_OPK, REQ_WORDS))
                    _stage_batch(DH, RR, TAKEN, same, ok, turn, start, sl, at, req, first, ns_ids, since, until,
                                 W_OPK, REQ_WORDS, E_Q, E_IDS, E_SC, NS, QB)
                    state = 1
                if state == 0:
                    first_seen, waited, quiet_since = _idle_again(first_seen, AGREE, clock_at, ON_GPU)
                last_pend = last_pend * 0
        else:
            polls += 1
            if first_seen >= 0:  # what was pending is gone (its client took it back): idle again
                first_seen, waited, quiet_since = _idle_again(first_seen, AGREE, clock_at, ON_GPU)
                last_pend = last_pend * 0
        if state == 0:  # (no idle exit while gathering)
            if _time_to_exit(host_now, polls, quiet_since, idle, first_seen < 0, AGREE, stop_at, clock_at, sl,
                             ON_GPU):
                state = 2
    return state


@triton.jit
def await_requests_kernel(
    SEG,  # the shared segment as int64 words (page-locked and mapped: read over the bus)
    SLOT_AT,  # [NS] int64: word offset of each slot in SEG
    IN_USE,  # [NS] int64 page-locked host: 1 where a slot has a client (the host's, read at every poll)
    TAKEN,  # [NS] int64 page-locked host: the seq a round took from a slot, until its answer is out (0)
    DSEEN,  # [2, NS] int64 device: per slot, the seq last answered here / last handed to the host
    HHOF,  # [NS] int64 page-locked host: seq handed to the host
    HCTL,  # the host control words (HOST_CONTROL_DTYPE, kalos.engine.gpu.layout)
    CTL,  # the device control words (DEVICE_CONTROL_DTYPE)
    DH,  # the header + QB gather-table rows the kernels after this one read
    AGREE,  # [NS * (REQ_WORDS + 2) + 16] int64 device scratch (_agree)
    NS_TAB,  # [NSMAX, 9] int64: known namespaces (see await_request_kernel)
    NS_IDS,  # [NSMAX + NE_WORDS * (1 + NS)] int64: their ids, the name found last, each slot's
    n_slots,
    k_limit,  # largest k this round serves (its k bucket's; larger ones go to the host)
    k_report,  # a pending single recall with a larger k is reported in HCTL's k_wanted
    k_most,  # largest k the server's rounds serve (of its largest k bucket)
    idle,  # ns without a request before the server stops (interpreter: polls)
    window,  # ns the gathering waits at least, from the first request, for the rest of the crowd (interpreter: polls)
    gap,  # then it goes on while requests keep coming, until none came for this long
    window_max,  # and at most this long from the first
    op_recall,
    flags_all,
    W_REQ: tl.constexpr,
    W_OPK: tl.constexpr,
    W_NQF: tl.constexpr,
    W_SINCE: tl.constexpr,
    W_UNTIL: tl.constexpr,
    W_NSLEN: tl.constexpr,
    W_NSB: tl.constexpr,
    REQ_WORDS: tl.constexpr,
    F_SINCE: tl.constexpr,
    F_UNTIL: tl.constexpr,
    E_Q: tl.constexpr,
    E_IDS: tl.constexpr,
    E_SC: tl.constexpr,
    NS: tl.constexpr,
    NSMAX: tl.constexpr,
    QB: tl.constexpr,  # most requests a round takes (the batch bucket the kernels after it were built for)
    ON_GPU: tl.constexpr,
):
    """The first node of the slot server's batch graph (one program): waits for requests and
    stages up to QB of one kind (:func:`_take_requests`: header and table rows; the stage-in
    kernel that follows copies the queries), so that the engine's batch kernels after it
    answer a crowd in one pass and the final kernel publishes each answer in its slot. On a
    stop or the idle limit: nq = 0 and the server marked stopped, as await_request_kernel."""
    state = 2
    if tl.load(CTL + CTL_STOPPED, volatile=True) == 0:
        tl.store(HCTL + HCTL_T_WAIT, _clock_ns(ON_GPU))
        state = _take_requests(
            SEG, SLOT_AT, IN_USE, TAKEN, DSEEN, HHOF, HCTL, CTL + CTL_TURN, DH, AGREE, NS_TAB, NS_IDS, n_slots, k_limit,
            k_report, k_most, idle,
            window, gap, window_max, op_recall, flags_all, W_REQ, W_OPK, W_NQF, W_SINCE, W_UNTIL, W_NSLEN, W_NSB,
            REQ_WORDS, F_SINCE, F_UNTIL, E_Q, E_IDS, E_SC, NS, NSMAX, QB, ON_GPU,
        )
    if state == 1:
        tl.store(HCTL + HCTL_T_STAGED, _clock_ns(ON_GPU))
    else:
        tl.store(DH + H_NQ, 0)
        tl.store(CTL + CTL_STOPPED, 1)
        tl.store(HCTL + HCTL_STOPPED, 1)
