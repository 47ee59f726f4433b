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
from gpuwatchd.jobs.storage import parse_storage

__all__ = [
    "InstallPlan",
    "entry_point",
    "install",
    "jobs_dropin",
    "notify_dropin",
    "notify_urls",
    "plan",
    "uninstall",
    "unit_text",
]

UNIT_NAME = "gpuwatchd.service"
JOBS_DROPIN = "50-gpuwatchd-jobs.conf"
"""The drop-in install-unit generates from the configured jobs (and removes on --uninstall)."""
NOTIFY_DROPIN: Final = "50-gpuwatchd-notify.conf"
"""The drop-in install-unit generates for ``notify`` URLs (docs/systemd.md#notifications)."""
RESOLV_CONF: Final = Path("/etc/resolv.conf")
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


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _addresses(host: str, what: str = "the storage host") -> list[str]:
    """``host``'s IP addresses (a literal address as is; a name through getaddrinfo)."""
    if _is_address(host):
        return [str(ipaddress.ip_address(host))]
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise GpuwatchError(f"cannot resolve {what} {host!r}: {exc}") from None
    return sorted({str(info[4][0]) for info in infos})


def _nameservers(resolv_conf: Path) -> list[str]:
    """The ``nameserver`` addresses of resolv.conf(5) (systemd-resolved's stub: 127.0.0.53)."""
    try:
        lines = resolv_conf.read_text(encoding="utf-8", errors="replace").splitlines()[:1000]
    except OSError:
        return []
    words = (line.split() for line in lines)
    return sorted(
        {w[1] for w in words if len(w) >= 2 and w[0] == "nameserver" and _is_address(w[1])}
    )


def notify_urls(settings: Settings) -> list[str]:
    """The apprise URLs of the ``notify`` actions in the config's ``policies:`` files
    (none when the config names no policy files). Raises PolicyError on a bad file."""
    if not settings.policies:
        return []
    from gpuwatchd.policy import action_names
    from gpuwatchd.policyfiles import load_policies

    loaded = load_policies(list(settings.policies))
    return [
        str(url)
        for policy in loaded.policies
        for action in policy.actions
        if action.action == action_names.NOTIFY
        for url in action.params.get("urls", ())
    ]


def notify_dropin(urls: Sequence[str], resolv_conf: Path = RESOLV_CONF) -> str | None:
    """The drop-in that lets ``notify`` reach ``urls`` (apprise URLs) under the unit's
    sandbox, or None without URLs: AF_INET/AF_INET6 and ``IPAddressAllow=`` each URL's
    host (an address as is, a name resolved now, plus resolv.conf's nameservers so the
    daemon can resolve it); ``IPAddressDeny=any`` of the unit stays. Raises
    :class:`GpuwatchError` naming the URL by scheme and host (never its tokens) when a host
    is missing or cannot be resolved (a ``slack://`` URL names tokens, not a host: relay
    through a webhook on an allowed address, docs/systemd.md#notifications)."""
    allowed: set[str] = set()
    names = False
    for number, url in enumerate(urls, 1):
        split = urlsplit(url)
        try:
            host = split.hostname
        except ValueError:
            host = None
        # Named by position and scheme only: a Slack URL's "host" is a token.
        what = f"notify URL {number} ({split.scheme}://…)"
        if not host:
            raise GpuwatchError(f"{what}: no host in the URL")
        try:
            allowed.update(_addresses(host, f"the host of {what}"))
        except GpuwatchError:
            raise GpuwatchError(
                f"cannot resolve the host of {what}; a service whose URL names no reachable "
                "host needs a relay on an allowed address (docs/systemd.md#notifications)"
            ) from None
        names = names or not _is_address(host)
    if not allowed:
        return None
    if names:
        allowed.update(_nameservers(resolv_conf))
    return (
        "# Generated by gpuwatchd install-unit for the notify action's URLs; rewritten by\n"
        "# the next install-unit, removed by --uninstall (docs/systemd.md#notifications).\n"
        "[Service]\n"
        "RestrictAddressFamilies=AF_UNIX AF_NETLINK AF_INET AF_INET6\n"
        f"IPAddressAllow={' '.join(sorted(allowed))}\n"
    )


def jobs_dropin(settings: Settings) -> str | None:
    """The drop-in the configured jobs need under the unit's sandbox, or None.

    The daemon's own study recovery (and workers under ``launcher: subprocess``, which
    share the daemon's sandbox: ProtectSystem=strict, no IP) need the jobs' storages: each
    job's ``cwd`` and the directory of an SQLite database or Optuna journal file become
    ``ReadWritePaths=``; a storage over TCP (``postgresql://host:port/...``,
    ``redis://host:port/db``) adds AF_INET/AF_INET6 and
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
        storage = parse_storage(job.optuna.storage)
        if storage.local_file is not None:  # SQLite or a journal (and its .lock) beside it
            writable.add(str((Path(job.cwd or "/") / storage.local_file).parent))
        elif storage.path is None:  # a database or Redis server
            host = urlsplit(job.optuna.storage).hostname
            if host:
                allowed.update(_addresses(host))
    if not writable and not allowed:
        return None
    lines = [
        "# Generated by gpuwatchd install-unit from the configured jobs; rewritten by the",
        "# next install-unit, removed by --uninstall (docs/systemd.md).",
        "[Service]",
    ]
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
    notify_dropin: Path | None = None
    """Where the notify drop-in goes (in ``files`` when there are URLs)."""

    def generated(self) -> list[Path]:
        """The drop-ins install-unit generates (removed when no longer needed)."""
        return [p for p in (self.jobs_dropin, self.notify_dropin) if p is not None]


def plan(
    root: Path = Path("/"), exec_start: Sequence[str] | None = None,
    settings: Settings | None = None, notify: Sequence[str] = (),
) -> InstallPlan:  # fmt: skip
    """The files install-unit writes: unit, sysusers.d and tmpfiles.d entries, and the jobs'
    drop-in (:func:`jobs_dropin`) when ``settings`` has jobs that need one.

    ``exec_start``: the argv before ``run`` (default :func:`entry_point`); a
    ``settings.config_path`` is passed on as ``--config``. ``notify``: apprise URLs (with
    those of the config's policies, :func:`notify_urls`) for :func:`notify_dropin`.
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
    urls = [*notify, *(notify_urls(settings) if settings is not None else ())]
    notify_text = notify_dropin(urls)
    notify_path = units / f"{UNIT_NAME}.d" / NOTIFY_DROPIN
    if notify_text is not None:
        files[notify_path] = notify_text
    return InstallPlan(files, root, generated, notify_path)


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
    for stale in p.generated():
        if stale not in p.files and stale.exists():
            stale.unlink()
            done.append(f"removed {stale} (not needed now)")
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
    for path in [*p.files, *p.generated()]:
        if path.exists():
            path.unlink()
            done.append(f"removed {path}")
    if p.jobs_dropin.parent.is_dir() and not any(p.jobs_dropin.parent.iterdir()):
        p.jobs_dropin.parent.rmdir()
    if activate:
        runner(["systemctl", "daemon-reload"])
        done.append("ran systemctl daemon-reload")
    return done
