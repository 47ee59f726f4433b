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
"""

from __future__ import annotations

from gpuwatchd.hook._knobs import DEFAULT_BOUNDS, KnobSpec, parse_knobs
from gpuwatchd.hook._loader import WatchedLoader, batch_samples
from gpuwatchd.hook._watch import Watch, attach, cuda_devices_from_env

__all__ = [
    "DEFAULT_BOUNDS",
    "KnobSpec",
    "Watch",
    "WatchedLoader",
    "attach",
    "batch_samples",
    "cuda_devices_from_env",
    "parse_knobs",
]
