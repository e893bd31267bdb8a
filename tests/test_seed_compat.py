"""The seed article's recall_shm_t protocol, served by kalos.server.seed_compat.SeedCompatServer.

Real processes where it matters: tests/seed_client.c is a client written from the article
(its struct, its O_CREAT + ftruncate + memset init, its __atomic ready/done handshake), built
here with the system C compiler; its answers are checked against a float64 brute force over
the same store. Bad input comes from a Python client of the same layout. Every random test
prints its seed (set KALOS_TEST_SEED to replay one). No timing assertions: deadlines only
turn a hang into a failure.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kalos.server.seed_compat as kalos_seed_compat
from kalos.engine import MISSING_ID, NumpyEngine, as_unit_rows
from kalos.errors import InvalidArgument
from kalos.ipc.sync import full_fence
from kalos.server.seed_compat import (
    MAGIC,
    MAX_QUERY_DIM,
    MAX_RESULT_ITEMS,
    OFFSETS,
    SEED_LAYOUT,
    SEGMENT_SIZE,
    TOP_K,
    VERSION,
    SeedCompatServer,
    segment_path,
    unlink_segment,
)

TESTS = Path(__file__).resolve().parent
DEADLINE_S = 30.0  # a hang guard, never a performance assertion
W = {name: OFFSETS[name] // 4 for name in SEED_LAYOUT.names[:8]}


def _seed() -> int:
    seed = int(os.environ.get("KALOS_TEST_SEED", random.randrange(2**32)))
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    return seed


def _wait_until(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.001)


# -- the store and the server ----------------------------------------------------------


@dataclass
class Store:
    engine: NumpyEngine
    lock: threading.Lock
    history: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (ids, vectors, deleted)

    def search(self, q: np.ndarray, k: int):
        with self.lock:
            return self.engine.search(q, k)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float64 unit vectors) of the live rows: the reference's view of the store."""
        e = self.engine
        n = e.rows.size
        live = e.rows.live[:n]
        return e.rows.ids[:n][live].copy(), e._vectors[:n][live].astype(np.float64)


def make_store(n: int, dim: int, seed: int, *, ids: np.ndarray | None = None, delete_frac: float = 0.05) -> Store:
    rng = np.random.default_rng(seed)
    engine = NumpyEngine(dim, capacity=max(n, 1))
    if ids is None:
        ids = 1000 + 3 * np.arange(n, dtype=np.int64)  # not 0..N-1
    vectors = as_unit_rows(rng.standard_normal((n, dim)))
    doomed = rng.choice(ids, size=int(delete_frac * n), replace=False) if n else ids[:0]
    if n:
        engine.add(ids, vectors, 0, 0.0)
        engine.delete(doomed)
    return Store(engine, threading.Lock(), (ids, vectors, doomed))


@pytest.fixture
def shm_name():
    name = f"/kalos_test_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    yield name
    unlink_segment(name)


@pytest.fixture
def servers():
    started: list[SeedCompatServer] = []

    def start(store_or_search, dim: int, shm_name: str, **kw) -> SeedCompatServer:
        search = store_or_search.search if isinstance(store_or_search, Store) else store_or_search
        srv = SeedCompatServer(search=search, dim=dim, shm_name=shm_name, **kw)
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


class ServerProcess:
    """The server in its own process (tests/seed/serve_store.py), as the sidecar runs it."""

    def __init__(self, store: Store, shm_name: str, tmp_path: Path) -> None:
        ids, vectors, deleted = store.history
        npz = tmp_path / f"store-{uuid.uuid4().hex[:8]}.npz"
        np.savez(npz, ids=ids, vectors=vectors, deleted=deleted)
        src = str(Path(kalos_seed_compat.__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "seed" / "serve_store.py"), str(npz), shm_name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        assert line.strip() == "serving", f"the server process did not start: {line!r}"

    def stop(self) -> dict:
        """Stops it; returns its stats."""
        out, _ = self.proc.communicate(input="", timeout=DEADLINE_S)
        assert self.proc.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server_process():
    started: list[ServerProcess] = []

    def start(store: Store, shm_name: str, tmp_path: Path) -> ServerProcess:
        started.append(ServerProcess(store, shm_name, tmp_path))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()


def wait_attached(srv: SeedCompatServer, count: int = 1) -> None:
    _wait_until(lambda: srv.stats["attaches"] >= count, f"the server to attach ({count})")


# -- the C client ------------------------------------------------------------------------


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.fixture(scope="session")
def c_client(tmp_path_factory) -> str:
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc/clang, or $CC) on this machine: the article's C client cannot be built")
    out = tmp_path_factory.mktemp("seed") / "seed_client"
    cmd = [cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", f"-I{TESTS}", "-o", str(out),
           str(TESTS / "seed_client.c"), "-lm", "-lrt"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"building the seed client failed: {' '.join(cmd)}\n{proc.stderr}")
    return str(out)


@dataclass
class Answers:
    request_ids: np.ndarray  # [R] uint32
    counts: np.ndarray  # [R]
    ids: np.ndarray  # [R, 16]
    scores: np.ndarray  # [R, 16]
    queries: np.ndarray  # [R, dim] float32, exactly as sent


def parse_client(stdout: str, dump: Path, dim: int) -> Answers:
    rows = [line.split() for line in stdout.splitlines()]
    m = MAX_RESULT_ITEMS
    assert all(len(r) == 3 + 2 * m for r in rows), "malformed client output"
    queries = np.fromfile(dump, dtype=np.float32).reshape(-1, dim)
    return Answers(
        request_ids=np.array([int(r[0]) for r in rows], np.int64),
        counts=np.array([int(r[1]) for r in rows], np.int64),
        ids=np.array([[int(x) for x in r[3 : 3 + m]] for r in rows], np.int64).reshape(-1, m),
        scores=np.array([[float(x) for x in r[3 + m :]] for r in rows], np.float64).reshape(-1, m),
        queries=queries[: len(rows)],
    )


def client_cmd(binary: str, n: int, seed: int, dim: int, name: str, dump: Path, *extra: str) -> list[str]:
    return [binary, str(n), str(seed), str(dim), name, "--dump", str(dump), *extra]


def run_client(binary: str, n: int, seed: int, dim: int, name: str, tmp_path: Path) -> Answers:
    dump = tmp_path / f"queries-{seed}.f32"
    proc = subprocess.run(client_cmd(binary, n, seed, dim, name, dump), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return parse_client(proc.stdout, dump, dim)


def check_answers(ans: Answers, store: Store, *, first_request_id: int = 1, tol: float = 1e-5) -> None:
    """Every answer against a float64 brute force: ids equal except near-exact ties, scores within tol."""
    live_ids, vecs = store.live()
    r = len(ans.counts)
    np.testing.assert_array_equal(ans.request_ids, np.arange(first_request_id, first_request_id + r))
    expect = min(TOP_K, len(live_ids))
    assert (ans.counts == expect).all(), f"result_count {np.unique(ans.counts)} != {expect}"
    assert (ans.ids[:, expect:] == MISSING_ID).all() and np.isneginf(ans.scores[:, expect:]).all()
    q = ans.queries.astype(np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    ref = q @ vecs.T  # [R, N]
    if expect == 0:
        return
    part = np.argpartition(-ref, expect - 1, axis=1)[:, :expect]
    order = np.take_along_axis(part, np.argsort(-np.take_along_axis(ref, part, axis=1), axis=1), axis=1)
    ref_top = np.take_along_axis(ref, order, axis=1)
    row_of = {int(i): j for j, i in enumerate(live_ids)}
    got = ans.ids[:, :expect]
    assert all(int(i) in row_of for i in np.unique(got)), "an answer names an id that is not live"
    got_rows = np.vectorize(row_of.__getitem__, otypes=[np.int64])(got)
    got_ref = np.take_along_axis(ref, got_rows, axis=1)
    # Reported scores are the float64 scores of the reported ids...
    np.testing.assert_allclose(ans.scores[:, :expect], got_ref, atol=tol, rtol=0)
    # ...each rank holds the reference's score at that rank (a swap only between near-equal scores)...
    np.testing.assert_allclose(got_ref, ref_top, atol=tol, rtol=0)
    # ...no id twice, and ids differ from the reference only where the scores tie.
    assert all(len(set(row)) == expect for row in got.tolist())
    mismatch = got != live_ids[order]
    if mismatch.any():
        gaps = np.abs(got_ref - ref_top)[mismatch]
        print(f"{int(mismatch.sum())} rank(s) differ from the reference, all ties within {gaps.max():.2e}")


# -- a Python client of the same layout (for bad input) -----------------------------------


class PyClient:
    """The article's client in Python: create/size/zero the segment, then ready/done."""

    def __init__(self, name: str, *, mode: int = 0o666, init: bool = True) -> None:
        self.path = segment_path(name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, mode)
        try:
            os.ftruncate(fd, SEGMENT_SIZE)
            self.mm = mmap.mmap(fd, SEGMENT_SIZE)
        finally:
            os.close(fd)
        self.rec = np.ndarray((), SEED_LAYOUT, buffer=self.mm)  # field views for payload
        self.words = np.ndarray(8, np.uint32, buffer=self.mm)
        self.next_id = 1
        if init:
            self.init()

    def init(self, memory_count: int = 65536) -> None:
        self.mm[:] = bytes(SEGMENT_SIZE)  # memset(shm, 0, sizeof(recall_shm_t))
        self.words[W["magic"]] = MAGIC
        self.words[W["version"]] = VERSION
        self.words[W["memory_count"]] = memory_count

    def send(self, query, *, dim: int | None = None, ready: int = 1, **header: int) -> int:
        """Writes a request (header fields may be overridden) and raises ready. Returns its id."""
        _wait_until(lambda: self.words[W["done"]] == 0, "done == 0")
        query = np.asarray(query, dtype=np.float32).reshape(-1)
        self.rec["query"][: len(query)] = query
        rid = header.pop("request_id", self.next_id)
        self.next_id = rid + 1
        self.words[W["query_dim"]] = len(query) if dim is None else dim
        for field, value in header.items():
            self.words[W[field]] = value
        self.words[W["request_id"]] = rid
        full_fence()  # release: payload before ready
        self.words[W["ready"]] = ready
        return rid

    def receive(self, timeout: float = DEADLINE_S) -> tuple[int, np.ndarray, np.ndarray]:
        _wait_until(lambda: self.words[W["done"]] == 1, "done == 1 (an answer)", timeout)
        full_fence()  # acquire: done before results
        out = int(self.words[W["result_count"]]), self.rec["result_ids"].copy(), self.rec["result_scores"].copy()
        self.words[W["done"]] = 0
        return out

    def request(self, query, **kw) -> tuple[int, np.ndarray, np.ndarray]:
        self.send(query, **kw)
        return self.receive()

    def close(self) -> None:
        del self.rec, self.words
        self.mm.close()


def reference_top(store: Store, query: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    ids, vecs = store.live()
    q = np.asarray(query, np.float64)
    s = vecs @ (q / np.linalg.norm(q))
    o = np.argsort(-s, kind="stable")[:k]
    return ids[o], s[o]


def assert_good_answer(answer, store: Store, query: np.ndarray) -> None:
    count, ids, scores = answer
    ref_ids, ref_scores = reference_top(store, query)
    assert count == len(ref_ids)
    np.testing.assert_array_equal(ids[:count], ref_ids)
    np.testing.assert_allclose(scores[:count], ref_scores, atol=1e-5, rtol=0)
    assert (ids[count:] == MISSING_ID).all() and np.isneginf(scores[count:]).all()


def assert_refused(answer) -> None:
    count, ids, scores = answer
    assert count == 0
    assert (ids == MISSING_ID).all() and np.isneginf(scores).all()


# == the layout ==========================================================================


def test_layout_matches_the_c_compiler(tmp_path):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc/clang, or $CC): cannot check offsetof() against the layout")
    fields = SEED_LAYOUT.names
    src = tmp_path / "layout.c"
    src.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "seed/shared_recall.h"\nint main(void) {\n'
        + "".join(f'    printf("{f} %zu\\n", offsetof(recall_shm_t, {f}));\n' for f in fields)
        + '    printf("sizeof %zu\\n", sizeof(recall_shm_t));\n    return 0;\n}\n'
    )
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{TESTS}", "-o", str(exe), str(src)], check=True)
    printed = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                            text=True).stdout.splitlines())
    assert {f: int(printed[f]) for f in fields} == OFFSETS
    assert int(printed["sizeof"]) == SEGMENT_SIZE == 4256


# == the article's C client ================================================================


def _segment_initialised(path: str) -> bool:
    try:
        words = np.fromfile(path, np.uint32, 8)
    except (FileNotFoundError, ValueError):
        return False
    return len(words) == 8 and words[W["magic"]] == MAGIC


def test_c_client_with_the_sidecar_started_first(c_client, server_process, shm_name, tmp_path):
    seed = _seed()
    store = make_store(1536, 1024, seed)
    path = segment_path(shm_name)
    srv = server_process(store, shm_name, tmp_path)
    _wait_until(lambda: _segment_initialised(path), "the server's segment")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.stat(path).st_size == SEGMENT_SIZE
    ans = run_client(c_client, 3000, seed, 1024, shm_name, tmp_path)
    check_answers(ans, store)
    # The client's O_CREAT on an existing segment does not change its mode.
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    stats = srv.stop()
    assert stats["segment_created"] and stats["attaches"] == 1
    assert stats["requests"] == 3000 and stats["served"] == 3000 and stats["errors"] == 0
    assert os.path.exists(path)  # stop() unlinks nothing


def test_c_client_started_first_waits_for_the_sidecar(c_client, server_process, shm_name, tmp_path):
    seed = _seed()
    dim = 384
    store = make_store(3000, dim, seed)
    dump = tmp_path / "queries.f32"
    proc = subprocess.Popen(client_cmd(c_client, 2000, seed, dim, shm_name, dump), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        path = segment_path(shm_name)
        _wait_until(lambda: os.path.exists(path) and os.stat(path).st_size >= SEGMENT_SIZE, "the client's segment")
        watcher = PyClient(shm_name, init=False)
        _wait_until(lambda: watcher.words[W["ready"]] == 1, "the client's first ready")  # it is waiting
        watcher.close()
        mode = stat.S_IMODE(os.stat(path).st_mode)
        srv = server_process(store, shm_name, tmp_path)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    check_answers(parse_client(out, dump, dim), store)
    stats = srv.stop()
    assert not stats["segment_created"] and stats["errors"] == 0 and stats["served"] == 2000
    assert stat.S_IMODE(os.stat(path).st_mode) == mode  # the client's permissions, untouched


def test_client_restarts_and_rezeroes_while_the_sidecar_runs(c_client, servers, shm_name, tmp_path):
    seed = _seed()
    store = make_store(1500, 256, seed)
    srv = servers(store, 256, shm_name)
    for run in range(2):  # clean exits: the second client re-creates (O_CREAT) and re-zeroes
        check_answers(run_client(c_client, 800, seed + run, 256, shm_name, tmp_path), store)
    # A client killed mid-stream (maybe mid-request), then a new one on the same segment.
    dump = tmp_path / "killed.f32"
    victim = subprocess.Popen(client_cmd(c_client, 10**6, seed + 2, 256, shm_name, dump),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = srv.stats["requests"]
    _wait_until(lambda: srv.stats["requests"] > before + 200, "the victim's requests")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    time.sleep(0.05)  # let the server finish the victim's last request (not a timing assertion)
    check_answers(run_client(c_client, 800, seed + 3, 256, shm_name, tmp_path), store)
    assert srv.stats["errors"] == 0 and srv.stats["attaches"] == 1


def test_client_unlinks_and_recreates_the_segment(c_client, servers, shm_name, tmp_path):
    seed = _seed()
    store = make_store(1000, 128, seed)
    srv = servers(store, 128, shm_name)
    check_answers(run_client(c_client, 300, seed, 128, shm_name, tmp_path), store)
    assert unlink_segment(shm_name)
    # The new client creates a new inode (or opens the one Kalos made after noticing the unlink);
    # its first request waits until Kalos has re-attached.
    check_answers(run_client(c_client, 300, seed + 1, 128, shm_name, tmp_path), store)
    assert srv.stats["attaches"] >= 2 and srv.stats["errors"] == 0


def test_many_ids_beyond_int32_are_hidden_and_the_rest_answered(c_client, servers, shm_name, tmp_path):
    """Random queries over a store where a third of the ids do not fit in int32."""
    seed = _seed()
    n = 1200
    ids = 1000 + np.arange(n, dtype=np.int64)
    ids[::3] += 2**31  # does not fit
    store = make_store(n, 64, seed, ids=ids)
    srv = servers(store, 64, shm_name)
    ans = run_client(c_client, 500, seed, 64, shm_name, tmp_path)
    ref_ids, ref_vecs = store.live()
    visible = (ref_ids >= 0) & (ref_ids <= 2**31 - 1)
    shown = Store(NumpyEngine(64), threading.Lock())
    shown.engine.add(ref_ids[visible], ref_vecs[visible].astype(np.float32), 0, 0.0)
    check_answers(ans, shown)
    assert srv.stats["hidden_ids"] > 0 and srv.stats["errors"] == 0


# == bad input (the Python client) ==========================================================


@pytest.fixture
def running(servers, shm_name):
    """(client, store, server) over a small store: D=32, 300 items, some deleted."""
    seed = _seed()
    store = make_store(300, 32, seed)
    client = PyClient(shm_name)
    srv = servers(store, 32, shm_name, log=logging.getLogger("kalos.server.seed_compat.test"))
    wait_attached(srv)
    yield client, store, srv, np.random.default_rng(seed)
    client.close()


def _bad_cases(dim: int):
    q = np.ones(dim, np.float32)
    nan, inf = q.copy(), q.copy()
    nan[3] = np.nan
    inf[-1] = -np.inf
    return {
        "query_dim too small": (dict(query=q, dim=dim - 1), "query_dim"),
        "query_dim too large": (dict(query=q, dim=dim + 1), "query_dim"),
        "query_dim 0": (dict(query=q, dim=0), "query_dim"),
        "query_dim 1025": (dict(query=q, dim=MAX_QUERY_DIM + 1), "query_dim"),
        "query_dim 2**32-1": (dict(query=q, dim=2**32 - 1), "query_dim"),
        "NaN": (dict(query=nan), "NaN"),
        "inf": (dict(query=inf), "infinity"),
        "zero vector": (dict(query=np.zeros(dim, np.float32)), "zero"),
        "wrong magic": (dict(query=q, magic=0xDEADBEEF), "magic"),
        "zero magic": (dict(query=q, magic=0), "magic"),
        "wrong version": (dict(query=q, version=2), "version"),
        "ready garbage": (dict(query=q, ready=0xFFFFFFFF), "ready"),
        "ready 2": (dict(query=q, ready=2), "ready"),
    }


@pytest.mark.parametrize("case", list(_bad_cases(32)))
def test_bad_requests_are_refused_and_serving_continues(running, case, caplog):
    client, store, srv, rng = running
    kw, needle = _bad_cases(32)[case]
    with caplog.at_level(logging.ERROR, logger="kalos.server.seed_compat.test"):
        assert_refused(client.request(**kw))
    assert srv.stats["errors"] == 1 and needle in srv.stats["last_error"]
    assert any(needle in r.getMessage() for r in caplog.records)
    if "magic" in kw or "version" in kw:
        client.init()  # the client re-initialises, as the article's client does at start
    q = rng.standard_normal(32).astype(np.float32)
    assert_good_answer(client.request(q), store, q)
    assert srv.stats["errors"] == 1 and srv.stats["served"] == 1


def test_memory_count_and_done_garbage_do_not_matter(running):
    client, store, srv, rng = running
    for memory_count in (0, 1, 7, 2**32 - 1):
        client.words[W["memory_count"]] = memory_count
        q = rng.standard_normal(32).astype(np.float32) * 1e-30  # tiny but non-zero: normalised
        assert_good_answer(client.request(q), store, q)
        assert client.words[W["memory_count"]] == memory_count  # Kalos never writes it
    assert srv.stats["errors"] == 0


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(header=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=8),
       payload=st.binary(min_size=SEGMENT_SIZE - 32, max_size=SEGMENT_SIZE - 32),
       keep=st.sets(st.sampled_from(["magic", "version", "query_dim", "ready"])))
def test_garbage_in_every_field_never_breaks_the_server(running, header, payload, keep):
    """Random bytes everywhere (optionally keeping some fields valid); ready raised last."""
    client, store, srv, rng = running
    words = dict(zip(SEED_LAYOUT.names[:8], header))
    valid = dict(magic=MAGIC, version=VERSION, query_dim=32, ready=1)
    words.update({f: valid[f] for f in keep})
    words["done"] = 0
    ready = words.pop("ready")
    if ready == 0:
        ready = 1  # a request must be raised to get an answer
    errors = srv.stats["errors"]
    client.mm[32:] = payload
    for field, value in words.items():
        client.words[W[field]] = value
    full_fence()
    client.words[W["ready"]] = ready
    count, ids, scores = client.receive()
    with np.errstate(invalid="ignore"):  # random bytes hold signalling NaNs
        query = client.rec["query"][:32].astype(np.float64)
    serveable = (ready == 1 and words["magic"] == MAGIC and words["version"] == VERSION
                 and words["query_dim"] == 32 and np.isfinite(query).all() and (query != 0).any())
    if serveable:
        assert count == TOP_K and srv.stats["errors"] == errors
        assert_good_answer((count, ids, scores), store, query)
    else:
        assert_refused((count, ids, scores))
        assert srv.stats["errors"] == errors + 1
    client.init()
    q = rng.standard_normal(32).astype(np.float32)
    assert_good_answer(client.request(q), store, q)


def test_search_failure_is_answered_and_serving_continues(servers, shm_name):
    seed = _seed()
    store = make_store(100, 16, seed)
    fail = [True]

    def search(q, k):
        if fail[0]:
            raise RuntimeError("engine on fire")
        return store.search(q, k)

    client = PyClient(shm_name)
    srv = servers(search, 16, shm_name)
    q = np.ones(16, np.float32)
    assert_refused(client.request(q))
    assert "engine on fire" in srv.stats["last_error"]
    fail[0] = False
    assert_good_answer(client.request(q), store, q)
    client.close()


def test_fewer_live_items_than_k(servers, shm_name):
    seed = _seed()
    store = make_store(5, 16, seed, delete_frac=0.0)
    client = PyClient(shm_name)
    srv = servers(store, 16, shm_name)
    q = np.ones(16, np.float32)
    answer = client.request(q)
    assert answer[0] == 5
    assert_good_answer(answer, store, q)
    store.engine.delete(store.live()[0])
    assert_refused(client.request(q))  # an empty store: nothing to answer, not an error
    assert srv.stats["errors"] == 0 and srv.stats["served"] == 2
    client.close()


def test_ids_beyond_int32_are_never_reported(servers, shm_name):
    seed = _seed()
    rng = np.random.default_rng(seed)
    dim = 16
    target = as_unit_rows(rng.standard_normal((1, dim)))[0]
    # 100 items right next to the query, with ids no int32 can hold, so the server must widen
    # its search past k = 64; then ordinary items.
    near = as_unit_rows(target + 0.01 * rng.standard_normal((100, dim)))
    far = as_unit_rows(rng.standard_normal((400, dim)))
    huge = np.concatenate([2**31 + np.arange(50), -5 - np.arange(50)]).astype(np.int64)
    engine = NumpyEngine(dim)
    engine.add(huge, near, 0, 0.0)
    engine.add(10 + np.arange(400), far, 0, 0.0)
    store = Store(engine, threading.Lock())
    client = PyClient(shm_name)
    srv = servers(store, dim, shm_name)
    count, ids, scores = client.request(target)
    visible = Store(NumpyEngine(dim), threading.Lock())
    visible.engine.add(10 + np.arange(400), far, 0, 0.0)
    assert_good_answer((count, ids, scores), visible, target)
    assert srv.stats["hidden_ids"] >= 100 and srv.stats["errors"] == 0
    client.close()


def test_ready_is_cleared_before_the_answer_is_computed(servers, shm_name):
    """The lost-request fix: ready = 0 is stored before any result and before done = 1.

    (The article's sidecar stored done = 1 first; a fast client could raise ready for its next
    request in between and the sidecar's late ready = 0 erased it.)
    """
    seed = _seed()
    store = make_store(100, 16, seed)
    client = PyClient(shm_name)
    seen: list[tuple[int, int]] = []

    def watching_search(q, k):
        seen.append((int(client.words[W["ready"]]), int(client.words[W["done"]])))
        return store.search(q, k)

    servers(watching_search, 16, shm_name)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        q = rng.standard_normal(16).astype(np.float32)
        assert_good_answer(client.request(q), store, q)
    assert seen == [(0, 0)] * 20
    client.close()


def test_answer_for_a_restarted_client_is_dropped(servers, shm_name):
    """The client dies mid-request and a new one re-zeroes the segment before the answer is out."""
    seed = _seed()
    store = make_store(200, 16, seed)
    entered, release = threading.Event(), threading.Event()

    def slow_search(q, k):
        entered.set()
        release.wait(DEADLINE_S)
        return store.search(q, k)

    client = PyClient(shm_name)
    srv = servers(slow_search, 16, shm_name)
    client.send(np.ones(16, np.float32), request_id=41)
    assert entered.wait(DEADLINE_S)
    client.init()  # the new client's memset + magic + version + memory_count
    release.set()
    _wait_until(lambda: srv.stats["stale_dropped"] == 1, "the stale answer to be dropped")
    assert client.words[W["done"]] == 0  # nothing published into the new client's segment
    q = np.random.default_rng(seed).standard_normal(16).astype(np.float32)
    assert_good_answer(client.request(q), store, q)
    client.close()


# == the segment's lifecycle ================================================================


def test_waits_for_the_clients_ftruncate(servers, shm_name):
    seed = _seed()
    store = make_store(50, 8, seed)
    path = segment_path(shm_name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # the client, before its ftruncate
    os.close(fd)
    srv = servers(store, 8, shm_name)
    time.sleep(0.1)
    assert srv.stats["attaches"] == 0 and os.stat(path).st_size == 0 and srv.stats["internal_errors"] == 0
    client = PyClient(shm_name)  # ftruncate, memset, magic
    q = np.ones(8, np.float32)
    assert_good_answer(client.request(q), store, q)
    assert not srv.stats["segment_created"]
    client.close()


def test_kalos_creates_an_owner_only_segment_and_recreates_it_when_unlinked(servers, shm_name):
    seed = _seed()
    store = make_store(50, 8, seed)
    srv = servers(store, 8, shm_name)
    wait_attached(srv)
    path = segment_path(shm_name)
    st1 = os.stat(path)
    assert stat.S_IMODE(st1.st_mode) == 0o600 and st1.st_size == SEGMENT_SIZE
    words = np.fromfile(path, np.uint32, 8)
    assert words[W["magic"]] == MAGIC and words[W["version"]] == VERSION
    os.unlink(path)
    wait_attached(srv, 2)
    st2 = os.stat(path)
    assert st2.st_ino != st1.st_ino and stat.S_IMODE(st2.st_mode) == 0o600
    client = PyClient(shm_name)
    q = np.ones(8, np.float32)
    assert_good_answer(client.request(q), store, q)
    client.close()


def test_stop_is_idempotent_and_never_unlinks(shm_name):
    store = make_store(10, 8, 0)
    srv = SeedCompatServer(search=store.search, dim=8, shm_name=shm_name)
    srv.stop()  # before start: fine
    client = PyClient(shm_name)
    inode = os.stat(client.path).st_ino
    srv.start()
    wait_attached(srv)
    srv.stop()
    srv.stop()
    assert os.stat(client.path).st_ino == inode  # the client's segment stays
    client.close()
    unlink_segment(shm_name)
    own = SeedCompatServer(search=store.search, dim=8, shm_name=shm_name)
    with own:
        wait_attached(own)
        assert own.stats["segment_created"]
    assert os.path.exists(segment_path(shm_name))  # its own segment stays too (for the next sidecar)
    with pytest.raises(InvalidArgument):
        own.start()  # a stopped server is not restarted


@pytest.mark.parametrize(
    "kw",
    [dict(dim=0), dict(dim=MAX_QUERY_DIM + 1), dict(dim=True), dict(spin_us=-1), dict(spin_us=float("nan")),
     dict(shm_name="kalos"), dict(shm_name="/a/b"), dict(shm_name="/"), dict(shm_name="/" + "x" * 300),
     dict(search=None)],
)
def test_constructor_rejects_bad_arguments(kw):
    args = dict(search=lambda q, k: None, dim=8, shm_name="/kalos_test_ctor")
    args.update(kw)
    with pytest.raises(InvalidArgument):
        SeedCompatServer(**args)


# -- through the real sidecar: kalos serve --seed-compat ---------------------------------


@dataclass
class _AddedStore:
    """What the test added through the Client: the reference's view of the sidecar's store."""

    ids: np.ndarray
    vectors: np.ndarray

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        v = self.vectors.astype(np.float64)
        return self.ids, v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.mark.parametrize("order", ["sidecar-first", "client-first"])
def test_kalos_serve_seed_compat_answers_the_article_client(c_client, shm_name, tmp_path, monkeypatch, order):
    """`kalos serve --seed-compat`: the article's C client, unchanged, against the store's memories."""
    from kalos import Client
    from kalos.server.launcher import SidecarProcess

    seed = _seed()
    dim = 256
    runtime = Path(f"/tmp/ks{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("KALOS_RUNTIME_DIR", str(runtime))
    name = f"seed{uuid.uuid4().hex[:8]}"
    store_path = tmp_path / "store.db"
    vectors = np.random.default_rng(seed).standard_normal((2000, dim)).astype(np.float32)
    # The store's memories exist before the seed client asks: fill the store first, offline of it.
    with SidecarProcess(store_path, name=name, dim=dim, device="cpu") as filler, Client(name) as client:
        ids = np.concatenate([client.add(vectors[:1000], namespace="a"), client.add(vectors[1000:], namespace="b")])
        client.delete(ids[::10])
    keep = np.ones(len(ids), bool)
    keep[::10] = False
    added = _AddedStore(ids[keep], vectors[keep])
    dump = tmp_path / "queries.f32"
    proc = None
    args = ["--seed-compat", "--seed-compat-shm", shm_name]
    try:
        if order == "client-first":
            proc = subprocess.Popen(client_cmd(c_client, 400, seed, dim, shm_name, dump), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            path = segment_path(shm_name)
            _wait_until(lambda: os.path.exists(path) and os.stat(path).st_size >= SEGMENT_SIZE, "the client's segment")
        with SidecarProcess(store_path, name=name, device="cpu", extra_args=args) as sidecar:
            assert shm_name in sidecar.ready_line
            if proc is None:
                ans = run_client(c_client, 400, seed, dim, shm_name, tmp_path)
            else:
                out, err = proc.communicate(timeout=600)
                assert proc.returncode == 0, err
                ans = parse_client(out, dump, dim)
            with Client(name) as client:
                seed_stats = client.stats()["seed_compat"]
            assert "Traceback" not in sidecar.log()
        check_answers(ans, added)
        assert seed_stats["served"] == 400 and seed_stats["errors"] == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        shutil.rmtree(runtime, ignore_errors=True)
