"""A fake daemon for the control-op tests (tests/test_daemon_ops_*.py).

It has the :class:`gpuwatchd.daemon.ops.ControlTarget` shape and nothing else, so an op
test shows exactly what the op reads and changes. Policies and the journal are real.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gpuwatchd.actuators import DecisionRecord, JobCommander
from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import Reply, Request
from gpuwatchd.cordon import CordonActions, Cordons
from gpuwatchd.daemon import ops
from gpuwatchd.daemon.ops import EventSource
from gpuwatchd.daemon.ops.status import brief_status, fit
from gpuwatchd.errors import SupervisorError
from gpuwatchd.journal import Journal
from gpuwatchd.logs import get_logger
from gpuwatchd.model import Decision
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.policy.schema import PolicySet
from gpuwatchd.policyfiles import load_policies

ROOT = PeerCredentials(pid=1, uid=0, gid=0)
ADMIN = PeerCredentials(pid=2, uid=1000, gid=1000)

POLICY = """\
policies:
  - name: gpu-idle
    when:
      low_utilization: {percent: 20, for: 5m}
    do:
      - log: {message: "GPU idle", level: warning}
"""


class FakeCommander:
    """Stands in for the control server: answers each command with ``replies`` after
    ``delay_s`` (or raises ``error``), recording what was sent."""

    def __init__(
        self, replies: list[Reply], *, delay_s: float = 0.0, error: Exception | None = None
    ):
        self.replies = replies
        self.delay_s = delay_s
        self.error = error
        self.sent: list[tuple[str, str, Any]] = []

    async def send_command(
        self,
        job: str,
        op: str,
        params: Any,
        *,
        pid: int | None = None,
        timeout_s: float = 60.0,
        source: str | None = None,
    ) -> list[Reply]:
        self.sent.append((job, op, params))
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return self.replies


class FakeDaemon:
    """The daemon as the ops see it: policies from ``policy_path``, an optional journal."""

    def __init__(
        self,
        policy_path: Path,
        *,
        journal: Journal | None = None,
        commander: JobCommander | None = None,
        status: dict[str, Any] | None = None,
    ) -> None:
        self.log: Any = get_logger("test.ops")
        self.policy_path = policy_path
        self.policies: PolicySet = load_policies([policy_path])
        self.reloads: list[str | None] = []
        self.paused_by: list[tuple[bool, int]] = []
        self.job_controls: list[tuple[str, str, int]] = []
        self._paused = False
        self.status_full: list[bool] = []
        self.status_brief: list[bool] = []
        self._journal = journal
        self._commander = commander
        self.knob_holds = KnobHolds()
        self._status = status if status is not None else {"decisions": [], "findings": []}
        self.decisions: list[DecisionRecord] = []
        self.finished: list[DecisionRecord] = []
        self.cordons = CordonActions(Cordons(None, self.log), None, lambda: 0.0, self.log)

    @property
    def paused(self) -> bool:
        return self._paused

    def set_paused(self, paused: bool, *, by_uid: int) -> None:
        self._paused = paused
        self.paused_by.append((paused, by_uid))

    async def set_cordon(self, gpu: int, cordoned: bool, *, by_uid: int) -> str:
        by = f"operator uid {by_uid}"
        if cordoned:
            return await self.cordons.cordon(gpu, None, by, "gpuwatchctl gpu cordon")
        return self.cordons.uncordon(gpu, None, by=by, operator=True)

    def status_report(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, list) else v for k, v in self._status.items()}

    def status_reply(self, *, full: bool = False, brief: bool = False) -> dict[str, Any]:
        self.status_full.append(full)
        self.status_brief.append(brief)
        report = self.status_report()
        return fit(brief_status(report) if brief else report)

    def jobs_report(self) -> dict[str, Any]:
        return {"jobs": [{"name": "digits", "pid": 4242}], "managed": []}

    def policies_report(self) -> dict[str, Any]:
        return dict(self.policies.to_dict()) | {"paused": self._paused}

    async def reload_policies(self, path: str | None = None) -> PolicySet:
        self.reloads.append(path)
        self.policies = load_policies([path or self.policy_path])
        return self.policies

    def event_source(self) -> EventSource | None:
        return self._journal

    def commander(self) -> JobCommander | None:
        return self._commander

    def record_decision(self, decision: Decision) -> DecisionRecord:
        record = DecisionRecord(decision, "pending", journal_id=len(self.decisions) + 1)
        self.decisions.append(record)
        return record

    def decision_done(self, record: DecisionRecord) -> None:
        self.finished.append(record)

    async def control_job(self, job: str, action: str, *, by_uid: int) -> tuple[int, int]:
        """One managed job, ``hpo``, with two workers; every request is kept."""
        self.job_controls.append((job, action, by_uid))
        if job != "hpo":
            raise SupervisorError(f"no managed job {job!r}", code="not_found")
        return (2 if action != "start" else 0), (2 if action != "stop" else 0)


def call(
    daemon: FakeDaemon, op: str, params: dict[str, Any] | None = None, peer: PeerCredentials = ADMIN
) -> Any:
    """Run one request through :func:`gpuwatchd.daemon.ops.dispatch`."""
    request = Request(id=1, op=op, params=params or {})
    return asyncio.run(ops.dispatch(daemon, request, peer))


def policy_file(tmp_path: Path, text: str = POLICY) -> Path:
    path = tmp_path / "policies.yaml"
    path.write_text(text, encoding="utf-8")
    return path
