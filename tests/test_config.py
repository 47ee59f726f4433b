"""The daemon config file: defaults, every setting, and errors that name file and line."""

from __future__ import annotations

import pytest

from gpuwatchd.config import (
    DEFAULT_MAX_RETRIES,
    OptunaConfig,
    Settings,
    parse_config,
    parse_devices,
)
from gpuwatchd.errors import ConfigError

FULL = """\
interval: 2s
devices: replay:/traces/h100.csv
policies: [/etc/gpuwatchd/policies.d, /srv/extra.yaml]
socket: /tmp/gw/control.sock
state_dir: /tmp/gw/state
admin_group: ml-ops
dry_run: true
log_level: debug
journal_retention: 90d
jobs:
  criteria-hpo:
    command: ["python", "tune.py", "--study", "criteria"]
    cwd: /srv/hpo
    env: {PYTHONUNBUFFERED: "1"}
    workers: 3
    min_workers: 1
    gpus: auto
    optuna: {storage: "sqlite:////srv/hpo/optuna.db", study: criteria}
    restart: {backoff: 5s, max_backoff: 5m, budget: 20}
"""


def test_empty_file_gives_defaults() -> None:
    settings = parse_config("", "/etc/gpuwatchd/gpuwatchd.yaml")
    assert settings.interval_s == 1.0
    assert settings.devices == "auto"
    assert settings.socket == "/run/gpuwatchd/control.sock"
    assert settings.state_dir == "/var/lib/gpuwatchd"
    assert settings.policies == ()
    assert settings.config_path == "/etc/gpuwatchd/gpuwatchd.yaml"
    assert settings.journal_retention_s == 30 * 86400


def test_design_md_example_parses() -> None:
    settings = parse_config(FULL, "gw.yaml")
    assert settings.interval_s == 2.0
    assert settings.devices == "replay:/traces/h100.csv"
    assert settings.policies == ("/etc/gpuwatchd/policies.d", "/srv/extra.yaml")
    assert settings.admin_group == "ml-ops"
    assert settings.dry_run is True
    assert settings.journal_retention_s == 90 * 86400
    (job,) = settings.jobs
    assert job.name == "criteria-hpo"
    assert job.command == ("python", "tune.py", "--study", "criteria")
    assert job.workers == 3 and job.min_workers == 1 and job.gpus == "auto"
    assert job.env == {"PYTHONUNBUFFERED": "1"}


def test_flags_override_file() -> None:
    settings = parse_config("interval: 5s\ndevices: none\n", "gw.yaml")
    merged = settings.with_overrides(interval_s=0.5, devices=None, socket="/tmp/s")
    assert (merged.interval_s, merged.devices, merged.socket) == (0.5, "none", "/tmp/s")


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("interval: 1s\nintervall: 2s\n", 2, "unknown setting 'intervall'"),
        ("interval: 30 parsecs\n", 1, "unknown duration unit"),
        ("interval: 0s\n", 1, "positive"),
        ("devices: cuda\n", 1, "auto, nvml, none or replay:PATH"),
        ("dry_run: yes please\n", 1, "true or false"),
        ("log_level: info\njournal_retention: 12h\n", 2, "at least 1d"),
        ("journal_retention: a month\n", 1, "duration"),
        ("jobs:\n  a:\n    command: python tune.py\n", 3, "never a shell string"),
        ("jobs:\n  a:\n    command: [python]\n    worker: 3\n", 4, "unknown key 'worker'"),
        (
            "jobs:\n  a:\n    command: [python]\n    workers: 1\n    min_workers: 2\n",
            5,
            "min_workers exceeds workers",
        ),
        ("interval: [1s\n", None, ""),
    ],
)
def test_errors_name_file_and_line(text: str, line: int | None, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "/etc/gpuwatchd/gpuwatchd.yaml")
    assert caught.value.path == "/etc/gpuwatchd/gpuwatchd.yaml"
    if line is not None:
        assert caught.value.line == line
        assert str(caught.value).startswith(f"/etc/gpuwatchd/gpuwatchd.yaml:{line}: ")
    else:
        assert caught.value.line is not None  # YAML syntax errors carry the parser's line
    assert words in str(caught.value)


def test_parse_devices() -> None:
    assert parse_devices("replay:x.csv") == "replay:x.csv"
    for bad in ("replay:", "gpu", ""):
        with pytest.raises(ValueError):
            parse_devices(bad)


def test_settings_is_plain_data() -> None:
    assert Settings() == Settings()


JOB = "jobs:\n  hpo:\n    command: [python, tune.py]\n"


def test_job_options_parse() -> None:
    text = JOB + (
        "    on_daemon_stop: drain\n"
        "    optuna: {storage: 'sqlite:////srv/o.db', study: s, max_retries: 1, grace_period: 2m}\n"
        "    restart: {backoff: 2s, max_backoff: 1m, budget: 5, stop_timeout: 20s}\n"
    )
    (job,) = parse_config(text, "gw.yaml").jobs
    assert job.on_daemon_stop == "drain"
    assert job.optuna == OptunaConfig("sqlite:////srv/o.db", "s", max_retries=1, grace_period_s=120)
    assert dict(job.restart) == {
        "backoff": "2s",
        "max_backoff": "1m",
        "budget": 5,
        "stop_timeout": "20s",
    }
    (default,) = parse_config(JOB, "gw.yaml").jobs
    assert (default.on_daemon_stop, default.optuna, default.workers) == ("stop", None, 1)
    (bare,) = parse_config(JOB + "    optuna: {storage: 'sqlite:////o.db', study: s}\n", "x").jobs
    assert bare.optuna is not None and bare.optuna.max_retries == DEFAULT_MAX_RETRIES
    assert bare.optuna.grace_period_s is None


def test_unit_properties_as_yaml_writes_them() -> None:
    # Unquoted yes/no are YAML booleans: they mean systemd's yes/no; numbers are text.
    text = JOB + (
        "    unit_properties: {PrivateTmp: yes, ProtectHome: no, ProtectSystem: strict,\n"
        "                      ReadWritePaths: /srv/hpo, LimitNOFILE: 4096}\n"
    )
    (job,) = parse_config(text, "gw.yaml").jobs
    assert dict(job.unit_properties) == {
        "PrivateTmp": "yes",
        "ProtectHome": "no",
        "ProtectSystem": "strict",
        "ReadWritePaths": "/srv/hpo",
        "LimitNOFILE": "4096",
    }


@pytest.mark.parametrize(
    ("extra", "line", "words"),
    [
        ("    restart:\n      backoff: 2s\n      budgett: 3\n", 6, "unknown key restart.budgett"),
        ("    restart:\n      backoff: 5 parsecs\n", 5, "restart.backoff"),
        ("    restart:\n      budget: 0\n", 5, "restart.budget must be a positive integer"),
        ("    restart:\n      backoff: 1m\n      max_backoff: 5s\n", 6, "shorter than"),
        ("    restart: 5s\n", 4, "'restart' must be a mapping"),
        ("    on_daemon_stop: kill\n", 4, "drain, stop, leave"),
        ("    optuna: {study: s}\n", 4, "optuna.storage is required"),
        ("    optuna:\n      storage: x\n      study: s\n      retries: 2\n", 7, "optuna.retries"),
        ("    optuna: {storage: x, study: s, max_retries: -1}\n", 4, "max_retries"),
        ("    optuna: {storage: x, study: s, grace_period: 0.5s}\n", 4, "whole seconds"),
        ("    optuna: [x]\n", 4, "'optuna' must be a mapping"),
        (
            "    optuna:\n      study: s\n      storage: sqlite:///runs/o.db\n",
            6,
            "the SQLite path 'runs/o.db' is relative",
        ),
        (
            "    optuna: {storage: 'sqlite:////srv/o.db', study: s, direction: up}\n",
            4,
            "optuna.direction must be",
        ),
        ("    workers: 0\n", 4, "'workers' must be a positive integer"),
        ("    min_workers: 0\n", 4, "'min_workers' must be a positive integer"),
        ("    unit_properties: {ExecStartPre: /bin/true}\n", 4, "'ExecStartPre' not allowed"),
        ("    unit_properties:\n      ReadWritePaths: data\n", 4, "ReadWritePaths"),
    ],
)
def test_job_option_errors_name_the_line(extra: str, line: int, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(JOB + extra, "gw.yaml")
    assert caught.value.line == line, str(caught.value)
    assert words in str(caught.value)


def test_optuna_direction_and_sqlite_paths() -> None:
    from gpuwatchd.jobs.storage import sqlite_path

    text = JOB + "    optuna: {storage: 'sqlite:////srv/o.db', study: s, direction: [maximize]}\n"
    (job,) = parse_config(text, "gw.yaml").jobs
    assert job.optuna is not None and job.optuna.directions == ("maximize",)
    assert sqlite_path("sqlite:////srv/hpo/o.db") == "/srv/hpo/o.db"
    assert sqlite_path("sqlite:///o.db?timeout=5") == "o.db"
    assert sqlite_path("postgresql://u@h/db") is None


def test_optuna_exclusive_defaults_to_the_storage_a_host_owns() -> None:
    """A file on this host (SQLite, a journal) is this daemon's workers' alone: the orphan
    sweep runs. A database or Redis server may be shared by other hosts' workers: a
    trial tagged by another host's worker must never be failed here, so the default is
    false there; either can be set explicitly."""

    def exclusive(storage: str, extra: str = "") -> bool:
        text = (
            "jobs:\n  hpo:\n    command: [python, w.py]\n"
            f"    optuna: {{storage: '{storage}', study: s{extra}}}\n"
        )
        (job,) = parse_config(text, "gw.yaml").jobs
        assert job.optuna is not None
        return job.optuna.exclusive

    assert exclusive("sqlite:////srv/hpo/optuna.db") is True
    assert exclusive("journal:///srv/hpo/optuna.log") is True
    assert exclusive("postgresql://hpo@db.example/hpo") is False
    assert exclusive("redis://127.0.0.1:6379/0") is False
    assert exclusive("postgresql://hpo@db.example/hpo", ", exclusive: true") is True
    assert exclusive("sqlite:////srv/hpo/optuna.db", ", exclusive: false") is False
