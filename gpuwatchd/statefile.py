"""Small JSON state files under the state directory, replaced atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomic"]


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` so that readers see the old or the new file.

    The text goes to ``.<name>.tmp`` beside ``path`` and is renamed over it (rename(2) is
    atomic within one file system). Raises ``OSError`` when either step fails; the old file
    is then left as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
