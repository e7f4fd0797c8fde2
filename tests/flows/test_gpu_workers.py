"""One Prefect worker per GPU: ablation jobs fan out as flow runs of `ablation-job` over two `gpu`
workers started with CUDA_VISIBLE_DEVICES=0 and =1 (CPU here: base.device auto -> cpu), the
coordinator `ablations/fan-out` on a `head` worker. Checks who ran what from the Prefect server's
own events and what each job recorded in MLflow."""

import sqlite3
import time

import pytest
import yaml

from tests.flows.prefect_server import copy_deployments, prefect_server

pytestmark = pytest.mark.slow

VISIBLE = {"gpu-0": "0", "gpu-1": "1"}  # worker name -> its CUDA_VISIBLE_DEVICES
# one seed: two jobs that train and one that fails are enough to reach both workers (a worker takes one at a time)
JOBS = {f"{v} seed=1" for v in ("mcse", "simcse")}
# a variant that fails on every worker: tried twice (ablate.retries: 1)
FAILING = {f"missing model seed=1{r}" for r in ("", " retry 1")}


def _job_flow_runs(server) -> list[dict]:
    return server.api("/flow_runs/filter", {"flows": {"name": {"any_": ["ablation-job"]}}})


def _executed_by(server, flow_run_ids: set[str]) -> dict[str, str]:
    """flow run id -> name of the worker whose `prefect.worker.executed-flow-run` event names it.
    Workers send events asynchronously: wait until every run has one."""
    deadline = time.time() + 120
    while True:
        page = server.api("/events/filter", {"filter": {"event": {"name": ["prefect.worker.executed-flow-run"]}},
                                             "limit": 50})
        assert page["total"] <= 50, page["total"]  # one page holds them all
        ran = {}
        for event in page["events"]:
            for related in event["related"]:
                if related["prefect.resource.role"] == "flow-run":
                    ran[related["prefect.resource.id"].removeprefix("prefect.flow-run.")] = \
                        event["resource"]["prefect.resource.name"]
        if flow_run_ids <= set(ran) or time.time() > deadline:
            return {i: ran.get(i, "?") for i in flow_run_ids}
        time.sleep(2)


def _mlflow_job_runs(project) -> list[dict[str, str]]:
    """Nested runs of experiment ablate, each as its tags plus 'name' and 'status'."""
    with sqlite3.connect(project / "mlruns/mlflow.db") as db:
        runs = db.execute(
            "select r.run_uuid, r.name, r.status from runs r join experiments e on e.experiment_id = r.experiment_id "
            "join tags t on t.run_uuid = r.run_uuid where e.name like '%-ablate' and t.key = 'mlflow.parentRunId'"
        ).fetchall()
        return [dict(db.execute("select key, value from tags where run_uuid = ?", (uuid,)).fetchall())
                | {"name": name, "status": status} for uuid, name, status in runs]


def test_fan_out_gives_every_job_its_own_gpu_worker(project):
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["base"]["device"] = "auto"
    # the failing variant first: it and its retry share the two rounds of the two workers with the jobs that train
    # (last, it took two rounds of its own: ~20 s of flow-run starts)
    raw["ablate"].update(seeds=[1], retries=1, variants={
        "missing model": {"model.name_or_path": str(project / "no-such-model")},
        "mcse": {}, "simcse": {"train.method": "simcse"}})
    raw["train"].update(max_steps=4, eval_steps=2, checkpoint_steps=2)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    copy_deployments(project)

    with prefect_server(project) as server:
        for pool in ("gpu", "head"):  # the REST call `prefect work-pool create --type process` makes (no CLI start)
            server.api("/work_pools/", {"name": pool, "type": "process"})
        server.cli("deploy", "--name", "fan-out", "--name", "ablation-job")
        # Each worker's flow runs inherit its environment; one torch thread each (2 cores here).
        fast = {"PREFECT_WORKER_QUERY_SECONDS": "1", "OMP_NUM_THREADS": "1"}
        for name, visible in VISIBLE.items():
            server.worker("gpu", name, {**fast, "CUDA_VISIBLE_DEVICES": visible})
        server.worker("head", "head", {**fast, "CUDA_VISIBLE_DEVICES": None})
        out = server.cli("deployment", "run", "ablations/fan-out", "--params", '{"poll_seconds": 1}', "--watch")
        assert "Completed" in out, out[-3000:] + server.log("head")
        coordinator = (project / "logs/head.log").read_text()
        assert coordinator.count(": trained on cpu") + coordinator.count(": trained on cuda:0 ") == len(JOBS), \
            coordinator[-3000:]
        assert "unreadable" not in coordinator  # results came back through Prefect's result storage

        flow_runs = _job_flow_runs(server)
        states = {r["name"]: r["state_type"] for r in flow_runs}
        assert len(flow_runs) == len(states) == len(JOBS | FAILING)  # each job submitted once, retried once
        assert states == {n: "COMPLETED" for n in JOBS} | {n: "FAILED" for n in FAILING}
        assert all(r["parent_task_run_id"] for r in flow_runs)  # subflow runs of the coordinator
        ran_by = _executed_by(server, {r["id"] for r in flow_runs})
        assert set(ran_by.values()) == set(VISIBLE), (ran_by, server.log("gpu-0"), server.log("gpu-1"))

        runs = {r["prefect.flow_run_id"]: r for r in _mlflow_job_runs(project)}
        assert len(runs) == len(flow_runs)  # one MLflow run per job flow run, none without one
        for flow_run in flow_runs:
            tags = runs[flow_run["id"]]
            worker = ran_by[flow_run["id"]]
            assert tags["status"] == ("FINISHED" if flow_run["name"] in JOBS else "FAILED")
            assert tags["prefect.worker"] == worker and tags["prefect.flow_run"] == flow_run["name"]
            assert tags["cuda_visible_devices"] == VISIBLE[worker]  # the job saw its own worker's GPU
            assert tags["device"] == "cpu" or tags["device"].startswith("cuda:0 ")  # auto, resolved in the job

        table = (project / "ablation/ablation.md").read_text().splitlines()
        rows = {line.split("|")[1].strip(): line for line in table[2:] if line.startswith("|")}  # not the notes
        assert list(rows) == ["missing model", "mcse", "simcse"]
        for name in ("mcse", "simcse"):  # seeds column: its seed, status ok
            assert [c.strip() for c in rows[name].split("|")[-3:-1]] == ["1", "ok"]
        assert rows["missing model"].endswith("| 0 | failed |")
        csv = (project / "ablation/ablation.csv").read_text()
        assert "no-such-model" in csv  # the failed jobs' error

        # A rerun reuses every finished job: nothing is submitted, the rows are the same.
        raw["ablate"]["variants"].pop("missing model")
        (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        out = server.cli("deployment", "run", "ablations/fan-out", "--params", '{"poll_seconds": 1}', "--watch")
        assert "Completed" in out, out[-3000:] + server.log("head")
        assert len(_job_flow_runs(server)) == len(flow_runs)
        again = (project / "ablation/ablation.md").read_text().splitlines()
        assert [line for line in again[2:] if line.startswith("|")] == [rows["mcse"], rows["simcse"]]
