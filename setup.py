"""Builds Kalos's two native pieces; everything else is Python.

- kalos.ipc._fence: the shared-memory channel's memory fence and its GIL-free waits. See
  src/kalos/ipc/sync.py for why Python alone cannot order stores and loads across processes,
  and for the fallback used where no compiler exists.
- kalos.engine._dots: the CPU engine's scores for a pass of a few queries (a crowd's pass),
  each row read once. Without it the engine multiplies with BLAS (the same answers up to
  float32 rounding, slower).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kalos.ipc._fence",
            sources=["src/kalos/ipc/_fence.c"],
            # Optional: without a C compiler the install still succeeds and kalos.ipc.sync
            # falls back to a lock-based fence, which is a full barrier on x86-64 only.
            optional=True,
        ),
        Extension(
            "kalos.engine._dots",
            sources=["src/kalos/engine/_dots.c"],
            # -O2 and no -ffast-math: the compiler does not reorder the sums (where the CPU has
            # FMA it may fuse a product into its sum, as BLAS's kernels do).
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
