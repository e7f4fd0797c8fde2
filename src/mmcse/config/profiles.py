"""Paper profiles: each paper's hyperparameters for wiki+flickr / wiki+coco × BERT / RoBERTa.

A profile file ``profiles/<paper>.yaml`` holds dotted overrides in three groups: ``common``
(the paper's method, teachers, τ, λ, μ, margins, evaluation every 125 steps, 5 seeds),
``data`` (``flickr`` / ``coco``) and ``model`` (``bert`` / ``roberta``: checkpoint, learning
rate, batch size, encoder-specific teachers). The profile ``<paper>-<data>-<model>`` is the
three merged in that order; a file without a ``model`` group (DUET, whose text stream its
``common`` group names) defines ``<paper>-<data>``. Applying one writes the values into
``params.yaml`` itself (its comments and layout kept), so DVC sees ordinary parameter changes,
``dvc params diff`` shows them and every stage reruns exactly where a value changed.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mmcse.config.checks import ConfigError
from mmcse.config.coercion import apply_overrides
from mmcse.config.load import parse_config, read_keyed_yaml

PROFILE_GROUPS = ("description", "common", "data", "model")


def _read(file: Path) -> dict[str, Any]:
    return read_keyed_yaml(file, PROFILE_GROUPS)


def _profiles(folder: Path) -> dict[str, tuple[Path, str, str | None]]:
    """Every profile name the files in ``folder`` define -> (file, data group, model group): a file
    with a ``model`` group names ``<paper>-<data>-<model>``, one without (DUET: one text encoder,
    set in ``common``) ``<paper>-<data>``."""
    names: dict[str, tuple[Path, str, str | None]] = {}
    for file in sorted(Path(folder).glob("*.yaml")):
        raw = _read(file)
        models = list(raw.get("model") or {})
        for d in raw.get("data") or {}:
            if models:
                names |= {f"{file.stem}-{d}-{m}": (file, d, m) for m in models}
            else:
                names[f"{file.stem}-{d}"] = (file, d, None)
    return names


def list_profiles(folder: str | Path) -> list[str]:
    """Every profile name the files in ``folder`` define (`_profiles`)."""
    return list(_profiles(Path(folder)))


def profile_overrides(name: str, folder: str | Path) -> dict[str, Any]:
    """The dotted overrides of profile ``name`` (``common``, then ``data``, then ``model``)."""
    folder = Path(folder)
    available = _profiles(folder)
    if name not in available:
        raise ConfigError(f"unknown profile {name!r}; profiles in {folder}: {', '.join(available) or 'none'}")
    file, data, model = available[name]
    raw = _read(file)
    overrides: dict[str, Any] = {}
    groups = [raw.get("common") or {}, raw["data"][data] or {}]
    if model is not None:
        groups.append(raw["model"][model] or {})
    for group in groups:
        overrides.update(group)
    return overrides


def _yaml_float(representer: Any, value: float) -> Any:
    # PyYAML (which reads params.yaml) takes 3e-05 for a string: keep a dot in the mantissa
    text = repr(value)
    if "e" in text and "." not in text.split("e")[0]:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


def _flow_list(value: list) -> Any:
    """A list of plain values written inline (``[1, 2, 3]``) as params.yaml writes them."""
    from ruamel.yaml.comments import CommentedSeq

    if any(isinstance(v, Mapping | list) for v in value):
        return value
    seq = CommentedSeq(value)
    seq.fa.set_flow_style()
    return seq


def apply_profile(params: str | Path, name: str, folder: str | Path) -> dict[str, tuple[Any, Any]]:
    """Write profile ``name`` into the params file; return ``{key: (old, new)}`` for changed keys.

    The result is validated as a whole before anything is written (a bad profile leaves the
    file untouched), and the file is replaced atomically."""
    from ruamel.yaml import YAML

    params = Path(params)
    overrides = profile_overrides(name, folder)
    plain = yaml.safe_load(params.read_text()) or {}
    updated = apply_overrides(plain, overrides, where=f"profile {name}")
    parse_config(updated, where=f"{params} with profile {name}")  # every key and value checked first

    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 120
    rt.indent(mapping=2, sequence=4, offset=2)
    rt.representer.add_representer(float, _yaml_float)
    doc = rt.load(params.read_text())
    changed: dict[str, tuple[Any, Any]] = {}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = doc
        for part in parents:
            node = node[part]
        old = node.get(leaf)
        if old != value:
            changed[dotted] = (old, value)
            node[leaf] = _flow_list(value) if isinstance(value, list) else value
    buf = io.StringIO()
    rt.dump(doc, buf)
    if yaml.safe_load(buf.getvalue()) != updated:  # the round trip must mean what was validated
        raise RuntimeError(f"{params}: writing profile {name} would not reproduce the validated values")
    fd, tmp = tempfile.mkstemp(prefix=f".{params.name}.", dir=params.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(buf.getvalue())
    os.replace(tmp, params)
    return changed
