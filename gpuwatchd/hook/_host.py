"""What the loader wrapper needs from the watch (:class:`LoaderHost`), and the pending
daemon commands the watch keeps; ``_loader.py`` depends on this, not on ``_watch.py``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gpuwatchd.model import KnobValue

__all__ = ["Command", "KnobChange", "LoaderHost"]


@dataclass(frozen=True, slots=True)
class KnobChange:
    """A ``set_knob`` accepted but not applied yet; ``generation`` numbers the connection
    it came on (its reply goes only there). ``request_id`` None: a value the daemon
    handed back in its ``hello`` reply (no request to answer; generation 0, kept across
    reconnects)."""

    knob: str
    value: KnobValue
    request_id: str | int | None
    generation: int
    source: str | None = None
    """Who asked (the command's ``source`` param: ``policy <name>``, ``operator``)."""


@dataclass(frozen=True, slots=True)
class Command:
    """A ``drain`` or ``stop`` received but not applied yet (acknowledged when applied)."""

    request_id: str | int
    generation: int


class LoaderHost(Protocol):
    """The watch as :class:`~gpuwatchd.hook.WatchedLoader` uses it (training thread only).

    Implemented by :class:`~gpuwatchd.hook.Watch`.
    """

    @property
    def stop_pending(self) -> bool:
        """Read once per batch: True when a ``stop`` waits for the next safe point."""

    @property
    def knobs(self) -> dict[str, Any]:
        """Current (applied) knob values (a copy)."""

    @property
    def should_stop(self) -> bool:
        """A ``drain`` or ``stop`` was applied: start no new epoch."""

    def record_step(self, step_time_s: float, data_wait_s: float, samples: int = 1) -> None:
        """Record one step: seconds of compute and of waiting for data, samples in it."""

    def safe_point(self) -> bool:
        """Apply a pending ``stop``; True when training should end here."""

    def stop_exception(self) -> BaseException | None:
        """The exception a stop raises inside a trial (``optuna.TrialPruned``), if any."""

    def set_epoch(self, epoch: int) -> None:
        """The primary loader starts epoch ``epoch`` (from 0)."""

    def epoch_finished(self) -> None:
        """The primary loader ran an epoch to its end (idempotent per epoch)."""

    def take_pending_knobs(self) -> tuple[dict[str, Any], list[KnobChange]] | None:
        """The knob values with the pending changes applied, and those changes; None if none."""

    def commit_knobs(self, knobs: dict[str, Any], changes: Iterable[KnobChange]) -> None:
        """The loader now runs with ``knobs``: make them current and acknowledge ``changes``."""

    def reject_knobs(self, changes: Iterable[KnobChange], reason: str) -> None:
        """The loader could not be rebuilt: refuse ``changes`` with ``reason``."""
