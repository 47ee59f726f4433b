"""/proc readers of the supervisor (gpuwatchd.jobs.procfs), on this very process."""

from __future__ import annotations

import os

from gpuwatchd.jobs.procfs import read_oom_counter, read_stat


def test_oom_counter_and_proc_stat_are_readable_here() -> None:
    counter = read_oom_counter(os.getpid())
    assert counter is not None and counter.value >= 0
    assert counter.reread() is not None
    stat = read_stat(os.getpid())
    assert stat is not None and stat.ppid == os.getppid() and stat.start_ticks > 0
    assert read_stat(2**22 + 12345) is None
