"""The ``status`` reply as JSON text, kept in parts that are encoded again only when they
change: the tick's (GPUs, host, findings) once per tick, each job once per report, each
decision once per outcome, the policies once per load. A request joins the parts and
encodes the few small ones that change at any time (pause, holds, journal, managed
jobs). Reply contents: docs/cli.md; why: bench/control.py (issue 24)."""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from gpuwatchd import __version__
from gpuwatchd.actuators import DecisionRecord
from gpuwatchd.config import Settings
from gpuwatchd.control.protocol import REPLY_BUDGET_BYTES, EncodedText, json_text
from gpuwatchd.daemon.ops.status import (
    BRIEF_DECISIONS,
    TRUNCATED_PARTS,
    Member,
    brief_job,
    brief_process,
    fit_members,
)
from gpuwatchd.daemon.report import RECENT_XID_EVENTS, gpus_and_host, plain
from gpuwatchd.daemon.restore import JournalKeeper
from gpuwatchd.daemon.tick import Ticker
from gpuwatchd.model import JobInfo, JobProcessSample, Snapshot
from gpuwatchd.policy.holds import KnobHold
from gpuwatchd.policy.schema import PolicySet

__all__ = ["TRUNCATED_PARTS", "StatusView"]


class _JobText(NamedTuple):
    """A job's kept text in a ``status`` reply and what it was made of."""

    job: JobInfo
    head: str
    """The text of ``job``'s entry without its closing brace."""
    process: JobProcessSample | None
    text: str


class StatusView:
    """Answers ``status`` from JSON text kept per part (module docstring).

    ``settings``, ``ticker`` and ``keeper`` are the daemon's; ``started_at_s`` (the
    daemon's clock) and ``started_monotonic_s`` (``time.monotonic``) date its start.
    :meth:`reply` gives the reply; it is the object
    :func:`gpuwatchd.daemon.report.status_dict` builds (less the policy definitions
    without ``full``), fitted to a line by :func:`gpuwatchd.daemon.ops.status.fit_members`
    (the one place that trims a ``status``).
    Not thread-safe: the event loop's.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        ticker: Ticker,
        keeper: JournalKeeper,
        started_at_s: float,
        started_monotonic_s: float,
    ) -> None:
        self._settings = settings
        self._ticker = ticker
        self._keeper = keeper
        self._head = json_text(
            {"version": __version__, "pid": os.getpid(), "started_at_s": started_at_s}
        )[1:-1]
        self._started_monotonic_s = started_monotonic_s
        self._snapshot: Snapshot | None = None
        self._gpus_host = ""
        self._findings_of: object = None
        self._findings: list[str] = []
        self._processes: dict[int, JobProcessSample] = {}
        """The tick's view of each attached job's process, by pid."""
        self._process_texts: dict[tuple[int, bool], str] = {}
        """The ``process`` member's text of each pid of the tick (and ``brief``)."""
        self._jobs: dict[bool, dict[tuple[str, int], _JobText]] = {}
        """Each job's kept text and what it was made of, per ``brief``."""
        self._last_jobs: dict[bool, tuple[Snapshot | None, Sequence[JobInfo], list[str]]] = {}
        """The last request's jobs and their texts, per ``brief``, and the tick they saw."""
        self._decisions: dict[int, tuple[tuple[Any, ...], str]] = {}
        self._policies: dict[bool, tuple[tuple[Any, ...], str]] = {}

    # -- parts that change with the tick ------------------------------------------------

    def _tick_parts(self) -> tuple[str, list[str]]:
        """The ``gpus`` and ``host`` members, and the findings' texts, of the last tick."""
        ticker = self._ticker
        snap = ticker.last_snapshot
        if snap is not self._snapshot or not self._gpus_host:
            self._snapshot = snap
            self._gpus_host = json_text(gpus_and_host(snap))[1:-1]
            self._processes = {}
            self._process_texts = {}
            for process in snap.host.jobs if snap is not None and snap.host is not None else ():
                self._processes.setdefault(process.pid, process)
        if ticker.active is not self._findings_of:  # a tick replaces the dict
            self._findings_of = ticker.active
            self._findings = [json_text(plain(f)) for f in ticker.active.values()]
        return self._gpus_host, self._findings

    # -- parts that change between ticks ------------------------------------------------

    def _job_texts(self, jobs: Sequence[JobInfo], brief: bool) -> list[str]:
        """One text per attached job (``brief``: as
        :func:`~gpuwatchd.daemon.ops.status.brief_job` gives it): the text of its
        :class:`JobInfo`, encoded again when that is another object (a session keeps its
        ``JobInfo`` until a report, a trial or a knob changes it,
        :meth:`gpuwatchd.control.sessions.JobSession.info`: an unchanged job costs
        identity checks), then its ``process`` member, the tick's view of its process,
        encoded once per tick and pid. (A job encoded whole whenever its process sample
        was another object made the first ``status`` after each tick encode every job:
        1.8 ms of thread CPU with 64 jobs of 64 processes, 0.8 ms now.) Within a tick, a
        job that is the same object at the same place as in the last request keeps its
        text without a look-up, and all of them when none changed."""
        processes = self._processes  # of the tick: _tick_parts ran first
        snap, last_jobs, last_texts = self._last_jobs.get(brief, (None, (), []))
        same_tick = snap is self._snapshot
        if same_tick and len(last_jobs) == len(jobs) and all(map(operator.is_, last_jobs, jobs)):
            return list(last_texts)  # nothing changed (fit_members cuts a copy)
        was = self._jobs.setdefault(brief, {})
        out = []
        for at, job in enumerate(jobs):
            if same_tick and at < len(last_jobs) and last_jobs[at] is job:
                out.append(last_texts[at])  # unchanged, in the same place: the same text
                continue
            seen = processes.get(job.pid)  # a process is frozen, a new one each tick
            hit = was.get((job.name, job.pid))  # a job's workers share its name
            if hit is None or hit.job is not job:
                entry = plain(job)
                head = json_text(brief_job(entry) if brief else entry)[:-1]
                hit = _JobText(
                    job, head, seen, head + ',"process":' + self._process_text(seen, brief) + "}"
                )
            elif hit.process is not seen:
                hit = _JobText(
                    job,
                    hit.head,
                    seen,
                    hit.head + ',"process":' + self._process_text(seen, brief) + "}",
                )
            was[job.name, job.pid] = hit
            out.append(hit.text)
        if len(was) != len(jobs):  # a job came or went: forget the gone
            self._jobs[brief] = {(job.name, job.pid): was[job.name, job.pid] for job in jobs}
        self._last_jobs[brief] = (self._snapshot, tuple(jobs), out)
        return list(out)

    def _process_text(self, seen: JobProcessSample | None, brief: bool) -> str:
        """The ``process`` member's text of a job whose process the tick saw as ``seen``."""
        if seen is None:
            return "null"
        text = self._process_texts.get((seen.pid, brief))
        if text is None:
            entry = plain(seen)
            text = self._process_texts[seen.pid, brief] = json_text(
                brief_process(entry) if brief else entry
            )
        return text

    def _decision_texts(self, records: Sequence[DecisionRecord]) -> list[str]:
        """One text per decision record, encoded again when its outcome changed."""
        kept: dict[int, tuple[tuple[Any, ...], str]] = {}
        out = []
        for record in records:
            key = (record, record.outcome, record.detail, record.finished_at_s, record.journal_id)
            hit = self._decisions.get(id(record))
            if hit is None or hit[0] != key:
                hit = (key, json_text(record.to_dict()))
            kept[id(record)] = hit
            out.append(hit[1])
        self._decisions = kept
        return out

    def _policies_text(
        self, policies: PolicySet, loaded_at_s: float, paused: bool, full: bool
    ) -> str:
        """The ``policies`` member's text, kept per ``full`` until a reload or a pause."""
        key = (policies, loaded_at_s, paused)
        kept = self._policies.get(full)
        if kept is None or any(a is not b and a != b for a, b in zip(key, kept[0], strict=True)):
            out: dict[str, Any] = {"sources": list(policies.sources)}
            out["policies"] = (
                [p.to_dict() for p in policies.policies]
                if full
                else [{"name": name} for name in policies.names]
            )
            out["loaded_at_s"] = loaded_at_s
            out["paused"] = paused
            out["dry_run"] = self._settings.dry_run
            kept = self._policies[full] = (key, json_text(out))
        return kept[1]

    # -- the reply ------------------------------------------------------------------------

    def reply(
        self,
        *,
        jobs: Sequence[JobInfo],
        managed: list[dict[str, Any]],
        policies: PolicySet,
        policies_loaded_at_s: float,
        paused: bool,
        cordons: list[dict[str, Any]],
        holds: Sequence[KnobHold],
        full: bool = False,
        brief: bool = False,
        budget_bytes: int = REPLY_BUDGET_BYTES,
    ) -> EncodedText:
        """The ``status`` reply's JSON text (class docstring); ``full`` keeps each
        policy's definition in ``policies.policies[]`` (else ``{"name"}`` only);
        ``brief`` gives each job as :func:`~gpuwatchd.daemon.ops.status.brief_job` does
        and the last :data:`~gpuwatchd.daemon.ops.status.BRIEF_DECISIONS` decisions.

        Drops the oldest decisions, then the oldest findings, then the last attached
        jobs, then (``full``) the policies' definitions (their names stay), then the last
        knob holds, GPU cordons and managed jobs, until the text fits ``budget_bytes``;
        ``truncated`` counts each (:data:`TRUNCATED_PARTS`).
        Raises :class:`~gpuwatchd.errors.ProtocolError` (``internal``) for a value JSON
        cannot carry (NaN).
        """
        ticker = self._ticker
        gpus_host, findings = self._tick_parts()
        stats = ticker.stats
        snap = self._snapshot
        before = json_text(
            {
                "uptime_s": time.monotonic() - self._started_monotonic_s,
                "interval_s": self._settings.interval_s,
                "ticks": stats.ticks,
                "failed_ticks": stats.failed_ticks,
                "last_tick_duration_s": stats.last_tick_duration_s,
                "last_tick_at_s": stats.last_tick_at_s,
                "gpu_status": snap.gpu_status if snap else ticker.gpu_status,
            }
        )[1:-1]
        tail = json_text(
            {
                "xid_events": [e.to_dict() for e in ticker.xid_log.recent(RECENT_XID_EVENTS)],
                "xid_watch": ticker.xid_watch(),
                "journal": self._keeper.report(),
            }
        )[1:-1]
        decisions = self._decision_texts(ticker.decisions)
        members: list[Member] = [
            (None, self._head),
            (None, before),
            (None, gpus_host),
            ("jobs", self._job_texts(jobs, brief)),
            ("managed", [json_text(entry) for entry in managed]),
            ("paused", "true" if paused else "false"),
            ("cordons", [json_text(entry) for entry in cordons]),
            ("holds", [json_text(held.to_dict()) for held in holds]),
            ("dry_run", "true" if self._settings.dry_run else "false"),
            ("policies", self._policies_text(policies, policies_loaded_at_s, paused, full)),
            ("findings", list(findings)),
            ("decisions", decisions[-BRIEF_DECISIONS:] if brief else decisions),
            (None, tail),
        ]
        names = None
        if full:  # the definitions go before the live lists
            short = self._policies_text(policies, policies_loaded_at_s, paused, False)
            names = (short, len(policies.policies))
        text, _ = fit_members(members, budget_bytes, policy_names=names)
        return EncodedText(text)
