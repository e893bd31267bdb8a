"""``kalos import``: memories from a JSONL, CSV or Parquet file, validated whole, then imported in
batches that can be resumed.

Each row has a text, and optionally a vector, a metadata object and a namespace; options name
the columns. A row without a vector is embedded with the client's embedder (the packaged
MiniLM by default); a row with one is stored as given (its text, if any, is kept beside it).

1. **Validate everything first.** The whole file is read and every row checked (types, vector
   length against the store, finite non-zero vectors, metadata a JSON object, namespace valid).
   If any row is malformed, :class:`ImportValidationError` lists them by line number (row number
   for Parquet) and *nothing* is imported.
2. **Import in batches.** Rows go to the sidecar ``batch`` at a time, each add one transaction.
   After each, the progress file records how many rows (a prefix of the file) are committed.
3. **Resume.** The progress file (``FILE.kalos-progress`` beside the input, see
   :func:`progress_path`) is keyed by the input's absolute path, size and mtime and by the target
   store; ``resume=True`` skips the rows it records as committed. Before each add it also records
   the batch as *pending* with the namespace's live count, so an import killed between the
   sidecar's commit and the progress write still resumes without duplicating the batch.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

import numpy as np

from kalos.config import default_store_path
from kalos.errors import InvalidArgument, KalosError
from kalos.store import check_namespace  # the store's own rule, so validation agrees with the add

__all__ = [
    "Columns",
    "ImportSummary",
    "ImportValidationError",
    "ValidationReport",
    "FORMATS",
    "detect_format",
    "import_file",
    "progress_path",
    "validate_file",
]

FORMATS = ("jsonl", "csv", "tsv", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv",
             ".parquet": "parquet", ".pq": "parquet"}
_PROGRESS_FORMAT = "kalos-import-progress"
_PROGRESS_VERSION = 1
_PROGRESS_SUFFIX = ".kalos-progress"
#: Rows validated or imported per Parquet read.
_PARQUET_BATCH = 8192


class ImportValidationError(InvalidArgument):
    """The file has malformed rows (listed in the message, with line numbers); nothing was imported."""

    def __init__(self, message: str, errors: list[tuple[str, str]], total_errors: int) -> None:
        super().__init__(message)
        self.errors = errors
        self.total_errors = total_errors


@dataclasses.dataclass(frozen=True)
class Columns:
    """Which column holds what. ``metadata_fields`` are plain columns folded into the metadata."""

    text: str = "text"
    vector: str = "vector"
    metadata: str = "metadata"
    namespace: str = "namespace"
    metadata_fields: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    rows: int
    to_embed: int
    namespaces: dict[str, int]


@dataclasses.dataclass(frozen=True)
class ImportSummary:
    path: str
    rows: int
    imported: int
    skipped: int
    embedded: int
    namespaces: dict[str, int]
    seconds: float
    embed_seconds: float
    add_seconds: float
    progress_file: str

    @property
    def rows_per_s(self) -> float:
        return self.imported / self.seconds if self.seconds > 0 else math.inf

    def describe(self) -> str:
        parts = [f"imported {self.imported:,} of {self.rows:,} rows from {self.path} in {self.seconds:.1f} s "
                 f"({self.rows_per_s:,.0f} rows/s)"]
        if self.skipped:
            parts.append(f"skipped {self.skipped:,} rows imported by an earlier run")
        if self.embedded:
            share = 100 * self.embed_seconds / self.seconds if self.seconds > 0 else 0.0
            parts.append(f"embedded {self.embedded:,} texts ({self.embed_seconds:.1f} s, {share:.0f}% of the time)")
        parts.append(f"adds took {self.add_seconds:.1f} s")
        if self.namespaces:
            parts.append("namespaces: " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.namespaces.items())))
        return "; ".join(parts)


def detect_format(path: Path, fmt: str | None = None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise InvalidArgument(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        return fmt
    found = _SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise InvalidArgument(f"cannot tell the format of {path} from its suffix; pass --format ({', '.join(FORMATS)})")
    return found


# -- reading: (location, raw record or a parse error) per row ---------------------------------


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    with path.open(encoding="utf-8", errors="strict", newline="") as f:
        number = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as exc:
                yield f"line {number + 1}", f"not UTF-8 ({exc.reason})"
                return
            if not line:
                return
            number += 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"line {number}", f"not valid JSON ({exc.msg} at column {exc.colno})"
                continue
            if not isinstance(row, dict):
                yield f"line {number}", f"expected a JSON object, got {type(row).__name__}"
                continue
            yield f"line {number}", row


def _read_csv(path: Path, delimiter: str) -> Iterator[tuple[str, dict[str, Any] | str]]:
    with path.open(encoding="utf-8", errors="strict", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        try:
            header = next(reader)
        except StopIteration:
            return
        except (csv.Error, UnicodeDecodeError) as exc:
            yield "line 1", f"unreadable header ({exc})"
            return
        if len(set(header)) != len(header):
            yield "line 1", f"the header names a column twice: {header}"
            return
        while True:
            start = reader.line_num + 1
            try:
                values = next(reader)
            except StopIteration:
                return
            except UnicodeDecodeError as exc:
                yield f"line {start}", f"not UTF-8 ({exc.reason})"
                return
            except csv.Error as exc:
                yield f"line {start}", f"not valid CSV ({exc})"
                continue
            if not values:
                continue  # a blank line
            if len(values) != len(header):
                yield f"line {start}", f"{len(values)} fields where the header has {len(header)}"
                continue
            # Empty CSV cells mean "absent".
            yield f"line {start}", {k: v for k, v in zip(header, values) if v != ""}


def _csv_header(path: Path, delimiter: str) -> list[str] | None:
    try:
        with path.open(encoding="utf-8", newline="") as f:
            return next(csv.reader(f, delimiter=delimiter), None)
    except (csv.Error, UnicodeDecodeError):
        return None


def _parquet_file(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidArgument("reading Parquet needs pyarrow: pip install 'kalos[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError kinds
        raise InvalidArgument(f"{path} is not a readable Parquet file: {exc}") from None


def _read_parquet(path: Path, columns: list[str]) -> Iterator[tuple[str, dict[str, Any] | str]]:
    pf = _parquet_file(path)
    names = set(pf.schema_arrow.names)
    wanted = [c for c in columns if c in names]
    number = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=wanted):
        for row in batch.to_pylist():
            number += 1
            yield f"row {number}", {k: v for k, v in row.items() if v is not None}


def _header(path: Path, fmt: str) -> list[str] | None:
    """The column names of a CSV/TSV/Parquet file (None for JSONL, whose keys vary per row)."""
    if fmt in ("csv", "tsv"):
        return _csv_header(path, "," if fmt == "csv" else "\t")
    if fmt == "parquet":
        return list(_parquet_file(path).schema_arrow.names)
    return None


def _records(path: Path, fmt: str, columns: Columns) -> Iterator[tuple[str, dict[str, Any] | str]]:
    if fmt == "jsonl":
        return _read_jsonl(path)
    if fmt in ("csv", "tsv"):
        return _read_csv(path, "," if fmt == "csv" else "\t")
    wanted = [columns.text, columns.vector, columns.metadata, columns.namespace, *columns.metadata_fields]
    return _read_parquet(path, wanted)


# -- one row: validated and converted ---------------------------------------------------------


@dataclasses.dataclass
class _Row:
    text: str | None
    vector: np.ndarray | None
    metadata: dict[str, Any] | None
    namespace: str


def _coerce(raw: dict[str, Any], columns: Columns, default_namespace: str, dim: int) -> _Row:
    """The row, or :class:`ValueError` saying what is wrong with it."""
    text = raw.get(columns.text)
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{columns.text!r} must be a string, got {type(text).__name__}")
    if text is not None and not text.strip():
        text = None

    vector = raw.get(columns.vector)
    if isinstance(vector, str):  # CSV: a JSON array in a cell
        try:
            vector = json.loads(vector)
        except json.JSONDecodeError:
            raise ValueError(f"{columns.vector!r} is not a JSON array of numbers") from None
    if vector is not None:
        # One C-level conversion instead of a Python check per element; strings, nested lists,
        # None and all-boolean lists end up with a dtype other than int/float and are refused.
        try:
            array = np.asarray(vector) if isinstance(vector, (list, tuple)) else None
        except ValueError:  # ragged nesting
            array = None
        if array is None or array.ndim != 1 or array.dtype.kind not in "iuf":
            raise ValueError(f"{columns.vector!r} must be a list of numbers")
        array = array.astype(np.float64, copy=False)
        if len(array) != dim:
            raise ValueError(f"{columns.vector!r} has {len(array)} numbers; the store holds dimension {dim}")
        if not np.isfinite(array).all():
            raise ValueError(f"{columns.vector!r} contains NaN or infinity")
        if not array.any():
            raise ValueError(f"{columns.vector!r} is all zeros (no direction to compare by cosine)")
        vector = array.astype(np.float32)
    if text is None and vector is None:
        raise ValueError(f"no text to embed ({columns.text!r} is missing or empty) and no {columns.vector!r}")

    metadata = raw.get(columns.metadata)
    if isinstance(metadata, str):  # CSV: a JSON object in a cell
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            raise ValueError(f"{columns.metadata!r} is not a JSON object") from None
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"{columns.metadata!r} must be an object, got {type(metadata).__name__}")
    extra = {f: raw[f] for f in columns.metadata_fields if f in raw}
    if extra:
        metadata = {**(metadata or {}), **extra}
    if metadata is not None:
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata is not storable as JSON ({exc})") from None
        if any(not isinstance(k, str) for k in metadata):
            raise ValueError("metadata keys must be strings")

    namespace = raw.get(columns.namespace, default_namespace)
    if not isinstance(namespace, str):
        raise ValueError(f"{columns.namespace!r} must be a string, got {type(namespace).__name__}")
    try:
        check_namespace(namespace)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return _Row(text, vector, metadata, namespace)


def _check_columns(path: Path, fmt: str, columns: Columns) -> None:
    header = _header(path, fmt)
    if header is None:
        return
    if columns.text not in header and columns.vector not in header:
        raise InvalidArgument(
            f"{path} has neither a text column {columns.text!r} nor a vector column {columns.vector!r} "
            f"(its columns: {', '.join(header) or 'none'}); name them with --text-column / --vector-column"
        )
    missing = [f for f in columns.metadata_fields if f not in header]
    if missing:
        raise InvalidArgument(f"{path} has no column {', '.join(map(repr, missing))} (its columns: {', '.join(header)})")


def validate_file(
    path: str | os.PathLike[str], *, dim: int, fmt: str | None = None, columns: Columns = Columns(),
    default_namespace: str = "default", max_errors: int = 20,
) -> ValidationReport:
    """Reads and checks every row; :class:`ImportValidationError` lists the malformed ones."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(f"{path} does not exist or is not a file")
    fmt = detect_format(path, fmt)
    _check_columns(path, fmt, columns)
    check_namespace(default_namespace)
    errors: list[tuple[str, str]] = []
    total_errors = rows = to_embed = 0
    namespaces: dict[str, int] = {}
    for where, raw in _records(path, fmt, columns):
        rows += 1
        if isinstance(raw, str):
            problem = raw
        else:
            try:
                row = _coerce(raw, columns, default_namespace, dim)
            except ValueError as exc:
                problem = str(exc)
            else:
                to_embed += row.vector is None
                namespaces[row.namespace] = namespaces.get(row.namespace, 0) + 1
                continue
        total_errors += 1
        if len(errors) < max_errors:
            errors.append((where, problem))
    if total_errors:
        listed = "\n".join(f"  {where}: {problem}" for where, problem in errors)
        more = f"\n  ... and {total_errors - len(errors)} more" if total_errors > len(errors) else ""
        raise ImportValidationError(
            f"{path}: {total_errors} of {rows} rows are malformed; nothing was imported:\n{listed}{more}",
            errors, total_errors,
        )
    if rows == 0:
        raise InvalidArgument(f"{path} holds no rows")
    return ValidationReport(rows, to_embed, namespaces)


# -- progress ---------------------------------------------------------------------------------


def progress_path(path: str | os.PathLike[str]) -> Path:
    """``FILE.kalos-progress`` beside the input; in ``$KALOS_HOME/imports/`` if that folder is read-only."""
    path = Path(path).resolve()
    if os.access(path.parent, os.W_OK):
        return path.with_name(path.name + _PROGRESS_SUFFIX)
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    return default_store_path().parent / "imports" / f"{path.name}-{digest}{_PROGRESS_SUFFIX}"


def _write_progress(where: Path, record: dict[str, Any]) -> None:
    where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = where.with_name(where.name + ".tmp")
    record["updated_at"] = time.time()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(record, indent=1).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, where)


def _read_progress(where: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(where.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"progress file {where} is unreadable ({exc}); remove it or pass --restart") from None
    if not isinstance(record, dict) or record.get("format") != _PROGRESS_FORMAT:
        raise InvalidArgument(f"{where} is not a kalos import progress file; remove it or pass --restart")
    return record


class _Bar:
    """A plain progress bar on a stream: redrawn in place on a terminal, a line per 10% elsewhere."""

    def __init__(self, total: int, start: int, stream: TextIO | None) -> None:
        self.total, self.start, self.stream = total, start, stream
        self.tty = stream is not None and stream.isatty()
        self.t0 = time.monotonic()
        self.last_draw = 0.0
        self.last_decile = start * 10 // max(total, 1)
        self.last_done = start

    def update(self, done: int, *, force: bool = False) -> None:
        if self.stream is None or (force and done == self.last_done and not self.tty):
            return
        now = time.monotonic()
        rate = (done - self.start) / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else math.inf
        eta_text = f"{eta:,.0f} s" if math.isfinite(eta) else "?"
        frac = done / max(self.total, 1)
        if self.tty:
            if not force and now - self.last_draw < 0.1:
                return
            filled = int(30 * frac)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done:,}/{self.total:,} rows "
                              f"{100 * frac:5.1f}%  {rate:,.0f} rows/s  ETA {eta_text}   ")
        else:
            decile = done * 10 // max(self.total, 1)
            if decile <= self.last_decile and not force:
                return
            self.last_decile = decile
            self.stream.write(f"{done:,}/{self.total:,} rows ({100 * frac:.0f}%), {rate:,.0f} rows/s, ETA {eta_text}\n")
        self.last_draw, self.last_done = now, done
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -- the import -------------------------------------------------------------------------------


def _file_key(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"input": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def import_file(
    client: Any, path: str | os.PathLike[str], *, fmt: str | None = None, columns: Columns = Columns(),
    default_namespace: str = "default", batch: int = 1000, resume: bool = False, restart: bool = False,
    progress_file: str | os.PathLike[str] | None = None, progress: TextIO | None = sys.stderr,
    max_errors: int = 20,
) -> ImportSummary:
    """Validates the whole file, then imports it through ``client`` in transactions of ``batch`` rows.

    ``resume`` continues an import the progress file records as unfinished; ``restart``
    ignores an existing progress file (its rows would be imported again). ``progress`` is the
    stream for the progress bar (None: silent). Raises :class:`ImportValidationError` (nothing
    imported) for malformed rows.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidArgument(f"batch must be an integer >= 1, got {batch!r}")
    if resume and restart:
        raise InvalidArgument("resume and restart exclude each other")
    path = Path(path)
    started = time.perf_counter()
    dim = client.dim
    report = validate_file(path, dim=dim, fmt=fmt, columns=columns, default_namespace=default_namespace,
                           max_errors=max_errors)
    fmt = detect_format(path, fmt)
    key = _file_key(path)
    target = str(client.stats()["store"])
    options = {"format": fmt, "columns": dataclasses.asdict(columns), "default_namespace": default_namespace}
    where = Path(progress_file) if progress_file is not None else progress_path(path)
    record = None if restart else _read_progress(where)
    if record is not None:
        same = all(record.get(k) == v for k, v in key.items()) and record.get("target") == target
        if not same:
            if resume:
                raise InvalidArgument(
                    f"cannot resume: progress file {where} is for another version of {path} (size/mtime "
                    f"changed) or another store ({record.get('target')}); pass --restart to import from the start"
                )
            record = None  # a stale record of another file version or store: start afresh
        elif not resume:
            done, rows = record.get("committed", 0), record.get("rows")
            if done >= rows:
                raise InvalidArgument(
                    f"{path} was already imported into {target} ({rows:,} rows, see {where}); "
                    "pass --restart to import it again (the rows would be stored twice)"
                )
            raise InvalidArgument(
                f"an earlier import of {path} into {target} stopped after {done:,} of {rows:,} rows "
                f"(see {where}); pass --resume to import the rest, or --restart to import everything again"
            )
    if record is None:
        record = {"format": _PROGRESS_FORMAT, "version": _PROGRESS_VERSION, **key, "target": target,
                  "options": options, "rows": report.rows, "committed": 0, "pending": None}
    committed = _settle_pending(client, record)
    skipped = committed
    embedder = client.embedder if report.to_embed else None  # loads the model, checks its dimension
    _write_progress(where, record)

    bar = _Bar(report.rows, committed, progress)
    embed_s = add_s = 0.0
    embedded = imported = 0
    namespaces: dict[str, int] = {}
    pending_rows: list[_Row] = []
    index = 0

    def flush() -> None:
        nonlocal committed, embed_s, add_s, embedded, imported
        rows = pending_rows
        need = [i for i, r in enumerate(rows) if r.vector is None]
        vectors = np.empty((len(rows), dim), np.float32)
        if need:
            t = time.perf_counter()
            vectors[need] = embedder.embed([rows[i].text for i in need])
            embed_s += time.perf_counter() - t
            embedded += len(need)
        for i, r in enumerate(rows):
            if r.vector is not None:
                vectors[i] = r.vector
        start = 0
        while start < len(rows):  # one add per run of rows that share a namespace
            ns = rows[start].namespace
            stop = start
            while stop < len(rows) and rows[stop].namespace == ns:
                stop += 1
            t = time.perf_counter()
            record["pending"] = {"start": committed, "stop": committed + stop - start, "namespace": ns,
                                 "count_before": client.stats()["namespaces"].get(ns, 0)}
            _write_progress(where, record)
            client.add(vectors[start:stop], texts=[r.text for r in rows[start:stop]],
                       metadata=[r.metadata for r in rows[start:stop]], namespace=ns)
            committed += stop - start
            record["committed"], record["pending"] = committed, None
            _write_progress(where, record)
            add_s += time.perf_counter() - t
            imported += stop - start
            namespaces[ns] = namespaces.get(ns, 0) + stop - start
            start = stop
        pending_rows.clear()
        bar.update(committed)

    try:
        if _file_key(path) != key:
            raise InvalidArgument(f"{path} changed while it was being validated; run the import again")
        for where_row, raw in _records(path, fmt, columns):
            if index < committed:
                index += 1
                continue
            index += 1
            try:
                if isinstance(raw, str):
                    raise ValueError(raw)
                pending_rows.append(_coerce(raw, columns, default_namespace, dim))
            except ValueError as exc:
                raise InvalidArgument(
                    f"{path} changed during the import ({where_row}: {exc}); {committed:,} rows are committed, "
                    f"see {where}"
                ) from None
            if len(pending_rows) >= batch:
                flush()
        if pending_rows:
            flush()
        bar.update(committed, force=True)
    finally:
        bar.close()
    return ImportSummary(
        path=str(path), rows=report.rows, imported=imported, skipped=skipped, embedded=embedded,
        namespaces=namespaces, seconds=time.perf_counter() - started, embed_seconds=embed_s, add_seconds=add_s,
        progress_file=str(where),
    )


def _settle_pending(client: Any, record: dict[str, Any]) -> int:
    """Decides whether the batch an interrupted import left *pending* was committed; returns the
    committed row count. The namespace's live count tells, unless someone else wrote to it."""
    pending = record.get("pending")
    committed = int(record.get("committed", 0))
    if not pending:
        return committed
    now = client.stats()["namespaces"].get(pending["namespace"], 0)
    size = pending["stop"] - pending["start"]
    if now == pending["count_before"] + size:
        committed = pending["stop"]
    elif now != pending["count_before"]:
        raise KalosError(
            f"cannot tell whether rows {pending['start']}..{pending['stop']} of the interrupted import were "
            f"committed: namespace {pending['namespace']!r} held {pending['count_before']:,} memories before that "
            f"batch and {now:,} now (other writers?). Check, then pass --restart or fix the progress file"
        )
    record["committed"], record["pending"] = committed, None
    return committed
