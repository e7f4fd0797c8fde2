"""Ctrl-C stops an ablation (issue 33, item 7): the running job at its next step, after a last resume
point; the stage within seconds, its MLflow runs KILLED, its temporary Prefect server stopped; the
rerun reuses the finished jobs and continues the interrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import mlflow
import psutil
import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # the real ablate stage, twice


STEPS = 120  # a step of the test model takes milliseconds: the Ctrl-C lands within a few steps of the resume point
EVERY = 30  # evaluations and resume points


def _two_long_jobs(project) -> None:
    """One variant, two seeds, each job long enough to be interrupted after its first resume point."""
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["train"].update(epochs=100, max_steps=STEPS, eval_steps=EVERY, checkpoint_steps=EVERY)
    raw["ablate"].update(variants={"mcse": {}}, reference="mcse", seeds=[1, 2])
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def test_ctrl_c_stops_the_ablation_within_seconds_and_the_rerun_continues(project):
    from mmcse import tracking
    from mmcse.experiments.params import load_config
    from mmcse.experiments.prefect_server import stale_temporary_servers

    _two_long_jobs(project)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stage = subprocess.Popen([sys.executable, str(REPO / "stages/ablate.py")], cwd=project, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    first_point = project / "ablation/mcse/seed2/last/state.json"
    deadline = time.monotonic() + 300
    while not first_point.is_file() and time.monotonic() < deadline and stage.poll() is None:
        time.sleep(0.05)  # the second job is training: its first resume point is written
    os.killpg(stage.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the foreground group
    sent = time.monotonic()
    lines = stage.stdout.readlines()
    stage.wait(60)
    took = time.monotonic() - sent
    log = "".join(lines)
    assert stage.returncode == 128 + signal.SIGINT and took < 30, log[-3000:]
    assert "Error logging to API" not in log and "ConnectError" not in log  # its server outlived the Ctrl-C
    assert "[1/2] mcse seed=1: trained on cpu" in log and "[2/2] mcse seed=2: starting" in log
    stopped = log.strip().splitlines()[-1]
    assert stopped.startswith("error: stopped on SIGINT: resume point written at step "), log[-2000:]
    step = int(stopped.split("at step ")[1].split()[0])
    assert EVERY <= step < STEPS
    children = [p for p in psutil.process_iter(["cmdline"]) if "prefect.server.api.server:create_app" in
                (p.info["cmdline"] or []) and str(project) in " ".join(p.info["cmdline"] or [])]
    assert stale_temporary_servers(project) == [] and not children  # its server went with it

    tracking.configure(load_config(project / "params.yaml"))
    runs = {r.data.tags.get("mlflow.runName"): r for r in mlflow.search_runs(
        experiment_names=["mmcse-ablate"], output_format="list")}
    interrupted = runs["mcse-seed2"]
    assert interrupted.info.status == "KILLED" and runs["mcse-seed1"].info.status == "FINISHED"
    assert interrupted.data.tags[tracking.END_REASON_TAG].startswith("stopped on SIGINT: resume point written")
    assert runs["ablation variants"].info.status == "KILLED"  # the ablation's parent run

    again = subprocess.run([sys.executable, str(REPO / "stages/ablate.py")], cwd=project, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[1/2] mcse seed=1: reused (finished before)" in again.stdout + again.stderr
    continued = mlflow.get_run(interrupted.info.run_id)
    assert continued.info.status == "FINISHED"
    assert continued.data.tags["mmcse.resumed_from_step"] == str(step)  # not retrained from step 0
