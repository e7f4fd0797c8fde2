import random

import numpy as np
import pytest

from mmcse.config import DataConfig, DemoDataConfig
from mmcse.data import demo
from mmcse.data.prepare import prepare_data
from mmcse.io import read_jsonl

SMALL = DataConfig(demo=DemoDataConfig(num_images=12, captions_per_image=3, corpus_sentences=50,
                                       sts_dev_pairs=20, sts_test_pairs=20, retrieval_images=10,
                                       retrieval_val_images=10))


def test_same_seed_same_bytes_other_seed_other_data(tmp_path):
    a = prepare_data(SMALL, 7, tmp_path / "a")
    b = prepare_data(SMALL, 7, tmp_path / "b")
    c = prepare_data(SMALL, 8, tmp_path / "c")
    assert a["sha256"] == b["sha256"]
    assert a["sha256"]["pairs.jsonl"] != c["sha256"]["pairs.jsonl"]
    assert (tmp_path / "a/images/img00003.png").read_bytes() == (tmp_path / "b/images/img00003.png").read_bytes()
    assert a["counts"] == {"images": 12, "pairs": 36, "corpus_sentences": 50, "sts_dev_pairs": 20,
                           "sts_test_pairs": 20, "pairs_with_phrases": 36, "retrieval_images": 10,
                           "retrieval_captions": 30, "retrieval_val_images": 10, "retrieval_val_captions": 30}
    assert a["retrieval_set"] == "demo" and a["retrieval_val_set"] == "demo_val"


def test_the_retrieval_test_set_is_drawn_apart_from_training(tmp_path):
    manifest = prepare_data(SMALL, 7, tmp_path)
    train = read_jsonl(tmp_path / "images.jsonl")
    test = read_jsonl(tmp_path / "retrieval/images.jsonl")
    captions = read_jsonl(tmp_path / "retrieval/captions.jsonl")
    assert [r["image_id"] for r in test] == [f"test{i:05d}" for i in range(10)]
    assert not {r["sha256"] for r in test} & {r["sha256"] for r in train}  # no training picture is a test picture
    for row in test:
        assert (tmp_path / row["file"]).stat().st_size == row["bytes"]
    # every caption of every test image (data.captions picks training captions only)
    assert [c["image_id"] for c in captions] == [r["image_id"] for r in test for _ in range(3)]
    assert all(c["caption"].strip() for c in captions)
    assert manifest["sha256"]["retrieval/captions.jsonl"]


def test_phrase_spans_name_their_objects_and_masks_match_boxes(tmp_path):
    from PIL import Image

    prepare_data(SMALL, 3, tmp_path)
    images = {r["image_id"]: r for r in read_jsonl(tmp_path / "images.jsonl")}
    for pair in read_jsonl(tmp_path / "pairs.jsonl"):
        objects = images[pair["image_id"]]["objects"]
        assert pair["caption"].strip()
        for ph in pair["phrases"]:
            text = pair["caption"][ph["start"] : ph["end"]]
            obj = objects[ph["object"]]
            assert text.startswith("a ") and obj["colour"] in text.split()
            assert any(word in text.split() for word in demo.SHAPES[obj["shape"]])
    for row in images.values():
        labels = np.asarray(Image.open(tmp_path / row["mask"]))
        for k, obj in enumerate(row["objects"]):
            ys, xs = np.nonzero(labels == k + 1)
            x0, y0, x1, y1 = obj["box"]
            assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (x0, y0, x1, y1)
            rgb = np.asarray(Image.open(tmp_path / row["file"]))[labels == k + 1]
            assert np.abs(rgb.mean(0) - demo.COLOURS[obj["colour"]]).max() < 1.0


def test_gold_scores_follow_meaning():
    rng = random.Random(0)
    scene = demo.sample_scene(rng, 2, 2)
    a = demo.describe(scene, rng, [0, 1])
    b = demo.describe(scene, rng, [1, 0])
    assert demo.meaning_similarity(a.mentioned(scene), b.mentioned(scene)) == 1.0
    red = demo.SceneObject("circle", "red", "small", 0, 0)
    blue = demo.SceneObject("circle", "blue", "small", 0, 0)
    square = demo.SceneObject("square", "blue", "large", 0, 0)
    assert demo.meaning_similarity([red], [red]) > demo.meaning_similarity([red], [blue]) > \
        demo.meaning_similarity([red], [square])
    golds = [demo.sts_pair(rng, 2, 4)[2] for _ in range(200)]
    assert min(golds) >= 0 and max(golds) == 5.0 and len(set(golds)) > 10


def test_senteval_source_needs_a_folder(tmp_path):
    cfg = DataConfig(source="senteval", senteval_dir=str(tmp_path / "missing"), demo=SMALL.demo)
    with pytest.raises(FileNotFoundError, match="data.senteval_dir"):
        prepare_data(cfg, 0, tmp_path / "out")


def test_senteval_source_uses_stsb_dev_and_all_tasks(tmp_path, senteval_dir):
    cfg = DataConfig(source="senteval", senteval_dir=str(senteval_dir), demo=SMALL.demo)
    manifest = prepare_data(cfg, 0, tmp_path)
    assert manifest["counts"]["sts_dev_pairs"] == 1500
    assert manifest["counts"]["sts_test_pairs"] == 3108 + 1500 + 3750 + 3000 + 1186 + 1379 + 4927
