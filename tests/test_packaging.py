"""Packaging: a wheel built from a clean copy of the repository, and ``pip install .``,
each installed into a fresh virtual environment, run ``gpuwatchd run --devices none``
with the default policies found inside the installed package.

Offline: the fresh environment sees the shared environment's dependencies through a
``.pth`` file naming a directory of links to them, leaving out the shared environment's
own (editable) gpuwatchd, so only the installed copy can be imported; the builds use the
shared environment's setuptools (``--no-build-isolation --no-index``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pip
import pytest
import structlog
import yaml

from conftest import REPO

pytestmark = pytest.mark.slow

_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)


def _run(*argv: str | Path, cwd: str | Path = "/") -> subprocess.CompletedProcess[str]:
    """Run a command (not from the checkout, whose gpuwatchd/ ``python -c`` would import)."""
    result = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=300, cwd=cwd,
        env=_clean_env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"
    return result


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH (which may name a checkout) or pip settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's sources without build outputs, caches or environments."""
    copy = tmp_path_factory.mktemp("src") / "gpuwatchd-src"
    shutil.copytree(REPO, copy, ignore=_NOT_COPIED, symlinks=True)
    return copy


@pytest.fixture(scope="module")
def shared_deps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of links to the shared environment's site-packages, except gpuwatchd."""
    deps = tmp_path_factory.mktemp("deps")
    # setuptools is located, not imported: importing it after another test module pulled in
    # the standard library's distutils trips its _distutils_hack assertion.
    spec = importlib.util.find_spec("setuptools")
    assert spec is not None and spec.origin is not None
    modules = [Path(m.__file__) for m in (structlog, yaml, pip) if m.__file__]
    roots = {p.resolve().parent.parent for p in [*modules, Path(spec.origin)]}
    for root in sorted(roots):
        for entry in root.iterdir():
            name = entry.name.lower()
            if name.startswith(("gpuwatchd", "__editable__", "_shared")) or entry.suffix == ".pth":
                continue
            if not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    return deps


def _fresh_venv(where: Path, shared_deps: Path) -> Path:
    """A new virtual environment (no pip of its own) that can import the dependencies."""
    _run(sys.executable, "-m", "venv", "--without-pip", where)
    python = where / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    Path(purelib.stdout.strip(), "_gpuwatchd_test_deps.pth").write_text(f"{shared_deps}\n")
    return python


def _pip(python: Path, *args: str | Path) -> None:
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--no-build-isolation", *args)  # fmt: skip


@pytest.fixture(scope="module")
def wheel(clean_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
         "--no-build-isolation", "-w", out, clean_copy)  # fmt: skip
    (built,) = out.glob("gpuwatchd-*.whl")
    return built


@pytest.fixture(params=["wheel", "pip install ."])
def installed(
    request: pytest.FixtureRequest, wheel: Path, clean_copy: Path, shared_deps: Path,
    tmp_path: Path,
) -> Iterator[tuple[Path, Path]]:  # fmt: skip
    """(the fresh environment's bin/, its gpuwatchd package directory)."""
    python = _fresh_venv(tmp_path / "venv", shared_deps)
    _pip(python, wheel if request.param == "wheel" else clean_copy)
    found = _run(python, "-c", "import gpuwatchd, pathlib; "
                 "print(pathlib.Path(gpuwatchd.__file__).resolve().parent)")  # fmt: skip
    yield python.parent, Path(found.stdout.strip())


def test_the_wheel_holds_the_package_and_default_policies_only(wheel: Path) -> None:
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "gpuwatchd/policies/default.yaml" in names
    assert "gpuwatchd/py.typed" in names and "gpuwatchd/cli/main.py" in names
    # gpuwatchd install-unit reads these from the installed package (docs/systemd.md)
    for unit_file in ("gpuwatchd.service", "gpuwatchd.sysusers", "gpuwatchd.tmpfiles"):
        assert f"gpuwatchd/unitfiles/{unit_file}" in names
    assert not [n for n in names if n.startswith(("tests/", "policies/", "docs/"))]
    assert not [n for n in names if "examples" in n]  # example policies stay in the repo


def test_installed_daemon_runs_with_the_packaged_default_policies(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    bin_dir, package = installed
    assert REPO not in package.parents, f"imported the checkout, not the install: {package}"
    assert (package / "policies" / "default.yaml").is_file()
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("interval: 1s\n", encoding="utf-8")
    sock = tmp_path / "control.sock"
    log = (tmp_path / "daemon.log").open("wb")
    daemon = subprocess.Popen(
        [bin_dir / "gpuwatchd", "run", "--devices", "none", "--socket", sock,
         "--state-dir", tmp_path / "state", "--config", config, "--log-format", "json"],
        stdout=log, stderr=subprocess.STDOUT, env=_clean_env(), cwd=tmp_path,
    )  # fmt: skip
    try:
        status = _wait_for_status(bin_dir, sock, daemon, tmp_path / "daemon.log")
        sources = [Path(s) for s in status["policies"]["sources"]]
        assert sources == [package / "policies" / "default.yaml"]
        names = {p["name"] for p in status["policies"]["policies"]}
        assert {"gpu-underused", "host-oversubscribed", "data-starved"} <= names
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        log.close()
    events = [json.loads(line)["event"] for line in (tmp_path / "daemon.log").open()
              if line.startswith("{")]  # fmt: skip
    assert events[-1] == "stopped" or events[-1] == "daemon.stopped", events[-5:]
    assert not sock.exists()


def _wait_for_status(
    bin_dir: Path, sock: Path, daemon: subprocess.Popen[bytes], log: Path
) -> dict[str, Any]:
    """``gpuwatchctl --json status`` once the daemon answers (exit 3 means not yet)."""
    deadline = time.monotonic() + 60
    while True:
        result = subprocess.run(
            [bin_dir / "gpuwatchctl", "--socket", sock, "--json", "status"],
            capture_output=True, text=True, timeout=30, env=_clean_env(), check=False,
        )  # fmt: skip
        if result.returncode == 0:
            status: dict[str, Any] = json.loads(result.stdout)
            return status
        assert result.returncode == 3, result.stderr
        assert daemon.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.2)


def test_a_fresh_environment_has_the_dependencies_but_no_gpuwatchd(
    shared_deps: Path, tmp_path: Path
) -> None:
    # The isolation the tests above rely on: only an install makes gpuwatchd importable.
    python = _fresh_venv(tmp_path / "venv", shared_deps)
    _run(python, "-c", "import structlog, yaml, psutil, apscheduler, prometheus_client")
    missing = subprocess.run(
        [python, "-c", "import gpuwatchd"], capture_output=True, text=True, timeout=60,
        cwd="/", env=_clean_env(), check=False,
    )  # fmt: skip
    assert missing.returncode == 1 and "No module named 'gpuwatchd'" in missing.stderr
