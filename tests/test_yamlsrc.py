"""Tests of the line-aware YAML loader shared by the config and policy files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuwatchd import yamlsrc
from gpuwatchd.errors import ConfigError, PolicyError
from gpuwatchd.yamlsrc import (
    MAX_DEPTH,
    LocatedDict,
    LocatedList,
    fail_at,
    line_of,
    load_located,
)

DOC = """\
# a comment
interval: 1s
count: 3
ratio: 0.5
enabled: true
nothing: null
name: "quoted"
jobs:
  hpo:
    command: ["python", "tune.py"]
    workers: 2
list:
  - first
  - {a: 1, b: [x, y]}
  -
    nested: yes
"""


def test_scalars_are_resolved_by_the_safe_loader() -> None:
    doc = load_located(DOC, "cfg.yaml")
    assert doc["interval"] == "1s"  # a value with a unit stays a string
    assert doc["count"] == 3 and type(doc["count"]) is int
    assert doc["ratio"] == 0.5 and type(doc["ratio"]) is float
    assert doc["enabled"] is True
    assert doc["nothing"] is None
    assert doc["name"] == "quoted"
    assert doc["list"][2]["nested"] is True  # YAML 1.1 "yes", as yaml.safe_load reads it


def test_values_equal_what_safe_load_gives() -> None:
    import yaml

    assert load_located(DOC, "cfg.yaml") == yaml.safe_load(DOC)


def test_mappings_and_lists_know_their_lines() -> None:
    doc = load_located(DOC, "cfg.yaml")
    assert isinstance(doc, LocatedDict)
    assert doc.path == "cfg.yaml"
    assert doc.line == 2  # the mapping starts at its first key; line 1 is a comment
    assert doc.key_line("interval") == 2
    assert doc.key_line("jobs") == 8
    hpo = doc["jobs"]["hpo"]
    assert isinstance(hpo, LocatedDict)
    assert hpo.key_line("command") == 10
    assert hpo.key_line("workers") == 11
    assert isinstance(hpo["command"], LocatedList) and hpo["command"].line == 10
    items = doc["list"]
    assert isinstance(items, LocatedList)
    assert [items.item_line(i) for i in range(3)] == [13, 14, 16]
    assert items[1].key_line("b") == 14
    assert items[2].key_line("nested") == 16
    assert line_of(doc, "count") == 3
    assert line_of(items, 1) == 14
    assert line_of(items, None) == items.line


def test_absent_key_falls_back_to_the_mapping_line() -> None:
    doc = load_located("a:\n  b: 1\n", "f.yaml")
    assert doc["a"].key_line("missing") == 2


def test_empty_document_is_none() -> None:
    assert load_located("", "f.yaml") is None
    assert load_located("# only a comment\n", "f.yaml") is None


def test_duplicate_key_is_an_error_at_the_second_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_located("a: 1\nb: 2\na: 3\n", "dup.yaml")
    assert str(err.value) == "dup.yaml:3: duplicate key 'a' (first at line 1)"
    assert err.value.path == "dup.yaml" and err.value.line == 3


def test_error_class_is_the_one_passed_in() -> None:
    with pytest.raises(PolicyError) as err:
        load_located("a: 1\na: 2\n", "p.yaml", error=PolicyError)
    assert err.value.line == 2


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("a: 1\nb: [1, 2\nc: 3\n", 3),  # unclosed flow sequence, noticed at the next key
        ("a: 1\n  b: 2\n", 2),  # bad indentation
        ("a: b: c\n", 1),
        ("ok: 1\nbad: \x07\n", 2),  # a control character (the reader rejects it)
        ("a: 1\n---\nb: 2\n", 2),  # two documents
    ],
)
def test_syntax_errors_carry_path_and_line(text: str, line: int) -> None:
    with pytest.raises(ConfigError) as err:
        load_located(text, "bad.yaml")
    assert err.value.path == "bad.yaml"
    assert err.value.line == line
    assert str(err.value).startswith(f"bad.yaml:{line}: invalid YAML")


def test_python_tags_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_located("x: !!python/object/apply:os.system ['true']\n", "evil.yaml")
    assert err.value.line == 1
    with pytest.raises(ConfigError):
        load_located("x: !!python/name:os.system\n", "evil.yaml")


def test_a_scalar_that_does_not_fit_its_tag_is_located() -> None:
    with pytest.raises(ConfigError) as err:
        load_located("a: 1\nb: !!int abc\n", "f.yaml")
    assert err.value.line == 2


def test_non_string_keys_are_errors_not_silent_booleans() -> None:
    with pytest.raises(ConfigError) as err:
        load_located("a: 1\non: 2\n", "f.yaml")
    assert err.value.line == 2
    assert "quote it" in str(err.value)
    assert load_located('"on": 2\n', "f.yaml") == {"on": 2}


def test_merge_keys_work_and_explicit_keys_win() -> None:
    text = "base: &base {a: 1, b: 2}\nuse:\n  <<: *base\n  b: 3\n"
    doc = load_located(text, "f.yaml")
    assert doc["use"] == {"a": 1, "b": 3}
    assert doc["use"].key_line("a") == 1  # where the merged value was written
    assert doc["use"].key_line("b") == 4


def test_recursive_alias_is_an_error() -> None:
    with pytest.raises(ConfigError):
        load_located("a: &x [*x]\n", "f.yaml")


def test_fail_at_raises_path_line_message() -> None:
    doc = load_located("a: 1\nb:\n  - x\n  - y\n", "c.yaml")
    with pytest.raises(ConfigError) as err:
        fail_at(doc, "b", "b is wrong")
    assert str(err.value) == "c.yaml:2: b is wrong"
    with pytest.raises(PolicyError) as perr:
        fail_at(doc["b"], 1, "second item is wrong", error=PolicyError)
    assert str(perr.value) == "c.yaml:4: second item is wrong"
    with pytest.raises(ConfigError) as whole:
        fail_at(doc, None, "whole file")
    assert whole.value.line == 1


def _located(value: object) -> object:
    """``value`` with every container's lines: what a file:line error would name."""
    if isinstance(value, LocatedDict):
        return (
            value.line,
            {k: (value.key_line(k), _located(v)) for k, v in value.items()},
        )
    if isinstance(value, LocatedList):
        return (value.line, [(value.item_line(i), _located(v)) for i, v in enumerate(value)])
    return (type(value).__name__, value)


SHIPPED_YAML = sorted(
    path
    for pattern in ("policies/**/*.yaml", "examples/**/*.yaml")
    for path in Path(__file__).resolve().parents[1].glob(pattern)
)


@pytest.mark.parametrize("path", SHIPPED_YAML, ids=lambda p: p.name)
def test_libyaml_and_pure_python_read_the_same_values_and_lines(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libyaml composes when PyYAML has it (the daemon's start, every reload and replay);
    # the pure Python loader is the reference, and reads whatever libyaml declines
    text = path.read_text()
    assert yaml.__with_libyaml__  # PyPI's and Debian's PyYAML: the fast path is tested
    with monkeypatch.context() as patch:
        patch.setattr(yamlsrc, "_compose_in_python", None)  # not called: libyaml read it all
        fast = _located(load_located(text, str(path)))
    monkeypatch.delattr(yaml, "CSafeLoader")
    assert _located(load_located(text, str(path))) == fast


def _outcome(text: str) -> tuple[str, object]:
    try:
        return "read", _located(load_located(text, "f.yaml"))
    except ConfigError as exc:
        return "refused", str(exc)


def _nested(levels: int, inner: str) -> str:
    return "[" * levels + inner + "]" * levels + "\n"


@pytest.mark.parametrize(
    "text",
    [
        DOC,
        "a: 1\nb: [1, 2\nc: 3\n",  # a syntax error: the Python loader's message and line
        "ok: 1\nbad: \x07\n",  # a control character
        "a: 1\n---\nb: 2\n",
        "a: 1\nb: 2\na: 3\n",
        "x: !!python/name:os.system\n",
        "base: &b {a: [1, {c: 2}]}\nuse: {<<: *b, d: *b}\n",
        _nested(MAX_DEPTH, ""),  # as deep as allowed
        _nested(MAX_DEPTH - 1, "1"),  # a scalar at the deepest level allowed
        _nested(MAX_DEPTH, "1"),  # one level too deep: refused by either
        _nested(MAX_DEPTH + 1, ""),
        "a: &x [1]\n" + "b: " + _nested(MAX_DEPTH - 1, "*x"),  # an alias one level too deep
        _nested(20_000, ""),  # no RecursionError, no crash in libyaml's composer
    ],
    ids=lambda text: repr(text[:24]),
)
def test_libyaml_reads_and_refuses_what_the_python_loader_does(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an error, or a depth over MAX_DEPTH, is read again by the Python loader: the same
    # message and line as without libyaml
    fast = _outcome(text)
    monkeypatch.delattr(yaml, "CSafeLoader")
    assert _outcome(text) == fast


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('a: 1\nb: !!int ""\n', "int"),  # SafeConstructor indexes the empty text
        ('a: 1\nb: !!float ""\n', "float"),
        ('a: 1\nb: !!bool ""\n', "bool"),  # ... and looks it up (KeyError)
        ("a: 1\nb: !!int\n", "int"),
        ('a: 1\nb: !!timestamp ""\n', "timestamp"),  # AttributeError
    ],
)
def test_an_empty_scalar_under_a_tag_is_a_located_error(text: str, kind: str) -> None:
    # hostile input: a file:line error, never a traceback from PyYAML's constructor
    with pytest.raises(ConfigError) as err:
        load_located(text, "f.yaml")
    assert err.value.line == 2 and f"as {kind}" in str(err.value)


def test_libyaml_reads_tabs_between_tokens_the_python_scanner_refuses() -> None:
    # PyYAML's pure Python scanner refuses a tab after "key:" or at the end of a line; YAML
    # allows it there (separation space) and libyaml reads it: a policy with a trailing tab
    # loads (docs/modules.md#gpuwatchdyamlsrc)
    doc = load_located("a:\t1\nb: [1,\t2]   \t\nc: x\t# note\n", "tabs.yaml")
    assert doc == {"a": 1, "b": [1, 2], "c": "x"}
    assert doc.key_line("c") == 3


def test_a_lone_surrogate_in_the_text_is_a_clean_error() -> None:
    # only reachable from the API (files are decoded strictly): libyaml cannot encode it,
    # and the Python loader refuses it
    with pytest.raises(ConfigError) as err:
        load_located("a: \ud800\n", "f.yaml")
    assert "invalid YAML" in str(err.value)


def test_the_depth_limit_counts_every_node_one_level_below_its_collection() -> None:
    # MAX_DEPTH nodes deep is read; a scalar or an alias one level deeper is refused at
    # its line, as an empty collection one level deeper is
    assert load_located(_nested(MAX_DEPTH - 1, "1"), "f.yaml") is not None
    assert load_located(_nested(MAX_DEPTH, ""), "f.yaml") is not None
    for text, line in (
        (_nested(MAX_DEPTH, "\n1"), 2),
        ("a: &x [1]\nb: " + _nested(MAX_DEPTH - 1, "*x"), 2),
        ("\n\n" + _nested(MAX_DEPTH + 1, ""), 3),
    ):
        with pytest.raises(ConfigError) as err:
            load_located(text, "deep.yaml")
        assert str(err.value) == f"deep.yaml:{line}: YAML nested more than {MAX_DEPTH} levels deep"
