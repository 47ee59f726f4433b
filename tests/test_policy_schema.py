"""Tests of policy file validation: accepted format, and file:line for every kind of error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.schema import (
    ACTIONS,
    PolicySet,
    default_policy_path,
    load_policies,
    parse_policies,
)

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
        "gpu-underused",
        "data-starved",
        "host-oversubscribed",
        "host-memory-pressure",
    )
    assert ps.sources == (str(path),)
    host = ps.get("host-oversubscribed")
    assert host is not None and host.cooldown_s == 30.0
    assert dict(host.conditions[0].params) == {"percent": 90.0, "for": 15.0}
    assert dict(host.actions[0].params) == {"knob": "num_workers", "factor": 0.5, "min": 1}


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
    expect_error(BASE + "    limit: 3\n", 7, "unknown key 'limit'")


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
    assert set(ACTIONS) == {"log", "set_knob"}
    for spec in ACTIONS.values():
        assert spec.description
        for param in spec.params:
            assert param.help and param.unit


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
