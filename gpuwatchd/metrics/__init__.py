"""Prometheus/OpenMetrics export of what the daemon sees (docs/metrics.md).

:mod:`.account` counts (decisions, crashes, trials, tick durations), :mod:`.view` is the
daemon's state for one scrape, :mod:`.collector` turns a view into ``gpuwatchd_*``
metric families (all three pure); :mod:`.serve` serves them over HTTP (own socket or
systemd's) or writes node_exporter's textfile. Built on prometheus-client; nothing here
is imported by the hook.
"""
