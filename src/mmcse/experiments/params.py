"""Reading ``params.yaml`` into a validated `Config`: its ``ablate.preset`` (a paper table in
``ablations/``) expanded, each row's recipe under a paper profile (`mmcse.experiments.recipes`) applied,
then the whole checked (`mmcse.config.parse_config`)."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mmcse.config import AblateConfig, Config, ConfigError, apply_overrides, parse_config, to_dict, with_overrides
from mmcse.config.checks import fail
from mmcse.config.coercion import deep_merge, flatten
from mmcse.config.declared import build
from mmcse.config.runs import PRESET_SETS, PresetFile
from mmcse.evaluation.names import check_evaluators
from mmcse.experiments.recipes import expand_recipes, expand_roles, read_yaml_mapping
from mmcse.io import load_yaml


def read_params(path: str | Path = "params.yaml", overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``params.yaml`` as a nested mapping, dotted ``overrides`` applied and ``ablate.preset``
    expanded (`expand_preset`), not yet validated; raises :class:`ConfigError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    if overrides:
        raw = apply_overrides(deep_merge(to_dict(Config()), raw), overrides, where=str(path))
    return expand_preset(raw, path.parent, str(path))


def load_config(
    path: str | Path = "params.yaml", overrides: Mapping[str, Any] | None = None
) -> Config:
    """Read ``params.yaml`` (`read_params`), expand each ablation row's recipe under a paper profile
    (`mmcse.experiments.recipes.expand_recipes`) and validate; raises :class:`ConfigError`."""
    path = Path(path)
    raw = expand_recipes(read_params(path, overrides), path.parent)
    return parse_config(expand_roles(raw, path.parent, str(path)), where=str(path))


def list_presets(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def check_preset_name(params: str | Path, name: str | None, given_as: str = "--preset") -> None:
    """``name`` is a preset of ``params``' presets folder (None: params.yaml's own), said before a command
    imports anything heavy; raises ConfigError listing the presets, naming where the name was given
    (``given_as``: the CLI's option, or a flow's parameter)."""
    if name is None:
        return
    params = Path(params)
    raw = load_yaml(params.read_text()) if params.is_file() else {}
    folder = params.parent / str(((raw or {}).get("ablate") or {}).get("presets_dir", AblateConfig.presets_dir))
    if name not in list_presets(folder):
        raise ConfigError(f"{given_as} {name!r}: no preset file {folder / f'{name}.yaml'}; presets: "
                          f"{', '.join(list_presets(folder)) or 'none'}")


def read_preset(folder: Path, name: str, where: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Preset ``name`` from ``folder``; ``rows_of: <other>`` takes every key of preset ``<other>`` that
    this file does not set itself (a table that repeats another's rows on other data, e.g. DALR
    Table 8 = Table 3 on wiki+coco)."""
    file = folder / f"{name}.yaml"
    if name not in list_presets(folder):  # a name, not a path: nothing outside the presets folder is read
        fail(where, "ablate.preset" if not seen else f"{folder / seen[-1]}.yaml: rows_of",
             f"no preset file {file}; presets: {', '.join(list_presets(folder)) or 'none'}")
    preset = read_yaml_mapping(file)
    build(PresetFile, preset, str(file))  # keys and types as AblateConfig declares them, the file named
    other = preset.pop("rows_of", None)
    if other is None:
        return preset
    if str(other) in (*seen, name):
        raise ConfigError(f"{file}: rows_of {other!r} makes a cycle ({' -> '.join((*seen, name, str(other)))})")
    return {**read_preset(folder, str(other), where, (*seen, name)), **preset}


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
    preset = read_preset(folder, name, where)
    variants = preset.get("variants")
    if not variants:
        raise ConfigError(f"{file}: 'variants' must be a non-empty mapping")
    ablate = {**ablate, **{k: preset[k] for k in PRESET_SETS if k in preset}}
    ablate["variants"] = {str(k): {**(preset.get("base") or {}), **(v or {})} for k, v in variants.items()}
    ablate["reference"] = preset.get("reference", next(iter(variants)))
    ablate["plot_x"] = preset.get("plot_x", "")
    ablate["title"] = preset.get("description", name)
    # rows that are not their paper's, with why: every row of a preset is its paper's unless named here
    ablate["caveats"] = preset.get("caveats") or {}
    ablate["skipped"] = {}  # the rows this profile cannot train (`mmcse.experiments.recipes.expand_roles`)
    ablate["transfer"] = bool(raw["ablate"].get("transfer", False)) or bool(preset.get("transfer"))
    raw["ablate"] = ablate
    return raw


def preset_row_keys(cfg: Config, variant: str, root: Path | str = ".") -> set[str]:
    """The keys a preset's row sets itself (its own overrides and the preset's ``base``: the ablation's variable,
    before any recipe or reading), empty for a row of params.yaml's own ``ablate.variants``."""
    if cfg.ablate.preset == "none":
        return set()
    raw = {"ablate": {"preset": cfg.ablate.preset, "presets_dir": cfg.ablate.presets_dir}}
    rows = expand_preset(raw, Path(root), f"preset {cfg.ablate.preset}")["ablate"]["variants"]
    return set(rows.get(variant) or {})


def check_params(path: str | Path = "params.yaml") -> Config:
    """Everything ``path`` asks for, checked at once and before any stage runs (DVC stage
    ``check_params``; the ablate stage and ``mmcse`` commands call it first): `load_config` (every
    section, each ablation row with its recipe, the preset), then both ends of every numeric
    ``sweep.space`` dimension and each categorical choice, applied as a trial applies them, so a
    range that leaves a key's valid values fails now, not in trial 5. Raises :class:`ConfigError`."""
    cfg = load_config(path)
    check_evaluators(cfg.evaluate.evaluators, str(path))
    for key, spec in cfg.sweep.space.items():
        values = spec["choices"] if spec["type"] == "categorical" else (spec["low"], spec["high"])
        for value in values:
            with_overrides(cfg, {key: value}, where=f"{path} (sweep.space.{key}: {value!r})")
    return cfg


def uncommitted_params(path: str | Path = "params.yaml") -> list[str]:
    """``key=value (committed: old)`` for each value of ``path`` that differs from the last commit's
    (``git show HEAD:<path>``); empty when they agree or there is no commit to compare with. `dvc exp run -S`
    writes its values into the workspace's file and leaves them there when the experiment fails, so the
    next ``-S`` is checked together with every earlier failed one."""
    path = Path(path)
    try:
        shown = subprocess.run(["git", "show", f"HEAD:./{path.name}"], cwd=path.parent.resolve(),
                               capture_output=True, text=True, timeout=30)
        if shown.returncode != 0:
            return []
        committed = flatten(load_yaml(shown.stdout) or {})
        current = flatten(load_yaml(path.read_text()) or {})
    except (OSError, subprocess.SubprocessError, yaml.YAMLError):
        return []
    missing = object()

    def shown(value: Any) -> str:
        text = str(value)
        return text if len(text) <= 60 else text[:57] + "..."

    return [f"{key}={shown(current.get(key, '(removed)'))} (committed: {shown(committed.get(key, '(none)'))})"
            for key in sorted(committed.keys() | current.keys())
            if committed.get(key, missing) != current.get(key, missing)]


def leftover_note(path: str | Path = "params.yaml") -> str | None:
    """The line that goes with a parameter error when ``path`` holds uncommitted values (`uncommitted_params`)."""
    changed = uncommitted_params(path)
    if not changed:
        return None
    return (f"note: {path} differs from the last commit at {', '.join(changed)}; a failed `dvc exp run -S` "
            f"leaves its values there and the next -S is checked with them: `git checkout {path}` drops them")
