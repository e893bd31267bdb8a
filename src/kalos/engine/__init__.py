"""Search backends behind one interface (:class:`Engine`), and the choice between them."""
from __future__ import annotations

from kalos.engine.base import MISSING_ID, Engine, Filter, as_unit_rows
from kalos.engine.numpy_engine import NumpyEngine
from kalos.engine.sharded import ShardedEngine
from kalos.errors import InvalidArgument

__all__ = [
    "Engine", "Filter", "MISSING_ID", "NumpyEngine", "ShardedEngine", "as_unit_rows", "make_engine", "cuda_available",
]


def cuda_available() -> bool:
    """True when PyTorch is installed and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def make_engine(device: str, dim: int, *, capacity: int = 1024, precision: str = "exact") -> Engine:
    """The engine for ``device``: "cpu" (NumPy), "cuda" / "cuda:N" (PyTorch + Triton), "auto",
    or several GPUs: "cuda:0,cuda:1" (a device may repeat: two shards on one card) or
    "cuda:all" (every visible GPU), which shard the rows (:class:`ShardedEngine`).

    ``precision`` applies to the GPU engine: "exact" scans float32; "fast" scans a 16-bit
    copy and re-scores a certified candidate set in float32 (the same top-k, 1.5x the memory).
    """
    if precision not in ("exact", "fast"):
        raise InvalidArgument(f"precision must be 'exact' or 'fast', got {precision!r}")
    if not isinstance(device, str) or not device.strip():
        raise InvalidArgument(f"device must be a non-empty string, got {device!r}")
    device = device.strip()
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return NumpyEngine(dim, capacity=capacity)
    devices = _gpu_devices(device)
    try:
        from kalos.engine.gpu import TorchEngine  # torch and triton load only here
    except ImportError as exc:
        raise InvalidArgument(f"device {device!r} needs PyTorch with CUDA (pip install 'kalos-recall[gpu]'): {exc}") from None
    if len(devices) == 1:
        return TorchEngine(dim, capacity=capacity, device=devices[0], precision=precision)
    per_shard = max(1024, -(-capacity // len(devices)))
    return ShardedEngine([TorchEngine(dim, capacity=per_shard, device=d, precision=precision) for d in devices])


def _gpu_devices(device: str) -> list[str]:
    """The CUDA devices a device string names: "cuda", "cuda:N", "cuda:all", or a comma list."""
    if device == "cuda:all":
        if not cuda_available():
            raise InvalidArgument("device 'cuda:all': PyTorch sees no CUDA device")
        import torch

        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    devices = [d.strip() for d in device.split(",")]
    for d in devices:
        if not (d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit())):
            raise InvalidArgument(
                f"unknown device {d!r} in {device!r}: use auto, cpu, cuda, cuda:N, cuda:all or a list "
                "such as cuda:0,cuda:1"
            )
    return devices
