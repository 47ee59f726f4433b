"""Conversions between journal rows and model objects / event dicts (pure).

Specification: docs/journal.md
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.journal.schema import MAX_EVENT_FINDINGS, MAX_TEXT, JournaledDecision
from gpuwatchd.model import Decision, Finding


def bounded_text(value: str | None) -> str:
    """``value`` (None as empty) cut to :data:`~gpuwatchd.journal.schema.MAX_TEXT`
    characters, the last one ``…``."""
    text = value or ""
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def _number(value: object) -> float | None:
    """A finite float for SQLite, or None (NA, NaN and inf are not numbers we keep)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _json_default(value: object) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return None if str(value) == "N/A" else str(value)


def dumps_json(value: object) -> str:
    """Compact, key-sorted JSON for a journal column; sets as sorted lists, ``N/A`` as null,
    anything else not JSON as its ``str``."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=_json_default)


def finding_dict(finding: Finding) -> dict[str, Any]:
    """A finding as the JSON object stored in a decision's ``findings`` column (non-finite
    numbers as null, the message bounded by :func:`bounded_text`)."""
    return {
        "detector": finding.detector,
        "subject": finding.subject,
        "timestamp_s": finding.timestamp_s,
        "since_s": finding.since_s,
        "value": _number(finding.value),
        "threshold": _number(finding.threshold),
        "message": bounded_text(finding.message),
        "gpu_uuid": finding.gpu_uuid,
        "gpu_index": finding.gpu_index,
        "job": finding.job,
    }


def _finding_from(d: Mapping[str, Any]) -> Finding:
    value, threshold = d.get("value"), d.get("threshold")
    return Finding(
        detector=str(d["detector"]),
        subject=str(d["subject"]),
        timestamp_s=float(d["timestamp_s"]),
        since_s=float(d["since_s"]),
        value=float(value) if value is not None else math.nan,
        threshold=float(threshold) if threshold is not None else math.nan,
        message=str(d.get("message", "")),
        gpu_uuid=d.get("gpu_uuid"),
        gpu_index=d.get("gpu_index"),
        job=d.get("job"),
    )


def decision_from_row(row: Sequence[Any]) -> JournaledDecision:
    """A :class:`JournaledDecision` from a ``decisions`` row selected with
    :data:`~gpuwatchd.journal.schema.DECISION_COLUMNS` (13 columns, in that order)."""
    (id_, ts, policy, action, params, job, gpu, dry, reason, findings, outcome, detail, fin) = row
    decision = Decision(
        policy=policy,
        action=action,
        params=json.loads(params),
        timestamp_s=ts,
        findings=tuple(_finding_from(f) for f in json.loads(findings)),
        job=job,
        gpu_uuid=gpu,
        dry_run=bool(dry),
        reason=reason,
    )
    return JournaledDecision(id_, decision, outcome, detail, fin)


def _gpu_index_of(findings: list[dict[str, Any]], gpu_uuid: str | None) -> int | None:
    if gpu_uuid is None:
        return None
    for finding in findings:
        if finding.get("gpu_uuid") == gpu_uuid and finding.get("gpu_index") is not None:
            return int(finding["gpu_index"])
    return None


def event_from_row(row: Sequence[Any]) -> dict[str, Any]:
    """One event dict; a row pruned from under its event gives null values, never a gap
    (a follower's ``after_id`` cursor must always move on)."""
    (eid, time_s, kind, fid, detector, subject, f_gpu, gpu_index, f_job, value, threshold) = row[
        :11
    ]
    (message, since_s, clear_reason, did, policy, action, params, d_job, d_gpu, dry_run) = row[
        11:21
    ]
    reason, findings, outcome, detail = row[21:25]
    event: dict[str, Any] = {"id": eid, "time_s": time_s, "kind": kind}
    if kind in ("finding_started", "finding_cleared"):
        event.update(
            finding_id=fid,
            detector=detector,
            subject=subject,
            gpu_index=gpu_index,
            gpu_uuid=f_gpu,
            job=f_job,
            value=value,
            threshold=threshold,
            message=message,
            since_s=since_s,
        )
        if kind == "finding_cleared":
            event["clear_reason"] = clear_reason
        return event
    summary: list[dict[str, Any]] = json.loads(findings) if findings else []
    event.update(
        decision_id=did,
        policy=policy,
        action=action,
        job=d_job,
        gpu_uuid=d_gpu,
        gpu_index=_gpu_index_of(summary, d_gpu),
    )
    if kind == "decision":
        event.update(
            params=json.loads(params) if params else None,
            dry_run=bool(dry_run) if dry_run is not None else None,
            reason=reason,
            findings=[
                {k: f.get(k) for k in ("detector", "subject", "value", "threshold")}
                for f in summary[:MAX_EVENT_FINDINGS]
            ],
            findings_count=len(summary),
        )
        return event
    event.update(outcome=outcome, detail=detail)
    return event
