"""The real-data path end to end on archives laid out like Flickr30k's (Karpathy's split file,
an image zip of JPEGs of assorted sizes, Flickr30k Entities), served from 127.0.0.1:
download → detect_objects (annotations from the Entities boxes) → cache_teachers → train
(MCSEO, which needs every one of them) → evaluate."""

from __future__ import annotations

import io
import json
import os
import random

import numpy as np
import pytest
from PIL import Image

from mmcse.io import read_json, read_jsonl
from mmcse.training.engine import Hooks
from tests.conftest import prepare_project, repo_params, shrink
from tests.data.served import make_zip, server  # noqa: F401  (the fixture)

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
THINGS = ["dog", "ball", "car", "kite"]


def _flickr_like(rng: random.Random, n_images: int) -> dict[str, bytes]:
    """Karpathy's caption file, JPEGs with two coloured things each, and Entities markup/boxes."""
    entries, members = [], {}
    for i in range(n_images):
        stem = str(5000 + i)
        w, h = rng.choice([(64, 48), (48, 64), (80, 60)])
        img = Image.new("RGB", (w, h), (128, 128, 128))
        px = img.load()
        things = rng.sample(THINGS, 2)
        colours = rng.sample(sorted(COLOURS), 2)
        boxes = [(2, 2, w // 2 - 2, h - 3), (w // 2 + 1, 4, w - 3, h // 2)]
        xml = "<annotation>"
        for k, ((x0, y0, x1, y1), colour) in enumerate(zip(boxes, colours, strict=True)):
            for x in range(x0, x1 + 1):
                for y in range(y0, y1 + 1):
                    px[x, y] = COLOURS[colour]
            xml += (f"<object><name>{k + 1}</name><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax>"
                    f"<ymax>{y1}</ymax></bndbox></object>")
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95)
        members[f"flickr30k-images/{stem}.jpg"] = buf.getvalue()
        marked = [f"[/EN#1/animals a {colours[0]} {things[0]}] next to [/EN#2/other a {colours[1]} {things[1]}] .",
                  f"[/EN#2/other The {colours[1]} {things[1]}] is above [/EN#1/animals the {colours[0]} {things[0]}] ."]
        members[f"annotations/Sentences/{stem}.txt"] = "\n".join(marked).encode()
        members[f"annotations/Annotations/{stem}.xml"] = (xml + "</annotation>").encode()
        plain = [m.replace("[/EN#1/animals ", "").replace("[/EN#2/other ", "").replace("]", "") for m in marked]
        entries.append({"filename": f"{stem}.jpg", "split": "train" if i < n_images - 2 else "test",
                        "sentences": [{"raw": c} for c in plain]})
    members["dataset_flickr30k.json"] = json.dumps({"images": entries}).encode()
    return members


@pytest.mark.slow
def test_flickr30k_like_archives_run_through_every_stage(server, tmp_path):  # noqa: F811
    files, url = server
    members = _flickr_like(random.Random(0), 26)
    for name, prefix in (("caption_datasets.zip", "dataset_"), ("flickr30k-images.zip", "flickr30k-images/"),
                         ("annotations.zip", "annotations/")):
        (files / name).write_bytes(make_zip({k: v for k, v in members.items() if k.startswith(prefix)}))
    raw = shrink(repo_params())
    raw["data"].update(pairs="flickr30k", annotations="flickr30k_entities", captions="all", sources={
        "karpathy_splits": {"url": f"{url}/caption_datasets.zip"},
        "flickr30k_images": {"url": f"{url}/flickr30k-images.zip"},
        "flickr30k_entities": {"url": f"{url}/annotations.zip"}})
    raw["train"].update(method="mcseo", max_steps=6, eval_steps=3, checkpoint_steps=3)
    raw["teachers"]["joint"]["dim"] = 8
    (tmp_path / "project").mkdir()
    root = prepare_project(tmp_path / "project", raw)

    manifest = read_json(root / "data/raw/manifest.json")
    assert manifest["counts"]["images"] == 24 and manifest["counts"]["pairs"] == 48  # the 2 test images left out
    assert manifest["counts"]["pairs_with_phrases"] == 48
    detect = read_json(root / "metrics/detect.json")
    assert detect["pairs_kept"] == 48 and detect["objects"] == 96
    rows = read_jsonl(root / "data/objects/objects.jsonl")
    first = rows[0]
    pair = next(p for p in read_jsonl(root / "data/raw/pairs.jsonl") if p["pair_id"] == first["pair_id"])
    assert [o["phrase"] for o in first["objects"]] == [pair["caption"][p["start"]:p["end"]] for p in pair["phrases"]]
    # an Entities box has no mask: the whole box is the object (opaque crop of the box's size)
    crop = np.asarray(Image.open(root / "data/objects" / first["objects"][0]["crop"]))
    x0, y0, x1, y1 = first["objects"][0]["box"]
    assert crop.shape == (y1 - y0, x1 - x0, 4) and (crop[..., 3] == 255).all()
    sets = read_json(root / "data/teachers/manifest.json")["sets"]
    images = read_json(root / "data/teachers" / sets["image"] / "index.json")["ids"]
    crops = read_json(root / "data/teachers" / sets["object"] / "index.json")["ids"]
    assert len(images) == 24 and len(crops) == 48  # every JPEG and every crop has its features

    from mmcse.experiments.params import load_config
    from mmcse.pipeline.evaluate import run_evaluate
    from mmcse.pipeline.paths import Paths
    from mmcse.pipeline.train import run_train

    cwd = os.getcwd()
    os.chdir(root)
    try:
        cfg = load_config("params.yaml")
        paths = Paths.of(cfg)
        summary = run_train(cfg, paths, hooks=Hooks(progress=False))
        scores = run_evaluate(cfg, paths, paths.student / "best")
    finally:
        os.chdir(cwd)
    assert summary["steps"] == 6 and np.isfinite(summary["best_dev_sts"])
    assert np.isfinite(scores["avg"])
