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


def make_engine(device: str, dim: int, *, capacity: int = 1024) -> Engine:
    """The engine for ``device``: "cpu", "cuda", "cuda:N" or "auto" (CUDA when visible)."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return NumpyEngine(dim, capacity=capacity)
    if device == "cuda" or device.startswith("cuda:"):
        raise InvalidArgument(f"device {device!r}: the GPU engine is not part of this build yet")
    raise InvalidArgument(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")
