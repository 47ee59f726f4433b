"""``watch.loader(factory)``: a re-buildable, timed wrapper around a DataLoader (or any iterable).

Each ``iter()`` is one epoch: it first applies pending knob changes by calling
``factory(knobs)`` again, then yields the batches of the current loader while
timing each ``next()`` (the data wait) and the interval between consecutive
``next()`` calls (the step time). Timing uses :func:`time.perf_counter` only: no
CUDA synchronisation and no lock on the step path.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from gpuwatchd.hook._watch import Watch

__all__ = ["LoaderFactory", "WatchedLoader", "batch_samples"]

logger = logging.getLogger("gpuwatchd.hook")

T_co = TypeVar("T_co", covariant=True)
LoaderFactory = Callable[[dict[str, Any]], Iterable[T_co]]
"""``factory(knobs) -> loader``: builds the loader from the current knob values."""


def batch_samples(batch: object) -> int:
    """Samples in ``batch``: ``len(batch[0])`` for a tuple/list batch, ``len`` of the first
    value of a dict batch, ``len(batch)`` otherwise; 1 when that has no length."""
    first: object = batch
    kind = type(batch)
    if kind is tuple or kind is list:
        if batch:
            first = batch[0]  # type: ignore[index]
    elif isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
    try:
        return len(first)  # type: ignore[arg-type]
    except TypeError:
        return 1


class _TimedIterator(Generic[T_co]):
    """Iterator over one epoch that records one step per batch into the watch.

    The step of batch *i* spans from the ``next()`` call that returned batch *i* to the
    following ``next()`` call; it is recorded when that following call starts (or ends
    the epoch), so the last batch's compute time is counted too.
    """

    __slots__ = ("__weakref__", "_call_s", "_it", "_samples", "_wait_s", "_watch")

    def __init__(self, it: Iterator[T_co], watch: Watch) -> None:
        self._it: Iterator[T_co] | None = it
        self._watch = watch
        self._call_s = -1.0
        self._wait_s = 0.0
        self._samples = 0

    def __iter__(self) -> _TimedIterator[T_co]:
        return self

    def __next__(self) -> T_co:
        start_s = perf_counter()
        if self._call_s >= 0.0:
            self._watch.record_step(start_s - self._call_s, self._wait_s, self._samples)
            self._call_s = -1.0
        it = self._it
        if it is None:
            raise StopIteration
        try:
            batch = next(it)
        except StopIteration:
            self._it = None  # let the DataLoader iterator (and its workers) go now
            raise
        self._wait_s = perf_counter() - start_s
        self._call_s = start_s
        self._samples = batch_samples(batch)
        return batch

    def close(self) -> None:
        """Drop the underlying iterator (a DataLoader iterator shuts its workers down)."""
        self._it = None
        self._call_s = -1.0


class WatchedLoader(Generic[T_co]):
    """The iterable returned by :meth:`gpuwatchd.hook.Watch.loader`.

    ``factory(knobs)`` is called once now (errors propagate to the caller) and again at
    the start of an epoch when a knob changed. ``len()`` and :attr:`loader` give the
    current underlying loader's length and the loader itself.
    """

    def __init__(self, watch: Watch, factory: LoaderFactory[T_co], *, primary: bool) -> None:
        self._watch = watch
        self._factory = factory
        self._primary = primary
        self._built_with: dict[str, Any] = watch.knobs
        self._loader: Iterable[T_co] = factory(dict(self._built_with))
        self._active: weakref.ref[_TimedIterator[T_co]] | None = None
        self._epochs_started = 0
        self.rebuilds = 0
        """How many times the loader was rebuilt after a knob change."""

    @property
    def loader(self) -> Iterable[T_co]:
        """The current underlying loader (a new object after each rebuild)."""
        return self._loader

    @property
    def knobs(self) -> dict[str, Any]:
        """The knob values the current loader was built with."""
        return dict(self._built_with)

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T_co]:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()  # an epoch left early: release its iterator before the new one
        self._active = None
        if self._primary:
            self._watch._set_epoch(self._epochs_started)
        self._epochs_started += 1
        self._apply_knobs()
        timed = _TimedIterator(iter(self._loader), self._watch)
        self._active = weakref.ref(timed)
        return timed

    def _rebuild(self, knobs: dict[str, Any]) -> None:
        """Build a loader for ``knobs`` and drop the old one; raises what the factory raises."""
        new_loader = self._factory(dict(knobs))
        self._loader = new_loader  # the old DataLoader (and any persistent workers) is released
        self._built_with = dict(knobs)
        self.rebuilds += 1

    def _apply_knobs(self) -> None:
        taken = self._watch._take_pending()
        if taken is not None:
            knobs, changes = taken
            if knobs == self._built_with:
                self._watch._commit(knobs, changes)
                return
            try:
                self._rebuild(knobs)
            except BaseException as exc:
                reason = f"the loader factory raised {type(exc).__name__}: {exc}"
                self._watch._reject(changes, reason)
                if not isinstance(exc, Exception):
                    raise
                logger.warning("gpuwatchd: knob change not applied: %s", reason)
                return
            self._watch._commit(knobs, changes)
            return
        current = self._watch.knobs
        if current != self._built_with:  # changed through another loader or apply_knobs()
            try:
                self._rebuild(current)
            except Exception as exc:
                logger.warning(
                    "gpuwatchd: loader kept its old knobs %s: factory raised %s: %s",
                    self._built_with,
                    type(exc).__name__,
                    exc,
                )
