import json
import math

import pytest
import torch
from safetensors.torch import load_file

from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.training.batches import Batches
from mmcse.training.checkpoints import release_resume_point
from mmcse.training.engine import Hooks
from mmcse.training.loop import train
from mmcse.training.schedule import (
    ALTERNATE,
    PAIR,
    RELEASED,
    TEXT,
    alternation_schedule,
    batches_per_epoch,
    epoch_schedule,
    pair_share,
    released_schedule,
)


def test_alternate_order_takes_each_batch_once_a_pair_after_every_ratio_text_batches():
    # 78 text batches, 18 pair batches: ratio 4 -> TTTTP repeated, leftovers at the end
    s = alternation_schedule(78, 18)
    assert len(s) == 96 and s.count(PAIR) == 18 and s.count(TEXT) == 78
    assert s[:10] == [TEXT] * 4 + [PAIR] + [TEXT] * 4 + [PAIR]
    assert s[-6:] == [TEXT] * 6
    assert alternation_schedule(5, 0) == [TEXT] * 5
    assert alternation_schedule(2, 3) == [TEXT, PAIR, TEXT, PAIR, PAIR]


def train_mix_kinds(n_text: int, n_pair: int) -> list[str]:
    """uds-lsv/MCSE @ 3031426 src/train_mix.py, one epoch's batch kinds: l.334 (steps = len(text) + len(pair)),
    l.367 (paired_sample_step), l.369–379 (a pair batch where step % paired_sample_step == 0)."""
    num_update_steps_per_epoch = math.ceil((n_text + n_pair) / 1)  # gradient_accumulation_steps 1
    paired_sample_step = n_text // n_pair
    return [PAIR if step % paired_sample_step == 0 else TEXT for step in range(num_update_steps_per_epoch)]


@pytest.mark.parametrize("n_text,n_pair", [(15_625, 6_467), (15_625, 2_265), (15_625, 453), (78, 18), (7, 7)],
                         ids=["wiki1m-coco-all", "wiki1m-flickr-all", "wiki1m-flickr-random", "78-18", "equal"])
def test_released_order_is_train_mix_arithmetic(n_text, n_pair):
    kinds = released_schedule(n_text, n_pair)
    assert kinds == train_mix_kinds(n_text, n_pair)
    assert len(kinds) == n_text + n_pair and kinds[0] == PAIR


def test_released_order_shares_of_pair_batches_are_the_issues_numbers():
    # Wiki1M at B 64 beside Karpathy's train split with every caption (KDMCSE, DALR) and with one (MCSE)
    assert pair_share(1_000_000, 82_783 * 5, 64, RELEASED) == pytest.approx(0.5, abs=1e-4)
    assert pair_share(1_000_000, 82_783 * 5, 64, ALTERNATE) == pytest.approx(0.293, abs=1e-3)
    assert pair_share(1_000_000, 29_000 * 5, 64, RELEASED) == pytest.approx(1 / 6, abs=1e-4)
    assert pair_share(1_000_000, 29_000, 64, RELEASED) == pytest.approx(0.029, abs=1e-3)
    assert batches_per_epoch(1_000_000, 82_783 * 5, 64, RELEASED) == 15_625 + 6_467


def test_released_order_refuses_more_pair_than_text_batches_and_an_unknown_order():
    with pytest.raises(ValueError, match="divides by zero"):
        released_schedule(2, 3)
    assert released_schedule(5, 0) == [TEXT] * 5
    with pytest.raises(ValueError, match="alternate, released"):
        epoch_schedule("interleaved", 5, 2)


def test_released_batches_are_endless_streams_that_go_on_into_the_next_epoch():
    """Each kind's stream is its passes, each a permutation of every item in full batches; an epoch takes the
    batches after the last epoch's (train_mix.py's inf_train_gen loaders are built once, before the epochs)."""
    b = Batches(n_text_items=40, n_pair_items=17, batch_size=4, seed=3, order=RELEASED)  # 10 text, 4 pair batches
    assert b.schedule == released_schedule(10, 4) and len(b) == 14
    epochs = [b.epoch(e) for e in range(3)]
    assert epochs[0] == b.epoch(0)  # a pure function of (seed, epoch)
    for kind, items, per_pass in ((TEXT, 40, 10), (PAIR, 17, 4)):
        stream = [idx for epoch in epochs for k, idx in epoch if k == kind]
        assert all(len(idx) == 4 for idx in stream)
        for start in range(0, len(stream) - per_pass + 1, per_pass):  # each whole pass: every item at most once
            seen = [i for idx in stream[start:start + per_pass] for i in idx]
            assert len(set(seen)) == len(seen) == per_pass * 4 and set(seen) <= set(range(items))
        # epoch 1 continues the stream: its first batch of this kind is not epoch 0's first
        first = [idx for k, idx in epochs[0] if k == kind][0]
        assert [idx for k, idx in epochs[1] if k == kind][0] != first
    # pair batches at steps 0, 2, …, 12 (every 10 // 4 = 2nd step): 7 of 14, where alternate takes the 4 once
    assert sum(k == PAIR for k, _ in epochs[0]) == 7
    alternate = Batches(40, 17, 4, seed=3)
    assert alternate.order == ALTERNATE and len(alternate) == 14 and sum(k == PAIR for k, _ in alternate.epoch(0)) == 4


def _weights(folder):
    return load_file(str(folder / "last" / "student.safetensors"))


class Killed(Exception):
    pass


def killed_and_resumed(cfg, project):
    """``cfg`` (8 steps, a resume point every 4) trained into ``project/full`` uninterrupted, and into
    ``project/resumed`` killed at its step-8 evaluation (so the resume point on disk is step 4's) and rerun:
    both results, and both runs' last weights."""
    full = train(cfg, "data/raw", "data/teachers", project / "full", hooks=Hooks(progress=False))

    def kill_at_8(step, score):
        if step == 8:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, "data/raw", "data/teachers", project / "resumed", hooks=Hooks(on_eval=kill_at_8, progress=False))
    assert json.loads((project / "resumed/last/state.json").read_text())["step"] == 4
    resumed = train(cfg, "data/raw", "data/teachers", project / "resumed", hooks=Hooks(progress=False))
    assert full.steps == resumed.steps == 8
    return full, resumed, _weights(project / "full"), _weights(project / "resumed")


def test_killed_run_resumes_to_the_same_weights(project):
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 4,
                                                        "train.checkpoint_steps": 4})
    full, resumed, a, b = killed_and_resumed(cfg, project)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert full.history == resumed.history


def test_released_resume_point_keeps_the_history_and_a_rerun_starts_afresh(project):
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 4, "train.eval_steps": 4})
    first = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    before = _weights(project / "m")
    weights = sum((project / "m/last" / n).stat().st_size for n in ("student.safetensors", "trainer.pt"))
    assert release_resume_point(project / "m") == weights > 0
    assert sorted(p.name for p in (project / "m/last").iterdir()) == ["state.json"]
    assert json.loads((project / "m/last/state.json").read_text())["history"] == first.history
    assert release_resume_point(project / "m") == 0

    again = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert again.steps == 4 and again.history == first.history  # retrained from step 0, same seed
    after = _weights(project / "m")
    for k in before:
        torch.testing.assert_close(before[k], after[k], rtol=0, atol=1e-6, msg=k)


def test_best_checkpoint_is_an_hf_folder_with_heads(project):
    from transformers import AutoModel

    cfg = load_config("params.yaml")
    result = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert result.best_score == max(h["dev"] for h in result.history if "dev" in h)
    assert (result.best_dir / "model.safetensors").is_file() and (result.best_dir / "heads.safetensors").is_file()
    AutoModel.from_pretrained(result.best_dir)
    assert [h["step"] for h in result.history if "dev" in h] == [0, 4, 8]


def test_changed_config_does_not_resume_a_different_run(project):
    cfg = load_config("params.yaml")
    train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    other = with_overrides(cfg, {"loss.temperature": 0.1})
    result = train(other, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert result.history[0]["step"] == 0 and result.steps == 8


METHOD_TERMS = {
    "simcse": {"simcse"},
    "mcse": {"simcse", "image"},
    "kdmcse": {"kdmcse_image", "kdmcse_text", "kdmcse"},  # Algorithm 1: no SimCSE on pair batches
    "dalr": {"info", "consistency", "cma", "rank", "ima"},  # Eq. 14 as printed: no SimCSE on pair batches
    "mcseo": {"simcse", "image", "object"},
}


@pytest.mark.parametrize("method", sorted(METHOD_TERMS))
def test_each_method_steps_on_cached_features_only(project, method, monkeypatch):
    """A pair batch of every method: its terms, finite gradients, and no teacher model run."""
    import mmcse.teachers.cache
    from mmcse.methods.objectives import Objective, needed_features
    from mmcse.models.student import Student, load_backbone, load_tokenizer
    from mmcse.models.tokens import tokenize_texts
    from mmcse.training.batches import TrainData
    from mmcse.training.loop import training_step_loss

    def no_teacher(*args, **kwargs):
        raise AssertionError("a training step ran a teacher")

    monkeypatch.setattr(mmcse.teachers.cache, "text_teacher_features", no_teacher)
    monkeypatch.setattr(mmcse.teachers.cache, "colour_edge_grid_features", no_teacher)
    from pathlib import Path

    cfg = with_overrides(load_config("params.yaml"), {"train.method": method})
    data = TrainData.load(Path("data/raw"), Path("data/teachers"))
    tok = load_tokenizer(cfg.model.name_or_path)
    student = Student(load_backbone(cfg.model), data.image_features.dim, cfg.model.proj_dim, data.joint_image.dim,
                      text_teacher_dim=data.text_captions[0].dim)
    idx = list(range(8))
    feats = data.pair_features(idx, needed_features(Objective.of(cfg), pair_batch=True), torch.device("cpu"))
    batch = tokenize_texts(tok, data.captions, cfg.model.max_seq_len).batch(idx, torch.device("cpu"))
    terms = training_step_loss(student, Objective.of(cfg), batch, feats, pair_batch=True, seed=3)
    assert {k for k in terms if not k.startswith("stat/")} - {"loss"} == METHOD_TERMS[method]
    terms["loss"].backward()
    grads = {n: p.grad for n, p in student.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    # the heads a method trains get gradients; the others stay untouched
    used = {n.split(".")[0] for n in grads} - {"backbone"}
    expected = {"simcse": {"mlp"}, "mcse": {"mlp", "text_proj", "image_proj"},
                "kdmcse": {"text_proj", "teacher_text_proj", "teacher_image_proj"},
                "dalr": {"mlp", "text_proj", "teacher_image_proj", "text_teacher_proj", "shared_text", "shared_image"},
                "mcseo": {"mlp", "text_proj", "image_proj"}}[method]
    assert used == expected


def test_mcseo_phrase_spans_match_the_training_tokenisation(project):
    """detect_objects' token spans point at the phrase's tokens in the batch the student sees."""
    from pathlib import Path

    from mmcse.models.student import load_tokenizer
    from mmcse.models.tokens import tokenize_texts
    from mmcse.training.batches import TrainData

    cfg = load_config("params.yaml")
    data = TrainData.load(Path("data/raw"), Path("data/teachers"))
    data.check_objects(cfg.detect.min_objects, cfg.model.max_seq_len, Path("data/objects"))
    tok = load_tokenizer(cfg.model.name_or_path)
    table = tokenize_texts(tok, data.captions, cfg.model.max_seq_len)  # what training reads
    checked = 0
    for i, pair_id in enumerate(data.pair_ids[:20]):
        ids = table.batch([i], torch.device("cpu"))["input_ids"][0]
        for o in data.objects.get(pair_id, []):
            decoded = tok.decode(ids[o["token_start"] : o["token_end"]])
            assert decoded.replace(" ", "") == o["phrase"].lower().replace(" ", "")
            checked += 1
    assert checked > 10


def _cut(path, by=16):
    path.write_bytes(path.read_bytes()[:-by])


def test_damaged_resume_point_falls_back_to_the_old_copy_then_starts_afresh(project, caplog):
    import shutil

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 4,
                                                        "train.checkpoint_steps": 4})
    out = project / "m"
    evals = []

    def kill_at_8(step, score):
        if step == 8:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=kill_at_8, progress=False))
    # as if killed between _swap_in's renames, then last/trainer.pt damaged: the whole .old copy resumes
    shutil.copytree(out / "last", out / "last.old")
    _cut(out / "last/trainer.pt", 100)
    resumed = train(
        cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False),
    )
    assert evals == [8] and resumed.steps == 8  # resumed at step 4
    assert f"{out / 'last/trainer.pt'}: damaged (not a whole torch archive)" in caplog.text

    # a truncated finished resume point and no other copy: trained again from step 0, to the same end
    caplog.clear()
    evals.clear()
    _cut(out / "last/student.safetensors")
    again = train(
        cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False),
    )
    assert evals == [4, 8] and again.steps == 8 and again.history == resumed.history
    assert f"{out / 'last/student.safetensors'}: truncated: " in caplog.text
    assert "retrained from step 0" in caplog.text
    assert load_file(str(out / "last/student.safetensors")).keys() == _weights(out).keys()


def test_damaged_best_checkpoint_is_retrained_not_returned(project, caplog):
    from transformers import AutoModel

    from mmcse.integrity.files import check_safetensors

    cfg = load_config("params.yaml")
    out = project / "m"
    first = train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(progress=False))
    heads = load_file(str(out / "best/heads.safetensors"))
    _cut(out / "best/model.safetensors")
    evals = []
    second = train(
        cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False),
    )
    assert evals == [4, 8] and second.history == first.history and second.best_step == first.best_step
    assert f"{out / 'best/model.safetensors'}: truncated: " in caplog.text
    check_safetensors(out / "best/model.safetensors", "")
    AutoModel.from_pretrained(out / "best")
    again = load_file(str(out / "best/heads.safetensors"))
    for k in heads:
        torch.testing.assert_close(heads[k], again[k], rtol=0, atol=1e-6, msg=k)

    evals.clear()  # a whole best checkpoint and a finished run: nothing to do
    train(cfg, "data/raw", "data/teachers", out, hooks=Hooks(on_eval=lambda s, v: evals.append(s), progress=False))
    assert evals == []


def test_training_names_a_damaged_teacher_set_and_the_stage_to_rerun(project):
    from mmcse.errors import CorruptArtifact
    from mmcse.io import read_json

    sets = read_json(project / "data/teachers/manifest.json")["sets"]
    file = project / "data/teachers" / sets["joint_image"] / "features.npy"
    _cut(file)
    with pytest.raises(CorruptArtifact) as err:
        train(load_config("params.yaml"), "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert str(err.value).startswith(f"{file.relative_to(project)}: truncated: ")
    assert str(err.value).endswith("; rerun the cache_teachers stage to rebuild it (dvc repro cache_teachers)")


def _direct_geometry(student, tokenizer, pooler, max_length, device, pairs):
    """Dev alignment (gold >= 4) and uniformity (t = 2) transcribed from DALR Eq. 15–16: every
    distinct sentence encoded alone (no batch, no padding), pair by pair in plain numpy."""
    import itertools
    import math

    import numpy as np

    sentences = sorted({s for p in pairs for s in (p.s1, p.s2)})
    unit = {}
    was_training = student.training
    student.eval()
    with torch.no_grad():
        for s in sentences:
            b = tokenizer([s], truncation=True, max_length=max_length, return_tensors="pt").to(device)
            v = student.encode(b["input_ids"], b["attention_mask"], pooler)[0].double().cpu().numpy()
            unit[s] = v / np.linalg.norm(v)
    student.train(was_training)
    positives = [p for p in pairs if p.score >= 4.0]
    align = sum(float(np.sum((unit[p.s1] - unit[p.s2]) ** 2)) for p in positives) / len(positives)
    pair_terms = [math.exp(-2.0 * float(np.sum((unit[a] - unit[b]) ** 2)))
                  for a, b in itertools.combinations(sentences, 2)]
    return align, math.log(sum(pair_terms) / len(pair_terms))


def test_dev_geometry_is_logged_at_every_dev_evaluation_from_that_checkpoint(project, device, monkeypatch):
    """dev_alignment / dev_uniformity at each dev evaluation equal a direct computation on the
    weights of that step; the history, plots/dev_geometry.csv and the best checkpoint agree."""
    import csv

    import mmcse.training.loop
    from mmcse.data.senteval import SentencePair
    from mmcse.evaluation.geometry import sts_dev_geometry
    from mmcse.evaluation.sts import TextEncoder
    from mmcse.io import read_json, read_jsonl
    from mmcse.pipeline.train import write_curves

    cfg = with_overrides(load_config("params.yaml"), {"base.device": device.type})
    pairs = [SentencePair.from_row(r) for r in read_jsonl(project / "data/raw/sts/dev.jsonl")]
    assert sum(p.score >= 4.0 for p in pairs) >= 3
    held = {}
    real_encoder = mmcse.training.loop.student_encoder

    def spy(student, tokenizer, pooler, max_length, dev, *args, **kwargs):  # the student being trained
        held["args"] = (student, tokenizer, pooler, max_length, dev)
        return real_encoder(student, tokenizer, pooler, max_length, dev, *args, **kwargs)

    monkeypatch.setattr(mmcse.training.loop, "student_encoder", spy)
    logged, direct = {}, {}

    def log_metrics(entries):
        for metrics, step in entries:
            if "dev_sts" in metrics:  # logged right after the evaluation, before the next step
                logged[step] = metrics
                direct[step] = _direct_geometry(*held["args"], pairs)

    result = train(
        cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(log_metrics=log_metrics, progress=False),
    )
    assert sorted(logged) == [0, 4, 8]
    for step, (align, unif) in direct.items():
        assert logged[step]["dev_alignment"] == pytest.approx(align, rel=1e-4, abs=1e-10), step
        assert logged[step]["dev_uniformity"] == pytest.approx(unif, rel=1e-4, abs=1e-10), step
    assert len({round(m["dev_uniformity"], 9) for m in logged.values()}) == 3  # the weights moved

    evals = [h for h in result.history if "dev" in h]
    assert [(h["step"], h["dev_alignment"], h["dev_uniformity"]) for h in evals] == [
        (s, logged[s]["dev_alignment"], logged[s]["dev_uniformity"]) for s in (0, 4, 8)]

    at_best = next(h for h in evals if h["step"] == result.best_step)
    want = {"dev_alignment": at_best["dev_alignment"], "dev_uniformity": at_best["dev_uniformity"]}
    assert result.best_geometry == want
    assert read_json(result.best_dir / "train_state.json") == {"step": result.best_step, "dev": result.best_score,
                                                               **want, "method": cfg.train.method,
                                                               "image_head": ["image_proj", "retrieval_image"]}
    # the evaluate stage's call: the saved best checkpoint, encoded afresh, gives the same numbers
    encoder = TextEncoder(str(result.best_dir), cfg.evaluate.pooler, device.type, max_length=cfg.model.max_seq_len)
    again = sts_dev_geometry(encoder, pairs, batch_size=cfg.evaluate.batch_size)
    assert again == {"alignment": pytest.approx(want["dev_alignment"], rel=1e-4, abs=1e-10),
                     "uniformity": pytest.approx(want["dev_uniformity"], rel=1e-4, abs=1e-10)}

    from mmcse.io import tracked

    write_curves(result.history, project / "plots")
    with open(project / "plots/dev_geometry.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "alignment", "uniformity"]
    assert [[int(r[0]), float(r[1]), float(r[2])] for r in rows[1:]] == [
        [h["step"], tracked(h["dev_alignment"]), tracked(h["dev_uniformity"])] for h in evals]  # DVC's precision
    assert (project / "plots/geometry_trajectory.png").stat().st_size > 1000


def test_a_dev_set_without_positive_pairs_is_refused_before_training(project):
    from mmcse.io import read_jsonl, write_jsonl

    dev = project / "data/raw/sts/dev.jsonl"
    write_jsonl(dev, [r | {"score": min(r["score"], 3.5)} for r in read_jsonl(dev)])
    with pytest.raises(ValueError, match=r"sts/dev.jsonl: no pair with gold score >= 4 \(highest 3.5 in"):
        train(load_config("params.yaml"), "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert not (project / "m").exists()


def test_run_train_logs_the_dev_geometry_the_figure_and_the_best_values(project):
    import mlflow

    from mmcse import tracking
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train
    from mmcse.training.checkpoints import load_history

    cfg = load_config("params.yaml")
    summary = run_train(cfg, Paths.of(cfg), out_dir=project / "m", hooks=Hooks(progress=False))
    evals = {h["step"]: h for h in load_history(project / "m") if "dev" in h}
    assert sorted(evals) == [0, 4, 8]
    tracking.configure(cfg)
    client = mlflow.MlflowClient()
    for name in ("dev_alignment", "dev_uniformity"):
        logged = {m.step: m.value for m in client.get_metric_history(summary["run_id"], name)}
        assert logged == {step: pytest.approx(h[name], rel=1e-6) for step, h in evals.items()}, name
    best = evals[summary["best_step"]]
    assert summary["best_dev_alignment"] == best["dev_alignment"]
    assert summary["best_dev_uniformity"] == best["dev_uniformity"]
    metrics = client.get_run(summary["run_id"]).data.metrics
    assert metrics["best_dev_alignment"] == pytest.approx(best["dev_alignment"], rel=1e-6)
    assert metrics["best_dev_uniformity"] == pytest.approx(best["dev_uniformity"], rel=1e-6)
    figures = {a.path for a in client.list_artifacts(summary["run_id"], "figures")}
    assert {"figures/training_curves.png", "figures/geometry_trajectory.png"} <= figures
    assert (project / "m/geometry_trajectory.png").stat().st_size > 1000


class _NarrowStore:
    """A text-teacher store that reports another width (what a teacher of another size would give)."""

    dim = 7

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.fixture
def two_teacher_widths(project, monkeypatch):
    """The project's training data with its second text teacher reporting width 7 (the first: 384)."""
    import mmcse.training.loop as loop

    load = loop.TrainData.load

    def two_widths(*args, **kwargs):
        data = load(*args, **kwargs)
        data.text_captions[1] = _NarrowStore(data.text_captions[1])
        return data

    monkeypatch.setattr(loop.TrainData, "load", staticmethod(two_widths))
    return project


@pytest.mark.parametrize("overrides", [{}, {"loss.dalr.iml": False}], ids=["dalr", "cml-only"])
def test_dalr_refuses_teachers_of_two_widths_before_any_compute(two_teacher_widths, monkeypatch, overrides):
    """DALR aggregates its text teachers' embeddings (App. B): teachers of two widths are refused
    before the student is built, naming both widths and the way out; L_CMA's projected Q^{t2t}
    aggregates them too, so a run with L_CMA alone is refused as well."""
    import mmcse.training.loop as loop

    monkeypatch.setattr(loop, "load_backbone", lambda *a, **k: pytest.fail("the student was built"))
    cfg = with_overrides(load_config("params.yaml"), {"train.method": "dalr", **overrides})
    with pytest.raises(ValueError, match=r"widths \[7, 384\] cannot be aggregated.*teacher_space: raw"):
        train(cfg, "data/raw", "data/teachers", two_teacher_widths / "m", hooks=Hooks(progress=False))
    assert not (two_teacher_widths / "m").exists()


def test_dalr_weighted_similarities_train_with_teachers_of_two_widths(two_teacher_widths):
    cfg = with_overrides(load_config("params.yaml"), {
        "train.method": "dalr", "train.max_steps": 2, "train.eval_steps": 2,
        "loss.dalr.teacher_weighting": "similarities", "loss.dalr.teacher_space": "raw"})
    assert train(cfg, "data/raw", "data/teachers", two_teacher_widths / "m", hooks=Hooks(progress=False)).steps == 2


def test_zero_epochs_evaluates_the_initial_encoder_without_a_step(project):
    """train.epochs: 0 (MCSEO Table 1's untrained BERT / RoBERTa rows): no training step; the best
    checkpoint is the encoder as loaded, scored once on dev, and a rerun finds it finished."""
    from mmcse.config import ConfigError
    from mmcse.models.student import load_backbone

    cfg = with_overrides(load_config("params.yaml"), {"train.epochs": 0, "train.max_steps": 0})
    result = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert (result.steps, result.best_step) == (0, 0) and [e["step"] for e in result.history] == [0]
    best = load_file(str(result.best_dir / "model.safetensors"))
    torch.manual_seed(cfg.base.seed)  # as `train` draws the random-init test encoder
    initial = load_backbone(cfg.model, dropout=cfg.train.dropout).state_dict()
    assert best.keys() <= initial.keys() and all(torch.equal(best[k], initial[k]) for k in best)
    again = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert (again.steps, again.best_score) == (0, result.best_score)
    with pytest.raises(ConfigError, match="train.epochs.*>= 1 with train.method duet"):
        with_overrides(cfg, {"train.method": "duet"})


def test_dalr_trains_with_the_joint_teachers_text_side_as_its_text_teacher(project):
    """DALR Table 9's "CLIP / CLIP" row: one text teacher, the joint teacher's text side (width = the
    joint space's), read from the manifest cache_teachers writes for it."""
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths

    cfg = with_overrides(load_config("params.yaml"), {
        "train.method": "dalr", "train.max_steps": 2, "train.eval_steps": 2, "teachers.text": [{"teacher": "joint"}]})
    run_cache_teachers(cfg, Paths.of(cfg))
    result = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False))
    assert result.steps == 2
    heads = json.loads((result.best_dir / "heads.json").read_text())
    assert heads["text_teacher_dim"] == cfg.teachers.joint.dim


def test_the_step_schedule_divides_the_rate_by_ten_every_n_epochs_and_clipping_bounds_the_update():
    """train.lr_decay_epochs (VSE++'s --lr_update) and train.max_grad_norm (its --grad_clip)."""
    from mmcse.training.engine import build_optimizer, clipped_update

    model = torch.nn.Linear(3, 2)
    cfg = with_overrides(load_config("params.yaml"), {"train.learning_rate": 0.5, "train.lr_decay_epochs": 2})
    optimizer, scheduler = build_optimizer(model, cfg.train, total_steps=100, steps_per_epoch=3)
    rates = []
    for _ in range(13):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.5] * 6 + [0.05] * 6 + [0.005])  # ÷10 after 2 epochs of 3 steps
    with pytest.raises(ValueError, match="steps an epoch"):
        build_optimizer(model, cfg.train, total_steps=100)
    linear = with_overrides(cfg, {"train.lr_decay_epochs": 0})
    opt, decay = build_optimizer(model, linear.train, total_steps=4)
    assert decay.get_last_lr()[0] == pytest.approx(0.5)
    opt.step()
    decay.step()
    assert decay.get_last_lr()[0] == pytest.approx(0.375)  # linear to 0 over 4 steps

    clip = with_overrides(cfg, {"train.max_grad_norm": 2.0, "train.lr_decay_epochs": 0, "train.learning_rate": 1.0})
    for limit, config in ((2.0, clip), (None, with_overrides(clip, {"train.max_grad_norm": 0.0}))):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        before = [p.detach().clone() for p in model.parameters()]
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        (model(torch.full((4, 3), 10.0)).sum() * 100).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        assert norm > 2.0
        clipped_update(model, config.train, sgd, torch.amp.GradScaler("cpu", enabled=False))
        step = torch.sqrt(sum((p.detach() - b).pow(2).sum() for p, b in zip(model.parameters(), before, strict=True)))
        assert float(step) == pytest.approx(2.0 if limit else float(norm), rel=1e-5)
    from mmcse.config import ConfigError

    with pytest.raises(ConfigError, match="train.warmup_ratio.*step schedule"):
        with_overrides(cfg, {"train.warmup_ratio": 0.1})


def test_a_resume_point_replaced_by_a_checkout_is_put_back_from_its_kept_copy(project, caplog):
    """Issue 53.2: `dvc exp run` checks every output out of its commit before it reproduces, which replaces
    an interrupted run's folder with the committed model (another configuration's). The resume point is
    kept outside the folder (hard links under data/resume), put back, and the rerun continues from it; a
    finished run leaves no kept copy behind."""
    import shutil

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 4,
                                                        "train.checkpoint_steps": 4})
    committed = train(
        with_overrides(cfg, {"train.learning_rate": 1e-4}), "data/raw", "data/teachers", project / "committed",
        hooks=Hooks(progress=False),
    )
    assert committed.steps == 8 and not any((project / "data/resume").iterdir())  # finished: nothing kept
    steps = []

    def kill_at_8(step, score):
        steps.append(step)
        if step == 8:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(on_eval=kill_at_8, progress=False))
    (kept,) = (project / "data/resume").iterdir()
    assert json.loads((kept / "last/state.json").read_text())["step"] == 4
    assert (kept / "last/student.safetensors").stat().st_ino == (project / "m/last/student.safetensors").stat().st_ino
    shutil.rmtree(project / "m")  # DVC's forced checkout: the folder is the commit's again
    shutil.copytree(project / "committed", project / "m")
    steps.clear()
    with caplog.at_level("INFO"):
        resumed = train(
            cfg, "data/raw", "data/teachers", project / "m",
            hooks=Hooks(on_eval=lambda s, _: steps.append(s), progress=False),
        )
    assert steps == [8] and resumed.steps == 8  # continued from step 4, not retrained from 0
    assert f"the resume point of step 4 put back into {project / 'm'} from {kept}" in caplog.text
    assert not kept.exists()
