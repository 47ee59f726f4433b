"""Policy groups: which findings of one step go together, by the policy's scope (pure).

Specification: docs/modules.md#gpuwatchdpolicyengine ("Scopes").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gpuwatchd.model import Finding, JobInfo, Snapshot, names_gpu


@dataclass(slots=True)
class FindingGroup:
    """Findings one policy acts on together: its subject (``global``, a job, a GPU UUID) and
    the GPU/job they are about, where one is known."""

    subject: str
    findings: list[Finding]
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    job: str | None = None


def group_findings(
    scope: str, per_condition: list[list[Finding]], scopes: Sequence[str], snap: Snapshot
) -> list[FindingGroup]:
    """The groups of one firing policy: ``per_condition`` are its conditions' findings,
    ``scopes`` their detectors' scopes, ``scope`` the policy's."""
    if scope == "global":
        return [FindingGroup("global", [f for fs in per_condition for f in fs])]
    jobs = snap.jobs
    groups: list[FindingGroup] = []
    if scope == "gpu":
        candidates: dict[str, int | None] = {}
        if "gpu" in scopes:
            first = per_condition[scopes.index("gpu")]
            for f in first:
                if f.gpu_uuid is not None:
                    candidates.setdefault(f.gpu_uuid, f.gpu_index)
        else:
            candidates = {g.uuid: g.index for g in snap.gpus}
        by_gpu = [_by_gpu(findings) for findings in per_condition]
        for uuid, index in candidates.items():
            matched = _match(per_condition, _concerns_gpu, uuid, index, jobs, by_gpu)
            if matched is not None:
                groups.append(FindingGroup("gpu:" + uuid, matched, uuid, index))
        return groups
    if "job" in scopes:
        first = per_condition[scopes.index("job")]
        names = unique_in_order(f.job for f in first if f.job is not None)
    else:
        names = unique_in_order(j.name for j in jobs)
    for name in names:
        matched = _match(per_condition, _concerns_job, name, None, jobs)
        if matched is not None:
            groups.append(FindingGroup("job:" + name, matched, job=name))
    return groups


def _match(
    per_condition: list[list[Finding]],
    concerns: Callable[[Finding, str, int | None, Sequence[JobInfo]], bool],
    subject: str,
    index: int | None,
    jobs: Sequence[JobInfo],
    by_subject: Sequence[dict[str, list[Finding]] | None] | None = None,
) -> list[Finding] | None:
    """The findings concerning ``subject``, or None if some condition has none.
    ``by_subject``: per condition, its findings by subject where ``concerns`` is that
    equality for every one (:func:`_by_gpu`; None: test each finding)."""
    matched: list[Finding] = []
    for position, findings in enumerate(per_condition):
        split = None if by_subject is None else by_subject[position]
        if split is not None:
            chosen = split.get(subject, [])
        else:
            chosen = [f for f in findings if concerns(f, subject, index, jobs)]
        if not chosen:
            return None
        matched.extend(chosen)
    return matched


def _by_gpu(findings: list[Finding]) -> dict[str, list[Finding]] | None:
    """``findings`` by GPU UUID, each list in their order, when every one names its GPU
    (then :func:`_concerns_gpu` is that equality); None when one does not."""
    split: dict[str, list[Finding]] = {}
    for f in findings:
        if f.gpu_uuid is None:
            return None
        split.setdefault(f.gpu_uuid, []).append(f)
    return split


def _job_uses(jobs: Sequence[JobInfo], name: str, uuid: str | None, index: int | None) -> bool:
    return any(j.name == name and uses_gpu(j, ((uuid, index),)) for j in jobs)


def _concerns_gpu(f: Finding, uuid: str, index: int | None, jobs: Sequence[JobInfo]) -> bool:
    if f.gpu_uuid is not None:
        return f.gpu_uuid == uuid
    if f.job is not None:
        if f.gpu_index is not None:
            return f.gpu_index == index
        return _job_uses(jobs, f.job, uuid, index)
    return True  # host findings concern every GPU


def _concerns_job(f: Finding, name: str, _index: int | None, jobs: Sequence[JobInfo]) -> bool:
    if f.job is not None:
        return f.job == name
    if f.gpu_uuid is not None:
        return _job_uses(jobs, name, f.gpu_uuid, f.gpu_index)
    return True  # host findings concern every job


def uses_gpu(job: JobInfo, gpus: Sequence[tuple[str | None, int | None]]) -> bool:
    """Whether ``job`` can use one of ``gpus`` ((UUID, NVML index) pairs), by its
    ``CUDA_VISIBLE_DEVICES`` entries (:func:`~gpuwatchd.model.names_gpu`: an index, a UUID
    or a UUID prefix); no entries: every GPU."""
    if not job.cuda_devices:
        return True  # no CUDA_VISIBLE_DEVICES: the job sees every GPU
    return any(names_gpu(e, uuid, index) for uuid, index in gpus for e in job.cuda_devices)


def unique_in_order(items: Iterable[str]) -> list[str]:
    """``items`` without repeats, in first-seen order."""
    return list(dict.fromkeys(items))
