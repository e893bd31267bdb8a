"""The slot server (kalos.engine.slot_server) on a GPU, in one process: correctness against
the engine's own search, hand-over of what it does not serve, and the round trip of one recall
through a slot, for variants of the CUDA-graph server (``graph:DEPTH[:TUNING[:WARPS]]``).

The "client" here is this process writing a request into a slot of an mmap'd segment and
spinning on resp_seq, as kalos.client does from another process (minus its Python call).

    PYTHONPATH=src python3 benchmarks/slot_server_diag.py --n 65536 --dim 1024 --repeats 2000
"""
from __future__ import annotations

import argparse
import functools
import json
import mmap
import tempfile
import time

import numpy as np
import torch

from kalos.engine.slot_server import SlotGraphServer
from kalos.engine.torch_engine import ScanConfig, TorchEngine
from kalos.protocol import Layout, Op, RequestFlag, SlotView

RECALL, ALL = int(Op.RECALL), int(RequestFlag.ALL_NAMESPACES)


def submit(view: SlotView, q: np.ndarray, k: int, seq: int, *, n_queries: int = 1, flags: int = ALL,
           namespace: bytes = b"") -> None:
    view.namespace[0] = namespace
    view.namespace_len[0] = len(namespace)
    view.op[0] = RECALL
    view.k[0] = k
    view.n_queries[0] = n_queries
    view.flags[0] = flags
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
    eng._tune = dict(base_tune)
    eng._tune.update({k: v if isinstance(k, tuple) or not v.isdigit() else int(v) for k, v in tune.items()})
    eng._plans.clear()
    server = SlotGraphServer(eng, layout, answered, idle_s=0.5,
                             depth=int(depth or 3), **({"warps": int(warps)} if warps else {}), **extra)
    server.set_namespaces({b"default": 0})
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--checks", type=int, default=300)
    ap.add_argument("--variants", default="graph:3",
                    help="exact mode: graph:DEPTH[:KEY=VALUE+...[:WARPS]] (engine tuning), comma-separated")
    ap.add_argument("--fast-variants", default="graph:3")
    ap.add_argument("--gap-us", type=float, default=0,
                    help="also time named requests this far apart (the next round already waiting)")
    ap.add_argument("--timeline", type=int, default=0, metavar="ROUNDS",
                    help="kernel start/end times of ROUNDS rounds (torch.profiler, CUPTI)")
    ap.add_argument("--ceiling", action="store_true",
                    help="kernel times of torch.mv over the scanned rows and of the engine's own search (CUPTI)")
    ap.add_argument("--json", default=None)
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
        base_tune = dict(eng._tune)
        if args.ceiling:
            x_scan = eng._x16 if precision == "fast" else eng._x32
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
            # (as kalos.client sends by default: the kernel looks the name up)
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


if __name__ == "__main__":
    main()
