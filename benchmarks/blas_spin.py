"""What a CPU sidecar's BLAS threads cost the client after each recall (issue #20, item 3).

NumPy's OpenBLAS runs a mat-vec of more than ~9,000 elements on every core, and its worker
threads then busy-wait for ~2^28 cycles (~0.1 s) before they sleep. On a small machine that
spinning takes the core the client needs next (to embed its next query, say). For each way of
running the sidecar's BLAS, side by side in one run, this measures from a client process:

* the sidecar's CPU time in the 200 ms after one recall (from /proc, averaged over recalls
  that each follow 0.5 s of idleness);
* the wall time of a fixed piece of client work started right after a recall, against the same
  work after idleness: pure Python (one thread, ~5 ms) and float32 GEMMs (every core, as torch
  embedding a query uses them);
* recall p50 / p99 at each store size (hot, back to back);
* with ``--text``, at dim 384: ``recall_text`` p50 / p99 (the packaged MiniLM embedding each
  question in this process, then the recall), one question every 50 ms, as an agent would ask.

    PYTHONPATH=src python3 benchmarks/blas_spin.py [--sizes 800x384,65536x384,65536x1024]

The variants: ``kalos serve`` as it runs now (worker threads sleep after 2^4 cycles instead of
2^28, see ``kalos/server/blas.py``), OpenBLAS's defaults (as before that), and one BLAS thread.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kalos.client.client import Client
from kalos.server.launcher import SidecarProcess
from kalos.tools.bench import percentiles

VARIANTS: dict[str, dict[str, str]] = {
    "kalos serve (quiet BLAS)": {},
    # KALOS_BLAS_SETTLED=1 skips serve's re-exec (kalos/server/blas.py): OpenBLAS's own defaults.
    "OpenBLAS defaults (before)": {"KALOS_BLAS_SETTLED": "1"},
    "OPENBLAS_NUM_THREADS=1": {"KALOS_BLAS_SETTLED": "1", "OPENBLAS_NUM_THREADS": "1"},
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def python_work() -> None:
    """~5 ms of single-threaded pure-Python work."""
    total = 0
    for i in range(120_000):
        total += i * i


_A = np.random.default_rng(2).standard_normal((256, 384), dtype=np.float32)
_B = np.random.default_rng(3).standard_normal((384, 1536), dtype=np.float32)


def gemm_work() -> None:
    """A few ms of float32 GEMM on every core, as embedding a query with torch would use them."""
    for _ in range(8):
        _A @ _B


QUESTIONS = ["Where does the user like to sit?", "What is the deploy key?", "When is the report due?",
             "Which editor does Dave use?", "How often is the password rotated?", "What does Bob drink?"]


def measure(variant: str, env_extra: dict[str, str], n: int, dim: int, tmp: str,
            rounds: int, text: bool = False) -> dict[str, float]:
    name = f"blas-spin-{os.getpid()}"
    env = {**os.environ, **env_extra}
    store = Path(tmp) / f"{abs(hash(variant))}-{n}x{dim}.db"
    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((n, dim), dtype=np.float32)
    queries = rng.standard_normal((64, dim), dtype=np.float32)
    with SidecarProcess(store, name=name, dim=dim, device="cpu", env=env) as sidecar, \
            Client(name) as client:
        for s in range(0, n, 8192):
            client.add(matrix[s : s + 8192])
        hot = []
        for i in range(300):
            t = time.perf_counter()
            client.recall(queries[i % 64], k=8)
            hot.append(time.perf_counter() - t)
        after: list[float] = []
        work: dict[str, list[float]] = {"python idle": [], "python after": [], "gemm idle": [], "gemm after": []}
        for i in range(rounds):
            for kind, fn in (("python", python_work), ("gemm", gemm_work)):
                time.sleep(0.5)
                t = time.perf_counter()
                fn()
                work[f"{kind} idle"].append(time.perf_counter() - t)
                time.sleep(0.5)
                client.recall(queries[i % 64], k=8)
                before = cpu_seconds(sidecar.pid)
                t = time.perf_counter()
                fn()
                work[f"{kind} after"].append(time.perf_counter() - t)
                time.sleep(max(0.0, 0.2 - (time.perf_counter() - t)))
                after.append(cpu_seconds(sidecar.pid) - before)
        text_row: dict[str, float] = {}
        if text:
            for q in QUESTIONS:  # warm-up (the model loads once per process, for every variant)
                client.recall_text(q, k=8)
            samples = []
            for i in range(60):
                time.sleep(0.05)
                t = time.perf_counter()
                client.recall_text(QUESTIONS[i % len(QUESTIONS)], k=8)
                samples.append(time.perf_counter() - t)
            tp = percentiles(samples)
            text_row = {"text_p50_us": tp["p50_us"], "text_p99_us": tp["p99_us"]}
    p = percentiles(hot[50:])
    return {"cpu_ms_200ms": 1e3 * float(np.mean(after)), **{k: 1e3 * float(np.median(v)) for k, v in work.items()},
            "p50_us": p["p50_us"], "p99_us": p["p99_us"], **text_row}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="800x384,65536x384,65536x1024",
                        help="store sizes as NxDIM (rows x dimension), comma-separated (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=20, help="recalls after idleness per row")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="ways of running the sidecar's BLAS (VARIANTS in this script), comma-separated "
                        "(default: all: %(default)s)")
    parser.add_argument("--text", action="store_true", help="also time recall_text (needs the embed extra)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, NumPy {np.__version__}")
    print("sidecar CPU: ms of CPU time in the 200 ms after a recall (mean); python / gemm: the client's work "
          "alone / right after a recall (median ms); recall: hot, back to back")
    print(f"{'variant':<28} {'N x dim':>11} {'sidecar CPU':>12} {'python':>15} {'gemm':>15}"
          f" {'recall p50':>11} {'p99':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            n, dim = (int(x) for x in size.split("x"))
            for variant in args.variants.split(","):
                r = measure(variant, VARIANTS[variant], n, dim, tmp, args.rounds, args.text and dim == 384)
                print(f"{variant:<28} {size:>11} {r['cpu_ms_200ms']:>9.1f} ms"
                      f" {r['python idle']:>6.2f} / {r['python after']:>6.2f} {r['gemm idle']:>6.2f} / {r['gemm after']:>6.2f}"
                      f" {r['p50_us']:>8.1f} us {r['p99_us']:>7.1f} us"
                      + (f"  recall_text p50 {r['text_p50_us'] / 1e3:.2f} ms p99 {r['text_p99_us'] / 1e3:.2f} ms"
                         if "text_p50_us" in r else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
