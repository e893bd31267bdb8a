"""Host memory the GPU reads and writes directly: page-locked buffers, the engine's staging
area (header, gather table, queries; results) and an attached host buffer (the segment).

The staging header's words are declared in :mod:`kalos.engine.gpu.layout`; :class:`Staging`
and :func:`fill_header` are the only host code that writes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kalos.engine.base import Filter
from kalos.engine.gpu.layout import HDR_WORDS, HEADER, TAB_WORDS, TABLE
from kalos.errors import InvalidArgument

__all__ = ["HostBuffer", "register_host_buffer", "AttachedHost", "Staging", "fill_header", "RESULT_COLS", "NO_BOUND"]

#: Result row stride of the engine's own result area: k_bucket(MAX_K).
RESULT_COLS = 1024
#: A certificate bound no chunk has raised (the kernels' SENTINEL).
NO_BOUND = -(2**63)


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


@dataclass
class AttachedHost:
    """The host buffer that :meth:`TorchEngine.search_attached` reads and writes in place."""

    host: HostBuffer
    f32: torch.Tensor  # the buffer as float32 / int64 words: kernel arguments
    i64: torch.Tensor
    f32_np: np.ndarray  # the same memory for the host-side paths (fallbacks)
    i64_np: np.ndarray

    @classmethod
    def of(cls, host: HostBuffer) -> "AttachedHost":
        words = host.nbytes // 8
        f32 = host.tensor[: 8 * words].view(torch.float32)
        i64 = host.tensor[: 8 * words].view(torch.int64)
        return cls(host, f32, i64, f32.numpy(), i64.numpy())


class Staging:
    """Page-locked host areas the kernels read and write directly (no copy nodes), and their
    device counterparts, for batches of up to ``max_batch`` queries of ``dim`` floats.

    Host: header + gather table + queries (``h_stage``); status + ids + scores (``h_res``,
    rows of :data:`RESULT_COLS` columns). Device: header + table + queries, which the
    stage-in kernel fills from the host side at the start of every search.
    """

    def __init__(self, max_batch: int, dim: int, device: torch.device, *, pin: bool) -> None:
        mb, d = max_batch, dim
        meta = 8 * (HDR_WORDS + TAB_WORDS * mb)
        self.h_stage = torch.zeros(meta + mb * d * 4, dtype=torch.uint8, pin_memory=pin)
        self.d_stage = torch.zeros(meta + mb * d * 4, dtype=torch.uint8, device=device)
        self.h_meta = self.h_stage[:meta].view(torch.int64)  # kernel argument HH
        self.h_metaf = self.h_stage[:meta].view(torch.float64)
        self.h_hdr = self.h_meta.numpy()[:HDR_WORDS]
        self.h_hdrf = self.h_hdr.view(np.float64)
        self.h_tab = self.h_meta.numpy()[HDR_WORDS:].reshape(mb, TAB_WORDS)
        self.h_tabf = self.h_tab.view(np.float64)
        self.h_q_t = self.h_stage[meta:].view(torch.float32)  # kernel argument SRC (own staging)
        self.h_q = self.h_q_t.numpy().reshape(mb, d)
        self.d_hdr = self.d_stage[:meta].view(torch.int64)
        self.d_hdrf = self.d_stage[:meta].view(torch.float64)
        self.d_q = self.d_stage[meta:].view(torch.float32).view(mb, d)
        # Fast mode's certificate bound per query (scores_rescore_kernel; the final kernel resets it).
        self.d_bound = torch.full((mb,), NO_BOUND, dtype=torch.int64, device=device)
        off_i = (mb * 4 + 7) // 8 * 8
        off_s = off_i + mb * RESULT_COLS * 8
        self.h_res = torch.zeros(off_s + mb * RESULT_COLS * 4, dtype=torch.uint8, pin_memory=pin)
        raw = self.h_res.numpy()
        self.r_status = raw[: mb * 4].view(np.int32)
        self.r_ids = raw[off_i:off_s].view(np.int64).reshape(mb, RESULT_COLS)
        self.r_scores = raw[off_s:].view(np.float32).reshape(mb, RESULT_COLS)
        self.res_status_t = self.h_res[: mb * 4].view(torch.int32)
        self.res_i64 = self.h_res.view(torch.int64)
        self.res_f32 = self.h_res.view(torch.float32)
        # The gather table of a search from the engine's own staging: query j at row j of
        # h_q, results at row j of the result area, scale 1 (the caller normalised).
        rows = np.arange(mb, dtype=np.int64)
        self.own_tab = np.empty((mb, TAB_WORDS), np.int64)
        self.own_tab[:, TABLE.query_at] = rows * d
        self.own_tab[:, TABLE.ids_at] = off_i // 8 + rows * RESULT_COLS
        self.own_tab[:, TABLE.scores_at] = off_s // 4 + rows * RESULT_COLS
        self.own_tab.view(np.float64)[:, TABLE.scale] = 1.0

    def set_table(self, nq: int, query_at, ids_at, scores_at, scales) -> None:
        """Gather-table rows ``[0, nq)``: where each query, its ids and its scores are."""
        fill_table(self.h_tab[:nq], query_at, ids_at, scores_at, scales)

    def own_table(self, nq: int) -> None:
        """Gather-table rows for queries in this staging's own query area."""
        self.h_tab[:nq] = self.own_tab[:nq]

    def scales(self, nq: int) -> np.ndarray:
        """The scales the table holds (the stage-in kernel writes them when it normalises)."""
        return self.h_tabf[:nq, TABLE.scale].copy()


def fill_table(tab: np.ndarray, query_at, ids_at, scores_at, scales) -> None:
    """Writes gather-table rows ``tab`` (int64 ``[rows, TAB_WORDS]``): where each query, its ids
    and its scores are (element offsets in the attached buffer) and its scale (float64; NaN: the
    stage-in kernel normalises the query)."""
    tab[:, TABLE.query_at] = query_at
    tab[:, TABLE.ids_at] = ids_at
    tab[:, TABLE.scores_at] = scores_at
    tab.view(np.float64)[:, TABLE.scale] = scales


# Header words as plain ints: fill_header runs once per search.
_N, _NQ, _K, _HAS_NS, _NS, _SINCE, _UNTIL, _MAX_NORM, _ROW_ERR8, _K_OUT, _OWN_FILTERS = (
    HEADER.n, HEADER.nq, HEADER.k, HEADER.has_ns, HEADER.ns, HEADER.since, HEADER.until, HEADER.max_norm,
    HEADER.row_err8, HEADER.k_out, HEADER.own_filters,
)


def fill_header(hdr: np.ndarray, hdrf: np.ndarray, n: int, nq: int, k: int, flt: Filter, max_norm: float,
                row_err8: float) -> None:
    """Writes a staging header: ``hdr`` its int64 words, ``hdrf`` the same memory as float64."""
    hdr[_N] = n
    hdr[_NQ] = nq
    hdr[_K] = min(k, n)
    if flt.namespace is None:
        hdr[_HAS_NS] = 0
        hdr[_NS] = 0
    else:
        hdr[_HAS_NS] = 1
        hdr[_NS] = int(flt.namespace)
    hdrf[_SINCE] = -np.inf if flt.since is None else float(flt.since)
    hdrf[_UNTIL] = np.inf if flt.until is None else float(flt.until)
    hdr[_OWN_FILTERS] = 0  # (the batch's filter is the header's: one filter a search)
    hdrf[_MAX_NORM] = max_norm
    hdrf[_ROW_ERR8] = row_err8
    hdr[_K_OUT] = k  # columns written: past min(k, n) they are padding (-1 / -inf)
