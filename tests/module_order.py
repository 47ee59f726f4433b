"""The order in which `make test` hands test modules to its two pytest-xdist workers: the
longest first, by the seconds of tests/module_seconds.json, so that no long module starts
last and keeps one core busy while the other idles (longest-processing-time-first
scheduling). `make test` passes ``--no-loadscope-reorder``, which makes pytest-xdist keep
this order instead of sorting modules by their number of tests.

``make durations`` rewrites the file from a whole run (``--store-module-seconds PATH``).
A module the file does not name counts as 0 s; the order changes nothing else."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).resolve().parent / "module_seconds.json"
"""``{"tests/test_x.py": seconds}``: each module's setup, call and teardown seconds, summed."""


def module_of(nodeid: str) -> str:
    """``"tests/test_x.py"`` of a node id such as ``"tests/test_x.py::test_y[1]"``."""
    return nodeid.split("::", 1)[0]


def read_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The file's seconds per module; ``{}`` when it is missing or not such a mapping."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}


class ModuleOrder:
    """Orders the collected items by module, longest first; with ``store`` set, sums the
    seconds of each module's reports (on the xdist controller, or a run without xdist)
    and writes them there at the end of the session."""

    def __init__(self, store: Path | None) -> None:
        self.store = store
        self.seconds: Counter[str] = Counter()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Stable: modules of equal (or unknown) seconds keep their collected order."""
        known = read_seconds()
        first_seen: dict[str, int] = {}
        for item in items:
            first_seen.setdefault(module_of(item.nodeid), len(first_seen))
        items.sort(
            key=lambda item: (
                -known.get(module_of(item.nodeid), 0.0),
                first_seen[module_of(item.nodeid)],
            )
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.store is not None:
            self.seconds[module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        if self.store is not None and self.seconds:
            ordered = {m: round(s, 1) for m, s in sorted(self.seconds.items())}
            self.store.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-module-seconds",
        type=Path,
        default=None,
        metavar="PATH",
        help="write each test module's seconds to PATH (tests/module_seconds.json)",
    )


def pytest_configure(config: pytest.Config) -> None:
    is_worker = hasattr(config, "workerinput")  # pytest-xdist's workers: the controller stores
    store = None if is_worker else config.getoption("--store-module-seconds")
    config.pluginmanager.register(ModuleOrder(store), "gpuwatchd-module-order")
