"""A real Prefect server on loopback, as a user brings it up: `mmcse prefect up` (server, pools `gpu` and `head`,
every deployment, the workers), one run of the deployment `ablations` on its worker, `mmcse prefect down`."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from tests.flows.prefect_server import copy_deployments, free_port

pytestmark = pytest.mark.slow


def test_mmcse_prefect_up_brings_everything_up_in_order_runs_the_ablations_deployment_and_down(project):
    """`mmcse prefect up`: the server (waited for), both pools, every deployment, the workers, with no
    connection error on the way; a second `up` reuses what runs; the `ablations` deployment (prefect.yaml's
    concurrency limit) runs to completion on its `gpu` worker, as the command's last line says to run it;
    `down` stops it all."""
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"]["seeds"] = [1]
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
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

        prefect = [str(Path(sys.executable).parent / "prefect"), "--no-prompt"]
        at_server = {**env, "PREFECT_API_URL": api}  # what `up`'s last line says to export
        inspected = subprocess.run([*prefect, "deployment", "inspect", "ablations/ablations"], cwd=project,
                                   env=at_server, capture_output=True, text=True, timeout=300)
        assert "'global_concurrency_limit'" in inspected.stdout and "'limit': 4" in inspected.stdout  # prefect.yaml
        ran = subprocess.run([*prefect, "deployment", "run", "ablations/ablations", "--watch"], cwd=project,
                             env=at_server, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0 and "Completed" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-3000:]
        table = (project / "ablation" / "ablation.md").read_text()
        assert "| mcse |" in table and "| simcse |" in table and "failed" not in table
    finally:
        down = subprocess.run([sys.executable, "-m", "mmcse.cli", "prefect", "down"], cwd=project, env=env,
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0 and "stopped server" in down.stdout
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids.values())
