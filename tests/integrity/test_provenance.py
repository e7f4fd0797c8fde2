"""Provenance that cannot lie: a run, a model card and a report row made from a checkout whose code differs from
its commit say so, naming the files; the code digest names the code whatever git says."""

from __future__ import annotations

import math
import subprocess

import pytest

from mmcse import tracking
from mmcse.analysis.papers import load_paper
from mmcse.analysis.report import Reproduction, RunCell, block_grid, table_sections
from mmcse.integrity import code
from mmcse.integrity.code import source_state
from mmcse.models import card
from tests.conftest import REPO


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(root)})


@pytest.fixture
def checkout(tmp_path):
    """A git checkout with a loss module, committed."""
    (tmp_path / "src/mmcse/methods").mkdir(parents=True)
    (tmp_path / "src/mmcse/methods/losses.py").write_text("def loss(): return 1\n")
    (tmp_path / "params.yaml").write_text("a: 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_a_checkout_whose_code_differs_from_its_commit_is_dirty_and_names_the_files(checkout):
    clean = source_state(checkout)
    assert clean["dirty"] is False and clean["changed"] == [] and len(clean["commit"]) == 40
    (checkout / "params.yaml").write_text("a: 2\n")  # a parameter is the run's params, not its code
    assert source_state(checkout)["dirty"] is False
    (checkout / "src/mmcse/methods/losses.py").write_text("def loss(): return 2\n")
    (checkout / "stages").mkdir()
    (checkout / "stages/new.py").write_text("print(1)\n")  # untracked code counts too
    dirty = source_state(checkout)
    assert dirty["dirty"] is True and dirty["commit"] == clean["commit"]
    assert dirty["changed"] == ["src/mmcse/methods/losses.py", "stages/new.py"]
    assert source_state(checkout / "no-such") == {"commit": "unknown", "dirty": None, "changed": []}


def test_a_dirty_runs_tags_card_and_report_row_say_uncommitted_changes(checkout, monkeypatch, tmp_path):
    (checkout / "src/mmcse/methods/losses.py").write_text("def loss(): return 2\n")
    state = source_state(checkout)
    monkeypatch.setattr(tracking, "source_state", lambda: state)
    monkeypatch.setattr(card, "source_state", lambda: state)
    # the MLflow run: commit, dirty, the files and the training code's digest
    tags = tracking.provenance_tags()
    assert tags[tracking.COMMIT_TAG] == state["commit"] and tags[tracking.DIRTY_TAG] == "true"
    assert tags[tracking.CHANGED_TAG] == "src/mmcse/methods/losses.py"
    assert tags[tracking.CODE_TAG] == code.code_digest(code.code_files(code.TRAINING_CODE))[:16]
    # the model card
    from mmcse.config import Config

    text = card.write_model_card(tmp_path, Config(), {"avg": 60.0}, {"python": "3.11"}).read_text()
    assert (f"- mmcse commit: `{state['commit']}`, **with uncommitted changes in** src/mmcse/methods/losses.py"
            in text)
    assert f"- training code digest: `{tags[tracking.CODE_TAG]}`" in text
    # the report's row
    paper = load_paper("kdmcse", REPO)
    table = paper.tables["table3"]
    run = Reproduction("kdmcse-flickr-bert", "r1", "FINISHED", "KDMCSE", "independent",
                       {"KDMCSE": {"avg": RunCell(78.0, 0.5, 5, math.nan)}},
                       uncommitted={"KDMCSE": "src/mmcse/methods/losses.py (commit abc1234)"})
    _, grid = block_grid(table, table.blocks["flickr-bert"], run)
    assert grid[1][1] == "mmcse (uncommitted code)"
    lines = [li for s in table_sections(paper, table, [run], True) for li in s.lines]
    assert ("Uncommitted code: row KDMCSE trained with uncommitted changes in src/mmcse/methods/losses.py "
            "(commit abc1234).") in lines


def test_a_clean_checkouts_card_names_its_commit_alone(checkout, monkeypatch, tmp_path):
    monkeypatch.setattr(card, "source_state", lambda: source_state(checkout))
    from mmcse.config import Config

    text = card.write_model_card(tmp_path, Config(), {"avg": 60.0}, {"python": "3.11"}).read_text()
    assert f"- mmcse commit: `{source_state(checkout)['commit']}`\n" in text and "uncommitted" not in text


def test_every_new_mlflow_run_carries_the_provenance_tags(tmp_path, monkeypatch):
    import mlflow

    from mmcse.experiments.params import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "params.yaml")
    tracking.configure(cfg)
    with tracking.run(cfg, "train", run_name="provenance") as active:
        run_id = active.info.run_id
    tags = mlflow.MlflowClient().get_run(run_id).data.tags
    assert {tracking.COMMIT_TAG, tracking.DIRTY_TAG, tracking.CODE_TAG} <= set(tags)
    assert tags[tracking.DIRTY_TAG] in ("true", "false")
