"""Embedding in the sidecar (issue 20, item 4): one model for every client of the host.

One CPU sidecar (ONNX runtime) serves the module. Covered: remember + recall_text end to end
with a client that has no embedder, a client process that recalls by text without importing
torch, the ONNX export against sentence-transformers on real text (cosine >= 0.999), concurrent
recall_text from threads (batched into shared embedding calls) and processes, texts of any
length, bad input refused by name with nothing stored, a sidecar that does not embed, and the
fallback to sentence-transformers when ONNX is impossible.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import DEADLINE_S, segment_path, short_tempdir, unique_name

from kalos import Client, InvalidArgument
from kalos.client.aio import AsyncClient
from kalos.client.embed import DEFAULT_DIM, DEFAULT_MODEL, EmbedderUnavailable, default_embedder
from kalos.server.launcher import SidecarProcess
from kalos.tools.corpus import QUESTIONS as PYDOC_QUESTIONS
from kalos.tools.corpus import passages

pytest.importorskip("onnxruntime")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FACTS = [
    "Alice's birthday is on the third of March.",
    "The production database password rotates every ninety days.",
    "Bob prefers green tea over coffee in the morning.",
    "The deploy key lives in the vault under ops/deploy.",
    "Our office moved to 12 Harbour Street in Lisbon.",
    "The quarterly report is due on the last Friday of the quarter.",
]
QUESTIONS = [
    ("When does Alice celebrate her birthday?", 0),
    ("How often is the database password changed?", 1),
    ("What does Bob like to drink?", 2),
    ("Where can I find the deploy key?", 3),
    ("What is the address of the office?", 4),
    ("When must the quarterly report be handed in?", 5),
]


class EmbedSidecar:
    """A sidecar in its own runtime dir (``kalos serve`` flags in ``extra``), torn down whatever happens."""

    def __init__(self, dim: int, extra: tuple[str, ...] = ()) -> None:
        self.monkeypatch = pytest.MonkeyPatch()
        self.runtime = short_tempdir("ke")
        self.monkeypatch.setenv("KALOS_RUNTIME_DIR", self.runtime)
        self.store_dir = short_tempdir("kes")
        self.name = unique_name("emb")
        self.process: SidecarProcess | None = None
        self.process = SidecarProcess(Path(self.store_dir) / "e.db", name=self.name, dim=dim, device="cpu",
                                      extra_args=extra)

    def close(self) -> None:
        try:
            if self.process is not None:
                self.process.stop(timeout=10)
                if self.process.process.poll() is None:
                    self.process.kill()
        finally:
            try:
                segment_path(self.name).unlink()
            except FileNotFoundError:
                pass
            shutil.rmtree(self.runtime, ignore_errors=True)
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.monkeypatch.undo()


@pytest.fixture(scope="module")
def onnx():
    """The ONNX runtime in this process (exported into the user's cache on first use, as the
    sidecar does: the sidecar below then loads the cached graph)."""
    from kalos.server.sidecar_embed import onnx_embedder

    return onnx_embedder()


@pytest.fixture(scope="module")
def sidecar(onnx) -> Iterator[EmbedSidecar]:
    sc = EmbedSidecar(DEFAULT_DIM, ("--embed", "start"))
    try:
        with Client(sc.name, timeout=DEADLINE_S) as c:
            c.remember(FACTS, namespace="facts")
        yield sc
    finally:
        sc.close()


@pytest.fixture
def ns() -> str:
    return f"e-{uuid.uuid4().hex[:12]}"


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_onnx_embeddings_equal_sentence_transformers_on_real_text(onnx):
    # Passages of Python's help (long: truncated at the model's 256 tokens), short questions, facts.
    texts = [p.text for p in passages()[::40][:20]] + list(PYDOC_QUESTIONS) + FACTS + [q for q, _ in QUESTIONS]
    reference = default_embedder().embed(texts)
    # Batched (padded to the longest of each run) and one by one (no padding) alike.
    batched = onnx.embed(texts)
    alone = np.vstack([onnx.embed([t]) for t in texts[:24]])
    assert _cosines(batched, reference).min() >= 0.999
    assert _cosines(alone, reference[:24]).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)


def test_remember_and_recall_text_embed_in_the_sidecar(sidecar, onnx):
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        embedder = c.embedder
        assert (embedder.name, embedder.dim, embedder.runtime) == (DEFAULT_MODEL, DEFAULT_DIM, "onnx")
        for question, fact in QUESTIONS:
            hits = c.recall_text(question, k=2, namespace="facts")
            assert hits[0].text == FACTS[fact], (question, hits)
        # What the sidecar stored is the model's vector of the text.
        ids = [h.id for h in c.recall_text(FACTS[3], k=1, namespace="facts")]
        stored = c.get(ids=ids, with_vectors=True)[0]
        assert stored.text == FACTS[3]
        assert _cosines(stored.vector[None], onnx.embed([FACTS[3]]))[0] > 0.99999


def test_a_recall_text_hit_carries_the_stored_items_fields(sidecar, ns):
    """The one round trip's hit of a keyed memory that an upsert revised: its fields are the
    stored item's, as get returns it."""
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        c.remember(["Carol keeps bees on the roof."], namespace=ns, keys=["carol"], metadata=[{"who": "carol"}])
        c.remember(["Carol keeps bees on the library's roof."], namespace=ns, keys=["carol"],
                   metadata=[{"who": "carol", "v": 2}])
        (hit,) = c.recall_text("Who keeps bees?", k=1, namespace=ns)
        (item,) = c.get(ids=[hit.id])
    fields = ("id", "text", "metadata", "namespace", "created_at", "key", "updated_at")
    assert [getattr(hit, f) for f in fields] == [getattr(item, f) for f in fields]
    assert (hit.key, hit.metadata, hit.namespace) == ("carol", {"who": "carol", "v": 2}, ns)
    assert hit.updated_at is not None and 0.0 < hit.score <= 1.0001

_CLIENT_WITHOUT_TORCH = r"""
import sys
from kalos import Client
with Client(sys.argv[1], timeout=60) as c:
    hits = c.recall_text("What does Bob like to drink?", k=1, namespace="facts")
    assert hits[0].text.startswith("Bob prefers green tea"), hits
    ids = c.remember(["A memory added by text from a client without torch."], namespace=sys.argv[2])
    assert c.recall_text("a client without torch", k=1, namespace=sys.argv[2])[0].id == ids[0]
heavy = sorted(m for m in ("torch", "sentence_transformers", "transformers", "onnxruntime", "tokenizers")
               if m in sys.modules)
print("heavy:", heavy)
assert not heavy, heavy
"""


def test_a_client_recalls_by_text_with_numpy_only(sidecar, ns):
    out = subprocess.run([sys.executable, "-c", _CLIENT_WITHOUT_TORCH, sidecar.name, ns], capture_output=True,
                         text=True, timeout=DEADLINE_S, env={**os.environ, "KALOS_RUNTIME_DIR": sidecar.runtime})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "heavy: []" in out.stdout


def test_the_cpu_sidecar_serves_a_cached_onnx_graph_without_torch(sidecar):
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        c.recall_text("warm", k=1, namespace="facts")
    maps = Path(f"/proc/{sidecar.process.pid}/maps").read_text()
    assert "onnxruntime" in maps and "libtorch" not in maps


def test_concurrent_recall_text_from_threads_is_batched_and_answered(sidecar):
    before = Client(sidecar.name, timeout=DEADLINE_S)._control({"op": "embedder"})[0]
    errors: list[BaseException] = []
    wrong: list[tuple[str, str | None]] = []
    barrier = threading.Barrier(8)

    def agent(i: int) -> None:
        try:
            with Client(sidecar.name, timeout=DEADLINE_S) as c:
                barrier.wait()
                for r in range(4):
                    question, fact = QUESTIONS[(i + r) % len(QUESTIONS)]
                    hit = c.recall_text(question, k=1, namespace="facts")[0]
                    if hit.text != FACTS[fact]:
                        wrong.append((question, hit.text))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not errors and not wrong, (errors, wrong)
    after = Client(sidecar.name, timeout=DEADLINE_S)._control({"op": "embedder"})[0]
    texts, calls = after["texts"] - before["texts"], after["calls"] - before["calls"]
    assert texts == 32
    assert calls < texts  # texts of several agents shared an embedding call


_AGENT = r"""
import sys
from kalos import Client
facts = sys.argv[2].split("|")
questions = sys.argv[3].split("|")
with Client(sys.argv[1], timeout=60) as c:
    for _ in range(3):
        for q, f in zip(questions, facts):
            assert c.recall_text(q, k=1, namespace="facts")[0].text == f, q
print("ok")
"""


def test_concurrent_recall_text_from_processes(sidecar):
    env = {**os.environ, "KALOS_RUNTIME_DIR": sidecar.runtime}
    procs = []
    for i in range(3):
        pick = [QUESTIONS[(i + j) % len(QUESTIONS)] for j in range(3)]
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _AGENT, sidecar.name, "|".join(FACTS[f] for _, f in pick), "|".join(q for q, _ in pick)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    for p in procs:
        out, err = p.communicate(timeout=DEADLINE_S)
        assert p.returncode == 0 and out.strip() == "ok", err


def test_texts_of_any_length_travel_over_the_control_socket(sidecar, ns, onnx, monkeypatch):
    long_text = ("The lighthouse keeper logged every passing ship in a leather book. " * 2000)
    assert len(long_text) > 100_000  # far more than a slot's query row holds
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        [memory_id] = c.remember([long_text], namespace=ns)
        hits = c.recall_text(long_text, k=1, namespace=ns)
        assert hits[0].id == memory_id and hits[0].text == long_text and hits[0].score > 0.999
        monkeypatch.setattr(type(c.embedder), "_TEXTS_PER_REQUEST", 16)
        many = [f"note {i}: the meeting moved to room {i}" for i in range(40)]  # three embed requests
        vectors = c.embedder.embed(many)
    assert _cosines(vectors, onnx.embed(many)).min() > 0.99999


def test_bad_text_input_is_refused_by_name_and_stores_nothing(sidecar, ns):
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        with pytest.raises(InvalidArgument, match="one str, got int"):
            c.recall_text(5)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=r"texts\[1\] must be a str, got int"):
            c.recall_texts(["fine", 3])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="at least one text"):
            c.remember([], namespace=ns)
        with pytest.raises(InvalidArgument, match=r"texts\[1\] must be a str, got NoneType"):
            c.remember(["fine", None], namespace=ns)  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match=r"texts\[0\] is empty"):
            c.remember(["   "], namespace=ns)
        # The sidecar's own checks, for a client that skips them.
        for texts, why in (([], "non-empty list"), ("abc", "non-empty list"), (["a", 7], r"texts\[1\] must be a str")):
            with pytest.raises(InvalidArgument, match=why):
                c._control({"op": "embed", "texts": texts})
        with pytest.raises(InvalidArgument, match="load must be true or false"):
            c._control({"op": "embedder", "load": "yes"})
        assert c.count(namespace=ns) == 0


def _ops_sent(client: Client, monkeypatch) -> list[str]:
    """The control operations ``client`` sends from now on, in order."""
    sent: list[str] = []
    control = client._control

    def recording(message, blob=b""):
        sent.append(message["op"])
        return control(message, blob)

    monkeypatch.setattr(client, "_control", recording)
    return sent


def test_recall_text_is_one_round_trip_equal_to_float64(sidecar, ns, monkeypatch):
    """The sidecar embeds, recalls in the client's slot and reads the texts for one control
    request; the hits are the float64 brute force's over the stored vectors, with their texts,
    for one text and several, with filters; the slot serves plain recalls afterwards."""
    from reference import assert_topk_matches

    texts = [p.text[:400] for p in passages()[::9][:60]]
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        ids = c.remember(texts, namespace=ns, metadata=[{"part": i % 3} for i in range(len(texts))])
        stored = np.vstack([item.vector for item in c.get(ids=ids, with_vectors=True)])
        questions = list(PYDOC_QUESTIONS[:6])
        vectors = c.embedder.embed(questions)
        sent = _ops_sent(c, monkeypatch)
        for question, vector in zip(questions, vectors):
            hits = c.recall_text(question, k=5, namespace=ns)
            assert_topk_matches(np.array([[h.id for h in hits]]), np.array([[h.score for h in hits]]), ids, stored,
                                vector[None], 5, context=question)
            assert [h.text for h in hits] == [texts[list(ids).index(h.id)] for h in hits]
        assert sent == ["recall_text"] * len(questions), "one round trip per recall_text, no embed, no get"
        many = c.recall_texts(questions, k=3, namespace=ns, where={"part": 1})
        eligible = np.array([i % 3 == 1 for i in range(len(texts))])
        for hits, vector in zip(many, vectors):
            assert_topk_matches(np.array([[h.id for h in hits]]), np.array([[h.score for h in hits]]), ids, stored,
                                vector[None], 3, eligible, context="where part == 1")
            assert all(h.metadata == {"part": 1} for h in hits)
        # Every namespace (None), and a time window that excludes everything.
        assert c.recall_text(FACTS[2], k=1, namespace=None)[0].text == FACTS[2]
        assert c.recall_text(FACTS[2], k=1, namespace=ns, until=1.0) == []
        # A memory changed after it was recalled is read as it is now (the sidecar keeps the
        # items of recent hits: kalos.server.item_cache).
        top = c.recall_text(questions[0], k=1, namespace=ns)[0]
        c.update(top.id, text="rewritten", metadata={"part": 9})
        again = c.recall_text(questions[0], k=1, namespace=ns)[0]
        assert (again.id, again.text, again.metadata) == (top.id, "rewritten", {"part": 9})
        # The slot is this client's again: plain recalls and pings alternate with it.
        for question, vector in zip(questions, vectors):
            c.ping()
            assert c.recall(vector, k=1, namespace=ns).ids[0] == c.recall_text(question, k=1, namespace=ns)[0].id
        assert "embed" not in sent and "get" not in sent


def test_a_recall_after_recall_text_writes_its_own_words_again(sidecar, ns):
    """The sidecar wrote its k, namespace and filter into the slot: the client's next recall with
    the same arguments as before the recall_text must not take the slot's words for its own."""
    other = f"{ns}-b"
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        texts = [p.text[:300] for p in passages()[:40]]
        c.remember(texts, namespace=ns)
        c.remember(FACTS, namespace=other)
        vector = c.embedder.embed([PYDOC_QUESTIONS[0]])[0]
        before = c.recall(vector, k=5, namespace=ns)
        assert len(c.recall_text(FACTS[1], k=1, namespace=other, where={"x": {"$ne": 1}})) == 1
        after = c.recall(vector, k=5, namespace=ns)
        assert after.ids.tolist() == before.ids.tolist() and len(after.ids) == 5


def test_recall_text_registers_an_evicted_where_clause_again(sidecar, ns, monkeypatch):
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        c.remember(FACTS, namespace=ns, metadata=[{"n": i} for i in range(len(FACTS))])
        assert [h.text for h in c.recall_text(QUESTIONS[2][0], k=1, namespace=ns, where={"n": 2})] == [FACTS[2]]
        # As if the sidecar's bounded table had evicted the clause: the handle it names is unknown.
        [key] = list(c._where_handles)
        c._where_handles[key] = (c._where_handles[key][0], 4_000_000)
        sent = _ops_sent(c, monkeypatch)
        assert [h.text for h in c.recall_text(QUESTIONS[2][0], k=1, namespace=ns, where={"n": 2})] == [FACTS[2]]
        assert sent == ["recall_text", "where", "recall_text"]
        assert c.recall(c.embedder.embed([FACTS[0]])[0], k=1, namespace=ns).ids.size == 1


def test_a_client_falls_back_to_three_round_trips_with_an_older_sidecar(sidecar, ns, monkeypatch):
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        c.remember(FACTS, namespace=ns)
        c._connection().ops = frozenset()  # a sidecar from before op recall_text names no ops
        sent = _ops_sent(c, monkeypatch)
        for question, fact in QUESTIONS:
            assert c.recall_text(question, k=1, namespace=ns)[0].text == FACTS[fact]
        assert sent == ["embed", "get"] * len(QUESTIONS)


def test_bad_recall_text_requests_are_refused_by_name_and_the_sidecar_goes_on(sidecar):
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        max_batch = c._connection().layout.max_batch
        base = {"op": "recall_text", "texts": ["fine"], "k": 1}
        for change, why in (
            ({"texts": []}, "non-empty list"),
            ({"texts": ["x"] * (max_batch + 1)}, f"at most {max_batch} texts"),
            ({"k": 0}, "k=0 is out of range"),
            ({"k": True}, "k=True is out of range"),
            ({"k": 10**6}, "out of range"),
            ({"flags": -1}, "flags must be an unsigned 32-bit"),
            ({"where_handle": 2**64}, "where_handle must be an unsigned 64-bit"),
            ({"since": "yesterday"}, "since must be a finite number"),
            ({"until": 10**400}, "until must be a finite number"),
            ({"namespace": 5}, "namespace must be a str"),
            ({"namespace": "n" * 300}, "namespace longer than 256 bytes"),
        ):
            with pytest.raises(InvalidArgument, match=why):
                c._control({**base, **change})
        # Words the slot check refuses (an unknown flag, a namespace no memory has) come back
        # as the slot's own errors; a where handle never registered too.
        with pytest.raises(InvalidArgument):
            c._control({**base, "flags": 1 << 20})
        with pytest.raises(InvalidArgument, match="where handle 77 is not registered"):
            c._control({**base, "flags": 8, "where_handle": 77})
        c._resync_slot()
        assert c.recall_text("What does Bob like to drink?", k=1, namespace="facts")[0].text == FACTS[2]
    # A connection that never said hello holds no slot.
    import socket as socket_module

    from kalos.ipc.control import recv_frame, send_frame

    with socket_module.socket(socket_module.AF_UNIX) as raw:
        raw.connect(str(Path(sidecar.runtime) / f"{sidecar.name}.sock"))
        send_frame(raw, base)
        reply, _ = recv_frame(raw, max_bytes=1 << 20)
    assert reply["ok"] is False and "holds no slot" in reply["error"]


async def test_the_async_client_recalls_text_in_one_round_trip(sidecar, ns, monkeypatch):
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        c.remember(FACTS, namespace=ns)
        vectors = c.embedder.embed([q for q, _ in QUESTIONS])
    async with AsyncClient(sidecar.name, timeout=DEADLINE_S) as client:
        await client.recall_text("warm", k=1, namespace=ns)  # (both connections open)
        on_slot = _ops_sent(client._recaller, monkeypatch)
        on_control = _ops_sent(await client._control_client(), monkeypatch)
        for (question, fact), vector in zip(QUESTIONS, vectors):
            hits = await client.recall_text(question, k=2, namespace=ns)
            assert hits[0].text == FACTS[fact]
            recalled = await client.recall(vector, k=2, namespace=ns)
            assert recalled.ids.tolist() == [h.id for h in hits]  # the slot is the async client's again
        assert on_slot == ["recall_text"] * len(QUESTIONS)
        assert "embed" not in on_control and "get" not in on_control


async def test_concurrent_async_recall_texts_go_together(sidecar, ns, monkeypatch):
    """Coroutines of one AsyncClient calling recall_text at once: the first goes alone, the
    ones that arrive while it is in flight go in one round trip (one embedding batch, one recall
    batch); each gets what it would alone; another group (k) goes in a request of its own."""
    import asyncio

    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        c.remember(FACTS, namespace=ns)
        alone = {q: [h.id for h in c.recall_text(q, k=2, namespace=ns)] for q, _ in QUESTIONS}
    async with AsyncClient(sidecar.name, timeout=DEADLINE_S) as client:
        await client.recall_text("warm", k=1, namespace=ns)
        batches: list[int] = []
        control = client._recaller._control

        def recording(message, blob=b""):
            if message["op"] == "recall_text":
                batches.append(len(message["texts"]))
            return control(message, blob)

        monkeypatch.setattr(client._recaller, "_control", recording)
        questions = [q for q, _ in QUESTIONS]
        got = await asyncio.gather(*(client.recall_text(q, k=2, namespace=ns) for q in questions),
                                   client.recall_text(questions[0], k=1, namespace=ns))
        for q, hits in zip(questions, got):
            assert [h.id for h in hits] == alone[q], q
        assert [h.id for h in got[-1]] == alone[questions[0]][:1]
        assert batches == [1, len(questions) - 1, 1], batches


async def test_a_cancelled_async_recall_text_keeps_the_slot_until_the_sidecar_replies(sidecar, ns):
    """Cancelled twice while the sidecar embeds and recalls in the slot: the coroutine ends
    cancelled, and the next recalls on the slot still get their own answers."""
    import asyncio

    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        c.remember(FACTS, namespace=ns)
        vectors = c.embedder.embed([q for q, _ in QUESTIONS])
        want = [c.recall(v, k=3, namespace=ns).ids.tolist() for v in vectors]
    async with AsyncClient(sidecar.name, timeout=DEADLINE_S) as client:
        await client.recall_text("warm", k=1, namespace=ns)
        for delay in (0.0, 0.0005, 0.001, 0.002):
            task = asyncio.ensure_future(client.recall_text(QUESTIONS[0][0] * 20, k=8, namespace=None))
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            got = await asyncio.gather(*(client.recall(v, k=3, namespace=ns) for v in vectors))
            assert [g.ids.tolist() for g in got] == want
            assert (await client.recall_text(QUESTIONS[1][0], k=1, namespace=ns))[0].text == FACTS[QUESTIONS[1][1]]


async def test_the_async_client_embeds_in_the_sidecar(sidecar):
    async with AsyncClient(sidecar.name, timeout=DEADLINE_S) as client:
        hits = await client.recall_text("Where can I find the deploy key?", k=1, namespace="facts")
        assert hits[0].text == FACTS[3]
        assert (await client.embedder()).runtime == "onnx"


def test_a_sidecar_that_does_not_embed_says_what_to_do():
    off = EmbedSidecar(DEFAULT_DIM, ("--embed", "off"))
    try:
        with Client(off.name, timeout=DEADLINE_S) as c:
            with pytest.raises(EmbedderUnavailable, match=r"--embed off.*Client\(embedder=\.\.\.\)"):
                c.recall_text("anything")
            # A client-side embedder still works against it.
            with Client(off.name, timeout=DEADLINE_S, embedder=lambda texts: np.ones((len(texts), DEFAULT_DIM))) as mine:
                mine.remember(["kept"])
                assert mine.recall_text("kept", k=1)[0].text == "kept"
    finally:
        off.close()


def test_onnx_impossible_falls_back_to_sentence_transformers_with_a_reason(monkeypatch, caplog):
    import kalos.server.sidecar_embed as se

    def no_onnx():
        raise RuntimeError("the exporter is broken here")

    made = []

    class FakeST:
        def __init__(self, path, **kwargs):
            made.append((path, kwargs))

    monkeypatch.setattr(se, "onnx_embedder", no_onnx)
    monkeypatch.setattr(se, "SentenceTransformerEmbedder", FakeST)
    with caplog.at_level(logging.WARNING, logger="kalos.client.embed"):
        embedder = se.load_embedder("auto", "cpu")
    assert isinstance(embedder, FakeST) and embedder.runtime == "torch (cpu)"
    assert made[0][1]["device"] == "cpu" and made[0][1]["local_files_only"] is True
    assert "ONNX runtime" in caplog.text and "the exporter is broken here" in caplog.text
    # On a GPU sidecar auto is the CUDA graphs of the Triton kernels on its (first) GPU, then
    # those of the model's own kernels, without trying ONNX; when both are impossible,
    # sentence-transformers there, with the reasons logged.
    import kalos.server.embed_graphs as eg

    made.clear()
    graphed = []

    def no_graphs(model, device, kernels="torch"):
        graphed.append((device, kernels))
        raise RuntimeError(f"capture of the {kernels} kernels refused")

    monkeypatch.setattr(se, "onnx_embedder", lambda: pytest.fail("ONNX tried on a GPU sidecar"))
    monkeypatch.setattr(se, "_triton_installed", lambda: True)
    monkeypatch.setattr(eg, "GraphedEmbedder", no_graphs)
    monkeypatch.setattr(se, "_model_path", lambda: Path("/nonexistent/model"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kalos.client.embed"):
        assert se.load_embedder("auto", "cuda:1,cuda:2").runtime == "torch (cuda:1)"
    assert graphed == [("cuda:1", "triton"), ("cuda:1", "torch")]
    assert "triton kernels refused" in caplog.text and "torch kernels refused" in caplog.text
    with pytest.raises(EmbedderUnavailable, match="graphs needs a GPU"):
        se.load_embedder("graphs", "cpu")
    with pytest.raises(ValueError, match="embed runtime"):
        se.load_embedder("tensorrt", "cpu")


def _graphed(device: str):
    from kalos.server.embed_graphs import GraphedEmbedder
    from kalos.server.sidecar_embed import _model_path

    return GraphedEmbedder(_model_path(), device)


def _graph_texts() -> list[str]:
    # Passages of Python's help (long: truncated at the model's 256 tokens), short questions,
    # facts, and more texts than one run holds (MAX_RUN).
    return ([p.text for p in passages()[::40][:20]] + list(PYDOC_QUESTIONS) + FACTS + [q for q, _ in QUESTIONS]
            + [p.text[:80] for p in passages()[::7][:30]])


def test_the_graph_buckets_equal_sentence_transformers_on_real_text():
    """The GPU runtime's padding into shape buckets, run eagerly on the CPU device: the same
    vectors as sentence-transformers, whatever bucket a text lands in."""
    from kalos.server.embed_graphs import MAX_RUN, MIN_TOKENS

    graphed = _graphed("cpu")
    assert graphed.runtime.startswith("buckets (cpu")
    texts = _graph_texts()
    assert len(texts) > MAX_RUN
    reference = default_embedder().embed(texts)
    batched = graphed.embed(texts)
    alone = np.vstack([graphed.embed([t]) for t in texts[:24]])
    assert _cosines(batched, reference).min() >= 0.9999
    assert _cosines(alone, reference[:24]).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    texts_per_bucket, tokens_per_bucket = zip(*graphed.buckets)
    assert max(texts_per_bucket) == MAX_RUN and min(tokens_per_bucket) == MIN_TOKENS
    assert max(tokens_per_bucket) == graphed.max_tokens  # the long passages: truncated, not refused
    with pytest.raises(InvalidArgument, match="empty"):
        graphed.embed(["fine", "  "])
    # A text alone after a longer one of the same bucket: none of the longer one's tokens stay.
    short, longer = "What does the global statement do?", "What does the global statement do inside a nested function body?"
    assert len(graphed.tokenizer.encode(short).ids) < len(graphed.tokenizer.encode(longer).ids) <= MIN_TOKENS
    first = graphed.embed([short])
    assert _cosines(graphed.embed([longer]), first).max() < 0.999
    np.testing.assert_allclose(graphed.embed([short]), first, atol=1e-6)


@pytest.mark.cuda
def test_the_gpu_runtime_replays_graphs_equal_to_sentence_transformers():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kalos.server.sidecar_embed import load_embedder

    graphed = load_embedder("graphs", "cuda")  # (auto is the Triton kernels' graphs: test_minilm_kernels)
    assert graphed.runtime == "graphs (cuda)", "the model's own kernels, captured"
    texts = _graph_texts()
    reference = default_embedder().embed(texts)
    assert _cosines(graphed.embed(texts), reference).min() >= 0.9999
    alone = np.vstack([graphed.embed([t]) for t in texts[:24]])
    assert _cosines(alone, reference[:24]).min() >= 0.9999
    assert all(graphed._buckets[b].graph is not None for b in graphed.buckets)
    # The graph reads the host buffer at each replay: a text alone after a longer one of its bucket.
    short, longer = "What does the global statement do?", "What does the global statement do inside a nested function body?"
    first = graphed.embed([short])
    graphed.embed([longer])
    np.testing.assert_allclose(graphed.embed([short]), first, atol=1e-6)
    assert _cosines(first, default_embedder().embed([short])).min() >= 0.9999


def test_a_big_request_is_embedded_in_slices_beside_the_small_ones(monkeypatch):
    import kalos.server.sidecar_embed as se

    calls: list[list[str]] = []
    first_call = threading.Event()
    release = threading.Event()

    class Recording:
        name, dim, runtime = "recording", 4, "fake"

        def embed(self, texts):
            calls.append(list(texts))
            first_call.set()
            release.wait(DEADLINE_S)  # the small request is queued while the first slice runs
            return np.array([[float(t.split()[1]) if t.startswith("big") else -1.0] * 4 for t in texts], np.float32)

    monkeypatch.setattr(se, "load_embedder", lambda runtime, device: Recording())
    monkeypatch.setattr(se, "_CALL_CHARS", 300)
    service = se.EmbedService("lazy", "auto", "cpu")
    big = [f"big {i}" for i in range(200)][::-1]  # 5 to 7 characters, the longest first
    out: dict[str, np.ndarray] = {}
    worker = threading.Thread(target=lambda: out.setdefault("big", service.embed(big)))
    worker.start()
    assert first_call.wait(DEADLINE_S)
    small = threading.Thread(target=lambda: out.setdefault("small", service.embed(["small"])))
    small.start()
    # Only once the small request is queued does the first slice end: released earlier, the
    # worker could take the big request's next slice before the small one arrived.
    queued_by = time.monotonic() + DEADLINE_S
    while service._queue.empty() and time.monotonic() < queued_by:
        time.sleep(0.001)
    release.set()
    small.join(DEADLINE_S)
    worker.join(DEADLINE_S)
    service.close()
    # Alone, the big request's slices hold 300 characters; beside the small one, half of that.
    assert sum(len(t) for t in calls[0]) <= 300 < sum(len(t) for t in calls[0]) + 7
    # The small request rode along with a slice of the big one (the worker had work: no
    # embedding in the caller's thread then), which gave it half the call.
    assert "small" in calls[1] and len(calls[1]) > 1 and sum(len(t) for t in calls[1] if t != "small") <= 150
    assert all(sum(len(t) for t in c) <= 300 for c in calls) and len(calls) > 4
    done = [t for c in calls for t in c if t != "small"]
    assert sorted(done) == sorted(big) and [len(t) for t in done] == sorted(len(t) for t in big)  # once each, shortest first
    # Each text got its own row back (the fake's row is the text's number).
    np.testing.assert_array_equal(out["big"][:, 0], [float(t.split()[1]) for t in big])
    np.testing.assert_array_equal(out["small"], [[-1.0] * 4])


def test_a_short_request_embeds_in_its_own_thread_only_when_nobody_else_is(monkeypatch):
    """An idle service embeds a short request in the caller's thread; while that runs, another
    request goes through the queue (to the worker), and the worker's requests go first."""
    import kalos.server.sidecar_embed as se

    threads: list[tuple[str, str]] = []
    entered = threading.Event()
    release = threading.Event()

    class Recording:
        name, dim, runtime = "recording", 4, "fake"

        def embed(self, texts):
            threads.append((texts[0], threading.current_thread().name))
            if texts[0] == "first":
                entered.set()
                release.wait(DEADLINE_S)
            return np.ones((len(texts), 4), np.float32)

    monkeypatch.setattr(se, "load_embedder", lambda runtime, device: Recording())
    service = se.EmbedService("lazy", "auto", "cpu")
    first = threading.Thread(target=service.embed, args=(["first"],), name="caller-1")
    first.start()
    assert entered.wait(DEADLINE_S)
    second = threading.Thread(target=service.embed, args=(["second"],), name="caller-2")
    second.start()
    release.set()
    first.join(DEADLINE_S)
    second.join(DEADLINE_S)
    assert threads == [("first", "caller-1"), ("second", "kalos-embed")]
    assert service.embed(["third"]).shape == (1, 4) and threads[-1] == ("third", threading.current_thread().name)
    assert (service.calls, service.texts) == (3, 3)
    service.close()
    with pytest.raises(EmbedderUnavailable, match="stopping"):
        service.embed(["after close"])


def test_a_runtime_is_checked_one_text_at_a_time_too():
    """The load check compares a runtime's vectors with the model's in one batch and one text at
    a time: a runtime whose one-text path (an agent's query) is off is refused by name."""
    from kalos.server.embed_model import check_against_reference

    reference = default_embedder().model

    class OffAlone:
        def embed(self, texts):
            vectors = reference.encode(list(texts), convert_to_numpy=True, normalize_embeddings=True,
                                       show_progress_bar=False)
            return vectors if len(texts) > 1 else vectors[:, ::-1].copy()

    class Right(OffAlone):
        def embed(self, texts):
            return reference.encode(list(texts), convert_to_numpy=True, normalize_embeddings=True,
                                    show_progress_bar=False)

    assert check_against_reference(Right(), reference, "right") >= 0.9999
    with pytest.raises(RuntimeError, match="off alone disagrees with sentence-transformers"):
        check_against_reference(OffAlone(), reference, "off alone")
