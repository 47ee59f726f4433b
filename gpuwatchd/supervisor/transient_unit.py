"""Pure pieces of the planned systemd launcher (issue 11 item 3): no I/O here.

Names a worker's transient unit, builds the ``systemd-run`` argv that would start it
(an argv, never a shell string) and parses ``systemctl show`` output. Not yet wired into
the supervisor: :mod:`gpuwatchd.supervisor.launch` still starts every worker.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = [
    "JOBS_SLICE",
    "UNIT_PROPERTIES",
    "choose_launcher",
    "parse_show",
    "systemd_run_argv",
    "unit_name",
]

JOBS_SLICE = "gpuwatchd-jobs.slice"
"""The slice every worker unit is placed in."""

UNIT_PROPERTIES = frozenset(
    {"MemoryMax", "MemoryHigh", "CPUQuota", "CPUWeight", "TasksMax", "IOWeight", "LimitNOFILE"}
)
"""Properties a job's ``unit_properties:`` may set (systemd.resource-control(5))."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")
_VALUE_OK = re.compile(r"^[A-Za-z0-9%.:_-]{1,64}$")


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
    stdout_path: str,
    stderr_path: str,
    env: Mapping[str, str],
    uid: int | None = None,
    gid: int | None = None,
    properties: Mapping[str, str] | None = None,
) -> list[str]:
    """The ``systemd-run`` command line starting ``argv`` as transient service ``unit``.

    Output is appended to the job's files (kept for crash evidence); ``properties`` must be
    in :data:`UNIT_PROPERTIES` with plain values. Raises ValueError on an empty argv, a
    property outside the allow-list or a value with characters other than ``[A-Za-z0-9%.:_-]``."""
    if not argv:
        raise ValueError("empty argv")
    cmd = [
        "systemd-run",
        f"--unit={unit}",
        f"--slice={JOBS_SLICE}",
        "--service-type=exec",
        "--collect",
        "--no-block",
        f"--working-directory={cwd}",
        f"--property=StandardOutput=append:{stdout_path}",
        f"--property=StandardError=append:{stderr_path}",
    ]
    if uid is not None:
        cmd.append(f"--uid={uid}")
    if gid is not None:
        cmd.append(f"--gid={gid}")
    for key, value in sorted((properties or {}).items()):
        if key not in UNIT_PROPERTIES:
            allowed = ", ".join(sorted(UNIT_PROPERTIES))
            raise ValueError(f"unit property {key!r} not allowed (allowed: {allowed})")
        if not _VALUE_OK.match(value):
            raise ValueError(f"unit property {key}={value!r}: bad value")
        cmd.append(f"--property={key}={value}")
    for key, value in sorted(env.items()):
        cmd.append(f"--setenv={key}={value}")
    cmd.append("--")
    cmd.extend(argv)
    return cmd


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show -p MainPID,ActiveState,...`` output (``Key=Value`` lines) as a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value
    return out
