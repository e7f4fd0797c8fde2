"""Writing a paper profile into ``params.yaml`` (`mmcse profile`).

A profile (`mmcse.experiments.recipes`) sets every key a profile or recipe owns: the offline default
(the ``demo`` profile) ← the profile's recipe ← its context. The values are written into
``params.yaml`` itself (its comments and layout kept), so DVC sees ordinary parameter changes,
``dvc params diff`` shows them and every stage reruns exactly where a value changed; applying one
profile after another leaves nothing of the first behind, and ``demo`` restores the offline file.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.tokens import CommentToken

from mmcse.config import parse_config
from mmcse.config.coercion import apply_overrides
from mmcse.experiments.recipes import list_profiles, profile_values
from mmcse.io import load_yaml, write_text

__all__ = ["apply_profile", "list_profiles", "profile_values"]


def _yaml_float(representer: Any, value: float) -> Any:
    # PyYAML (which reads params.yaml) takes 3e-05 for a string: a dot in the mantissa; and the
    # exponent without padding (3.0e-5), as params.yaml writes it, so a value written back reads the same
    text = repr(value)
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exponent)}"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


def dvc_style_yaml() -> YAML:
    """A ruamel round-trip writer set as DVC's own (``dvc exp run -S`` rewrites params.yaml with
    ruamel's defaults and block style), plus floats PyYAML reads back: params.yaml is kept in that
    style, so a ``-S`` changes its own lines only and `apply_profile` restores the file byte for byte."""
    rt = YAML()
    rt.default_flow_style = False
    rt.representer.add_representer(float, _yaml_float)
    return rt


def dvc_style(text: str) -> str:
    """``text`` (a YAML document) as `dvc_style_yaml` writes it: its lists in block style, as DVC writes
    a list it sets (a flow list of params.yaml would be rewritten by the first ``-S``)."""
    rt = dvc_style_yaml()
    doc = rt.load(text)

    def blocks(node: Any) -> None:
        if isinstance(node, CommentedSeq) and len(node):
            node.fa.set_block_style()
        if isinstance(node, Mapping):
            for value in node.values():
                blocks(value)
        elif isinstance(node, list):
            for value in node:
                blocks(value)

    blocks(doc)
    buf = io.StringIO()
    rt.dump(doc, buf)
    return buf.getvalue()


def _replace(node: Any, key: str, value: Any) -> None:
    """``node[key] = value`` keeping the key's end-of-line comment where it was: ruamel would move it
    when a value changes between ``[]`` and a block list, and a profile and back would not give back
    the file."""
    comment = (node.ca.items.get(key) or [None] * 3)[2]
    node[key] = value
    if comment is not None:  # the same text (blank lines after it included) at the same column
        node.ca.items[key] = [None, None, CommentToken(comment.value, CommentMark(comment.column), None), None]


# Keys whose profile value ``download`` means "fetch the data": a local copy the params file already
# names (an existing folder) is kept, so applying a profile never swaps data the user gave for a download.
LOCAL_DATA_KEYS = ("data.senteval_dir",)


def _local_copies(plain: Mapping[str, Any], overrides: Mapping[str, Any], base: Path) -> dict[str, str]:
    """The `LOCAL_DATA_KEYS` a profile would set to ``download`` while the params file names an
    existing local folder (relative to ``base``, the params file's folder): ``{key: that folder}``."""
    kept = {}
    for dotted in LOCAL_DATA_KEYS:
        node: Any = plain
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if overrides.get(dotted) == "download" and isinstance(node, str) and node != "download" \
                and (base / Path(node).expanduser()).is_dir():
            kept[dotted] = node
    return kept


def apply_profile(params: str | Path, name: str, root: str | Path | None = None,
                  write: bool = True, kept: dict[str, str] | None = None) -> dict[str, tuple[Any, Any]]:
    """Write profile ``name`` (from ``root``'s ``profiles/`` and ``recipes/``; default the params
    file's folder) into the params file; return ``{key: (old, new)}`` for the changed keys
    (``write=False``: only that, the file untouched: `mmcse profile --show`).

    A local data folder the file already names for a key the profile would ``download``
    (`LOCAL_DATA_KEYS`) is kept; ``kept`` (a dict) receives those keys and folders.
    The result is validated as a whole before anything is written (a bad profile leaves the
    file untouched), and the file is replaced atomically."""

    params = Path(params)
    root = params.parent if root is None else Path(root)
    overrides = profile_values(name, root)
    plain = load_yaml(params.read_text()) or {}
    local = _local_copies(plain, overrides, params.parent)
    overrides = {k: local.get(k, v) for k, v in overrides.items()}
    if kept is not None:
        kept.update(local)
    updated = apply_overrides(plain, overrides, where=f"profile {name}")
    parse_config(updated, where=f"{params} with profile {name}")  # every key and value checked first

    rt = dvc_style_yaml()
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
            if leaf in node:
                _replace(node, leaf, value)
            else:  # a key params.yaml leaves to its default: added at the end of its section
                node.insert(len(node), leaf, value)
    if not write:
        return changed
    buf = io.StringIO()
    rt.dump(doc, buf)
    if load_yaml(buf.getvalue()) != updated:  # the round trip must mean what was validated
        raise RuntimeError(f"{params}: writing profile {name} would not reproduce the validated values")
    write_text(params, buf.getvalue())  # atomic, with the mode a plain write gives
    return changed
