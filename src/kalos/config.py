"""Every tunable of Kalos, its default, and the environment variable that overrides it.

Read once (:func:`settings`), never inside a loop. The CLI's flags override these for the
process they start; the environment is for settings a user wants everywhere.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

from kalos.errors import InvalidArgument

__all__ = ["Settings", "settings", "default_store_path", "runtime_dir", "GPU_POLLING"]

#: How a GPU sidecar may answer single recalls without Python (SidecarConfig.gpu_polling).
GPU_POLLING = ("off", "graph", "resident")


@dataclasses.dataclass(frozen=True)
class Settings:
    # How long a waiting client busy-polls its slot before it blocks on its doorbell. Spinning
    # costs a core; blocking costs a wake-up (tens of microseconds). A search that takes
    # milliseconds (CPU, large N) should not be spun on: the spinning core is taken from BLAS.
    client_spin_us: float = 100.0
    # How long the sidecar keeps sweeping the slots after the last request before it sleeps.
    sidecar_spin_us: float = 2000.0
    # Largest k a recall may ask for; fixes the size of each slot's result area.
    max_k: int = 256
    # Most query rows one slot carries per request; recall_many splits larger batches.
    max_batch: int = 64
    # Slots in the segment = most clients connected at once.
    slots: int = 32
    # How often the sidecar stamps its heartbeat. A client declares the sidecar dead when the
    # stamp is older than the client's timeout, so keep this well under the default 1 s.
    heartbeat_interval_s: float = 0.05
    # Largest control-socket message (an add of many vectors with texts). Bounded so that a
    # malformed length prefix cannot make the sidecar allocate without limit.
    max_message_bytes: int = 1 << 30


def _env_number(name: str, default: float, kind: type) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None
    if value < 0:
        raise InvalidArgument(f"environment variable {name}={raw!r} must not be negative")
    return value


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """The settings of this process: defaults, overridden by KALOS_* environment variables."""
    d = Settings()
    return Settings(
        client_spin_us=_env_number("KALOS_CLIENT_SPIN_US", d.client_spin_us, float),
        sidecar_spin_us=_env_number("KALOS_SIDECAR_SPIN_US", d.sidecar_spin_us, float),
        max_k=int(_env_number("KALOS_MAX_K", d.max_k, int)),
        max_batch=int(_env_number("KALOS_MAX_BATCH", d.max_batch, int)),
        slots=int(_env_number("KALOS_SLOTS", d.slots, int)),
        heartbeat_interval_s=_env_number("KALOS_HEARTBEAT_S", d.heartbeat_interval_s, float),
        max_message_bytes=int(_env_number("KALOS_MAX_MESSAGE_BYTES", d.max_message_bytes, int)),
    )


def default_store_path() -> Path:
    """``$KALOS_HOME/memories.db``; KALOS_HOME defaults to the user's data directory."""
    home = os.environ.get("KALOS_HOME")
    if home:
        return Path(home) / "memories.db"
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kalos" / "memories.db"


def runtime_dir() -> Path:
    """Where sidecars put their control sockets and lock files (created 0700, owner only)."""
    explicit = os.environ.get("KALOS_RUNTIME_DIR")
    if explicit:
        path = Path(explicit)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "kalos"
    else:
        path = Path("/tmp") / f"kalos-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise InvalidArgument(
            f"runtime directory {path} must be owned by uid {os.getuid()} with mode 0700 "
            f"(it is uid {st.st_uid}, mode {st.st_mode & 0o777:o}); set KALOS_RUNTIME_DIR elsewhere"
        )
    return path
