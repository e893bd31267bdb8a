"""Keeping a CPU sidecar's BLAS worker threads from spinning after each recall.

NumPy's OpenBLAS runs a mat-vec of more than ~9,000 elements on every core; when the work is
done its worker threads busy-wait (``sched_yield`` in a loop) for 2^28 CPU cycles, about
0.1 s, before they sleep. A sidecar that answers one recall therefore burns ~100 ms of a core
afterwards, which on a small machine is the core the client needs next, to embed its next
query, say (issue #20; BENCHMARKS.md has the figures).

OpenBLAS reads how long to spin (``OPENBLAS_THREAD_TIMEOUT``: 2^N cycles, N from 4 to 30) only
when the library loads, and ``kalos serve`` has NumPy loaded before it parses its arguments.
So :func:`settle_blas_threads` replaces the process by itself (``execve``, same pid) with the
spin cut short, once. The worker threads are kept: limiting BLAS to one thread instead
(``OPENBLAS_NUM_THREADS=1``) also stops the spinning, but makes large scans slower on an idle
machine (``benchmarks/blas_spin.py`` measures the three side by side; BENCHMARKS.md).
OpenMP runtimes spin too, for NumPy builds on MKL or an OpenMP OpenBLAS: they get the
equivalent settings. A variable the user set is left as it is.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

__all__ = ["QUIET_BLAS", "quiet_blas_environment", "settle_blas_threads"]

#: What a sidecar's BLAS runs with, unless the environment says otherwise: worker threads sleep
#: as soon as they run out of work (2^4 cycles: OpenBLAS's minimum) instead of spinning ~0.1 s.
QUIET_BLAS: dict[str, str] = {
    "OPENBLAS_THREAD_TIMEOUT": "4",
    "OMP_WAIT_POLICY": "PASSIVE",  # GNU and LLVM OpenMP (an OpenMP-threaded OpenBLAS)
    "KMP_BLOCKTIME": "0",  # Intel OpenMP (MKL)
}
#: Set in the re-executed process, so that it never executes itself again.
_SETTLED = "KALOS_BLAS_SETTLED"


def quiet_blas_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with every :data:`QUIET_BLAS` variable it lacks added."""
    return {**QUIET_BLAS, **env}


def settle_blas_threads(argv: list[str] | None = None) -> None:
    """Re-executes this process with :data:`QUIET_BLAS` in its environment, unless it is there.

    Returns without doing anything when every variable is set already, when this process was
    re-executed once, or when the command line that started it is unknown. ``argv``: the
    interpreter's full command line (default: ``sys.orig_argv``).
    """
    env = os.environ
    if env.get(_SETTLED) or all(name in env for name in QUIET_BLAS):
        return
    argv = list(sys.orig_argv if argv is None else argv)
    if not argv or not sys.executable:
        return
    new_env = quiet_blas_environment(env)
    new_env[_SETTLED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], new_env)
