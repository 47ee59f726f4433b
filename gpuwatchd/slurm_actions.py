"""Decisions carried out through Slurm: the parallelism ladder of an attached Slurm array
(its ``ArrayTaskThrottle``), the drain of this node and the requeue of a crashed task, each
read back from slurmctld and decided idempotently, so daemons on several nodes converge;
and the crashes of array tasks that died without their hook's word, read from Slurm.
Specification: docs/slurm.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from gpuwatchd.config import SlurmArrayConfig
from gpuwatchd.crash import SLURM_FAILED_STATES, classify_slurm_task
from gpuwatchd.errors import ActionRefused, ConfigError
from gpuwatchd.jobs.attribution import TRIALS_KEPT
from gpuwatchd.jobs.study_recovery import StudyRecovery, describe_requeue
from gpuwatchd.model import Decision, JobEvent, JobInfo
from gpuwatchd.slurm import (
    SLURM_NODE_PATTERN,
    ArrayThrottle,
    Slurm,
    SlurmCommandFailed,
    SlurmError,
    SlurmOutputError,
    TaskRecord,
)

__all__ = [
    "ARRAYS_KEPT",
    "OUTPUT_TAIL_BYTES",
    "SCAN_EVERY_S",
    "SlurmActions",
    "node_name",
    "read_output_tail",
    "this_node",
]

ARRAYS_KEPT: Final = 8
"""Slurm arrays remembered per job name (the newest seen): a ladder decision acts on those
still pending or running, also between two tasks, when none is attached."""
SCAN_EVERY_S: Final = 2.0
"""Seconds between two reads of the known arrays' tasks for crashes (one
``scontrol show job -o`` per array); a task is taken as crashed on the second read that
finds it ended (its hook's crash report, sent before it exited, is in by then)."""
OUTPUT_TAIL_BYTES: Final = 64 * 1024
"""Bytes read at most from the end of a crashed task's stderr file (a Python traceback
and CUDA's assert lines fit many times over)."""
REQUEUE_WAIT_S: Final = 30.0
"""How long ``requeue_task`` waits for a task its hook reported crashed to leave
``RUNNING``/``COMPLETING`` (the process exits right after the report), and for a
``restart_study`` of the same crash to end (the daemon's first imports Optuna: seconds)."""
_KEPT: Final = 4096
"""Tasks remembered (seen ended, handled, reported by their hook), the oldest dropped."""
_ERRORS_KEPT: Final = ARRAYS_KEPT * 4
"""Arrays and tasks whose last scan failure is remembered (logged once while the same)."""
_LIVE_STATES: Final = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"})


def read_output_tail(path: str, user_id: int, max_bytes: int = OUTPUT_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of a task's output file ``path`` (UTF-8, errors replaced).

    The path comes from the task's owner (``sbatch -o``) and the daemon reads as root, so
    it is opened without following a symbolic link and read only if it is a regular file
    owned by ``user_id`` (the task's ``UserId``): a task cannot have another user's file
    (``/etc/shadow``) quoted in the journal. Raises :class:`OSError` (missing, a link)
    and :class:`PermissionError` (another owner, not a regular file).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{path}: not a regular file")
        if info.st_uid != user_id:
            raise PermissionError(f"{path}: owned by uid {info.st_uid}, not the task's {user_id}")
        return os.pread(fd, max_bytes, max(0, info.st_size - max_bytes)).decode(errors="replace")
    finally:
        os.close(fd)


def this_node() -> str:
    """This host's short name (``hostname -s``): Slurm's ``NodeName`` by default."""
    return socket.gethostname().split(".", 1)[0]


def node_name(configured: str | None, config_path: str | None) -> str:
    """The ``NodeName`` the daemon acts on: ``slurm.node`` of the config at
    ``config_path``, else :func:`this_node`. Raises :class:`~gpuwatchd.errors.ConfigError`
    (naming the config file) when it is not a Slurm node name
    (:data:`~gpuwatchd.slurm.SLURM_NODE_PATTERN`): found at startup, not when a drain or
    resume would run ``scontrol``."""
    node = configured or this_node()
    if not SLURM_NODE_PATTERN.fullmatch(node):
        source = "slurm.node" if configured else "this host's name"
        raise ConfigError(
            f"{source} {node[:70]!r} is not a Slurm node name: set slurm.node",
            path=config_path,
        )
    return node


class SlurmActions:
    """Carries out ``lower_parallelism``/``raise_parallelism`` on Slurm arrays,
    ``restart_study``/``requeue_task`` on their crashed tasks and ``drain_node``/the
    operator's resume on this node; and reads the arrays' tasks for crashes no hook
    reported (:meth:`start_scan`, :meth:`take_events`).

    ``slurm``: the client (:class:`gpuwatchd.slurm.Slurm`). ``arrays``: the configured
    arrays by job name (``slurm.arrays``); the array ids come from the attached jobs'
    hellos, fed each tick to :meth:`observe`. ``node``: this node's ``NodeName``
    (:func:`node_name`; :class:`ValueError` for one that is not). ``max_drained_nodes``:
    the cluster-wide cap on nodes drained with gpuwatchd's reason. ``study``: the Optuna
    storage access for ``restart_study`` (the arrays' ``optuna:``). ``logger``:
    structlog-style. ``clock``: seconds (monotonic), when a throttle was seen lowered,
    for the arrays' ``raise_hold``, and when the last crash scan started
    (:data:`SCAN_EVERY_S`).
    """

    def __init__(
        self,
        slurm: Slurm,
        arrays: Mapping[str, SlurmArrayConfig],
        *,
        node: str,
        max_drained_nodes: int,
        logger: Any,
        study: StudyRecovery | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not SLURM_NODE_PATTERN.fullmatch(node):
            raise ValueError(f"not a Slurm node name: {node[:70]!r}")
        self._study = study
        self._slurm = slurm
        self._arrays = dict(arrays)
        self._trials: OrderedDict[int, tuple[int, bool]] = OrderedDict()
        """Task pid -> (its latest trial, whether that trial may be the one it died in:
        running, or ended FAIL), from reports and ``trial`` events."""
        self._seen: dict[str, list[str]] = {name: [] for name in arrays}
        """Job name -> array ids its tasks named, newest last (at most ARRAYS_KEPT)."""
        self._namers: dict[str, set[int]] = {}
        """Array id (of ``_seen``) -> the peer uids (``SO_PEERCRED``) of the hellos that
        named it: the array is acted on only if it runs as one of them."""
        self._throttles: dict[str, tuple[int, float]] = {}
        """Array id -> (the throttle this node last read or set, as a task count; when
        this node last lowered it or saw it lower than before, clock seconds or -inf)."""
        self._clock = clock
        self.node = node
        self._cap = max_drained_nodes
        self._log = logger
        self._labels: OrderedDict[int, str] = OrderedDict()
        """Task pid -> its ``<array>_<task>`` (hellos), newest last."""
        self._hook_crashed: OrderedDict[str, None] = OrderedDict()
        """Tasks whose hook reported their crash: the scan posts none of its own."""
        self._ended: OrderedDict[tuple[str, int], bool] = OrderedDict()
        """(task, Restarts) found ended in a failed state -> whether handled (False: seen
        once, decided on the next scan)."""
        self._scanned: OrderedDict[str, None] = OrderedDict()
        """Arrays read once: a failed task found on the first read, of no hello seen
        here, ended before this daemon knew the array and is left alone."""
        self._events: list[JobEvent] = []
        self._scan: asyncio.Task[None] | None = None
        self._last_scan_s: float | None = None
        """When the last crash scan started, clock seconds (None: none yet)."""
        self._accounting: bool | None = None
        """Whether ``sacct`` answers here (None: not asked yet)."""
        self._scan_errors: OrderedDict[str, str] = OrderedDict()
        """Array or task -> the last scan failure logged for it (logged once while the
        same), at most :data:`_ERRORS_KEPT`."""
        self._recovering: dict[tuple[str, int], asyncio.Event] = {}
        """(job, trial) -> set once the ``restart_study`` in progress on it ended."""

    def owns(self, job: str) -> bool:
        """Whether ``job`` is a configured Slurm array (its ladder moves a throttle)."""
        return job in self._arrays

    def observe(self, jobs: Sequence[JobInfo]) -> None:
        """Remember the arrays the attached ``jobs`` of configured names run in, with the
        peer uid of each hello that named one, and the trial each reports running."""
        for info in jobs:
            seen = self._seen.get(info.name)
            if seen is not None and info.slurm is not None and info.slurm.array_job_id:
                _remember(self._labels, info.pid, info.slurm.label())
            trial, known = info.trial_number, self._trials.get(info.pid)
            if seen is not None and trial is not None and (known is None or known[0] != trial):
                self._note(info.pid, trial, True)  # a new trial reported running
            if seen is None or info.slurm is None or info.slurm.array_job_id is None:
                continue
            array = info.slurm.array_job_id
            if info.uid is not None:
                self._namers.setdefault(array, set()).add(info.uid)
            if seen and seen[-1] == array:
                continue
            if array in seen:
                seen.remove(array)
            seen.append(array)
            for gone in seen[:-ARRAYS_KEPT]:
                self._forget(info.name, gone)

    def _forget(self, job: str, array: str) -> None:
        self._seen[job].remove(array)
        if not any(array in seen for seen in self._seen.values()):
            self._namers.pop(array, None)
            self._throttles.pop(array, None)

    def note_events(self, events: Iterable[JobEvent]) -> None:
        """Remember the trial each task of a configured array ended (``trial`` events):
        one that ended ``FAIL`` is the one a crash right after it died in; and the tasks
        whose hook reported their crash (``crash`` events, the task its hello named), of
        which the crash scan posts none of its own."""
        for event in events:
            label = event.slurm_job
            if label is None and event.pid is not None:
                label = self._labels.get(event.pid)
            if event.kind == "crash" and label is not None and event.job in self._seen:
                _remember(self._hook_crashed, label, None)
            if (
                event.kind == "trial"
                and event.job in self._seen
                and event.pid is not None
                and event.trial_number is not None
            ):
                self._note(event.pid, event.trial_number, event.trial_state == "FAIL")

    def _note(self, pid: int, trial: int, crashed_in: bool) -> None:
        self._trials[pid] = (trial, crashed_in)
        self._trials.move_to_end(pid)
        while len(self._trials) > TRIALS_KEPT:
            self._trials.popitem(last=False)

    def array_ids(self, job: str) -> tuple[str, ...]:
        """The array job ids ``job``'s tasks named (:meth:`observe`), oldest first."""
        return tuple(self._seen.get(job, ()))

    async def set_parallelism(self, job: str, to: int, lowering: bool) -> str:
        """Move the throttle of each array ``job``'s tasks belong to toward ``to``,
        clamped to the array's ``min_workers``..``max_workers``.

        The throttle slurmctld holds is the state: lowering never raises it and raising
        never lowers it, so a throttle another node already moved past ``to`` is left as
        it is (a no-op, said in the detail); each change is read back. An array Slurm no
        longer knows, or whose tasks all ended, is forgotten. An array is changed only if
        it runs as the uid of a hello that named it (any member of the socket's group may
        name any array id in a hello) and slurmctld knows a task of it that ran on this
        node (``BatchHost``); otherwise it is left alone and the refusal said in the
        detail (logged ``slurm.array_refused``). A raise is held (refused, logged
        ``slurm.raise_held``) within the array's ``raise_hold`` of its last lower: one this
        node carried out, moved or found done already, or a throttle this node read lower
        than it last read or set it (another node lowered it). Returns the detail (one
        line per array, ``;``-joined). Raises :class:`~gpuwatchd.errors.ActionRefused`
        when no array of ``job`` has tasks left or every one was refused or held,
        :class:`~gpuwatchd.slurm.SlurmError` when Slurm fails or reads back another value.
        """
        config = self._arrays[job]
        target = max(config.min_workers, min(config.max_workers, to))
        details, refusals = [], []
        for array in self.array_ids(job):
            try:
                now = await self._slurm.array_throttle(array)
            except SlurmCommandFailed as exc:
                if "Invalid job id" not in exc.message:
                    raise
                now = None
            if now is None or now.running + now.pending == 0:
                self._forget(job, array)
                continue
            refused = self._refusal(now)
            if refused is not None:
                self._log.warning("slurm.array_refused", job=job, array=array, reason=refused)
                refusals.append(f"array {array}: not changed: {refused}")
                continue
            current = now.throttle or config.max_workers  # 0: no limit
            held = self._held(array, current, lowering, config.raise_hold_s)
            moves = target < current if lowering else target > current
            if moves and held is not None:
                self._log.info("slurm.raise_held", job=job, array=array, reason=held)
                refusals.append(f"array {array}: ArrayTaskThrottle {now.throttle} held: {held}")
                continue
            if not moves:
                details.append(
                    f"array {array}: ArrayTaskThrottle already {now.throttle} "
                    f"({'at or below' if lowering else 'at or above'} {target})"
                )
                continue
            await self._slurm.set_array_throttle(array, target)
            after = await self._slurm.array_throttle(array)
            if after.throttle != target:
                raise SlurmOutputError(
                    ["scontrol", "show", "job", array],
                    f"ArrayTaskThrottle reads {after.throttle} after setting {target}",
                )
            self._throttles[array] = (target, self._throttles[array][1])
            self._log.info(
                "slurm.throttle_set", job=job, array=array, previous=now.throttle, throttle=target
            )
            details.append(f"array {array}: ArrayTaskThrottle {now.throttle} -> {target}")
        if not details:
            raise ActionRefused(
                "; ".join(refusals) or f"no Slurm array of job {job!r} has tasks left"
            )
        return "; ".join(details + refusals)

    def _held(self, array: str, current: int, lowering: bool, hold_s: float) -> str | None:
        """Note the throttle ``current`` read of ``array`` (a lowering, or a value below
        the last one this node read or set, is a lower now); why a raise of it is held
        now, or None when it is not (``hold_s``: the array's ``raise_hold``)."""
        now_s = self._clock()
        last, lowered_s = self._throttles.get(array, (current, -math.inf))
        if lowering or current < last:
            lowered_s = now_s
        self._throttles[array] = (current, lowered_s)
        if lowering or now_s - lowered_s >= hold_s:
            return None
        return f"lowered {now_s - lowered_s:.0f} s ago, within raise_hold {hold_s:g} s"

    def _refusal(self, array: ArrayThrottle) -> str | None:
        """Why ``array`` may not be changed from this node, or None if it may."""
        return self._foreign(array.array_job_id, array.user_id, array.hosts)

    def _foreign(self, array: str, user_id: int | None, hosts: Sequence[str]) -> str | None:
        """Why array ``array`` running as ``user_id`` with tasks on ``hosts`` is not this
        node's to act on (no hello of that uid named it, or no task ran here), or None."""
        namers = sorted(self._namers.get(array, ()))
        if user_id is None or user_id not in namers:
            return (
                f"it runs as uid {user_id}, not as the uid of a task attached here "
                f"({', '.join(map(str, namers)) or 'none known'})"
            )
        if self.node not in hosts:
            return f"no task of it is known to run on node {self.node}"
        return None

    async def restart_study(self, decision: Decision) -> str:
        """Fail the crashed task's trial (``params["trial_number"]``, else the trial its
        hook last reported running or ending FAIL) in the array's study and re-enqueue its
        params, at most ``min(params["max_retries"],
        optuna.max_retries)`` times in a chain; a later task of the array runs it (Slurm
        starts the next task itself). Returns the detail; raises
        :class:`~gpuwatchd.errors.ActionRefused` without the array's ``optuna:`` or a
        trial number, :class:`~gpuwatchd.errors.StudyError` when the storage fails."""
        params = decision.params
        job = str(params.get("job") or decision.job or "")
        config = self._arrays[job]
        trial = self._crashed_trial(decision)
        if config.optuna is None or self._study is None:
            raise ActionRefused(f"Slurm array {job!r} has no optuna: to recover trials in")
        if trial is None:
            raise ActionRefused(f"the crashed task of {job!r} named no trial")
        asked = params.get("max_retries", config.optuna.max_retries)
        retries = min(int(asked) if isinstance(asked, int) else 0, config.optuna.max_retries)
        reason = str(params.get("crash_kind") or "other")
        done = self._recovering.setdefault((job, trial), asyncio.Event())
        try:
            results = await self._study.fail_and_requeue(
                config.optuna, [trial], max_retries=retries, reason=reason
            )
        finally:
            done.set()
            self._recovering.pop((job, trial), None)
        return "; ".join(describe_requeue(result, retries) for result in results)

    def _crashed_trial(self, decision: Decision) -> int | None:
        """The trial a crash decision is about: ``params["trial_number"]``, else the one
        the task's hook last reported running or ending FAIL; None if neither."""
        trial = decision.params.get("trial_number")
        pid = decision.params.get("pid")
        if trial is None and isinstance(pid, int) and pid in self._trials:
            last, crashed_in = self._trials[pid]
            trial = last if crashed_in else None
        return trial if isinstance(trial, int) and not isinstance(trial, bool) else None

    # -- crashed tasks ---------------------------------------------------------------

    def start_scan(self, now: float) -> None:
        """Start a read of the known arrays' tasks for crashes (:meth:`scan_crashes`) when
        :data:`SCAN_EVERY_S` passed on the monotonic ``clock`` since the last started and
        none runs; the tick calls it with its time (wall-clock seconds, the crash events'
        timestamp only: a step of the wall clock neither starts nor holds back a scan).
        Needs a running loop (else nothing happens)."""
        if self._scan is not None and not self._scan.done():
            return
        started_s = self._clock()
        if self._last_scan_s is not None and started_s - self._last_scan_s < SCAN_EVERY_S:
            return
        if not any(self._seen.values()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._last_scan_s = started_s
        self._scan = loop.create_task(self.scan_crashes(now), name="gpuwatchd-slurm-scan")

    def take_events(self) -> tuple[JobEvent, ...]:
        """The ``crash`` events of tasks that died without their hook's word, posted by
        the scans since the last call (for the tick's snapshot)."""
        taken, self._events = tuple(self._events), []
        return taken

    async def close(self) -> None:
        """Stop a scan in progress (the daemon's stop)."""
        if self._scan is not None and not self._scan.done():
            self._scan.cancel()
            await asyncio.gather(self._scan, return_exceptions=True)

    async def scan_crashes(self, now: float) -> None:
        """Read each known array's tasks (:meth:`Slurm.array_tasks`) and post a ``crash``
        event (:meth:`take_events`) for each task of this node that ended ``FAILED`` or
        ``OUT_OF_MEMORY`` (:data:`~gpuwatchd.crash.SLURM_FAILED_STATES`) without its hook
        reporting the crash: found so on two scans in a row, classified from Slurm
        (:meth:`classify_task`), once per task and ``Restarts``. A task already ended on
        an array's first scan counts only if its hello was seen here. Only arrays that run as
        the uid of a hello that named them count; one slurmctld forgot is forgotten. A
        Slurm failure is logged (``slurm.scan_failed``, once while it says the same) and
        the next scan tries again. ``now``: the events' time."""
        for job, arrays in list(self._seen.items()):
            for array in list(arrays):
                try:
                    tasks = await self._slurm.array_tasks(array)
                except SlurmCommandFailed as exc:
                    if "Invalid job id" in exc.message:  # slurmctld forgot it (MinJobAge)
                        self._forget(job, array)
                        continue
                    self._scan_failed(array, job=job, array=array, error=str(exc))
                    continue
                except SlurmError as exc:
                    self._scan_failed(array, job=job, array=array, error=str(exc))
                    continue
                self._scan_errors.pop(array, None)
                first = array not in self._scanned
                _remember(self._scanned, array, None)
                for task in tasks:
                    await self._check_task(job, task, now, first)

    def _scan_failed(self, key: str, **fields: str) -> None:
        """Log ``slurm.scan_failed`` for ``key`` (an array, a task) unless the last
        failure of that key said the same: a controller down for an hour is one line."""
        if self._scan_errors.get(key) != fields["error"]:
            _remember(self._scan_errors, key, fields["error"], _ERRORS_KEPT)
            self._log.warning("slurm.scan_failed", **fields)

    async def _check_task(self, job: str, task: TaskRecord, now: float, first: bool) -> None:
        key = (task.label, task.restarts)
        if task.state not in SLURM_FAILED_STATES or self._ended.get(key, False):
            return
        if first and task.label not in self._labels.values():
            _remember(self._ended, key, True)  # ended before this daemon knew the array
            return
        if self._foreign(task.array_job_id, task.user_id, (task.batch_host,)) is not None:
            return
        if key not in self._ended:
            _remember(self._ended, key, False)  # decided on the next scan
            return
        _remember(self._ended, key, True)
        if task.label in self._hook_crashed:
            del self._hook_crashed[task.label]
            return  # its hook reported the crash: that event is the one
        kind, reason, evidence = await self.classify_task(task)
        pid = next((p for p, label in self._labels.items() if label == task.label), None)
        known = self._trials.get(pid) if pid is not None else None
        trial = known[0] if known is not None and known[1] else None
        self._log.warning(
            "slurm.task_crashed",
            job=job,
            task=task.label,
            state=task.state,
            crash_kind=kind,
            reason=reason,
            evidence=evidence,
        )
        message = f"Slurm task {task.label}: {reason}" + (f"; {evidence}" if evidence else "")
        self._events.append(
            JobEvent(now, job, "crash", pid, kind, trial, None, None, message[:500], task.label)
        )

    async def classify_task(self, task: TaskRecord) -> tuple[str, str, str]:
        """``(crash kind, reason, evidence)`` of a task that ended failed: its state and
        exit code from ``sacct`` where accounting exists (asked once; its absence logged
        ``slurm.accounting_absent``, then ``scontrol``'s record alone), its stderr's tail
        (:func:`read_output_tail`; unreadable: logged ``slurm.output_unreadable``,
        classified without it), through :func:`gpuwatchd.crash.classify_slurm_task`."""
        state, returncode = task.state, task.returncode
        if self._accounting is not False:
            try:
                rows = await self._slurm.accounting(task.label)
            except SlurmError as exc:
                self._scan_failed(task.label, task=task.label, error=str(exc))
                rows = []
            if rows is None:
                self._accounting = False
                self._log.info("slurm.accounting_absent", task=task.label)
            else:
                self._accounting = True
                accounted = task.accounted(rows)
                state, returncode = accounted.state, accounted.returncode
        tails = []
        for path in task.output_paths():
            try:
                if task.user_id is None:
                    raise PermissionError("the task's UserId is unknown")
                tails.append(await asyncio.to_thread(read_output_tail, path, task.user_id))
            except OSError as exc:
                self._log.warning(
                    "slurm.output_unreadable", task=task.label, path=path, error=str(exc)
                )
        info = classify_slurm_task(state, returncode, "\n".join(tails))
        return info.kind, info.reason, info.evidence

    async def requeue_task(self, decision: Decision) -> str:
        """Requeue the crashed task (``params["slurm_job"]``, else the task of
        ``params["pid"]``'s hello) with ``scontrol requeue <array>_<task>``: it starts
        again (``Restarts`` one more), runs the next trial of its study. Waits up to
        :data:`REQUEUE_WAIT_S` for a task still ``RUNNING`` to end, and as long for a
        ``restart_study`` of the same crash in progress (so that the requeued task finds
        its trial re-enqueued). Returns the detail;
        raises :class:`~gpuwatchd.errors.ActionRefused` when no task is known, the array
        is not this node's (as for the ladder), the task runs on, or it was requeued
        ``params["max_requeues"]`` times already; :class:`~gpuwatchd.slurm.SlurmError`
        when Slurm fails (e.g. the task is not requeueable)."""
        params = decision.params
        pid = params.get("pid")
        label = params.get("slurm_job")
        if not isinstance(label, str):
            label = self._labels.get(pid) if isinstance(pid, int) else None
        if label is None:
            raise ActionRefused(f"the crashed worker of {decision.job!r} named no Slurm task")
        task = await self._slurm.task(label)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REQUEUE_WAIT_S
        while task.state in _LIVE_STATES and loop.time() < deadline:
            await asyncio.sleep(0.5)
            task = await self._slurm.task(label)
        refused = self._foreign(task.array_job_id, task.user_id, (task.batch_host,))
        if refused is not None:
            self._log.warning("slurm.array_refused", job=decision.job, array=label, reason=refused)
            raise ActionRefused(f"task {label} not requeued: {refused}")
        if task.state in _LIVE_STATES:
            raise ActionRefused(f"task {label} is still {task.state} after {REQUEUE_WAIT_S:g} s")
        limit = params.get("max_requeues", 1)
        if isinstance(limit, int) and task.restarts >= limit:
            raise ActionRefused(
                f"task {label} was requeued {task.restarts} time(s) already (max_requeues {limit})"
            )
        trial = self._crashed_trial(decision)
        job = str(params.get("job") or decision.job or "")
        recovery = self._recovering.get((job, trial)) if trial is not None else None
        if recovery is not None:  # the requeued task is to find its trial re-enqueued
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(recovery.wait(), REQUEUE_WAIT_S)
        await self._slurm.requeue(label)
        after = await self._slurm.task(label)
        self._log.warning(
            "slurm.task_requeued",
            job=decision.job,
            task=label,
            was=task.state,
            state=after.state,
            restarts=after.restarts,
        )
        return (
            f"task {label} requeued ({task.state}, exit {task.exit_status}:{task.signal}): "
            f"now {after.state}, restart {after.restarts}"
        )

    async def drain(self, finding: str) -> str:
        """Drain this node with reason ``gpuwatchd: <finding>``, unless the cluster-wide
        cap is reached: the nodes drained with gpuwatchd's reason, read from Slurm (this
        one aside), number ``max_drained_nodes`` already. Returns the detail; raises
        :class:`~gpuwatchd.errors.ActionRefused` at the cap or when this node is drained
        by gpuwatchd already, :class:`~gpuwatchd.slurm.SlurmError` when Slurm fails."""
        drained = await self._slurm.drained_by_gpuwatchd()
        if self.node in drained:
            raise ActionRefused(f"node {self.node} is drained by gpuwatchd already")
        if len(drained) >= self._cap:
            raise ActionRefused(
                f"{len(drained)} node(s) drained by gpuwatchd already ({', '.join(drained)}); "
                f"the cap (slurm.max_drained_nodes) is {self._cap}"
            )
        reason = await self._slurm.drain_node(self.node, finding)
        self._log.warning("slurm.node_drained", node=self.node, reason=reason)
        return f"node {self.node} drained: {reason}"

    async def resume(self) -> str:
        """Return this node to service (``State=RESUME``); the detail. Raises
        :class:`~gpuwatchd.slurm.SlurmError` (e.g. the node was not drained)."""
        await self._slurm.resume_node(self.node)
        state, _ = await self._slurm.node_state(self.node)
        self._log.info("slurm.node_resumed", node=self.node, state=state)
        return f"node {self.node} resumed: {state}"


def _remember(kept: OrderedDict[Any, Any], key: Any, value: Any, most: int = _KEPT) -> None:
    """Set ``kept[key]`` as the newest, dropping the oldest beyond ``most`` entries."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > most:
        kept.popitem(last=False)
