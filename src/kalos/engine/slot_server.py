"""Moved: the slot server is :mod:`kalos.engine.gpu.slot_server`. This name stays importable
for code written against it."""
from kalos.engine.gpu.slot_server import DEFAULT_MAX_K, SlotGraphServer, name_home  # noqa: F401

__all__ = ["SlotGraphServer", "DEFAULT_MAX_K", "name_home"]
