"""Cordoned GPUs: no new managed worker is placed on them, and what stands on them moves.

:class:`Cordons` is the set of cordoned GPUs, kept in ``<state_dir>/cordons.json``
(replaced atomically, read at start) so a cordon survives a daemon restart; a GPU is
named by its UUID (stable across reboots and re-enumeration) and the NVML index it had
(shown to people; used where the UUID is not known). :class:`CordonActions` cordons and
lifts cordons for the policy actions (their contracts: gpuwatchd/policy/actions/cordon_gpu.py
and uncordon_gpu.py) and for the operator's ``gpuwatchctl gpu cordon|uncordon N``: a
cordon moves the managed workers on the GPU elsewhere (their trials re-enqueued up to
the job's ``optuna.max_retries``: stopped by gpuwatchd, not at fault); a policy lifts only
a policy's cordon, an operator any. A lifted GPU takes new workers again; nothing
already placed moves back.
Specification: docs/managed-jobs.md, "Cordoned GPUs".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from gpuwatchd.errors import ActionRefused
from gpuwatchd.jobs.records import WorkerInfo
from gpuwatchd.model import GpuSample
from gpuwatchd.policy.actions import ACTIONS
from gpuwatchd.policy.actions.spec import Effects
from gpuwatchd.statefile import write_json_atomic

__all__ = [
    "CORDONS_FILENAME",
    "MAX_CORDONS",
    "RESUME_WINDOW_S",
    "Cordon",
    "CordonActions",
    "Cordons",
    "WorkerMover",
    "resume_cordons",
]

CORDONS_FILENAME: Final = "cordons.json"
"""The file under the state directory that keeps the cordons."""
MAX_CORDONS: Final = 1024
"""Cordons kept at most (a host has at most a few dozen GPUs; a larger file is refused)."""
_REASON_CHARS: Final = 500
RESUME_WINDOW_S: Final = 24 * 3600.0
"""How far back :func:`resume_cordons` looks for interrupted cordon decisions."""


@dataclass(frozen=True, slots=True)
class Cordon:
    """One cordoned GPU: ``uuid`` (``""`` where NVML gave none), the NVML ``index`` it had,
    when (``since_s``, daemon clock), ``by`` (``"policy NAME"`` or ``"operator uid N"``)
    and why (``reason``: the findings' messages, cut to 500 characters)."""

    uuid: str
    index: int
    since_s: float
    by: str
    reason: str = ""

    @property
    def key(self) -> str:
        """The set's key: the UUID, else ``index:N``."""
        return self.uuid or f"index:{self.index}"

    @property
    def by_policy(self) -> bool:
        """Whether a policy set it (a policy's ``uncordon_gpu`` may lift it)."""
        return self.by.startswith("policy ")


class Cordons:
    """The cordoned GPUs, persisted in ``path`` (None: in memory only, for tests).

    ``logger``: structlog-style. :meth:`load` reads the file (a missing file is none; an
    unreadable or malformed one is logged as an error and taken as none). Every change is
    written at once; a failed write is logged and the change stays in memory. Not
    thread-safe: the daemon uses it on its event-loop thread.
    """

    def __init__(self, path: Path | None, logger: Any) -> None:
        self._path = path
        self._log = logger
        self._by_key: dict[str, Cordon] = {}

    def load(self) -> None:
        """Read the cordons kept by an earlier daemon (see the class docstring)."""
        path = self._path
        if path is None or not path.exists():
            return
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            rows = data["cordons"]
            if not isinstance(rows, list) or len(rows) > MAX_CORDONS:
                raise ValueError("'cordons' must be a list of at most 1024")
            loaded = [
                Cordon(
                    uuid=str(r["uuid"]),
                    index=int(r["index"]),
                    since_s=float(r["since_s"]),
                    by=str(r["by"]),
                    reason=str(r.get("reason", ""))[:_REASON_CHARS],
                )
                for r in rows
            ]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._log.error("gpu.cordons_unreadable", path=str(path), error=str(exc))
            return
        self._by_key = {c.key: c for c in loaded}
        if loaded:
            self._log.warning(
                "gpu.cordons_restored", gpus=[c.index for c in loaded], path=str(path)
            )

    def _save(self) -> None:
        if self._path is None:
            return
        try:
            write_json_atomic(
                self._path, {"version": 1, "cordons": [asdict(c) for c in self._by_key.values()]}
            )
        except OSError as exc:
            self._log.error("gpu.cordons_write_failed", path=str(self._path), error=str(exc))

    def all(self) -> list[Cordon]:
        """The cordons, by NVML index."""
        return sorted(self._by_key.values(), key=lambda c: (c.index, c.uuid))

    def find(self, uuid: str | None, index: int | None) -> Cordon | None:
        """The cordon of the GPU with ``uuid`` (else with NVML ``index``), if any."""
        if uuid:
            found = self._by_key.get(uuid)
            if found is not None:
                return found
        if index is not None:
            for cordon in self._by_key.values():
                if cordon.index == index and (not uuid or not cordon.uuid):
                    return cordon
        return None

    def shown(self, index: int, gpus: Iterable[GpuSample]) -> Cordon | None:
        """The cordon shown as GPU ``index`` (:meth:`indexes`' mapping over ``gpus``): what
        an operator's ``gpuwatchctl gpu uncordon N`` names."""
        by_uuid = {g.uuid: g.index for g in gpus}
        for cordon in self.all():
            if by_uuid.get(cordon.uuid, cordon.index) == index:
                return cordon
        return None

    def add(self, cordon: Cordon) -> bool:
        """Cordon a GPU; False when it already was (the first cordon is kept)."""
        if self.find(cordon.uuid, cordon.index) is not None:
            return False
        if len(self._by_key) >= MAX_CORDONS:
            raise ActionRefused(f"{MAX_CORDONS} GPUs are cordoned already")
        self._by_key[cordon.key] = Cordon(
            cordon.uuid, cordon.index, cordon.since_s, cordon.by, cordon.reason[:_REASON_CHARS]
        )
        self._save()
        return True

    def remove(self, cordon: Cordon) -> None:
        """Lift ``cordon``."""
        self._by_key.pop(cordon.key, None)
        self._save()

    def indexes(self, gpus: Iterable[GpuSample]) -> frozenset[int]:
        """The NVML indexes of the cordoned GPUs among ``gpus`` (matched by UUID; a cordon
        whose UUID is not among them, or that has none, counts by its recorded index)."""
        by_uuid = {g.uuid: g.index for g in gpus}
        return frozenset(by_uuid.get(c.uuid, c.index) for c in self._by_key.values())

    def report(self, gpus: Iterable[GpuSample] = ()) -> list[dict[str, Any]]:
        """``status``'s ``cordons``: each cordon as a dict, by index; ``index`` is the one
        the GPU has among ``gpus`` (matched by UUID), else the recorded one."""
        by_uuid = {g.uuid: g.index for g in gpus}
        rows = [asdict(c) | {"index": by_uuid.get(c.uuid, c.index)} for c in self.all()]
        return sorted(rows, key=lambda r: r["index"])


class WorkerMover(Protocol):
    """What cordoning needs from the supervisor (:class:`gpuwatchd.jobs.supervisor.Supervisor`)."""

    def workers(self, job: str | None = None) -> list[WorkerInfo]: ...

    async def restart_worker(self, job: str, worker: int, gpu: int | None = None) -> None: ...

    def note_cordoned(self, indexes: frozenset[int]) -> None: ...


_MOVABLE: Final = frozenset({"running", "backoff"})
"""Worker states that are moved off a cordoned GPU (a draining or stopping worker is on
its way out already; a stopped or failed one is placed anew when it starts)."""


class CordonActions:
    """Carries out cordon decisions over :class:`Cordons` and the supervisor (``None``
    without managed jobs: a cordon then only keeps future placements off the GPU).

    The daemon hands it the latest GPU inventory (:meth:`note_gpus`: at start, then each
    tick), which names an operator's GPU by UUID; it hands the supervisor the NVML indexes
    of the cordoned GPUs (``note_cordoned``) at each inventory and each cordon change.
    ``clock`` the daemon's seconds; ``logger`` structlog-style.
    """

    def __init__(
        self,
        cordons: Cordons,
        supervisor: WorkerMover | None,
        clock: Any,
        logger: Any,
    ) -> None:
        self.cordons = cordons
        self._supervisor = supervisor
        self._gpus: tuple[GpuSample, ...] = ()
        self._clock = clock
        self._log = logger

    def note_gpus(self, gpus: Sequence[GpuSample]) -> None:
        """The GPUs seen now (the daemon's latest sample); tells the supervisor which of
        them are cordoned."""
        self._gpus = tuple(gpus)
        self._tell_supervisor()

    def _tell_supervisor(self) -> None:
        if self._supervisor is not None:
            self._supervisor.note_cordoned(self.cordons.indexes(self._gpus))

    def _uuid_of(self, index: int) -> str:
        return next((g.uuid for g in self._gpus if g.index == index), "")

    async def cordon(
        self, index: int, uuid: str | None, by: str, reason: str, *, relaunch: bool = True
    ) -> str:
        """Cordon GPU ``index`` (``uuid`` None: looked up); returns the outcome's detail.

        Raises :class:`ActionRefused` for a negative index or when too many are cordoned.
        """
        if index < 0:
            raise ActionRefused(f"no such GPU index {index}")
        if uuid is None and self.cordons.shown(index, self._gpus) is not None:
            return f"GPU {index} was cordoned already"
        uuid = uuid if uuid is not None else self._uuid_of(index)
        added = self.cordons.add(Cordon(uuid, index, float(self._clock()), by, reason))
        self._tell_supervisor()  # before any worker moves: none is placed on it again
        head = f"GPU {index} cordoned" if added else f"GPU {index} was cordoned already"
        if added:
            self._log.warning(
                "gpu.cordoned", gpu=index, gpu_uuid=uuid or None, by=by, reason=reason
            )
        if not relaunch or self._supervisor is None:
            return head
        moved: list[str] = []
        for w in self._supervisor.workers():
            if w.gpu_index != index or w.state not in _MOVABLE:
                continue
            try:
                await self._supervisor.restart_worker(w.job, w.worker)
            except Exception as exc:  # one worker's refusal must not stop the others
                self._log.error(
                    "gpu.cordon_move_failed",
                    job=w.job,
                    worker=w.worker,
                    gpu=index,
                    error=str(exc),
                )
                continue
            moved.append(f"{w.job} worker {w.worker}")
        if not moved:
            return head + "; no managed worker on it"
        return head + f"; relaunched elsewhere: {', '.join(moved)} (their trials retried)"

    def uncordon(self, index: int, uuid: str | None, *, by: str, operator: bool) -> str:
        """Lift the cordon of GPU ``index``; returns the outcome's detail.

        A policy (``operator=False``) lifts only a cordon a policy set (a GPU not cordoned
        is no error for it: nothing to lift). Raises :class:`ActionRefused` for an
        operator when the GPU is not cordoned, and for a policy when an operator
        cordoned it.
        """
        if uuid is None:  # an operator's index: the GPU as status shows it
            cordon = self.cordons.shown(index, self._gpus)
        else:
            cordon = self.cordons.find(uuid, index)
        if cordon is None:
            if not operator:  # a recovery of a GPU no policy cordoned: nothing to lift
                return f"GPU {index} was not cordoned; nothing to lift"
            raise ActionRefused(f"GPU {index} is not cordoned")
        if not operator and not cordon.by_policy:
            raise ActionRefused(
                f"GPU {index} was cordoned by {cordon.by}; only an operator lifts it "
                f"(gpuwatchctl gpu uncordon {index})"
            )
        self.cordons.remove(cordon)
        self._tell_supervisor()
        self._log.warning("gpu.uncordoned", gpu=index, gpu_uuid=cordon.uuid or None, by=by)
        return f"GPU {index} uncordoned (cordoned by {cordon.by})"

    def is_cordoned(self, index: int) -> bool:
        """Whether GPU ``index`` is cordoned (for refusing ``place_on_idle_gpu``)."""
        return index in self.cordons.indexes(self._gpus)


async def resume_cordons(journal: Any, actions: CordonActions, now_s: float, logger: Any) -> int:
    """Carry out the cordon decisions a killed daemon journaled but never finished
    (outcome ``unknown`` after :meth:`gpuwatchd.journal.Journal.recover`, within
    :data:`RESUME_WINDOW_S`): the ``resumable`` actions (``cordon_gpu``, ``uncordon_gpu``)
    are idempotent, so each runs now through its action module and gets its real outcome
    with ``resumed after a daemon restart`` in the detail. Dry-run decisions are left
    alone. ``journal``: an open :class:`gpuwatchd.journal.Journal`. Returns how
    many were resumed; never raises for one decision (its failure is its outcome)."""
    resumed = 0
    effects = Effects(gpus=actions)
    for entry in journal.journaled_since(now_s - RESUME_WINDOW_S):
        decision = entry.decision
        spec = ACTIONS.get(decision.action)
        if entry.outcome != "unknown" or decision.dry_run:
            continue
        if spec is None or not spec.resumable or spec.carry_out is None:
            continue
        try:
            outcome, detail = await spec.carry_out(decision, effects)
        except ActionRefused as exc:
            detail, outcome = exc.message, "refused"
        except Exception as exc:  # one bad decision must not stop the daemon's start
            detail, outcome = f"{type(exc).__name__}: {exc}", "failed"
        try:
            journal.record_outcome(
                entry.id, outcome, f"resumed after a daemon restart: {detail}", now_s
            )
        except Exception as exc:
            logger.error("cannot record a resumed outcome", decision_id=entry.id, error=str(exc))
        resumed += 1
    return resumed
