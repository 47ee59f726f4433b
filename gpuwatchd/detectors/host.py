"""Host detectors: ``host_cpu_above``, ``host_cpu_below``, ``host_memory_above`` (pure).

Specification: docs/modules.md#gpuwatchddetectors
"""

from __future__ import annotations

from typing import Any, ClassVar

from gpuwatchd.detectors.base import ThresholdDetector
from gpuwatchd.detectors.params import clear_param, for_param, percent_param
from gpuwatchd.model import Finding
from gpuwatchd.windows import Scope


class _HostDetector(ThresholdDetector):
    scope: ClassVar[Scope] = "host"
    label: ClassVar[str] = ""

    def finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        """:meth:`ThresholdDetector.finding` for the host (``entry``: ``("host",
        by_metric)``): ``host <label> <mean> % <rule>``."""
        message = f"host {self.label} {mean:.1f} % {self._rule_text(held)}"
        return Finding(self.name, "host", now, since, mean, self.threshold, message)


class HostCpuAbove(_HostDetector):
    """Host CPU utilization (psutil ``cpu_percent()``: all logical CPUs, 0..100) above
    ``percent``. Default: 90 % for 30 s.
    """

    name = "host_cpu_above"
    label = "CPU"
    description = "host CPU utilization (all logical CPUs) above a percentage"
    default_metric = "cpu_pct"
    params = (
        percent_param(90, "CPU threshold, percent of all logical CPUs"),
        clear_param(above=True),
        for_param("30s"),
    )


class HostCpuBelow(HostCpuAbove):
    """Host CPU utilization strictly below ``percent``: the host has cores to spare.

    Pairs with ``data_starved`` so that more DataLoader workers are asked for only
    when they can get a core (more workers on a saturated host starve the job more).
    Default: 80 % for 30 s.
    """

    name = "host_cpu_below"
    description = "host CPU utilization (all logical CPUs) strictly below a percentage"
    above = False
    params = (
        percent_param(80, "CPU threshold, percent of all logical CPUs"),
        clear_param(above=False),
        for_param("30s"),
    )


class HostMemoryAbove(_HostDetector):
    """Host memory used (psutil ``virtual_memory()``: used / total) above ``percent``.
    Default: 90 % for 30 s.
    """

    name = "host_memory_above"
    label = "memory"
    description = "host memory used above a percentage of total"
    default_metric = "memory_used_pct"
    params = (
        percent_param(90, "memory threshold, percent of total"),
        clear_param(above=True),
        for_param("30s"),
    )
