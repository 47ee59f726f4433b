"""Tests of policy file validation: accepted format, and file:line for every kind of error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.schema import ACTIONS, PolicySet, parse_policies
from gpuwatchd.policyfiles import default_policy_path, load_policies

GOOD = """\
policies:
  - name: host-oversubscribed
    description: "workers saturate the CPU"
    when:
      host_cpu_above: {percent: 90, for: 30s}
    do:
      - set_knob: {knob: num_workers, factor: 0.5, min: 1}
      - log: {message: "cut DataLoader workers"}
    cooldown: 2m
    dry_run: false
  - name: big-vram
    when:
      vram_above: {bytes: 20GiB}
      low_utilization:
    do:
      - log
"""


def test_parses_the_documented_format() -> None:
    ps = parse_policies(GOOD, "p.yaml")
    assert isinstance(ps, PolicySet)
    assert ps.sources == ("p.yaml",)
    assert ps.names == ("host-oversubscribed", "big-vram")
    first = ps.policies[0]
    assert first.description == "workers saturate the CPU"
    assert first.source == "p.yaml:2"
    assert first.cooldown_s == 120.0 and first.dry_run is False
    (cond,) = first.conditions
    assert cond.detector == "host_cpu_above"
    assert dict(cond.params) == {"percent": 90.0, "for": 30.0}
    assert cond.source == "p.yaml:5"
    assert [a.action for a in first.actions] == ["set_knob", "log"]
    assert dict(first.actions[0].params) == {"knob": "num_workers", "factor": 0.5, "min": 1}
    assert dict(first.actions[1].params) == {"message": "cut DataLoader workers", "level": "info"}
    second = ps.get("big-vram")
    assert second is not None
    assert [c.detector for c in second.conditions] == ["vram_above", "low_utilization"]
    assert dict(second.conditions[0].params) == {"bytes": 20 * 2**30, "for": 30.0}
    assert dict(second.conditions[1].params) == {"percent": 20.0, "for": 300.0}
    assert second.cooldown_s == 0.0
    assert second.actions[0].action == "log"


def test_to_dict_is_json_and_describe_is_readable() -> None:
    ps = parse_policies(GOOD, "p.yaml")
    data = json.loads(json.dumps(ps.to_dict()))
    assert data["sources"] == ["p.yaml"]
    assert data["policies"][0]["name"] == "host-oversubscribed"
    assert data["policies"][0]["when"][0] == {
        "detector": "host_cpu_above",
        "params": {"percent": 90.0, "for": 30.0},
        "source": "p.yaml:5",
    }
    assert data["policies"][0]["cooldown_s"] == 120.0
    assert data["policies"][0]["scope"] == "global" and data["policies"][0]["limit"] is None
    text = ps.describe()
    assert "when host_cpu_above percent=90% for=30s" in text
    assert "do   set_knob knob=num_workers factor=0.5 min=1" in text
    assert "cooldown 2m00s" in text


def test_packaged_default_policies_load() -> None:
    path = default_policy_path()
    assert path.is_file()
    ps = load_policies([path])
    assert ps.names == (
        "vram-near-limit",
        "vram-lower-parallelism",
        "crashed-trials-restart",
        "worker-given-up",
        "job-stalled",
        "clean-trials-raise",
        "gpu-underused",
        "data-starved",
        "idle-gpu-place-worker",
        "host-oversubscribed",
        "host-memory-pressure",
        "gpu-hardware-xid",
        "gpu-hardware-ecc-dbe",
        "gpu-hardware-remap-failure",
        "gpu-remap-pending",
        "gpu-hardware-lost",
        "gpu-recovered-uncordon",
        "gpu-driver-xid",
        "gpu-throttled",
    )
    assert {p.name: p.scope for p in ps} == {
        "vram-near-limit": "gpu",
        "vram-lower-parallelism": "gpu",
        "crashed-trials-restart": "job",
        "worker-given-up": "job",
        "job-stalled": "job",
        "clean-trials-raise": "job",
        "gpu-underused": "gpu",
        "data-starved": "job",
        "idle-gpu-place-worker": "gpu",
        "host-oversubscribed": "global",
        "host-memory-pressure": "global",
        "gpu-hardware-xid": "gpu",
        "gpu-hardware-ecc-dbe": "gpu",
        "gpu-hardware-remap-failure": "gpu",
        "gpu-remap-pending": "gpu",
        "gpu-hardware-lost": "gpu",
        "gpu-recovered-uncordon": "gpu",
        "gpu-driver-xid": "gpu",
        "gpu-throttled": "gpu",
    }
    assert ps.sources == (str(path),)
    host = ps.get("host-oversubscribed")
    assert host is not None and host.cooldown_s == 30.0
    assert dict(host.conditions[0].params) == {"percent": 90.0, "for": 5.0}
    assert dict(host.actions[0].params) == {
        "knob": "num_workers",
        "direction": "down",
        "min": 0,
        "measure": 2.0,
        "noise": 0.05,
        "settle_epochs": 0,
    }


def expect_error(text: str, line: int, fragment: str, path: str = "bad.yaml") -> None:
    with pytest.raises(PolicyError) as err:
        parse_policies(text, path)
    assert err.value.path == path
    assert err.value.line == line, str(err.value)
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert fragment in str(err.value)


BASE = """\
policies:
  - name: p
    when:
      host_cpu_above: {percent: 90, for: 30s}
    do:
      - log: {message: hi}
"""


def test_unknown_top_level_key() -> None:
    expect_error(BASE + "extra: 1\n", 7, "unknown top-level key 'extra'")


def test_unknown_key_in_a_policy() -> None:
    expect_error(BASE + "    limits: 3\n", 7, "unknown key 'limits'")


def test_bad_unit() -> None:
    expect_error(BASE.replace("for: 30s", "for: 30 parsecs"), 4, "unknown duration unit")
    text = (
        "policies:\n  - name: p\n    when:\n      host_cpu_above:\n        percent: 90\n"
        "        for: 30 parsecs\n    do: [log]\n"
    )
    expect_error(text, 6, "for:")


def test_unknown_detector() -> None:
    expect_error(BASE.replace("host_cpu_above", "gpu_on_fire"), 4, "unknown detector 'gpu_on_fire'")


def test_unknown_action() -> None:
    expect_error(BASE.replace("- log:", "- reboot:"), 6, "unknown action 'reboot'")


def test_duplicate_name_in_one_file() -> None:
    second = BASE.split("\n", 1)[1]
    expect_error(BASE + second, 7, "duplicate policy name 'p' (first defined at bad.yaml:2)")


def test_yaml_syntax_error() -> None:
    expect_error(BASE.replace("{message: hi}", "{message: hi"), 7, "invalid YAML")


def test_duplicate_key_in_yaml() -> None:
    expect_error(BASE.replace("    do:", "    name: q\n    do:"), 5, "duplicate key 'name'")


@pytest.mark.parametrize(
    ("action", "line_fragment"),
    [
        ("set_knob: {factor: 2}", "needs parameter 'knob'"),
        ("set_knob: {knob: num_workers}", "needs one of value, factor, step"),
        ("set_knob: {knob: num_workers, value: 2, factor: 2}", "only one of value, factor, step"),
        ("set_knob: {knob: num_workers, factor: 0}", "factor must be > 0"),
        ("set_knob: {knob: num_workers, step: 1.5}", "step must be an integer"),
        ("set_knob: {knob: num_workers, factor: 2, min: 4, max: 2}", "max (2) is below min (4)"),
        ("set_knob: {knob: num_workers, factor: 2, jobs: x}", "unknown parameter 'jobs'"),
        ("log: {level: loud}", "expected one of info, warning, error"),
        ("log: 3", "must be a mapping"),
        ("{log: {}, set_knob: {knob: x, value: 1}}", "single-key mapping"),
    ],
)
def test_bad_action_params(action: str, line_fragment: str) -> None:
    expect_error(BASE.replace("log: {message: hi}", action), 6, line_fragment)


@pytest.mark.parametrize(
    ("replace", "by", "line", "fragment"),
    [
        ("    do:\n      - log: {message: hi}\n", "", 2, "policy needs 'do'"),
        ("      host_cpu_above: {percent: 90, for: 30s}\n", "      {}\n", 3, "non-empty mapping"),
        ("name: p", "name: 'has space'", 2, "policy name must be"),
        ("    do:", "    dry_run: maybe\n    do:", 5, "dry_run must be true or false"),
        ("    do:", "    cooldown: soon\n    do:", 5, "cooldown:"),
        ("percent: 90", "percent: 190", 4, "outside 0..100"),
        ("percent: 90", "threshold: 90", 4, "unknown parameter 'threshold'"),
    ],
)
def test_other_errors_are_located(replace: str, by: str, line: int, fragment: str) -> None:
    assert replace in BASE
    expect_error(BASE.replace(replace, by), line, fragment)


def test_document_shape_errors() -> None:
    expect_error("", 1, "empty policy file")
    expect_error("- a\n- b\n", 1, "must be a mapping")
    expect_error("other: 1\n", 1, "unknown top-level key")
    expect_error("policies: {a: 1}\n", 1, "must be a list")
    expect_error("policies:\n  - just-a-name\n", 2, "each policy must be a mapping")


def test_empty_policy_list_is_allowed() -> None:
    assert len(parse_policies("policies: []\n", "p.yaml")) == 0
    assert len(parse_policies("policies:\n", "p.yaml")) == 0


def test_action_registry_documents_every_param() -> None:
    assert set(ACTIONS) == {
        "log",
        "set_knob",
        "lower_parallelism",
        "raise_parallelism",
        "place_on_idle_gpu",
        "restart_worker",
        "restart_study",
        "exec",
        "notify",
        "tune_loader",
        "cordon_gpu",
        "uncordon_gpu",
        "drain_node",
        "requeue_task",
    }
    for spec in ACTIONS.values():
        assert spec.description
        for param in spec.params:
            assert param.help and param.unit


MANAGED = """\
policies:
  - name: vram-ladder
    when:
      vram_above: {percent: 95, clear: 90}
    do:
      - lower_parallelism: {job: not-configured-yet, floor: 2, mode: now}
      - raise_parallelism: {job: other}
    cooldown: 10m
    limit: {max: 3, per: 1h}
  - name: crash
    when:
      job_crashed: {kind: [cuda_assert, cuda_oom]}
    do:
      - restart_worker
      - restart_study: {max_retries: 0}
  - name: idle
    scope: gpu
    when:
      idle_gpu: {no_process: true, for: 1m}
      host_cpu_below: {}
    do:
      - place_on_idle_gpu: {job: hpo}
      - exec: {argv: [/usr/bin/logger, "idle {gpu_index}"], timeout: 5s}
"""


def test_new_actions_scope_and_limit() -> None:
    ps = parse_policies(MANAGED, "m.yaml")
    ladder = ps.policies[0]
    assert ladder.scope == "gpu" and ladder.limit is not None
    assert (ladder.limit.max, ladder.limit.per_s) == (3, 3600.0)
    assert dict(ladder.conditions[0].params) == {"percent": 95.0, "clear": 90.0, "for": 30.0}
    assert dict(ladder.actions[0].params) == {
        "job": "not-configured-yet",  # managed jobs are resolved when the policy fires
        "step": 1,
        "floor": 2,
        "mode": "now",
    }
    assert dict(ladder.actions[1].params) == {"job": "other", "step": 1}
    crash = ps.policies[1]
    assert crash.scope == "job"
    assert dict(crash.conditions[0].params) == {"kind": ("cuda_assert", "cuda_oom")}
    assert [dict(a.params) for a in crash.actions] == [{}, {"max_retries": 0}]
    idle = ps.policies[2]
    assert idle.scope == "gpu"
    assert dict(idle.actions[1].params) == {
        "argv": ("/usr/bin/logger", "idle {gpu_index}"),
        "timeout": 5.0,
    }
    data = json.loads(json.dumps(ps.to_dict()))
    assert data["policies"][0]["limit"] == {"max": 3, "per_s": 3600.0}
    assert data["policies"][2]["do"][1]["params"]["argv"] == ["/usr/bin/logger", "idle {gpu_index}"]
    assert "limit 3 per 1h00m" in ps.describe()
    assert "when job_crashed kind=[cuda_assert, cuda_oom]" in ps.describe()


def test_scope_is_derived_or_given() -> None:
    ps = parse_policies(BASE + "    scope: job\n", "s.yaml")
    assert ps.policies[0].scope == "job"
    assert parse_policies(BASE, "s.yaml").policies[0].scope == "global"
    both = BASE.replace(
        "      host_cpu_above",
        "      low_utilization: {}\n      data_starved: {}\n      host_cpu_above",
    )
    assert parse_policies(both, "s.yaml").policies[0].scope == "job"


@pytest.mark.parametrize(
    ("policy_text", "line", "fragment"),
    [
        (BASE + "    scope: rack\n", 7, "scope: expected one of gpu, job, global"),
        (BASE + "    limit: 3\n", 7, "limit must be a mapping"),
        (BASE + "    limit: {max: 3}\n", 7, "limit needs 'per'"),
        (BASE + "    limit:\n      max: 0\n      per: 1h\n", 8, "max: expected an integer >= 1"),
        (BASE + "    limit:\n      max: 3\n      per: 0s\n", 9, "per: expected a duration > 0"),
        (BASE + "    limit: {max: 3, per: 1h, burst: 2}\n", 7, "unknown key 'burst' in limit"),
        (
            BASE.replace("log: {message: hi}", "exec: {argv: 'rm -rf /tmp/x'}"),
            6,
            "never a shell string",
        ),
        (BASE.replace("log: {message: hi}", "exec: {argv: []}"), 6, "non-empty list"),
        (BASE.replace("log: {message: hi}", "exec: {argv: [ls, 3]}"), 6, "non-empty string"),
        (BASE.replace("log: {message: hi}", "exec: {timeout: 5s}"), 6, "needs parameter 'argv'"),
        (BASE.replace("log: {message: hi}", "restart_worker: {}"), 6, "needs a job_crashed"),
        (BASE.replace("log: {message: hi}", "restart_study"), 6, "needs a job_crashed"),
        (BASE.replace("log: {message: hi}", "place_on_idle_gpu: {}"), 6, "needs scope gpu"),
        (BASE.replace("log: {message: hi}", "lower_parallelism: {mode: later}"), 6, "drain, now"),
        (BASE.replace("log: {message: hi}", "lower_parallelism: {step: 0}"), 6, "integer >= 1"),
        (
            BASE.replace("log: {message: hi}", "raise_parallelism: {floor: 1}"),
            6,
            "unknown parameter",
        ),
        (
            BASE.replace("log: {message: hi}", "restart_study: {max_retries: -1}"),
            6,
            "integer >= 0",
        ),
    ],
)
def test_new_keys_and_actions_are_validated(policy_text: str, line: int, fragment: str) -> None:
    expect_error(policy_text, line, fragment)


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_directory_sorted_yaml_only(tmp_path: Path) -> None:
    write(tmp_path, "20-b.yaml", BASE.replace("name: p", "name: b"))
    write(tmp_path, "10-a.yaml", BASE.replace("name: p", "name: a"))
    write(tmp_path, "notes.txt", "not yaml at all: [")
    ps = load_policies([tmp_path])
    assert ps.names == ("a", "b")
    assert ps.sources == (str(tmp_path / "10-a.yaml"), str(tmp_path / "20-b.yaml"))


def test_names_unique_across_files(tmp_path: Path) -> None:
    first = write(tmp_path, "a.yaml", BASE)
    second = write(tmp_path, "b.yaml", "# another file\n" + BASE)
    with pytest.raises(PolicyError) as err:
        load_policies([first, second])
    assert err.value.path == str(second) and err.value.line == 3
    assert f"first defined at {first}:2" in str(err.value)


def test_one_broken_file_fails_the_whole_load(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", BASE)
    write(tmp_path, "b.yaml", BASE.replace("name: p", "name: q").replace("30s", "30 parsecs"))
    with pytest.raises(PolicyError) as err:
        load_policies([tmp_path])
    assert str(err.value).startswith(f"{tmp_path / 'b.yaml'}:4: ")


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as err:
        load_policies([tmp_path / "nope.yaml"])
    assert "no such policy file" in str(err.value)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"policies: []\n# caf\xe9\n")
    with pytest.raises(PolicyError) as err2:
        load_policies([bad])
    assert "cannot read policy file" in str(err2.value)


def test_job_crashed_matches_optunas_own_errors(tmp_path: Path) -> None:
    """``kind: optuna_error`` (a worker that died of ``Cannot tell a COMPLETE trial.``,
    ``StorageInternalError``) is a crash kind policies can name."""
    text = (
        "policies:\n"
        "  - name: optuna-errors\n"
        "    when:\n"
        "      job_crashed: {kind: optuna_error}\n"
        "    do:\n"
        "      - log: {level: warning}\n"
    )
    (policy,) = parse_policies(text, "p.yaml").policies
    assert dict(policy.conditions[0].params) == {"kind": ("optuna_error",)}
    with pytest.raises(PolicyError, match=r"p\.yaml:4: kind: expected one of .*optuna_error"):
        parse_policies(text.replace("optuna_error", "optuna"), "p.yaml")
