"""The GPU engine (PyTorch + Triton), one job per module.

==================  ==========================================================================
``engine``          :class:`TorchEngine`: the :class:`~kalos.engine.base.Engine` over the parts below
``attached``        searches in place in an attached host buffer, and their passes in flight
``layout``          the staging header, gather table and slot-server control words, declared once
``buffers``         page-locked host memory: :class:`HostBuffer`, the staging area, attached buffers
``columns``         the rows on the device (float32 / 16-bit / 8-bit copies, filter columns)
``bounds``          the error bounds that make the reduced-precision scans exact
``planner``         scan kinds, the typed :class:`Tuning` table, launch plans
``pipeline``        the Triton stages of a search as public methods (the slot server's seam)
``torch_path``      the plain PyTorch path (``backend="torch"``)
``slot_server``     :class:`SlotGraphServer`: a CUDA graph that serves the slots by itself
``kernels``         the Triton kernels, one module per stage
==================  ==========================================================================

Importing this package imports PyTorch; Triton loads only with the Triton backend.
"""
from kalos.engine.gpu.bounds import fast_error_terms, int8_error_terms
from kalos.engine.gpu.buffers import HostBuffer, register_host_buffer
from kalos.engine.gpu.engine import TorchEngine
from kalos.engine.gpu.planner import DEFAULT_TUNING, MAX_K, ScanConfig, Tuning

__all__ = [
    "TorchEngine", "HostBuffer", "register_host_buffer", "fast_error_terms", "int8_error_terms", "MAX_K",
    "ScanConfig", "Tuning", "DEFAULT_TUNING",
]
