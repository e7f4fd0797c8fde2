"""The `ablations` flow's MLflow record as a user reads it: run names, the parent's settings,
metrics and table (one job: the cheapest ablation)."""

import sys

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # a Prefect test server per module


def test_the_flow_names_its_runs_and_fills_its_parent(project):
    from prefect.testing.utilities import prefect_test_harness

    sys.path.insert(0, str(REPO))
    import mlflow

    from flows.ablations import ablations
    from mmcse import tracking
    from mmcse.experiments.params import load_config

    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"].update(variants={"mcse": {}}, seeds=[1], title="one job")
    raw["train"].update(max_steps=2, eval_steps=2)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with prefect_test_harness(server_startup_timeout=120):
        rows = ablations("params.yaml")

    tracking.configure(load_config("params.yaml"))
    client = mlflow.MlflowClient()
    runs = mlflow.search_runs(experiment_names=["mmcse-ablate"], output_format="list")
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(by_name) == ["ablation one job", "mcse-seed1"]
    parent, job = by_name["ablation one job"], by_name["mcse-seed1"]
    assert job.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.data.params["ablation.variants"] == "mcse" and parent.data.params["ablation.jobs"] == "1"
    assert parent.data.params["ablation.metric"] == "avg" and parent.data.params["ablation.seeds"] == "1"
    assert parent.data.metrics["mcse/avg_mean"] == pytest.approx(rows[0]["avg_mean"])
    assert parent.data.metrics["ablation/jobs_done"] == 1
    history = client.get_metric_history(parent.info.run_id, "mcse/avg_mean")
    assert [m.step for m in history] == [0]  # the final table's, once: not a curve over jobs done
    assert "ablation_table.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    kind = client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"]
    assert kind == "custom_model_development"
