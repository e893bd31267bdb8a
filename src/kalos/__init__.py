"""Kalos: memory recall for LLM agents in microseconds.

A sidecar process keeps every memory embedding resident (GPU, or NumPy on the CPU) and
answers top-k cosine recalls through POSIX shared memory::

    from kalos import Client
    with Client() as memory:
        ids = memory.add(vectors, texts=["..."] * len(vectors))
        hits = memory.recall(query, k=8)
"""
from kalos.client.client import Client, Hit, Item, Page, Recall, RecallBatch
from kalos.errors import (
    DimensionMismatch,
    InvalidArgument,
    InvalidQuery,
    KalosError,
    NotAKalosStore,
    ProtocolMismatch,
    ServerError,
    SidecarAlreadyRunning,
    SidecarUnavailable,
    StoreError,
    StoreLocked,
    UnknownFilter,
    UnknownKey,
    UnknownNamespace,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "AsyncClient",
    "Hit",
    "Item",
    "Page",
    "Recall",
    "RecallBatch",
    "KalosError",
    "InvalidArgument",
    "InvalidQuery",
    "DimensionMismatch",
    "UnknownNamespace",
    "UnknownKey",
    "UnknownFilter",
    "SidecarUnavailable",
    "SidecarAlreadyRunning",
    "ProtocolMismatch",
    "StoreError",
    "NotAKalosStore",
    "StoreLocked",
    "ServerError",
]


def __getattr__(name: str) -> object:
    # kalos.AsyncClient is imported on first use: asyncio costs tens of milliseconds at import,
    # which every sync user (and every `kalos` command) would otherwise pay.
    if name == "AsyncClient":
        from kalos.client.aio import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'kalos' has no attribute {name!r}")
