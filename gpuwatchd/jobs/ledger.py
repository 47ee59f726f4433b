"""The crash ledger: the daemon's one memory of worker crashes.

Which crashes are known (for the restart decisions that name a crashed pid), which are
pending (``crashes-pending.json``: not finished with), which are posted to the policies
(their event waits in the control server's queue), which a tick consumed (journaled at
its end) and which were replayed after a daemon restart: :class:`CrashLedger` answers all
of it; the supervisor, the crash handler and the managed-job actions ask it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, get_args

from gpuwatchd.crash import CrashInfo, CrashKind
from gpuwatchd.jobs.records import TrialHolder, WorkerCrash
from gpuwatchd.model import JobEvent
from gpuwatchd.statefile import write_json_atomic
from gpuwatchd.xid import XidEvent

__all__ = [
    "CRASH_LEDGER_FILENAME",
    "KNOWN_KEPT",
    "POSTED_KEPT",
    "CrashLedger",
    "crash_from_dict",
    "crash_to_dict",
]

CRASH_LEDGER_FILENAME = "crashes-pending.json"
"""Worker crashes not yet journaled by a tick (``<state_dir>/crashes-pending.json``)."""
KNOWN_KEPT: Final = 1024
"""Crashes remembered for restart decisions (oldest forgotten first)."""
POSTED_KEPT: Final = 10_000
"""Crash events posted and not yet seen by a tick that are remembered (the control
server's event queue holds as many; older ones were dropped from it, and their ledger
entries wait for the next start)."""


def crash_to_dict(crash: WorkerCrash) -> dict[str, Any]:
    """``crash`` as a ledger entry (JSON types; the stderr tail is not kept)."""
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


def crash_from_dict(d: Mapping[str, Any]) -> WorkerCrash:
    """Rebuild a ledger entry; raises KeyError/TypeError/ValueError for a bad one."""
    kinds: dict[str, CrashKind] = {kind: kind for kind in get_args(CrashKind)}
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
    """The daemon's crash memory; its pending part in a JSON file (atomic rewrites).

    *Pending* (:meth:`add`, :meth:`remove`, ``in``): an entry is written before anything
    is done about a crash and removed once a tick has journaled the crash's event (or,
    for a worker the daemon stopped itself, once its trial is recovered). A daemon killed
    in between finds the entry at its next start and finishes the job
    (:meth:`gpuwatchd.jobs.crashes.CrashHandler.replay_ledger`). Errors are logged, never
    raised: a lost entry costs at most one recovery.

    *Being handled* (:meth:`record`, :meth:`handled`, :meth:`holders`): from the moment
    the supervisor saw the end until the crash handler is done with it; the dead launch
    may still be named by RUNNING trials the handler is about to fail, so the orphan
    sweep counts it as a holder.
    *Known* (:meth:`remember`, :meth:`crash_of`, :meth:`is_crashed_worker`): the last
    :data:`KNOWN_KEPT` crashes handled, for the restart decisions that name a crashed pid.
    *Posted* (:meth:`note_posted`, :meth:`claim_posted`): crash events on their way to a
    tick through the control server's queue. *Consumed* (:meth:`consume`,
    :meth:`journaled`): the keys the current tick took. *Replayed*
    (:meth:`note_replayed`, :meth:`replayed`): the crashes resumed from the file at this
    start (the supervisor may report the same death again: killed after the ledger
    write, before ``workers.json``).
    """

    def __init__(self, path: Path, logger: Any) -> None:
        self.path = path
        self._log = logger
        self._entries: dict[str, dict[str, Any]] = {}
        self._known: OrderedDict[str, WorkerCrash] = OrderedDict()
        self._posted: OrderedDict[JobEvent, str] = OrderedDict()
        """Crash events this daemon posted -> their ledger key. Keyed by the (frozen,
        hashable) event itself, which the map keeps alive: an ``id()`` key could be taken
        over by a later event once the server's bounded queue dropped the posted one."""
        self._consumed: list[str] = []
        self._replayed: dict[str, WorkerCrash] = {}
        self._handling: dict[str, WorkerCrash] = {}

    @staticmethod
    def key(job: str, pid: int) -> str:
        """The entry key of ``job``'s worker ``pid``."""
        return f"{job}:{pid}"

    # -- pending: the file ----------------------------------------------------------------

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
                crash = crash_from_dict(entry)
            except (KeyError, TypeError, ValueError):
                self._log.warning("ignoring a bad crash ledger entry", entry=repr(entry)[:200])
                continue
            self._entries[self.key(crash.job, crash.pid)] = crash_to_dict(crash)
            crashes.append(crash)
        return crashes

    def add(self, crash: WorkerCrash) -> None:
        """Record ``crash`` as pending (replacing an entry of the same job and pid)."""
        self._entries[self.key(crash.job, crash.pid)] = crash_to_dict(crash)
        self._save()

    def remove(self, keys: Sequence[str]) -> None:
        """Forget the pending entries ``keys`` (unknown keys are ignored)."""
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

    # -- being handled: from the supervisor's report to the handler's end ---------------

    def record(self, crash: WorkerCrash) -> None:
        """The supervisor saw ``crash``: pending (:meth:`add`) and being handled until
        :meth:`handled`. Called before ``workers.json`` stops naming the dead worker."""
        self._handling[self.key(crash.job, crash.pid)] = crash
        self.add(crash)

    def handled(self, key: str) -> None:
        """The crash handler is done with ``key`` (unknown keys are ignored)."""
        self._handling.pop(key, None)

    def holders(self) -> tuple[TrialHolder, ...]:
        """The launches whose end is being handled, as holders of their RUNNING trials
        (start unknown: as the slot of a worker whose end is being handled)."""
        return tuple(TrialHolder(crash.worker_id, None) for crash in self._handling.values())

    # -- known: for the restart decisions -------------------------------------------------

    def remember(self, crash: WorkerCrash) -> None:
        """Remember ``crash`` for the restart decisions that will name its pid."""
        key = self.key(crash.job, crash.pid)
        self._known[key] = crash
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEPT:
            self._known.popitem(last=False)

    def crash_of(self, job: str, pid: int) -> WorkerCrash | None:
        """The remembered crash of ``job``'s worker ``pid``, if any."""
        return self._known.get(self.key(job, pid))

    def is_crashed_worker(self, pid: int) -> bool:
        """True when ``pid`` is a managed worker whose end was handled."""
        return any(crash.pid == pid for crash in self._known.values())

    # -- posted and consumed: on the way to the journal -----------------------------------

    def note_posted(self, event: JobEvent, key: str) -> None:
        """``event`` (the crash ``key``'s) was posted to the control server's queue."""
        self._posted[event] = key
        self._posted.move_to_end(event)
        while len(self._posted) > POSTED_KEPT:
            self._posted.popitem(last=False)

    def claim_posted(self, event: JobEvent) -> str | None:
        """The ledger key of ``event`` when this daemon posted it (forgotten as posted)."""
        return self._posted.pop(event, None)

    def consume(self, keys: Sequence[str]) -> None:
        """The current tick took the events of ``keys`` (dropped at :meth:`journaled`)."""
        self._consumed = list(keys)

    def journaled(self) -> None:
        """The tick that took the last events is journaled: drop their pending entries."""
        if self._consumed:
            self.remove(self._consumed)  # a restart must not act again
            self._consumed = []

    def in_flight(self, key: str) -> bool:
        """Whether ``key``'s event is posted or taken by a tick, not journaled yet."""
        return key in self._consumed or key in self._posted.values()

    # -- replayed: resumed at this start ---------------------------------------------------

    def note_replayed(self, crash: WorkerCrash) -> None:
        """``crash`` came from the file at this start and is being finished."""
        self._replayed[self.key(crash.job, crash.pid)] = crash

    def replayed(self, key: str) -> WorkerCrash | None:
        """The crash of ``key`` resumed from the file at this start, if any."""
        return self._replayed.get(key)
