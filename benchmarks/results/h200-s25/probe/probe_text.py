"""Session 25: where a recall_text's time goes in a GPU sidecar. A sidecar with the probe's
timers (kalos_probe_timers) and 65,536 x 384 memories (the corpus passages embedded by it,
random filler); phases of 300 calls each from one client (recall_text, the embed op, the get
of 8 hits, the `embedder` op as the control floor, a bare recall), the client's p50 beside the
sidecar's own timers of that phase; then py-spy on the sidecar during recall_text (wall time
with --idle, and --gil), its connection thread's leaf frames summarised.

    PYTHONPATH=.snap/model:src python3 benchmarks/results/h200-s25/probe/probe_text.py --label polling [--serve-arg=...] [--py-spy PATH]
"""
import argparse, collections, json, os, subprocess, sys, tempfile, time
from pathlib import Path

import numpy as np

from kalos.client.client import Client
from kalos.tools.corpus import QUESTIONS, passages

HERE = Path(__file__).resolve().parent
parser = argparse.ArgumentParser()
parser.add_argument("--label", required=True)
parser.add_argument("--device", default="cuda")
parser.add_argument("--runtime", default="triton")
parser.add_argument("--serve-arg", action="append", default=[])
parser.add_argument("--py-spy", default=None)
parser.add_argument("--rounds", type=int, default=300)
parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
args = parser.parse_args()

tmp = Path(tempfile.mkdtemp(prefix="kprobe"))
os.environ["KALOS_RUNTIME_DIR"] = str(tmp / "run")
probe_dir = tmp / "probe"; probe_dir.mkdir()
env = dict(os.environ, KALOS_PROBE_DIR=str(probe_dir),
           PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}")
name = "probe"
cmd = [sys.executable, str(HERE / "probe_serve.py"), "serve", "--store", str(tmp / "p.db"), "--name", name,
       "--device", args.device, "--dim", "384", "--embed", "start", "--embed-runtime", args.runtime, *args.serve_arg]
log = open(Path(args.out) / f"sidecar-{args.label}.log", "w")
proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def command(text, wait_for=None):
    (probe_dir / "cmd.tmp").write_text(text)
    os.replace(probe_dir / "cmd.tmp", probe_dir / "cmd")
    if wait_for:
        path = probe_dir / f"{wait_for}.json"
        for _ in range(200):
            if path.exists():
                return json.loads(path.read_text())
            time.sleep(0.05)
        return {}
    while (probe_dir / "cmd").exists():
        time.sleep(0.02)


def timed(fn, rounds):
    out = []
    for i in range(rounds):
        q = QUESTIONS[i % len(QUESTIONS)]
        t = time.perf_counter(); fn(q); out.append(time.perf_counter() - t)
    return np.asarray(out) * 1e6


try:
    t0 = time.perf_counter()
    for _ in range(600):
        try:
            c = Client(name, timeout=120); break
        except Exception:
            if proc.poll() is not None:
                raise SystemExit(f"sidecar exited: {proc.returncode}")
            time.sleep(0.2)
    emb = c.embedder
    print(f"[{args.label}] sidecar ready and embedder loaded in {time.perf_counter() - t0:.1f} s; {c.stats().get('engine')}",
          flush=True)
    corpus = [p.text for p in passages()]
    n = 65_536
    m = np.empty((n, 384), np.float32)
    m[:len(corpus)] = emb.embed(corpus)
    noise = np.random.default_rng(20).standard_normal((n - len(corpus), 384), dtype=np.float32)
    m[len(corpus):] = noise / np.linalg.norm(noise, axis=1, keepdims=True)
    texts = corpus + [f"filler memory {i}" for i in range(n - len(corpus))]
    for s in range(0, n, 8192):
        c.add(m[s:s + 8192], texts=texts[s:s + 8192], namespace="pydoc")
    vec = {q: emb.embed([q])[0] for q in QUESTIONS}
    found = {q: c.recall(vec[q], k=8, namespace="pydoc").ids for q in QUESTIONS}
    phases = {
        "recall_text": lambda q: c.recall_text(q, k=8, namespace="pydoc"),
        "embed op": lambda q: emb.embed([q]),
        "get 8": lambda q: c.get(found[q]),
        "embedder op (control floor)": lambda q: c._control({"op": "embedder"}),
        "recall (shared memory)": lambda q: c.recall(vec[q], k=8, namespace="pydoc"),
    }
    for fn in phases.values():
        timed(fn, 30)
    rows = []
    for label, fn in phases.items():
        command("reset")
        client = timed(fn, args.rounds)
        side = command(f"dump p{len(rows)}", wait_for=f"p{len(rows)}")
        rows.append((label, np.percentile(client, 50), np.percentile(client, 90), side))
    print(f"\n[{args.label}] client p50 / p90 us, then the sidecar's timers in that phase (p50 / p90 / mean us, count)")
    for label, p50, p90, side in rows:
        print(f"  {label}: {p50:.1f} / {p90:.1f}")
        for k, v in sorted(side.items(), key=lambda kv: -kv[1]["mean"]):
            print(f"      {k}: {v['p50']:.1f} / {v['p90']:.1f} / {v['mean']:.1f} ({v['n']})")
    if args.py_spy:
        for mode in ("idle", "gil"):
            raw = Path(args.out) / f"pyspy-{args.label}-{mode}.txt"
            spy = subprocess.Popen([args.py_spy, "record", "-p", str(proc.pid), "-d", "4", "-r", "1000", "-f", "raw",
                                    "-o", str(raw), "--threads", f"--{mode}", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.5)
            t = time.perf_counter(); k = 0
            while spy.poll() is None and time.perf_counter() - t < 8:
                c.recall_text(QUESTIONS[k % len(QUESTIONS)], k=8, namespace="pydoc"); k += 1
            err = spy.communicate()[1].decode()[-300:]
            if not raw.exists():
                print(f"py-spy {mode}: no output ({err})"); continue
            threads, leaves = collections.Counter(), collections.Counter()
            for line in raw.read_text().splitlines():
                stack, cnt = line.rsplit(" ", 1)
                frames = stack.split(";")
                threads[frames[0]] += int(cnt)
                if "conn" in frames[0]:
                    leaves[";".join(f.split(" (")[0] for f in frames[-4:])] += int(cnt)
            print(f"\n[{args.label}] py-spy --{mode}, {k} recall_text in the window; samples per thread:")
            for th, cnt in threads.most_common(8):
                print(f"  {cnt:6d} {th}")
            total = sum(leaves.values()) or 1
            print("  the connection thread's leaves (4 frames), share of its samples:")
            for s, cnt in leaves.most_common(18):
                print(f"  {100 * cnt / total:5.1f}% {s}")
finally:
    try:
        c.close()
    except Exception:
        pass
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
