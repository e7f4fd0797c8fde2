import numpy as np
import pytest
from PIL import Image

from mmcse.config import DetectConfig
from mmcse.detection.crops import char_span_to_token_span
from mmcse.detection.objects import detect_objects
from mmcse.io import read_jsonl, write_jsonl
from mmcse.models.student import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("packaged:all-MiniLM-L6-v2")


def test_char_span_to_token_span(tokenizer):
    text = "a small red circle above a big blue square"
    enc = tokenizer(text, return_offsets_mapping=True)
    start = text.index("a big")
    first, last = char_span_to_token_span(enc["offset_mapping"], start, len(text))
    assert tokenizer.decode(enc["input_ids"][first:last]) == "a big blue square"
    cut = tokenizer(text, truncation=True, max_length=8, return_offsets_mapping=True)
    assert char_span_to_token_span(cut["offset_mapping"], start, len(text)) is None


def test_crops_are_transparent_outside_the_object(prepared_project):
    raw, objects = prepared_project / "data/raw", prepared_project / "data/objects"
    images = {r["image_id"]: r for r in read_jsonl(raw / "images.jsonl")}
    row = read_jsonl(objects / "objects.jsonl")[0]
    assert len(row["objects"]) >= 2
    labels = np.asarray(Image.open(raw / images[row["image_id"]]["mask"]))
    for obj in row["objects"]:
        crop = np.asarray(Image.open(objects / obj["crop"]))
        x0, y0, x1, y1 = obj["box"]
        assert crop.shape == (y1 - y0, x1 - x0, 4)
        inside = labels[y0:y1, x0:x1] == obj["object"] + 1
        assert (crop[..., 3][inside] == 255).all() and (crop[..., 3][~inside] == 0).all()


def test_truncated_phrases_and_small_pairs_are_dropped(tmp_path, prepared_project, tokenizer):
    raw = prepared_project / "data/raw"
    pairs = read_jsonl(raw / "pairs.jsonl")
    long_caption = "there is " + " and ".join(["a big red circle"] * 20)
    pairs[0] = {**pairs[0], "caption": long_caption,
                "phrases": [{"object": 0, "start": 9, "end": 25}, {"object": 1, "start": len(long_caption) - 16,
                                                                  "end": len(long_caption)}]}
    (tmp_path / "raw").mkdir()
    for name in ("images", "masks"):
        (tmp_path / "raw" / name).symlink_to(raw / name)
    (tmp_path / "raw/images.jsonl").write_text((raw / "images.jsonl").read_text())
    write_jsonl(tmp_path / "raw/pairs.jsonl", pairs)
    stats = detect_objects(tmp_path / "raw", tmp_path / "out", DetectConfig(min_objects=2), tokenizer, 16)
    kept = {r["pair_id"] for r in read_jsonl(tmp_path / "out/objects.jsonl")}
    assert pairs[0]["pair_id"] not in kept
    assert stats["phrases_truncated"] >= 1 and stats["pairs_too_few_objects"] >= 1
    assert all(len(r["objects"]) >= 2 for r in read_jsonl(tmp_path / "out/objects.jsonl"))


def test_empty_caption_and_corrupt_image_are_clear_errors(tmp_path, prepared_project, tokenizer):
    raw = prepared_project / "data/raw"
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/images.jsonl").write_text((raw / "images.jsonl").read_text())
    pairs = read_jsonl(raw / "pairs.jsonl")
    write_jsonl(tmp_path / "raw/pairs.jsonl", [{**pairs[0], "caption": "  "}])
    with pytest.raises(ValueError, match="empty caption"):
        detect_objects(tmp_path / "raw", tmp_path / "out", DetectConfig(), tokenizer, 32)
    write_jsonl(tmp_path / "raw/pairs.jsonl", pairs[:1])
    (tmp_path / "raw/images").mkdir()
    (tmp_path / "raw/masks").mkdir()
    (tmp_path / f"raw/images/{pairs[0]['image_id']}.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="corrupt or unreadable image"):
        detect_objects(tmp_path / "raw", tmp_path / "out", DetectConfig(), tokenizer, 32)
    assert not (tmp_path / "out/objects.jsonl").exists()
