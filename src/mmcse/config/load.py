"""Reading ``params.yaml`` (with ``ablate.preset`` expanded) into a validated `Config`."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mmcse.config.checks import ConfigError, fail
from mmcse.config.coercion import apply_overrides, build, deep_merge, to_dict
from mmcse.config.runs import AblateConfig
from mmcse.config.schema import Config


def parse_config(raw: Mapping[str, Any] | None, where: str = "params.yaml") -> Config:
    """Build and validate a :class:`Config` from a nested mapping."""
    raw = dict(raw or {})
    config = build(Config, raw, where, "")
    config.validate(where)
    return config


def load_config(
    path: str | Path = "params.yaml", overrides: Mapping[str, Any] | None = None
) -> Config:
    """Read ``params.yaml``, apply dotted overrides, validate; raises :class:`ConfigError`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    if overrides:
        raw = apply_overrides(deep_merge(to_dict(Config()), raw), overrides, where=str(path))
    return parse_config(expand_preset(raw, path.parent, str(path)), where=str(path))


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


def list_presets(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


PRESET_KEYS = ("description", "base", "reference", "variants", "plot_x", "seeds", "transfer", "metric")


def expand_preset(raw: Mapping[str, Any], root: Path, where: str) -> dict[str, Any]:
    """Replace ``ablate.variants/reference/plot_x`` by those of ``ablate.preset`` (a YAML file
    under ``root/<ablate.presets_dir>``); the preset's ``base`` overrides go into every variant.
    A preset that names ``seeds`` replaces ``ablate.seeds``; ``transfer: true`` turns on
    ``ablate.transfer`` (a table with a transfer column, e.g. DALR's TR (Avg.))."""
    raw = copy.deepcopy(dict(raw))
    ablate = raw.get("ablate")
    if not isinstance(ablate, Mapping) or ablate.get("preset", "none") == "none":
        return raw
    name = str(ablate["preset"])
    folder = root / str(ablate.get("presets_dir", AblateConfig.presets_dir))
    file = folder / f"{name}.yaml"
    if not file.is_file():
        fail(where, "ablate.preset", f"no preset file {file}; presets: {', '.join(list_presets(folder)) or 'none'}")
    preset = read_keyed_yaml(file, PRESET_KEYS)
    base = preset.get("base") or {}
    variants = preset.get("variants") or {}
    if not isinstance(base, Mapping) or not isinstance(variants, Mapping) or not variants:
        raise ConfigError(f"{file}: 'base' must be a mapping and 'variants' a non-empty mapping")
    ablate = dict(ablate)
    ablate["variants"] = {str(k): {**base, **(v or {})} for k, v in variants.items()}
    ablate["reference"] = preset.get("reference", next(iter(variants)))
    ablate["plot_x"] = preset.get("plot_x", "")
    ablate["title"] = preset.get("description", name)
    if "seeds" in preset:
        ablate["seeds"] = preset["seeds"]
    if "metric" in preset:
        ablate["metric"] = preset["metric"]
    if "transfer" in preset:
        if not isinstance(preset["transfer"], bool):
            raise ConfigError(f"{file}: 'transfer' must be true or false, got {preset['transfer']!r}")
        ablate["transfer"] = bool(ablate.get("transfer", False)) or preset["transfer"]
    raw["ablate"] = ablate
    return raw


def with_overrides(config: Config, overrides: Mapping[str, Any], where: str = "overrides") -> Config:
    """A new validated config with dotted overrides applied (ablation variants, sweep trials)."""
    return parse_config(apply_overrides(to_dict(config), overrides, where), where=where)
