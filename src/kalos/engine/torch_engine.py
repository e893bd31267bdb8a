"""The GPU engine: rows resident in device memory, a fused Triton scan + mask + top-k.

Importing this module imports PyTorch (and Triton when the Triton backend is used); kalos
core never imports it unless a GPU engine is asked for.

Layout on the device
--------------------
``x32 [capacity, dim] float32`` -- the master copy, always resident.
``x16 [capacity, dim] float16`` -- only with ``precision="fast"``: the copy batches scan.
``x8 [capacity, dim] int8``, ``scale8 [capacity] float32`` -- only with ``precision="fast"``
and the Triton backend (``tune={"single_scan": "int8"}``, the default): the copy a single
query scans, row ``i`` about ``scale8[i] * x8[i]`` (``scale8[i] = max|x_i| / 127``).
``live uint8``, ``namespace int32``, ``created_at float64``, ``ids int64`` -- per-row columns,
mirrored from :class:`~kalos.engine.base.RowTable` so that filtering happens inside the scan
and results leave the device as store ids.

Capacity doubles when full (one copy of the used rows, amortised O(1) per add); tombstones
clear the live byte; compaction moves rows forward in place, chunk by chunk (no second copy
of the matrix).

One search (Triton backend)
---------------------------
A 64-byte header (rows in use ``n``, query count, ``k``, filter, max row norm) and the
queries sit in a page-locked staging area at a fixed address. One host-to-device copy moves
them; then the scan kernel, the merge levels and the final kernel run; one device-to-host
copy brings status, ids and scores back. On CUDA all of it is captured once per
(mode, batch bucket, k bucket, filter kind) in a CUDA graph and replayed; because ``n``
travels in the header, adds and deletes need no re-capture. A resize moves the matrix, so
it drops the graphs (captured again on next use).

Exactness of ``precision="fast"``
---------------------------------
Let ``x``, ``q`` be the float32 row and query, ``x~``, ``q~`` their 16-bit roundings,
``u`` the unit roundoff of the 16-bit format (2^-11 for float16), ``eta`` its subnormal
absolute error (2^-25 for float16, ~0 for bfloat16), ``a = |x|``, ``b = |q|``. The products
``x~_i q~_i`` are exact in float32, so the 16-bit score ``s~`` (float32 accumulation, any
order, tensor cores allowed: we charge ``2^-22`` per addition instead of ``2^-24`` to cover
their truncating accumulation) and the float32 re-score ``s`` (same ``gamma_D(2^-24)``
bound as any float32 dot product) satisfy

    |s~ - s| <= E = (2u + u^2) ab + eta (1+u) sqrt(D) (a+b) + eta^2 D
                    + gamma_D(2^-22) [(1+u)^2 ab + eta (1+u) sqrt(D) (a+b) + eta^2 D]
                    + gamma_D(2^-24) ab,        gamma_D(v) = D v / (1 - D v),

inflated by 1% (:func:`fast_error_terms`). ``a`` is the largest row norm ever written
(float64), ``b`` is computed per query in the kernel. Let ``t_k`` be the k-th best 16-bit
score among eligible rows. Any row with ``s~ < t_k - 2E`` has ``s < t_k - E <= s_j`` for the
k rows ``j`` at or above ``t_k``, so it cannot be in the float32 top-k. The pipeline keeps
the exact top-``KF`` by 16-bit score (``KF`` = 4x the k bucket, at least 32); if the
``KF``-th kept score is below ``t_k - 2E`` (or fewer than ``KF`` rows are eligible), every
possible member of the float32 top-k is among the kept rows, which are re-scored in float32
and the top k of those returned: the same answer as a float32 scan (ties aside). Otherwise
the query's status is set and the host re-runs it with the exact float32 scan. For random
unit vectors at D = 1024, E is about 1.3e-3 and the fallback essentially never fires;
clusters of near-duplicates can make it fire, and it then costs one exact scan.

A single query (``single_chunk_rescore``, up to ``chunk_rescore_max_rows`` rows) certifies
chunk by chunk instead: each chunk of scores keeps its top ``R`` by 16-bit score (``R`` =
2x the k bucket, at least 32), re-scores them in float32 and passes on its best ``kp`` float32
keys; a row the chunk left out has ``s~ <= t_R`` (the chunk's R-th kept 16-bit score), so
``s <= t_R + E``. With ``B`` the largest ``t_R + E`` over the chunks that left rows out
(rounded up to a float32), if the k-th best float32 score among the kept rows beats ``B``, no
row left out can enter the top k: the same answer again. Rows a chunk re-scored but did not
pass on had ``kp >= k`` better ones in that chunk. The final kernel then selects among float32
keys only (scores_rescore_kernel, final_kernel's CHUNK_CERT).

A single query in fast mode (``single_scan="int8"``, the default with the Triton backend)
scans an 8-bit copy instead, with the same chunk certificate and a wider E. A row is stored as
``x8 = scale8 * c`` (``c`` int8, ``scale8 = max|x| / 127``) with residual ``e = x - x8``;
``r`` is the largest ``|e|`` of any row written (float64; it never shrinks). The kernel
splits the query into two int8 planes against ``s_q = max|q| / 127``:
``q8 = s_q (hi + lo/256)``, ``|q - q8| <= eps_q |q|`` with ``eps_q = sqrt(D) / (127 * 256)``
(+ float32 rounding of ``q / s_q``). The products are summed in int32, exactly; the float32
steps after them (two conversions, one add, two scalings) cost ``16 * 2^-24`` of
``|q8| |x8|``. As ``q.x - q8.x8 = q8.e + (q - q8).x``,

    |s8 - s32| <= E = [eps_q + gamma_D(2^-24) + 16 * 2^-24 (1 + eps_q)] ab
                      + (1 + eps_q + 16 * 2^-24 (1 + eps_q)) r b,

inflated by 1% (:func:`int8_error_terms`; the ``r`` term travels in header word 12, so
adds after a graph's capture are covered). For random unit vectors at D = 1024, ``r`` is
about 0.013 and E about 0.014: ten times the 16-bit bound, still far below the gap between
a chunk's 32nd score and the k-th best of 65,536 rows. The ``r b`` term is what a query along
a row's rounding error needs (``test_int8_error_bound_holds``).

The same certificate serves an opt-in tf32 scan of the float32 rows for exact batches
(``tune={"exact_batch_scan": "tf32"}``; u = 2^-10 covers tf32 truncation), which moves
exact batches from the FMA units to the tensor cores without a second copy of the rows.

Scan variants (``benchmarks/NOTES-gpu.md`` has the measurements): v1 keeps a running top-K
inside the streaming loop (default, measured); v2 (``tune={"scores_max_q": Q}``) writes
masked float32 scores (4 bytes per row) and selects with a parallel chunked top-k, which
takes every barrier out of the streaming loop (compiled for sm_90a and checked under the
interpreter; not yet timed on a GPU).
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kalos.engine.base import MISSING_ID, Engine, Filter
from kalos.errors import InvalidArgument, InvalidQuery

__all__ = ["TorchEngine", "HostBuffer", "register_host_buffer", "fast_error_terms", "int8_error_terms", "MAX_K"]

#: Largest k a search may ask for. The fast (16-bit) path serves k <= MAX_FAST_K; beyond it
#: a fast engine answers with the exact float32 scan.
MAX_K = 1024
MAX_FAST_K = 256
_NO_BOUND = -(2**63)  # a certificate bound no chunk has raised (triton_kernels.SENTINEL)
# The staging header (int64[16]: n, nq, k, has_ns, ns, since (f64), until (f64), max row norm
# (f64), k_out, the slot server's words, the 8-bit rows' error per unit of query norm (f64),
# spare) and the gather table after it (int64[4] per query: query offset, ids offset, scores
# offset, scale (f64)); triton_kernels.HDR_WORDS declares the same layout.
_HDR_WORDS = 16
_HDR_BYTES = 8 * _HDR_WORDS
_TAB_WORDS = 4
# Groups of score_chunk / 16 scores give the group maxima of the threshold selection: at 1,024
# scores per chunk, 1,024 maxima per 65,536-row slice (_gemm_scores).
_GROUPS_PER_CHUNK = 16
_COLLECT_STEP = 8  # groups collect_kernel reads per step (a random query picks ~K of them)
_THRESHOLD_MAX_K = 64  # larger candidate sets (k > 16) keep the per-chunk top-K
_KP_MAX = 1024  # result row stride of the engine's own result area: _kp(MAX_K)
_HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


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


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _kp(k: int) -> int:
    """Columns the final kernel writes for k: a power of two, at least 4."""
    return max(4, _next_pow2(k))


def _kf(k: int) -> int:
    """Candidates the fast path keeps for k (see the module docstring)."""
    kp = _kp(k)
    return min(max(32, 4 * kp), max(2 * kp, 256))


def fast_error_terms(dim: int, half: str = "float16") -> tuple[float, float, float]:
    """``(A, B, C)`` with ``|s16 - s32| <= A*|x|*|q| + B*(|x| + |q|) + C`` for one dot product
    whose operands were rounded to ``half`` ("float16", "bfloat16" or "tf32").

    See the module docstring for the derivation; 1% is added for the float64 evaluation.
    """
    if half == "float16":
        u, eta = 2.0**-11, 2.0**-25
    elif half == "bfloat16":
        u, eta = 2.0**-8, 2.0**-134
    elif half == "tf32":  # 10 stored mantissa bits; 2^-10 covers truncation as well as rounding
        u, eta = 2.0**-10, 2.0**-134
    else:
        raise InvalidArgument(f"unknown reduced format {half!r}: use float16, bfloat16 or tf32")

    def gamma(v: float) -> float:
        nv = dim * v
        if nv >= 0.5:
            raise InvalidArgument(f"dimension {dim} too large for the 16-bit error bound")
        return nv / (1.0 - nv)

    g_acc, g32 = gamma(2.0**-22), gamma(2.0**-24)
    root = math.sqrt(dim)
    a = (2 * u + u * u) + g_acc * (1 + u) ** 2 + g32
    b = eta * (1 + u) * root * (1 + g_acc)
    c = eta * eta * dim * (1 + g_acc)
    return a * 1.01, b * 1.01, c * 1.01 + 1e-12


def int8_error_terms(dim: int) -> tuple[float, float]:
    """``(A, R)`` with ``|s8 - s32| <= A*|x|*|q| + R*r*|q|`` for the 8-bit score of a row
    (``int8_scores_kernel``) against its float32 re-score, ``r`` the largest ``|x - x8 *
    scale8|`` of a row written (float64). See the module docstring; 1% is added."""
    g32 = dim * 2.0**-24 / (1.0 - dim * 2.0**-24)
    eps_q = math.sqrt(dim) / (127 * 256) * (1 + 2.0**-23) + 2.0**-22  # the query's two planes
    rounding = 16 * 2.0**-24 * (1 + eps_q)  # the kernel's float32 steps after the exact sums
    return (eps_q + g32 + rounding) * 1.01, (1 + eps_q + rounding) * 1.01


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """float32 rows as (int8 codes, float32 scales, the largest residual norm, float64):
    ``x ~ scale * codes``, ``scale = max|x| / 127`` per row (1 for a zero row)."""
    amax = x.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    resid = torch.linalg.vector_norm(x.double() - codes.double() * scale.double()[:, None], dim=1)
    return codes, scale, float(resid.max()) if len(resid) else 0.0


# -- tuning ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanConfig:
    """Tile shape of the scan kernel; ``progs`` = programs per query block (0: from occupancy);
    ``maxnreg``: registers per thread the compiler may use (0: its choice)."""

    block_n: int
    block_d: int
    block_q: int
    warps: int
    stages: int
    progs: int = 0
    maxnreg: int = 0


#: Defaults by (16-bit rows, batched): the fastest tiles of the v1 sweep on an H200
#: (benchmarks/NOTES-gpu.md). ("scores", 16-bit, batched): tiles of the v2 score-writing scan.
DEFAULT_TUNE: dict = {
    (False, False): ScanConfig(block_n=8, block_d=512, block_q=1, warps=4, stages=1),
    (True, False): ScanConfig(block_n=32, block_d=128, block_q=1, warps=4, stages=1),
    (False, True): ScanConfig(block_n=64, block_d=32, block_q=32, warps=4, stages=3),
    (True, True): ScanConfig(block_n=128, block_d=64, block_q=64, warps=8, stages=3),
    # (128 registers: 4 programs per SM with the filter's columns loaded ahead of the rows; at
    # the compiler's 140, 3 fit and the scan took 67.3 us instead of 64.1, H200, 65,536 rows.)
    ("scores", False, False): ScanConfig(block_n=32, block_d=128, block_q=1, warps=4, stages=1, maxnreg=128),
    ("scores", True, False): ScanConfig(block_n=32, block_d=128, block_q=1, warps=4, stages=1),
    ("scores", False, True): ScanConfig(block_n=64, block_d=64, block_q=16, warps=4, stages=3),
    ("scores", True, True): ScanConfig(block_n=64, block_d=64, block_q=16, warps=4, stages=3),
    # The 8-bit scan of a single query (int8_scores_kernel, tensor cores): the fastest tile of
    # benchmarks/int8_scan_probe.py on an H200, 18.9 us at 65,536 x 1024 (16-bit scan: 32.9).
    ("scores", "i8", False): ScanConfig(block_n=128, block_d=128, block_q=1, warps=4, stages=3),
    # What a single query scans in fast mode: "int8" (an 8-bit copy of the rows, held beside
    # the 16-bit one that batches scan) or "f16" (the 16-bit copy; no 8-bit one is held).
    "single_scan": "int8",
    # Batches of at least this many queries (16-bit and tf32 scans) are scored by cuBLAS, a
    # slice of gemm_rows rows at a time, then the same chunked top-k and certified re-score.
    "gemm_min_q": 16,
    "gemm_rows": 65536,
    # Whole slices select by threshold (group maxima, then every row above the K-th largest);
    # False: a bitonic top-K of every chunk. Measured (H200): see benchmarks/NOTES-gpu.md.
    "threshold_select": True,
    # v2 (scan writes scores, parallel top-K per chunk) for batches of at most this many
    # queries; 0 keeps the v1 fused scan everywhere. Measured (H200, NOTES-gpu.md, run 6):
    # Q=1 at 1M rows 977 vs 1074 us exact, 551 vs 650 fast; Q=8 fast 109 vs 148 us at 65,536.
    "scores_max_q": 8,
    "score_chunk": 1024,
    # Exact batches (Q > 1): "ieee" = float32 FMA scan; "tf32" = tensor-core scan + the
    # certified float32 re-score (same answer). Measured (H200, run 6): at 65,536 rows Q=64
    # 386 vs 1210 us, Q=256 1350 vs 4667 us; at 1M rows Q=256 20.4 vs 72.9 ms.
    "exact_batch_scan": "tf32",
    "merge_chunk": 1024,
    "final_max": 2048,
    # The final kernel's [candidates x BLOCK_D] tile (elements) and warps: the certified
    # re-score reads KF float32 rows per query in one program, latency-bound when narrow.
    # Measured (H200, fast Q=1 graph at 65,536 rows): 4096/4 warps 85.2 us, 8192/8 77.6 us;
    # a single query (the slot server's graph): 16384/16 95.8 us round trip against 102.3
    # for 8192/8 (benchmarks/NOTES-gpu.md, 2026-12-01).
    "final_tile": 8192,
    "final_warps": 8,
    "single_final_tile": 16384,
    "single_final_warps": 16,
    # A single query's selection (the slot server's graph), measured there (H200, 65,536 rows,
    # 2026-12-01): the chunk top-K with 8 warps 4.2 us against 5.7 with 4; the exact final
    # kernel (top-k of 1,024 keys, no re-score) with 8 warps 6.3 us against 7.2 with 4 and 6.6
    # with 16. Batches keep 4 warps for both (not measured there).
    "single_topk_warps": 8,
    "single_exact_final_warps": 8,
    # Fast mode, a single query: each chunk's candidates re-scored in float32 by the chunk's
    # own program (scores_rescore_kernel) instead of one program re-scoring the whole query's
    # in the final kernel. Measured at 65,536 rows only, hence the limit: at more rows the
    # chunks' re-scores read more rows than the one program did.
    "single_chunk_rescore": True,
    "chunk_rescore_max_rows": 262144,
    # Scores per chunk, candidates each chunk re-scores (at least 2x the k bucket) and the
    # [candidates x BLOCK_D] tile of their re-score. The chunk kernel took 13.2-13.4 us with 16
    # or 32 candidates and chunks of 512 or 1,024, 19.3 with 2,048; 12.3 with a tile of 8,192
    # against 13.2 with 16,384; 8 warps against 4 (22.6) and 16 (14.0) (H200, 65,536 rows,
    # 8-bit scan; BENCHMARKS.md, 2026-12-01 fourth session).
    "chunk_rescore_chunk": 1024,
    "chunk_rescore_k": 32,
    "chunk_rescore_tile": 8192,
    # PyTorch's CPU device (Triton's interpreter): few, large blocks, since every
    # tl.topk costs the interpreter a fraction of a second.
    "cpu_progs": 2,
    "cpu_block_n": 64,
}


@dataclass
class _Plan:
    k1: int  # keys kept per scan program
    kout: int
    cfg: ScanConfig
    n_qblocks: int
    progs: int
    levels: list  # (chunk, programs) per merge level
    count_final: int
    final_chunk: int
    final_block_d: int
    final_warps: int
    ws_keys: int  # int64 keys per query the workspace must hold
    topk_warps: int  # warps of a program of the score-writing scan's chunk top-K
    rescore_k: int = 0  # fast mode: candidates each chunk re-scores in float32 (0: the final kernel does)
    score_chunk: int = 0  # v2: the scan writes scores, top-K per chunk of this many (0: fused)
    gemm_rows: int = 0  # batches: cuBLAS scores this many rows at a time instead of the scan (0: scan)
    threshold: bool = False  # whole GEMM slices select by threshold (_gemm_scores), not per chunk


# -- host buffers ------------------------------------------------------------------------------


@dataclass
class _Attached:
    """The host buffer that :meth:`TorchEngine.search_attached` reads and writes in place."""

    host: HostBuffer
    f32: torch.Tensor  # the buffer as float32 / int64 words: kernel arguments
    i64: torch.Tensor
    f32_np: np.ndarray  # the same memory for the host-side paths (fallbacks)
    i64_np: np.ndarray


class HostBuffer:
    """A host buffer (mmap, bytearray, writable memoryview, NumPy array) as a uint8 tensor,
    page-locked with ``cudaHostRegister`` when CUDA is available.

    ``tensor`` shares the buffer's memory; :meth:`view` carves typed tensors out of it (for
    the sidecar's slot areas). Unregister before the buffer is closed or unmapped;
    :meth:`unregister` is idempotent and the handle is a context manager.
    """

    tensor: torch.Tensor | None = None
    pinned: bool = False
    _view: memoryview | None = None

    def __init__(self, buffer, *, pin: bool = True) -> None:
        view = memoryview(buffer)
        if view.readonly:
            raise InvalidArgument("host buffer must be writable")
        if not view.contiguous:
            raise InvalidArgument("host buffer must be contiguous")
        self._view = view.cast("B")
        self.nbytes = self._view.nbytes
        if self.nbytes == 0:
            raise InvalidArgument("host buffer is empty")
        self.tensor = torch.frombuffer(self._view, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        if pin and torch.cuda.is_available():
            # 1 = cudaHostRegisterPortable (pinned for every context), 2 = Mapped (device
            # pointer; implied under unified addressing, asked for explicitly anyway).
            err = torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, 3)
            if int(err) != 0:
                raise InvalidArgument(f"cudaHostRegister({self.nbytes} bytes) failed with CUDA error {int(err)}")
            self.pinned = True

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A typed tensor over bytes ``[offset, offset + size)`` of the buffer."""
        item = torch.empty((), dtype=dtype).element_size()
        size = item * math.prod(shape)
        if offset % item or offset < 0 or offset + size > self.nbytes:
            raise InvalidArgument(f"view of {size} bytes at offset {offset} does not fit or is misaligned")
        return self.tensor[offset : offset + size].view(dtype).view(shape)

    def unregister(self) -> None:
        """Unpins the buffer and drops this handle's references to it (idempotent). Tensors
        made by :meth:`view` still reference the memory: delete them before unmapping."""
        if self.pinned:
            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        self.tensor = None
        view, self._view = self._view, None
        if view is not None:
            try:
                view.release()
            except BufferError:  # a view() tensor is still alive; it holds the export
                pass

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()

    def __repr__(self) -> str:
        return f"HostBuffer({self.nbytes} bytes, pinned={self.pinned})"


def register_host_buffer(buffer, *, pin: bool = True) -> HostBuffer:
    """Page-locks ``buffer`` (an mmap of /dev/shm, say) for direct DMA; see :class:`HostBuffer`."""
    return HostBuffer(buffer, pin=pin)


# -- the engine -------------------------------------------------------------------------------


def _triton_kernels(require_interpreter: bool):
    """The kernel module, or None when Triton is missing (or cannot run on this device)."""
    try:
        from kalos.engine import triton_kernels as tk
    except ImportError:
        return None
    if tk.HDR_WORDS.value != _HDR_WORDS:
        raise AssertionError(f"header layouts disagree: kernels {tk.HDR_WORDS.value} words, engine {_HDR_WORDS}")
    if require_interpreter:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tk.scan_topk_kernel, InterpretedFunction):
            return None
    return tk


class TorchEngine(Engine):
    """Exact top-k over rows in device memory (CUDA, or PyTorch's CPU device for tests).

    All arguments are keyword-only except ``dim``.

    ``device``: "cuda", "cuda:N" or "cpu". ``precision``: "exact" scans float32; "fast" scans
    a 16-bit copy (``half``: "float16" or "bfloat16") and re-scores a certified candidate set
    in float32 (same answer, see the module docstring). ``backend``: "triton" (the fused
    kernels; on the CPU device only under ``TRITON_INTERPRET=1``), "torch" (``matmul`` +
    ``topk``), or "auto". ``max_batch``: most queries per kernel launch (larger batches are
    split; a GEMM batch holds ``max_batch x 65,536`` float32 scores while it runs: 256 MiB at
    the default 1,024). ``graphs``: capture CUDA graphs (CUDA only). ``tune``: overrides of
    :data:`DEFAULT_TUNE` (benchmarks).
    """

    name = "torch"
    #: Largest k a search may ask for (the sidecar refuses a larger --max-k at start).
    max_k = MAX_K

    def __init__(
        self,
        dim: int,
        *,
        capacity: int = 1024,
        device: str = "cuda",
        precision: str = "exact",
        half: str = "float16",
        backend: str = "auto",
        max_batch: int = 1024,
        graphs: bool = True,
        tune: dict | None = None,
    ) -> None:
        super().__init__(dim, capacity=capacity)
        if precision not in ("exact", "fast"):
            raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
        if half not in _HALF_DTYPES:
            raise InvalidArgument(f"half must be 'float16' or 'bfloat16', got {half!r}")
        if max_batch < 1:
            raise InvalidArgument(f"max_batch must be >= 1, got {max_batch}")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgument(f"unknown device {device!r}: {e}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidArgument(f"device {device!r}: PyTorch sees no CUDA device")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise InvalidArgument(f"device {device!r}: PyTorch sees {torch.cuda.device_count()} CUDA device(s)")
        elif dev.type != "cpu":
            raise InvalidArgument(f"device {device!r}: use cuda, cuda:N or cpu")
        self._dev = dev
        self.device = str(dev)
        self.precision = precision
        self.half = half
        self._half_dtype = _HALF_DTYPES[half]
        self.max_batch = int(max_batch)
        self._is_cuda = dev.type == "cuda"
        if backend not in ("auto", "triton", "torch"):
            raise InvalidArgument(f"backend must be auto, triton or torch, got {backend!r}")
        tk = None
        if backend in ("auto", "triton"):
            tk = _triton_kernels(require_interpreter=not self._is_cuda)
            if tk is None and backend == "triton":
                raise InvalidArgument(
                    "the Triton backend needs triton installed and, on the CPU device, "
                    "TRITON_INTERPRET=1 set before triton is first imported"
                )
        self._tk = tk
        self.backend = "triton" if tk is not None else "torch"
        self.name = f"torch-{self.backend}-{precision}"
        self._graphs_enabled = bool(graphs) and self._is_cuda
        self._tune = dict(DEFAULT_TUNE)
        if tune:
            self._tune.update(tune)
        if self._tune["single_scan"] not in ("int8", "f16"):
            raise InvalidArgument(f"tune single_scan must be 'int8' or 'f16', got {self._tune['single_scan']!r}")
        self._int8 = precision == "fast" and tk is not None and self._tune["single_scan"] == "int8"
        i8_a, self._i8_r = int8_error_terms(dim)
        self._err = {"f16": fast_error_terms(dim, half), "tf32": fast_error_terms(dim, "tf32"), "f32": (0.0, 0.0, 0.0),
                     "i8": (i8_a, 0.0, 1e-12)}
        self._max_norm = 0.0
        self._max_resid8 = 0.0  # the largest |x - x8 * scale8| of a row written (the 8-bit bound)
        self.stats = {"searches": 0, "fallbacks": 0, "graph_captures": 0}

        if self._is_cuda:
            # The highest priority PyTorch offers (out-of-range values are clamped to it).
            self._stream = torch.cuda.Stream(device=dev, priority=-100)
            props = torch.cuda.get_device_properties(dev)
            self._sms = props.multi_processor_count
            self._regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536) or 65536
            self._smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) or 228 * 1024
        else:
            self._stream = None
            self._sms = 1
        self._plans: dict = {}
        self._graphs: dict = {}
        self._uncapturable: set = set()  # graph keys whose capture failed: launched eagerly
        self._bound = threading.local()  # .stream: this thread runs on the engine's stream
        # The waiter of a search_start not yet awaited: every other use of the staging areas
        # (searches, adds, deletes, compaction) first finishes it (_settle).
        self._pending: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
        self._d_q16: torch.Tensor | None = None
        self._mm_fp32_out: bool | None = None
        self._occupancy: dict = {}
        self._ws = (None, None, None)
        self._sel_ws = None
        self._graph_pool = None
        self._alloc_columns(self.rows.capacity)
        self._alloc_staging()

    # -- storage ------------------------------------------------------------------------------

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._is_cuda else _NullContext()

    def _alloc_columns(self, capacity: int) -> None:
        dev, d = self._dev, self.dim
        self._x32 = torch.zeros((capacity, d), dtype=torch.float32, device=dev)
        self._x16 = (
            torch.zeros((capacity, d), dtype=self._half_dtype, device=dev) if self.precision == "fast" else None
        )
        self._x8 = torch.zeros((capacity, d), dtype=torch.int8, device=dev) if self._int8 else None
        self._scale8 = torch.ones(capacity, dtype=torch.float32, device=dev) if self._int8 else None
        self._live = torch.zeros(capacity, dtype=torch.uint8, device=dev)
        self._ns = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self._ts = torch.zeros(capacity, dtype=torch.float64, device=dev)
        self._ids = torch.full((capacity,), MISSING_ID, dtype=torch.int64, device=dev)

    def _alloc_staging(self) -> None:
        """Page-locked host areas the kernels read and write directly (no copy nodes), and
        their device counterparts.

        Host: header + gather table + queries (``_h_stage``); status + ids + scores
        (``_h_res``, rows of ``_KP_MAX`` columns). Device: header + table + queries, which
        :func:`stage_in_kernel` fills from the host side at the start of every search.
        """
        mb, d = self.max_batch, self.dim
        meta = _HDR_BYTES + 8 * _TAB_WORDS * mb
        pin = self._is_cuda
        self._h_stage = torch.zeros(meta + mb * d * 4, dtype=torch.uint8, pin_memory=pin)
        self._d_stage = torch.zeros(meta + mb * d * 4, dtype=torch.uint8, device=self._dev)
        self._h_meta = self._h_stage[:meta].view(torch.int64)  # kernel argument HH
        self._h_metaf = self._h_stage[:meta].view(torch.float64)
        self._h_hdr = self._h_meta.numpy()[:_HDR_WORDS]
        self._h_hdrf = self._h_hdr.view(np.float64)
        self._h_tab = self._h_meta.numpy()[_HDR_WORDS:].reshape(mb, _TAB_WORDS)
        self._h_tabf = self._h_tab.view(np.float64)
        self._h_q_t = self._h_stage[meta:].view(torch.float32)  # kernel argument SRC (own staging)
        self._h_q = self._h_q_t.numpy().reshape(mb, d)
        self._d_hdr = self._d_stage[:meta].view(torch.int64)
        self._d_hdrf = self._d_stage[:meta].view(torch.float64)
        self._d_q = self._d_stage[meta:].view(torch.float32).view(mb, d)
        # Fast mode's certificate bound per query (scores_rescore_kernel; the final kernel resets it).
        self._d_bound = torch.full((mb,), _NO_BOUND, dtype=torch.int64, device=self._dev)
        off_i = (mb * 4 + 7) // 8 * 8
        off_s = off_i + mb * _KP_MAX * 8
        self._h_res = torch.zeros(off_s + mb * _KP_MAX * 4, dtype=torch.uint8, pin_memory=pin)
        raw = self._h_res.numpy()
        self._r_status = raw[: mb * 4].view(np.int32)
        self._r_ids = raw[off_i:off_s].view(np.int64).reshape(mb, _KP_MAX)
        self._r_scores = raw[off_s:].view(np.float32).reshape(mb, _KP_MAX)
        self._res_status_t = self._h_res[: mb * 4].view(torch.int32)
        self._res_i64 = self._h_res.view(torch.int64)
        self._res_f32 = self._h_res.view(torch.float32)
        # The gather table of a search from the engine's own staging: query j at row j of
        # _h_q, results at row j of the result area, scale 1 (the caller normalised).
        rows = np.arange(mb, dtype=np.int64)
        self._own_tab = np.empty((mb, _TAB_WORDS), np.int64)
        self._own_tab[:, 0] = rows * d
        self._own_tab[:, 1] = off_i // 8 + rows * _KP_MAX
        self._own_tab[:, 2] = off_s // 4 + rows * _KP_MAX
        self._own_tab.view(np.float64)[:, 3] = 1.0
        self._attached: _Attached | None = None  # see attach_host

    def _settle(self) -> None:
        """Finishes a search that search_start queued (its waiter then returns the kept answer)."""
        if self._pending is not None:
            self._pending()

    def _resize(self, capacity: int) -> None:
        self._settle()
        n = self.rows.size
        old = self._columns()
        with self._on_stream():
            self._alloc_columns(capacity)
            for new, src in zip(self._columns(), old):
                if new is not None and n:
                    new[:n].copy_(src[:n])
        del old
        self._drop_graphs()
        self._plans.clear()  # the v2 plan's grid and workspace follow the capacity

    def _write(self, rows: slice, vectors: np.ndarray) -> None:
        self._settle()
        with self._on_stream():
            x = torch.from_numpy(vectors).to(self._dev)
            self._x32[rows].copy_(x)
            if self._x16 is not None:
                self._x16[rows].copy_(x.to(self._half_dtype))
            self._live[rows] = 1
            self._ns[rows].copy_(torch.from_numpy(self.rows.namespaces[rows]))
            self._ts[rows].copy_(torch.from_numpy(self.rows.created_at[rows]))
            self._ids[rows].copy_(torch.from_numpy(self.rows.ids[rows]))
            step = 16384  # (float64 temporaries a slice at a time, not of a whole bulk load)
            for s in range(0, len(x), step):
                norm = torch.linalg.vector_norm(x[s : s + step].double(), dim=1).max().item()
                self._max_norm = max(self._max_norm, float(norm))
                if self._x8 is not None:
                    codes, scale, resid = _quantize_rows(x[s : s + step])
                    at = slice(rows.start + s, rows.start + s + len(codes))
                    self._x8[at].copy_(codes)
                    self._scale8[at].copy_(scale)
                    self._max_resid8 = max(self._max_resid8, resid)

    def _tombstoned(self, rows: np.ndarray) -> None:
        self._settle()
        with self._on_stream():
            self._live[torch.from_numpy(rows).to(self._dev)] = 0

    def _compacted(self, keep: np.ndarray) -> None:
        self._settle()
        n = len(keep)
        keep_t = torch.from_numpy(keep).to(self._dev)
        # keep is increasing with keep[i] >= i: moving rows forward in ascending chunks never
        # overwrites a row a later chunk still has to read, so one chunk-sized buffer suffices.
        step = max(1, (64 << 20) // (self.dim * 4))
        with self._on_stream():
            for mat in (self._x32, self._x16, self._x8, self._scale8):
                if mat is None:
                    continue
                for s in range(0, n, step):
                    e = min(n, s + step)
                    mat[s:e] = mat.index_select(0, keep_t[s:e])
            cap = self.rows.capacity
            self._live.copy_(torch.from_numpy(self.rows.live[:cap].view(np.uint8)))
            self._ns.copy_(torch.from_numpy(self.rows.namespaces[:cap]))
            self._ts.copy_(torch.from_numpy(self.rows.created_at[:cap]))
            self._ids.copy_(torch.from_numpy(self.rows.ids[:cap]))

    def _columns(self) -> tuple:
        """Every per-row tensor on the device (None: not held by this engine)."""
        return (self._x32, self._x16, self._x8, self._scale8, self._live, self._ns, self._ts, self._ids)

    def _vector_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._columns() if t is not None)

    # -- searching ------------------------------------------------------------------------------

    def search(self, queries: np.ndarray, k: int, flt: Filter = Filter()) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by cosine: ``(ids[Q, k] int64, scores[Q, k] float32)``, best first, padded -1/-inf."""
        queries = self._host_queries(queries, k)
        nq = len(queries)
        ids = np.full((nq, k), MISSING_ID, np.int64)
        scores = np.full((nq, k), -np.inf, np.float32)
        if nq == 0 or self.rows.size == 0:
            return ids, scores
        self._search_rows(queries, k, self.rows.simplify(flt), ids, scores, want_ids=True)
        return ids, scores

    def search_start(self, queries: np.ndarray, k: int, flt: Filter = Filter()) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """Starts :meth:`search` and returns the function that waits for its answer.

        With the Triton backend on CUDA a batch of up to ``max_batch`` queries is queued on
        the engine's stream and the call returns at once, so that several engines (the shards
        of :class:`~kalos.engine.sharded.ShardedEngine`, one per GPU) scan at the same time.
        Otherwise the search runs here and the function returns its result. Anything else
        this engine is asked to do before the function is called finishes the search first
        (the function then returns the kept answer), so answers can never be mixed up.
        """
        queries = self._host_queries(queries, k)
        nq = len(queries)
        if self.backend != "triton" or nq == 0 or nq > self.max_batch or self.rows.size == 0:
            result = self.search(queries, k, flt)
            return lambda: result
        flt = self.rows.simplify(flt)
        kind = self._scan_kind(nq, k, self.precision)
        self.stats["searches"] += nq
        self._triton_start(queries, k, flt, True, kind, None)

        answer: list[tuple[np.ndarray, np.ndarray]] = []

        def finish() -> tuple[np.ndarray, np.ndarray]:
            if not answer:
                self._pending = None  # first: a failure below must not leave it pending
                ids = np.empty((nq, k), np.int64)
                scores = np.empty((nq, k), np.float32)
                self._triton_finish(queries, k, flt, ids, scores, True, kind, None)
                answer.append((ids, scores))
            return answer[0]

        self._pending = finish
        return finish

    def search_into(
        self,
        queries,
        k: int,
        flt: Filter = Filter(),
        *,
        out_ids: torch.Tensor,
        out_scores: torch.Tensor,
        precision: str | None = None,
    ) -> None:
        """Top-k of ``queries`` written into ``out_ids[:Q, :k]`` (int64) and ``out_scores``
        (float32), best first, padded with -1 / -inf.

        ``queries``: ``[Q, dim]`` float32 unit rows, a host tensor (pinned or not, e.g. a
        view of a registered shared-memory slot), a tensor on this engine's device, or a
        NumPy array. The outputs may be host tensors (pinned or not) or device tensors.
        Work runs on the engine's own high-priority stream; only that stream is synchronised.
        Nothing is written when an argument is rejected.
        """
        if isinstance(queries, np.ndarray):
            if queries.dtype != np.float32:
                raise InvalidQuery(f"queries must be float32, got {queries.dtype}")
            q_np = queries
        elif isinstance(queries, torch.Tensor):
            if queries.dtype != torch.float32:
                raise InvalidQuery(f"queries must be float32, got {queries.dtype}")
            q_np = queries.detach().numpy() if queries.device.type == "cpu" else None
        else:
            raise InvalidQuery(f"queries must be a torch.Tensor or numpy array, got {type(queries).__name__}")
        shape = tuple(queries.shape)
        if len(shape) != 2 or shape[1] != self.dim:
            raise InvalidQuery(f"expected queries of shape (Q, {self.dim}), got {shape}")
        self._check_k(k)
        nq = shape[0]
        for name, t, dt in (("out_ids", out_ids, torch.int64), ("out_scores", out_scores, torch.float32)):
            if not isinstance(t, torch.Tensor) or t.dtype != dt or t.dim() != 2:
                raise InvalidArgument(f"{name} must be a 2-d {dt} tensor")
            if t.shape[0] < nq or t.shape[1] < k:
                raise InvalidArgument(f"{name} of shape {tuple(t.shape)} cannot hold ({nq}, {k}) results")
        if q_np is None and queries.device != self._dev:
            raise InvalidQuery(f"queries on {queries.device}, engine on {self._dev}")
        if precision not in (None, "exact", "fast"):
            raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
        if precision == "fast" and self._x16 is None:
            raise InvalidArgument("precision='fast' needs an engine built with precision='fast'")
        if nq == 0:
            return
        self._settle()
        host_out = out_ids.device.type == "cpu" and out_scores.device.type == "cpu"
        if host_out:
            ids_np, sc_np = out_ids.numpy(), out_scores.numpy()
        else:
            ids_np = np.empty((nq, k), np.int64)
            sc_np = np.empty((nq, k), np.float32)
        if self.rows.size == 0:
            ids_np[:nq, :k] = MISSING_ID
            sc_np[:nq, :k] = -np.inf
        else:
            src = q_np if q_np is not None else queries.detach()
            self._search_rows(src, k, self.rows.simplify(flt), ids_np, sc_np, want_ids=True, precision=precision)
        if not host_out:
            with self._on_stream():
                out_ids[:nq, :k].copy_(torch.from_numpy(ids_np[:nq, :k]))
                out_scores[:nq, :k].copy_(torch.from_numpy(sc_np[:nq, :k]))
            if self._is_cuda:
                self._stream.synchronize()

    # -- searching in place, in an attached host buffer (the sidecar's shared segment) -------

    def bind_stream(self) -> None:
        """Makes the engine's stream the calling thread's current CUDA stream, for good.

        Searches from a bound thread replay their graphs without entering a
        ``torch.cuda.stream`` context, which costs ~10 us of Python on a server CPU
        (benchmarks/NOTES-gpu.md). For a thread that does nothing else on the GPU: the
        sidecar's sweep. A no-op on the CPU device.
        """
        if self._is_cuda:
            torch.cuda.set_stream(self._stream)
            self._bound.stream = True  # thread-local: dies with the thread

    def unbind_stream(self) -> None:
        """Undoes :meth:`bind_stream` for the calling thread (its current stream: the default)."""
        if getattr(self._bound, "stream", False):
            self._bound.stream = False
            torch.cuda.set_stream(torch.cuda.default_stream(self._dev))

    def attach_host(self, buffer) -> HostBuffer:
        """Page-locks ``buffer`` (an mmap, say) so that :meth:`search_attached` reads queries
        from it and writes results into it with no intermediate host copy.

        Replaces an earlier attachment. Call :meth:`detach_host` before the buffer is closed.
        """
        self.detach_host()
        hb = register_host_buffer(buffer, pin=self._is_cuda)
        words = hb.nbytes // 8
        f32 = hb.tensor[: 8 * words].view(torch.float32)
        i64 = hb.tensor[: 8 * words].view(torch.int64)
        self._attached = _Attached(hb, f32, i64, f32.numpy(), i64.numpy())
        return hb

    def detach_host(self) -> None:
        """Forgets the attached buffer (its graphs too) and unpins it; idempotent."""
        if self._attached is None:
            return
        if self._is_cuda:
            # The whole device, not only the engine's stream: a kernel on another stream (the
            # slot server's) may read the buffer too.
            torch.cuda.synchronize(self._dev)
        self._graphs = {key: g for key, g in self._graphs.items() if not key[-1]}
        host = self._attached.host
        self._attached = None
        host.unregister()

    def search_attached(
        self,
        query_at: np.ndarray,
        scales: np.ndarray | None,
        ids_at: np.ndarray,
        scores_at: np.ndarray,
        k: int,
        flt: Filter = Filter(),
    ) -> np.ndarray:
        """Top-k of queries that live in the attached buffer, written back into it.

        Query ``j`` is the ``dim`` float32 values at float32 element ``query_at[j]`` of the
        buffer, multiplied by ``scales[j]`` in float64 and rounded (exactly what
        ``normalise_rows`` does on the host). Its ``k`` ids go to int64 element ``ids_at[j]``
        and its scores to float32 element ``scores_at[j]``, best first, padded -1 / -inf.
        With the Triton backend on CUDA the query travels from the buffer to the GPU and the
        results back into the buffer with no host copy; otherwise the same answer is computed
        through :meth:`search`. Nothing is written when an argument is rejected.

        ``scales=None`` computes ``1 / |query|`` in float64 on the device instead (a batch
        spares the host a float64 pass over every query). Returns the scales applied; the
        caller checks them when it passed None: a query whose scale is zero, infinite or NaN
        (all zeros, or NaN / inf values) has no direction, and its answer is unspecified.
        """
        if self._attached is None:
            raise InvalidArgument("search_attached needs a buffer: call attach_host first")
        self._check_k(k)
        f32, i64 = self._attached.f32_np, self._attached.i64_np
        query_at, ids_at, scores_at = (np.asarray(a, dtype=np.int64) for a in (query_at, ids_at, scores_at))
        nq = len(query_at)
        device_norms = scales is None
        scales = np.full(nq, np.nan) if device_norms else np.asarray(scales, dtype=np.float64)
        if not (len(scales) == len(ids_at) == len(scores_at) == nq):
            raise InvalidArgument("query_at, scales, ids_at and scores_at must have one entry per query")
        if nq == 0:
            return scales
        for name, at, width, size in (("query_at", query_at, self.dim, len(f32)), ("ids_at", ids_at, k, len(i64)),
                                      ("scores_at", scores_at, k, len(f32))):
            # (Python ints for the common single query: NumPy reductions cost ~1 us each.)
            lo, hi = (int(at[0]),) * 2 if nq == 1 else (int(at.min()), int(at.max()))
            if lo < 0 or hi + width > size:
                raise InvalidArgument(f"{name} points outside the attached buffer")
        if not device_norms and not (math.isfinite(float(scales[0])) if nq == 1 else np.isfinite(scales).all()):
            raise InvalidQuery("query scales must be finite")
        self._settle()
        n = self.rows.size
        if self.backend != "triton" or n == 0:
            if device_norms:  # no kernel here: the same float64 scales on the host
                rows = f32[query_at[:, None] + np.arange(self.dim)]
                with np.errstate(divide="ignore", invalid="ignore"):
                    scales = 1.0 / np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))
            good = np.flatnonzero(np.isfinite(scales) & (scales > 0)) if device_norms else np.arange(nq)
            ids, scores = self.search(self._gather(query_at[good], scales[good]), k, flt)
            self._scatter(ids, scores, ids_at[good], scores_at[good], k)
            return scales
        flt = self.rows.simplify(flt)
        for s in range(0, nq, self.max_batch):
            e = min(nq, s + self.max_batch)
            scales[s:e] = self._attached_batch(query_at[s:e], scales[s:e], ids_at[s:e], scores_at[s:e], k, flt,
                                               device_norms)
        return scales

    def _attached_batch(self, query_at, scales, ids_at, scores_at, k: int, flt: Filter, device_norms: bool) -> np.ndarray:
        nq = len(query_at)
        n = self.rows.size
        kind = self._scan_kind(nq, k, self.precision)
        self._fill_header(n, nq, k, flt)
        tab = self._h_tab
        tab[:nq, 0] = query_at
        tab[:nq, 1] = ids_at
        tab[:nq, 2] = scores_at
        self._h_tabf[:nq, 3] = scales
        self.stats["searches"] += nq
        self._run(self._key(kind, nq, k, flt, True, True, True, device_norms), None)
        if device_norms:
            scales = self._h_tabf[:nq, 3].copy()  # stage_in_kernel wrote them
        if kind != "f32" and n > _kf(k):
            failed = self._r_status[:nq] != 0
            if device_norms:  # a query with no direction has no answer to certify
                failed &= np.isfinite(scales) & (scales > 0)
            bad = np.flatnonzero(failed)
            if len(bad):  # the certificate failed: redo those queries with the float32 scan
                self.stats["fallbacks"] += len(bad)
                queries = self._gather(query_at[bad], scales[bad])
                ids = np.empty((len(bad), k), np.int64)
                scores = np.empty((len(bad), k), np.float32)
                self._triton_batch(queries, k, flt, ids, scores, True, "f32", None)
                self._scatter(ids, scores, ids_at[bad], scores_at[bad], k)
        return scales

    def _gather(self, query_at: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Queries of the attached buffer, normalised on the host (the paths without kernels)."""
        rows = self._attached.f32_np[query_at[:, None] + np.arange(self.dim)]
        return (rows * scales[:, None]).astype(np.float32)

    def _scatter(self, ids: np.ndarray, scores: np.ndarray, ids_at: np.ndarray, scores_at: np.ndarray, k: int) -> None:
        cols = np.arange(k)
        self._attached.i64_np[ids_at[:, None] + cols] = ids[:, :k]
        self._attached.f32_np[scores_at[:, None] + cols] = scores[:, :k]

    def _search(self, queries: np.ndarray, k: int, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The base-class hook (row numbers, host mask): an eager scan with the mask as the live column."""
        self._settle()
        n = self.rows.size
        nq = len(queries)
        rows = np.zeros((nq, k), np.int64)
        scores = np.full((nq, k), -np.inf, np.float32)
        live = None
        if mask is not None:
            live = torch.zeros(self.rows.capacity, dtype=torch.uint8, device=self._dev)
            live[:n].copy_(torch.from_numpy(mask.view(np.uint8)))
        self._search_rows(queries, k, Filter(), rows, scores, want_ids=False, live=live)
        return rows, scores

    def _host_queries(self, queries, k: int) -> np.ndarray:
        """``queries`` as a float32 ``[Q, dim]`` host array after checking them and ``k``; a
        search that search_start left pending is finished first."""
        if isinstance(queries, torch.Tensor):
            queries = queries.detach().to("cpu", torch.float32).numpy()
        queries = np.asarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise InvalidQuery(f"expected queries of shape (Q, {self.dim}), got {queries.shape}")
        self._check_k(k)
        self._settle()
        return queries

    def _check_k(self, k: int) -> None:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise InvalidQuery(f"k must be an integer, got {type(k).__name__}")
        if k < 1 or k > MAX_K:
            raise InvalidQuery(f"k must be in [1, {MAX_K}], got {k}")

    def _search_rows(self, queries, k, flt, out_i, out_s, *, want_ids, precision=None, live=None) -> None:
        """Fills ``out_i[:Q, :k]``, ``out_s[:Q, :k]`` (ids or rows), splitting into batches."""
        precision = precision or self.precision
        if precision not in ("exact", "fast"):
            raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
        fast = precision == "fast" and k <= MAX_FAST_K
        if fast and self._x16 is None:
            raise InvalidArgument("precision='fast' needs an engine built with precision='fast'")
        nq = len(queries)
        self.stats["searches"] += nq
        for s in range(0, nq, self.max_batch):
            e = min(nq, s + self.max_batch)
            if self.backend == "triton":
                kind = self._scan_kind(e - s, k, precision)
                self._triton_batch(queries[s:e], k, flt, out_i[s:e], out_s[s:e], want_ids, kind, live)
            else:
                self._torch_batch(queries[s:e], k, flt, out_i[s:e], out_s[s:e], want_ids, fast, live)

    # -- the Triton pipeline ---------------------------------------------------------------------
    #
    # A scan "kind": "f32" reads the float32 rows and is exact as it stands; "f16" reads the
    # 16-bit copy and "tf32" the float32 rows through tensor cores in tf32 (batches, opt-in):
    # both keep the top-KF candidates and end in the certified float32 re-score.

    def _fill_header(self, n: int, nq: int, k: int, flt: Filter, hdr: np.ndarray | None = None) -> None:
        """The staging header's words (``hdr``: another int64 header than the engine's own)."""
        if hdr is None:  # (the search path: the views made once, not a NumPy call per search)
            hdr, hdrf = self._h_hdr, self._h_hdrf
        else:
            hdrf = hdr.view(np.float64)
        hdr[0] = n
        hdr[1] = nq
        hdr[2] = min(k, n)
        if flt.namespace is None:
            hdr[3] = 0
            hdr[4] = 0
        else:
            hdr[3] = 1
            hdr[4] = int(flt.namespace)
        hdrf[5] = -np.inf if flt.since is None else float(flt.since)
        hdrf[6] = np.inf if flt.until is None else float(flt.until)
        hdrf[7] = self._max_norm
        hdrf[12] = self._max_resid8 * self._i8_r
        hdr[8] = k  # columns written: past min(k, n) they are padding (-1 / -inf)

    def _triton_batch(self, queries, k, flt, out_i, out_s, want_ids, kind, live) -> None:
        self._triton_start(queries, k, flt, want_ids, kind, live)
        self._triton_finish(queries, k, flt, out_i, out_s, want_ids, kind, live)

    def _triton_start(self, queries, k, flt, want_ids, kind, live) -> None:
        """Stages the batch and queues its work on the engine's stream (no wait)."""
        nq = len(queries)
        self._fill_header(self.rows.size, nq, k, flt)
        self._h_tab[:nq] = self._own_tab[:nq]
        host_q = isinstance(queries, np.ndarray)
        if host_q:
            self._h_q[:nq] = queries
        else:
            with self._on_stream():
                self._d_q[:nq].copy_(queries, non_blocking=True)
        self._run(self._key(kind, nq, k, flt, want_ids, host_q, False), live, wait=False)

    def _triton_finish(self, queries, k, flt, out_i, out_s, want_ids, kind, live) -> None:
        """Waits for the batch :meth:`_triton_start` queued; copies its results out."""
        if self._is_cuda:
            self._stream.synchronize()
        nq = len(queries)
        n = self.rows.size
        bad = np.flatnonzero(self._r_status[:nq]) if kind != "f32" and n > _kf(k) else ()
        out_i[:nq, :k] = self._r_ids[:nq, :k]
        out_s[:nq, :k] = self._r_scores[:nq, :k]
        if len(bad):
            self.stats["fallbacks"] += len(bad)
            redo = queries[bad] if isinstance(queries, np.ndarray) else queries[torch.from_numpy(bad).to(queries.device)]
            self._triton_batch(redo, k, flt, _RowSink(out_i, bad), _RowSink(out_s, bad), want_ids, "f32", live)

    def _key(self, kind: str, nq: int, k: int, flt: Filter, want_ids: bool, host_q: bool, attached: bool,
             device_norms: bool = False) -> tuple:
        """The graph key of a batch: what its launches depend on (attached last: detach_host)."""
        qb, kp = _next_pow2(nq), _kp(k)
        plan = self._plan(kind, qb, kp)
        slices = -(-self.rows.size // plan.gemm_rows) if plan.gemm_rows else 0
        return (kind, qb, kp, not flt.is_trivial, want_ids, host_q, slices, device_norms, attached)

    def _run(self, key, live, *, wait: bool = True) -> None:
        """Replays the graph of ``key`` (capturing it on first use), or launches eagerly; waits
        for it unless ``wait`` is False."""
        use_graph = self._graphs_enabled and live is None and key not in self._uncapturable
        entry = self._graphs.get(key) if use_graph else None
        if entry is not None:
            if getattr(self._bound, "stream", False):
                entry.replay()  # the engine's stream is already this thread's current stream
            else:
                with self._on_stream():  # ~10 us of Python on a server CPU: see bind_stream
                    entry.replay()
        else:
            self._launch(key, live)
            if use_graph:
                try:
                    self._capture(key)
                except Exception as e:  # noqa: BLE001 - eager launches still work; say why once
                    # Only this kind of pass runs eagerly from now on: one pass that cannot be
                    # captured must not cost every other kind its graph.
                    self._uncapturable.add(key)
                    self.stats["graph_error"] = f"{key}: {e!r}"[:400]
                    if not self._graphs:
                        self._graph_pool = None  # a pool with no live graph may not be captured into
        if wait and self._is_cuda:
            self._stream.synchronize()

    def _plan(self, kind: str, qb: int, kp: int) -> _Plan:
        key = (kind, qb, kp)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        tune = self._tune
        batched = qb > 1
        half = kind == "f16"
        base: ScanConfig = tune[(half, batched)]
        k1 = kp if kind == "f32" else _kf(kp)
        scores = qb <= int(tune["scores_max_q"])
        gemm = batched and kind != "f32" and qb >= int(tune["gemm_min_q"]) and self._gemm_ok(kind)
        scores = scores or gemm
        rescore_k = 0
        if kind == "i8" or (kind == "f16" and qb == 1 and scores and not gemm and self._chunk_rescore()):
            # Each chunk keeps its kp best float32 keys, re-scored from its top rescore_k.
            rescore_k, k1, scores = max(int(tune["chunk_rescore_k"]), 2 * kp), kp, True
        if scores:
            base = tune[("scores", "i8" if kind == "i8" else half, batched)]
        block_n = base.block_n if scores else max(base.block_n, k1)
        if not self._is_cuda:
            block_n = max(block_n, int(tune["cpu_block_n"]))
        tile = base.block_n * base.block_d
        # (int8 tensor-core products take K in steps of 32, 16-bit ones in steps of 16)
        block_d = max(32 if kind == "i8" else 16, min(base.block_d, tile // block_n, _next_pow2(self.dim)))
        block_q = min(base.block_q, max(16, qb)) if batched else 1
        cfg = ScanConfig(block_n, block_d, block_q, base.warps, base.stages, base.progs, base.maxnreg)
        n_qblocks = -(-qb // block_q)
        if scores and cfg.progs == 0:  # one row block per program, capacity-wide grid
            progs = -(-self.rows.capacity // block_n)
        elif cfg.progs > 0:
            progs = cfg.progs
        elif cfg.progs < 0:  # -m: m programs per SM, whatever the occupancy
            progs = max(1, (self._sms * -cfg.progs) // n_qblocks)
        elif self._is_cuda:
            progs = max(1, (self._sms * self._programs_per_sm(kind, cfg, k1)) // n_qblocks)
        else:
            progs = tune["cpu_progs"]
        chunk_scores = int(tune["chunk_rescore_chunk"] if rescore_k else tune["score_chunk"])
        score_chunk = max(_next_pow2(chunk_scores), 2 * k1, 2 * rescore_k)
        gemm_rows = max(score_chunk, int(tune["gemm_rows"]) // score_chunk * score_chunk) if gemm else 0
        threshold = gemm and bool(tune["threshold_select"]) and self._threshold_fits(gemm_rows, score_chunk, k1)
        if threshold:  # K keys per whole slice, then K per chunk of a narrower last one
            whole, rest = divmod(self.rows.capacity, gemm_rows)
            count = whole * k1 + -(-rest // score_chunk) * k1
        elif scores:
            count = -(-self.rows.capacity // score_chunk) * k1
        else:
            count = progs * k1
        ws = count
        levels = []
        chunk = max(int(tune["merge_chunk"]), 2 * k1)
        while count > max(int(tune["final_max"]), k1):
            p2 = -(-count // chunk)
            levels.append((chunk, p2))
            count = p2 * k1
        final_chunk = _next_pow2(max(count, k1))
        single = "single_" if qb == 1 else ""
        # (With rescore_k the final kernel re-scores nothing: the tile is the chunks' re-score's.)
        tile_key = "chunk_rescore_tile" if rescore_k else single + "final_tile"
        final_block_d = max(16, min(_next_pow2(self.dim), int(tune[tile_key]) // (rescore_k or k1)))
        if kind != "f32" and not rescore_k:
            final_warps = int(tune[single + "final_warps"])
        else:  # the final kernel selects among float32 keys and re-scores nothing
            final_warps = int(tune["single_exact_final_warps"]) if single else 4
        topk_warps = int(tune["single_topk_warps"]) if single else 4
        plan = _Plan(k1, kp, cfg, n_qblocks, progs, levels, count, final_chunk, final_block_d, final_warps, ws,
                     topk_warps, rescore_k, score_chunk if scores else 0, gemm_rows, threshold)
        self._plans[key] = plan
        return plan

    @staticmethod
    def _threshold_fits(slice_rows: int, chunk: int, k1: int) -> bool:
        """Whether whole slices may select by threshold: chunks per slice a power of two (the
        kernels' tile shapes), tau the k1-th of at least 2 * k1 group maxima, and k1 small
        enough that collect_kernel's scratch (k1 groups' rows per query) stays small."""
        chunks = slice_rows // chunk
        return (chunks & (chunks - 1) == 0 and chunk % _GROUPS_PER_CHUNK == 0
                and 2 * k1 <= chunks * _GROUPS_PER_CHUNK and k1 <= _THRESHOLD_MAX_K)

    def _programs_per_sm(self, kind: str, cfg: ScanConfig, k1: int) -> int:
        """Resident programs per SM for the scan kernel, from its compiled registers/shared memory."""
        key = (kind, cfg, k1)
        occ = self._occupancy.get(key)
        if occ is None:
            tk = self._tk
            x = self._x16 if kind == "f16" else self._x32
            ker = tk.scan_topk_kernel.warmup(
                x, self._d_q, self._d_hdr, self._d_hdrf, self._live, self._ns, self._ts, self._d_hdr, 16,
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

    def _workspace(self, qb: int, keys: int, scores: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two int64 key buffers (ping-pong between merge levels) and a float32 score buffer."""
        need, need_s = qb * keys, qb * scores
        a, b, sc = self._ws
        if a is None or a.numel() < need or (need_s and (sc is None or sc.numel() < need_s)):
            self._drop_graphs()
            if a is None or a.numel() < need:
                size = max(need, 2 * (a.numel() if a is not None else 0))
                a = torch.empty(size, dtype=torch.int64, device=self._dev)
                b = torch.empty(size, dtype=torch.int64, device=self._dev)
            if need_s and (sc is None or sc.numel() < need_s):
                sc = torch.empty(need_s, dtype=torch.float32, device=self._dev)
            self._ws = (a, b, sc)
        return a, b, sc

    def _launch(self, key, live) -> None:
        """Runs one batch: stage-in (header, table, queries from host memory), scan, merges,
        final (results straight into host memory: the engine's result area or the attached
        buffer)."""
        kind, qb, kp, filtered, want_ids, host_q, slices, device_norms, attached = key
        plan = self._plan(kind, qb, kp)
        cap = self.rows.capacity
        with self._on_stream():  # the workspace belongs to the stream that uses it
            # (The GEMM path's scores come from cuBLAS's own output buffers, one slice at a time.)
            ws_a, ws_b, ws_s = self._workspace(qb, plan.ws_keys, cap if plan.score_chunk and not plan.gemm_rows else 0)
        live_t = self._live if live is None else live
        if attached:
            src, res_i, res_s = self._attached.f32, self._attached.i64, self._attached.f32
        else:
            src, res_i, res_s = self._h_q_t, self._res_i64, self._res_f32
        with self._on_stream():
            self._tk.stage_in_kernel[(qb,)](
                self._h_meta, self._h_metaf, src, self._d_hdr, self._d_q,
                D=self.dim, BLOCK_D=min(1024, _next_pow2(self.dim)), COPY_Q=host_q, NORM=device_norms, num_warps=4,
            )
            over = None
            if plan.gemm_rows:
                stride = plan.ws_keys
                over = self._gemm_scores(kind, qb, plan, slices, ws_a, stride, live_t, filtered)
            else:
                stride = self._scan_keys(kind, plan, qb, self._d_hdr, self._d_hdrf, self._d_q, live_t, filtered,
                                         ws_a, ws_s, self._d_bound)
            self._select_final(kind, plan, qb, ws_a, ws_b, stride, self._d_hdr, self._d_hdrf, self._d_q, res_i,
                               res_s, self._res_status_t, want_ids, over=over, bound=self._d_bound)

    def _scan_keys(self, kind, plan, qb, hdr, hdrf, dq, live_t, filtered, ws_a, ws_s, bound) -> int:
        """The scan of a plan without GEMM: each query's candidate keys into ``ws_a``
        (``ws_s``: the score-writing scan's scores; ``bound``: the chunks' certificate bound
        per query, with ``plan.rescore_k``); returns the keys per query."""
        tk, cfg, cap = self._tk, plan.cfg, self.rows.capacity
        x = self._x16 if kind == "f16" else self._x32
        common = dict(
            D=self.dim, K=plan.k1, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, BLOCK_Q=cfg.block_q,
            HALF=kind == "f16", FILTER=filtered, PREC="tf32" if kind == "tf32" else "ieee",
            num_warps=cfg.warps, num_stages=cfg.stages,
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and self._is_cuda else {}),
        )
        if plan.score_chunk:
            if kind == "i8":
                tk.int8_scores_kernel[(plan.progs,)](
                    self._x8, self._scale8, dq, hdr, hdrf, live_t, self._ns, self._ts, ws_s, D=self.dim,
                    D_POW2=_next_pow2(self.dim), BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, FILTER=filtered,
                    num_warps=cfg.warps, num_stages=cfg.stages,
                )
            else:
                tk.scan_topk_kernel[(plan.progs, plan.n_qblocks)](
                    x, dq, hdr, hdrf, live_t, self._ns, self._ts, ws_s, cap, WRITE_SCORES=True, **common,
                )
            chunks = -(-cap // plan.score_chunk)
            stride = chunks * plan.k1
            if plan.rescore_k:
                ea, eb, ec = self._err[kind]
                tk.scores_rescore_kernel[(chunks, qb)](
                    ws_s, ws_a, bound, hdr, hdrf, self._x32, dq, cap, stride, ea, eb, ec, D=self.dim,
                    K=plan.rescore_k, KOUT=plan.k1, CHUNK=plan.score_chunk, BLOCK_D=plan.final_block_d,
                    ROW_ERR=kind == "i8", num_warps=plan.topk_warps,
                )
                return stride
            tk.scores_topk_kernel[(chunks, qb)](ws_s, ws_a, hdr, cap, stride, K=plan.k1, CHUNK=plan.score_chunk,
                                                num_warps=plan.topk_warps)
            return stride
        stride = plan.progs * plan.k1
        tk.scan_topk_kernel[(plan.progs, plan.n_qblocks)](
            x, dq, hdr, hdrf, live_t, self._ns, self._ts, ws_a, stride, **common
        )
        return stride

    def _select_final(self, kind, plan, qb, ws_a, ws_b, stride, hdr, hdrf, dq, res_i, res_s, status, want_ids, *,
                      over=None, bound=None, publish: dict | None = None) -> None:
        """The merge levels over the keys in ``ws_a`` (``ws_b``: the other buffer of the ping-pong),
        then the final kernel: answers into host memory at the table's offsets (``publish``:
        the slot server's extra arguments, see final_kernel)."""
        tk = self._tk
        cur, nxt, count = ws_a, ws_b, stride
        for chunk, p2 in plan.levels:
            out_stride = p2 * plan.k1
            tk.merge_topk_kernel[(p2, qb)](cur, nxt, hdr, stride, out_stride, count, K=plan.k1, CHUNK=chunk,
                                           num_warps=4)
            cur, nxt, stride, count = nxt, cur, out_stride, out_stride
        ea, eb, ec = self._err[kind]
        tk.final_kernel[(qb,)](
            cur, hdr, hdrf, self._x32, dq, self._ids, res_i, res_s, status,
            stride, count, ea, eb, ec, D=self.dim, KIN=plan.k1, KOUT=plan.kout, CHUNK=plan.final_chunk,
            BLOCK_D=plan.final_block_d, RESCORE=kind != "f32" and not plan.rescore_k, OUT_IDS=want_ids,
            num_warps=plan.final_warps, OVER=over, CHECK_OVER=over is not None,
            BOUND=bound, CHUNK_CERT=plan.rescore_k > 0, **(publish or {}),
        )

    def _gemm_scores(self, kind, qb, plan, slices, ws_a, stride, live_t, filtered) -> torch.Tensor:
        """Batched scores by cuBLAS (tensor cores: fp16 rows, or fp32 rows read as tf32), a
        slice of rows at a time, each slice reduced to a superset of its top-K keys at once.

        A whole slice goes through the threshold selection (``group_max_kernel``, then
        ``collect_kernel``), which leaves the slice's top-K keys; a narrower last slice (or a
        plan without ``threshold``) the top-K of every chunk (``scores_topk_kernel``). Only
        the ``slices`` that hold rows are scored (the graph key carries the count); the keys
        after theirs are set to SENTINEL so the merge sees no stale keys. Returns the
        per-query overflow words the final kernel checks.
        """
        tk, g, chunk = self._tk, plan.gemm_rows, plan.score_chunk
        cap = self.rows.capacity
        q = self._d_q[:qb]
        if kind == "f16":
            if self._d_q16 is None:
                self._d_q16 = torch.empty((self.max_batch, self.dim), dtype=self._half_dtype, device=self._dev)
            q16 = self._d_q16[:qb]
            q16.copy_(q)
        group = chunk // _GROUPS_PER_CHUNK
        gm, picked, cand, over = self._selection_workspace(qb, g // group, plan.k1 * group)
        over.zero_()
        out_base = 0  # keys written so far per query
        for c0 in range(0, slices * g, g):
            c1 = min(cap, c0 + g)
            if kind == "f16":
                if self._is_cuda:  # fp16 products, fp32 accumulation and output
                    sc = torch.mm(q16, self._x16[c0:c1].T, out_dtype=torch.float32)
                else:  # the CPU emulates it: fp16 values are exact in fp32
                    sc = torch.mm(q16.float(), self._x16[c0:c1].float().T)
            else:
                with _tf32_matmul():
                    sc = torch.mm(q, self._x32[c0:c1].T)
            chunks = -(-(c1 - c0) // chunk)
            masks = (c0, c1 - c0, live_t, self._ns, self._ts, self._d_hdrf)
            if c1 - c0 == g and plan.threshold:
                tk.group_max_kernel[(chunks, qb)](
                    sc, gm, self._d_hdr, c1 - c0, gm.stride(0), *masks,
                    CHUNK=chunk, GROUPS=_GROUPS_PER_CHUNK, FILTER=filtered, num_warps=4,
                )
                tk.collect_kernel[(qb,)](
                    sc, gm, picked, cand, over, ws_a, self._d_hdr, c1 - c0, gm.stride(0), cand.stride(0), stride,
                    out_base, *masks, K=plan.k1, NG=g // group, GROUP=group, STEP=_COLLECT_STEP,
                    MERGE=max(128, 2 * plan.k1), FILTER=filtered, num_warps=4,
                )
                out_base += plan.k1
            else:
                tk.scores_topk_kernel[(chunks, qb)](
                    sc, ws_a, self._d_hdr, c1 - c0, stride, *masks,
                    K=plan.k1, CHUNK=chunk, MASK=True, FILTER=filtered, out_first=out_base, num_warps=4,
                )
                out_base += chunks * plan.k1
        if out_base < stride:  # the slices past the rows in use
            ws_a[: qb * stride].view(qb, stride)[:, out_base:].fill_(tk.SENTINEL)
        return over

    def _selection_workspace(self, qb: int, groups: int, scratch: int) -> tuple[torch.Tensor, ...]:
        """The threshold selection's buffers: group maxima [qb, groups] (float32), the picked
        groups (int32, same shape), candidate keys [qb, scratch] (int64), overflow words."""
        held = self._sel_ws
        if held is None or held[0].shape[0] < qb or held[0].shape[1] != groups or held[2].shape[1] < scratch:
            self._drop_graphs()  # captured launches point at the buffers they replace
            rows = max(qb, held[0].shape[0] if held is not None else 0)
            scratch = max(scratch, held[2].shape[1] if held is not None else 0)
            with self._on_stream():
                held = (torch.empty((rows, groups), dtype=torch.float32, device=self._dev),
                        torch.empty((rows, groups), dtype=torch.int32, device=self._dev),
                        torch.empty((rows, scratch), dtype=torch.int64, device=self._dev),
                        torch.empty(rows, dtype=torch.int32, device=self._dev))
            self._sel_ws = held
        return held

    def _gemm_ok(self, kind: str) -> bool:
        """Whether cuBLAS can score this kind here (fp16 needs mm with a float32 output)."""
        if kind == "tf32" or not self._is_cuda:
            return True
        if self._mm_fp32_out is None:
            try:
                a = torch.zeros((2, 8), dtype=self._half_dtype, device=self._dev)
                self._mm_fp32_out = torch.mm(a, a.T, out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError):
                self._mm_fp32_out = False
        return self._mm_fp32_out

    def _capture(self, key) -> None:
        graph = torch.cuda.CUDAGraph()
        self._stream.synchronize()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # One memory pool for every graph: they replay one at a time on this stream, and what
        # they allocate (a GEMM batch's scores: up to max_batch x 65,536 floats) dies inside
        # each replay, so one graph's scratch may be another's.
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=self._stream, capture_error_mode="thread_local"):
            self._launch(key, None)
        self._graphs[key] = graph
        self.stats["graph_captures"] += 1

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._uncapturable.clear()
        self._graph_pool = None  # a pool id with no live graph may not be captured into again

    def retune(self, tune: dict | None = None) -> None:
        """Replaces entries of the tuning table (benchmarks); drops plans and graphs."""
        if tune:
            self._tune.update(tune)
        self._plans.clear()
        self._occupancy.clear()
        self._drop_graphs()

    @property
    def stream(self):
        """The engine's CUDA stream (None on the CPU device)."""
        return self._stream

    def plan(self, q: int, k: int, precision: str | None = None) -> _Plan:
        """The launch plan (tiles, programs, merge levels) a batch of q queries would use."""
        return self._plan(self._scan_kind(q, k, precision or self.precision), _next_pow2(q), _kp(k))

    def _scan_kind(self, nq: int, k: int, precision: str) -> str:
        """What a batch of ``nq`` queries scans: "i8" (fast, a single query), "f16" (fast),
        "tf32" (exact batches, certified) or "f32" (exact). All but "f32" serve k <= MAX_FAST_K."""
        if k > MAX_FAST_K:
            return "f32"
        if precision == "fast":
            int8 = self._x8 is not None and self._tune["single_scan"] == "int8"
            return "i8" if nq == 1 and int8 and self._chunk_rescore() else "f16"
        return "tf32" if nq > 1 and self._tune["exact_batch_scan"] == "tf32" else "f32"

    def _chunk_rescore(self) -> bool:
        """Whether a single query's chunks re-score their own candidates (``single_chunk_rescore``
        up to ``chunk_rescore_max_rows``): the 8-bit scan depends on it."""
        return bool(self._tune["single_chunk_rescore"]) and self.rows.capacity <= int(self._tune["chunk_rescore_max_rows"])

    # -- the plain PyTorch path -----------------------------------------------------------------

    def _torch_batch(self, queries, k, flt, out_i, out_s, want_ids, fast, live) -> None:
        nq = len(queries)
        n = self.rows.size
        kk = min(k, n)
        with self._on_stream():
            q = torch.as_tensor(queries).to(self._dev, torch.float32)
            ok = (self._live[:n] if live is None else live[:n]) != 0
            if flt.namespace is not None:
                ok &= self._ns[:n] == int(flt.namespace)
            if flt.since is not None:
                ok &= self._ts[:n] >= float(flt.since)
            if flt.until is not None:
                ok &= self._ts[:n] < float(flt.until)
            bad = None
            if fast:
                kf = min(_kf(k), n)
                s16 = q.to(self._half_dtype).float() @ self._x16[:n].float().T
                s16.masked_fill_(~ok, -math.inf)
                v16, r16 = s16.topk(kf, dim=1)
                s32 = torch.einsum("qkd,qd->qk", self._x32[r16], q)
                s32.masked_fill_(~torch.isfinite(v16), -math.inf)
                sc, j = s32.topk(kk, dim=1)
                rows = r16.gather(1, j)
                if kf < n:
                    ea, eb, ec = self._err["f16"]
                    qn = torch.linalg.vector_norm(q.double(), dim=1)
                    err = ea * self._max_norm * qn + eb * (self._max_norm + qn) + ec
                    n_valid = torch.isfinite(v16).sum(dim=1)
                    certified = (n_valid < kf) | (v16[:, kf - 1].double() < v16[:, kk - 1].double() - 2 * err)
                    bad = torch.nonzero(~certified).flatten()
            else:
                s = q @ self._x32[:n].T
                s.masked_fill_(~ok, -math.inf)
                sc, rows = s.topk(kk, dim=1)
            idx = self._ids[rows] if want_ids else rows
            idx = torch.where(torch.isfinite(sc), idx, MISSING_ID if want_ids else 0)
            idx_np, sc_np = idx.cpu().numpy(), sc.cpu().numpy()
            bad_np = bad.cpu().numpy() if bad is not None else ()
        out_i[:nq, :kk] = idx_np
        out_s[:nq, :kk] = sc_np
        if kk < k:
            out_i[:nq, kk:k] = MISSING_ID if want_ids else 0
            out_s[:nq, kk:k] = -np.inf
        if len(bad_np):
            self.stats["fallbacks"] += len(bad_np)
            self._torch_batch(queries[bad_np], k, flt, _RowSink(out_i, bad_np), _RowSink(out_s, bad_np),
                              want_ids, False, live)


class _RowSink:
    """Writes ``sink[a:b, c:d] = v`` through to rows ``rows[a:b]`` of ``target`` (fallback re-runs)."""

    def __init__(self, target: np.ndarray, rows: np.ndarray) -> None:
        self._t = target
        self._rows = np.asarray(rows)

    def __getitem__(self, key):
        return _RowSink(self._t, self._rows[key]) if isinstance(key, slice) else self._t[self._rows[key[0]], key[1]]

    def __setitem__(self, key, value) -> None:
        r, c = key
        self._t[self._rows[r], c] = value

    def __len__(self) -> int:
        return len(self._rows)


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
