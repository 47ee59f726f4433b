"""The command line as scripts use it (issue 12 item 5): ``--json`` before or after
every command, errors as JSON in JSON mode, ``--format csv`` / ``--no-legend`` tables,
``study`` without Optuna naming the extra, shell completion and man pages generated from
the parsers, ``python -m gpuwatchd`` and ``--version``. Real daemon (replaying the real
8-GPU H100 trace), real ``gpuwatchctl`` subprocesses, real bash."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN, REPO, TRACES, RunningDaemon
from gpuwatchd import __version__
from gpuwatchd.cli.main import main

GPU_COLUMNS = [
    "GPU", "name", "util", "memory used", "memory total", "mem %", "temp", "power", "procs",
    "state", "SM act",
]  # fmt: skip
H100 = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"

JOB = """
import sys, time
from gpuwatchd.hook import attach
with attach("csv-job", knobs={"num_workers": 4}) as watch:
    for _ in watch.loader(lambda knobs: range(10**9)):
        time.sleep(0.05)
"""


@pytest.fixture
def daemon(run_daemon: Callable[..., RunningDaemon]) -> RunningDaemon:
    return run_daemon(
        script={"devices": []},
        args=["--devices", f"replay:{H100}", "--policies", str(REPO / "policies" / "default.yaml")],
    )


@pytest.mark.parametrize(
    "command", [["status"], ["jobs"], ["policy", "show"], ["events"], ["top", "--once"]]
)
def test_json_before_or_after_the_command(daemon: RunningDaemon, command: list[str]) -> None:
    before = daemon.ctl("--json", *command)
    after = daemon.ctl(*command, "--json")
    assert before.returncode == 0 and after.returncode == 0, (before.stderr, after.stderr)
    for result in (before, after):
        text = result.stdout.strip()
        if command == ["events"]:  # one object per line
            objects = [json.loads(line) for line in text.splitlines()]
            assert all("kind" in o for o in objects)
        else:
            assert isinstance(json.loads(text), dict)
    if command in (["jobs"], ["policy", "show"]):
        assert json.loads(before.stdout) == json.loads(after.stdout)


def test_errors_are_json_in_json_mode(daemon: RunningDaemon, tmp_path: Path) -> None:
    # The daemon answers with an error (no such job): exit 1, the error on stdout.
    result = daemon.ctl("knob", "no-such-job", "num_workers", "2", "--json")
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] and "no-such-job" in error["message"]
    # No daemon: exit 3, code unavailable.
    gone = subprocess.run(
        [str(BIN / "gpuwatchctl"), "--socket", str(tmp_path / "none.sock"), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=20,
        env=daemon.env,
    )
    assert gone.returncode == 3
    assert json.loads(gone.stdout)["error"]["code"] == "unavailable"
    # Bad usage: exit 2, code usage; without --json argparse's usage text on stderr.
    usage = daemon.ctl("--json", "status", "--bogus")
    assert usage.returncode == 2
    assert json.loads(usage.stdout)["error"] == {
        "code": "usage",
        "message": "unrecognized arguments: --bogus",
    }
    plain = daemon.ctl("status", "--bogus")
    assert plain.returncode == 2 and plain.stdout == ""
    assert "usage: gpuwatchctl" in plain.stderr


def _gpuwatchd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpuwatchd"), *args], capture_output=True, text=True, timeout=120
    )


def test_gpuwatchd_commands_take_json_either_side_and_report_errors_as_json(
    tmp_path: Path,
) -> None:
    bad_policy = tmp_path / "bad.yaml"
    bad_policy.write_text("policies:\n  - name: x\n    when: {nope: {}}\n    do: [log: {}]\n")
    bad_config = tmp_path / "gpuwatchd.yaml"
    bad_config.write_text("interval: 1s\nbogus: 1\n")
    good = str(REPO / "policies" / "default.yaml")
    for before, after in ((["--json"], []), ([], ["--json"])):
        checked = _gpuwatchd(*before, "check-policy", good, str(bad_policy), *after)
        assert checked.returncode == 1 and checked.stderr == ""
        ok, failed = [json.loads(line) for line in checked.stdout.splitlines()]
        assert ok["ok"] is True and "host-oversubscribed" in ok["policies"]
        assert failed["ok"] is False and failed["error"]["code"] == "policy"
        assert (failed["error"]["path"], failed["error"]["line"]) == (str(bad_policy), 3)
        assert "unknown detector 'nope'" in failed["error"]["message"]

        config = _gpuwatchd(*before, "check-config", str(bad_config), *after)
        assert config.returncode == 1 and config.stderr == ""
        report = json.loads(config.stdout)
        assert report["ok"] is False
        assert [(m["path"], m["line"]) for m in report["mistakes"]] == [(str(bad_config), 2)]
        assert "unknown setting 'bogus'" in report["mistakes"][0]["message"]

        missing = _gpuwatchd(*before, "replay", str(tmp_path / "missing.csv"), *after)
        assert missing.returncode == 1 and missing.stderr == ""
        error = json.loads(missing.stdout)["error"]
        assert error["code"] == "replay" and "cannot read trace" in error["message"]

        usage = _gpuwatchd(*before, "record", "--count", "x", *after)
        assert usage.returncode == 2 and usage.stderr == ""
        assert json.loads(usage.stdout)["error"]["code"] == "usage"

        broken_policies = _gpuwatchd(
            *before, "replay", str(H100), "--policies", str(bad_policy), *after
        )
        assert broken_policies.returncode == 1 and broken_policies.stderr == ""
        error = json.loads(broken_policies.stdout)["error"]
        assert (error["code"], error["path"], error["line"]) == ("policy", str(bad_policy), 3)
    # without --json: text on stderr, as before
    text = _gpuwatchd("check-policy", str(bad_policy))
    assert text.returncode == 1 and text.stdout == ""
    assert f"{bad_policy}:3: unknown detector" in text.stderr
    usage = _gpuwatchd("record", "--count", "x")
    assert usage.returncode == 2 and "usage: gpuwatchd record" in usage.stderr


_TIMINGS = ("parse_s", "engine_s", "gpu_samples_per_s")
"""A replay summary's measured seconds and rate: they differ between two runs."""


def _without_timings(lines: str) -> list[dict[str, object]]:
    records = [json.loads(line) for line in lines.splitlines()]
    return [{k: v for k, v in r.items() if k not in _TIMINGS} for r in records]


def test_gpuwatchd_replay_writes_all_it_found_before_it_exits_and_ends_quietly_under_head(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # five copies of the real trace: ~90 KB of JSON lines, more than a pipe holds; the
    # console script ends with os._exit once its output is flushed
    traces = [str(H100)] * 5
    # stdout block-buffered, as users run it (this environment may set PYTHONUNBUFFERED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    whole = subprocess.run(
        [str(BIN / "gpuwatchd"), "replay", *traces, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert whole.returncode == 0 and whole.stderr == ""
    assert len(whole.stdout) > 65_536
    assert main(["replay", *traces, "--json"]) == 0
    in_process = capsys.readouterr().out
    records = _without_timings(whole.stdout)
    assert records == _without_timings(in_process)
    assert [r["kind"] for r in records].count("summary") == 5
    # `gpuwatchd replay ... | head -1`: the reader goes away, the replay ends quietly
    first, status, stderr = _head_one_line(["replay", *traces, "--json"], env)
    assert status == 0
    assert stderr == b""
    assert first == json.loads(whole.stdout.splitlines()[0])
    # a trace that could not be read before the reader went away: the status is kept
    missing = str(tmp_path / "missing.csv")
    first, status, stderr = _head_one_line(["replay", missing, *traces, "--json"], env)
    assert status == 1
    assert stderr == b""
    error = first["error"]
    assert error["code"] == "replay" and "missing.csv" in error["message"]


def _head_one_line(args: list[str], env: dict[str, str]) -> tuple[dict[str, Any], int, bytes]:
    """``gpuwatchd ARGS | head -1``: the first line (JSON), then the pipe closed; the exit
    status and what went to stderr."""
    with subprocess.Popen(
        [str(BIN / "gpuwatchd"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    ) as head:
        assert head.stdout is not None and head.stderr is not None
        first = json.loads(head.stdout.readline())
        head.stdout.close()
        status = head.wait(timeout=120)
        return first, status, head.stderr.read()


def test_status_and_jobs_as_csv_and_without_legend(daemon: RunningDaemon) -> None:
    result = daemon.ctl("status", "--format", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.reader(io.StringIO(result.stdout)))
    assert rows[0] == GPU_COLUMNS
    assert [row[0] for row in rows[1:]] == [str(i) for i in range(8)]
    assert all(len(row) == len(GPU_COLUMNS) and row[-2] == "ok" for row in rows[1:])
    bare = daemon.ctl("status", "--format", "csv", "--no-legend")
    # The same GPUs without the header line; the sampled cells (util, memory used, power)
    # may differ, as a tick of the replayed trace can fall between the two calls.
    fixed = [GPU_COLUMNS.index(c) for c in ("GPU", "name", "memory total", "state")]
    bare_rows = list(csv.reader(io.StringIO(bare.stdout)))
    assert [[r[i] for i in fixed] for r in bare_rows] == [[r[i] for i in fixed] for r in rows[1:]]
    assert all(len(row) == len(GPU_COLUMNS) for row in bare_rows)
    table = daemon.ctl("status", "--no-legend")
    assert table.returncode == 0 and "memory used" not in table.stdout
    assert len([line for line in table.stdout.splitlines() if " ok " in line]) == 8

    job = subprocess.Popen([sys.executable, "-c", JOB], env=daemon.env)
    try:
        daemon.wait_until(lambda: daemon.status()["jobs"], timeout_s=30, what="the job attached")
        jobs = daemon.ctl("jobs", "--format", "csv")
        assert jobs.returncode == 0, jobs.stderr
        header, *lines = list(csv.reader(io.StringIO(jobs.stdout)))
        assert header[:2] == ["job", "pid"] and "knobs" in header
        assert len(lines) == 1 and lines[0][:2] == ["csv-job", str(job.pid)]
        assert lines[0][header.index("knobs")].startswith("num_workers=4 ")
    finally:
        job.terminate()
        job.wait(timeout=20)


def test_study_without_optuna_names_the_extra(tmp_path: Path) -> None:
    # An install without the 'optuna' extra: Optuna and SQLAlchemy are not importable.
    code = (
        "import sys; sys.modules['optuna'] = None; sys.modules['sqlalchemy'] = None\n"
        "from gpuwatchd.cli.ctl import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    for args, stream in (
        (["study", "--storage", storage], "stderr"),
        (["--json", "study"], "stdout"),
    ):
        result = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1, result
        text = getattr(result, stream)
        assert "pip install 'gpuwatchd[optuna]'" in text
        assert "Traceback" not in result.stderr
        if stream == "stdout":
            assert json.loads(text)["error"]["code"] == "missing_extra"


def test_bash_completion_from_the_parser(tmp_path: Path) -> None:
    for program, word, expected in (
        ("gpuwatchctl", "st", {"status", "study"}),
        ("gpuwatchd", "re", {"replay", "record"}),
    ):
        script = subprocess.run(
            [str(BIN / program), "--print-completion", "bash"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        path = tmp_path / program
        path.write_text(script)
        function = f"_shtab_{program}"
        shell = (
            f"source {path}; COMP_WORDS=({program} {word}); COMP_CWORD=1; "
            f'{function}; echo "${{COMPREPLY[@]}}"'
        )
        result = subprocess.run(
            ["bash", "-c", shell], capture_output=True, text=True, timeout=20, check=True
        )
        assert set(result.stdout.split()) == expected, result
    options = subprocess.run(
        [
            "bash",
            "-c",
            f"source {tmp_path / 'gpuwatchctl'}; COMP_WORDS=(gpuwatchctl jobs --n); "
            'COMP_CWORD=2; _shtab_gpuwatchctl; echo "${COMPREPLY[@]}"',
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert options.stdout.split() == ["--no-legend"]


@pytest.mark.parametrize(
    ("prog", "module", "description"),
    [
        (
            "gpuwatchd",
            "gpuwatchd.cli.main",
            "watch NVIDIA GPUs and the host, fix GPU-hour-wasting patterns",
        ),
        ("gpuwatchctl", "gpuwatchd.cli.ctl", "the client of gpuwatchd's control socket"),
    ],
)
def test_man_pages_are_generated_from_the_parsers(
    tmp_path: Path, prog: str, module: str, description: str
) -> None:
    """man/*.1 is what `make man` writes now (the .TH line's date aside)."""
    out = tmp_path / f"{prog}.1"
    subprocess.run(
        [
            str(BIN / "argparse-manpage"),
            "--project-name",
            "gpuwatchd",
            "--version",
            __version__,
            "--manual-title",
            "gpuwatchd manual",
            "--function",
            "build_parser",
            "--module",
            module,
            "--prog",
            prog,
            "--output",
            str(out),
            "--description",
            description,
        ],
        check=True,
        timeout=60,
        capture_output=True,
        env=dict(os.environ, COLUMNS="80"),  # argparse wraps usage lines at it, as make man
    )
    committed = (REPO / "man" / f"{prog}.1").read_text().splitlines()
    fresh = out.read_text().splitlines()
    assert committed[1:] == fresh[1:], f"man/{prog}.1 is stale: run `make man`"
    assert committed[0].startswith(f'.TH {prog.upper()} "1"')
    text = "\n".join(committed)
    assert "--print-completion" in text and "--version" in text
    if prog == "gpuwatchctl":
        for command in ("status", "top", "jobs", "events", "knob", "pause", "resume", "study"):
            assert f"'gpuwatchctl {command}'" in text, command
        assert "\\-\\-no\\-legend" in text and "\\-\\-format" in text


def test_version_and_python_dash_m() -> None:
    for command in (
        [str(BIN / "gpuwatchd"), "--version"],
        [str(BIN / "gpuwatchctl"), "--version"],
        [sys.executable, "-m", "gpuwatchd", "--version"],
    ):
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        name = "gpuwatchctl" if command[0].endswith("gpuwatchctl") else "gpuwatchd"
        assert result.stdout.strip() == f"{name} {__version__}", command
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "check-policy",
            str(REPO / "policies" / "default.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_a_plain_command_does_not_import_the_completion_library(tmp_path: Path) -> None:
    """shtab costs ~40 ms to import: only --print-completion and --help load it."""
    code = (
        "import sys\nfrom gpuwatchd.cli.ctl import main\n"
        f"status = main(['--socket', {str(tmp_path / 'none.sock')!r}, 'status'])\n"
        "assert status == 3, status\nassert 'shtab' not in sys.modules, 'shtab imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
