"""``kalos bench --crowd``: many client processes, each sending single recalls at once.

This is the load Kalos exists for: an LLM host running many agents, each calling ``Client.recall(q,
k)`` one query at a time from its own process. For each crowd size C the run starts C client
processes against one sidecar; every process connects (its connect time is recorded) and warms up,
and the crowd starts once all of them are in (a barrier), so that C clients really recall at once;
each then recalls in a loop for ``--crowd-seconds``. While the crowd is hot, one more process
connects and disconnects in a loop, so a connect under load is measured too. Every answer (the first
65,536 of each client) is checked against a float64 brute force of the same query (the ids as a set,
the scores to 1e-4), once the crowd is over: a check between recalls would cost each client as much
CPU as its recall does, and at C = 64 the rounds wait for the clients' CPU.
``--crowd-scopes mixed``: a third of the clients recall in all namespaces, a third in namespace
"default" and a third with a time window, so one pass holds several filter groups; ``windows``: each
client with a time window of its own; ``agents``: the rows spread over 64 namespaces ("agent-0" to
"agent-63", row i in agent-(i mod 64)), client i recalling in agent-(i mod 64), as agents that each
keep their own memories do (each answer checked against the float64 top-k of its namespace's rows).
``--crowd-writers W``: W more processes store memories meanwhile, as agents that remember between
their recalls do, each adding one row at a time in a loop into a namespace of their own ("crowd-writes",
which no recall of the default or agents scopes reads, so the references still hold); their adds per
second and latency are reported beside the crowd's row. The store they grow may pass the engine's
capacity, so the crowd also meets the engine's growth.
Reported per C: p50 / p99 / p99.9 per call (and the slowest, in the progress lines and the JSON),
the aggregate recalls/s, connect p99 (the crowd's and the late connector's), errors, failed
connects, wrong answers, and the sweep's queries per pass, time per pass and share of the crowd's
time spent answering (where the GPU's polling answered most recalls, "q/pass" is its requests per
round instead, and the sweep's two columns read "-").

``--colocated`` (CUDA) repeats chosen crowd sizes beside a process that keeps the GPU busy
with bf16 matrix products (a stand-in for the LLM) and reports its rate alone and meanwhile.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

__all__ = ["run_crowd", "parse_crowd", "add_crowd_arguments", "writers_problem"]

_QUERIES = 256
# Generous: C processes importing NumPy and Kalos at once on a small machine.
_READY_TIMEOUT_S = 120.0
#: Answers each client keeps to check after the crowd (the rest are timed, not checked).
_KEPT_ANSWERS = 65_536
#: The namespace the writers add to: no recall of the scopes that allow writers reads it.
WRITES_NAMESPACE = "crowd-writes"
#: The scopes whose recalls never read WRITES_NAMESPACE (the others recall in every namespace).
WRITER_SCOPES = ("default", "agents")


def parse_crowd(spec: str) -> list[int]:
    """``"1,2,4"`` as crowd sizes; SystemExit naming the bad part."""
    sizes = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise SystemExit(f"--crowd: {part!r} is not a positive number of client processes (e.g. 1,4,16)")
        sizes.append(int(part))
    if not sizes:
        raise SystemExit("--crowd: give at least one crowd size, e.g. 1,2,4,8")
    return sizes


def add_crowd_arguments(parser: argparse.ArgumentParser) -> None:
    """The crowd's options (``kalos bench --crowd ...``; the rest of ``kalos bench`` has --n, --dim,
    -k, --device and --json)."""
    parser.add_argument("--crowd", default="", metavar="C1,C2,...",
                        help="instead of the suite: C client processes (for each comma-separated C) sending single "
                        "recalls at once against one sidecar at --n x --dim; p50/p99/p99.9 per call, aggregate "
                        "recalls/s, connect times, errors, and every answer (the first 65,536 of each client) checked "
                        "against float64 after the crowd (e.g. --crowd 1,2,4,8,16,32,64)")
    parser.add_argument("--crowd-seconds", type=float, default=4.0,
                        help="--crowd: seconds each crowd recalls for (default: %(default)s)")
    parser.add_argument("--colocated", default="", metavar="C1,C2,...",
                        help="--crowd on CUDA: also run these crowd sizes beside a process busy with bf16 GEMMs "
                        "(the LLM's stand-in), with its rate alone and meanwhile")
    parser.add_argument("--serve-arg", dest="serve_args", action="append", default=[], metavar="ARG",
                        help="--crowd: an argument passed on to kalos serve (repeat it; e.g. --serve-arg=--precision "
                        "--serve-arg=fast)")
    parser.add_argument("--crowd-scopes", choices=sorted(SCOPES), default="default",
                        help="--crowd: what the recalls are scoped to: namespace 'default' (what Client.recall "
                        "uses), 'mixed' (a third each: 'default', every namespace, a time window) or 'windows' "
                        "(every namespace, each client its own time window, as agents asking for 'the last hour' "
                        "send) or 'agents' (the rows spread over 64 namespaces, client i in agent-(i mod 64): "
                        "agents each with their own memories) (default: %(default)s)")
    parser.add_argument("--crowd-writers", type=int, default=0, metavar="W",
                        help="--crowd: W more processes adding one memory at a time in a loop meanwhile (agents that "
                        f"remember between recalls), into namespace {WRITES_NAMESPACE!r}; their adds/s and p50/p99 "
                        "are reported beside each crowd (scopes default and agents only) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=20261201, help="--crowd: seed of the random rows and queries")


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    m = rng.standard_normal((n, dim), dtype=np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    return m


def _reference(matrix: np.ndarray, queries: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 brute-force top-k ids and scores of each query."""
    m64 = matrix.astype(np.float64)
    top_ids = np.empty((len(queries), k), np.int64)
    top_scores = np.empty((len(queries), k), np.float64)
    for lo in range(0, len(queries), 32):
        scores = queries[lo : lo + 32].astype(np.float64) @ m64.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        s = np.take_along_axis(scores, part, axis=1)
        order = np.argsort(-s, axis=1)
        top_ids[lo : lo + 32] = ids[np.take_along_axis(part, order, axis=1)]
        top_scores[lo : lo + 32] = np.take_along_axis(s, order, axis=1)
    return top_ids, top_scores


#: The namespaces "agents" spreads the rows over (row i in agent-(i mod this)).
AGENT_NAMESPACES = 64

#: What each crowd client's recalls are scoped to: "default" (the namespace an agent's
#: Client.recall uses unless told otherwise); "mixed": a third each in "default", in every
#: namespace, and with a time window, so one pass holds three filter groups; "windows": in
#: every namespace, each client with a window of its own (client i: from i seconds after
#: 1970-01-01 to i seconds after 2100-01-01); "agents": client i in namespace agent-(i mod 64),
#: its own memories (:func:`_store_rows`). In the other scopes every row is in "default" and
#: inside every window, so all have the same answer.
SCOPES = {
    "default": lambda index: {"namespace": "default"},
    "mixed": lambda index: ({"namespace": None}, {"namespace": "default"},
                            {"namespace": None, "since": 0.0})[index % 3],
    "windows": lambda index: {"namespace": None, "since": float(index), "until": 4_102_444_800.0 + index},
    "agents": lambda index: {"namespace": f"agent-{index % AGENT_NAMESPACES}"},
}


def _reference_group(scopes: str, index: int) -> int:
    """Which of the data file's references client ``index`` is checked against: its namespace's
    under "agents"; the one reference of every row otherwise."""
    return index % AGENT_NAMESPACES if scopes == "agents" else 0


def _store_rows(store: Any, matrix: np.ndarray, queries: np.ndarray, k: int, scopes: str,
                data: str) -> None:
    """Adds ``matrix`` to ``store`` as ``scopes`` needs (all in "default", or row i in namespace
    agent-(i mod AGENT_NAMESPACES)) and writes the queries with their float64 references to
    ``data``: ``ref_ids``/``ref_scores`` are [groups, queries, k] (:func:`_reference_group`)."""
    if scopes == "agents":
        refs = []
        for group in range(AGENT_NAMESPACES):
            rows = matrix[group::AGENT_NAMESPACES]
            ids = store.add(rows, namespace=f"agent-{group}")[0]
            refs.append(_reference(rows, queries, ids, k))
        ref_ids, ref_scores = np.stack([r[0] for r in refs]), np.stack([r[1] for r in refs])
    else:
        ids = np.concatenate([store.add(matrix[lo : lo + 16384], namespace="default")[0]
                              for lo in range(0, len(matrix), 16384)])
        ref_ids, ref_scores = (r[None] for r in _reference(matrix, queries, ids, k))
    np.savez(data, queries=queries, ref_ids=ref_ids, ref_scores=ref_scores)


def _crowd_client(name: str, data: str, k: int, seconds: float, index: int, ready: Any, out: Any,
                  scopes: str = "default") -> None:
    """One agent: connect, warm up, wait at the barrier with the others, recall single queries
    for ``seconds``."""
    from kalos.client.client import Client
    from kalos.errors import KalosError

    arrays = np.load(data, allow_pickle=False)
    group = _reference_group(scopes, index)
    queries, ref_ids, ref_scores = arrays["queries"], arrays["ref_ids"][group], arrays["ref_scores"][group]
    result: dict[str, Any] = {"connect_s": None, "connect_error": None, "errors": 0, "wrong": 0, "checked": 0,
                              "error_text": ""}
    samples = np.empty(2_000_000, np.float64)
    # The answers, kept to be checked once the crowd is over: checked between recalls, the
    # check's numpy cost a client as much CPU as the recall itself, CPU the crowd's other
    # clients and the sidecar need (pages are touched only as answers come).
    kept = min(len(samples), _KEPT_ANSWERS)
    asked = np.empty(kept, np.int64)
    got_ids = np.empty((kept, k), np.int64)
    got_scores = np.empty((kept, k), np.float32)
    done = 0
    client = None
    try:
        began = time.perf_counter()
        try:
            client = Client(name)  # the default timeout, as agents use it
            client.ping()
            result["connect_s"] = time.perf_counter() - began
            scope = SCOPES[scopes](index)
            client.recall(queries[index % len(queries)], k=k, **scope)  # warm
        except KalosError as exc:
            result["connect_error"] = f"{type(exc).__name__}: {exc}"
        _wait(ready)  # everyone, failed or not: the crowd starts when all are in
        if client is None or result["connect_error"]:
            return
        with client:
            clock = time.perf_counter
            end = clock() + seconds
            i = index * 7
            while done < len(samples):
                q = i % len(queries)
                t0 = clock()
                if t0 >= end:
                    break
                try:
                    hits = client.recall(queries[q], k=k, **scope)
                except Exception as exc:  # noqa: BLE001 - counted and shown, whatever it is
                    result["errors"] += 1
                    result["error_text"] = f"{type(exc).__name__}: {exc}"
                    i += 1
                    continue
                samples[done] = clock() - t0
                if done < kept:
                    asked[done] = q
                    n = len(hits.ids)
                    got_ids[done, :n] = hits.ids
                    got_scores[done, :n] = hits.scores
                    if n < k:  # fewer than k: wrong, as the references hold k
                        got_ids[done, n:] = -1
                        got_scores[done, n:] = -np.inf
                done += 1
                i += 1
        checked = min(done, kept)
        try:
            result["wrong"] = _wrong_answers(asked[:checked], got_ids[:checked], got_scores[:checked], ref_ids,
                                             ref_scores)
        except Exception as exc:  # noqa: BLE001 - answers nobody could check count as wrong: loud
            result["wrong"] = checked
            result["error_text"] = f"the answers' check failed: {type(exc).__name__}: {exc}"
        result["checked"] = checked
    finally:
        result["samples"] = samples[:done]
        out.put((index, result))


def _wrong_answers(asked: np.ndarray, ids: np.ndarray, scores: np.ndarray, ref_ids: np.ndarray,
                   ref_scores: np.ndarray) -> int:
    """How many answers differ from the float64 reference of the query asked: their ids as a set
    (ties may order them either way), their scores in order to 1e-4."""
    same_ids = (np.sort(ids, axis=1) == np.sort(ref_ids[asked], axis=1)).all(axis=1)
    close = np.abs(scores.astype(np.float64) - ref_scores[asked]).max(axis=1, initial=0.0) <= 1e-4
    return int(np.count_nonzero(~(same_ids & close)))


def _wait(barrier: Any) -> None:
    try:
        barrier.wait(timeout=_READY_TIMEOUT_S)
    except threading.BrokenBarrierError:
        pass  # someone never arrived: the parent reports the crowd as incomplete


def writers_problem(writers: int, scopes: str) -> str | None:
    """What is wrong with ``--crowd-writers writers`` beside ``--crowd-scopes scopes`` (None: nothing)."""
    if writers < 0:
        return f"--crowd-writers must be >= 0, got {writers}"
    if writers and scopes not in WRITER_SCOPES:
        return (f"--crowd-writers needs --crowd-scopes {' or '.join(WRITER_SCOPES)}: the {scopes!r} scope recalls in "
                "every namespace, where the writers' rows would change the answers the check expects")
    return None


def _writer(name: str, data: str, seconds: float, index: int, ready: Any, out: Any, seed: int) -> None:
    """One agent that remembers: connect, wait at the barrier, add one unit row at a time (each
    add acknowledged durable) for ``seconds``, into WRITES_NAMESPACE."""
    from kalos.client.client import Client
    from kalos.errors import KalosError

    dim = np.load(data, allow_pickle=False)["queries"].shape[1]
    rng = np.random.default_rng([seed, index])
    times, errors, last, client = [], 0, "", None
    try:
        client = Client(name)
        client.ping()
    except KalosError as exc:
        client, errors, last = None, 1, f"{type(exc).__name__}: {exc}"
    _wait(ready)  # everyone, failed or not: the crowd starts when all are in
    if client is not None:
        with client:
            end = time.perf_counter() + seconds
            while True:
                row = _unit(rng, 1, dim)
                began = time.perf_counter()
                if began >= end:
                    break
                try:
                    client.add(row, namespace=WRITES_NAMESPACE)
                    times.append(time.perf_counter() - began)
                except Exception as exc:  # noqa: BLE001 - counted and shown, whatever it is
                    errors += 1
                    last = f"{type(exc).__name__}: {exc}"
    out.put((-2 - index, {"times": times, "errors": errors, "error_text": last}))


def _connector(name: str, seconds: float, ready: Any, out: Any) -> None:
    """Connects, pings and disconnects in a loop while the crowd runs (from 20% of its time to 80%)."""
    from kalos.client.client import Client
    from kalos.errors import KalosError

    times, failures, last = [], 0, ""
    _wait(ready)
    time.sleep(0.2 * seconds)
    end = time.perf_counter() + 0.6 * seconds
    while time.perf_counter() < end or len(times) + failures < 5:  # a few, even when the crowd is short
        began = time.perf_counter()
        try:
            with Client(name) as client:
                client.ping()
            times.append(time.perf_counter() - began)
        except KalosError as exc:
            failures += 1
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.01)
    out.put((-1, {"connect_times": times, "failures": failures, "error_text": last}))


class _Passes(NamedTuple):
    """A sidecar's counts so far: its sweep's queries, passes and seconds spent answering, and
    the recalls its GPU polling answered in how many rounds."""

    queries: int
    passes: int
    busy_s: float
    gpu_polled: int
    gpu_rounds: int


def _passes(name: str) -> _Passes:
    from kalos.client.client import Client

    with Client(name) as client:
        stats = client.stats()
    return _Passes(int(stats["queries"]), int(stats["batches"]), float(stats.get("busy_s", 0.0)),
                   int(stats.get("gpu_polled", 0)), int(stats.get("gpu_rounds", 0)))


def _with_passes(name: str, seconds: float, crowd: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs ``crowd`` and adds to its row who answered it and in passes of how many: the sweep's
    queries per pass, time per pass and share of the crowd's time spent answering (near 100%: the
    sweep is the bottleneck; well below: the clients are), or, where the GPU's polling answered
    most recalls, its requests per round (the sweep's figures then describe only the few requests
    the kernel handed over, so they are left out)."""
    before = _passes(name)
    row = crowd()
    after = _passes(name)
    swept = after.queries - before.queries
    passes = max(1, after.passes - before.passes)
    polled, rounds = after.gpu_polled - before.gpu_polled, after.gpu_rounds - before.gpu_rounds
    if polled > swept and rounds > 0:
        row.update(answered_by="gpu polling", queries_per_pass=polled / rounds, pass_us=None, sweep_busy=None)
    else:
        busy_s = after.busy_s - before.busy_s
        row.update(answered_by="sweep", queries_per_pass=swept / passes, pass_us=busy_s / passes * 1e6,
                   sweep_busy=busy_s / seconds)
    return row


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _one_crowd(name: str, data: str, k: int, clients: int, seconds: float, scopes: str = "default",
               on_start: Callable[[], None] | None = None, writers: int = 0, seed: int = 0) -> dict[str, Any]:
    """Runs C client processes (and the late connector, and ``writers`` adding processes, their
    rows drawn from ``seed``) once all of them are connected and warm.

    The arrays go to the children in a file: pickled into ``Process`` arguments, they made each
    ``start()`` wait until that child had imported Kalos, so that the processes of a large crowd
    came up one after another, and many after the crowd was over."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ready = ctx.Barrier(clients + writers + 2)  # the clients, the writers, the connector, and this process
    procs = [ctx.Process(target=_crowd_client, args=(name, data, k, seconds, c, ready, out, scopes))
             for c in range(clients)]
    procs.append(ctx.Process(target=_connector, args=(name, seconds, ready, out)))
    procs += [ctx.Process(target=_writer, args=(name, data, seconds, w, ready, out, seed)) for w in range(writers)]
    for p in procs:
        p.start()
    complete = True
    try:
        ready.wait(timeout=_READY_TIMEOUT_S)
    except threading.BrokenBarrierError:
        complete = False
    if complete and on_start is not None:
        on_start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.time() + seconds + 120
    while len(results) < len(procs) and time.time() < deadline:
        try:
            index, result = out.get(timeout=1.0)
        except Exception:  # queue.Empty: a process may have died; keep waiting until the deadline
            if all(not p.is_alive() for p in procs) and out.empty():
                break
            continue
        results[index] = result
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    connector = results.pop(-1, {"connect_times": [], "failures": 1, "error_text": "the connector did not report"})
    wrote = [results.pop(-2 - w, {"times": [], "errors": 1, "error_text": "a writer did not report"})
             for w in range(writers)]
    write_ms = np.concatenate([np.asarray(w["times"], np.float64) for w in wrote]) * 1e3 if wrote else np.empty(0)
    crowd = [results.get(c) for c in range(clients)]
    lost = sum(r is None for r in crowd)
    crowd = [r for r in crowd if r is not None]
    samples = np.concatenate([r["samples"] for r in crowd]) * 1e6 if crowd else np.empty(0)
    connects = np.array([r["connect_s"] for r in crowd if r["connect_s"] is not None]) * 1e3
    late_ms = np.asarray(connector["connect_times"]) * 1e3
    errors = [r["error_text"] or r["connect_error"] for r in crowd if r["error_text"] or r["connect_error"]]
    return {
        "clients": clients,
        "recalls": int(len(samples)),
        "checked": sum(r.get("checked", 0) for r in crowd),
        "p50_us": _pct(samples, 50), "p99_us": _pct(samples, 99), "p999_us": _pct(samples, 99.9),
        "max_us": float(samples.max()) if len(samples) else float("nan"),  # (one stall, a compile say)
        "recalls_per_s": len(samples) / seconds if complete else 0.0,
        "connect_p99_ms": _pct(connects, 99),
        "late_connect_p50_ms": _pct(late_ms, 50), "late_connect_p99_ms": _pct(late_ms, 99),
        "late_connects": int(len(late_ms)), "late_connect_failures": int(connector["failures"]),
        "failed_connects": sum(r["connect_error"] is not None for r in crowd) + lost,
        "errors": sum(r["errors"] for r in crowd),
        "wrong": sum(r["wrong"] for r in crowd),
        "complete": complete,  # every process connected and warm before the crowd started
        "fewest_by_one_client": min((len(r["samples"]) for r in crowd), default=0),
        "writers": writers,
        "writes": int(len(write_ms)),
        "writes_per_s": len(write_ms) / seconds if complete else 0.0,
        "write_p50_ms": _pct(write_ms, 50), "write_p99_ms": _pct(write_ms, 99),
        "write_errors": sum(w["errors"] for w in wrote),
        "first_error": (errors[0] if errors else connector["error_text"]
                        or next((w["error_text"] for w in wrote if w["error_text"]), "")
                        or ("" if complete else "not every process came up in time"))[:300],
    }


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'C':>4} {'p50 us':>9} {'p99 us':>9} {'p99.9 us':>9} {'recalls/s':>11} {'conn p99 ms':>11} "
          f"{'late conn p99 ms':>16} {'failed':>6} {'errors':>6} {'wrong':>6} {'checked':>9} {'q/pass':>6} "
          f"{'pass us':>7} {'busy':>5}")
    for r in rows:
        print(f"{r['clients']:>4} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} {r['p999_us']:>9.1f} "
              f"{r['recalls_per_s']:>11,.0f} {r['connect_p99_ms']:>11.2f} {r['late_connect_p99_ms']:>16.2f} "
              f"{r['failed_connects'] + r['late_connect_failures']:>6} {r['errors']:>6} {r['wrong']:>6} "
              f"{r['checked']:>9,} {r['queries_per_pass']:>6.1f} {_cell(r['pass_us'], '.1f'):>7} "
              f"{_cell(r['sweep_busy'], '.0%'):>5}")
        if r.get("writers"):
            print(f"     beside {r['writers']} writers: {r['writes_per_s']:,.0f} adds/s, p50 {r['write_p50_ms']:.2f} / "
                  f"p99 {r['write_p99_ms']:.2f} ms, {r['write_errors']} errors")
        if r["first_error"]:
            print(f"     first error: {r['first_error']}")


def run_crowd(args: argparse.Namespace) -> int:
    from kalos.server.launcher import SidecarProcess
    from kalos.store.sqlite import Store

    sizes = parse_crowd(args.crowd)
    colocated = parse_crowd(args.colocated) if getattr(args, "colocated", "") else []
    if args.crowd_scopes == "agents" and args.n // AGENT_NAMESPACES < args.k:
        raise SystemExit(f"--crowd-scopes agents: --n {args.n:,} gives each of the {AGENT_NAMESPACES} namespaces "
                         f"{args.n // AGENT_NAMESPACES} rows, fewer than -k {args.k}; give --n >= "
                         f"{AGENT_NAMESPACES * args.k:,}")
    writers = args.crowd_writers
    problem = writers_problem(writers, args.crowd_scopes)  # (kalos bench checked it; python -m ... did not)
    if problem:
        raise SystemExit(problem)
    rng = np.random.default_rng(args.seed)
    n, dim, k = args.n, args.dim, args.k
    print(f"crowd bench: N={n:,} x dim {dim}, k={k}, device {args.device}, {os.cpu_count()} CPUs, "
          f"crowds {sizes}, {args.crowd_seconds:g} s each"
          + (f", beside {writers} writers" if writers else "")
          + f"; serve {' '.join(args.serve_args) or '(defaults)'}", flush=True)
    matrix = _unit(rng, n, dim)
    queries = _unit(rng, _QUERIES, dim)
    report: dict[str, Any] = {"n": n, "dim": dim, "k": k, "device": args.device, "cpus": os.cpu_count(),
                              "serve_args": list(args.serve_args), "rows": [], "colocated": []}
    name = f"crowd-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="kalos-crowd-") as tmp:
        store_path = Path(tmp) / "crowd.db"
        data = str(Path(tmp) / "queries.npz")
        with Store.open(store_path, dim=dim) as store:
            _store_rows(store, matrix, queries, k, args.crowd_scopes, data)
        del matrix
        slots = max(sizes + colocated) + writers + 8
        extra = ["--slots", str(slots), *args.serve_args]
        with SidecarProcess(store_path, name=name, device=args.device, extra_args=extra, ready_timeout=900) as sidecar:
            print(f"  {sidecar.ready_line}", flush=True)
            for c in sizes:
                row = _with_passes(name, args.crowd_seconds,
                                   lambda: _one_crowd(name, data, k, c, args.crowd_seconds, args.crowd_scopes,
                                                      writers=writers, seed=args.seed))
                report["rows"].append(row)
                print(f"  C={c}: p50 {row['p50_us']:.1f} us, p99 {row['p99_us']:.1f}, "
                      f"max {row['max_us'] / 1e3:.1f} ms, "
                      f"{row['recalls_per_s']:,.0f} recalls/s, failed {row['failed_connects']}, "
                      f"errors {row['errors']}, wrong {row['wrong']}, {row['queries_per_pass']:.1f} queries per "
                      f"{'round' if row['answered_by'] == 'gpu polling' else 'pass'}"
                      + (f"; {row['writes_per_s']:,.0f} adds/s beside it, p99 {row['write_p99_ms']:.2f} ms, "
                         f"{row['write_errors']} errors" if writers else ""), flush=True)
            if colocated:
                report["colocated"] = _colocated(name, data, k, colocated, args)
            report["sidecar_log_tail"] = sidecar.log()[-4000:]
            from kalos.client.client import Client

            with Client(name) as client:
                stats = client.stats()
                report["engine_stats"] = {**(stats.get("engine_stats") or {}),
                                          **{key: value for key, value in stats.items() if key.startswith("gather_")}}
    print(f"engine: {report['engine_stats']}")
    _print_rows(f"crowd of single recalls (N={n:,} x {dim}, k={k}, {args.device}; serve "
                f"{' '.join(args.serve_args) or 'defaults'})", report["rows"])
    if report["colocated"]:
        _print_rows("the same beside a process running bf16 GEMMs on the GPU (the LLM's stand-in)",
                    report["colocated"])
        for r in report["colocated"]:
            print(f"  C={r['clients']}: GEMMs {r['gemm_tflops_alone']:.0f} TFLOP/s alone, "
                  f"{r['gemm_tflops_during']:.0f} during the crowd")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    failures = sum(r["failed_connects"] + r["late_connect_failures"] + r["errors"] + r["wrong"] + r["write_errors"]
                   for r in report["rows"] + report["colocated"])
    return 1 if failures else 0


def _colocated(name: str, data: str, k: int, sizes: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    from kalos.tools.bench_gpu import _LOAD_SCRIPT

    rows = []
    for c in sizes:
        hog = subprocess.Popen([sys.executable, "-c", _LOAD_SCRIPT, str(args.crowd_seconds + 60)],
                               stdout=subprocess.PIPE, text=True)
        try:
            alone = hog.stdout.readline().split()
            if hog.stdout.readline().strip() != "busy":
                raise RuntimeError("the GEMM process did not start")
            # Its rate is counted from the crowd's start (the signal marks it).
            row = _with_passes(name, args.crowd_seconds, lambda: _one_crowd_marked(
                name, data, k, c, args.crowd_seconds, hog, args.crowd_scopes,
                writers=args.crowd_writers, seed=args.seed))
            shared = hog.stdout.readline().split()
            row["gemm_tflops_alone"] = float(alone[1]) if alone else float("nan")
            row["gemm_tflops_during"] = float(shared[1]) if shared else float("nan")
            rows.append(row)
        finally:
            hog.kill()
            hog.wait()
    return rows


def _one_crowd_marked(name: str, data: str, k: int, clients: int, seconds: float, hog: subprocess.Popen,
                      scopes: str, **writing: int) -> dict[str, Any]:
    """:func:`_one_crowd`, with the GEMM process told when the crowd starts and ends."""

    def mark() -> None:
        time.sleep(seconds)
        hog.terminate()

    def started() -> None:
        hog.send_signal(signal.SIGUSR1)
        threading.Thread(target=mark, daemon=True).start()

    return _one_crowd(name, data, k, clients, seconds, scopes, on_start=started, **writing)


if __name__ == "__main__":  # python -m kalos.tools.crowd: the same as kalos bench --crowd
    _parser = argparse.ArgumentParser(
        description="kalos bench --crowd: C client processes sending single recalls at once against one sidecar "
                    "on a temporary store of N x dim random unit rows, every answer (the first 65,536 of each "
                    "client) checked against float64 after the crowd")
    _parser.add_argument("--n", type=int, default=65536, help="memories in the sidecar's store (default: 65536)")
    _parser.add_argument("--dim", type=int, default=1024, help="their dimension (default: 1024)")
    _parser.add_argument("-k", type=int, default=8, help="k of every recall (default: 8)")
    _parser.add_argument("--device", default="cpu", help="the sidecar's device: cpu, cuda or cuda:N (default: cpu)")
    _parser.add_argument("--json", type=Path, default=None, help="also write the crowds' rows to this JSON file")
    add_crowd_arguments(_parser)
    sys.exit(run_crowd(_parser.parse_args()))
