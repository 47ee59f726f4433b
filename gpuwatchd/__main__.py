"""``python -m gpuwatchd``: the ``gpuwatchd`` command (see :mod:`gpuwatchd.cli.main`)."""

from __future__ import annotations

import sys

from gpuwatchd.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
