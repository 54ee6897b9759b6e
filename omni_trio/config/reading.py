"""Reading a pipeline config file safely: every failure is a ConfigError naming the file.

What this guards against, besides plain syntax errors: bytes that are not UTF-8 (line and
column of the first bad byte), nesting deeper than :data:`MAX_DEPTH` (the parsers would raise
``RecursionError``), duplicate keys in YAML and JSON (both parsers keep the last one silently;
TOML's parser refuses them itself), YAML aliases that expand to more than :data:`MAX_NODES`
values ("billion laughs") or refer to themselves, and numbers that are not finite (``.nan``,
``inf``, JSON's ``Infinity``). :func:`check_tree` applies the data checks to any mapping (a
config given as a dict too), walking it iteratively with the ``$``-path of every value.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

import msgspec
import msgspec.inspect
import yaml

from ..errors import ConfigError

#: A value as a YAML, TOML or JSON config file holds it, before it is checked: open by nature.
Value: TypeAlias = object
#: The same in a config struct's field: msgspec writes a JSON Schema for ``Any``, not ``object``.
FieldValue: TypeAlias = Any  # type: ignore[explicit-any]

__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "check_struct",
    "check_tree",
    "explain_validation_error",
    "json_object",
    "prechecked",
    "read_config_file",
    "with_value",
]

#: deepest nesting a config may have (a real one is under 10 levels deep)
MAX_DEPTH = 64
#: most values a config may expand to (a 20,000-stage pipeline has about 200,000)
MAX_NODES = 2_000_000


class _Mapping(dict[Value, Value]):
    """A parsed mapping that remembers the keys it saw twice: (key, "line L, column C")."""

    duplicates: list[tuple[Value, str]]

    def __init__(self) -> None:
        super().__init__()
        self.duplicates = []


def _where(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


# libyaml's parser when PyYAML has it (about 3x faster on big files), else PyYAML's own
if TYPE_CHECKING:
    from yaml import SafeLoader as _BaseLoader
else:
    _BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_BaseLoader):  # type: ignore[misc]
    """SafeLoader whose mappings record duplicate keys instead of keeping the last one."""

    def construct_tracked_map(self, node: yaml.MappingNode) -> Iterator[_Mapping]:
        data = _Mapping()
        yield data
        seen: set[Value] = set()
        for key_node, _value in node.value:  # before merge keys are flattened in
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                data.duplicates.append((key, f" ({_where(key_node.start_mark)})"))
            seen.add(key)
        data.update(self.construct_mapping(node))


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_tracked_map)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _label(parent: yaml.Node, i: int) -> str:
    if isinstance(parent, yaml.SequenceNode):
        return f"[{i}]"
    key = parent.value[i // 2][0]
    return "" if i % 2 == 0 else "." + (key.value if isinstance(key, yaml.ScalarNode) else "?")


@dataclass(slots=True)
class _Frame:
    node: yaml.Node
    children: list[yaml.Node]
    next: int = 0  # the next child's index
    size: int = 1  # its expanded size so far


def _check_yaml_nodes(root: yaml.Node, source: str) -> None:
    """Reject alias bombs, self-referring aliases and deep nesting before constructing:
    the node graph shares aliased nodes, so this is linear in the file, not the expansion."""
    size: dict[int, int] = {}
    on_stack = {id(root)}
    stack = [_Frame(root, _children(root))]

    def fail(reason: str, mark: yaml.Mark) -> ConfigError:
        path = "$" + "".join(_label(f.node, f.next - 1) for f in stack)
        return ConfigError(f"{reason} ({_where(mark)})", path=path, source=source)

    while stack:
        frame = stack[-1]
        if frame.next < len(frame.children):
            child = frame.children[frame.next]
            frame.next += 1
            if isinstance(child, yaml.ScalarNode):
                frame.size += 1
            elif id(child) in size:
                frame.size += size[id(child)]
            elif id(child) in on_stack:
                raise fail("a YAML alias refers to a node that contains it", child.start_mark)
            elif len(stack) >= MAX_DEPTH:
                raise fail(f"nested more than {MAX_DEPTH} levels deep", child.start_mark)
            else:
                on_stack.add(id(child))
                stack.append(_Frame(child, _children(child)))
            if frame.size > MAX_NODES:
                raise fail(
                    f"expands to more than {MAX_NODES:,} values through YAML aliases",
                    child.start_mark,
                )
            continue
        stack.pop()
        on_stack.discard(id(frame.node))
        size[id(frame.node)] = frame.size
        if stack:
            stack[-1].size += frame.size


def _load_yaml(text: str, source: str) -> Value:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_nodes(node, source)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def json_object(pairs: list[tuple[str, Value]]) -> _Mapping:
    """``json.loads``'s ``object_pairs_hook``: a dict that remembers duplicate keys."""
    data = _Mapping()
    for key, value in pairs:
        if key in data:
            data.duplicates.append((key, ""))
        data[key] = value
    return data


def _decode(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(
            f"the file is not UTF-8: byte 0x{raw[exc.start]:02x} at line {line}, column "
            f"{column} (offset {exc.start}); save it as UTF-8",
            source=source,
        ) from None


def read_config_file(path: Path) -> Value:
    """Read and parse a ``.yaml``/``.yml``/``.toml``/``.json`` file. Blocking.

    Raises :class:`ConfigError` naming the file (and line and column where the parser has
    them). The data is not yet checked with :func:`check_tree`.
    """
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(
            f"unsupported config file type {suffix!r}; use .yaml, .yml, .toml or .json",
            source=source,
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", source=source) from exc
    text = _decode(raw, source)
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=json_object)
        return _load_yaml(text, source)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(
            f"cannot parse file: nested too deeply (a config is at most {MAX_DEPTH} levels)",
            source=source,
        ) from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(f"cannot parse file: {message}", source=source) from exc
    except (ValueError, OverflowError) as exc:  # e.g. YAML's `2024-13-01` as a date
        raise ConfigError(f"cannot parse file: {type(exc).__name__}: {exc}", source=source) from exc


_Link: TypeAlias = "tuple[_Link, object, bool] | None"  # (parent link, key or index, is an index)
_LEAVES = (str, int, bool, type(None))


def _path(link: _Link) -> str:
    parts: list[str] = []
    while link is not None:
        link, key, is_index = link
        parts.append(f"[{key}]" if is_index else f".{key}")
    return "$" + "".join(reversed(parts))


def check_tree(data: Value, source: str) -> None:
    """Check parsed config data iteratively: depth, size, duplicate keys, non-finite
    numbers. Pure. Raises :class:`ConfigError` with the value's ``$``-path."""
    # paths are built only for an error: this runs on every load, 20,000 stages included
    stack: list[tuple[Value, int, _Link]] = [(data, 0, None)]
    seen = 0
    while stack:
        value, depth, link = stack.pop()
        if depth >= MAX_DEPTH:
            raise ConfigError(
                f"nested more than {MAX_DEPTH} levels deep", path=_path(link), source=source
            )
        if isinstance(value, Mapping):
            for key, where in getattr(value, "duplicates", ()):
                raise ConfigError(
                    f"duplicate key {key!r}{where}; each key may appear once",
                    path=_path((link, key, False)),
                    source=source,
                )
            items: Iterable[tuple[object, object]] = value.items()
            is_index = False
        else:
            items = enumerate(cast("Iterable[object]", value))  # a list or tuple
            is_index = True
        for key, item in items:
            seen += 1
            kind = type(item)
            if kind in _LEAVES:
                continue
            if kind is float or isinstance(item, float):
                if not math.isfinite(cast(float, item)):
                    raise ConfigError(
                        f"numbers must be finite, got {item!r} (use null for 'no limit' where "
                        f"a key allows it)",
                        path=_path((link, key, is_index)),
                        source=source,
                    )
            elif isinstance(item, (Mapping, list, tuple)):
                stack.append((item, depth + 1, (link, key, is_index)))
        if seen > MAX_NODES:
            raise ConfigError(
                f"has more than {MAX_NODES:,} values", path=_path(link), source=source
            )


# `.name`, `[index]` or a dict's `[...]` in a msgspec path
_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


class _Indexable(Protocol):
    # a mapping or a sequence; anything else raises TypeError when indexed
    def __getitem__(self, key: str | int, /) -> Value: ...


def _value_at(data: Value, path: str) -> Value:
    """The value at a msgspec path suffix like ``.a[2].b`` inside ``data`` (or Ellipsis)."""
    for name, index in _PATH_STEP.findall(path):
        if index == "...":  # msgspec does not say which key of a dict
            return ...
        try:
            data = cast(_Indexable, data)[name if name else int(index)]
        except (KeyError, IndexError, TypeError):
            return ...
    return data


def _types_at(info: msgspec.inspect.Type, name: str, index: str) -> list[msgspec.inspect.Type]:
    """The types one path step (``.name`` or ``[index]``) leads to from ``info``."""
    if isinstance(info, msgspec.inspect.Metadata):
        return _types_at(info.type, name, index)
    if isinstance(info, msgspec.inspect.UnionType):
        return [t for member in info.types for t in _types_at(member, name, index)]
    if isinstance(info, (msgspec.inspect.DictType, msgspec.inspect.FrozenDictType)):
        return [info.value_type]
    if name:
        fields = getattr(info, "fields", ())  # structs, dataclasses, typed dicts
        return [f.type for f in fields if f.encode_name == name]
    if isinstance(info, msgspec.inspect.TupleType) and index.isdigit():
        return list(info.item_types[int(index) : int(index) + 1])
    item = getattr(info, "item_type", None)  # lists, sets, variadic tuples
    return [] if item is None else [item]


def _allowed_values(schema: type, path: str) -> list[Value]:
    """The values of the Literal or Enum types that ``schema`` has at msgspec path ``path``
    (``.stages[0].lb_policy``), in msgspec's (sorted) order; empty when it has none there."""
    types = [msgspec.inspect.type_info(schema)]
    for name, index in _PATH_STEP.findall(path):
        types = [t for info in types for t in _types_at(info, name, index)]
    values: list[Value] = []
    while types:
        info = types.pop(0)
        if isinstance(info, msgspec.inspect.Metadata):
            types.insert(0, info.type)
        elif isinstance(info, msgspec.inspect.UnionType):
            types[:0] = info.types
        elif isinstance(info, msgspec.inspect.LiteralType):
            values.extend(info.values)
        elif isinstance(info, msgspec.inspect.EnumType):
            values.extend(member.value for member in info.cls)
    return values


def explain_validation_error(
    exc: msgspec.ValidationError, data: Value, schema: type | None = None
) -> tuple[str, str]:
    """msgspec's message split into (reason, ``$``-path), the reason ending with the value
    found there (``Expected `int` >= 1, got 0``). With ``schema`` (the type ``data`` was
    converted to), a bad enum or Literal value is explained with the values allowed there
    (``Expected one of 'a', 'b', got str 'c'``). Pure."""
    message = str(exc)
    m = re.search(r" - at `(\$[^`]*)`$", message)
    reason, path = (message[: m.start()], m.group(1)) if m else (message, "$")
    unknown = re.fullmatch(r"Object contains unknown field `([^`]*)`", reason)
    if unknown:
        return reason, f"{path}.{unknown.group(1)}"
    value = _value_at(data, path[1:])
    if schema is not None and reason.startswith("Invalid enum value "):
        allowed = ", ".join(repr(v) for v in _allowed_values(schema, path[1:]))
        if allowed and value is not ...:  # the value is added below
            reason = f"Expected one of {allowed}"
        elif allowed:  # msgspec's reason names the value the path does not lead to
            reason = f"{reason}; expected one of {allowed}"
    if value is not ... and not isinstance(value, (Mapping, list)):
        reason = with_value(reason, value)
    return reason, path


def with_value(reason: str, value: Value) -> str:
    """msgspec's reason with the offending value: ``Expected `int`, got str 'lots'``. Pure."""
    reason = re.sub(r", got `[^`]*`$", "", reason)
    return f"{reason}, got {type(value).__name__} {value!r}"


# set while msgspec converts data it checks itself (load_config, and check_struct's copy):
# the structs it builds need no second check
_PRECHECKED: ContextVar[bool] = ContextVar("omni_trio_config_prechecked", default=False)


@contextmanager
def prechecked() -> Iterator[None]:
    """Within it, config structs built (by a ``msgspec.convert`` that checks every field
    itself) skip :func:`check_struct`. Synchronous."""
    token = _PRECHECKED.set(True)
    try:
        yield
    finally:
        _PRECHECKED.reset(token)


def check_struct(obj: msgspec.Struct) -> None:
    """Check a config struct built in Python (``PipelineConfig(stages="nope")``) as loading
    checks a file: every field converted with the struct's own types and bounds, plain data
    where a struct is expected (a stage given as a dict) converted to it, and the converted
    values kept. For a struct's ``__post_init__``; pure but for setting ``obj``'s fields.
    Raises :class:`ConfigError` naming the field (``<PipelineConfig>: $.stages: Expected
    `array`, got str 'nope'``)."""
    if _PRECHECKED.get():
        return
    cls = type(obj)
    data = msgspec.structs.asdict(obj)
    try:
        with prechecked():
            converted = msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        reason, where = explain_validation_error(exc, data, cls)
        source = getattr(obj, "source", None) or f"<{cls.__name__}>"
        raise ConfigError(reason, path=where, source=source) from None
    for name in cls.__struct_fields__:
        setattr(obj, name, getattr(converted, name))
