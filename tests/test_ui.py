"""`mmcse ui`: the MLflow UI on the project's stores and optuna-dashboard on the sweep storage,
both on 127.0.0.1 only, stopped together."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from mmcse import cli, tracking
from mmcse.analysis import views
from mmcse.experiments.params import load_config
from tests.conftest import REPO


@pytest.fixture
def params(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    return tmp_path


def test_ui_commands_serve_the_project_stores_on_localhost(params):
    cfg = load_config("params.yaml")
    commands = views.ui_commands(cfg, port=5123, dashboard_port=8123, dashboard="/opt/bin/optuna-dashboard")
    assert commands == {
        "mlflow": [sys.executable, "-m", "mlflow", "server",
                   "--backend-store-uri", f"sqlite:///{params}/mlruns/mlflow.db",
                   "--registry-store-uri", f"sqlite:///{params}/mlruns/mlflow.db",
                   "--host", "127.0.0.1", "--port", "5123", "--workers", "1",
                   "--artifacts-destination", (params / "mlruns" / "artifacts").as_uri()],
        "optuna": ["/opt/bin/optuna-dashboard", f"sqlite:///{params}/mlruns/optuna.db",
                   "--host", "127.0.0.1", "--port", "8123"],
    }
    assert list(views.ui_commands(cfg)) == ["mlflow"]  # optuna-dashboard not installed: MLflow only


def test_ui_commands_keep_a_server_store_as_given(params):
    raw = yaml.safe_load(Path("params.yaml").read_text())
    raw["base"]["mlflow_tracking_uri"] = "postgresql+psycopg://mmcse@db:5432/mlflow"
    raw["sweep"]["storage"] = "postgresql+psycopg://mmcse@db:5432/optuna"
    Path("params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    commands = views.ui_commands(load_config("params.yaml"), dashboard="optuna-dashboard")
    assert commands["mlflow"][4:] == ["--backend-store-uri", "postgresql+psycopg://mmcse@db:5432/mlflow",
                                      "--registry-store-uri", "postgresql+psycopg://mmcse@db:5432/mlflow",
                                      "--host", "127.0.0.1", "--port", "5000", "--workers", "1"]
    assert commands["optuna"][1] == "postgresql+psycopg://mmcse@db:5432/optuna"


class _FakeProcess:
    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.cmd, self.env, self.returncode, self.terminated = cmd, env, None, False
        started.append(self)

    def poll(self):
        return self.returncode

    def terminate(self) -> None:
        self.terminated, self.returncode = True, -15

    def wait(self, timeout=None):
        return self.returncode


started: list[_FakeProcess] = []


def _interrupt(_seconds: float) -> None:
    raise KeyboardInterrupt


def test_mmcse_ui_prints_both_urls_and_stops_both_on_ctrl_c(params, monkeypatch, capsys):
    started.clear()
    monkeypatch.setattr(views, "start_server", _FakeProcess)
    monkeypatch.setattr("time.sleep", _interrupt)  # Ctrl-C while both run
    monkeypatch.setattr(views, "optuna_dashboard_executable", lambda: "/opt/bin/optuna-dashboard")
    tracking.experiment(load_config("params.yaml"), "mcse")  # id 1 in a new SQLite store
    cli.main(["ui", "--port", "5124", "--dashboard-port", "8124"])
    out = capsys.readouterr().out
    assert "http://127.0.0.1:5124/#/experiments?workflowType=machine_learning" in out
    assert "  mmcse-mcse: http://127.0.0.1:5124/#/experiments/1/runs?workflowType=machine_learning" in out
    assert "http://127.0.0.1:8124/" in out
    assert [p.cmd[0] for p in started] == [sys.executable, "/opt/bin/optuna-dashboard"]
    assert started[0].env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false" and started[1].env is None
    assert started[0].env["PYTHONWARNINGS"] == "ignore:starlette.middleware.wsgi is deprecated"
    assert all(p.terminated for p in started)
    assert out.rstrip().endswith("\nstopped MLflow and optuna-dashboard")  # a normal stop: one line, no "error"


def test_the_ui_servers_run_in_their_own_process_group():
    """Issue 39.6: the terminal's Ctrl-C (SIGINT to the foreground process group) reaches `mmcse ui` alone;
    it stops the servers itself, so none tears down mid-request or looks like a crash."""
    proc = views.start_server([sys.executable, "-c", "import time; time.sleep(60)"], None)
    try:
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    finally:
        proc.terminate()
        proc.wait()


def test_experiment_urls_open_each_mmcse_experiment_in_the_training_view(params):
    import mlflow

    cfg = load_config("params.yaml")
    made = tracking.experiment(cfg, "mcse")
    old = mlflow.create_experiment("mmcse-ablate")  # made by an older mmcse: no kind tag
    mlflow.create_experiment("someone-else")
    urls = tracking.experiment_urls(cfg, "http://127.0.0.1:5000")
    view = "workflowType=machine_learning&viewStateShareKey=mmcse-headline"  # the runs view, headline columns
    assert urls == {
        "mmcse-ablate": f"http://127.0.0.1:5000/#/experiments/{old}/runs?{view}",
        "mmcse-mcse": f"http://127.0.0.1:5000/#/experiments/{made}/runs?{view}",
    }
    tags = mlflow.MlflowClient().get_experiment(old).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert tracking.latest_ablation_url(cfg, "http://127.0.0.1:5000") is None  # no ablation ran yet
    for name in ("ablation dalr-table3", "mcse-seed1", "ablation variants"):
        with mlflow.start_run(experiment_id=old, run_name=name) as run:
            time.sleep(0.01)  # start times apart (milliseconds)
    assert tracking.latest_ablation_url(cfg, "http://127.0.0.1:5000") == (
        f"http://127.0.0.1:5000/#/experiments/{old}/runs/{run.info.run_id}?workflowType=machine_learning")


def test_mmcse_ui_without_optuna_dashboard_says_how_to_install_it(params, monkeypatch, capsys):
    started.clear()
    monkeypatch.setattr(views, "start_server", _FakeProcess)
    monkeypatch.setattr("time.sleep", _interrupt)
    monkeypatch.setattr(views, "optuna_dashboard_executable", lambda: None)
    cli.main(["ui"])
    out = capsys.readouterr().out
    assert "pip install -e '.[dashboard]'" in out and "http://127.0.0.1:5000/" in out
    assert len(started) == 1 and started[0].terminated


def test_mmcse_ui_stops_the_other_server_when_one_exits(params, monkeypatch, capsys):
    started.clear()
    monkeypatch.setattr(views, "start_server", _FakeProcess)

    def mlflow_dies(_seconds: float) -> None:
        started[0].returncode = 1  # e.g. the port was taken

    monkeypatch.setattr("time.sleep", mlflow_dies)
    monkeypatch.setattr(views, "optuna_dashboard_executable", lambda: "/opt/bin/optuna-dashboard")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["ui"])
    assert exit_.value.code == 1 and "mlflow (exit 1) stopped" in capsys.readouterr().err
    assert started[1].terminated


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_real_mlflow_server_lists_mmcse_experiments_in_the_training_view(params):
    cfg = load_config("params.yaml")
    made = tracking.experiment(cfg, "mcse")
    port = _free_port()
    log = params / "mlflow-server.log"
    with log.open("w") as sink:  # a file, not a pipe: an unread pipe would block the server
        proc = subprocess.Popen(views.ui_commands(cfg, port=port)["mlflow"], stdout=sink, stderr=sink,
                                env={**os.environ, **views.UI_MLFLOW_ENV})
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search", method="POST",
            data=json.dumps({"max_results": 100}).encode(), headers={"Content-Type": "application/json"})
        listed = None
        for _ in range(240):  # until the server answers (startup: a few seconds)
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    listed = json.load(response)["experiments"]
                break
            except OSError:  # not listening yet
                time.sleep(0.25)
        assert listed is not None, "mlflow server did not answer"
        found = {e["name"]: e for e in listed}
        assert found["mmcse-mcse"]["experiment_id"] == made
        tags = {t["key"]: t["value"] for t in found["mmcse-mcse"].get("tags", [])}
        assert tags["mlflow.experimentKind"] == "custom_model_development"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
