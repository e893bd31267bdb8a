"""Every tunable of Kalos, its default, and the environment variable that overrides it.

Read once (:func:`settings`), never inside a loop. The CLI's flags override these for the
process they start; the environment is for settings a user wants everywhere.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import math
import os
import stat
import textwrap
from pathlib import Path
from typing import Any

from kalos.errors import InvalidArgument

__all__ = ["Settings", "settings", "environment_help", "default_store_path", "runtime_dir", "open_runtime_dir",
           "RuntimeDir", "GPU_POLLING", "DEFAULT_GPU_WINDOW_US"]

#: How a GPU sidecar may answer single recalls without Python (SidecarConfig.gpu_polling).
GPU_POLLING = ("off", "graph")
#: How long the GPU's polling kernel, once a request is pending, waits for the rest of the
#: crowd (SidecarConfig.gpu_window_us).
DEFAULT_GPU_WINDOW_US = 20.0


def _setting(default: float, env: str, help: str) -> Any:
    """A Settings field: its default, the environment variable that overrides it, and the line
    ``kalos serve --help`` shows for it (:func:`environment_help`)."""
    return dataclasses.field(default=default, metadata={"env": env, "help": help})


@dataclasses.dataclass(frozen=True)
class Settings:
    # Spinning costs a core; blocking costs a wake-up (tens of microseconds). A search that takes
    # milliseconds (CPU, large N) should not be spun on: the spinning core is taken from BLAS.
    client_spin_us: float = _setting(100.0, "KALOS_CLIENT_SPIN_US",
                                     "how long a waiting client busy-polls its slot before it blocks, us "
                                     "(a GPU sidecar advises its clients 1000)")
    sidecar_spin_us: float = _setting(2000.0, "KALOS_SIDECAR_SPIN_US",
                                      "how long the sidecar keeps sweeping the slots after the last request "
                                      "before it sleeps, us (serve --spin-us)")
    # (kalos.server.cohort: only clients that came back quickly before are waited for). A crowd
    # recalling back to back then shares one pass instead of splitting into cohorts that take turns.
    sidecar_gather_us: float = _setting(200.0, "KALOS_SIDECAR_GATHER_US",
                                        "how long after a pass the next one may wait for that pass's clients "
                                        "to send their next request, us; 0 searches at once (serve --gather-us)")
    # (It fixes the size of each slot's result area.)
    max_k: int = _setting(256, "KALOS_MAX_K", "largest k a recall may ask for (serve --max-k)")
    max_batch: int = _setting(64, "KALOS_MAX_BATCH",
                              "most query rows one request carries; recall_many splits larger batches "
                              "(serve --max-batch)")
    # 128: a host running 64 agents at once, each with its client, has room to spare. A slot
    # holds max_batch query rows and results (~0.45 MiB at dim 1024), reserved at start.
    slots: int = _setting(128, "KALOS_SLOTS", "slots in the shared segment: most clients connected at once "
                                              "(serve --slots)")
    # A client declares the sidecar dead when the stamp is older than its timeout or four of
    # these intervals (the hello says it), whichever is longer: well under 1 s keeps the default
    # timeout the bound.
    heartbeat_interval_s: float = _setting(0.05, "KALOS_HEARTBEAT_S", "how often the sidecar stamps its heartbeat, s")
    # Bounded so that a malformed length prefix cannot make the sidecar allocate without limit.
    max_message_bytes: int = _setting(1 << 30, "KALOS_MAX_MESSAGE_BYTES",
                                      "largest control-socket message (an add of many vectors with texts), bytes")
    # A peer stuck or hostile must not hold a thread for ever.
    control_stall_s: float = _setting(10.0, "KALOS_CONTROL_STALL_S",
                                      "a control connection stuck in the middle of a frame is dropped after "
                                      "this long without a byte moving, s")
    # Connections that hold a slot may idle between requests for ever.
    control_idle_s: float = _setting(30.0, "KALOS_CONTROL_IDLE_S",
                                     "a control connection that holds no slot (no hello) and sends nothing is "
                                     "dropped after this long, s")
    # Bounded: each connection costs a thread.
    spare_connections: int = _setting(64, "KALOS_SPARE_CONNECTIONS",
                                      "control connections the sidecar takes beyond the slot holders")
    # (See kalos.server.item_cache.)
    item_cache_bytes: int = _setting(64 << 20, "KALOS_ITEM_CACHE_BYTES",
                                     "the JSON of recently read items the sidecar keeps for get and recall_text "
                                     "replies, bytes; 0 keeps none (a SQLite store's items only)")
    # So a lost or damaged -wal file can only cost the writes since the pause.
    checkpoint_idle_s: float = _setting(1.0, "KALOS_CHECKPOINT_IDLE_S",
                                        "the sidecar checkpoints the store's WAL into the database file once "
                                        "writes have paused this long, s")


def _env_number(name: str, default: float, kind: type) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None
    if not math.isfinite(value):  # ("inf" and "nan" parse as floats)
        raise InvalidArgument(f"environment variable {name}={raw!r} must be a finite number")
    if value < 0:
        raise InvalidArgument(f"environment variable {name}={raw!r} must not be negative")
    return value


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """The settings of this process: defaults, overridden by KALOS_* environment variables."""
    return Settings(**{field.name: _env_number(field.metadata["env"], field.default, type(field.default))
                       for field in dataclasses.fields(Settings)})


def environment_help() -> str:
    """Every setting's environment variable, its default and what it sets, a line each (the
    epilog of ``kalos serve --help``)."""
    entries = [f"{field.metadata['env']} (default {field.default}): {field.metadata['help']}"
               for field in dataclasses.fields(Settings)]
    entries += ["KALOS_HOME: the folder of the default store, memories.db (default: $XDG_DATA_HOME/kalos, "
                "else ~/.local/share/kalos)",
                "KALOS_RUNTIME_DIR: the folder of the sidecars' sockets (default: $XDG_RUNTIME_DIR/kalos, "
                "else /tmp/kalos-<uid>)",
                "KALOS_CACHE_DIR: the folder of the exported ONNX model (default: $XDG_CACHE_HOME/kalos, "
                "else ~/.cache/kalos)"]
    return "\n".join(["environment (read once at start; serve's flags win over them):"]
                     + [textwrap.fill(entry, 96, initial_indent="  ", subsequent_indent="      ") for entry in entries])


def default_store_path() -> Path:
    """``$KALOS_HOME/memories.db``; KALOS_HOME defaults to the user's data directory."""
    home = os.environ.get("KALOS_HOME")
    if home:
        return Path(home) / "memories.db"
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kalos" / "memories.db"


def _runtime_path() -> Path:
    explicit = os.environ.get("KALOS_RUNTIME_DIR")
    if explicit:
        return Path(os.path.abspath(explicit))
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.path.abspath(os.environ["XDG_RUNTIME_DIR"])) / "kalos"
    return Path("/tmp") / f"kalos-{os.getuid()}"


_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class RuntimeDir:
    """The runtime directory, opened once and checked on the open descriptor.

    Everything Kalos creates there is created relative to :attr:`fd` (``dir_fd=``), and Unix
    sockets are bound and connected through ``/proc/self/fd/<fd>/<name>``, so a path that is
    swapped after the check (another user flipping ``/tmp/kalos-<uid>`` between a directory
    of the victim and one of his own: issue 19, item 1) cannot redirect anything.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def entry(self, name: str) -> str:
        """A path naming ``name`` inside this very directory (for bind/connect, which take paths)."""
        if os.path.isdir(f"/proc/self/fd/{self.fd}"):
            return f"/proc/self/fd/{self.fd}/{name}"
        return str(self.path / name)  # no /proc: the checked path itself

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RuntimeDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse(message: str) -> InvalidArgument:
    return InvalidArgument(message + "; set KALOS_RUNTIME_DIR to a directory that only you can write")


def _check_ancestor(st: os.stat_result, shown: str, uid: int) -> None:
    # Whoever can rename entries in an ancestor can swap the directory below it after we
    # checked it: the ancestor must be root's or ours, and group/other-writable only when
    # sticky (like /tmp: there nobody may rename another user's entry).
    if st.st_uid not in (0, uid):
        raise _refuse(f"{shown}, on the way to the runtime directory, belongs to uid {st.st_uid}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(
            f"{shown}, on the way to the runtime directory, is writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}, not sticky)"
        )


def open_runtime_dir() -> RuntimeDir:
    """Resolves, creates (0700) and opens the runtime directory; the caller closes it.

    The directory itself must not be a symlink, must belong to this uid and have no group or
    other permission bits; each ancestor is checked as in :func:`_check_ancestor`. The checks
    are made on open descriptors (``fstat``), each component opened relative to its checked
    parent with ``O_NOFOLLOW``, so nothing can be swapped between the check and the use.
    """
    uid = os.getuid()
    path = _runtime_path()
    # Symlinks among the ancestors (a /tmp that is a link, say) are resolved once, here; the
    # walk below then refuses any link, so what was checked is what is used.
    parent = Path(os.path.realpath(path.parent))
    fd = os.open("/", os.O_PATH | _DIR_FLAGS)
    try:
        shown = Path("/")
        _check_ancestor(os.fstat(fd), str(shown), uid)
        for part in parent.parts[1:]:
            shown = shown / part
            fd = _step(fd, part, shown, uid, final=False)
        final = _step(fd, path.name, path, uid, final=True)
    finally:
        os.close(fd)
    st = os.fstat(final)
    if st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(final)
        raise _refuse(
            f"runtime directory {path} must be owned by uid {uid} with mode 0700 "
            f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
        )
    return RuntimeDir(path, final)


def _step(parent_fd: int, part: str, shown: Path, uid: int, *, final: bool) -> int:
    """Opens ``part`` relative to ``parent_fd`` (creating it 0700 if missing); closes
    ``parent_fd`` when it returns a new descriptor for an ancestor."""
    flags = (os.O_RDONLY if final else os.O_PATH) | _DIR_FLAGS
    for _ in range(2):
        try:
            fd = os.open(part, flags, dir_fd=parent_fd)
            break
        except FileNotFoundError:
            try:
                os.mkdir(part, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass  # created concurrently: open what is there, and check it
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            try:
                lst = os.stat(part, dir_fd=parent_fd, follow_symlinks=False)
            except OSError:
                raise _refuse(f"{shown} is not a directory") from None
            if stat.S_ISLNK(lst.st_mode):
                target = os.readlink(part, dir_fd=parent_fd)
                raise _refuse(
                    f"{shown} is a symlink (owned by uid {lst.st_uid}) to {target}: Kalos follows no "
                    "symlink to its runtime directory, since whoever can change the link chooses where "
                    "Kalos writes; remove it"
                ) from None
            raise _refuse(f"{shown} is not a directory") from None
    else:
        raise _refuse(f"{shown} could not be created or opened")
    if not final:
        try:
            _check_ancestor(os.fstat(fd), str(shown), uid)
        except BaseException:
            os.close(fd)
            raise
        os.close(parent_fd)
    return fd


def runtime_dir() -> Path:
    """Where sidecars put their control sockets and lock files (created 0700, owner only),
    checked as :func:`open_runtime_dir` does; for messages and tools. Code that creates or
    connects to anything there must use :func:`open_runtime_dir` and its descriptor."""
    with open_runtime_dir() as directory:
        return directory.path
