"""``watch.loader(factory)``: a re-buildable, timed wrapper around a DataLoader (or any iterable).

Each ``iter()`` is one epoch: it first applies pending knob changes by calling
``factory(knobs)`` again, then yields the batches of the current loader while
timing each ``next()`` (the data wait) and the interval between consecutive
``next()`` calls (the step time). Timing uses :func:`time.perf_counter` only: no
CUDA synchronisation and no lock on the step path; the only other work per step is
one attribute read that tells whether the daemon asked to ``stop``.

Also here: :func:`slice_batch` (micro-batches for ``Watch.step``) and
:func:`set_live_loader_knob` / :func:`find_dataloaders`, which change the DataLoader
knobs of loaders a framework (Lightning, the Hugging Face Trainer) built itself.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from time import perf_counter
from typing import Any, Generic, TypeVar

from gpuwatchd.errors import KnobError
from gpuwatchd.hook._host import LoaderHost
from gpuwatchd.model import KnobValue

__all__ = [
    "LoaderFactory",
    "WatchedLoader",
    "batch_samples",
    "find_dataloaders",
    "set_live_loader_knob",
    "slice_batch",
]

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


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``batch``, with the structure ``batch_samples`` understands.

    A tuple, list or namedtuple batch is a record of fields sliced one by one
    (``(x, y)`` -> ``(x[a:b], y[a:b])``); a mapping batch is sliced value by value. A
    field is sliced as a sequence (tensors give views, no copy), a mapping field value
    by value, and a field without a length (a scalar, None) is kept as it is.
    """
    kind: Any = type(batch)
    if kind is tuple or kind is list:
        return kind(_slice_field(item, start, stop) for item in batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return kind(*(_slice_field(item, start, stop) for item in batch))
    return _slice_field(batch, start, stop)


def _slice_field(field: Any, start: int, stop: int) -> Any:
    if isinstance(field, Mapping):
        sliced = {key: _slice_field(value, start, stop) for key, value in field.items()}
        if type(field) is dict:
            return sliced
        kind: Any = type(field)
        try:
            return kind(sliced)  # e.g. transformers' BatchEncoding
        except Exception:
            return sliced
    try:
        len(field)
    except TypeError:
        return field
    return field[start:stop]


def find_dataloaders(obj: object, _depth: int = 0) -> list[Any]:
    """The ``torch.utils.data.DataLoader`` objects in ``obj``: itself, or inside lists,
    tuples, dicts and Lightning's ``CombinedLoader`` (``.iterables``), deduplicated.

    A DataLoader is recognised by its ``num_workers``, ``dataset`` and ``batch_sampler``
    attributes (no torch import). For Accelerate's ``DataLoaderShard`` (what the Hugging
    Face Trainer iterates) it is the wrapped ``base_dataloader``.
    """
    if obj is None or _depth > 4:
        return []
    base = getattr(obj, "base_dataloader", None)
    if base is not None:  # Accelerate's DataLoaderAdapter iterates the DataLoader it wraps
        return find_dataloaders(base, _depth + 1)
    if all(hasattr(obj, name) for name in ("num_workers", "dataset", "batch_sampler")):
        return [obj]
    children: Iterable[object]
    if isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif hasattr(obj, "iterables"):
        return find_dataloaders(obj.iterables, _depth + 1)
    else:
        return []
    found: list[Any] = []
    for child in children:
        for loader in find_dataloaders(child, _depth + 1):
            if not any(loader is seen for seen in found):
                found.append(loader)
    return found


def set_live_loader_knob(loader: Any, name: str, value: KnobValue) -> None:
    """Set DataLoader knob ``name`` on an existing DataLoader; the next ``iter()`` uses it.

    ``num_workers`` and ``prefetch_factor`` only (see
    :data:`gpuwatchd.hook._knobs.LIVE_LOADER_KNOBS`). Going from 0 workers to some sets
    ``prefetch_factor`` to PyTorch's default 2 when it was None; ``prefetch_factor`` on
    a loader with 0 workers is not set (PyTorch refuses it there; the watch sets it when
    ``num_workers`` is raised); a loader with
    ``persistent_workers`` drops its running iterator so that the workers restart with
    the new setting. Raises :class:`KnobError` for other knobs.
    """
    if name == "num_workers":
        loader.num_workers = int(value)
        if value and getattr(loader, "prefetch_factor", 2) is None:
            loader.prefetch_factor = 2  # DataLoader's default with workers
    elif name == "prefetch_factor":
        if not getattr(loader, "num_workers", 0):
            return  # DataLoader refuses prefetch_factor without workers; set once raised
        loader.prefetch_factor = int(value)
    else:
        raise KnobError(
            f"{name} cannot be changed on a DataLoader the framework already built "
            "(DataLoader forbids it); build the loader with watch.loader() to rebuild it",
            knob=name,
        )
    # DataLoader has no public way to stop persistent workers (they live in its private
    # _iterator until the loader is collected): dropping that iterator is the only way
    if getattr(loader, "persistent_workers", False) and getattr(loader, "_iterator", None):
        loader._iterator = None  # its workers shut down when it is collected


class _Seen:
    """How far one ``iter()`` of a :class:`WatchedLoader` went: batches taken, whether it
    ran to its end. Kept by the loader, so it outlives an iterator dropped at once
    (``next(iter(loader))``)."""

    __slots__ = ("batches", "exhausted")

    def __init__(self) -> None:
        self.batches = 0
        self.exhausted = False

    @property
    def peek(self) -> bool:
        """One batch or none taken and the epoch left there: ``next(iter(loader))`` (the
        PyTorch DDP tutorial's look at a batch), not an epoch."""
        return self.batches <= 1 and not self.exhausted


class _TimedIterator(Generic[T_co]):
    """Iterator over one epoch that records one step per batch into the watch.

    The step of batch *i* spans from the ``next()`` call that returned batch *i* to the
    following ``next()`` call; it is recorded when that following call starts (or ends
    the epoch), so the last batch's compute time is counted too.
    """

    __slots__ = (
        "__weakref__",
        "_call_s",
        "_it",
        "_primary",
        "_samples",
        "_seen",
        "_wait_s",
        "_watch",
    )

    def __init__(self, it: Iterator[T_co], watch: LoaderHost, primary: bool, seen: _Seen) -> None:
        self._it: Iterator[T_co] | None = it
        self._watch = watch
        self._primary = primary
        self._seen = seen
        self._call_s = -1.0
        self._wait_s = 0.0
        self._samples = 0

    def __iter__(self) -> _TimedIterator[T_co]:
        return self

    def __next__(self) -> T_co:
        start_s = perf_counter()
        watch = self._watch
        if self._call_s >= 0.0:
            watch.record_step(start_s - self._call_s, self._wait_s, self._samples)
            self._call_s = -1.0
        it = self._it
        if it is None:
            raise StopIteration
        if watch.stop_pending:  # the daemon asked to stop: this is a safe point
            self._stop_here()
        try:
            batch = next(it)
        except StopIteration:
            self._it = None  # let the DataLoader iterator (and its workers) go now
            self._seen.exhausted = True
            if self._primary:
                watch.epoch_finished()
            raise
        self._seen.batches += 1
        self._wait_s = perf_counter() - start_s
        self._call_s = start_s
        self._samples = batch_samples(batch)
        return batch

    def _stop_here(self) -> None:
        """Apply a pending ``stop`` (user callback, ack); end the epoch or prune the trial."""
        if not self._watch.safe_point():
            return
        self._it = None
        pruned = self._watch.stop_exception()
        if pruned is not None:
            raise pruned
        raise StopIteration

    def close(self) -> None:
        """Drop the underlying iterator (a DataLoader iterator shuts its workers down)."""
        self._it = None
        self._call_s = -1.0


class WatchedLoader(Generic[T_co]):
    """The iterable returned by :meth:`gpuwatchd.hook.Watch.loader`.

    ``factory(knobs)`` is called once now (errors propagate to the caller) and again at
    the start of an epoch when a knob changed. ``len()`` and :attr:`loader` give the
    current underlying loader's length and the loader itself; every other public
    attribute (``dataset``, ``batch_size``, ``sampler``, ``num_workers``, ...) is read
    from the current loader, so the wrapper stands in for a DataLoader where the
    training code reads one.

    The first loader of a watch (the *primary*, the training loader) counts epochs and
    ends training when the daemon asks: after a ``drain`` it finishes the current epoch
    and then yields no more batches; after a ``stop`` it ends the epoch at the next
    batch (or raises ``optuna.TrialPruned`` inside a trial).
    """

    def __init__(self, watch: LoaderHost, factory: LoaderFactory[T_co], *, primary: bool) -> None:
        self._watch = watch
        self._factory = factory
        self._primary = primary
        taken = watch.take_pending_knobs()  # e.g. values the daemon handed back at hello
        if taken is not None:
            watch.commit_knobs(*taken)  # applied by building the loader with them
        self._built_with: dict[str, Any] = watch.knobs
        self._loader: Iterable[T_co] = factory(dict(self._built_with))
        self._active: weakref.ref[_TimedIterator[T_co]] | None = None
        self._last: _Seen | None = None
        self._epochs_started = 0
        self._ended_logged = False
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

    def __getattr__(self, name: str) -> Any:
        """Read any other public attribute from the current loader (after a rebuild, the
        new one): a DataLoader's ``dataset``, ``batch_size``, ``sampler``,
        ``batch_sampler``, ``num_workers``, ``collate_fn``, ``drop_last``,
        ``pin_memory``, ``prefetch_factor``, ... so that code written for a DataLoader
        (``len(train_loader.dataset)``) runs unchanged. Raises ``AttributeError`` as the
        loader does; private names (``_x``) are not forwarded.
        """
        if name.startswith("_"):
            raise AttributeError(name)
        loader = self.__dict__.get("_loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    def __iter__(self) -> Iterator[T_co]:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()  # an epoch left early: release its iterator before the new one
        self._active = None
        watch = self._watch
        if self._last is not None and self._last.peek:
            self._epochs_started -= 1  # the last iter() was a look at one batch: no epoch
        elif self._primary and self._epochs_started > 0:
            watch.epoch_finished()  # a no-op when the last epoch ran to its end
        if self._primary:
            if watch.should_stop:
                if not self._ended_logged:
                    self._ended_logged = True
                    logger.info("gpuwatchd: training ended by the daemon; no further epochs")
                return iter(())
            watch.set_epoch(self._epochs_started)
        self._epochs_started += 1
        self._apply_knobs()
        self._last = _Seen()
        timed = _TimedIterator(iter(self._loader), watch, self._primary, self._last)
        self._active = weakref.ref(timed)
        return timed

    def _rebuild(self, knobs: dict[str, Any]) -> None:
        """Build a loader for ``knobs`` and drop the old one; raises what the factory raises."""
        new_loader = self._factory(dict(knobs))
        self._loader = new_loader  # the old DataLoader (and any persistent workers) is released
        self._built_with = dict(knobs)
        self.rebuilds += 1

    def _apply_knobs(self) -> None:
        taken = self._watch.take_pending_knobs()
        if taken is not None:
            knobs, changes = taken
            if knobs == self._built_with:
                self._watch.commit_knobs(knobs, changes)
                return
            try:
                self._rebuild(knobs)
            except BaseException as exc:
                reason = f"the loader factory raised {type(exc).__name__}: {exc}"
                self._watch.reject_knobs(changes, reason)
                if not isinstance(exc, Exception):
                    raise
                logger.warning("gpuwatchd: knob change not applied: %s", reason)
                return
            self._watch.commit_knobs(knobs, changes)
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
