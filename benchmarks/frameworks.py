"""The framework adapters side by side with the frameworks' own stores, on one sidecar.

    PYTHONPATH=src python3 benchmarks/frameworks.py [--memories 2000] [--dim 384] [--steps 300] [--seed 1]
        [--device cpu|cuda] [--postgres-dsn DSN] [--pg-ann flat|hnsw]

1. A LangGraph agent-style loop, in a namespace that already holds ``--memories`` items
   (``fields=["text"]``; the same deterministic embedding, ``DeterministicFakeEmbedding``, on
   every side, so the embedding's cost is equal): each step one
   ``store.search(namespace, query=..., limit=4)`` then one ``store.put`` of a new memory; then
   ``--steps`` reads: one ``store.get`` of a random existing key and one ``store.search(namespace,
   limit=4)`` without a query. The same operations, pre-generated from ``--seed``, run through
   :class:`KalosStore` (on the sidecar this script starts, ``--device``), LangGraph's
   ``InMemoryStore`` and LangGraph's ``PostgresStore`` (package ``langgraph-checkpoint-postgres``,
   in no extra: ``pip install langgraph-checkpoint-postgres``).
   PostgresStore runs on a throwaway PostgreSQL server started here (tests/pg_server.py: initdb
   into a temp dir, a free loopback port and a Unix socket in that dir, durable settings; stopped
   and deleted at the end, also on error), or on ``--postgres-dsn DSN`` (the run's items are
   deleted from it at the end). Its vector search needs the pgvector extension: with it,
   PostgresStore gets the same ``index`` (``ann_index_config`` kind ``--pg-ann``: ``flat``, the
   default, is an exact scan, comparable key for key; ``hnsw``, LangGraph's default, is
   approximate); without it, PostgresStore runs without an index (puts embed nothing, the loop
   is puts only) and only its put / get / search-without-query are timed, the line saying why.
   Without PostgreSQL binaries or the package (as on a GPU machine) its column is skipped, the
   line saying why.
   Checked on the same operations: every step's search result of KalosStore (and of an indexed
   PostgresStore) against InMemoryStore's, same keys in the same order (the number of compared
   steps and of mismatches is printed, each mismatch shown); every get's value; the
   search-without-query keys of KalosStore (PostgresStore lists newest first, InMemoryStore in
   insertion order: not comparable).
2. mem0's vector store ``search`` (top 5, ``filters={"user_id": ...}``, one user of ten) through
   the Kalos provider and through mem0's default local provider (Qdrant, local mode in a temp
   dir), on the same random vectors; both answers are checked against a float64 brute force.

Per-operation p50 / p99 of every store and operation, seeded, in one run, printed as one table
at the end (with the load average before and after: the numbers move with the machine's load).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import pwd
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Callable

import numpy as np

os.environ.setdefault("MEM0_TELEMETRY", "False")

from kalos.server.launcher import SidecarProcess  # noqa: E402

TESTS = Path(__file__).resolve().parent.parent / "tests"  # pg_server.py: the throwaway PostgreSQL server


def stats(samples: list[float]) -> str:
    a = np.asarray(samples) * 1e6
    return f"p50 {np.percentile(a, 50):9.1f} us   p99 {np.percentile(a, 99):9.1f} us"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def version(dist: str) -> str:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return "not installed"


@dataclass
class Row:
    """One line of the final table: a store's operation, its samples or why there are none."""
    part: str
    store: str
    op: str
    samples: list[float] = field(default_factory=list)
    missing: str = ""


# -- LangGraph ---------------------------------------------------------------------------------

OPS = {"search": "search(query, limit=4)", "put": "put", "get": "get", "list": "search(limit=4), no query"}


@dataclass
class Workload:
    prefill: list[tuple[str, str]]  # (key, text) already in the namespace
    steps: list[tuple[str, str, str]]  # (query, key, text): a search, then a put
    reads: list[str]  # keys to get (each followed by a search without a query)


def workload(args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)
    words = [f"w{i}" for i in range(500)]

    def text() -> str:
        return " ".join(rng.choice(words, 8))

    prefill = [(f"m{i}", text()) for i in range(args.memories)]
    steps = [(text(), f"new{s}", text()) for s in range(args.steps)]
    keys = [k for k, _ in prefill] + [k for _, k, _ in steps]
    return Workload(prefill, steps, [keys[i] for i in rng.integers(0, len(keys), args.steps)])


@dataclass
class Run:
    times: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    searches: list[list[tuple[str, float | None]]] = field(default_factory=list)
    gets: list[dict[str, Any] | None] = field(default_factory=list)
    lists: list[list[str]] = field(default_factory=list)


def run_loop(store: Any, ns: tuple[str, ...], work: Workload, *, vector_search: bool) -> Run:
    from langgraph.store.base import PutOp

    run = Run()
    for start in range(0, len(work.prefill), 500):
        store.batch([PutOp(ns, k, {"text": t}) for k, t in work.prefill[start : start + 500]])
    for query, key, text in work.steps:
        if vector_search:
            dt, found = timed(lambda: store.search(ns, query=query, limit=4))  # noqa: B023 (called at once)
            run.times["search"].append(dt)
            run.searches.append([(r.key, r.score) for r in found])
        value = {"text": text}
        dt, _ = timed(lambda: store.put(ns, key, value))  # noqa: B023
        run.times["put"].append(dt)
    for key in work.reads:
        dt, item = timed(lambda: store.get(ns, key))  # noqa: B023
        run.times["get"].append(dt)
        run.gets.append(None if item is None else item.value)
        dt, found = timed(lambda: store.search(ns, limit=4))
        run.times["list"].append(dt)
        run.lists.append([r.key for r in found])
    return run


def open_postgres(args: argparse.Namespace, stack: contextlib.ExitStack, index: dict[str, Any]) -> tuple[Any, bool, str]:
    """(PostgresStore, whether it has the vector index, a line about it), or (None, False, why not)."""
    try:
        import psycopg
        from langgraph.store.postgres import PostgresStore
    except ImportError as exc:
        return None, False, (f"skipped: langgraph-checkpoint-postgres is not installed ({exc}; "
                             "pip install langgraph-checkpoint-postgres)")
    dsn = args.postgres_dsn
    where = "--postgres-dsn"
    if dsn is None:
        sys.path.insert(0, str(TESTS))
        try:
            from pg_server import PgServer, find_bin_dir
        except ImportError as exc:
            return None, False, f"skipped: tests/pg_server.py not importable ({exc}); give --postgres-dsn DSN"
        if find_bin_dir() is None:
            return None, False, ("skipped: no PostgreSQL server binaries on this machine (no initdb in "
                                 "/usr/lib/postgresql/*/bin or on PATH); give --postgres-dsn DSN to use a running server")
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                return None, False, ("skipped: running as root and there is no 'postgres' OS user to run the "
                                     "throwaway server as (PostgreSQL refuses root); give --postgres-dsn DSN")
        try:
            server = PgServer(durable=True)
        except Exception as exc:  # noqa: BLE001 - reported, the column skipped
            return None, False, f"skipped: the throwaway PostgreSQL server could not be prepared ({exc})"
        stack.callback(server.destroy)  # stop it and delete its directory, also on error
        try:
            server.init().start()
        except Exception as exc:  # noqa: BLE001
            log = " | ".join(server.log().strip().splitlines()[-3:])
            return None, False, f"skipped: the throwaway PostgreSQL server did not start ({exc}; log: {log})"
        dsn = server.url()
        where = f"a throwaway server (initdb in {server.dir}, port {server.port}, durable: fsync on)"
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            server_version = conn.execute("SHOW server_version").fetchone()[0]
            vector = conn.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'vector'").fetchone()
    except psycopg.Error as exc:
        return None, False, f"skipped: cannot connect to PostgreSQL ({type(exc).__name__}: {str(exc).strip()[:200]})"
    if vector is not None:
        pg_index = {**index, "ann_index_config": {"kind": args.pg_ann}}
        note = (f"PostgreSQL {server_version} on {where}, pgvector {vector[0]}, index kind {args.pg_ann!r}"
                + (" (exact scan)" if args.pg_ann == "flat" else " (approximate)"))
    else:
        pg_index = None
        note = (f"PostgreSQL {server_version} on {where}: pgvector is NOT available (pg_available_extensions has no "
                "'vector'), so PostgresStore cannot take an index: its vector search is not run and cannot be "
                "compared; timed without an index (put embeds nothing; get; search without a query)")
    try:
        store = stack.enter_context(PostgresStore.from_conn_string(dsn, index=pg_index))
        store.setup()
    except Exception as exc:  # noqa: BLE001
        return None, False, f"skipped: PostgresStore setup failed ({type(exc).__name__}: {str(exc).strip()[:300]})"
    return store, pg_index is not None, note


def compare_searches(label: str, ref: list[list[tuple[str, float | None]]],
                     got: list[list[tuple[str, float | None]]]) -> None:
    bad = [i for i, (a, b) in enumerate(zip(ref, got)) if [k for k, _ in a] != [k for k, _ in b]]
    diffs = [abs(sa - sb) for a, b in zip(ref, got) for (ka, sa), (kb, sb) in zip(a, b)
             if ka == kb and sa is not None and sb is not None]
    print(f"  compare search(query, limit=4) {label} vs InMemoryStore: {min(len(ref), len(got))} steps compared, "
          f"{len(bad)} mismatches (same keys, same order); max |score difference| on equal keys "
          f"{max(diffs, default=0.0):.2e}")
    if len(ref) != len(got):
        print(f"    MISMATCH: {len(got)} searches against {len(ref)}")
    for i in bad[:5]:
        print(f"    step {i}: InMemoryStore {[(k, round(s or 0, 6)) for k, s in ref[i]]}")
        print(f"    step {i}: {label:13s} {[(k, round(s or 0, 6)) for k, s in got[i]]}")


def compare_reads(label: str, ref: Run, got: Run, *, lists: bool) -> None:
    bad_gets = sum(a != b for a, b in zip(ref.gets, got.gets))
    line = f"  compare get {label} vs InMemoryStore: {len(got.gets)} gets compared, {bad_gets} values differ"
    if lists:
        bad = [i for i, (a, b) in enumerate(zip(ref.lists, got.lists)) if a != b]
        line += f"; search without query: {len(got.lists)} compared, {len(bad)} mismatches"
        print(line)
        for i in bad[:3]:
            print(f"    read {i}: InMemoryStore {ref.lists[i]}, {label} {got.lists[i]}")
    else:
        print(line + "; search without query: not comparable (PostgresStore orders by updated_at, newest "
              "first; InMemoryStore lists in insertion order)")


def langgraph_part(name: str, args: argparse.Namespace, rows: list[Row]) -> None:
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langgraph.store.base import PutOp
    from langgraph.store.memory import InMemoryStore

    from kalos.integrations.langgraph import KalosStore

    index = {"dims": args.dim, "embed": DeterministicFakeEmbedding(size=args.dim), "fields": ["text"]}
    work = workload(args)
    ns = ("bench", uuid.uuid4().hex[:8], "memories")  # fresh, also on a --postgres-dsn database
    print(f"LangGraph loop: search(query, limit=4) then put, {args.memories} memories, dim {args.dim}, "
          f"{args.steps} steps; then {args.steps} x (get, search(limit=4) without query)")
    print(f"  langgraph {version('langgraph')}, langgraph-checkpoint-postgres {version('langgraph-checkpoint-postgres')}")
    runs: dict[str, Run] = {}
    for label, store in (("KalosStore", KalosStore(name, index=index, prefix=f"bench{uuid.uuid4().hex[:8]}")),
                         ("InMemoryStore", InMemoryStore(index=index))):
        runs[label] = run_loop(store, ns, work, vector_search=True)
        print(f"  {label:14s} search {stats(runs[label].times['search'])}   put {stats(runs[label].times['put'])}")
    pg_vector = False
    with contextlib.ExitStack() as stack:
        store, pg_vector, note = open_postgres(args, stack, index)
        print(f"  PostgresStore: {note}")
        if store is not None:
            try:
                runs["PostgresStore"] = run_loop(store, ns, work, vector_search=pg_vector)
            finally:
                if args.postgres_dsn is not None:  # leave the user's database as it was (bar the tables)
                    keys = [k for k, _ in work.prefill] + [k for _, k, _ in work.steps]
                    for start in range(0, len(keys), 500):
                        store.batch([PutOp(ns, k, None) for k in keys[start : start + 500]])
            pg = runs["PostgresStore"]
            print(f"  {'PostgresStore':14s} "
                  + (f"search {stats(pg.times['search'])}   " if pg_vector else "search not run (no pgvector)   ")
                  + f"put {stats(pg.times['put'])}")
    ref = runs["InMemoryStore"]
    compare_searches("KalosStore", ref.searches, runs["KalosStore"].searches)
    compare_reads("KalosStore", ref, runs["KalosStore"], lists=True)
    if "PostgresStore" in runs:
        if pg_vector:
            compare_searches("PostgresStore", ref.searches, runs["PostgresStore"].searches)
        else:
            print("  compare search(query) PostgresStore vs InMemoryStore: impossible here, no pgvector on the server "
                  "(PostgresStore has no index, so a query is not a vector search)")
        compare_reads("PostgresStore", ref, runs["PostgresStore"], lists=False)
    for label in ("KalosStore", "InMemoryStore", "PostgresStore"):
        run = runs.get(label)
        if run is None:
            rows.append(Row("LangGraph", label, "(all)", missing="skipped: see the PostgresStore line above"))
            continue
        for op, title in OPS.items():
            if not run.times[op]:
                rows.append(Row("LangGraph", label, title, missing="not run: no pgvector on the server"))
            else:
                extra = " (no index: no embedding)" if label == "PostgresStore" and op == "put" and not pg_vector else ""
                rows.append(Row("LangGraph", label, title + extra, run.times[op]))


# -- mem0 --------------------------------------------------------------------------------------


def mem0_search(name: str, args: argparse.Namespace, rows: list[Row]) -> None:
    from mem0.configs.vector_stores.qdrant import QdrantConfig
    from mem0.vector_stores.qdrant import Qdrant

    from kalos.integrations.mem0 import KalosMem0

    rng = np.random.default_rng(args.seed + 1)
    n = args.memories
    vectors = rng.standard_normal((n, args.dim)).astype(np.float32)
    users = [f"user{i}" for i in rng.integers(0, 10, n)]
    ids = [str(uuid.uuid4()) for _ in range(n)]
    payloads = [{"user_id": u, "data": f"memory {i}", "hash": str(i)} for i, u in enumerate(users)]
    queries = rng.standard_normal((args.steps, args.dim)).astype(np.float32)
    unit = vectors.astype(np.float64) / np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
    qdir = tempfile.mkdtemp(prefix="kbq")
    try:
        config = QdrantConfig(collection_name="bench", embedding_model_dims=args.dim, path=qdir, on_disk=False)
        qdrant = Qdrant(**config.model_dump())
        kalos = KalosMem0(collection_name=f"bench{uuid.uuid4().hex[:8]}", embedding_model_dims=args.dim, sidecar=name,
                          timeout=10.0)
        print(f"mem0 vector store search: top 5 of one user's memories (of {n}, ten users), dim {args.dim}, "
              f"{args.steps} searches")
        for label, store in (("kalos", kalos), ("qdrant (local)", qdrant)):
            for start in range(0, n, 500):
                store.insert(vectors[start : start + 500].tolist(), payloads[start : start + 500], ids[start : start + 500])
            samples, exact = [], 0
            for j, q in enumerate(queries):
                user = f"user{j % 10}"
                dt, out = timed(lambda: store.search("", q.tolist(), top_k=5, filters={"user_id": user}))  # noqa: B023
                samples.append(dt)
                picked = [i for i, u in enumerate(users) if u == user]
                scores = unit[picked] @ (q / np.linalg.norm(q))
                want = [ids[picked[i]] for i in np.argsort(-scores)[:5]]
                exact += [str(o.id) for o in out] == want
            print(f"  {label:14s} {stats(samples)}   exact top-5 {exact}/{len(queries)}")
            rows.append(Row("mem0", label, f"search top 5 (exact {exact}/{len(queries)})", samples))
    finally:
        shutil.rmtree(qdir, ignore_errors=True)


def table(rows: list[Row]) -> None:
    print()
    print(f"{'part':10s} {'store':15s} {'operation':44s} {'n':>5s} {'p50 us':>10s} {'p99 us':>10s}")
    for r in rows:
        if r.samples:
            a = np.asarray(r.samples) * 1e6
            print(f"{r.part:10s} {r.store:15s} {r.op:44s} {len(a):5d} {np.percentile(a, 50):10.1f} "
                  f"{np.percentile(a, 99):10.1f}")
        else:
            print(f"{r.part:10s} {r.store:15s} {r.op:44s} {'-':>5s} {r.missing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=2000,
                        help="items stored before the timed operations, in each part (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=384, help="the embeddings' dimension (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300,
                        help="LangGraph loop steps (and reads after them); mem0 searches (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the generated texts, keys, vectors and queries (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="the sidecar's --device (cpu, or cuda on a GPU machine)")
    parser.add_argument("--postgres-dsn", default=None,
                        help="PostgresStore on this database instead of a throwaway server started here")
    parser.add_argument("--pg-ann", choices=["flat", "hnsw"], default="flat",
                        help="PostgresStore's ann_index_config kind where pgvector is available (flat: exact)")
    args = parser.parse_args()
    print(f"frameworks.py: {args.memories} memories, dim {args.dim}, {args.steps} steps, seed {args.seed}, "
          f"sidecar device {args.device}; {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"NumPy {np.__version__}")
    print(f"load average before: {loadavg()}")
    runtime = tempfile.mkdtemp(prefix="kbf")
    os.environ["KALOS_RUNTIME_DIR"] = runtime
    store_dir = tempfile.mkdtemp(prefix="kbfs")
    name = f"bench-{os.getpid()}"
    rows: list[Row] = []
    try:
        sidecar = SidecarProcess(Path(store_dir) / "bench.db", name=name, dim=args.dim, device=args.device)
        try:
            langgraph_part(name, args, rows)
            mem0_search(name, args, rows)
        finally:
            sidecar.stop(timeout=10)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
    table(rows)
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
