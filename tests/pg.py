"""A throw-away PostgreSQL server for tests, from the distribution's own packages.

:func:`postgres_cluster` runs ``initdb`` and ``pg_ctl`` (Debian's ``postgresql`` package
puts them in ``/usr/lib/postgresql/<version>/bin``) on a cluster in a fresh temp dir,
reachable only over a Unix socket in that dir (``listen_addresses=''``): no TCP port,
nothing shared with a system server. PostgreSQL refuses to run as root, so under root
the server runs as the ``postgres`` user (created by the Debian package), or ``nobody``;
the clients (the tests, the worker subprocesses) stay root. Durability is off (``fsync``,
``synchronous_commit``, ``full_page_writes``) to keep it fast; it is a test server.

A missing server is a test *failure* naming the package to install, never a skip.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

SUPERUSER = "gpuwatchd"
INSTALL_HINT = (
    "install Debian's PostgreSQL server package (apt-get install -y postgresql) "
    "and psycopg2-binary into the venv"
)


@dataclass(frozen=True)
class PostgresCluster:
    """A running test server: its socket directory and how to reach a database on it."""

    bindir: Path
    socket_dir: Path
    tcp_port: int | None = None

    def url(self, database: str) -> str:
        """An SQLAlchemy/Optuna storage URL for ``database`` over the Unix socket."""
        port = "" if self.tcp_port is None else f"&port={self.tcp_port}"
        return f"postgresql+psycopg2://{SUPERUSER}@/{database}?host={self.socket_dir}{port}"

    def tcp_url(self, database: str) -> str:
        """The storage URL for ``database`` over TCP on 127.0.0.1 (``tcp=True`` only)."""
        assert self.tcp_port is not None, "started without tcp=True"
        return f"postgresql+psycopg2://{SUPERUSER}@127.0.0.1:{self.tcp_port}/{database}"

    def createdb(self, name: str) -> str:
        """Create database ``name``; return its storage URL."""
        subprocess.run(
            [str(self.bindir / "createdb"), "-h", str(self.socket_dir), "-U", SUPERUSER,
             "-p", str(self.tcp_port or 5432), name],  # the socket is named after the port
            check=True,
            capture_output=True,
            timeout=30,
        )
        return self.url(name)


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


def find_bindir() -> Path | None:
    """The directory with ``initdb`` and ``pg_ctl``: the newest Debian version, else PATH."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: [int(part) for part in Path(p).parts[4].split(".") if part.isdigit()],
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _server_user() -> tuple[int, int] | None:
    """(uid, gid) to run the server as when we are root; None when we are not."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return entry.pw_uid, entry.pw_gid
    _fail("running as root and neither a 'postgres' nor a 'nobody' user exists")


def _run(argv: list[str], user: tuple[int, int] | None, cwd: Path, what: str) -> None:
    kwargs: dict[str, Any] = {}
    if user is not None:
        kwargs = {"user": user[0], "group": user[1], "extra_groups": []}
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)
    if done.returncode != 0:
        _fail(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a test server's process; kill it when it outlives 10 s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def postgres_cluster(tcp: bool = False) -> Iterator[PostgresCluster]:
    """Start a private PostgreSQL server; stop it (immediate) and delete it at exit.

    ``tcp=True``: it also listens on 127.0.0.1 on a free port (trust authentication, as
    over the socket: a test server), for clients that reach it over TCP only (the
    systemd tests' namespace has its own /tmp, so not the socket)."""
    bindir = find_bindir()
    if bindir is None or not (bindir / "pg_ctl").exists():
        _fail(f"PostgreSQL server binaries (initdb, pg_ctl) not found: {INSTALL_HINT}")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        _fail(f"psycopg2 is not importable: {INSTALL_HINT}")
    # A short path under /tmp: a Unix socket path must fit in 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="gw-pg-", dir="/tmp"))
    user = _server_user()
    data = base / "data"
    started = False
    try:
        if user is not None:
            os.chown(base, *user)
        _run(
            [
                str(bindir / "initdb"),
                "-D", str(data),
                "-U", SUPERUSER,
                "--auth=trust",
                "--no-sync",
                "--encoding=UTF8",
                "--locale=C",
            ],
            user, base, "initdb",
        )  # fmt: skip
        # pg_ctl hands -o to the server through /bin/sh: base has no spaces (mkdtemp).
        port = free_port() if tcp else None
        listen = f"-c listen_addresses=127.0.0.1 -p {port}" if tcp else "-c listen_addresses=''"
        options = (
            f"-k {base} {listen} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        _run(
            [
                str(bindir / "pg_ctl"),
                "-D", str(data),
                "-l", str(base / "server.log"),
                "-w", "-t", "60",
                "-o", options,
                "start",
            ],
            user, base, "pg_ctl start",
        )  # fmt: skip
        started = True
        yield PostgresCluster(bindir=bindir, socket_dir=base, tcp_port=port)
    finally:
        if started:
            _run(
                [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                user, base, "pg_ctl stop",
            )  # fmt: skip
        shutil.rmtree(base, ignore_errors=True)
