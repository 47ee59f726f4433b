"""The crash ledger: worker crashes the daemon has not finished with (``crashes-pending.json``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

from gpuwatchd.crash import CrashInfo, CrashKind
from gpuwatchd.jobs.records import WorkerCrash
from gpuwatchd.statefile import write_json_atomic
from gpuwatchd.xid import XidEvent

__all__ = ["CRASH_LEDGER_FILENAME", "CrashLedger", "crash_from_dict", "crash_to_dict"]

CRASH_LEDGER_FILENAME = "crashes-pending.json"
"""Worker crashes not yet journaled by a tick (``<state_dir>/crashes-pending.json``)."""


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
    """Worker crashes the daemon has not finished with, in a JSON file (atomic rewrites).

    An entry is written before anything is done about a crash and removed once a tick has
    journaled the crash's event (or, for a worker the daemon stopped itself, once its
    trial is recovered). A daemon killed in between finds the entry at its next start and
    finishes the job (:meth:`gpuwatchd.jobs.crashes.CrashHandler.replay_ledger`). Errors
    are logged, never raised: a lost entry costs at most one recovery.
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
                crash = crash_from_dict(entry)
            except (KeyError, TypeError, ValueError):
                self._log.warning("ignoring a bad crash ledger entry", entry=repr(entry)[:200])
                continue
            self._entries[self.key(crash.job, crash.pid)] = crash_to_dict(crash)
            crashes.append(crash)
        return crashes

    def add(self, crash: WorkerCrash) -> None:
        """Record ``crash`` (replacing an entry of the same job and pid)."""
        self._entries[self.key(crash.job, crash.pid)] = crash_to_dict(crash)
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
