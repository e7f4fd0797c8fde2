"""The model card a trained sentence encoder's folder gets (issue 39): huggingface_hub's own parser reads
its metadata back, its model-index holds the evaluated scores at metrics/eval.json's precision, and its
body names the method's paper, the resolved configuration, the commit and the environment."""

from __future__ import annotations

import pytest
import yaml
from huggingface_hub import ModelCard

from mmcse.config import Config, to_dict, with_overrides
from mmcse.integrity.code import source_state
from mmcse.io import tracked
from mmcse.models.card import PAPERS, model_card, write_model_card

ENV = {"python": "3.11.7", "torch": "2.9.0", "cuda": "cpu", "transformers": "5.0.0", "numpy": "2.0.0",
       "device": "cpu (test)", "lock_sha256": "ab" * 32, "locked": "yes"}


def test_the_card_parses_with_huggingface_hub_and_holds_the_scores(tmp_path):
    cfg = with_overrides(Config(), {"train.method": "kdmcse", "model.name_or_path": "bert-base-uncased",
                                    "data.pairs": "flickr30k", "data.corpus": "wiki1m"})
    scores = {"STS12": 70.123456, "STSBenchmark": 80.98765, "avg": 75.5, "MR": 81.25, "transfer_avg": 85.0,
              "demo_rsum": 27.0, "dev_alignment": 0.51234567}
    path = write_model_card(tmp_path, cfg, scores, ENV, commit="0123abc")
    assert path == tmp_path / "README.md"
    card = ModelCard.load(path)
    data = card.data
    assert (data.library_name, data.pipeline_tag, data.base_model) == (
        "sentence-transformers", "sentence-similarity", "bert-base-uncased")
    assert {"sentence-transformers", "mmcse", "kdmcse"} <= set(data.tags)
    assert data.datasets == ["nlphuji/flickr30k", "princeton-nlp/datasets-for-simcse"]
    assert data.license is None and "**License**: not set" in card.text  # left to whoever publishes it
    got = {(r.dataset_name, r.metric_type): r.metric_value for r in data.eval_results}
    assert got == {("STS12", "spearman_cosine"): tracked(70.123456),
                   ("STSBenchmark", "spearman_cosine"): tracked(80.98765), ("MR", "accuracy"): 81.25}
    assert "| dev_alignment | 0.5123 | mean squared distance" in card.text
    assert "| demo_rsum | 27.0 | sum of" in card.text
    assert "**Data**: trained on flickr30k image–caption pairs, the wiki1m text corpus" in card.text
    assert "| method | kdmcse (KDMCSE:" in card.text
    assert "| starts from | `bert-base-uncased` (pretrained) |" in card.text
    # KDMCSE's points where its paper and its authors' code differ, as params.yaml sets them: the printed ones, but
    # Eq. 8's direction, where params.yaml follows the paper's prose and the code against the equation as typeset
    assert "| paper or code | loss.kdmcse.threshold_drops: 'above' (code; printed 'below') |" in card.text
    assert PAPERS["kdmcse"][1] in card.text and "mmcse commit: `0123abc`" in card.text
    assert "Python 3.11.7, torch 2.9.0" in card.text
    resolved = yaml.safe_load(card.text.split("```yaml\n")[1].split("```")[0])
    assert resolved == {k: v for k, v in to_dict(cfg).items() if k not in ("ablate", "sweep")}


def test_a_packaged_or_local_base_is_no_hub_id_and_the_demo_score_is_its_one_result(tmp_path):
    cfg = Config()  # the demo: packaged MiniLM, generated data
    card = ModelCard(model_card(cfg, {"avg": 66.1854}, ENV, "abc"))
    assert card.data.base_model is None and card.data.datasets is None
    (result,) = card.data.eval_results
    assert (result.dataset_name, result.metric_value) == ("mmcse demo STS", 66.1854)
    assert "starts from `packaged:all-MiniLM-L6-v2`" in card.text
    assert "**Data: generated, not a benchmark.**" in card.text and "no benchmark result is claimed" in card.text


def test_retrieval_scores_stand_beside_their_chance_level_and_every_score_has_its_scale(tmp_path):
    """The chance column holds what `chance_metrics` gives for the test set (at eval.json's precision); every score
    of the table says its measure and range."""
    from mmcse.evaluation.retrieval import chance_metrics
    from mmcse.models.card import score_scale

    chance = chance_metrics("demo", [i // 4 for i in range(400)], 100)
    scores = {"avg": 66.2, "demo_i2t_R10": 7.0, "demo_rsum": 27.0, "demo_NDCG25_rouge_l": 0.56, "dev_uniformity": -1.9,
              "STS12": 70.0, "MR": 80.0}
    untrained = {"avg": 41.23456, "demo_i2t_R10": 8.5, "demo_rsum": 30.0}  # no transfer tasks in the reference
    text = model_card(Config(), scores, ENV, "abc", chance=chance, untrained=untrained)
    assert (f"| demo_i2t_R10 | 7.0 | {score_scale('demo_i2t_R10')} | 8.5 | {tracked(chance['demo_i2t_R10'])} |"
            in text)
    assert tracked(chance["demo_i2t_R10"]) == pytest.approx(9.6662, abs=1e-4)
    assert f"| demo_rsum | 27.0 | sum of the six R@K, 0–600 | 30.0 | {tracked(chance['demo_rsum'])} |" in text
    assert all(score_scale(name) for name in scores)  # no score without its scale
    assert f"| avg | 66.2 | {score_scale('avg')} | {tracked(41.23456)} |  |" in text
    assert "| MR | 80.0 | accuracy ×100 |  |  |" in text
    assert "| score | value | scale | untrained | chance |" in text


def test_the_commit_is_this_checkouts_or_unknown(tmp_path):
    commit = source_state()["commit"]
    assert commit == "unknown" or len(commit) == 40
    assert source_state(tmp_path)["commit"] == "unknown"


def test_the_first_screen_judges_the_model_and_the_teachers_row_names_each_model_once():
    """Issue 67.6: the scores come before the recipe, the headline score says it is the headline, a geometry score
    that rose above the untrained encoder's (lower is better) says so, and two poolers of one teacher are one
    entry of the teachers row."""
    cfg = with_overrides(Config(), {"train.method": "dalr"})
    assert [x.teacher for x in cfg.teachers.text] == ["packaged:all-MiniLM-L6-v2"] * 2  # the demo's two poolers
    scores = {"avg": 66.2, "dev_alignment": 0.513, "dev_uniformity": -2.5}
    untrained = {"avg": 58.7, "dev_alignment": 0.258, "dev_uniformity": -2.0}
    text = model_card(cfg, scores, ENV, "0123abc", untrained=untrained).split("\n---\n", 1)[1]
    assert text.index("## Scores") < text.index("## Recipe") < text.index("## Use")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "the headline" in rows["avg"] and "worse than untrained" not in rows["avg"]
    assert "**worse than untrained** (0.258 → 0.513)" in rows["dev_alignment"]
    assert "worse than untrained" not in rows["dev_uniformity"]  # −2.5 is below −2.0: more uniform
    (teachers,) = [line for line in text.splitlines() if line.startswith("| teachers |")]
    assert teachers.count("packaged:all-MiniLM-L6-v2") == 1
    assert "packaged:all-MiniLM-L6-v2 (avg_first_last ×0.33, avg ×0.67)" in teachers
