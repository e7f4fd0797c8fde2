"""`mmcse.stopping` and `mmcse.io.hold_outputs`: a stage stops cleanly on SIGTERM / Ctrl-C or when its
dvc parent dies, and two stages never write one output (issue 33, item 6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import mlflow
import psutil
import pytest
import torch
from safetensors.torch import load_file

from mmcse import stopping, tracking
from mmcse.config import with_overrides
from mmcse.errors import StageError
from mmcse.experiments.params import load_config
from mmcse.io import hold_outputs
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import run_train
from mmcse.training.engine import Hooks
from tests.conftest import REPO, stage_here


@pytest.fixture
def handlers():
    """`stopping.install()` for the test, the previous handlers and a clear flag afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stopping.reset()
    stopping.install()
    yield
    for s, h in before.items():
        signal.signal(s, h)
    stopping.reset()


@pytest.mark.slow  # a training process signalled (~4 s)
def test_sigterm_during_training_writes_a_resume_point_ends_the_run_killed_and_resumes(project, handlers):
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 2,
                                                        "train.checkpoint_steps": 4})
    full = run_train(cfg, Paths.of(cfg), out_dir=project / "full", hooks=Hooks(progress=False))

    def terminate_at_6(step, score):
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill <pid>` or a dying dvc parent sends it

    with pytest.raises(stopping.StopRequested) as stop:
        run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False, on_eval=terminate_at_6))
    assert stop.value.exit_code == 128 + signal.SIGTERM
    assert str(stop.value).startswith("stopped on SIGTERM: resume point written at step 6 of 8")
    assert json.loads((project / "m/last/state.json").read_text())["step"] == 6  # not the step-4 checkpoint
    run = mlflow.get_run(tracking.remembered_run(project / "m")["run_id"])
    assert run.info.status == "KILLED"
    assert run.data.tags[tracking.END_REASON_TAG].startswith("stopped on SIGTERM: resume point written at step 6")
    stopping.reset()
    resumed = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    assert resumed["run_id"] == run.info.run_id  # one run, continued
    a, b = (load_file(str(project / d / "last/student.safetensors")) for d in ("full", "m"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert resumed["best_dev"] == full["best_dev"]


def test_outside_a_training_and_on_a_second_signal_it_stops_at_once(handlers):
    with pytest.raises(stopping.StopRequested, match="stopped on SIGINT"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs at the next bytecode
    stopping.reset()
    with stopping.graceful():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert stopping.requested()  # the first one only asks
        with pytest.raises(stopping.StopRequested):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)


@pytest.mark.slow  # two processes (~3 s)
def test_a_stage_whose_dvc_parent_dies_stops_instead_of_running_on_as_an_orphan(tmp_path):
    """kill -9 of the parent (as of `dvc`): the stage sees it within a second or two and ends as on
    SIGTERM; outside DVC (no DVC_STAGE) nothing is watched."""
    stage = tmp_path / "stage.py"
    stage.write_text(textwrap.dedent(f"""
        import sys, time
        from mmcse import stopping
        stopping.install()
        stopping.watch_parent(poll_seconds=0.2)
        try:
            while True:
                time.sleep(0.05)
        except stopping.StopRequested as err:
            open({str(tmp_path / 'ended')!r}, "w").write(str(err.exit_code))
            sys.exit(err.exit_code)
    """))
    fake_dvc = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, {str(stage)!r}]); "
                "print(p.pid, flush=True); p.wait()")
    dvc = subprocess.Popen([sys.executable, "-c", fake_dvc], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "DVC_STAGE": "train"})
    child = psutil.Process(int(dvc.stdout.readline()))
    time.sleep(1.0)  # the stage is up and watching
    dvc.kill()
    dvc.wait()
    child.wait(timeout=20)
    assert (tmp_path / "ended").read_text() == str(128 + signal.SIGTERM)


def test_a_second_stage_on_the_same_output_fails_at_once_naming_the_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mmcse.io import hold_outputs\n"
                               "with hold_outputs(['models/student'], 'the train stage'):\n"
                               "    print('held', flush=True); time.sleep(60)"],
                              cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StageError) as err:
            with hold_outputs(["models/student"], "the train stage"):
                pass
        assert str(err.value).startswith(f"models/student: in use by the train stage (pid {holder.pid}, started ")
        assert f"kill {holder.pid}" in str(err.value) and "\n" not in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    with hold_outputs(["models/student"], "the train stage"):  # the kernel let go with the process
        pass


@pytest.mark.slow  # a stage process on the prepared project (the second start, refused, in this one)
def test_the_train_stage_refuses_to_start_while_another_one_runs(project, capsys):
    import yaml

    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["train"].update(epochs=1000, max_steps=8000, eval_steps=4000, checkpoint_steps=4000)  # still running then
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = project / "first.log"
    first = subprocess.Popen([sys.executable, str(REPO / "stages/train.py")], cwd=project, env=env,
                             stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and first.poll() is None and "train mcse:" not in log.read_text():
            time.sleep(0.2)  # the first stage holds models/student and trains (its progress bar is up)
        second = stage_here("train", project, capsys)  # in this process: the first holds the outputs
        assert second.returncode == 2
        assert second.stderr.strip().startswith(f"error: {Paths.of(load_config(project / 'params.yaml')).student}: "
                                                f"in use by the train stage (pid {first.pid}")
        first.send_signal(signal.SIGTERM)
        first.wait(60)
        assert first.returncode == 128 + signal.SIGTERM  # stopped at a resume point
        assert "error: stopped on SIGTERM: resume point written at step " in log.read_text()
    finally:
        if first.poll() is None:
            first.kill()
