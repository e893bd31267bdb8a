"""Progress on the command line (issue #20, item 7): ``kalos bench`` and ``kalos demo`` say what
they are doing while they run, with a progress library (tqdm) that ends at 100%; the bench also
reports the sidecar's CPU time right after recalls (item 3). The model's load is covered by
tests/test_import.py (``kalos import`` shows it and times it apart)."""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import DEADLINE_S, unique_name

from kalos.client.embed import DEFAULT_DIM, DEFAULT_MODEL, CallableEmbedder


def test_bench_shows_progress_and_the_cpu_after_a_recall(runtime_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kalos", "bench", "--n", "2048", "--dim", "32", "--repeats", "20", "--e2e-repeats",
         "10", "--cold", "1", "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=DEADLINE_S * 3,
    )
    assert out.returncode == 0, out.stderr
    final = out.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert "kalos bench: 100%" in final and "10/10" in final, out.stderr
    for phase in ("ping", "tiny recall, cold", "sidecar CPU after a recall", "end to end against in-process NumPy"):
        assert phase in out.stderr, phase
    assert "sidecar CPU in the 200 ms after a recall" in out.stdout
    info = json.loads((tmp_path / "bench.json").read_text())["info"]
    for key in ("after_recall_cpu_ms_tiny", "after_recall_cpu_ms_e2e"):
        assert info[key] >= 0, info


def _hash_embed(texts: list[str]) -> np.ndarray:
    """A stand-in for the model (the demo's loop is under test, not MiniLM): stable unit vectors."""
    out = np.empty((len(texts), DEFAULT_DIM), np.float32)
    for i, t in enumerate(texts):
        seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
        out[i] = np.random.default_rng(seed).standard_normal(DEFAULT_DIM)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_demo_embedding_progress_has_a_rate_and_reaches_100_percent(sidecars, store_dir, monkeypatch, capsys):
    import kalos.client.embed
    import kalos.tools.corpus
    from kalos.tools.demo import run_demo

    name = unique_name("demo")
    sidecars.start(store_dir / "demo.db", name=name, dim=DEFAULT_DIM)
    corpus = kalos.tools.corpus.passages()[:150]  # 3 chunks: 64 + 64 + 22
    monkeypatch.setattr(kalos.tools.corpus, "passages", lambda: corpus)
    monkeypatch.setattr(kalos.client.embed, "_default", CallableEmbedder(_hash_embed, dim=DEFAULT_DIM, name=DEFAULT_MODEL))
    args = argparse.Namespace(name=name, store=None, memories=0, recalls=20, rounds=1, synthetic=False, device="cpu")
    assert run_demo(args) == 0
    captured = capsys.readouterr()
    bar = captured.err.replace("\r", "\n")
    final = [line for line in bar.splitlines() if line.startswith("embedding and storing")][-1]
    assert "100%" in final and "150/150" in final and "passages/s" in final, bar
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, ", final), final  # tqdm's [elapsed<remaining (the ETA), rate]
    assert "stored 150 passages" in captured.out
