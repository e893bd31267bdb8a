"""Workloads, child-process workers and oracles shared by the reliability suites.

The oracle idea is Jepsen's: every client records each operation with its invocation and
completion times (``time.monotonic()``, one clock for every process of the host) and its
outcome; nothing is judged while the test runs. Afterwards:

* **Store snapshots** (read with :meth:`kalos.store.sqlite.Store.open` readonly while the sidecar is
  dead, right after each ``kill -9``) are checked against the operation log: every add
  acknowledged before the kill is there in full, every row in the store belongs to an add
  invoked before the kill and is complete (vector bytes, text, metadata, namespace), an add
  that was not acknowledged is there with all of its rows or none, and a delete is there
  entirely or not at all (and once acknowledged, forever).
* **Recalls** are checked against every state the store could have been in while the recall
  was in flight. For an item, ``add_inv``/``add_eff`` are the moments after which it may /
  must be present (invocation, acknowledgement or the first snapshot showing it), and
  ``del_inv``/``del_eff`` the same for its delete. A recall over ``[t0, t1]`` sees some state
  ``S`` with ``sure ⊆ S ⊆ possible``, where ``sure = add_eff < t0 and del_inv >= t1`` and
  ``possible = add_inv < t1 and del_eff >= t0``. The answer ``R`` is accepted iff it is the
  top-k of such an ``S``: ``R ⊆ possible``, scores are the float64 cosine of the query and each
  id (within 1e-5), best first, and no sure item outside ``R`` beats the worst of ``R`` (by
  more than a near-tie tolerance); with fewer than k hits, ``S = R``, so ``sure ⊆ R``.

Every item's content is a function of ``(seed, client, op, row)``, so the oracle regenerates
it instead of shipping vectors between processes: the text ``c<client>:op<op>:r<row>`` names
it, which is also how rows of adds that were never acknowledged are recognised.

No pytest or hypothesis import here: the module is what every 'spawn' child imports.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from kalos import Client
from kalos.errors import SidecarUnavailable
from kalos.ipc.channel import wake_pair
from kalos.ipc.control import PROTOCOL_VERSION, recv_frame, send_fd, send_frame
from kalos.store.sqlite import Store
from kalos.validation import normalise_rows

DIM = 8
BASE_CLIENT = 10_000  # the client number of the items a test loads before the workload starts
SCORE_TOL = 1e-5  # a returned score versus its float64 value
TIE_TOL = 5e-6  # float32 scores of two different items closer than this may come in either order
_TEXT = re.compile(r"c(\d+):op(\d+):r(\d+)")


# -- the workload: every item is a function of (seed, client, op, row) ----------------------------


class Workload:
    """Deterministic item contents, shared by the workers that add and the oracle that checks."""

    def __init__(self, seed: int, dim: int = DIM) -> None:
        self.seed = seed
        self.dim = dim
        self._unit: dict[tuple[int, int, int], np.ndarray] = {}

    def vectors(self, client: int, op: int, n: int) -> np.ndarray:
        # Row r depends on (client, op) only, not on n: a recaller can aim at row 0 of an add.
        rng = np.random.default_rng([self.seed, client, op])
        return rng.standard_normal((n, self.dim)).astype(np.float32)

    @staticmethod
    def namespace(client: int) -> str:
        return "default" if client == BASE_CLIENT else f"w{client}"

    @staticmethod
    def text(client: int, op: int, row: int) -> str:
        return f"c{client}:op{op}:r{row}"

    @staticmethod
    def metadata(client: int, op: int, row: int) -> dict[str, Any]:
        return {"c": client, "op": op, "r": row, "tags": ["é", row % 3], "nested": {"even": row % 2 == 0}}

    def batch(self, client: int, op: int, n: int) -> tuple[np.ndarray, list[str], list[dict[str, Any]]]:
        rows = range(n)
        return (self.vectors(client, op, n), [self.text(client, op, r) for r in rows],
                [self.metadata(client, op, r) for r in rows])

    def unit(self, client: int, op: int, n: int) -> np.ndarray:
        """The float32 unit vectors the sidecar stores for that add (same function, same batch)."""
        key = (client, op, n)
        if key not in self._unit:
            self._unit[key] = normalise_rows(self.vectors(client, op, n).copy(), what="vector", error=ValueError)
        return self._unit[key]


def parse_text(text: Any) -> tuple[int, int, int] | None:
    m = _TEXT.fullmatch(text) if isinstance(text, str) else None
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


# -- store snapshots ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoreRow:
    id: int
    namespace: str
    text: str | None
    metadata: dict | None
    vector: bytes


@dataclasses.dataclass
class Snapshot:
    t: float  # monotonic time by which the sidecar was dead (or stopped)
    rows: dict[int, StoreRow]
    integrity: str
    label: str = ""


def read_store(path: str | os.PathLike[str], *, t: float | None = None, label: str = "") -> Snapshot:
    """Every row of the store (Store.open readonly) and SQLite's integrity check."""
    taken = time.monotonic() if t is None else t
    rows: dict[int, StoreRow] = {}
    with Store.open(path, readonly=True) as store:
        integrity = store.integrity_check()
        for ids, vectors, _ns, _created in store.iter_rows():
            for item_id, vector, item in zip(ids.tolist(), vectors, store.get(ids)):
                if item is None:  # only with a concurrent writer; snapshots are taken without one
                    continue
                rows[item_id] = StoreRow(item_id, item.namespace, item.text, item.metadata, vector.tobytes())
    return Snapshot(taken, rows, integrity, label)


# -- the operation log -------------------------------------------------------------------------------


@dataclasses.dataclass
class AddOp:
    client: int
    op: int
    t0: float
    t1: float
    ok: bool
    ids: list[int] | None
    n: int


@dataclasses.dataclass
class DeleteOp:
    client: int
    op: int
    t0: float
    t1: float
    ok: bool
    ids: list[int]


@dataclasses.dataclass
class RecallOp:
    client: int
    op: int
    t0: float
    t1: float
    status: str
    queries: np.ndarray
    k: int
    namespace: str | None
    ids: list[np.ndarray] | None  # one array per query row (single recalls: unpadded)
    scores: list[np.ndarray] | None


def succeeded(op: AddOp | DeleteOp | RecallOp) -> bool:
    return op.status == "ok" if isinstance(op, RecallOp) else op.ok


def parse_records(records: Iterable[tuple]) -> tuple[list[AddOp], list[DeleteOp], list[RecallOp], list[tuple]]:
    """Splits worker records into adds, deletes and recalls; the fourth list: unexpected errors."""
    adds, deletes, recalls, errors = [], [], [], []
    for rec in records:
        kind, client, op, t0, t1, status = rec[:6]
        if status not in ("ok", "unavailable"):
            errors.append(rec[:6])
        if kind == "add":
            adds.append(AddOp(client, op, t0, t1, status == "ok", rec[6], rec[7]))
        elif kind == "delete":
            deletes.append(DeleteOp(client, op, t0, t1, status == "ok", list(rec[6])))
        elif kind == "recall":
            recalls.append(RecallOp(client, op, t0, t1, status, rec[6], rec[7], rec[8], rec[9], rec[10]))
    return adds, deletes, recalls, errors


# -- the store oracle -------------------------------------------------------------------------------


class History:
    """Adds, deletes and store snapshots of one test; checks the snapshots, then builds the item table."""

    def __init__(self, workload: Workload, adds: list[AddOp], deletes: list[DeleteOp], snapshots: list[Snapshot]):
        self.w = workload
        self.adds = {(a.client, a.op): a for a in adds}
        self.deletes = deletes
        self.snapshots = sorted(snapshots, key=lambda s: s.t)
        self.problems: list[str] = []
        self.stats = {"snapshots": len(self.snapshots), "rows_checked": 0, "acked_adds": 0, "unacked_adds": 0,
                      "unacked_adds_committed": 0, "acked_deletes": 0, "unacked_deletes": 0}
        self._deleted_by: dict[int, DeleteOp] = {}
        for d in deletes:
            for i in d.ids:
                if i in self._deleted_by:
                    self.problems.append(f"id {i} is deleted twice by the workload (a test bug)")
                self._deleted_by[i] = d

    def _problem(self, text: str) -> None:
        if len(self.problems) < 200:
            self.problems.append(text)

    def check_snapshots(self) -> None:
        committed_unacked: set[tuple[int, int]] = set()
        for a in self.adds.values():
            self.stats["acked_adds" if a.ok else "unacked_adds"] += 1
        for d in self.deletes:
            self.stats["acked_deletes" if d.ok else "unacked_deletes"] += 1
        gone_for_good: dict[int, float] = {}  # id -> time of the snapshot where its delete showed
        for snap in self.snapshots:
            where = f"snapshot {snap.label or snap.t}"
            if snap.integrity != "ok":
                self._problem(f"{where}: integrity_check says {snap.integrity!r}")
            present_by_op: dict[tuple[int, int], list[int]] = {}
            for item_id, row in snap.rows.items():
                self.stats["rows_checked"] += 1
                origin = parse_text(row.text)
                if origin is None:
                    self._problem(f"{where}: row {item_id} has text {row.text!r}, written by no one")
                    continue
                client, op, r = origin
                add = self.adds.get((client, op))
                if add is None or add.t0 >= snap.t:
                    self._problem(f"{where}: row {item_id} ({row.text}) belongs to no add invoked before the kill")
                    continue
                if add.ok and add.ids is not None and add.ids[r] != item_id:
                    self._problem(f"{where}: {row.text} has id {item_id}, but the add acknowledged id {add.ids[r]}")
                self._check_row(where, row, client, op, r, add.n)
                present_by_op.setdefault((client, op), []).append(item_id)
                if item_id in gone_for_good:
                    self._problem(f"{where}: id {item_id} is back after its delete showed in an earlier snapshot")
            for key, add in self.adds.items():
                if add.t0 >= snap.t:
                    continue
                present = present_by_op.get(key, [])
                if add.ok and add.t1 < snap.t:
                    expected = [i for i in add.ids if not (i in self._deleted_by and self._deleted_by[i].t0 < snap.t)]
                    lost = sorted(set(expected) - set(present))
                    if lost:
                        self._problem(f"{where}: acknowledged add c{add.client}:op{add.op} lost ids {lost[:10]}")
                elif len(present) not in (0, add.n):
                    self._problem(f"{where}: unacknowledged add c{add.client}:op{add.op} is half present: "
                                  f"{len(present)} of {add.n} rows")
                elif present and not add.ok:
                    committed_unacked.add(key)
            for d in self.deletes:
                if d.t0 >= snap.t:
                    continue
                still = [i for i in d.ids if i in snap.rows]
                if d.ok and d.t1 < snap.t and still:
                    self._problem(f"{where}: acknowledged delete c{d.client}:op{d.op} left ids {still[:10]}")
                elif len(still) not in (0, len(d.ids)):
                    self._problem(f"{where}: unacknowledged delete c{d.client}:op{d.op} is half done: "
                                  f"{len(still)} of {len(d.ids)} ids remain")
                if not still:
                    for i in d.ids:
                        gone_for_good.setdefault(i, snap.t)
        self.stats["unacked_adds_committed"] = len(committed_unacked)

    def _check_row(self, where: str, row: StoreRow, client: int, op: int, r: int, n: int) -> None:
        expected_ns = self.w.namespace(client)
        if row.namespace != expected_ns:
            self._problem(f"{where}: {row.text} is in namespace {row.namespace!r}, not {expected_ns!r}")
        if row.metadata != self.w.metadata(client, op, r):
            self._problem(f"{where}: {row.text} has metadata {row.metadata!r}")
        if r >= n or row.vector != self.w.unit(client, op, n)[r].tobytes():
            self._problem(f"{where}: {row.text} does not hold the vector that was added (torn or foreign)")

    # -- the item table of the recall oracle --

    def item_table(self) -> "ItemTable":
        """Every item that ever existed, with the four moments the recall oracle needs."""
        info: dict[int, list] = {}  # id -> [client, op, row, n, add_inv, add_eff, del_inv, del_eff]
        inf = float("inf")
        for a in self.adds.values():
            if a.ok:
                for r, i in enumerate(a.ids):
                    info[i] = [a.client, a.op, r, a.n, a.t0, a.t1, inf, inf]
        for snap in self.snapshots:
            for i, row in snap.rows.items():
                origin = parse_text(row.text)
                if origin is None or (origin[0], origin[1]) not in self.adds:
                    continue
                a = self.adds[(origin[0], origin[1])]
                entry = info.setdefault(i, [origin[0], origin[1], origin[2], a.n, a.t0, inf, inf, inf])
                entry[5] = min(entry[5], snap.t)  # committed by the kill: surely there afterwards
        for d in self.deletes:
            for i in d.ids:
                if i not in info:
                    continue
                entry = info[i]
                entry[6] = min(entry[6], d.t0)
                if d.ok:
                    entry[7] = min(entry[7], d.t1)
                else:
                    for snap in self.snapshots:
                        if snap.t > d.t0 and i not in snap.rows:
                            entry[7] = min(entry[7], snap.t)
                            break
        ids = np.array(sorted(info), dtype=np.int64)
        table = ItemTable(ids)
        if len(ids):
            cols = np.array([info[i][4:] for i in ids.tolist()], dtype=np.float64)
            table.add_inv, table.add_eff, table.del_inv, table.del_eff = cols.T.copy()
            table.unit = np.stack([self.w.unit(info[i][0], info[i][1], info[i][3])[info[i][2]]
                                   for i in ids.tolist()]).astype(np.float64)
            table.namespaces = np.array([self.w.namespace(info[i][0]) for i in ids.tolist()], dtype=object)
        return table


class ItemTable:
    """Item ids, their unit vectors (float64 of the stored float32), namespaces and the four moments."""

    def __init__(self, ids: np.ndarray) -> None:
        n = len(ids)
        self.ids = ids
        self.unit = np.zeros((n, DIM))
        self.namespaces = np.array([], dtype=object)
        self.add_inv = self.add_eff = self.del_inv = self.del_eff = np.zeros(n)

    @classmethod
    def static(cls, ids: np.ndarray, unit: np.ndarray, namespaces: list[str]) -> "ItemTable":
        order = np.argsort(ids)
        table = cls(np.asarray(ids, np.int64)[order])
        table.unit = np.asarray(unit, np.float64)[order]
        table.namespaces = np.asarray(namespaces, dtype=object)[order]
        n = len(ids)
        table.add_inv = np.full(n, -np.inf)
        table.add_eff = np.full(n, -np.inf)
        table.del_inv = np.full(n, np.inf)
        table.del_eff = np.full(n, np.inf)
        return table

    def index_of(self, ids: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.ids, ids)
        pos = np.minimum(pos, max(len(self.ids) - 1, 0))
        found = (self.ids[pos] == ids) if len(self.ids) else np.zeros(len(ids), bool)
        return np.where(found, pos, -1)


@dataclasses.dataclass
class RecallVerdict:
    rows: int = 0
    recalls: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    cross_delivered: int = 0
    unavailable: int = 0


def check_recalls(table: ItemTable, recalls: list[RecallOp], *, score_tol: float = SCORE_TOL,
                  tie_tol: float = TIE_TOL) -> RecallVerdict:
    """Judges every answered recall row against the states the store could have been in."""
    verdict = RecallVerdict()
    bad_rows: list[tuple[RecallOp, int]] = []
    for rec in recalls:
        if rec.status != "ok":
            verdict.unavailable += 1
            continue
        verdict.recalls += 1
        ns_ok = np.ones(len(table.ids), bool) if rec.namespace is None else table.namespaces == rec.namespace
        sure = (table.add_eff < rec.t0) & (table.del_inv >= rec.t1) & ns_ok
        possible = (table.add_inv < rec.t1) & (table.del_eff >= rec.t0) & ns_ok
        for qi, q in enumerate(np.atleast_2d(rec.queries)):
            verdict.rows += 1
            problem = check_row(q, rec.k, rec.ids[qi], rec.scores[qi], table, sure, possible,
                                score_tol=score_tol, tie_tol=tie_tol)
            if problem is not None:
                bad_rows.append((rec, qi))
                if len(verdict.mismatches) < 50:
                    verdict.mismatches.append(f"client {rec.client} recall {rec.op} row {qi} "
                                              f"(k={rec.k}, ns={rec.namespace}): {problem}")
    if bad_rows:
        # A wrong answer that fits another logged query is a response delivered to the wrong slot.
        others = np.concatenate([np.atleast_2d(r.queries) for r in recalls if r.status == "ok"]).astype(np.float64)
        others /= np.linalg.norm(others, axis=1, keepdims=True)
        for rec, qi in bad_rows:
            got = np.asarray(rec.ids[qi])
            n = int(np.count_nonzero(got != -1))
            idx = table.index_of(got[:n])
            if n == 0 or (idx < 0).any():
                continue
            ref = others @ table.unit[idx].T  # [all queries, n]
            fits = np.all(np.abs(ref - np.asarray(rec.scores[qi][:n], np.float64)) <= score_tol, axis=1)
            own = rec.queries[qi] / np.linalg.norm(rec.queries[qi])
            if fits.any() and not np.all(np.abs(table.unit[idx] @ own - rec.scores[qi][:n]) <= score_tol):
                verdict.cross_delivered += 1
    verdict.mismatches = verdict.mismatches[:50]
    return verdict


def check_row(q: np.ndarray, k: int, got_ids: Any, got_scores: Any, table: ItemTable, sure: np.ndarray,
              possible: np.ndarray, *, score_tol: float = SCORE_TOL, tie_tol: float = TIE_TOL) -> str | None:
    """None if (got_ids, got_scores) is the top-k of some state S, sure ⊆ S ⊆ possible; else why not."""
    got_ids = np.asarray(got_ids, np.int64)
    got_scores = np.asarray(got_scores, np.float32)
    if got_ids.shape != got_scores.shape or got_ids.ndim != 1 or len(got_ids) > k:
        return f"malformed answer: ids {got_ids.shape}, scores {got_scores.shape}, k={k}"
    valid = got_ids != -1
    n = int(valid.sum())
    if not valid[:n].all():
        return f"padding before hits: {got_ids.tolist()}"
    if not np.all(np.isneginf(got_scores[n:])):
        return f"padding scores are not -inf: {got_scores[n:].tolist()}"
    hits = got_ids[:n]
    if len(set(hits.tolist())) != n:
        return f"an id came back twice: {hits.tolist()}"
    idx = table.index_of(hits)
    if (idx < 0).any():
        return f"ids {hits[idx < 0].tolist()[:5]} were never added by anyone"
    impossible = hits[~possible[idx]]
    if len(impossible):
        return (f"ids {impossible.tolist()[:5]} cannot be in the store while the recall runs "
                "(deleted before it started, added after it ended, or in another namespace)")
    qn = np.asarray(q, np.float64) / np.linalg.norm(np.asarray(q, np.float64))
    scores_all = table.unit @ qn
    ref = scores_all[idx]
    if n and float(np.max(np.abs(ref - got_scores[:n]))) > score_tol:
        return f"scores {got_scores[:n].tolist()[:5]} are not the cosines {ref.tolist()[:5]}"
    if n and np.any(np.diff(got_scores[:n]) > 0):
        return f"scores are not best first: {got_scores[:n].tolist()}"
    outside = sure.copy()
    outside[idx] = False
    if n < k and outside.any():
        return (f"{n} hits for k={k}, yet items {table.ids[outside].tolist()[:5]} were surely in the store "
                "and not returned")
    if n == k and n:
        beaten = outside & (scores_all > ref.min() + tie_tol)
        if beaten.any():
            j = int(np.flatnonzero(beaten)[0])
            return (f"item {int(table.ids[j])} (score {scores_all[j]:.7f}) was surely in the store and beats "
                    f"the worst hit (score {ref.min():.7f}) but was not returned")
    return None


# -- sidecar helpers ---------------------------------------------------------------------------------


def tracebacks(log: str) -> list[str]:
    """Each "Traceback" in a sidecar log with a little context."""
    found = []
    start = 0
    while (i := log.find("Traceback", start)) >= 0:
        found.append(log[max(0, i - 300): i + 1500])
        start = i + 1
    return found


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def raw_connection(runtime: str | os.PathLike[str], name: str, timeout: float = 30.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(Path(runtime) / f"{name}.sock"))
    return sock


def hello_and_vanish(runtime: str, name: str) -> None:
    """A client that asks for a slot and hangs up before reading the answer (dies mid-hello)."""
    sock = raw_connection(runtime, name)
    theirs, wake = wake_pair()
    try:
        send_frame(sock, {"op": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid()})
        send_fd(sock, theirs.fileno())
    finally:
        sock.close()
        theirs.close()
        wake.close()


def ask(sock: socket.socket, message: dict, blob: bytes = b"") -> dict:
    send_frame(sock, message, blob)
    return recv_frame(sock, max_bytes=1 << 26)[0]


# -- child-process workers ('spawn': module-level functions, arguments picklable) -------------------


def _report_error(out: Any, client: int) -> None:
    out.put(("error", client, traceback.format_exc()))


def _status(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, SidecarUnavailable):
        return "unavailable"
    return f"error: {type(exc).__name__}: {exc}"


def writer(name: str, seed: int, client: int, timeout: float, stop: Any, progress: Any, wprogress: Any,
           out: Any, max_ops: int, delete_every: int = 3) -> None:
    """Adds (1 to 40 rows, with texts and metadata) and deletes of its own acknowledged items."""
    try:
        w = Workload(seed)
        rng = np.random.default_rng([seed, client, 7])
        records: list[tuple] = []
        live: list[int] = []
        c = Client(name, timeout=timeout)
        op = 0
        while not stop.is_set() and op < max_ops:
            op += 1
            exc: BaseException | None = None
            if op % delete_every == 0 and live:
                recent = live[-30:]
                picks = sorted(rng.choice(recent, size=min(len(recent), int(rng.integers(1, 5))), replace=False).tolist())
                live = [i for i in live if i not in set(picks)]  # never deleted twice, acked or not
                t0 = time.monotonic()
                try:
                    c.delete(picks)
                except Exception as e:  # noqa: BLE001 - judged by the oracle
                    exc = e
                t1 = time.monotonic()
                records.append(("delete", client, op, t0, t1, _status(exc), picks))
            else:
                n = int(rng.choice([1, 1, 2, 3, 5, 8, 13, 40]))
                vectors, texts, metadata = w.batch(client, op, n)
                ids = None
                t0 = time.monotonic()
                try:
                    ids = c.add(vectors, texts=texts, metadata=metadata, namespace=w.namespace(client)).tolist()
                except Exception as e:  # noqa: BLE001
                    exc = e
                t1 = time.monotonic()
                records.append(("add", client, op, t0, t1, _status(exc), ids, n))
                if ids is not None:
                    live.extend(ids)
            wprogress[client] = op
            if exc is None:
                progress[client] = t1
            else:
                time.sleep(0.02)  # the sidecar is down: do not spin on connect()
        c.close()
        out.put(("log", client, records))
    except BaseException:  # noqa: BLE001
        _report_error(out, client)


def recaller(name: str, seed: int, client: int, timeout: float, stop: Any, progress: Any, wprogress: Any,
             writers: list[int], out: Any, max_ops: int, namespaces: list[str | None]) -> None:
    """Recalls (single and batched, k 1-16), half of them aimed at what the writers touch right now."""
    try:
        w = Workload(seed)
        rng = np.random.default_rng([seed, client, 11])
        records: list[tuple] = []
        c = Client(name, timeout=timeout)
        op = 0

        def query() -> np.ndarray:
            if writers and rng.random() < 0.6:
                target = int(rng.choice(writers))
                j = int(wprogress[target]) + int(rng.integers(-4, 2))
                if j >= 1:
                    return w.vectors(target, j, 1)[0] + rng.normal(0, 0.02, w.dim).astype(np.float32)
            return rng.standard_normal(w.dim).astype(np.float32)

        while not stop.is_set() and op < max_ops:
            op += 1
            k = int(rng.integers(1, 17))
            namespace = namespaces[int(rng.integers(len(namespaces)))]
            many = rng.random() < 0.25
            queries = np.stack([query() for _ in range(int(rng.integers(2, 6)) if many else 1)])
            ids = scores = None
            exc: BaseException | None = None
            t0 = time.monotonic()
            try:
                if many:
                    batch = c.recall_many(queries, k=k, namespace=namespace)
                    ids, scores = list(batch.ids), list(batch.scores)
                else:
                    hit = c.recall(queries[0], k=k, namespace=namespace)
                    ids, scores = [hit.ids], [hit.scores]
            except Exception as e:  # noqa: BLE001
                exc = e
            t1 = time.monotonic()
            records.append(("recall", client, op, t0, t1, _status(exc), queries, k, namespace, ids, scores))
            if exc is None:
                progress[client] = t1
            else:
                time.sleep(0.02)
        c.close()
        out.put(("log", client, records))
    except BaseException:  # noqa: BLE001
        _report_error(out, client)


def honest(name: str, ids: np.ndarray, unit: np.ndarray, namespace: str, seed: int, stop: Any, out: Any,
           timeout: float = 30.0) -> None:
    """Recalls in a namespace nobody writes to, each answer checked exactly, until ``stop``."""
    try:
        rng = np.random.default_rng(seed)
        table = ItemTable.static(ids, unit, [namespace] * len(ids))
        everything = np.ones(len(ids), bool)
        c = Client(name, timeout=timeout)
        done, problems = 0, []
        while not stop.is_set():
            k = int(rng.integers(1, 17))
            queries = rng.standard_normal((int(rng.integers(1, 4)), unit.shape[1])).astype(np.float32)
            batch = c.recall_many(queries, k=k, namespace=namespace)
            for qi in range(len(queries)):
                problem = check_row(queries[qi], k, batch.ids[qi], batch.scores[qi], table, everything, everything)
                if problem is not None and len(problems) < 20:
                    problems.append(f"round {done} row {qi}: {problem}")
            done += 1
            if done == 5:
                out.put(("warm", os.getpid()))
        c.close()
        out.put(("honest", os.getpid(), done, problems))
    except BaseException:  # noqa: BLE001
        _report_error(out, os.getpid())


# -- victims of the client-death suite: each says "warm" once it is in the state to be killed in ---


def victim_recall(name: str, seed: int, spin_us: float, out: Any) -> None:
    try:
        rng = np.random.default_rng(seed)
        c = Client(name, timeout=30.0, spin_us=spin_us)
        queries = rng.standard_normal((c._conn.layout.max_batch * 3, DIM)).astype(np.float32)
        c.recall_many(queries, k=c.max_k)
        out.put(("warm", os.getpid()))
        while True:
            c.recall_many(queries, k=c.max_k)
    except BaseException:  # noqa: BLE001
        _report_error(out, os.getpid())


def victim_add(name: str, seed: int, client: int, rows: int, out: Any) -> None:
    try:
        w = Workload(seed)
        c = Client(name, timeout=30.0)
        op = 0
        while True:
            op += 1
            vectors, texts, metadata = w.batch(client, op, rows)
            c.add(vectors, texts=texts, metadata=metadata, namespace=w.namespace(client))
            if op == 1:  # one add done: the kill lands in one of the next ones
                out.put(("warm", os.getpid()))
    except BaseException:  # noqa: BLE001
        _report_error(out, os.getpid())


def victim_idle(name: str, out: Any) -> None:
    try:
        c = Client(name, timeout=30.0)
        c.stats()
        out.put(("warm", os.getpid()))
        while True:
            time.sleep(60)
        del c
    except BaseException:  # noqa: BLE001
        _report_error(out, os.getpid())


def victim_connect(name: str, out: Any) -> None:
    """Connects and hangs up in a loop: killed mid-hello, mid-attach or mid-close."""
    try:
        first = True
        while True:
            c = Client(name, timeout=30.0)
            if first:
                out.put(("warm", os.getpid()))
                first = False
            c.close()
    except BaseException:  # noqa: BLE001
        _report_error(out, os.getpid())


def victim_forked(name: str, out: Any) -> None:
    """A client that forks; the child recalls through a slot of its own; both die together."""
    try:
        c = Client(name, timeout=30.0)
        c.stats()
        pid = os.fork()
        q = np.ones(DIM, np.float32)
        if pid == 0:
            try:
                while True:
                    c.recall(q, k=3)
            finally:
                os._exit(1)
        c.recall(q, k=3)
        out.put(("warm", os.getpid(), pid))
        while True:
            c.recall(q, k=3)
    except BaseException:  # noqa: BLE001
        _report_error(out, os.getpid())


def kill9(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_cycles(sidecars: Any, store: Path, name: str, procs: list, rng: np.random.Generator, kills: int,
                progress: Any, snapshot: Callable[[Path], Any], what: str) -> tuple[list[float], list[Any]]:
    """``kills`` times, after a random pause: kill -9 the running sidecar (``procs[-1]``), read
    ``snapshot(store)`` (what survived it), start the next one (appended to ``procs``) and wait for
    the writer's next acknowledged ``what`` (``progress.value``: the time of its last). Returns
    the kill times and the snapshots."""
    from conftest import DEADLINE_S, wait_until

    kill_times, snapshots = [], []
    for cycle in range(kills):
        time.sleep(float(rng.uniform(0.05, 0.8)))
        procs[-1].kill()
        kill_times.append(time.monotonic())
        snapshots.append(snapshot(store))
        procs.append(sidecars.start(store, name=name))
        restarted = time.monotonic()
        wait_until(lambda: progress.value > restarted, f"an acknowledged {what} after kill {cycle + 1}",
                   timeout=DEADLINE_S)
    return kill_times, snapshots
