"""How long an ablation takes here, said before it starts (issue 39, item 5): the train stage's measured
pace times each job's steps, plus its evaluation minutes per job; jobs on other data have no estimate."""

from __future__ import annotations

import json

import pytest

from mmcse import tracking
from mmcse.config import with_overrides
from mmcse.experiments.estimate import downloaded_counts, estimate, job_steps
from mmcse.experiments.params import load_config
from mmcse.experiments.plan import plan, plan_text
from mmcse.io import read_json, write_json
from mmcse.pipeline.paths import Paths
from tests.conftest import REPO


def _trained_here(cfg, minutes: float, eval_minutes: float, steps: int) -> None:
    """What the train and evaluate stages leave: the summary's steps, the folder's run and its minutes beside it."""
    paths = Paths.of(cfg)
    write_json(paths.student / "summary.json", {"steps": steps})
    tracking.remember_run(paths.student, "a-run-id")
    tracking.note_run(paths.student, train_minutes=minutes)
    tracking.note_run(paths.student, eval_minutes=eval_minutes)


def test_jobs_are_estimated_from_the_train_stages_pace_and_other_data_is_counted_unknown(project):
    cfg = load_config("params.yaml")
    assert estimate(cfg, [cfg]).line() == ("1 job(s); no time estimate: the train stage has not trained on this "
                                           "machine (dvc repro train measures its pace)")
    _trained_here(cfg, minutes=2.0, eval_minutes=0.5, steps=10)
    counts = read_json(Paths.of(cfg).raw / "manifest.json")["counts"]
    bs = cfg.train.batch_size
    batches = counts["corpus_sentences"] // bs + counts["pairs"] // bs  # one epoch: every full batch of each
    steps = min(batches * cfg.train.epochs, cfg.train.max_steps) if cfg.train.max_steps else batches * cfg.train.epochs
    assert job_steps(cfg, cfg) == steps
    longer = with_overrides(cfg, {"train.max_steps": 0, "train.epochs": 3})
    assert job_steps(longer, cfg) == 3 * batches
    fine_tuned = with_overrides(longer, {"train.method": "vsepp", "model.vsepp.image_input": "pixels",
                                         "model.vsepp.finetune_epochs": 2})  # VSE++'s fine-tuning epochs follow
    pair_batches = counts["pairs"] // bs  # a retrieval model trains on the pairs alone
    assert job_steps(fine_tuned, cfg) == 5 * pair_batches
    assert job_steps(with_overrides(fine_tuned, {"model.vsepp.image_input": "regions",
                                                 "model.vsepp.finetune_epochs": 0}), cfg) == 3 * pair_batches
    other = with_overrides(cfg, {"data.captions": "longest"})  # other data: its size is not known here
    assert job_steps(other, cfg) is None
    # another profile's data (the folder still holds the demo's): its size is not known here
    elsewhere = with_overrides(cfg, {"data.captions": "longest"})
    assert downloaded_counts(elsewhere) is None and job_steps(elsewhere, elsewhere) is None
    time = estimate(cfg, [cfg, longer, other])
    assert time.jobs == 3 and time.unknown == 1
    assert time.minutes == pytest.approx((steps + 3 * batches) * 2.0 / 10 + 2 * 0.5)
    assert time.line() == (f"3 job(s); about {time.minutes:.0f} min for 2 of them on this machine (the train "
                           "stage's last run: 2.0 min for 10 steps, evaluated in 0.5 min); 1 on data not "
                           "downloaded here: no estimate")


def test_plan_prints_the_jobs_and_their_time_first(project):
    for folder in ("ablations", "profiles", "recipes"):
        if not (project / folder).exists():
            import shutil

            shutil.copytree(REPO / folder, project / folder)
    cfg = load_config("params.yaml")
    _trained_here(cfg, minutes=1.0, eval_minutes=1.0, steps=8)
    result = plan(project / "params.yaml", "dalr-table3")
    assert result["jobs"] == 9 * len(cfg.ablate.seeds)
    second_line = plan_text(result, {}).splitlines()[1]
    assert second_line.startswith(f"{result['jobs']} job(s); about ") and "evaluated in 1.0 min" in second_line
    assert json.loads(json.dumps(result))["train_minutes"] == pytest.approx(result["train_minutes"])
