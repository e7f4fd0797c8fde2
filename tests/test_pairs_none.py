"""``data.pairs: none``: SimCSE on the text corpus alone (the papers' "wiki" rows), end to end."""

import json

import numpy as np
import pytest

from mmcse.config import ConfigError, parse_config
from tests.conftest import prepare_project, repo_params, shrink


@pytest.mark.parametrize("method", ["mcse", "kdmcse", "dalr", "mcseo"])
def test_pairs_none_refuses_every_method_but_simcse(method):
    with pytest.raises(ConfigError, match=rf"data\.pairs.*train\.method is '{method}'") as err:
        parse_config({"data": {"pairs": "none"}, "train": {"method": method},
                      "ablate": {"variants": {"a": {}}, "reference": "a"}})
    assert str(err.value).count("\n") == 0  # one line


def test_pairs_none_refuses_an_ablation_variant_that_adds_a_multimodal_method():
    with pytest.raises(ConfigError, match=r"ablate\.variants\.mcse.*data\.pairs.*train\.method is 'mcse'"):
        parse_config({"data": {"pairs": "none"}, "train": {"method": "simcse"},
                      "ablate": {"variants": {"simcse": {}, "mcse": {"train.method": "mcse"}}, "reference": "simcse"}})


def test_pairs_none_trains_and_evaluates_simcse_from_the_corpus_alone(tmp_path, monkeypatch):
    from mmcse.config import load_config
    from mmcse.pipeline import Paths, run_evaluate, run_train
    from mmcse.teachers import FeatureStore

    raw = shrink(repo_params())
    raw["data"]["pairs"] = "none"
    raw["train"].update(method="simcse", max_steps=4, eval_steps=4, checkpoint_steps=4)
    raw["ablate"].update(variants={"simcse": {}}, reference="simcse")
    root = prepare_project(tmp_path, raw)  # download, detect_objects, cache_teachers
    monkeypatch.chdir(root)
    manifest = json.loads((root / "data/raw/manifest.json").read_text())
    assert manifest["pairs"] == "none"
    assert manifest["counts"]["pairs"] == manifest["counts"]["images"] == 0
    assert manifest["counts"]["corpus_sentences"] == raw["data"]["demo"]["corpus_sentences"]
    assert (root / "data/raw/pairs.jsonl").read_text() == "" and not (root / "data/raw/images").exists()
    assert json.loads((root / "metrics/detect.json").read_text())["pairs_in"] == 0
    sets = json.loads((root / "data/teachers/manifest.json").read_text())["sets"]
    for name in ("image", "object", "joint_text", "joint_image"):  # empty sets: no image model ran
        assert FeatureStore.open(root / "data/teachers" / sets[name]).features.shape == (0, 0), name
    for text in sets["text"]:  # the text teachers still score the corpus (DALR-style ranking needs it)
        corpus = FeatureStore.open(root / "data/teachers" / text["corpus"]).features
        assert corpus.shape[0] == raw["data"]["demo"]["corpus_sentences"] and np.isfinite(corpus).all()
        assert FeatureStore.open(root / "data/teachers" / text["caption"]).features.shape[0] == 0

    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    summary = run_train(cfg, paths, progress=False)
    assert summary["steps"] == 4 and np.isfinite(summary["best_dev_sts"])
    scores = run_evaluate(cfg, paths, paths.student / "best")
    assert set(scores) == {"DemoSTS", "avg"} and -100 <= scores["avg"] <= 100
