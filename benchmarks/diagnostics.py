"""Diagnostics of the GPU path: scaffolding for kernel and serving work, not the figures of
BENCHMARKS.md (those come from ``kalos bench`` and the other scripts here). One script, three
parts; each prints as it goes and writes JSON where ``--out`` says:

    PYTHONPATH=src python3 benchmarks/diagnostics.py slot-server --n 65536 --dim 1024 --repeats 2000
    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/diagnostics.py gpu --out $OUT
    PYTHONPATH=src python3 benchmarks/diagnostics.py profile --device cuda --out $OUT

``slot-server``: the slot server (:mod:`kalos.engine.gpu.slot_server`) in one process:
correctness against the engine's own search, hand-over of what it does not serve, the round
trip of one recall through a slot, the kernels' phase stamps. ``gpu``: where the device time
of one search goes (ceilings, the graph's kernels by the profiler, a scan-tile sweep).
``profile``: py-spy on a sidecar and its client during a recall loop. The one-off probes that
shaped the kernels (launch costs, host-memory reads, 8-bit scan variants) are in the git
history; what they found is in ``docs/gpu-kernels.md``.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gpu_engine import Flusher, time_events  # benchmarks/: the script's own folder is on sys.path

from kalos import Client
from kalos.engine import Filter
from kalos.engine.gpu import ScanConfig, TorchEngine
from kalos.engine.gpu.slot_server import SlotGraphServer
from kalos.ipc.protocol import Layout, Op, RequestFlag, SlotView
from kalos.server.launcher import SidecarProcess
from kalos.store.sqlite import Store

SLOT_SERVER = """The slot server (kalos.engine.gpu.slot_server) on a GPU, in one process: correctness against
the engine's own search, hand-over of what it does not serve, and the round trip of one recall
through a slot, for variants of the CUDA-graph server (``graph:DEPTH[:TUNING[:WARPS]]``).

The "client" here is this process writing a request into a slot of an mmap'd segment and
spinning on resp_seq, as kalos.client.client does from another process (minus its Python call).

    PYTHONPATH=src python3 benchmarks/diagnostics.py slot-server --n 65536 --dim 1024 --repeats 2000"""
GPU = """Where the time of one Q=1 search goes on the device, and which scan tile is fastest.

Run on the device machine (one H200), from the repo root:

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/diagnostics.py gpu --out $OUT

Parts (each prints as it goes; a short table last):
1. ceilings: device copy bandwidth, a read-only reduction (``x.sum()``), cuBLAS ``mv``;
2. the engine's graph for Q=1, k=8 (exact and fast): device time by CUDA events, and the
   per-kernel / per-copy durations inside it from the PyTorch profiler (CUPTI);
3. the v2 score-writing scan kernel alone over a sweep of tiles (device time, GB/s);
4. a Triton kernel reading from and writing to page-locked host memory (the zero-copy path):
   correctness and device time;
5. host-side costs of one ``search`` call: wall time against device time."""
PROFILE = """Where the host time of one end-to-end recall goes: py-spy on the sidecar and on the client.

    PYTHONPATH=src python3 benchmarks/diagnostics.py profile --device cuda --out $OUT

Builds a store of N random unit rows, starts ``kalos serve`` on it, and runs a recall loop
(k=8, ``--batch`` queries per call) from this process for ``--seconds`` while two py-spy processes
sample the sidecar and this client (non-blocking, so the loop keeps its pace). Writes the
collapsed stacks to $OUT/{sidecar,client}.txt and prints the top self-time lines of each and
the loop's own p50/p99."""


# -- slot-server --------------------------------------------------------------------------------

RECALL, ALL = int(Op.RECALL), int(RequestFlag.ALL_NAMESPACES)


def submit(view: SlotView, q: np.ndarray, k: int, seq: int, *, n_queries: int = 1, flags: int = ALL,
           namespace: bytes = b"") -> None:
    view.write_request(RECALL, n_queries, k, flags, 0.0, 0.0, namespace)
    view.queries[0] = q
    view.req_seq[0] = seq


def wait(view: SlotView, seq: int, server, slot: int, timeout: float = 2.0) -> str:
    end = time.perf_counter() + timeout
    while True:
        if view.resp_seq[0] == seq:
            return "answered"
        if server.handed[slot] == seq:
            return "handed"
        if time.perf_counter() > end:
            return "timeout"
        server.running()  # the graph server's queue of rounds is topped up by this call


def round_trips(server, view: SlotView, queries: np.ndarray, k: int, repeats: int, named: bool, gap_us: float = 0,
                ref: tuple | None = None):
    """Round trips (us, after 200 warm-up ones) of requests through one slot, back to back or
    ``gap_us`` apart (the server keeps serving meanwhile), the graph server's median phases
    (GPU clock stamps), and how many answers differ from ``ref`` (ids, scores of each query;
    checked after the clock stopped)."""
    lat = []
    phases = []  # graph server: host and GPU clocks (ns) of each request's phases
    stamps = getattr(server, "stamps", None)
    seq = int(view.req_seq[0])
    wrong = 0
    extra = dict(flags=0, namespace=b"default") if named else {}
    for i in range(repeats + 200):
        seq += 1
        if gap_us:
            until = time.perf_counter() + gap_us / 1e6
            while time.perf_counter() < until:
                server.running()
        t = time.perf_counter()
        t_ns = time.time_ns()
        submit(view, queries[i % 512], k, seq, **extra)
        while view.resp_seq[0] != seq:
            if server.handed[0] == seq or not server.running():
                raise SystemExit(f"request {i} not answered by the kernel "
                                 f"(handed {server.handed[0] == seq}, running {server.running()})")
        lat.append(time.perf_counter() - t)
        if stamps is not None:
            phases.append((t_ns, time.time_ns(), *stamps()))
        if ref is not None:
            wrong += not answer_matches(view, ref, i % 512, k)
    phase_us = {}
    if phases:
        ph = np.array(phases[200:], np.float64)
        # (The round's "waiting since" stamp, when read, is still this round's: the next
        # round starts a few microseconds after the answer lands.)
        submit_t, seen_t, wait_t, seen_gpu_t, staged_t, pub_t = ph.T
        for label, v in (("round_trip", seen_t - submit_t), ("waiting_before_seen", seen_gpu_t - wait_t),
                         ("seen_to_staged", staged_t - seen_gpu_t), ("staged_to_published", pub_t - staged_t),
                         ("outside_the_gpu", (seen_t - submit_t) - (pub_t - seen_gpu_t))):
            phase_us[label] = round(float(np.median(v)) / 1e3, 1)
    phase_us["wrong_answers"] = wrong
    return np.array(lat[200:]) * 1e6, phase_us


def answer_matches(view: SlotView, ref: tuple, qi: int, k: int) -> bool:
    """The slot's answer is the reference's top-k (ids, or float32 ties: the same scores)."""
    ref_i, ref_s = ref
    if view.status[0] != 0 or view.n_results[0] != k:
        return False
    if np.array_equal(view.ids[0, :k], ref_i[qi, :k]):
        return True
    return float(np.abs(view.scores[0, :k] - ref_s[qi, :k]).max()) <= 1e-6


def make_server(eng: TorchEngine, layout: Layout, variant: str, base_tune: dict, answered: np.ndarray):
    """``graph:DEPTH[:KEY=VALUE+KEY=VALUE[:WARPS]]`` (engine tuning for the graph server's plan,
    e.g. single_final_warps=8, scan=32x128x4x1x128 for the scan's BLOCK_N x BLOCK_D x warps x
    stages [x registers per thread], scan8=... the same for fast mode's 8-bit scan, single_scan=f16,
    max_k=8 for the server's; the waiting kernel's warps), serving the namespace every row is in."""
    if not variant.startswith("graph"):
        raise SystemExit(f"variant {variant!r}: only graph:DEPTH[...] variants exist")
    _, depth, tune, warps = (variant.split(":", 3) + ["", "", ""])[:4]
    tune = dict(kv.split("=") for kv in tune.split("+") if kv)
    extra = {"max_k": int(tune.pop("max_k"))} if "max_k" in tune else {}
    if "scan" in tune:  # scan=BLOCK_NxBLOCK_DxWARPSxSTAGES[xMAXNREG]: the single query's score-writing scan
        bn, bd, w, st, *regs = (int(v) for v in tune.pop("scan").split("x"))
        tune[("scores", eng.precision == "fast", False)] = ScanConfig(bn, bd, 1, w, st, 0, *regs)
    if "scan8" in tune:  # the same for fast mode's 8-bit scan
        bn, bd, w, st, *regs = (int(v) for v in tune.pop("scan8").split("x"))
        tune[("scores", "i8", False)] = ScanConfig(bn, bd, 1, w, st, 0, *regs)
    eng.retune(base_tune)
    eng.retune({k: v if isinstance(k, tuple) or not v.isdigit() else int(v) for k, v in tune.items()})
    server = SlotGraphServer(eng, layout, answered, idle_s=0.5,
                             depth=int(depth or 3), **({"warps": int(warps)} if warps else {}), **extra)
    server.set_namespaces({b"default": 0})
    server.in_use[:] = 1  # (every slot of these probes has a client: the channel's mirror, by hand)
    return server


def kernel_timeline(new_server, view: SlotView, active: np.ndarray, queries: np.ndarray, k: int, rounds: int) -> dict:
    """Median duration of each kernel of a graph round and of the gaps between them (us), from
    CUPTI's kernel records of ``rounds`` back-to-back named requests. The profiler runs from
    before the graph's capture (a graph captured earlier may not be traced)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        server = new_server()
        server.warm()
        server.start(active)
        round_trips(server, view, queries, k, rounds, True)
        server.stop()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:  # by name: the exporter may have written a new file
            events = json.load(trace)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    by_round, current = [], None
    for e in kernels:
        name = e["name"].split("(")[0].removesuffix("_kernel")
        if name.startswith("await_request"):
            current = []
            by_round.append(current)
        if current is not None:
            current.append((name, float(e["ts"]), float(e["dur"])))
    full = [r for r in by_round[-rounds:] if len(r) > 1]
    if not full:
        return {"rounds": 0, "kernels_seen": len(kernels)}
    shape = [name for name, _, _ in full[-1]]
    full = [r for r in full if [name for name, _, _ in r] == shape]
    steps = {}
    for i, name in enumerate(shape):
        if i:
            steps[f"gap before {name}"] = [r[i][1] - (r[i - 1][1] + r[i - 1][2]) for r in full]
        steps[name] = [r[i][2] for r in full]
    steps["await end -> last end"] = [r[-1][1] + r[-1][2] - (r[0][1] + r[0][2]) for r in full]
    return {"rounds": len(full), **{label: round(float(np.median(v)), 2) for label, v in steps.items()}}


def kernel_medians(fn, reps: int) -> dict:
    """Median duration (us) of each kernel ``fn`` launches, over ``reps`` calls (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:  # by name: the exporter may have written a new file
            events = json.load(trace)["traceEvents"]
    durations: dict = {}
    for e in events:
        if e.get("cat") == "kernel":
            durations.setdefault(e["name"].split("(")[0][:40], []).append(float(e["dur"]))
    return {name: round(float(np.median(v)), 2) for name, v in durations.items()}


def slot_server_main() -> None:
    ap = argparse.ArgumentParser(prog="diagnostics.py slot-server", description=SLOT_SERVER)
    ap.add_argument("--n", type=int, default=65536, help="rows (random unit vectors) (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    ap.add_argument("--k", type=int, default=8, help="k of the timed round trips (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2000,
                    help="timed round trips per latency line, after 200 warm-up ones (default: %(default)s)")
    ap.add_argument("--checks", type=int, default=300,
                    help="correctness requests per variant (random slot, k 1 to 16) (default: %(default)s)")
    ap.add_argument("--variants", default="graph:3",
                    help="exact mode: graph:DEPTH[:KEY=VALUE+...[:WARPS]] (engine tuning), comma-separated")
    ap.add_argument("--fast-variants", default="graph:3",
                    help="fast mode: the same format as --variants (default: %(default)s)")
    ap.add_argument("--gap-us", type=float, default=0,
                    help="also time named requests this far apart (the next round already waiting)")
    ap.add_argument("--timeline", type=int, default=0, metavar="ROUNDS",
                    help="kernel start/end times of ROUNDS rounds (torch.profiler, CUPTI)")
    ap.add_argument("--ceiling", action="store_true",
                    help="kernel times of torch.mv over the scanned rows and of the engine's own search (CUPTI)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the table's rows to FILE as JSON")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    n, dim = args.n, args.dim
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    queries = rng.standard_normal((512, dim), dtype=np.float32)
    layout = Layout(8, dim, 64, 4)
    buf = mmap.mmap(-1, layout.size)
    views = [SlotView(memoryview(buf), layout, s) for s in range(layout.n_slots)]
    active = np.ones(layout.n_slots, bool)
    table = []
    for precision in ("exact", "fast"):
        eng = TorchEngine(dim, capacity=n, device="cuda", precision=precision)
        eng.add(np.arange(1, n + 1), x, np.zeros(n, np.int32), np.zeros(n))
        eng.attach_host(buf)
        unit = queries / np.linalg.norm(queries.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
        ref_i, ref_s = eng.search(unit.astype(np.float32), 16)
        base_tune = eng.tuning
        if args.ceiling:
            x_scan = eng.columns.x16 if precision == "fast" else eng.columns.x32
            q_scan = torch.from_numpy(unit[0]).to(x_scan.device, x_scan.dtype)
            print(f"   {precision}: torch.mv over the scanned rows: {kernel_medians(lambda: torch.mv(x_scan, q_scan), 50)}; "
                  f"engine search, one query: {kernel_medians(functools.partial(eng.search, unit[:1], 8), 50)}", flush=True)
        for variant in [v for v in (args.variants if precision == "exact" else args.fast_variants).split(",") if v]:
            # Sequence numbers go on from the last variant's: every request so far counts as answered.
            seqs = np.array([int(v.req_seq[0]) for v in views], np.int64)
            server = make_server(eng, layout, variant, base_tune, seqs.astype(np.uint64))
            t0 = time.perf_counter()
            server.warm()
            compile_s = time.perf_counter() - t0
            server.start(active)
            # correctness: random slots and k, one request at a time
            bad = 0
            outcomes = {"answered": 0, "handed": 0, "timeout": 0}
            for i in range(args.checks):
                s = int(rng.integers(layout.n_slots))
                k = int(rng.integers(1, 17))
                seqs[s] += 1
                qi = i % 512
                submit(views[s], queries[qi] * float(rng.uniform(0.5, 3)), k, int(seqs[s]))
                got = wait(views[s], int(seqs[s]), server, s)
                outcomes[got] += 1
                if got == "answered":
                    bad += not answer_matches(views[s], (ref_i, ref_s), qi, k)
                if not server.running():
                    server.start(active)
            # what it must hand over: k > max_k, batches, a filter, a zero query
            handed_ok = 0
            for j, (q, k, nq, flags) in enumerate([
                (queries[0], 17, 1, ALL), (queries[1], 8, 2, ALL), (queries[2], 8, 1, ALL | 2), (queries[3] * 0, 8, 1, ALL),
                (queries[4] * np.nan, 8, 1, ALL), (queries[5], 8, 1, 0),
            ]):
                s = j % layout.n_slots
                seqs[s] += 1
                submit(views[s], q, k, int(seqs[s]), n_queries=nq, flags=flags)
                handed_ok += wait(views[s], int(seqs[s]), server, s) == "handed"
            # latency: one slot, back to back; requests for all namespaces, then naming "default"
            # (as kalos.client.client sends by default: the kernel looks the name up)
            latency = {}
            runs = [("all", False, 0), ("named", True, 0)] + ([("named_gap", True, args.gap_us)] if args.gap_us else [])
            for label, named, gap in runs:
                lat, phase_us = round_trips(server, views[0], queries, args.k, args.repeats, named, gap,
                                            (ref_i, ref_s))
                latency[label] = dict(p50_us=round(float(np.percentile(lat, 50)), 1),
                                      p99_us=round(float(np.percentile(lat, 99)), 1), phases_us=phase_us)
                print(f"   {label}: {json.dumps(latency[label])}", flush=True)
            served = server.served
            server.stop()
            timeline = None
            if args.timeline:
                timeline = kernel_timeline(functools.partial(make_server, eng, layout, variant, base_tune,
                                                             np.array([v.req_seq[0] for v in views], np.uint64)), views[0], active,
                                           queries, args.k, args.timeline)
                print(f"   kernel timeline (median us per round): {json.dumps(timeline)}", flush=True)
            row = dict(precision=precision, variant=variant, compile_s=round(compile_s, 1),
                       checks=outcomes, bad=bad, handed_ok=f"{handed_ok}/6", served=served,
                       p50_us=latency["all"]["p50_us"], p99_us=latency["all"]["p99_us"],
                       named_p50_us=latency["named"]["p50_us"], named_p99_us=latency["named"]["p99_us"],
                       latency=latency, timeline=timeline)
            print(json.dumps(row), flush=True)
            table.append(row)
        eng.detach_host()
        del eng
        torch.cuda.empty_cache()
    print(f"\nslot server, in-process slot round trip, N={n:,} dim={dim} k={args.k} ({torch.cuda.get_device_name()})")
    print(f"{'precision':<6} {'variant':<14} {'bad':>4} {'handed':>6} {'answered':>8} {'p50 us':>8} {'p99 us':>8} {'named p50':>9} {'named p99':>9}")
    for r in table:
        print(f"{r['precision']:<6} {r['variant']:<14} {r['bad']:>4} {r['handed_ok']:>6} "
              f"{r['checks']['answered']:>8} {r['p50_us']:>8} {r['p99_us']:>8} {r['named_p50_us']:>9} {r['named_p99_us']:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


# -- gpu ----------------------------------------------------------------------------------------

OUT_ROWS: list[dict] = []


def emit(**kw) -> None:
    OUT_ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def build(n: int, dim: int, precision: str, max_batch: int = 256) -> TorchEngine:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(n, dim, device="cuda", generator=g)
    x /= torch.linalg.vector_norm(x, dim=1, keepdim=True)
    eng = TorchEngine(dim, capacity=n, device="cuda", precision=precision, max_batch=max_batch)
    xh = x.cpu().numpy()
    ids = np.arange(n, dtype=np.int64)
    eng.add(ids, xh, np.zeros(n, np.int32), np.zeros(n))
    return eng


def ceilings(n: int, dim: int, stream, flush) -> None:
    x = torch.randn(n, dim, device="cuda")
    q = torch.randn(dim, device="cuda")
    nbytes = x.numel() * 4
    for name, fn in (("read_sum", lambda: x.sum()), ("cublas_mv", lambda: torch.mv(x, q)),
                     ("copy", lambda: x.clone())):
        p50, p99 = time_events(fn, 100, stream, flush=flush)
        moved = nbytes * (2 if name == "copy" else 1)
        emit(part="ceiling", what=name, n=n, p50_us=p50, p99_us=p99, tb_s=moved / (p50 * 1e-6) / 1e12)


def check_batch(eng: TorchEngine, nq: int) -> dict:
    """The batch's top-8 against a float64 reference on the device: rows that differ beyond ties."""
    q = np.random.default_rng(nq).standard_normal((nq, eng.dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    ids, scores = eng.search(q, 8)
    n = eng.rows.size
    ref = torch.from_numpy(q).to("cuda", torch.float64) @ eng.columns.x32[:n].to(torch.float64).T
    top = torch.topk(ref, 8, dim=1).values[:, -1].cpu().numpy()
    got = ref.gather(1, torch.from_numpy(ids).cuda()).cpu().numpy()
    wrong = int(((got < top[:, None] - 1e-6)).any(axis=1).sum())
    return {"wrong_queries": wrong, "max_score_err": float(np.abs(got - scores).max()),
            "fallbacks": int(eng.stats["fallbacks"])}


def profile_graph(eng: TorchEngine, precision: str, stream, flush, nq: int = 1) -> None:
    dim = eng.dim
    q = np.random.default_rng(1).standard_normal((nq, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    eng.search(q, 8)  # compile + capture
    graph = eng.graph_of(nq, 8, precision)
    p50, p99 = time_events(graph.replay, 200, stream, flush=flush)
    emit(part="graph", precision=precision, q=nq, n=eng.rows.size, p50_us=p50, p99_us=p99,
         kind=eng.scan_kind(nq, 8, precision))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(ev.name[:70], [0, 0.0])
            r[0] += 1
            r[1] += ev.device_time
    for name, (count, total) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        emit(part="graph_kernel", precision=precision, q=nq, name=name, count=count / 30,
             avg_us=total / max(count, 1), per_search_us=total / 30)
    if nq > 1:
        return
    # host side of one search: wall vs device
    t = []
    for _ in range(300):
        a = time.perf_counter()
        eng.search(q, 8)
        t.append((time.perf_counter() - a) * 1e6)
    emit(part="host_search", precision=precision, p50_us=float(np.median(t)), p99_us=float(np.percentile(t, 99)))
    t = []
    for _ in range(300):
        a = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.replay()
        b = time.perf_counter()
        stream.synchronize()
        t.append(((b - a) * 1e6, (time.perf_counter() - b) * 1e6))
    t = np.array(t)
    emit(part="host_replay", precision=precision, launch_p50_us=float(np.median(t[:, 0])),
         sync_p50_us=float(np.median(t[:, 1])))


def sweep_scan(eng: TorchEngine, half: bool, stream, flush) -> None:
    tk, st, cols = eng.kernels, eng.staging, eng.columns
    n, dim = eng.rows.size, eng.dim
    x = cols.x16 if half else cols.x32
    cap = eng.rows.capacity
    scores = torch.empty(cap, dtype=torch.float32, device="cuda")
    q = torch.randn(1, dim, device="cuda")
    eng.fill_header(n, 1, 8, Filter())
    st.d_hdr[: len(st.h_hdr)].copy_(torch.from_numpy(st.h_hdr))
    st.d_q[:1].copy_(q)
    nbytes = n * dim * x.element_size()
    tiles = [(32, 128, 4), (16, 256, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 8), (16, 1024, 8),
             (32, 256, 8), (64, 128, 8), (64, 64, 4), (4, 1024, 4), (4, 512, 2), (8, 256, 2),
             (16, 128, 2), (32, 64, 2), (2, 1024, 2), (128, 64, 8)]
    for bn, bd, w in tiles:
        def fn(bn=bn, bd=bd, w=w):
            tk.scan_topk_kernel[(-(-cap // bn), 1)](
                x, st.d_q, st.d_hdr, st.d_hdrf, cols.live, cols.ns, cols.ts, scores, cap,
                D=dim, K=8, BLOCK_N=bn, BLOCK_D=bd, BLOCK_Q=1, HALF=half, FILTER=False, PREC="ieee",
                WRITE_SCORES=True, num_warps=w, num_stages=1,
            )
        try:
            p50, p99 = time_events(fn, 100, stream, flush=flush)
        except Exception as e:  # noqa: BLE001
            emit(part="scan_tile", half=half, tile=[bn, bd, w], error=repr(e)[:200])
            continue
        emit(part="scan_tile", half=half, tile=[bn, bd, w], p50_us=p50, p99_us=p99, tb_s=nbytes / (p50 * 1e-6) / 1e12)


def host_pointer_check(stream) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(SRC, DST, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n) * 2.0, mask=offs < n)

    n = 1024
    src = torch.randn(n).pin_memory()
    dst_dev = torch.empty(n, device="cuda")
    dst_host = torch.zeros(n).pin_memory()
    try:
        copy_kernel[(1,)](src, dst_dev, n, BLOCK=1024)
        torch.cuda.synchronize()
        ok_in = bool(torch.equal(dst_dev.cpu(), src * 2))
        copy_kernel[(1,)](dst_dev, dst_host, n, BLOCK=1024)
        torch.cuda.synchronize()
        ok_out = bool(torch.equal(dst_host, src * 4))
        p_in = time_events(lambda: copy_kernel[(1,)](src, dst_dev, n, BLOCK=1024), 200, stream)
        p_out = time_events(lambda: copy_kernel[(1,)](dst_dev, dst_host, n, BLOCK=1024), 200, stream)
        p_memcpy = time_events(lambda: dst_dev.copy_(src, non_blocking=True), 200, stream)
        emit(part="host_pointer", read_ok=ok_in, write_ok=ok_out, kernel_read_p50_us=p_in[0],
             kernel_write_p50_us=p_out[0], memcpy_h2d_p50_us=p_memcpy[0])
    except Exception as e:  # noqa: BLE001
        emit(part="host_pointer", error=repr(e)[:300])


def gpu_main() -> int:
    ap = argparse.ArgumentParser(prog="diagnostics.py gpu", description=GPU)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), metavar="DIR",
                    help="folder for diag.jsonl (the full run only) (default: $OUT, else the current folder)")
    ap.add_argument("--n", type=int, default=65536, help="rows (random unit vectors) (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    ap.add_argument("--batches", default="", help="only profile the graphs of these batch sizes (e.g. 64,256)")
    ap.add_argument("--precisions", default="exact,fast", help="with --batches: these precisions (default: both)")
    ap.add_argument("--thresholds", default="on,off", help="with --batches: threshold selection on, off, or both")
    ap.add_argument("--exact-scans", default="tf32",
                    help="with --batches: what exact batches scan, tf32 (tensor cores, then the certified float32 "
                    "re-score), ieee (float32 FMA), or both: tf32,ieee")
    ap.add_argument("--final-tiles", action="store_true",
                    help="only time the fast Q=1 graph for several final-kernel tiles (single_final_tile, single_final_warps)")
    args = ap.parse_args()
    stream = torch.cuda.Stream(priority=-100)
    flush = Flusher(torch.device("cuda"))  # zeroes 256 MiB: L2 holds none of the matrix
    if args.final_tiles:
        eng = build(args.n, args.dim, "fast")
        q = np.random.default_rng(1).standard_normal((1, args.dim)).astype(np.float32)
        q /= np.linalg.norm(q)
        for tile, warps in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16)):
            eng.retune({"single_final_tile": tile, "single_final_warps": warps})
            eng.search(q, 8)
            graph = eng.graph_of(1, 8)
            p50, p99 = time_events(graph.replay, 300, eng.stream, flush=flush)
            emit(part="final_tile", tile=tile, warps=warps, p50_us=p50, p99_us=p99)
        return 0
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
        for precision in args.precisions.split(","):
            eng = build(args.n, args.dim, precision, max_batch=max(batches))
            scans = args.exact_scans.split(",") if precision == "exact" else ["tf32"]
            for threshold, scan in [(t == "on", sc) for t in args.thresholds.split(",") for sc in scans]:
                eng.retune({"threshold_select": threshold, "exact_batch_scan": scan})
                for nq in batches:
                    emit(part="select", precision=precision, q=nq, threshold=threshold, exact_scan=scan,
                         **check_batch(eng, nq))
                    profile_graph(eng, precision, eng.stream, flush, nq)
            del eng
            torch.cuda.empty_cache()
        print("\n== summary ==")
        for r in OUT_ROWS:
            if r["part"] in ("select", "graph") or (r["part"] == "graph_kernel" and r["per_search_us"] > 2):
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k != "key"})
        return 0
    ceilings(args.n, args.dim, stream, flush)
    ceilings(1 << 20, args.dim, stream, flush)
    host_pointer_check(stream)
    for precision in ("exact", "fast"):
        eng = build(args.n, args.dim, precision)
        profile_graph(eng, precision, eng.stream, flush)
        sweep_scan(eng, precision == "fast", eng.stream, flush)
        del eng
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "diag.jsonl"), "w") as f:
        for r in OUT_ROWS:
            f.write(json.dumps(r) + "\n")
    print("\n== summary ==")
    for r in OUT_ROWS:
        if r["part"] in ("ceiling", "graph", "graph_kernel", "host_search", "host_replay", "host_pointer"):
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
    for r in sorted((r for r in OUT_ROWS if r["part"] == "scan_tile" and "p50_us" in r),
                    key=lambda r: (r["half"], r["p50_us"])):
        print(f"scan half={r['half']!s:5} tile={r['tile']} p50={r['p50_us']:.1f} p99={r['p99_us']:.1f} {r['tb_s']:.2f} TB/s")
    return 0


# -- profile ------------------------------------------------------------------------------------

def top_frames(path: Path, limit: int = 25) -> None:
    """Self time per innermost frame, and inclusive time per frame, from py-spy's raw output."""
    self_t: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_t[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    print(f"\n== {path.name}: {total} samples; self time ==")
    for frame, n in self_t.most_common(limit):
        print(f"{100 * n / total:6.1f}%  {frame}")
    print(f"== {path.name}: inclusive ==")
    for frame, n in incl.most_common(limit + 15):
        print(f"{100 * n / total:6.1f}%  {frame}")


def profile_main() -> int:
    ap = argparse.ArgumentParser(prog="diagnostics.py profile", description=PROFILE)
    ap.add_argument("--device", default="cuda", help="the sidecar's --device (default: %(default)s)")
    ap.add_argument("--n", type=int, default=65536,
                    help="rows in the store (random unit vectors) (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=8.0,
                    help="py-spy's recording time, in seconds; the timed loop runs 1 s less (default: %(default)s)")
    ap.add_argument("--rate", type=int, default=2000, help="py-spy's samples per second (default: %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), metavar="DIR",
                    help="folder for py-spy's {sidecar,client}.txt and .err (default: $OUT, else the current folder)")
    ap.add_argument("--extra", default="", help="extra arguments for kalos serve")
    ap.add_argument("--batch", type=int, default=1, help="queries per call (recall_many above 1)")
    args = ap.parse_args()
    out = Path(args.out)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "s.db"
        with Store.open(store, dim=args.dim) as s:
            for lo in range(0, args.n, 65536):
                x = rng.standard_normal((min(65536, args.n - lo), args.dim)).astype(np.float32)
                s.add(x / np.linalg.norm(x, axis=1, keepdims=True), namespace="default")
        queries = rng.standard_normal((256, args.dim)).astype(np.float32)
        with SidecarProcess(store, name="prof", device=args.device, extra_args=args.extra.split(),
                            ready_timeout=600) as sidecar, Client("prof") as client:
            print(sidecar.ready_line, flush=True)
            b = args.batch

            def call(i: int) -> None:
                if b == 1:
                    client.recall(queries[i % 256], k=8)
                else:
                    client.recall_many(queries[(i * b) % 256 : (i * b) % 256 + b], k=8)

            for i in range(300):
                call(i)
            spies = [
                subprocess.Popen(["py-spy", "record", "--nonblocking", "-r", str(args.rate), "-d", str(int(args.seconds)),
                                  "-f", "raw", "-o", str(out / f"{who}.txt"), "--pid", str(pid)],
                                 stdout=subprocess.DEVNULL, stderr=open(out / f"{who}.err", "w"))
                for who, pid in (("sidecar", sidecar.process.pid), ("client", os.getpid()))
            ]
            time.sleep(0.5)
            lat = []
            end = time.monotonic() + args.seconds - 1.0
            i = 0
            while time.monotonic() < end:
                a = time.perf_counter()
                call(i)
                lat.append((time.perf_counter() - a) * 1e6)
                i += 1
            for spy in spies:
                spy.wait(timeout=60)
            stats = client.stats()
    print(f"recall p50 {np.median(lat):.1f} us, p99 {np.percentile(lat, 99):.1f} us over {len(lat)} calls; "
          f"sidecar service p50 {stats['service_p50_us']} us")
    for who in ("sidecar", "client"):
        path = out / f"{who}.txt"
        if path.exists():
            top_frames(path)
    return 0


PARTS = {"slot-server": slot_server_main, "gpu": gpu_main, "profile": profile_main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in PARTS:
        usage = f"usage: diagnostics.py {{{','.join(PARTS)}}} [options]   (diagnostics.py PART --help: its options)"
        if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
            print(f"{usage}\n\n{__doc__.strip()}")
            raise SystemExit(0)
        raise SystemExit(usage)
    part = PARTS[sys.argv.pop(1)]
    raise SystemExit(part() or 0)
