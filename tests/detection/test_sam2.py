"""detect.backend sam2: SAM 2 (bundled config, random weights) and Florence-2 (a tiny random
transformers model with its real processor) on CPU; the backend on demo data with the
recorded ground-truth grounding as the grounder's output; resume per shard; unreadable
images skipped and counted; offline ids fail fast."""

import hashlib
import json
import logging
import re
import shutil
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from mmcse.config import ConfigError, DetectConfig, parse_config
from mmcse.detection import sam2 as segment
from mmcse.detection.crops import masked_crop
from mmcse.detection.grounding import TASK, parse_grounding
from mmcse.detection.objects import detect_objects
from mmcse.hub import ModelUnavailableError
from mmcse.io import open_image, read_jsonl
from mmcse.models.student import load_tokenizer
from tests.conftest import prepare_project, repo_params, shrink

SAM2_CONFIG = "configs/sam2.1/sam2.1_hiera_t.yaml"
CPU = torch.device("cpu")
MAX_SEQ_LEN = 32  # model.max_seq_len of the shrunk params (TINY_MODEL)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo world with 4 images × 2 captions after download and the annotations backend."""
    raw = shrink(repo_params())
    raw["data"]["demo"]["num_images"] = 4
    return prepare_project(tmp_path_factory.mktemp("segment"), raw)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("packaged:all-MiniLM-L6-v2")


def _pixels(image: Image.Image) -> str:
    return hashlib.sha256(np.asarray(image.convert("RGB")).tobytes()).hexdigest()


class DemoWorld:
    """Ground truth of the demo images, found by their pixels (the models only see images)."""

    def __init__(self, raw):
        self.images = {r["image_id"]: r for r in read_jsonl(raw / "images.jsonl")}
        self.pairs = read_jsonl(raw / "pairs.jsonl")
        self.by_pixels = {_pixels(open_image(raw / r["file"])): r for r in self.images.values()}
        self.labels = {i: np.asarray(open_image(raw / r["mask"])) for i, r in self.images.items()}


class RecordedGrounder:
    """Florence-2's documented post-processed output, filled with the recorded phrases and boxes;
    counts its calls and raises on call ``fail_on`` (an interrupted run)."""

    def __init__(self, world: DemoWorld, fail_on: int | None = None):
        self.world, self.fail_on, self.calls = world, fail_on, 0
        self.outputs = {}
        for p in world.pairs:
            boxes = [world.images[p["image_id"]]["objects"][ph["object"]]["box"] for ph in p["phrases"]]
            labels = [p["caption"][ph["start"] : ph["end"]] for ph in p["phrases"]]
            self.outputs[(p["image_id"], p["caption"])] = {TASK: {"bboxes": boxes, "labels": labels}}

    def __call__(self, images, captions):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("interrupted")
        ids = [self.world.by_pixels[_pixels(im)]["image_id"] for im in images]
        return [self.outputs[(i, c)] for i, c in zip(ids, captions, strict=True)]


class LabelMapSegmenter:
    """SAM stand-in: each box's mask is the recorded mask of the object with that box."""

    def __init__(self, world: DemoWorld):
        self.world, self.calls = world, 0

    def __call__(self, image, boxes):
        self.calls += 1
        row = self.world.by_pixels[_pixels(image)]
        index = {tuple(o["box"]): k for k, o in enumerate(row["objects"])}
        labels = self.world.labels[row["image_id"]]
        return np.stack([labels == index[tuple(int(v) for v in b)] + 1 for b in boxes])  # (N, H, W)


@pytest.fixture(scope="module")
def world(demo):
    return DemoWorld(demo / "data/raw")


# --------------------------------------------------------------------------- SAM 2


@pytest.fixture(scope="module")
def sam2_file(tmp_path_factory):
    """SAM 2.1 tiny from the package's bundled config with random weights, saved as a checkpoint."""
    torch.manual_seed(0)
    model = segment.build_sam2_model(SAM2_CONFIG, None)
    path = tmp_path_factory.mktemp("sam2") / "sam2.1_hiera_tiny.pt"
    torch.save({"model": model.state_dict()}, path)
    return path, model.state_dict()


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_sam2_masks_have_the_image_shape_and_crops_follow_them(sam2_file, world, demo):
    path, reference = sam2_file
    torch.manual_seed(1)  # other random init: equality below means the file's weights were loaded
    model = segment.build_sam2_model(SAM2_CONFIG, path)
    loaded = model.state_dict()
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)
    segmenter = segment.Sam2Segmenter(model, CPU)
    for count, row in zip((None, 1), list(world.images.values())[:2], strict=True):  # all boxes, then a single box
        image = open_image(demo / "data/raw" / row["file"])
        boxes = np.array([o["box"] for o in row["objects"]][:count], dtype=np.float32)
        masks = segmenter(image, boxes)
        assert masks.shape == (len(boxes), image.height, image.width) and masks.dtype == bool
        for mask, box in zip(masks, boxes.astype(int), strict=True):
            x0, y0, x1, y1 = box
            crop = np.asarray(masked_crop(image, mask, box))
            assert crop.shape == (y1 - y0, x1 - x0, 4)
            inside = mask[y0:y1, x0:x1]
            assert (crop[..., 3][inside] == 255).all() and (crop[..., 3][~inside] == 0).all()
            np.testing.assert_array_equal(crop[..., :3], np.asarray(image.convert("RGB"))[y0:y1, x0:x1])


def test_sam2_checkpoints_load_safely_or_fail_clearly(tmp_path):
    torch.save({"model": {"image_encoder.nope": torch.zeros(1)}}, tmp_path / "wrong.pt")
    with pytest.raises(ValueError, match="does not fit detect.sam2_config"):
        segment.build_sam2_model(SAM2_CONFIG, tmp_path / "wrong.pt")
    torch.save({"weights": {}}, tmp_path / "nomodel.pt")
    with pytest.raises(ValueError, match="under the key 'model'"):
        segment.build_sam2_model(SAM2_CONFIG, tmp_path / "nomodel.pt")
    torch.save({"model": {}, "note": Fraction(1, 3)}, tmp_path / "pickled.pt")  # needs unpickling arbitrary code
    with pytest.raises(ValueError, match="not a loadable SAM 2 checkpoint"):
        segment.build_sam2_model(SAM2_CONFIG, tmp_path / "pickled.pt")


# --------------------------------------------------------------------------- Florence-2


@pytest.fixture(scope="module")
def tiny_florence(tmp_path_factory):
    """A Florence-2 with random weights (2-stage DaViT, 1-layer BART, 64-px images: 2×2 + 1
    image tokens), a byte-level BPE tokenizer with <image> and the 1000 <loc_k> tokens, and
    the real Florence2Processor, saved as a model folder."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import (
        BartTokenizer,
        CLIPImageProcessor,
        Florence2Config,
        Florence2ForConditionalGeneration,
        Florence2Processor,
    )

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["Locate the phrases in the caption: a big red circle above a small blue square"],
                            vocab_size=320, min_frequency=1, show_progress=False,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    merges = [tuple(m) for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]]
    tok = BartTokenizer(vocab=bpe.get_vocab(), merges=merges, extra_special_tokens={"image_token": "<image>"})
    tok.add_tokens([f"<loc_{i}>" for i in range(1000)])  # Florence-2's location tokens: added, not special
    images = CLIPImageProcessor(size={"height": 64, "width": 64}, do_center_crop=False, image_seq_length=5,
                                image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    processor = Florence2Processor(image_processor=images, tokenizer=tok,
                                   post_processor_config={"phrase_grounding": {"banned_grounding_tokens": []}})
    config = Florence2Config(
        text_config=dict(vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=128, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, decoder_start_token_id=tok.eos_token_id,
                         forced_bos_token_id=tok.bos_token_id),
        vision_config=dict(depths=[1, 1, 1, 1], embed_dim=[8, 16, 16, 32], num_heads=[1, 1, 1, 1],
                           num_groups=[1, 1, 1, 1], window_size=2, projection_dim=32, max_position_embeddings=8),
        image_token_id=tok.image_token_id,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("florence") / "florence"
    Florence2ForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_florence_grounder_generates_and_post_processes(tiny_florence, world, demo):
    assert segment.resolve_grounding_model(str(tiny_florence)) == str(tiny_florence)
    grounder = segment.FlorenceGrounder(str(tiny_florence), CPU, max_new_tokens=12, num_beams=2)
    rows = list(world.images.values())[:2]
    images = [open_image(demo / "data/raw" / r["file"]) for r in rows]
    captions = [p["caption"] for p in world.pairs if p["image_id"] == rows[0]["image_id"]][:1] + [
        "a big red circle above a small blue square and more words to pad"]
    outputs = grounder(images, captions)
    assert len(outputs) == 2
    for output, image, caption in zip(outputs, images, captions, strict=True):
        assert set(output) == {TASK} and set(output[TASK]) == {"bboxes", "labels"}
        boxes, labels = output[TASK]["bboxes"], output[TASK]["labels"]
        assert len(boxes) == len(labels) and all(isinstance(label, str) for label in labels)
        for box in boxes:
            assert len(box) == 4 and 0 <= box[0] <= image.width and 0 <= box[3] <= image.height
        parse_grounding(output, caption, image.width, image.height)  # accepted as is
    # The loaded processor turns a recorded generation into the documented pixel boxes.
    text = "</s><s>a big red circle<loc_0><loc_0><loc_499><loc_999></s><pad>"
    parsed = grounder.processor.post_process_generation(text, task=TASK, image_size=(64, 48))
    assert parsed == {TASK: {"bboxes": [[0, 0, 31, 47]], "labels": ["a big red circle"]}}


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_backend_runs_from_params_with_both_models(tiny_florence, sam2_file, demo, tokenizer, tmp_path, monkeypatch):
    cfg = DetectConfig(backend="sam2", grounding_model=str(tiny_florence), sam2_checkpoint=str(sam2_file[0]),
                       max_new_tokens=12, num_beams=1, batch_size=2, shard_size=2)
    stats = detect_objects(demo / "data/raw", tmp_path / "out", cfg, tokenizer, MAX_SEQ_LEN, "cpu")
    assert stats["images_in"] == 4 and stats["pairs_in"] == 8 and stats["shards"] == 2
    assert stats["pairs_in"] == stats["pairs_kept"] + stats["pairs_too_few_objects"] + stats["pairs_unreadable_image"]
    rows = read_jsonl(tmp_path / "out/objects.jsonl")
    assert len(rows) == stats["pairs_kept"] and sum(len(r["objects"]) for r in rows) == stats["objects"]
    assert sorted(p.name for p in (tmp_path / "out/shards").iterdir()) == ["shard-00000.jsonl", "shard-00001.jsonl"]
    # Finished: a rerun reuses both shards and loads no model.
    monkeypatch.setattr(segment, "load_models", lambda *a: pytest.fail("a finished run loaded a model"))
    again = detect_objects(demo / "data/raw", tmp_path / "out", cfg, tokenizer, MAX_SEQ_LEN, "cpu")
    assert again["shards_reused"] == 2 and {**again, "shards_reused": 0} == stats


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_backend_segments_with_sam2_loaded_from_the_checkpoint(sam2_file, demo, world, tokenizer, tmp_path):
    raw = tmp_path / "raw"  # two images: SAM 2 embeds each at 1024 px (seconds on a CPU)
    shutil.copytree(demo / "data/raw", raw)
    keep = ["img00000", "img00001"]
    (raw / "images.jsonl").write_text("".join(json.dumps(world.images[i]) + "\n" for i in keep))
    (raw / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in world.pairs if p["image_id"] in keep))
    cfg = _sam2_cfg(sam2_checkpoint=str(sam2_file[0]), min_objects=1)
    stats = segment.detect_objects_sam2(raw, tmp_path / "out", cfg, tokenizer, MAX_SEQ_LEN, "cpu",
                                        grounder=RecordedGrounder(world))  # segmenter: from the config
    assert stats["images_in"] == 2 and stats["pairs_in"] == stats["pairs_kept"] + stats["pairs_too_few_objects"]
    assert stats["phrases_grounded"] == sum(len(p["phrases"]) for p in world.pairs if p["image_id"] in keep)
    assert stats["objects"] > 0  # with min_objects 1, every grounded phrase is kept, empty or truncated:
    assert stats["objects"] + stats["masks_empty"] + stats["phrases_truncated"] == stats["phrases_grounded"]
    for row in read_jsonl(tmp_path / "out/objects.jsonl"):
        image = np.asarray(open_image(raw / world.images[row["image_id"]]["file"]).convert("RGB"))
        for obj in row["objects"]:
            x0, y0, x1, y1 = obj["box"]
            crop = np.asarray(Image.open(tmp_path / "out" / obj["crop"]))
            assert crop.shape == (y1 - y0, x1 - x0, 4) and set(np.unique(crop[..., 3])) <= {0, 255}
            assert (crop[..., 3] == 255).any()  # empty masks are dropped, not written
            opaque = crop[..., 3] == 255
            np.testing.assert_array_equal(crop[..., :3][opaque], image[y0:y1, x0:x1][opaque])


# --------------------------------------------------------------------------- the backend


def _sam2_cfg(**kw) -> DetectConfig:
    return DetectConfig(backend="sam2", **kw)


def test_recorded_grounding_gives_the_annotations_table(demo, world, tokenizer, tmp_path):
    grounder, segmenter = RecordedGrounder(world), LabelMapSegmenter(world)
    stats = segment.detect_objects_sam2(demo / "data/raw", tmp_path, _sam2_cfg(batch_size=2, shard_size=3),
                                        tokenizer, MAX_SEQ_LEN, grounder=grounder, segmenter=segmenter)
    expected = read_jsonl(demo / "data/objects/objects.jsonl")
    rows = read_jsonl(tmp_path / "objects.jsonl")
    assert [r["pair_id"] for r in rows] == [r["pair_id"] for r in expected]
    assert stats["pairs_kept"] == len(rows) and stats["phrases_unmatched"] == stats["bad_boxes"] == 0
    assert stats["images_in"] == 4 and stats["shards"] == 2 and grounder.calls == 3 and segmenter.calls == 4
    fields = ("char_start", "char_end", "phrase", "token_start", "token_end", "box")
    for row, ref in zip(rows, expected, strict=True):
        assert row.keys() == ref.keys() and row["image_id"] == ref["image_id"]
        ref_objects = sorted(ref["objects"], key=lambda o: o["char_start"])
        assert [o.keys() for o in row["objects"]] == [o.keys() for o in ref_objects]
        assert [[o[f] for f in fields] for o in row["objects"]] == [[o[f] for f in fields] for o in ref_objects]
        for k, (obj, ref_obj) in enumerate(zip(row["objects"], ref_objects, strict=True)):
            assert obj["object"] == k and obj["crop"] == f"crops/{row['pair_id']}-o{k}.png"
            crop = Image.open(tmp_path / obj["crop"])
            assert crop.mode == "RGBA"
            pixels = np.asarray(crop)
            np.testing.assert_array_equal(pixels, np.asarray(Image.open(demo / "data/objects" / ref_obj["crop"])))
            assert (pixels[..., 3] == 0).any() and (pixels[..., 3] == 255).any()  # transparent background


def test_interrupted_run_resumes_at_the_unfinished_shard(demo, world, tokenizer, tmp_path):
    raw, cfg = demo / "data/raw", _sam2_cfg(batch_size=1, shard_size=2)  # 2 shards of 2 images, 2 calls each

    def run(out, grounder, config=cfg):
        return segment.detect_objects_sam2(raw, out, config, tokenizer, MAX_SEQ_LEN, grounder=grounder,
                                           segmenter=LabelMapSegmenter(world))

    reference = run(tmp_path / "ref", RecordedGrounder(world))
    ref_rows = read_jsonl(tmp_path / "ref/objects.jsonl")
    ref_crops = {p.name: p.read_bytes() for p in (tmp_path / "ref/crops").iterdir()}

    def same_as_reference(stats):
        assert {**stats, "shards_reused": 0} == reference
        assert read_jsonl(out / "objects.jsonl") == ref_rows
        assert {p.name: p.read_bytes() for p in (out / "crops").iterdir()} == ref_crops

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="interrupted"):
        run(out, RecordedGrounder(world, fail_on=3))  # dies in the second shard
    assert (out / "shards/shard-00000.jsonl").is_file() and not (out / "shards/shard-00001.jsonl").exists()
    assert not (out / "objects.jsonl").exists()
    grounder = RecordedGrounder(world)
    stats = run(out, grounder)
    assert grounder.calls == 2 and stats["shards_reused"] == 1  # only the second shard
    same_as_reference(stats)

    (out / "shards/shard-00001.jsonl").write_text('{"format": 1, "hash": "trunc')  # a corrupt last shard
    grounder = RecordedGrounder(world)
    same_as_reference(run(out, grounder))
    assert grounder.calls == 2

    grounder = RecordedGrounder(world)
    assert run(out, grounder, _sam2_cfg(batch_size=2, shard_size=2))["shards_reused"] == 2  # batch size: same work
    assert grounder.calls == 0
    grounder = RecordedGrounder(world)
    run(out, grounder, _sam2_cfg(batch_size=1, shard_size=2, min_objects=3))  # a changed config redoes every shard
    assert grounder.calls == 4
    kept = {o["crop"].split("/")[1] for r in read_jsonl(out / "objects.jsonl") for o in r["objects"]}
    assert {p.name for p in (out / "crops").iterdir()} == kept  # crops of dropped pairs removed


def test_unreadable_image_is_skipped_and_counted(demo, world, tokenizer, tmp_path, caplog):
    raw = tmp_path / "raw"
    shutil.copytree(demo / "data/raw", raw)
    bad = world.images["img00001"]["file"]
    (raw / bad).write_bytes(b"\x89PNG garbage")
    with caplog.at_level(logging.WARNING, logger="mmcse.detection.sam2"):
        stats = segment.detect_objects_sam2(raw, tmp_path / "out", _sam2_cfg(batch_size=2, shard_size=2), tokenizer,
                                            MAX_SEQ_LEN, grounder=RecordedGrounder(world),
                                            segmenter=LabelMapSegmenter(world))
    assert stats["images_unreadable"] == 1 and stats["pairs_unreadable_image"] == 2 and stats["images_in"] == 4
    assert any(bad in r.getMessage() and "corrupt or unreadable" in r.getMessage() for r in caplog.records)
    expected = [r["pair_id"] for r in read_jsonl(demo / "data/objects/objects.jsonl") if r["image_id"] != "img00001"]
    assert [r["pair_id"] for r in read_jsonl(tmp_path / "out/objects.jsonl")] == expected


def test_offline_uncached_models_fail_fast_naming_them(demo, tokenizer, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("MMCSE_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelUnavailableError, match=r"detect.grounding_model: .*'florence-community/Florence-2-base'"):
        detect_objects(demo / "data/raw", tmp_path / "out", _sam2_cfg(), tokenizer, MAX_SEQ_LEN, "cpu")
    assert not (tmp_path / "out").exists()  # nothing computed
    with pytest.raises(ModelUnavailableError, match=r"'facebook/sam2.1-hiera-tiny' \(sam2.1_hiera_tiny.pt\).*OFFLINE"):
        segment.resolve_sam2_checkpoint("facebook/sam2.1-hiera-tiny")
    with pytest.raises(ModelUnavailableError, match="not found"):
        segment.resolve_sam2_checkpoint(str(tmp_path / "missing.pt"))
    # A cached checkpoint is found offline through the hub cache.
    repo = tmp_path / "hub/models--facebook--sam2.1-hiera-tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text("a" * 40)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40) / "sam2.1_hiera_tiny.pt").write_bytes(b"weights")
    found = segment.resolve_sam2_checkpoint("facebook/sam2.1-hiera-tiny")
    assert found.read_bytes() == b"weights" and found.name == "sam2.1_hiera_tiny.pt"
    assert segment.sam2_checkpoint_filename("facebook/sam2.1-hiera-base-plus") == "sam2.1_hiera_base_plus.pt"


@pytest.mark.parametrize(
    ("detect", "key"),
    [
        ({"backend": "yolo"}, "detect.backend"),
        ({"batch_size": 0}, "detect.batch_size"),
        ({"shard_size": 0}, "detect.shard_size"),
        ({"max_new_tokens": 4096}, "detect.max_new_tokens"),
        ({"num_beams": 0}, "detect.num_beams"),
        ({"grounding_model": " "}, "detect.grounding_model"),
        ({"sam2_checkpoint": "facebook/sam2.1-hiera-large"}, "detect.sam2_config"),  # tiny config, large weights
        ({"backend": "sam2", "sam2_config": "configs/sam3/x.yaml", "sam2_checkpoint": "me/mine"},
         "detect.sam2_config"),
    ],
)
def test_detect_config_is_validated(detect, key):
    with pytest.raises(ConfigError, match=re.escape(f"key '{key}'")):
        parse_config({"detect": detect})


def test_paper_models_parse_and_params_list_exactly_the_keys():
    cfg = parse_config({"detect": {"backend": "sam2", "grounding_model": "florence-community/Florence-2-large",
                                   "sam2_config": "configs/sam2.1/sam2.1_hiera_l.yaml",
                                   "sam2_checkpoint": "facebook/sam2.1-hiera-large"}})
    assert cfg.detect.sam2_checkpoint == "facebook/sam2.1-hiera-large"
    assert list(repo_params()["detect"]) == list(DetectConfig.__dataclass_fields__)
