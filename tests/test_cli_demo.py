"""``kalos demo`` and the corpus tool, as a newcomer meets them: the demo says how to recall
what it stored (its own namespace), never writes into a store the user did not name, and the
corpus tool counts what it wrote."""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import numpy as np
import pytest
from conftest import DEADLINE_S, run_guarded, unique_name

from kalos import Client
from kalos.errors import InvalidArgument

DIM = 8


def kalos(*args: str) -> subprocess.CompletedProcess:
    return run_guarded([sys.executable, "-m", "kalos", *map(str, args)], DEADLINE_S)


def _args(name: str, store=None) -> argparse.Namespace:
    return argparse.Namespace(name=name, store=store, memories=300, recalls=60, rounds=1, synthetic=True, device="cpu")


def test_the_demo_prints_a_recall_command_that_finds_its_memories(sidecars, store_dir, capsys):
    from kalos.tools.demo import NAMESPACE, run_demo

    name = unique_name("demo")
    sidecars.start(store_dir / "demo.db", name=name, dim=DIM)
    assert run_demo(_args(name)) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith("kalos recall"))
    words = shlex.split(line.split("   (")[0])
    assert words[:2] == ["kalos", "recall"] and "--namespace" in words and NAMESPACE in words, line
    with Client(name, timeout=10.0) as client:
        query = client.get([1], with_vectors=True)[0].vector
    np.save(store_dir / "QUERY.npy", query)
    words[words.index("QUERY.npy")] = str(store_dir / "QUERY.npy")
    result = kalos(*words[1:], "--json")
    assert result.returncode == 0, result.stderr
    hits = [h["id"] for h in json.loads(result.stdout)]
    assert hits and hits[0] == 1, result.stdout


def test_the_demo_refuses_a_store_other_than_the_running_sidecars(sidecars, store_dir, capsys):
    from kalos.tools.demo import run_demo

    name = unique_name("demo")
    sidecars.start(store_dir / "users.db", name=name, dim=DIM)
    other = store_dir / "new.db"
    with pytest.raises(InvalidArgument, match="new.db") as caught:
        run_demo(_args(name, store=other))
    assert "users.db" in str(caught.value) and "--name" in str(caught.value)
    assert not other.exists()
    with Client(name, timeout=10.0) as client:
        assert client.stats()["count"] == 0, "the demo wrote into the user's store"
    # Naming the store the sidecar serves is fine.
    assert run_demo(_args(name, store=store_dir / "users.db")) == 0


def test_the_demo_that_starts_its_sidecar_prints_how_to_serve_its_store(runtime_dir, store_dir):
    name = unique_name("own")
    store = store_dir / "own.db"
    result = kalos("demo", "--synthetic", "--name", name, "--store", store, "--memories", "200", "--recalls", "60",
                   "--device", "cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    serve = next(line for line in lines if line.strip().startswith("kalos serve"))
    assert shlex.split(serve.rstrip(" &"))[2:] == ["--name", name, "--store", str(store)], serve
    assert any(line.strip().startswith(f"kalos recall --name {name} --namespace kalos-demo ") for line in lines)


def test_corpus_counts_the_distinct_passages_it_wrote(tmp_path, capsys):
    from kalos.tools.corpus import main, passages

    assert main(["--out", str(tmp_path / "p.jsonl"), "--passages", "50"]) == 0
    assert "wrote 50 rows (50 distinct passages)" in capsys.readouterr().err
    total = len(passages())
    assert main(["--out", str(tmp_path / "q.jsonl"), "--passages", str(total + 3)]) == 0
    assert f"({total:,} distinct passages)" in capsys.readouterr().err


def test_demo_help_does_not_promise_800_passages():
    result = kalos("demo", "--help")
    assert result.returncode == 0 and "800" not in result.stdout and "kalos-demo-pydoc" in result.stdout
