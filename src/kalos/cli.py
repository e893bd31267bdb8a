"""The ``kalos`` command: serve, add, recall, stats, demo, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kalos.config import default_store_path, settings
from kalos.errors import InvalidArgument, KalosError

__all__ = ["main"]


def _add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="default", help="the sidecar's name on this host (default: %(default)s)")


def _build_parser() -> argparse.ArgumentParser:
    s = settings()
    parser = argparse.ArgumentParser(
        prog="kalos",
        description="Kalos: microsecond memory recall for LLM agents. A sidecar keeps every memory "
        "embedding resident (GPU or CPU) and answers top-k cosine recalls through shared memory.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run a sidecar in the foreground",
        description="Run a sidecar in the foreground until SIGINT/SIGTERM. Prints one line when ready.",
    )
    serve.add_argument("--store", type=Path, default=None,
                       help=f"SQLite store file (created if missing; default: {default_store_path()})")
    _add_name(serve)
    serve.add_argument("--dim", type=int, default=None,
                       help="vector dimension; required to create a store, checked against an existing one")
    serve.add_argument("--device", default="auto", help="auto (CUDA when visible), cpu, cuda or cuda:N (default: auto)")
    serve.add_argument("--slots", type=int, default=s.slots, help="most clients connected at once (default: %(default)s)")
    serve.add_argument("--max-k", type=int, default=s.max_k, help="largest k a recall may ask for (default: %(default)s)")
    serve.add_argument("--max-batch", type=int, default=s.max_batch,
                       help="query rows per request; bigger batches are split (default: %(default)s)")
    serve.add_argument("--spin-us", type=float, default=s.sidecar_spin_us,
                       help="microseconds to keep sweeping after the last request before sleeping (default: %(default)s)")
    serve.add_argument("--seed-compat", action="store_true",
                       help="also serve the seed article's recall_shm_t protocol at /dev/shm/kalos_recall_shm")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    add = commands.add_parser(
        "add", help="add memories from a .npy or JSONL file",
        description="Add memories. FILE is a .npy matrix [n, dim] (float) or JSONL with one object per line: "
        '{"vector": [...], "text": "...", "metadata": {...}, "namespace": "..."} (text, metadata, namespace optional).',
    )
    add.add_argument("file", type=Path)
    _add_name(add)
    add.add_argument("--namespace", default="default", help="namespace for rows that name none (default: %(default)s)")
    add.add_argument("--batch", type=int, default=4096, help="rows per add request (default: %(default)s)")

    recall = commands.add_parser(
        "recall", help="recall the memories nearest to a vector",
        description="Recall the k nearest memories to a query vector and print id, score and text.",
    )
    source = recall.add_mutually_exclusive_group(required=True)
    source.add_argument("--vector", help="comma-separated floats")
    source.add_argument("--npy", type=Path, help="a .npy file holding the query vector (or a matrix: see --row)")
    recall.add_argument("--row", type=int, default=0, help="row of --npy to use (default: 0)")
    _add_name(recall)
    recall.add_argument("-k", type=int, default=8, help="number of hits (default: %(default)s)")
    recall.add_argument("--namespace", default="default", help="namespace to search (default: %(default)s)")
    recall.add_argument("--all-namespaces", action="store_true", help="search every namespace")
    recall.add_argument("--since", type=float, default=None, help="only memories created at or after (unix seconds)")
    recall.add_argument("--until", type=float, default=None, help="only memories created before (unix seconds)")
    recall.add_argument("--json", action="store_true", help="print JSON")

    stats = commands.add_parser("stats", help="print a sidecar's live statistics",
                                description="Print counts, namespaces, device, QPS and latency percentiles.")
    _add_name(stats)
    stats.add_argument("--json", action="store_true", help="print JSON")

    demo = commands.add_parser(
        "demo", help="start (or find) a sidecar on the default store and run a demo client",
        description="Start a sidecar on the default store (or use the running one), add demo memories once, "
        "run an agent-style loop of recalls, print what was recalled and the latency percentiles.",
    )
    _add_name(demo)
    demo.add_argument("--store", type=Path, default=None, help=f"store to serve if no sidecar runs (default: {default_store_path()})")
    demo.add_argument("--memories", type=int, default=20000, help="demo memories to add on first run (default: %(default)s)")
    demo.add_argument("--recalls", type=int, default=2000, help="recalls to time (default: %(default)s)")
    demo.add_argument("--device", default="auto", help="device if the demo starts the sidecar (default: auto)")

    bench = commands.add_parser(
        "bench", help="measure round trip, end-to-end recall and idle CPU against in-process baselines",
        description="Start a sidecar on a temporary store and measure, from this (separate) process: the bare "
        "channel round trip, recall on a tiny store (hot and cold), end-to-end recall at N x dim against "
        "in-process NumPy on the same data, and the sidecar's CPU use while idle.",
    )
    bench.add_argument("--n", type=int, default=65536, help="memories for the end-to-end row (default: %(default)s)")
    bench.add_argument("--dim", type=int, default=1024, help="dimension for the end-to-end row (default: %(default)s)")
    bench.add_argument("-k", type=int, default=8, help="k (default: %(default)s)")
    bench.add_argument("--repeats", type=int, default=2000, help="timed round trips per hot row (default: %(default)s)")
    bench.add_argument("--e2e-repeats", type=int, default=200, help="timed recalls for the N x dim row (default: %(default)s)")
    bench.add_argument("--cold", type=int, default=20, help="cold (after 1 s idle) samples (default: %(default)s)")
    bench.add_argument("--device", default="cpu", help="sidecar device (default: %(default)s)")
    bench.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except KalosError as exc:
        print(f"kalos {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    from kalos.sidecar import Sidecar, SidecarConfig

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    config = SidecarConfig(
        store=args.store or default_store_path(), name=args.name, dim=args.dim, device=args.device,
        slots=args.slots, max_k=args.max_k, max_batch=args.max_batch, spin_us=args.spin_us,
        seed_compat=args.seed_compat,
    )
    sidecar = Sidecar(config)
    print(sidecar.ready_message(), flush=True)
    sidecar.serve_forever(install_signal_handlers=True)
    print(f"kalos sidecar {args.name!r} stopped", file=sys.stderr)
    return 0


def _read_jsonl(path: Path, default_namespace: str) -> dict[str, list[tuple[list[float], str | None, dict | None]]]:
    groups: dict[str, list[tuple[list[float], str | None, dict | None]]] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{number}: not valid JSON: {exc}") from None
            if not isinstance(row, dict) or not isinstance(row.get("vector"), list):
                raise InvalidArgument(f"{path}:{number}: expected an object with a \"vector\" list")
            text, metadata = row.get("text"), row.get("metadata")
            if text is not None and not isinstance(text, str):
                raise InvalidArgument(f"{path}:{number}: \"text\" must be a string")
            if metadata is not None and not isinstance(metadata, dict):
                raise InvalidArgument(f"{path}:{number}: \"metadata\" must be an object")
            namespace = row.get("namespace", default_namespace)
            if not isinstance(namespace, str):
                raise InvalidArgument(f"{path}:{number}: \"namespace\" must be a string")
            groups.setdefault(namespace, []).append((row["vector"], text, metadata))
    return groups


def _add(args: argparse.Namespace) -> int:
    from kalos.client import Client

    if args.batch < 1:
        raise InvalidArgument("--batch must be >= 1")
    if not args.file.exists():
        raise InvalidArgument(f"{args.file} does not exist")
    with Client(args.name) as client:
        total = 0
        if args.file.suffix == ".npy":
            matrix = np.load(args.file, allow_pickle=False)
            if matrix.ndim == 1:
                matrix = matrix[None, :]
            for start in range(0, len(matrix), args.batch):
                total += len(client.add(matrix[start : start + args.batch], namespace=args.namespace))
        else:
            for namespace, rows in _read_jsonl(args.file, args.namespace).items():
                for start in range(0, len(rows), args.batch):
                    chunk = rows[start : start + args.batch]
                    try:
                        vectors = np.asarray([r[0] for r in chunk], dtype=np.float32)
                    except ValueError as exc:
                        raise InvalidArgument(f"{args.file}: vectors of unequal length or not numbers: {exc}") from None
                    total += len(client.add(vectors, texts=[r[1] for r in chunk],
                                            metadata=[r[2] for r in chunk], namespace=namespace))
    print(f"added {total} memories from {args.file}")
    return 0


def _recall(args: argparse.Namespace) -> int:
    from kalos.client import Client

    if args.vector is not None:
        try:
            vector = np.array([float(x) for x in args.vector.split(",")], dtype=np.float32)
        except ValueError:
            raise InvalidArgument(f"--vector must be comma-separated numbers, got {args.vector!r}") from None
    else:
        matrix = np.load(args.npy, allow_pickle=False)
        vector = matrix if matrix.ndim == 1 else matrix[args.row]
    with Client(args.name) as client:
        hits = client.recall(vector, k=args.k, namespace=None if args.all_namespaces else args.namespace,
                             since=args.since, until=args.until)
        items = client.get(hits.ids) if len(hits) else []
    rows = [
        {"id": int(i), "score": float(s), "namespace": it.namespace if it else None, "text": it.text if it else None}
        for (i, s), it in zip(hits, items)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            text = (row["text"] or "").replace("\n", " ")
            print(f"{row['id']:>10}  {row['score']:.4f}  [{row['namespace']}]  {text[:100]}")
        if not rows:
            print("no memories matched")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from kalos.client import Client

    with Client(args.name) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(format_stats(stats))
    return 0


def format_stats(stats: dict[str, Any]) -> str:
    def us(value: Any) -> str:
        return "-" if value is None else f"{value:,.1f} us"

    lines = [
        f"sidecar {stats['name']!r} (pid {stats['pid']}) on {stats['device']} [{stats['engine']}], up {stats['uptime_s']:.0f} s",
        f"  memories   {stats['count']:,} live, {stats['tombstones']:,} deleted awaiting compaction, dim {stats['dim']}",
        f"  store      {stats['store']} ({stats['store_bytes'] / 2**20:,.1f} MiB)",
        f"  engine     {stats['engine_bytes'] / 2**20:,.1f} MiB for capacity {stats['capacity']:,}",
        f"  clients    {stats['clients']} of {stats['slots']} slots",
        f"  recalls    {stats['queries']:,} in {stats['batches']:,} batches, {stats['errors']:,} errors, {stats['qps']:,.1f}/s (last 10 s)",
        f"  service    p50 {us(stats['service_p50_us'])}, p99 {us(stats['service_p99_us'])} (in the sidecar, per batch)",
        "  namespaces " + (", ".join(f"{k}: {v:,}" for k, v in sorted(stats["namespaces"].items())) or "-"),
    ]
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    from kalos.demo import run_demo

    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    from kalos.bench import run_bench

    return run_bench(args)


_COMMANDS = {"serve": _serve, "add": _add, "recall": _recall, "stats": _stats, "demo": _demo, "bench": _bench}
