"""Starting a sidecar as a child process and waiting until it serves (demo, bench, tests)."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from kalos.errors import SidecarUnavailable

__all__ = ["SidecarProcess"]

READY_MARKER = "kalos sidecar"


class SidecarProcess:
    """``kalos serve`` in a child process. ``stop()`` ends it with SIGTERM (``kill()``: SIGKILL)."""

    def __init__(
        self,
        store: str | os.PathLike[str],
        *,
        name: str,
        dim: int | None = None,
        device: str = "cpu",
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        args = [sys.executable, "-m", "kalos", "serve", "--store", str(store), "--name", name, "--device", device]
        if dim is not None:
            args += ["--dim", str(dim)]
        args += list(extra_args)
        child_env = dict(os.environ if env is None else env)
        src = str(Path(__file__).resolve().parents[2])  # the src folder holding this kalos
        child_env["PYTHONPATH"] = src + os.pathsep + child_env.get("PYTHONPATH", "")
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        self.args = args
        # The sidecar logs to stderr for as long as it runs: a file, not a pipe nobody drains.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self.stderr, env=child_env, text=True, start_new_session=True
        )
        self.ready_line = self._wait_ready(ready_timeout)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                if selector.select(timeout=0.1):
                    line = self.process.stdout.readline()
                    if line.startswith(READY_MARKER):
                        return line.strip()
                    if not line and self.process.poll() is not None:
                        break
                elif self.process.poll() is not None:
                    break
        finally:
            selector.close()
        self.kill()
        stderr = self.log()
        from kalos.store.spec import describe_store  # a postgresql:// store's password stays out of errors

        shown = " ".join(describe_store(a) for a in self.args)
        raise SidecarUnavailable(
            f"sidecar {shown} did not become ready (exit code {self.process.returncode}): {stderr.strip()[-2000:]}"
        )

    def log(self) -> str:
        """Everything the sidecar wrote to stderr so far."""
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.process.stdout is not None and not self.process.stdout.closed and self.process.poll() is not None:
            self.process.stdout.close()

    def __enter__(self) -> "SidecarProcess":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
