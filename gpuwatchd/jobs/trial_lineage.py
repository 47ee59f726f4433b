"""Retry chains of an Optuna study: gpuwatchd's retries and those of Optuna's
``RetryFailedTrialCallback``, read as one lineage. Pure: reads trials, imports no Optuna.

Specification: docs/modules.md#gpuwatchdjobstrial_lineage
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol

__all__ = [
    "ATTR_MAX_RETRIES",
    "ATTR_PARENT",
    "ATTR_RETRY",
    "ATTR_RETRY_OF",
    "ATTR_RETRY_REASON",
    "SYSTEM_ATTR_FAILED_TRIAL",
    "SYSTEM_ATTR_RETRY_HISTORY",
    "RetryChains",
    "RetryMaker",
    "TrialLike",
    "retry_link",
]

ATTR_RETRY_OF = "gpuwatchd:retry_of"
"""User attr of a gpuwatchd retry: number of the original trial of its chain."""
ATTR_PARENT = "gpuwatchd:parent"
"""User attr of a gpuwatchd retry: number of the failed trial it replaces."""
ATTR_RETRY = "gpuwatchd:retry"
"""User attr of a gpuwatchd retry: its 1-based position in the chain."""
ATTR_RETRY_REASON = "gpuwatchd:retry_reason"
"""User attr of a gpuwatchd retry: why its parent was failed."""
ATTR_MAX_RETRIES = "gpuwatchd:max_retries"
"""User attr of a gpuwatchd retry: the ``max_retries`` in force when it was enqueued."""
SYSTEM_ATTR_FAILED_TRIAL = "failed_trial"
"""Optuna's system attr of a retry (``optuna.storages.RetryFailedTrialCallback``): number of
the original trial of its chain; ``RetryFailedTrialCallback.retried_trial_number`` reads it."""
SYSTEM_ATTR_RETRY_HISTORY = "retry_history"
"""Optuna's system attr of a retry: the numbers of the trials of its chain before it, original
first, its parent last; ``RetryFailedTrialCallback.retry_history`` reads it."""

RetryMaker = Literal["gpuwatchd", "optuna"]
"""Who made a retry: gpuwatchd (``gpuwatchd.jobs.study.fail_and_requeue`` and
``fail_stale_trials``) or Optuna's ``RetryFailedTrialCallback`` (run by a worker's heartbeat
check)."""


class TrialLike(Protocol):
    """What is read of a trial: :class:`optuna.trial.FrozenTrial` has it."""

    @property
    def number(self) -> int:
        """The trial's number in its study."""

    @property
    def user_attrs(self) -> Mapping[str, Any]:
        """The trial's user attrs."""

    @property
    def system_attrs(self) -> Mapping[str, Any]:
        """The trial's system attrs."""


def retry_link(trial: TrialLike) -> tuple[int, RetryMaker] | None:
    """(number of the trial ``trial`` retries, who made it), or None when it is no retry.

    Optuna's ``RetryFailedTrialCallback`` writes ``retry_history`` (the parent last) and
    copies the failed trial's user attrs into its retry, so a retry whose
    ``gpuwatchd:parent`` is the last of its ``retry_history`` is gpuwatchd's, and one with
    another (copied) ``gpuwatchd:parent`` or none is Optuna's. A gpuwatchd retry enqueued
    before gpuwatchd wrote the system attrs has only ``gpuwatchd:parent``. A parent that is
    not an int, or is the trial itself, makes no link.
    """
    history = trial.system_attrs.get(SYSTEM_ATTR_RETRY_HISTORY)
    own = trial.user_attrs.get(ATTR_PARENT)
    parent: object
    if isinstance(history, list) and history:
        parent = history[-1]
        maker: RetryMaker = "gpuwatchd" if own == parent else "optuna"
    else:
        parent, maker = own, "gpuwatchd"
    if isinstance(parent, int) and not isinstance(parent, bool) and parent != trial.number:
        return parent, maker
    return None


class RetryChains:
    """The retry chains of one study's trials, whoever made the retries.

    Each retry links to its parent (:func:`retry_link`) and a chain is followed through the
    links, so a chain mixing gpuwatchd's and Optuna's retries is one chain, and its length
    counts both (``max_retries``). Trial numbers in, trial numbers out.
    """

    def __init__(self, trials: Iterable[TrialLike]) -> None:
        """Index ``trials`` (one study's, in any order)."""
        self._links: dict[int, tuple[int, RetryMaker]] = {}
        self._first_retry: dict[int, int] = {}
        for trial in sorted(trials, key=lambda t: t.number):
            self.add(trial)

    def add(self, trial: TrialLike) -> None:
        """Index ``trial``, newer than every trial indexed before (a trial's first retry is
        the first one indexed)."""
        link = retry_link(trial)
        if link is not None:
            self._links[trial.number] = link
            self._first_retry.setdefault(link[0], trial.number)

    def is_retry(self, number: int) -> bool:
        """Whether trial ``number`` is a retry."""
        return number in self._links

    def maker(self, number: int) -> RetryMaker | None:
        """Who made retry ``number`` (None: not a retry)."""
        link = self._links.get(number)
        return None if link is None else link[1]

    def parent(self, number: int) -> int | None:
        """The trial retry ``number`` replaces (None: not a retry)."""
        link = self._links.get(number)
        return None if link is None else link[0]

    def retry_of(self, number: int) -> int | None:
        """The first retry made of trial ``number``, by either maker (None: none)."""
        return self._first_retry.get(number)

    def history(self, number: int) -> list[int]:
        """The trials of ``number``'s chain before it, original first, its parent last
        (``[]``: not a retry); its length is ``number``'s position in the chain."""
        chain: list[int] = []
        parent = self.parent(number)
        while parent is not None and parent != number and parent not in chain:  # no loops
            chain.append(parent)
            parent = self.parent(parent)
        return chain[::-1]
