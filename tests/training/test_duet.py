"""DUET in the pipeline: the cache_regions / train / evaluate stage scripts with ``train.method: duet``,
its resume point, checkpoint format, dev and test scores against a direct computation, and config checks."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertModel

from mmcse import tracking
from mmcse.config import ConfigError, with_overrides
from mmcse.detection.regions import RegionStore
from mmcse.evaluation.retrieval import retrieval_metrics
from mmcse.experiments.params import load_config
from mmcse.io import read_jsonl
from mmcse.models.duet import DuetArchitecture, DuetModel
from mmcse.pipeline.cache_regions import run_cache_regions
from mmcse.pipeline.paths import Paths
from mmcse.training.checkpoints import load_history
from mmcse.training.duet import (
    DUET_META,
    DUET_WEIGHTS,
    RetrievalSplit,
    load_duet,
    same_image_mask,
    save_duet,
    split_embeddings,
    train_duet,
)
from mmcse.training.engine import Hooks
from tests.conftest import REPO, TINY_DUET, prepare_project, repo_params, shrink, stage_here


def duet_params() -> dict:
    raw = shrink(repo_params())
    raw["train"]["method"] = "duet"
    raw["model"]["duet"] = dict(TINY_DUET)
    raw["train"].update(max_steps=8, epochs=2, eval_steps=2, checkpoint_steps=4)  # 48 pairs: 6 steps an epoch
    return raw


@pytest.fixture(scope="module")
def duet_project(tmp_path_factory) -> Path:
    """download, detect_objects, cache_teachers, then the cache_regions stage script."""
    root = prepare_project(tmp_path_factory.mktemp("duet"), duet_params())
    assert stage_here("cache_regions", root).returncode == 0
    return root


@pytest.fixture
def duet_cwd(duet_project, monkeypatch) -> Path:
    monkeypatch.chdir(duet_project)
    return duet_project


def region_sets(root: Path) -> dict[str, Path]:
    cfg = load_config(root / "params.yaml")
    result = run_cache_regions(cfg, Paths.of(cfg))
    assert all(result["hits"].values())  # the cache_regions stage built them: opened, not rebuilt
    return {split: Path(cfg.base.data_dir) / cfg.regions.cache_dir / name for split, name in result["sets"].items()}


def val_rsum(model, tokenizer, cfg, sets: dict[str, Path], tmp_path: Path) -> float:
    """The val split's rsum of a loaded retrieval checkpoint, encoded here (what its dev score must be)."""
    from mmcse.models.tokens import cached_tokens

    val = RetrievalSplit.load(Path("data/raw/retrieval/val_images.jsonl"),
                              Path("data/raw/retrieval/val_captions.jsonl"), RegionStore.open(sets["val"]))
    tokens = cached_tokens(tmp_path / "tok", "val", tokenizer, val.captions, cfg.model.max_seq_len)
    images, texts = split_embeddings(model, val, tokens, 16, torch.device("cpu"))
    return retrieval_metrics(images, texts, val.text_image)["rsum"]


def assert_killed_at_6_resumes_to(cfg, sets: dict[str, Path], tmp_path: Path, full, full_dir: Path) -> None:
    """Killed after step 6 (resume point at 4), run again in ``tmp_path/resumed``: the same steps, history and
    weights as the uninterrupted run ``full`` in ``full_dir``."""
    def kill_at_6(step: int, score: float) -> None:
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_duet(cfg, "data/raw", sets, tmp_path / "resumed", hooks=Hooks(on_eval=kill_at_6, progress=False))
    assert json.loads((tmp_path / "resumed/last/state.json").read_text())["step"] == 4
    resumed = train_duet(cfg, "data/raw", sets, tmp_path / "resumed", hooks=Hooks(progress=False))
    assert resumed.steps == full.steps == 8 and resumed.history == full.history
    a = load_file(str(full_dir / "last/student.safetensors"))
    b = load_file(str(tmp_path / "resumed/last/student.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_image_mask_marks_other_pairs_of_one_image():
    mask = same_image_mask(["a", "b", "a", "c", "b"], torch.device("cpu"))
    expected = np.zeros((5, 5), bool)
    expected[0, 2] = expected[2, 0] = expected[1, 4] = expected[4, 1] = True
    assert np.array_equal(mask.numpy(), expected)  # never the diagonal: that is the positive


def test_a_saved_duet_loads_to_the_same_embeddings_with_its_layers_still_tied(tmp_path):
    from transformers import AutoTokenizer

    from mmcse.hub import resolve_model

    torch.manual_seed(0)
    text = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
                     add_pooling_layer=False)
    arch = {"region_dim": 12, "visual_layers": 1, "shared_layers": 1, "joint_dim": 16, "heads": 2, "ff_dim": 32,
            "box_layer": None, "dropout": 0.1, "visual_dim": None, "region_norm": "layernorm", "tie_shared": True,
            "spatial": True}
    model = DuetModel(text, DuetArchitecture(**arch)).eval()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("packaged:all-MiniLM-L6-v2"))
    save_duet(model, tokenizer, arch, tmp_path / "ck")
    assert not any(k.startswith("text.") for k in load_file(str(tmp_path / "ck" / DUET_WEIGHTS)))  # in the HF folder
    loaded, _ = load_duet(tmp_path / "ck")
    assert loaded.text_layers() is loaded.shared  # tying survives: one set of modules, not two copies
    regions, boxes = torch.randn(3, 4, 12), torch.rand(3, 4, 5)
    ids = torch.randint(5, 900, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(model.encode_image(regions, boxes)[0], loaded.encode_image(regions, boxes)[0])
        assert torch.equal(model.encode_text(ids, mask), loaded.encode_text(ids, mask))


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_duet_trains_and_evaluates_through_the_stage_scripts(duet_cwd, capsys):
    assert stage_here("train", duet_cwd).returncode == 0 and stage_here("evaluate", duet_cwd).returncode == 0
    summary = json.loads(Path("models/student/summary.json").read_text())
    assert summary["dev_metric"] == "val_rsum" and summary["steps"] == 8
    assert 0 <= summary["best_dev_rsum"] <= 600 and summary["best_dev"] == summary["best_dev_rsum"]
    state = json.loads(Path("models/student/best/train_state.json").read_text())
    assert state["method"] == "duet" and state["image_head"] is None
    for name in ("config.json", "model.safetensors", DUET_WEIGHTS, DUET_META):
        assert Path("models/student/best", name).is_file()

    scores = {k.removeprefix("test_"): v for k, v in json.loads(Path("metrics/eval.json").read_text()).items()}
    assert {"demo_i2t_R1", "demo_t2i_R10", "demo_rsum", "demo_NDCG25_rouge_l"} <= set(scores)
    assert not any(k in scores for k in ("DemoSTS", "avg", "dev_alignment"))  # a retrieval model: no STS
    assert scores["demo_rsum"] == pytest.approx(sum(scores[f"demo_{d}_R{k}"] for d in ("i2t", "t2i")
                                                    for k in (1, 5, 10)), abs=1e-3)
    train_metrics = json.loads(Path("metrics/train.json").read_text())
    assert train_metrics["best_dev_rsum"] == pytest.approx(summary["best_dev_rsum"])
    dev_rows = Path("plots/dev.csv").read_text().splitlines()
    assert dev_rows[0] == "step,dev" and len(dev_rows) == 1 + 5  # steps 0, 2, 4, 6, 8: the val rsum
    assert [float(r.split(",")[1]) for r in dev_rows[1:]] == [
        round(h["dev"], 6) for h in load_history(Path("models/student")) if "dev" in h]

    # the run record: every loss term, the dev scores, the test scores
    with sqlite3.connect("mlruns/mlflow.db") as db:
        run_id = tracking.folder_run_id("models/student")
        keys = {k for (k,) in db.execute("select distinct key from metrics where run_uuid=?", (run_id,))}
    assert "run_id" not in summary  # random: kept out of the DVC output (mlruns/records)
    assert {"loss/hinge", "loss/box", "loss/norm", "loss/loss", "dev_rsum", "dev_i2t_R1", "best_dev_rsum",
            "test_demo_rsum", "test_demo_NDCG25_rouge_l"} <= keys

    # mmcse eval --retrieval on the DUET checkpoint reports the evaluate stage's scores
    from mmcse.cli import main

    capsys.readouterr()
    main(["eval", "--model", "models/student/best", "--retrieval", "--params", "params.yaml"])
    out = capsys.readouterr().out
    printed = json.loads(out[out.index("{"):])
    assert {k: v for k, v in printed.items() if k.startswith("demo_")} == pytest.approx(
        {k: round(v, 4) for k, v in scores.items() if k.startswith("demo_")}, abs=1e-4)

    # the test scores are those of v_I, v_C computed here directly from the checkpoint
    cfg = load_config("params.yaml")
    model, tokenizer = load_duet("models/student/best")
    sets = {k: Path(v) for k, v in summary["region_sets"].items()}
    images = [r["image_id"] for r in read_jsonl("data/raw/retrieval/images.jsonl")]
    captions = read_jsonl("data/raw/retrieval/captions.jsonl")
    store = RegionStore.open(sets["test"])
    r, b, m = (torch.from_numpy(a) for a in store.rows(images))
    enc = tokenizer([c["caption"] for c in captions], padding=True, truncation=True,
                    max_length=cfg.model.max_seq_len, return_tensors="pt")
    with torch.no_grad():
        v_img = model.encode_image(r, b, m)[0].numpy()
        v_txt = model.encode_text(enc["input_ids"], enc["attention_mask"]).numpy()
    direct = retrieval_metrics(v_img, v_txt, [images.index(c["image_id"]) for c in captions])
    for key, value in direct.items():
        assert scores[f"demo_{key}"] == pytest.approx(value, abs=1e-3)


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_a_killed_duet_run_resumes_to_the_same_weights(duet_cwd, tmp_path):
    cfg = load_config("params.yaml")
    sets = region_sets(duet_cwd)
    full = train_duet(cfg, "data/raw", sets, tmp_path / "full", hooks=Hooks(progress=False))
    assert_killed_at_6_resumes_to(cfg, sets, tmp_path, full, tmp_path / "full")


def test_a_checkpoint_has_the_same_bytes_with_cold_and_warm_token_caches(duet_cwd, tmp_path):
    """Tokenizing the captions (cold cache) sets the fast tokenizer's truncation and padding; the
    saved tokenizer is the loaded one either way, so models/student hashes the same."""
    import hashlib
    import shutil

    from mmcse.models.student import load_tokenizer

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2})
    sets = region_sets(duet_cwd)
    shutil.rmtree("data/tokens", ignore_errors=True)
    train_duet(cfg, "data/raw", sets, tmp_path / "cold", hooks=Hooks(progress=False))
    assert any(Path("data/tokens").glob("captions-*"))
    train_duet(cfg, "data/raw", sets, tmp_path / "warm", hooks=Hooks(progress=False))

    def digests(folder: Path) -> dict[str, str]:
        return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    cold, warm = digests(tmp_path / "cold/best"), digests(tmp_path / "warm/best")
    assert "tokenizer.json" in cold and cold == warm
    load_tokenizer(cfg.model.name_or_path).save_pretrained(tmp_path / "as_loaded")  # no call made on it
    assert (tmp_path / "cold/best/tokenizer.json").read_bytes() == (tmp_path / "as_loaded/tokenizer.json").read_bytes()


def test_a_damaged_stage_region_set_is_passed_by_and_its_rebuilt_copy_used(duet_cwd, tmp_path):
    """With the cache_regions stage's set damaged, the lookup a training makes rebuilds the set under
    data/upstream/regions and hands out that copy, never the damaged one (which it does not touch)."""
    import shutil

    from mmcse.integrity.keys import require_top_level
    from mmcse.pipeline.cache_regions import region_sets_for

    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    stage_sets = region_sets(duet_cwd)
    damaged = stage_sets["train"]
    backup = tmp_path / "backup"
    shutil.copytree(damaged, backup)
    try:
        data = bytearray((damaged / "regions.npy").read_bytes())
        data[-64:] = b"\x07" * 64  # same size, other values (the tail may be zero padding): only the digest tells
        (damaged / "regions.npy").write_bytes(bytes(data))
        found = region_sets_for(cfg, paths, require_top_level(cfg, paths))
        assert found["train"] == paths.raw.parent / "upstream" / "regions" / damaged.name
        assert found["val"] == stage_sets["val"]  # intact sets are still read where they are
        RegionStore.open(found["train"])  # the copy handed out is sound
        assert (damaged / "regions.npy").read_bytes() == bytes(data)  # the stage's output is not written
        result = train_duet(
            with_overrides(cfg, {"train.max_steps": 2, "train.eval_steps": 2}), "data/raw", found, tmp_path / "m",
            hooks=Hooks(progress=False),
        )
        assert result.steps == 2
    finally:
        shutil.rmtree(damaged)
        shutil.copytree(backup, damaged)
        shutil.rmtree(paths.raw.parent / "upstream" / "regions" / damaged.name, ignore_errors=True)


def test_the_dev_score_is_the_val_rsum_of_the_best_checkpoint(duet_cwd, tmp_path):
    cfg = load_config("params.yaml")
    sets = region_sets(duet_cwd)
    result = train_duet(cfg, "data/raw", sets, tmp_path / "m", hooks=Hooks(progress=False))
    devs = [(h["dev"], h["step"]) for h in result.history if "dev" in h]
    assert result.best_score == max(d for d, _ in devs)
    model, tokenizer = load_duet(tmp_path / "m/best")

    assert val_rsum(model, tokenizer, cfg, sets, tmp_path) == pytest.approx(result.best_score, abs=1e-6)


def test_an_ablation_job_of_another_region_setting_builds_its_own_regions(duet_cwd):
    from mmcse.analysis.tables import table_metric
    from mmcse.experiments.ablate import run_job
    from mmcse.experiments.jobs import expand

    cfg = with_overrides(load_config("params.yaml"), {
        "ablate.variants": {"36 regions": {}, "2 regions": {"regions.max_regions": 2}},
        "ablate.reference": "36 regions", "ablate.seeds": [1], "ablate.metric": "rsum",
        "train.max_steps": 2, "train.eval_steps": 2})
    assert table_metric(cfg) == "demo_rsum"
    results = {r["variant"]: r for r in (run_job(cfg, job, Paths.of(cfg).ablations) for job in expand(cfg))}
    assert {r["status"] for r in results.values()} == {"ok"}
    two = Path(json.loads((Path("ablation/2_regions/seed1/summary.json")).read_text())["region_sets"]["train"])
    assert two.parent == Path("data/upstream/regions")  # not the stage's folder (DVC's output)
    assert RegionStore.open(two).max_regions == 2
    assert all(r["dev_metric"] == "val_rsum" and "demo_rsum" in r["scores"] for r in results.values())


def test_missing_region_files_fail_before_training_naming_the_file(duet_cwd, tmp_path):
    from mmcse.errors import CorruptArtifact

    cfg = load_config("params.yaml", {"regions.source": "tsv", "regions.files": [str(tmp_path / "absent.tsv")]})
    with pytest.raises(CorruptArtifact, match="absent.tsv"):
        run_cache_regions(cfg, Paths.of(cfg))


def test_no_val_split_is_refused_with_the_reason(tmp_path):
    (tmp_path / "val_images.jsonl").write_text("")
    (tmp_path / "val_captions.jsonl").write_text("")
    with pytest.raises(ValueError, match="val split"):  # refused before the regions are looked at
        RetrievalSplit.load(tmp_path / "val_images.jsonl", tmp_path / "val_captions.jsonl", None)  # type: ignore


@pytest.mark.parametrize(("overrides", "message"), [
    ({"data.pairs": "none"}, "data.pairs"),
    ({"data.pairs": "coco", "data.splits": ["train", "val"]}, "val split"),
    ({"evaluate.retrieval.enabled": False}, "retrieval"),
    ({"model.duet.box_layer": 3}, "Eq. 30"),  # TINY_DUET: L = 3, so l <= 2
    ({"model.duet.heads": 5}, "divisible"),
    ({"regions.source": "tsv"}, "regions.files"),
    ({"regions.dim": 2048}, "regions.dim"),
    ({"loss.duet.margin": -0.1}, "loss.duet.margin"),
])
def test_duet_settings_are_checked_before_any_compute(overrides, message):
    small = {"train.method": "duet", "model.duet.visual_layers": 2, "model.duet.shared_layers": 1}
    assert load_config(REPO / "params.yaml", small).train.method == "duet"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(REPO / "params.yaml", {**small, **overrides})


def test_duet_presets_and_profiles_resolve(tmp_path):
    from mmcse.analysis.tables import table_metric
    from mmcse.experiments.profiles import list_profiles, profile_values

    assert {"duet-coco", "duet-flickr"} <= set(list_profiles(REPO))
    coco = load_config(REPO / "params.yaml", profile_values("duet-coco", REPO))
    assert (coco.train.batch_size, coco.train.learning_rate, coco.train.epochs, coco.loss.duet.margin) == \
        (90, 2e-5, 30, 0.2)
    assert (coco.model.duet.joint_dim, coco.model.duet.shared_layers, coco.model.duet.visual_layers) == (1024, 2, 4)
    assert table_metric(coco) == "coco_1k_rsum" and set(coco.ablate.variants) == {
        "Full DUET", "w/o shared layers", "w/o spatial features", "no norm reg"}
    flickr = load_config(REPO / "params.yaml", profile_values("duet-flickr", REPO))
    assert table_metric(flickr) == "flickr30k_1k_rsum" and flickr.regions.source == "npy"
    table1 = load_config(REPO / "params.yaml", {"ablate.preset": "duet-table1"})
    assert list(table1.ablate.variants) == ["VSE++", "VSRN", "DUET"] and table1.ablate.variants["VSE++"] == {
        "train.method": "vsepp"} and table1.ablate.variants["VSRN"] == {"train.method": "vsrn"}
    from mmcse.experiments.plan import plan

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    for folder in ("recipes", "profiles", "ablations"):
        (tmp_path / folder).symlink_to(REPO / folder)
    from mmcse.experiments.profiles import apply_profile

    apply_profile(params, "duet-coco")
    rows = {row["variant"]: row["config"] for row in plan(params, "duet-table1")["rows"]}
    vsepp = rows["VSE++"]  # its own recipe: the authors' train.py defaults
    assert (vsepp["train"]["learning_rate"], vsepp["train"]["batch_size"], vsepp["train"]["lr_decay_epochs"],
            vsepp["train"]["max_grad_norm"], vsepp["loss"]["vsepp"]["margin"]) == (2e-4, 128, 15, 2.0, 0.2)
    # its own input: ResNet-152 (ImageNet) on the images, 30 epochs frozen, then 15 fine-tuned at 2e-5 (RN152 (FT))
    assert vsepp["data"]["splits"] == ["train", "restval"] and vsepp["model"]["vsepp"] == {
        "word_dim": 300, "joint_dim": 1024, "gru_layers": 1, "min_word_count": 4, "image_input": "pixels",
        "crop_size": 224, "finetune_epochs": 15, "finetune_learning_rate": 2e-5}
    assert (vsepp["regions"]["grid_model"], vsepp["regions"]["grid_weights"], vsepp["train"]["epochs"]) == (
        "resnet152", "IMAGENET1K_V1", 30)
    assert not plan(params, "duet-table1")["rows"][0].get("caveat")  # the printed row's own input
    vsrn = rows["VSRN"]  # its own recipe: the authors' train.py defaults, on the same region sets
    assert (vsrn["train"]["learning_rate"], vsrn["train"]["batch_size"], vsrn["train"]["lr_decay_epochs"],
            vsrn["train"]["max_grad_norm"], vsrn["train"]["epochs"], vsrn["loss"]["vsrn"]) == (
        2e-4, 128, 15, 2.0, 30, {"margin": 0.2, "caption_weight": 1.0})
    assert (vsrn["model"]["vsrn"]["joint_dim"], vsrn["model"]["vsrn"]["caption_max_len"],
            vsrn["regions"]["source"], vsrn["regions"]["max_regions"]) == (2048, 60, "tsv", 36)


def test_a_sweep_can_name_duets_margin_shared_layers_and_lambdas():
    space = {"loss.duet.margin": {"type": "float", "low": 0.1, "high": 0.3},
             "model.duet.shared_layers": {"type": "int", "low": 0, "high": 2},
             "loss.duet.lambda_box": {"type": "float", "low": 0.01, "high": 1.0, "log": True},
             "loss.duet.lambda_norm": {"type": "float", "low": 0.01, "high": 1.0, "log": True}}
    cfg = load_config(REPO / "params.yaml", {"train.method": "duet", "sweep.space": space})
    assert set(cfg.sweep.space) == set(space)
    trial = with_overrides(cfg, {"loss.duet.margin": 0.25, "model.duet.shared_layers": 0})
    assert (trial.loss.duet.margin, trial.model.duet.shared_layers) == (0.25, 0)


# --------------------------------------------------------------------------- VSE++ (DUET Table 1's baseline)


def test_vsepp_trains_resumes_and_is_scored_by_the_same_loop(duet_cwd, tmp_path):
    """train.method vsepp through DUET's loop: its checkpoint (vocabulary, weights, architecture)
    loads back to the embeddings it was scored with, the dev score is the best checkpoint's val rsum,
    the learning rate follows the step schedule and a killed run resumes to the same weights."""
    from mmcse.models.vsepp import VseppModel
    from mmcse.training.duet import VSEPP_META, VSEPP_WEIGHTS

    cfg = with_overrides(load_config("params.yaml"), {
        "train.method": "vsepp", "model.vsepp.joint_dim": 24, "model.vsepp.word_dim": 12,
        "model.vsepp.min_word_count": 2, "train.learning_rate": 2e-3, "train.lr_decay_epochs": 1,
        "train.max_grad_norm": 2.0})
    sets = region_sets(duet_cwd)
    lrs = []
    result = train_duet(
        cfg, "data/raw", sets, tmp_path / "m",
        hooks=Hooks(progress=False,
                    log_metrics=lambda entries: lrs.extend((s, m["lr"]) for m, s in entries if "lr" in m)),
    )
    best = tmp_path / "m/best"
    assert {VSEPP_META, VSEPP_WEIGHTS, "tokenizer.json", "train_state.json"} <= {f.name for f in best.iterdir()}
    assert json.loads((best / "train_state.json").read_text())["method"] == "vsepp"
    model, tokenizer = load_duet(best)
    assert isinstance(model, VseppModel) and tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == [
        "<pad>", "<start>", "<end>", "<unk>"]
    assert val_rsum(model, tokenizer, cfg, sets, tmp_path) == pytest.approx(result.best_score, abs=1e-6)
    # after s steps the rate is 2e-3 · 0.1^(s // steps an epoch): 48 pairs, 6 steps an epoch
    per_epoch = len(read_jsonl("data/raw/pairs.jsonl")) // cfg.train.batch_size
    assert per_epoch == 6 and lrs
    assert [lr for _, lr in lrs] == pytest.approx([2e-3 * 0.1 ** (s // per_epoch) for s, _ in lrs])
    assert_killed_at_6_resumes_to(cfg, sets, tmp_path, result, tmp_path / "m")


def test_vsrn_trains_resumes_loads_and_is_evaluated_by_the_same_loop(duet_cwd, tmp_path):
    """train.method vsrn through DUET's loop: the loss terms are the hinge and the caption loss, the
    checkpoint (vocabulary, weights, architecture) loads back to the embeddings it was scored with, a
    killed run resumes to the same weights, and the evaluate stage scores it."""
    from mmcse.models.tokens import cached_tokens
    from mmcse.models.vsrn import VsrnModel
    from mmcse.pipeline.evaluate import TrainedOn, evaluate_duet
    from mmcse.training.duet import VSRN_META, VSRN_WEIGHTS

    cfg = with_overrides(load_config("params.yaml"), {
        "train.method": "vsrn", "model.vsrn.joint_dim": 16, "model.vsrn.word_dim": 8, "model.vsrn.gcn_layers": 2,
        "model.vsrn.caption_hidden": 12, "model.vsrn.caption_word_dim": 8, "model.vsrn.caption_max_len": 8,
        "model.vsrn.min_word_count": 2, "train.learning_rate": 2e-3, "train.max_grad_norm": 2.0})
    sets = region_sets(duet_cwd)
    logged: list[dict] = []
    result = train_duet(
        cfg, "data/raw", sets, tmp_path / "m",
        hooks=Hooks(progress=False, log_metrics=lambda entries: logged.extend(m for m, _ in entries)),
    )
    assert {"loss/hinge", "loss/caption", "loss/loss"} <= set().union(*logged)
    step = next(m for m in logged if "loss/loss" in m)
    assert step["loss/loss"] == pytest.approx(step["loss/hinge"] + step["loss/caption"], rel=1e-5)
    best = tmp_path / "m/best"
    assert {VSRN_META, VSRN_WEIGHTS, "tokenizer.json", "train_state.json"} <= {f.name for f in best.iterdir()}
    model, tokenizer = load_duet(best)
    assert isinstance(model, VsrnModel) and (model.variant, model.caption_max_len, model.end_id) == ("coco", 8, 2)
    assert val_rsum(model, tokenizer, cfg, sets, tmp_path) == pytest.approx(result.best_score, abs=1e-6)
    assert_killed_at_6_resumes_to(cfg, sets, tmp_path, result, tmp_path / "m")
    scores = evaluate_duet(cfg, Paths.of(cfg), best, trained_on=TrainedOn(region_sets={"test": sets["test"]}))
    test = RetrievalSplit.load(Path("data/raw/retrieval/images.jsonl"), Path("data/raw/retrieval/captions.jsonl"),
                               RegionStore.open(sets["test"]))
    images, texts = split_embeddings(model, test, cached_tokens(tmp_path / "tok", "test", tokenizer, test.captions,
                                                                cfg.model.max_seq_len), 16, torch.device("cpu"))
    assert scores["demo_rsum"] == pytest.approx(retrieval_metrics(images, texts, test.text_image)["rsum"], abs=1e-6)


def test_a_vsepp_checkpoint_is_evaluated_as_duets_are(duet_cwd, tmp_path, capsys):
    from mmcse.pipeline.evaluate import TrainedOn, evaluate_duet

    cfg = with_overrides(load_config("params.yaml"), {
        "train.method": "vsepp", "model.vsepp.joint_dim": 16, "model.vsepp.word_dim": 8, "train.max_steps": 2})
    sets = region_sets(duet_cwd)
    train_duet(cfg, "data/raw", sets, tmp_path / "m", hooks=Hooks(progress=False))
    scores = evaluate_duet(cfg, Paths.of(cfg), tmp_path / "m/best",
                           trained_on=TrainedOn(region_sets={"test": sets["test"]}))
    model, tokenizer = load_duet(tmp_path / "m/best")
    test = RetrievalSplit.load(Path("data/raw/retrieval/images.jsonl"), Path("data/raw/retrieval/captions.jsonl"),
                               RegionStore.open(sets["test"]))
    from mmcse.models.tokens import cached_tokens

    tokens = cached_tokens(tmp_path / "tok", "test", tokenizer, test.captions, cfg.model.max_seq_len)
    images, texts = split_embeddings(model, test, tokens, 16, torch.device("cpu"))
    direct = retrieval_metrics(images, texts, test.text_image)
    assert scores["demo_rsum"] == pytest.approx(direct["rsum"], abs=1e-6)
    assert scores["demo_t2i_R1"] == pytest.approx(direct["t2i_R1"], abs=1e-6)
    # `mmcse eval --retrieval` of the checkpoint: the same scores (VSE++ has no HF folder to load)
    from mmcse.cli import main

    capsys.readouterr()
    main(["eval", "--model", str(tmp_path / "m/best"), "--retrieval", "--params", "params.yaml"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["demo_rsum"] == pytest.approx(scores["demo_rsum"], abs=1e-3)
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(tmp_path / "m/best"), "--senteval-dir", "x"])
    assert "score it with --retrieval; --senteval-dir: a retrieval model has no" in capsys.readouterr().err


@pytest.mark.slow  # three trainings with a ResNet-50 in the loop; the fast tier times its step (preflight)
def test_vsepp_on_pixels_trains_frozen_then_fine_tunes_its_cnn_and_resumes_across_the_switch(duet_cwd, tmp_path):
    """model.vsepp.image_input: pixels runs the CNN (regions.grid_weights) on random crops in the loop:
    frozen for train.epochs (its convolutions keep the loaded weights), then fine-tuned for
    model.vsepp.finetune_epochs at finetune_learning_rate from the frozen phase's best weights; the best
    checkpoint is the fine-tuning's; a run killed after the switch resumes to the same weights; the
    evaluate stage reads the test images' center crops (no region set)."""
    from safetensors.torch import save_file

    from mmcse.data.images import ImagePixels
    from mmcse.models.cnn import pooled_resnet
    from mmcse.models.tokens import cached_tokens
    from mmcse.models.vsepp import VseppModel
    from mmcse.pipeline.evaluate import evaluate_duet
    from mmcse.training.duet import VSEPP_WEIGHTS

    torch.manual_seed(0)
    imagenet = pooled_resnet("resnet50").state_dict()  # the "ImageNet" weights: a file, so known exactly
    save_file({k: v.contiguous() for k, v in imagenet.items()}, str(tmp_path / "resnet50.safetensors"))
    overrides = {
        "train.method": "vsepp", "model.vsepp.joint_dim": 16, "model.vsepp.word_dim": 8,
        "model.vsepp.min_word_count": 2, "model.vsepp.image_input": "pixels", "model.vsepp.crop_size": 32,
        "regions.grid_model": "resnet50", "regions.grid_weights": str(tmp_path / "resnet50.safetensors"),
        "train.learning_rate": 2e-3, "train.lr_decay_epochs": 1, "train.max_grad_norm": 2.0,
        "train.epochs": 1, "train.max_steps": 0, "train.eval_steps": 4, "train.checkpoint_steps": 4}
    frozen_cfg = with_overrides(load_config("params.yaml"), overrides)
    frozen = train_duet(frozen_cfg, "data/raw", {}, tmp_path / "frozen", hooks=Hooks(progress=False))
    weights = load_file(str(tmp_path / "frozen/best" / VSEPP_WEIGHTS))
    assert frozen.steps == 6 and torch.equal(weights["cnn.conv1.weight"], imagenet["conv1.weight"])
    assert not torch.equal(weights["cnn.bn1.running_mean"], imagenet["bn1.running_mean"])  # in train mode, as theirs

    cfg = with_overrides(frozen_cfg, {"model.vsepp.finetune_epochs": 1, "model.vsepp.finetune_learning_rate": 1e-4})
    lrs = []
    result = train_duet(
        cfg, "data/raw", {}, tmp_path / "m",
        hooks=Hooks(progress=False,
                    log_metrics=lambda entries: lrs.extend((s, m["lr"]) for m, s in entries if "lr" in m)),
    )
    assert result.steps == 12 and [s for s, lr in lrs if lr == pytest.approx(1e-4)] == [s for s, _ in lrs if s >= 6]
    # the frozen phase is the frozen run step for step; its dev scores end at step 6, the fine-tuning's follow
    devs = [h for h in result.history if "dev" in h]
    assert [h for h in devs if h["step"] <= 6] == [h for h in frozen.history if "dev" in h]
    assert result.best_step > 6 and result.best_score == max(h["dev"] for h in devs if h["step"] > 6)
    best = load_file(str(tmp_path / "m/best" / VSEPP_WEIGHTS))
    assert not torch.equal(best["cnn.conv1.weight"], imagenet["conv1.weight"])  # fine-tuned
    state = json.loads((tmp_path / "m/best/train_state.json").read_text())
    assert (state["image_input"], state["region_sets"]) == ("pixels", {})

    def kill_at_8(step: int, score: float) -> None:
        if step == 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the resume point is the switch's (step 6): it switches again
        train_duet(cfg, "data/raw", {}, tmp_path / "resumed", hooks=Hooks(on_eval=kill_at_8, progress=False))
    assert json.loads((tmp_path / "resumed/last/state.json").read_text())["step"] == 6
    resumed = train_duet(cfg, "data/raw", {}, tmp_path / "resumed", hooks=Hooks(progress=False))
    assert resumed.history == result.history
    again = load_file(str(tmp_path / "resumed/best" / VSEPP_WEIGHTS))
    assert all(torch.equal(again[k], best[k]) for k in best)

    model, tokenizer = load_duet(tmp_path / "m/best")
    assert isinstance(model, VseppModel) and model.reads_pixels and model.crop_size == 32
    scores = evaluate_duet(cfg, Paths.of(cfg), tmp_path / "m/best")
    ids = [row["image_id"] for row in read_jsonl("data/raw/retrieval/images.jsonl")]
    test = RetrievalSplit.load(Path("data/raw/retrieval/images.jsonl"), Path("data/raw/retrieval/captions.jsonl"),
                               ImagePixels("data/raw", ids, 32))
    tokens = cached_tokens(tmp_path / "tok", "test", tokenizer, test.captions, cfg.model.max_seq_len)
    images, texts = split_embeddings(model, test, tokens, 16, torch.device("cpu"))
    assert scores["demo_rsum"] == pytest.approx(retrieval_metrics(images, texts, test.text_image)["rsum"], abs=1e-6)


def test_fine_tuning_vsepps_cnn_needs_it_in_the_loop():
    with pytest.raises(ConfigError, match=re.escape("model.vsepp.finetune_epochs': fine-tunes the CNN, which runs "
                                                    "only with model.vsepp.image_input: pixels")):
        with_overrides(load_config(REPO / "params.yaml"), {"train.method": "vsepp", "model.vsepp.finetune_epochs": 2})
