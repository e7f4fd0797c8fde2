"""The download stage's caption choice per image (data.captions)."""

import pytest

from mmcse.data.prepare import select_captions

PAIRS = [
    {"pair_id": f"i{i}-c{c}", "image_id": f"i{i}", "caption": "x" * (3 + (c * 7 + i) % 5)}
    for i in range(6) for c in range(4)
]


def test_all_keeps_every_caption():
    assert select_captions(PAIRS, "all", 0) == PAIRS


def test_longest_takes_the_longest_caption_of_each_image():
    chosen = select_captions(PAIRS, "longest", 0)
    assert [p["image_id"] for p in chosen] == [f"i{i}" for i in range(6)]
    for p in chosen:
        group = [q for q in PAIRS if q["image_id"] == p["image_id"]]
        assert len(p["caption"]) == max(len(q["caption"]) for q in group)
        assert p is next(q for q in group if len(q["caption"]) == len(p["caption"]))  # ties: the first


def test_random_takes_one_seeded_caption_per_image():
    a, b = select_captions(PAIRS, "random", 1), select_captions(PAIRS, "random", 1)
    assert a == b and [p["image_id"] for p in a] == [f"i{i}" for i in range(6)]
    draws = {tuple(p["pair_id"] for p in select_captions(PAIRS, "random", s)) for s in range(10)}
    assert len(draws) > 1  # the seed changes the choice
    with pytest.raises(ValueError, match="all, random, longest"):
        select_captions(PAIRS, "first", 0)


def test_download_writes_only_the_chosen_captions(tmp_path):
    from mmcse.config import DataConfig, DemoDataConfig
    from mmcse.data.prepare import prepare_data

    demo = DemoDataConfig(num_images=6, captions_per_image=3, corpus_sentences=5, sts_dev_pairs=10,
                          sts_test_pairs=10)
    everything = prepare_data(DataConfig(demo=demo), 3, tmp_path / "all")
    longest = prepare_data(DataConfig(demo=demo, captions="longest"), 3, tmp_path / "longest")
    assert everything["counts"]["pairs"] == 18 and longest["counts"]["pairs"] == 6


def test_demo_images_record_their_digest_and_size(tmp_path):
    import hashlib

    from mmcse.config import DataConfig, DemoDataConfig
    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    demo = DemoDataConfig(num_images=3, captions_per_image=1, corpus_sentences=5, sts_dev_pairs=10,
                          sts_test_pairs=10)
    prepare_data(DataConfig(demo=demo), 3, tmp_path / "raw")
    rows = read_jsonl(tmp_path / "raw/images.jsonl")
    assert len(rows) == 3
    for row in rows:
        data = (tmp_path / "raw" / row["file"]).read_bytes()
        assert row["sha256"] == hashlib.sha256(data).hexdigest() and row["bytes"] == len(data)
    assert len({r["sha256"] for r in rows}) == 3


def test_corpus_from_a_text_file_and_from_the_hub_cache(tmp_path, monkeypatch):
    from mmcse.config import ConfigError, DataConfig, parse_config
    from mmcse.data.prepare import load_corpus

    text = tmp_path / "corpus.txt"
    text.write_text("first sentence.\n\n  second one.  \nthird\n")
    assert load_corpus(DataConfig(corpus=str(text)), 0) == ["first sentence.", "second one.", "third"]
    assert load_corpus(DataConfig(corpus=str(text), corpus_limit=2), 0) == ["first sentence.", "second one."]
    with pytest.raises(ConfigError, match="data.corpus"):
        parse_config({"data": {"corpus": str(tmp_path / "missing.txt")}})
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no sentences"):
        load_corpus(DataConfig(corpus=str(tmp_path / "empty.txt")), 0)

    # wiki1m from a cache laid out as the hub client lays it out, offline
    import huggingface_hub.constants as constants

    repo, filename = DataConfig().sources.wiki1m.hub, DataConfig().sources.wiki1m.file
    commit = "f" * 40
    root = tmp_path / "hub" / f"datasets--{repo.replace('/', '--')}"
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "snapshots" / commit / filename).write_text("a wiki sentence.\nanother one.\n")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_corpus(DataConfig(corpus="wiki1m"), 0, tmp_path / "downloads") == ["a wiki sentence.", "another one."]


def test_download_copies_the_chosen_transfer_tasks(tmp_path, transfer_dir):
    from mmcse.config import DataConfig, DemoDataConfig
    from mmcse.data.prepare import prepare_data
    from mmcse.data.senteval import TransferExample
    from mmcse.io import read_jsonl

    demo = DemoDataConfig(num_images=6, captions_per_image=1, corpus_sentences=5)
    cfg = DataConfig(source="senteval", senteval_dir=str(transfer_dir), transfer_tasks=["TREC", "MRPC"], demo=demo)
    manifest = prepare_data(cfg, 3, tmp_path / "raw")
    assert manifest["counts"]["transfer_TREC"] == 5452 + 500 and manifest["counts"]["transfer_MRPC"] == 4076 + 1725
    assert sorted(p.name for p in (tmp_path / "raw" / "transfer").iterdir()) == ["MRPC.jsonl", "TREC.jsonl"]
    assert {"transfer/TREC.jsonl", "transfer/MRPC.jsonl"} <= set(manifest["sha256"])
    rows = [TransferExample.from_row(r) for r in read_jsonl(tmp_path / "raw" / "transfer" / "MRPC.jsonl")]
    assert rows[0].text.startswith("Amrozi accused") and rows[0].text2.startswith("Referring to him")


def test_download_fails_before_building_when_a_transfer_task_is_missing(tmp_path, transfer_dir):
    import shutil

    from mmcse.config import DataConfig
    from mmcse.data.prepare import prepare_data

    shutil.copytree(transfer_dir / "downstream" / "STS" / "STSBenchmark",
                    tmp_path / "se" / "downstream" / "STS" / "STSBenchmark")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "keep.txt").write_text("previous data")
    cfg = DataConfig(source="senteval", senteval_dir=str(tmp_path / "se"), transfer_tasks=["SUBJ"])
    with pytest.raises(FileNotFoundError, match=r"data.transfer_tasks names SUBJ.*present: none"):
        prepare_data(cfg, 3, tmp_path / "raw")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".raw")] == []  # nothing half-built
    assert (tmp_path / "raw" / "keep.txt").read_text() == "previous data"


# --------------------------------------------------------------------------- the retrieval validation set

def _small_demo(**demo):
    from mmcse.config import DataConfig, DemoDataConfig

    return DataConfig(demo=DemoDataConfig(**{"num_images": 6, "captions_per_image": 2, "corpus_sentences": 5,
                                             "sts_dev_pairs": 10, "sts_test_pairs": 10, "retrieval_images": 10,
                                             "retrieval_val_images": 10, **demo}))


def test_demo_val_scenes_are_their_own_set_with_every_caption(tmp_path):
    import hashlib

    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_json, read_jsonl

    raw = tmp_path / "raw"
    manifest = prepare_data(_small_demo(), 3, raw)
    train, test = read_jsonl(raw / "images.jsonl"), read_jsonl(raw / "retrieval/images.jsonl")
    val, captions = read_jsonl(raw / "retrieval/val_images.jsonl"), read_jsonl(raw / "retrieval/val_captions.jsonl")
    assert [r["image_id"] for r in val] == [f"val{i:05d}" for i in range(10)]
    # other ids and other pictures than training's and the test set's
    assert not {r["image_id"] for r in val} & {r["image_id"] for r in train + test}
    assert not {r["sha256"] for r in val} & {r["sha256"] for r in train + test}
    for row in val:  # image rows as the test set's: file, digest, mask and annotated objects
        data = (raw / row["file"]).read_bytes()
        assert row["sha256"] == hashlib.sha256(data).hexdigest() and row["bytes"] == len(data)
        assert (raw / row["mask"]).is_file() and len(row["objects"]) >= 2
        assert all(len(o["box"]) == 4 for o in row["objects"])
        assert set(row) == set(test[0])
    # every caption of exactly the val images (captions_per_image each)
    assert [c["image_id"] for c in captions] == [r["image_id"] for r in val for _ in range(2)]
    assert all(set(c) == {"image_id", "caption"} and c["caption"].strip() for c in captions)
    # manifest: digests of both tables, counts, the set's name
    for name in ("retrieval/val_images.jsonl", "retrieval/val_captions.jsonl"):
        assert manifest["sha256"][name] == hashlib.sha256((raw / name).read_bytes()).hexdigest()
    assert manifest["counts"]["retrieval_val_images"] == 10 and manifest["counts"]["retrieval_val_captions"] == 20
    assert manifest["retrieval_val_set"] == "demo_val" and read_json(raw / "manifest.json") == manifest


def test_demo_val_scenes_are_deterministic_and_change_no_other_scene(tmp_path):
    from mmcse.data.prepare import prepare_data

    a = prepare_data(_small_demo(), 3, tmp_path / "a")
    b = prepare_data(_small_demo(), 3, tmp_path / "b")
    c = prepare_data(_small_demo(), 4, tmp_path / "c")
    more = prepare_data(_small_demo(retrieval_val_images=12), 3, tmp_path / "more")
    val = "retrieval/val_images.jsonl"
    assert a["sha256"] == b["sha256"]
    assert (tmp_path / "a/images/val00004.png").read_bytes() == (tmp_path / "b/images/val00004.png").read_bytes()
    assert a["sha256"][val] != c["sha256"][val]  # the seed draws other scenes
    # their own random stream: more val scenes leave training and test scenes (and the first val ones) as they were
    for name in ("images.jsonl", "pairs.jsonl", "retrieval/images.jsonl", "retrieval/captions.jsonl"):
        assert more["sha256"][name] == a["sha256"][name]
    assert more["counts"]["retrieval_val_images"] == 12
    assert (tmp_path / "more/images/val00009.png").read_bytes() == (tmp_path / "a/images/val00009.png").read_bytes()


def test_no_pairs_no_val_set(tmp_path):
    import dataclasses

    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    manifest = prepare_data(dataclasses.replace(_small_demo(), pairs="none"), 3, tmp_path / "raw")
    assert read_jsonl(tmp_path / "raw/retrieval/val_images.jsonl") == []
    assert read_jsonl(tmp_path / "raw/retrieval/val_captions.jsonl") == []
    assert manifest["retrieval_val_set"] is None and manifest["counts"]["retrieval_val_images"] == 0
    assert "retrieval/val_images.jsonl" in manifest["sha256"]


def _karpathy_folder(tmp_path):
    """A local Karpathy caption_datasets.zip and a Flickr30k image zip: 2 train, 4 val (one of
    them not in the image archive), 1 test image; coco: one val image from val2014."""
    import io
    import json

    from PIL import Image

    from tests.data.served import make_zip

    def jpeg(shade: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (20, 16), (shade, 10, 10)).save(buf, format="JPEG")
        return buf.getvalue()

    def entry(filename, split, captions, **extra):
        return {"filename": filename, "split": split, "sentences": [{"raw": c} for c in captions], **extra}

    flickr = [entry("1.jpg", "train", ["A train image ."]), entry("2.jpg", "val", ["Val two .", "Val  two again ."]),
              entry("3.jpg", "train", ["Another train image ."]), entry("4.jpg", "val", ["Val four ."]),
              entry("5.jpg", "test", ["A test image ."]), entry("6.jpg", "val", ["Not in the archive ."]),
              entry("7.jpg", "val", ["Val seven ."])]
    coco = [entry("COCO_train2014_000000000009.jpg", "train", ["Food ."], filepath="train2014", cocoid=9),
            entry("COCO_val2014_000000000042.jpg", "val", ["A val bus ."], filepath="val2014", cocoid=42),
            entry("COCO_val2014_000000000073.jpg", "test", ["A test bus ."], filepath="val2014", cocoid=73)]
    folder = tmp_path / "sources"
    folder.mkdir()
    (folder / "caption_datasets.zip").write_bytes(make_zip({
        "dataset_flickr30k.json": json.dumps({"images": flickr}).encode(),
        "dataset_coco.json": json.dumps({"images": coco}).encode()}))
    (folder / "flickr30k-images.zip").write_bytes(make_zip(
        {f"flickr30k-images/{k}.jpg": jpeg(20 * k) for k in (1, 2, 3, 4, 5, 7)}))
    (folder / "train2014.zip").write_bytes(make_zip({"train2014/COCO_train2014_000000000009.jpg": jpeg(1)}))
    (folder / "val2014.zip").write_bytes(make_zip({"val2014/COCO_val2014_000000000042.jpg": jpeg(2),
                                                   "val2014/COCO_val2014_000000000073.jpg": jpeg(3)}))
    return folder


def _real(folder, **data):
    from mmcse.config import parse_config

    sources = {name: {"path": str(folder / f"{file}.zip")} for name, file in (
        ("karpathy_splits", "caption_datasets"), ("flickr30k_images", "flickr30k-images"),
        ("coco_train2014", "train2014"), ("coco_val2014", "val2014"))}
    return parse_config({"data": {"sources": sources, "demo": {"corpus_sentences": 5, "sts_dev_pairs": 10,
                                                               "sts_test_pairs": 10}, **data}}).data


def test_real_val_split_is_the_val_set_cut_to_val_images(tmp_path):
    import hashlib

    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    folder, dl = _karpathy_folder(tmp_path), tmp_path / "dl"
    raw = tmp_path / "raw"
    manifest = prepare_data(_real(folder, pairs="flickr30k", val_images=2), 0, raw, dl)
    val = read_jsonl(raw / "retrieval/val_images.jsonl")
    assert [r["image_id"] for r in val] == ["flickr30k-2", "flickr30k-4"]  # the first two of Karpathy's val split
    assert [r["split"] for r in val] == ["val", "val"] and "objects" not in val[0]
    for row in val:
        data = (raw / row["file"]).read_bytes()
        assert row["sha256"] == hashlib.sha256(data).hexdigest() and row["bytes"] == len(data)
    assert read_jsonl(raw / "retrieval/val_captions.jsonl") == [
        {"image_id": "flickr30k-2", "caption": "Val two ."}, {"image_id": "flickr30k-2", "caption": "Val two again ."},
        {"image_id": "flickr30k-4", "caption": "Val four ."}]
    # training and test tables are untouched by it
    assert [r["image_id"] for r in read_jsonl(raw / "images.jsonl")] == ["flickr30k-1", "flickr30k-3"]
    assert [r["image_id"] for r in read_jsonl(raw / "retrieval/images.jsonl")] == ["flickr30k-5"]
    assert manifest["retrieval_val_set"] == "flickr30k_val" and manifest["retrieval_set"] == "flickr30k_1k"
    assert manifest["counts"]["retrieval_val_images"] == 2 and manifest["counts"]["retrieval_val_captions"] == 3
    assert manifest["counts"]["retrieval_val_images_missing"] == 0
    assert manifest["sha256"]["retrieval/val_captions.jsonl"] == hashlib.sha256(
        (raw / "retrieval/val_captions.jsonl").read_bytes()).hexdigest()

    # 0: every val image; one the archive lacks is dropped and counted
    every = prepare_data(_real(folder, pairs="flickr30k", val_images=0), 0, tmp_path / "all", dl)
    assert [r["image_id"] for r in read_jsonl(tmp_path / "all/retrieval/val_images.jsonl")] == [
        "flickr30k-2", "flickr30k-4", "flickr30k-7"]
    assert every["counts"]["retrieval_val_images_missing"] == 1 and every["counts"]["retrieval_val_images"] == 3

    coco = prepare_data(_real(folder, pairs="coco"), 0, tmp_path / "coco", dl)
    assert [r["image_id"] for r in read_jsonl(tmp_path / "coco/retrieval/val_images.jsonl")] == ["coco-42"]
    assert coco["retrieval_val_set"] == "coco_val"


def test_training_on_val_leaves_no_val_set(tmp_path):
    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    folder = _karpathy_folder(tmp_path)
    manifest = prepare_data(_real(folder, pairs="flickr30k", splits=["train", "val"]), 0, tmp_path / "raw",
                            tmp_path / "dl")
    assert "flickr30k-2" in {r["image_id"] for r in read_jsonl(tmp_path / "raw/images.jsonl")}  # val trains
    assert read_jsonl(tmp_path / "raw/retrieval/val_images.jsonl") == []
    assert read_jsonl(tmp_path / "raw/retrieval/val_captions.jsonl") == []
    assert manifest["retrieval_val_set"] is None and manifest["counts"]["retrieval_val_images"] == 0
    assert manifest["retrieval_set"] == "flickr30k_1k"  # the test set is written as always


def test_val_keys_are_validated_and_fixed():
    from mmcse.config import ConfigError, DataConfig, is_fixed, parse_config

    assert DataConfig().val_images == 1000 and DataConfig().demo.retrieval_val_images == 50
    assert parse_config({"data": {"val_images": 0}}).data.val_images == 0
    with pytest.raises(ConfigError, match="data.val_images"):
        parse_config({"data": {"val_images": -1}})
    with pytest.raises(ConfigError, match="data.demo.retrieval_val_images"):
        parse_config({"data": {"demo": {"retrieval_val_images": 9}}})
    assert is_fixed("data.val_images") and is_fixed("data.demo.retrieval_val_images")


def test_the_retrieval_test_set_of_another_data_set(tmp_path):
    """DALR Table 4: a wiki+coco model scored on the Flickr30k test split (data.retrieval_test)."""
    from mmcse.config import ConfigError, parse_config
    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    folder, dl = _karpathy_folder(tmp_path), tmp_path / "dl"
    manifest = prepare_data(_real(folder, pairs="coco", retrieval_test="flickr30k"), 0, tmp_path / "raw", dl)
    raw = tmp_path / "raw"
    assert [r["image_id"] for r in read_jsonl(raw / "images.jsonl")] == ["coco-9"]  # coco trains
    assert [r["image_id"] for r in read_jsonl(raw / "retrieval/images.jsonl")] == ["flickr30k-5"]
    assert read_jsonl(raw / "retrieval/captions.jsonl") == [{"image_id": "flickr30k-5", "caption": "A test image ."}]
    assert manifest["retrieval_set"] == "flickr30k_1k" and manifest["retrieval_val_set"] == "coco_val"
    assert "flickr30k_images" in manifest["sources"]
    # Karpathy's test captions of both data sets, from the caption file alone: what a figure may encode
    assert read_jsonl(raw / "test_captions/coco.jsonl") == [{"image_id": "coco-73", "caption": "A test bus ."}]
    assert read_jsonl(raw / "test_captions/flickr30k.jsonl") == [
        {"image_id": "flickr30k-5", "caption": "A test image ."}]
    assert manifest["counts"]["test_captions_coco"] == 1 and "test_captions/coco.jsonl" in manifest["sha256"]
    same = prepare_data(_real(folder, pairs="coco"), 0, tmp_path / "same", dl)
    assert same["retrieval_set"] == "coco_5k"
    assert [r["image_id"] for r in read_jsonl(tmp_path / "same/retrieval/images.jsonl")] == ["coco-73"]
    with pytest.raises(ConfigError, match="data.retrieval_test.*demo world.*use same"):
        parse_config({"data": {"pairs": "demo", "retrieval_test": "coco"}})
    with pytest.raises(ConfigError, match="retrieval_test"):
        parse_config({"data": {"pairs": "coco", "retrieval_test": "demo"}})


def _cc12m_folder(tmp_path):
    """Two webdataset shards laid out like pixparse/cc12m-wds: 4 + 3 samples, one without its
    caption (shard 0) and one unreadable image (shard 1)."""
    import io
    import tarfile

    from PIL import Image

    def jpeg(shade: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (12, 10), (shade, 30, 90)).save(buf, format="JPEG")
        return buf.getvalue()

    def shard(path, samples):
        with tarfile.open(path, "w") as tar:
            for name, data in samples.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    folder = tmp_path / "cc12m"
    folder.mkdir()
    shard(folder / "cc12m-train-0000.tar", {
        "000000000.jpg": jpeg(10), "000000000.txt": b"a red  kite over the sea",
        "000000001.jpg": jpeg(20), "000000001.txt": b"two dogs",
        "000000002.jpg": jpeg(30),  # no caption
        "000000003.jpg": jpeg(40), "000000003.txt": b"a bowl of soup"})
    shard(folder / "cc12m-train-0001.tar", {
        "000010000.jpg": jpeg(50), "000010000.txt": b"a train at night",
        "000010001.jpg": b"not a jpeg", "000010001.txt": b"broken",
        "000010002.jpg": jpeg(70), "000010002.txt": b"a small boat"})
    return folder


def test_cc12m_subsets_are_disjoint_blocks_of_readable_captioned_samples(tmp_path):
    """KDMCSE Table 4: subset k of N pairs = the k-th block of N usable samples in shard order."""
    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    folder, dl = _cc12m_folder(tmp_path), tmp_path / "dl"
    data = {"pairs": "cc12m", "image_limit": 2, "sources": {"cc12m": {"path": str(folder)}}}
    one = prepare_data(_real(tmp_path, **{**data, "cc12m_subset": 1}), 0, tmp_path / "one", dl)
    two = prepare_data(_real(tmp_path, **{**data, "cc12m_subset": 2}), 0, tmp_path / "two", dl)
    pairs1, pairs2 = read_jsonl(tmp_path / "one/pairs.jsonl"), read_jsonl(tmp_path / "two/pairs.jsonl")
    assert [p["caption"] for p in pairs1] == ["a red kite over the sea", "two dogs"]  # whitespace folded
    assert [p["caption"] for p in pairs2] == ["a bowl of soup", "a train at night"]  # across the shard boundary
    assert [p["image_id"] for p in pairs2] == ["cc12m-000000003", "cc12m-000010000"]
    rows = read_jsonl(tmp_path / "two/images.jsonl")
    assert (tmp_path / "two" / rows[1]["file"]).read_bytes()[:2] == b"\xff\xd8"
    assert one["counts"]["captions_missing"] == 0 and two["counts"]["captions_missing"] == 1  # met on the way
    assert one["retrieval_set"] is None and one["retrieval_val_set"] is None  # CC12M has no test or val split
    assert two["counts"]["images"] == 2 and set(two["sources"]) == {"cc12m/cc12m-train-0000", "cc12m/cc12m-train-0001"}
    three = prepare_data(_real(tmp_path, **{**data, "cc12m_subset": 4, "image_limit": 1}), 0, tmp_path / "three", dl)
    assert [p["caption"] for p in read_jsonl(tmp_path / "three/pairs.jsonl")] == ["a train at night"]
    assert three["counts"]["images_unreadable"] == 0  # never reached: the subset was full before it
    with pytest.raises(ValueError, match="subset 2 of 3 pairs needs 6 samples, the shards hold 5"):
        prepare_data(_real(tmp_path, **{**data, "cc12m_subset": 2, "image_limit": 3}), 0, tmp_path / "four", dl)


def test_cc12m_shards_come_from_a_url_pattern_and_keys_are_checked(tmp_path, server):
    from mmcse.config import ConfigError, parse_config
    from mmcse.data.fetch import DownloadError
    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    files, url = server
    for shard in _cc12m_folder(tmp_path).glob("*.tar"):
        (files / shard.name).write_bytes(shard.read_bytes())
    sources = {"cc12m": {"url": f"{url}/cc12m-train-{{shard:04d}}.tar"}}
    manifest = prepare_data(_real(tmp_path, pairs="cc12m", image_limit=4, sources=sources), 0, tmp_path / "raw",
                            tmp_path / "dl")
    assert [p["caption"] for p in read_jsonl(tmp_path / "raw/pairs.jsonl")][-1] == "a train at night"
    assert manifest["sources"]["cc12m/cc12m-train-0001"]["origin"].endswith("/cc12m-train-0001.tar")
    with pytest.raises(DownloadError, match=r"cc12m-train-0002.tar: HTTP 404.*shards 0-1 hold too few"):
        prepare_data(_real(tmp_path, pairs="cc12m", image_limit=6, sources=sources), 0, tmp_path / "more",
                     tmp_path / "dl")
    with pytest.raises(ConfigError, match=r"data.sources.cc12m.url.*\{shard\}"):
        parse_config({"data": {"sources": {"cc12m": {"url": f"{url}/one.tar"}}}})
    with pytest.raises(ConfigError, match="data.image_limit.*remote"):
        parse_config({"data": {"pairs": "cc12m"}})
    with pytest.raises(ConfigError, match="data.splits.*one split"):
        parse_config({"data": {"pairs": "cc12m", "image_limit": 5, "splits": ["train", "restval"]}})
    with pytest.raises(ConfigError, match="cc12m has no val split"):
        parse_config({"data": {"pairs": "cc12m", "image_limit": 5}, "train": {"method": "duet"}})


def test_a_karpathy_archive_with_one_data_set_writes_that_ones_test_captions(tmp_path):
    """A local caption archive holding dataset_flickr30k.json alone: its test captions are written, COCO's
    are left out (a figure asking for them names the missing file)."""
    import json
    import zipfile

    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl
    from tests.data.served import make_zip

    folder = _karpathy_folder(tmp_path)
    with zipfile.ZipFile(folder / "caption_datasets.zip") as archive:
        flickr = archive.read("dataset_flickr30k.json")
    (folder / "caption_datasets.zip").write_bytes(make_zip({"dataset_flickr30k.json": flickr}))
    manifest = prepare_data(_real(folder, pairs="flickr30k"), 0, tmp_path / "raw", tmp_path / "dl")
    assert read_jsonl(tmp_path / "raw/test_captions/flickr30k.jsonl") == [
        {"image_id": "flickr30k-5", "caption": "A test image ."}]
    assert not (tmp_path / "raw/test_captions/coco.jsonl").exists() and "test_captions_coco" not in manifest["counts"]
    assert json.loads(flickr)["images"][4]["split"] == "test"


def test_flickr30k_entities_split_trains_validates_and_tests_on_its_own_lists_with_its_sentences(tmp_path):
    """data.flickr_split: entities (KDMCSE / MCSE / MCSEO: 29,783 training images): the split lists decide
    which image trains, validates and tests, and each image's captions are its Sentences file's, the phrase
    markup removed; a listed image without a Sentences file is skipped and counted."""
    from mmcse.config import ConfigError, parse_config
    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl
    from tests.data.served import make_zip

    folder, dl = _karpathy_folder(tmp_path), tmp_path / "dl"
    sentences = {1: "[/EN#1/people A man] rides .\n[/EN#2/animals A horse] runs  fast .\n", 3: "Three .\n",
                 2: "Two on [/EN#4/scene grass] .\n", 4: "Four .\n", 5: "Five .\n", 7: "Seven .\n"}
    (folder / "annotations.zip").write_bytes(make_zip(
        {f"annotations/Sentences/{k}.txt": v.encode() for k, v in sentences.items()}))
    lists = {"train": "1\n3\n9\n", "val": "2\n4\n", "test": "7\n5\n"}  # 9: no Sentences file
    for split, text in lists.items():
        (folder / f"{split}.txt").write_text(text)
    data = _real(folder, pairs="flickr30k", flickr_split="entities", val_images=0)
    sources = {"flickr30k_entities": {"path": str(folder / "annotations.zip")},
               **{f"entities_{s}": {"path": str(folder / f"{s}.txt")} for s in lists}}
    data = parse_config({"data": {**_as_raw(data), "sources": {**_as_raw(data)["sources"], **sources}}}).data
    manifest = prepare_data(data, 0, tmp_path / "raw", dl)
    raw = tmp_path / "raw"
    assert [r["image_id"] for r in read_jsonl(raw / "images.jsonl")] == ["flickr30k-1", "flickr30k-3"]
    assert [p["caption"] for p in read_jsonl(raw / "pairs.jsonl")] == ["A man rides .", "A horse runs fast .",
                                                                      "Three ."]
    assert [r["image_id"] for r in read_jsonl(raw / "retrieval/val_images.jsonl")] == ["flickr30k-2", "flickr30k-4"]
    # Karpathy's test image 5 and his val image 7 are Entities' test split, in its list's order
    assert [r["image_id"] for r in read_jsonl(raw / "retrieval/images.jsonl")] == ["flickr30k-7", "flickr30k-5"]
    assert read_jsonl(raw / "retrieval/captions.jsonl")[0] == {"image_id": "flickr30k-7", "caption": "Seven ."}
    assert manifest["counts"]["captions_missing"] == 1
    assert {"entities_train", "entities_val", "entities_test", "flickr30k_entities"} <= set(manifest["sources"])
    # a damaged list names its file and line; restval is no split of Entities'
    (folder / "val.txt").write_text("2\nflickr30k-4\n")
    with pytest.raises(ValueError, match=r"val.txt:2: not a Flickr30k image id: 'flickr30k-4'"):
        prepare_data(data, 0, tmp_path / "again", dl)
    with pytest.raises(ConfigError, match="data.splits.*no restval"):
        parse_config({"data": {"pairs": "flickr30k", "flickr_split": "entities", "splits": ["train", "restval"]}})


def _as_raw(data) -> dict:
    from mmcse.config import to_dict

    return to_dict(data)


def test_the_declared_entities_lists_are_the_published_files():
    """The split lists' digests are declared (29,783 / 1,000 / 1,000 ids), as every fetched source's should be."""
    from mmcse.config import DataConfig

    s = DataConfig().sources
    for spec in (s.entities_train, s.entities_val, s.entities_test):
        assert spec.url.startswith("https://github.com/BryanPlummer/flickr30k_entities/raw/") and len(spec.sha256) == 64
