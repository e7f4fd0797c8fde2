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
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcse.config.coercion import flatten
from mmcse.data.sizes import CAPTIONS_PER_IMAGE, SPLIT_IMAGES, WIKI1M_SENTENCES
from mmcse.experiments.plan import plan
from mmcse.experiments.profiles import apply_profile
from mmcse.experiments.recipes import PROFILES_DIR, RECIPES_DIR, RunScripts, load_scripts
from mmcse.training.schedule import pair_share

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


def _share(pairs: str, captions_per_image: int, batch_size: int, order: str) -> str:
    images = SPLIT_IMAGES[f"{pairs}/karpathy"]["train"]
    return f"{100 * pair_share(WIKI1M_SENTENCES, images * captions_per_image, batch_size, order):.1f} %"


def loops_markdown() -> list[str]:
    """The section on what the released training loops feed the loss lines: the loop settings, the shares of
    image–caption batches they give, what tests/training/test_authors_loop.py holds and what is still open."""
    rows = [(f"{name}, {pairs}", *(_share(pairs, per_image, size, order) for order in ("released", "alternate")))
            for name, per_image, size in (("MCSE (one caption an image), B 64", 1, 64),
                                          ("KDMCSE (every caption), B 64", CAPTIONS_PER_IMAGE, 64),
                                          ("DALR (every caption), B 128", CAPTIONS_PER_IMAGE, 128))
            for pairs in ("flickr30k", "coco")]
    return [_wrapped(line) for line in [
        "## What the training loops feed", "",
        "The released `src/train_mix.py` of MCSE, KDMCSE and DALR share one loop, and three of its settings are no "
        "script argument: each is a `train.*` setting whose `--reading code` value the tables below list with its "
        "line. `train.batch_order: released` takes the loop's arithmetic (`n_text + n_pair` steps an epoch, a pair "
        "batch where `step % (n_text // n_pair) == 0`, both loaders endless streams that go on into the next epoch; "
        "`mmcse.training.schedule`), where the printed papers only say the kinds alternate (`alternate`: each full "
        "batch once an epoch, a pair batch after every `n_text // n_pair` text batches). `train.optimizer: "
        "transformers_adamw` is transformers' AdamW as the loops build it (eps 1e-6 added before the second moment's "
        "bias correction; `mmcse.training.optimizers`), where mmcse's default is PyTorch's (eps 1e-8). "
        "`train.dev_truncation: none` scores the dev STS-B sentences whole, as their `evaluate()` pads without "
        "truncating, where mmcse's default cuts them at `model.max_seq_len` as in training (which can pick another "
        "best checkpoint). `mmcse plan` prints each row's epoch and its share of image–caption batches "
        "(Wiki1M's 1,000,000 sentences and the Karpathy train split here):", "",
        "| method, pairs | `released` | `alternate` |", "|---|---|---|",
        *(f"| {name} | {released} | {alternate} |" for name, released, alternate in rows), "",
        "`python -m pytest tests -k authors_loop` runs MCSE's loop and KDMCSE's (its copy with ClipVisnModel's heads "
        "and its loss), transcribed line by line (tests/training/test_authors_loop.py: the MCSE, `--framework simcse` "
        "and KDMCSE rows of kdmcse-table1 under `--reading code`), beside mmcse's own training "
        "from the same initial weights on the same sentences with the same dropout masks (both sides keyed by "
        "(step, sentence, view)), and compares every parameter after every step in float64 (1e-8), and the dev score "
        "that picks the best checkpoint; setting any of the three back to its printed value breaks it.", "",
        "Still different from the released loops, each to become a setting or a fix:", "",
        "- The released DataLoaders keep each pass's last, partial batch (`len = ⌈N/B⌉`); mmcse trains full batches "
        "only, and counts `n_text`, `n_pair` in them (one batch a pass; Wiki1M at B 64 and 128 divides evenly).",
        "- What the heads see: MCSE's extractor (preprocess/extract_visn_feature.py) stores raw ResNet-50 pooled "
        "features, which its image head takes as they are; mmcse's teacher cache stores L2-normalised features "
        "(`mmcse.teachers.encoders`). KDMCSE's and DALR's CLIP features come from a JSON file whose extraction is not "
        "in either repository: their heads take the stored vectors as they are (KDMCSE src/model.py l.225–231 "
        "normalises only after `vmlp`/`tmlp`), and their collator normalises them itself before the image–image and "
        "caption–caption scores (src/train_mix.py l.325–329) but not for the threshold's image–caption dot products "
        "(l.322–323), which would be needless if the stored vectors were unit vectors.",
        "- DALR: the global-to-local term the code adds to its ranking loss (src/model_modified.py l.734–739), the "
        "text teachers mixed as raw embeddings and normalised after (l.720, l.742), the teachers reading the "
        "student's ids cut at 32 tokens (l.670–677; mmcse's cache: 128) and the consistency heads' "
        "Linear–BatchNorm–ReLU at width 768 (l.100–119).",
        "- SimCSE's own rows (MCSEO Table 1, DALR Tables 2 and 5) under `--reading code` train with MCSE's "
        "run_wiki.sh (3 epochs, fp32), not princeton-nlp/SimCSE's run_unsup_example.sh.",
        "- DALR's loop is not transcribed yet (its loss lines are: `python -m pytest tests -k authors_code`), nor "
        "princeton-nlp/SimCSE's Trainer loop.", "",
    ]]


def _wrapped(paragraph: str, width: int = 118) -> str:
    """A prose line of the page wrapped at ``width`` (a list item's continuation indented); tables stay whole."""
    if paragraph.startswith("|") or len(paragraph) <= width:
        return paragraph
    return textwrap.fill(paragraph, width, subsequent_indent="  " if paragraph.startswith("- ") else "",
                         break_on_hyphens=False, break_long_words=False)


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
             "`tests/methods/test_authors_code.py` ([methods](methods.md#paper-and-code-side-by-side)).", "",
             *loops_markdown()]
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
