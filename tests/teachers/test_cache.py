import json
from pathlib import Path

import numpy as np
import pytest

from mmcse.errors import CorruptArtifact
from mmcse.teachers.cache import FeatureStore, cached_features, colour_edge_grid_features, read_rgba


def test_colour_edge_grid_features_see_colour_position_and_alpha():
    img = np.zeros((3, 32, 32, 4), np.uint8)
    img[..., 3] = 255
    img[0, :16, :16, 0] = 255  # red, top-left
    img[1, 16:, 16:, 0] = 255  # red, bottom-right
    img[2, :16, :16, 2] = 255  # blue, top-left
    f = colour_edge_grid_features(img, grid=2, bins=2)
    assert f.shape == (3, 4 * (8 + 8)) and f.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, atol=1e-6)
    assert len({tuple(np.round(row, 5)) for row in f}) == 3
    transparent = img[:1].copy()
    transparent[0, 16:, :, 3] = 0  # hide the bottom half: only the top half counts
    g = colour_edge_grid_features(transparent, grid=2, bins=2).reshape(4, 16)
    assert g[2:, :8].sum() == 0


def test_cache_hit_never_calls_the_model(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return np.arange(6, dtype=np.float32).reshape(3, 2)

    store, hit = cached_features(tmp_path, "t", {"name": "m"}, "fp", ["a", "b", "c"], compute)
    assert not hit and calls == [1]
    again, hit = cached_features(tmp_path, "t", {"name": "m"}, "fp", ["a", "b", "c"], compute)
    assert hit and calls == [1]
    assert isinstance(again.features, np.memmap)
    np.testing.assert_array_equal(again.rows(["c", "a"]), [[4, 5], [0, 1]])
    _, hit = cached_features(tmp_path, "t", {"name": "m"}, "other-data", ["a", "b", "c"], compute)
    assert not hit and calls == [1, 1]


def test_interrupted_set_is_recomputed(tmp_path):
    store, _ = cached_features(tmp_path, "t", {"n": 1}, "fp", ["a"], lambda: np.ones((1, 2)))
    (store.folder / "index.json").unlink()  # as if killed before the index was written
    calls = []
    _, hit = cached_features(tmp_path, "t", {"n": 1}, "fp", ["a"], lambda: calls.append(1) or np.ones((1, 2)))
    assert not hit and calls == [1]
    with pytest.raises(KeyError, match="no cached features for id 'zz'"):
        FeatureStore.open(store.folder).rows(["zz"])


def test_bad_images_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.png"):
        read_rgba(tmp_path / "missing.png", 8)
    (tmp_path / "bad.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(ValueError, match="bad.png"):
        read_rgba(tmp_path / "bad.png", 8)


def test_prepared_project_caches_every_set(prepared_project):
    from mmcse.experiments.params import load_config
    from mmcse.io import read_json, read_jsonl
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths

    teachers = prepared_project / "data/teachers"
    manifest = read_json(teachers / "manifest.json")
    assert set(manifest["sets"]) == {"image", "object", "text", "joint_text", "joint_image", "retrieval_image",
                                     "retrieval_joint_image"}
    assert [(t["pooler"], t["weight"]) for t in manifest["sets"]["text"]] == [("avg_first_last", 0.33), ("avg", 0.67)]
    text = FeatureStore.open(teachers / manifest["sets"]["text"][1]["caption"])
    assert text.dim == 384  # all-MiniLM-L6-v2
    np.testing.assert_allclose(np.linalg.norm(text.features, axis=1), 1.0, atol=1e-5)
    # the joint teacher's text side reuses the avg set (same teacher + pooler: one cache entry)
    assert len({t["caption"] for t in manifest["sets"]["text"]}) == 2
    assert "hits" not in manifest  # part of a DVC output: nothing that depends on what ran before
    cfg = load_config(prepared_project / "params.yaml")
    rerun = run_cache_teachers(cfg, Paths.of(cfg, prepared_project))  # every set cached: no model runs
    assert sorted(rerun["hits"]) == sorted(
        ["image", "object", "joint_text", "joint_image", "retrieval_image", "retrieval_joint_image"]
        + [f"text_{k}:packaged:all-MiniLM-L6-v2:{p}" for k in ("caption", "corpus") for p in ("avg_first_last", "avg")])
    assert all(rerun["hits"].values()) and read_json(teachers / "manifest.json") == manifest
    joint_text = FeatureStore.open(teachers / manifest["sets"]["joint_text"])
    joint_image = FeatureStore.open(teachers / manifest["sets"]["joint_image"])
    assert joint_text.dim == joint_image.dim == 32
    # a caption is closer to its own image than to the other images in the joint space
    pairs = read_jsonl(prepared_project / "data/raw/pairs.jsonl")
    t = joint_text.rows([p["pair_id"] for p in pairs])
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    v = joint_image.features / np.linalg.norm(joint_image.features, axis=1, keepdims=True)
    sims = t @ v.T  # (pairs, images)
    own = np.array([joint_image.ids.index(p["image_id"]) for p in pairs])
    ranks = (sims > sims[np.arange(len(pairs)), own][:, None]).sum(1)
    assert np.mean(ranks == 0) > 0.5  # own image first for most captions (chance: 1/24)

    # the retrieval test images: the image encoder's features, and v̂ from the CCA fitted on the training pairs
    from mmcse.experiments.params import load_config
    from mmcse.teachers.cache import fit_cca

    cfg = load_config(prepared_project / "params.yaml").teachers
    test_ids = [r["image_id"] for r in read_jsonl(prepared_project / "data/raw/retrieval/images.jsonl")]
    test_image = FeatureStore.open(teachers / manifest["sets"]["retrieval_image"])
    assert list(test_image.ids) == test_ids and test_image.dim == FeatureStore.open(
        teachers / manifest["sets"]["image"]).dim
    image = FeatureStore.open(teachers / manifest["sets"]["image"])
    cca = fit_cca(np.asarray(text.rows([p["pair_id"] for p in pairs])), image.rows([p["image_id"] for p in pairs]),
                  cfg.joint.dim, cfg.joint.regularization)
    test_joint = FeatureStore.open(teachers / manifest["sets"]["retrieval_joint_image"])
    np.testing.assert_allclose(test_joint.features, cca.image(np.asarray(test_image.features)), rtol=1e-4, atol=1e-5)


def test_cca_recovers_a_shared_latent_and_whitens():
    from mmcse.teachers.cache import fit_cca

    rng = np.random.default_rng(0)
    latent = rng.normal(size=(500, 2))
    text = np.hstack([latent @ rng.normal(size=(2, 6)), rng.normal(size=(500, 4))])
    image = np.hstack([latent @ rng.normal(size=(2, 9)), rng.normal(size=(500, 5))])
    cca = fit_cca(text, image, dim=2, regularization=1e-6)
    assert cca.correlations[0] == pytest.approx(1.0, abs=1e-3) and cca.correlations[1] == pytest.approx(1.0, abs=1e-3)
    a, b = cca.text(text), cca.image(image)
    np.testing.assert_allclose(np.cov(a.T), np.eye(2), atol=1e-2)  # whitened within a modality
    np.testing.assert_allclose(np.diag(np.corrcoef(a.T, b.T)[:2, 2:]), 1.0, atol=1e-3)  # correlated across
    with pytest.raises(ValueError, match="teachers.joint.dim"):
        fit_cca(text, image, dim=11, regularization=0.1)


def test_text_teacher_gives_every_pooler_from_one_pass():
    import torch
    from transformers import AutoModel, AutoTokenizer

    from mmcse.hub import resolve_model
    from mmcse.models.student import pool
    from mmcse.teachers.cache import text_teacher_features

    poolers = ["avg", "cls_before_pooler", "avg_first_last", "avg_top2"]
    sentences = ["a small red circle", "a big blue box in the centre", "two discs"]
    got = text_teacher_features("packaged:all-MiniLM-L6-v2", sentences, poolers, batch_size=2)
    location = resolve_model("packaged:all-MiniLM-L6-v2")
    tok, model = AutoTokenizer.from_pretrained(location), AutoModel.from_pretrained(location).eval()
    with torch.no_grad():
        for i, s in enumerate(sentences):  # one sentence at a time: no padding involved
            b = tok([s], return_tensors="pt")
            hidden = model(**b, output_hidden_states=True).hidden_states
            for pooler in poolers:
                emb = pool(pooler, hidden, b["attention_mask"])
                np.testing.assert_allclose(got[pooler][i], torch.nn.functional.normalize(emb, dim=-1)[0].numpy(),
                                           atol=1e-5, err_msg=pooler)


@pytest.mark.parametrize("raw", [{"text": [{"pooler": "cls"}]}, {"joint": {"text_pooler": "cls"}}])
def test_text_teacher_pooler_needing_our_mlp_is_rejected_at_load(raw):
    from mmcse.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="pooler"):
        parse_config({"teachers": raw})


REBUILD = "rerun the cache_teachers stage to rebuild it (dvc repro cache_teachers)"


def _truncate(path, by=4):
    data = path.read_bytes()
    path.write_bytes(data[:-by])


def test_truncated_store_is_named_in_one_line_on_open(tmp_path):
    store, _ = cached_features(tmp_path, "t", {"n": 1}, "fp", ["a", "b"], lambda: np.ones((2, 3)))
    file = store.folder / "features.npy"
    _truncate(file)
    with pytest.raises(CorruptArtifact) as err:
        FeatureStore.open(store.folder)
    assert str(err.value).startswith(f"{file}: truncated: ") and str(err.value).endswith(f"; {REBUILD}")
    assert "\n" not in str(err.value)


def test_store_rows_must_match_its_index(tmp_path):
    store, _ = cached_features(tmp_path, "t", {"n": 1}, "fp", ["a", "b"], lambda: np.ones((2, 3)))
    index = json.loads((store.folder / "index.json").read_text())
    assert index["shape"] == [2, 3] and index["bytes"] == (store.folder / "features.npy").stat().st_size
    (store.folder / "index.json").write_text(json.dumps({**index, "ids": ["a", "b", "c"], "shape": [2, 3]}))
    with pytest.raises(CorruptArtifact, match=r"features.npy: holds shape \(2, 3\), index.json lists 3 ids"):
        FeatureStore.open(store.folder)
    (store.folder / "index.json").write_text("{")
    with pytest.raises(CorruptArtifact, match=r"index.json: corrupt JSON"):
        FeatureStore.open(store.folder)


def test_old_index_without_a_digest_is_still_read(tmp_path):
    store, _ = cached_features(tmp_path, "t", {"n": 1}, "fp", ["a"], lambda: np.full((1, 2), 7.0))
    index = json.loads((store.folder / "index.json").read_text())
    del index["sha256"], index["bytes"]
    (store.folder / "index.json").write_text(json.dumps(index))
    np.testing.assert_array_equal(FeatureStore.open(store.folder).rows(["a"]), [[7, 7]])


@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_damaged_cached_set_is_deleted_and_recomputed(tmp_path, damage, caplog, monkeypatch):
    from mmcse.integrity import files as integrity

    values = np.arange(8, dtype=np.float32).reshape(4, 2)
    store, _ = cached_features(tmp_path, "t", {"n": 1}, "fp", list("abcd"), lambda: values)
    file = store.folder / "features.npy"
    if damage == "truncated":
        _truncate(file, 8)
    else:
        data = bytearray(file.read_bytes())
        data[-3] ^= 0x40  # same size: only the recorded digest tells
        file.write_bytes(bytes(data))
        monkeypatch.setattr(integrity, "_DIGESTS", {})  # as in the next process (the digest is memoised)
    calls = []
    again, hit = cached_features(tmp_path, "t", {"n": 1}, "fp", list("abcd"),
                                 lambda: calls.append(1) or values)
    assert not hit and calls == [1] and again.folder == store.folder
    np.testing.assert_array_equal(again.rows(["d", "a"]), [[6, 7], [0, 1]])
    assert f"{file}: " in caplog.text and "computing it again" in caplog.text
    _, hit = cached_features(tmp_path, "t", {"n": 1}, "fp", list("abcd"), lambda: calls.append(1) or values)
    assert hit and calls == [1]  # healed: the next run hits


def _rerecord_image(project, image_id, pixels):
    """Replace one image and record it as the download stage does (images.jsonl row + manifest)."""
    from PIL import Image

    from mmcse.io import read_json, read_jsonl, sha256_file, write_json, write_jsonl

    raw = project / "data/raw"
    rows = read_jsonl(raw / "images.jsonl")
    row = next(r for r in rows if r["image_id"] == image_id)
    with Image.open(raw / row["file"]) as img:
        changed = np.asarray(img.convert("RGB")).copy()
    changed[pixels] = 255 - changed[pixels]
    Image.fromarray(changed).save(raw / row["file"], format="PNG")
    row |= {"sha256": sha256_file(raw / row["file"]), "bytes": (raw / row["file"]).stat().st_size}
    write_jsonl(raw / "images.jsonl", rows)
    manifest = read_json(raw / "manifest.json")
    manifest["sha256"]["images.jsonl"] = sha256_file(raw / "images.jsonl")
    write_json(raw / "manifest.json", manifest)


def test_changed_image_bytes_change_the_image_feature_key(project):
    from mmcse.experiments.params import load_config
    from mmcse.io import read_json, read_jsonl
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths

    cfg = load_config("params.yaml")
    before = read_json(project / "data/teachers/manifest.json")["sets"]
    rows = read_jsonl(project / "data/raw/images.jsonl")
    assert all(len(r["sha256"]) == 64 and r["bytes"] > 0 for r in rows)  # recorded at download
    old_image = FeatureStore.open(project / "data/teachers" / before["image"])

    _rerecord_image(project, "img00003", np.s_[:, :])
    result = run_cache_teachers(cfg, Paths.of(cfg))
    assert not result["hits"]["image"] and not result["hits"]["object"] and not result["hits"]["joint_image"]
    assert all(hit for role, hit in result["hits"].items() if role.startswith("text_"))
    assert result["sets"]["image"] != before["image"]
    new_image = FeatureStore.open(project / "data/teachers" / result["sets"]["image"])
    others = [r["image_id"] for r in rows if r["image_id"] != "img00003"]
    np.testing.assert_array_equal(new_image.rows(others), old_image.rows(others))
    assert not np.allclose(new_image.rows(["img00003"]), old_image.rows(["img00003"]))


def test_image_changed_after_download_is_named_with_the_stage_to_rerun(project):
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths

    cfg = load_config("params.yaml")
    image = project / "data/raw/images/img00002.png"
    image.write_bytes(image.read_bytes()[:-10])
    with pytest.raises(CorruptArtifact) as err:
        run_cache_teachers(cfg, Paths.of(cfg))
    assert str(err.value) == (f"{Path('data/raw/images/img00002.png')}: {image.stat().st_size} bytes, images.jsonl "
                              f"records {image.stat().st_size + 10} (changed or damaged since the download stage); "
                              "rerun the download stage (dvc repro download)")


def test_a_same_size_image_swap_is_named_when_a_set_is_built(project):
    """The size check passes a same-size swap; building a teacher set checks the recorded SHA-256
    first, so the wrong image is never encoded under its row's key."""
    import shutil

    from mmcse.experiments.params import load_config
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths

    cfg = load_config("params.yaml")
    for built in (project / "data/teachers").glob("image-*"):  # the image set must be built again
        shutil.rmtree(built)
    image, other = project / "data/raw/images/img00006.png", project / "data/raw/images/img00007.png"
    swapped = bytearray(other.read_bytes()[: image.stat().st_size].ljust(image.stat().st_size, b"\0"))
    image.write_bytes(bytes(swapped))
    with pytest.raises(CorruptArtifact, match=r"img00006.png: SHA-256 .* differs .* images.jsonl records"):
        run_cache_teachers(cfg, Paths.of(cfg))
    assert not list((project / "data/teachers").glob("image-*"))  # nothing cached under its key


def test_a_same_size_image_swap_is_named_while_every_set_is_cached(project):
    """Issue 33.5: every teacher set cached, one image replaced by other bytes of the same size: the
    stage names it (cache_teachers, and cache_regions and detect_objects read the images too)."""
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.detect import run_detect
    from mmcse.pipeline.paths import Paths

    cfg = load_config("params.yaml")
    assert not any(run_cache_teachers(cfg, Paths.of(cfg))["hits"][k] is False for k in ("image", "object"))
    image = project / "data/raw/images/img00006.png"
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF
    image.write_bytes(bytes(data))
    for stage in (run_cache_teachers, run_detect):
        with pytest.raises(CorruptArtifact, match=r"img00006.png: SHA-256 .* differs .* images.jsonl records"):
            stage(cfg, Paths.of(cfg))


def test_an_image_only_teacher_is_the_image_encoders_set_beside_the_joint_text_side(project):
    """teachers.joint.image_side: image_encoder (DALR Table 9's ResNet rows): v̂ of the training and test
    images are the image encoder's own sets, t̂ the joint teacher's text side, unchanged (a cache hit)."""
    from mmcse.config import with_overrides
    from mmcse.experiments.params import load_config
    from mmcse.io import read_json
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.paths import Paths

    before = read_json(project / "data/teachers/manifest.json")["sets"]
    cfg = with_overrides(load_config("params.yaml"), {"teachers.joint.image_side": "image_encoder"})
    result = run_cache_teachers(cfg, Paths.of(cfg))
    sets = result["sets"]
    assert sets["joint_image"] == sets["image"] == before["image"]
    assert sets["retrieval_joint_image"] == sets["retrieval_image"] == before["retrieval_image"]
    assert sets["joint_text"] == before["joint_text"] and result["hits"]["joint_text"]
    joint_text = FeatureStore.open(project / "data/teachers" / sets["joint_text"])
    joint_image = FeatureStore.open(project / "data/teachers" / sets["joint_image"])
    assert joint_text.dim == 32 and joint_image.dim != 32  # two spaces: only DALR-style heads read them
