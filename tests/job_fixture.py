"""A :class:`gpuwatchd.jobs.job.Job` as the supervisor builds one for a configuration
without ``user:``, for tests of the parts that take a Job (launch, workers.json)."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.config import JobConfig
from gpuwatchd.jobs.job import Job
from gpuwatchd.restart import RestartPolicy


def make_job(cfg: JobConfig, directory: Path, *, parallelism: int) -> Job:
    """``cfg``'s Job with its state in ``directory``, ``parallelism`` workers wanted."""
    return Job(
        cfg=cfg,
        policy=RestartPolicy.from_mapping(cfg.restart, job=cfg.name),
        directory=directory,
        allowed_gpus=None,
        popen_user={},
        user_env={},
        parallelism=parallelism,
    )
