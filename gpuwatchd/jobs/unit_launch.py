"""The systemd launcher: each managed worker a transient unit ``gpuwatchd-<job>-<slot>.service``.

Used when the daemon itself runs under systemd (:func:`usable`). The worker is started
with ``systemd-run`` (an argv from :mod:`.transient_unit`, run through
:func:`gpuwatchd.jobs.launch.run_tool`: no shell), so it gets its own cgroup in
``gpuwatchd-jobs.slice``, its own journal stream and none of the daemon's sandbox. Its
end is read from ``systemctl show`` (``Result=oom-kill`` is exact) and its output of that
invocation is copied from the journal into ``worker-<n>.err`` for crash classification.
Blocking calls: the runner calls them with ``asyncio.to_thread``. Specification:
docs/systemd.md, "Worker units".
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuwatchd.crash import CrashInfo, signal_of
from gpuwatchd.errors import SupervisorError
from gpuwatchd.jobs.launch import run_tool
from gpuwatchd.jobs.transient_unit import (
    check_properties,
    choose_launcher,
    environment_file_text,
    parse_show,
    systemd_run_argv,
)

__all__ = [
    "JOURNAL_LINES",
    "SHOW_PROPERTIES",
    "UnitEnd",
    "append_evidence",
    "check_job",
    "chosen",
    "ended_pid",
    "finish",
    "journal",
    "oom_kill_crash",
    "resolve",
    "returncode_of",
    "running_pid",
    "show",
    "show_many",
    "start",
    "usable",
]

JOURNAL_LINES: Final = 200
"""Lines of the invocation's journal copied for crash evidence (as the stderr tail keeps)."""

SHOW_PROPERTIES: Final = (
    "Id",
    "Result",
    "ExecMainStatus",
    "ExecMainCode",
    "ExecMainPID",
    "InvocationID",
    "MainPID",
    "ActiveState",
    "SubState",
    "LoadState",
)
"""The ``systemctl show`` properties read of a worker unit (org.freedesktop.systemd1(5))."""
_ENDED: Final = frozenset({"inactive", "failed"})


def usable() -> str | None:
    """Why the systemd launcher cannot be used here, or ``None`` when it can.

    Needs a host booted with systemd (``/run/systemd/system``, sd_booted(3)), ``systemd-run``
    and ``systemctl`` on PATH and root (the system manager starts units for root without
    polkit)."""
    if not os.path.isdir("/run/systemd/system"):
        return "the host did not boot with systemd (/run/systemd/system is missing)"
    for tool in ("systemd-run", "systemctl", "journalctl"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    if os.geteuid() != 0:
        return "the daemon does not run as root"
    return None


def resolve(setting: str, environ: Mapping[str, str]) -> tuple[str, str]:
    """``launcher:`` (auto|systemd|subprocess) to the launcher used and why.

    ``auto``: systemd when the daemon is a unit (``INVOCATION_ID``) and :func:`usable`;
    ``systemd`` when it is not usable falls back to subprocess (the reason says why).
    Raises ValueError for another setting."""
    why_not = usable()
    chosen = choose_launcher(setting, environ, why_not is None)
    if chosen == "systemd" and why_not is not None:
        return "subprocess", why_not
    if chosen == "systemd":
        return chosen, "the daemon runs under systemd"
    if setting == "subprocess":
        return chosen, "configured"
    return chosen, why_not or "the daemon is not a systemd unit (no INVOCATION_ID)"


def chosen(setting: str, environ: Mapping[str, str] | None, log: Any) -> str:
    """:func:`resolve` for the supervisor (``environ`` default ``os.environ``), logged as
    ``supervisor.launcher_chosen`` when ``log`` is given; SupervisorError for a bad one."""
    try:
        launcher, why = resolve(setting, os.environ if environ is None else environ)
    except ValueError as exc:
        raise SupervisorError(str(exc)) from None
    if log is not None:
        log.info("supervisor.launcher_chosen", launcher=launcher, reason=why)
    return launcher


def check_job(job: str, properties: Mapping[str, str]) -> None:
    """:func:`~.transient_unit.check_properties` of job ``job``'s ``unit_properties``;
    SupervisorError naming the job (a config means the same with either launcher)."""
    try:
        check_properties(properties)
    except ValueError as exc:
        raise SupervisorError(f"job {job!r}: {exc}") from None


def start(
    unit: str,
    argv: list[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    uid: int | None,
    gid: int | None,
    properties: Mapping[str, str],
    env_file: Path,
    syslog_identifier: str | None = None,
) -> int:
    """Start ``argv`` as transient service ``unit``; return its main pid.

    A unit of that name left from an earlier launch (ended, failed) is stopped and reset
    first; one still running raises OSError (the supervisor adopts running units before it
    launches). ``argv[0]`` is found as Popen with ``cwd=`` and ``env=`` finds it: a name
    without ``/`` on ``env``'s PATH, a relative path from ``cwd`` (systemd-run would use
    the service manager's PATH and the daemon's directory). ``env`` is written to
    ``env_file`` (mode 0600) for ``EnvironmentFile=`` and removed once ``systemd-run``
    returns: systemd has read it by then (``--service-type=exec`` waits for the exec).
    Returns -1 when the unit already ended (a very short command). Raises OSError with
    systemd-run's message, the unit's exit status and its last journal lines when the
    unit cannot be started (that unit is reset), ValueError for a refused property or
    environment variable."""
    if "/" not in argv[0]:
        found = shutil.which(argv[0], path=env.get("PATH", os.defpath))
        if found is not None:
            argv = [found, *argv[1:]]
    elif not os.path.isabs(argv[0]):
        argv = [os.path.join(cwd, argv[0]), *argv[1:]]
    cmd = systemd_run_argv(
        unit,
        argv,
        cwd=cwd,
        env_file=str(env_file),
        uid=uid,
        gid=gid,
        properties=properties,
        syslog_identifier=syslog_identifier,
    )
    text = environment_file_text(env)
    left = show(unit)
    if running_pid(left) is not None:
        raise OSError(f"{unit} is already running (MainPID={left['MainPID']})")
    if left.get("LoadState") == "loaded":
        _release(unit, left)
    _write_private(env_file, text)
    try:
        status, _out, err = run_tool(cmd)
    finally:
        env_file.unlink(missing_ok=True)
    if status != 0:
        raise OSError(_start_failed(unit, err.strip() or f"exit status {status}"))
    for _ in range(3):
        props = show(unit)
        if props:
            return running_pid(props) or -1
        time.sleep(0.1)
    raise OSError(f"{unit} was started but systemctl show cannot read its MainPID")


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner (root) only; OSError as open(2)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _start_failed(unit: str, message: str) -> str:
    """Why a start failed: systemd-run's message (a program it cannot find: the unit was
    never created) or, for a unit that was created and failed, systemd's own lines of that
    invocation ("Changing to the requested working directory failed: ...") and its
    ``ExecMainStatus`` (systemd.exec(5)'s exit codes: 200/CHDIR, 217/USER, ...); that
    unit is reset so that it is not taken for a worker that ended later."""
    first = message.splitlines()[0] if message else ""
    props = show(unit)
    invocation = props.get("InvocationID", "")
    if props.get("LoadState") != "loaded" or not invocation:
        return f"systemd-run {unit}: {first}"[:600]
    # systemd's own lines about the invocation carry INVOCATION_ID=, the process's its
    # trusted _SYSTEMD_INVOCATION_ID= ("+": either).
    out = _journal([f"INVOCATION_ID={invocation}", "+", f"_SYSTEMD_INVOCATION_ID={invocation}"], 20)
    lines = out.strip().splitlines()
    said = [ln for ln in lines if "failed:" in ln or "Failed at step" in ln] or lines[-2:]
    _release(unit, props)
    status = props.get("ExecMainStatus", "")
    detail = f" (ExecMainStatus={status})" if status not in ("", "0") else ""
    return f"systemd-run {unit}: {' | '.join(said[-2:]) or first}{detail}"[:600]


def show(unit: str) -> dict[str, str]:
    """``systemctl show`` of ``unit`` (:data:`SHOW_PROPERTIES`)."""
    return show_many([unit]).get(unit, {})


def show_many(units: Sequence[str]) -> dict[str, dict[str, str]]:
    """``systemctl show`` of several units in one call: unit name -> its properties
    (:data:`SHOW_PROPERTIES`; a unit never loaded has ``LoadState=not-found``). Empty
    when systemctl fails."""
    if not units:
        return {}
    argv = ["systemctl", "show", "-p", ",".join(SHOW_PROPERTIES), "--", *units]
    status, out, _err = run_tool(argv, timeout_s=10.0)
    if status != 0:
        return {}
    found: dict[str, dict[str, str]] = {}
    for block in out.split("\n\n"):
        props = parse_show(block)
        if props.get("Id") in units:
            found[props["Id"]] = props
    return found


def _pid(props: Mapping[str, str], key: str) -> int | None:
    try:
        pid = int(props.get(key, "0"))
    except ValueError:
        return None
    return pid if pid > 0 else None


def running_pid(props: Mapping[str, str]) -> int | None:
    """``MainPID`` of a unit's :func:`show` properties: its main process runs; else None."""
    return _pid(props, "MainPID")


def ended_pid(props: Mapping[str, str]) -> int | None:
    """The pid of the main process of a unit that ran and whose end nobody has read yet
    (``ExecMainPID``): a loaded unit whose main process exited (``active (exited)`` under
    ``RemainAfterExit=yes``, ``failed``, or ``deactivating`` while systemd ends what is
    left of its cgroup). ``None`` for a unit running, never run or not loaded. The caller
    checks that the process is gone (systemd may not have reaped it yet)."""
    if props.get("LoadState") != "loaded":
        return None
    if running_pid(props) is None and not _main_exited(props):
        return None  # never ran, or its end was read and it was released
    return _pid(props, "ExecMainPID")


def _main_exited(props: Mapping[str, str]) -> bool:
    """systemd has recorded the main process's end: ``ExecMainCode`` CLD_EXITED (1),
    CLD_KILLED (2) or CLD_DUMPED (3) (waitid(2)) and no ``MainPID`` left."""
    return running_pid(props) is None and props.get("ExecMainCode") in ("1", "2", "3")


@dataclass(frozen=True, slots=True)
class UnitEnd:
    """How a worker unit ended: ``returncode`` as Popen gives it (``-N``: signal N; ``None``:
    unknown), systemd's ``Result`` (``success``, ``exit-code``, ``signal``, ``oom-kill``,
    ...; ``""`` when the unit was already collected) and the invocation's journal lines."""

    returncode: int | None
    result: str
    journal: str


def returncode_of(props: Mapping[str, str]) -> int | None:
    """``ExecMainCode``/``ExecMainStatus`` (waitid(2) CLD_EXITED=1, CLD_KILLED=2,
    CLD_DUMPED=3) as a Popen return code; ``None`` when the unit has no main exit."""
    try:
        code, status = int(props.get("ExecMainCode", "")), int(props.get("ExecMainStatus", ""))
    except ValueError:
        return None
    if code == 1:
        return status
    if code in (2, 3):
        return -status
    return None


def finish(unit: str, *, identifier: str | None = None, wait_s: float = 5.0) -> UnitEnd:
    """Read how ``unit`` ended once its main process is gone, copy its journal, then stop
    and reset it (leftover processes of its cgroup, a DataLoader's, are killed).

    Waits up to ``wait_s`` for systemd to record the end (it reaps the process itself;
    ``ExecMainCode`` set, no ``MainPID``). A unit no longer loaded (stopped from outside
    and collected) gives ``UnitEnd(None, "", ...)``: status unknown; so does a unit whose
    end systemd has not recorded by then (or one ``systemctl show`` cannot read), which is
    then left as it is: a running main process is never killed here."""
    deadline = time.monotonic() + wait_s
    props = show(unit)
    while not _ended(props) and time.monotonic() < deadline:
        time.sleep(0.1)
        props = show(unit)
    invocation = props.get("InvocationID", "")
    text = journal(unit, invocation, identifier)
    if not _ended(props) or props.get("LoadState") != "loaded":
        return UnitEnd(None, "", text)
    _release(unit, props)
    return UnitEnd(returncode_of(props), props.get("Result", ""), text)


def _ended(props: Mapping[str, str]) -> bool:
    if not props:
        return False  # systemctl show failed: nothing known
    if props.get("LoadState") != "loaded":
        return True
    return _main_exited(props) or props.get("ActiveState") in _ENDED


def _release(unit: str, props: Mapping[str, str]) -> None:
    """Stop an ended unit kept by ``RemainAfterExit=yes`` or still ``deactivating``
    (SIGKILL to what is left of its cgroup first: the stop would wait for processes that
    ignore SIGTERM) and reset a failed one, so that systemd unloads it and the name can
    be started again. Does nothing to a unit whose main process runs."""
    if running_pid(props) is not None:
        return
    if props.get("ActiveState") in ("active", "activating", "deactivating", "reloading"):
        run_tool(["systemctl", "kill", "--signal=SIGKILL", "--", unit], timeout_s=10.0)
        run_tool(["systemctl", "stop", "--", unit], timeout_s=30.0)
    run_tool(["systemctl", "reset-failed", "--", unit], timeout_s=10.0)


def oom_kill_crash(unit: str, returncode: int | None) -> CrashInfo:
    """The crash of a worker unit whose ``Result`` is ``oom-kill`` (systemd saw its cgroup's
    ``memory.events`` ``oom_kill`` rise; cgroup v2): kind ``host_oom``, whatever the status."""
    sig, exit_code, status = signal_of(returncode)
    return CrashInfo(
        "host_oom",
        f"the kernel OOM killer ended a process of {unit} ({status}; its memory limit, "
        "MemoryMax=, or the host's memory)",
        sig,
        exit_code,
        evidence=f"{unit}: Result=oom-kill",
    )


def journal(unit: str, invocation: str, identifier: str | None = None) -> str:
    """The last :data:`JOURNAL_LINES` lines one launch of ``unit`` logged (its stdout and
    stderr), after asking journald to flush: those tagged ``SYSLOG_IDENTIFIER=identifier``
    when the launch had one (:func:`.transient_unit.launch_identifier`), else the unit's in
    ``invocation`` (all of the unit's when empty)."""
    if identifier:
        matches = [f"SYSLOG_IDENTIFIER={identifier}"]
    else:
        matches = ["-u", unit]
        if invocation:
            matches.append(f"_SYSTEMD_INVOCATION_ID={invocation}")
    return _journal(matches, JOURNAL_LINES)


def _journal(matches: Sequence[str], lines: int) -> str:
    """The last ``lines`` journal messages (``-o cat``) selected by the journalctl(1)
    ``matches``, after asking journald to flush; empty when journalctl fails."""
    run_tool(["journalctl", "--sync"], timeout_s=10.0)
    argv = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines), *matches]
    _status, out, _err = run_tool(argv, timeout_s=20.0)
    return out


def append_evidence(path: Path, text: str) -> None:
    """Append the journal's lines to the worker's stderr file (crash evidence); quiet."""
    if not text:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError:
        pass
