"""MLflow runs end with the status of what happened in them."""

import mlflow
import pytest

from mmcse import tracking
from mmcse.config import load_config


class Pruned(Exception):
    mlflow_status = "FINISHED"


def _status(run_id: str) -> str:
    return mlflow.get_run(run_id).info.status


def test_run_status_follows_how_the_block_ended(project):
    cfg = load_config("params.yaml")
    ids = {}
    with tracking.run(cfg, "t", run_name="ok") as r:
        ids["ok"] = r.info.run_id
    for name, err in [("failed", ValueError("boom")), ("pruned", Pruned("pruned at step 2")),
                      ("interrupted", KeyboardInterrupt())]:
        with pytest.raises(type(err)):
            with tracking.run(cfg, "t", run_name=name) as r:
                ids[name] = r.info.run_id
                raise err
    assert {name: _status(i) for name, i in ids.items()} == {
        "ok": "FINISHED", "failed": "FAILED", "pruned": "FINISHED", "interrupted": "KILLED"}
    assert mlflow.active_run() is None


def test_a_failed_child_run_leaves_its_parent_running(project):
    cfg = load_config("params.yaml")
    with tracking.run(cfg, "t", run_name="parent") as parent:
        with pytest.raises(ValueError):
            with tracking.run(cfg, "t", run_name="child", parent_run_id=parent.info.run_id) as child:
                raise ValueError("boom")
        assert mlflow.active_run().info.run_id == parent.info.run_id
        assert _status(child.info.run_id) == "FAILED" and _status(parent.info.run_id) == "RUNNING"
    assert _status(parent.info.run_id) == "FINISHED"


KILLED_TRAINING = """
import os, signal, sys
from pathlib import Path
from mmcse.config import load_config, with_overrides
from mmcse.pipeline import Paths, run_train

cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 12, "train.eval_steps": 4,
                                                    "train.checkpoint_steps": 4})
kill_at = int(sys.argv[1])

def die(step, score):
    if step == kill_at:  # after this evaluation is logged, before its resume point is written
        os.kill(os.getpid(), signal.SIGKILL)

run_train(cfg, Paths.of(cfg), out_dir=Path("m"), on_eval=die, progress=False)
"""


def test_kill_9_then_resume_is_one_run_and_the_dead_run_is_marked_killed(project):
    import subprocess
    import sys

    from mmcse.config import with_overrides
    from mmcse.pipeline import Paths, run_train

    for kill_at in (4, 8):  # 4: before any resume point; 8: the resume point of step 4 exists
        proc = subprocess.run([sys.executable, "-c", KILLED_TRAINING, str(kill_at)], cwd=project,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == -9, proc.stderr[-2000:]
    cfg = load_config("params.yaml")
    tracking.configure(cfg)
    runs = mlflow.search_runs(experiment_names=["mmcse-mcse"], output_format="list")
    assert [r.info.status for r in runs] == ["RUNNING", "KILLED"]  # newest first: the 2nd start ended the 1st
    killed_first, second = runs[1], runs[0]
    assert "was gone" in killed_first.data.tags["mmcse.ended_by"]

    cfg = with_overrides(cfg, {"train.max_steps": 12, "train.eval_steps": 4, "train.checkpoint_steps": 4})
    summary = run_train(cfg, Paths.of(cfg), out_dir=project / "m", progress=False)
    assert summary["run_id"] == second.info.run_id  # the resumed training continued the killed run
    runs = mlflow.search_runs(experiment_names=["mmcse-mcse"], output_format="list")
    assert len(runs) == 2 and _status(second.info.run_id) == "FINISHED"
    assert mlflow.get_run(second.info.run_id).data.tags["mmcse.resumed_from_step"] == "4"
    history = mlflow.MlflowClient().get_metric_history(second.info.run_id, "dev_sts")
    by_step = {}
    for m in history:
        by_step.setdefault(m.step, set()).add(round(m.value, 6))
    # one history, steps 0..12 with no gap; steps 5-8 were replayed bit-identically after the kill
    assert sorted(by_step) == [0, 4, 8, 12] and all(len(v) == 1 for v in by_step.values())
    losses = {m.step for m in mlflow.MlflowClient().get_metric_history(second.info.run_id, "loss/loss")}
    assert {5, 10} <= losses
