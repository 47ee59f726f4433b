"""Pure pieces of the systemd launcher (:mod:`gpuwatchd.jobs.unit_launch`): no I/O.

Names a worker's transient unit, builds the ``systemd-run`` argv that starts it (an argv,
never a shell string) and parses ``systemctl show`` output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = [
    "CHOICE_PROPERTIES",
    "JOBS_SLICE",
    "MAX_PATHS",
    "PATH_PROPERTIES",
    "RESOURCE_PROPERTIES",
    "UNIT_OWN_ENV",
    "UNIT_PROPERTIES",
    "check_properties",
    "choose_launcher",
    "environment_file_text",
    "launch_identifier",
    "parse_show",
    "systemd_run_argv",
    "unit_name",
]

JOBS_SLICE = "gpuwatchd-jobs.slice"
"""The slice every worker unit is placed in."""

RESOURCE_PROPERTIES = frozenset(
    {
        "MemoryMax",
        "MemoryHigh",
        "MemorySwapMax",
        "CPUQuota",
        "CPUWeight",
        "TasksMax",
        "IOWeight",
        "LimitNOFILE",
    }
)
"""Resource properties (systemd.resource-control(5), LimitNOFILE: systemd.exec(5)): a
plain value of ``[A-Za-z0-9%.:_-]``."""

PATH_PROPERTIES = frozenset({"ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths"})
"""Sandboxing path lists (systemd.exec(5)): space-separated absolute paths, each may start
with ``-`` (ignored when missing)."""

CHOICE_PROPERTIES: Final[Mapping[str, frozenset[str]]] = {
    "ProtectSystem": frozenset({"yes", "no", "full", "strict"}),
    "ProtectHome": frozenset({"yes", "no", "read-only", "tmpfs"}),
    "PrivateTmp": frozenset({"yes", "no"}),
    "NoNewPrivileges": frozenset({"yes", "no"}),
}
"""Sandboxing switches a job may set for its workers, with their values (systemd.exec(5))."""

UNIT_PROPERTIES = RESOURCE_PROPERTIES | PATH_PROPERTIES | frozenset(CHOICE_PROPERTIES)
"""Properties a job's ``unit_properties:`` may set."""

MAX_PATHS = 32
"""Paths one path-list property may name."""

UNIT_OWN_ENV = frozenset(
    {
        "INVOCATION_ID",
        "JOURNAL_STREAM",
        "MAINPID",
        "SYSTEMD_EXEC_PID",
        "WATCHDOG_PID",
        "WATCHDOG_USEC",
        "NOTIFY_SOCKET",
        "LISTEN_PID",
        "LISTEN_FDS",
        "LISTEN_FDNAMES",
        "RUNTIME_DIRECTORY",
        "STATE_DIRECTORY",
        "CONFIGURATION_DIRECTORY",
        "CACHE_DIRECTORY",
        "LOGS_DIRECTORY",
        "CREDENTIALS_DIRECTORY",
    }
)
"""Variables systemd sets for each unit (systemd.exec(5), "Environment Variables in Spawned
Processes"): the daemon's values would be wrong for a worker's unit."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")
_VALUE_OK = re.compile(r"[A-Za-z0-9%.:_-]{1,64}")
_PATH_OK = re.compile(r"-?/[A-Za-z0-9._@+/-]{0,255}")
_IDENT_OK = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_ENV_NAME_OK = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_ENV_ESCAPE = re.compile(r'[\\"`$]')


def launch_identifier(worker_id: str | None) -> str | None:
    """The ``SyslogIdentifier=`` of one launch: its worker id (``<job>.<slot>.<hex>``) when
    that is plain ``[A-Za-z0-9._-]`` text, else ``None`` (a job name with other characters:
    its lines are then found by unit only)."""
    if worker_id is None or not _IDENT_OK.fullmatch(worker_id):
        return None
    return worker_id


def unit_name(job: str, slot: int) -> str:
    """``gpuwatchd-<job>-<slot>.service``; bytes outside ``[A-Za-z0-9_.]`` escaped as ``\\xNN``
    like systemd-escape(1). Raises ValueError for a negative slot."""
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    escaped = _UNSAFE.sub(lambda m: "".join(f"\\x{b:02x}" for b in m.group().encode()), job)
    return f"gpuwatchd-{escaped}-{slot}.service"


def choose_launcher(setting: str, environ: Mapping[str, str], systemd_booted: bool) -> str:
    """Resolve ``launcher: auto|systemd|subprocess`` to ``systemd`` or ``subprocess``.

    ``auto`` means systemd when the daemon is itself a unit (``INVOCATION_ID`` set,
    systemd.exec(5)) and the host booted with systemd (``/run/systemd/system`` exists,
    sd_booted(3)). Raises ValueError for any other setting."""
    if setting not in ("auto", "systemd", "subprocess"):
        raise ValueError(f"launcher must be auto, systemd or subprocess, not {setting!r}")
    if setting != "auto":
        return setting
    return "systemd" if environ.get("INVOCATION_ID") and systemd_booted else "subprocess"


def systemd_run_argv(
    unit: str,
    argv: Sequence[str],
    *,
    cwd: str,
    env_file: str | None = None,
    uid: int | None = None,
    gid: int | None = None,
    properties: Mapping[str, str] | None = None,
    syslog_identifier: str | None = None,
) -> list[str]:
    """The ``systemd-run`` command line starting ``argv`` as transient service ``unit``.

    Output goes to the journal (the unit's own stream, ``journalctl -u UNIT``); the unit
    stays loaded after its main process ended, active (exited) or failed, until the
    daemon has read its exit status and ``Result`` and stops it (``--remain-after-exit``,
    no ``--collect``: systemd counts SIGTERM as a clean end and unloads such a unit);
    ``systemd-run`` returns once the command was executed (``--service-type=exec``).
    The environment comes from ``env_file`` (``EnvironmentFile=``, written by
    :func:`environment_file_text`): values on systemd-run's command line would be readable
    by every user (``/proc/<pid>/cmdline``, ``systemctl show -p Environment``). ``$`` in
    the arguments after ``argv[0]`` is doubled: systemd expands ``$VAR`` and ``${VAR}`` in
    ``ExecStart=`` (systemd.service(5), "Command lines"), Popen does not.
    ``properties`` are checked by :func:`check_properties`. ``syslog_identifier`` (one
    launch's, :func:`launch_identifier`) tags each output line: journald can miss the unit
    of a short-lived process's lines (systemd issue #2913), never this tag. Raises
    ValueError on an empty argv, a property it refuses, a bad identifier or an
    ``env_file`` that is not an absolute path."""
    if not argv:
        raise ValueError("empty argv")
    cmd = [
        "systemd-run",
        f"--unit={unit}",
        f"--slice={JOBS_SLICE}",
        "--service-type=exec",
        "--remain-after-exit",
        "--quiet",
        f"--working-directory={cwd}",
        "--property=KillMode=control-group",
    ]
    if syslog_identifier is not None:
        if not _IDENT_OK.fullmatch(syslog_identifier):
            raise ValueError(f"bad syslog identifier {syslog_identifier[:80]!r}")
        cmd.append(f"--property=SyslogIdentifier={syslog_identifier}")
    if uid is not None:
        cmd.append(f"--uid={uid}")
    if gid is not None:
        cmd.append(f"--gid={gid}")
    check_properties(properties or {})
    for key, value in sorted((properties or {}).items()):
        cmd.append(f"--property={key}={value}")
    if env_file is not None:
        if not env_file.startswith("/") or "\n" in env_file or "\0" in env_file:
            raise ValueError(f"bad environment file path {env_file[:200]!r}")
        cmd.append(f"--property=EnvironmentFile={env_file}")
    cmd.append("--")
    cmd.append(argv[0])
    cmd.extend(a.replace("$", "$$") for a in argv[1:])
    return cmd


def environment_file_text(env: Mapping[str, str]) -> str:
    """``env`` as an ``EnvironmentFile=`` (systemd.exec(5)): one ``NAME="value"`` per line,
    ``\\ " ` $`` escaped with a backslash (systemd's double-quote rules: no expansion, a
    newline kept). Variables systemd sets per unit (:data:`UNIT_OWN_ENV`) are left out.
    Raises ValueError for a name systemd would drop (not ``[A-Za-z_][A-Za-z0-9_]*``) or a
    NUL in a value."""
    lines = []
    for key, value in sorted(env.items()):
        if key in UNIT_OWN_ENV:
            continue
        if not _ENV_NAME_OK.fullmatch(key):
            raise ValueError(f"environment variable {key[:80]!r}: not a name systemd passes")
        if "\0" in value:
            raise ValueError(f"environment variable {key}: a NUL cannot be passed")
        quoted = _ENV_ESCAPE.sub(lambda m: "\\" + m.group(), value)
        lines.append(f'{key}="{quoted}"\n')
    return "".join(lines)


def check_properties(properties: Mapping[str, str]) -> None:
    """Raise ValueError unless every key is in :data:`UNIT_PROPERTIES` with a value of its
    kind: a resource value of 1-64 characters of ``[A-Za-z0-9%.:_-]``; a path list of 1 to
    :data:`MAX_PATHS` absolute paths (``[A-Za-z0-9._@+/-]``, no ``..`` component, an
    optional leading ``-``); a switch one of its values. No unit file syntax (newlines,
    ``=``, quotes, specifiers) can be smuggled in."""
    for key, value in properties.items():
        if key not in UNIT_PROPERTIES:
            allowed = ", ".join(sorted(UNIT_PROPERTIES))
            raise ValueError(f"unit property {key!r} not allowed (allowed: {allowed})")
        if key in CHOICE_PROPERTIES:
            if value not in CHOICE_PROPERTIES[key]:
                choices = "|".join(sorted(CHOICE_PROPERTIES[key]))
                raise ValueError(f"unit property {key}={value!r}: must be {choices}")
        elif key in PATH_PROPERTIES:
            paths = value.split(" ")
            if not 1 <= len(paths) <= MAX_PATHS or not all(
                _PATH_OK.fullmatch(p) and ".." not in p.split("/") for p in paths
            ):
                raise ValueError(
                    f"unit property {key}={value[:80]!r}: must be 1-{MAX_PATHS} absolute "
                    "paths separated by single spaces"
                )
        elif not _VALUE_OK.fullmatch(value):
            raise ValueError(f"unit property {key}={value!r}: bad value")


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show -p MainPID,ActiveState,...`` output (``Key=Value`` lines) as a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value
    return out
