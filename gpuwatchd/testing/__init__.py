"""Public test helpers for gpuwatchd's own tests and for users' tests.

The only fake in gpuwatchd's tests sits at the hardware boundary:

* :class:`FakeNvml` / :class:`FakeDevice`: a stand-in for the ``pynvml`` module
  (nvidia-ml-py), scripted from series, from a JSON script or from a real
  nvidia-smi trace, with lost GPUs, unsupported fields and init failures;
  :func:`install_fake_nvml` puts it in place of ``pynvml`` for a ``with`` block.
* :class:`FakeClock`: a clock you advance by hand, for the pure core.
* :class:`NotifyListener`: a real ``AF_UNIX`` datagram socket to use as
  ``NOTIFY_SOCKET``, collecting what the daemon tells systemd.

To run a whole daemon on the fake NVML in a subprocess:
``python -m gpuwatchd.testing.fakerun SCRIPT.json run --socket ...``.
Importing this package imports neither pynvml nor the daemon.
"""

from __future__ import annotations

from gpuwatchd.testing.clock import FakeClock
from gpuwatchd.testing.notify import Notification, NotifyListener
from gpuwatchd.testing.nvml import FakeDevice, FakeNvml, install, install_fake_nvml

__all__ = [
    "FakeClock",
    "FakeDevice",
    "FakeNvml",
    "Notification",
    "NotifyListener",
    "install",
    "install_fake_nvml",
]
