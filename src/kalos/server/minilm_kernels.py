"""The packaged model's forward pass (a BERT encoder, mean pooling, L2 norm) as a few Triton kernels.

Why. Captured in a CUDA graph, sentence-transformers' forward pass of one short text is still
about a hundred small kernels, each a few microseconds of launch and tail on the GPU (issue 20:
that pass was the largest part of a ``recall_text`` on the H200). The arithmetic of one short
text is tiny and its weights are read once, so the pass is bound by the number of kernels and
their latency, not by the GPU's throughput. Here each layer is seven kernels, the whole pass
forty-four: the embeddings' sum with its LayerNorm in one, each linear with its bias and its
GELU or residual in one, one attention kernel (a program per text, head and block of queries),
one LayerNorm after each residual, and the masked mean with the normalisation in the last.

What it computes. Exactly the model of ``transformers.BertModel`` in inference (no dropout):
absolute positions, token types, LayerNorm after each residual, exact (erf) GELU, padding keys
masked out of the attention, then sentence-transformers' masked mean and, where the model's
pooling asks for it, the L2 normalisation. Matrix products take TF32 inputs with float32
accumulation; the graphed embedder checks the vectors against sentence-transformers' at every
load (:func:`kalos.server.embed_model.check_against_reference`) and falls back to the
model's own forward pass when they differ.

Layout. Hidden states are row-major ``[texts * tokens, hidden]`` float32 (a text's tokens
consecutive); the query, key and value projections are one ``[hidden, 3 * hidden]`` weight,
so one linear writes ``[q | k | v]`` per token, each split into heads of ``head_dim`` columns.
"""
from __future__ import annotations

import math
from typing import Any

import triton
import triton.language as tl

__all__ = ["MiniLMKernels", "UnsupportedModel"]


class UnsupportedModel(ValueError):
    """The model is no BERT encoder these kernels compute exactly (its config says so)."""


# -- the kernels ---------------------------------------------------------------------------

@triton.jit
def _layernorm_row(x, mask, gamma_ptr, beta_ptr, cols, eps, HIDDEN: tl.constexpr):
    mean = tl.sum(x, axis=0) / HIDDEN
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / HIDDEN
    gamma = tl.load(gamma_ptr + cols, mask=mask, other=0.0)
    beta = tl.load(beta_ptr + cols, mask=mask, other=0.0)
    return centred / tl.sqrt(var + eps) * gamma + beta


@triton.jit
def _embeddings_kernel(inputs_ptr, word_ptr, position_ptr, type_ptr, gamma_ptr, beta_ptr, out_ptr,
                       n_rows, tokens, eps, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token: word + position + token type embeddings, then LayerNorm."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    token = tl.load(inputs_ptr + row)  # inputs: [3, n_rows] = ids, attention mask, token types
    token_type = tl.load(inputs_ptr + 2 * n_rows + row)
    position = row % tokens
    x = tl.load(word_ptr + token * HIDDEN + cols, mask=mask, other=0.0)
    x += tl.load(position_ptr + position * HIDDEN + cols, mask=mask, other=0.0)
    x += tl.load(type_ptr + token_type * HIDDEN + cols, mask=mask, other=0.0)
    y = _layernorm_row(x, mask, gamma_ptr, beta_ptr, cols, eps, HIDDEN)
    tl.store(out_ptr + row * HIDDEN + cols, y, mask=mask)


@triton.jit
def _layernorm_kernel(x_ptr, gamma_ptr, beta_ptr, out_ptr, eps, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * HIDDEN + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * HIDDEN + cols, _layernorm_row(x, mask, gamma_ptr, beta_ptr, cols, eps, HIDDEN), mask=mask)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, M, N, K,
                   GELU: tl.constexpr, RESIDUAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[M, N] = x[M, K] @ w[K, N] + bias, then GELU or + residual[M, N]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + ks[:, None] * N + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision="tf32")
    acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    where = rows[:, None] * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        acc += tl.load(residual_ptr + where, mask=ok, other=0.0)
    tl.store(out_ptr + where, acc, mask=ok)


@triton.jit
def _attention_kernel(qkv_ptr, inputs_ptr, out_ptr, n_rows, tokens, scale,
                      HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr):
    """One (text, head, block of queries): softmax(q k^T * scale, padding keys masked) v."""
    text = tl.program_id(0)
    head = tl.program_id(1)
    queries = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    keys = tl.arange(0, BLOCK_T)
    dims = tl.arange(0, HEAD_DIM)
    first = text * tokens
    q_ok = queries < tokens
    k_ok = keys < tokens
    stride = 3 * HIDDEN
    column = head * HEAD_DIM + dims
    q = tl.load(qkv_ptr + (first + queries)[:, None] * stride + column[None, :], mask=q_ok[:, None], other=0.0)
    k = tl.load(qkv_ptr + (first + keys)[:, None] * stride + HIDDEN + column[None, :], mask=k_ok[:, None], other=0.0)
    v = tl.load(qkv_ptr + (first + keys)[:, None] * stride + 2 * HIDDEN + column[None, :], mask=k_ok[:, None], other=0.0)
    attends = tl.load(inputs_ptr + n_rows + first + keys, mask=k_ok, other=0) != 0
    scores = tl.dot(q, tl.trans(k), input_precision="tf32") * scale
    # A large finite floor, as BertModel's additive mask: a row with no key to attend to is
    # uniform, never NaN (the embedder always unmasks each row's first token anyway).
    scores = tl.where(attends[None, :], scores, -1.0e30)
    weights = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    weights = weights / tl.sum(weights, axis=1)[:, None]
    context = tl.dot(weights, v, input_precision="tf32")
    tl.store(out_ptr + (first + queries)[:, None] * HIDDEN + column[None, :], context, mask=q_ok[:, None])


@triton.jit
def _mean_pool_kernel(x_ptr, inputs_ptr, out_ptr, n_rows, tokens, NORMALISE: tl.constexpr,
                      HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """One text: the mean of its unmasked tokens' states, then (NORMALISE) its L2 normalisation."""
    text = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < HIDDEN
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    count = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for start in range(0, tokens, BLOCK_T):
        positions = start + tl.arange(0, BLOCK_T)
        ok = positions < tokens
        rows = text * tokens + positions
        weight = tl.load(inputs_ptr + n_rows + rows, mask=ok, other=0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * HIDDEN + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
        total += tl.sum(x * weight[:, None], axis=0)
        count += weight
    # sentence-transformers clamps the count at 1e-9, and F.normalize the norm at 1e-12.
    mean = total / tl.maximum(tl.sum(count, axis=0), 1e-9)
    if NORMALISE:
        mean = mean / tl.maximum(tl.sqrt(tl.sum(mean * mean, axis=0)), 1e-12)
    tl.store(out_ptr + text * HIDDEN + cols, mean, mask=col_ok)


# -- the pass --------------------------------------------------------------------------------

def _linear_blocks(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for an [m, k] @ [k, n] product. A short text's product is a
    few rows against a weight matrix read once: narrow column blocks spread that read over many
    programs (SMs). Many rows (an import's batch) take wider tiles for the tensor cores."""
    if m <= 16:
        return 16, (16 if n <= 512 else 32), 64
    if m <= 128:
        return 32, 32, 64
    return 64, 64, 32


class MiniLMKernels:
    """The forward pass of ``transformer`` (a ``transformers`` BERT model in eval mode) and the
    sentence embedding's pooling, as Triton kernels: ``kernels(inputs)`` maps the graphed
    embedder's int64 ``[3, texts, tokens]`` input (ids, attention mask, token types) to float32
    ``[texts, hidden]`` vectors on the same device. Holds the weights in the layout the kernels
    read: float32, the projections transposed, q, k and v side by side (copies of those; the
    embedding tables and LayerNorm parameters are the model's own tensors where they are float32
    already)."""

    def __init__(self, transformer: Any, normalise: bool) -> None:
        import torch

        config = transformer.config
        problems = []
        if getattr(config, "model_type", None) != "bert":
            problems.append(f"model_type {getattr(config, 'model_type', None)!r} (bert only)")
        if getattr(config, "hidden_act", None) != "gelu":
            problems.append(f"hidden_act {getattr(config, 'hidden_act', None)!r} (exact gelu only)")
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            problems.append(f"position_embedding_type {config.position_embedding_type!r} (absolute only)")
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = hidden // heads if heads else 0
        if heads <= 0 or hidden % heads or head_dim < 16 or head_dim & (head_dim - 1):
            problems.append(f"{heads} heads of a {hidden}-wide state (a head must be a power of two >= 16 wide)")
        if problems:
            raise UnsupportedModel("these kernels do not compute this model: " + "; ".join(problems))
        self.hidden, self.heads, self.head_dim = hidden, heads, head_dim
        self.intermediate = int(config.intermediate_size)
        self.max_positions = int(config.max_position_embeddings)
        self.eps = float(config.layer_norm_eps)
        self.normalise = bool(normalise)

        def f32(t: Any) -> Any:
            return t.detach().to(torch.float32).contiguous()

        embeddings = transformer.embeddings
        self.word = f32(embeddings.word_embeddings.weight)
        self.position = f32(embeddings.position_embeddings.weight)
        self.token_type = f32(embeddings.token_type_embeddings.weight)
        self.embed_norm = (f32(embeddings.LayerNorm.weight), f32(embeddings.LayerNorm.bias))
        self.layers = []
        for layer in transformer.encoder.layer:
            attention = layer.attention
            q, k, v = attention.self.query, attention.self.key, attention.self.value
            self.layers.append({
                # nn.Linear holds [out, in]; the kernel reads [in, out] rows.
                "qkv": (f32(torch.cat([q.weight, k.weight, v.weight], 0).t()), f32(torch.cat([q.bias, k.bias, v.bias]))),
                "attention_out": (f32(attention.output.dense.weight.t()), f32(attention.output.dense.bias)),
                "attention_norm": (f32(attention.output.LayerNorm.weight), f32(attention.output.LayerNorm.bias)),
                "up": (f32(layer.intermediate.dense.weight.t()), f32(layer.intermediate.dense.bias)),
                "down": (f32(layer.output.dense.weight.t()), f32(layer.output.dense.bias)),
                "output_norm": (f32(layer.output.LayerNorm.weight), f32(layer.output.LayerNorm.bias)),
            })
        self.device = self.word.device
        self._torch = torch

    def _linear(self, x: Any, weight_bias: tuple[Any, Any], *, gelu: bool = False, residual: Any = None) -> Any:
        weight, bias = weight_bias
        m, k = x.shape
        n = weight.shape[1]
        out = self._torch.empty((m, n), dtype=self._torch.float32, device=x.device)
        block_m, block_n, block_k = _linear_blocks(m, n)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _linear_kernel[grid](x, weight, bias, residual if residual is not None else out, out, m, n, k,
                             GELU=gelu, RESIDUAL=residual is not None,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        return out

    def _layernorm(self, x: Any, gamma_beta: tuple[Any, Any]) -> Any:
        out = self._torch.empty_like(x)
        _layernorm_kernel[(x.shape[0],)](x, gamma_beta[0], gamma_beta[1], out, self.eps,
                                         HIDDEN=self.hidden, BLOCK_H=triton.next_power_of_2(self.hidden))
        return out

    def __call__(self, inputs: Any) -> Any:
        torch = self._torch
        if inputs.dim() != 3 or inputs.shape[0] != 3 or inputs.dtype != torch.int64:
            raise ValueError(f"inputs must be int64 [3, texts, tokens], got {inputs.dtype} {tuple(inputs.shape)}")
        _, texts, tokens = inputs.shape
        if tokens > self.max_positions:
            raise ValueError(f"{tokens} tokens exceed the model's {self.max_positions} positions")
        inputs = inputs.contiguous()
        rows = texts * tokens
        hidden, block_h = self.hidden, triton.next_power_of_2(self.hidden)
        x = torch.empty((rows, hidden), dtype=torch.float32, device=inputs.device)
        _embeddings_kernel[(rows,)](inputs, self.word, self.position, self.token_type, *self.embed_norm, x,
                                    rows, tokens, self.eps, HIDDEN=hidden, BLOCK_H=block_h)
        block_t = max(16, triton.next_power_of_2(tokens))
        block_q = min(block_t, 64)
        # A block's scores are BLOCK_Q x BLOCK_T floats in registers: more warps share the wide ones.
        attention_warps = 8 if block_q * block_t >= 64 * 128 else 4
        scale = 1.0 / math.sqrt(self.head_dim)
        for layer in self.layers:
            qkv = self._linear(x, layer["qkv"])
            context = torch.empty_like(x)
            _attention_kernel[(texts, self.heads, triton.cdiv(tokens, block_q))](
                qkv, inputs, context, rows, tokens, scale,
                HIDDEN=hidden, HEAD_DIM=self.head_dim, BLOCK_Q=block_q, BLOCK_T=block_t, num_warps=attention_warps)
            x = self._layernorm(self._linear(context, layer["attention_out"], residual=x), layer["attention_norm"])
            up = self._linear(x, layer["up"], gelu=True)
            x = self._layernorm(self._linear(up, layer["down"], residual=x), layer["output_norm"])
        out = torch.empty((texts, hidden), dtype=torch.float32, device=inputs.device)
        # (16 tokens of a 512-wide block at a time: a wider tile would not fit the registers.)
        _mean_pool_kernel[(texts,)](x, inputs, out, rows, tokens, NORMALISE=self.normalise,
                                    HIDDEN=hidden, BLOCK_H=block_h, BLOCK_T=16)
        return out
