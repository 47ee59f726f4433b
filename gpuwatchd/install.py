"""``gpuwatchd install-unit``: install (or remove) the systemd unit, sysusers and tmpfiles files.

The files ship inside the package (``gpuwatchd/unitfiles/``, from the repository's
``systemd/``); ``ExecStart=`` is rewritten to the entry point of the installation that runs
this command (a venv under /opt, pipx, or the system). Specification: docs/systemd.md.
This command-line tool (not the daemon) runs systemd's own tools, hence its own
``subprocess`` import.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from gpuwatchd.config import Settings
from gpuwatchd.errors import GpuwatchError

__all__ = [
    "InstallPlan",
    "entry_point",
    "install",
    "jobs_dropin",
    "plan",
    "uninstall",
    "unit_text",
]

UNIT_NAME = "gpuwatchd.service"
JOBS_DROPIN = "50-gpuwatchd-jobs.conf"
"""The drop-in install-unit generates from the configured jobs (and removes on --uninstall)."""
METRICS_SOCKET: Final = "gpuwatchd-metrics.socket"
"""The Prometheus endpoint's socket unit (docs/metrics.md)."""

_PACKAGED = (
    "gpuwatchd.service",
    "gpuwatchd-metrics.socket",
    "gpuwatchd.sysusers",
    "gpuwatchd.tmpfiles",
)
_SHIPPED_EXEC_START = "ExecStart=/usr/bin/gpuwatchd run"


def unit_files_dir() -> Path:
    """``gpuwatchd/unitfiles/`` in an installed wheel, else the checkout's ``systemd/``."""
    package = Path(__file__).resolve().parent
    installed = package / "unitfiles"
    return installed if (installed / UNIT_NAME).is_file() else package.parent / "systemd"


def entry_point(executable: str | None = None) -> list[str]:
    """The argv that runs ``gpuwatchd`` of this installation.

    The ``gpuwatchd`` script in the scripts directory of the running interpreter's scheme
    (``/usr/local/bin`` for a system ``pip install``, ``<venv>/bin`` for a venv or pipx),
    else the one beside ``executable`` (default :data:`sys.executable`, unresolved: a
    venv's ``bin/python`` must stay the venv's), else ``[executable, "-m", "gpuwatchd"]``.
    """
    python = executable or sys.executable
    candidates = [Path(python).parent / "gpuwatchd"]
    if executable is None:
        candidates.insert(0, Path(sysconfig.get_path("scripts")) / "gpuwatchd")
    for script in candidates:
        if script.is_file() and os.access(script, os.X_OK):
            return [str(script)]
    return [python, "-m", "gpuwatchd"]


def _quote(arg: str) -> str:
    """One ExecStart= word (systemd.syntax(7) quoting); paths with spaces stay one word."""
    if arg and not any(c in arg for c in ' \t"\'\\$%;'):
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$").replace("%", "%%")
    return f'"{escaped}"'


def unit_text(exec_start: Sequence[str], run_args: Sequence[str] = ()) -> str:
    """The packaged gpuwatchd.service, ``ExecStart=`` set to ``exec_start run run_args...``.

    Raises :class:`GpuwatchError` when the packaged unit lacks the ExecStart= line.
    """
    text = (unit_files_dir() / UNIT_NAME).read_text(encoding="utf-8")
    if _SHIPPED_EXEC_START not in text:
        raise GpuwatchError(f"the packaged {UNIT_NAME} has no {_SHIPPED_EXEC_START!r} line")
    line = "ExecStart=" + " ".join(_quote(a) for a in [*exec_start, "run", *run_args])
    return text.replace(_SHIPPED_EXEC_START, line, 1)


def _addresses(host: str) -> list[str]:
    """``host``'s IP addresses (a literal address as is; a name through getaddrinfo)."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise GpuwatchError(f"cannot resolve the storage host {host!r}: {exc}") from None
    return sorted({str(info[4][0]) for info in infos})


def jobs_dropin(settings: Settings) -> str | None:
    """The drop-in the configured jobs need under the unit's sandbox, or None.

    Managed workers run inside the daemon's sandbox (ProtectSystem=strict, no IP): each
    job's ``cwd`` and the directory of an SQLite storage become ``ReadWritePaths=``; a
    storage over TCP (``postgresql://host:port/...``) adds AF_INET/AF_INET6 and
    ``IPAddressAllow=`` its host's addresses (resolved now; the unit denies all others).
    Raises :class:`GpuwatchError` when a storage host cannot be resolved.
    """
    writable: set[str] = set()
    allowed: set[str] = set()
    for job in settings.jobs:
        if job.cwd:
            writable.add(job.cwd)
        if job.optuna is None:
            continue
        url = urlsplit(job.optuna.storage)
        if url.scheme.startswith("sqlite"):
            db = job.optuna.storage.split(":///", 1)[-1]
            if db and db != ":memory:":
                base = Path(job.cwd or "/") / db if not db.startswith("/") else Path(db)
                writable.add(str(base.parent))
        elif url.hostname:
            allowed.update(_addresses(url.hostname))
    if not writable and not allowed:
        return None
    lines = ["# Generated by gpuwatchd install-unit from the configured jobs; rewritten by the",
             "# next install-unit, removed by --uninstall (docs/systemd.md).", "[Service]"]
    lines += [f"ReadWritePaths=-{path}" for path in sorted(writable)]
    if allowed:
        lines.append("RestrictAddressFamilies=AF_UNIX AF_NETLINK AF_INET AF_INET6")
        lines.append("IPAddressAllow=" + " ".join(sorted(allowed)))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class InstallPlan:
    """Where each file goes (under ``root``) and what it holds."""

    files: dict[Path, str]
    root: Path
    jobs_dropin: Path


def plan(
    root: Path = Path("/"), exec_start: Sequence[str] | None = None,
    settings: Settings | None = None,
) -> InstallPlan:  # fmt: skip
    """The files install-unit writes: unit, sysusers.d and tmpfiles.d entries, and the jobs'
    drop-in (:func:`jobs_dropin`) when ``settings`` has jobs that need one.

    ``exec_start``: the argv before ``run`` (default :func:`entry_point`); a
    ``settings.config_path`` is passed on as ``--config``.
    """
    src = unit_files_dir()
    etc = root / "etc"
    run_args = []
    if settings is not None and settings.config_path:
        run_args = ["--config", settings.config_path]
    units = etc / "systemd" / "system"
    files = {
        units / UNIT_NAME: unit_text(exec_start or entry_point(), run_args),
        # Installed, not enabled (docs/metrics.md: enable it while gpuwatchd is stopped).
        units / METRICS_SOCKET: (src / METRICS_SOCKET).read_text("utf-8"),
        etc / "sysusers.d" / "gpuwatchd.conf": (src / "gpuwatchd.sysusers").read_text("utf-8"),
        etc / "tmpfiles.d" / "gpuwatchd.conf": (src / "gpuwatchd.tmpfiles").read_text("utf-8"),
    }
    dropin = jobs_dropin(settings) if settings is not None else None
    generated = units / f"{UNIT_NAME}.d" / JOBS_DROPIN
    if dropin is not None:
        files[generated] = dropin
    return InstallPlan(files, root, generated)


Runner = Callable[[Sequence[str]], None]


def run_tool(argv: Sequence[str]) -> None:
    """Run one of systemd's tools (argv, never a shell); raise GpuwatchError on failure."""
    if shutil.which(argv[0]) is None:
        raise GpuwatchError(f"{argv[0]} not found: is systemd installed?")
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()
        raise GpuwatchError(f"{' '.join(argv)} exited {result.returncode}: {detail}")


def install(p: InstallPlan, activate: bool = True, runner: Runner = run_tool) -> list[str]:
    """Write the files (0644; parent directories 0755 as needed), then with ``activate``
    run systemd-sysusers, systemd-tmpfiles --create and systemctl daemon-reload.

    Returns what was done, one line each. Raises :class:`OSError` when a file cannot be
    written, :class:`GpuwatchError` when a tool fails.
    """
    done = []
    if p.jobs_dropin not in p.files and p.jobs_dropin.exists():
        p.jobs_dropin.unlink()
        done.append(f"removed {p.jobs_dropin} (no job needs it now)")
    for path, text in p.files.items():
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)
        tmp.replace(path)
        done.append(f"wrote {path}")
    if activate:
        etc = p.root / "etc"
        steps = [
            ["systemd-sysusers", str(etc / "sysusers.d" / "gpuwatchd.conf")],
            ["systemd-tmpfiles", "--create", str(etc / "tmpfiles.d" / "gpuwatchd.conf")],
            ["systemctl", "daemon-reload"],
        ]
        for argv in steps:
            runner(argv)
            done.append("ran " + " ".join(argv))
    return done


def uninstall(p: InstallPlan, activate: bool = True, runner: Runner = run_tool) -> list[str]:
    """Stop and disable the unit (with ``activate``), remove the files, daemon-reload.

    Kept, as packages keep them: the groups, /var/lib/gpuwatchd, /etc/gpuwatchd and the
    administrator's drop-ins (gpuwatchd.service.d/ but install-unit's own).
    """
    done = []
    if activate:
        try:
            runner(["systemctl", "disable", "--now", UNIT_NAME])
            done.append(f"ran systemctl disable --now {UNIT_NAME}")
        except GpuwatchError as exc:
            done.append(f"not disabled ({exc})")
    for path in [*p.files, p.jobs_dropin]:
        if path.exists():
            path.unlink()
            done.append(f"removed {path}")
    if p.jobs_dropin.parent.is_dir() and not any(p.jobs_dropin.parent.iterdir()):
        p.jobs_dropin.parent.rmdir()
    if activate:
        runner(["systemctl", "daemon-reload"])
        done.append("ran systemctl daemon-reload")
    return done
