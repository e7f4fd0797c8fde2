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


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_pairs_none_trains_and_evaluates_simcse_from_the_corpus_alone(tmp_path, monkeypatch):
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.paths import Paths
    from mmcse.teachers.cache import FeatureStore

    raw = shrink(repo_params())
    raw["data"]["pairs"] = "none"
    raw["train"].update(method="simcse", max_steps=2, eval_steps=2, checkpoint_steps=2)
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

    # Train + evaluate as ablation jobs (2 rows × 2 seeds), transfer asked for on data without it.
    from mmcse.analysis.tables import aggregate, write_table
    from mmcse.config import with_overrides
    from mmcse.experiments.ablate import run_job
    from mmcse.experiments.jobs import expand

    cfg = with_overrides(load_config("params.yaml"), {
        "ablate.variants": {"simcse": {}, "lr 5e-4": {"train.learning_rate": 5e-4}}, "ablate.transfer": True})
    paths = Paths.of(cfg)
    results = [run_job(cfg, job, paths.ablations) for job in expand(cfg)]
    assert [r["status"] for r in results] == ["ok"] * 4
    keys = json.loads((root / "data/raw/manifest.json").read_text())["artifact_key"]
    assert {r["artifacts"]["data"] for r in results} == {keys}  # the pair-free data made above
    for r in results:
        history = json.loads((paths.ablations / r["variant"].replace(" ", "_") / f"seed{r['seed']}" /
                              "last/state.json").read_text())
        assert history["step"] == 2 and r["dev_metric"] == "dev_sts" and np.isfinite(r["best_dev"])
        assert set(r["scores"]) == {"avg", "dev_alignment", "dev_uniformity"}  # no images: no retrieval
        assert -100 <= r["scores"]["avg"] <= 100
    rows = aggregate(cfg, results)
    md = write_table(rows, paths.ablations, "avg", "simcse")["md"].read_text()
    assert "| variant | dev_alignment | dev_uniformity | STS avg | TR avg |" in md
    assert md.count("n/a (no transfer tasks)") == 2
    assert 0 <= rows[1]["avg_p"] <= 1 and rows[1]["paired_seeds"] == 2
