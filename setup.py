"""Builds the one native piece of Kalos: a memory fence for the shared-memory channel.

Everything else is Python. See src/kalos/ipc/sync.py for why Python alone cannot order
stores and loads across processes, and for the fallback used where no compiler exists.
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
        )
    ]
)
