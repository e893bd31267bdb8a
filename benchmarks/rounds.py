"""The GPU polling server's rounds in process: what one round of b requests costs, per tuning.

The slot server (:mod:`kalos.engine.gpu.slot_server`) answers a crowd's single recalls in
rounds: its waiting kernel gathers the requests pending in the slots, the engine's kernels
score and select, the final kernel publishes each answer in its slot. This script plays b
clients from one process (b slots' requests published at once, then spinning on their
``resp_seq``) so that a round's cost is seen without processes, scheduling or Python clients.
For each variant (precision, tuning overrides) and round size b it prints the host's time from
publishing the b requests to the last answer (p50, p99) and the GPU's own stamps of the pass
(staged -> the last answer's publish stamp, p50); every answer of a sample of rounds is checked
against a float64 top-k, and requests the kernels hand to the host (fast mode's failed
certificates; nothing answers them here) are counted. A table last. Variants run one after
another, ``--repeat`` times (alternated, for noise).

    PYTHONPATH=src python3 benchmarks/rounds.py --sizes 1,2,8,16,32,64 \\
        --variant 'one program:exact:{"final_split_rows": 0}' --variant 'split:exact:{}'

A variant is ``name:precision:json``, the JSON being :meth:`Tuning.replace` overrides (field
names only); without any, the default tuning in both precisions. ``--k-buckets 8,16`` runs each
variant with its rounds held at each k bucket (the selection's and final kernel's columns; by
default the server's own choice, the smaller bucket for k <= 8):

    PYTHONPATH=src python3 benchmarks/rounds.py --sizes 1,2,8,16,32,64 --k-buckets 8,16

``--windows``: each request carries a time window of its own (the rounds mask each query by its own;
every row is inside, so the answers are the same). ``--profile 16,64`` then runs a few more rounds
of those sizes under the PyTorch profiler and prints each kernel's device time per round (where a
round's time goes).
"""
from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from typing import Any

import numpy as np
import torch

from kalos.engine.gpu import TorchEngine
from kalos.engine.gpu.slot_server import DEFAULT_BATCH, DEFAULT_MAX_K, SlotGraphServer
from kalos.ipc.protocol import Layout, Op, RequestFlag, SlotView, rest_seq

#: (host p50, host p99, GPU pass p50, wrong answers, handed requests), us, per round size.
Figures = dict[int, tuple[float, float, float, int, int]]


def parse_variant(text: str) -> tuple[str, str, dict]:
    name, precision, overrides = text.split(":", 2)
    if precision not in ("exact", "fast"):
        raise SystemExit(f"variant {name!r}: precision must be exact or fast, got {precision!r}")
    return name, precision, json.loads(overrides or "{}")


def run_variant(args: argparse.Namespace, name: str, precision: str, tune: dict[str, Any], kout: int | None,
                rows: np.ndarray, ref_rows: torch.Tensor) -> Figures:
    rng = np.random.default_rng(0)
    engine = TorchEngine(args.dim, device="cuda", backend="triton", precision=precision, tune=tune)
    engine.add(np.arange(args.n, dtype=np.int64), rows, np.zeros(args.n, np.int32), np.zeros(args.n))
    layout = Layout(args.slots, args.dim, DEFAULT_MAX_K, 1)
    buf = mmap.mmap(-1, layout.size)
    engine.attach_host(buf)
    views = [SlotView(memoryview(buf), layout, s) for s in range(args.slots)]
    seqs = np.full(args.slots, rest_seq(1), np.uint64)
    for view in views:
        view.req_seq[0] = view.resp_seq[0] = rest_seq(1)
    # (A k bucket held: no switch back to the smaller one during the run.)
    held = dict(k_resize_s=3600.0) if kout else {}
    server = SlotGraphServer(engine, layout, seqs.copy(), idle_s=5.0, window_s=args.window_us * 1e-6, **held)
    if kout and kout not in server.kouts:
        raise SystemExit(f"--k-buckets: {kout} is not one of the server's k buckets {server.kouts}")
    server.in_use[:] = 1
    t0 = time.perf_counter()
    server.warm()
    print(f"{name} ({precision}): warm {time.perf_counter() - t0:.1f} s", flush=True)
    words = server.words
    req = np.ndarray((args.slots,), np.uint64, buf, layout.slot_offset(0) + 8 * words.req_seq, (layout.slot_size,))
    resp = np.ndarray((args.slots,), np.uint64, buf, layout.slot_offset(0) + 8 * words.resp_seq, (layout.slot_size,))
    handed = server.handed
    out: Figures = {}
    for b in args.sizes:
        server.in_use[:] = 0
        server.in_use[:b] = 1
        queries = rng.standard_normal((b, args.dim)).astype(np.float32)
        flags = RequestFlag.ALL_NAMESPACES | (RequestFlag.HAS_SINCE | RequestFlag.HAS_UNTIL if args.windows else 0)
        for s, view in enumerate(views[:b]):
            view.op[0], view.k[0], view.n_queries[0], view.flags[0] = Op.RECALL, args.k, 1, flags
            view.since[0], view.until[0] = -1.0 - s, 1.0 + s  # (read with --windows: every row inside)
            view.namespace_len[0] = 0
            view.queries[:1] = queries[s]
        unit = torch.from_numpy(queries).cuda().double()
        unit /= unit.norm(dim=1, keepdim=True)
        want = torch.topk(unit @ ref_rows.T, args.k, dim=1)
        want_ids, kth = want.indices.cpu().numpy(), want.values[:, -1].cpu().numpy()
        scores64 = (unit @ ref_rows.T).cpu().numpy()
        server.start(server.in_use, kout=kout)
        host, passes, wrong, n_handed = [], [], 0, 0
        for it in range(args.rounds):
            host.append(one_round(seqs, req, resp, handed, b, f"{name}: round {it}"))
            _wait, _seen, staged, published = server.stamps()
            passes.append(published - staged)
            n_handed += int((handed[:b] == seqs[:b]).sum())
            if it % 25 == 0:  # a sample of rounds: every answer against the float64 top-k
                for s, view in enumerate(views[:b]):
                    if resp[s] != seqs[s]:
                        continue
                    got = view.ids[0, : args.k]
                    distinct = len(set(got.tolist())) == args.k and (got >= 0).all()
                    ok = int(view.status[0]) == 0 and distinct and (
                        set(got.tolist()) == set(want_ids[s].tolist()) or scores64[s, got].min() >= kth[s] - 1e-6)
                    wrong += not ok
            server.running()
        server.stop()
        if b in args.profile:
            profile_round(server, kout, args.profile_rounds, seqs, req, resp, handed, b)
        h = np.array(host[args.rounds // 6:]) * 1e6
        out[b] = (float(np.percentile(h, 50)), float(np.percentile(h, 99)),
                  float(np.median(passes[args.rounds // 6:])) / 1e3, wrong, n_handed)
        print(f"  b={b:2d} host p50 {out[b][0]:7.1f} us p99 {out[b][1]:7.1f}  pass {out[b][2]:7.1f} us"
              f"  wrong {wrong}  handed {n_handed}", flush=True)
    engine.detach_host()
    del server, engine
    torch.cuda.empty_cache()
    return out


def one_round(seqs: np.ndarray, req: np.ndarray, resp: np.ndarray, handed: np.ndarray, b: int, what: str) -> float:
    """Publishes the next request of slots 0..b-1 and waits until every one is answered, or
    handed to the host (which nobody runs here); returns the host's seconds for it."""
    seqs[:b] += np.uint64(1)
    t = time.perf_counter()
    deadline = t + 5.0
    req[:b] = seqs[:b]
    while not ((resp[:b] == seqs[:b]) | (handed[:b] == seqs[:b])).all():
        if time.perf_counter() > deadline:
            raise SystemExit(f"{what} of {b} not answered in 5 s")
    return time.perf_counter() - t


def profile_round(server: SlotGraphServer, kout: int | None, rounds: int, seqs: np.ndarray, req: np.ndarray,
                  resp: np.ndarray, handed: np.ndarray, b: int) -> None:
    """Each kernel's device time per round over ``rounds`` more rounds of ``b`` (CUPTI records of
    the graphs' kernels; the waiting kernel's includes its wait for the round's requests). The
    profiler starts before the server: enabling it waits for the kernels running."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        server.start(server.in_use, kout=kout)
        for it in range(rounds):
            one_round(seqs, req, resp, handed, b, f"profiled round {it}")
            server.running()
        server.stop()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel.setdefault(event.name[:60], []).append(event.device_time)
    print(f"    kernels of a round of {b} (its timed row follows):", flush=True)
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {name:60s} {len(times) / rounds:5.2f} a round, median {np.median(times):7.2f} us", flush=True)


def main() -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536, help="rows (uniform random, unit)")
    ap.add_argument("--dim", type=int, default=1024, help="their dimension")
    ap.add_argument("-k", type=int, default=8, help=f"k of every request (1 to {DEFAULT_MAX_K}, the server's)")
    ap.add_argument("--slots", type=int, default=64, help="the segment's slots (the waiting kernels poll them all)")
    ap.add_argument("--sizes", default="1,2,8,16,32,64",
                    help=f"round sizes b (1 to --slots, and at most {DEFAULT_BATCH}: the largest round)")
    ap.add_argument("--rounds", type=int, default=300, help="rounds per size (the first sixth not counted)")
    ap.add_argument("--window-us", type=float, default=20.0, help="the batch rounds' gathering window")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the variants, alternated")
    ap.add_argument("--windows", action="store_true",
                    help="each request with a created_at window of its own (every row inside: the same answers)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:PRECISION:JSON",
                    help="a variant to run, repeatable: PRECISION exact or fast, JSON Tuning.replace overrides "
                    "(default: the default tuning, exact and fast)")
    ap.add_argument("--profile", default="", metavar="B1,B2",
                    help="after the timed rounds of these sizes, each kernel's device time per round (torch.profiler)")
    ap.add_argument("--profile-rounds", type=int, default=40, help="rounds under the profiler, per size in --profile")
    ap.add_argument("--k-buckets", default="", metavar="K1,K2",
                    help="hold the rounds at each of these k buckets in turn (default: the server's choice)")
    args = ap.parse_args()
    args.sizes = [int(b) for b in args.sizes.split(",")]
    args.profile = {int(b) for b in args.profile.split(",") if b.strip()}
    kouts: list[int | None] = [int(k) for k in args.k_buckets.split(",") if k.strip()] or [None]
    if any(kout is not None and kout < args.k for kout in kouts):
        raise SystemExit(f"--k-buckets: a bucket below -k {args.k} would hand every request to the host")
    if not 1 <= args.k <= DEFAULT_MAX_K:
        raise SystemExit(f"-k must be 1 to {DEFAULT_MAX_K}: the server hands larger k to a host that is not running")
    if not all(1 <= b <= min(args.slots, DEFAULT_BATCH) for b in args.sizes):
        raise SystemExit(f"round sizes must be 1 to {min(args.slots, DEFAULT_BATCH)} (--slots, the largest round)")
    if args.rounds < 6:
        raise SystemExit("--rounds must be at least 6")
    variants = [parse_variant(v) for v in args.variant] or [("default", "exact", {}), ("default", "fast", {})]
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    ref_rows = torch.from_numpy(rows).cuda().double()
    table: dict[tuple[int, str, str], Figures] = {}
    for rep in range(args.repeat):
        for name, precision, tune in variants:
            for kout in kouts:
                label = name if kout is None else f"{name} k<={kout}"
                table[rep, label, precision] = run_variant(args, label, precision, tune, kout, rows, ref_rows)
    print(f"\nround host p50 / p99 / GPU pass p50 us by round size b ({args.n:,} x {args.dim}, k = {args.k}, "
          f"{args.slots} slots); wrong answers in the sampled rounds")
    print(f"{'variant':28s}" + "".join(f"{'b=' + str(b):>18s}" for b in args.sizes) + "  wrong handed")
    for (rep, name, precision), out in table.items():
        label = f"{name} ({precision})" + (f" #{rep + 1}" if args.repeat > 1 else "")
        cells = "".join(f"{out[b][0]:6.0f}/{out[b][1]:4.0f}/{out[b][2]:<6.0f}" for b in args.sizes)
        print(f"{label:28s}{cells}  {sum(o[3] for o in out.values())} {sum(o[4] for o in out.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
