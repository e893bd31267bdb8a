"""Both README install commands must resolve from the public package index alone.

This machine's pip finds wheels in local folders (a CPU torch among them) that a stock machine
lacks, so a green CI here proved nothing about a user's `pip install`: `torch==2.13.0` from the
index is the CUDA build, which pins its own triton, and a conflicting pin of ours made the test
command unresolvable there (issue #20). Here pip runs with no configuration at all
(PIP_CONFIG_FILE=/dev/null, --isolated: no find-links, no extra index, no constraints) in
--dry-run mode: it resolves and reads metadata but installs nothing.

A resolution failure fails CI. Not reaching the index is not a failure of this project: it is
reported as a warning and the check is skipped, so a network hiccup cannot turn CI red
(the index is retried first). Run with the venv's Python: .venv/bin/python .ci/resolve_public.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

COMMANDS = [".[embed]", ".[test,gpu]"]  # README's "Two commands", as pip receives them
INDEX = "https://pypi.org/simple/"
# pip's words when it could not fetch something (as opposed to "ResolutionImpossible" or "No
# matching distribution" after it did fetch the index pages).
NETWORK_SIGNS = ("NewConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "Max retries exceeded",
                 "Temporary failure in name resolution", "Name or service not known", "ProxyError",
                 "SSLError", "Connection reset", "Network is unreachable", "HTTP error 5")


def index_reachable(attempts: int = 3) -> str | None:
    """None when the index answers, else why it did not (after ``attempts`` tries)."""
    reason = ""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(INDEX + "pip/", timeout=30) as reply:
                if reply.status == 200:
                    return None
                reason = f"HTTP {reply.status}"
        except (urllib.error.URLError, OSError) as exc:
            reason = str(exc)
        time.sleep(2 * (attempt + 1))
    return reason


def resolve(spec: str) -> tuple[int, str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        out = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
             "--disable-pip-version-check", "--retries", "5", "--timeout", "60", "--report", report, spec],
            capture_output=True, text=True, env=env, timeout=1800,
        )
        data: dict = {}
        if out.returncode == 0 and os.path.exists(report):
            with open(report) as f:
                data = json.load(f)
    return out.returncode, out.stdout + out.stderr, data


def main() -> int:
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the specs are paths
    why = index_reachable()
    if why is not None:
        print(f"warning: {INDEX} is unreachable ({why}); skipping the public-index resolution check", file=sys.stderr)
        return 0
    from concurrent.futures import ThreadPoolExecutor

    def resolve_retrying(spec: str) -> tuple[int, str, dict]:
        for _ in range(2):
            code, text, data = resolve(spec)
            if code == 0 or not any(sign in text for sign in NETWORK_SIGNS):
                break
            time.sleep(10)
        return code, text, data

    with ThreadPoolExecutor(len(COMMANDS)) as pool:  # side by side: each is mostly waiting on the index
        results = list(pool.map(resolve_retrying, COMMANDS))
    failed = False
    for spec, (code, text, data) in zip(COMMANDS, results):
        if code == 0:
            picked = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data.get("install", [])}
            shown = ", ".join(f"{n} {picked[n]}" for n in ("torch", "triton") if n in picked)
            print(f"public index: pip install '{spec}' resolves: {len(picked)} packages ({shown})")
        elif any(sign in text for sign in NETWORK_SIGNS):
            print(f"warning: the index failed mid-way for '{spec}'; not counted as a failure:\n{text[-2000:]}",
                  file=sys.stderr)
        else:
            failed = True
            print(f"error: pip install '{spec}' does not resolve from the public index alone:\n{text[-4000:]}",
                  file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
