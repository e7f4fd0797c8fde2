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
