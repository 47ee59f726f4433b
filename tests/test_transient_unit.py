"""The systemd launcher's pure pieces: unit names, systemd-run argv, systemctl show parsing."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from gpuwatchd.jobs.transient_unit import (
    choose_launcher,
    environment_file_text,
    launch_identifier,
    parse_show,
    systemd_run_argv,
    unit_name,
)
from gpuwatchd.jobs.unit_launch import returncode_of


def test_unit_name_escapes_like_systemd_escape() -> None:
    assert unit_name("mnist", 0) == "gpuwatchd-mnist-0.service"
    name = unit_name("a b/c", 3)
    assert name == "gpuwatchd-a\\x20b\\x2fc-3.service"
    if shutil.which("systemd-escape"):
        out = subprocess.run(
            ["systemd-escape", "--unescape", name[len("gpuwatchd-"):-len("-3.service")]],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        assert out == "a b/c"


def test_choose_launcher() -> None:
    assert choose_launcher("auto", {"INVOCATION_ID": "abc"}, True) == "systemd"
    assert choose_launcher("auto", {}, True) == "subprocess"
    assert choose_launcher("auto", {"INVOCATION_ID": "abc"}, False) == "subprocess"
    assert choose_launcher("subprocess", {"INVOCATION_ID": "abc"}, True) == "subprocess"
    with pytest.raises(ValueError):
        choose_launcher("docker", {}, True)


def test_argv_is_a_list_ending_with_the_worker_argv() -> None:
    cmd = systemd_run_argv(
        "gpuwatchd-j-0.service", ["python", "worker.py", "--storage", "sqlite:///x; rm -rf /"],
        cwd="/srv/j", env_file="/var/lib/gpuwatchd/jobs/j/worker-0.env",
        uid=1000, gid=1000, properties={"MemoryMax": "2G"},
    )  # fmt: skip
    assert cmd[0] == "systemd-run"
    assert "--slice=gpuwatchd-jobs.slice" in cmd and "--property=MemoryMax=2G" in cmd
    assert "--remain-after-exit" in cmd  # the exit status stays readable after the end
    assert "--property=EnvironmentFile=/var/lib/gpuwatchd/jobs/j/worker-0.env" in cmd
    assert "--uid=1000" in cmd
    assert not any(a.startswith("--setenv") for a in cmd)  # values stay off the command line
    tail = cmd[cmd.index("--") + 1:]
    assert tail == ["python", "worker.py", "--storage", "sqlite:///x; rm -rf /"]
    with pytest.raises(ValueError):
        systemd_run_argv("u.service", ["true"], cwd="/", env_file="relative.env")


def test_dollars_in_the_arguments_reach_the_worker_as_written() -> None:
    argv = ["python", "train.py", "hydra.sweep.dir=multirun/${now:%Y}", "$5", "a$$b"]
    cmd = systemd_run_argv("u.service", argv, cwd="/")
    tail = cmd[cmd.index("--") + 1:]
    # systemd.service(5): "$$" is one literal "$"; "$VAR"/"${VAR}" would be expanded.
    assert tail == ["python", "train.py", "hydra.sweep.dir=multirun/$${now:%Y}", "$$5", "a$$$$b"]


def test_the_environment_file_quotes_every_value_and_leaves_out_the_units_own() -> None:
    text = environment_file_text({
        "PATH": "/usr/bin",
        "TOKEN": 'a"b\\c$HOME`x`#not a comment',
        "MULTI": "line one\nline two",
        "INVOCATION_ID": "the daemon's",
        "EMPTY": "",
    })  # fmt: skip
    assert text.splitlines(keepends=True) == [
        'EMPTY=""\n',
        'MULTI="line one\n',
        'line two"\n',
        'PATH="/usr/bin"\n',
        'TOKEN="a\\"b\\\\c\\$HOME\\`x\\`#not a comment"\n',
    ]
    for bad in ({"A-B": "1"}, {"1A": "1"}, {"": "1"}, {"A=B": "1"}, {"A": "a\0b"}):
        with pytest.raises(ValueError):
            environment_file_text(bad)


@pytest.mark.parametrize(
    "props",
    [
        {"ExecStartPre": "/bin/sh"},
        {"MemoryMax": "1G\nUser=root"},
        {"ReadWritePaths": "srv/relative"},
        {"ReadWritePaths": "/srv/../etc"},
        {"ReadWritePaths": "/srv/a\nExecStart=/bin/sh"},
        {"ReadWritePaths": "/srv/%h"},
        {"ReadWritePaths": "/srv/a  /srv/b"},
        {"ReadWritePaths": " ".join(["/srv"] * 33)},
        {"ProtectSystem": "maybe"},
        {"MemoryMax": "8G\n"},
        {"ReadWritePaths": "/srv/a\n"},
        {"PrivateTmp": "true; rm"},
    ],
)
def test_unit_properties_outside_allow_list_refused(props: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        systemd_run_argv("u.service", ["true"], cwd="/", properties=props)


def test_sandbox_properties_a_job_may_set() -> None:
    props = {
        "ProtectSystem": "strict",
        "ReadWritePaths": "/srv/hpo -/scratch/hpo",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
    }
    cmd = systemd_run_argv("u.service", ["true"], cwd="/", properties=props)
    assert "--property=ProtectSystem=strict" in cmd
    assert "--property=ReadWritePaths=/srv/hpo -/scratch/hpo" in cmd  # one argv item
    assert "--property=ProtectHome=read-only" in cmd and "--property=PrivateTmp=yes" in cmd


def test_each_launch_tags_its_output_with_its_worker_id() -> None:
    assert launch_identifier("hpo.0.0123abcd") == "hpo.0.0123abcd"
    assert launch_identifier("my job.0.0123abcd") is None  # found by unit then
    assert launch_identifier(None) is None
    cmd = systemd_run_argv("u.service", ["true"], cwd="/",
                           syslog_identifier="hpo.0.0123abcd")  # fmt: skip
    assert "--property=SyslogIdentifier=hpo.0.0123abcd" in cmd
    with pytest.raises(ValueError):
        systemd_run_argv("u.service", ["true"], cwd="/", syslog_identifier="a\nb")


def test_parse_show() -> None:
    text = "MainPID=4242\nActiveState=failed\nResult=oom-kill\nExecMainStatus=9\nExecMainCode=2\n"
    show = parse_show(text)
    assert show["MainPID"] == "4242" and show["Result"] == "oom-kill"
    assert returncode_of(show) == -9  # CLD_KILLED by signal 9
    assert returncode_of({"ExecMainCode": "1", "ExecMainStatus": "3"}) == 3
    assert returncode_of({"ExecMainCode": "0", "ExecMainStatus": "0"}) is None
