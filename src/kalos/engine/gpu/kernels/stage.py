"""Stage 0: the header, gather table and queries from page-locked host memory to the device."""
from __future__ import annotations

import triton
import triton.language as tl

from kalos.engine.gpu.kernels.common import (
    H_NQ,
    HDR_WORDS,
    T_QUERY_AT,
    T_SCALE,
    TAB_WORDS,
    _copy_normalised,
)


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
    COPY_META: tl.constexpr = True,  # False: the header and table are already in DH (HH is DH)
):
    """Grid (Qb,): program j copies query j (scaled, in float64 then rounded, exactly as the
    host's normalisation) and its table row to the device; program 0 also copies the header.

    This replaces a host-to-device memcpy node: a kernel reading page-locked host memory
    directly costs the graph less than a copy-engine node (docs/gpu-kernels.md).
    """
    j = tl.program_id(0)
    if COPY_META:
        if j == 0:
            w = tl.arange(0, HDR_WORDS)
            tl.store(DH + w, tl.load(HH + w))
    nq = tl.load(HH + H_NQ)
    if j < nq:
        tab = HDR_WORDS + TAB_WORDS * j  # this query's gather-table row
        if COPY_META:
            w4 = tl.arange(0, TAB_WORDS)
            row = tl.load(HH + tab + w4)
            tl.store(DH + tab + w4, row)
        if COPY_Q:
            q_off = tl.load(HH + tab + T_QUERY_AT)
            if NORM:
                ssq = _copy_normalised(SRC + q_off, DQ + j.to(tl.int64) * D, D, BLOCK_D)
                tl.store(HHF + tab + T_SCALE, 1.0 / tl.sqrt(ssq))  # the host checks it: 0, inf, NaN
            else:
                scale = tl.load(HHF + tab + T_SCALE)
                for d0 in range(0, D, BLOCK_D):
                    ds = d0 + tl.arange(0, BLOCK_D)
                    x = tl.load(SRC + q_off + ds, mask=ds < D, other=0.0)
                    tl.store(DQ + j.to(tl.int64) * D + ds, (x.to(tl.float64) * scale).to(tl.float32), mask=ds < D)


@triton.jit
def _piece(part, PIECE: tl.constexpr, COLS: tl.constexpr):
    """Offsets of floats [part * PIECE, (part + 1) * PIECE) as a [PIECE / COLS, COLS] tile."""
    return part * PIECE + tl.arange(0, PIECE // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]


@triton.jit
def stage_queries_kernel(
    DH,  # device header + gather table (int64 words)
    DHF,  # the same words as float64
    SRC,  # float32 base the table's query offsets point into (the slots: page-locked host memory)
    DQ,  # [Qb, D] float32 device queries, scaled
    PARTS,  # float64, room for Qb * SPLIT: query j's programs' sums of squares at j * SPLIT
    ARRIVED,  # [Qb] int32: a query's programs done (zero between rounds: the last one resets it)
    D: tl.constexpr,
    PIECE: tl.constexpr,  # floats a program copies (a power of two)
    SPLIT: tl.constexpr,
):
    """Grid (Qb, SPLIT): the queries the table names, each read over the bus by SPLIT programs
    (PIECE floats each) on as many SMs, and scaled by ``1 / |q|`` in float64, then rounded, by
    the last of them to arrive, which writes the scale back to the table (``Tuning.stage_split``;
    the parts' sums are added in a fixed order, so the scale may differ from
    :func:`stage_in_kernel`'s in its last bit). Why: reads of host memory are requests over the
    bus, and a program of 4 warps that reads PIECE = 128 floats loads 4 bytes a thread, 128
    bytes a warp; more and smaller requests in flight than one program's 16-byte loads of a
    whole query (docs/gpu-kernels.md, the slot server)."""
    tl.static_assert(SPLIT * PIECE >= D, "the parts cover the query")
    j = tl.program_id(0)
    part = tl.program_id(1)
    if j < tl.load(DH + H_NQ):
        tab = HDR_WORDS + TAB_WORDS * j
        q_off = tl.load(DH + tab + T_QUERY_AT)
        COLS: tl.constexpr = 128 if PIECE > 128 else PIECE
        offs = _piece(part, PIECE, COLS)
        dst = DQ + j.to(tl.int64) * D
        # (.cg, past L1: see _copy_normalised)
        x = tl.load(SRC + q_off + offs, mask=offs < D, other=0.0, cache_modifier=".cg")
        tl.store(dst + offs, x, mask=offs < D)
        x64 = x.to(tl.float64)
        tl.store(PARTS + j * SPLIT + part, tl.sum(tl.sum(x64 * x64, axis=1), axis=0))
        # Every thread's stores before the count moves (the barrier, then the atomic's release);
        # the last arrival's acquire makes the other programs' stores visible to its loads.
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVED + j, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            ssq = tl.sum(tl.load(PARTS + j * SPLIT + tl.arange(0, SPLIT), cache_modifier=".cg"), axis=0)
            scale = 1.0 / tl.sqrt(ssq)
            for p in tl.static_range(SPLIT):
                ds = _piece(p, PIECE, COLS)
                y = tl.load(dst + ds, mask=ds < D, other=0.0, cache_modifier=".cg")
                tl.store(dst + ds, (y.to(tl.float64) * scale).to(tl.float32), mask=ds < D)
            tl.store(DHF + tab + T_SCALE, scale)  # the host checks it: 0, inf, NaN
            tl.store(ARRIVED + j, 0)  # for the next round (a graph replays this word)
