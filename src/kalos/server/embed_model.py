"""What every runtime of the packaged model must agree on: how the model pools and normalises
(:func:`pooling_config`, read from its sentence-transformers config) and the vectors it gives
(:func:`check_against_reference`: a faster runtime is used only when its vectors of
:data:`PROBES` match sentence-transformers'). Read by the sidecar's embedder
(:mod:`kalos.server.sidecar_embed`, its ONNX export) and by the CUDA graphs
(:mod:`kalos.server.embed_graphs`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PROBES", "check_against_reference", "pooling_config"]

#: Texts of several lengths and scripts every runtime embeds as sentence-transformers does.
PROBES = [
    "Hi.",
    "The cat sat on the mat while the dog barked at the mailman outside.",
    "When does Alice celebrate her birthday?",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons. " * 30,
    "東京は日本の首都です。",
    "Ça va très bien, merci !",
]


def check_against_reference(embedder: Any, reference: Any, what: str, minimum: float = 0.9999) -> float:
    """The least cosine between ``embedder``'s vectors of the probe texts (several lengths and
    scripts) and the SentenceTransformer ``reference``'s; RuntimeError naming ``what`` below
    ``minimum``: a faster runtime of the model is used only when it gives the model's vectors,
    in one batch and one text at a time (an agent's query: some runtimes have a path of its own)."""
    alone = [embedder.embed([text]) for text in PROBES]
    mine = np.vstack([embedder.embed(PROBES), *alone]).astype(np.float64)
    theirs = reference.encode(PROBES, convert_to_numpy=True, normalize_embeddings=True,
                              show_progress_bar=False).astype(np.float64)
    theirs = np.vstack([theirs, theirs])
    cosines = np.einsum("ij,ij->i", mine, theirs) / (np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1))
    least = float(cosines.min())
    if not least >= minimum:
        raise RuntimeError(f"{what} disagrees with sentence-transformers (cosine {least:.6f})")
    return least


def pooling_config(model: Path) -> tuple[int, bool]:
    """``(max_seq_length, normalise)`` from the model's sentence-transformers config; refuses a
    pooling other than the mean, which the exported graph computes."""
    modules = json.loads((model / "modules.json").read_text())
    kinds = [m.get("type", "") for m in modules]
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        raise RuntimeError("the model has no pooling module")
    config = json.loads((model / pooling.get("path", "1_Pooling") / "config.json").read_text())
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
    if not config.get("pooling_mode_mean_tokens") or others:
        raise RuntimeError(f"the model pools by {others or 'no mode'}, the exported graph by the mean")
    max_len = int(json.loads((model / "sentence_bert_config.json").read_text()).get("max_seq_length", 256))
    return max_len, any(k.endswith("Normalize") for k in kinds)
