"""The authors' released run scripts beside mmcse's plans: for every setting a method's script sets
(recipes/scripts/<method>.yaml), the params.yaml key, its value under ``--reading code`` and under ``--reading
printed`` in the plan row the script is held to, as one Markdown page (docs/authors-code.md;
``python -m mmcse.experiments.scripts`` rewrites it, tests/experiments/test_scripts.py holds it to the plans).
"""

from __future__ import annotations

import functools
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcse.config.coercion import flatten
from mmcse.experiments.plan import plan
from mmcse.experiments.profiles import apply_profile
from mmcse.experiments.recipes import PROFILES_DIR, RECIPES_DIR, RunScripts, load_scripts

DOC = Path("docs/authors-code.md")


@dataclass(frozen=True)
class ScriptRow:
    """One setting of one script: its source, the params.yaml key, the script's value, the plan row's value under
    each reading."""

    source: str
    key: str
    script: Any
    code: Any
    printed: Any

    @property
    def held(self) -> bool:
        """Whether ``--reading code`` trains with the script's value."""
        return self.code == self.script


@functools.lru_cache(maxsize=8)
def planned_rows(root: Path, profile: str, preset: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``{reading: {row: its plan row, "config" flattened}}`` of ``preset`` under ``profile`` for the code and
    printed readings, planned in a scratch copy of ``root``'s params.yaml, presets, profiles and recipes (``root`` is
    not touched); one plan per (profile, preset) and reading in a process. Read-only."""
    with tempfile.TemporaryDirectory(prefix="mmcse-scripts-") as tmp:
        scratch = Path(tmp)
        shutil.copy(root / "params.yaml", scratch / "params.yaml")
        for folder in ("ablations", PROFILES_DIR, RECIPES_DIR):
            shutil.copytree(root / folder, scratch / folder)
        apply_profile(scratch / "params.yaml", profile)
        return {reading: {row["variant"]: {**row, "config": flatten(row["config"])}
                          for row in plan(scratch / "params.yaml", preset, reading)["rows"]}
                for reading in ("code", "printed")}


def script_rows(root: Path, run: RunScripts, pairs: str) -> list[ScriptRow]:
    """Every setting of ``run``'s script for data set ``pairs`` against its plan row (`RunScripts.checked_by`)."""
    profile, preset, variant = run.checked_by[pairs]
    planned = planned_rows(root, profile, preset)
    sources = run.sources(pairs)
    return [ScriptRow(sources[key], key, value, planned["code"][variant]["config"].get(key),
                      planned["printed"][variant]["config"].get(key)) for key, value in run.values(pairs).items()]


def _cell(value: Any) -> str:
    return f"`{value}`"


def scripts_markdown(root: Path = Path(".")) -> str:
    """docs/authors-code.md: per method and data set, every script setting → key → code / printed value."""
    lines = ["# The authors' run scripts, setting by setting", "",
             "Made by `python -m mmcse.experiments.scripts` from `recipes/scripts/<method>.yaml`;",
             "`tests/experiments/test_scripts.py` holds it to the plans. For every setting a released run script",
             "sets (its line, or the `src/train_mix.py` default it keeps), the params.yaml key, the script's value and",
             "the value of the plan row the script is held to under `--reading code` and under `--reading printed`",
             "(the paper as printed, mmcse's recipe where the paper is silent). Under `code` every row trains with its",
             "method's script values (BERT, the profile's data set; the scripts train no RoBERTa, whose rows keep",
             "their recipe); the plan names each one that differs from the printed side (`mmcse plan`, its `reading:`",
             "line). The loss functions behind these settings are held equal to the authors' code by",
             "`tests/methods/test_authors_code.py` ([methods](methods.md#paper-and-code-side-by-side)).", ""]
    for method, run in load_scripts(root).items():
        lines += [f"## {method}: {run.repository} @ {run.commit}", ""]
        for pairs, script in run.scripts.items():
            profile, preset, variant = run.checked_by[pairs]
            lines += [f"### `{script}` (data.pairs `{pairs}`)", "",
                      f"Held to the `{variant}` row of `mmcse plan --preset {preset}` under `mmcse profile {profile}`.",
                      "", "| script | key | script's value | `--reading code` | `--reading printed` |",
                      "|---|---|---|---|---|"]
            for row in script_rows(root, run, pairs):
                lines.append(f"| {row.source} | `{row.key}` | {_cell(row.script)} | {_cell(row.code)} | "
                             f"{_cell(row.printed)}{'' if row.printed == row.script else ' (differs)'} |")
            lines.append("")
        if run.not_settings:
            lines += ["No setting of mmcse's:", ""]
            lines += [f"- {n.setting}: {n.why}" for n in run.not_settings]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Write docs/authors-code.md (or print it with ``-``)."""
    text = scripts_markdown()
    if argv and argv[0] == "-":
        sys.stdout.write(text)
        return
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main(sys.argv[1:])
