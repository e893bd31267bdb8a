"""The rows on the device: the matrices a scan reads and the per-row columns it filters on.

``x32 [capacity, dim] float32`` -- the master copy, always resident.
``x16 [capacity, dim] float16`` -- only with ``precision="fast"``: the copy batches scan.
``x8 [capacity, dim] int8``, ``scale8 [capacity] float32`` -- only with ``precision="fast"``
and the Triton backend's 8-bit single scan: the copy a single query scans, row ``i`` about
``scale8[i] * x8[i]`` (``scale8[i] = max|x_i| / 127``).
``live uint8``, ``namespace int32``, ``created_at float64``, ``ids int64`` -- mirrored from
:class:`~kalos.engine.base.RowTable` so that filtering happens inside the scan and results
leave the device as store ids.

Growth copies the used rows once (the caller doubles the capacity); compaction moves rows
forward in place, chunk by chunk (no second copy of the matrix). ``max_norm`` and
``max_resid8`` (the largest row norm and 8-bit residual ever written, float64) feed the
certificates (:mod:`kalos.engine.gpu.bounds`); they never shrink.
"""
from __future__ import annotations

import numpy as np
import torch

from kalos.engine.base import MISSING_ID, NAMESPACE_DTYPE, RowTable
from kalos.engine.gpu.bounds import quantize_rows

__all__ = ["DeviceColumns"]

_WRITE_STEP = 16384  # rows per float64 temporary of a write (not one of a whole bulk load)
# The row table's namespace column as torch names it: the device copy mirrors it.
_NAMESPACE_TORCH_DTYPE = torch.from_numpy(np.empty(0, NAMESPACE_DTYPE)).dtype
_COMPACT_BYTES = 64 << 20  # one chunk of a compaction's row moves


class DeviceColumns:
    """Every per-row tensor of an engine on ``device``; ``None`` where not held."""

    def __init__(self, dim: int, capacity: int, device: torch.device, *, half: torch.dtype | None,
                 int8: bool) -> None:
        self.dim = dim
        self.device = device
        self.half = half  # the 16-bit copy's dtype (None: no 16-bit copy)
        self.int8 = int8
        self.max_norm = 0.0
        self.max_resid8 = 0.0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        dev, d = self.device, self.dim
        self.x32 = torch.zeros((capacity, d), dtype=torch.float32, device=dev)
        self.x16 = torch.zeros((capacity, d), dtype=self.half, device=dev) if self.half is not None else None
        self.x8 = torch.zeros((capacity, d), dtype=torch.int8, device=dev) if self.int8 else None
        self.scale8 = torch.ones(capacity, dtype=torch.float32, device=dev) if self.int8 else None
        self.live = torch.zeros(capacity, dtype=torch.uint8, device=dev)
        self.ns = torch.zeros(capacity, dtype=_NAMESPACE_TORCH_DTYPE, device=dev)
        self.ts = torch.zeros(capacity, dtype=torch.float64, device=dev)
        self.ids = torch.full((capacity,), MISSING_ID, dtype=torch.int64, device=dev)

    def tensors(self) -> tuple:
        """Every per-row tensor (None: not held), in a fixed order."""
        return (self.x32, self.x16, self.x8, self.scale8, self.live, self.ns, self.ts, self.ids)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def resize(self, capacity: int, used: int) -> None:
        """New tensors of ``capacity`` rows holding rows ``[0, used)`` of the old ones."""
        old = self.tensors()
        self._alloc(capacity)
        for new, src in zip(self.tensors(), old):
            if new is not None and used:
                new[:used].copy_(src[:used])

    def write(self, rows: slice, vectors: np.ndarray, table: RowTable) -> None:
        """Stores ``vectors`` at ``rows`` and mirrors the table's columns there."""
        x = torch.from_numpy(vectors).to(self.device)
        self.x32[rows].copy_(x)
        if self.x16 is not None:
            self.x16[rows].copy_(x.to(self.half))
        self.live[rows] = 1
        self.ns[rows].copy_(torch.from_numpy(table.namespaces[rows]))
        self.ts[rows].copy_(torch.from_numpy(table.created_at[rows]))
        self.ids[rows].copy_(torch.from_numpy(table.ids[rows]))
        for s in range(0, len(x), _WRITE_STEP):
            norm = torch.linalg.vector_norm(x[s : s + _WRITE_STEP].double(), dim=1).max().item()
            self.max_norm = max(self.max_norm, float(norm))
            if self.x8 is not None:
                codes, scale, resid = quantize_rows(x[s : s + _WRITE_STEP])
                at = slice(rows.start + s, rows.start + s + len(codes))
                self.x8[at].copy_(codes)
                self.scale8[at].copy_(scale)
                self.max_resid8 = max(self.max_resid8, resid)

    def tombstone(self, rows: np.ndarray) -> None:
        self.live[torch.from_numpy(rows).to(self.device)] = 0

    def compact(self, keep: np.ndarray, table: RowTable) -> None:
        """Moves row ``keep[i]`` to row ``i`` (``table`` already compacted)."""
        n = len(keep)
        keep_t = torch.from_numpy(keep).to(self.device)
        # keep is increasing with keep[i] >= i: moving rows forward in ascending chunks never
        # overwrites a row a later chunk still has to read, so one chunk-sized buffer suffices.
        step = max(1, _COMPACT_BYTES // (self.dim * 4))
        for mat in (self.x32, self.x16, self.x8, self.scale8):
            if mat is None:
                continue
            for s in range(0, n, step):
                e = min(n, s + step)
                mat[s:e] = mat.index_select(0, keep_t[s:e])
        cap = table.capacity
        self.live.copy_(torch.from_numpy(table.live[:cap].view(np.uint8)))
        self.ns.copy_(torch.from_numpy(table.namespaces[:cap]))
        self.ts.copy_(torch.from_numpy(table.created_at[:cap]))
        self.ids.copy_(torch.from_numpy(table.ids[:cap]))
