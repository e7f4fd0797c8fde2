"""Turning a nested mapping into the frozen dataclasses, and dotted overrides into a mapping:
every unknown key and wrong type fails naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from mmcse.config.checks import ConfigError, fail


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            fail(where, key, f"must be a mapping, got {type(value).__name__}")
        return build(tp, value, where, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            fail(where, key, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where, key)
            except ConfigError:
                continue
        fail(where, key, f"has the wrong type: {value!r}")
    if origin is dict:
        if not isinstance(value, Mapping):
            fail(where, key, f"must be a mapping, got {type(value).__name__}")
        return {str(k): copy.deepcopy(v) for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list | tuple):
            fail(where, key, f"must be a list, got {type(value).__name__}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            fail(where, key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(where, key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML reads "1e-3" as a string
            except ValueError:
                fail(where, key, f"must be a number, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(where, key, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(where, key, f"must be a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)} for {key}")


def build(cls: type, raw: Mapping[str, Any], where: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        dotted = ", ".join(f"{prefix}.{k}" if prefix else str(k) for k in unknown)
        raise ConfigError(
            f"{where}: unknown key(s) {dotted}; valid keys"
            f"{' under ' + prefix if prefix else ''}: {', '.join(names)}"
        )
    kwargs = {}
    for name in names:
        if name in raw:
            key = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _coerce(raw[name], hints[name], where, key)
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for logging, hashing and overrides)."""
    return copy.deepcopy(dataclasses.asdict(config))


def resolve_path(raw: dict[str, Any], dotted: str, where: str) -> tuple[dict[str, Any], str]:
    parts = dotted.split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        if not isinstance(node, dict) or part not in node or not isinstance(node[part], dict):
            valid = sorted(k for k, v in node.items() if isinstance(v, dict)) if isinstance(node, dict) else []
            prefix = ".".join(parts[:depth])
            raise ConfigError(
                f"{where}: unknown key '{dotted}': no section '{part}'"
                f"{' under ' + prefix if prefix else ''}; valid sections: {', '.join(valid)}"
            )
        node = node[part]
    leaf = parts[-1]
    # Free-form mappings (variants, sweep space) accept new keys; typed sections do not.
    if leaf not in node and not _is_free_form(parts[:-1]):
        prefix = ".".join(parts[:-1])
        raise ConfigError(
            f"{where}: unknown key '{dotted}'; valid keys under {prefix}: {', '.join(sorted(node))}"
        )
    return node, leaf


def _is_free_form(parent: list[str]) -> bool:
    return parent in (["ablate", "variants"], ["sweep", "space"]) or (
        len(parent) >= 3 and parent[:2] in (["ablate", "variants"], ["sweep", "space"])
    )


def apply_overrides(
    raw: dict[str, Any], overrides: Mapping[str, Any], where: str = "overrides"
) -> dict[str, Any]:
    """Return a copy of ``raw`` with ``{"section.key": value}`` overrides applied."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        node, leaf = resolve_path(out, str(dotted), where)
        node[leaf] = copy.deepcopy(value)
    return out


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and key not in ("variants", "space"):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_keyed_yaml(file: Path, valid_keys: tuple[str, ...]) -> dict[str, Any]:
    """A YAML mapping from ``file`` whose top-level keys must be among ``valid_keys`` (preset
    and profile files); invalid YAML or an unknown key is a ConfigError naming the file."""
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{file}: not valid YAML: {err}") from None
    unknown = sorted(set(raw) - set(valid_keys)) if isinstance(raw, Mapping) else ["<not a mapping>"]
    if unknown:
        raise ConfigError(f"{file}: unknown key(s) {unknown}; valid keys: {', '.join(valid_keys)}")
    return dict(raw)
