"""Dotted overrides into a mapping (every unknown key fails naming the key and the valid ones) and a
config back into a plain mapping.
Turning a mapping into the frozen dataclasses is `mmcse.config.declared.build`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from mmcse.config.checks import ConfigError


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for logging, hashing and overrides): a copy that shares nothing with
    ``config`` (``dataclasses.asdict`` builds new containers and deep-copies every other value)."""
    return dataclasses.asdict(config)


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
    return set_overrides(copy.deepcopy(raw), overrides, where)


def set_overrides(tree: dict[str, Any], overrides: Mapping[str, Any], where: str = "overrides") -> dict[str, Any]:
    """``tree`` itself with the overrides applied (a tree nothing else holds: a fresh `to_dict`), returned."""
    for dotted, value in overrides.items():
        node, leaf = resolve_path(tree, str(dotted), where)
        node[leaf] = copy.deepcopy(value)
    return tree


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and key not in ("variants", "space"):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A configuration tree as dotted keys (``train.method``); ablation variants and a sweep space stay whole."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value and key not in ("variants", "space"):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out
