"""An ablation job on several processes (`mmcse.pipeline.train_processes`): a worker whose job asks for
``train.devices: 2`` trains it through torchrun with rank 0's run record, tagged as the job's context tags it,
and gets one process's scores; a sweep trial's pruning callback is refused before anything starts."""

from __future__ import annotations

import shutil

import mlflow
import pytest
import yaml

from mmcse import tracking
from mmcse.experiments.ablate import run_job
from mmcse.experiments.jobs import expand
from mmcse.experiments.params import load_config
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train_processes import run_train_on_processes
from mmcse.training.engine import Hooks


def _one_job(project, **train):
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["train"].update(dropout_rng="per_row", **train)
    raw["ablate"].update(variants={"mcse": {}}, reference="mcse", seeds=[1])
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(project / "params.yaml")
    (job,) = expand(cfg)
    return cfg, job


@pytest.mark.slow  # torchrun and two training processes
def test_an_ablation_job_on_two_processes_scores_as_on_one(project):
    cfg, job = _one_job(project)
    alone = run_job(cfg, job, project / "ablation-one")
    shutil.rmtree(Paths.of(cfg).jobs)  # else the same job (1 process or 2) is restored from its keep
    cfg, job = _one_job(project, devices=2)
    with tracking.tagged({"prefect.worker": "gpu-box"}):
        result = run_job(cfg, job, project / "ablation")

    assert result["status"] == "ok" and result["config_hash"] == alone["config_hash"]  # the same job
    assert result["best_dev"] == pytest.approx(alone["best_dev"], abs=1e-3)
    assert result["scores"].keys() == alone["scores"].keys()
    for name, score in alone["scores"].items():
        assert result["scores"][name] == pytest.approx(score, abs=1e-2), name
    run = mlflow.get_run(result["run_id"])  # rank 0's, with the tags of the job's context and its own
    assert run.info.status == "FINISHED" and run.data.tags["mmcse.processes"] == "2"
    assert run.data.tags["prefect.worker"] == "gpu-box" and run.data.tags[tracking.VARIANT_TAG] == "mcse"
    assert not list((project / "ablation").glob(".*.json"))  # the job's description and summary files are gone


def test_a_sweep_trials_pruning_cannot_reach_other_processes(project):
    cfg, _ = _one_job(project, devices=2)
    with pytest.raises(ValueError, match="a sweep trial trains in one process"):
        run_train_on_processes(cfg, Paths.of(cfg), project / "trial", hooks=Hooks(on_eval=lambda step, score: None))
