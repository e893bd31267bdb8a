"""Moved: the GPU engine is the package :mod:`kalos.engine.gpu` (``TorchEngine`` in
:mod:`kalos.engine.gpu.engine`). This name stays importable for code written against it."""
from kalos.engine.gpu import (  # noqa: F401
    MAX_K, HostBuffer, ScanConfig, TorchEngine, Tuning, fast_error_terms, int8_error_terms, register_host_buffer,
)

__all__ = ["TorchEngine", "HostBuffer", "register_host_buffer", "fast_error_terms", "int8_error_terms", "MAX_K",
           "ScanConfig", "Tuning"]
