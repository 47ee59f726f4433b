"""Lightning adapter: a ``lightning.pytorch.Callback`` over one :class:`Watch`.

::

    import lightning as L
    from gpuwatchd.hook.lightning import GpuwatchCallback

    callback = GpuwatchCallback(job="digits", checkpoint_path="stop.ckpt")
    L.Trainer(max_epochs=20, callbacks=[callback]).fit(model, datamodule=dm)

What it does, at Lightning's hooks:

* ``on_train_start``: attaches (unless a started ``watch`` was given). Without
  ``knobs`` the knobs are the first training DataLoader's ``num_workers`` and
  ``prefetch_factor`` (declared with 0 workers too). Knob values the daemon remembers
  for the job (a new Trainer per trial starts with the script's values) are set on the
  live loaders at the first epoch start.
* ``on_train_epoch_start`` (before the epoch's ``iter()`` on the loaders; for the first
  epoch, whose iterator Lightning creates earlier, the iterator is started again when a
  knob changed): pending
  ``num_workers``/``prefetch_factor`` changes are set on the live training DataLoaders
  (:func:`gpuwatchd.hook.set_live_loader_knob`) and acknowledged; ``batch_size`` and
  ``persistent_workers`` changes are refused (a built DataLoader cannot take them).
* each batch: step time and data wait (:class:`gpuwatchd.hook._adapter.StepTimer`);
  at the batch end a pending ``stop`` runs ``on_stop``, saves ``checkpoint_path``
  (``trainer.save_checkpoint``) if given, is acknowledged and sets
  ``trainer.should_stop``; inside :meth:`Watch.trial` it raises ``optuna.TrialPruned``.
* ``on_train_epoch_end``: a pending ``drain`` is applied and sets ``trainer.should_stop``.
* ``on_exception``: a CUDA out-of-memory error is reported (``oom`` event); Lightning's
  own ``BatchSizeFinder`` is the tool for a batch size that fits.
* ``teardown``: detaches (only a watch this callback attached itself).

Requires ``lightning`` (2.x); imported when this module is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.hook._adapter import WatchOwner
from gpuwatchd.hook._cuda import is_cuda_oom
from gpuwatchd.hook._loader import batch_samples, find_dataloaders
from gpuwatchd.hook._watch import Watch

if TYPE_CHECKING:
    _Callback = object
else:
    from lightning.pytorch.callbacks import Callback as _Callback

__all__ = ["GpuwatchCallback", "loader_knobs"]


def loader_knobs(loaders: object) -> dict[str, object]:
    """``num_workers`` and ``prefetch_factor`` of the first DataLoader in ``loaders``
    (``prefetch_factor`` PyTorch's default 2 when the loader has none, i.e. 0 workers, so
    that it can be set once workers are raised); ``{}`` without one."""
    found = find_dataloaders(loaders)
    if not found:
        return {}
    first = found[0]
    prefetch = getattr(first, "prefetch_factor", None)
    return {
        "num_workers": int(first.num_workers),
        "prefetch_factor": int(prefetch) if prefetch is not None else 2,
    }


def _live_knobs(loader: Any) -> tuple[object, object]:
    return getattr(loader, "num_workers", None), getattr(loader, "prefetch_factor", None)


class GpuwatchCallback(_Callback):
    """Connects a Lightning ``Trainer`` to gpuwatchd (see the module docstring).

    Either pass a ``watch`` (from :func:`gpuwatchd.hook.attach`, entered by you), or
    the :func:`~gpuwatchd.hook.attach` arguments (``job``, ``knobs``, ``socket``,
    ``report_interval_s``, ``on_stop``) and the callback attaches at ``on_train_start``
    and detaches at ``teardown``. ``checkpoint_path``: where a ``stop`` saves a
    checkpoint before training ends (None: no checkpoint).
    """

    def __init__(
        self,
        watch: Watch | None = None,
        *,
        job: str | None = None,
        knobs: Mapping[str, object] | None = None,
        socket: str | os.PathLike[str] | None = None,
        report_interval_s: float = 0.5,
        on_stop: Callable[[str | None], object] | None = None,
        checkpoint_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self._owner = WatchOwner(
            watch,
            job=job,
            knobs=knobs,
            socket=socket,
            report_interval_s=report_interval_s,
            on_stop=on_stop,
        )
        self._checkpoint_path = os.fspath(checkpoint_path) if checkpoint_path else None
        self._trainer: Any = None
        self._epoch_started = False
        if watch is not None:
            self._bind(watch)

    @property
    def watch(self) -> Watch | None:
        """The watch this callback reports through (None before training starts when it
        attaches itself, and after it detached)."""
        return self._owner.watch

    def _bind(self, watch: Watch) -> None:
        if self._checkpoint_path is not None:
            watch.add_on_stop(self._save_checkpoint)

    def _save_checkpoint(self, reason: str | None) -> None:
        if self._trainer is not None and self._checkpoint_path is not None:
            self._trainer.save_checkpoint(self._checkpoint_path)

    # -- Lightning hooks -------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach (when owned), with the training DataLoader's knobs by default."""
        self._trainer = trainer
        self._epoch_started = False
        if self._owner.attach_if_needed(lambda: loader_knobs(trainer.train_dataloader)):
            assert self.watch is not None
            self._bind(self.watch)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Apply pending knob changes to the live training DataLoaders."""
        watch = self.watch
        if watch is None:
            return
        watch.set_epoch(int(trainer.current_epoch))
        loaders = find_dataloaders(trainer.train_dataloader)
        before = [_live_knobs(loader) for loader in loaders]
        watch.apply_knobs(loaders)
        first_epoch = not self._epoch_started
        self._epoch_started = True
        if first_epoch and before != [_live_knobs(loader) for loader in loaders]:
            # Lightning 2.x creates the first epoch's iterator before any epoch hook
            # (FitLoop.setup_data); later epochs call iter() after this hook. Start the
            # first epoch's iterator again so that it runs with the changed knobs.
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            if fetcher is not None:
                iter(fetcher)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """Time the step that starts now."""
        if self._owner.timer is not None:
            self._owner.timer.batch_start(batch_samples(batch))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """End of a step: a safe point for ``stop``."""
        watch = self.watch
        if watch is None or self._owner.timer is None:
            return
        self._owner.timer.batch_end()
        if (watch.stop_pending or watch.should_stop) and watch.safe_point():
            trainer.should_stop = True
            pruned = watch.stop_exception()
            if pruned is not None:
                raise pruned

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """End of an epoch: a safe point for ``drain``."""
        watch = self.watch
        if watch is None or self._owner.timer is None:
            return
        self._owner.timer.epoch_end()
        if watch.epoch_end():
            trainer.should_stop = True

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Report a CUDA out-of-memory error to the daemon."""
        if self.watch is not None and is_cuda_oom(exception):
            self.watch.report_oom(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Detach a watch this callback attached."""
        self._owner.detach()
