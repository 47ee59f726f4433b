"""Decisions carried out through Slurm: the parallelism ladder of an attached Slurm array
(its ``ArrayTaskThrottle``) and the drain of this node, each read back from slurmctld and
decided idempotently, so daemons on several nodes converge. Specification: docs/slurm.md.
"""

from __future__ import annotations

import math
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from gpuwatchd.config import SlurmArrayConfig
from gpuwatchd.errors import ActionRefused, ConfigError
from gpuwatchd.jobs.attribution import TRIALS_KEPT
from gpuwatchd.jobs.study_recovery import StudyRecovery, describe_requeue
from gpuwatchd.model import Decision, JobEvent, JobInfo
from gpuwatchd.slurm import (
    SLURM_NODE_PATTERN,
    ArrayThrottle,
    Slurm,
    SlurmCommandFailed,
    SlurmOutputError,
)

__all__ = ["ARRAYS_KEPT", "SlurmActions", "node_name", "this_node"]

ARRAYS_KEPT: Final = 8
"""Slurm arrays remembered per job name (the newest seen): a ladder decision acts on those
still pending or running, also between two tasks, when none is attached."""


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
    """Carries out ``lower_parallelism``/``raise_parallelism`` on Slurm arrays and
    ``drain_node``/the operator's resume on this node.

    ``slurm``: the client (:class:`gpuwatchd.slurm.Slurm`). ``arrays``: the configured
    arrays by job name (``slurm.arrays``); the array ids come from the attached jobs'
    hellos, fed each tick to :meth:`observe`. ``node``: this node's ``NodeName``
    (:func:`node_name`; :class:`ValueError` for one that is not). ``max_drained_nodes``:
    the cluster-wide cap on nodes drained with gpuwatchd's reason. ``study``: the Optuna
    storage access for ``restart_study`` (the arrays' ``optuna:``). ``logger``:
    structlog-style. ``clock``: seconds (monotonic), when a throttle was seen lowered,
    for the arrays' ``raise_hold``.
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

    def owns(self, job: str) -> bool:
        """Whether ``job`` is a configured Slurm array (its ladder moves a throttle)."""
        return job in self._arrays

    def observe(self, jobs: Sequence[JobInfo]) -> None:
        """Remember the arrays the attached ``jobs`` of configured names run in, with the
        peer uid of each hello that named one, and the trial each reports running."""
        for info in jobs:
            seen = self._seen.get(info.name)
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
        one that ended ``FAIL`` is the one a crash right after it died in."""
        for event in events:
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
        namers = sorted(self._namers.get(array.array_job_id, ()))
        if array.user_id is None or array.user_id not in namers:
            return (
                f"it runs as uid {array.user_id}, not as the uid of a task attached here "
                f"({', '.join(map(str, namers)) or 'none known'})"
            )
        if self.node not in array.hosts:
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
        trial = params.get("trial_number")
        pid = params.get("pid")
        if trial is None and isinstance(pid, int) and pid in self._trials:
            last, crashed_in = self._trials[pid]
            trial = last if crashed_in else None
        if config.optuna is None or self._study is None:
            raise ActionRefused(f"Slurm array {job!r} has no optuna: to recover trials in")
        if isinstance(trial, bool) or not isinstance(trial, int):
            raise ActionRefused(f"the crashed task of {job!r} named no trial")
        asked = params.get("max_retries", config.optuna.max_retries)
        retries = min(int(asked) if isinstance(asked, int) else 0, config.optuna.max_retries)
        reason = str(params.get("crash_kind") or "other")
        results = await self._study.fail_and_requeue(
            config.optuna, [trial], max_retries=retries, reason=reason
        )
        return "; ".join(describe_requeue(result, retries) for result in results)

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
