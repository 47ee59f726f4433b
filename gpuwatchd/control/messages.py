"""Pure parsing and validation of the job messages of protocol v1 (no sockets, no clock).

:func:`parse_hello`, :func:`parse_report` and :func:`parse_event` take a request's
``params`` and return a named, checked value, or raise
:class:`~gpuwatchd.errors.ProtocolError` (``bad_request``) without changing anything. The
message shapes and limits: docs/protocol-internals.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from gpuwatchd.control.protocol import (
    EVENT_MESSAGE_MAX_CHARS,
    HOOK_CRASH_KINDS,
    JOB_EVENT_KINDS,
    TRIAL_STATES,
    ErrorCode,
)
from gpuwatchd.errors import ProtocolError
from gpuwatchd.model import CudaMemory, JobEvent, JobReport, Knob, KnobValue, SlurmJob

__all__ = [
    "JOB_NAME_MAX_CHARS",
    "JOB_NAME_PATTERN",
    "KNOB_NAME_MAX_CHARS",
    "MAX_CUDA_DEVICES",
    "MAX_CUDA_DEVICES_PER_REPORT",
    "MAX_KNOBS",
    "SLURM_ARRAY_TASK_MAX",
    "SLURM_ENV",
    "SLURM_GPU_ENV",
    "SLURM_GPU_PATTERN",
    "SLURM_ID_PATTERN",
    "SLURM_NAME_PATTERN",
    "DroppedKnob",
    "Hello",
    "KnobApplied",
    "ReportUpdate",
    "choice",
    "count",
    "cuda_memory",
    "fraction",
    "is_int",
    "is_knob_value",
    "is_number",
    "parse_event",
    "parse_hello",
    "parse_knobs",
    "parse_report",
    "parse_set_knob_result",
    "parse_slurm",
    "report_knobs",
    "salvage_id",
    "seconds",
    "slurm_gpus",
    "slurm_identity",
    "trial_number",
]

JOB_NAME_MAX_CHARS: Final = 128
PID_MAX_LIMIT: Final = 4_194_304
"""The largest pid Linux can hand out (``PID_MAX_LIMIT``, include/linux/threads.h: 2**22)."""
JOB_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A job name: letters, digits, ``.``, ``_``, ``-``; no leading ``-`` (it may reach an argv)."""
MAX_CUDA_DEVICES: Final = 64
"""Entries of a hello's ``cuda_devices`` at most."""
MAX_KNOBS: Final = 64
"""Knobs one hello may declare at most."""
KNOB_NAME_MAX_CHARS: Final = 64
MAX_CUDA_DEVICES_PER_REPORT: Final = 64
"""Entries a report's ``cuda_memory`` list may hold (more than any node has GPUs)."""
SLURM_ID_PATTERN: Final = re.compile(r"[1-9][0-9]{0,9}")
"""A Slurm job id in a ``hello``'s ``slurm``: a positive 32-bit integer as text
(slurm.conf(5) ``MaxJobId`` is at most 67 043 328)."""
SLURM_ARRAY_TASK_MAX: Final = 4_000_000
"""The largest array task id Slurm accepts (slurm.conf(5) ``MaxArraySize`` is at most
4 000 001)."""
SLURM_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._@-]{0,63}")
"""A Slurm user or partition name in a ``hello``'s ``slurm`` (at most 64 characters)."""
SLURM_GPU_ENV: Final = (
    "SLURM_JOB_GPUS",
    "SLURM_STEP_GPUS",
    "GPU_DEVICE_ORDINAL",
    "CUDA_VISIBLE_DEVICES",
)
"""Where a Slurm task's environment names the GPUs allocated to it on its node, in the
order :func:`slurm_gpus` trusts them: ``SLURM_JOB_GPUS`` (the job's, sbatch(1)) and
``SLURM_STEP_GPUS`` (the step's, srun(1)) hold the node's own GPU indices;
``GPU_DEVICE_ORDINAL`` and ``CUDA_VISIBLE_DEVICES``, which the gres/gpu plugin sets too,
are indices as the task sees them (numbered from 0 inside a job whose devices cgroup.conf's
``ConstrainDevices`` limits), so they are read only when neither of the first two is set."""
SLURM_ENV: Final = frozenset(
    {
        "SLURM_JOB_ID",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_JOB_USER",
        "SLURM_JOB_PARTITION",
        *SLURM_GPU_ENV,
    }
)
"""The environment variables :func:`slurm_identity` reads (sbatch(1), "OUTPUT ENVIRONMENT
VARIABLES")."""
SLURM_GPU_PATTERN: Final = re.compile(r"[0-9]{1,4}|GPU-[0-9A-Fa-f-]{8,60}")
"""One GPU of a ``hello``'s ``slurm.gpus``: an NVML index or a GPU UUID (NVML
``nvmlDeviceGetUUID``: ``GPU-`` and 36 hex digits and dashes)."""


@dataclass(frozen=True, slots=True)
class DroppedKnob:
    """A knob a ``hello`` declared that the daemon left out: ``knob`` its name as sent,
    ``reason`` why (the text a whole-hello refusal used to carry). The job attaches with
    the other knobs; the reply's ``dropped_knobs`` lists these (docs/protocol.md)."""

    knob: str
    reason: str

    def as_reply(self) -> dict[str, str]:
        """``{"knob": name, "reason": text}``, as the ``hello`` reply carries it."""
        return {"knob": self.knob, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Hello:
    """A checked ``hello`` (``role: job``): the job a connection speaks for.

    ``job``: its name (:data:`JOB_NAME_PATTERN`, at most :data:`JOB_NAME_MAX_CHARS`).
    ``pid``: the training process (> 0). ``cuda_devices``: the job's
    ``CUDA_VISIBLE_DEVICES`` entries (UUIDs or indices as strings). ``knobs``: the knobs it
    declares, by name. ``study``: its Optuna study name, if any. ``trial_number``: the
    Optuna trial it runs now, if any. ``dropped_knobs``: declared knobs left out, with
    the reason (the job attaches without them).
    """

    job: str
    pid: int
    cuda_devices: tuple[str, ...]
    knobs: dict[str, Knob]
    study: str | None
    trial_number: int | None
    slurm: SlurmJob | None = None
    """The Slurm job the process runs in (:func:`parse_slurm`), None outside Slurm."""
    dropped_knobs: tuple[DroppedKnob, ...] = ()


@dataclass(frozen=True, slots=True)
class ReportUpdate:
    """A checked ``report``: what the session takes from it, all or nothing.

    ``report``: the :class:`~gpuwatchd.model.JobReport` (stamped with the caller's time).
    ``knob_values``: current values of declared knobs, kind and bounds checked.
    ``trial_given``: the report has a ``trial`` key; then ``trial_number`` is the trial
    now run (``None``: between trials), else the session's trial stands.
    """

    report: JobReport
    knob_values: dict[str, KnobValue]
    trial_given: bool
    trial_number: int | None


@dataclass(frozen=True, slots=True)
class KnobApplied:
    """A job's reply to ``set_knob``: the knob ``name`` now has ``value``."""

    name: str
    value: KnobValue


def parse_hello(params: Mapping[str, Any], *, authorize: Callable[[str, int], None]) -> Hello:
    """Check a ``hello``'s ``params``; ``authorize(job, pid)`` is called once name and pid
    are valid, before the rest is looked at (it raises ``forbidden`` for a peer that may not
    speak for them, so that rights are refused before shape).

    Raises :class:`ProtocolError` ``bad_request`` for any malformed field but a single
    knob's: a knob descriptor that is malformed or out of its own bounds is left out and
    named in :attr:`Hello.dropped_knobs` (:func:`parse_knobs`); the hello is refused
    only when ``knobs`` itself is not an object or holds more than :data:`MAX_KNOBS`.
    """
    if params.get("role") != "job":
        raise ProtocolError(ErrorCode.BAD_REQUEST, 'hello needs "role": "job"')
    name = params.get("job")
    if (
        not isinstance(name, str)
        or len(name) > JOB_NAME_MAX_CHARS
        or not JOB_NAME_PATTERN.fullmatch(name)
    ):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"'job' must be 1-{JOB_NAME_MAX_CHARS} letters, digits, '.', '_' or '-', "
            "not starting with '-'",
        )
    pid = params.get("pid")
    if not is_int(pid) or not 0 < pid <= PID_MAX_LIMIT:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"'pid' must be a positive integer up to {PID_MAX_LIMIT}"
        )
    authorize(name, pid)
    cuda_devices = params.get("cuda_devices")
    if cuda_devices is None:
        cuda_devices = []
    if (
        not isinstance(cuda_devices, list)
        or len(cuda_devices) > MAX_CUDA_DEVICES
        or not all(isinstance(d, str) and len(d) <= 64 for d in cuda_devices)
    ):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"'cuda_devices' must be a list of at most {MAX_CUDA_DEVICES} short strings",
        )
    raw_knobs = params.get("knobs")
    if isinstance(raw_knobs, dict) and len(raw_knobs) > MAX_KNOBS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"at most {MAX_KNOBS} knobs")
    knobs, dropped = parse_knobs(raw_knobs)
    study = params.get("study")
    if study is not None and not isinstance(study, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'study' must be a string or null")
    return Hello(
        job=name,
        pid=pid,
        cuda_devices=tuple(cuda_devices),
        knobs=knobs,
        study=study,
        trial_number=trial_number(params.get("trial")),
        slurm=parse_slurm(params.get("slurm")),
        dropped_knobs=dropped,
    )


def parse_slurm(value: object) -> SlurmJob | None:
    """Check a ``hello``'s ``slurm`` (``{job_id, array_job_id, array_task_id, user,
    partition, gpus}``; only ``job_id`` required; absent or null: not a Slurm job).

    Ids are decimal strings (:data:`SLURM_ID_PATTERN`), the task id an integer
    0..:data:`SLURM_ARRAY_TASK_MAX` given together with the array id, names match
    :data:`SLURM_NAME_PATTERN`, ``gpus`` is a list of at most :data:`MAX_CUDA_DEVICES`
    strings matching :data:`SLURM_GPU_PATTERN`. Unknown keys are ignored. Raises
    :class:`ProtocolError` ``bad_request``.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'slurm' must be an object or null")

    def field(key: str, pattern: re.Pattern[str], required: bool = False) -> str | None:
        item = value.get(key)
        if item is None and not required:
            return None
        if not isinstance(item, str) or not pattern.fullmatch(item):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"'slurm.{key}' must match {pattern.pattern}"
            )
        return item

    job_id = field("job_id", SLURM_ID_PATTERN, required=True)
    assert job_id is not None
    array_job_id = field("array_job_id", SLURM_ID_PATTERN)
    task = value.get("array_task_id")
    if task is not None and (not is_int(task) or not 0 <= task <= SLURM_ARRAY_TASK_MAX):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"'slurm.array_task_id' must be an integer 0..{SLURM_ARRAY_TASK_MAX}",
        )
    if (task is None) != (array_job_id is None):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "'slurm.array_job_id' and 'array_task_id' come together"
        )
    gpus = value.get("gpus", [])
    if (
        not isinstance(gpus, list)
        or len(gpus) > MAX_CUDA_DEVICES
        or not all(isinstance(g, str) and SLURM_GPU_PATTERN.fullmatch(g) for g in gpus)
    ):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"'slurm.gpus' must be a list of at most {MAX_CUDA_DEVICES} GPU indices or UUIDs",
        )
    return SlurmJob(
        job_id=job_id,
        array_job_id=array_job_id,
        array_task_id=task,
        user=field("user", SLURM_NAME_PATTERN),
        partition=field("partition", SLURM_NAME_PATTERN),
        gpus=tuple(gpus),
    )


def slurm_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs allocated to a Slurm task on its node, from the first of
    :data:`SLURM_GPU_ENV` that is set and well formed: comma-separated NVML indices or
    UUIDs (:data:`SLURM_GPU_PATTERN`), at most :data:`MAX_CUDA_DEVICES`, duplicates
    dropped. Empty when none is (``NoDevFiles``, a malformed list: never a guess)."""
    for name in SLURM_GPU_ENV:
        text = environ.get(name, "")
        if not text:
            continue
        items = list(dict.fromkeys(text.split(",")))
        if len(items) <= MAX_CUDA_DEVICES and all(SLURM_GPU_PATTERN.fullmatch(g) for g in items):
            return items
        return []
    return []


def slurm_identity(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``slurm`` of a ``hello`` from a Slurm task's environment (``SLURM_JOB_ID``,
    ``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID``, ``SLURM_JOB_USER``,
    ``SLURM_JOB_PARTITION``, the GPUs of :func:`slurm_gpus`; sbatch(1) "OUTPUT ENVIRONMENT
    VARIABLES"); None outside Slurm
    or when ``SLURM_JOB_ID`` is malformed. A malformed optional field is left out (the
    daemon would refuse the whole hello for it; the job is still watched)."""
    job_id = environ.get("SLURM_JOB_ID", "")
    if not SLURM_ID_PATTERN.fullmatch(job_id):
        return None
    found: dict[str, Any] = {"job_id": job_id}
    array, task = environ.get("SLURM_ARRAY_JOB_ID", ""), environ.get("SLURM_ARRAY_TASK_ID", "")
    if (
        SLURM_ID_PATTERN.fullmatch(array)
        and task.isdigit()
        and int(task) <= SLURM_ARRAY_TASK_MAX
    ):
        found["array_job_id"], found["array_task_id"] = array, int(task)
    for key, name in (("user", "SLURM_JOB_USER"), ("partition", "SLURM_JOB_PARTITION")):
        value = environ.get(name, "")
        if SLURM_NAME_PATTERN.fullmatch(value):
            found[key] = value
    gpus = slurm_gpus(environ)
    if gpus:
        found["gpus"] = gpus
    return found


def parse_report(
    params: Mapping[str, Any], *, declared: Mapping[str, Knob], timestamp_s: float
) -> ReportUpdate:
    """Check a ``report``'s ``params`` whole (a bad one changes nothing).

    Required: ``steps``, ``epoch``, ``step_time_s``, ``data_wait_s``,
    ``data_wait_fraction``, ``samples_per_s``. Optional: ``cuda_memory``, ``oom_events``,
    ``knobs`` (values of the ``declared`` knobs) and ``trial`` (``{number, params}`` or
    null). Unknown keys are ignored, so that a newer hook can talk to an older daemon.
    Raises :class:`ProtocolError` ``bad_request``.
    """
    body = params.get("report")
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'report' must be an object")
    report = JobReport(
        timestamp_s=timestamp_s,
        steps=count(body, "steps"),
        epoch=count(body, "epoch"),
        step_time_s=seconds(body, "step_time_s"),
        data_wait_s=seconds(body, "data_wait_s"),
        data_wait_fraction=fraction(body, "data_wait_fraction"),
        samples_per_s=seconds(body, "samples_per_s"),
        cuda_memory=cuda_memory(body.get("cuda_memory")),
        oom_events=count(body, "oom_events") if "oom_events" in body else 0,
    )
    knob_values = report_knobs(body.get("knobs"), declared)
    given = "trial" in body
    return ReportUpdate(
        report=report,
        knob_values=knob_values,
        trial_given=given,
        trial_number=trial_number(body["trial"]) if given else None,
    )


def parse_event(
    params: Mapping[str, Any],
    *,
    job: str,
    pid: int,
    default_trial: int | None,
    timestamp_s: float,
) -> JobEvent:
    """Check a job ``event``'s ``params``; the :class:`~gpuwatchd.model.JobEvent` for the tick.

    ``kind`` is one of :data:`~gpuwatchd.control.protocol.JOB_EVENT_KINDS`; a ``trial``
    event needs ``trial_state`` (:data:`~gpuwatchd.control.protocol.TRIAL_STATES`), a
    ``crash`` event ``crash_kind`` (:data:`~gpuwatchd.control.protocol.HOOK_CRASH_KINDS`).
    ``trial_number`` defaults to ``default_trial``; ``message`` is at most
    :data:`EVENT_MESSAGE_MAX_CHARS`. Raises :class:`ProtocolError` ``bad_request``.
    """
    body = params.get("event")
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'event' must be an object")
    kind = body.get("kind")
    if kind not in JOB_EVENT_KINDS:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"event 'kind' must be one of {sorted(JOB_EVENT_KINDS)}"
        )
    trial_state = choice(body, "trial_state", TRIAL_STATES, required=kind == "trial")
    crash_kind = choice(body, "crash_kind", HOOK_CRASH_KINDS, required=kind == "crash")
    number = default_trial
    if body.get("trial_number") is not None:
        number = trial_number({"number": body["trial_number"]})
    message = body.get("message", "")
    if message is None:
        message = ""
    if not isinstance(message, str) or len(message) > EVENT_MESSAGE_MAX_CHARS:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"event 'message' must be a string of at most {EVENT_MESSAGE_MAX_CHARS} characters",
        )
    return JobEvent(
        timestamp_s=timestamp_s,
        job=job,
        kind=str(kind),
        pid=pid,
        crash_kind=crash_kind,
        trial_number=number,
        trial_state=trial_state,
        message=message,
    )


def parse_set_knob_result(result: object) -> KnobApplied | None:
    """A job's ``set_knob`` reply ``result`` (``{knob, value}``); ``None`` if malformed."""
    if not isinstance(result, Mapping):
        return None
    name = result.get("knob")
    value = result.get("value")
    if not isinstance(name, str) or not is_knob_value(value):
        return None
    return KnobApplied(name, value)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value)


def is_knob_value(value: object) -> TypeGuard[KnobValue]:
    return isinstance(value, bool) or is_number(value)


def count(body: Mapping[str, Any], key: str) -> int:
    value = body.get(key)
    if not is_int(value) or value < 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"report '{key}' must be a non-negative integer")
    return int(value)


def seconds(body: Mapping[str, Any], key: str) -> float:
    value = body.get(key)
    if not is_number(value) or value < 0:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"report '{key}' must be a finite non-negative number"
        )
    return float(value)


def fraction(body: Mapping[str, Any], key: str) -> float:
    value = seconds(body, key)
    if value > 1.0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"report '{key}' must be between 0 and 1")
    return value


def cuda_memory(raw: object) -> tuple[CudaMemory, ...]:
    """A report's ``cuda_memory`` list -> CudaMemory tuple (``None``/absent: empty)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_CUDA_DEVICES_PER_REPORT:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"report 'cuda_memory' must be a list of at most {MAX_CUDA_DEVICES_PER_REPORT} objects",
        )
    entries: list[CudaMemory] = []
    seen: set[int] = set()
    for item in raw:
        if not isinstance(item, dict):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "report 'cuda_memory' items must be objects")
        fields = ("device", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes")
        values: list[int] = []
        for key in fields:
            value = item.get(key)
            if not is_int(value) or value < 0:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"report 'cuda_memory' {key!r} must be a non-negative integer",
                )
            values.append(value)
        if values[0] in seen:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"report 'cuda_memory' lists device {values[0]} twice"
            )
        seen.add(values[0])
        entries.append(CudaMemory(*values))
    return tuple(entries)


def report_knobs(raw: object, declared: Mapping[str, Knob]) -> dict[str, KnobValue]:
    """A report's ``knobs`` ``{name: value}``: declared names, right kind, within bounds."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "report 'knobs' must be an object {name: value}")
    values: dict[str, KnobValue] = {}
    for name, value in raw.items():
        knob = declared.get(name)
        if knob is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"report 'knobs': {name!r} was not declared in hello"
            )
        if not is_knob_value(value) or isinstance(value, bool) != isinstance(knob.value, bool):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"report 'knobs': {name!r} must be a {type(knob.value).__name__}",
            )
        problem = knob.bounds_error(value)
        if problem is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"report 'knobs': {problem}")
        values[name] = value
    return values


def trial_number(raw: object) -> int | None:
    """``{number, params}`` or null -> the trial number (None without one)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'trial' must be {number, params} or null")
    number = raw.get("number")
    if number is not None and (not is_int(number) or number < 0):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "'trial.number' must be a non-negative integer or null"
        )
    if not isinstance(raw.get("params") or {}, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'trial.params' must be an object")
    return number


def choice(
    body: Mapping[str, Any], key: str, allowed: frozenset[str], *, required: bool
) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"this event needs {key!r} (one of {sorted(allowed)})",
            )
        return None
    if value not in allowed:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"event {key!r} must be one of {sorted(allowed)}"
        )
    return str(value)


def parse_knobs(raw: object) -> tuple[dict[str, Knob], tuple[DroppedKnob, ...]]:
    """``{name: {value, min?, max?}}`` -> the valid knobs as Knob objects, and the others
    as :class:`DroppedKnob` with the reason (a name of 1..:data:`KNOB_NAME_MAX_CHARS`
    characters, a value int|float|bool, numeric bounds or null with min <= max, the
    value within them). Raises ProtocolError ``bad_request`` when ``raw`` is neither null
    nor an object."""
    if raw is None:
        return {}, ()
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'knobs' must be an object {name: {value, ...}}")
    knobs: dict[str, Knob] = {}
    dropped: list[DroppedKnob] = []
    for name, spec in raw.items():
        try:
            knobs[name] = _parse_knob(name, spec)
        except ProtocolError as exc:
            dropped.append(DroppedKnob(knob=name, reason=exc.message))
    return knobs, tuple(dropped)


def _parse_knob(name: str, spec: object) -> Knob:
    """One knob descriptor of a hello; raises ProtocolError ``bad_request`` naming it."""
    if not name or len(name) > KNOB_NAME_MAX_CHARS:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"knob names must be 1..{KNOB_NAME_MAX_CHARS} characters",
        )
    if not isinstance(spec, dict) or not is_knob_value(spec.get("value")):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"knob {name!r} must be {{value: int|float|bool, min?, max?}}",
        )
    value: KnobValue = spec["value"]
    low = spec.get("min")
    high = spec.get("max")
    if isinstance(value, bool) and all(b is None or isinstance(b, bool) for b in (low, high)):
        low = high = None  # a boolean has no range (hooks before 0.1.1 sent False/True)
    for bound, label in ((low, "min"), (high, "max")):
        if bound is not None and not is_number(bound):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"knob {name!r} '{label}' must be a number or null"
            )
    if low is not None and high is not None and low > high:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"knob {name!r} has min > max")
    knob = Knob(name=name, value=value, min=low, max=high)
    problem = knob.bounds_error(value)
    if problem is not None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, problem)
    return knob


def salvage_id(line: bytes) -> str | int | None:
    """The ``id`` of a line that failed validation, if it is at least an object with a valid id."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(message, dict):
        return None
    value = message.get("id")
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and len(value) <= 128):
        return value
    return None
