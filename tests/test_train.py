import json

import pytest
import torch
from safetensors.torch import load_file

from mmcse.config import load_config, with_overrides
from mmcse.train import PAIR, TEXT, alternation_schedule, train


def test_alternation_schedule_matches_mcse():
    # 78 text batches, 18 pair batches: ratio 4 -> TTTTP repeated, leftovers at the end
    s = alternation_schedule(78, 18)
    assert len(s) == 96 and s.count(PAIR) == 18 and s.count(TEXT) == 78
    assert s[:10] == [TEXT] * 4 + [PAIR] + [TEXT] * 4 + [PAIR]
    assert s[-6:] == [TEXT] * 6
    assert alternation_schedule(5, 0) == [TEXT] * 5
    assert alternation_schedule(2, 3) == [TEXT, PAIR, TEXT, PAIR, PAIR]


def _weights(folder):
    return load_file(str(folder / "last" / "student.safetensors"))


class Killed(Exception):
    pass


def test_killed_run_resumes_to_the_same_weights(project):
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 4,
                                                        "train.checkpoint_steps": 4})
    full = train(cfg, "data/raw", "data/teachers", project / "full", progress=False)
    assert full.steps == 8

    def kill_at_8(step, score):
        if step == 8:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, "data/raw", "data/teachers", project / "resumed", on_eval=kill_at_8, progress=False)
    assert json.loads((project / "resumed/last/state.json").read_text())["step"] == 4
    resumed = train(cfg, "data/raw", "data/teachers", project / "resumed", progress=False)
    assert resumed.steps == 8
    a, b = _weights(project / "full"), _weights(project / "resumed")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert full.history == resumed.history


def test_best_checkpoint_is_an_hf_folder_with_heads(project):
    from transformers import AutoModel

    cfg = load_config("params.yaml")
    result = train(cfg, "data/raw", "data/teachers", project / "m", progress=False)
    assert result.best_score == max(h["dev"] for h in result.history if "dev" in h)
    assert (result.best_dir / "model.safetensors").is_file() and (result.best_dir / "heads.safetensors").is_file()
    AutoModel.from_pretrained(result.best_dir)
    assert [h["step"] for h in result.history if "dev" in h] == [0, 4, 8]


def test_changed_config_does_not_resume_a_different_run(project):
    cfg = load_config("params.yaml")
    train(cfg, "data/raw", "data/teachers", project / "m", progress=False)
    other = with_overrides(cfg, {"loss.temperature": 0.1})
    result = train(other, "data/raw", "data/teachers", project / "m", progress=False)
    assert result.history[0]["step"] == 0 and result.steps == 8


def test_image_term_only_for_mcse(project):
    from mmcse.models import Student, load_backbone, load_tokenizer
    from mmcse.train import training_step_loss

    cfg = load_config("params.yaml")
    tok = load_tokenizer(cfg.model.name_or_path)
    student = Student(load_backbone(cfg.model), 16, cfg.model.proj_dim)
    batch = dict(tok(["a red circle", "a blue box", "a big ball"], padding=True, return_tensors="pt"))
    batch.pop("token_type_ids", None)
    feats = torch.randn(3, 16)
    assert set(training_step_loss(student, cfg, batch, feats)) == {"simcse", "image", "loss"}
    simcse = with_overrides(cfg, {"train.method": "simcse"})
    assert set(training_step_loss(student, simcse, batch, feats)) == {"simcse", "loss"}


def test_cuda_request_without_gpu_fails_before_training(project):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    cfg = with_overrides(load_config("params.yaml"), {"base.device": "cuda"})
    with pytest.raises(RuntimeError, match="base.device=cuda"):
        train(cfg, "data/raw", "data/teachers", project / "m", progress=False)


def test_optimizer_decay_groups_and_linear_warmup_schedule():
    from mmcse.config import Config
    from mmcse.train import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    cfg = with_overrides(Config(), {"train.weight_decay": 0.01, "train.warmup_ratio": 0.25,
                                    "train.learning_rate": 1e-3})
    optimizer, scheduler = build_optimizer(model, cfg, total_steps=8)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.01 and [p.shape for p in decayed["params"]] == [(3, 3)]
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 3  # bias + LayerNorm weight/bias
    lrs = []
    for _ in range(8):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1e-3 * 5 / 6, 1e-3 * 4 / 6, 1e-3 * 3 / 6, 1e-3 * 2 / 6, 1e-3 / 6])


def test_epochs_run_every_batch_of_each_epoch_in_a_new_order(project):
    from mmcse.train import _Batches

    batches = _Batches(160, 48, 8, seed=3)
    assert len(batches) == 26
    first, second = batches.epoch(0), batches.epoch(1)
    assert [k for k, _ in first] == [k for k, _ in second] == batches.schedule
    assert first != second
    text_items = sorted(i for k, idx in first if k == TEXT for i in idx)
    assert text_items == list(range(160))  # every sentence once per epoch
    cfg = with_overrides(load_config("params.yaml"), {"train.epochs": 2, "train.max_steps": 0,
                                                        "train.eval_steps": 100})
    assert train(cfg, "data/raw", "data/teachers", project / "m", progress=False).steps == 52
