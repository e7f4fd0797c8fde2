"""Each job trains on the upstream artifacts of its own configuration (mmcse.experiments.upstream)."""

import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mmcse.config import ConfigError, parse_config, to_dict, with_overrides
from mmcse.experiments import upstream
from mmcse.experiments.ablate import run_job
from mmcse.experiments.jobs import Job, job_hash
from mmcse.experiments.params import load_config
from mmcse.experiments.upstream import resolve
from mmcse.integrity.keys import artifact_keys, require_top_level
from mmcse.io import read_json, read_jsonl
from mmcse.models.student import HEADS_FILE, HEADS_META
from mmcse.pipeline import download as download_stage
from mmcse.pipeline import train as train_stage
from mmcse.pipeline.paths import Paths
from mmcse.training.engine import Hooks


def test_keys_change_with_what_makes_each_artifact_and_nothing_else():
    cfg = parse_config({})
    base = artifact_keys(cfg)
    captions = artifact_keys(with_overrides(cfg, {"data.captions": "longest"}))
    assert all(captions[k] != base[k] for k in ("data", "objects", "teachers"))  # inputs' keys chain
    threshold = artifact_keys(with_overrides(cfg, {"detect.min_objects": 3}))
    assert threshold["data"] == base["data"] and threshold["objects"] != base["objects"]
    assert threshold["teachers"] != base["teachers"]  # object crops are teacher inputs
    teacher = artifact_keys(with_overrides(cfg, {"teachers.joint.dim": 16}))
    assert (teacher["data"], teacher["objects"]) == (base["data"], base["objects"])
    assert teacher["teachers"] != base["teachers"]
    tokenizer = artifact_keys(with_overrides(cfg, {"model.max_seq_len": 16}))
    assert tokenizer["data"] == base["data"] and tokenizer["objects"] != base["objects"]
    for untouched in ({"train.learning_rate": 1e-4}, {"loss.lambda_img": 0.5}, {"teachers.num_workers": 0},
                      {"detect.shard_size": 8}, {"evaluate.pooler": "avg"}):
        assert artifact_keys(with_overrides(cfg, untouched)) == base, untouched
    # an ablation seed repeats training on the pipeline's data
    assert artifact_keys(with_overrides(cfg, {"base.seed": 7}), data_seed=cfg.base.seed) == base
    assert artifact_keys(with_overrides(cfg, {"base.seed": 7}))["data"] != base["data"]


@pytest.mark.parametrize("key, value", [("data.source", "senteval"), ("base.data_dir", "elsewhere"),
                                        ("data.demo.sts_test_pairs", 10), ("teachers.cache_dir", "t2"),
                                        ("data.demo", {"num_images": 8})])
def test_a_key_that_cannot_vary_per_job_is_refused_when_the_variants_load(key, value):
    raw = to_dict(parse_config({}))
    raw["ablate"]["variants"] = {"mcse": {}, "bad": {key: value}}
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    message = str(err.value)
    assert "\n" not in message and "ablate.variants.bad" in message and key in message
    assert "data.captions" in message and "teachers.*" in message  # the keys that can
    raw["ablate"]["variants"] = {"mcse": {}}
    raw["sweep"]["space"] = {key: {"type": "categorical", "choices": [value]}}
    with pytest.raises(ConfigError, match="sweep.space"):
        parse_config(raw)


def test_the_train_stage_refuses_top_level_artifacts_of_another_configuration(project):
    cfg = load_config("params.yaml")
    assert require_top_level(cfg, Paths.of(cfg)).raw == Path("data/raw")
    changed = with_overrides(cfg, {"data.captions": "longest"})  # params edited, download not rerun
    with pytest.raises(ValueError) as err:
        train_stage.run_train(changed, Paths.of(changed), out_dir=project / "m", hooks=Hooks(progress=False))
    assert "data/raw (data: made from another configuration)" in str(err.value) and "dvc repro" in str(err.value)
    assert not (project / "m").exists()  # refused before any run or training


def test_a_variant_gets_its_own_artifacts_once_and_shares_the_rest(project, monkeypatch):
    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    top_sets = sorted(p.name for p in paths.teachers.iterdir())
    variant = with_overrides(cfg, {"data.captions": "longest", "base.seed": 3})
    calls = []
    real_download = download_stage.run_download
    monkeypatch.setattr(upstream, "run_download", lambda *a, **k: calls.append(1) or real_download(*a, **k))
    # two jobs of the same variant at once: one computes, the other waits and reuses
    found = []
    threads = [threading.Thread(target=lambda: found.append(resolve(variant, paths, cfg.base.seed)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 2 and found[0] == found[1] and calls == [1]
    up = found[0]
    assert up.raw == paths.raw.parent / "upstream" / f"raw-{up.keys['data']}"
    pairs, top_pairs = read_jsonl(up.raw / "pairs.jsonl"), read_jsonl(paths.raw / "pairs.jsonl")
    assert len(pairs) == cfg.data.demo.num_images < len(top_pairs)  # one (the longest) caption per image
    by_image = {}
    for p in top_pairs:
        by_image.setdefault(p["image_id"], []).append(p["caption"])
    assert all(p["caption"] == max(by_image[p["image_id"]], key=len) for p in pairs)
    # same generated world and the same evaluation data as the top level
    assert (up.raw / "sts/test.jsonl").read_text() == (paths.raw / "sts/test.jsonl").read_text()
    assert read_json(up.teacher_manifest)["artifact_key"] == up.keys["teachers"]
    assert sorted(p.name for p in paths.teachers.iterdir()) == top_sets  # the DVC-tracked cache is only read

    # a teacher-only variant: the top-level data and objects, its own joint teacher, shared image sets
    teacher = with_overrides(cfg, {"teachers.joint.dim": 16})
    up = resolve(teacher, paths, cfg.base.seed)
    assert (up.raw, up.objects) == (paths.raw, paths.objects) and calls == [1]
    sets = read_json(up.teacher_manifest)["sets"]
    assert (paths.teachers / sets["image"]).is_dir()  # found in the top-level cache, not recomputed
    assert (up.teachers / sets["joint_image"]).is_dir() and not (paths.teachers / sets["joint_image"]).exists()


def test_an_ablation_job_trains_on_the_teachers_its_variant_names(project):
    import mlflow

    cfg = load_config("params.yaml")
    job = Job("cca16", 1, {"teachers.joint.dim": 16, "train.method": "kdmcse", "base.seed": 1})
    result = run_job(cfg, job, project / "ablation")
    best = project / "ablation/cca16/seed1/best"
    heads = load_file(str(best / HEADS_FILE))
    assert heads["teacher_image_proj.0.weight"].shape[1] == 16  # g_φv (dense + tanh) read 16-d v̂: the variant's CCA
    assert read_json(best / HEADS_META)["joint_dim"] == 16 != cfg.teachers.joint.dim
    keys = artifact_keys(with_overrides(cfg, job.overrides), data_seed=cfg.base.seed)
    assert result["artifacts"] == keys and result["config_hash"] == job_hash(
        with_overrides(cfg, job.overrides), cfg.base.seed)
    tags = mlflow.get_run(result["run_id"]).data.tags
    assert {k: tags[f"artifact.{k}"] for k in keys} == keys


def test_the_teacher_comparison_preset_computes_each_teacher_set_once_offline(project):
    import shutil

    from mmcse.experiments.jobs import expand, job_config
    from tests.conftest import REPO

    shutil.copytree(REPO / "ablations", project / "ablations")
    shutil.copytree(REPO / "profiles", project / "profiles")  # the preset names its teachers by role
    cfg = load_config("params.yaml", {"ablate.preset": "dalr-table9", "ablate.seeds": [1]})
    paths = Paths.of(cfg)
    image_sides, text_sets, joint_rows = {}, set(), set()
    for job in expand(cfg):
        job_cfg = job_config(cfg, job)
        up = resolve(job_cfg, paths, cfg.base.seed)
        sets = read_json(up.teacher_manifest)["sets"]
        assert [(t["pooler"], t["weight"]) for t in sets["text"]] == [
            (t.pooler, t.weight) for t in job_cfg.teachers.text]
        joint = next(d / sets["joint_image"] for d in up.teacher_dirs if (d / sets["joint_image"]).is_dir())
        kind = read_json(joint / "index.json")["teacher"].get("kind")  # the image encoder's key has none
        # "CLIP": the CCA joint teacher's own image side; "ResNet": the image encoder's set itself (image-only)
        side = job_cfg.teachers.joint.image_side
        assert (kind == "cca") == (side == "joint") and (sets["joint_image"] == sets["image"]) == (side != "joint")
        image_sides[job.variant.split(" + ")[0]] = side
        for t in sets["text"]:
            if t["teacher"] == "joint":  # the "CLIP" text teacher: the row's own joint text side, not a new set
                assert t["caption"] == sets["joint_text"]
                joint_rows.add(t["caption"])
            else:
                text_sets.add((t["pooler"], t["caption"]))
    assert len({pooler for pooler, _ in text_sets}) == 3 == len(text_sets)  # one set per pooler, shared by rows
    assert image_sides == {"CLIP": "joint", "ResNet": "image_encoder"}
    assert len(joint_rows) == 1  # one CCA text side, shared by the CLIP and ResNet rows
