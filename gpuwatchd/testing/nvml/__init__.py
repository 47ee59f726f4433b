"""A fake of the ``pynvml`` module (nvidia-ml-py) for tests without an NVIDIA GPU.

``FakeNvml`` (fake.py) over ``FakeDevice`` (device.py), built from scripts (script.py),
with pynvml's codes (codes.py). Specification: docs/modules.md#gpuwatchdtestingnvml
"""

from __future__ import annotations

from gpuwatchd.testing.nvml.codes import NVMLError, error_code
from gpuwatchd.testing.nvml.device import (
    ALL_SERIES,
    DEFAULT_MEMORY_TOTAL_BYTES,
    DEFAULT_NAME,
    GPM_SERIES,
    HEALTH_SERIES,
    SERIES_FIELDS,
    FakeDevice,
    FakeEventData,
    FakeEventSet,
    FakeFieldValue,
    FakeGpmMetricsGet,
    FakeGpmSample,
    FakeGpmSupport,
    FakeMemory,
    FakeMemoryV2,
    FakeProcessInfo,
    FakeProcessUtilizationSample,
    FakeUtilization,
)
from gpuwatchd.testing.nvml.fake import FakeNvml, install, install_fake_nvml

__all__ = [
    "ALL_SERIES",
    "DEFAULT_MEMORY_TOTAL_BYTES",
    "DEFAULT_NAME",
    "GPM_SERIES",
    "HEALTH_SERIES",
    "SERIES_FIELDS",
    "FakeDevice",
    "FakeEventData",
    "FakeEventSet",
    "FakeFieldValue",
    "FakeGpmMetricsGet",
    "FakeGpmSample",
    "FakeGpmSupport",
    "FakeMemory",
    "FakeMemoryV2",
    "FakeNvml",
    "FakeProcessInfo",
    "FakeProcessUtilizationSample",
    "FakeUtilization",
    "NVMLError",
    "error_code",
    "install",
    "install_fake_nvml",
]
