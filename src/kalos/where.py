"""Metadata filters (``where=``): the Chroma / mem0 syntax, compiled once, evaluated in the scan.

A clause is a dict over top-level metadata keys::

    {"user_id": "alice"}                                  # implicit $eq
    {"year": {"$gte": 2020, "$lt": 2030}}                 # several operators: all must hold
    {"$or": [{"tag": {"$in": ["a", "b"]}}, {"pinned": True}]}
    {"$not": {"archived": {"$exists": True}}}

Operators: ``$eq $ne $in $nin $gt $gte $lt $lte $exists``; combinators ``$and $or $not``;
operands are strings, numbers and booleans (``$in`` / ``$nin`` take a list of them, ``$exists``
a boolean, the range operators a number). A dict with several keys means all of them. ``{}``
matches every row.

Semantics (as Chroma and mem0): a row whose metadata lacks the key fails every comparison
except ``$ne``, ``$nin`` and ``$exists: false``; a comparison between values of different
types (a string with a number, a boolean with a number: a boolean is not a number) is false,
never an error, so ``$ne`` / ``$nin`` of such a value is true. Numbers compare as float64, as
JSON readers do; metadata values that are not strings, numbers or booleans (null, lists,
objects) exist but equal nothing.

:func:`compile_where` validates a clause and returns a :class:`Where`: immutable, hashable,
with a canonical JSON :attr:`Where.key` (the same for dicts that differ only in key order),
:meth:`Where.matches` for one metadata dict, and :meth:`Where.mask` for the column index
:class:`MetaColumns` an engine's rows keep beside their vectors (one NumPy pass per
comparison instead of a Python call per row).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from kalos.errors import InvalidArgument

__all__ = ["Where", "MetaColumns", "compile_where", "MAX_WHERE_BYTES", "MAX_WHERE_DEPTH"]

#: A clause's canonical JSON may not exceed this (it crosses the control socket once).
MAX_WHERE_BYTES = 64 * 1024
#: Nesting of $and / $or / $not beyond this is refused (a clause is written by people).
MAX_WHERE_DEPTH = 32

_COMPARISONS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte")
_LISTS = ("$in", "$nin")
_FIELD_OPS = _COMPARISONS + _LISTS + ("$exists",)
_COMBINATORS = ("$and", "$or", "$not")

# Value type tags, shared by the compiled operands and the column index.
_MISSING, _STR, _NUM, _BOOL, _OTHER = 0, 1, 2, 3, 4


def _classify(value: Any) -> tuple[int, Any]:
    """A metadata value as (type tag, comparable value): numbers as float64, bools as 0/1."""
    if isinstance(value, bool):
        return _BOOL, float(value)
    if isinstance(value, str):
        return _STR, value
    if isinstance(value, (int, float)):
        try:
            return _NUM, float(value)
        except OverflowError:  # an int beyond float64: exists, compares with nothing
            return _OTHER, None
    return _OTHER, None


def _operand(value: Any, where_at: str) -> tuple[int, Any]:
    """A compiled operand (tag, value); refuses what JSON cannot carry or metadata cannot hold."""
    if isinstance(value, bool):
        return _BOOL, float(value)
    if isinstance(value, str):
        return _STR, value
    if isinstance(value, (int, float)):
        try:
            f = float(value)
        except OverflowError:
            raise InvalidArgument(f"where: number out of range at {where_at}: {value!r}") from None
        if not math.isfinite(f):
            raise InvalidArgument(f"where: {value!r} at {where_at} is not a JSON number")
        return _NUM, f
    raise InvalidArgument(
        f"where: value at {where_at} must be a string, number or boolean, got {type(value).__name__}"
    )


def _json_value(tag: int, value: Any, original: Any) -> Any:
    """The operand as it appears in the canonical key (ints stay ints, bools stay bools)."""
    if tag == _NUM and isinstance(original, int) and not isinstance(original, bool):
        return int(original)
    if tag == _BOOL:
        return bool(original)
    return original if tag == _STR else value


# A compiled node is a tuple:
#   ("and", (node, ...)) / ("or", (node, ...)) / ("not", node)
#   ("cmp", key, op, (tag, value))            op in _COMPARISONS
#   ("in", key, negate, ((tag, value), ...))  $in (negate False) / $nin (negate True)
#   ("exists", key, wanted)


@dataclass(frozen=True, eq=False)
class Where:
    """A compiled, validated ``where`` clause (build it with :func:`compile_where`)."""

    key: str
    _node: tuple = field(repr=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Where) and other.key == self.key

    def __hash__(self) -> int:
        return hash(("where", self.key))

    def __repr__(self) -> str:
        return f"Where({self.key})"

    @property
    def is_trivial(self) -> bool:
        """True for ``{}``: every row matches."""
        return self._node == ("and", ())

    @property
    def fields(self) -> frozenset[str]:
        """The metadata keys the clause reads."""
        out: set[str] = set()
        _fields(self._node, out)
        return frozenset(out)

    def to_dict(self) -> dict:
        """The clause in its canonical form (``json.loads(self.key)``)."""
        return json.loads(self.key)

    @classmethod
    def from_json(cls, text: str) -> "Where":
        """Compiles a clause given as JSON text (the CLI's ``--where``, the control socket)."""
        if not isinstance(text, str):
            raise InvalidArgument(f"where: expected JSON text, got {type(text).__name__}")
        if len(text.encode("utf-8", "surrogatepass")) > MAX_WHERE_BYTES:
            raise InvalidArgument(f"where: longer than {MAX_WHERE_BYTES} bytes")
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument(f"where: not valid JSON: {exc}") from None
        return compile_where(parsed)

    def matches(self, metadata: Mapping[str, Any] | None) -> bool:
        """Whether one row with ``metadata`` (None: no metadata) passes the clause."""
        return _match(self._node, metadata if metadata is not None else {})

    def mask(self, columns: "MetaColumns", n: int) -> np.ndarray:
        """Which of rows ``[0, n)`` of ``columns`` pass: a boolean array of length ``n``."""
        return _mask(self._node, columns, n)


def compile_where(where: Any) -> Where:
    """Validates a ``where`` clause and compiles it (a :class:`Where` is returned as it is).

    Raises :class:`~kalos.errors.InvalidArgument` naming the bad part, for example
    ``where: unknown operator '$regex' at user_id``.
    """
    if isinstance(where, Where):
        return where
    if not isinstance(where, Mapping):
        raise InvalidArgument(f"where must be a dict of metadata conditions, got {type(where).__name__}")
    node, canonical = _compile_clause(where, "where", 0)
    key = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if len(key.encode("utf-8", "surrogatepass")) > MAX_WHERE_BYTES:
        raise InvalidArgument(f"where: longer than {MAX_WHERE_BYTES} bytes once compiled")
    return Where(key, node)


def _compile_clause(clause: Mapping, at: str, depth: int) -> tuple[tuple, Any]:
    if depth > MAX_WHERE_DEPTH:
        raise InvalidArgument(f"where: nested deeper than {MAX_WHERE_DEPTH} levels at {at}")
    parts: list[tuple[tuple, Any]] = []
    for name in sorted(clause, key=lambda s: s if isinstance(s, str) else ""):
        if not isinstance(name, str):
            raise InvalidArgument(f"where: keys must be strings, got {name!r} at {at}")
        value = clause[name]
        if name.startswith("$"):
            if name not in _COMBINATORS:
                hint = " (field operators go inside a key: {\"key\": {\"$eq\": ...}})" if name in _FIELD_OPS else ""
                raise InvalidArgument(f"where: unknown operator {name!r} at {at}{hint}")
            parts.append(_compile_combinator(name, value, f"{at}.{name}" if at != "where" else name, depth))
        else:
            if not name:
                raise InvalidArgument(f"where: an empty metadata key at {at}")
            parts.extend(_compile_field(name, value, name if at == "where" else f"{at}.{name}"))
    if len(parts) == 1:
        return parts[0]
    # Several keys in one dict: all must hold. Sorted above, so key order does not matter.
    return ("and", tuple(p[0] for p in parts)), ({"$and": [p[1] for p in parts]} if parts else {})


def _compile_combinator(name: str, value: Any, at: str, depth: int) -> tuple[tuple, Any]:
    if name == "$not":
        if not isinstance(value, Mapping):
            raise InvalidArgument(f"where: $not takes a clause (a dict) at {at}, got {type(value).__name__}")
        node, canon = _compile_clause(value, at, depth + 1)
        return ("not", node), {"$not": canon}
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidArgument(f"where: {name} takes a non-empty list of clauses at {at}")
    nodes, canons = [], []
    for i, sub in enumerate(value):
        if not isinstance(sub, Mapping):
            raise InvalidArgument(f"where: {name} takes clauses (dicts) at {at}[{i}], got {type(sub).__name__}")
        node, canon = _compile_clause(sub, f"{at}[{i}]", depth + 1)
        nodes.append(node)
        canons.append(canon)
    return (name[1:], tuple(nodes)), {name: canons}


def _compile_field(key: str, spec: Any, at: str) -> list[tuple[tuple, Any]]:
    if not isinstance(spec, Mapping):  # implicit $eq
        return [_compile_op(key, "$eq", spec, at)]
    if not spec:
        raise InvalidArgument(f"where: no operator at {at} (write {{\"{key}\": {{\"$eq\": ...}}}})")
    out = []
    for op in sorted(spec, key=lambda s: s if isinstance(s, str) else ""):
        if not isinstance(op, str) or not op.startswith("$"):
            raise InvalidArgument(
                f"where: expected an operator at {at}, got {op!r} (only top-level metadata keys can be filtered)"
            )
        if op not in _FIELD_OPS:
            raise InvalidArgument(f"where: unknown operator {op!r} at {at}")
        out.append(_compile_op(key, op, spec[op], at))
    return out


def _compile_op(key: str, op: str, value: Any, at: str) -> tuple[tuple, Any]:
    if op == "$exists":
        if not isinstance(value, bool):
            raise InvalidArgument(f"where: $exists takes true or false at {at}, got {value!r}")
        return ("exists", key, value), {key: {op: value}}
    if op in _LISTS:
        if not isinstance(value, (list, tuple)):
            raise InvalidArgument(f"where: {op} takes a list at {at}, got {type(value).__name__}")
        operands = []
        canon = []
        for i, v in enumerate(value):
            tag, val = _operand(v, f"{at}.{op}[{i}]")
            operands.append((tag, val))
            canon.append(_json_value(tag, val, v))
        return ("in", key, op == "$nin", tuple(operands)), {key: {op: canon}}
    tag, val = _operand(value, at if op == "$eq" else f"{at}.{op}")
    if op in ("$gt", "$gte", "$lt", "$lte") and tag != _NUM:
        raise InvalidArgument(f"where: {op} takes a number at {at}, got {value!r}")
    return ("cmp", key, op, (tag, val)), {key: {op: _json_value(tag, val, value)}}


def _fields(node: tuple, out: set[str]) -> None:
    kind = node[0]
    if kind in ("and", "or"):
        for sub in node[1]:
            _fields(sub, out)
    elif kind == "not":
        _fields(node[1], out)
    else:
        out.add(node[1])


# -- one row ----------------------------------------------------------------------------------


def _match(node: tuple, metadata: Mapping[str, Any]) -> bool:
    kind = node[0]
    if kind == "and":
        return all(_match(sub, metadata) for sub in node[1])
    if kind == "or":
        return any(_match(sub, metadata) for sub in node[1])
    if kind == "not":
        return not _match(node[1], metadata)
    key = node[1]
    present = key in metadata
    if kind == "exists":
        return present == node[2]
    tag, val = _classify(metadata[key]) if present else (_MISSING, None)
    if kind == "in":
        hit = any(tag == t and val == v for t, v in node[3])
        return not hit if node[2] else hit
    op, (otag, oval) = node[2], node[3]
    if op == "$eq":
        return tag == otag and val == oval
    if op == "$ne":
        return not (tag == otag and val == oval)
    if tag != _NUM:  # range operators: numbers only (the operand is one: compile_where)
        return False
    if op == "$gt":
        return val > oval
    if op == "$gte":
        return val >= oval
    if op == "$lt":
        return val < oval
    return val <= oval


# -- the column index -------------------------------------------------------------------------


class _Column:
    """One metadata key over the rows: type tag, float64 value (numbers, bools), string code.

    Sparse (a dict row -> (tag, value, code)) while few rows hold the key, dense NumPy arrays
    once many do: a store whose rows carry thousands of distinct keys (one-off names) costs
    memory in proportion to the values, not keys x rows."""

    __slots__ = ("tag", "num", "code", "codes", "sparse")

    def __init__(self) -> None:
        self.tag: np.ndarray | None = None  # dense arrays, or None while sparse
        self.num: np.ndarray | None = None
        self.code: np.ndarray | None = None
        self.codes: dict[str, int] = {}  # interned strings of this key (pruned at compaction)
        self.sparse: dict[int, tuple[int, float, int]] = {}

    def densify(self, capacity: int) -> None:
        self.tag = np.zeros(capacity, dtype=np.uint8)
        self.num = np.zeros(capacity, dtype=np.float64)
        self.code = np.zeros(capacity, dtype=np.int32)
        if self.sparse:
            rows = np.fromiter(self.sparse, dtype=np.int64, count=len(self.sparse))
            values = list(self.sparse.values())
            self.tag[rows] = [v[0] for v in values]
            self.num[rows] = [v[1] for v in values]
            self.code[rows] = [v[2] for v in values]
        self.sparse = {}

    def resize(self, capacity: int, size: int) -> None:
        if self.tag is None:
            return
        for name in ("tag", "num", "code"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            new[:size] = old[:size]
            setattr(self, name, new)

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tag, num, code) of rows ``[0, n)``: views when dense, filled temporaries when sparse."""
        if self.tag is not None:
            return self.tag[:n], self.num[:n], self.code[:n]
        tag = np.zeros(n, dtype=np.uint8)
        num = np.zeros(n, dtype=np.float64)
        code = np.zeros(n, dtype=np.int32)
        items = [(r, v) for r, v in self.sparse.items() if r < n]
        if items:
            rows = np.fromiter((r for r, _ in items), dtype=np.int64, count=len(items))
            tag[rows] = [v[0] for _, v in items]
            num[rows] = [v[1] for _, v in items]
            code[rows] = [v[2] for _, v in items]
        return tag, num, code

    def nbytes(self) -> int:
        dense = 0 if self.tag is None else self.tag.nbytes + self.num.nbytes + self.code.nbytes
        # (a dict entry and its tuple: about 100 bytes; an interned string: about 80 and itself)
        return dense + 100 * len(self.sparse) + sum(80 + len(s) for s in self.codes)

    def prune(self, n: int) -> bool:
        """Forgets the strings no row of ``[0, n)`` holds any more (their codes renumbered);
        False when no row holds the key at all (the column can go)."""
        if self.tag is not None:
            tag, code = self.tag[:n], self.code[:n]
            if not (tag != _MISSING).any():
                return False
            is_str = tag == _STR
            used = np.unique(code[is_str])
        else:
            if not self.sparse:
                return False
            used = np.unique(np.fromiter((v[2] for v in self.sparse.values() if v[0] == _STR), dtype=np.int64))
        if len(used) == len(self.codes):
            return True
        renumber = np.zeros(max(len(self.codes), 1), dtype=np.int32)
        renumber[used] = np.arange(len(used), dtype=np.int32)
        kept = set(used.tolist())
        self.codes = {text: int(renumber[c]) for text, c in self.codes.items() if c in kept}
        if self.tag is not None:
            code[is_str] = renumber[code[is_str]]
        else:
            self.sparse = {r: (t, v, int(renumber[c]) if t == _STR else c) for r, (t, v, c) in self.sparse.items()}
        return True


class MetaColumns:
    """The metadata of an engine's rows, by key, in NumPy columns aligned with the rows.

    Kept by :class:`~kalos.engine.base.RowTable` in step with its own columns (append,
    compaction, growth), so a :class:`Where` becomes a row mask with a few vectorised passes.
    A key held by many rows (a 16th of the capacity, at least 1,024) gets dense columns of 13
    bytes a row (tag, float64, string code); a rarer one a dict of its rows.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._cols: dict[str, _Column] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._cols

    @property
    def keys(self) -> list[str]:
        return list(self._cols)

    def nbytes(self) -> int:
        """Bytes held (the sparse columns' estimated)."""
        return sum(c.nbytes() for c in self._cols.values())

    def _dense_at(self) -> int:
        return max(1024, self.capacity // 16)

    def resize(self, capacity: int) -> None:
        for col in self._cols.values():
            col.resize(capacity, self.size)
        self.capacity = capacity

    def write(self, rows: Iterable[int] | slice, metadatas: Sequence[Mapping[str, Any] | None]) -> None:
        """Sets rows ``rows`` (a slice or row numbers, one per entry of ``metadatas``) to
        ``metadatas``, replacing whatever they held."""
        if isinstance(rows, slice):
            row_list: Sequence[int] = range(rows.start, rows.stop)
            stop = rows.stop
            fresh = rows.start >= self.size  # appended rows: nothing to clear
        else:
            row_list = [int(r) for r in rows]
            stop = max(row_list) + 1 if row_list else 0
            fresh = False
        if len(row_list) != len(metadatas):
            raise InvalidArgument(f"{len(metadatas)} metadata entries for {len(row_list)} rows")
        cols = self._cols
        if not fresh and len(row_list):
            idx = np.asarray(row_list, dtype=np.int64)
            row_set: set[int] | None = None
            for col in cols.values():
                if col.tag is not None:
                    col.tag[idx] = _MISSING
                elif len(col.sparse) < len(row_list):  # the cheaper side: many one-off keys stay cheap
                    if row_set is None:
                        row_set = set(row_list)
                    col.sparse = {r: v for r, v in col.sparse.items() if r not in row_set}
                elif col.sparse:
                    for r in row_list:
                        col.sparse.pop(r, None)
        touched: set[str] = set()
        for row, meta in zip(row_list, metadatas):
            if not meta:
                continue
            for key, value in meta.items():
                col = cols.get(key)
                if col is None:
                    col = cols[key] = _Column()
                tag, val = _classify(value)
                code = 0
                if tag == _STR:
                    code = col.codes.get(val)
                    if code is None:
                        code = col.codes[val] = len(col.codes)
                    val = 0.0
                elif tag == _OTHER:
                    val = 0.0
                if col.tag is not None:
                    col.tag[row], col.num[row], col.code[row] = tag, val, code
                else:
                    col.sparse[row] = (tag, val, code)
                    touched.add(key)
        dense_at = self._dense_at()
        for key in touched:
            col = cols[key]
            if len(col.sparse) >= dense_at:
                col.densify(self.capacity)
        self.size = max(self.size, stop)

    def compact(self, keep: np.ndarray) -> None:
        """Moves row ``keep[i]`` to row ``i`` (``keep`` increasing), as RowTable.compact does."""
        n = len(keep)
        new_of: list[int] | None = None  # old row -> new row (-1: dropped), made on first need
        for col in self._cols.values():
            if col.tag is not None:
                for arr in (col.tag, col.num, col.code):
                    arr[:n] = arr[keep]
                col.tag[n : self.size] = _MISSING
            elif col.sparse:
                if new_of is None:
                    mapping = np.full(max(self.size, 1), -1, dtype=np.int64)
                    mapping[keep] = np.arange(n)
                    new_of = mapping.tolist()
                col.sparse = {new_of[r]: v for r, v in col.sparse.items() if new_of[r] >= 0}
        self.size = n
        # Keys and strings of rows that are gone go too: a store whose memories come and go
        # with one-off keys or values (a run id, a session) grew by every one ever written,
        # and each write of rows in place walked every column ever made.
        self._cols = {key: col for key, col in self._cols.items() if col.prune(n)}

    def row(self, row: int) -> dict[str, Any]:
        """The indexed scalar metadata of one row (strings, numbers as float, bools): tests."""
        out: dict[str, Any] = {}
        for key, col in self._cols.items():
            tag_a, num_a, code_a = col.arrays(row + 1)
            tag = int(tag_a[row])
            if tag == _STR:
                out[key] = next(s for s, c in col.codes.items() if c == code_a[row])
            elif tag == _NUM:
                out[key] = float(num_a[row])
            elif tag == _BOOL:
                out[key] = bool(num_a[row])
            elif tag == _OTHER:
                out[key] = None
        return out


def _mask(node: tuple, columns: MetaColumns, n: int) -> np.ndarray:
    kind = node[0]
    if kind == "and":
        out = np.ones(n, dtype=bool)
        for sub in node[1]:
            out &= _mask(sub, columns, n)
        return out
    if kind == "or":
        out = np.zeros(n, dtype=bool)
        for sub in node[1]:
            out |= _mask(sub, columns, n)
        return out
    if kind == "not":
        return ~_mask(node[1], columns, n)
    col = columns._cols.get(node[1])
    if col is None:  # no row holds the key: only $ne, $nin and $exists: false pass (all rows)
        if kind == "exists":
            passes = not node[2]
        elif kind == "in":
            passes = node[2]
        else:
            passes = node[2] == "$ne"
        return np.full(n, passes, dtype=bool)
    tag, num, code = col.arrays(n)
    if kind == "exists":
        present = tag != _MISSING
        return present if node[2] else ~present
    if kind == "in":
        hit = np.zeros(n, dtype=bool)
        strs = [col.codes[v] for t, v in node[3] if t == _STR and v in col.codes]
        nums = [v for t, v in node[3] if t == _NUM]
        bools = [v for t, v in node[3] if t == _BOOL]
        if strs:
            hit |= (tag == _STR) & np.isin(code, np.asarray(strs, dtype=np.int32))
        if nums:
            hit |= (tag == _NUM) & np.isin(num, np.asarray(nums, dtype=np.float64))
        if bools:
            hit |= (tag == _BOOL) & np.isin(num, np.asarray(bools, dtype=np.float64))
        return ~hit if node[2] else hit
    op, (otag, oval) = node[2], node[3]
    if op in ("$eq", "$ne"):
        if otag == _STR:
            c = col.codes.get(oval)
            eq = np.zeros(n, dtype=bool) if c is None else (tag == _STR) & (code == c)
        else:
            eq = (tag == otag) & (num == oval)
        return ~eq if op == "$ne" else eq
    is_num = tag == _NUM
    if op == "$gt":
        return is_num & (num > oval)
    if op == "$gte":
        return is_num & (num >= oval)
    if op == "$lt":
        return is_num & (num < oval)
    return is_num & (num <= oval)
