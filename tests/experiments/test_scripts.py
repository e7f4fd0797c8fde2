"""Every released run script diffed: each setting a script sets is the value `--reading code` plans for the row the
script is held to, and where the printed reading plans another value the plan's row names the point."""

from __future__ import annotations

import pytest

from mmcse.config.coercion import flatten
from mmcse.experiments.recipes import load_scripts
from mmcse.experiments.scripts import DOC, planned_rows, script_rows, scripts_markdown
from tests.conftest import REPO


def _check(method: str, pairs: str) -> None:
    run = load_scripts(REPO)[method]
    rows = script_rows(REPO, run, pairs)
    assert rows and {r.key for r in rows} == set(run.values(pairs))
    wrong = [(r.key, r.script, r.code) for r in rows if not r.held]
    assert not wrong, f"--reading code does not plan {method}'s script ({run.scripts[pairs]}) at: {wrong}"
    # where the printed reading differs, the row's reading line names the point (no "no point differs" there)
    profile, preset, variant = run.checked_by[pairs]
    for reading in ("printed", "code"):
        row = planned_rows(REPO, profile, preset)[reading][variant]
        named = {e["key"]: e["follows"] for e in row["reading"]}
        reads = flatten(row["reads"])  # a key the row does not read under this reading (a margin off) is no point
        for r in rows:
            if r.printed != r.script and r.key in reads:
                assert r.key in named, (reading, r.key)
                assert named[r.key] == ("code" if reading == "code" else "printed"), (reading, r.key, named[r.key])


def test_dalrs_coco_script_is_the_code_reading_of_its_row():
    """DALR's wiki+coco script trains at LR 1e-5 for 3 epochs (the paper prints 2e-5 and 4): the code reading of a
    DALR row under dalr-coco-bert takes them, and the plan names both."""
    _check("dalr", "coco")
    rows = {r.key: r for r in script_rows(REPO, load_scripts(REPO)["dalr"], "coco")}
    assert (rows["train.learning_rate"].code, rows["train.epochs"].code) == (1e-5, 3)
    assert (rows["train.learning_rate"].printed, rows["train.epochs"].printed) == (2e-5, 4)


@pytest.mark.slow  # every script of every method: nine plans under two readings
@pytest.mark.parametrize(("method", "pairs"), [(m, p) for m, run in load_scripts(REPO).items() for p in run.scripts])
def test_every_released_script_is_the_code_reading_of_its_row(method, pairs):
    _check(method, pairs)


@pytest.mark.slow
def test_the_script_table_is_the_plans_table():
    assert (REPO / DOC).read_text() == scripts_markdown(REPO), "run: python -m mmcse.experiments.scripts"
