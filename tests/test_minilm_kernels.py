"""The packaged model as Triton kernels (``--embed-runtime triton``) against the model in float64.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before the kernels are first imported, as in test_torch_engine.py); the interpreter is slow, so
these tests embed a few real texts. Tests marked ``cuda`` need a real GPU and are skipped
without one.
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HAVE_CUDA = torch.cuda.is_available()
if not HAVE_CUDA and "kalos.server.minilm_kernels" not in sys.modules:
    from conftest import import_interpreted

    import_interpreted("kalos.server.minilm_kernels")

pytest.importorskip("sentence_transformers")  # (after the kernels: transformers may import triton)
minilm_kernels = pytest.importorskip("kalos.server.minilm_kernels")
from kalos.client.embed import EmbedderUnavailable, _load_sentence_transformer  # noqa: E402
from kalos.server.minilm_kernels import MiniLMKernels, UnsupportedModel  # noqa: E402
from kalos.tools.corpus import QUESTIONS, passages  # noqa: E402


def _interpreted() -> bool:
    """The kernels and triton.language's own (tl.sum is one) decorated under the interpreter:
    both were imported with TRITON_INTERPRET set."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(minilm_kernels._linear_kernel, InterpretedFunction) and isinstance(standard.sum, InterpretedFunction)


HAVE_INTERPRETER = not HAVE_CUDA and _interpreted()
needs_interpreter = pytest.mark.skipif(not HAVE_INTERPRETER, reason="needs triton's interpreter (no CUDA GPU here)")


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """The interpreter also reads TRITON_INTERPRET while it runs: set it per test only."""
    if HAVE_INTERPRETER:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def model():
    """The packaged sentence-transformers model on the CPU, and its pooling's normalisation."""
    from kalos.server.embed_model import pooling_config
    from kalos.server.sidecar_embed import _model_path

    path = _model_path()
    return _load_sentence_transformer(str(path), device="cpu", local_files_only=True), pooling_config(path)[1]


def _inputs(model, texts: list[str], tokens: int, padding_rows: int = 0):
    """The graphed embedder's input for ``texts`` cut to ``tokens`` tokens, plus rows of padding
    (only their first token unmasked, as the embedder fills a bucket's unused rows)."""
    tokenizer = model.tokenizer
    inputs = torch.zeros((3, len(texts) + padding_rows, tokens), dtype=torch.int64)
    inputs[1, :, 0] = 1
    for row, text in enumerate(texts):
        ids = tokenizer(text, truncation=True, max_length=tokens)["input_ids"]
        inputs[0, row, :len(ids)] = torch.tensor(ids)
        inputs[1, row, :len(ids)] = 1
    return inputs


def _float64_reference(model, normalise: bool, inputs) -> np.ndarray:
    """The model's own forward pass and sentence-transformers' pooling, all in float64."""
    transformer = copy.deepcopy(model[0].auto_model).double().eval()
    with torch.inference_mode():
        states = transformer(input_ids=inputs[0], attention_mask=inputs[1], token_type_ids=inputs[2]).last_hidden_state
        weights = inputs[1].unsqueeze(-1).double()
        mean = (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return (torch.nn.functional.normalize(mean, dim=1) if normalise else mean).numpy()


def _check_against_float64(model, texts: list[str], tokens: int, padding_rows: int) -> None:
    st, normalise = model
    inputs = _inputs(st, texts, tokens, padding_rows)
    assert int(inputs[1, 0].sum()) == tokens, "the first text fills its bucket (truncated to it)"
    if len(texts) > 1:
        assert int(inputs[1, 1].sum()) < tokens, "the second text is padded"
    kernels = MiniLMKernels(st[0].auto_model.eval(), normalise)
    with torch.inference_mode():
        got = kernels(inputs).numpy().astype(np.float64)
    want = _float64_reference(st, normalise, inputs)
    assert got.shape == want.shape == (len(texts) + padding_rows, 384)
    assert np.isfinite(got).all()
    real = len(texts)
    cosines = np.einsum("ij,ij->i", got[:real], want[:real]) / (
        np.linalg.norm(got[:real], axis=1) * np.linalg.norm(want[:real], axis=1))
    assert cosines.min() >= 0.99999, cosines
    # Under the interpreter the products are float32 (no TF32): the rows agree to float32 rounding.
    np.testing.assert_allclose(got, want, atol=2e-5)
    if normalise:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


LONG_QUESTION = "What is the difference between a list and a tuple in Python, and when is each the better choice?"


@needs_interpreter
def test_one_short_query_equals_the_model_in_float64(model):
    """An agent's query: one text in the narrowest bucket (16 rows: the smallest linear tiles)."""
    _check_against_float64(model, [LONG_QUESTION], tokens=16, padding_rows=0)


@needs_interpreter
def test_short_texts_and_padding_equal_the_model_in_float64(model):
    """Real texts in the narrowest bucket (64 rows: the middle tiles): one truncated to it,
    shorter ones padded, and a padding row; one query block per (text, head)."""
    _check_against_float64(model, [LONG_QUESTION, "Bob prefers green tea over coffee.", "Hi."], tokens=16,
                           padding_rows=1)


@needs_interpreter
def test_a_long_passage_equals_the_model_in_float64(model):
    """The model's longest input, 256 tokens (the largest tiles): the attention in four blocks of
    64 queries over 256 keys, the pooling in four blocks of tokens."""
    passage = max((p.text for p in passages()[:80]), key=len)
    _check_against_float64(model, [passage], tokens=256, padding_rows=0)


def test_a_model_the_kernels_do_not_compute_is_refused_by_name():
    config = types.SimpleNamespace(model_type="roberta", hidden_act="relu", position_embedding_type="relative_key",
                                   hidden_size=384, num_attention_heads=5, intermediate_size=1536,
                                   max_position_embeddings=512, layer_norm_eps=1e-12)
    with pytest.raises(UnsupportedModel) as refused:
        MiniLMKernels(types.SimpleNamespace(config=config), normalise=True)
    for named in ("roberta", "relu", "relative_key", "5 heads"):
        assert named in str(refused.value)


def test_the_triton_runtime_needs_a_gpu_and_falls_back_to_the_graphs(monkeypatch, caplog):
    import kalos.server.embed_graphs as eg
    import kalos.server.sidecar_embed as se

    with pytest.raises(EmbedderUnavailable, match="triton needs a GPU"):
        se.load_embedder("triton", "cpu")
    with pytest.raises(ValueError, match="kernels must be one of"):
        eg.GraphedEmbedder(Path("/nonexistent/model"), "cpu", kernels="cuda")
    made = []

    class FakeGraphed:
        def __init__(self, model, device, kernels="torch"):
            made.append((device, kernels))
            if kernels == "triton":
                raise UnsupportedModel("no such kernels here")
            self.runtime = f"graphs ({device})"

    monkeypatch.setattr(eg, "GraphedEmbedder", FakeGraphed)
    monkeypatch.setattr(se, "_model_path", lambda: Path("/nonexistent/model"))
    with caplog.at_level(logging.WARNING, logger="kalos.client.embed"):
        assert se.load_embedder("triton", "cuda:1").runtime == "graphs (cuda:1)"
    assert made == [("cuda:1", "triton"), ("cuda:1", "torch")]
    assert "Triton kernels" in caplog.text and "no such kernels here" in caplog.text
    made.clear()  # a GPU sidecar's default tries the kernels first, the same way
    monkeypatch.setattr(se, "_triton_installed", lambda: True)
    assert se.load_embedder("auto", "cuda:0").runtime == "graphs (cuda:0)"
    assert made == [("cuda:0", "triton"), ("cuda:0", "torch")]
    made.clear()  # where Triton is not installed, straight to the graphs: nothing failed, nothing said
    monkeypatch.setattr(se, "_triton_installed", lambda: False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kalos.client.embed"):
        assert se.load_embedder("auto", "cuda:0").runtime == "graphs (cuda:0)"
    assert made == [("cuda:0", "torch")] and not caplog.text


@pytest.mark.cuda
def test_the_triton_graphs_equal_sentence_transformers_on_a_gpu():
    if not HAVE_CUDA:
        pytest.skip("needs a CUDA GPU")
    from kalos.client.embed import default_embedder
    from kalos.server.sidecar_embed import load_embedder

    embedder = load_embedder("auto", "cuda")  # (a GPU sidecar's default)
    assert embedder.runtime == "triton graphs (cuda)", "the kernels passed their load check"
    texts = [p.text for p in passages()[::40][:20]] + list(QUESTIONS) + [p.text[:80] for p in passages()[::7][:30]]
    reference = default_embedder().embed(texts).astype(np.float64)
    for got in (embedder.embed(texts), np.vstack([embedder.embed([t]) for t in texts[:24]])):
        got = got.astype(np.float64)
        want = reference[:len(got)]
        cosines = np.einsum("ij,ij->i", got, want) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        assert cosines.min() >= 0.9999, cosines.min()
    assert all(embedder._buckets[b].graph is not None for b in embedder.buckets)
