"""Paper profiles: every profile writes valid params (comments kept), each paper's numbers
land where they belong, bad profiles change nothing, and the real path fails fast offline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from mmcse.config import ConfigError
from mmcse.experiments.params import load_config
from mmcse.experiments.profiles import apply_profile, list_profiles, profile_values
from tests.conftest import REPO, params_copy


@pytest.fixture
def project(tmp_path):
    """A copy of the repo's params.yaml with the presets, profiles and recipes beside it."""
    return params_copy(tmp_path)

PROFILES = REPO / "profiles"


def test_every_paper_has_four_profiles_and_duet_one_per_dataset():
    students = [f"{paper}-{data}-{model}" for paper in ("dalr", "kdmcse", "mcseo")
                for data in ("flickr", "coco") for model in ("bert", "roberta")]
    cc12m = [f"kdmcse-cc12m{k}-{model}" for k in (1, 2) for model in ("bert", "roberta")]  # KDMCSE Table 4
    assert sorted(list_profiles(REPO)) == sorted([*students, *cc12m, "duet-coco", "duet-flickr", "demo"])


# (lr, batch, method, preset) as each paper prints them
EXPECTED = {
    "kdmcse-flickr-bert": (3e-5, 64, "kdmcse", "kdmcse-table3"),
    "kdmcse-coco-roberta": (1e-5, 128, "kdmcse", "kdmcse-table3"),
    "dalr-flickr-bert": (2e-5, 128, "dalr", "dalr-table3"),
    "dalr-coco-roberta": (1e-5, 128, "dalr", "dalr-table3"),
    "mcseo-flickr-bert": (3e-5, 64, "mcseo", "mcseo-table1"),
    "mcseo-flickr-roberta": (1e-5, 64, "mcseo", "mcseo-table1"),
    "duet-coco": (2e-5, 90, "duet", "duet-table2"),  # §5.2: Adam 2e-5, batch 90
    "duet-flickr": (2e-5, 90, "duet", "duet-table2"),
}


# ~0.5 s each: the fast tier checks the profiles whose printed numbers EXPECTED holds, the full suite all
@pytest.mark.parametrize("name", [n if n in EXPECTED else pytest.param(n, marks=pytest.mark.slow)
                                  for n in list_profiles(REPO) if n != "demo"])
def test_each_profile_gives_valid_params_with_the_papers_numbers(project, name):
    original = (project / "params.yaml").read_text()
    changed = apply_profile(project / "params.yaml", name)
    assert changed
    cfg = load_config(project / "params.yaml")
    text = (project / "params.yaml").read_text()
    paper, data, model = name.split("-") if not name.startswith("duet-") else (*name.split("-"), "bert")
    # every comment of the original file is still there (but those of replaced list items)
    lines = original.splitlines()
    comments = [line.split("#", 1)[1].strip() for line in lines if "#" in line]
    assert [c for c in comments if c not in text] == []
    assert cfg.model.name_or_path == {"bert": "bert-base-uncased", "roberta": "roberta-base"}[model]
    assert cfg.data.pairs == {"flickr": "flickr30k", "coco": "coco", "cc12m1": "cc12m", "cc12m2": "cc12m"}[data]
    if cfg.data.pairs == "cc12m":  # KDMCSE Table 4: two subsets of one million pairs
        assert (cfg.data.image_limit, cfg.data.cc12m_subset) == (1_000_000, int(data[-1]))
    # DALR scores every model's retrieval on Flickr30k (Table 4); the others on their own test split
    assert cfg.data.retrieval_test == ("flickr30k" if (paper, data) == ("dalr", "coco") else "same")
    assert cfg.model.max_seq_len == 32 and cfg.train.max_steps == 0 and cfg.ablate.seeds == [1, 2, 3, 4, 5]
    if paper == "duet":  # a retrieval model: no corpus or STS; 30 epochs, val rsum every 2,000 steps
        assert (cfg.train.epochs, cfg.train.eval_steps, cfg.model.duet.joint_dim) == (30, 2000, 1024)
        assert cfg.regions.source == {"coco": "tsv", "flickr": "npy"}[data] and cfg.regions.dim == 2048
    else:
        assert cfg.data.corpus == "wiki1m" and cfg.data.source == "senteval" and cfg.data.senteval_dir == "download"
        assert cfg.train.eval_steps == 125 and cfg.loss.temperature == 0.05
        assert cfg.evaluate.pooler == "cls_before_pooler"
    if name in EXPECTED:
        lr, batch, method, preset = EXPECTED[name]
        assert (cfg.train.learning_rate, cfg.train.batch_size, cfg.train.method) == (lr, batch, method)
        assert cfg.ablate.preset == preset and cfg.ablate.variants  # the preset's rows
    if paper == "dalr":
        assert (cfg.loss.dalr.lambda_cml, cfg.loss.dalr.mu_iml) == (0.1, 0.2)
        assert [t.teacher.split("/")[0] for t in cfg.teachers.text] == ["princeton-nlp", "voidism"]
        assert all(model in t.teacher for t in cfg.teachers.text)
        assert [t.weight for t in cfg.teachers.text] == [0.33, 0.67]
        assert cfg.data.transfer_tasks == ["MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC"]  # Table 2
        assert cfg.evaluate.transfer.kfold == 10
    else:
        assert cfg.data.transfer_tasks == []
    if paper == "kdmcse":
        assert (cfg.loss.kdmcse.threshold, cfg.loss.kdmcse.margin, cfg.loss.lambda_img) == (0.9, 0.125, 0.01)
        assert cfg.teachers.joint.kind == "clip" and cfg.data.captions == "all"
    if paper == "mcseo":
        assert (cfg.loss.lambda_img, cfg.loss.mcseo.beta, cfg.data.captions) == (0.01, 0.005, "longest")
        assert cfg.detect.backend == "sam2" and cfg.teachers.image_encoder == "resnet50"
    # applying it again changes nothing; the file reads the same to PyYAML and to DVC's loader
    assert apply_profile(project / "params.yaml", name) == {}
    assert yaml.safe_load(text)["train"]["learning_rate"] == cfg.train.learning_rate


def test_a_bad_profile_changes_nothing(project):
    folder = project / "profiles"
    (folder / "broken.yaml").write_text(yaml.safe_dump({
        "common": {"train.checkpoint_steps": 100, "train.warp_speed": 9},
        "data": {"flickr": {}}, "model": {"bert": {}}}))
    (folder / "negative.yaml").write_text(yaml.safe_dump({
        "common": {"train.checkpoint_steps": -1}, "data": {"flickr": {}}, "model": {"bert": {}}}))
    before = (project / "params.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"train\.warp_speed.*valid keys under train: .*learning_rate"):
        apply_profile(project / "params.yaml", "broken-flickr-bert")
    (folder / "broken.yaml").unlink()  # its unknown key is owned by every profile: every application fails on it
    with pytest.raises(ConfigError, match="train.checkpoint_steps.*must be"):
        apply_profile(project / "params.yaml", "negative-flickr-bert")
    with pytest.raises(ConfigError, match="unknown profile 'kdmcse-wiki-bert'.*negative-flickr-bert"):
        profile_values("kdmcse-wiki-bert", project)
    (folder / "typo.yaml").write_text("comon: {}\n")
    with pytest.raises(ConfigError, match="unknown key.*comon.*valid keys: description, recipe, encoder, common"):
        list_profiles(project)
    assert (project / "params.yaml").read_bytes() == before


def test_one_command_applies_a_profile_and_the_real_path_fails_fast_offline(project):
    """`mmcse profile NAME` then the download stage, offline: a clear error naming what is
    missing and how to get it, before any compute."""
    env = {**os.environ, "MMCSE_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(project / "hub")}
    got = subprocess.run([sys.executable, "-m", "mmcse.cli", "profile", "kdmcse-coco-bert"], cwd=project,
                         env=env, capture_output=True, text=True)
    assert got.returncode == 0 and "train.method: 'mcse' -> 'kdmcse'" in got.stdout
    got = subprocess.run([sys.executable, str(REPO / "stages" / "download.py")], cwd=project, env=env,
                         capture_output=True, text=True)
    assert got.returncode == 2, got.stderr
    assert "senteval.tar is not in the local Hugging Face cache" in got.stderr and "offline" in got.stderr
    assert "Traceback" not in got.stderr and not (project / "data" / "raw").exists()


def test_a_profile_keeps_the_local_senteval_copy_the_params_name(project, capsys):
    """Issue 33.9: `mmcse profile` would set data.senteval_dir to `download`; a SentEval folder the
    params file already names is kept (and said so), one that does not exist is replaced."""
    from mmcse.cli import main

    (project / "senteval").mkdir()
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["data"]["senteval_dir"] = "senteval"
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    main(["profile", "kdmcse-flickr-bert", "--params", str(project / "params.yaml")])
    assert load_config(project / "params.yaml").data.senteval_dir == "senteval"
    assert "data.senteval_dir: 'senteval' kept (a local copy; the profile would download it)" in capsys.readouterr().out
    (project / "senteval").rmdir()
    apply_profile(project / "params.yaml", "demo")
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["data"]["senteval_dir"] = "senteval"  # named, but not there: the profile's download
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    apply_profile(project / "params.yaml", "kdmcse-flickr-bert")
    assert load_config(project / "params.yaml").data.senteval_dir == "download"


def test_dvc_set_param_changes_its_own_lines_and_the_demo_profile_restores_the_file(project):
    """issue 39: params.yaml is in the style DVC writes. `dvc exp run -S` (DVC's own
    `dvc.utils.hydra.apply_overrides`, what -S calls before running) then changes only the lines of the
    keys it sets, and `mmcse profile demo` gives back the committed file byte for byte, after a paper
    profile too."""
    import difflib

    from dvc.utils.hydra import apply_overrides

    from mmcse.experiments.profiles import dvc_style

    params = project / "params.yaml"
    before = params.read_text()
    assert before == (REPO / "params.yaml").read_text() and dvc_style(before) == before
    apply_overrides(str(params), ["train.method=simcse", "data.splits=[train,restval]", "loss.lambda_img=0.5"])
    diff = [line for line in difflib.unified_diff(before.splitlines(), params.read_text().splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert sorted(line.split("#")[0].strip() for line in diff) == [
        "+  - restval", "+  lambda_img: 0.5", "+  method: simcse", "-  lambda_img: 0.1", "-  method: mcse"]
    assert apply_profile(params, "demo") == {"data.splits": (["train", "restval"], ["train"]),
                                             "train.method": ("simcse", "mcse"), "loss.lambda_img": (0.5, 0.1)}
    assert params.read_text() == before
    apply_profile(params, "dalr-coco-roberta")
    apply_overrides(str(params), ["train.epochs=2"])
    apply_profile(params, "demo")
    assert params.read_text() == before
