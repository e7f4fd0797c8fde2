"""`mmcse.training.checkpoints`: a result always comes from its configuration's finished training.

Each test reproduces a fault probe of issue 33 on the demo project: another configuration's
interrupted run left in the folder, a deleted or same-size-damaged ``best/``, a diverged run.
"""

import json
import os
import shutil

import mlflow
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmcse import tracking
from mmcse.config import with_overrides
from mmcse.errors import CorruptArtifact, StoppedEarly, TrainingDiverged
from mmcse.experiments.params import load_config
from mmcse.integrity.files import SEAL, check_model_folder, read_seal
from mmcse.pipeline.evaluate import require_trained_with
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import run_train
from mmcse.training.checkpoints import plan_start, run_definition_hash
from mmcse.training.divergence import DivergenceWatch
from mmcse.training.engine import Hooks
from mmcse.training.loop import train


class Killed(Exception):
    pass


def kill_at(step_to_kill):
    def on_eval(step, score):
        if step == step_to_kill:
            raise Killed

    return on_eval


def tensors(path):
    return load_file(str(path))


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def overwrite_tensor_data(path, seed=0):
    """Random bytes over the last 256 bytes of a safetensors file's data: same size, header intact."""
    data = bytearray(path.read_bytes())
    data[-256:] = np.random.default_rng(seed).integers(0, 256, 256, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


@pytest.fixture
def cfg(project):
    return with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 4,
                                                        "train.checkpoint_steps": 4})


def test_every_checkpoint_is_sealed_with_its_configuration_step_and_digests(project, cfg):
    result = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    sealed = check_model_folder(project / "m/best", "")
    assert sealed["config_hash"] == run_definition_hash(cfg) and sealed["step"] == result.best_step
    listed = {p.relative_to(project / "m/best").as_posix() for p in (project / "m/best").rglob("*")
              if p.is_file() and p.name != SEAL}
    assert set(sealed["files"]) == listed and "model.safetensors" in listed and "1_Pooling/config.json" in listed
    state = json.loads((project / "m/last/state.json").read_text())
    assert state["config_hash"] == run_definition_hash(cfg) and set(state["files"]) == {"student.safetensors",
                                                                                        "trainer.pt"}
    assert require_trained_with(cfg, project / "m/best") == run_definition_hash(cfg)
    # another configuration is refused by name before evaluation (a number means what it says)
    with pytest.raises(ValueError, match="trained with another configuration than params.yaml's"):
        require_trained_with(with_overrides(cfg, {"train.max_steps": 22}), project / "m/best")


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_another_configurations_interrupted_run_never_becomes_the_result(project, cfg):
    """Issue 33.1: A trained; B (train.max_steps changed) started in the same folder and killed early;
    A again must give A's own best checkpoint, not B's untrained one."""
    out = project / "m"
    a = train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    a_best = tensors(out / "best/model.safetensors")
    other = with_overrides(cfg, {"train.max_steps": 12})
    with pytest.raises(Killed):  # killed before B's first checkpoint: B wrote nothing
        train(other, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=kill_at(4), progress=False))
    assert read_seal(out / "best", "")["config_hash"] == run_definition_hash(cfg)
    again = train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    assert (again.best_step, again.best_score) == (a.best_step, a.best_score)
    assert_same_tensors(tensors(out / "best/model.safetensors"), a_best)

    # B killed after its first checkpoint (step 4: B's best/ and last/ written): A is retrained from step 0
    # (its best weights are gone) and ends with the same checkpoint
    with pytest.raises(Killed):
        train(other, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=kill_at(8), progress=False))
    assert read_seal(out / "best", "")["config_hash"] == run_definition_hash(other)
    evals = []
    again = train(
        cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False),
    )
    assert evals == [4, 8] and (again.best_step, again.best_score) == (a.best_step, a.best_score)
    assert_same_tensors(tensors(out / "best/model.safetensors"), a_best)
    assert read_seal(out / "best", "")["config_hash"] == run_definition_hash(cfg)


def edit_training_code(monkeypatch, name="mmcse/methods/terms/mcse.py"):
    """As if ``name`` had been edited since: the code map checkpoints see differs in that file."""
    import mmcse.training.checkpoints as checkpoints

    real = checkpoints.code_files
    monkeypatch.setattr(checkpoints, "code_files", lambda roots: {**real(roots), name: "0" * 64})


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_a_planned_stop_leaves_its_best_checkpoint_and_a_resume_point_a_crash_does_not(project):
    """`StoppedEarly` (a pruned sweep trial) at the step-2 evaluation, between checkpoints: the best weights
    held so far and a resume point are written before it propagates; any other exception there is a crash,
    which leaves nothing new (the folder as its last checkpoint left it)."""
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 2,
                                                       "train.checkpoint_steps": 8})
    scores = {}

    def prune_at_4(step, score):
        scores[step] = score
        if step == 4:
            raise StoppedEarly("pruned at step 4")

    with pytest.raises(StoppedEarly) as stopped:
        train(cfg, "data/raw", "data/teachers", project / "pruned", hooks=Hooks(on_eval=prune_at_4, progress=False))
    sealed = check_model_folder(project / "pruned/best", "")
    assert sealed["step"] == stopped.value.best_step and sealed["config_hash"] == run_definition_hash(cfg)
    # the best of the evaluations so far (the initial one, step 0, is not reported to on_eval)
    assert stopped.value.best_score >= max(scores.values())
    if stopped.value.best_step > 0:
        assert scores[stopped.value.best_step] == stopped.value.best_score
    assert json.loads((project / "pruned/last/state.json").read_text())["step"] == 4

    with pytest.raises(Killed):
        train(cfg, "data/raw", "data/teachers", project / "killed", hooks=Hooks(on_eval=kill_at(4), progress=False))
    assert not (project / "killed/best").exists() and not (project / "killed/last").exists()


def test_a_checkpoint_of_code_edited_since_is_trained_again_not_taken(project, cfg, monkeypatch):
    """A finished run, and a run killed after its first checkpoint, then an edit of a loss: DVC reruns
    the stage, which must train from step 0 (not stop at the sealed best/, not continue the resume
    point), and evaluation refuses the old best/ naming the file."""
    out = project / "m"
    train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    edit_training_code(monkeypatch)
    plan = plan_start(out, run_definition_hash(cfg))
    assert plan.resume_from is None and "trained by other library code" in plan.reason
    assert "mmcse/methods/terms/mcse.py" in plan.reason and plan.reason.endswith("retrained from step 0")
    with pytest.raises(ValueError, match=r"other library code \(changed since: mmcse/methods/terms/mcse.py\)"):
        require_trained_with(cfg, out / "best")
    evals = []
    train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False))
    assert evals == [4, 8]  # from step 0
    sealed = read_seal(out / "best", "")
    assert sealed["config_hash"] == run_definition_hash(cfg)
    assert sealed["code_files"]["mmcse/methods/terms/mcse.py"] == "0" * 64
    assert require_trained_with(cfg, out / "best") == run_definition_hash(cfg)

    # killed after its checkpoint at step 4, then another edit: not continued from step 4
    shutil.rmtree(out)
    with pytest.raises(Killed):
        train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=kill_at(8), progress=False))
    edit_training_code(monkeypatch, "mmcse/training/loop.py")
    evals = []
    train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False))
    assert evals == [4, 8]


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_the_mlflow_run_continued_is_only_ever_the_same_configurations(project, cfg):
    out = project / "m"
    first = run_train(cfg, Paths.of(cfg), out_dir=out, hooks=Hooks(progress=False))
    other = with_overrides(cfg, {"train.max_steps": 12})
    with pytest.raises(Killed):
        run_train(other, Paths.of(other), out_dir=out, hooks=Hooks(on_eval=kill_at(4), progress=False))
    killed = tracking.remembered_run(out)["run_id"]
    assert killed != first["run_id"] and mlflow.get_run(killed).info.status in ("KILLED", "FAILED")
    again = run_train(cfg, Paths.of(cfg), out_dir=out, hooks=Hooks(progress=False))
    assert again["run_id"] == first["run_id"]  # A's own run, not B's
    assert mlflow.get_run(killed).data.metrics.get("best_dev_sts") is None  # B's run got none of A's record


def test_a_deleted_best_is_rebuilt_from_the_resume_point_or_retrained(project, cfg):
    """Issue 33.2: a missing best/ is damage, never a finished run."""
    out = project / "m"
    first = train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    best = tensors(out / "best/model.safetensors")
    shutil.rmtree(out / "best")
    state = json.loads((out / "last/state.json").read_text())
    evals = []
    again = train(
        cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False),
    )
    # the best step is the last one: rebuilt from the resume point without a step; else retrained
    assert evals == ([] if state["best_step"] == state["step"] else [4, 8])
    assert (again.best_step, again.best_score) == (first.best_step, first.best_score)
    assert_same_tensors(tensors(out / "best/model.safetensors"), best)
    check_model_folder(out / "best", "")

    # the rebuild path, whatever the demo's best step: a resume point whose best is its own step
    state["best_step"] = state["step"]
    (out / "last/state.json").write_text(json.dumps(state))
    shutil.rmtree(out / "best")
    assert plan_start(out, run_definition_hash(cfg)).rewrite_best
    evals.clear()
    train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False))
    assert evals == [] and read_seal(out / "best", "")["step"] == state["step"]
    assert_same_tensors(tensors(out / "best/model.safetensors"),
                        {k[len("backbone."):]: v for k, v in tensors(out / "last/student.safetensors").items()
                         if k.startswith("backbone.")})


def test_same_size_damage_inside_a_checkpoint_is_named_and_rebuilt(project, cfg, caplog):
    """Issue 33.4: random bytes over a tensor's data pass the header checks, not the seal."""
    from mmcse.evaluation.sts import TextEncoder

    out = project / "m"
    first = train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    weights = out / "best/model.safetensors"
    size = weights.stat().st_size
    overwrite_tensor_data(weights)
    assert weights.stat().st_size == size
    with pytest.raises(CorruptArtifact, match="model.safetensors: content does not match the SHA-256"):
        require_trained_with(cfg, out / "best")
    with pytest.raises(CorruptArtifact, match="does not match the SHA-256"):
        TextEncoder(str(out / "best"), "cls_before_pooler")  # mmcse eval and the evaluate stage load through it
    again = train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    assert f"{weights}: content does not match the SHA-256" in caplog.text
    assert again.best_score == first.best_score
    check_model_folder(out / "best", "")

    # the resume point's weights, same-size damaged: named, never restored
    caplog.clear()
    overwrite_tensor_data(out / "last/student.safetensors")
    plan = plan_start(out, run_definition_hash(cfg))
    assert plan.resume_from is None and "student.safetensors: content does not match the SHA-256" in plan.reason


def test_a_diverged_run_stops_at_the_first_non_finite_step_and_saves_nothing(project, cfg):
    """Issue 33.3: learning rate 1e30, as `dvc exp run -S train.learning_rate=1e30` does."""
    out = project / "m"
    diverging = with_overrides(cfg, {"train.learning_rate": 1e30})
    with pytest.raises(TrainingDiverged, match=r"training diverged at step \d+: .*likely cause: "
                                               r"train.learning_rate 1e\+30 is far above"):
        train(diverging, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    for path in out.rglob("*.safetensors"):  # whatever was written holds finite numbers only
        assert all(torch.isfinite(t).all() for t in tensors(path).values()), path


def test_a_diverged_run_ends_failed_with_its_reason_and_the_stage_exits_non_zero(project, cfg, capsys):
    from mmcse.entry import run_entry

    diverging = with_overrides(cfg, {"train.learning_rate": 1e30})
    with pytest.raises(SystemExit) as exit_info:
        run_entry(lambda: run_train(
            diverging, Paths.of(diverging), out_dir=project / "m", hooks=Hooks(progress=False),
        ))
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: training diverged at step ") and "\n" not in line
    run = mlflow.get_run(tracking.remembered_run(project / "m")["run_id"])
    assert run.info.status == "FAILED"
    assert run.data.tags[tracking.END_REASON_TAG].startswith("TrainingDiverged: training diverged at step ")


def test_the_divergence_watch_reports_the_first_bad_step_without_a_sync_per_step(device):
    cfg = load_config_of_repo()
    watch = DivergenceWatch(device)
    one = torch.ones((), device=device)
    watch.observe(1, one, one)
    watch.check(cfg)  # finite: nothing
    watch.observe(2, one, torch.tensor(float("inf"), device=device))
    watch.observe(3, torch.tensor(float("nan"), device=device), one)
    with pytest.raises(TrainingDiverged, match=r"at step 2: gradient norm = inf \(loss 1\)"):
        watch.check(cfg)
    nan_first = DivergenceWatch(device)
    nan_first.observe(5, torch.tensor(float("nan"), device=device), None)
    with pytest.raises(TrainingDiverged, match="at step 5: loss = nan"):
        nan_first.check(cfg)


def load_config_of_repo():
    from tests.conftest import REPO

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return load_config("params.yaml")
    finally:
        os.chdir(cwd)


def test_checkpoints_and_the_data_folder_follow_the_umask(project, cfg):
    """Issue 33.13: best/, last/ (safetensors writes 0600) and data/raw (built in a mkdtemp folder)."""
    import stat

    old = os.umask(0o022)
    try:
        train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    finally:
        os.umask(old)
    modes = {p.relative_to(project).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [project / "m", *(project / "m").rglob("*")]}
    assert {m for p, m in modes.items() if (project / p).is_dir()} == {0o755}
    assert {m for p, m in modes.items() if (project / p).is_file()} == {0o644}, modes
    assert stat.S_IMODE((project / "data/raw").stat().st_mode) == 0o755


def test_a_full_disk_at_a_checkpoint_is_one_line_and_loses_nothing(project, cfg, monkeypatch):
    """Issue 33.10: ENOSPC while writing the step-8 resume point (safetensors says "os error 28"), then
    while sealing a best checkpoint: one line naming the folder and the size it needs, no temporary
    folder left, the previous checkpoint intact and resumable."""
    import errno

    import mmcse.training.checkpoints as checkpoints
    from mmcse.errors import StageError

    out = project / "m"
    real_save, calls = checkpoints.save_file, []

    def full_at_second(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                               "\"No space left on device\" }) (os error 28)")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_file", full_at_second)
    with pytest.raises(StageError) as err:
        train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    assert str(err.value).startswith(f"{out / 'last'}: no space left on the device while writing it (it needs about ")
    assert "the previous checkpoint is intact" in str(err.value) and "\n" not in str(err.value)
    assert not (out / "last.tmp").exists() and not (out / "best.tmp").exists()
    assert json.loads((out / "last/state.json").read_text())["step"] == 4
    assert plan_start(out, run_definition_hash(cfg)).resume_from == out / "last"

    monkeypatch.setattr(checkpoints, "save_file", real_save)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints, "seal_folder", no_space)
    shutil.rmtree(out / "best")  # so the next run writes one (rebuilt, or at its first checkpoint)
    last = (out / "last/state.json").read_text()
    with pytest.raises(StageError, match=rf"^{out / 'best'}: no space left on the device"):
        train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    assert not (out / "best.tmp").exists() and (out / "last/state.json").read_text() == last


def test_tied_weights_round_trip_through_a_resume_file(tmp_path):
    """BERT's LM head (loss.simcse.mlm) ties its bias to its decoder's: both keys are written, as
    copies, and loading the file fills the one shared parameter again."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertForMaskedLM

    from mmcse.training.checkpoints import unshared

    torch.manual_seed(0)
    head = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=16)).cls
    with torch.no_grad():
        head.predictions.bias.uniform_()
    assert head.predictions.decoder.bias is head.predictions.bias
    save_file(unshared(head.state_dict()), str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(loaded["predictions.bias"], head.predictions.bias.detach())
    assert torch.equal(loaded["predictions.decoder.bias"], head.predictions.bias.detach())
    torch.manual_seed(1)
    fresh = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=16)).cls
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.predictions.bias, head.predictions.bias)
    assert fresh.predictions.decoder.bias is fresh.predictions.bias


def test_a_resume_point_is_written_beside_training_from_a_snapshot_of_its_step(tmp_path, monkeypatch):
    """`Checkpoints.save` returns while the resume point is still being written (on a thread), what it writes is
    the weights and optimizer state of the step it was called at (training on meanwhile changes neither), the
    next save waits for it, and a write that fails raises at the next wait."""
    import threading

    import mmcse.training.checkpoints as checkpoints
    from mmcse.models.precision import grad_scaler
    from mmcse.training.checkpoints import Checkpoints, TrainState

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = grad_scaler("fp32", torch.device("cpu"))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    moment = optimizer.state[model.weight]["exp_avg"].clone()

    release, writing = threading.Event(), threading.Event()
    real_write = checkpoints.write_resume_point

    def held_write(*args, **kwargs):
        writing.set()
        assert release.wait(10)
        real_write(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "write_resume_point", held_write)
    ckpt = Checkpoints(tmp_path, "hash", lambda tmp, state: None)
    ckpt.save(model, optimizer, scheduler, scaler, TrainState(step=3))
    assert writing.wait(10) and not (tmp_path / "last").exists()  # save returned; the write is in flight
    for _ in range(2):  # training goes on
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    release.set()
    ckpt.wait()
    assert json.loads((tmp_path / "last/state.json").read_text())["step"] == 3
    assert_same_tensors(tensors(tmp_path / "last/student.safetensors"), at_save)
    trainer = torch.load(tmp_path / "last/trainer.pt", weights_only=True)
    assert torch.equal(trainer["optimizer"]["state"][0]["exp_avg"], moment)

    def failing_write(folder, snapshot, config_hash):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints, "write_resume_point", failing_write)
    ckpt.save(model, optimizer, scheduler, scaler, TrainState(step=5))  # returns: the failure is on the thread
    with pytest.raises(OSError, match="No space left"):
        ckpt.wait()
    assert json.loads((tmp_path / "last/state.json").read_text())["step"] == 3  # the previous one intact
