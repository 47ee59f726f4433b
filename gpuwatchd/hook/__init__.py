"""The job-side hook: connect a training process to gpuwatchd.

::

    from gpuwatchd.hook import attach

    with attach(job="digits", knobs={"num_workers": 4, "prefetch_factor": 2}) as watch:
        loader = watch.loader(lambda k: DataLoader(ds, batch_size=64, num_workers=k["num_workers"]))
        for epoch in range(epochs):
            for x, y in loader:  # a new epoch applies pending knob changes (loader rebuilt)
                ...

Adapters (``lightning``, ``transformers``, ``optuna``) and ``batch_size`` are separate
modules, not imported here. What the hook imports and why: docs/hook-internals.md.
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
