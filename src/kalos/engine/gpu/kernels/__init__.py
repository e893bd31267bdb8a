"""The GPU engine's Triton kernels, one module per stage of a search.

Importing this package imports Triton; only :mod:`kalos.engine.gpu.engine` does, and only
when it is asked for the Triton backend. Under ``TRITON_INTERPRET=1`` (set before Triton is
first imported) the same kernels run on PyTorch CPU tensors, which is how CI checks them.

Pipeline (per query, all on the device; nothing round-trips through host memory):

0. :mod:`~kalos.engine.gpu.kernels.stage` -- header, gather table and queries in from
   page-locked host memory (``stage_in_kernel``; a polling round's queries may be read by
   several programs each, ``stage_queries_kernel``).
1. :mod:`~kalos.engine.gpu.kernels.scan` -- the scans (``scan_topk_kernel``,
   ``int8_scores_kernel``); batches of 32 or more queries are scored by cuBLAS instead
   (``planner.Tuning.gemm_min_q``).
2. :mod:`~kalos.engine.gpu.kernels.select` -- the selections and merge levels.
3. :mod:`~kalos.engine.gpu.kernels.final` -- the final kernel: answers into host memory.

:mod:`~kalos.engine.gpu.kernels.poll` holds the slot server's waiting kernel and
:mod:`~kalos.engine.gpu.kernels.common` what the stages share (keys, header offsets made
from :mod:`kalos.engine.gpu.layout`, the re-score). Why the kernels are shaped this way:
``docs/gpu-kernels.md``.
"""
from kalos.engine.gpu.kernels import common
from kalos.engine.gpu.kernels.common import SENTINEL
from kalos.engine.gpu.kernels.final import final_kernel
from kalos.engine.gpu.kernels.poll import NS_PROBE, await_request_kernel, await_requests_kernel
from kalos.engine.gpu.kernels.scan import int8_scores_kernel, scan_topk_kernel
from kalos.engine.gpu.kernels.select import (
    collect_kernel,
    group_max_kernel,
    merge_topk_kernel,
    scores_rescore_kernel,
    scores_topk_kernel,
)
from kalos.engine.gpu.kernels.stage import stage_in_kernel, stage_queries_kernel

__all__ = [
    "common", "SENTINEL", "NS_PROBE", "stage_in_kernel", "stage_queries_kernel", "scan_topk_kernel",
    "int8_scores_kernel", "scores_topk_kernel",
    "group_max_kernel", "collect_kernel", "merge_topk_kernel", "scores_rescore_kernel", "final_kernel",
    "await_request_kernel", "await_requests_kernel",
]
