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
