"""A private Prometheus (Debian's ``prometheus``) on 127.0.0.1 at a free port, serving a
TSDB that ``promtool tsdb create-blocks-from openmetrics`` backfilled: for
tests/test_replay_prometheus.py and bench/prometheus.py. Nothing shared with a system
server; a missing tool is an error naming the package, never a skip."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.pg import free_port, stop_process


def prometheus_tool(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``; RuntimeError naming the package."""
    path = shutil.which(name)
    if not path:
        raise RuntimeError(f"{name} is missing: `make prometheus` (apt-get install prometheus)")
    return path


@contextlib.contextmanager
def prometheus_serving(
    data: Path, work: Path, ready_s: float = 60.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``prometheus`` on the TSDB folder ``data`` (retention 100 years: backfilled
    blocks are old), its config and log in ``work``; yields (its URL, its process) once
    ``/-/ready`` answers, and stops it at exit. RuntimeError with the log's end when it
    exits or is not ready within ``ready_s`` seconds."""
    (work / "prometheus.yml").write_text("global: {scrape_interval: 1m}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (work / "prometheus.log").open("wb") as log:
        server = subprocess.Popen(
            [prometheus_tool("prometheus"), f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={data}", "--storage.tsdb.retention.time=100y",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + ready_s
            while not _ready(url):
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = (work / "prometheus.log").read_text()[-2000:]
                    raise RuntimeError(f"prometheus not ready within {ready_s:.0f} s: {tail}")
                time.sleep(0.2)
            yield url, server
        finally:
            stop_process(server)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as ready:
            return bool(ready.status == 200)
    except OSError:
        return False
