"""Line-aware YAML loading for the config and policy files (pure: parses text, no I/O).

Specification: docs/modules.md#gpuwatchdyamlsrc
"""

from __future__ import annotations

from typing import Any, Final, NoReturn

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gpuwatchd.errors import ConfigError

__all__ = [
    "MAX_DEPTH",
    "MAX_EXPANDED_NODES",
    "LocatedDict",
    "LocatedList",
    "excerpt",
    "fail_at",
    "line_of",
    "load_located",
]

MAX_DEPTH: Final = 64
"""Nesting of collections a document may have, aliases expanded (a policy needs about 6)."""
MAX_EXPANDED_NODES: Final = 100_000
"""Nodes a document may have with every alias expanded: refuses alias bombs ("billion
laughs": 471 bytes that expand to 10**9 strings) while merge keys stay usable."""
_EXCERPT_CHARS: Final = 80

_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class LocatedDict(dict[str, Any]):
    """A YAML mapping as a ``dict`` that remembers its file and lines.

    ``path`` is the file name given to :func:`load_located`, ``line`` the 1-based line
    where the mapping starts; :meth:`key_line` gives the line of one key.
    """

    __slots__ = ("_key_lines", "line", "path")

    def __init__(self, path: str = "<string>", line: int = 1) -> None:
        super().__init__()
        self.path = path
        self.line = line
        self._key_lines: dict[str, int] = {}

    def key_line(self, key: str) -> int:
        """Return the 1-based line of ``key``, or the mapping's own line if the key is absent."""
        return self._key_lines.get(key, self.line)


class LocatedList(list[Any]):
    """A YAML sequence as a ``list`` that remembers its file and lines.

    ``line`` is the 1-based line where the sequence starts; :meth:`item_line` gives the
    line where item ``index`` starts.
    """

    __slots__ = ("_item_lines", "line", "path")

    def __init__(self, path: str = "<string>", line: int = 1) -> None:
        super().__init__()
        self.path = path
        self.line = line
        self._item_lines: list[int] = []

    def item_line(self, index: int) -> int:
        """Return the 1-based line of item ``index``, or the sequence's own line if out of range."""
        if -len(self._item_lines) <= index < len(self._item_lines):
            return self._item_lines[index]
        return self.line


def line_of(container: LocatedDict | LocatedList, where: str | int | None = None) -> int:
    """Return the 1-based line of key/index ``where`` in ``container`` (its own line if None)."""
    if where is None:
        return container.line
    if isinstance(container, LocatedDict):
        return container.key_line(str(where))
    if isinstance(where, int):
        return container.item_line(where)
    return container.line


def fail_at(
    container: LocatedDict | LocatedList,
    where: str | int | None,
    message: str,
    *,
    error: type[ConfigError] = ConfigError,
) -> NoReturn:
    """Raise ``error(message)`` located at key/index ``where`` of ``container``.

    ``where`` is a key of a :class:`LocatedDict`, an index of a :class:`LocatedList`,
    or None for the container itself. ``str()`` of the raised error is
    ``"<path>:<line>: <message>"``.
    """
    raise error(message, path=container.path, line=line_of(container, where))


def _line(node: Node) -> int:
    return int(node.start_mark.line) + 1


def excerpt(value: object, limit: int = _EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters (``...`` marks the cut), for
    error messages that quote a value from a file or a message."""
    if isinstance(value, (list, dict, tuple, set)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _TooDeep(Exception):
    def __init__(self, mark: Any) -> None:
        super().__init__("too deep")
        self.line = int(mark.line) + 1


def _check_depth(text: str, loader: Any) -> None:
    """Raise :class:`_TooDeep` at the first node of ``text``'s first document nested
    deeper than :data:`MAX_DEPTH` (a scalar or an alias one level below its collection),
    read from the events of ``loader``'s parser, which keeps its own stack. PyYAML's
    composers recurse once per level (20,000 ``[`` would overflow Python's stack, or the
    C one in libyaml's), so the depth is refused before one runs. Stops at the first
    document's end: the composer refuses a second. Raises what the parser raises."""
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(event, yaml.NodeEvent):
            if depth + 1 > MAX_DEPTH:
                raise _TooDeep(event.start_mark)
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
        elif isinstance(event, yaml.DocumentEndEvent):
            return


def _compose(text: str) -> tuple[Any, Node | None]:
    """``(loader, document node)`` of ``text``: composed by libyaml (PyYAML's
    ``CSafeLoader``: the packaged default policies in ~1 ms, not the pure Python
    loader's ~16) where PyYAML has it and libyaml finds no error and no depth over
    :data:`MAX_DEPTH`; else by the pure Python loader (:func:`_compose_in_python`),
    whose errors (message and line) are the ones raised. libyaml reads a few texts
    that loader refuses (a tab between tokens, ``|#``): docs/modules.md."""
    c_loader = getattr(yaml, "CSafeLoader", None)
    if c_loader is not None:
        loader = None
        try:
            _check_depth(text, c_loader)
            loader = c_loader(text)
            return loader, loader.get_single_node()
        except (yaml.YAMLError, UnicodeError, _TooDeep):  # UnicodeError: a lone surrogate
            if loader is not None:
                loader.dispose()
    return _compose_in_python(text)


def _compose_in_python(text: str) -> tuple[Any, Node | None]:
    """:func:`_compose` by PyYAML's pure Python safe loader (its reader rejects
    non-printable characters); raises :class:`_TooDeep` or ``yaml.YAMLError``."""
    _check_depth(text, yaml.SafeLoader)
    loader = yaml.SafeLoader(text)
    try:
        return loader, loader.get_single_node()
    except BaseException:
        loader.dispose()
        raise


def _check_expansion(root: Node, fail: Any) -> None:
    """Refuse a node graph deeper than MAX_DEPTH or larger than MAX_EXPANDED_NODES once its
    aliases are expanded. Memoized per node, so the cost is the size of the graph."""
    sizes: dict[int, tuple[int, int]] = {}

    def visit(node: Node) -> tuple[int, int]:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if isinstance(node, ScalarNode):
            return (1, 0)
        sizes[id(node)] = (1, 0)  # a recursive alias: counted once; the builder refuses it
        children: list[Node] = []
        for item in node.value:
            children.extend(item if isinstance(item, tuple) else (item,))
        size, depth = 1, 0
        for child in children:
            child_size, child_depth = visit(child)
            size += child_size
            depth = max(depth, child_depth)
            if size > MAX_EXPANDED_NODES:
                fail(node, f"YAML expands to more than {MAX_EXPANDED_NODES} nodes (alias bomb?)")
        if depth + 1 > MAX_DEPTH:
            fail(node, f"YAML nested more than {MAX_DEPTH} levels deep (aliases expanded)")
        sizes[id(node)] = (size, depth + 1)
        return size, depth + 1

    visit(root)


class _Builder:
    """Turns a composed node graph into Located containers and plain scalars."""

    def __init__(self, loader: Any, path: str, error: type[ConfigError]) -> None:
        self._loader = loader
        self._path = path
        self._error = error
        self._done: dict[int, Any] = {}
        self._active: set[int] = set()

    def fail(self, node: Node, message: str) -> NoReturn:
        raise self._error(message, path=self._path, line=_line(node))

    def build(self, node: Node) -> Any:
        if isinstance(node, ScalarNode):
            kind = node.tag.rsplit(":", 1)[-1]
            try:
                return self._loader.construct_object(node, deep=True)
            except yaml.YAMLError:
                raise  # the constructor's own refusals (``!!set ""``): invalid YAML
            except (ValueError, TypeError, OverflowError) as exc:  # ``!!int abc``, a bad date
                self.fail(node, f"cannot read {excerpt(node.value)} as {kind}: {exc}")
            except Exception:  # SafeConstructor on an empty text: ``!!int ""`` (IndexError),
                # ``!!bool ""`` (KeyError), ``!!timestamp ""`` (AttributeError)
                self.fail(node, f"cannot read {excerpt(node.value)} as {kind}")
        key = id(node)
        if key in self._done:  # an alias of a collection already built: share it, as PyYAML does
            return self._done[key]
        if key in self._active:
            self.fail(node, "recursive YAML alias is not supported")
        self._active.add(key)
        try:
            if isinstance(node, MappingNode):
                if node.tag != _MAP_TAG:
                    self.fail(node, f"unsupported YAML tag {node.tag!r} on a mapping")
                result: Any = self._mapping(node)
            elif isinstance(node, SequenceNode):
                if node.tag != _SEQ_TAG:
                    self.fail(node, f"unsupported YAML tag {node.tag!r} on a sequence")
                result = self._sequence(node)
            else:  # pragma: no cover - the composer only makes the three node kinds
                self.fail(node, f"unsupported YAML node {type(node).__name__}")
        finally:
            self._active.discard(key)
        self._done[key] = result
        return result

    def _sequence(self, node: SequenceNode) -> LocatedList:
        out = LocatedList(self._path, _line(node))
        for item in node.value:
            out.append(self.build(item))
            out._item_lines.append(_line(item))
        return out

    def _mapping(self, node: MappingNode) -> LocatedDict:
        out = LocatedDict(self._path, _line(node))
        merges: list[LocatedDict] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merges.extend(self._merge_sources(value_node))
                continue
            if not isinstance(key_node, ScalarNode):
                self.fail(key_node, "a mapping key must be a plain string, not a collection")
            key = self.build(key_node)
            if not isinstance(key, str):
                self.fail(
                    key_node,
                    f"key {excerpt(key_node.value)} is read as {type(key).__name__} "
                    f"{excerpt(key)}, not a string; quote it",
                )
            if key in out:
                self.fail(
                    key_node, f"duplicate key {excerpt(key)} (first at line {out.key_line(key)})"
                )
            out[key] = self.build(value_node)
            out._key_lines[key] = _line(key_node)
        for source in merges:  # explicit keys win; earlier merge sources win over later ones
            for key, value in source.items():
                if key not in out:
                    out[key] = value
                    out._key_lines[key] = source.key_line(key)
        return out

    def _merge_sources(self, node: Node) -> list[LocatedDict]:
        if isinstance(node, MappingNode):
            return [self._mapping_value(node)]
        if isinstance(node, SequenceNode):
            return [self._mapping_value(item) for item in node.value]
        self.fail(node, "a merge key '<<' needs a mapping or a list of mappings")

    def _mapping_value(self, node: Node) -> LocatedDict:
        value = self.build(node)
        if not isinstance(value, LocatedDict):
            self.fail(node, "a merge key '<<' needs a mapping or a list of mappings")
        return value


def _yaml_error_line(text: str, exc: yaml.YAMLError) -> int | None:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return int(mark.line) + 1
    position = getattr(exc, "position", None)  # yaml.reader.ReaderError (bad characters)
    if isinstance(position, int):
        return text.count("\n", 0, position) + 1
    return None


def _yaml_error_message(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [p for p in (exc.context, exc.problem) if p]
        return "invalid YAML: " + (", ".join(parts) if parts else "malformed document")
    problem = getattr(exc, "reason", None) or str(exc).splitlines()[0]
    return f"invalid YAML: {problem}"


def load_located(text: str, path: str, *, error: type[ConfigError] = ConfigError) -> Any:
    """Parse one YAML document from ``text`` with the safe loader, keeping line numbers.

    ``path`` is only used in messages and stored on the containers. Returns a
    :class:`LocatedDict`, :class:`LocatedList`, a scalar, or None for an empty document.
    Raises ``error`` (a :class:`~gpuwatchd.errors.ConfigError` subclass) with ``path``
    and the 1-based line for a syntax error, more than one document, a duplicate or
    non-string key, a recursive alias, a tag the safe loader does not know, nesting
    deeper than :data:`MAX_DEPTH` or more than :data:`MAX_EXPANDED_NODES` nodes with
    aliases expanded. Never RecursionError: the depth is refused before composing.
    """
    loader: Any = None
    try:
        loader, node = _compose(text)
        if node is None:
            return None
        builder = _Builder(loader, path, error)
        _check_expansion(node, builder.fail)
        return builder.build(node)
    except _TooDeep as exc:
        message = f"YAML nested more than {MAX_DEPTH} levels deep"
        raise error(message, path=path, line=exc.line) from None
    except yaml.YAMLError as exc:
        raise error(_yaml_error_message(exc), path=path, line=_yaml_error_line(text, exc)) from None
    finally:
        if loader is not None:
            loader.dispose()
