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

A preset names a paper's **teachers by their role** (``teachers.text: [{role: simcse, weight: 0.33}]``,
``teachers.image_role: resnet``); each profile's ``teacher_roles`` says what a role is on this machine
(`expand_roles`): the demo's offline stand-ins, a paper profile's released checkpoints for its encoder.
One preset serves both; a role a profile does not name is refused, naming the profile and its roles.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmcse.config import Config, ConfigError, is_fixed, to_dict
from mmcse.config.coercion import resolve_path
from mmcse.config.declared import SECTION, Str, build
from mmcse.config.readings import READINGS, ReadingPoint, reading_values
from mmcse.io import load_yaml

RECIPES_DIR, PROFILES_DIR = "recipes", "profiles"
DEMO = "demo"
PROFILE_KEY = "base.profile"
RECIPE = "recipe"  # a variant key naming another recipe of its method (recipes/<name>.yaml), expanded away
ROLE = "role"  # a teachers.text entry naming its teacher by role
IMAGE_ROLE = "teachers.image_role"  # a variant key naming its image teacher by role (expanded before validation)
ROLE_TEXT_FIELDS = ("teacher", "pooler")


Overrides = dict[str, Any]  # dotted params.yaml keys -> values (`_check_keys` holds them to Config)


# A recipe file and a profile file as declared (keys and types, checked by `mmcse.config.declared.build`: one
# line naming the file and the key); what their values mean is checked against Config and each other below.
@dataclass(frozen=True)
class _RecipeFile:
    __pydantic_config__ = SECTION
    description: Str = ""
    method: Str | None = None  # the method it trains (default: the file's stem)
    settings: Overrides = field(default_factory=dict)  # every encoder's
    encoders: dict[str, Overrides] = field(default_factory=dict)  # bert / roberta: what differs per encoder


@dataclass(frozen=True)
class _TeacherRolesFile:
    __pydantic_config__ = SECTION
    text: dict[str, dict[str, Any]] = field(default_factory=dict)  # {teacher, pooler}, or one such per encoder
    image: dict[str, Overrides] = field(default_factory=dict)  # the teachers.* keys a role sets


@dataclass(frozen=True)
class _ProfileFile:
    __pydantic_config__ = SECTION
    description: Str = ""
    recipe: Str | None = None  # the method's recipe (none: demo)
    encoder: Str | None = None  # the recipes' encoder group, for a file without model groups
    common: Overrides = field(default_factory=dict)
    recipe_overrides: Overrides = field(default_factory=dict)  # recipe values this profile's tables change
    data: dict[str, Overrides] = field(default_factory=dict)  # one profile per data group (× model group)
    model: dict[str, Overrides] = field(default_factory=dict)
    teacher_roles: _TeacherRolesFile = field(default_factory=_TeacherRolesFile)


def _read(file: Path, declared: type) -> Any:
    return build(declared, read_yaml_mapping(file), str(file))


@functools.cache
def _default_tree() -> dict[str, Any]:
    """The defaults (`Config`) as a plain tree, built once (a plan reads it hundreds of times): never changed."""
    return to_dict(Config())


def _check_keys(file: Path, where: str, overrides: Mapping[str, Any]) -> None:
    """Every key a recipe or profile names is a params.yaml key (one line naming the file, the key and
    the valid ones otherwise)."""
    for dotted in overrides:
        resolve_path(_default_tree(), str(dotted), where=f"{file} ({where})")


@dataclass(frozen=True)
class _ScriptSetting:
    __pydantic_config__ = SECTION
    key: Str  # the params.yaml key the script's setting is
    value: Any
    source: Str  # the script's line (or its train_mix.py default) that sets it
    pairs: Str | None = None  # only for this data set's script (None: every script of the method)


@dataclass(frozen=True)
class _NotASetting:
    __pydantic_config__ = SECTION
    setting: Str
    why: Str


@dataclass(frozen=True)
class _ScriptsFile:
    __pydantic_config__ = SECTION
    method: Str
    repository: Str
    commit: Str
    encoder: Str  # the encoder the scripts train (their MODEL)
    scripts: dict[str, str]  # data.pairs -> the script's path in the repository
    checked_by: dict[str, list[str]]  # data.pairs -> [profile, preset, row]: the plan row held to the script
    settings: list[_ScriptSetting]
    not_settings: list[_NotASetting] = field(default_factory=list)


SCRIPTS_DIR = "scripts"  # under RECIPES_DIR: recipes/scripts/<method>.yaml, a method's released run scripts


@dataclass(frozen=True)
class RunScripts:
    """A method's released run scripts as settings (recipes/scripts/<method>.yaml): the values `--reading code` trains
    a row of the method with under a paper profile of the scripts' encoder, each with the script line it comes from,
    and the script's arguments that are no setting of mmcse's, each with why."""

    method: str
    repository: str
    commit: str
    encoder: str
    scripts: dict[str, str]
    checked_by: dict[str, tuple[str, str, str]]
    settings: tuple[_ScriptSetting, ...]
    not_settings: tuple[_NotASetting, ...]
    file: Path

    def values(self, pairs: str) -> dict[str, Any]:
        """The settings of the script of data set ``pairs`` (empty where the method has no such script)."""
        if pairs not in self.scripts:
            return {}
        return {s.key: s.value for s in self.settings if s.pairs in (None, pairs)}

    def sources(self, pairs: str) -> dict[str, str]:
        return {s.key: s.source for s in self.settings if s.pairs in (None, pairs)}


def load_scripts(root: Path) -> dict[str, RunScripts]:
    """Every method's released run scripts under ``root/recipes/scripts``, by method, checked: known keys, valid
    values."""
    out: dict[str, RunScripts] = {}
    for file in sorted((root / RECIPES_DIR / SCRIPTS_DIR).glob("*.yaml")):
        raw = _read(file, _ScriptsFile)
        for pairs in raw.scripts:
            values = {s.key: s.value for s in raw.settings if s.pairs in (None, pairs)}
            _check_keys(file, f"settings of {pairs}", values)
        if set(raw.checked_by) != set(raw.scripts) or any(len(v) != 3 for v in raw.checked_by.values()):
            raise ConfigError(f"{file}: checked_by must name [profile, preset, row] for each script's data set "
                              f"({', '.join(raw.scripts)})")
        out[raw.method] = RunScripts(raw.method, raw.repository, raw.commit, raw.encoder, dict(raw.scripts),
                                     {k: (v[0], v[1], v[2]) for k, v in raw.checked_by.items()},
                                     tuple(raw.settings), tuple(raw.not_settings), file)
    return out


def script_values(scripts: Mapping[str, RunScripts], method: str, pairs: str, encoder: str | None) -> dict[str, Any]:
    """What ``method``'s released script for data set ``pairs`` sets, where it trains ``encoder`` (the scripts are
    BERT's: a RoBERTa row keeps its recipe); empty where there is no such script."""
    run = scripts.get(method)
    return run.values(pairs) if run is not None and encoder == run.encoder else {}


def script_points(root: Path, profile_name: str, method: str, pairs: str) -> tuple[ReadingPoint, ...]:
    """The settings where ``method``'s released script for ``pairs`` differs from what mmcse trains the row with as
    printed (its recipe for the profile's encoder, else the profile), as reading points of the row (their non-code
    side ``recipe`` or ``profile``): `mmcse plan` and a job's tags name them beside the catalogue's
    (`mmcse.config.readings.row_reading`). Empty under demo, for an encoder the scripts do not train, or a method
    without scripts."""
    if profile_name == DEMO:
        return ()
    recipes = load_recipes(root)
    profile = load_profile(profile_name, root, recipes)
    run = load_scripts(root).get(method)
    if run is None or profile.encoder != run.encoder or pairs not in run.scripts:
        return ()
    recipe = recipes[method].values(profile.encoder) if method in recipes else {}
    sources = run.sources(pairs)
    points = []
    for key, value in run.values(pairs).items():
        if key in recipe:
            ours, side, where = recipe[key], "recipe", f"recipes/{method}.yaml"
        elif key in profile.context:
            ours, side, where = profile.context[key], "profile", f"profiles/{profile.file.name}"
        else:
            continue
        if ours != value:
            points.append(ReadingPoint(method, key, f"{method}'s run script", ours, value, where,
                                       f"{run.repository} @ {run.commit} {run.scripts[pairs]}: {sources[key]}",
                                       side=side))
    return tuple(points)


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
    """Every recipe under ``root/recipes`` by its name (the file's stem; a method's own recipe is named
    after the method, another recipe of it, e.g. ``simcse-wiki``, is chosen by a row's ``recipe`` key),
    checked: known keys, valid values, none of the keys a job cannot vary (`mmcse.config.keys.is_fixed`),
    and ``train.method`` equal to its ``method``."""
    recipes: dict[str, Recipe] = {}
    for file in sorted((root / RECIPES_DIR).glob("*.yaml")):
        raw = _read(file, _RecipeFile)
        method, settings, encoders = raw.method or file.stem, raw.settings, raw.encoders
        if settings.get("train.method") != method:
            raise ConfigError(f"{file}: settings must set train.method: {method} (the recipe's method)")
        for name, values in [("settings", settings), *((f"encoders.{e}", v) for e, v in encoders.items())]:
            _check_keys(file, name, values)
            fixed = sorted(k for k in values if is_fixed(k))
            if fixed:
                raise ConfigError(f"{file}: {name} sets {', '.join(fixed)}, which a table's rows share (the "
                                  "evaluation data, storage, the ablation): put them in a profile")
        recipes[file.stem] = Recipe(method, settings, encoders, file)
    return recipes


@dataclass(frozen=True)
class Profile:
    name: str
    recipe: str | None  # the method params.yaml trains under this profile (None: demo)
    encoder: str | None  # the recipes' encoder group (bert, roberta)
    context: dict[str, Any]  # common ← data ← model groups: what the profile sets
    recipe_overrides: dict[str, Any]  # recipe values this profile's tables change, declared
    file: Path
    teacher_roles: _TeacherRolesFile  # the paper's teachers by role, as written (`teacher_roles` checks them)


def _profile_files(root: Path) -> dict[str, tuple[Path, str | None, str | None]]:
    """Every profile name -> (file, data group, model group): ``<paper>-<data>-<model>``, or
    ``<paper>-<data>`` for a file without a ``model`` group, or ``demo``."""
    names: dict[str, tuple[Path, str | None, str | None]] = {}
    for file in sorted((root / PROFILES_DIR).glob("*.yaml")):
        raw = _read(file, _ProfileFile)
        data, models = list(raw.data), list(raw.model)
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
    raw = _read(file, _ProfileFile)
    context = {**raw.common, **(raw.data[data] if data is not None else {}), **(raw.model[model] if model else {})}
    declared = raw.recipe_overrides
    _check_keys(file, "context", context)
    _check_keys(file, "recipe_overrides", declared)
    recipe, encoder = raw.recipe, model or raw.encoder
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
    return Profile(name, recipe, encoder, context, declared, file, raw.teacher_roles)


def owned_keys(root: Path, recipes: Mapping[str, Recipe] | None = None) -> list[str]:
    """Every key a profile or a recipe can set: applying a profile sets all of them."""
    recipes = load_recipes(root) if recipes is None else recipes
    keys = {PROFILE_KEY}.union(*(r.keys() for r in recipes.values()))
    for file in sorted((root / PROFILES_DIR).glob("*.yaml")):
        raw = _read(file, _ProfileFile)
        keys |= set(raw.common) | set(raw.recipe_overrides)
        for values in (*raw.data.values(), *raw.model.values()):
            keys |= set(values)
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
    for tree in (raw, _default_tree()):
        node: Any = tree
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            return node if tree is raw else copy.deepcopy(node)
    raise KeyError(dotted)


def row_recipe(raw: Mapping[str, Any], variant: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """How a variant's row differs from params.yaml ``raw`` before its own overrides: ``{"recipe":
    its recipe's name or None, "encoder", "swap": {key: value}}``. A row's recipe is its method's own
    (``recipes/<method>.yaml``) unless its ``recipe`` key names another of that method. Under ``demo``,
    or for a row of params.yaml's own method and recipe, nothing is swapped; otherwise the keys of
    params.yaml's recipe go back to their defaults and the row's recipe is applied, then the profile's
    declared recipe overrides."""
    name = str(_get(raw, PROFILE_KEY))
    method = str(variant.get("train.method", _get(raw, "train.method")))
    if name == DEMO:
        return {"recipe": None, "encoder": None, "swap": {}}
    recipes = load_recipes(root)
    profile = load_profile(name, root, recipes)
    chosen = str(variant.get(RECIPE, method))
    if chosen in recipes and recipes[chosen].method != method:
        raise ConfigError(f"profile {name}: a row names recipe {chosen}, which trains {recipes[chosen].method}, "
                          f"but the row trains {method}")
    if method == _get(raw, "train.method") and RECIPE not in variant:
        return {"recipe": method if method in recipes else None, "encoder": profile.encoder, "swap": {}}
    if chosen not in recipes:
        raise ConfigError(f"profile {name}: a row trains {method} with recipe {chosen}, which has no file in "
                          f"{root / RECIPES_DIR} (recipes: {', '.join(recipes)})")
    base = defaults(root, recipes)
    old = recipes[profile.recipe].keys() if profile.recipe in recipes else set()
    target = {k: base[k] for k in old} | recipes[chosen].values(profile.encoder)
    # the profile's context wins over any recipe (a key another method's recipe owns included)
    target |= {k: v for k, v in profile.context.items() if k in target} | profile.recipe_overrides
    swap = {k: v for k, v in target.items() if _get(raw, k) != v}
    return {"recipe": chosen, "encoder": profile.encoder, "swap": swap}


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
    raw = copy.deepcopy(raw)
    variants = (raw.get("ablate") or {}).get("variants") or {}
    if name != DEMO:
        load_profile(str(name), root)  # an unknown profile is named even without an ablation
    reading = table_reading(raw, root)
    # under the code reading each row also takes its method's released script (BERT, the profile's data set)
    code = str(_get(raw, "ablate.reading")) == "code" and name != DEMO
    scripts = load_scripts(root) if code else {}
    encoder = load_profile(str(name), root).encoder if code else None
    for variant, overrides in list(variants.items()):
        overrides = dict(overrides or {})
        if RECIPE in overrides and not (root / RECIPES_DIR / f"{overrides[RECIPE]}.yaml").is_file():
            known = sorted(p.stem for p in (root / RECIPES_DIR).glob("*.yaml"))
            raise ConfigError(f"ablate.variants.{variant}: recipe {overrides[RECIPE]!r} has no file in "
                              f"{root / RECIPES_DIR} (recipes: {', '.join(known)})")
        swap = row_recipe(raw, overrides, root)["swap"]
        overrides.pop(RECIPE, None)  # under demo a row keeps params.yaml's values, whatever recipe it names
        method = overrides.get("train.method", swap.get("train.method", _get(raw, "train.method")))
        pairs = overrides.get("data.pairs", swap.get("data.pairs", _get(raw, "data.pairs")))
        script = script_values(scripts, str(method), str(pairs), encoder)
        variants[variant] = {**swap, **reading, **script, **overrides}
    return raw


def table_reading(raw: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """The reading points' values every row of ``raw``'s table takes (``ablate.reading``,
    `mmcse.config.readings`): ``printed`` / ``code`` set every point; ``recipe`` sets each point as the recipe
    of its paper does under a paper profile (so a DALR term weighs the same on every row that has it), and
    nothing under ``demo`` (every row keeps params.yaml's values). A row's own overrides still win."""
    reading, name = str(_get(raw, "ablate.reading")), str(_get(raw, PROFILE_KEY))
    if reading not in READINGS:
        raise ConfigError(f"ablate.reading: unknown reading {reading!r}; readings: {', '.join(READINGS)}")
    if reading == "recipe" and name == DEMO:
        return {}
    recipes = load_recipes(root)
    encoder = load_profile(name, root, recipes).encoder if name != DEMO else None
    settings = {n: r.values(encoder if encoder in r.encoders else None) for n, r in recipes.items()}
    return reading_values(reading, encoder, settings)


@dataclass(frozen=True)
class TeacherRoles:
    """What a profile's paper teachers are on this machine: text roles -> ``{teacher, pooler}`` (for the
    profile's encoder), image roles -> the ``teachers.*`` keys they set."""

    text: dict[str, dict[str, Any]]
    image: dict[str, dict[str, Any]]
    file: Path
    profile: str


def teacher_roles(name: str, root: Path) -> TeacherRoles:
    """Profile ``name``'s ``teacher_roles``, checked: a text role is ``{teacher, pooler}`` or one such per
    encoder (``bert: {...}, roberta: {...}``), an image role a mapping of ``teachers.*`` keys."""
    profile = load_profile(name, root)
    file, encoder, raw = profile.file, profile.encoder, profile.teacher_roles
    text: dict[str, dict[str, Any]] = {}
    for role, value in raw.text.items():
        if "teacher" not in value and encoder in value:
            value = value[encoder]
        if not isinstance(value, Mapping) or "teacher" not in value or set(value) - set(ROLE_TEXT_FIELDS):
            raise ConfigError(f"{file}: teacher_roles.text.{role} must be {{teacher, pooler}} or one per encoder "
                              f"(for {encoder or 'no encoder'}), got {value!r}")
        text[str(role)] = dict(value)
    image: dict[str, dict[str, Any]] = {}
    for role, value in raw.image.items():
        if not all(k.startswith("teachers.") for k in value):
            raise ConfigError(f"{file}: teacher_roles.image.{role} must map teachers.* keys to values, got {value!r}")
        _check_keys(file, f"teacher_roles.image.{role}", value)
        image[str(role)] = dict(value)
    return TeacherRoles(text, image, file, name)


def _text_entries(entries: Any, roles: TeacherRoles, where: str) -> Any:
    """``teachers.text`` with every ``{role: r, weight: w}`` entry made the profile's teacher for role r."""
    if not isinstance(entries, list):
        return entries
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or ROLE not in entry:
            out.append(entry)
            continue
        role = str(entry[ROLE])
        named = sorted(set(entry) & set(ROLE_TEXT_FIELDS))
        if named:
            raise ConfigError(f"{where}: teachers.text[{i}] names role {role} and {', '.join(named)}: the role "
                              f"gives them ({roles.file}: teacher_roles.text)")
        if role not in roles.text:
            raise ConfigError(f"{where}: teachers.text[{i}]: profile {roles.profile} names no text teacher role "
                              f"{role!r} ({roles.file}: teacher_roles.text has {', '.join(roles.text) or 'none'}); "
                              f"to train this row, add `{role}: {{teacher: <HF id or local folder>, pooler: "
                              f"<pooler>}}` under teacher_roles.text there")
        out.append({**roles.text[role], **{k: v for k, v in entry.items() if k != ROLE}})
    return out


def _image_role(overrides: dict[str, Any], roles: TeacherRoles, where: str) -> dict[str, Any]:
    if IMAGE_ROLE not in overrides:
        return overrides
    overrides = dict(overrides)
    role = str(overrides.pop(IMAGE_ROLE))
    if role not in roles.image:
        raise ConfigError(f"{where}: {IMAGE_ROLE}: profile {roles.profile} names no image teacher role {role!r} "
                          f"({roles.file}: teacher_roles.image has {', '.join(roles.image) or 'none'}); to train "
                          f"this row, add `{role}: {{<teachers.* key>: <value>, ...}}` under teacher_roles.image there")
    return {**roles.image[role], **overrides}


def missing_roles(overrides: Mapping[str, Any], roles: TeacherRoles) -> list[str]:
    """What a variant needs that profile ``roles`` does not name: one line per missing teacher role, saying
    where to name it (empty: the row can train)."""
    out = []
    text = overrides.get("teachers.text")
    for entry in text if isinstance(text, list) else []:
        if isinstance(entry, Mapping) and ROLE in entry and str(entry[ROLE]) not in roles.text:
            role = str(entry[ROLE])
            out.append(f"needs a {role} checkpoint: profile {roles.profile} names no text teacher role {role!r} "
                       f"({roles.file}: teacher_roles.text has {', '.join(roles.text) or 'none'}); to train this "
                       f"row, add `{role}: {{teacher: <HF id or local folder>, pooler: <pooler>}}` there")
    if IMAGE_ROLE in overrides and str(overrides[IMAGE_ROLE]) not in roles.image:
        role = str(overrides[IMAGE_ROLE])
        out.append(f"needs a {role} image teacher: profile {roles.profile} names no image teacher role {role!r} "
                   f"({roles.file}: teacher_roles.image has {', '.join(roles.image) or 'none'}); to train this "
                   f"row, add `{role}: {{<teachers.* key>: <value>, ...}}` there")
    return out


def expand_roles(raw: dict[str, Any], root: Path, where: str = "params.yaml") -> dict[str, Any]:
    """``raw`` (params.yaml, preset and recipes expanded) with every teacher named by its role made the
    current profile's (`teacher_roles`): ``teachers.text`` entries ``{role: …}`` and the variant key
    ``teachers.image_role``, in params.yaml's own teachers and every ablation variant. A variant that names
    a role the profile lacks is taken out of the table into ``ablate.skipped`` (row -> what it needs, e.g. DALR
    Table 9's RankCSE rows: no checkpoint is released), so the rest of the table runs; a table whose every row,
    or whose reference row, needs one is refused, naming it."""
    raw = copy.deepcopy(raw)
    variants = (raw.get("ablate") or {}).get("variants") or {}
    teachers = raw.get("teachers") if isinstance(raw.get("teachers"), Mapping) else {}
    uses_roles = any(isinstance(e, Mapping) and ROLE in e for e in teachers.get("text") or []) or any(
        isinstance(v, Mapping) and (IMAGE_ROLE in v or any(isinstance(e, Mapping) and ROLE in e
                                                           for e in (v.get("teachers.text") or [])))
        for v in variants.values())
    if not uses_roles:
        return raw
    roles = teacher_roles(str(_get(raw, PROFILE_KEY)), root)
    if "text" in teachers:
        teachers["text"] = _text_entries(teachers["text"], roles, where)
    for name, overrides in list(variants.items()):
        here = f"{where} (ablate.variants.{name})"
        missing = missing_roles(dict(overrides or {}), roles)
        if missing:  # a row the profile cannot train: planned as skipped, with what would make it run
            del variants[name]
            raw["ablate"].setdefault("skipped", {})[name] = "; ".join(missing)
            raw["ablate"].get("caveats", {}).pop(name, None)
            continue
        overrides = _image_role(dict(overrides or {}), roles, here)
        if "teachers.text" in overrides:
            overrides["teachers.text"] = _text_entries(overrides["teachers.text"], roles, here)
        variants[name] = overrides
    skipped = raw.get("ablate", {}).get("skipped") or {}
    reference = raw.get("ablate", {}).get("reference")
    if skipped and (not variants or reference in skipped):
        row = reference if reference in skipped else next(iter(skipped))
        raise ConfigError(f"{where} (ablate.variants.{row}): {skipped[row]}" + (
            "" if variants else " (no row of the table can train under this profile)") + (
            " (the table's reference row)" if row == reference and variants else ""))
    return raw


@functools.lru_cache(maxsize=512)
def _parsed_yaml(text: str) -> Any:
    """``text`` parsed (`mmcse.io.load_yaml`), once per distinct text: resolving a table reads the same recipe
    and profile files for every row (hundreds of parses a plan)."""
    return load_yaml(text)


def read_yaml_mapping(file: Path) -> dict[str, Any]:
    """The YAML mapping in ``file`` (a recipe, profile or preset file), a copy its caller may edit; invalid
    YAML or another top level is a ConfigError naming the file."""
    try:
        raw = copy.deepcopy(_parsed_yaml(file.read_text())) or {}  # a copy: callers edit what they get
    except yaml.YAMLError as err:
        raise ConfigError(f"{file}: not valid YAML: {err}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{file}: must be a mapping of keys, got {type(raw).__name__}")
    return dict(raw)
