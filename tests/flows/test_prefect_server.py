"""A real Prefect server on loopback: pool `gpu`, deployment `ablations`, a worker, one run."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_deployment_runs_to_completion_on_a_worker(project):
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"]["seeds"] = [1]
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    shutil.copytree(REPO / "flows", project / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "prefect.yaml", project / "prefect.yaml")

    port = _free_port()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PREFECT_HOME": str(project / ".prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MMCSE_ROOT": str(project),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    prefect = str(bin_dir / "prefect")
    logs = project / "logs"
    logs.mkdir()
    started = []
    try:
        server = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, cwd=project, stdout=open(logs / "server.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        started.append(server)
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, (logs / "server.log").read_text()[-2000:]
            time.sleep(1)

        def cli(*args):
            out = subprocess.run([prefect, "--no-prompt", *args], env=env, cwd=project, capture_output=True,
                                 text=True, timeout=400)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            return out.stdout

        cli("work-pool", "create", "gpu", "--type", "process")
        cli("deploy", "--name", "ablations")
        inspected = cli("deployment", "inspect", "ablations/ablations")
        assert "'global_concurrency_limit'" in inspected and "'limit': 4" in inspected  # from prefect.yaml
        worker = subprocess.Popen([prefect, "worker", "start", "--pool", "gpu", "--limit", "1"], env=env, cwd=project,
                                  stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        started.append(worker)
        out = cli("deployment", "run", "ablations/ablations", "--watch")
        assert "Completed" in out
        table = (project / "ablation" / "ablation.md").read_text()
        assert "| mcse |" in table and "| simcse |" in table and "failed" not in table
    finally:
        for proc in reversed(started):
            _stop(proc)
    assert all(p.poll() is not None for p in started)
