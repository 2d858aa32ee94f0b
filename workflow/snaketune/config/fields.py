"""A config key declared once: its type (the field's annotation), its default, the values it allows (`setting`) and
what it does (the docstring under the field).

Every section's dataclass declares its fields with `setting(...)`. From that one declaration come
- the check each section makes when it is built (`check`, the first thing its __post_init__ does): the type, then
  the allowed values, each error naming the key and what is allowed;
- the JSON schema of each key and section (`field_schema`, `section_schema`; snaketune.config.generate writes
  workflow/schemas/config.schema.yaml);
- the descriptions (`docstrings`: the string under each field, as the schema's descriptions).
What one key cannot say alone (one key against another, a file that must exist, a hub id's shape) stays in the
section's __post_init__, after `check`. tests/test_config_sources.py proves that what the schema refuses, loading
refuses too, and that config/config.yaml and config/README.md hold every key with its default.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

from snaketune.config.choices import fail

_META = "snaketune.setting"


@dataclass(frozen=True)
class Allowed:
    """What a key allows beyond its type. On a list-typed key, choices, bounds and pattern apply to each item."""

    choices: tuple[str, ...] = ()
    """The strings it takes (or each item takes)."""
    keywords: tuple[str, ...] = ()
    """Strings a list-typed key takes instead of a list (`auto`)."""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    pattern: str | None = None
    """A regular expression (searched, as JSON schema does) a string (or each item) matches."""
    min_items: int | None = None
    """Fewest items of a list."""
    allowed: str | None = None
    """What is allowed, in words, for the message where a value breaks the pattern, the keywords, the bounds or
    min_items."""
    hint: str | None = None
    """Said after a bound's message, in parentheses."""
    schema: dict | Callable[[], dict] | None = None
    """The key's JSON schema where its annotation cannot say it (a mapping of mappings, a YAML form the loader
    converts), or a function that makes it (from other fields' declarations); loading checks such a key in code."""


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, **allowed: Any) -> Any:
    """A dataclass field with what it allows (`Allowed`'s fields as keywords)."""
    meta = {_META: Allowed(**allowed)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def declared(cls: type) -> dict[str, tuple[Any, Allowed]]:
    """Each field of a dataclass: its annotation and what it allows."""
    return {f.name: (hints(cls)[f.name], f.metadata.get(_META) or Allowed()) for f in dataclasses.fields(cls)}


def options(tp: Any) -> tuple[Any, ...]:
    """The alternatives of an annotation: `int | None` -> (int, NoneType)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


@functools.cache
def docstrings(cls: type) -> dict[str, str]:
    """The string under each field of a dataclass, whitespace as one space (Python keeps no attribute docstrings)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    out = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = " ".join(after.value.value.split())
    return out


# ---- the check -------------------------------------------------------------------------------------------------

_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    tuple: "a list",
    dict: "a mapping",
    type(None): "null",
}


def _base(tp: Any) -> Any:
    return typing.get_origin(tp) or tp


def _is(value: Any, tp: Any) -> bool:
    """Whether a value has a type, the container only (a list for a tuple; items are checked after)."""
    base = _base(tp)
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if base is tuple:
        return isinstance(value, list | tuple)
    if base is type(None):
        return value is None
    return isinstance(value, base)


def _name(tp: Any) -> str:
    base = _base(tp)
    if dataclasses.is_dataclass(base):
        return f"a mapping of {base.SECTION} settings"
    return _NAMES.get(base, base.__name__)


def _wrong_type(key: str, value: Any, words: str) -> None:
    fail(key, f"{value!r} ({type(value).__name__}) is not allowed; allowed: {words}")


def _check_type(key: str, value: Any, tp: Any, rule: Allowed) -> Any:
    """The alternative of `tp` the value is, or an error naming the key and what it allows: its choices or its
    words for them where it has some (a --config value arrives as a string: '1' is not a value the key wants either),
    else the types."""
    alternatives = options(tp)
    match = next((t for t in alternatives if _is(value, t)), None)
    if match is None:
        if rule.choices and str in alternatives:
            words = ", ".join(rule.choices)
        else:
            words = rule.allowed or " or ".join(_name(t) for t in alternatives)
        _wrong_type(key, value, words)
    if _base(match) is tuple:
        args = typing.get_args(match)
        variadic = len(args) == 2 and args[1] is Ellipsis  # tuple[str, ...]; tuple[float, float] has two
        if not variadic and len(value) != len(args):
            fail(key, f"{list(value)!r} is not allowed; allowed: {len(args)} items, each {_name(args[0])}")
        for item in value:
            if not _is(item, args[0]):
                _wrong_type(key, item, _name(args[0]))
    if _base(match) is dict and typing.get_args(match):
        value_tp = typing.get_args(match)[1]
        for name, item in value.items():
            if not _is(item, value_tp):
                _wrong_type(f"{key}.{name}", item, _name(value_tp))
    return match


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _bounds(rule: Allowed) -> str:
    """The bounds in words: 'between 1 and 4096', '> 0 and < 1', '>= 1'."""
    low = (
        (">=", rule.minimum)
        if rule.minimum is not None
        else (">", rule.exclusive_minimum)
        if rule.exclusive_minimum is not None
        else None
    )
    high = (
        ("<=", rule.maximum)
        if rule.maximum is not None
        else ("<", rule.exclusive_maximum)
        if rule.exclusive_maximum is not None
        else None
    )
    if low and high and low[0] == ">=" and high[0] == "<=":
        return f"between {_number(low[1])} and {_number(high[1])}"
    return " and ".join(f"{op} {_number(x)}" for op, x in (b for b in (low, high) if b))


def _out_of_bounds(x: float, rule: Allowed) -> bool:
    return (
        (rule.minimum is not None and x < rule.minimum)
        or (rule.maximum is not None and x > rule.maximum)
        or (rule.exclusive_minimum is not None and x <= rule.exclusive_minimum)
        or (rule.exclusive_maximum is not None and x >= rule.exclusive_maximum)
    )


def _not_allowed(key: str, value: Any, rule: Allowed, fallback: str) -> None:
    fail(key, f"{value!r} is not allowed; allowed: {rule.allowed or fallback}")


def _check_value(key: str, value: Any, rule: Allowed) -> None:
    """One value (or one item of a list) against the choices, bounds and pattern."""
    if isinstance(value, str):
        if rule.choices and value not in rule.choices:
            _not_allowed(key, value, rule, ", ".join(rule.choices))
        if rule.pattern is not None and not re.search(rule.pattern, value):
            _not_allowed(key, value, rule, f"a string matching {rule.pattern}")
    elif isinstance(value, int | float) and not isinstance(value, bool) and _out_of_bounds(value, rule):
        if rule.allowed:
            _not_allowed(key, value, rule, "")
        hint = f" ({rule.hint})" if rule.hint else ""
        fail(key, f"{value} must be {_bounds(rule)}{hint}")


def check(obj: Any) -> None:
    """Every field of a section (a dataclass with SECTION, its name in the config) against its annotation and its
    setting: its type, then the values it allows. The first thing each section's __post_init__ does."""
    cls = type(obj)
    for name in declared(cls):
        check_field(cls, name, getattr(obj, name), f"{cls.SECTION}.{name}")


def check_field(cls: type, name: str, value: Any, key: str) -> None:
    """One value as field `name` of `cls` takes it (also for a value given elsewhere under `key`: a benchmark
    task's own limit)."""
    tp, rule = declared(cls)[name]
    match = _check_type(key, value, tp, rule)
    if isinstance(value, str) and rule.keywords:
        if value not in rule.keywords:
            _not_allowed(key, value, rule, " or ".join((*rule.keywords, "a list")))
    elif _base(match) is tuple:
        if rule.min_items is not None and len(value) < rule.min_items:
            _not_allowed(key, list(value), rule, f"a list of at least {rule.min_items}")
        for item in value:
            _check_value(key, item, rule)
    else:
        _check_value(key, value, rule)


# ---- the JSON schema -------------------------------------------------------------------------------------------

_JSON = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", dict: "object"}


def _item_schema(tp: Any, rule: Allowed) -> dict:
    """A list item's or a scalar's schema with the constraints that apply to it."""
    base = _base(tp)
    if base is str and rule.choices:
        return {"enum": list(rule.choices)}
    out: dict = {"type": _JSON[base]} if base in _JSON else {}
    if base is str and rule.pattern is not None:
        out["pattern"] = rule.pattern
    if base in (int, float):
        for name, value in (
            ("minimum", rule.minimum),
            ("maximum", rule.maximum),
            ("exclusiveMinimum", rule.exclusive_minimum),
            ("exclusiveMaximum", rule.exclusive_maximum),
        ):
            if value is not None:
                out[name] = value
    return out


def field_schema(cls: type, name: str) -> dict:
    """One field's JSON schema: from its annotation and setting, or the setting's own `schema`; its docstring as
    the description."""
    tp, rule = declared(cls)[name]
    description = docstrings(cls).get(name)
    if rule.schema is not None:
        out = dict(rule.schema() if callable(rule.schema) else rule.schema)
    else:
        out = _type_schema(tp, rule)
    return {**out, "description": description} if description else out


def _type_schema(tp: Any, rule: Allowed) -> dict:
    alternatives = [t for t in options(tp) if t is not type(None)]
    nullable = len(alternatives) < len(options(tp))
    branches = []
    for t in alternatives:
        base = _base(t)
        if dataclasses.is_dataclass(base):
            branches.append(section_schema(base))
        elif base is tuple:
            items = typing.get_args(t)
            node = {"type": "array", "items": _item_schema(items[0], rule)}
            if items[-1] is not Ellipsis:
                node.update(minItems=len(items), maxItems=len(items))
            elif rule.min_items is not None:
                node["minItems"] = rule.min_items
            branches.append(node)
        elif base is dict and typing.get_args(t):
            branches.append(
                {"type": "object", "additionalProperties": _item_schema(typing.get_args(t)[1], rule)}
            )
        elif base is str and rule.keywords:
            branches.append({"enum": list(rule.keywords)})
        else:
            branches.append(_item_schema(t, rule))
    if nullable:
        branches.append({"type": "null"})
    if len(branches) == 1:
        return branches[0]
    # Plain alternatives as one list of types (`[integer, "null"]`) with their constraints side by side.
    if all(
        set(b) - {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} == {"type"} for b in branches
    ):
        merged: dict = {"type": [b["type"] for b in branches]}
        for b in branches:
            merged.update({k: v for k, v in b.items() if k != "type"})
        return merged
    return {"anyOf": branches}


def section_schema(cls: type, nullable: bool = False) -> dict:
    """A section's JSON schema: its fields, nothing else; `nullable` where the YAML may leave it empty (null)."""
    out: dict = {"type": ["object", "null"] if nullable else "object", "additionalProperties": False}
    doc = cls.__dict__.get("__doc__") or ""
    if doc and not doc.startswith(
        f"{cls.__name__}("
    ):  # dataclasses write the signature where there is no docstring
        out["description"] = " ".join(doc.split())
    out["properties"] = {name: field_schema(cls, name) for name in declared(cls)}
    return out
