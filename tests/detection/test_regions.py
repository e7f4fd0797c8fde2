"""Region features (DUET §4.1.1): published-layout readers, Eq. 23 boxes, regions from the demo world's
objects, and the memory-mapped cache."""

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from mmcse.config import DataConfig, DemoDataConfig, DetectConfig, TeachersConfig
from mmcse.detection.region_files import normalise_boxes, read_butd_tsv, read_npy_regions
from mmcse.detection.regions import (
    RegionStore,
    ReusedFeatures,
    build_region_cache,
    npy_source,
    objects_source,
    regions_from_objects,
    tsv_source,
)
from mmcse.errors import CorruptArtifact
from mmcse.io import read_jsonl

# --------------------------------------------------------------------------- writers, independent of the readers


def b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode()


def butd_line(image_id, width, height, boxes, feats) -> str:
    return "\t".join([str(image_id), str(width), str(height), str(len(boxes)), b64(boxes), b64(feats)])


def lxmert_line(image_id, width, height, boxes, feats) -> str:
    n = len(boxes)
    ints = base64.b64encode(np.zeros(n, "<i8").tobytes()).decode()
    return "\t".join([str(image_id), str(height), str(width), ints, b64(np.ones(n)), ints, b64(np.ones(n)), str(n),
                      b64(boxes), b64(feats)])


def random_regions(rng, n, d, width, height):
    x1 = rng.uniform(0, width / 2, n)
    y1 = rng.uniform(0, height / 2, n)
    boxes = np.stack([x1, y1, x1 + rng.uniform(1, width / 2, n), y1 + rng.uniform(1, height / 2, n)], 1)
    return boxes.astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)


IMAGES = {"7": (640, 480, 6), "12": (300, 500, 2), "99": (100, 100, 3)}  # file id: width, height, regions


@pytest.fixture
def tsv(tmp_path):
    """A 6-field TSV of three images (8-d features) and the arrays written into it."""
    rng = np.random.default_rng(0)
    truth, lines = {}, []
    for image_id, (w, h, n) in IMAGES.items():
        boxes, feats = random_regions(rng, n, 8, w, h)
        truth[image_id] = (boxes, feats, w, h)
        lines.append(butd_line(image_id, w, h, boxes, feats))
    path = tmp_path / "feats.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path, truth


# --------------------------------------------------------------------------- readers


@pytest.mark.parametrize("layout", ["butd", "lxmert"])
def test_tsv_reader_round_trips_both_layouts(tmp_path, layout):
    rng = np.random.default_rng(1)
    write = butd_line if layout == "butd" else lxmert_line
    truth = {i: random_regions(rng, n, 16, w, h) for i, (w, h, n) in IMAGES.items()}
    path = tmp_path / "f.tsv"
    path.write_text("".join(write(i, *IMAGES[i][:2], *truth[i]) + "\n" for i in IMAGES))
    got = list(read_butd_tsv(path, ["12", "0007"]))  # only those asked for; digit ids compare as integers
    assert [r.image_id for r in got] == ["7", "12"]
    assert [r.image_id for r in read_butd_tsv(path, ["COCO_val2014_000000000099"])] == ["99"]
    for image_id, boxes, feats, width, height in got:
        assert (width, height) == IMAGES[image_id][:2]  # LXMERT stores height first
        np.testing.assert_array_equal(boxes, truth[image_id][0])
        np.testing.assert_array_equal(feats, truth[image_id][1])
    assert len(list(read_butd_tsv(path))) == 3


def _corrupt(line: str, how: str) -> str:
    f = line.split("\t")
    if how == "truncated base64":
        f[5] = f[5][: len(f[5]) - 3]
    elif how == "short features":
        f[5] = b64(np.zeros((2, 7)))  # 2 × 7 floats where num_boxes × 8 are due
    elif how == "wrong num_boxes":
        f[3] = str(int(f[3]) + 1)
    elif how == "field count":
        f = f[:5]
    elif how == "NaN":
        f[5] = b64(np.full((2, 8), np.nan))
    elif how == "box outside":
        f[4] = b64(np.array([[0, 0, 400, 10], [0, 0, 10, 10]]))  # x2 = 400 in a 300-wide image
    return "\t".join(f)


@pytest.mark.parametrize(("how", "problem"), [
    ("truncated base64", "field features is not valid base64"),
    ("short features", "features decode to 56 bytes, num_boxes=2 × 8-d × 4 needs 64"),
    ("wrong num_boxes", "boxes decode to 32 bytes, num_boxes=3 needs 3 × 4 × 4 = 48"),
    ("field count", "5 tab-separated fields"),
    ("NaN", "features hold NaN"),
    ("box outside", "a box lies outside the 300×500 image"),
])
def test_malformed_tsv_is_one_error_naming_file_and_line(tsv, how, problem):
    path, _ = tsv
    lines = path.read_text().splitlines()
    lines[1] = _corrupt(lines[1], how)  # image 12, 2 regions
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptArtifact) as err:
        list(read_butd_tsv(path, None, dim=8))
    message = str(err.value)
    assert message.startswith(f"{path}: line 2")
    assert "image 12" in message or how == "field count"
    assert problem in message and "\n" not in message


def test_npy_layouts_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    boxes, feats = random_regions(rng, 5, 8, 200, 100)
    a = tmp_path / "npz"
    a.mkdir()
    np.savez_compressed(a / "1.npz", x=feats, bbox=boxes, num_bbox=5, image_w=200, image_h=100)
    np.savez(a / "2.npz", x=feats.T, bbox=boxes, image_w=200, image_h=100)  # extract_feature_to_npz: x is (d, n)
    for file_id in ("1", "2"):
        got = read_npy_regions(a, file_id)
        assert (got.width, got.height) == (200, 100)
        np.testing.assert_array_equal(got.features, feats)
        np.testing.assert_array_equal(got.boxes, boxes)
    att, box = tmp_path / "cocobu_att", tmp_path / "cocobu_box"  # self-critical make_bu_data
    att.mkdir()
    box.mkdir()
    np.savez_compressed(att / "3.npz", feat=feats)
    np.save(box / "3.npy", boxes)
    got = read_npy_regions(att, "3", image_size=(200, 100))
    np.testing.assert_array_equal(got.features, feats)
    np.testing.assert_array_equal(got.boxes, boxes)
    plain = tmp_path / "plain"
    plain.mkdir()
    np.save(plain / "4.npy", feats)
    np.save(plain / "4_boxes.npy", boxes)
    got = read_npy_regions(plain, "4", image_size=(200, 100))
    np.testing.assert_array_equal(got.features, feats)
    np.testing.assert_array_equal(got.boxes, boxes)


def test_malformed_npy_files_are_named(tmp_path):
    rng = np.random.default_rng(3)
    boxes, feats = random_regions(rng, 4, 8, 50, 50)
    np.save(tmp_path / "1.npy", feats)  # no 1_boxes.npy
    with pytest.raises(CorruptArtifact, match=r"1_boxes\.npy: missing"):
        read_npy_regions(tmp_path, "1", image_size=(50, 50))
    with pytest.raises(CorruptArtifact, match=r"5\.npz: missing"):
        read_npy_regions(tmp_path, "5", image_size=(50, 50))
    np.save(tmp_path / "1_boxes.npy", boxes)
    with pytest.raises(CorruptArtifact, match="records no image size"):
        read_npy_regions(tmp_path, "1")
    np.save(tmp_path / "1_boxes.npy", boxes[:3])
    with pytest.raises(CorruptArtifact, match=r"1\.npy: image 1: 3 boxes but 4 feature rows"):
        read_npy_regions(tmp_path, "1", image_size=(50, 50))
    np.savez(tmp_path / "2.npz", x=feats, bbox=boxes, num_bbox=5, image_w=50, image_h=50)
    with pytest.raises(CorruptArtifact, match=r"2\.npz: image 2: num_bbox=5 but bbox has 4 rows"):
        read_npy_regions(tmp_path, "2")
    (tmp_path / "3.npz").write_bytes((tmp_path / "2.npz").read_bytes()[:100])
    with pytest.raises(CorruptArtifact, match=r"3\.npz: unreadable"):
        read_npy_regions(tmp_path, "3")


# --------------------------------------------------------------------------- Eq. 23


def test_boxes_are_normalised_by_eq_23():
    got = normalise_boxes(np.array([[10, 20, 30, 60], [0, 0, 100, 200]]), 100, 200)
    # [x1/W, y1/H, x2/W, y2/H, (x2-x1)(y2-y1)/(WH)] by hand: 20·40 / 20000 = 0.04; the whole image: area 1
    np.testing.assert_allclose(got, [[0.1, 0.1, 0.3, 0.3, 0.04], [0, 0, 1, 1, 1]], rtol=1e-6)
    assert got.dtype == np.float32


# --------------------------------------------------------------------------- the cache


def test_cache_from_tsv_pads_hits_and_rebuilds(tsv, tmp_path, caplog):
    path, truth = tsv
    ids = ["coco-12", "coco-7"]  # the project's ids; the file uses the plain COCO ids
    store, hit = build_region_cache(tmp_path / "cache", ids, tsv_source([path]), max_regions=4, dtype="float32")
    assert not hit and store.regions.shape == (2, 4, 8) and isinstance(store.regions, np.memmap)
    regions, boxes, mask = store.rows(["coco-7", "coco-12"])
    np.testing.assert_array_equal(mask, [[True] * 4, [True, True, False, False]])
    b7, f7, w7, h7 = truth["7"]
    np.testing.assert_array_equal(regions[0], f7[:4])  # 6 regions, the first 4 kept
    np.testing.assert_allclose(boxes[0], normalise_boxes(b7[:4], w7, h7), rtol=1e-6)
    b12, f12, w12, h12 = truth["12"]
    np.testing.assert_array_equal(regions[1, :2], f12)
    np.testing.assert_allclose(boxes[1, :2], normalise_boxes(b12, w12, h12), rtol=1e-6)
    assert not regions[1, 2:].any() and not boxes[1, 2:].any()  # padding is zero

    again, hit = build_region_cache(tmp_path / "cache", ids, tsv_source([path]), max_regions=4, dtype="float32")
    assert hit and again.folder == store.folder

    (store.folder / "index.json").unlink()  # an interrupted write: no index, so built again
    _, hit = build_region_cache(tmp_path / "cache", ids, tsv_source([path]), max_regions=4, dtype="float32")
    assert not hit and (store.folder / "index.json").is_file()

    data = store.folder / "regions.npy"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptArtifact, match="SHA-256"):
        RegionStore.open(store.folder)
    rebuilt, hit = build_region_cache(tmp_path / "cache", ids, tsv_source([path]), max_regions=4, dtype="float32")
    assert not hit and "building it again" in caplog.text
    np.testing.assert_array_equal(rebuilt.rows(["coco-7"])[0][0], f7[:4])
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [store.folder.name]  # no temporary folder left

    with pytest.raises(KeyError, match="no cached regions for image 'coco-5'"):
        rebuilt.rows(["coco-5"])
    with pytest.raises(CorruptArtifact, match=rf"{path}: no regions for 1 of 2 image\(s\), e.g. coco-5"):
        build_region_cache(tmp_path / "cache", ["coco-7", "coco-5"], tsv_source([path]), max_regions=4)

    half, _ = build_region_cache(tmp_path / "cache", ids, tsv_source([path]), max_regions=4)  # float16 default
    assert half.regions.dtype == np.float16 and half.folder != store.folder
    np.testing.assert_allclose(half.rows(["coco-12"])[0][0, :2], f12, rtol=1e-3, atol=1e-3)


def test_cache_from_npy_folder_reads_sizes_from_images(tmp_path):
    from PIL import Image

    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    Image.new("RGB", (40, 30)).save(raw / "images/a.png")
    (raw / "images.jsonl").write_text('{"image_id": "flickr30k-5", "file": "images/a.png"}\n')
    folder = tmp_path / "feats"
    folder.mkdir()
    boxes = np.array([[0, 0, 40, 30], [10, 3, 20, 9]], np.float32)
    np.save(folder / "5.npy", np.eye(2, 3, dtype=np.float32))
    np.save(folder / "5_boxes.npy", boxes)
    store, _ = build_region_cache(tmp_path / "cache", ["flickr30k-5"], npy_source(folder, raw), max_regions=3,
                                  dtype="float32")
    regions, got, mask = store.rows(["flickr30k-5"])
    np.testing.assert_allclose(got[0, :2], [[0, 0, 1, 1, 1], [0.25, 0.1, 0.5, 0.3, 60 / 1200]], rtol=1e-6)
    np.testing.assert_array_equal(regions[0, :2], np.eye(2, 3))
    assert mask.tolist() == [[True, True, False]]


# --------------------------------------------------------------------------- from the demo world's objects

TINY = DataConfig(demo=DemoDataConfig(num_images=5, captions_per_image=2, corpus_sentences=10, sts_dev_pairs=4,
                                      sts_test_pairs=4, retrieval_images=2, retrieval_val_images=2))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny demo data folder, the detect stage's objects and the weight-free encoder."""
    from mmcse.data.prepare import prepare_data
    from mmcse.detection.objects import detect_objects
    from mmcse.models.student import load_tokenizer
    from mmcse.teachers.cache import image_encoder

    root = tmp_path_factory.mktemp("demo")
    prepare_data(TINY, 5, root / "raw")
    detect_objects(root / "raw", root / "objects", DetectConfig(min_objects=1),
                   load_tokenizer("packaged:all-MiniLM-L6-v2"), 32)
    key, encode = image_encoder(TeachersConfig(batch_size=64), torch.device("cpu"))
    return root, key, encode


def test_regions_from_demo_objects_are_the_encoder_on_the_crops(demo, tmp_path):
    from mmcse.detection.crops import object_crop
    from mmcse.io import open_image

    root, key, encode = demo
    raw, objects = root / "raw", root / "objects"
    train = read_jsonl(raw / "images.jsonl")
    test = read_jsonl(raw / "retrieval/images.jsonl")
    ids = [r["image_id"] for r in train + test]
    got = {r.image_id: r for r in regions_from_objects(raw, objects, ids, encode, max_regions=36)}
    assert list(got) == ids
    for row in train + test:  # the retrieval test scenes record their objects as training's do
        r = got[row["image_id"]]
        picture, labels = open_image(raw / row["file"]), np.asarray(open_image(raw / row["mask"]))
        files = []
        for k, obj in enumerate(row["objects"]):
            files.append(tmp_path / f"{row['image_id']}-{k}.png")
            object_crop(picture, labels, k, obj["box"]).save(files[-1])
        expected = encode([*files, raw / row["file"]], "test")  # every object, then the whole image
        np.testing.assert_allclose(r.features, expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(r.boxes, [o["box"] for o in row["objects"]] + [[0, 0, *picture.size]])
    # the detect stage's own crop files encode to the same rows
    detected = read_jsonl(objects / "objects.jsonl")[0]
    for obj in detected["objects"]:
        np.testing.assert_allclose(got[detected["image_id"]].features[obj["object"]],
                                   encode([objects / obj["crop"]], "test")[0], rtol=1e-6, atol=1e-7)
    # at most max_regions: objects first, no room left for the whole image (demo images have >= 2 objects)
    two = next(regions_from_objects(raw, objects, ids[:1], encode, max_regions=2))
    np.testing.assert_array_equal(two.features, got[ids[0]].features[:2])


def test_cached_teacher_rows_are_reused_and_the_cache_hits(demo, tmp_path):
    from mmcse.teachers.cache import cached_features

    root, key, encode = demo
    raw, objects = root / "raw", root / "objects"
    crop_files = sorted({o["crop"] for row in read_jsonl(objects / "objects.jsonl") for o in row["objects"]})
    object_store, _ = cached_features(tmp_path / "teachers", "object", key, "fp", crop_files,
                                      lambda: encode([objects / c for c in crop_files], "crops"))
    train_ids = [r["image_id"] for r in read_jsonl(raw / "images.jsonl")]
    image_store, _ = cached_features(tmp_path / "teachers", "image", key, "fp", train_ids,
                                     lambda: encode([raw / f"images/{i}.png" for i in train_ids], "images"))
    encoded: list[str] = []

    def counting(files, label):
        encoded.extend(Path(f).name for f in files)
        return encode(files, label)

    ids = train_ids + ["test00000"]
    plain = {r.image_id: r for r in regions_from_objects(raw, objects, ids, encode)}
    cached = ReusedFeatures(objects=[object_store], images=[image_store], encoder_key=key)
    reused = {r.image_id: r for r in regions_from_objects(raw, objects, ids, counting, reused=cached)}
    for image_id in ids:
        np.testing.assert_allclose(reused[image_id].features, plain[image_id].features, rtol=1e-6, atol=1e-7)
    n_objects = sum(len(r["objects"]) for r in read_jsonl(raw / "images.jsonl"))
    test_objects = len(read_jsonl(raw / "retrieval/images.jsonl")[0]["objects"])
    # encoded: the objects no caption names (no detect crop), the uncached test image and its objects, nothing else
    assert len(encoded) == n_objects - len(crop_files) + test_objects + 1 and "test00000.png" in encoded

    source = objects_source(raw, objects, key, counting, object_features=[object_store], image_features=[image_store])
    store, hit = build_region_cache(tmp_path / "regions", ids, source, dtype="float32")
    assert not hit and store.max_regions == 36 and store.dim == plain[ids[0]].features.shape[1]
    regions, boxes, mask = store.rows(ids[:2])
    for b, image_id in enumerate(ids[:2]):
        n = len(plain[image_id].features)
        assert mask[b].sum() == n and mask[b, :n].all()
        np.testing.assert_array_equal(regions[b, :n], plain[image_id].features)
        np.testing.assert_allclose(boxes[b, n - 1], [0, 0, 1, 1, 1])  # the whole image comes last
    encoded.clear()
    again, hit = build_region_cache(tmp_path / "regions", ids, source, dtype="float32")
    assert hit and encoded == [] and again.folder == store.folder


def test_val_scenes_have_regions_and_a_folder_without_the_val_table_still_reads(demo, tmp_path):
    import shutil

    from mmcse.detection.crops import object_crop
    from mmcse.io import open_image

    root, key, encode = demo
    raw, objects = root / "raw", root / "objects"
    val = read_jsonl(raw / "retrieval/val_images.jsonl")
    assert [r["image_id"] for r in val] == ["val00000", "val00001"]
    got = list(regions_from_objects(raw, objects, [r["image_id"] for r in val], encode))
    for row, r in zip(val, got, strict=True):  # the val scenes' annotated objects, then the whole image
        picture, labels = open_image(raw / row["file"]), np.asarray(open_image(raw / row["mask"]))
        files = []
        for k, obj in enumerate(row["objects"]):
            files.append(tmp_path / f"{row['image_id']}-{k}.png")
            object_crop(picture, labels, k, obj["box"]).save(files[-1])
        assert r.image_id == row["image_id"]
        np.testing.assert_allclose(r.features, encode([*files, raw / row["file"]], "val"), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(r.boxes, [o["box"] for o in row["objects"]] + [[0, 0, *picture.size]])
    # the val table is part of the objects source's fingerprint
    with_val = objects_source(raw, objects, key, encode).fingerprint

    # a data folder written before the val set: the other tables still serve, a val id is reported missing
    old = tmp_path / "old"
    shutil.copytree(raw, old)
    (old / "retrieval/val_images.jsonl").unlink()
    train_id = read_jsonl(raw / "images.jsonl")[0]["image_id"]
    assert next(regions_from_objects(old, objects, [train_id], encode)).image_id == train_id
    with pytest.raises(KeyError, match="no image row for 1 id.*val00000") as err:
        next(regions_from_objects(old, objects, ["val00000"], encode))
    assert "val_images.jsonl" not in str(err.value)  # names the tables it searched
    assert objects_source(old, objects, key, encode).fingerprint != with_val


def test_a_same_size_image_swap_is_named_before_any_region_is_encoded(demo, tmp_path):
    """Another image of the same byte size passes a size check; its recorded SHA-256 does not."""
    import shutil

    from mmcse.errors import CorruptArtifact

    root, key, encode = demo
    raw = tmp_path / "raw"
    shutil.copytree(root / "raw", raw)
    rows = read_jsonl(raw / "images.jsonl")
    target = raw / rows[1]["file"]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x55  # same size, other bytes
    target.write_bytes(bytes(data))
    calls = []

    def counting(files, what):
        calls.append(len(files))
        return encode(files, what)

    with pytest.raises(CorruptArtifact, match=rf"{rows[1]['file']}: SHA-256 .* differs .*images.jsonl records"):
        list(regions_from_objects(raw, root / "objects", [r["image_id"] for r in rows], counting, max_regions=36))
    assert calls == []  # named before anything was encoded


# --------------------------------------------------------------------------- grid: a CNN's feature map (VSE++)


def test_grid_cell_boxes_follow_resize_and_center_crop():
    from mmcse.teachers.encoders import crop_grid_boxes

    # 512 × 384: shorter side 384 → 256 (scale 2/3), 341 × 256, crop offset (58, 16), cells of 32
    boxes = crop_grid_boxes(512, 384)
    assert boxes.shape == (49, 4)
    np.testing.assert_allclose(boxes[0], [58 * 1.5, 16 * 1.5, 90 * 1.5, 48 * 1.5], rtol=1e-6)
    np.testing.assert_allclose(boxes[8], [90 * 1.5, 48 * 1.5, 122 * 1.5, 80 * 1.5], rtol=1e-6)  # row 1, col 1
    np.testing.assert_allclose(boxes[48], [250 * 1.5, 208 * 1.5, 282 * 1.5, 240 * 1.5], rtol=1e-6)
    # a square image: the crop is centred, cells tile its middle 224/256
    square = crop_grid_boxes(256, 256)
    np.testing.assert_allclose(square[0], [16, 16, 48, 48])
    np.testing.assert_allclose(square[48], [208, 208, 240, 240])


def test_grid_source_regions_are_the_cnns_cells_whose_mean_is_its_pooled_feature(demo, tmp_path):
    """regions.source grid: 49 cells of the last feature map per image; their mean is the pooled
    feature the same ResNet gives (what VSE++ reads), and the cache keeps them with their boxes."""
    from torchvision import transforms

    from mmcse.detection.region_files import normalise_boxes
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.cache_regions import resnet_grid_source
    from mmcse.teachers.encoders import build_resnet50, crop_grid_boxes, resnet_grid_features, rgb_on_black

    root, _, _ = demo
    raw = root / "raw"
    rows = read_jsonl(raw / "images.jsonl")[:3]
    files = [raw / r["file"] for r in rows]
    torch.manual_seed(0)
    model = build_resnet50(None, "resnet50")
    grid = resnet_grid_features(files, model, batch_size=2, num_workers=0, device=torch.device("cpu"))
    assert grid.shape == (3, 49, 2048)
    preprocess = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                                     transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    with torch.inference_mode():
        pooled = model(torch.stack([preprocess(rgb_on_black(f)) for f in files])).numpy()
    np.testing.assert_allclose(grid.mean(1), pooled, rtol=1e-4, atol=1e-5)

    cfg = load_config(Path(__file__).parents[2] / "params.yaml", {"train.method": "vsepp", "regions.source": "grid",
                                      "regions.grid_model": "resnet50", "regions.grid_weights": "random",
                                      "regions.max_regions": 49, "regions.dtype": "float32"})
    source = resnet_grid_source(cfg, raw)
    assert source.describe["kind"] == "grid" and source.describe["encoder"]["model"] == "torchvision/resnet50"
    ids = [r["image_id"] for r in rows]
    store, hit = build_region_cache(tmp_path / "regions", ids, source, 49, "float32")
    assert not hit and store.dim == 2048 and store.max_regions == 49
    regions, boxes, mask = store.rows(ids)
    assert mask.all() and regions.shape == (3, 49, 2048)
    for i in range(len(rows)):
        width, height = rgb_on_black(files[i]).size
        np.testing.assert_allclose(boxes[i], normalise_boxes(crop_grid_boxes(width, height), width, height),
                                   rtol=1e-5, atol=1e-6)
    again, hit = build_region_cache(tmp_path / "regions", ids, resnet_grid_source(cfg, raw), 49, "float32")
    assert hit and again.folder == store.folder


def test_grid_source_settings_are_checked_at_load():
    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config

    with pytest.raises(ConfigError, match="regions.max_regions"):
        load_config(Path(__file__).parents[2] / "params.yaml", {"regions.source": "grid", "regions.max_regions": 36})
    with pytest.raises(ConfigError, match="regions.grid_model"):
        load_config(Path(__file__).parents[2] / "params.yaml",
                    {"regions.source": "grid", "regions.grid_model": "vgg19"})


def test_grid_weights_offline_and_unknown_are_named_with_the_setting(tmp_path, monkeypatch):
    from mmcse.experiments.params import load_config
    from mmcse.hub import ModelUnavailableError
    from mmcse.pipeline.cache_regions import resnet_grid_source

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("MMCSE_OFFLINE", "1")
    params = Path(__file__).parents[2] / "params.yaml"
    cfg = load_config(params, {"regions.source": "grid", "regions.max_regions": 49,
                               "regions.grid_weights": "IMAGENET1K_V1"})
    with pytest.raises(ModelUnavailableError, match=r"ResNet-152 weights IMAGENET1K_V1 .*regions.grid_weights"):
        resnet_grid_source(cfg, tmp_path)
    cfg = load_config(params, {"regions.source": "grid", "regions.max_regions": 49, "regions.grid_weights": "V9"})
    with pytest.raises(ModelUnavailableError, match="regions.grid_weights='V9' is neither"):
        resnet_grid_source(cfg, tmp_path)
