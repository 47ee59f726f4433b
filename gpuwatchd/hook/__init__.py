"""The job-side hook: connect a training process to gpuwatchd.

::

    from gpuwatchd.hook import attach

    with attach(job="digits", knobs={"num_workers": 4, "prefetch_factor": 2}) as watch:
        loader = watch.loader(lambda k: DataLoader(ds, batch_size=64, num_workers=k["num_workers"]))
        for epoch in range(epochs):
            for x, y in loader:  # a new epoch applies pending knob changes (loader rebuilt)
                ...              # data wait and step time are measured between next() calls

The hook imports only the control protocol, ``errors``, ``model`` and the standard
library (torch is never imported by it). All socket I/O runs on one background
daemon thread; the training thread only appends to bounded deques. Without a daemon
the job runs untouched and one warning is logged on the ``gpuwatchd.hook`` logger.

Framework adapters, each a thin layer over :class:`Watch`, live in their own modules
so that importing this package imports none of them: :mod:`gpuwatchd.hook.lightning`
(a Lightning ``Callback``), :mod:`gpuwatchd.hook.transformers` (a Hugging Face
``TrainerCallback``), :mod:`gpuwatchd.hook.optuna` (trial context and study callback).
The batch-size finder is :mod:`gpuwatchd.hook.batch_size`.
"""

from __future__ import annotations

from gpuwatchd.hook._cuda import cuda_memory, is_cuda_oom
from gpuwatchd.hook._knobs import DEFAULT_BOUNDS, KnobSpec, parse_knobs
from gpuwatchd.hook._loader import (
    WatchedLoader,
    batch_samples,
    find_dataloaders,
    set_live_loader_knob,
    slice_batch,
)
from gpuwatchd.hook._watch import TrialScope, Watch, attach, cuda_devices_from_env

__all__ = [
    "DEFAULT_BOUNDS",
    "KnobSpec",
    "TrialScope",
    "Watch",
    "WatchedLoader",
    "attach",
    "batch_samples",
    "cuda_devices_from_env",
    "cuda_memory",
    "find_dataloaders",
    "is_cuda_oom",
    "parse_knobs",
    "set_live_loader_knob",
    "slice_batch",
]
