"""The one actuator for Slurm: read and change what the scheduler holds, through its clients.

Every call runs one Slurm client (``squeue``, ``scontrol``, ``sinfo``, ``sacct``) as an argv, never
through a shell, under a timeout, and parses its parsable output; every failure is a
:class:`SlurmError`. What gpuwatchd does on a cluster: docs/slurm.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gpuwatchd.control.messages import SLURM_ID_PATTERN
from gpuwatchd.errors import GpuwatchError
from gpuwatchd.systemd import strip_notify_env

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "DRAIN_REASON_PREFIX",
    "SLURM_ID_PATTERN",
    "SLURM_NODE_PATTERN",
    "SLURM_TASK_PATTERN",
    "ArrayThrottle",
    "Slurm",
    "SlurmCommandFailed",
    "SlurmError",
    "SlurmOutputError",
    "SlurmUnavailable",
    "TaskRecord",
    "drain_reason",
    "parse_job_record",
    "parse_sacct_rows",
]

DRAIN_REASON_PREFIX: Final = "gpuwatchd: "
"""How every drain reason gpuwatchd sets starts: the nodes drained by gpuwatchd (the
cluster-wide cap counts them) are those whose ``sinfo`` reason starts with it."""
REASON_MAX_CHARS: Final = 200
"""Characters of a drain reason at most (Slurm stores any length; ``sinfo`` shows them
all in ``%E``, so keep a line)."""
SLURM_NODE_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A Slurm ``NodeName`` (a host name; no list expressions such as ``gpu[1-4]``)."""
SLURM_TASK_PATTERN: Final = re.compile(r"[1-9][0-9]{0,9}_[0-9]{1,7}")
"""An array task as ``squeue`` and ``scontrol`` name it: ``<array job id>_<task id>``
(task ids below slurm.conf(5)'s ``MaxArraySize``, at most 4 000 001)."""
ACCOUNTING_DISABLED: Final = "accounting storage is disabled"
"""What ``sacct`` says (exit 1) where slurm.conf has ``AccountingStorageType=
accounting_storage/none``: no accounting to read (src/sacct/sacct.c)."""
DEFAULT_TIMEOUT_S: Final = 10.0
"""How long one Slurm client may run: slurmctld answers in milliseconds; a client that
waits longer is retrying an unreachable controller (``MessageTimeout`` defaults to 10 s)."""
OUTPUT_MAX_BYTES: Final = 4 * 1024 * 1024
"""Bytes of one client's stdout read at most (``squeue`` of a 100 000-task array is about
1.5 MiB in the formats used here); a client that writes more is killed and its call fails
(:class:`SlurmOutputError`): a record cut short is never parsed."""
STDERR_MAX_BYTES: Final = 1024 * 1024
"""Bytes of one client's stderr read at most (``scontrol update`` of an array answers one
short line per task range); more fails the call as :data:`OUTPUT_MAX_BYTES` does."""
_READ_CHUNK_BYTES: Final = 64 * 1024
_USER_ID_PATTERN: Final = re.compile(r"[^()]*\((\d{1,10})\)")
"""``UserId=`` of ``scontrol show job``: ``name(uid)``."""


class SlurmError(GpuwatchError):
    """A Slurm client could not do what was asked; ``argv`` is the command, ``message`` why."""

    def __init__(self, argv: Sequence[str], message: str) -> None:
        self.argv = tuple(argv)
        self.message = message
        super().__init__(f"{' '.join(self.argv[:4])}: {message}")


class SlurmUnavailable(SlurmError):
    """The client could not be run or did not answer in time (not installed, timeout)."""


class SlurmCommandFailed(SlurmError):
    """The client exited non-zero (``message`` holds the end of its stderr, ``stderr``
    all of it, up to 4000 characters): no such job, permission denied (``scontrol update``
    needs SlurmUser, root or an operator), the controller down."""

    def __init__(self, argv: Sequence[str], message: str, stderr: str = "") -> None:
        super().__init__(argv, message)
        self.stderr = stderr


class SlurmOutputError(SlurmError):
    """The client's output was not what its parsable format promises."""


@dataclass(frozen=True, slots=True)
class ArrayThrottle:
    """An array job's throttle as slurmctld holds it.

    ``array_job_id``: the array's job id. ``throttle``: ``ArrayTaskThrottle``, the most
    tasks that may run at once (0: no limit). ``running``: tasks running now.
    ``pending``: tasks not started yet (0 once all have started). ``user_id``: the uid
    the array runs as (``UserId``; None if no record said). ``hosts``: the nodes its
    started tasks slurmctld still remembers ran on (``BatchHost``, sorted; a task ended
    longer than slurm.conf's ``MinJobAge`` ago is forgotten).
    """

    array_job_id: str
    throttle: int
    running: int
    pending: int
    user_id: int | None = None
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One started array task as slurmctld holds it (``scontrol show job -o``).

    ``job_id``: the task's own job id. ``array_job_id``/``array_task_id``: its array and
    index. ``state``: ``JobState`` (``RUNNING``, ``COMPLETED``, ``FAILED``,
    ``OUT_OF_MEMORY``, ``PENDING`` once requeued...). ``exit_status``/``signal``:
    ``ExitCode=<status>:<signal>`` (None when malformed). ``restarts``: ``Restarts``, how
    often it was requeued. ``user_id``: ``UserId``'s uid (None if unreadable).
    ``batch_host``: ``BatchHost`` (``""`` before it started). ``stdout_path`` /
    ``stderr_path``: ``StdOut``/``StdErr`` as scontrol shows them (may still hold
    ``%A``-style patterns: :meth:`output_paths`).
    """

    job_id: str
    array_job_id: str
    array_task_id: int
    state: str
    exit_status: int | None = None
    signal: int | None = None
    restarts: int = 0
    user_id: int | None = None
    batch_host: str = ""
    stdout_path: str = ""
    stderr_path: str = ""

    @property
    def label(self) -> str:
        """``<array>_<task>``, as ``squeue`` names the task."""
        return f"{self.array_job_id}_{self.array_task_id}"

    @property
    def returncode(self) -> int | None:
        """As :attr:`subprocess.Popen.returncode`: ``-signal`` when a signal ended the
        batch script, else its exit status (None when unknown)."""
        if self.signal:
            return -self.signal
        return self.exit_status

    def accounted(self, rows: Sequence[tuple[str, str, str]]) -> TaskRecord:
        """This task with its state and exit code from its ``sacct`` rows
        (:func:`parse_sacct_rows`): its own row's (``JobID`` = :attr:`label`), and
        ``OUT_OF_MEMORY`` when any of its steps ended so (the batch step does where the
        job row says ``FAILED``); unchanged where no row is its."""
        state, status, sig = self.state, self.exit_status, self.signal
        for job_id, row_state, code in rows:
            if job_id == self.label:
                state = row_state
                row_status, row_sig = _exit_code(code)
                if row_status is not None and row_sig is not None:
                    status, sig = row_status, row_sig
        if any(row_state == "OUT_OF_MEMORY" for _, row_state, _ in rows):
            state = "OUT_OF_MEMORY"
        return dataclasses.replace(self, state=state, exit_status=status, signal=sig)

    def output_paths(self) -> tuple[str, ...]:
        """The task's stderr and stdout files, stderr first, without repeats, with
        sbatch(1)'s ``%A %a %j %%`` filled in; a path still holding another ``%``
        pattern (``%u``, ``%x``...) or not absolute is left out."""
        paths: list[str] = []
        for raw in (self.stderr_path, self.stdout_path):
            path = _fill_pattern(raw, self)
            if path is not None and path.startswith("/") and path not in paths:
                paths.append(path)
        return tuple(paths)


def _fill_pattern(raw: str, task: TaskRecord) -> str | None:
    values = {"A": task.array_job_id, "a": str(task.array_task_id), "j": task.job_id, "%": "%"}
    out, i = [], 0
    while i < len(raw):
        if raw[i] != "%":
            out.append(raw[i])
            i += 1
            continue
        key = raw[i + 1 : i + 2]
        if key not in values:
            return None
        out.append(values[key])
        i += 2
    return "".join(out) or None


def parse_sacct_rows(text: str) -> list[tuple[str, str, str]]:
    """Rows of ``sacct --parsable2 --noheader -o JobID,State,ExitCode``: ``(job id,
    state, exit code)``, the job's own row and its steps' (``12_3.batch``); a state
    such as ``CANCELLED by 0`` is cut to its first word. Raises :class:`ValueError` for a
    row without three ``|``-separated fields."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 3:
            raise ValueError(f"expected 3 fields: {line[:80]!r}")
        job_id, state, code = fields
        rows.append((job_id, state.split(" ", 1)[0], code))
    return rows


def drain_reason(finding: str) -> str:
    """The ``Reason=`` gpuwatchd gives a node it drains: :data:`DRAIN_REASON_PREFIX` and
    the finding, control characters replaced, cut to :data:`REASON_MAX_CHARS`."""
    text = "".join(c if c.isprintable() else " " for c in finding).strip() or "finding"
    return (DRAIN_REASON_PREFIX + text)[:REASON_MAX_CHARS]


def parse_job_record(line: str) -> dict[str, str]:
    """One line of ``scontrol show job -o``: ``Key=Value`` pairs separated by spaces.

    Values never hold spaces in the fields read here (ids, states, numbers); a value with
    spaces (``Reason``, ``Command`` of a path with spaces) is cut at the first one, its rest
    joined to it as long as it holds no ``=``. Raises :class:`ValueError` for a line
    without ``JobId=``.
    """
    record: dict[str, str] = {}
    last: str | None = None
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key and "=" not in key:
            record[key] = value
            last = key
        elif last is not None:
            record[last] += " " + token
    if "JobId" not in record:
        raise ValueError(f"not a job record: {line[:80]!r}")
    return record


def _check_id(argv: Sequence[str], job_id: str) -> str:
    if not SLURM_ID_PATTERN.fullmatch(job_id):
        raise SlurmOutputError(argv, f"not a Slurm job id: {job_id[:40]!r}")
    return job_id


def _check_task(argv: Sequence[str], label: str) -> None:
    if not SLURM_TASK_PATTERN.fullmatch(label):
        raise SlurmOutputError(argv, f"not a Slurm array task: {label[:40]!r}")


class Slurm:
    """Runs Slurm's clients for gpuwatchd.

    ``conf``: the slurm.conf the clients read (``SLURM_CONF``; None: the clients' default,
    ``/etc/slurm/slurm.conf``). ``timeout_s``: per client call (default
    :data:`DEFAULT_TIMEOUT_S`). ``env``: the clients' environment (default: the daemon's,
    without systemd's notify socket).
    """

    def __init__(
        self,
        conf: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        base = dict(strip_notify_env(os.environ if env is None else env))
        if conf is not None:
            base["SLURM_CONF"] = conf
        self._env = base
        self._timeout_s = timeout_s

    async def run(self, argv: Sequence[str]) -> str:
        """Run one client ``argv``; its stdout (UTF-8, errors replaced).

        Raises :class:`SlurmUnavailable` (cannot start, timeout: killed),
        :class:`SlurmCommandFailed` (non-zero exit, with the end of stderr),
        :class:`SlurmOutputError` (more than :data:`OUTPUT_MAX_BYTES` on stdout or
        :data:`STDERR_MAX_BYTES` on stderr: killed, nothing parsed).
        """
        import asyncio  # loaded by the running loop; not at import: `gpuwatchd replay` needs none

        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
            )
        except OSError as exc:
            raise SlurmUnavailable(argv, f"cannot run: {exc.strerror or exc}") from None
        try:
            out, err = await asyncio.wait_for(_communicate(argv, proc), self._timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.communicate()  # what the pipes still hold: a pipe buffer at most
            raise SlurmUnavailable(argv, f"no answer in {self._timeout_s:g} s") from None
        except BaseException:
            if proc.returncode is None:
                proc.kill()
            await proc.communicate()
            raise
        if proc.returncode != 0:
            text = err.decode(errors="replace").strip()[-4000:]
            tail = text[-500:] or "no message"
            raise SlurmCommandFailed(argv, f"exit {proc.returncode}: {tail}", text)
        return out.decode(errors="replace")

    # -- arrays ------------------------------------------------------------------------

    async def array_throttle(self, array_job_id: str) -> ArrayThrottle:
        """The throttle of array ``array_job_id`` and how many of its tasks run and wait.

        From ``scontrol show job -o <id>``: one record per task started and one for the
        tasks still pending; every record carries the array's ``ArrayTaskThrottle`` and
        ``UserId``, a started task's its ``BatchHost``. Raises
        :class:`SlurmCommandFailed` (e.g. no such job), :class:`SlurmOutputError` when
        the job is not an array or a field is malformed.
        """
        argv = ["scontrol", "show", "job", "-o", array_job_id]
        _check_id(argv, array_job_id)
        out = await self.run(argv)
        throttle: int | None = None
        running = pending = 0
        user_id: int | None = None
        hosts: set[str] = set()
        for line in out.splitlines():
            if not line.strip():
                continue
            try:
                record = parse_job_record(line)
            except ValueError as exc:
                raise SlurmOutputError(argv, str(exc)) from None
            if record.get("ArrayJobId") != array_job_id:
                raise SlurmOutputError(argv, f"job {array_job_id} is not an array job")
            raw = record.get("ArrayTaskThrottle", "")
            if not raw.isdigit():
                raise SlurmOutputError(argv, f"ArrayTaskThrottle={raw[:20]!r}")
            throttle = int(raw)
            user = _USER_ID_PATTERN.fullmatch(record.get("UserId", ""))
            if user is not None:
                user_id = int(user.group(1))
            host = record.get("BatchHost", "")
            if SLURM_NODE_PATTERN.fullmatch(host):
                hosts.add(host)
            state = record.get("JobState", "")
            if state == "RUNNING":
                running += 1
            elif state == "PENDING":
                pending += _task_count(argv, record.get("ArrayTaskId", ""))
        if throttle is None:
            raise SlurmOutputError(argv, f"no record of job {array_job_id}")
        return ArrayThrottle(
            array_job_id, throttle, running, pending, user_id, tuple(sorted(hosts))
        )

    async def set_array_throttle(self, array_job_id: str, throttle: int) -> None:
        """``scontrol update JobId=<array> ArrayTaskThrottle=<throttle>`` (0: no limit).

        Slurm starts no new task beyond it; running tasks go on. Once some tasks ended,
        scontrol (22.05) exits 1 and answers per task range: ``<id>_0-3: Job has already
        finished`` and ``<id>_4-23: No error`` for the rest, which took the update; that
        is success here. Raises :class:`SlurmCommandFailed` (no such job, not permitted,
        every task ended), :class:`ValueError` for a negative throttle.
        """
        if isinstance(throttle, bool) or throttle < 0:
            raise ValueError(f"a throttle is an integer >= 0, not {throttle!r}")
        argv = ["scontrol", "update", f"JobId={array_job_id}", f"ArrayTaskThrottle={throttle}"]
        _check_id(argv, array_job_id)
        try:
            await self.run(argv)
        except SlurmCommandFailed as exc:
            answers = [line.partition(": ")[2] for line in exc.stderr.splitlines() if line]
            done = ("Job has already finished", "No error")
            if not answers or "No error" not in answers or any(a not in done for a in answers):
                raise

    async def array_tasks(self, array_job_id: str) -> tuple[TaskRecord, ...]:
        """The started tasks of array ``array_job_id`` slurmctld still holds (a task that
        ended longer than ``MinJobAge`` ago is forgotten), from ``scontrol show job -o``;
        the pending remainder's record is left out. Raises :class:`SlurmCommandFailed`
        (``Invalid job id``: an array slurmctld forgot), :class:`SlurmOutputError`."""
        argv = ["scontrol", "show", "job", "-o", array_job_id]
        _check_id(argv, array_job_id)
        return _task_records(argv, await self.run(argv))

    async def task(self, label: str) -> TaskRecord:
        """The array task ``<array>_<task>`` (:data:`SLURM_TASK_PATTERN`) from
        ``scontrol show job -o <label>``. Raises :class:`SlurmCommandFailed` (no such
        task), :class:`SlurmOutputError` (not a started array task)."""
        argv = ["scontrol", "show", "job", "-o", label]
        _check_task(argv, label)
        for task in _task_records(argv, await self.run(argv)):
            if task.label == label:
                return task
        raise SlurmOutputError(argv, f"no record of task {label}")

    async def accounting(self, label: str) -> list[tuple[str, str, str]] | None:
        """The accounting rows of task ``label`` (:func:`parse_sacct_rows`) from
        ``sacct --parsable2 --noheader -j <label> -o JobID,State,ExitCode``, or None where
        the cluster keeps no accounting (``sacct`` answers
        :data:`ACCOUNTING_DISABLED`). Raises :class:`SlurmError` otherwise (slurmdbd
        unreachable: ``SlurmCommandFailed``), :class:`SlurmOutputError` for a bad label."""
        argv = ["sacct", "--parsable2", "--noheader", "-j", label, "-o", "JobID,State,ExitCode"]
        _check_task(argv, label)
        try:
            out = await self.run(argv)
        except SlurmCommandFailed as exc:
            if ACCOUNTING_DISABLED in exc.stderr:
                return None
            raise
        try:
            return parse_sacct_rows(out)
        except ValueError as exc:
            raise SlurmOutputError(argv, str(exc)) from None

    async def requeue(self, job_id: str) -> None:
        """``scontrol requeue <job_id>``: a batch job (an array task's own job id, or
        ``<array>_<task>``: :data:`SLURM_TASK_PATTERN`) goes back to pending and starts
        again (after slurm.conf's ``cred_expire``, 120 s by default), its ``Restarts``
        one more. Raises :class:`SlurmCommandFailed` (not requeueable: ``JobRequeue=0``
        without ``--requeue``; finished longer than ``MinJobAge`` ago)."""
        argv = ["scontrol", "requeue", job_id]
        if not SLURM_TASK_PATTERN.fullmatch(job_id):
            _check_id(argv, job_id)
        await self.run(argv)

    # -- nodes -------------------------------------------------------------------------

    async def drain_node(self, node: str, finding: str) -> str:
        """``scontrol update NodeName=<node> State=DRAIN Reason="gpuwatchd: <finding>"``:
        Slurm starts no new job there; running ones go on. Returns the reason set.
        Raises :class:`SlurmCommandFailed`, :class:`ValueError` for a bad node name."""
        _check_node(node)
        reason = drain_reason(finding)
        await self.run(
            ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]
        )
        return reason

    async def resume_node(self, node: str) -> None:
        """``scontrol update NodeName=<node> State=RESUME``: back in service. Raises
        :class:`SlurmCommandFailed` (e.g. the node was not drained)."""
        _check_node(node)
        await self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])

    async def node_state(self, node: str) -> tuple[str, str]:
        """``(state, reason)`` of ``node`` from ``sinfo -h -N -n <node> -o %T|%E``: the
        long state (``idle``, ``drained``, ``draining``, ``mixed``...) and the reason
        (``none`` when there is none). Raises :class:`SlurmOutputError` for an unknown node."""
        _check_node(node)
        argv = ["sinfo", "-h", "-N", "-n", node, "-o", "%N|%T|%E"]
        for name, state, reason in _rows(argv, await self.run(argv), 3):
            if name == node:
                return state, reason
        raise SlurmOutputError(argv, f"no node {node!r}")

    async def drained_by_gpuwatchd(self) -> tuple[str, ...]:
        """Names of the nodes drained or draining with a gpuwatchd reason (starting with
        :data:`DRAIN_REASON_PREFIX`), sorted: what the cluster-wide drain cap counts.
        From ``sinfo -h -N -t drain -o %N|%E`` (every node in a draining or drained state)."""
        argv = ["sinfo", "-h", "-N", "-t", "drain", "-o", "%N|%E"]
        names = {
            name
            for name, reason in _rows(argv, await self.run(argv), 2)
            if reason.startswith(DRAIN_REASON_PREFIX)
        }
        return tuple(sorted(names))


async def _communicate(
    argv: Sequence[str], proc: asyncio.subprocess.Process
) -> tuple[bytes, bytes]:
    """``proc``'s stdout and stderr, each bounded (:func:`_read_bounded`), once it exited.
    On an error or cancellation both readers are stopped before it propagates (the caller
    then kills ``proc`` and drains what its pipes still hold)."""
    import asyncio

    readers = [
        asyncio.ensure_future(_read_bounded(argv, proc.stdout, "stdout", OUTPUT_MAX_BYTES)),
        asyncio.ensure_future(_read_bounded(argv, proc.stderr, "stderr", STDERR_MAX_BYTES)),
    ]
    try:
        out, err = await asyncio.gather(*readers)
    except BaseException:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        raise
    await proc.wait()
    return out, err


async def _read_bounded(
    argv: Sequence[str], stream: asyncio.StreamReader | None, what: str, limit: int
) -> bytes:
    """All of ``stream`` up to EOF; raises :class:`SlurmOutputError` past ``limit`` bytes."""
    data = bytearray()
    while stream is not None and (chunk := await stream.read(_READ_CHUNK_BYTES)):
        data += chunk
        if len(data) > limit:
            raise SlurmOutputError(argv, f"more than {limit} bytes on {what}")
    return bytes(data)


def _task_records(argv: Sequence[str], out: str) -> tuple[TaskRecord, ...]:
    """The :class:`TaskRecord` of each started array task in ``scontrol show job -o``'s
    ``out`` (one record a line; other records left out)."""
    return tuple(
        task
        for line in out.splitlines()
        if line.strip() and (task := _task_record(argv, line)) is not None
    )


def _exit_code(text: str) -> tuple[int | None, int | None]:
    """``(status, signal)`` of an ``ExitCode`` (``<status>:<signal>``, scontrol's and
    sacct's), each None when not a decimal number."""
    status, _, sig = text.partition(":")
    return (int(status) if status.isdigit() else None, int(sig) if sig.isdigit() else None)


def _task_record(argv: Sequence[str], line: str) -> TaskRecord | None:
    """The :class:`TaskRecord` of one ``scontrol show job -o`` line, None for a record
    that is not one started array task (a pending remainder ``4-23%4``, a plain job)."""
    try:
        record = parse_job_record(line)
    except ValueError as exc:
        raise SlurmOutputError(argv, str(exc)) from None
    job_id, array = record["JobId"], record.get("ArrayJobId", "")
    task = record.get("ArrayTaskId", "")
    if not task.isdigit() or not SLURM_ID_PATTERN.fullmatch(array):
        return None
    if not SLURM_ID_PATTERN.fullmatch(job_id):
        raise SlurmOutputError(argv, f"JobId={job_id[:20]!r}")
    status, sig = _exit_code(record.get("ExitCode", ""))
    user = _USER_ID_PATTERN.fullmatch(record.get("UserId", ""))
    restarts = record.get("Restarts", "0")
    host = record.get("BatchHost", "")
    return TaskRecord(
        job_id=job_id,
        array_job_id=array,
        array_task_id=int(task),
        state=record.get("JobState", ""),
        exit_status=status,
        signal=sig,
        restarts=int(restarts) if restarts.isdigit() else 0,
        user_id=int(user.group(1)) if user is not None else None,
        batch_host=host if SLURM_NODE_PATTERN.fullmatch(host) else "",
        stdout_path=record.get("StdOut", ""),
        stderr_path=record.get("StdErr", ""),
    )


def _check_node(node: str) -> None:
    if not SLURM_NODE_PATTERN.fullmatch(node):
        raise ValueError(f"not a Slurm node name: {node[:70]!r}")


def _rows(argv: Sequence[str], out: str, fields: int) -> list[list[str]]:
    """``|``-separated rows of ``fields`` fields (the last one may hold ``|``)."""
    rows = []
    for line in out.splitlines():
        if not line.strip():
            continue
        row = line.split("|", fields - 1)
        if len(row) != fields:
            raise SlurmOutputError(argv, f"expected {fields} fields: {line[:80]!r}")
        rows.append(row)
    return rows


def _task_count(argv: Sequence[str], spec: str) -> int:
    """Tasks in an ``ArrayTaskId`` expression such as ``4-23%4`` or ``1,3,5-7``."""
    total = 0
    for part in spec.split("%", 1)[0].split(","):
        low, dash, high = part.partition("-")
        step = 1
        if ":" in high:
            high, _, raw_step = high.partition(":")
            step = int(raw_step) if raw_step.isdigit() and int(raw_step) > 0 else 0
        if not low.isdigit() or (dash and not high.isdigit()) or step == 0:
            raise SlurmOutputError(argv, f"ArrayTaskId={spec[:40]!r}")
        total += (int(high) - int(low)) // step + 1 if dash else 1
    return total
