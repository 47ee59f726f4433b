"""Helpers of the detector tests (test_detectors.py, test_detectors_faults.py); not a test
module: build a detector from raw params as a policy file's would be, with a ``fail`` that
raises :class:`Located` (the key and message the policy loader would put at file:line)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from gpuwatchd.detectors import Detector


class Located(Exception):
    """A parameter error: the param's ``key`` (None: the whole block) and the message."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(message)
        self.key = key


def fail(key: str | None, message: str) -> NoReturn:
    raise Located(key, message)


def make(cls: type[Detector], raw: Mapping[str, object] | None = None) -> Detector:
    """``cls`` with ``raw`` parsed as its policy params (``Located`` for a bad one)."""
    return cls(cls.parse_params(raw, fail))
