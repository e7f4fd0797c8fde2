"""Pixels for a CNN in the training loop (VSE++'s): the random crop's rule, its determinism, the evaluation
crop against torchvision's own transforms, and missing images named before any batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmcse.data.images import ImagePixels, OneAhead, eval_crop, random_crop_box, train_crop
from mmcse.errors import CorruptArtifact


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("size", [(640, 480), (300, 900), (57, 41)])
def test_a_random_crop_lies_in_the_image_with_area_and_aspect_in_bounds(size):
    width, height = size
    rng = np.random.default_rng(3)
    fallbacks = 0
    for _ in range(300):
        top, left, h, w = random_crop_box(width, height, rng)
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h > 0 and w > 0
        area, aspect = h * w / (width * height), w / h
        # a drawn crop: area within 8-100 % and aspect within 3/4-4/3 (up to rounding to whole pixels)
        drawn = 0.08 - 2 / min(width, height) <= area and 3 / 4 * 0.9 <= aspect <= 4 / 3 * 1.1
        fallbacks += not drawn
        if not drawn:  # the fallback: the largest centered crop of an allowed aspect
            assert (top, left) == ((height - h) // 2, (width - w) // 2)
    assert fallbacks < 30


def test_the_same_seed_gives_the_same_crop_and_flip_another_seed_another():
    img = _image(120, 90)
    a = train_crop(img, 32, np.random.default_rng([7, 3, 0]))
    b = train_crop(img, 32, np.random.default_rng([7, 3, 0]))
    c = train_crop(img, 32, np.random.default_rng([7, 4, 0]))
    assert a.shape == (3, 32, 32) and torch.equal(a, b) and not torch.equal(a, c)


def test_a_training_crop_is_torchvisions_resized_crop_of_its_box_flipped_by_its_draw():
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    img = _image(80, 60, seed=1)
    for seed in range(8):
        rng = np.random.default_rng(seed)
        top, left, h, w = random_crop_box(80, 60, rng)
        flip = rng.random() < 0.5
        expected = TF.resized_crop(img, top, left, h, w, [24, 24], InterpolationMode.BILINEAR, antialias=True)
        expected = TF.hflip(expected) if flip else expected
        expected = TF.normalize(TF.to_tensor(expected), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        assert torch.equal(train_crop(img, 24, np.random.default_rng(seed)), expected)


def test_the_evaluation_crop_is_vsepps_resize_256_center_crop_224():
    from torchvision import transforms

    img = _image(500, 375, seed=2)
    theirs = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                                 transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    assert torch.allclose(eval_crop(img, 224), theirs(img), atol=1e-6)


def _data(tmp_path, n: int = 5):
    rows = []
    (tmp_path / "images").mkdir()
    for i in range(n):
        _image(40 + 3 * i, 30 + 2 * i, seed=i).save(tmp_path / "images" / f"{i}.png")
        rows.append({"image_id": f"img{i}", "file": f"images/{i}.png"})
    (tmp_path / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["image_id"] for r in rows]


def test_batches_are_pure_functions_of_seed_and_step_whatever_the_threads(tmp_path):
    ids = _data(tmp_path)
    one, four = ImagePixels(tmp_path, ids, 32, workers=1), ImagePixels(tmp_path, ids, 32, workers=4)
    rows = one.row_indices(["img3", "img0", "img3"])
    assert rows.tolist() == [3, 0, 3]
    a, b = one.train_batch(rows, seed=5, step=2), four.train_batch(rows, seed=5, step=2)
    assert a.shape == (3, 3, 32, 32) and torch.equal(a, b)
    assert not torch.equal(a[0], a[2])  # one image twice in a batch: two positions, two crops
    assert not torch.equal(a, one.train_batch(rows, seed=5, step=3))
    evaluated = one.eval_batch(rows)
    assert torch.equal(evaluated[0], evaluated[2])  # the center crop is fixed
    assert torch.equal(evaluated[1], eval_crop(Image.open(tmp_path / "images/0.png").convert("RGB"), 32))


def test_a_missing_image_row_or_file_is_named_before_any_batch(tmp_path):
    ids = _data(tmp_path)
    with pytest.raises(KeyError, match="no image row for 1 id"):
        ImagePixels(tmp_path, [*ids, "nope"], 32)
    (tmp_path / "images/2.png").unlink()
    with pytest.raises(CorruptArtifact, match=r"images/2.png"):
        ImagePixels(tmp_path, ids, 32)
    (tmp_path / "images/2.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match=r"2.png: corrupt or unreadable image"):
        ImagePixels(tmp_path, ids, 32).eval_batch(np.arange(5))


def test_one_ahead_makes_the_next_steps_batch_while_this_one_trains_and_the_same_batch_either_way():
    import threading
    import time

    made: list[tuple[int, str]] = []

    def make(step: int) -> torch.Tensor:
        made.append((step, threading.current_thread().name))
        time.sleep(0.01)
        return torch.full((2,), float(step))

    ahead = OneAhead(make)
    try:
        assert ahead.get(0, 1).tolist() == [0.0, 0.0]  # nothing prefetched: made here, step 1 started
        assert ahead.get(1, 2).tolist() == [1.0, 1.0]
        ahead.pending[1].result()  # step 2 made in the thread (else the jump below may cancel it before it starts)
        assert ahead.get(5, None).tolist() == [5.0, 5.0]  # a jump (a resume): made on the spot, the same batch
        assert ahead.pending is None
    finally:
        ahead.close()
    where = dict(made)
    assert where[0] == threading.current_thread().name and where[5] == threading.current_thread().name
    assert where[1].startswith("mmcse-prefetch") and where[2].startswith("mmcse-prefetch")

    def broken(step: int) -> torch.Tensor:
        if step == 1:
            raise OSError("image-1.jpg: truncated")
        return torch.zeros(1)

    failing = OneAhead(broken)
    try:
        failing.get(0, 1)
        with pytest.raises(OSError, match="image-1.jpg"):  # the thread's error surfaces in the step that needs it
            failing.get(1, 2)
    finally:
        failing.close()
