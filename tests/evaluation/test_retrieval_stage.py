"""The evaluate stage's retrieval on the demo world: each method's heads, checked against a
direct recomputation from the saved checkpoint; no head, no retrieval; bad test data named."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from mmcse.cli import main
from mmcse.evaluation.ndcg import image_relevance, ndcg_metrics
from mmcse.evaluation.retrieval import chance_metrics
from mmcse.experiments.params import load_config
from mmcse.io import read_json, read_jsonl, write_jsonl
from mmcse.methods.objectives import Objective, image_head
from mmcse.models.card import score_scale
from mmcse.models.student import load_student
from mmcse.pipeline.evaluate import EvalOutputs, run_evaluate
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.relevance import run_relevance
from mmcse.teachers.cache import FeatureStore
from mmcse.training.engine import Hooks
from mmcse.training.loop import train
from tests.evaluation.test_retrieval import transcribed


def _config(method: str):
    cfg = load_config("params.yaml")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, method=method, max_steps=4, eval_steps=4))


def _by_hand(folder, features, captions):
    """text_proj on the last layer's [CLS] and the image head on the cached features, written
    out without the library's batching or autocast."""
    student, tokenizer = load_student(folder)
    student.eval()
    with torch.no_grad():
        batch = tokenizer(captions, padding=True, truncation=True, max_length=512, return_tensors="pt")
        hidden = student.backbone(**batch).last_hidden_state  # (N_txt, L, H)
        texts = student.text_proj(hidden[:, 0]).numpy()
        return student, texts


@pytest.mark.parametrize("method, head, feature_set", [
    ("mcse", "image_proj", "retrieval_image"),
    ("dalr", "teacher_image_proj", "retrieval_joint_image"),
])
@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_recall_is_that_of_the_trained_heads_on_the_test_images(project, method, head, feature_set, capsys):
    cfg = _config(method)
    assert image_head(Objective.of(cfg)) == (head, feature_set)
    paths = Paths.of(cfg)
    assert run_relevance(cfg, paths) == {"captions": 40, "kinds": ["rouge_l"]}
    cached = list(paths.relevance.glob("rouge_l-*.npy"))
    result = train(cfg, paths.raw, paths.teachers, project / method, hooks=Hooks(progress=False))
    scores = run_evaluate(cfg, paths, result.best_dir, EvalOutputs(plots_dir=project / "plots"))
    assert list(paths.relevance.glob("*.npy")) == cached and not (paths.raw.parent / "upstream").exists()
    # the stage's model gets its card (issue 39), its model-index the evaluated score at eval.json's precision
    from huggingface_hub import ModelCard

    from mmcse.io import tracked

    card = ModelCard.load(result.best_dir / "README.md")
    assert [r.metric_value for r in card.data.eval_results] == [tracked(scores["avg"])]
    assert method in card.data.tags
    # issue 56: the card's first words say the data are generated; every score of eval.json is in its table with
    # its scale, and retrieval with its chance level on the same test set
    assert card.text.lstrip().splitlines()[2].startswith("**Data: generated, not a benchmark.**")
    for name, value in scores.items():
        assert f"| {name} | {tracked(value)} | {score_scale(name)}" in card.text, name

    images = read_jsonl(paths.raw / "retrieval/images.jsonl")
    rows = read_jsonl(paths.raw / "retrieval/captions.jsonl")
    assert len(images) == 20 and len(rows) == 40  # shrunk demo: 20 test scenes × 2 captions
    sets = read_json(paths.teachers / "manifest.json")["sets"]
    features = FeatureStore.open(paths.teachers / sets[feature_set]).rows([r["image_id"] for r in images])
    student, texts = _by_hand(result.best_dir, features, [r["caption"] for r in rows])
    with torch.no_grad():
        image_emb = getattr(student, head)(torch.as_tensor(features)).numpy()
    owner = [[r["image_id"] for r in images].index(row["image_id"]) for row in rows]
    chance = chance_metrics("demo", owner, len(images))
    # and the encoder training started from, on the same sets (its heads as initialised: train.epochs 0)
    start = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=0)), paths.raw,
                  paths.teachers, project / "start", hooks=Hooks(progress=False))
    untrained = run_evaluate(cfg, paths, start.best_dir, transfer=False)
    for name in ("demo_i2t_R10", "demo_t2i_R1", "demo_rsum", "avg"):
        chance_text = tracked(chance[name]) if name in chance else ""
        assert (f"| {tracked(scores[name])} | {score_scale(name)} | {tracked(untrained[name])} | {chance_text} |"
                in card.text), name
    want = transcribed(image_emb, texts, owner)
    for key, value in want.items():
        assert scores[f"demo_{key}"] == pytest.approx(value, abs=1e-6), key
    assert 0 < scores["demo_rsum"] < 600
    # graded NDCG@25 on the same embeddings, ROUGE-L relevance of each test caption to each test image
    relevance = {"rouge_l": image_relevance([r["caption"] for r in rows], owner, "rouge_l")}
    for key, value in ndcg_metrics(image_emb, texts, owner, relevance, k=25).items():
        assert scores[f"demo_{key}"] == pytest.approx(value, abs=1e-6), key
    assert 0 < scores["demo_NDCG25_rouge_l"] <= 1

    table = (project / "plots/sentence_retrieval.md").read_text()
    assert table.count("| 1 |") == 5 and table.count("| 3 |") == 5

    # `mmcse eval --retrieval` scores the checkpoint the same way: its image head travels with it
    assert read_json(result.best_dir / "train_state.json")["image_head"] == [head, feature_set]
    main(["eval", "--model", str(result.best_dir), "--retrieval", "--pooler", cfg.evaluate.pooler])
    cli = json.loads(capsys.readouterr().out)
    assert set(cli) == {k for k in scores if k.startswith("demo_")}
    for key, value in cli.items():
        assert value == pytest.approx(scores[key], abs=1e-4), key


def test_a_method_without_an_image_head_reports_no_retrieval_but_lists_neighbours(project):
    cfg = _config("simcse")
    assert image_head(Objective.of(cfg)) is None
    assert image_head(Objective("kdmcse", cfg.loss)) == (
        "teacher_image_proj", "retrieval_joint_image")
    no_term = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, method="mcse"),
                                  loss=dataclasses.replace(cfg.loss, image_term=False))
    assert image_head(Objective.of(no_term)) is None
    paths = Paths.of(cfg)
    result = train(cfg, paths.raw, paths.teachers, project / "simcse", hooks=Hooks(progress=False))
    scores = run_evaluate(cfg, paths, result.best_dir, EvalOutputs(plots_dir=project / "plots"))
    assert set(scores) == {"avg", "dev_alignment", "dev_uniformity", "cluster_silhouette"}  # nor NDCG
    assert "| 1 |" in (project / "plots/sentence_retrieval.md").read_text()


def test_a_caption_of_a_missing_test_image_is_named_before_scoring(project):
    cfg = _config("mcse")
    paths = Paths.of(cfg)
    result = train(cfg, paths.raw, paths.teachers, project / "m", hooks=Hooks(progress=False))
    rows = read_jsonl(paths.raw / "retrieval/captions.jsonl")
    write_jsonl(paths.raw / "retrieval/captions.jsonl", rows + [{"image_id": "test09999", "caption": "a red cube"}])
    with pytest.raises(ValueError, match=r"retrieval/captions.jsonl: captions of images not in the test set "
                                         r"\['test09999'\]"):
        run_evaluate(cfg, paths, result.best_dir)
    # the CLI: a plain HF model has no image head to score
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", "packaged:all-MiniLM-L6-v2", "--retrieval"])
    assert exit_.value.code == 2


def test_neighbours_exclude_the_query_and_mark_its_image():
    from mmcse.evaluation.retrieval import neighbours_markdown, sentence_neighbours

    emb = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [1.0, 0.0]])
    rows = sentence_neighbours(["a", "b", "c", "d"], emb, [0, 0, 1, 1], queries=2, k=2)
    assert [r["query"] for r in rows] == ["a", "d"]
    assert [n["caption"] for n in rows[0]["neighbours"]] == ["d", "b"]  # d identical (cos 1), then b
    assert [n["same_image"] for n in rows[0]["neighbours"]] == [False, True]
    assert rows[0]["neighbours"][0]["cosine"] == pytest.approx(1.0)
    md = neighbours_markdown(rows, "t")
    assert "| a | 1 | d | 1.000 | no |" in md and "|  | 2 | b |" in md


def test_the_retrieval_options_change_what_is_reported(project):
    from mmcse.config import with_overrides

    cfg = _config("mcse")
    paths = Paths.of(cfg)
    result = train(cfg, paths.raw, paths.teachers, project / "m", hooks=Hooks(progress=False))
    full = run_evaluate(cfg, paths, result.best_dir)
    assert "demo_NDCG25_rouge_l" in full and "demo_rsum" in full
    # another block size: the same numbers
    blocked = run_evaluate(with_overrides(cfg, {"evaluate.retrieval.block_size": 7}), paths, result.best_dir)
    assert {k: v for k, v in blocked.items() if k.startswith("demo_")} == pytest.approx(
        {k: v for k, v in full.items() if k.startswith("demo_")})
    # no relevance kinds: R@K without NDCG; another k: other NDCG
    no_ndcg = run_evaluate(with_overrides(cfg, {"evaluate.ndcg.relevance": []}), paths, result.best_dir)
    assert "demo_rsum" in no_ndcg and not any("NDCG" in k for k in no_ndcg)
    k1 = run_evaluate(with_overrides(cfg, {"evaluate.ndcg.k": 1}), paths, result.best_dir)
    assert "demo_NDCG1_rouge_l" in k1 and "demo_NDCG25_rouge_l" not in k1
    # retrieval off: neither, and no examples table
    off = run_evaluate(with_overrides(cfg, {"evaluate.retrieval.enabled": False}), paths, result.best_dir,
                       EvalOutputs(plots_dir=project / "off"))
    assert not any(k.startswith("demo_") for k in off) and not (project / "off/sentence_retrieval.md").exists()
