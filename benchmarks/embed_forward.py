"""The graphed embedder's forward pass on a GPU: the model's own kernels against the Triton ones.

For each bucket shape (texts x tokens), both embedders (``--embed-runtime graphs``: the model's
own forward pass captured in a CUDA graph; ``--embed-runtime triton``: the model as
:mod:`kalos.server.minilm_kernels`, captured the same way) are timed side by side in one run:

* the device time of one graph replay (CUDA events around it on the embedder's stream, p50/p99;
  since session 26 a replay includes the copies of the input in and the vectors out, which
  earlier records timed apart);
* ``embed([question])`` end to end in process (tokenise, fill the bucket, copy in, replay, copy
  out), p50/p99 over the questions of ``kalos.tools.corpus``;
* how many kernels one replay launches (``torch.profiler``), and the least cosine of each
  embedder's vectors against sentence-transformers' on real text (passages and questions).

    PYTHONPATH=src python3 benchmarks/embed_forward.py [--rounds 400] [--device cuda]

On a machine without the packaged model, carry the copy ``benchmarks/export_model.py`` writes:
``PYTHONPATH=.snap/model:src``.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES = ((1, 16), (1, 32), (8, 32), (32, 64), (32, 256))


def percentiles(seconds: list[float]) -> str:
    p50, p99 = np.percentile(np.asarray(seconds) * 1e6, [50, 99])
    return f"{p50:8.1f} / {p99:8.1f}"


def replay_device_time(torch, embedder, shape: tuple[int, int], rounds: int) -> list[float]:
    bucket = embedder._bucket(*shape)
    stream = embedder._stream
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(rounds + 20):
        with torch.cuda.stream(stream):
            start.record(stream)
            bucket.graph.replay()
            end.record(stream)
        end.synchronize()
        if i >= 20:
            out.append(start.elapsed_time(end) / 1e3)
    return out


def kernels_per_replay(torch, embedder, shape: tuple[int, int]) -> int:
    from torch.profiler import ProfilerActivity, profile

    bucket = embedder._bucket(*shape)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.cuda.stream(embedder._stream):
                bucket.graph.replay()
            embedder._stream.synchronize()
    except Exception:  # noqa: BLE001 - a profiler that cannot run here leaves the count unknown (-1)
        return -1
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def least_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float((np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400, help="replays and embeds timed per row (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="a CUDA device (default: %(default)s)")
    args = parser.parse_args()

    import torch

    from kalos.client.embed import default_embedder
    from kalos.server.embed_graphs import GraphedEmbedder
    from kalos.server.sidecar_embed import _model_path
    from kalos.tools.corpus import QUESTIONS, passages

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark times CUDA graph replays: it needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name(args.device)}; torch {torch.__version__}")
    texts = [p.text for p in passages()[::20][:40]] + list(QUESTIONS)
    reference = default_embedder().embed(texts)
    embedders = {}
    for kernels in ("torch", "triton"):
        started = time.perf_counter()
        embedders[kernels] = GraphedEmbedder(_model_path(), args.device, kernels=kernels)
        print(f"{kernels}: loaded, every bucket captured and checked, in {time.perf_counter() - started:.1f} s; "
              f"least cosine against sentence-transformers on {len(texts)} real texts: "
              f"{least_cosine(embedders[kernels].embed(texts), reference):.7f}")

    print("\ndevice time of one replay, p50 / p99 us (kernels per replay)")
    print(f"{'texts x tokens':>15} | {'model (graphs)':>26} | {'Triton kernels (triton)':>26}")
    for shape in SHAPES:
        cells = []
        for kernels in ("torch", "triton"):
            embedder = embedders[kernels]
            cells.append(f"{percentiles(replay_device_time(torch, embedder, shape, args.rounds))} "
                         f"({kernels_per_replay(torch, embedder, shape):3d})")
        print(f"{shape[0]:>6} x {shape[1]:<6} | {cells[0]:>26} | {cells[1]:>26}")

    print("\nembed([question]) in process, p50 / p99 us")
    for kernels, embedder in embedders.items():
        samples = []
        for i in range(args.rounds + 20):
            question = QUESTIONS[i % len(QUESTIONS)]
            started = time.perf_counter()
            embedder.embed([question])
            if i >= 20:
                samples.append(time.perf_counter() - started)
        print(f"{kernels:>7}: {percentiles(samples)}")


if __name__ == "__main__":
    main()
