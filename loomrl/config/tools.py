"""Typed, frozen, documented config trees: load YAML plus ``key=value`` overrides, validate, dump.

A config is a tree of ``@dataclass(frozen=True)`` classes. Each field is documented by an attribute
docstring (a string literal on the line right after it) and may carry constraints through :func:`spec`::

    @dataclass(frozen=True)
    class AlgoConfig(ValidatedConfig):
        name: Literal["ppo", "grpo"] = "ppo"
        \"\"\"Policy-gradient estimator.\"\"\"
        clip_eps: float = spec(0.2, gt=0, le=1)
        \"\"\"PPO ratio clip range.\"\"\"

        def validate(self) -> None:  # optional cross-field check; paths are relative to self
            if self.name == "grpo" and self.clip_eps > 0.5:
                fail("clip_eps", f"{self.clip_eps} is too large for grpo (must be <= 0.5)")

    cfg = load_config(TrainConfig, "examples/ppo.yaml", ["algo.clip_eps=0.1"])

Conversion is strict: no bool for int, no 0/1 for bool, no str for a number (except a float literal
such as ``1e-4``, which YAML 1.1 reads as a string), unknown keys are errors. Every failure is a
:class:`~loomrl.errors.ConfigError` of one line, ``<dotted.path>: <bad value> <what is valid>``, prefixed
by the file or override the value came from.

Paths given to :func:`fail` and carried by :class:`FieldError` are relative to the object being checked;
:func:`from_dict` prefixes where that object sits in the tree, so a section never needs to know where it
is mounted. Inheriting :class:`ValidatedConfig` also validates at direct construction (and in
``dataclasses.replace``); plain frozen dataclasses are validated by :func:`from_dict` only.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from loomrl.errors import ConfigError

__all__ = [
    "FieldError",
    "ValidatedConfig",
    "deep_merge",
    "describe",
    "dump_yaml",
    "fail",
    "field_docs",
    "from_dict",
    "load_config",
    "nesting_problem",
    "parse_overrides",
    "read_yaml",
    "spec",
    "to_dict",
]

T = TypeVar("T")

_META_KEY = "loomrl.constraints"
_MISSING = dataclasses.MISSING
# YAML 1.1 (PyYAML) reads ``1e-4`` as a string because it lacks a dot; accept such literals for floats.
_FLOAT_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_OVERRIDE_KEY_RE = re.compile(r"[^\s.=]+(\.[^\s.=]+)*")
_MAX_SHOWN = 80
MAX_NESTING = 50
"""Deepest nesting of lists and mappings a YAML file or an override value may have (a config is a few levels)."""


# ----------------------------------------------------------------------------------------------- errors


class FieldError(ConfigError):
    """A :class:`ConfigError` at a dotted path, so callers can add where the value sits or came from."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = _one_line(reason)
        super().__init__(f"{path or 'config'}: {self.reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through ``args`` (the message); Ray ships errors between processes.
        return (type(self), (self.path, self.reason))

    def under(self, prefix: str) -> FieldError:
        """The same error seen from the object that holds this one at ``prefix``."""
        return FieldError(_join(prefix, self.path), self.reason)


class _Mismatch(FieldError):
    """The value at ``path`` itself has the wrong shape (as opposed to something inside it)."""


class _UnknownKey(FieldError):
    """A key that is not a field; the message names the section, so it is rebuilt when prefixed."""

    def __init__(self, section: str, key: Any, valid: Sequence[str]) -> None:
        self.section, self.key, self.valid = section, key, tuple(valid)
        where = f"valid keys of {section}" if section else "valid keys"
        reason = f"unknown key; {where}: {', '.join(valid)}"
        close = difflib.get_close_matches(key, valid, n=1) if isinstance(key, str) else []
        if close:
            reason += f"; did you mean {close[0]!r}?"
        super().__init__(_join(section, key if isinstance(key, str) else repr(key)), reason)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.section, self.key, self.valid))

    def under(self, prefix: str) -> FieldError:
        return _UnknownKey(_join(prefix, self.section), self.key, self.valid)


def fail(path: str, msg: str) -> NoReturn:
    """Raise a one-line config error at ``path`` (relative to the object being validated)."""
    raise FieldError(path, msg)


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _not_one_of(value: Any, choices: Sequence[Any]) -> str:
    text = f"{_show(value)} is not one of {', '.join(map(str, choices))}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
        if close:
            text += f"; did you mean {close[0]!r}?"
    return text


# ------------------------------------------------------------------------------------------ constraints


@dataclasses.dataclass(frozen=True)
class _Constraints:
    """Bounds and choices attached to a field by :func:`spec`; applied per element for lists and dicts."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None

    def bounds_text(self) -> str:
        ops = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        return " and ".join(f"{op} {bound}" for op, bound in ops if bound is not None)

    def summary(self) -> str:
        parts = [self.bounds_text()] if self.bounds_text() else []
        if self.choices is not None:
            parts.append("one of " + ", ".join(map(str, self.choices)))
        return "; ".join(parts)

    def violation(self, value: Any) -> str | None:
        """Why ``value`` breaks the constraints, or None when it satisfies them."""
        if self.choices is not None and value not in self.choices:
            return _not_one_of(value, self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        ok = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        return None if ok else f"{_show(value)} is out of range (must be {self.bounds_text()})"

    def check(self, value: Any, path: str) -> None:
        if value is None:
            return
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.check(item, f"{path}[{i}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                self.check(item, f"{path}.{key}")
        elif (reason := self.violation(value)) is not None:
            fail(path, reason)


def spec(
    default: Any = _MISSING,
    *,
    default_factory: Any = _MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
) -> Any:
    """A ``dataclasses.field`` with a default and constraints checked whenever the config is validated.

    ``ge``/``gt``/``le``/``lt`` bound numbers; ``choices`` lists the allowed values. For list, tuple and
    dict fields the constraints apply to each element. ``None`` values are never checked.
    """
    if (ge is not None and gt is not None) or (le is not None and lt is not None):
        raise TypeError("spec: give at most one lower bound (ge or gt) and one upper bound (le or lt)")
    if choices is not None and (isinstance(choices, str) or len(choices) == 0):
        raise TypeError(f"spec: choices must be a non-empty sequence of values, got {choices!r}")
    constraints = _Constraints(ge, gt, le, lt, None if choices is None else tuple(choices))
    # Catch a default that breaks its own constraints when the class is defined, not at first use.
    if default is not _MISSING and not isinstance(default, (list, tuple, dict, type(None))):
        if (reason := constraints.violation(default)) is not None:
            raise ValueError(f"spec: default {reason}")
    metadata = {_META_KEY: constraints}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


# --------------------------------------------------------------------------------------- introspection


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings written in ``cls``'s own body (not its bases)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}  # no source (REPL, exec) or source that will not dedent: the fields stay undocumented
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if node is None:
        return {}
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Field name → attribute docstring of a dataclass, inherited ones included; undocumented: absent."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"field_docs needs a dataclass type, got {cls!r}")
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # subclasses override their bases' docs
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return {f.name: docs[f.name] for f in dataclasses.fields(cls) if f.name in docs}


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if get_origin(hint) is Literal:
        return " | ".join(repr(a) for a in get_args(hint))
    if _is_union(hint):
        return " | ".join(_type_name(a) for a in get_args(hint))
    if get_origin(hint) is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in get_args(hint))
        return f"{get_origin(hint).__name__}[{inner}]"
    return getattr(hint, "__name__", repr(hint))


def _expected(hint: Any) -> str:
    """What a valid value for ``hint`` looks like, phrased for 'X is not <this>'."""
    origin = get_origin(hint)
    if hint is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(map(str, get_args(hint)))
    if _is_union(hint):
        return " or ".join(_expected(a) for a in get_args(hint))
    if hint in (tuple, list) or origin in (tuple, list) or origin is Sequence:
        return "a list"
    if hint is dict or origin in (dict, Mapping) or dataclasses.is_dataclass(hint):
        return "a mapping"
    simple = {int: "an int", float: "a float", str: "a str", bool: "a bool (true or false)"}
    return simple.get(hint, _type_name(hint))


# ------------------------------------------------------------------------------------------ conversion


def _to_scalar(hint: type, value: Any, path: str) -> Any:
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise _Mismatch(path, f"{_show(value)} is not {_expected(hint)}")


def _convert_sequence(hint: Any, value: Any, path: str) -> Any:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise _Mismatch(path, f"{_show(value)} is not a list")
    origin, args = get_origin(hint) or hint, get_args(hint)
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _Mismatch(path, f"{_show(value)} has {len(value)} items, expected {len(args)}")
        items = [_convert(arg, item, f"{path}[{i}]") for i, (arg, item) in enumerate(zip(args, value))]
    else:
        element = args[0] if args else Any
        items = [_convert(element, item, f"{path}[{i}]") for i, item in enumerate(value)]
    return items if origin is list else tuple(items)


def _convert_mapping(hint: Any, value: Any, path: str) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise _Mismatch(path, f"expected a mapping, got {_show(value)}")
    key_hint, value_hint = get_args(hint) or (Any, Any)
    out: dict[Any, Any] = {}
    for key, item in value.items():
        if key_hint is not Any:
            _convert(key_hint, key, f"{path} key {_show(key)}")
        out[key] = _convert(value_hint, item, f"{path}.{key}")
    return out


def _convert_union(hint: Any, value: Any, path: str) -> Any:
    members = get_args(hint)
    if value is None and type(None) in members:
        return None
    for member in members:
        if member is type(None):
            continue
        try:
            return _convert(member, value, path)
        except _Mismatch as err:
            if err.path != path:  # the container matched and an element is wrong: that error says more
                raise
    raise _Mismatch(path, f"{_show(value)} is not {_expected(hint)}")


def _convert_literal(hint: Any, value: Any, path: str) -> Any:
    for allowed in get_args(hint):
        if type(value) is type(allowed) and value == allowed:  # type check: True must not match 1
            return allowed
    raise _Mismatch(path, _not_one_of(value, get_args(hint)))


def _convert_dataclass(cls: type, value: Any, path: str) -> Any:
    if isinstance(value, cls):
        if not isinstance(value, ValidatedConfig):
            _normalize_at(value, path)
        return value
    return from_dict(cls, value, path)


def _convert(hint: Any, value: Any, path: str) -> Any:
    """``value`` converted to ``hint`` (int→float, list→tuple, mapping→dataclass), or a FieldError."""
    origin = get_origin(hint)
    if hint is Any or hint is object:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch(path, f"{_show(value)} is not null")
    if origin is Literal:
        return _convert_literal(hint, value, path)
    if _is_union(hint):
        return _convert_union(hint, value, path)
    if hint in (tuple, list) or origin in (tuple, list) or origin is Sequence:
        return _convert_sequence(hint, value, path)
    if hint is dict or origin in (dict, Mapping):
        return _convert_mapping(hint, value, path)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _convert_dataclass(hint, value, path)
    if hint in (int, float, str, bool):
        return _to_scalar(hint, value, path)
    raise TypeError(f"{path}: unsupported config annotation {hint!r}")


def _normalize(obj: Any) -> None:
    """Convert, constrain and cross-check ``obj``'s fields in place; error paths are relative to ``obj``."""
    cls: type = type(obj)
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        if not f.init:  # derived attributes are not configuration
            continue
        value = getattr(obj, f.name)
        converted = _convert(hints[f.name], value, f.name)
        if converted is not value:
            # Frozen, so normalise through object.__setattr__; this runs once, during construction.
            object.__setattr__(obj, f.name, converted)
        constraints = f.metadata.get(_META_KEY)
        if constraints is not None:
            constraints.check(converted, f.name)
    hook = getattr(obj, "validate", None)
    if callable(hook):
        hook()


def _normalize_at(obj: Any, path: str) -> None:
    try:
        _normalize(obj)
    except FieldError as err:
        raise err.under(path) from None


class ValidatedConfig:
    """Optional base of a frozen config dataclass: validate and normalise on every construction.

    Without it a class is validated only by :func:`from_dict`; with it ``AlgoConfig(clip_eps=2.0)`` and
    ``dataclasses.replace(cfg, clip_eps=2.0)`` fail too, and ``lr=1`` is stored as ``1.0``. A subclass
    that needs its own ``__post_init__`` must call ``super().__post_init__()``.
    """

    __slots__ = ()

    def __post_init__(self) -> None:
        _normalize(self)


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build and validate ``cls`` from plain data; ``path`` is where it sits, used to prefix error paths. A key
    that ``cls.RENAMED`` (a class attribute, where a record declares one) maps to a field's new name is refused
    with that name."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise _Mismatch(path, f"expected a mapping, got {_show(data)}")
    init_fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    for key in data:
        if key in renamed and key not in init_fields:
            raise FieldError(_join(path, key), f"was renamed to '{renamed[key]}'")
        if key not in init_fields:
            raise _UnknownKey(path, key, list(init_fields))
    for name, f in init_fields.items():
        if name not in data and f.default is _MISSING and f.default_factory is _MISSING:
            expected = _expected(_hints(cls)[name])
            raise FieldError(_join(path, name), f"missing; this field is required ({expected})")
    try:
        obj = cls(**data)
        if not isinstance(obj, ValidatedConfig):
            _normalize(obj)
    except FieldError as err:
        raise err.under(path) from None
    return obj


# -------------------------------------------------------------------------------------- YAML, overrides


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects duplicate keys instead of silently keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *anchor`` keys are meant to be overridden
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # unhashable key: the base class reports it
            if duplicate:
                problem = f"duplicate key {key!r}"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(err: yaml.YAMLError) -> tuple[int | None, str]:
    """(1-based line or None, one-line description) of a YAML error."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        return (mark.line + 1 if mark else None), _one_line(err.problem or err.context or "syntax error")
    return None, _one_line(str(err))


def nesting_problem(value: Any, limit: int = MAX_NESTING) -> str | None:
    """Why ``value`` (lists and mappings, as YAML or JSON loads them) is nested too deeply to be data, or None.

    Iterative, and each shared node (a YAML alias) is measured once, so neither deep nor aliased input costs
    more than its distinct nodes."""

    def kids(node: Any) -> list[Any]:
        items = node.values() if isinstance(node, dict) else node
        return [item for item in items if isinstance(item, (dict, list))]

    if not isinstance(value, (dict, list)):
        return None
    height: dict[int, int] = {}
    on_path = {id(value)}
    stack = [(value, iter(kids(value)))]
    while stack:
        node, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            height[id(node)] = 1 + max((height[id(k)] for k in kids(node)), default=0)
            continue
        if id(child) in height:
            if len(stack) + height[id(child)] > limit:
                return f"nested more than {limit} levels deep"
            continue
        if id(child) in on_path:
            return "holds itself (an alias inside its own anchor)"
        if len(stack) >= limit:
            return f"nested more than {limit} levels deep"
        on_path.add(id(child))
        stack.append((child, iter(kids(child))))
    return None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file (empty file → ``{}``); errors name the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        line, problem = _yaml_problem(err)
        where = f" at line {line}" if line is not None else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise ConfigError(f"{path}: invalid YAML: nested more than {MAX_NESTING} levels deep") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    if (too_deep := nesting_problem(data)) is not None:
        raise ConfigError(f"{path}: invalid YAML: {too_deep}")
    return data


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not _OVERRIDE_KEY_RE.fullmatch(key):
        raise ConfigError(f"override {item!r}: expected key.sub=value")
    text = text.strip()
    if not text:
        return key.split("."), ""  # ``a.b=`` is an empty string; ``a.b=null`` is how to say None
    try:
        value = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: invalid value ({_yaml_problem(err)[1]})") from None
    except RecursionError:
        raise ConfigError(f"override {item!r}: invalid value (nested more than {MAX_NESTING} levels deep)") from None
    if (problem := nesting_problem(value)) is not None:
        raise ConfigError(f"override {item!r}: invalid value ({problem})")
    return key.split("."), value


def _nest(parsed: Sequence[tuple[list[str], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for keys, value in parsed:
        node = out
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}  # a later ``a.b=`` replaces an earlier ``a=``: the last override wins
            node = node[key]
        node[keys[-1]] = value
    return out


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["algo.kl=0.05", "task.name=sort"]`` → ``{"algo": {"kl": 0.05}, "task": {"name": "sort"}}``.

    Values are read as YAML, so numbers, booleans, ``null`` and ``[1, 2]`` get their types and bare words
    stay strings.
    """
    return _nest([_parse_override(item) for item in items])


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: ``base`` with ``override`` merged in, recursively for mappings; inputs are not modified."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _blame(path: str, items: Sequence[str], parsed: Sequence[tuple[list[str], Any]]) -> str | None:
    """The last override that set ``path``, one of its ancestors or something inside it (an unknown key is reported
    at its first unknown part: ``runtime`` for ``runtime.device=cpu`` where there is no runtime), if any did."""
    for item, (keys, _) in reversed(list(zip(items, parsed))):
        key = ".".join(keys)
        if path == key or path.startswith((key + ".", key + "[", key + " ")) or key.startswith(path + "."):
            return item
    return None


def load_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
) -> T:
    """Read ``yaml_path`` (None: all defaults), apply ``key.sub=value`` overrides, build and validate ``cls``.
    ``base`` holds values below the file's (e.g. settings taken from a run's own config).

    An error is prefixed by its source: ``override 'a.b=1': a.b: ...`` or ``file.yaml: a.b: ...``.
    """
    data = deep_merge(base or {}, {} if yaml_path is None else read_yaml(yaml_path))
    items = list(overrides)
    parsed = [_parse_override(item) for item in items]
    try:
        return from_dict(cls, deep_merge(data, _nest(parsed)))
    except FieldError as err:
        source = _blame(err.path, items, parsed)
        if source is not None:
            raise ConfigError(f"override {source!r}: {err}") from None
        if yaml_path is not None:
            raise ConfigError(f"{yaml_path}: {err}") from None
        raise


# ------------------------------------------------------------------------------------- output, --help


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dicts, lists and scalars (YAML-serialisable); :func:`from_dict` undoes it."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {cfg!r}")
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}


def dump_yaml(cfg: Any) -> str:
    """YAML text of ``cfg`` in field order; ``load_config(type(cfg), <that file>) == cfg``."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True, default_flow_style=False)


def _section_class(hint: Any) -> type | None:
    """The dataclass behind ``hint`` (also inside ``X | None``), whose fields ``describe`` also lists."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if _is_union(hint):
        members = [m for m in get_args(hint) if m is not type(None)]
        if len(members) == 1:
            return _section_class(members[0])
    return None


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not _MISSING:
        return repr(f.default)
    if f.default_factory is not _MISSING:
        value = f.default_factory()
        return "" if dataclasses.is_dataclass(value) else repr(value)
    return "(required)"


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Rows ``(dotted path, type, default, doc)`` for every field, sections followed by their fields.

    The type column carries constraints, e.g. ``float (> 0 and <= 1)``; a section's default is empty.
    """
    docs, hints = field_docs(cls), _hints(cls)
    rows: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path, hint = _join(prefix, f.name), hints[f.name]
        type_text = _type_name(hint)
        constraints = f.metadata.get(_META_KEY)
        if constraints is not None and constraints.summary():
            type_text += f" ({constraints.summary()})"
        rows.append((path, type_text, _default_text(f), _one_line(docs.get(f.name, ""))))
        section = _section_class(hint)
        if section is not None:
            rows.extend(describe(section, path))
    return rows
