"""The daemon's configuration file (``/etc/gpuwatchd/gpuwatchd.yaml``), validated strictly.

Specification: docs/modules.md#gpuwatchdconfig
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from gpuwatchd.control.protocol import DEFAULT_SOCKET_PATH
from gpuwatchd.errors import ConfigError, StudyError, UnitError
from gpuwatchd.jobs.storage import parse_storage, redact_url, shared_path_problem
from gpuwatchd.restart import RestartPolicy
from gpuwatchd.slurm import SLURM_NODE_PATTERN
from gpuwatchd.units import parse_duration
from gpuwatchd.yamlsrc import LocatedDict, load_located

__all__ = [
    "CONFIG_KEYS",
    "DAEMON_STOP_MODES",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_JOURNAL_RETENTION_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_POLICY_DIR",
    "DEFAULT_STATE_DIR",
    "MIN_JOURNAL_RETENTION_S",
    "JobConfig",
    "OptunaConfig",
    "Settings",
    "SlurmArrayConfig",
    "SlurmConfig",
    "config_errors",
    "parse_config",
    "parse_devices",
]

DEFAULT_CONFIG_PATH = "/etc/gpuwatchd/gpuwatchd.yaml"
DEFAULT_POLICY_DIR = "/etc/gpuwatchd/policies.d"
DEFAULT_STATE_DIR = "/var/lib/gpuwatchd"
"""systemd ``StateDirectory=gpuwatchd`` creates ``/var/lib/gpuwatchd`` (systemd.exec(5))."""
DEFAULT_JOURNAL_RETENTION_S: Final = 30 * 86400.0
"""``journal_retention``: journal rows older than this are pruned (a month of HPO runs)."""
MIN_JOURNAL_RETENTION_S: Final = 86400.0
"""The shortest ``journal_retention``: a restarted daemon restores cooldowns, limits and
interrupted decisions from the journal's last day."""

_LOG_LEVELS = ("debug", "info", "warning", "error")
CONFIG_KEYS: Final = frozenset(
    {
        "admin_group",
        "devices",
        "dry_run",
        "interval",
        "jobs",
        "journal_retention",
        "launcher",
        "log_level",
        "policies",
        "slurm",
        "socket",
        "state_dir",
    }
)
"""The top-level settings of a config file (docs/configuration.md)."""

_JOB_KEYS = frozenset(
    {
        "command",
        "cwd",
        "env",
        "user",
        "workers",
        "min_workers",
        "gpus",
        "optuna",
        "restart",
        "on_daemon_stop",
        "unit_properties",
    }
)
_OPTUNA_KEYS = ("storage", "study", "max_retries", "grace_period", "direction", "exclusive")
_DIRECTIONS = ("minimize", "maximize")
DAEMON_STOP_MODES: Final = ("drain", "stop", "leave")
LAUNCHERS: Final = ("auto", "systemd", "subprocess")
"""``launcher`` values: how managed workers are started (docs/systemd.md, "Worker units")."""
"""``on_daemon_stop`` values: what a daemon stop (SIGTERM) does with a job's workers:
``drain`` (each finishes its trial, then exits; stopped after a grace), ``stop`` (SIGTERM,
then SIGKILL after ``restart.stop_timeout``) or ``leave`` (they keep running and the next
daemon adopts them)."""
DEFAULT_MAX_RETRIES: Final = 3
"""``optuna.max_retries`` default: as the ``restart_study`` action's default."""


@dataclass(frozen=True, slots=True)
class OptunaConfig:
    """The Optuna study a managed job's workers run (``optuna:`` of a job).

    ``storage``: the storage spec (:mod:`gpuwatchd.jobs.storage`): an RDB URL
    (``sqlite:////srv/hpo/optuna.db``, ``postgresql://...``) or Optuna's JournalStorage
    (``journal:///srv/hpo/optuna.log``, ``redis://host:6379/0``); a file's path is
    absolute. ``study``: the study's name. ``max_retries``: the retries any
    chain of the job's trials may have (docs/managed-jobs.md, "Retries"): a trial the
    daemon cut short itself or that was killed from outside, one found stale, and a
    ``restart_study`` action's (whose own ``max_retries`` may only lower it).
    ``grace_period_s``: when set, the
    workers record Optuna heartbeats (``RDBStorage(heartbeat_interval=...)`` well under
    it) and the daemon fails a crashed worker's trial through
    :func:`gpuwatchd.jobs.study.fail_stale_trials` when the hook never told it the trial's
    number (whole seconds, >= 1, as Optuna's ``grace_period``; RDB storages only: a
    JournalStorage records no heartbeats).
    """

    storage: str
    study: str
    max_retries: int = DEFAULT_MAX_RETRIES
    grace_period_s: int | None = None
    directions: tuple[str, ...] = ()
    """``direction``: ``minimize``/``maximize`` (a list for a multi-objective study) of
    the study the daemon creates when it is missing; ``()``: Optuna's default."""
    exclusive: bool = True
    """``exclusive``: the job's workers on this host are the only processes running the
    study's trials. Then a RUNNING trial that no live worker can hold is an orphan,
    failed and re-enqueued by the daemon (docs/managed-jobs.md, "No trial left
    RUNNING"). ``false`` when workers on other hosts (or outside gpuwatchd) share the
    study: dead trials are then found only through Optuna's heartbeat (``grace_period``).
    Default in the config: true for an SQLite database or a journal file (on this host),
    false for a database or Redis server (PostgreSQL, MySQL, ``redis://``), which workers
    on other hosts may share."""


@dataclass(frozen=True, slots=True)
class JobConfig:
    """A managed job: an argv command run as ``workers`` processes (docs/design.md, "Managed jobs").

    Supervised by :class:`gpuwatchd.jobs.supervisor.Supervisor`; ``restart`` is the raw
    ``restart:`` mapping, validated by
    :meth:`gpuwatchd.restart.RestartPolicy.from_mapping` when the file is parsed.
    ``on_daemon_stop`` is one of :data:`DAEMON_STOP_MODES`.
    """

    name: str
    command: tuple[str, ...]
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    workers: int = 1
    min_workers: int = 1
    gpus: str | tuple[int, ...] = "auto"
    optuna: OptunaConfig | None = None
    restart: Mapping[str, Any] = field(default_factory=dict)
    on_daemon_stop: str = "stop"
    unit_properties: Mapping[str, str] = field(default_factory=dict)
    """systemd unit properties of each worker's unit (systemd launcher), e.g. MemoryMax;
    the allowed names: :data:`gpuwatchd.jobs.transient_unit.UNIT_PROPERTIES`."""


@dataclass(frozen=True, slots=True)
class SlurmArrayConfig:
    """A Slurm array whose tasks attach as job ``name`` (their hook's ``job``): the
    ``lower_parallelism``/``raise_parallelism`` ladder moves its ``ArrayTaskThrottle``
    between ``min_workers`` and ``max_workers`` (docs/slurm.md)."""

    name: str
    max_workers: int
    min_workers: int = 1
    optuna: OptunaConfig | None = None
    """The study the tasks run (``storage``, ``study``, ``max_retries``): a crashed task's
    trial is failed and re-enqueued there by ``restart_study``; None: no recovery."""
    raise_hold_s: float = 300.0
    """``raise_hold``: seconds after the array's throttle was last lowered (by this node,
    or seen lowered by another) during which a ``raise_parallelism`` is held."""


@dataclass(frozen=True, slots=True)
class SlurmConfig:
    """The ``slurm:`` section (docs/slurm.md): ``conf`` (the slurm.conf Slurm's clients
    read, None: their default), ``node`` (this node's ``NodeName``, None: the host's short
    name), ``timeout_s`` of one client call, ``max_drained_nodes`` (nodes gpuwatchd may
    have drained cluster-wide at once), ``arrays`` (by job name)."""

    conf: str | None = None
    node: str | None = None
    timeout_s: float = 10.0
    max_drained_nodes: int = 1
    arrays: Mapping[str, SlurmArrayConfig] = field(default_factory=dict)


_SLURM_KEYS: Final = ("conf", "node", "timeout", "max_drained_nodes", "arrays")
_SLURM_ARRAY_KEYS: Final = ("max_workers", "min_workers", "optuna", "raise_hold")


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the daemon needs to start, after file and flags are merged.

    ``policies`` empty means: ``/etc/gpuwatchd/policies.d`` when it holds ``*.yaml``
    files, else the packaged ``policies/default.yaml`` (resolved by the daemon).
    """

    interval_s: float = 1.0
    devices: str = "auto"
    policies: tuple[str, ...] = ()
    socket: str = DEFAULT_SOCKET_PATH
    state_dir: str = DEFAULT_STATE_DIR
    admin_group: str | None = "gpuwatch-admin"
    dry_run: bool = False
    log_level: str = "info"
    replay_speed: float = 1.0
    jobs: tuple[JobConfig, ...] = ()
    config_path: str | None = None
    journal_retention_s: float = DEFAULT_JOURNAL_RETENTION_S
    launcher: str = "auto"
    metrics_listen: str | None = None
    """``HOST:PORT`` of the Prometheus endpoint (``--metrics-listen``); None: none."""
    metrics_textfile: str | None = None
    """Path of node_exporter's textfile to write (``--metrics-textfile``); None: none."""
    slurm: SlurmConfig | None = None
    """The ``slurm:`` section; None: gpuwatchd does not act through Slurm."""

    def with_overrides(self, **changes: Any) -> Settings:
        """Return a copy with the non-None ``changes`` applied (command-line flags)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def parse_devices(value: str) -> str:
    """Validate a ``devices`` value: ``auto``, ``nvml``, ``none`` or ``replay:PATH``.

    Raises :class:`ValueError` with a readable message otherwise.
    """
    if value in ("auto", "nvml", "none"):
        return value
    if value.startswith("replay:") and len(value) > len("replay:"):
        return value
    raise ValueError(f"devices must be auto, nvml, none or replay:PATH, not {value!r}")


def _fail(doc: LocatedDict, key: str, message: str, path: str) -> ConfigError:
    return ConfigError(message, path=path, line=doc.key_line(key))


def _str_list(value: object) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _seconds(
    doc: LocatedDict, key: str, default_s: float, what: str, path: str, positive: bool = False
) -> float:
    """``doc[key]``, a duration (``10s``, ``5m``), in seconds; ``default_s`` when absent.
    Raises ConfigError at the key's line (``what`` names it) for a value that is not a
    duration, is negative, or (``positive``) is 0."""
    if key not in doc:
        return default_s
    try:
        seconds = parse_duration(doc[key])
    except UnitError as exc:
        raise _fail(doc, key, str(exc), path) from None
    if seconds < 0 or (positive and seconds == 0):
        raise _fail(doc, key, f"{what} must be {'positive' if positive else '>= 0'}", path)
    return seconds


def _parse_slurm(doc: LocatedDict, value: object, path: str) -> SlurmConfig:
    """The ``slurm:`` section; raises ConfigError."""
    if not isinstance(value, LocatedDict):
        raise _fail(doc, "slurm", "slurm must be a mapping", path)
    for key in value:
        if key not in _SLURM_KEYS:
            raise _fail(
                value, key, f"unknown key {key!r} in slurm ({', '.join(_SLURM_KEYS)})", path
            )
    for key in ("conf", "node"):
        if key in value and not (isinstance(value[key], str) and value[key]):
            raise _fail(value, key, f"slurm.{key} must be a non-empty string", path)
    if "node" in value and not SLURM_NODE_PATTERN.fullmatch(value["node"]):
        raise _fail(
            value, "node", f"slurm.node {value['node'][:70]!r} is not a Slurm node name", path
        )
    timeout_s = _seconds(value, "timeout", 10.0, "slurm.timeout", path, positive=True)
    cap = value.get("max_drained_nodes", 1)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise _fail(value, "max_drained_nodes", "max_drained_nodes must be an integer >= 0", path)
    arrays: dict[str, SlurmArrayConfig] = {}
    raw = value.get("arrays")
    if raw is None:
        raw = LocatedDict()
    if not isinstance(raw, LocatedDict):
        raise _fail(value, "arrays", "slurm.arrays must map job names to settings", path)
    for name, spec in raw.items():
        if not isinstance(spec, LocatedDict) or any(k not in _SLURM_ARRAY_KEYS for k in spec):
            raise _fail(
                raw,
                name,
                f"slurm array {name!r}: a mapping of {', '.join(_SLURM_ARRAY_KEYS)}",
                path,
            )
        numbers = [spec.get("max_workers"), spec.get("min_workers", 1)]
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in numbers):
            raise _fail(
                raw, name, f"slurm array {name!r}: max_workers and min_workers are >= 1", path
            )
        if numbers[1] > numbers[0]:
            raise _fail(raw, name, f"slurm array {name!r}: min_workers exceeds max_workers", path)
        optuna = _parse_optuna(str(name), spec["optuna"], spec, path) if "optuna" in spec else None
        hold_s = _seconds(spec, "raise_hold", 300.0, f"slurm array {name!r}: raise_hold", path)
        arrays[str(name)] = SlurmArrayConfig(str(name), numbers[0], numbers[1], optuna, hold_s)
    return SlurmConfig(
        conf=value.get("conf"),
        node=value.get("node"),
        timeout_s=timeout_s,
        max_drained_nodes=cap,
        arrays=arrays,
    )


def _parse_job(name: str, spec: object, path: str, line: int) -> JobConfig:
    if not isinstance(spec, LocatedDict):
        raise ConfigError(f"job {name!r} must be a mapping", path=path, line=line)
    for key in spec:
        if key not in _JOB_KEYS:
            raise _fail(
                spec,
                key,
                f"unknown key {key!r} in job {name!r} "
                f"(expected one of: {', '.join(sorted(_JOB_KEYS))})",
                path,
            )
    command = spec.get("command")
    if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
        raise ConfigError(
            f"job {name!r} needs 'command': a non-empty list of strings (an argv, "
            "never a shell string)",
            path=path,
            line=spec.key_line("command") if "command" in spec else spec.line,
        )
    env = spec.get("env", {})
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise _fail(spec, "env", f"job {name!r}: 'env' must map names to strings", path)
    workers, min_workers = spec.get("workers", 1), spec.get("min_workers", 1)
    for key, number in (("workers", workers), ("min_workers", min_workers)):
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise _fail(spec, key, f"job {name!r}: {key!r} must be a positive integer", path)
    if min_workers > workers:
        raise _fail(spec, "min_workers", f"job {name!r}: min_workers exceeds workers", path)
    gpus = spec.get("gpus", "auto")
    if gpus != "auto" and not (
        isinstance(gpus, list)
        and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)
    ):
        raise _fail(
            spec, "gpus", f"job {name!r}: 'gpus' must be auto or a list of GPU indices", path
        )
    for key in ("cwd", "user"):
        if key in spec and not isinstance(spec[key], str):
            raise _fail(spec, key, f"job {name!r}: {key!r} must be a string", path)
    on_stop = spec.get("on_daemon_stop", "stop")
    if on_stop not in DAEMON_STOP_MODES:
        raise _fail(
            spec,
            "on_daemon_stop",
            f"job {name!r}: on_daemon_stop must be one of {', '.join(DAEMON_STOP_MODES)}",
            path,
        )
    props = spec.get("unit_properties", {})
    if not (isinstance(props, dict) and all(isinstance(v, (str, int)) for v in props.values())):
        raise _fail(
            spec,
            "unit_properties",
            f"job {name!r}: 'unit_properties' must map names to values",
            path,
        )
    unit_properties = {
        # YAML reads an unquoted yes/no as a bool: systemd's spelling is yes/no.
        str(k): ("yes" if v else "no") if isinstance(v, bool) else str(v)
        for k, v in props.items()
    }
    from gpuwatchd.jobs.transient_unit import check_properties  # the launcher's rule

    try:
        check_properties(unit_properties)
    except ValueError as exc:
        raise _fail(spec, "unit_properties", f"job {name!r}: {exc}", path) from None
    restart = spec.get("restart", {})
    if not isinstance(restart, dict):
        raise _fail(spec, "restart", f"job {name!r}: 'restart' must be a mapping", path)
    _check_restart(name, restart, spec, path)
    optuna = None
    if "optuna" in spec:
        optuna = _parse_optuna(name, spec["optuna"], spec, path)
    return JobConfig(
        name=name,
        command=tuple(command),
        cwd=spec.get("cwd"),
        env=dict(env),
        user=spec.get("user"),
        workers=workers,
        min_workers=min_workers,
        gpus="auto" if gpus == "auto" else tuple(gpus),
        optuna=optuna,
        restart=dict(restart),
        on_daemon_stop=str(on_stop),
        unit_properties=unit_properties,
    )


def _check_restart(name: str, restart: dict[str, Any], spec: LocatedDict, path: str) -> None:
    """Validate ``restart:`` with the supervisor's own parser; errors name the key's line."""

    try:
        RestartPolicy.from_mapping(restart, job=name)
    except ConfigError as exc:
        line = spec.key_line("restart")
        if isinstance(restart, LocatedDict):
            for key in restart:
                try:
                    RestartPolicy.from_mapping({key: restart[key]}, job=name)
                except ConfigError:
                    line = restart.key_line(key)
                    break
            else:  # a combination (max_backoff < backoff): point at max_backoff
                line = restart.key_line("max_backoff")
        raise ConfigError(exc.message, path=path, line=line) from None


def _parse_optuna(name: str, raw: object, spec: LocatedDict, path: str) -> OptunaConfig:
    if not isinstance(raw, LocatedDict):
        raise _fail(spec, "optuna", f"job {name!r}: 'optuna' must be a mapping", path)
    for key in raw:
        if key not in _OPTUNA_KEYS:
            raise _fail(
                raw,
                key,
                f"job {name!r}: unknown key optuna.{key} (expected one of: "
                f"{', '.join(_OPTUNA_KEYS)})",
                path,
            )
    for key in ("storage", "study"):
        value = raw.get(key)
        if not isinstance(value, str) or not value:
            raise _fail(
                raw, key, f"job {name!r}: optuna.{key} is required (a non-empty string)", path
            )
    retries = raw.get("max_retries", DEFAULT_MAX_RETRIES)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise _fail(
            raw, "max_retries", f"job {name!r}: optuna.max_retries must be an integer >= 0", path
        )
    grace: int | None = None
    if raw.get("grace_period") is not None:
        try:
            seconds = parse_duration(raw["grace_period"])
        except UnitError as exc:
            raise _fail(
                raw, "grace_period", f"job {name!r}: optuna.grace_period: {exc}", path
            ) from None
        if seconds < 1 or seconds != int(seconds):
            raise _fail(
                raw,
                "grace_period",
                f"job {name!r}: optuna.grace_period must be whole seconds, at least 1s "
                "(Optuna's grace_period is an integer)",
                path,
            )
        grace = int(seconds)
    try:
        storage = parse_storage(str(raw["storage"]))
    except StudyError as exc:
        raise _fail(raw, "storage", f"job {name!r}: optuna.storage: {exc}", path) from None
    problem = shared_path_problem(storage)
    if problem is not None:
        raise _fail(raw, "storage", f"job {name!r}: optuna.storage: {problem}", path)
    if grace is not None and storage.kind != "rdb":
        raise _fail(
            raw,
            "grace_period",
            f"job {name!r}: optuna.grace_period needs Optuna trial heartbeats, which only "
            "RDBStorage records (SQLite, PostgreSQL); Optuna's JournalStorage "
            f"({redact_url(storage.text)}) has none: remove grace_period",
            path,
        )
    direction = raw.get("direction")
    directions: tuple[str, ...] = ()
    if direction is not None:
        items = direction if isinstance(direction, list) else [direction]
        if not items or any(d not in _DIRECTIONS for d in items):
            raise _fail(
                raw,
                "direction",
                f"job {name!r}: optuna.direction must be minimize or maximize "
                "(or a list of them for a multi-objective study)",
                path,
            )
        directions = tuple(str(d) for d in items)
    exclusive = raw.get("exclusive")
    if exclusive is None:
        # An SQLite database or a journal file on this host: its workers are this daemon's.
        # A database or Redis server may be shared by workers on other hosts.
        exclusive = storage.local_file is not None
    elif not isinstance(exclusive, bool):
        raise _fail(raw, "exclusive", f"job {name!r}: optuna.exclusive must be true or false", path)
    return OptunaConfig(
        storage=str(raw["storage"]),
        study=str(raw["study"]),
        max_retries=retries,
        grace_period_s=grace,
        directions=directions,
        exclusive=exclusive,
    )


def parse_config(text: str, path: str) -> Settings:
    """Parse the config file's ``text`` (``path`` names it in errors) into :class:`Settings`.

    An empty file gives the defaults. Raises :class:`ConfigError` with path and line for
    YAML syntax errors, unknown keys, bad durations, bad ``devices`` or bad job entries
    (the first one; :func:`config_errors` gives each).
    """
    doc = _document(text, path)
    values: dict[str, Any] = {"config_path": path}
    if doc is None:
        return Settings(**values)
    for key, value in doc.items():
        _parse_setting(doc, key, value, path, values)
    return Settings(**values)


def config_errors(text: str, path: str) -> tuple[list[JobConfig], list[ConfigError]]:
    """Every mistake :func:`parse_config` stops at, one per bad setting and per bad job
    (``gpuwatchd check-config``): the jobs that parse and the errors, in file order. A
    YAML syntax error is the only error (nothing after it can be read)."""
    try:
        doc = _document(text, path)
    except ConfigError as exc:
        return [], [exc]
    jobs: list[JobConfig] = []
    errors: list[ConfigError] = []
    if doc is None:
        return jobs, errors
    for key, value in doc.items():
        if key == "jobs" and isinstance(value, LocatedDict):
            for name, spec in value.items():
                try:
                    jobs.append(_parse_job(str(name), spec, path, value.key_line(name)))
                except ConfigError as exc:
                    errors.append(exc)
            continue
        try:
            _parse_setting(doc, key, value, path, {})
        except ConfigError as exc:
            errors.append(exc)
    return jobs, errors


def _document(text: str, path: str) -> LocatedDict | None:
    doc = load_located(text, path, error=ConfigError)
    if doc is None:
        return None
    if not isinstance(doc, LocatedDict):
        raise ConfigError("the config file must be a mapping of settings", path=path, line=1)
    return doc


def _parse_setting(
    doc: LocatedDict, key: str, value: Any, path: str, values: dict[str, Any]
) -> None:
    """Parse top-level ``key`` into ``values`` (Settings field names); raises ConfigError."""
    if key == "interval":
        values["interval_s"] = _seconds(doc, key, 0.0, "interval", path, positive=True)
    elif key == "devices":
        try:
            values["devices"] = parse_devices(str(value))
        except ValueError as exc:
            raise _fail(doc, key, str(exc), path) from None
    elif key == "policies":
        paths = _str_list(value)
        if paths is None:
            raise _fail(doc, key, "policies must be a path or a list of paths", path)
        values["policies"] = paths
    elif key in ("socket", "state_dir"):
        if not isinstance(value, str) or not value:
            raise _fail(doc, key, f"{key} must be a path", path)
        values[key] = value
    elif key == "admin_group":
        if value is not None and not isinstance(value, str):
            raise _fail(doc, key, "admin_group must be a group name or null", path)
        values[key] = value
    elif key == "dry_run":
        if not isinstance(value, bool):
            raise _fail(doc, key, "dry_run must be true or false", path)
        values[key] = value
    elif key == "launcher":
        if value not in LAUNCHERS:
            raise _fail(doc, key, f"launcher must be one of {', '.join(LAUNCHERS)}", path)
        values[key] = value
    elif key == "log_level":
        if value not in _LOG_LEVELS:
            raise _fail(doc, key, f"log_level must be one of {', '.join(_LOG_LEVELS)}", path)
        values[key] = value
    elif key == "journal_retention":
        try:
            retention = parse_duration(value)
        except UnitError as exc:
            raise _fail(doc, key, str(exc), path) from None
        if retention < MIN_JOURNAL_RETENTION_S:
            raise _fail(
                doc,
                key,
                "journal_retention must be at least 1d (cooldowns, limits and "
                "interrupted decisions are restored from the last day after a restart)",
                path,
            )
        values["journal_retention_s"] = retention
    elif key == "slurm":
        values["slurm"] = None if value is None else _parse_slurm(doc, value, path)
    elif key == "jobs":
        if value is None:
            return
        if not isinstance(value, LocatedDict):
            raise _fail(doc, key, "jobs must map job names to job settings", path)
        values["jobs"] = tuple(
            _parse_job(str(name), spec, path, value.key_line(name)) for name, spec in value.items()
        )
    else:
        raise _fail(
            doc,
            key,
            f"unknown setting {key!r} (expected one of: {', '.join(sorted(CONFIG_KEYS))})",
            path,
        )
