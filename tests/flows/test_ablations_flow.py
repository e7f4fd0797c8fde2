"""The `ablations` flow under Prefect's test harness, on the shrunk real params."""

import sqlite3

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # a Prefect test server per module


@pytest.fixture(scope="module")
def harness():
    from prefect.logging.configuration import setup_logging
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        # Prefect's console handler keeps the sys.stderr of the moment it is made; made here, it is the session's
        # (made by the first flow run, it was that test's capsys stream, closed when the test ended)
        setup_logging()
        yield


def _flow_record(flow_run_name: str | None = None) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """The newest `ablations` flow run's tasks ``{task run name: (state name, message)}`` and its
    artifacts ``{key: type}``, read back from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    return ({t.name: (t.state.name, t.state.message or "") for t in tasks if t.state},
            {a.key: a.type for a in artifacts})


def test_flow_trains_every_variant_retries_failures_and_resumes(project, harness, monkeypatch, capsys, caplog):
    import sys

    sys.path.insert(0, str(REPO))
    from flows.ablations import ablations

    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"]["variants"] = {
        "mcse": {},
        "simcse": {"train.method": "simcse"},
        "missing model": {"model.name_or_path": str(project / "no-such-model")},
    }
    raw["ablate"]["retries"] = 1
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


    from mmcse.experiments import upstream

    calls = []  # every job attempt (each resolves its upstream artifacts first): the job's model
    real_resolve = upstream.resolve_on_record
    monkeypatch.setattr("mmcse.experiments.ablate.resolve_on_record",
                        lambda *a, **k: calls.append(a[0].model.name_or_path) or real_resolve(*a, **k))
    rows = {r["variant"]: r for r in ablations("params.yaml")}
    assert rows["mcse"]["status"] == "ok" and rows["mcse"]["seeds"] == 2
    assert rows["simcse"]["status"] == "ok" and 0 <= rows["simcse"]["p_value"] <= 1
    assert rows["missing model"]["status"] == "failed" and "no-such-model" in rows["missing model"]["error"]
    assert calls.count(str(project / "no-such-model")) == 4  # 2 seeds x (1 try + 1 retry)
    table = (project / "ablation/ablation.md").read_text()
    assert "missing model" in table and "failed" in table
    from mmcse.environment import describe, environment

    assert table.rstrip().endswith(f"Environment: {describe(environment('cpu'))}.")  # every job ran here
    assert (project / "plots/ablation.png").stat().st_size > 1000
    for job in ("mcse/seed1", "simcse/seed2"):  # finished jobs keep their model and history only
        folder = project / "ablation" / job
        assert (folder / "best/model.safetensors").is_file() and (folder / "result.json").is_file()
        assert sorted(p.name for p in (folder / "last").iterdir()) == ["state.json"]

    with sqlite3.connect(project / "mlruns/mlflow.db") as db:
        nested = dict(db.execute(
            "select r.status, count(*) from runs r join tags t on t.run_uuid = r.run_uuid "
            "where t.key = 'mlflow.parentRunId' group by r.status").fetchall())
        tables = db.execute("select count(*) from runs where name like 'ablation%'").fetchone()[0]
    # each ok variant x seed is a finished nested run; each failed attempt stays visible as failed
    assert nested == {"FINISHED": 4, "FAILED": 4} and tables == 1

    out = "".join(capsys.readouterr()) + caplog.text  # printed in the flow: Prefect's run logger shows it
    assert "[1/6] mcse seed=1: starting" in out and "[1/6] mcse seed=1: trained on cpu in " in out
    assert "[6/6] missing model seed=2: failed: " in out
    tasks, artifacts = _flow_record()
    assert artifacts == {"ablation-table": "markdown", "ablation-rows": "table"}
    assert tasks["mcse seed=1"][0] == "Completed"
    caplog.clear()

    calls.clear()
    again = {r["variant"]: r for r in ablations("params.yaml")}
    assert [c for c in calls if "no-such-model" not in c] == []  # finished variants are skipped
    out = "".join(capsys.readouterr()) + caplog.text
    assert "[2/6] mcse seed=2: reused (finished before), avg " in out
    tasks, _ = _flow_record()
    state, message = tasks["mcse seed=2"]
    assert state == "Reused" and "not retrained" in message  # the Prefect UI tells it from a trained job
    assert again["mcse"]["avg_mean"] == pytest.approx(rows["mcse"]["avg_mean"])
    # the rerun continued the same parent run: one record with every job, the aggregates and the table
    import mlflow

    from mmcse import tracking
    from mmcse.experiments.params import load_config

    tracking.configure(load_config("params.yaml"))
    parents = mlflow.search_runs(experiment_names=["mmcse-ablate"], filter_string="tags.fan_out = 'local'",
                                 output_format="list")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.data.metrics["mcse/avg_mean"] == pytest.approx(rows["mcse"]["avg_mean"])
    assert parent.data.metrics["simcse/avg_std"] == pytest.approx(rows["simcse"]["avg_std"])
    assert parent.data.metrics["missing model/seeds"] == 0
    assert parent.data.params["ablate.reference"] == "mcse"
    jobs = mlflow.artifacts.load_dict(f"{parent.info.artifact_uri}/jobs.json")["jobs"]
    assert [(j["variant"], j["seed"], j["status"]) for j in jobs] == [
        (v, s, "failed" if v == "missing model" else "ok") for v in ("mcse", "simcse", "missing model") for s in (1, 2)]
    children = {r.info.run_id for r in mlflow.search_runs(
        experiment_names=["mmcse-ablate"], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        output_format="list")}
    assert {j["run_id"] for j in jobs if j["status"] == "ok"} <= children
    # issue 67.3: the rerun says in MLflow what it did with each finished job: a record under the parent, naming
    # the run it reused (no row tag: nothing counts it as a job twice)
    reused = mlflow.search_runs(experiment_names=["mmcse-ablate"], output_format="list",
                                filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}' and "
                                              "attributes.run_name LIKE 'reused: %'")
    by_job = {j["run_id"]: f"{j['variant']}-seed{j['seed']}" for j in jobs if j["status"] == "ok"}
    assert sorted(r.info.run_name for r in reused) == sorted(f"reused: {name}" for name in by_job.values())
    for record in reused:
        assert by_job[record.data.tags[tracking.REUSED_TAG]] == record.info.run_name.removeprefix("reused: ")
        assert tracking.VARIANT_TAG not in record.data.tags and record.info.status == "FINISHED"


def test_a_preset_chosen_as_the_flows_parameter_gives_its_table_in_order_and_a_line_plot(project, harness):
    import json
    import sys

    sys.path.insert(0, str(REPO))
    from flows.ablations import ablations

    (project / "ablations").mkdir()
    (project / "ablations/margin.yaml").write_text(
        'description: "margin sweep"\nbase: {train.method: kdmcse}\nreference: "m=0.1"\n'
        "plot_x: loss.kdmcse.margin\nvariants:\n"
        '  "m=0.2": {loss.kdmcse.margin: 0.2}\n  "m=0.1": {loss.kdmcse.margin: 0.1}\n')
    # issue 67.3: the preset and overrides as the deployment's parameters (`prefect deployment run
    # 'ablations/ablations' --param preset=margin --params '{"overrides": …}'`), params.yaml left as it is
    before = (project / "params.yaml").read_text()
    assert yaml.safe_load(before)["ablate"]["preset"] == "none"
    with pytest.raises(ValueError, match=r"^flow parameter preset 'margins': no preset file .*presets: margin$"):
        ablations("params.yaml", preset="margins")
    stale = project / "ablation/mcse/seed3"  # an earlier table's finished job: not in this table's output
    stale.mkdir(parents=True)
    (stale / "result.json").write_text(json.dumps({"status": "ok", "config_hash": "e" * 64}))
    rows = ablations("params.yaml", preset="margin", overrides={"ablate.seeds": [1, 2], "train.max_steps": 4})
    assert (project / "params.yaml").read_text() == before
    assert [r["variant"] for r in rows] == ["m=0.2", "m=0.1"]  # the preset's row order
    assert sorted(p.name for p in (project / "ablation").iterdir()) == ["ablation.csv", "ablation.md", "m=0.1", "m=0.2"]
    assert (project / "data/jobs" / ("e" * 64) / "result.json").is_file()
    assert all(r["status"] == "ok" and r["seeds"] == 2 for r in rows)
    md = (project / "ablation/ablation.md").read_text().splitlines()
    assert md[0] == "### margin sweep" and "p vs m=0.1" in md[2]
    assert (project / "plots/ablation.png").stat().st_size > 1000
    metrics = json.loads((project / "metrics/ablate.json").read_text())
    assert metrics["preset"] == "margin" and set(metrics["variants"]) == {"m=0.2", "m=0.1"}
    # issue 67.5: the parent run holds no row's margin or seed; the method every row shares is its own
    import sqlite3

    with sqlite3.connect(project / "mlruns/mlflow.db") as db:
        (parent,) = db.execute("select run_uuid from runs where name = 'ablation margin'").fetchall()
        params = dict(db.execute("select key, value from params where run_uuid = ?", parent).fetchall())
    assert params["loss.kdmcse.margin"] == params["base.seed"] == "table: margin"
    assert params["train.method"] == "kdmcse" and params["ablation.preset"] == "margin"


def test_a_diverged_job_fails_at_once_without_retries_and_the_ablation_goes_on(project, harness, monkeypatch):
    """Issue 33.3: a diverged training is a failed job (its reason in the table), never retried."""
    import sys

    sys.path.insert(0, str(REPO))
    from flows.ablations import ablations

    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"].update(variants={"mcse": {}, "diverged": {"train.learning_rate": 1e30}}, seeds=[1], retries=2)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    from mmcse.pipeline import train as train_stage

    calls = []
    real_train = train_stage.run_train
    monkeypatch.setattr("mmcse.experiments.ablate.run_train", lambda *a, **k: calls.append(a[0].train.learning_rate) or
                        real_train(*a, **k))
    rows = {r["variant"]: r for r in ablations("params.yaml")}
    assert rows["mcse"]["status"] == "ok"
    assert rows["diverged"]["status"] == "failed" and "training diverged at step" in rows["diverged"]["error"]
    assert calls.count(1e30) == 1  # no retry of a run that diverges again


def test_a_stop_that_lands_as_a_job_starts_stops_the_flow_not_just_the_job(project, harness, monkeypatch):
    """A Ctrl-C that arrives while Prefect starts a job's task is reported by Prefect as the task's crash (an
    exception, "Task run is not set"): the flow stops there, as on a Ctrl-C during training, instead of recording
    the job as failed and training the next ones."""
    import sys

    sys.path.insert(0, str(REPO))
    import flows.ablations as flow_module
    from mmcse import stopping

    started = []

    class CrashedByStop:
        def with_options(self, **_):
            return self

        def __call__(self, params_path, variant, seed, parent_run_id, overrides):
            started.append((variant, seed))
            stopping._REQUESTED.set()  # as the handler left it: the stop raised inside Prefect's engine
            stopping._SIGNAL[:] = [2]
            raise RuntimeError("Task run is not set")

    monkeypatch.setattr(flow_module, "train_variant", CrashedByStop())
    try:
        with pytest.raises(stopping.StopRequested, match=r"stopped on SIGINT: job 1 of 4 \(mcse seed=1\) did not "
                                                         r"finish; rerun to continue"):
            flow_module.ablations("params.yaml")
    finally:
        stopping.reset()
    assert started == [("mcse", 1)]  # no further job was started
