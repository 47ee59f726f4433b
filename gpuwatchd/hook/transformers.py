"""Hugging Face adapter: a ``transformers.TrainerCallback`` over one :class:`Watch`.

::

    from transformers import Trainer
    from gpuwatchd.hook.transformers import GpuwatchTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GpuwatchTrainerCallback(job="bert-ft")])
    trainer.train()

What it does, at the Trainer's events:

* ``on_train_begin``: attaches (unless a ``watch`` was given). Without ``knobs`` the
  knobs are ``TrainingArguments.dataloader_num_workers`` and
  ``dataloader_prefetch_factor`` (2 when unset, declared with 0 workers too). Knob
  values the daemon remembers for the job (a new Trainer per trial starts with the
  script's values) are set on the live loader at the first epoch start.
* ``on_epoch_begin`` (the Trainer calls ``iter()`` on the loader right after):
  pending ``num_workers``/``prefetch_factor`` changes are set on the live training
  DataLoader and acknowledged; ``batch_size``/``persistent_workers`` are refused.
* ``on_step_begin``/``on_step_end``: one hook step per optimizer step (of
  ``per_device_train_batch_size * gradient_accumulation_steps`` samples); at a step end
  a pending ``stop`` runs ``on_stop``, asks for a checkpoint (``control.should_save``,
  when ``save_on_stop``), is acknowledged and sets ``control.should_training_stop``.
* ``on_epoch_end``: a pending ``drain`` is applied and sets
  ``control.should_training_stop``.
* ``on_train_end``: detaches (only a watch this callback attached itself).

For a batch size that fits the GPU use the Trainer's ``auto_find_batch_size`` or
:mod:`gpuwatchd.hook.batch_size`. Requires ``transformers`` (with ``accelerate``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.hook._adapter import WatchOwner
from gpuwatchd.hook._loader import find_dataloaders
from gpuwatchd.hook._watch import Watch

if TYPE_CHECKING:
    _TrainerCallback = object
else:
    from transformers import TrainerCallback as _TrainerCallback

__all__ = ["GpuwatchTrainerCallback", "args_knobs"]


def args_knobs(args: Any) -> dict[str, object]:
    """The DataLoader knobs of ``TrainingArguments``: ``num_workers`` and
    ``prefetch_factor`` (PyTorch's default 2 when unset, also with 0 workers, so that it
    can be set once workers are raised)."""
    workers = int(getattr(args, "dataloader_num_workers", 0) or 0)
    prefetch = getattr(args, "dataloader_prefetch_factor", None)
    return {"num_workers": workers, "prefetch_factor": int(prefetch) if prefetch else 2}


class GpuwatchTrainerCallback(_TrainerCallback):
    """Connects a Hugging Face ``Trainer`` to gpuwatchd (see the module docstring).

    Either pass a ``watch`` (entered by you) or the :func:`~gpuwatchd.hook.attach`
    arguments (``job``, ``knobs``, ``socket``, ``report_interval_s``, ``on_stop``).
    ``save_on_stop``: a ``stop`` asks the Trainer to save a checkpoint before ending.
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
        save_on_stop: bool = True,
    ) -> None:
        self._owner = WatchOwner(
            watch,
            job=job,
            knobs=knobs,
            socket=socket,
            report_interval_s=report_interval_s,
            on_stop=on_stop,
        )
        self._save_on_stop = save_on_stop

    @property
    def watch(self) -> Watch | None:
        """The watch this callback reports through (None before training starts when it
        attaches itself, and after it detached)."""
        return self._owner.watch

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Attach (when owned), with the TrainingArguments' DataLoader knobs by default."""
        self._owner.attach_if_needed(lambda: args_knobs(args))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Apply pending knob changes to the live training DataLoader."""
        if self.watch is None:
            return
        self.watch.set_epoch(int(state.epoch or 0))
        self.watch.apply_knobs(find_dataloaders(kwargs.get("train_dataloader")))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Time the optimizer step that starts now."""
        if self._owner.timer is not None:
            samples = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
            self._owner.timer.batch_start(samples)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End of an optimizer step: a safe point for ``stop``."""
        watch = self.watch
        if watch is None or self._owner.timer is None:
            return
        self._owner.timer.batch_end()
        if (watch.stop_pending or watch.should_stop) and watch.safe_point():
            control.should_training_stop = True
            if self._save_on_stop:
                control.should_save = True

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End of an epoch: a safe point for ``drain``."""
        watch = self.watch
        if watch is None or self._owner.timer is None:
            return
        self._owner.timer.epoch_end()
        if watch.epoch_end():
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Detach a watch this callback attached."""
        self._owner.detach()
