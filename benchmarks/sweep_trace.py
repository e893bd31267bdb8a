"""Where a crowd's time goes: the sweep's timeline under C client processes of single recalls.

For each crowd size, one sidecar is started with ``benchmarks/trace`` on its path (the trace
hooks, ``sitecustomize.py``), the crowd of ``kalos.tools.crowd`` runs against it, and the
sidecar's trace is summarised: passes per second, queries per pass, the device time of a pass
(CUDA events around its work on the engine's stream) and the GPU's busy share, the host's time
from reading a pass's requests to queueing it, from its landing to its publishing, and the
clients' turnaround (from an answer's publishing to the same slot's next request, as the
sweep first saw it). CUDA only (the trace times the GPU engine's queued passes).

    PYTHONPATH=src python3 benchmarks/sweep_trace.py --crowd 1,16,64 --seconds 3
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def summarise(trace: Path, seconds: float) -> dict:
    data = np.load(trace)
    passes, turn = data["passes"], data["turnaround"] * 1e6
    turns = {"turnaround_p50_us": float(np.median(turn)) if len(turn) else float("nan"),
             "turnaround_p90_us": float(np.percentile(turn, 90)) if len(turn) else float("nan")}
    if not len(passes):
        return {"passes": 0, **turns}
    read, queued, q, device, landed, published, launch_cpu, land_cpu = passes.T
    # The crowd's window: the last `seconds` of the trace (warm-up passes come before).
    end = published.max()
    keep = published >= end - seconds
    read, queued, q, device, landed, published, launch_cpu, land_cpu = (
        a[keep] for a in (read, queued, q, device, landed, published, launch_cpu, land_cpu))
    span = published.max() - queued.min()
    order = np.argsort(queued)
    gaps = np.diff(queued[order]) * 1e6
    return {
        "passes": int(len(q)),
        "q_per_pass": float(q.mean()),
        "passes_per_s": len(q) / span,
        "device_us_p50": float(np.median(device) * 1e6),
        "gpu_busy": float(device.sum() / span),
        "read_to_queued_us": float(np.median(queued - read) * 1e6),
        "read_to_queued_cpu_us": float(np.median(launch_cpu) * 1e6),
        "queued_to_landed_us": float(np.median(landed - queued) * 1e6),
        "landing_cpu_us": float(np.median(land_cpu) * 1e6),
        "land_to_published_us": float(np.median(published - landed) * 1e6),
        "between_launches_us": float(np.median(gaps)) if len(gaps) else float("nan"),
        **turns,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crowd", default="1,16,64", metavar="C1,C2,...",
                        help="crowd sizes (client processes), comma-separated; one sidecar each (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="how long each crowd recalls, in seconds; the summary covers the trace's last as "
                        "many seconds (default: %(default)s)")
    parser.add_argument("--n", type=int, default=65536,
                        help="rows in the store (random unit vectors) (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=1024, help="their dimension (default: %(default)s)")
    parser.add_argument("-k", type=int, default=8, help="k of every recall (default: %(default)s)")
    parser.add_argument("--serve-arg", dest="serve_args", action="append", default=[], metavar="ARG",
                        help="one more kalos serve argument (one word), repeatable, given with an = sign: "
                        "--serve-arg=--precision --serve-arg=fast")
    parser.add_argument("--label", default="", help="a label for the table's title (default: none)")
    parser.add_argument("--device", default="cuda", help="cuda (cpu: only to try the harness; no passes are traced)")
    args = parser.parse_args()

    from kalos.server.launcher import SidecarProcess
    from kalos.store.sqlite import Store
    from kalos.tools import crowd

    sizes = crowd.parse_crowd(args.crowd)
    rng = np.random.default_rng(20261201)
    matrix = crowd._unit(rng, args.n, args.dim)
    queries = crowd._unit(rng, 256, args.dim)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kalos-trace-") as tmp:
        store_path = Path(tmp) / "crowd.db"
        data = str(Path(tmp) / "queries.npz")
        with Store.open(store_path, dim=args.dim) as store:
            crowd._store_rows(store, matrix, queries, args.k, "default", data)
        for c in sizes:
            trace = Path(tmp) / f"trace-{c}.npz"
            env = dict(os.environ, KALOS_TRACE_OUT=str(trace))
            env["PYTHONPATH"] = str(HERE / "trace") + os.pathsep + env.get("PYTHONPATH", "")
            name = f"trace-{os.getpid()}-{c}"
            # The sweep is what this traces: GPU polling (the default) would answer the crowd instead.
            extra = ["--slots", str(max(sizes) + 8), "--gpu-polling", "off", *args.serve_args]
            with SidecarProcess(store_path, name=name, device=args.device, extra_args=extra, env=env,
                                ready_timeout=900) as sidecar:
                row = crowd._one_crowd(name, data, args.k, c, args.seconds)
                sidecar.stop()
            row.update(summarise(trace, args.seconds))
            rows.append(row)
            print(f"C={c}: {row['recalls_per_s']:,.0f}/s p50 {row['p50_us']:.1f} us, wrong {row['wrong']}, "
                  f"errors {row['errors']}", flush=True)
    cols = [("C", "clients", 4, "d"), ("p50", "p50_us", 7, ".1f"), ("p99", "p99_us", 7, ".1f"),
            ("rec/s", "recalls_per_s", 8, ",.0f"), ("q/pass", "q_per_pass", 6, ".1f"),
            ("pass/s", "passes_per_s", 7, ",.0f"), ("dev us", "device_us_p50", 6, ".1f"),
            ("gpu", "gpu_busy", 5, ".0%"), ("rd>q", "read_to_queued_us", 6, ".1f"), ("cpu", "read_to_queued_cpu_us", 5, ".1f"),
            ("q>land", "queued_to_landed_us", 6, ".1f"), ("land>pub", "land_to_published_us", 8, ".1f"),
            ("cpu", "landing_cpu_us", 5, ".1f"),
            ("launch gap", "between_launches_us", 10, ".1f"), ("turn p50", "turnaround_p50_us", 8, ".1f"),
            ("turn p90", "turnaround_p90_us", 8, ".1f")]
    print(f"\nsweep trace {args.label} (N={args.n:,} x {args.dim}, k={args.k}; "
          f"serve {' '.join(args.serve_args) or 'defaults'})")
    print(" ".join(f"{h:>{w}}" for h, _key, w, _f in cols))
    for r in rows:
        print(" ".join(format(r.get(key, float("nan")), f">{w}{f}") for _h, key, w, f in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
