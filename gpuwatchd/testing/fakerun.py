"""Run ``gpuwatchd`` in a subprocess with the fake NVML installed (for tests and demos).

Specification: docs/modules.md#gpuwatchdtestingfakerun
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Install the fake NVML from ``argv[0]`` (a JSON file) and run ``gpuwatchd argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(
            "usage: python -m gpuwatchd.testing.fakerun SCRIPT.json GPUWATCHD-ARGS...",
            file=sys.stderr,
        )
        return 2
    from gpuwatchd.cli.main import main as gpuwatchd_main
    from gpuwatchd.testing.nvml import FakeNvml, install

    with open(args[0], encoding="utf-8") as handle:
        script = json.load(handle)
    install(FakeNvml.from_script(script))
    return gpuwatchd_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
