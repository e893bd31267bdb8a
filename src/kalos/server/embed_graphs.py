"""The packaged model on a GPU as replays of captured CUDA graphs (``--embed-runtime graphs``).

Why. sentence-transformers' forward pass of one short text launches about a hundred small
kernels from Python, one after another, and returns in milliseconds on a GPU that would run
those kernels in a fraction of that (issue 20: on the H200 the embedding was most of a
``recall_text``). Replayed from a captured CUDA graph, the pass costs the kernels' own time.

How. The ``tokenizers`` fast tokenizer cuts the texts as :class:`OnnxEmbedder` does (truncated
to the model's ``max_seq_length``, unpadded). A call's texts are sorted by length and split
into runs of at most :data:`MAX_RUN` texts; each run is padded to a bucket, a power of two of
texts and a power of two of tokens (at least :data:`MIN_TOKENS`, at most ``max_seq_length``),
whose graph is captured at load (every bucket: :meth:`GraphedEmbedder.shapes`): the copy of
the page-locked input buffer to the device, the transformer, the mean over the unmasked tokens,
the L2 normalisation and the copy of the vectors back to a page-locked output buffer, so that a
replay is one launch. One text (an agent's query) fills its bucket's row directly. Padding tokens are
masked out of the attention and the mean, so a text's vector does not depend on its bucket
beyond float rounding; every load checks the vectors against sentence-transformers' on probe
texts of several lengths (cosine >= 0.9999 each, as the ONNX export is checked), and a model
that fails the check is not used (the sidecar falls back to sentence-transformers).

The forward pass captured is the model's own (``kernels="torch"``, ``--embed-runtime graphs``)
or :class:`kalos.server.minilm_kernels.MiniLMKernels`, the same model as a few fused Triton
kernels (``kernels="triton"``, ``--embed-runtime triton``), checked the same way at load.

On PyTorch's CPU device (the tests) the same buckets run eagerly, without graphs (the Triton
kernels only under Triton's interpreter).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kalos.client.embed import DEFAULT_DIM, DEFAULT_MODEL, _check_output, _load_sentence_transformer
from kalos.server.embed_model import check_against_reference, pooling_config
from kalos.validation import check_embed_texts

__all__ = ["FORWARD_KERNELS", "GraphedEmbedder", "MAX_RUN", "MIN_TOKENS"]

#: What computes the captured forward pass: the model's own modules, or Triton kernels.
FORWARD_KERNELS = ("torch", "triton")

#: Most texts one replay embeds (a call of more texts replays several graphs).
MAX_RUN = 32
#: The narrowest token bucket: shorter texts share one graph.
MIN_TOKENS = 16


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


class _Bucket:
    """One padded shape: its input buffer (ids, attention mask, token types), its output, and
    the graph that maps one to the other (None on the CPU device)."""

    __slots__ = ("texts", "tokens", "host", "host_view", "device_in", "host_out", "out", "graph")

    def __init__(self, texts: int, tokens: int, torch: Any, device: Any, pinned: bool) -> None:
        self.texts, self.tokens = texts, tokens
        self.host = torch.zeros((3, texts, tokens), dtype=torch.int64, pin_memory=pinned)
        self.host_view = self.host.numpy()  # (the embedder fills the input through it)
        self.device_in = torch.zeros((3, texts, tokens), dtype=torch.int64, device=device)
        self.host_out = torch.empty((texts, DEFAULT_DIM), dtype=torch.float32, pin_memory=pinned)
        self.out: Any = None
        self.graph: Any = None


class GraphedEmbedder:
    """all-MiniLM-L6-v2 on ``device`` ("cuda", "cuda:N"; "cpu" runs the buckets eagerly): an
    :class:`~kalos.client.embed.Embedder` whose forward passes are CUDA graph replays."""

    def __init__(self, model: Path, device: str = "cuda", kernels: str = "torch") -> None:
        if kernels not in FORWARD_KERNELS:
            raise ValueError(f"kernels must be one of {FORWARD_KERNELS}, got {kernels!r}")
        import torch
        from tokenizers import Tokenizer

        self._torch = torch
        self.name = DEFAULT_MODEL
        self.dim = DEFAULT_DIM
        self.device = torch.device(device)
        self._on_gpu = self.device.type == "cuda"
        self.kernels = kernels
        self.runtime = (f"{'triton ' if kernels == 'triton' else ''}graphs ({self.device})" if self._on_gpu
                        else f"{'triton ' if kernels == 'triton' else ''}buckets ({self.device}, no graphs)")
        self.max_tokens, self._normalise = pooling_config(model)
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=self.max_tokens)
        self._pad_id = int((self.tokenizer.padding or {}).get("pad_id", 0))  # (read before no_padding drops it)
        self.tokenizer.no_padding()
        self._reference = _load_sentence_transformer(str(model), device=str(self.device), local_files_only=True)
        self._transformer = self._reference[0].auto_model.eval()
        self._kernels: Any = None
        if kernels == "triton":
            from kalos.server.minilm_kernels import MiniLMKernels

            self._kernels = MiniLMKernels(self._transformer, self._normalise)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._stream = torch.cuda.Stream(self.device) if self._on_gpu else None
        self._pool = torch.cuda.graph_pool_handle() if self._on_gpu else None
        self._lock = threading.Lock()
        if self._on_gpu:
            # Every bucket is captured here, at load: entering a capture synchronises the device,
            # collects Python's garbage and empties the allocator's cache, which in the middle of
            # serving would stall the sweep's passes.
            for texts, tokens in self.shapes():
                self._bucket(texts, tokens)
        check_against_reference(self, self._reference, f"the graphed model ({kernels} kernels)")
        self._reference = None  # (the check was its last use: its weights are the transformer's)
        if self._kernels is not None:
            self._transformer = None  # the kernels hold their own copy of the weights

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket's (texts, tokens): powers of two up to MAX_RUN texts, and from
        MIN_TOKENS up to the model's max_seq_length tokens (the last bucket that, if it is no
        power of two)."""
        texts = [1 << i for i in range(MAX_RUN.bit_length()) if 1 << i <= MAX_RUN]
        tokens = sorted({min(MIN_TOKENS << i, self.max_tokens)
                         for i in range(32) if i == 0 or MIN_TOKENS << (i - 1) < self.max_tokens})
        return [(t, n) for t in texts for n in tokens]

    # -- the forward pass ----------------------------------------------------------------

    def _forward(self, inputs: Any) -> Any:
        if self._kernels is not None:
            return self._kernels(inputs)
        ids, mask, types = inputs[0], inputs[1], inputs[2]
        tokens = self._transformer(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        weights = mask.unsqueeze(-1).to(tokens.dtype)
        mean = (tokens * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return self._torch.nn.functional.normalize(mean, p=2, dim=1) if self._normalise else mean

    def _bucket(self, texts: int, tokens: int) -> _Bucket:
        """The bucket of that shape, made (and its graph captured) on first use: on a GPU, at
        load for every shape; on the CPU, when a run first needs it."""
        bucket = self._buckets.get((texts, tokens))
        if bucket is not None:
            return bucket
        torch = self._torch
        bucket = _Bucket(texts, tokens, torch, self.device, self._on_gpu)
        bucket.host[1, :, 0] = 1  # every row attends to something: an all-masked row is NaN
        bucket.device_in.copy_(bucket.host)
        with torch.inference_mode():
            if not self._on_gpu:
                bucket.out = self._forward(bucket.device_in)
            else:
                stream = self._stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # lazy initialisations (cuBLAS handles, kernels) before the capture
                        self._forward(bucket.device_in)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the sweep's own CUDA calls in other threads do not spoil the capture.
                # The copies from and to the page-locked host buffers are part of the graph: a
                # replay is then one launch, not three calls through PyTorch's dispatcher.
                with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                    bucket.device_in.copy_(bucket.host, non_blocking=True)
                    bucket.out = self._forward(bucket.device_in)
                    bucket.host_out.copy_(bucket.out, non_blocking=True)
                bucket.graph = graph
        self._buckets[(texts, tokens)] = bucket
        return bucket

    def _run(self, bucket: _Bucket, n: int) -> np.ndarray:
        """The vectors of the first ``n`` rows of ``bucket.host`` (filled by the caller)."""
        torch = self._torch
        if not self._on_gpu:
            bucket.device_in.copy_(bucket.host)
            with torch.inference_mode():
                return self._forward(bucket.device_in)[:n].numpy().copy()
        with torch.cuda.stream(self._stream):
            bucket.graph.replay()  # (host -> device, the pass, device -> host)
        self._stream.synchronize()
        return bucket.host_out[:n].numpy().copy()

    # -- the Embedder interface ----------------------------------------------------------

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        texts = check_embed_texts(texts)
        if len(texts) == 1:
            return self._embed_one(texts[0])
        out = np.empty((len(texts), self.dim), np.float32)
        if not texts:
            return out
        with self._lock:
            encoded = self.tokenizer.encode_batch(texts)
            order = sorted(range(len(texts)), key=lambda i: len(encoded[i].ids))
            for start in range(0, len(order), MAX_RUN):
                run = order[start:start + MAX_RUN]
                width = len(encoded[run[-1]].ids)  # the longest of the run (sorted)
                bucket = self._bucket(_pow2_at_least(len(run)), min(_pow2_at_least(width, MIN_TOKENS), self.max_tokens))
                host = bucket.host_view
                for row, i in enumerate(run):
                    self._fill_row(host, row, encoded[i])
                host[0, len(run):] = self._pad_id  # (the bucket's padding rows: see _bucket)
                host[1, len(run):] = 0
                host[1, len(run):, 0] = 1
                host[2, len(run):] = 0
                out[run] = self._run(bucket, len(run))
        return _check_output(out, len(texts), self.dim, self.name)

    def _fill_row(self, host: np.ndarray, row: int, encoding: Any) -> None:
        """Row ``row`` of a bucket's input: the encoding's token ids and types, attending to
        every token (an unpadded encoding's attention mask is all ones), and the row's tail
        cleared (a shorter text than the row's last one leaves its tokens there)."""
        n = len(encoding.ids)
        host[0, row, :n] = encoding.ids
        host[0, row, n:] = self._pad_id
        host[1, row, :n] = 1
        host[1, row, n:] = 0
        host[2, row, :n] = encoding.type_ids
        host[2, row, n:] = 0

    def _embed_one(self, text: str) -> np.ndarray:
        """embed() of one text (an agent's query, the usual call), without the sorting and the runs."""
        # (encode, not encode_batch, which hands the work to the tokenizer's thread pool and
        # waits for one of its threads to wake)
        encoding = self.tokenizer.encode(text)
        with self._lock:
            bucket = self._bucket(1, min(_pow2_at_least(len(encoding.ids), MIN_TOKENS), self.max_tokens))
            self._fill_row(bucket.host_view, 0, encoding)
            return _check_output(self._run(bucket, 1), 1, self.dim, self.name)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The (texts, tokens) shapes captured so far."""
        return sorted(self._buckets)

    def __repr__(self) -> str:
        return f"GraphedEmbedder({self.name!r}, dim={self.dim}, device={str(self.device)!r})"
