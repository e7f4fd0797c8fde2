"""The train stage on several processes (issue 37: ``train.devices: 2``, ``train.nodes: 2``; gloo on this machine's
CPUs): the same dev scores and weights as one process; a killed rank fails the job, Ctrl-C stops every rank after rank
0's resume point, and a rerun resumes all of them from it."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import yaml
from safetensors.torch import load_file

from tests.conftest import REPO, prepare_project, stage_here
from tests.training.test_duet import duet_params

pytestmark = pytest.mark.slow  # the real stage, torchrun and its processes


def _params(project: Path, **train) -> None:
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["train"].update(dropout_rng="per_row", **train)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def _stage(project: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(REPO / "stages/train.py")], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def _finished(project: Path) -> str:
    stage = _stage(project)
    log = stage.communicate(timeout=600)[0]
    assert stage.returncode == 0, log[-3000:]
    return log


def _runs(project: Path) -> list:
    from mmcse import tracking
    from mmcse.experiments.params import load_config

    tracking.configure(load_config(project / "params.yaml"))
    return mlflow.search_runs(experiment_names=["mmcse-mcse"], output_format="list")


def _dev(project: Path) -> list[tuple[int, float]]:
    with open(project / "plots/dev.csv") as handle:
        return [(int(row["step"]), float(row["dev"])) for row in csv.DictReader(handle)]


def test_two_machines_train_as_one_process_and_node_0_alone_writes(project: Path):
    """``train.nodes: 2`` as a user runs it on two machines (here two checkouts on one): node 0 runs the stage,
    node 1 joins with ``MMCSE_NODE_RANK=1`` at ``train.master_addr:master_port`` (torchrun's static rendezvous),
    only node 0's checkout gets outputs, and the two processes train as one: the same dev scores and weights
    as the stage on one process (the launch on one machine, ``--standalone``, trains in the kill/resume test
    below; the step's equality on 2 ranks, every method, in tests/training/test_distributed.py)."""
    _params(project)
    one = project.parent / "one"
    shutil.copytree(project, one)
    assert stage_here("train", one).returncode == 0  # the reference: one process, in this one
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _params(project, nodes=2, master_addr="127.0.0.1", master_port=port)
    other = project.parent / "node1"
    shutil.copytree(project, other)
    node0 = _stage(project)
    node1 = subprocess.Popen([sys.executable, str(REPO / "stages/train.py")], cwd=other, text=True,
                             env={**os.environ, "MMCSE_NODE_RANK": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    log0, log1 = node0.communicate(timeout=600)[0], node1.communicate(timeout=600)[0]
    assert node0.returncode == 0 and node1.returncode == 0, (log0[-2000:], log1[-2000:])
    assert not (other / "models").exists() and not (other / "metrics/train.json").exists()

    assert log0.count("train mcse: 100%") >= 1 and "[rank1]" not in log0  # one progress bar: rank 0's
    want, got = json.loads((one / "metrics/train.json").read_text()), json.loads(
        (project / "metrics/train.json").read_text())
    assert got.keys() == want.keys() and got["steps"] == want["steps"] == 8
    for key, value in want.items():  # float32: the two ranks' matrix products round differently
        assert got[key] == pytest.approx(value, abs=1e-3), key
    assert [s for s, _ in _dev(project)] == [s for s, _ in _dev(one)] == [0, 4, 8]
    assert [d for _, d in _dev(project)] == pytest.approx([d for _, d in _dev(one)], abs=1e-3)
    trained = load_file(project / "models/student/last/student.safetensors")
    alone = load_file(one / "models/student/last/student.safetensors")
    assert trained.keys() == alone.keys()
    assert max((trained[k] - alone[k]).abs().max().item() for k in alone) < 1e-4
    initial = load_file(one / "models/student/best/model.safetensors")  # best at step 0: the initial encoder
    assert json.loads((one / "models/student/best/train_state.json").read_text())["step"] == 0
    moved = max((alone[k] - initial[k.removeprefix("backbone.")]).abs().max().item()
                for k in alone if k.startswith("backbone."))
    assert moved > 1e-3  # the weights did train: the agreement above is not that of two untouched models
    (run,) = _runs(project)  # rank 1 opened no run
    assert run.data.tags["mmcse.processes"] == "2" and run.info.status == "FINISHED"


def _rank(stage: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(stage.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process of rank {rank}")


def _step_of(project: Path) -> int:
    state = project / "models/student/last/state.json"
    return json.loads(state.read_text())["step"] if state.is_file() else -1


def _wait_for_step(project: Path, stage: subprocess.Popen, beyond: int) -> int:
    deadline = time.monotonic() + 300
    while (step := _step_of(project)) <= beyond and time.monotonic() < deadline and stage.poll() is None:
        time.sleep(0.05)
    assert step > beyond and stage.poll() is None, stage.communicate()[0][-3000:] if stage.poll() is not None else ""
    return step


def test_a_killed_rank_fails_the_job_ctrl_c_stops_every_rank_and_the_rerun_resumes(project: Path):
    # a resume point every 4 steps: killed after the first, stopped after the next (about step 12), then finished
    _params(project, devices=2, epochs=100, max_steps=48, eval_steps=40, checkpoint_steps=4)

    stage = _stage(project)
    _wait_for_step(project, stage, 0)
    _rank(stage, 1).send_signal(signal.SIGKILL)
    log = stage.communicate(timeout=120)[0]
    assert stage.returncode == 2, log[-3000:]  # failed with its error, not hung
    # issue 53.4/53.7: one line, naming the rank and the signal; torchrun's report in the file it names
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 was killed by SIGKILL and printed no error; "), log[-3000:]
    report = Path(last.rsplit("torchrun's report: ", 1)[1].rstrip(")"))
    assert report.parent == project / "mlruns/launch" and "exitcode  : -9" in report.read_text()
    assert sum(line.startswith("error:") for line in log.splitlines()) == 1
    assert "Traceback" not in log and "OMP_NUM_THREADS" not in log
    killed_at = _step_of(project)

    stage = _stage(project, start_new_session=True)
    _wait_for_step(project, stage, killed_at)  # resumed, and a later resume point written
    os.killpg(stage.pid, signal.SIGINT)  # a terminal's Ctrl-C
    log = stage.communicate(timeout=120)[0]
    assert stage.returncode == 128 + signal.SIGINT, log[-3000:]
    # rank 0's reason, once (every rank's copy is in the log it names)
    (line,) = [line for line in log.splitlines() if line.startswith("error:")]
    assert line == log.strip().splitlines()[-1]
    assert line.startswith("error: stopped on SIGINT: resume point written at step ")
    assert "(every process stopped; their output: " in line and "Traceback" not in log
    stopped_at = _step_of(project)
    assert killed_at < stopped_at < 48
    (run,) = _runs(project)  # one run throughout: resumed, not restarted
    assert run.info.status == "KILLED"

    # issue 53.2: `dvc exp run` checks the folder out of its commit first (here: none); the kept copy puts it back
    shutil.rmtree(project / "models/student")
    _finished(project)
    (run,) = _runs(project)
    assert run.info.status == "FINISHED" and run.data.tags["mmcse.resumed_from_step"] == str(stopped_at)
    assert not any((project / "data/resume").iterdir())
    assert json.loads((project / "metrics/train.json").read_text())["steps"] == 48
    assert _step_of(project) == 48


def test_duet_on_two_processes_trains_as_on_one(tmp_path: Path):
    """DUET (its dropout keyed by row in BERT and its own layers): the same val rsums at every evaluation and the
    same best checkpoint's step, on 2 processes as on 1."""
    raw = duet_params()
    raw["train"].update(dropout_rng="per_row", max_steps=6, eval_steps=2)
    one = tmp_path / "one"
    one.mkdir()
    prepare_project(one, raw)
    assert stage_here("cache_regions", one).returncode == 0
    two = tmp_path / "two"
    shutil.copytree(one, two)
    _params(two, devices=2)
    assert stage_here("train", one).returncode == 0  # the reference: one process, in this one
    log = _finished(two)
    assert "train duet: 100%" in log
    want, got = (json.loads((p / "metrics/train.json").read_text()) for p in (one, two))
    assert got == want and want["steps"] == 6  # rsums are sums of recall percentages: equal, not close
    assert _dev(two) == _dev(one) and len(_dev(one)) == 4
    for name in ("duet.safetensors", "model.safetensors"):
        trained, alone = (load_file(p / "models/student/best" / name) for p in (two, one))
        assert max((trained[k] - alone[k]).abs().max().item() for k in alone) < 1e-3, name
