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


def test_mmcse_prefect_up_brings_everything_up_in_order_and_down(project):
    """`mmcse prefect up`: the server (waited for), both pools, every deployment, the workers, with no
    connection error on the way; a second `up` reuses what runs; `down` stops it all."""
    import json
    import os
    import subprocess
    import sys
    import urllib.request

    import psutil

    from tests.flows.prefect_server import free_port

    copy_deployments(project)
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(project / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    up = [sys.executable, "-m", "mmcse.cli", "prefect", "up", "--port", str(port)]
    try:
        first = subprocess.run(up, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        out = first.stdout + first.stderr
        assert "ConnectError" not in out and "Traceback" not in out
        lines = [line for line in first.stdout.splitlines() if line]
        assert lines[0].startswith("Prefect server: starting") and lines[1].startswith("Prefect server: healthy")
        assert "work pools: gpu, head (created gpu, head)" in first.stdout
        api = f"http://127.0.0.1:{port}/api"

        def post(path: str) -> list:
            request = urllib.request.Request(f"{api}{path}", data=b"{}", method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())

        assert {p["name"] for p in post("/work_pools/filter")} >= {"gpu", "head"}
        assert {d["name"] for d in post("/deployments/filter")} == {"ablations", "fan-out", "ablation-job", "sweep"}
        recorded = json.loads((project / ".prefect-up/pids.json").read_text())
        pids = {name: entry["pid"] for name, entry in recorded.items()}
        assert set(pids) == {"server", f"{os.uname().nodename}-cpu0", f"{os.uname().nodename}-head"}
        assert all(psutil.pid_exists(p) for p in pids.values())
        # each process with its start time and command line: a reused pid is never taken for it
        assert all(psutil.Process(e["pid"]).create_time() == pytest.approx(e["started"], abs=0.01) and
                   psutil.Process(e["pid"]).cmdline() == e["cmdline"] for e in recorded.values())
        again = subprocess.run(up, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0 and "already answering" in again.stdout and "(present)" in again.stdout
        assert json.loads((project / ".prefect-up/pids.json").read_text()) == recorded  # nothing started twice
    finally:
        down = subprocess.run([sys.executable, "-m", "mmcse.cli", "prefect", "down"], cwd=project, env=env,
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0 and "stopped server" in down.stdout
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids.values())
