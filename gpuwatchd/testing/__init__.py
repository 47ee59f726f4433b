"""Public test helpers for gpuwatchd's own tests and for users' tests.

Specification: docs/modules.md#gpuwatchdtesting
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
