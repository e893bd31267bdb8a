"""The Triton pipeline of one search, stage by stage: the public seam that the engine's own
searches and the slot server's CUDA graph (:mod:`kalos.engine.gpu.slot_server`) both launch.

A batch is: the stage-in (header, gather table and queries from page-locked host memory),
the scan (:meth:`Pipeline.scan_keys`; batches of 32 or more queries: cuBLAS,
:meth:`Pipeline.gemm_scores`), then the merge levels and the final kernel
(:meth:`Pipeline.select_final`), which writes the answers straight into host memory.
Every launch reads the rows in use and the filter from the device header, so a CUDA graph
of these launches stays valid across adds and deletes (:class:`~kalos.engine.gpu.engine.TorchEngine`
captures them).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import torch

from kalos.engine.gpu.buffers import AttachedHost, Staging
from kalos.engine.gpu.columns import DeviceColumns
from kalos.engine.gpu.planner import GROUPS_PER_CHUNK, SPLIT_MAX_CANDIDATES, Plan, Planner, ScanConfig, next_pow2

__all__ = ["Pipeline", "BatchKey", "GemmScratch", "Selection", "SplitBuffers"]


class SplitBuffers(NamedTuple):
    """What the final kernel's split re-score needs for a batch (final_kernel's RESCORED and
    ARRIVED): each query's float32 keys, filed by its programs, and how many have filed them
    (zero between searches: the last program resets it)."""

    keys: torch.Tensor  # int64, room for SPLIT_MAX_CANDIDATES a query (the kernel files q's KF at q * KF)
    arrived: torch.Tensor  # int32, one count a query

class Selection(NamedTuple):
    """The threshold selection's buffers for a batch (:meth:`GemmScratch.selection`); the
    kernels take the maxima's row stride, so a GEMM's slice and a scan's whole capacity share
    them."""

    maxima: torch.Tensor  # float32 [rows, groups or more]: each group's largest eligible score
    picked: torch.Tensor  # int32, the same shape: the groups a query's collect_kernel walks
    candidates: torch.Tensor  # int64 [rows, scratch]: the keys of rows scoring >= tau
    overflow: torch.Tensor  # int32 [rows]: 1 where the candidates did not fit (the final kernel checks)


# Groups collect_kernel reads per step. K groups reach tau unless maxima tie there (fewer where
# fewer groups hold an eligible row), and K (fast_candidates) is 32 at the k buckets of 4 and 8,
# 64 at 16: one step, or two. Each step waits for the group list, then the scores (and with a
# filter the mask's columns); at the bucket of 8, 8 and 16 a step measured slower
# (BENCHMARKS.md). A step reads at most _COLLECT_ROWS rows, whose keys a program holds in
# registers: a tuning with larger groups takes fewer of them a step.
_COLLECT_STEP = 32
_COLLECT_ROWS = 2048
_GROUP_MAX_QUERIES = 8  # queries a program of group_max_kernel takes (its chunk's mask read once for them)

#: What a batch's launches depend on (a CUDA graph per key): (kind, query bucket, k bucket,
#: filtered, want ids, queries from host memory, GEMM slices, device norms, staging side,
#: attached buffer).
BatchKey = tuple


@contextlib.contextmanager
def _tf32_matmul():
    """float32 matmuls on tensor cores (tf32) inside the block; the caller's setting after.

    The setting is process-wide, read by cuBLAS when a matmul is issued (or captured)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class Pipeline:
    """The stages of a search over ``columns`` with the kernel module ``kernels``.

    ``stagings``: the engine's staging areas (a batch names its side; the second may be None);
    ``half``: the 16-bit dtype; ``errors``: the error-bound terms per scan kind
    (:mod:`kalos.engine.gpu.bounds`); ``attached``: the engine's attached host buffer, if
    any; ``on_stream``: a context that runs work on the engine's stream; ``on_realloc``:
    called before a workspace is replaced (captured graphs point at the old one).
    """

    def __init__(self, kernels: Any, columns: DeviceColumns, stagings: tuple[Staging, Staging | None],
                 planner: Planner, *, dim: int,
                 device: torch.device, max_batch: int, half: torch.dtype,
                 errors: dict[str, tuple[float, float, float]],
                 attached: Callable[[], AttachedHost | None], on_stream: Callable[[], Any],
                 on_realloc: Callable[[], None], props: Any = None) -> None:
        self.kernels = kernels
        self.columns = columns
        self.stagings = stagings
        self.staging = stagings[0]
        self.planner = planner
        self.dim = dim
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.max_batch = max_batch
        self._err = errors
        self.attached = attached
        self.on_stream = on_stream
        self.on_realloc = on_realloc
        self._regs_per_sm = (getattr(props, "regs_per_multiprocessor", 65536) or 65536) if props else 65536
        self._smem_per_sm = (getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) or 228 * 1024
                             ) if props else 228 * 1024
        self._half_dtype = half  # the 16-bit copy's dtype (GEMM batches of fast mode)
        self._occupancy: dict = {}
        self._ws: tuple = (None, None, None)
        self._scratch = GemmScratch(device, half, dim, max_batch)
        # The split final kernel's buffers for the engine's own passes (one stream: the two
        # staging sides' passes never overlap on them).
        self.split_buffers = self.new_split_buffers(max_batch) if kernels is not None else None
        self._mm_fp32_out: bool | None = None

    def plan(self, kind: str, qb: int, kp: int) -> Plan:
        """The plan of a batch bucket at the columns' capacity (:meth:`Planner.plan`)."""
        return self.planner.plan(kind, qb, kp, self.columns.x32.shape[0])

    def clear(self) -> None:
        """Forgets compiled-kernel occupancies (a new tuning)."""
        self._occupancy.clear()

    def programs_per_sm(self, kind: str, cfg: ScanConfig, k1: int) -> int:
        """Resident programs per SM for the scan kernel, from its compiled registers/shared memory."""
        cols, st = self.columns, self.staging
        key = (kind, cfg, k1)
        occ = self._occupancy.get(key)
        if occ is None:
            tk = self.kernels
            x = cols.x16 if kind == "f16" else cols.x32
            ker = tk.scan_topk_kernel.warmup(
                x, st.d_q, st.d_hdr, st.d_hdrf, cols.live, cols.ns, cols.ts, st.d_hdr, 16,
                D=self.dim, K=k1, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, BLOCK_Q=cfg.block_q,
                HALF=kind == "f16", FILTER=True, PREC="tf32" if kind == "tf32" else "ieee",
                num_warps=cfg.warps, num_stages=cfg.stages, grid=(1,),
            )
            ker._init_handles()
            threads = cfg.warps * 32
            by_regs = self._regs_per_sm // max(1, ker.n_regs * threads)
            by_smem = self._smem_per_sm // max(1, ker.metadata.shared) if ker.metadata.shared else 32
            occ = max(1, min(by_regs, by_smem, 2048 // threads, 32))
            self._occupancy[key] = occ
        return occ

    def workspace(self, qb: int, keys: int, scores: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two int64 key buffers (ping-pong between merge levels) and a float32 score buffer."""
        need, need_s = qb * keys, qb * scores
        a, b, sc = self._ws
        if a is None or a.numel() < need or (need_s and (sc is None or sc.numel() < need_s)):
            self.on_realloc()
            if a is None or a.numel() < need:
                size = max(need, 2 * (a.numel() if a is not None else 0))
                a = torch.empty(size, dtype=torch.int64, device=self.device)
                b = torch.empty(size, dtype=torch.int64, device=self.device)
            if need_s and (sc is None or sc.numel() < need_s):
                sc = torch.empty(need_s, dtype=torch.float32, device=self.device)
            self._ws = (a, b, sc)
        return a, b, sc

    def run(self, key: BatchKey, live: torch.Tensor | None) -> None:
        """Runs one batch: stage-in (header, table, queries from host memory), scan, merges,
        final (results straight into host memory: the engine's result area or the attached
        buffer)."""
        kind, qb, kp, filtered, want_ids, host_q, slices, device_norms, side, attached = key
        cols, st = self.columns, self.stagings[side]
        plan = self.plan(kind, qb, kp)
        cap = cols.x32.shape[0]
        with self.on_stream():  # the workspace belongs to the stream that uses it
            # (The GEMM path's scores come from cuBLAS's own output buffers, one slice at a time.)
            ws_a, ws_b, ws_s = self.workspace(qb, plan.ws_keys, cap if plan.score_chunk and not plan.gemm_rows else 0)
        live_t = cols.live if live is None else live
        if attached:
            src, res_i, res_s = self.attached().f32, self.attached().i64, self.attached().f32
        else:
            src, res_i, res_s = st.h_q_t, st.res_i64, st.res_f32
        with self.on_stream():
            self.kernels.stage_in_kernel[(qb,)](
                st.h_meta, st.h_metaf, src, st.d_hdr, st.d_q,
                D=self.dim, BLOCK_D=min(1024, next_pow2(self.dim)), COPY_Q=host_q, NORM=device_norms, num_warps=4,
            )
            over = None
            if plan.gemm_rows:
                stride = plan.ws_keys
                over = self.gemm_scores(kind, qb, plan, slices, ws_a, stride, live_t, filtered, st.d_hdr, st.d_hdrf,
                                        st.d_q)
            else:
                stride, over = self.scan_keys(kind, plan, qb, st.d_hdr, st.d_hdrf, st.d_q, live_t, filtered,
                                              ws_a, ws_s, st.d_bound)
            self.select_final(kind, plan, qb, ws_a, ws_b, stride, st.d_hdr, st.d_hdrf, st.d_q, res_i,
                               res_s, st.res_status_t, want_ids, over=over, bound=st.d_bound, split=self.split_buffers)

    def scan_keys(self, kind: str, plan: Plan, qb: int, hdr: torch.Tensor, hdrf: torch.Tensor, dq: torch.Tensor,
                  live_t: torch.Tensor, filtered: bool, ws_a: torch.Tensor, ws_s: torch.Tensor | None,
                  bound: torch.Tensor, *, scratch: "GemmScratch | None" = None) -> tuple[int, torch.Tensor | None]:
        """The scan of a plan without GEMM: each query's candidate keys into ``ws_a``
        (``hdr``/``hdrf``: a staging header on the device, ``dq``: its queries; ``ws_s``: the
        score-writing scan's scores; ``bound``: the chunks' certificate bound per query, with
        ``plan.rescore_k``; ``scratch``: the threshold selection's buffers, as in
        :meth:`gemm_scores`); returns the keys per query and, for a plan that selects by
        threshold, the per-query overflow words the final kernel checks (else None)."""
        cols = self.columns
        tk, cfg, cap = self.kernels, plan.cfg, cols.x32.shape[0]
        x = cols.x16 if kind == "f16" else cols.x32
        common = dict(
            D=self.dim, K=plan.k1, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, BLOCK_Q=cfg.block_q,
            HALF=kind == "f16", FILTER=filtered, PREC="tf32" if kind == "tf32" else "fma" if plan.fma else "ieee",
            num_warps=cfg.warps, num_stages=cfg.stages,
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and self.on_gpu else {}),
        )
        if plan.score_chunk:
            if kind == "i8":
                tk.int8_scores_kernel[(plan.progs,)](
                    cols.x8, cols.scale8, dq, hdr, hdrf, live_t, cols.ns, cols.ts, ws_s, D=self.dim,
                    D_POW2=next_pow2(self.dim), BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, FILTER=filtered,
                    num_warps=cfg.warps, num_stages=cfg.stages,
                )
            elif plan.threshold:
                return self._scan_by_threshold(plan, qb, x, hdr, hdrf, dq, live_t, filtered, ws_a, ws_s, common,
                                               scratch)
            else:
                tk.scan_topk_kernel[(plan.progs, plan.n_qblocks)](
                    x, dq, hdr, hdrf, live_t, cols.ns, cols.ts, ws_s, cap, WRITE_SCORES=True, **common,
                )
            chunks = -(-cap // plan.score_chunk)
            stride = chunks * plan.k1
            if plan.rescore_k:
                ea, eb, ec = self._err[kind]
                tk.scores_rescore_kernel[(chunks, qb)](
                    ws_s, ws_a, bound, hdr, hdrf, cols.x32, dq, cap, stride, ea, eb, ec, D=self.dim,
                    K=plan.rescore_k, KOUT=plan.k1, CHUNK=plan.score_chunk, BLOCK_D=plan.final_block_d,
                    ROW_ERR=kind == "i8", num_warps=plan.topk_warps,
                )
                return stride, None
            tk.scores_topk_kernel[(chunks, qb)](ws_s, ws_a, hdr, cap, stride, K=plan.k1, CHUNK=plan.score_chunk,
                                                num_warps=plan.topk_warps)
            return stride, None
        stride = plan.progs * plan.k1
        tk.scan_topk_kernel[(plan.progs, plan.n_qblocks)](
            x, dq, hdr, hdrf, live_t, cols.ns, cols.ts, ws_a, stride, **common
        )
        return stride, None

    def _scan_by_threshold(self, plan: Plan, qb: int, x: torch.Tensor, hdr: torch.Tensor, hdrf: torch.Tensor,
                           dq: torch.Tensor, live_t: torch.Tensor, filtered: bool, ws_a: torch.Tensor,
                           ws_s: torch.Tensor, common: dict, scratch: "GemmScratch | None") -> tuple[int, torch.Tensor]:
        """The score-writing scan of a batch that selects by threshold: masked scores and each
        row block's maximum (a group's) per query, then each slice of ``plan.slice_rows`` as a
        GEMM's (:meth:`_select_slice`); returns the keys per query and the overflow words."""
        cols, tk, cap = self.columns, self.kernels, self.columns.x32.shape[0]
        group = plan.score_chunk // GROUPS_PER_CHUNK
        shape = (qb, -(-cap // group), plan.k1 * group)  # (a maximum for every block the scan writes)
        selection = self._selection(scratch, *shape)
        maxima = selection.maxima
        selection.overflow.zero_()
        tk.scan_topk_kernel[(plan.progs, plan.n_qblocks)](
            x, dq, hdr, hdrf, live_t, cols.ns, cols.ts, ws_s, cap, WRITE_SCORES=True, GM=maxima,
            gm_stride=maxima.stride(0), GROUP_MAX=True, **common,
        )
        scores = ws_s[: qb * cap].view(qb, cap)
        out_base = 0
        for c0 in range(0, cap, plan.slice_rows):
            width = min(cap, c0 + plan.slice_rows) - c0
            out_base = self._select_slice(plan, qb, scores[:, c0:], c0, width, selection, ws_a, plan.ws_keys,
                                          out_base, live_t, filtered, hdr, hdrf, stride_s=cap,
                                          maxima=maxima[:, c0 // group:])
        return plan.ws_keys, selection.overflow

    def select_final(self, kind: str, plan: Plan, qb: int, ws_a: torch.Tensor, ws_b: torch.Tensor, stride: int,
                     hdr: torch.Tensor, hdrf: torch.Tensor, dq: torch.Tensor, res_i: torch.Tensor,
                     res_s: torch.Tensor, status: torch.Tensor, want_ids: bool, *, over: torch.Tensor | None = None,
                     bound: torch.Tensor | None = None, split: SplitBuffers | None = None,
                     publish: dict | None = None) -> None:
        """The merge levels over the keys in ``ws_a`` (``ws_b``: the other buffer of the ping-pong),
        then the final kernel: answers into host memory at the table's offsets (``split``: the
        split re-score's buffers, :meth:`new_split_buffers`, used when ``plan.final_split`` > 1;
        ``publish``: the slot server's extra arguments, see final_kernel)."""
        cols = self.columns
        tk = self.kernels
        cur, nxt, count = ws_a, ws_b, stride
        for chunk, p2 in plan.levels:
            out_stride = p2 * plan.k1
            tk.merge_topk_kernel[(p2, qb)](cur, nxt, hdr, stride, out_stride, count, K=plan.k1, CHUNK=chunk,
                                           num_warps=4)
            cur, nxt, stride, count = nxt, cur, out_stride, out_stride
        ea, eb, ec = self._err[kind]
        splits = plan.final_split > 1
        if splits and (split is None or split.arrived.numel() < qb or split.keys.shape[1] < plan.k1):
            raise AssertionError("a split final kernel needs its buffers for this batch")
        tk.final_kernel[(qb, plan.final_split)](
            cur, hdr, hdrf, cols.x32, dq, cols.ids, res_i, res_s, status,
            stride, count, ea, eb, ec, D=self.dim, KIN=plan.k1, KOUT=plan.kout, CHUNK=plan.final_chunk,
            BLOCK_D=plan.final_block_d, RESCORE=plan.final_rescore, OUT_IDS=want_ids,
            num_warps=plan.final_warps, OVER=over, CHECK_OVER=over is not None,
            BOUND=bound, CHUNK_CERT=plan.rescore_k > 0, SPLIT=plan.final_split,
            RESCORED=split.keys if splits else None, ARRIVED=split.arrived if splits else None, **(publish or {}),
        )

    def gemm_scores(self, kind: str, qb: int, plan: Plan, slices: int, ws_a: torch.Tensor, stride: int,
                    live_t: torch.Tensor, filtered: bool, hdr: torch.Tensor, hdrf: torch.Tensor, dq: torch.Tensor,
                    *, scratch: "GemmScratch | None" = None) -> torch.Tensor:
        """Batched scores by cuBLAS (tensor cores: fp16 rows, or fp32 rows read as tf32), a
        slice of rows at a time, each slice reduced to a superset of its top-K keys at once.

        A whole slice goes through the threshold selection (``group_max_kernel``, then
        ``collect_kernel``), which leaves the slice's top-K keys; a narrower last slice (or a
        plan without ``threshold``) the top-K of every chunk (``scores_topk_kernel``). Only
        the ``slices`` that hold rows are scored (the graph key carries the count); the keys
        after theirs are set to SENTINEL so the merge sees no stale keys. Returns the
        per-query overflow words the final kernel checks.

        ``hdr``/``hdrf``/``dq``: the header and queries on the device (as :meth:`scan_keys`);
        ``scratch``: the 16-bit queries' and the selection's buffers (default: the engine's; a
        stream that runs beside the engine's, the slot server's, brings its own).
        """
        cols = self.columns
        g, group = plan.gemm_rows, plan.score_chunk // GROUPS_PER_CHUNK
        cap = cols.x32.shape[0]
        q = dq[:qb]
        selection = self._selection(scratch, qb, g // group, plan.k1 * group)
        if kind == "f16":
            q16 = (scratch if scratch is not None else self._scratch).queries16(qb)
            q16.copy_(q)
        selection.overflow.zero_()
        out_base = 0  # keys written so far per query
        for c0 in range(0, slices * g, g):
            c1 = min(cap, c0 + g)
            if kind == "f16":
                if self.on_gpu:  # fp16 products, fp32 accumulation and output
                    sc = torch.mm(q16, cols.x16[c0:c1].T, out_dtype=torch.float32)
                else:  # the CPU emulates it: fp16 values are exact in fp32
                    sc = torch.mm(q16.float(), cols.x16[c0:c1].float().T)
            else:
                with _tf32_matmul():
                    sc = torch.mm(q, cols.x32[c0:c1].T)
            out_base = self._select_slice(plan, qb, sc, c0, c1 - c0, selection, ws_a, stride, out_base, live_t,
                                          filtered, hdr, hdrf, stride_s=c1 - c0)
        if out_base < stride:  # the slices past the rows in use
            ws_a[: qb * stride].view(qb, stride)[:, out_base:].fill_(self.kernels.SENTINEL)
        return selection.overflow

    def _select_slice(self, plan: Plan, qb: int, sc: torch.Tensor, c0: int, width: int, selection: Selection,
                      ws_a: torch.Tensor, stride: int, out_base: int, live_t: torch.Tensor, filtered: bool,
                      hdr: torch.Tensor, hdrf: torch.Tensor, *, stride_s: int,
                      maxima: torch.Tensor | None = None) -> int:
        """The keys of one slice's scores (rows ``c0`` to ``c0 + width``; ``sc``: the slice's
        first score of query 0, ``stride_s`` between queries) into ``ws_a`` from ``out_base``
        on; returns the keys written per query so far. A whole slice selects by threshold
        (``maxima``: its group maxima, the scan's; None: ``group_max_kernel`` finds them, the
        scores being a GEMM's, unmasked), a narrower one keeps the top-K of every chunk."""
        cols, tk = self.columns, self.kernels
        chunk = plan.score_chunk
        group = chunk // GROUPS_PER_CHUNK
        gm, picked, cand, over = selection
        masks = (c0, width, live_t, cols.ns, cols.ts, hdrf)
        unmasked = plan.gemm_rows > 0  # (a GEMM's scores; the scan's are masked: -inf)
        if width == plan.slice_rows and plan.threshold:
            if maxima is None:
                group_qb = min(qb, _GROUP_MAX_QUERIES)
                tk.group_max_kernel[(width // chunk, -(-qb // group_qb))](
                    sc, gm, hdr, stride_s, gm.stride(0), *masks,
                    CHUNK=chunk, GROUPS=GROUPS_PER_CHUNK, FILTER=filtered, QB=group_qb, num_warps=4,
                )
                maxima = gm
            tk.collect_kernel[(qb,)](
                sc, maxima, picked, cand, over, ws_a, hdr, stride_s, maxima.stride(0), cand.stride(0), stride,
                out_base, *masks, K=plan.k1, NG=width // group, GROUP=group,
                STEP=max(1, min(_COLLECT_STEP, _COLLECT_ROWS // group)),
                MERGE=max(128, 2 * plan.k1), FILTER=filtered, MASK=unmasked, num_warps=4,
            )
            return out_base + plan.k1
        tk.scores_topk_kernel[(-(-width // chunk), qb)](
            sc, ws_a, hdr, stride_s, stride, *masks,
            K=plan.k1, CHUNK=chunk, MASK=unmasked, FILTER=filtered and unmasked, out_first=out_base, num_warps=4,
        )
        return out_base + -(-width // chunk) * plan.k1

    def _selection(self, scratch: "GemmScratch | None", qb: int, groups: int, candidates: int) -> Selection:
        """The selection buffers of ``scratch`` (a stream's own), else the engine's."""
        if scratch is not None:
            return scratch.selection(qb, groups, candidates)
        return self.selection_workspace(qb, groups, candidates)

    def selection_workspace(self, qb: int, groups: int, scratch: int) -> Selection:
        """The engine's :meth:`GemmScratch.selection`: buffers replaced only after
        ``on_realloc`` (captured launches point at the buffers they replace)."""
        held = self._scratch
        if not held.fits(qb, groups, scratch):
            self.on_realloc()
            with self.on_stream():
                held.selection(qb, groups, scratch)
        return held.selection(qb, groups, scratch)

    def new_split_buffers(self, max_batch: int) -> SplitBuffers:
        """The split final kernel's buffers for batches of up to ``max_batch`` queries (a batch
        runs in the power of two that holds it), any plan."""
        rows = next_pow2(max_batch)
        return SplitBuffers(torch.zeros((rows, SPLIT_MAX_CANDIDATES), dtype=torch.int64, device=self.device),
                            torch.zeros(rows, dtype=torch.int32, device=self.device))

    def new_scratch(self, max_batch: int) -> GemmScratch:
        """A :class:`GemmScratch` of its own, for passes on another stream."""
        return GemmScratch(self.device, self._half_dtype, self.dim, max_batch)

    def gemm_ok(self, kind: str) -> bool:
        """Whether cuBLAS can score this kind here (fp16 needs mm with a float32 output)."""
        if kind == "tf32" or not self.on_gpu:
            return True
        if self._mm_fp32_out is None:
            try:
                a = torch.zeros((2, 8), dtype=self._half_dtype, device=self.device)
                self._mm_fp32_out = torch.mm(a, a.T, out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError):
                self._mm_fp32_out = False
        return self._mm_fp32_out


class GemmScratch:
    """What a GEMM batch needs besides its workspace, on one stream: the 16-bit copy of its
    queries (fast mode) and the threshold selection's buffers, grown on demand."""

    def __init__(self, device: torch.device, half: torch.dtype, dim: int, max_batch: int) -> None:
        self.device, self.half, self.dim, self.max_batch = device, half, dim, max_batch
        self._q16: torch.Tensor | None = None
        self._sel: Selection | None = None

    def queries16(self, qb: int) -> torch.Tensor:
        if self._q16 is None:
            self._q16 = torch.empty((self.max_batch, self.dim), dtype=self.half, device=self.device)
        return self._q16[:qb]

    def fits(self, qb: int, groups: int, scratch: int) -> bool:
        held = self._sel
        return (held is not None and held.maxima.shape[0] >= qb and held.maxima.shape[1] >= groups
                and held.candidates.shape[1] >= scratch)

    def selection(self, qb: int, groups: int, scratch: int) -> Selection:
        """The threshold selection's buffers for ``qb`` queries, ``groups`` group maxima and
        ``scratch`` candidates a query, grown on demand (:class:`Selection`)."""
        held = self._sel
        if not self.fits(qb, groups, scratch):
            if held is not None:
                rows, groups = max(qb, held.maxima.shape[0]), max(groups, held.maxima.shape[1])
                scratch = max(scratch, held.candidates.shape[1])
            else:
                rows = qb
            held = Selection(torch.empty((rows, groups), dtype=torch.float32, device=self.device),
                             torch.empty((rows, groups), dtype=torch.int32, device=self.device),
                             torch.empty((rows, scratch), dtype=torch.int64, device=self.device),
                             torch.empty(rows, dtype=torch.int32, device=self.device))
            self._sel = held
        return held
