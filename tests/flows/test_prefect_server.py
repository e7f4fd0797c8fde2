"""A real Prefect server on loopback: pool `gpu`, deployment `ablations`, a worker, one run."""

import pytest
import yaml

from tests.flows.prefect_server import copy_deployments, prefect_server

pytestmark = pytest.mark.slow


def test_deployment_runs_to_completion_on_a_worker(project):
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"]["seeds"] = [1]
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    copy_deployments(project)

    with prefect_server(project) as server:
        server.cli("work-pool", "create", "gpu", "--type", "process")
        server.cli("deploy", "--name", "ablations")
        inspected = server.cli("deployment", "inspect", "ablations/ablations")
        assert "'global_concurrency_limit'" in inspected and "'limit': 4" in inspected  # from prefect.yaml
        server.worker("gpu", "worker")
        out = server.cli("deployment", "run", "ablations/ablations", "--watch")
        assert "Completed" in out
    table = (project / "ablation" / "ablation.md").read_text()
    assert "| mcse |" in table and "| simcse |" in table and "failed" not in table
