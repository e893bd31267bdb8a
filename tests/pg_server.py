"""A throwaway PostgreSQL server from Debian's binaries, for the tests and the benchmarks.

``PgServer.start()`` runs initdb into a fresh directory under /tmp and starts ``postgres`` on
a free loopback port (TCP with a password, scram-sha-256) and a Unix socket in the same
directory. PostgreSQL refuses to run as root, so under root the server runs as the
``postgres`` OS user that Debian's package creates (the directory is chowned to it).
``find_bin_dir()`` is None when the binaries are missing: the tests then skip, saying why
(CI's ``.ci/run`` installs them).
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

PASSWORD = "s3cret-Pw!"  # the tests check that it never shows up in output or logs
USER = "kalos"


def find_bin_dir() -> Path | None:
    """The directory of Debian's initdb/pg_ctl (newest major version), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(os.path.realpath(which)).parent if which else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self, *, durable: bool = False) -> None:
        self.bin = find_bin_dir()
        if self.bin is None:
            raise RuntimeError("PostgreSQL binaries not found (apt-get install postgresql)")
        self.dir = Path(tempfile.mkdtemp(prefix="kpg", dir="/tmp"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.durable = durable  # False: fsync off, for quick tests; benchmarks use True
        self.user_ids: tuple[int, int] | None = None
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            self.user_ids = (pw.pw_uid, pw.pw_gid)
            os.chown(self.dir, *self.user_ids)
        os.chmod(self.dir, 0o700)

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        kwargs: dict = {}
        if self.user_ids is not None:
            kwargs.update(user=self.user_ids[0], group=self.user_ids[1], extra_groups=[])
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, check=check, timeout=120,
                              cwd=self.dir, **kwargs)

    def init(self) -> "PgServer":
        pwfile = self.dir / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.user_ids is not None:
            os.chown(pwfile, *self.user_ids)
        self._run(self.bin / "initdb", "-D", self.data, "-U", USER, "--pwfile", pwfile, "--auth-local=trust",
                  "--auth-host=scram-sha-256", "-E", "UTF8", "--no-locale", "--no-sync")
        pwfile.unlink()
        options = [f"port = {self.port}", "listen_addresses = '127.0.0.1'", f"unix_socket_directories = '{self.dir}'",
                   "max_connections = 200", "shared_buffers = 256MB"]
        if not self.durable:
            options += ["fsync = off", "synchronous_commit = off", "full_page_writes = off"]
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("\n".join(options) + "\n")
        return self

    def start(self) -> "PgServer":
        self._run(self.bin / "pg_ctl", "-D", self.data, "-l", self.dir / "log", "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(self.bin / "pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        out = self._run(self.bin / "psql", "-h", self.dir, "-p", str(self.port), "-U", USER, "-d", database,
                        "-v", "ON_ERROR_STOP=1", "-At", "-c", sql)
        return out.stdout.strip()

    def create_database(self, prefix: str = "t") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self.psql(f"CREATE DATABASE {name}")
        return name

    def has_pgvector(self) -> bool:
        return bool(self.psql("SELECT count(*) FROM pg_available_extensions WHERE name = 'vector'") != "0")

    def log(self) -> str:
        try:
            return (self.dir / "log").read_text()
        except OSError:
            return ""

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
