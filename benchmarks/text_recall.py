"""Text recall end to end with the embedder in the sidecar (issue 20, item 4), side by side in one run.

On this machine's CPU, over the ~800 passages of Python's help texts (``kalos.tools.corpus``), the
questions of ``kalos.tools.corpus.QUESTIONS`` asked one after another (k = 8, hits with their texts):

* ``recall_text`` with the sidecar embedding (``Client()``; the sidecar runs all-MiniLM-L6-v2
  on ONNX Runtime);
* ``recall_text`` with the embedder in the client (``Client(embedder=default_embedder())``,
  sentence-transformers in the client process: how every client embedded before);
* what a user would write instead: sentence-transformers + NumPy in process (encode, a mat-vec
  over the same vectors, argpartition, the texts from a list);
* Chroma's default embedded client is named but not measured: its default embedding function
  downloads its ONNX model at first use, which a machine without a model hub (this one) cannot.

Then a client process's start-up to its first ``recall_text`` answer (wall time from spawn)
and its peak RSS, embedder in the client against in the sidecar; and ``kalos import`` of
short passages (one a line, a .txt), rows/s with the model's load reported apart, for the
sidecar's ONNX runtime and its sentence-transformers one (``--embed-runtime torch``).

    PYTHONPATH=src python3 benchmarks/text_recall.py [--rounds 300] [--import-rows 10000]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kalos.client.client import Client
from kalos.client.embed import default_embedder
from kalos.server.launcher import SidecarProcess
from kalos.tools.corpus import QUESTIONS, passages

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NAMESPACE = "pydoc"


def pct(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def timed(fn, rounds: int) -> list[float]:
    for q in QUESTIONS[:3]:
        fn(q)  # warm
    out = []
    for i in range(rounds):
        q = QUESTIONS[i % len(QUESTIONS)]
        t = time.perf_counter()
        fn(q)
        out.append(time.perf_counter() - t)
    return out


_STARTUP = r"""
import sys
from kalos import Client
embedder = None
if sys.argv[2] == "client":
    from kalos.client.embed import default_embedder
    embedder = default_embedder()
with Client(sys.argv[1], timeout=60, embedder=embedder) as c:
    hits = c.recall_text("How do I open a file for writing?", k=8, namespace="pydoc")
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child would report its parent's peak.
hwm = open("/proc/self/status").read().split("VmHWM:")[1].split()[0]
print(len(hits), hwm, "torch" in sys.modules, flush=True)
"""


def startup(name: str, where: str, env: dict[str, str], runs: int = 3) -> tuple[float, float, bool]:
    walls, rss = [], []
    torch = False
    for _ in range(runs):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _STARTUP, name, where], capture_output=True, text=True, env=env,
                             timeout=300, check=True)
        walls.append(time.perf_counter() - t)
        n, kb, torch_loaded = out.stdout.split()
        rss.append(int(kb) / 1024)
        torch = torch_loaded == "True"
    return float(np.median(walls)), float(np.median(rss)), torch


def short_passages(n: int) -> list[str]:
    """``n`` distinct short passages: sentences of Python's help texts, numbered past the first pass."""
    sentences: list[str] = []
    seen = set()
    for p in passages():
        for s in re.split(r"(?<=[.!?])\s+", " ".join(p.text.split())):
            if 4 <= len(s.split()) <= 30 and s not in seen:
                seen.add(s)
                sentences.append(s)
    return [sentences[i % len(sentences)] + ("" if i < len(sentences) else f" ({i // len(sentences)})")
            for i in range(n)]


def kalos_import(name: str, path: Path, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "kalos", "import", str(path), "--name", name, "--json",
                          "--namespace", "imp"], capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--import-rows", type=int, default=10_000)
    parser.add_argument("--torch-import-rows", type=int, default=2_000,
                        help="rows of the import through the sidecar's sentence-transformers runtime")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ktr", dir="/tmp"))
    os.environ["KALOS_RUNTIME_DIR"] = str(tmp / "run")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    print(f"uptime before: {os.popen('uptime').read().strip()}")
    rows = []
    sidecar = SidecarProcess(tmp / "a.db", name="textbench", dim=384, extra_args=["--embed", "start"])
    try:
        corpus = [p.text for p in passages()]
        with Client("textbench", timeout=120) as c:
            t = time.perf_counter()
            for i in range(0, len(corpus), 64):
                c.remember(corpus[i:i + 64], namespace=NAMESPACE)
            print(f"{len(corpus)} passages remembered through the sidecar in {time.perf_counter() - t:.1f} s "
                  f"(the sidecar's embedder runtime: {c.embedder.runtime})")
            side = timed(lambda q: c.recall_text(q, k=8, namespace=NAMESPACE), args.rounds)
            rows.append(("kalos recall_text, embedding in the sidecar (ONNX)", *pct(side)))
            # The stored vectors, for the in-process baseline's matrix.
            items, cursor = [], None
            while True:
                page = c.list(namespace=NAMESPACE, limit=1000, cursor=cursor)
                items += page.items
                cursor = page.next_cursor
                if cursor is None:
                    break
            got = c.get(ids=[it.id for it in items], with_vectors=True)
        model = default_embedder()
        with Client("textbench", timeout=120, embedder=model) as local:
            here = timed(lambda q: local.recall_text(q, k=8, namespace=NAMESPACE), args.rounds)
            rows.append(("kalos recall_text, embedding in the client (sentence-transformers)", *pct(here)))
        matrix = np.stack([g.vector for g in got])
        texts = [g.text for g in got]

        def in_process(q: str) -> list[tuple[str, float]]:
            v = model.embed([q])[0]
            scores = matrix @ v
            top = np.argpartition(-scores, 8)[:8]
            top = top[np.argsort(-scores[top])]
            return [(texts[i], float(scores[i])) for i in top]

        st = timed(in_process, args.rounds)
        rows.append(("sentence-transformers + NumPy in process", *pct(st)))
        rows.append(("Chroma default client: not measured (its default embedder downloads its model)",
                     float("nan"), float("nan")))
        print(f"uptime after recalls: {os.popen('uptime').read().strip()}")
        print(f"\nrecall_text end to end, {len(corpus)} passages x 384, k = 8, {args.rounds} questions one after another")
        print("| path | p50 ms | p99 ms |\n| --- | ---: | ---: |")
        for name, p50, p99 in rows:
            print(f"| {name} | {p50:.2f} | {p99:.2f} |")

        before = startup("textbench", "client", env)
        after = startup("textbench", "sidecar", env)
        print("\nclient process: spawn to its first recall_text answer, peak RSS (median of 3)")
        print("| embedder | start-up s | peak RSS MiB | torch imported |\n| --- | ---: | ---: | --- |")
        print(f"| in the client (before) | {before[0]:.2f} | {before[1]:.0f} | {before[2]} |")
        print(f"| in the sidecar (after) | {after[0]:.2f} | {after[1]:.0f} | {after[2]} |")
        rss = int(open(f"/proc/{sidecar.pid}/status").read().split("VmRSS:")[1].split()[0]) / 1024
        print(f"the sidecar's RSS with the ONNX embedder loaded: {rss:.0f} MiB")

        lines = short_passages(args.import_rows)
        path = tmp / "passages.txt"
        path.write_text("\n".join(lines) + "\n")
        print(f"uptime before imports: {os.popen('uptime').read().strip()}")
        print(f"\nkalos import of short passages (a .txt, {np.mean([len(s) for s in lines]):.0f} characters on average)")
        print("| sidecar runtime | rows | rows/s (load apart) | embedding s | adding s | model load s | whole command s |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    finally:
        sidecar.stop(timeout=20)
    for runtime, n in (("onnx", args.import_rows), ("torch", args.torch_import_rows)):
        if n <= 0:
            continue
        part = tmp / f"passages-{runtime}.txt"
        part.write_text("\n".join(lines[:n]) + "\n")
        sc = SidecarProcess(tmp / f"imp-{runtime}.db", name=f"imp-{runtime}", dim=384,
                            extra_args=["--embed-runtime", runtime])
        try:
            t = time.perf_counter()
            summary = kalos_import(f"imp-{runtime}", part, env)
            whole = time.perf_counter() - t
        finally:
            sc.stop(timeout=20)
        print(f"| {runtime} | {summary['imported']:,} | {summary['rows_per_s']:.0f} | {summary['embed_seconds']:.1f} | "
              f"{summary['add_seconds']:.1f} | {summary['load_seconds']:.1f} | {whole:.1f} |")
    print(f"uptime after: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
