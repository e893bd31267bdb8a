"""``kalos bench``: the channel and the sidecar measured against in-process baselines.

Every row is measured from this process against a sidecar in another process (started
here on a temporary store), side by side with its baseline in the same run. Latencies are
wall-clock per call (``time.perf_counter``), reported as p50/p99 over all samples.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import select
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from kalos.client.client import Client
from kalos.server.launcher import SidecarProcess
from kalos.tools.timing import percentiles, time_calls  # noqa: F401 - also kalos.tools.bench's, for its users

__all__ = ["run_bench", "percentiles", "time_calls", "cpu_seconds", "cpu_after_recalls"]

TINY_N, TINY_DIM = 1024, 128
#: The window after a recall in which the sidecar's CPU time is measured: long enough to see
#: BLAS worker threads that busy-wait after their work (OpenBLAS's default spins ~0.1 s).
AFTER_RECALL_S = 0.2


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of ``pid``, in nanosecond resolution (``/proc/PID/task/*/
    schedstat``; ``/proc/PID/stat`` counts in 10 ms ticks, too coarse for a 200 ms window)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def cpu_after_recalls(pid: int, recall: Callable[[int], Any], count: int, *, idle_s: float = 0.5,
                      window_s: float = AFTER_RECALL_S) -> list[float]:
    """The sidecar's CPU seconds in the ``window_s`` after each of ``count`` recalls, each made
    after ``idle_s`` without requests (so that nothing of the previous one is still running)."""
    samples = []
    for i in range(count):
        time.sleep(idle_s)
        recall(i)
        before = cpu_seconds(pid)
        time.sleep(window_s)
        samples.append(cpu_seconds(pid) - before)
    return samples


class _Progress:
    """The bench's progress on stderr: one step per measured row, the running one named."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="kalos bench", unit="row", file=sys.stderr,
                        dynamic_ncols=True, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                        "[{elapsed}]{postfix}")

    def step(self, name: str) -> None:
        """Marks the previous step done and ``name`` as running."""
        if self.bar.postfix:
            self.bar.update(1)
        self.bar.set_postfix_str(name)

    def each(self, name: str, count: int) -> Iterator[int]:
        """``range(count)`` while showing ``name i/count`` (for the rows that take seconds)."""
        for i in range(count):
            self.bar.set_postfix_str(f"{name} {i + 1}/{count}")
            yield i

    def close(self) -> None:
        if self.bar.postfix:
            self.bar.update(1)
        self.bar.set_postfix_str("done")
        self.bar.close()


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    m = rng.standard_normal((n, dim), dtype=np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    return m


def _fill(client: Client, matrix: np.ndarray, chunk: int = 8192) -> np.ndarray:
    return np.concatenate([client.add(matrix[s : s + chunk]) for s in range(0, len(matrix), chunk)])


def _eventfd_round_trips(count: int, *, idle_s: float) -> list[float]:
    """The platform's floor for a cold wake-up: two processes, each blocked on an eventfd,
    ping-pong once after ``idle_s`` of idleness (two wake-ups, no Kalos code)."""
    ping, pong = os.eventfd(0), os.eventfd(0)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            while True:
                select.select([ping], [], [])
                if os.eventfd_read(ping) > 1:
                    os._exit(0)
                os.eventfd_write(pong, 1)
        finally:
            os._exit(0)
    samples = []
    try:
        for _ in range(count):
            time.sleep(idle_s)
            start = time.perf_counter()
            os.eventfd_write(ping, 1)
            select.select([pong], [], [])
            os.eventfd_read(pong)
            samples.append(time.perf_counter() - start)
    finally:
        os.eventfd_write(ping, 2)
        os.waitpid(child, 0)
        os.close(ping)
        os.close(pong)
    return samples


def run_bench(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda"):
        from kalos.tools.bench_gpu import run_gpu_bench

        return run_gpu_bench(args)
    plot_path = getattr(args, "plot", None)
    if plot_path is not None:
        from kalos.tools.plot import require_matplotlib

        require_matplotlib()  # before minutes of measuring, not after
    rng = np.random.default_rng(20261130)
    name = f"bench-{os.getpid()}"
    rows: list[dict[str, Any]] = []
    samples: dict[str, list[float]] = {}  # per-row samples (seconds), for --plot; not in the JSON
    info = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "numpy": np.__version__, "device": args.device,
    }
    after_count = max(1, min(args.cold, 10))
    progress = _Progress(10)
    with tempfile.TemporaryDirectory(prefix="kalos-bench-") as tmp:
        # Tiny store: the channel itself (ping = no search) and a recall that costs almost nothing.
        progress.step(f"starting a sidecar, {TINY_N:,} x {TINY_DIM}")
        with SidecarProcess(Path(tmp) / "tiny.db", name=name, dim=TINY_DIM, device=args.device) as sidecar, \
                Client(name) as client:
            tiny = _unit(rng, TINY_N, TINY_DIM)
            _fill(client, tiny)
            queries = _unit(rng, 256, TINY_DIM)
            progress.step("ping")
            samples["ping"] = time_calls(lambda i: client.ping(), args.repeats)
            rows.append({"row": "channel round trip (ping, no search)", "N": 0, "dim": TINY_DIM, "k": 0,
                         **percentiles(samples["ping"])})
            progress.step("tiny recall, hot")
            samples["tiny hot"] = time_calls(lambda i: client.recall(queries[i % 256], k=args.k), args.repeats)
            rows.append({"row": "recall, tiny store, hot", "N": TINY_N, "dim": TINY_DIM, "k": args.k,
                         **percentiles(samples["tiny hot"])})
            progress.step("tiny recall, cold")
            cold = []
            for i in progress.each("tiny recall after 1 s idle", args.cold):
                time.sleep(1.0)
                start = time.perf_counter()
                client.recall(queries[i % 256], k=args.k)
                cold.append(time.perf_counter() - start)
            samples["tiny cold"] = cold
            rows.append({"row": "recall, tiny store, cold (first after 1 s idle)", "N": TINY_N, "dim": TINY_DIM,
                         "k": args.k, **percentiles(cold)})
            progress.step("eventfd baseline")
            samples["eventfd cold"] = _eventfd_round_trips(args.cold, idle_s=1.0)
            rows.append({"row": "baseline: bare eventfd round trip after 1 s idle", "N": 0, "dim": 0, "k": 0,
                         **percentiles(samples["eventfd cold"])})
            progress.step("sidecar CPU while idle (6 s)")
            time.sleep(1.0)
            before, t0 = _cpu_seconds(sidecar.pid), time.monotonic()
            time.sleep(5.0)
            idle = (_cpu_seconds(sidecar.pid) - before) / (time.monotonic() - t0)
            info["idle_cpu_percent_of_one_core"] = round(100 * idle, 3)
            # What a recall leaves running (BLAS threads spinning, the sweep's own spin): the
            # client would have that much less of the machine right after each recall.
            progress.step("sidecar CPU after a recall")
            after = cpu_after_recalls(sidecar.pid, lambda i: client.recall(queries[i % 256], k=args.k), after_count)
            info["after_recall_cpu_ms_tiny"] = round(1e3 * float(np.median(after)), 3)

        # N x dim: end to end through the sidecar against in-process NumPy on the same data.
        progress.step(f"starting a sidecar, {args.n:,} x {args.dim}")
        with SidecarProcess(Path(tmp) / "e2e.db", name=name, dim=args.dim, device=args.device) as sidecar, \
                Client(name) as client:
            matrix = _unit(rng, args.n, args.dim)
            ids = _fill(client, matrix)
            queries = _unit(rng, 64, args.dim)
            k = args.k

            def in_process(i: int) -> np.ndarray:
                scores = matrix @ queries[i % 64]
                top = np.argpartition(scores, -k)[-k:]
                return top[np.argsort(-scores[top])]

            for i in range(8):  # the two paths must agree before they are timed
                if not np.array_equal(client.recall(queries[i], k=k).ids, ids[in_process(i)]):
                    raise AssertionError("sidecar and in-process NumPy disagree on the top-k")
            progress.step("end to end against in-process NumPy")
            sidecar_samples, numpy_samples = [], []
            for _ in progress.each("end to end, block", 10):  # interleaved blocks: both paths see the same noise
                sidecar_samples += time_calls(lambda i: client.recall(queries[i % 64], k=k), args.e2e_repeats // 10, 5)
                numpy_samples += time_calls(in_process, args.e2e_repeats // 10, 5)
            e2e, base = percentiles(sidecar_samples), percentiles(numpy_samples)
            samples["e2e"], samples["numpy"] = sidecar_samples, numpy_samples
            rows.append({"row": "in-process NumPy argpartition(M @ q) (baseline)", "N": args.n, "dim": args.dim, "k": k, **base})
            rows.append({"row": "recall end to end via sidecar", "N": args.n, "dim": args.dim, "k": k, **e2e,
                         "vs_baseline_p50": round(e2e["p50_us"] / base["p50_us"], 3)})
            progress.step(f"sidecar CPU after a recall, {args.n:,} x {args.dim}")
            after = cpu_after_recalls(sidecar.pid, lambda i: client.recall(queries[i % 64], k=k), after_count)
            info["after_recall_cpu_ms_e2e"] = round(1e3 * float(np.median(after)), 3)
    progress.close()

    print(f"kalos bench on {info['machine']}, {info['cpus']} CPUs, Python {info['python']}, NumPy {info['numpy']}, "
          f"device {info['device']}; float32, batch 1")
    print(f"{'path':<52} {'N':>8} {'dim':>5} {'k':>3} {'p50 us':>10} {'p99 us':>10}")
    for row in rows:
        extra = f"  ({row['vs_baseline_p50']}x baseline p50)" if "vs_baseline_p50" in row else ""
        print(f"{row['row']:<52} {row['N']:>8} {row['dim']:>5} {row['k']:>3} {row['p50_us']:>10.1f} {row['p99_us']:>10.1f}{extra}")
    print(f"sidecar CPU while idle (5 s window after 1 s idle): {info['idle_cpu_percent_of_one_core']:.2f}% of one core")
    window_ms = 1e3 * AFTER_RECALL_S
    print(f"sidecar CPU in the {window_ms:.0f} ms after a recall (median of {after_count}, each after 0.5 s idle): "
          f"{info['after_recall_cpu_ms_tiny']:.1f} ms at {TINY_N:,} x {TINY_DIM}, "
          f"{info['after_recall_cpu_ms_e2e']:.1f} ms at {args.n:,} x {args.dim} "
          f"(of {window_ms:.0f} ms per core: BLAS threads left spinning would show here)")
    if args.json is not None:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    if plot_path is not None:
        _plot(plot_path, samples, info, args)
        print(f"latency CDFs written to {plot_path}")
    return 0


def _plot(path: Path, samples: dict[str, list[float]], info: dict[str, Any], args: argparse.Namespace) -> None:
    from kalos.tools.plot import Panel, Series, plot_latency_cdfs

    panels = [
        Panel(f"end-to-end recall, N={args.n:,} x dim {args.dim}, k={args.k}", [
            Series("in-process NumPy argpartition(M @ q)", samples["numpy"], baseline=True),
            Series("recall via sidecar (separate process)", samples["e2e"]),
        ]),
        Panel(f"the channel: tiny store N={TINY_N:,} x dim {TINY_DIM}, k={args.k}", [
            Series("channel round trip (ping, no search)", samples["ping"], baseline=True),
            Series("recall, hot", samples["tiny hot"]),
            Series("recall, cold (first after 1 s idle)", samples["tiny cold"]),
            Series("bare eventfd round trip after 1 s idle", samples["eventfd cold"], baseline=True),
        ]),
    ]
    plot_latency_cdfs(panels, path, title=(
        f"kalos bench: {info['machine']}, {info['cpus']} CPUs, device {info['device']}, float32, batch 1"
    ))
