"""Prometheus/OpenMetrics export of what the daemon sees (docs/metrics.md).

:mod:`.collector` turns the ``status`` object and a few counters into ``gpuwatchd_*``
metric families (pure); :mod:`.serve` serves them over HTTP or writes node_exporter's
textfile. Built on prometheus-client; nothing here is imported by the hook.
"""
