"""The composition root: wires samplers, the policy engine, actuators and the control socket.

One tick (an APScheduler interval job on the asyncio loop, default every 1 s)
samples the GPUs and the host, hands the snapshot to the policy engine, carries
out its decisions and pings the systemd watchdog. Because the tick runs on the
loop, a stuck loop stops the pings and systemd restarts the daemon
(``WatchdogSec=``, systemd.service(5)).

Every tick whose findings start or clear, or that decides anything, is written to the
action journal (:mod:`gpuwatchd.journal`, ``<state_dir>/journal.sqlite3``) in one
transaction *before* the actuator acts; a quiet tick writes nothing. At start the
daemon closes what a killed predecessor left open and restores the policy engine's
cooldowns, rate limits and ladders from the journaled decisions, so a restart neither
repeats an action nor forgets one. If a tick's journal write fails, its decisions are
not carried out (no action without a record) and ``status`` shows the error.

Managed jobs (``jobs:`` of the config) run under a
:class:`~gpuwatchd.supervisor.Supervisor` started once the journal is restored: each job
starts as many workers as its restored ladder position (the latest real
``lower_parallelism``/``raise_parallelism`` decision), workers a killed predecessor left
running are adopted (``<state_dir>/jobs/<job>/workers.json``), and a SIGTERM drains,
stops or leaves them per the job's ``on_daemon_stop``. A worker that dies is classified by
the supervisor; the daemon then fails its Optuna trial at once (so none stays RUNNING)
and, unless the daemon stopped it itself, turns it into a ``crash`` job event for the
next tick (``job_crashed``); the crash waits in ``<state_dir>/crashes-pending.json`` until
a tick has journaled it, so a daemon killed in between neither loses it nor, after its
restart, acts on it twice. The hook's own ``crash`` event of a managed worker only feeds
the classification (the supervisor reports that death).

Signals are turned into events the main loop handles: SIGTERM/SIGINT stop,
SIGHUP reloads the policies. Only :mod:`gpuwatchd.cli` imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import json
import math
import os
import signal
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from gpuwatchd import __version__
from gpuwatchd.actuators import Actuator, DecisionRecord, StudyRecovery, SupervisorActions
from gpuwatchd.config import DEFAULT_POLICY_DIR, JobConfig, Settings
from gpuwatchd.control.protocol import ErrorCode, Request
from gpuwatchd.control.server import ControlServer, PeerCredentials
from gpuwatchd.crash import CrashInfo, CrashKind
from gpuwatchd.errors import (
    ControlError,
    GpuwatchError,
    JournalError,
    NvmlUnavailable,
    PolicyError,
    ProtocolError,
)
from gpuwatchd.journal import JOURNAL_FILENAME, Journal, Outcome
from gpuwatchd.logs import get_logger
from gpuwatchd.model import (
    Decision,
    Finding,
    GpuSample,
    HostSample,
    JobEvent,
    JobInfo,
    Snapshot,
)
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policy.schema import PolicySet
from gpuwatchd.policyfiles import default_policy_path, load_policies
from gpuwatchd.sampling import GpuSampler
from gpuwatchd.sampling.host import HostSampler
from gpuwatchd.statefile import write_json_atomic
from gpuwatchd.supervisor import Supervisor, WorkerCrash
from gpuwatchd.systemd import Notifier
from gpuwatchd.xid import XidEvent, XidLog

__all__ = ["Daemon", "HostOnlySampler", "TickStats", "open_gpu_sampler", "resolve_policy_paths"]

_RECENT_DECISIONS = 50
EVENTS_DEFAULT_LIMIT = 100
"""``events`` op: events per reply when the request names no ``limit``."""
EVENTS_MAX_LIMIT = 1000
"""``events`` op: the largest ``limit`` accepted."""
_EVENTS_REPLY_BUDGET_BYTES = 56 * 1024
_MAX_FAILED_TICKS_IN_ROW = 30
"""After this many failed ticks in a row the watchdog pings stop (WatchdogSec= restarts us)."""
_STATUS_REPLY_BUDGET_BYTES = 56 * 1024
"""Under protocol.MAX_LINE_BYTES (64 KiB) with room for the reply's envelope."""
_RECENT_XID_EVENTS = 20
"""``status``: the last Xid events shown (the daemon keeps :data:`gpuwatchd.xid.XID_LOG_SIZE`)."""


def _json_size(value: Any) -> int:
    """Bytes of ``value`` as a protocol line would carry it (NA and the like as null)."""
    return len(json.dumps(value, separators=(",", ":"), default=lambda _: None).encode())


"""Encoded events per ``events`` reply, below the protocol's 64 KiB line limit with room
for the envelope; a reply cut short says ``more: true``."""
_PRUNE_EVERY_S = 86400.0
"""The journal is pruned at start and then once a day."""
CRASH_LEDGER_FILENAME = "crashes-pending.json"
"""Worker crashes not yet journaled by a tick (``<state_dir>/crashes-pending.json``)."""
_DRAIN_ACK_TIMEOUT_S = 6 * 3600.0
"""``lower_parallelism`` with ``mode: drain``: how long the worker's hook may take to
finish its trial and acknowledge (a long trial is not cut short)."""
_DRAIN_ON_STOP_S = 20.0
"""``on_daemon_stop: drain``: how long a worker may take to finish its trial before it is
stopped (SIGTERM, then SIGKILL after ``restart.stop_timeout``; the unit's TimeoutStopSec=
leaves room for both)."""
_V = TypeVar("_V")
_TRIALS_KEPT = 4096
"""Worker pids whose latest trial the daemon remembers (oldest forgotten first)."""
_RESUME_WINDOW_S = 24 * 3600.0
"""How far back :meth:`Daemon.resume_interrupted_decisions` looks for ``unknown`` ones."""
_DETACH_FRESH_S = 10.0
"""How recent a hook's ``detach`` must be for an adopted worker's end to count as clean
(the interpreter's exit after the hook's block takes a second or two, with DataLoader
and CUDA teardown; a process that goes on longer, or attaches or reports again, loses
its ``detach``)."""
_DRAIN_ATTACH_WAIT_S = 15.0
"""A drain asked of a worker whose hook has not (re)attached yet waits this long for it
(hooks reconnect with backoff after a daemon restart) before the worker gets SIGTERM."""


class HostOnlySampler:
    """The GPU sampler used when there is no GPU to watch: returns no samples.

    ``reason`` is shown by ``gpuwatchctl status`` as ``host-only: <reason>``.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason

    @property
    def status(self) -> str:
        """``"host-only: <reason>"``."""
        return f"host-only: {self.reason}"

    def sample(self, now_s: float) -> tuple[GpuSample, ...]:
        """Return no GPU samples."""
        return ()

    def close(self) -> None:
        """Nothing to release."""


def open_gpu_sampler(devices: str, *, logger: Any = None) -> GpuSampler:
    """Open the GPU sampler named by ``devices`` (``auto``, ``nvml``, ``none``, ``replay:PATH``).

    ``auto`` and ``nvml`` fall back to :class:`HostOnlySampler` when NVML cannot be
    initialised (no driver, no library, driver/library mismatch) and log that once:
    the daemon keeps watching the host. ``replay:PATH`` raises
    :class:`~gpuwatchd.errors.ReplayError` for an unreadable trace.
    """
    log = logger or get_logger("gpuwatchd.daemon")
    if devices == "none":
        return HostOnlySampler("GPU sampling disabled (--devices none)")
    if devices.startswith("replay:"):
        from gpuwatchd.sampling.replay import ReplaySampler, parse_trace

        trace = parse_trace(devices[len("replay:") :])
        log.info(
            "replaying trace",
            path=str(trace.path),
            gpus=trace.gpu_count,
            frames=len(trace.frames),
            duration_s=round(trace.duration_s, 1),
        )
        # The daemon scales its own clock by replay_speed (see Daemon), so the sampler
        # plays at speed 1 on that clock and `for:` durations stay in trace seconds.
        return ReplaySampler(trace, speed=1.0)
    from gpuwatchd.sampling.nvml import NvmlSampler

    sampler = NvmlSampler()
    try:
        sampler.open()
    except NvmlUnavailable as exc:
        log.warning("running host-only", reason=exc.reason, devices=devices)
        return HostOnlySampler(exc.reason)
    return sampler


def resolve_policy_paths(paths: Sequence[str]) -> tuple[str, ...]:
    """Return the policy sources to load: ``paths``, else the system directory, else the default.

    The system directory (``/etc/gpuwatchd/policies.d``) counts only when it holds
    ``*.yaml`` files; otherwise the packaged ``policies/default.yaml`` is used.
    """
    if paths:
        return tuple(paths)
    system_dir = Path(DEFAULT_POLICY_DIR)
    if system_dir.is_dir() and any(system_dir.glob("*.yaml")):
        return (str(system_dir),)
    return (str(default_policy_path()),)


@dataclass(slots=True)
class TickStats:
    """Counters shown by ``gpuwatchctl status``: ticks done and the last tick's duration."""

    ticks: int = 0
    last_tick_duration_s: float = 0.0
    last_tick_at_s: float | None = None
    failed_ticks: int = 0


def _admin_gid(group: str | None, logger: Any) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        logger.warning(
            "admin group not found; only root and the daemon's user are admins", group=group
        )
        return None


def _scaled_clock(clock: Callable[[], float], speed: float) -> Callable[[], float]:
    """A clock that runs ``speed`` times faster than ``clock`` from now on.

    With ``--devices replay:… --replay-speed N`` the policy engine lives on this
    clock, so ``for:`` durations and cooldowns are measured in trace seconds.
    """
    anchor = clock()
    return lambda: anchor + (clock() - anchor) * speed


def _finding_key(finding: Finding) -> tuple[str, str]:
    return finding.detector, finding.subject


def _jsonable(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` for the status reply (NA becomes null when encoded)."""
    return asdict(obj)


def restore_horizon_s(policies: PolicySet) -> float:
    """How far back (seconds) decisions matter to the engine's state: the longest window.

    The longest ``cooldown`` or rate-limit period (``limit: {max, per}``) of the
    ``policies``; ladder positions come from the latest ladder decision whatever its age
    (:meth:`Journal.decisions_since`).
    """
    horizon = 0.0
    for policy in policies.policies:
        horizon = max(horizon, policy.cooldown_s)
        if policy.limit is not None:
            horizon = max(horizon, policy.limit.per_s)
    return horizon


def _int_param(params: Mapping[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name!r} must be a non-negative integer")
    return value


def _crash_to_dict(crash: WorkerCrash) -> dict[str, Any]:
    info = crash.crash_info
    return {
        "job": crash.job,
        "worker": crash.worker,
        "pid": crash.pid,
        "gpu_index": crash.gpu_index,
        "kind": info.kind,
        "reason": info.reason,
        "signal": info.signal,
        "exit_code": info.exit_code,
        "evidence": info.evidence,
        "trial_number": crash.trial_number,
        "timestamp_s": crash.timestamp_s,
        "returncode": crash.returncode,
        "uptime_s": crash.uptime_s,
        "intentional": crash.intentional,
        "worker_id": crash.worker_id,
        "xid_events": [event.to_dict() for event in crash.xid_events],
    }


def _crash_from_dict(d: Mapping[str, Any]) -> WorkerCrash:
    """Rebuild a ledger entry; raises KeyError/TypeError/ValueError for a bad one."""
    kinds: dict[str, CrashKind] = {
        "cuda_assert": "cuda_assert",
        "cuda_oom": "cuda_oom",
        "host_oom": "host_oom",
    }
    info = CrashInfo(
        kinds.get(str(d["kind"]), "other"),
        str(d.get("reason", "")),
        d.get("signal"),
        d.get("exit_code"),
        str(d.get("evidence", "")),
    )
    trial = d.get("trial_number")
    gpu = d.get("gpu_index")
    return WorkerCrash(
        job=str(d["job"]),
        worker=int(d["worker"]),
        pid=int(d["pid"]),
        gpu_index=None if gpu is None else int(gpu),
        crash_info=info,
        trial_number=None if trial is None else int(trial),
        stderr_tail="",
        timestamp_s=float(d["timestamp_s"]),
        returncode=d.get("returncode"),
        uptime_s=d.get("uptime_s"),
        intentional=bool(d.get("intentional", False)),
        worker_id=None if d.get("worker_id") is None else str(d["worker_id"]),
        xid_events=tuple(XidEvent.from_dict(x) for x in d.get("xid_events") or ()),
    )


class CrashLedger:
    """Worker crashes the daemon has not finished with, in a JSON file (atomic rewrites).

    An entry is written before anything is done about a crash and removed once a tick has
    journaled the crash's event (or, for a worker the daemon stopped itself, once its
    trial is recovered). A daemon killed in between finds the entry at its next start and
    finishes the job (see :meth:`Daemon.replay_crash_ledger`). Errors are logged, never
    raised: a lost entry costs at most one recovery.
    """

    def __init__(self, path: Path, logger: Any) -> None:
        self.path = path
        self._log = logger
        self._entries: dict[str, dict[str, Any]] = {}

    @staticmethod
    def key(job: str, pid: int) -> str:
        """The entry key of ``job``'s worker ``pid``."""
        return f"{job}:{pid}"

    def load(self) -> list[WorkerCrash]:
        """Read the file; return the crashes it holds (bad entries are logged and dropped)."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            self._log.error(
                "ignoring an unreadable crash ledger", path=str(self.path), error=str(exc)
            )
            return []
        crashes: list[WorkerCrash] = []
        entries = raw.get("crashes", []) if isinstance(raw, dict) else []
        for entry in entries if isinstance(entries, list) else []:
            try:
                crash = _crash_from_dict(entry)
            except (KeyError, TypeError, ValueError):
                self._log.warning("ignoring a bad crash ledger entry", entry=repr(entry)[:200])
                continue
            self._entries[self.key(crash.job, crash.pid)] = _crash_to_dict(crash)
            crashes.append(crash)
        return crashes

    def add(self, crash: WorkerCrash) -> None:
        """Record ``crash`` (replacing an entry of the same job and pid)."""
        self._entries[self.key(crash.job, crash.pid)] = _crash_to_dict(crash)
        self._save()

    def remove(self, keys: Sequence[str]) -> None:
        """Forget the entries ``keys`` (unknown keys are ignored)."""
        removed = [k for k in keys if self._entries.pop(k, None) is not None]
        if removed:
            self._save()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _save(self) -> None:
        data = {"version": 1, "crashes": list(self._entries.values())}
        try:
            write_json_atomic(self.path, data)
        except OSError as exc:
            self._log.error("cannot write the crash ledger", path=str(self.path), error=str(exc))


def _remember(by_pid: OrderedDict[int, _V], pid: int, value: _V) -> None:
    """Set ``by_pid[pid]`` as the newest entry; forget the oldest beyond :data:`_TRIALS_KEPT`."""
    by_pid[pid] = value
    by_pid.move_to_end(pid)
    while len(by_pid) > _TRIALS_KEPT:
        by_pid.popitem(last=False)


def _crash_decided(journal: Journal, crash: WorkerCrash) -> bool:
    """Whether the journal holds a decision made about ``crash`` (a restart action naming
    its pid, or any decision whose findings include its ``job_crashed`` finding)."""
    marker = f"job {crash.job} worker pid {crash.pid} crashed"
    for entry in journal.journaled_since(crash.timestamp_s - 1.0):
        decision = entry.decision
        params = decision.params
        if decision.job == crash.job and params.get("pid") == crash.pid:
            return True
        if any(f.message.startswith(marker) for f in decision.findings):
            return True
    return False


class Daemon:
    """The gpuwatchd daemon: one instance per process.

    ``clock`` (seconds, default :func:`time.time`) stamps snapshots; ``notifier``
    defaults to a :class:`~gpuwatchd.systemd.Notifier` (a no-op outside systemd).
    Use :meth:`run` in a process; :meth:`tick` alone in benchmarks.

    Raises :class:`~gpuwatchd.errors.PolicyError` for broken policies and
    :class:`~gpuwatchd.errors.SupervisorError` for a managed job that cannot run (an
    unknown ``user``, ``user`` without root).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        notifier: Notifier | None = None,
        logger: Any = None,
    ) -> None:
        self.settings = settings
        if settings.devices.startswith("replay:") and settings.replay_speed != 1.0:
            clock = _scaled_clock(clock, settings.replay_speed)
        self._clock = clock
        self._notifier = notifier or Notifier()
        self._log = logger or get_logger("gpuwatchd.daemon")
        self._started_at_s = clock()
        self._started_monotonic_s = time.monotonic()
        self._ready_sent = False
        self._failed_in_row = 0
        self.stats = TickStats()
        self._decisions: deque[DecisionRecord] = deque(maxlen=_RECENT_DECISIONS)
        self._active: dict[tuple[str, str], Finding] = {}
        self._last_snapshot: Snapshot | None = None
        self._status_line = ""
        self._gpu_errors: dict[int, str] = {}
        self._policy_paths = resolve_policy_paths(settings.policies)
        self._policies_loaded_at_s = clock()
        # A pause of more than three ticks (daemon stopped, host suspended) breaks every
        # streak; in replay the engine's clock runs replay_speed times faster.
        speed = settings.replay_speed if settings.devices.startswith("replay:") else 1.0
        self.engine = PolicyEngine(
            load_policies(self._policy_paths),
            dry_run=settings.dry_run,
            max_gap_s=3 * settings.interval_s * speed,
            managed_jobs={job.name: (job.workers, job.min_workers) for job in settings.jobs},
        )
        self._job_configs: dict[str, JobConfig] = {job.name: job for job in settings.jobs}
        self._initial_gpus: tuple[GpuSample, ...] = ()
        self.supervisor: Supervisor | None = None
        self._managed: SupervisorActions | None = None
        self._study = StudyRecovery(get_logger("gpuwatchd.study"))
        if settings.jobs:
            self.supervisor = Supervisor(
                settings.jobs,
                state_dir=settings.state_dir,
                socket_path=settings.socket,
                clock=clock,
                logger=get_logger("gpuwatchd.supervisor"),
                gpu_inventory=self._gpu_inventory,
                on_crash=self._on_crash,
                drain_worker=self._drain_worker,
                exit_hint=self._exit_hint,
            )
            self._managed = SupervisorActions(
                self.supervisor, settings.jobs, self._study, get_logger("gpuwatchd.actuators")
            )
        self._ledger = CrashLedger(
            Path(settings.state_dir) / CRASH_LEDGER_FILENAME, get_logger("gpuwatchd.daemon")
        )
        self._posted: dict[int, str] = {}
        """id() of the crash events this daemon posted -> their ledger key."""
        self._consumed: list[str] = []
        self._event_buffer: list[tuple[JobEvent, str | None]] = []
        self._trials: OrderedDict[int, tuple[int, str]] = OrderedDict()
        """Worker pid -> (trial number, "running" | "ended:<TrialState>"), latest word."""
        self._detached: OrderedDict[int, float] = OrderedDict()
        """Pid -> when its hook said ``detach`` (daemon clock), for :meth:`_exit_hint`."""
        self._session_trials: dict[int, int] = {}
        self._stopping = False
        self._background: set[asyncio.Task[Any]] = set()
        self._reconciling: set[str] = set()
        self._gpu_sampler: GpuSampler | None = None
        self._host_sampler: HostSampler | None = None
        self._xid_log = XidLog()
        self._server: ControlServer | None = None
        self._actuator: Actuator | None = None
        self._stop: asyncio.Event | None = None
        self._journal: Journal | None = None
        self._journal_error: str | None = None
        self._journal_failed_writes = 0
        self._restored = 0

    # -- the tick -------------------------------------------------------------------------

    def open_samplers(self) -> None:
        """Open the GPU and host samplers (:meth:`run` does; call it before :meth:`tick`)."""
        self._gpu_sampler = open_gpu_sampler(self.settings.devices, logger=self._log)
        self._host_sampler = HostSampler()

    def open_journal(self) -> Journal:
        """Open ``<state_dir>/journal.sqlite3`` and continue where the last daemon stopped.

        Moves a corrupt journal aside (logged as an error) and starts a new one; closes
        findings and pending decisions a killed daemon left open; prunes old rows;
        restores the engine from the decisions within :func:`restore_horizon_s`; refills
        the recent decisions ``status`` shows. Raises :class:`JournalError` when the
        journal cannot be opened (the daemon refuses to start). :meth:`run` calls it.
        """
        path = Path(self.settings.state_dir) / JOURNAL_FILENAME
        now = self._clock()
        try:
            journal = Journal.open(path, retention_s=self.settings.journal_retention_s, now_s=now)
        except JournalError as exc:
            self._log.error("cannot open the journal", path=str(path), error=str(exc))
            raise
        if journal.moved_aside is not None:
            self._log.error(
                "journal was corrupt; moved it aside and started a new one",
                path=str(path),
                moved_to=str(journal.moved_aside),
            )
        try:
            recovery = journal.recover(now)
            pruned = journal.prune(now)
            horizon_s = restore_horizon_s(self.engine.policies)
            decisions = journal.decisions_since(now - horizon_s)
            self.engine.restore(decisions)
            recent = journal.recent_decisions(_RECENT_DECISIONS)
        except BaseException:
            journal.close()
            raise
        self._restored = len(decisions)
        for entry in recent:
            self._decisions.append(
                DecisionRecord(
                    entry.decision,
                    entry.outcome,
                    entry.detail,
                    entry.finished_s,
                    journal_id=entry.id,
                )
            )
        self._journal = journal
        self._log.info(
            "journal opened",
            path=str(path),
            restored_decisions=len(decisions),
            horizon_s=horizon_s,
            findings_closed=recovery.findings_closed,
            outcomes_unknown=recovery.decisions_unknown,
            pruned_events=pruned,
        )
        return journal

    def close_journal(self) -> None:
        """Close the open findings and pending outcomes in the journal, then the journal.

        Idempotent; :meth:`run` calls it on stop. A failure is logged, not raised.
        """
        journal, self._journal = self._journal, None
        if journal is None:
            return
        try:
            journal.recover(self._clock())
        except JournalError as exc:
            self._log.error("journal: cannot close open findings at stop", error=str(exc))
        finally:
            journal.close()

    async def _prune_job(self) -> None:
        self.prune_journal()

    def prune_journal(self) -> None:
        """Delete journal rows older than the retention (daily job; errors are logged)."""
        if self._journal is None:
            return
        try:
            pruned = self._journal.prune(self._clock())
        except JournalError as exc:
            self._log.error("journal prune failed", error=str(exc))
            return
        self._log.info("journal pruned", pruned_events=pruned)

    def sample(self, jobs: tuple[JobInfo, ...]) -> Snapshot:
        """Sample GPUs and host into a :class:`Snapshot`; a failing sampler degrades it."""
        assert self._gpu_sampler is not None and self._host_sampler is not None
        now = self._clock()
        gpu_status = self._gpu_sampler.status
        try:
            gpus = self._gpu_sampler.sample(now)
        except Exception as exc:
            self._log.error("gpu sampling failed", error=f"{type(exc).__name__}: {exc}")
            gpus, gpu_status = (), f"degraded: {type(exc).__name__}: {exc}"
        self._log_gpu_errors(gpus)
        self._poll_xid(now)
        host: HostSample | None
        try:
            host = self._host_sampler.sample(now, [job.pid for job in jobs])
        except Exception as exc:
            self._log.error("host sampling failed", error=f"{type(exc).__name__}: {exc}")
            host = None
        events = self._take_events()
        return Snapshot(
            timestamp_s=now, gpus=gpus, host=host, jobs=jobs, gpu_status=gpu_status, events=events
        )

    def _poll_xid(self, now: float) -> None:
        """Drain the GPU sampler's pending Xid errors (NVML only) into the Xid log, logging
        each as a warning. On the event-loop thread, like every NVML call."""
        poll = getattr(self._gpu_sampler, "poll_xid_events", None)
        if poll is None:
            return
        try:
            events: tuple[XidEvent, ...] = poll(now)
        except Exception as exc:  # the sampler never raises; a bug must not fail the tick
            self._log.error("xid polling failed", error=f"{type(exc).__name__}: {exc}")
            return
        for event in events:
            self._log.warning(
                "gpu xid",
                gpu=event.gpu_index,
                gpu_uuid=event.gpu_uuid,
                xid=event.xid,
                description=event.description,
                cause=event.cause,
            )
        self._xid_log.add(events)

    def _xid_evidence(self, crash: WorkerCrash) -> tuple[XidEvent, ...]:
        """The Xid errors on ``crash``'s GPU around its time (:meth:`XidLog.near`).

        Drains NVML first, so an Xid the driver reported since the last tick counts too.
        ``()`` for a worker the daemon stopped itself (``intentional``: its Xid 45 is the
        daemon's doing) or one with no known GPU.
        """
        if crash.intentional or crash.gpu_index is None:
            return ()
        self._poll_xid(self._clock())
        return self._xid_log.near(crash.gpu_index, crash.timestamp_s)

    def _xid_watch(self) -> dict[str, Any] | None:
        """``status``'s ``xid_watch``: which GPUs report Xid errors (None without NVML)."""
        sampler: Any = self._gpu_sampler
        devices = getattr(sampler, "xid_devices", None)
        if devices is None:
            return None
        return {
            "gpus": list(devices),
            "unsupported": {str(k): v for k, v in sampler.xid_unsupported.items()},
            "error": sampler.xid_error,
        }

    def _take_events(self) -> tuple[JobEvent, ...]:
        """The job events for this tick's snapshot (see :meth:`_collect_events`).

        Keys of this daemon's own crash events go to ``_consumed`` (removed from the
        crash ledger once the tick is journaled).
        """
        self._collect_events()
        taken, self._event_buffer = self._event_buffer, []
        events: list[JobEvent] = []
        for event, key in taken:
            if key is not None:
                self._consumed.append(key)
            events.append(event)
        return tuple(events)

    def _collect_events(self) -> None:
        """Move the control server's queued job events into the daemon's buffer.

        On the way: the hook's ``crash`` event of a managed worker is dropped (the
        supervisor reports that death, classified, with its stderr; the hook's exception
        text goes to the classification), every ``trial`` event updates the trial
        each worker pid last ran (:meth:`_crashed_trial`), and a ``detach`` event is kept
        for :meth:`_exit_hint` (not passed on).
        """
        if self._server is None:
            return
        for event in self._server.drain_events():
            key = self._posted.pop(id(event), None)
            if key is None and event.pid is not None:
                if event.kind == "detach":  # for _exit_hint only; no detector reads it
                    _remember(self._detached, event.pid, event.timestamp_s)
                    continue
                self._detached.pop(event.pid, None)  # it went on after its block
                if event.kind == "trial" and event.trial_number is not None:
                    self._note_trial(event.pid, event.trial_number, f"ended:{event.trial_state}")
                elif event.kind == "crash" and self._is_managed(event):
                    self._log.info(
                        "hook crash report of a managed worker",
                        job=event.job,
                        pid=event.pid,
                        crash_kind=event.crash_kind,
                        message=event.message[:200],
                    )
                    continue
            self._event_buffer.append((event, key))

    def _note_trial(self, pid: int, number: int, what: str) -> None:
        _remember(self._trials, pid, (number, what))

    def _observe_trials(self, jobs: Sequence[JobInfo]) -> None:
        """Note each attached job's running trial when its hook reports a new one (and
        forget the ``detach`` of a process that attached again since)."""
        for job in jobs:
            detached_at = self._detached.get(job.pid)
            if detached_at is not None and job.connected_at_s > detached_at:
                del self._detached[job.pid]
            if job.trial_number is None:
                continue
            if self._session_trials.get(job.pid) != job.trial_number:
                self._session_trials[job.pid] = job.trial_number
                self._note_trial(job.pid, job.trial_number, "running")
        if len(self._session_trials) > _TRIALS_KEPT:
            live = {job.pid for job in jobs}
            self._session_trials = {p: n for p, n in self._session_trials.items() if p in live}

    def _crashed_trial(self, crash: WorkerCrash) -> int | None:
        """The Optuna trial ``crash``'s worker died in, from what its hook said last.

        The hook's last word decides: a trial it reported running, or one it reported
        ending ``FAIL`` (Optuna fails the trial whose objective raised, and the hook
        reports that before the process dies), is the crashed trial; after a COMPLETE or
        PRUNED trial the worker had started one the hook had not reported yet: unknown
        (None; the stale-trial sweep finds it). Without any word from the hook (e.g. a
        worker adopted after a restart), the supervisor's record.
        """
        seen = self._trials.get(crash.pid)
        if seen is None:
            return crash.trial_number
        number, what = seen
        return number if what in ("running", "ended:FAIL") else None

    async def _settle(self, crash: WorkerCrash) -> WorkerCrash:
        """Let the dead worker's last hook messages arrive; return ``crash`` with its trial.

        The hook flushes its trial and crash events before the process exits, but the
        exit may be noticed before the socket is read: wait (at most 1 s) until the
        worker's hook connection is gone, take the events, then read the trial.
        """
        if self._server is not None:
            self._observe_trials(self._server.jobs())
        await self._take_last_words(crash.pid)
        trial = self._crashed_trial(crash)
        if trial != crash.trial_number:
            self._log.info(
                "crashed trial from the hook",
                job=crash.job,
                pid=crash.pid,
                trial=trial,
                supervisor_trial=crash.trial_number,
            )
            crash = dataclasses.replace(crash, trial_number=trial)
        return crash

    async def _take_last_words(self, pid: int) -> None:
        """Wait (at most 1 s) until ``pid``'s hook connection is gone, then take the events."""
        server = self._server
        if server is None:
            return
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(j.pid == pid for j in server.jobs()):
            await asyncio.sleep(0.02)
        self._collect_events()

    async def _exit_hint(self, pid: int) -> bool:
        """The supervisor's ``exit_hint``: did adopted worker ``pid``'s hook detach cleanly?

        Its ``detach`` event is sent just before the process exits, and may still be on
        its way: as :meth:`_settle`, wait (at most 1 s) until the hook's connection is
        gone, then take the events. Only a ``detach`` of the last
        :data:`_DETACH_FRESH_S` seconds counts (a pid is reused in time).
        """
        if self._server is not None:
            self._observe_trials(self._server.jobs())  # attached again since? not clean
        if pid not in self._detached:
            await self._take_last_words(pid)
        at = self._detached.pop(pid, None)
        return at is not None and self._clock() - at <= _DETACH_FRESH_S

    def _is_managed(self, event: JobEvent) -> bool:
        """Whether ``event`` comes from a managed worker (noting its exception text)."""
        if self.supervisor is None or self._managed is None or event.pid is None:
            return False
        text = event.message or event.crash_kind
        if self.supervisor.note_exception(event.pid, text):
            return True
        return self._managed.is_crashed_worker(event.pid)

    def _gpu_inventory(self) -> tuple[GpuSample, ...]:
        """The GPUs the supervisor places workers on: the last snapshot's (or the first sample)."""
        snap = self._last_snapshot
        return snap.gpus if snap is not None and snap.gpus else self._initial_gpus

    def _log_gpu_errors(self, gpus: tuple[GpuSample, ...]) -> None:
        for gpu in gpus:
            previous = self._gpu_errors.get(gpu.index)
            if gpu.error != previous:
                if gpu.error is None:
                    self._gpu_errors.pop(gpu.index, None)
                    self._log.info("gpu recovered", gpu=gpu.index, gpu_uuid=gpu.uuid)
                else:
                    self._gpu_errors[gpu.index] = gpu.error
                    self._log.error(
                        "gpu degraded", gpu=gpu.index, gpu_uuid=gpu.uuid, error=gpu.error
                    )

    def tick(self, jobs: tuple[JobInfo, ...] = ()) -> Snapshot:
        """One tick: sample, detect, decide, act. Returns the snapshot it worked on.

        Must run on the event loop when decisions may include ``set_knob`` (the
        actuator starts a task there).
        """
        started = time.perf_counter()
        if self.supervisor is not None:
            self.supervisor.observe(jobs)
            self._observe_trials(jobs)
        self._consumed = []
        snapshot = self.sample(jobs)
        now = snapshot.timestamp_s
        result = self.engine.step(snapshot)
        self._track_findings(result.findings, now)
        actuator = self._actuator
        records = [
            actuator.plan(d)
            if actuator is not None
            else DecisionRecord(d, "dry-run", "no actuator (daemon not running)", now)
            for d in result.decisions
        ]
        recorded = True
        if self._journal is not None:
            recorded = self._journal_tick(now, result.findings, records)
        if recorded and self._consumed:
            self._ledger.remove(self._consumed)  # journaled: a restart must not act again
        for record in records:
            if not recorded:
                pass  # no action without a record: _journal_tick marked it failed
            elif actuator is not None:
                actuator.start(record)
            else:
                self._log_unactuated(record.decision)
            self._decisions.append(record)
        self._last_snapshot = snapshot
        self._reconcile_parallelism()
        self.stats.ticks += 1
        self.stats.last_tick_at_s = snapshot.timestamp_s
        self.stats.last_tick_duration_s = time.perf_counter() - started
        return snapshot

    def _journal_tick(
        self,
        now_s: float,
        findings: Sequence[Finding],
        records: Sequence[DecisionRecord],
    ) -> bool:
        """Write-ahead: journal the tick; False (decisions marked failed) when that failed."""
        assert self._journal is not None
        outcomes = [
            None if r.outcome == "pending" else Outcome(r.outcome, r.detail, r.finished_at_s)
            for r in records
        ]
        try:
            ids = self._journal.record_tick(
                now_s, findings, [r.decision for r in records], outcomes
            )
        except JournalError as exc:
            self._journal_failed_writes += 1
            self._journal_error = str(exc)
            self._log.error(
                "journal write failed; this tick's decisions are not carried out",
                error=str(exc),
                decisions=[f"{r.decision.policy}/{r.decision.action}" for r in records],
            )
            for record in records:
                record.outcome = "failed"
                record.detail = f"not carried out: journal write failed: {exc}"
                record.finished_at_s = now_s
            return False
        self._journal_error = None
        for record, decision_id in zip(records, ids, strict=True):
            record.journal_id = decision_id
        return True

    def _on_outcome(self, record: DecisionRecord) -> None:
        """The actuator's callback for a late outcome (a job acknowledging ``set_knob``)."""
        if self._journal is None or record.journal_id is None:
            return
        try:
            self._journal.record_outcome(
                record.journal_id, record.outcome, record.detail, record.finished_at_s
            )
        except (JournalError, KeyError) as exc:
            self._journal_failed_writes += 1
            self._journal_error = str(exc)
            self._log.error(
                "journal write failed; outcome not recorded",
                decision_id=record.journal_id,
                outcome=record.outcome,
                error=str(exc),
            )

    def _log_unactuated(self, decision: Decision) -> None:
        self._log.info(
            "decision",
            policy=decision.policy,
            action=decision.action,
            job=decision.job,
            params=dict(decision.params),
            dry_run=True,
        )

    def _track_findings(self, findings: Sequence[Finding], now_s: float) -> None:
        """Log findings that start and clear (the journal keeps its own account)."""
        current = {_finding_key(f): f for f in findings}
        for key, finding in current.items():
            if key not in self._active:
                self._log.warning(
                    "finding",
                    detector=finding.detector,
                    subject=finding.subject,
                    gpu=finding.gpu_index,
                    job=finding.job,
                    value=round(finding.value, 2),
                    threshold=finding.threshold,
                    held_s=round(now_s - finding.since_s, 1),
                    message=finding.message,
                )
        for key, finding in self._active.items():
            if key not in current:
                self._log.info(
                    "finding cleared",
                    detector=finding.detector,
                    subject=finding.subject,
                    gpu=finding.gpu_index,
                    job=finding.job,
                )
        self._active = current

    async def _tick_job(self) -> None:
        try:
            jobs = self._server.jobs() if self._server is not None else ()
            self.tick(jobs)
            self._failed_in_row = 0
        except Exception as exc:
            self.stats.failed_ticks += 1
            self._failed_in_row += 1
            self._log.exception("tick failed", error=f"{type(exc).__name__}: {exc}")
        if not self._ready_sent:
            # After the first tick, failed or not: the socket answers and the loop runs.
            self._ready_sent = True
            self._notifier.ready()
            self._log.info(
                "ready",
                socket=self.settings.socket,
                interval_s=self.settings.interval_s,
                gpus=self._gpu_sampler.status if self._gpu_sampler else None,
            )
        if self._failed_in_row < _MAX_FAILED_TICKS_IN_ROW:
            self._notifier.watchdog()
        elif self._failed_in_row == _MAX_FAILED_TICKS_IN_ROW:
            self._log.error(
                "every tick fails; no more watchdog pings, systemd will restart the daemon",
                failed_in_row=self._failed_in_row,
            )
        line = self.summary()
        if line != self._status_line:
            self._status_line = line
            self._notifier.status(line)

    def summary(self) -> str:
        """One-line state for systemd's ``STATUS=`` (``systemctl status`` shows it)."""
        snap = self._last_snapshot
        gpus = (
            f"{len(snap.gpus)} GPUs"
            if snap and snap.gpus
            else (self._gpu_sampler.status if self._gpu_sampler else "starting")
        )
        jobs = len(snap.jobs) if snap else 0
        paused = ", paused" if self.engine.paused else ""
        return (
            f"{gpus}, {jobs} jobs, {len(self.engine.policies.policies)} policies, "
            f"{len(self._active)} findings{paused}"
        )

    # -- managed jobs -----------------------------------------------------------------------

    async def _on_crash(self, crash: WorkerCrash) -> None:
        """The supervisor's ``on_crash``: ledger, Optuna trial, then the tick's crash event.

        The trial the worker died in comes from the hook's last word (:meth:`_settle`),
        then from the study itself when its trials carry the worker's launch id
        (:meth:`SupervisorActions.locate_trial`). The ledger entry is written first
        (before any await), so a daemon killed at any later point finds the crash again at
        its next start. A worker the daemon stopped itself (``intentional``) has its trial
        failed and re-enqueued but makes no event.
        """
        key = CrashLedger.key(crash.job, crash.pid)
        self._ledger.add(crash)
        located = crash
        if not crash.intentional:
            located = await self._settle(located)
        if self._managed is not None:
            located = await self._managed.locate_trial(located)
        # After the waits above: an Xid drained meanwhile (e.g. 45, the driver's cleanup
        # of the dead process) still counts.
        located = dataclasses.replace(located, xid_events=self._xid_evidence(located))
        if located != crash:
            crash = located
            self._ledger.add(crash)
        await self._recover_crash(crash)
        if crash.intentional:
            self._ledger.remove([key])
        else:
            self._post_crash_event(crash, key)

    async def _recover_crash(self, crash: WorkerCrash) -> None:
        if self._managed is None:
            return
        detail = await self._managed.handle_crash(crash)
        self._log.info(
            "worker end handled",
            job=crash.job,
            worker=crash.worker,
            pid=crash.pid,
            kind=crash.crash_info.kind,
            intentional=crash.intentional,
            trial=crash.trial_number,
            study=detail,
        )

    def _post_crash_event(self, crash: WorkerCrash, key: str) -> None:
        if self._server is None:
            return
        event = crash.to_event()
        self._posted[id(event)] = key
        self._server.post_event(event)

    async def replay_crash_ledger(self) -> int:
        """Finish the crashes a killed predecessor left in the ledger; return how many.

        Each one's Optuna recovery runs again (idempotent); its crash event is posted again
        unless the journal already holds a decision about it (then the entry is dropped:
        that decision was made, and is never made twice). Call it with the journal open
        and the control server started, before the first tick.
        """
        crashes = self._ledger.load()
        for crash in crashes:
            key = CrashLedger.key(crash.job, crash.pid)
            if self._managed is not None:
                # A predecessor killed while it looked the trial up left the older number.
                crash = await self._managed.locate_trial(crash)
                self._managed.remember(crash)
            await self._recover_crash(crash)
            decided = self._journal is not None and _crash_decided(self._journal, crash)
            if crash.intentional or decided or crash.job not in self._job_configs:
                self._ledger.remove([key])
            else:
                self._post_crash_event(crash, key)
            self._log.info(
                "pending crash resumed",
                job=crash.job,
                pid=crash.pid,
                kind=crash.crash_info.kind,
                already_decided=decided,
            )
        return len(crashes)

    async def resume_interrupted_decisions(self) -> int:
        """Finish the ``restart_study`` decisions a killed predecessor left ``unknown``.

        A decision is journaled (``pending``) before it is carried out; a daemon killed
        in between leaves it ``unknown`` (:meth:`Journal.recover`), and the crash it was
        about has left the crash ledger. Re-enqueueing a trial is idempotent, so the
        study part runs again (:meth:`SupervisorActions.resume_restart_study`) and the
        decision gets its real outcome, with ``resumed after a daemon restart`` in the
        detail; no decision is made twice. Returns how many were resumed.
        """
        journal, managed = self._journal, self._managed
        if journal is None or managed is None:
            return 0
        since = self._clock() - _RESUME_WINDOW_S
        resumed = 0
        for entry in journal.journaled_since(since):
            decision = entry.decision
            if entry.outcome != "unknown" or decision.action != "restart_study":
                continue
            if decision.dry_run:
                continue
            if self.settings.dry_run:  # left unknown for a daemon that acts
                self._log.info("interrupted decision not resumed (dry run)", decision_id=entry.id)
                continue
            if decision.job not in self._job_configs:
                detail, outcome = f"job {decision.job!r} is no longer configured", "refused"
            else:
                try:
                    detail = await managed.resume_restart_study(decision)
                    outcome = "applied"
                except Exception as exc:  # one bad decision must not stop the daemon's start
                    detail, outcome = f"{type(exc).__name__}: {exc}", "failed"
            detail = f"resumed after a daemon restart: {detail}"
            try:
                journal.record_outcome(entry.id, outcome, detail, self._clock())
            except Exception as exc:
                self._log.error(
                    "cannot record a resumed outcome", decision_id=entry.id, error=str(exc)
                )
            resumed += 1
            self._log.info(
                "interrupted decision resumed",
                decision_id=entry.id,
                action=decision.action,
                job=decision.job,
                outcome=outcome,
                detail=detail,
            )
        return resumed

    async def _drain_worker(self, job: str, pid: int) -> bool:
        """The supervisor's ``drain_worker``: the hook's ``drain``, True once acknowledged.

        The hook acknowledges when it has applied the drain (its trial finished), so this
        waits up to :data:`_DRAIN_ACK_TIMEOUT_S` (:data:`_DRAIN_ON_STOP_S` while the daemon
        stops). A hook not attached yet is waited for (:data:`_DRAIN_ATTACH_WAIT_S`, not
        while stopping); False (the supervisor falls back to SIGTERM) when none answers.
        """
        server = self._server
        if server is None:
            return False
        deadline = time.monotonic() + (0.0 if self._stopping else _DRAIN_ATTACH_WAIT_S)
        while not any(j.name == job and j.pid == pid for j in server.jobs()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.25)
        timeout = _DRAIN_ON_STOP_S if self._stopping else _DRAIN_ACK_TIMEOUT_S
        try:
            replies = await server.send_command(job, "drain", {}, pid=pid, timeout_s=timeout)
        except ControlError as exc:
            self._log.warning("drain not sent", job=job, pid=pid, error=exc.message)
            return False
        return bool(replies) and all(r.ok for r in replies)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _reconcile_parallelism(self) -> None:
        """Trim a job running more worker slots than its parallelism (each tick).

        The supervisor counts a slot toward the parallelism until it leaves; after a daemon
        restart an adopted worker that was asked to drain is a normal slot again, so a job
        can briefly hold one slot too many. Idle slots go first, then the newest worker
        (drained). Not while a ladder action on the job is in flight.
        """
        supervisor = self.supervisor
        if supervisor is None or self._stopping:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # a tick outside the loop (benchmarks) does not manage workers
        for name in self._job_configs:
            if name in self._reconciling or (
                self._managed is not None and self._managed.busy(name)
            ):
                continue
            want = supervisor.parallelism(name)
            slots = [w for w in supervisor.workers(name) if w.state not in ("draining", "stopping")]
            if len(slots) <= want:
                continue
            self._log.warning(
                "more worker slots than the parallelism; trimming",
                job=name,
                slots=len(slots),
                parallelism=want,
            )
            self._reconciling.add(name)
            self._spawn(self._trim(name, want), f"gpuwatchd-trim-{name}")

    async def _trim(self, job: str, want: int) -> None:
        assert self.supervisor is not None
        try:
            await self.supervisor.set_parallelism(job, want, "drain")
        except GpuwatchError as exc:
            self._log.error("trimming worker slots failed", job=job, error=str(exc))
        finally:
            self._reconciling.discard(job)

    async def start_supervisor(self) -> None:
        """Start the managed jobs at their restored ladder positions (no-op without jobs).

        The supervisor adopts the workers a killed predecessor left running and restores
        the parallelism it recorded; when the journal's ladder position differs (a ladder
        decision journaled but not carried out before a kill), the journal's wins: its
        decision is the record of what the daemon decided.
        """
        supervisor = self.supervisor
        if supervisor is None:
            return
        if not self._initial_gpus and self._gpu_sampler is not None:
            try:
                self._initial_gpus = self._gpu_sampler.sample(self._clock())
            except Exception as exc:
                self._log.error("gpu sampling failed", error=f"{type(exc).__name__}: {exc}")
        await supervisor.start()
        for job in self._job_configs.values():
            # A crash whose trial was unknown may have left a RUNNING trial that the
            # killed predecessor meant to sweep: sweep once (heartbeat jobs only).
            if job.optuna is not None:
                self._study.request_sweep(job.name, job.optuna)
        for name in self._job_configs:
            want = self.engine.parallelism(name)
            have = supervisor.parallelism(name)
            if want is not None and want != have:
                self._log.warning(
                    "parallelism restored from the journal",
                    job=name,
                    parallelism=want,
                    recorded=have,
                )
                self._reconciling.add(name)
                self._spawn(self._trim(name, want), f"gpuwatchd-restore-{name}")
        self._log.info(
            "managed jobs started",
            jobs={name: supervisor.parallelism(name) for name in self._job_configs},
        )

    async def stop_supervisor(self) -> None:
        """Stop supervising: each job's workers drain, stop or stay per ``on_daemon_stop``."""
        supervisor = self.supervisor
        if supervisor is None:
            return
        self._stopping = True
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        groups: dict[str, list[str]] = {"drain": [], "stop": [], "leave": []}
        for job in self._job_configs.values():
            groups[job.on_daemon_stop].append(job.name)
        try:
            await asyncio.gather(
                *(
                    supervisor.stop(mode, jobs=names, drain_timeout_s=_DRAIN_ON_STOP_S)
                    for mode, names in groups.items()
                    if names and mode != "leave"
                )
            )
            # The last call ends the supervision; "leave" keeps workers.json naming the
            # workers left running (the others have none left).
            await supervisor.stop("leave")
        except GpuwatchError as exc:
            self._log.error("stopping the managed jobs failed", error=str(exc))
        await self._study.close()
        self._log.info("managed jobs stopped", modes={k: v for k, v in groups.items() if v})

    def _managed_dict(self) -> list[dict[str, Any]]:
        """Managed jobs for ``status``/``jobs``: the supervisor's view plus the ladder."""
        if self.supervisor is None:
            return []
        out = []
        for entry in self.supervisor.status()["jobs"]:
            name = entry["job"]
            cfg = self._job_configs.get(name)
            entry["ladder"] = self.engine.parallelism(name)
            entry["on_daemon_stop"] = cfg.on_daemon_stop if cfg is not None else None
            entry["study"] = (
                None
                if cfg is None or cfg.optuna is None
                else {"study": cfg.optuna.study, "max_retries": cfg.optuna.max_retries}
            )
            out.append(entry)
        return out

    # -- control operations -----------------------------------------------------------------

    async def handle(self, request: Request, peer: PeerCredentials) -> Any:
        """Answer one control request (the server has already checked admin rights).

        Raises :class:`ProtocolError` with a stable code for errors the client sees.
        """
        op, params = request.op, request.params
        if op == "status":
            return self.status()
        if op == "jobs":
            return {
                "jobs": [self._job_dict(job) for job in self._jobs()],
                "managed": self._managed_dict(),
            }
        if op == "events":
            return self.events(params)
        if op == "policy.show":
            return self._policies_dict()
        if op == "policy.reload":
            path = params.get("path")
            if path is not None and not isinstance(path, str):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "'path' must be a string")
            if path is not None and peer.uid != 0:
                # The daemon runs as root: loading a file a caller names would read any
                # file for them (errors quote its lines) and run its exec actions as root.
                raise ProtocolError(
                    ErrorCode.FORBIDDEN,
                    "only root may reload policies from a path; admins reload the configured "
                    "policy files (gpuwatchctl policy reload without PATH)",
                )
            try:
                self.reload_policies(path)
            except PolicyError as exc:
                raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
            return self._policies_dict()
        if op == "knob":
            return await self._knob(params)
        if op in ("pause", "resume"):
            self.engine.paused = op == "pause"
            self._log.warning(
                "remediation " + ("paused" if self.engine.paused else "resumed"), by_uid=peer.uid
            )
            return {"paused": self.engine.paused}
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")

    async def _knob(self, params: Mapping[str, Any]) -> Any:
        job, knob, value = params.get("job"), params.get("knob"), params.get("value")
        if not isinstance(job, str) or not isinstance(knob, str):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'job' and 'knob' must be strings")
        if isinstance(value, (dict, list)) or value is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'value' must be a number or a boolean")
        wait_s = params.get("wait_s", 2.0)
        if (
            isinstance(wait_s, bool)
            or not isinstance(wait_s, (int, float))
            or not 0 <= wait_s <= 600
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "'wait_s' must be a number of seconds, 0-600"
            )
        if self._server is None:
            raise ProtocolError(ErrorCode.INTERNAL, "no control server")
        send = asyncio.ensure_future(
            self._server.send_command(
                job, "set_knob", {"knob": knob, "value": value}, timeout_s=600.0
            )
        )
        self._log.info("knob requested", job=job, knob=knob, value=value, action="set_knob")
        done, _ = await asyncio.wait({send}, timeout=float(wait_s))
        if not done:
            return {"job": job, "knob": knob, "value": value, "state": "pending"}
        try:
            replies = send.result()
        except ControlError as exc:
            raise ProtocolError(
                exc.code if exc.code in ErrorCode.ALL else ErrorCode.INTERNAL, exc.message
            ) from None
        refused = [r for r in replies if not r.ok]
        if refused:
            raise ProtocolError(
                ErrorCode.CONFLICT, "; ".join(f"{r.error_code}: {r.error_message}" for r in refused)
            )
        return {"job": job, "knob": knob, "value": value, "state": "applied"}

    def events(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The ``events`` reply: ``{"events": [...], "last_id": N, "more": bool}``.

        ``params``: ``since_s`` (Unix time, optional), ``after_id`` (optional), ``limit``
        (default :data:`EVENTS_DEFAULT_LIMIT`, at most :data:`EVENTS_MAX_LIMIT`). Without
        ``since_s`` and ``after_id`` the reply holds the latest ``limit`` events.
        ``last_id`` is the cursor to pass as ``after_id`` next; ``more`` says events
        after it were left out (``limit``, or the 64 KiB reply size). Raises
        ProtocolError ``bad_request`` for bad params, ``internal`` without a journal.
        """
        since = params.get("since_s")
        if since is not None and (isinstance(since, bool) or not isinstance(since, (int, float))):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'since_s' must be a number")
        after_id = _int_param(params, "after_id")
        limit = _int_param(params, "limit")
        limit = EVENTS_DEFAULT_LIMIT if limit is None else limit
        if not 1 <= limit <= EVENTS_MAX_LIMIT:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"'limit' must be between 1 and {EVENTS_MAX_LIMIT}"
            )
        if self._journal is None:
            raise ProtocolError(ErrorCode.INTERNAL, "the journal is not open")
        tail = since is None and after_id is None
        try:
            found = self._journal.events(
                since_s=None if since is None else float(since),
                after_id=after_id,
                limit=limit if tail else limit + 1,
            )
            newest = self._journal.last_event_id()
        except JournalError as exc:
            raise ProtocolError(ErrorCode.INTERNAL, str(exc)) from None
        more = len(found) > limit
        events: list[dict[str, Any]] = []
        size = 0
        for event in found[:limit]:
            size += len(json.dumps(event, separators=(",", ":"), default=str)) + 1
            if events and size > _EVENTS_REPLY_BUDGET_BYTES:
                more = True
                break
            events.append(event)
        if events:
            last_id = int(events[-1]["id"])
        elif after_id is not None:
            last_id = after_id
        else:
            last_id = newest
        return {"events": events, "last_id": last_id, "more": more}

    def reload_policies(self, path: str | None = None) -> PolicySet:
        """Load policies from ``path`` (or the configured sources) and swap them in atomically.

        Raises :class:`~gpuwatchd.errors.PolicyError` (file and line) and keeps the
        running policies when any file is broken.
        """
        paths = (path,) if path else resolve_policy_paths(self.settings.policies)
        self._notifier.reloading()
        try:
            policies = load_policies(paths)
        except PolicyError as exc:
            self._log.error("policy reload failed; keeping the running policies", error=str(exc))
            raise
        finally:
            self._notifier.ready_after_reload()
        self.engine.reload(policies)
        self._policy_paths = tuple(paths)
        self._policies_loaded_at_s = self._clock()
        self._log.info(
            "policies reloaded",
            sources=list(policies.sources),
            policies=[p.name for p in policies.policies],
        )
        return policies

    def _jobs(self) -> tuple[JobInfo, ...]:
        return self._server.jobs() if self._server is not None else ()

    def _policies_dict(self) -> dict[str, Any]:
        out = dict(self.engine.policies.to_dict())
        out["loaded_at_s"] = self._policies_loaded_at_s
        out["paused"] = self.engine.paused
        out["dry_run"] = self.settings.dry_run
        return out

    def _job_dict(self, job: JobInfo) -> dict[str, Any]:
        out = _jsonable(job)
        snap = self._last_snapshot
        host_job = None
        if snap is not None and snap.host is not None:
            host_job = next((p for p in snap.host.jobs if p.pid == job.pid), None)
        out["process"] = _jsonable(host_job) if host_job is not None else None
        return out

    def status(self) -> dict[str, Any]:
        """The ``status`` reply: a stable, documented JSON object (see README, "status --json").

        Kept under :data:`_STATUS_REPLY_BUDGET_BYTES` so it always fits one protocol line:
        when it would not, the oldest ``decisions`` go first, then ``findings``, and
        ``truncated`` says how many of each were left out.
        """
        status = self._full_status()
        truncated = {"decisions": 0, "findings": 0}
        for key in ("decisions", "findings"):
            while status[key] and _json_size(status) > _STATUS_REPLY_BUDGET_BYTES:
                status[key].pop(0)
                truncated[key] += 1
        status["truncated"] = truncated
        return status

    def _full_status(self) -> dict[str, Any]:
        snap = self._last_snapshot
        host = snap.host if snap else None
        return {
            "version": __version__,
            "pid": os.getpid(),
            "started_at_s": self._started_at_s,
            "uptime_s": time.monotonic() - self._started_monotonic_s,
            "interval_s": self.settings.interval_s,
            "ticks": self.stats.ticks,
            "failed_ticks": self.stats.failed_ticks,
            "last_tick_duration_s": self.stats.last_tick_duration_s,
            "last_tick_at_s": self.stats.last_tick_at_s,
            "gpu_status": snap.gpu_status
            if snap
            else (self._gpu_sampler.status if self._gpu_sampler else "starting"),
            "gpus": [_jsonable(g) | {"memory_used_pct": g.memory_used_pct} for g in snap.gpus]
            if snap
            else [],
            "host": None
            if host is None
            else {
                "cpu_pct": host.cpu_pct,
                "cpu_count": host.cpu_count,
                "memory_used_bytes": host.memory_used_bytes,
                "memory_total_bytes": host.memory_total_bytes,
                "memory_used_pct": host.memory_used_pct,
            },
            "jobs": [self._job_dict(job) for job in self._jobs()],
            "managed": self._managed_dict(),
            "policies": self._policies_dict(),
            "paused": self.engine.paused,
            "dry_run": self.settings.dry_run,
            "findings": [_jsonable(f) for f in self._active.values()],
            "decisions": [record.to_dict() for record in self._decisions],
            "xid_events": [e.to_dict() for e in self._xid_log.recent(_RECENT_XID_EVENTS)],
            "xid_watch": self._xid_watch(),
            "journal": {
                "path": str(self._journal.path) if self._journal is not None else None,
                "restored_decisions": self._restored,
                "failed_writes": self._journal_failed_writes,
                "error": self._journal_error,
                "retention_s": self.settings.journal_retention_s,
            },
        }

    # -- process lifecycle ------------------------------------------------------------------

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`); return the exit status (0)."""
        from apscheduler.schedulers.asyncio import AsyncIOScheduler

        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        Path(self.settings.state_dir).mkdir(parents=True, exist_ok=True)
        self.open_journal()  # first: a journal that cannot be opened stops the start
        try:
            self.open_samplers()
            admin_gid = _admin_gid(self.settings.admin_group, self._log)
            self._server = ControlServer(
                self.settings.socket,
                self.handle,
                admin_gid=admin_gid,
                clock=self._clock,
                logger=get_logger("gpuwatchd.control"),
            )
            await self._server.start()  # raises when another gpuwatchd listens there
        except BaseException:
            if self._gpu_sampler is not None:
                self._gpu_sampler.close()
            self.close_journal()
            raise
        self._actuator = Actuator(
            self._server,
            get_logger("gpuwatchd.actuators"),
            self._clock,
            on_outcome=self._on_outcome,
            managed=self._managed,
        )
        try:
            await self.replay_crash_ledger()
            await self.resume_interrupted_decisions()
            await self.start_supervisor()
        except BaseException:
            await self._server.close()
            self.close_journal()
            raise
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        watchdog_s = self._notifier.watchdog_interval_s()
        if watchdog_s is not None and self.settings.interval_s > watchdog_s:
            self._log.warning(
                "tick interval is longer than half of WatchdogSec; systemd will restart the daemon",
                interval_s=self.settings.interval_s,
                watchdog_ping_s=watchdog_s,
            )
        scheduler = AsyncIOScheduler(event_loop=loop)
        scheduler.add_job(
            self._tick_job,
            "interval",
            seconds=self.settings.interval_s,
            id="tick",
            next_run_time=datetime.now(timezone.utc),
            max_instances=1,
            coalesce=True,
            misfire_grace_time=max(1, math.ceil(self.settings.interval_s)),
        )
        # A coroutine, so APScheduler runs it on the loop's thread: sqlite3 connections
        # refuse to be used from the executor's threads.
        scheduler.add_job(self._prune_job, "interval", seconds=_PRUNE_EVERY_S, id="prune")
        self._log.info(
            "starting",
            version=__version__,
            pid=os.getpid(),
            socket=self.settings.socket,
            devices=self.settings.devices,
            policies=list(self._policy_paths),
            dry_run=self.settings.dry_run,
        )
        scheduler.start()
        try:
            await self._stop.wait()
        finally:
            self._notifier.stopping()
            self._log.info("stopping")
            scheduler.shutdown(wait=False)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
            self._stopping = True
            await self._actuator.close()
            await self.stop_supervisor()
            await self._server.close()
            if self._gpu_sampler is not None:
                self._gpu_sampler.close()
            self.close_journal()
            self._log.info("stopped", ticks=self.stats.ticks)
        return 0

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop cleanly (SIGTERM and SIGINT call this)."""
        if self._stop is not None:
            self._stop.set()

    def _on_sighup(self) -> None:
        self._log.info("SIGHUP: reloading policies")
        with contextlib.suppress(PolicyError):  # logged; the running policies stay
            self.reload_policies()
