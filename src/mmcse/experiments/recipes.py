"""Method recipes and paper profiles: each row of a table trains with its own paper's settings.

A **recipe** (``recipes/<method>.yaml``) is one method as its paper trained it: ``settings`` that hold
for every encoder (its teachers and image encoder, λ/μ/β, margins, temperatures, batch composition,
epochs, evaluation cadence) and ``encoders`` (``bert`` / ``roberta``: learning rate, batch size,
encoder-specific teachers), every value traced to its paper in a comment.

A **profile** (``profiles/<paper>.yaml``) is the *context* of a paper's tables: the data (``data``
group: wiki+flickr, wiki+coco), the encoder (``model`` group: bert, roberta), the seeds, the device,
the table (``ablate.preset``), and ``recipe``: the method params.yaml trains. A profile may change a
recipe value only by saying so, in its ``recipe_overrides`` group. ``profiles/demo.yaml`` is the
offline default: the value of every key a profile or a recipe can set (`owned_keys`).

Applying profile X (`profile_values`) sets every owned key: the demo default ← X's recipe ← X's
context. So the result does not depend on what was applied before, and ``demo`` restores the
offline values. A table row whose method differs from params.yaml's trains with its own recipe in
place of params.yaml's (`expand_recipes`): its configuration is the defaults ← the recipe of its
method ← the profile's context ← the variant's own overrides. Rows of params.yaml's own method, and
every row under ``demo``, keep params.yaml's values (edits included).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mmcse.config import Config, ConfigError, apply_overrides, is_fixed, to_dict

RECIPES_DIR, PROFILES_DIR = "recipes", "profiles"
DEMO = "demo"
PROFILE_KEY = "base.profile"
RECIPE_FIELDS = ("description", "method", "settings", "encoders")
PROFILE_FIELDS = ("description", "recipe", "encoder", "common", "recipe_overrides", "data", "model")


def _mapping(file: Path, raw: dict[str, Any], field: str) -> dict[str, Any]:
    value = raw.get(field) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{file}: '{field}' must be a mapping of dotted keys, got {type(value).__name__}")
    return {str(k): copy.deepcopy(v) for k, v in value.items()}


def _check_keys(file: Path, where: str, overrides: Mapping[str, Any]) -> None:
    """Every key a recipe or profile names is a params.yaml key with a valid value (one line naming
    the file and the key otherwise)."""
    apply_overrides(to_dict(Config()), overrides, where=f"{file} ({where})")


@dataclass(frozen=True)
class Recipe:
    method: str
    settings: dict[str, Any]
    encoders: dict[str, dict[str, Any]]
    file: Path

    def values(self, encoder: str | None) -> dict[str, Any]:
        """The recipe for ``encoder`` (``bert``, ``roberta``; None: the encoder-independent settings)."""
        if encoder is not None and encoder not in self.encoders:
            raise ConfigError(f"{self.file}: no settings for encoder {encoder!r}; encoders: "
                              f"{', '.join(self.encoders) or 'none'}")
        return {**self.settings, **(self.encoders.get(encoder, {}) if encoder else {})}

    def keys(self) -> set[str]:
        return set(self.settings).union(*self.encoders.values()) if self.encoders else set(self.settings)


def load_recipes(root: Path) -> dict[str, Recipe]:
    """Every recipe under ``root/recipes``, checked: known keys, valid values, none of the keys a
    job cannot vary (`mmcse.config.keys.is_fixed`), and ``train.method`` equal to its ``method``."""
    recipes: dict[str, Recipe] = {}
    for file in sorted((root / RECIPES_DIR).glob("*.yaml")):
        raw = read_keyed_yaml(file, RECIPE_FIELDS)
        method = str(raw.get("method", file.stem))
        settings = _mapping(file, raw, "settings")
        encoders = {str(name): _mapping(file, raw.get("encoders") or {}, name) for name in raw.get("encoders") or {}}
        if settings.get("train.method") != method:
            raise ConfigError(f"{file}: settings must set train.method: {method} (the recipe's method)")
        for name, values in [("settings", settings), *((f"encoders.{e}", v) for e, v in encoders.items())]:
            _check_keys(file, name, values)
            fixed = sorted(k for k in values if is_fixed(k))
            if fixed:
                raise ConfigError(f"{file}: {name} sets {', '.join(fixed)}, which a table's rows share (the "
                                  "evaluation data, storage, the ablation): put them in a profile")
        recipes[method] = Recipe(method, settings, encoders, file)
    return recipes


@dataclass(frozen=True)
class Profile:
    name: str
    recipe: str | None  # the method params.yaml trains under this profile (None: demo)
    encoder: str | None  # the recipes' encoder group (bert, roberta)
    context: dict[str, Any]  # common ← data ← model groups: what the profile sets
    recipe_overrides: dict[str, Any]  # recipe values this profile's tables change, declared
    file: Path


def _profile_files(root: Path) -> dict[str, tuple[Path, str | None, str | None]]:
    """Every profile name -> (file, data group, model group): ``<paper>-<data>-<model>``, or
    ``<paper>-<data>`` for a file without a ``model`` group, or ``demo``."""
    names: dict[str, tuple[Path, str | None, str | None]] = {}
    for file in sorted((root / PROFILES_DIR).glob("*.yaml")):
        raw = read_keyed_yaml(file, PROFILE_FIELDS)
        data, models = list(raw.get("data") or {}), list(raw.get("model") or {})
        if not data:
            names[file.stem] = (file, None, None)
        for d in data:
            if models:
                names |= {f"{file.stem}-{d}-{m}": (file, d, m) for m in models}
            else:
                names[f"{file.stem}-{d}"] = (file, d, None)
    return names


def list_profiles(root: str | Path) -> list[str]:
    """Every profile name the files under ``root/profiles`` define."""
    return list(_profile_files(Path(root)))


def load_profile(name: str, root: Path, recipes: Mapping[str, Recipe] | None = None) -> Profile:
    """Profile ``name`` (its groups merged: ``common``, then ``data``, then ``model``), checked: known
    keys, a known recipe with settings for its encoder, and no recipe key set outside
    ``recipe_overrides``."""
    available = _profile_files(root)
    if name not in available:
        raise ConfigError(f"unknown profile {name!r}; profiles in {root / PROFILES_DIR}: {', '.join(available)}")
    file, data, model = available[name]
    raw = read_keyed_yaml(file, PROFILE_FIELDS)
    context = _mapping(file, raw, "common")
    if data is not None:
        context.update(_mapping(file, raw["data"], data))
    if model is not None:
        context.update(_mapping(file, raw["model"], model))
    declared = _mapping(file, raw, "recipe_overrides")
    _check_keys(file, "context", context)
    _check_keys(file, "recipe_overrides", declared)
    recipe = raw.get("recipe")
    encoder = model or raw.get("encoder")
    recipes = load_recipes(root) if recipes is None else recipes
    if recipe is not None:
        if recipe not in recipes:
            raise ConfigError(f"{file}: recipe {recipe!r} has no file {root / RECIPES_DIR / f'{recipe}.yaml'}; "
                              f"recipes: {', '.join(recipes)}")
        recipes[recipe].values(encoder)  # the encoder has settings
        owned = recipes[recipe].keys()
        undeclared = sorted(k for k in context if k in owned)
        if undeclared:
            raise ConfigError(f"{file}: profile {name} sets {', '.join(undeclared)}, which recipe {recipe} owns "
                              f"({recipes[recipe].file}): move it to the recipe, or list it under recipe_overrides")
    return Profile(name, recipe, encoder, context, declared, file)


def owned_keys(root: Path, recipes: Mapping[str, Recipe] | None = None) -> list[str]:
    """Every key a profile or a recipe can set: applying a profile sets all of them."""
    recipes = load_recipes(root) if recipes is None else recipes
    keys = {PROFILE_KEY}.union(*(r.keys() for r in recipes.values()))
    for file in sorted((root / PROFILES_DIR).glob("*.yaml")):
        raw = read_keyed_yaml(file, PROFILE_FIELDS)
        keys |= set(_mapping(file, raw, "common")) | set(_mapping(file, raw, "recipe_overrides"))
        for group in ("data", "model"):
            for values in (raw.get(group) or {}).values():
                keys |= set(values or {})
    return sorted(keys)


def defaults(root: Path, recipes: Mapping[str, Recipe] | None = None) -> dict[str, Any]:
    """The offline default of every owned key: the ``demo`` profile, which must name each of them."""
    demo = load_profile(DEMO, root, recipes)
    missing = sorted(set(owned_keys(root, recipes)) - set(demo.context) - {PROFILE_KEY})
    if missing:
        raise ConfigError(f"{demo.file}: the demo profile must give the offline value of every key a profile or "
                          f"recipe sets; missing: {', '.join(missing)}")
    return {**demo.context, PROFILE_KEY: DEMO}


def profile_values(name: str, root: str | Path) -> dict[str, Any]:
    """What applying profile ``name`` writes into params.yaml: every owned key, its demo default ←
    the profile's recipe ← its context (recipe overrides included) ← ``base.profile: <name>``."""
    root = Path(root)
    recipes = load_recipes(root)
    profile = load_profile(name, root, recipes)
    values = defaults(root, recipes)
    if profile.recipe is not None:
        values.update(recipes[profile.recipe].values(profile.encoder))
    values.update(profile.context)
    values.update(profile.recipe_overrides)
    values[PROFILE_KEY] = name
    return values


def _get(raw: Mapping[str, Any], dotted: str) -> Any:
    """A dotted key of params.yaml ``raw``; one it leaves out has its default (`Config`)."""
    for tree in (raw, to_dict(Config())):
        node: Any = tree
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            return node
    raise KeyError(dotted)


def row_recipe(raw: Mapping[str, Any], variant: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """How a variant's row differs from params.yaml ``raw`` before its own overrides: ``{"recipe":
    method or None, "encoder", "swap": {key: value}}``. Under ``demo``, or for a row of params.yaml's
    own method, nothing is swapped; otherwise the keys of params.yaml's recipe go back to their
    defaults and the row's recipe is applied, then the profile's declared recipe overrides."""
    name = str(_get(raw, PROFILE_KEY))
    method = str(variant.get("train.method", _get(raw, "train.method")))
    if name == DEMO:
        return {"recipe": None, "encoder": None, "swap": {}}
    recipes = load_recipes(root)
    profile = load_profile(name, root, recipes)
    if method == _get(raw, "train.method"):
        return {"recipe": method if method in recipes else None, "encoder": profile.encoder, "swap": {}}
    if method not in recipes:
        raise ConfigError(f"profile {name}: a row trains {method}, which has no recipe in {root / RECIPES_DIR} "
                          f"(recipes: {', '.join(recipes)})")
    base = defaults(root, recipes)
    old = recipes[profile.recipe].keys() if profile.recipe in recipes else set()
    target = {k: base[k] for k in old} | recipes[method].values(profile.encoder)
    # the profile's context wins over any recipe (a key another method's recipe owns included)
    target |= {k: v for k, v in profile.context.items() if k in target} | profile.recipe_overrides
    swap = {k: v for k, v in target.items() if _get(raw, k) != v}
    return {"recipe": method, "encoder": profile.encoder, "swap": swap}


def recipe_conflicts(raw: Mapping[str, Any], variant: Mapping[str, Any], root: Path) -> dict[str, list[Any]]:
    """The recipe values a variant overrides: ``{key: [recipe value, the row's value]}``."""
    info = row_recipe(raw, variant, root)
    if info["recipe"] is None:
        return {}
    recipe = load_recipes(root)[info["recipe"]].values(info["encoder"])
    return {k: [recipe[k], v] for k, v in variant.items() if k in recipe and recipe[k] != v}


def expand_recipes(raw: dict[str, Any], root: Path) -> dict[str, Any]:
    """``raw`` (params.yaml, preset expanded) with each ablation variant's overrides preceded by its
    row's recipe swap (`row_recipe`): the row trains as its own paper did."""
    name = _get(raw, PROFILE_KEY)
    if name == DEMO:
        return raw
    load_profile(str(name), root)  # an unknown profile is named even without an ablation
    raw = copy.deepcopy(raw)
    variants = (raw.get("ablate") or {}).get("variants") or {}
    for name, overrides in list(variants.items()):
        overrides = dict(overrides or {})
        variants[name] = {**row_recipe(raw, overrides, root)["swap"], **overrides}
    return raw


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
