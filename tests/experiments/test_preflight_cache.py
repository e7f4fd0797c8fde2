"""`mmcse preflight`'s teacher-cache check: the stage's own encoders on synthetic items in the real formats,
random weights where a teacher is not here, the word tokenizer's ids, and the projection over the download's
counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmcse.experiments import preflight_cache as pc
from mmcse.experiments.params import load_config
from mmcse.experiments.profiles import apply_profile
from mmcse.models import architectures
from mmcse.teachers.cache import colour_edge_grid_features, read_rgba, text_teacher_features
from tests.conftest import params_copy


@pytest.fixture
def project(tmp_path):
    return params_copy(tmp_path)


def test_the_word_tokenizer_gives_each_word_one_id_between_the_familys_special_ids():
    bert = pc.WordTokenizer("bert", 30522)
    out = bert(["a man", "two dogs on the grass"], max_length=128)
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.shape == (2, 7) and mask.sum(1).tolist() == [4, 7]  # words + [CLS] + [SEP]
    assert ids[0, :4].tolist()[0] == 101 and ids[0, 3] == 102 and ids[0, 4:].tolist() == [0, 0, 0]
    assert ((ids[:, 1:-1][mask[:, 1:-1].bool() & (ids[:, 1:-1] != 102)] >= 1000).all())
    again = bert(["two dogs on the grass"])["input_ids"][0]
    assert torch.equal(again, ids[1]) and ids[0, 1] != ids[0, 2]  # a word's id is fixed, words differ
    cut = bert(["one two three four five six"], max_length=4)["input_ids"][0]
    assert cut.tolist()[0] == 101 and cut.tolist()[-1] == 102 and len(cut) == 4
    roberta = pc.WordTokenizer("roberta", 50265)(["a", "a b c"])["input_ids"]
    assert roberta[0].tolist() == [0, roberta[1, 1].item(), 2, 1, 1]  # RoBERTa pads with 1 (its positions skip it)
    clip = pc.WordTokenizer("clip_text_model", 49408)(["a red ball"])["input_ids"][0]
    assert clip[0] == 49406 and clip[-1] == 49407 and (clip[1:-1] < 49406).all()  # CLIP pools at its end id
    with pytest.raises(Exception, match="no known special ids"):
        pc.WordTokenizer("t5", 32128)


def test_the_demos_teacher_caches_are_the_stages_functions_on_the_synthetic_items(project):
    """The demo's encoders are here (colour-edge grid, the packaged MiniLM, the CCA): every set a DALR row's
    terms read is built (the CCA joint teacher needs the image and its text teacher's sets), at its encoder's
    width, with the counts its projection multiplies; an MCSE row's terms read the image set alone."""
    from mmcse.config import with_overrides

    mcse = load_config(project / "params.yaml")
    assert mcse.train.method == "mcse" and [s["set"] for s in pc.teacher_cache_check(mcse, 2)["sets"]] == ["image"]
    job = with_overrides(mcse, {"train.method": "dalr"}, where="test")
    out = pc.teacher_cache_check(job, 6)
    sets = {s["set"]: s for s in out["sets"]}
    t = job.teachers
    assert list(sets) == ["image", *[f"text {x.pooler}" for x in t.text], "joint text (cca)"]
    assert sets["image"]["dim"] == t.image_grid ** 2 * (t.colour_bins ** 3 + 8) and sets["image"]["weights"] == "none"
    text = [s for s in out["sets"] if s["set"].startswith("text")]
    assert all(s["dim"] == 384 and s["weights"] == "real" and s["model"] == "packaged:all-MiniLM-L6-v2" for s in text)
    assert sets["joint text (cca)"]["dim"] == t.joint.dim
    assert all(s["seconds_per_item"] >= 0 for s in out["sets"]) and text[0]["seconds_per_item"] > 0
    assert sets["image"]["counted"] == ["images", "retrieval_images"]
    assert text[0]["counted"] == ["pairs", "corpus_sentences"]


def test_an_items_time_is_the_marginal_cost_between_one_item_and_many():
    """A call's fixed start (a loader's workers, the first allocations) is not spread over the items."""
    import time as clock

    calls = []

    def run(n: int) -> list[int]:
        calls.append(n)
        clock.sleep(0.05 + 0.01 * n)  # 50 ms to start, 10 ms an item
        return list(range(n))

    out, per_item, fixed = pc.marginal(run, 6)
    assert calls == [1, 1, 6] and out == list(range(6))
    assert per_item == pytest.approx(0.01, abs=0.004) and fixed == pytest.approx(0.05, abs=0.02)


def test_the_synthetic_items_are_photo_sized_jpegs_and_caption_length_sentences(tmp_path):
    sentences, files = pc.synthetic_items(tmp_path, 3, seed=1)
    assert len(sentences) == len(files) == 3 and all(len(s.split()) == pc.CAPTION_WORDS for s in sentences)
    from PIL import Image

    with Image.open(files[0]) as image:
        assert (image.format, image.size) == ("JPEG", pc.IMAGE_SIZE)
    assert pc.synthetic_items(tmp_path / "..", 3, seed=1)[0] == sentences  # the same seed, the same items
    grid = colour_edge_grid_features(np.stack([read_rgba(f, 64) for f in files]), 2, 3)
    assert grid.shape == (3, 4 * 35) and np.isfinite(grid).all()


def test_a_text_teacher_not_here_is_built_at_its_architecture_with_the_word_tokenizer(monkeypatch):
    monkeypatch.setattr(pc, "local_model", lambda name: None)
    monkeypatch.setattr(architectures, "local_model", lambda name: None)
    (tokenizer, model), real = pc._text_teacher("princeton-nlp/unsup-simcse-roberta-base")
    assert not real and isinstance(tokenizer, pc.WordTokenizer) and tokenizer.pad == 1
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (768, 12, 50265)
    model.encoder.layer = model.encoder.layer[:1]  # one layer is enough to run the teacher path
    out = text_teacher_features("x", ["a man", "two dogs run"], ["cls_before_pooler", "avg"], 2,
                                loaded=(tokenizer, model))
    assert out["avg"].shape == (2, 768) and np.allclose(np.linalg.norm(out["avg"], axis=1), 1, atol=1e-5)
    assert not np.allclose(out["avg"], out["cls_before_pooler"])  # one forward, two poolers


def test_the_projection_is_each_sets_seconds_over_the_items_the_download_counted():
    sets = [{"seconds_per_item": 0.5, "fixed_seconds": 3.0, "counted": ["images", "retrieval_images"]},
            {"seconds_per_item": 0.1, "fixed_seconds": 1.0, "counted": ["pairs", "corpus_sentences"]},
            {"seconds_per_item": 0.0, "fixed_seconds": 2.0, "counted": []}]  # the CCA's fit: once
    counts = {"images": 100, "retrieval_images": 20, "pairs": 500, "corpus_sentences": 1000}
    assert pc.projected_minutes(sets, counts) == pytest.approx((0.5 * 120 + 2 * 3 + 0.1 * 1500 + 2 * 1 + 2) / 60)
    assert pc.projected_minutes(sets, None) is None


@pytest.mark.slow  # CLIP ViT-B/32 and two BERT-bases built with random weights (about 25 s)
def test_a_paper_profiles_teachers_not_here_are_built_at_their_architectures(project, monkeypatch):
    monkeypatch.setattr(pc, "local_model", lambda name: None)
    monkeypatch.setattr(architectures, "local_model", lambda name: None)
    apply_profile(project / "params.yaml", "dalr-flickr-bert")
    out = pc.teacher_cache_check(load_config(project / "params.yaml"), 4)
    got = {(s["set"], s["model"]): (s["dim"], s["weights"]) for s in out["sets"]}
    assert got[("text cls_before_pooler", "princeton-nlp/unsup-simcse-bert-base-uncased")] == (768, "random")
    assert got[("text cls_before_pooler", "voidism/diffcse-bert-base-uncased-sts")] == (768, "random")
    assert got[("joint text", "openai/clip-vit-base-patch32")] == (512, "random")
    assert got[("joint image", "openai/clip-vit-base-patch32")] == (512, "random")
    # DALR's terms read no image-encoder set: the demo's colour-edge grid is not built under a paper profile
    assert not any(s["set"] == "image" for s in out["sets"])
