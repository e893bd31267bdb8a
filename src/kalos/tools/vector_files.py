"""The vector files ``kalos add`` and ``kalos recall --npy`` read (.npy matrices, JSON lines of
``{"vector": [...], "text", "metadata", "namespace", "key"}``), checked whole before anything is
sent: an error names the file and its line or row, and nothing is added. (``kalos import`` reads
text and vector files of its own kinds, resumably: :mod:`kalos.tools.importer`.)"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kalos.errors import InvalidArgument
from kalos.validation import check_keys

__all__ = ["check_rows", "load_npy", "read_vector_jsonl"]


def read_vector_jsonl(path: Path, default_namespace: str,
                      dim: int) -> dict[str, list[tuple[list[float], str | None, dict | None, str | None]]]:
    """The file's rows ``(vector, text, metadata, key)`` by namespace; InvalidArgument naming the
    line of the first bad one (a key repeated within a namespace too: nothing is sent then)."""
    groups: dict[str, list[tuple[list[float], str | None, dict | None, str | None]]] = {}
    key_lines: dict[tuple[str, str], int] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidArgument(f"{path}:{number}: not UTF-8 text: {exc}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{number}: not valid JSON: {exc}") from None
            if not isinstance(row, dict) or not isinstance(row.get("vector"), list):
                raise InvalidArgument(f"{path}:{number}: expected an object with a \"vector\" list")
            # Checked per line, so that the message names it (one matrix of all rows would only
            # say that its shape is "inhomogeneous").
            vector = row["vector"]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vector):
                raise InvalidArgument(f"{path}:{number}: \"vector\" must be a list of numbers")
            if len(vector) != dim:
                raise InvalidArgument(f"{path}:{number}: \"vector\" has {len(vector)} numbers; the sidecar's store "
                                      f"holds dimension {dim}")
            # JSON as Python reads it allows NaN and Infinity; refused here, by line, before any add.
            if not all(math.isfinite(x) for x in vector):
                raise InvalidArgument(f"{path}:{number}: \"vector\" contains NaN or infinity")
            if not any(vector):
                raise InvalidArgument(f"{path}:{number}: \"vector\" is all zeros (no direction to compare by cosine)")
            text, metadata = row.get("text"), row.get("metadata")
            if text is not None and not isinstance(text, str):
                raise InvalidArgument(f"{path}:{number}: \"text\" must be a string")
            if metadata is not None and not isinstance(metadata, dict):
                raise InvalidArgument(f"{path}:{number}: \"metadata\" must be an object")
            namespace = row.get("namespace", default_namespace)
            if not isinstance(namespace, str):
                raise InvalidArgument(f"{path}:{number}: \"namespace\" must be a string")
            key = row.get("key")
            if key is not None:
                try:
                    check_keys([key])
                except InvalidArgument as exc:
                    raise InvalidArgument(f"{path}:{number}: \"key\": {exc}") from None
                first = key_lines.setdefault((namespace, key), number)
                if first != number:
                    raise InvalidArgument(f"{path}:{number}: key {key!r} is also on line {first} (namespace {namespace!r})")
            groups.setdefault(namespace, []).append((row["vector"], text, metadata, key))
    return groups


def load_npy(path: Path) -> np.ndarray:
    try:
        matrix = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise InvalidArgument(f"{path}: not a readable .npy array ({exc})") from None
    if not isinstance(matrix, np.ndarray) or matrix.dtype.kind not in "iuf" or matrix.ndim not in (1, 2):
        raise InvalidArgument(f"{path}: expected a 1-D or 2-D numeric array")
    return matrix


def check_rows(path: Path, matrix: np.ndarray, dim: int) -> np.ndarray:
    """The whole matrix as float32, checked before anything is sent: a bad row found by the add
    of a later batch would leave the earlier batches stored, and be named by its index in that
    batch. InvalidArgument names the file's row (counting from 0)."""
    if matrix.shape[1] != dim:
        raise InvalidArgument(f"{path}: the vectors have dimension {matrix.shape[1]}; the sidecar's store holds "
                              f"dimension {dim}")
    if len(matrix) == 0:
        raise InvalidArgument(f"{path} holds no rows")
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, reported below
        matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(matrix).all(axis=1))
    if len(bad):
        raise InvalidArgument(f"{path}: row {bad[0]} (counting from 0) contains NaN or infinity"
                              + (f", as do {len(bad) - 1} more rows" if len(bad) > 1 else "") + "; nothing was added")
    zero = np.flatnonzero(~matrix.any(axis=1))
    if len(zero):
        raise InvalidArgument(f"{path}: row {zero[0]} (counting from 0) is all zeros (no direction to compare by "
                              "cosine); nothing was added")
    return matrix
