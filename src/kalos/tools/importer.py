"""``kalos import``: memories from a JSONL, CSV, plain-text or Parquet file, validated whole, then
imported in batches that can be resumed.

Each row has a text, and optionally a vector, a metadata object, a namespace and a key (a row whose
key its namespace holds replaces that memory, as with ``Client.add(keys=)``); options name
the columns. A plain ``.txt`` file is one memory per line (blank lines skipped). CSV and
JSONL may start with a UTF-8 byte-order mark (Excel's "CSV UTF-8" writes one). A row without a vector is embedded with the client's embedder (the packaged
MiniLM by default); a row with one is stored as given (its text, if any, is kept beside it).

1. **Validate everything first.** The whole file is read and every row checked (types, vector
   length against the store, finite non-zero vectors, metadata a JSON object, namespace valid).
   If any row is malformed, :class:`ImportValidationError` lists them by line number (row number
   for Parquet) and *nothing* is imported.
2. **Import in batches.** Rows go to the sidecar ``batch`` at a time, each add one transaction.
   After each, the progress file records how many rows (a prefix of the file) are committed.
3. **Resume.** The progress file (``FILE.kalos-progress`` beside the input, see
   :func:`progress_path`) keeps one record per target store, each keyed by the input's absolute
   path, size and mtime; ``resume=True`` skips the rows it records as committed, and a second
   import of the same file into a store that has it is refused, whatever other stores the file
   went into meanwhile. Before each add it also records the batch as *pending* with the
   namespace's live count, so an import killed between the sidecar's commit and the progress
   write still resumes without duplicating the batch.

The embedder is loaded only when a row that needs it is reached (not at all for a finished
import that is resumed, or for rows that all carry vectors), and its load time is reported
apart from the import's rate.
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
from kalos.validation import check_keys, check_namespace  # the store's own rules, so validation agrees with the add

__all__ = [
    "Columns",
    "ImportInterrupted",
    "ImportSummary",
    "ImportValidationError",
    "ValidationReport",
    "FORMATS",
    "detect_format",
    "import_file",
    "progress_path",
    "validate_file",
]

FORMATS = ("jsonl", "csv", "tsv", "text", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv",
             ".txt": "text", ".text": "text", ".parquet": "parquet", ".pq": "parquet"}
_PROGRESS_FORMAT = "kalos-import-progress"
# Version 2 keeps a record per target store ("imports"); version 1 held one record, for the
# store imported into last, and so forgot the others (issue #20). Version 1 files are read.
_PROGRESS_VERSION = 2
# "utf-8-sig" reads UTF-8 and drops a leading byte-order mark, which would otherwise stick to
# the first column's name (or make the first JSON line invalid).
_TEXT_ENCODING = "utf-8-sig"
_PROGRESS_SUFFIX = ".kalos-progress"
#: Rows validated or imported per Parquet read.
_PARQUET_BATCH = 8192


class ImportValidationError(InvalidArgument):
    """The file has malformed rows (listed in the message, with line numbers); nothing was imported."""

    def __init__(self, message: str, errors: list[tuple[str, str]], total_errors: int) -> None:
        super().__init__(message)
        self.errors = errors
        self.total_errors = total_errors


class ImportInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGINT) during the adds: ``committed`` of ``rows`` rows are stored and recorded
    in ``progress_file``, so ``resume=True`` (``--resume``) imports the rest."""

    def __init__(self, committed: int, rows: int, progress_file: Path) -> None:
        super().__init__(f"interrupted after {committed:,} of {rows:,} rows")
        self.committed, self.rows, self.progress_file = committed, rows, progress_file


@dataclasses.dataclass(frozen=True)
class Columns:
    """Which column holds what. ``metadata_fields`` are plain columns folded into the metadata."""

    text: str = "text"
    vector: str = "vector"
    metadata: str = "metadata"
    namespace: str = "namespace"
    metadata_fields: tuple[str, ...] = ()
    #: The caller's own id of the memory: a row whose key its namespace already holds replaces
    #: that memory (an upsert, as Client.add with keys=); rows without one are plain adds.
    key: str = "key"


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    rows: int
    to_embed: int
    namespaces: dict[str, int]
    #: Position (0-based, among the rows) of the last row without a vector; -1 when none lacks one.
    last_to_embed: int = -1


@dataclasses.dataclass(frozen=True)
class ImportSummary:
    """What an import did. ``seconds`` is the whole call; ``load_seconds`` of it went to loading
    the embedder (a one-off per process), which :attr:`rows_per_s` leaves out."""

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
    load_seconds: float = 0.0

    @property
    def rows_per_s(self) -> float:
        """Rows imported per second of the import itself: validating, embedding, adding."""
        working = self.seconds - self.load_seconds
        return self.imported / working if working > 0 else math.inf

    def describe(self) -> str:
        parts = [f"imported {self.imported:,} of {self.rows:,} rows from {self.path} in {self.seconds:.1f} s "
                 f"({self.rows_per_s:,.0f} rows/s"
                 + (f", not counting {self.load_seconds:.1f} s loading the embedder" if self.load_seconds else "")
                 + ")"]
        if self.skipped:
            parts.append(f"skipped {self.skipped:,} rows imported by an earlier run")
        if self.embedded:
            working = self.seconds - self.load_seconds
            share = 100 * self.embed_seconds / working if working > 0 else 0.0
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
    with path.open(encoding=_TEXT_ENCODING, errors="strict", newline="") as f:
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


def _read_lines(path: Path, text_column: str) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """A plain text file: each non-blank line is one memory's text (its line ending removed).

    Read as bytes and decoded a line at a time, so that a line that is not UTF-8 is reported
    by its own number (a text stream fails on the whole buffered block)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a byte-order mark
                raw = raw[3:]
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield f"line {number}", f"not UTF-8 ({exc.reason} at byte {exc.start + 1})"
                continue
            if text.strip():
                yield f"line {number}", {text_column: text}


def _read_csv(path: Path, delimiter: str) -> Iterator[tuple[str, dict[str, Any] | str]]:
    with path.open(encoding=_TEXT_ENCODING, errors="strict", newline="") as f:
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
        with path.open(encoding=_TEXT_ENCODING, newline="") as f:
            return next(csv.reader(f, delimiter=delimiter), None)
    except (csv.Error, UnicodeDecodeError):
        return None


def _parquet_file(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidArgument("reading Parquet needs pyarrow: pip install 'kalos-recall[parquet]'") from None
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
    """The column names of a CSV/TSV/Parquet file (None for JSONL, whose keys vary per row, and
    for plain text, which is all text)."""
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
    if fmt == "text":
        return _read_lines(path, columns.text)
    wanted = [columns.text, columns.vector, columns.metadata, columns.namespace, columns.key, *columns.metadata_fields]
    return _read_parquet(path, wanted)


# -- one row: validated and converted ---------------------------------------------------------


@dataclasses.dataclass
class _Row:
    text: str | None
    vector: np.ndarray | None
    metadata: dict[str, Any] | None
    namespace: str
    key: str | None = None


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

    key = raw.get(columns.key)
    if key is not None:
        if not isinstance(key, str):
            raise ValueError(f"{columns.key!r} must be a string, got {type(key).__name__}")
        try:
            check_keys([key])
        except InvalidArgument as exc:
            raise ValueError(f"{columns.key!r}: {str(exc).replace('keys[0] ', '')}") from None
    return _Row(text, vector, metadata, namespace, key)


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
    last_to_embed = -1
    namespaces: dict[str, int] = {}
    key_rows: dict[tuple[str, str], str] = {}
    for where, raw in _records(path, fmt, columns):
        rows += 1
        if isinstance(raw, str):
            problem = raw
        else:
            try:
                row = _coerce(raw, columns, default_namespace, dim)
                if row.key is not None:
                    # Two rows of one key would leave whichever came last: ambiguous, refused.
                    first = key_rows.setdefault((row.namespace, row.key), where)
                    if first != where:
                        raise ValueError(f"key {row.key!r} is also on {first} (namespace {row.namespace!r})")
            except ValueError as exc:
                problem = str(exc)
            else:
                if row.vector is None:
                    to_embed += 1
                    last_to_embed = rows - 1
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
    return ValidationReport(rows, to_embed, namespaces, last_to_embed)


# -- progress ---------------------------------------------------------------------------------


def progress_path(path: str | os.PathLike[str]) -> Path:
    """``FILE.kalos-progress`` beside the input; in ``$KALOS_HOME/imports/`` if that folder is read-only."""
    path = Path(path).resolve()
    if os.access(path.parent, os.W_OK):
        return path.with_name(path.name + _PROGRESS_SUFFIX)
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    return default_store_path().parent / "imports" / f"{path.name}-{digest}{_PROGRESS_SUFFIX}"


def _write_progress(where: Path, records: dict[str, dict[str, Any]]) -> None:
    """Writes the records of every target store (``records[target]``) atomically."""
    where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = where.with_name(where.name + ".tmp")
    document = {"format": _PROGRESS_FORMAT, "version": _PROGRESS_VERSION, "updated_at": time.time(),
                "imports": records}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(document, indent=1).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, where)


def _read_progress(where: Path) -> dict[str, dict[str, Any]]:
    """The records of the progress file by target store ({} when there is no file)."""
    try:
        document = json.loads(where.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"progress file {where} is unreadable ({exc}); remove it or pass --restart") from None
    if not isinstance(document, dict) or document.get("format") != _PROGRESS_FORMAT:
        raise InvalidArgument(f"{where} is not a kalos import progress file; remove it or pass --restart")
    if document.get("version") == 1:  # one record, of the store imported into last
        return {str(document.get("target")): document}
    records = document.get("imports")
    if document.get("version") != _PROGRESS_VERSION or not isinstance(records, dict) or not all(
            isinstance(r, dict) for r in records.values()):
        raise InvalidArgument(f"{where} is a kalos import progress file of an unknown version "
                              f"{document.get('version')!r}; remove it or pass --restart")
    return records


def _progress_bar(total: int, done: int, stream: TextIO | None) -> Any:
    """tqdm on ``stream`` (None: silent): redrawn in place on a terminal; in a log, redrawn at
    most every 5 s (tqdm writes the final state when closed whatever the interval)."""
    from tqdm import tqdm

    tty = stream is not None and stream.isatty()
    return tqdm(total=total, initial=done, desc="importing", unit=" rows", file=stream, disable=stream is None,
                mininterval=0.1 if tty else 5.0, dynamic_ncols=tty, unit_scale=False)


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
    ignores what the progress file records for this store (its rows would be imported again).
    ``progress`` is the stream for the progress bars, the embedder's load included (None:
    silent). Raises :class:`ImportValidationError` (nothing imported) for malformed rows.
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
    try:
        records = _read_progress(where)
    except InvalidArgument:
        if not restart:
            raise
        records = {}  # --restart over an unreadable file: what it held is lost either way
    record = None if restart else records.get(target)
    if record is not None:
        same = all(record.get(k) == v for k, v in key.items())
        if not same:
            if resume:
                raise InvalidArgument(
                    f"cannot resume: progress file {where} records an import into {target} of another version "
                    f"of {path} (size/mtime changed); pass --restart to import from the start"
                )
            record = None  # a stale record of another file version: start afresh
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
        record = {**key, "target": target, "options": options, "rows": report.rows, "committed": 0,
                  "pending": None}
    records[target] = record
    committed = _settle_pending(client, record)
    skipped = committed

    embedder: Any = None
    load_s = 0.0
    if report.last_to_embed >= committed:  # not for rows that all carry vectors, nor a finished import
        from kalos.client.embed import load_progress

        t = time.perf_counter()
        with load_progress(progress):
            embedder = client.embedder  # loads the model, checks its dimension before anything is added
        load_s = time.perf_counter() - t
    _write_progress(where, records)  # after the load: an embedder that fails to load leaves no record

    embed_s = add_s = 0.0
    embedded = imported = 0
    namespaces: dict[str, int] = {}
    pending_rows: list[_Row] = []
    index = 0

    def flush(bar: Any) -> None:
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
        # One add per run of rows that share a namespace and either all have keys or none
        # does (an add takes keys for all its rows or for none).
        while start < len(rows):
            ns, keyed = rows[start].namespace, rows[start].key is not None
            stop = start
            while stop < len(rows) and rows[stop].namespace == ns and (rows[stop].key is not None) == keyed:
                stop += 1
            t = time.perf_counter()
            record["pending"] = {"start": committed, "stop": committed + stop - start, "namespace": ns,
                                 "count_before": client.stats()["namespaces"].get(ns, 0),
                                 **({"keyed": True} if keyed else {})}
            _write_progress(where, records)
            client.add(vectors[start:stop], texts=[r.text for r in rows[start:stop]],
                       metadata=[r.metadata for r in rows[start:stop]], namespace=ns,
                       keys=[r.key for r in rows[start:stop]] if keyed else None)
            committed += stop - start
            record["committed"], record["pending"] = committed, None
            _write_progress(where, records)
            add_s += time.perf_counter() - t
            imported += stop - start
            namespaces[ns] = namespaces.get(ns, 0) + stop - start
            start = stop
        bar.update(len(rows))
        pending_rows.clear()

    if committed < report.rows:
        if _file_key(path) != key:
            raise InvalidArgument(f"{path} changed while it was being validated; run the import again")
        bar = _progress_bar(report.rows, committed, progress)
        try:
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
                    flush(bar)
            if pending_rows:
                flush(bar)
        except KeyboardInterrupt as exc:
            # The caller is told how far it got (a batch interrupted mid-add is settled by the
            # pending record on resume).
            raise ImportInterrupted(committed, report.rows, where) from exc
        finally:
            bar.close()
    return ImportSummary(
        path=str(path), rows=report.rows, imported=imported, skipped=skipped, embedded=embedded,
        namespaces=namespaces, seconds=time.perf_counter() - started, embed_seconds=embed_s, add_seconds=add_s,
        progress_file=str(where), load_seconds=load_s,
    )


def _settle_pending(client: Any, record: dict[str, Any]) -> int:
    """Decides whether the batch an interrupted import left *pending* was committed; returns the
    committed row count. The namespace's live count tells, unless someone else wrote to it."""
    pending = record.get("pending")
    committed = int(record.get("committed", 0))
    if not pending:
        return committed
    if pending.get("keyed"):
        # Upserts replace rather than add, so the count cannot tell; adding the batch again is
        # harmless (each key ends with the same row), so it is taken as not committed.
        record["pending"] = None
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
