"""A section of params.yaml declared once: its fields' types and bounds (pydantic ``Field`` in
``Annotated`` hints) and descriptions (the docstring under each field, `json_schema`), validated by pydantic, its
errors turned into the one line a bad params file has always got (``<where>: key 'train.batch_size':
must be >= 2 (in-batch negatives)``, ``unknown key(s) ...; valid keys under ...``), and the JSON Schema
of the whole file.

Scalars are strict as YAML is read: an integer is not ``"5"`` or ``1.0`` or ``true`` (`Int`), a
switch is ``true``/``false`` (`Bool`), a name is a string (`Str`); a number may be an integer or
YAML's string form of ``1e-3`` (PyYAML reads it so), never ``true`` (`build` refuses a bool there).
Cross-field rules stay the sections' ``validate(where)`` methods.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import threading
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from mmcse.errors import ConfigError

# The largest integer a setting takes: a count or size beyond it is no run's (a step counter, a batch a device could
# hold, a seed numpy takes), and a typo like 1e23 written out is refused with the key, not met by an overflow later.
MAX_INT = 2**31 - 1
Int = Annotated[StrictInt, Field(le=MAX_INT)]
Bool = StrictBool
Str = StrictStr
# each section's ``__pydantic_config__``: unknown keys are errors, and so is a non-finite number (.inf, .nan)
SECTION = ConfigDict(extra="forbid", allow_inf_nan=False)
PositiveInt = Annotated[Int, Field(ge=1)]
NonNegativeInt = Annotated[Int, Field(ge=0)]
Name = Annotated[Str, Field(pattern=r"\S")]  # a name, id or path: not empty, not blank
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, lt=1)]  # a probability that cannot be 1 (dropout, warm-up share)
Angle = Annotated[float, Field(ge=0, le=math.pi / 2, description="radians, at most π/2")]  # an angular margin
Switch = Bool | Literal["auto"]  # auto: on when train.method's paper uses the term


def number_or_off(value: Any) -> Any:
    """YAML 1.1 reads ``off`` as false: the same switch (a bare 0 stays the number 0); true means nothing (a
    ``BeforeValidator`` of a ``float | Literal["off"]`` field)."""
    if value is True:
        raise ValueError("a number or off")
    return "off" if value is False else value


_BUILDING = threading.Lock()


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    with _BUILDING:  # one build at a time: pydantic parses default factories' signatures (see `json_schema`)
        return TypeAdapter(cls)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A section's field types, ``Annotated`` kept (read for every key of every build: cached)."""
    return typing.get_type_hints(cls, include_extras=True)


def build(cls: type, raw: Any, where: str, prefix: str = "") -> Any:
    """``raw`` (a mapping from params.yaml) as the frozen dataclass ``cls``: types, bounds and unknown
    keys checked by its declaration; the first problem is a `ConfigError` naming the dotted key
    (``prefix``: the key ``raw`` sits under)."""
    _refuse_bool_numbers(raw, cls, where, prefix)
    try:
        return _adapter(cls).validate_python(raw)
    except ValidationError as err:
        raise ConfigError(_message(err, cls, where, prefix)) from None


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema of ``cls`` (an editor validates and completes params.yaml with it), each field's
    description the docstring under it (`field_docstrings`) unless its ``Field`` gives one.

    The docstrings are read here, for the schema, and not by pydantic as it builds a validator
    (``use_attribute_docstrings``): that parses the module's source, and CPython 3.11's AST constructor
    fails at random when two threads parse at once (gh-106905: "AST constructor recursion depth
    mismatch"), which an ablation's Prefect tasks did while validating their configurations."""
    schema = _adapter(cls).json_schema()
    for section in _sections(cls):
        body = schema if section is cls else schema["$defs"][section.__name__]
        for name, text in field_docstrings(section).items():
            prop = body.get("properties", {}).get(name)
            if prop is not None and "description" not in prop:
                prop["description"] = text
    return schema


def field_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its declaration in ``cls``'s source (cleaned as a
    docstring)."""
    found: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # a base's fields too
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        found |= {stmt.target.id: inspect.cleandoc(after.value.value)
                  for stmt, after in zip(body, body[1:], strict=False)
                  if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                  and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                  and isinstance(after.value.value, str)}
    return found


def _sections(cls: type) -> list[type]:
    """``cls`` and every dataclass its fields hold (in lists, mappings and optionals too), each once."""
    found: list[type] = []

    def visit(tp: Any) -> None:
        tp, _ = _strip(tp)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            if tp not in found:
                found.append(tp)
                for hint in _hints(tp).values():
                    visit(hint)
        for arg in typing.get_args(tp):
            visit(arg)

    visit(cls)
    return found


# --------------------------------------------------------------------------- errors as one line


def _strip(tp: Any) -> tuple[Any, list[Any]]:
    """``Annotated[T, m...]`` → (T, [m...]), flattened."""
    metadata: list[Any] = []
    while typing.get_origin(tp) is Annotated:
        metadata += list(tp.__metadata__)
        tp = tp.__origin__
    return tp, metadata


def _walk(cls: type, loc: tuple[Any, ...]) -> tuple[list[str], Any, list[Any]]:
    """The dotted-key parts ``loc`` names below ``cls``, and the type and metadata it ends at (a union
    member's tag in ``loc`` ends the walk)."""
    parts: list[str] = []
    tp, metadata = cls, []
    for part in loc:
        tp, metadata = _strip(_optional_of(tp))
        if dataclasses.is_dataclass(tp) and part in {f.name for f in dataclasses.fields(tp)}:
            tp, metadata = _strip(_hints(tp)[part])
            parts.append(str(part))
        elif typing.get_origin(tp) is list and isinstance(part, int):
            parts[-1] += f"[{part}]"
            tp, metadata = _strip(typing.get_args(tp)[0])
        elif typing.get_origin(tp) is dict:
            parts.append(str(part))
            tp, metadata = _strip(typing.get_args(tp)[1])
        else:
            break
    return parts, tp, metadata


def _optional_of(tp: Any) -> Any:
    """``T | None`` → ``T`` (an optional key's value is reported as ``T``'s)."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        members = [m for m in typing.get_args(tp) if m is not type(None)]
        if len(members) == 1:
            return members[0]
    return tp


def _bounds(metadata: list[Any], violated: dict[str, Any]) -> str:
    """``must be >= 1``, ``must be in [0, 1)`` … from a field's declared bounds (``violated``: the
    error's own, e.g. ``{"ge": 1}``, when the field's cannot be read)."""
    found: dict[str, Any] = {}
    for m in metadata:
        for item in (m.metadata if isinstance(m, FieldInfo) else [m]):
            for name in ("ge", "gt", "le", "lt"):
                if isinstance(item, getattr(annotated_types, name.capitalize())):
                    found[name] = getattr(item, name)
    found = found or violated
    if found.get("le") == MAX_INT and len(found) > 1:  # every integer's cap: said only when it is the one broken
        del found["le"]
    lo = ("[", found["ge"]) if "ge" in found else ("(", found["gt"]) if "gt" in found else None
    hi = ("]", found["le"]) if "le" in found else (")", found["lt"]) if "lt" in found else None
    if lo and hi:
        return f"must be in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"must be {'>=' if lo[0] == '[' else '>'} {lo[1]}"
    return f"must be {'<=' if hi[0] == ']' else '<'} {hi[1]}"


def _description(metadata: list[Any]) -> str:
    return next((m.description for m in metadata if isinstance(m, FieldInfo) and m.description), "")


_WANTED = {"finite_number": "a finite number", "int_type": "an integer", "int_from_float": "an integer",
           "int_parsing": "an integer",
           "bool_type": "true or false", "bool_parsing": "true or false", "float_type": "a number",
           "float_parsing": "a number", "string_type": "a string", "list_type": "a list",
           "dict_type": "a mapping", "dataclass_type": "a mapping", "dataclass_exact_type": "a mapping"}


def _message(err: ValidationError, cls: type, where: str, prefix: str) -> str:
    errors = err.errors(include_url=False)
    unknown = [e for e in errors if e["type"] in ("unexpected_keyword_argument", "extra_forbidden")]
    if unknown:  # all unknown keys of the first section that has any, with that section's valid keys
        parent = unknown[0]["loc"][:-1]
        here = [e for e in unknown if e["loc"][:-1] == parent]
        parts, tp, _ = _walk(cls, parent)
        section = ".".join(p for p in (prefix, *parts) if p)
        dotted = ", ".join(f"{section}.{e['loc'][-1]}" if section else str(e["loc"][-1]) for e in here)
        names = [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []
        return (f"{where}: unknown key(s) {dotted}; valid keys{' under ' + section if section else ''}: "
                f"{', '.join(names)}")
    first = errors[0]
    parts, _, metadata = _walk(cls, first["loc"])
    key = ".".join(p for p in (prefix, *parts) if p)
    same = [e for e in errors if _walk(cls, e["loc"])[0] == parts]  # a union's members fail together
    value = first["input"]
    if first["type"] == "less_than_equal" and first["ctx"].get("le") == MAX_INT:
        return (f"{where}: key '{key}': must be at most {MAX_INT:,} (2³¹ − 1: no count or size a run takes is larger), "
                f"got {value!r}")
    if first["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        note = _description(metadata)
        return f"{where}: key '{key}': {_bounds(metadata, first['ctx'])}{f' ({note})' if note else ''}"
    if first["type"] == "string_pattern_mismatch":
        return f"{where}: key '{key}': must not be empty"
    wanted = []
    for e in same:
        if e["type"] == "literal_error":
            choices = typing.get_args(_literal_of(cls, e["loc"]))
            wanted.append(f"one of {list(choices)}")
        elif e["type"] == "value_error":  # a field's own validator says what it takes
            wanted.append(str(e["ctx"]["error"]))
        elif e["type"] in _WANTED:
            wanted.append(_WANTED[e["type"]])
        else:
            wanted.append(e["msg"].lower())
    shown = type(value).__name__ if first["type"].startswith(("dict", "dataclass")) else repr(value)
    return f"{where}: key '{key}': must be {' or '.join(dict.fromkeys(wanted))}, got {shown}"


def _literal_of(cls: type, loc: tuple[Any, ...]) -> Any:
    """The ``Literal[...]`` a literal error's ``loc`` points at (alone or as a union member)."""
    _, tp, _ = _walk(cls, loc)
    if typing.get_origin(tp) is Literal:
        return tp
    members = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else ()
    return next((m for m in members if typing.get_origin(m) is Literal), Literal[()])


def _checked_type(tp: Any) -> Any:
    """``tp`` without ``Annotated``, or None when a ``BeforeValidator`` reads its input itself (read for every
    key of every build: cached, where the type can be a cache key)."""
    try:
        return _checked_type_cached(tp)
    except TypeError:  # unhashable metadata
        return _checked_type_cached.__wrapped__(tp)


@functools.cache
def _checked_type_cached(tp: Any) -> Any:
    tp, metadata = _strip(tp)
    return None if any(isinstance(m, BeforeValidator) for m in metadata) else tp


def _refuse_bool_numbers(raw: Any, tp: Any, where: str, key: str) -> None:
    """pydantic reads ``true`` as 1.0 for a number; params.yaml never meant that (a field with its own
    ``BeforeValidator`` reads its input itself)."""
    if not isinstance(raw, (Mapping, list, bool)):  # only a bool, or a container that may hold one
        return
    tp = _checked_type(tp)
    if tp is None:
        return
    if dataclasses.is_dataclass(tp) and isinstance(raw, Mapping):
        hints = _hints(tp)
        for name, value in raw.items():
            if name in hints and isinstance(value, (Mapping, list, bool)):  # a leaf of another type: nothing to check
                _refuse_bool_numbers(value, hints[name], where, f"{key}.{name}" if key else str(name))
    elif typing.get_origin(tp) is list and isinstance(raw, list):
        for i, value in enumerate(raw):
            if isinstance(value, (Mapping, list, bool)):
                _refuse_bool_numbers(value, typing.get_args(tp)[0], where, f"{key}[{i}]")
    elif isinstance(raw, bool):
        members = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else (tp,)
        members = [_strip(m)[0] for m in members]
        if float in members and bool not in members and not any(
                typing.get_origin(m) is Literal and raw in typing.get_args(m) for m in members):
            raise ConfigError(f"{where}: key '{key}': must be a number, got {raw!r}")
