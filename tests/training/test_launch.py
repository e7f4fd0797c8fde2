"""Starting a job on several processes (`mmcse.training.launch`, `mmcse.processes`): how many, torchrun's command
on one machine and on several, what is refused before any compute, and that the number of processes is not part
of what a run or a job is (a resume point carries over from 1 process to N)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmcse import processes
from mmcse.config import ConfigError, with_overrides
from mmcse.experiments.jobs import job_hash
from mmcse.experiments.params import load_config
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import run_train
from mmcse.training import launch
from mmcse.training.checkpoints import Checkpoints, TrainState, run_definition_hash
from tests.conftest import REPO, params_copy

TORCHRUN_ENV = ("LOCAL_RANK", "WORLD_SIZE", "RANK", processes.NODE_RANK)


@pytest.fixture
def cfg(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    return with_overrides(load_config(REPO / "params.yaml"), {"train.dropout_rng": "per_row", "base.device": "cpu"})


def test_devices_resolve_to_processes_per_machine(cfg):
    assert launch.processes_per_node(with_overrides(cfg, {"train.devices": 4}).train, "cpu") == 4
    auto = with_overrides(cfg, {"train.devices": "auto"}).train
    assert launch.processes_per_node(auto, "cpu") == 1  # a CPU job: one process
    assert launch.processes_per_node(auto, "auto") == max(torch.cuda.device_count(), 1)
    assert launch.processes(with_overrides(cfg, {"train.devices": 2, "train.nodes": 4}).train, "cpu") == 8


def test_one_machine_runs_torchrun_standalone(cfg):
    train = with_overrides(cfg, {"train.devices": 2}).train
    assert launch.needs_launch(train, "cpu") and not launch.needs_launch(cfg.train, "cpu")
    assert launch.torchrun_command(train, "cpu", ["stages/train.py"]) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "stages/train.py"]


def test_each_machine_of_several_meets_node_0_at_the_master_address(cfg, monkeypatch):
    train = with_overrides(cfg, {"train.devices": 4, "train.nodes": 2, "train.master_addr": "10.0.0.7",
                                 "train.master_port": 29400}).train
    monkeypatch.setenv(processes.NODE_RANK, "1")
    assert launch.torchrun_command(train, "cpu", ["stages/train.py"])[3:] == [
        "--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.7", "--master-port=29400",
        "stages/train.py"]
    for bad in ("2", "-1", "one"):
        monkeypatch.setenv(processes.NODE_RANK, bad)
        with pytest.raises(ConfigError, match=rf"MMCSE_NODE_RANK='{bad}': must be a whole number in \[0, 1\]"):
            launch.torchrun_command(train, "cpu", ["stages/train.py"])
    assert not processes.holds_outputs()  # machine 1 writes nothing: it holds nothing either
    monkeypatch.setenv(processes.NODE_RANK, "0")
    assert processes.holds_outputs()


def test_a_process_torchrun_started_neither_launches_nor_holds_and_only_rank_0_leads(cfg, monkeypatch):
    train = with_overrides(cfg, {"train.devices": 2}).train
    assert processes.lead() and processes.holds_outputs()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert not launch.needs_launch(train, "cpu") and not processes.lead() and not processes.holds_outputs()
    monkeypatch.setenv("RANK", "0")
    assert processes.lead()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"train.devices": 2, "train.dropout_rng": "torch"}, "train.devices': needs train.dropout_rng: per_row"),
    ({"train.devices": 3}, "train.batch_size': 32 does not split evenly over 3 processes"),
    ({"train.devices": 2, "train.nodes": 3}, "train.batch_size': 32 does not split evenly over 6 processes"),
    ({"train.devices": 2, "train.method": "duet", "train.dropout_rng": "torch"},
     "train.devices': needs train.dropout_rng: per_row"),
    ({"train.devices": 2, "train.method": "vsrn", "train.dropout_rng": "torch"},
     "train.devices': vsrn trains on one process: its BatchNorm"),
    ({"train.devices": 2, "train.method": "vsepp", "model.vsepp.image_input": "pixels", "train.dropout_rng": "torch"},
     "train.devices': VSE.. on pixels trains on one process"),
    ({"train.method": "vsepp", "train.dropout_rng": "per_row"}, "vsepp's models have none to key"),
    ({"train.devices": 0}, "train.devices': must be >= 1"),
    ({"train.devices": "all"}, "train.devices': must be an integer or one of \\['auto'\\]"),
    ({"train.nodes": 2, "train.master_port": 70000}, "train.master_port': must be in \\[1, 65535\\]"),
])
def test_params_that_cannot_run_on_several_processes_are_refused_when_read(cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        with_overrides(cfg, overrides)


def test_auto_is_checked_against_the_gpus_it_finds(cfg, monkeypatch):
    train = with_overrides(cfg, {"train.devices": "auto", "train.batch_size": 30}).train
    monkeypatch.setattr(launch, "processes_per_node", lambda train, device: 4)
    with pytest.raises(ConfigError, match="batch_size=30 does not split evenly over the job's 4 processes "
                                          r"\(train.devices: auto is 4 here"):
        launch.check_split(train, "auto")


def test_several_processes_in_one_are_refused_before_any_compute(cfg, tmp_path):
    job = with_overrides(cfg, {"train.devices": 2})
    with pytest.raises(ConfigError, match="is 2 processes, which torchrun starts for the train stage"):
        run_train(job, Paths.of(job, tmp_path))  # nothing exists there: refused before it is read


def test_how_many_processes_is_not_what_a_run_or_a_job_is(cfg):
    spread = with_overrides(cfg, {"train.devices": 4, "train.nodes": 2, "train.master_addr": "10.0.0.7"})
    assert run_definition_hash(spread) == run_definition_hash(cfg)  # a resume point carries over
    assert job_hash(spread) == job_hash(cfg)
    assert run_definition_hash(with_overrides(cfg, {"train.batch_size": 16})) != run_definition_hash(cfg)


def test_a_rank_other_than_0_keeps_the_runs_best_but_writes_nothing(tmp_path: Path):
    written = []
    model = torch.nn.Linear(2, 2)
    checkpoints = Checkpoints(tmp_path, "hash", lambda tmp, state: written.append(tmp), writes=False)
    state = TrainState()
    checkpoints.consider(3.0, state, model)
    assert (state.best_score, state.best_step) == (3.0, 0) and checkpoints.best_weights is None
    checkpoints.save(model, None, None, None, state)
    assert list(tmp_path.iterdir()) == [] and written == []


REPORT = """Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 2398)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_05:40:25
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 2399)  (SIGKILL)
"""


@pytest.mark.parametrize(("rank", "code", "lines", "summary"), [
    (1, -9, [], "rank 1 was killed by SIGKILL and printed no error; the job's other processes were stopped"),
    (1, 3, [], "rank 1 exited with status 3 and printed no error"),
    (1, 1, ["[default1]:error: train.batch_size is too large\n"], "rank 1 failed: train.batch_size is too large"),
    (0, 1, ["[default0]:[rank0]: Traceback (most recent call last):\n", "[default0]:[rank0]:   File \"x.py\"\n",
            "[default0]:[rank0]: RuntimeError: Connection reset by peer\n"],
     "rank 0 failed: RuntimeError: Connection reset by peer"),
])
def test_a_failed_job_is_one_line_naming_the_rank_that_failed_first_and_how(tmp_path, capsys, rank, code, lines,
                                                                            summary):
    """Issues 53.4 and 53.7: torchrun's banner and report and the ranks' error lines stay in the log; the ranks'
    other lines reach the console without their prefix; the line names the root cause's rank and how it ended."""
    output = launch.LaunchOutput(tmp_path / "launch.log")
    with open(output.log, "w") as handle:
        for line in ["*****\n", "Setting OMP_NUM_THREADS environment variable for each process to be 1\n",
                     "[default0]:train mcse: 5%[default0]:\n", "[default0]:train mcse: 10%\n", "[default1]:\n",
                     "[default0]:Exception ignored in atexit callback: <function dump_compile_times>\n",
                     "[default0]:Traceback (most recent call last):\n", "[default0]:  File \"utils.py\", line 967\n",
                     "[default0]:mmcse.stopping.StopRequested: stopped on SIGTERM\n", *lines,
                     *REPORT.format(rank=rank, code=code).splitlines(keepends=True)]:
            output.take(line, handle)
    assert capsys.readouterr().out == "train mcse: 5%\ntrain mcse: 10%\n"
    assert output.failure(1) == f"{summary} (torchrun's report: {output.log})"
    assert "Root Cause" in output.log.read_text() and "OMP_NUM_THREADS" in output.log.read_text()
    (tmp_path / "launch.log").write_text("no report\n")
    assert output.failure(1).startswith("the job's processes failed (torchrun exit status 1; torchrun's report: ")



def test_the_train_stages_launcher_imports_no_training_stack(tmp_path):
    """With train.devices: 2 the stage's own process only starts torchrun and waits: its module and the decision
    import neither torch nor transformers nor MLflow (~7 s a process, and a GPU context held while the ranks train)."""
    probe = (f"import runpy, sys; runpy.run_path({str(REPO / 'stages/train.py')!r}); "
             "from mmcse.experiments.params import load_config; from mmcse.training import launch; "
             "cfg = load_config('params.yaml', {'train.devices': 2, 'train.dropout_rng': 'per_row'}); "
             "assert launch.needs_launch(cfg.train, cfg.base.device); "
             "print(sorted(m for m in ('torch', 'transformers', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=params_copy(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
