"""The ``kalos`` command: serve, add, import, recall, stats, list, count, demo, bench, doctor."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kalos.config import DEFAULT_GPU_WINDOW_US, GPU_POLLING, Settings, default_store_path, environment_help, settings
from kalos.errors import DimensionMismatch, EmbedderUnavailable, InvalidArgument, KalosError
from kalos.server.sidecar_embed import EMBED_RUNTIMES
from kalos.tools.vector_files import check_rows, load_npy, read_vector_jsonl

__all__ = ["main"]


def _add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="default", help="the sidecar's name on this host (default: %(default)s)")


def version() -> str:
    """The installed distribution's version; a source tree run without installing has only the
    package's own ``__version__``, and says so."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kalos-recall")
    except PackageNotFoundError:
        from kalos import __version__

        return f"{__version__} (source tree, not installed)"


def _build_parser(s: Settings | None = None) -> argparse.ArgumentParser:
    """The parser; ``s`` gives the defaults the help shows (default: this process's settings)."""
    s = settings() if s is None else s
    parser = argparse.ArgumentParser(
        prog="kalos",
        description="Kalos: microsecond memory recall for LLM agents. A sidecar keeps every memory "
        "embedding resident (GPU or CPU) and answers top-k cosine recalls through shared memory.",
    )
    parser.add_argument("--version", action="version", version=f"kalos {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run a sidecar in the foreground",
        description="Run a sidecar in the foreground until SIGINT/SIGTERM. Prints one line when ready.",
        epilog=environment_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--store", type=_store_arg, default=None,
                       help=f"SQLite store file (created if missing; default: {default_store_path()}), or "
                       "postgresql://USER@HOST:PORT/DB to share one PostgreSQL database between the sidecars of "
                       "several hosts (each follows the others' writes; needs pip install 'kalos-recall[postgres]'; give the password "
                       "by PGPASSWORD or ~/.pgpass rather than in the URL, which ps shows)")
    _add_name(serve)
    serve.add_argument("--dim", type=int, default=None,
                       help="vector dimension; required to create a store, checked against an existing one")
    serve.add_argument("--device", default="auto",
                       help="auto (CUDA when visible), cpu, cuda, cuda:N, or several GPUs to shard the rows over: "
                       "cuda:0,cuda:1 or cuda:all (default: auto)")
    serve.add_argument("--precision", choices=["exact", "fast"], default="exact",
                       help="GPU scan: exact float32, or fast (an 8-bit scan for single queries, 16-bit for batches, "
                       "+ certified float32 re-score, "
                       "the same top-k) (default: %(default)s)")
    serve.add_argument("--slots", type=int, default=s.slots, help="most clients connected at once (default: %(default)s)")
    serve.add_argument("--max-k", type=int, default=s.max_k, help="largest k a recall may ask for (default: %(default)s)")
    serve.add_argument("--max-batch", type=int, default=s.max_batch,
                       help="query rows per request; bigger batches are split (default: %(default)s)")
    serve.add_argument("--spin-us", type=float, default=s.sidecar_spin_us,
                       help="microseconds to keep sweeping after the last request before sleeping (default: %(default)s)")
    serve.add_argument("--gather-us", type=float, default=s.sidecar_gather_us,
                       help="microseconds after a pass during which the next one waits for that pass's clients "
                       "to send their next request, if they came back that quickly before: a crowd recalling back to "
                       "back shares one pass instead of taking turns; an agent that thinks between recalls is not "
                       "waited for (0: search at once; default: %(default)s)")
    serve.add_argument("--no-zero-copy", dest="zero_copy", action="store_false",
                       help="GPU engine: pass queries and answers through host copies instead of letting the "
                       "kernels read and write the page-locked shared segment directly (for comparisons)")
    serve.add_argument("--gpu-polling", nargs="?", const="graph", default="graph", choices=GPU_POLLING,
                       help="GPU engine: a kernel polls the slots and answers single recalls (k <= 16, all "
                       "namespaces or one, a time window or none) by itself while traffic lasts, with no Python on the "
                       "way; it stops after --spin-us without a request. 'graph' (the default, and the value when "
                       "none is given): a CUDA graph that waits for requests, then scans with the whole GPU, the "
                       "requests of several clients in one batch. Beside another process's GPU work it answers "
                       "without waiting for a time slice, but takes more of that process's time slices than "
                       "'off' (the sweep answers everything) does. Figures: BENCHMARKS.md")
    serve.add_argument("--gpu-window-us", type=float, default=DEFAULT_GPU_WINDOW_US,
                       help="with GPU polling (the default on a GPU): microseconds the polling kernel, once a request "
                       "is pending, waits for other clients' requests before its pass (it stops waiting as soon as "
                       "as many have asked as the recent passes found, or every client); 0: take what is pending at "
                       "once (default: %(default)s)")
    serve.add_argument("--embed", choices=["lazy", "start", "off"], default="lazy",
                       help="the text embedder (all-MiniLM-L6-v2) that clients without one of their own use, one "
                       "model for every client of the host: Client.remember / recall_text send text and the sidecar "
                       "embeds it (batched across clients), so a client needs NumPy only. lazy: loaded at the first "
                       "text (that call waits for the load: under a second from the cached ONNX graph, about ten the "
                       "first time, while the graph is exported); start: loaded in the background at start, so the "
                       "first text does not wait (costs ~150 MB of memory even if no text comes); off: clients must "
                       "embed themselves. "
                       "Needs pip install 'kalos-recall[embed]' where the sidecar runs (default: %(default)s)")
    serve.add_argument("--embed-runtime", choices=list(EMBED_RUNTIMES), default="auto",
                       help="how the sidecar runs the embedder: onnx (ONNX Runtime over a graph exported once from "
                       "the packaged weights and cached under ~/.cache/kalos; same vectors within cosine 0.9999, "
                       "about twice as fast on a small CPU), graphs (the model on the sidecar's GPU, each forward pass "
                       "a replay of a captured CUDA graph, checked against sentence-transformers at load), triton (the same "
                       "graphs, capturing the model written as 44 fused Triton kernels instead of its own 120-150; "
                       "checked the same way, else graphs; one short text's forward pass in 206 instead of 469 us of "
                       "device time on an H200), torch "
                       "(sentence-transformers as it is), auto (onnx on a CPU sidecar, triton on a GPU sidecar). When "
                       "onnx or graphs are not possible the sidecar logs why and uses torch (default: %(default)s)")
    serve.add_argument("--seed-compat", action="store_true",
                       help="also serve the seed article's recall_shm_t protocol (top-8 over all namespaces)")
    serve.add_argument("--seed-compat-shm", default="/kalos_recall_shm",
                       help="POSIX shared-memory name of the seed-compat segment (default: %(default)s)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="the least severe log records the sidecar writes to stderr (default: %(default)s)")

    add = commands.add_parser(
        "add", help="add memories from a .npy or JSONL file",
        description="Add memories. FILE is a .npy matrix [n, dim] (float) or JSONL with one object per line: "
        '{"vector": [...], "text": "...", "metadata": {...}, "namespace": "...", "key": "..."} (text, metadata, '
        'namespace, key optional). A row whose key already exists in its namespace replaces that memory (upsert).',
    )
    add.add_argument("file", type=Path, help="the .npy matrix or JSONL file of memories (described above)")
    _add_name(add)
    add.add_argument("--namespace", default="default", help="namespace for rows that name none (default: %(default)s)")
    add.add_argument("--batch", type=int, default=4096, help="rows per add request (default: %(default)s)")
    add.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                     help="the memories expire this many seconds after the add (default: never)")

    imp = commands.add_parser(
        "import", help="import text memories from a JSONL, CSV/TSV, plain-text or Parquet file (validated, batched, "
        "resumable)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Import memories from FILE: one row per memory with a text column and, optionally, a vector, "
        "a metadata object, a namespace and a key column (the options below name them; other columns are "
        "ignored unless --metadata-fields names them).\n"
        "A plain .txt file is one memory per line (blank lines skipped). CSV and JSONL may begin with a UTF-8 "
        "byte-order mark.\n"
        "Rows without a vector are embedded by the sidecar, in batches, with its embedder (all-MiniLM-L6-v2, "
        "384-dim; needs pip install 'kalos-recall[embed]' where the sidecar runs); the sidecar's store must have "
        "the vectors' dimension.\n\n"
        "The WHOLE FILE IS VALIDATED FIRST: if any row is malformed, every malformed row is reported with its "
        "line number\n(row number for Parquet) and NOTHING of the file is imported.\n\n"
        "Then rows are added in batches (one transaction each). The progress file FILE.kalos-progress records how "
        "many rows\nare committed, for each store the file went into; after an interrupted import, --resume "
        "imports only the rest (the\nprogress is keyed by the file's path, size and mtime, and by the store); "
        "importing the file into a store\nthat has it again is refused. The rows/s figure leaves out the model's "
        "load, reported apart. CSV cells hold\nvectors and metadata as JSON text. Parquet needs "
        "pip install 'kalos-recall[parquet]'.",
    )
    imp.add_argument("file", type=Path, help="the .jsonl/.ndjson, .csv, .tsv, .txt or .parquet file")
    _add_name(imp)
    imp.add_argument("--format", choices=["jsonl", "csv", "tsv", "text", "parquet"], default=None,
                     help="file format (default: from the file's suffix)")
    imp.add_argument("--text-column", default="text", help="column holding the text (default: %(default)s)")
    imp.add_argument("--vector-column", default="vector",
                     help="column holding a precomputed vector; rows without one are embedded (default: %(default)s)")
    imp.add_argument("--metadata-column", default="metadata",
                     help="column holding a JSON object of metadata (default: %(default)s)")
    imp.add_argument("--metadata-fields", default="",
                     help="comma-separated plain columns to fold into each row's metadata (default: none)")
    imp.add_argument("--namespace-column", default="namespace",
                     help="column naming the row's namespace (default: %(default)s)")
    imp.add_argument("--key-column", default="key",
                     help="column holding the row's key (its own id, unique in its namespace): a key the namespace "
                     "already holds replaces that memory, as kalos add does (default: %(default)s)")
    imp.add_argument("--namespace", default="default", help="namespace for rows that name none (default: %(default)s)")
    imp.add_argument("--batch", type=int, default=1000, help="rows per transaction (default: %(default)s)")
    again = imp.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue an interrupted import of this file")
    again.add_argument("--restart", action="store_true",
                       help="ignore the progress file and import every row again")
    imp.add_argument("--progress-file", type=Path, default=None,
                     help="where to keep the progress (default: FILE.kalos-progress beside the file)")
    imp.add_argument("--max-errors", type=int, default=20, help="malformed rows to list (default: %(default)s)")
    imp.add_argument("--validate-only", action="store_true", help="check the file, import nothing")
    imp.add_argument("--quiet", action="store_true", help="no progress bar")
    imp.add_argument("--json", action="store_true", help="print the summary as JSON")

    recall = commands.add_parser(
        "recall", help="recall the memories nearest to a vector or a text",
        description="Recall the k nearest memories to a query vector (or to a text, embedded by the sidecar) and "
        "print id, score and text.",
    )
    source = recall.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a text, embedded by the sidecar (which needs pip install "
                        "'kalos-recall[embed]'; this command then loads no model)")
    source.add_argument("--vector", help="comma-separated floats")
    source.add_argument("--npy", type=Path, help="a .npy file holding the query vector (or a matrix: see --row)")
    recall.add_argument("--row", type=int, default=0, help="row of --npy to use (default: 0)")
    _add_name(recall)
    recall.add_argument("-k", type=int, default=8, help="number of hits (default: %(default)s)")
    recall.add_argument("--namespace", default="default", help="namespace to search (default: %(default)s)")
    recall.add_argument("--all-namespaces", action="store_true", help="search every namespace")
    recall.add_argument("--since", type=float, default=None, help="only memories created at or after (unix seconds)")
    recall.add_argument("--until", type=float, default=None, help="only memories created before (unix seconds)")
    recall.add_argument("--where", default=None, metavar="JSON",
                        help='only memories whose metadata passes this filter, e.g. \'{"user_id": "alice"}\' '
                        "(operators and combinators as for kalos list), applied inside the scan")
    recall.add_argument("--json", action="store_true", help="print JSON")
    recall.add_argument("--store", default=None, metavar="postgresql://...",
                        help="no sidecar: search this PostgreSQL store on the server (exact cosine; needs the "
                        "pgvector extension; --vector or --npy only, no --since/--until/--where)")

    stats = commands.add_parser("stats", help="print a sidecar's live statistics",
                                description="Print counts, namespaces, device, QPS and latency percentiles.")
    _add_name(stats)
    stats.add_argument("--json", action="store_true", help="print JSON")

    listing = commands.add_parser(
        "list", help="list stored memories (a page at a time, in the order they were added)",
        description="Print the stored memories of a namespace (or of all) whose metadata passes --where: id, "
        "key, namespace and text, one per line, then the cursor of the next page (pass it as --cursor).",
    )
    _add_name(listing)
    listing.add_argument("--namespace", default=None, help="only this namespace (default: every namespace)")
    listing.add_argument("--where", default=None, metavar="JSON",
                         help='a metadata filter, e.g. \'{"user_id": "alice"}\' (operators $eq $ne $in $nin $gt '
                         "$gte $lt $lte $exists, $and $or $not)")
    listing.add_argument("--limit", type=int, default=100, help="memories per page, 1 to 1000 (default: %(default)s)")
    listing.add_argument("--cursor", default=None, help="the cursor a previous page printed")
    listing.add_argument("--all", action="store_true", help="every page, not only the first")
    listing.add_argument("--json", action="store_true", help="one JSON object per memory (and {\"next_cursor\": ...})")

    counting = commands.add_parser("count", help="count stored memories",
                                   description="Print how many stored memories pass --namespace and --where.")
    _add_name(counting)
    counting.add_argument("--namespace", default=None, help="only this namespace (default: every namespace)")
    counting.add_argument("--where", default=None, metavar="JSON", help="a metadata filter (as for kalos list)")

    demo = commands.add_parser(
        "demo", help="start (or find) a sidecar on the default store and run a demo client",
        description="Start a sidecar on the default store (or use the running one), store Python's own help texts "
        "(pydoc_data.topics, about 650 passages) once, into the namespace kalos-demo-pydoc, embedded with the default embedder, then run an agent-style "
        "loop of recall_text over questions, print what was recalled and the latency percentiles of the recall "
        "alone, the embedding alone and both together. A second run finds the passages in the store and skips the "
        "embedding. Without pip install 'kalos-recall[embed]' (or with --synthetic) it runs on synthetic vectors instead.",
    )
    _add_name(demo)
    demo.add_argument("--store", type=Path, default=None,
                      help=f"store to serve if no sidecar runs (default: {default_store_path()}); refused if the "
                      "running sidecar serves another (then pass --name too, for a sidecar of the demo's own)")
    demo.add_argument("--memories", type=int, default=20000,
                      help="synthetic demo: memories to add on first run (default: %(default)s)")
    demo.add_argument("--recalls", type=int, default=2000, help="vector recalls to time (default: %(default)s)")
    demo.add_argument("--rounds", type=int, default=4,
                      help="text demo: rounds over the questions when timing the embedding paths (default: %(default)s)")
    demo.add_argument("--synthetic", action="store_true", help="run the synthetic-vector demo even if the embedder is installed")
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
    bench.add_argument("--device", default="cpu",
                       help="sidecar device; cuda or cuda:N runs the GPU suite (default: %(default)s)")
    bench.add_argument("--gpu-sizes", default="65536,1048576",
                       help="GPU suite: comma-separated N values (default: %(default)s)")
    bench.add_argument("--gpu-precisions", default="exact,fast",
                       help="GPU suite: sidecar precisions measured end to end (default: %(default)s)")
    bench.add_argument("--gpu-polling", nargs="?", const="graph", default="",
                       help="GPU suite: also measure single recalls end to end with serve --gpu-polling MODE, "
                       "side by side with the main rows, which the sweep answers (--gpu-polling off); graph, the "
                       "only mode, is the value when none is given")
    bench.add_argument("--gpu-host-copies", action="store_true",
                       help="GPU suite: also measure the exact path end to end with --no-zero-copy, side by side")
    bench.add_argument("--batches", default="1,8,64,256",
                       help="GPU suite: batch sizes for throughput rows (default: %(default)s)")
    bench.add_argument("--clients", default="8x64",
                       help="GPU suite: aggregate throughput of CxB = C client processes each sending batches of B "
                       "at once, comma-separated; empty for none (default: %(default)s)")
    from kalos.tools.crowd import add_crowd_arguments

    add_crowd_arguments(bench)
    bench.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    bench.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                       help="also draw the latency CDF of each path beside its baseline (needs pip install 'kalos-recall[plot]')")

    doctor = commands.add_parser(
        "doctor", help="check this machine for Kalos: GPU and CUDA, shared memory, permissions, store, sidecar",
        description="Explain this machine in plain words: GPU visible or not, the NVIDIA driver against PyTorch's "
        "CUDA runtime, /dev/shm, the runtime directory and socket permissions, the store's health (opened "
        "readonly) and the sidecar's status. Exit code 0 when healthy, 1 when problems are listed.",
    )
    _add_name(doctor)
    doctor.add_argument("--store", type=_store_arg, default=None,
                        help=f"store to check: a file or a postgresql:// URL (default: {default_store_path()})")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    return parser


def _store_arg(text: str) -> Any:
    from kalos.store.spec import store_spec

    try:
        return store_spec(text)
    except InvalidArgument as exc:
        # argparse shows the message of this type only (of a ValueError, a generic one).
        raise argparse.ArgumentTypeError(str(exc)) from None


def _glue_negative_values(argv: list[str]) -> list[str]:
    """``--vector -0.5,1`` -> ``--vector=-0.5,1``: argparse would take "-0.5,1" for an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--vector" and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"--vector={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    # A bad KALOS_* variable is reported like any usage error, after parsing, so that --help and
    # --version still work (their defaults are then the built-in ones).
    try:
        bad_env = None
        parser = _build_parser()
    except InvalidArgument as exc:
        bad_env = exc
        parser = _build_parser(Settings())
    args = parser.parse_args(_glue_negative_values(list(sys.argv[1:] if argv is None else argv)))
    if bad_env is not None:
        print(f"kalos: error: {bad_env}", file=sys.stderr)
        return 2
    if args.command == "serve" and argv is None:
        from kalos.server.blas import settle_blas_threads

        settle_blas_threads()  # re-executes this process once, so BLAS loads with its spinning cut short
    # The text embedder loads from the installed package; this process never needs a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return _COMMANDS[args.command](args)
    except KalosError as exc:
        print(f"kalos {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def new_store_hint() -> str:
    """How to create a store, in the command's own words (shared with ``kalos doctor``)."""
    from kalos.client.embed import DEFAULT_DIM, DEFAULT_MODEL

    return (f"pass --dim {DEFAULT_DIM} to create it for text memories (the dimension of the default embedder, "
            f"{DEFAULT_MODEL}), or --dim D for vectors of your own of dimension D")


def _serve(args: argparse.Namespace) -> int:
    from kalos.server.sidecar import Sidecar, SidecarConfig
    from kalos.store.spec import describe_store, is_store_url

    store = args.store or default_store_path()
    # The store would say "pass dim" (its API's argument); a user of this command needs the flag.
    if args.dim is None and not is_store_url(store) and not Path(store).exists():
        raise InvalidArgument(f"there is no store at {store} yet; {new_store_hint()}")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    config = SidecarConfig(
        store=store, name=args.name, dim=args.dim, device=args.device,
        precision=args.precision,
        slots=args.slots, max_k=args.max_k, max_batch=args.max_batch, spin_us=args.spin_us, gather_us=args.gather_us,
        seed_compat=args.seed_compat, seed_compat_shm=args.seed_compat_shm, zero_copy=args.zero_copy,
        gpu_polling=args.gpu_polling, gpu_window_us=args.gpu_window_us, embed=args.embed,
        embed_runtime=args.embed_runtime,
    )
    try:
        sidecar = Sidecar(config)
    except InvalidArgument as exc:
        # A PostgreSQL database is known to hold no store only once connected.
        if args.dim is None and is_store_url(store) and "holds no Kalos store" in str(exc):
            raise InvalidArgument(f"{describe_store(store)} holds no Kalos store yet; {new_store_hint()}") from None
        raise
    sidecar.stop_on_signals()  # before the ready line: whoever saw it may signal at once
    print(sidecar.ready_message(), flush=True)
    sidecar.serve_forever()
    print(f"kalos sidecar {args.name!r} stopped", file=sys.stderr)
    return 0


def _add(args: argparse.Namespace) -> int:
    from kalos.client.client import Client

    if args.batch < 1:
        raise InvalidArgument("--batch must be >= 1")
    if args.ttl is not None:
        from kalos.validation import check_ttl

        check_ttl(args.ttl, 1)  # before anything is sent: a bad --ttl adds nothing
    if not args.file.exists():
        raise InvalidArgument(f"{args.file} does not exist")
    with Client(args.name) as client:
        added = updated = 0
        if args.file.suffix == ".npy":
            matrix = load_npy(args.file)
            if matrix.ndim == 1:
                matrix = matrix[None, :]
            matrix = check_rows(args.file, matrix, client.dim)
            for start in range(0, len(matrix), args.batch):
                added += len(client.add(matrix[start : start + args.batch], namespace=args.namespace, ttl=args.ttl))
        else:
            for namespace, all_rows in read_vector_jsonl(args.file, args.namespace, client.dim).items():
                # One add carries keys for all its rows or none: keyed and unkeyed rows apart.
                for rows in ([r for r in all_rows if r[3] is None], [r for r in all_rows if r[3] is not None]):
                    for start in range(0, len(rows), args.batch):
                        chunk = rows[start : start + args.batch]
                        vectors = np.asarray([r[0] for r in chunk], dtype=np.float32)  # rows checked by read_vector_jsonl
                        keys = None if chunk[0][3] is None else [r[3] for r in chunk]
                        # An upsert keeps the id of the memory it replaces: only a look-up tells
                        # "updated" from "added", for the summary.
                        there = 0 if keys is None else sum(
                            item is not None for item in client.get(keys=keys, namespace=namespace))
                        n = len(client.add(vectors, texts=[r[1] for r in chunk], metadata=[r[2] for r in chunk],
                                           namespace=namespace, keys=keys, ttl=args.ttl))
                        added, updated = added + n - there, updated + there
    print(f"added {added} memories" + (f" and updated {updated} (their keys were stored already)" if updated else "")
          + f" from {args.file}")
    return 0


def _recall(args: argparse.Namespace) -> int:
    from kalos.client.client import Client

    if args.text is not None:
        if args.store is not None:
            raise InvalidArgument("--store takes --vector or --npy (the server search has no embedder)")
        return _recall_text(args)
    if args.vector is not None:
        try:
            vector = np.array([float(x) for x in args.vector.split(",")], dtype=np.float32)
        except ValueError:
            raise InvalidArgument(f"--vector must be comma-separated numbers, got {args.vector!r}") from None
    else:
        matrix = load_npy(args.npy)
        if matrix.ndim == 2 and not 0 <= args.row < len(matrix):
            raise InvalidArgument(f"--row {args.row}: {args.npy} has {len(matrix)} rows (0 to {len(matrix) - 1})")
        if matrix.ndim == 1 and args.row != 0:
            raise InvalidArgument(f"--row {args.row}: {args.npy} holds one vector (1-D), not a matrix")
        vector = matrix if matrix.ndim == 1 else matrix[args.row]
    if args.store is not None:
        return _recall_on_server(args, vector)
    where = _where_arg(args.where)
    with Client(args.name) as client:
        hits = client.recall(vector, k=args.k, namespace=None if args.all_namespaces else args.namespace,
                             since=args.since, until=args.until, where=where)
        items = client.get(hits.ids) if len(hits) else []
        hint = None if len(hits) else _empty_namespace_hint(args, client.stats()["namespaces"])
    rows = [
        {"id": int(i), "score": float(s), "namespace": it.namespace if it else None, "text": it.text if it else None}
        for (i, s), it in zip(hits, items)
    ]
    return _print_hits(rows, as_json=args.json, hint=hint)


def _recall_on_server(args: argparse.Namespace, vector: np.ndarray) -> int:
    """The fallback without a sidecar: pgvector's exact cosine search inside PostgreSQL."""
    from kalos.store.spec import is_store_url

    if not is_store_url(args.store):
        raise InvalidArgument("--store takes a postgresql:// URL (a SQLite store is searched by its sidecar)")
    if args.since is not None or args.until is not None or args.where is not None:
        raise InvalidArgument("--since/--until/--where need a sidecar; the server search filters by namespace only")
    from kalos.store.postgres import PostgresStore

    with PostgresStore.open(args.store, readonly=True) as store:
        hits = store.search(np.asarray(vector, dtype=np.float32), args.k,
                            None if args.all_namespaces else args.namespace)
        items = store.get([i for i, _ in hits]) if hits else []
        hint = None if hits else _empty_namespace_hint(args, store.namespace_counts())
    rows = [
        {"id": i, "score": s, "namespace": it.namespace if it else None, "text": it.text if it else None}
        for (i, s), it in zip(hits, items)
    ]
    return _print_hits(rows, as_json=args.json, hint=hint)


def _empty_namespace_hint(args: argparse.Namespace, counts: dict[str, int]) -> str | None:
    """When a recall found nothing because its namespace is empty while others hold memories
    (``kalos demo`` stores into its own), which ones do, and the flags that search them."""
    if args.all_namespaces or counts.get(args.namespace, 0):
        return None
    held = sorted(((n, c) for n, c in counts.items() if c), key=lambda nc: (-nc[1], nc[0]))
    if not held:
        return None
    shown = ", ".join(f"{n!r} ({c:,})" for n, c in held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    return (f"namespace {args.namespace!r} holds no memories; these do: {shown}. Search one with "
            f"--namespace {shlex.quote(held[0][0])}, or every one with --all-namespaces")


def _print_hits(rows: list[dict[str, Any]], *, as_json: bool, hint: str | None = None) -> int:
    if as_json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        if hint:  # stdout stays JSON
            print(hint, file=sys.stderr)
        return 0
    for row in rows:
        text = (row["text"] or "").replace("\n", " ")
        print(f"{row['id']:>10}  {row['score']:.4f}  [{row['namespace']}]  {text[:100]}")
    if not rows:
        print("no memories matched" + (f": {hint}" if hint else ""))
    return 0


def _embed_error_for_the_cli(exc: KalosError, name: str, vectors: str) -> KalosError:
    """``exc`` with the library's advice (``Client(embedder=...)``, which a command-line user
    cannot follow) replaced by the command-line fix; ``vectors``: how this command takes
    vectors instead of texts."""
    from kalos.client.embed import DEFAULT_DIM

    text = str(exc)
    if "Client(embedder=" not in text:
        return exc
    if "--embed off" in text:
        message = (f"sidecar {name!r} does not embed texts (it was started with kalos serve --embed off): restart "
                   f"it without --embed off, or {vectors}")
    elif isinstance(exc, DimensionMismatch):
        message = (f"{text.split(': serve a store')[0]}: texts need a store of dimension {DEFAULT_DIM} (kalos serve "
                   f"--store NEW.db --dim {DEFAULT_DIM} --name NAME), or {vectors}")
    else:  # the embedder is not installed where the sidecar runs
        message = (f"{text.split(' (or give the client')[0].rstrip('; ')}, and restart the sidecar {name!r}; "
                   f"or {vectors}")
    return type(exc)(message)


def _recall_text(args: argparse.Namespace) -> int:
    from kalos.client.client import Client
    from kalos.client.embed import load_progress

    where = _where_arg(args.where)
    with Client(args.name) as client, load_progress(sys.stderr):  # the model's load takes seconds: show it
        try:
            hits = client.recall_text(args.text, k=args.k, namespace=None if args.all_namespaces else args.namespace,
                                      since=args.since, until=args.until, where=where)
        except (EmbedderUnavailable, DimensionMismatch) as exc:
            raise _embed_error_for_the_cli(exc, args.name, "recall by --vector or --npy") from None
        hint = None if hits else _empty_namespace_hint(args, client.stats()["namespaces"])
    rows = [{"id": h.id, "score": h.score, "namespace": h.namespace, "text": h.text, "metadata": h.metadata,
             "created_at": h.created_at} for h in hits]
    return _print_hits(rows, as_json=args.json, hint=hint)


def _import(args: argparse.Namespace) -> int:
    from kalos.client.client import Client
    from kalos.tools.importer import Columns, ImportInterrupted, import_file, validate_file

    if args.batch < 1:
        raise InvalidArgument("--batch must be >= 1")
    columns = Columns(
        text=args.text_column, vector=args.vector_column, metadata=args.metadata_column,
        namespace=args.namespace_column, key=args.key_column,
        metadata_fields=tuple(f.strip() for f in args.metadata_fields.split(",") if f.strip()),
    )
    with Client(args.name) as client:
        if args.validate_only:
            report = validate_file(args.file, dim=client.dim, fmt=args.format, columns=columns,
                                   default_namespace=args.namespace, max_errors=args.max_errors)
            print(f"{args.file}: {report.rows:,} rows are valid ({report.to_embed:,} to embed); namespaces: "
                  + ", ".join(f"{k} {v:,}" for k, v in sorted(report.namespaces.items())))
            return 0
        try:
            summary = import_file(
                client, args.file, fmt=args.format, columns=columns, default_namespace=args.namespace,
                batch=args.batch, resume=args.resume, restart=args.restart, progress_file=args.progress_file,
                progress=None if args.quiet else sys.stderr, max_errors=args.max_errors,
            )
        except (EmbedderUnavailable, DimensionMismatch) as exc:
            raise _embed_error_for_the_cli(exc, args.name, "give every row a vector (--vector-column)") from None
        except ImportInterrupted as exc:
            print(f"kalos import: interrupted after {exc.committed:,} of {exc.rows:,} rows (recorded in "
                  f"{exc.progress_file}); rerun with --resume to import the rest", file=sys.stderr)
            return 130
    if args.json:
        import dataclasses

        print(json.dumps({**dataclasses.asdict(summary), "rows_per_s": summary.rows_per_s}, indent=2))
    else:
        print(summary.describe())
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from kalos.tools.doctor import run_doctor

    return run_doctor(args)


def _stats(args: argparse.Namespace) -> int:
    from kalos.client.client import Client

    with Client(args.name) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(format_stats(stats))
    return 0


def _where_arg(text: str | None) -> dict | None:
    from kalos.where import Where

    return None if text is None else Where.from_json(text).to_dict()


def _list(args: argparse.Namespace) -> int:
    import dataclasses

    from kalos.client.client import Client

    where = _where_arg(args.where)
    cursor = args.cursor
    with Client(args.name) as client:
        while True:
            page = client.list(namespace=args.namespace, where=where, limit=args.limit, cursor=cursor)
            for item in page:
                if args.json:
                    row = {k: v for k, v in dataclasses.asdict(item).items() if k != "vector"}
                    print(json.dumps(row, ensure_ascii=False))
                else:
                    text = (item.text or "").replace("\n", " ")
                    print(f"{item.id}\t{item.key or '-'}\t{item.namespace}\t{text[:80]}")
            cursor = page.next_cursor
            if cursor is None or not args.all:
                break
    if args.json:
        print(json.dumps({"next_cursor": cursor}))
    elif cursor is not None:
        print(f"more: --cursor {cursor}", file=sys.stderr)
    return 0


def _count(args: argparse.Namespace) -> int:
    from kalos.client.client import Client

    with Client(args.name) as client:
        print(client.count(namespace=args.namespace, where=_where_arg(args.where)))
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
    cache = stats.get("item_cache")  # (a sidecar before the cache has none)
    if cache:
        looked = cache["hits"] + cache["misses"]
        rate = f"{cache['hits'] / looked:.0%} of {looked:,} items read from it" if looked else "nothing read yet"
        lines.append(f"  item cache {cache['entries']:,} items, {cache['bytes'] / 2**20:,.1f} of "
                     f"{cache['max_bytes'] / 2**20:,.0f} MiB; {rate}")
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    from kalos.tools.demo import run_demo

    return run_demo(args)


def _positive_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise InvalidArgument(f"{flag} takes comma-separated whole numbers >= 1, got {text!r}")
    return values


def _check_bench_args(args: argparse.Namespace) -> None:
    """Refuses what would fail only after minutes of measuring (or be silently ignored)."""
    for flag, value, least in (("--n", args.n, 1), ("--dim", args.dim, 1), ("-k", args.k, 1),
                               ("--repeats", args.repeats, 1), ("--cold", args.cold, 1),
                               ("--e2e-repeats", args.e2e_repeats, 10)):  # timed in 10 rounds of a tenth each
        if value < least:
            raise InvalidArgument(f"{flag} must be >= {least}, got {value}")
    if args.crowd and args.crowd_seconds <= 0:
        raise InvalidArgument(f"--crowd-seconds must be > 0, got {args.crowd_seconds:g}")
    if args.crowd_writers and not args.crowd:
        raise InvalidArgument("--crowd-writers adds writers beside a crowd: give --crowd C1,C2,... too")
    if args.crowd:
        from kalos.tools.crowd import writers_problem

        problem = writers_problem(args.crowd_writers, args.crowd_scopes)
        if problem:
            raise InvalidArgument(problem)
    gpu = args.device.startswith("cuda")
    if gpu and not args.crowd:
        _positive_list(args.gpu_sizes, "--gpu-sizes")
        _positive_list(args.batches, "--batches")
    if args.plot is not None and (args.crowd or gpu):
        raise InvalidArgument("--plot draws the CPU suite's latency CDFs only; "
                              + ("--crowd" if args.crowd else "the GPU suite (--device cuda)")
                              + " draws none: drop --plot (--json FILE keeps the figures)")


def _bench(args: argparse.Namespace) -> int:
    _check_bench_args(args)
    if args.crowd:
        from kalos.tools.crowd import run_crowd

        return run_crowd(args)
    from kalos.tools.bench import run_bench

    return run_bench(args)


_COMMANDS = {"serve": _serve, "add": _add, "import": _import, "recall": _recall, "stats": _stats, "demo": _demo,
             "bench": _bench, "doctor": _doctor, "list": _list, "count": _count}
