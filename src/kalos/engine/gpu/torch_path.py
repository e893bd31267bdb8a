"""The GPU engine's plain PyTorch path (``backend="torch"``): ``matmul`` + ``topk`` over the
device columns, for devices or installs without Triton; the same answers as the kernels."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from kalos.engine.base import MISSING_ID, Filter, RowTable
from kalos.engine.gpu.columns import DeviceColumns
from kalos.engine.gpu.planner import fast_candidates

__all__ = ["TorchPath", "RowSink"]


class TorchPath:
    """Searches by ``matmul`` + ``topk`` over ``columns`` (the rows of ``table``), on the
    engine's stream (``on_stream``); ``errors``: the error-bound terms per scan kind; fallbacks
    counted in ``stats``."""

    def __init__(self, columns: DeviceColumns, table: RowTable, *, on_stream: Callable[[], Any],
                 errors: dict[str, tuple[float, float, float]], stats: dict) -> None:
        self.columns = columns
        self.rows = table
        self.on_stream = on_stream
        self.error_terms = errors
        self.stats = stats

    def batch(self, queries, k: int, flt: Filter, out_i, out_s, want_ids: bool, fast: bool,
              live: torch.Tensor | None) -> None:
        """One batch (at most ``max_batch`` queries): results into ``out_i[:Q, :k]`` / ``out_s``
        (ids, or rows without ``want_ids``). ``fast``: the 16-bit copy, the candidates re-scored
        in float32 and certified as the Triton path does (:mod:`kalos.engine.gpu.bounds`); a
        query whose certificate fails is re-run exactly. ``live``: a row mask in place of the
        live column."""
        cols = self.columns
        nq = len(queries)
        n = self.rows.size
        kk = min(k, n)
        with self.on_stream():
            q = torch.as_tensor(queries).to(cols.device, torch.float32)
            ok = (cols.live[:n] if live is None else live[:n]) != 0
            if flt.namespace is not None:
                ok &= cols.ns[:n] == int(flt.namespace)
            if flt.since is not None:
                ok &= cols.ts[:n] >= float(flt.since)
            if flt.until is not None:
                ok &= cols.ts[:n] < float(flt.until)
            bad = None
            if fast:
                kf = min(fast_candidates(k), n)
                s16 = q.to(cols.half).float() @ cols.x16[:n].float().T
                s16.masked_fill_(~ok, -math.inf)
                v16, r16 = s16.topk(kf, dim=1)
                s32 = torch.einsum("qkd,qd->qk", cols.x32[r16], q)
                s32.masked_fill_(~torch.isfinite(v16), -math.inf)
                sc, j = s32.topk(kk, dim=1)
                rows = r16.gather(1, j)
                if kf < n:
                    ea, eb, ec = self.error_terms["f16"]
                    qn = torch.linalg.vector_norm(q.double(), dim=1)
                    err = ea * cols.max_norm * qn + eb * (cols.max_norm + qn) + ec
                    n_valid = torch.isfinite(v16).sum(dim=1)
                    certified = (n_valid < kf) | (v16[:, kf - 1].double() < v16[:, kk - 1].double() - 2 * err)
                    bad = torch.nonzero(~certified).flatten()
            else:
                s = q @ cols.x32[:n].T
                s.masked_fill_(~ok, -math.inf)
                sc, rows = s.topk(kk, dim=1)
            idx = cols.ids[rows] if want_ids else rows
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
            self.batch(queries[bad_np], k, flt, RowSink(out_i, bad_np), RowSink(out_s, bad_np), want_ids, False,
                       live)


class RowSink:
    """Writes ``sink[a:b, c:d] = v`` through to rows ``rows[a:b]`` of ``target`` (fallback re-runs)."""

    def __init__(self, target: np.ndarray, rows: np.ndarray) -> None:
        self._t = target
        self._rows = np.asarray(rows)

    def __getitem__(self, key):
        return RowSink(self._t, self._rows[key]) if isinstance(key, slice) else self._t[self._rows[key[0]], key[1]]

    def __setitem__(self, key, value) -> None:
        r, c = key
        self._t[self._rows[r], c] = value

    def __len__(self) -> int:
        return len(self._rows)
