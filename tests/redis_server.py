"""A throw-away Redis server for tests, from the distribution's own package.

:func:`redis_server` runs Debian's ``redis-server`` in a fresh temp dir, bound to
127.0.0.1 on a free port, without persistence (``--save ""``, ``--appendonly no``): no
system server is used or touched. A missing server or ``redis`` package is a test
*failure* naming what to install, never a skip (``make test`` installs both).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from pg import free_port, stop_process

INSTALL_HINT = (
    "install Debian's redis-server package (apt-get install -y redis-server; `make redis`) "
    "and the redis package into the venv"
)
START_TIMEOUT_S = 30.0


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


@contextlib.contextmanager
def redis_server(password: str | None = None) -> Iterator[str]:
    """Start a private Redis server; yield its URL (``redis://127.0.0.1:PORT/0``, with
    ``:PASSWORD@`` when ``password`` is set); stop it and delete its dir at exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        _fail(f"redis-server not found: {INSTALL_HINT}")
    try:
        import redis
    except ImportError:
        _fail(f"the redis package is not importable: {INSTALL_HINT}")
    base = Path(tempfile.mkdtemp(prefix="gw-redis-", dir="/tmp"))
    port = free_port()
    argv = [
        binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(base),
        "--save", "", "--appendonly", "no", "--daemonize", "no",
    ]  # fmt: skip
    if password is not None:
        argv += ["--requirepass", password]
    log = (base / "redis.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=base)
    auth = "" if password is None else f":{password}@"
    url = f"redis://{auth}127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis.from_url(url)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    _fail(f"redis-server did not start:\n{(base / 'redis.log').read_text()}")
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        stop_process(proc)
        log.close()
        shutil.rmtree(base, ignore_errors=True)
