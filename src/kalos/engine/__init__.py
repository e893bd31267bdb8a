"""Search backends behind one interface (:class:`Engine`), and the choice between them."""
from __future__ import annotations

from kalos.engine.base import MISSING_ID, Engine, Filter, as_unit_rows
from kalos.engine.numpy_engine import NumpyEngine
from kalos.errors import InvalidArgument

__all__ = ["Engine", "Filter", "MISSING_ID", "NumpyEngine", "as_unit_rows", "make_engine", "cuda_available"]


def cuda_available() -> bool:
    """True when PyTorch is installed and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def make_engine(device: str, dim: int, *, capacity: int = 1024, precision: str = "exact") -> Engine:
    """The engine for ``device``: "cpu" (NumPy), "cuda" / "cuda:N" (PyTorch + Triton), or "auto".

    ``precision`` applies to the GPU engine: "exact" scans float32; "fast" scans a 16-bit
    copy and re-scores a certified candidate set in float32 (the same top-k, 1.5x the memory).
    """
    if precision not in ("exact", "fast"):
        raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return NumpyEngine(dim, capacity=capacity)
    if device == "cuda" or device.startswith("cuda:"):
        try:
            from kalos.engine.torch_engine import TorchEngine  # torch and triton load only here
        except ImportError as exc:
            raise InvalidArgument(
                f"device {device!r} needs PyTorch with CUDA (pip install 'kalos[gpu]'): {exc}"
            ) from None
        return TorchEngine(dim, capacity=capacity, device=device, precision=precision)
    raise InvalidArgument(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")
