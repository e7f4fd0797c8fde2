"""The download stage's real sources (Flickr30k, COCO 2014 with Karpathy's splits, Flickr30k
Entities, SentEval), fetched from a 127.0.0.1 server serving archives laid out like the real
ones, built here; the hub path from a hub-layout cache, offline."""

from __future__ import annotations

import hashlib
import io
import json
import shutil

import pytest
from PIL import Image

from mmcse.config import ConfigError, DataConfig, parse_config
from mmcse.data import sources
from mmcse.data.fetch import DownloadError
from mmcse.data.prepare import prepare_data
from mmcse.data.sources import parse_entities_boxes, parse_entities_sentence
from mmcse.io import read_json, read_jsonl
from tests.data.served import RangeHandler, make_zip, tar_gz


def _jpeg(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="JPEG")
    return buf.getvalue()


def _karpathy_entry(filename: str, split: str, captions: list[str], **extra) -> dict:
    return {"filename": filename, "split": split, "sentences": [{"raw": c, "tokens": c.split()} for c in captions],
            **extra}


FLICKR = [  # (stem, split, captions)
    ("1000", "train", ["A man  in a red hat walks a dog .", "Man walking.", "A dog and a man outside ."]),
    ("1001", "train", ["Two girls play on grass .", "Children playing in a park with a ball ."]),
    ("1002", "val", ["A val image ."]),
    ("1003", "train", ["This one is truncated ."]),
    ("1004", "train", ["This one is not in the archive ."]),
    ("1005", "test", ["A test image ."]),
]
ENTITIES_SENTENCES = {
    "1000": "[/EN#1/people A man] in [/EN#2/clothing a red hat] walks [/EN#3/animals a dog] .\n"
            "[/EN#1/people Man] walking in [/EN#9/scene the park] .\n",
    "1001": "[/EN#5/people Two girls] play on [/EN#6/scene grass] .\n",
}
ENTITIES_XML = {
    "1000": """<annotation><filename>1000.jpg</filename>
      <object><name>1</name><bndbox><xmin>2</xmin><ymin>3</ymin><xmax>10</xmax><ymax>20</ymax></bndbox></object>
      <object><name>1</name><bndbox><xmin>5</xmin><ymin>1</ymin><xmax>12</xmax><ymax>15</ymax></bndbox></object>
      <object><name>2</name><name>3</name>
        <bndbox><xmin>20</xmin><ymin>4</ymin><xmax>30</xmax><ymax>9</ymax></bndbox></object>
      <object><name>9</name><nobndbox>1</nobndbox><scene>1</scene></object></annotation>""",
    "1001": """<annotation><object><name>5</name>
      <bndbox><xmin>0</xmin><ymin>0</ymin><xmax>7</xmax><ymax>7</ymax></bndbox></object></annotation>""",
}


@pytest.fixture
def archives(server):
    """Karpathy's caption_datasets.zip, a Flickr30k image zip, COCO train/val zips and the
    Flickr30k Entities zip on the local server; returns (folder, url, sha256 per file)."""
    files, url = server
    flickr = [_karpathy_entry(f"{stem}.jpg", split, caps) for stem, split, caps in FLICKR]
    coco = [
        _karpathy_entry("COCO_train2014_000000000009.jpg", "train", ["A plate of food ."], filepath="train2014",
                        cocoid=9),
        _karpathy_entry("COCO_val2014_000000000042.jpg", "restval", ["A bus on a street ."], filepath="val2014",
                        cocoid=42),
        _karpathy_entry("COCO_val2014_000000000073.jpg", "test", ["A test bus ."], filepath="val2014", cocoid=73),
    ]
    blobs = {
        "caption_datasets.zip": make_zip({
            "dataset_flickr30k.json": json.dumps({"images": flickr, "dataset": "flickr30k"}).encode(),
            "dataset_coco.json": json.dumps({"images": coco, "dataset": "coco"}).encode(),
        }),
        "flickr30k-images.zip": make_zip({
            "flickr30k-images/1000.jpg": _jpeg((200, 10, 10), (40, 30)),
            "flickr30k-images/1001.jpg": _jpeg((10, 200, 10), (32, 48)),
            "flickr30k-images/1002.jpg": _jpeg((10, 10, 200), (20, 20)),
            "flickr30k-images/1003.jpg": _jpeg((90, 90, 90), (64, 64))[:300],  # truncated JPEG
            "flickr30k-images/1005.jpg": _jpeg((0, 0, 0), (20, 20)),
        }),
        "train2014.zip": make_zip({"train2014/COCO_train2014_000000000009.jpg": _jpeg((1, 2, 3), (24, 24))}),
        "val2014.zip": make_zip({
            "val2014/COCO_val2014_000000000042.jpg": _jpeg((4, 5, 6), (24, 16)),
            "val2014/COCO_val2014_000000000073.jpg": _jpeg((7, 8, 9), (16, 24)),
        }),
        "annotations.zip": make_zip({
            **{f"annotations/Sentences/{k}.txt": v.encode() for k, v in ENTITIES_SENTENCES.items()},
            **{f"annotations/Annotations/{k}.xml": v.encode() for k, v in ENTITIES_XML.items()},
        }),
    }
    for name, blob in blobs.items():
        (files / name).write_bytes(blob)
    return files, url, {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}


def _config(url: str, **data) -> DataConfig:
    """The repo's data section with every source pointed at the local server."""
    raw = {
        "sources": {
            "karpathy_splits": {"url": f"{url}/caption_datasets.zip"},
            "flickr30k_images": {"url": f"{url}/flickr30k-images.zip"},
            "coco_train2014": {"url": f"{url}/train2014.zip"},
            "coco_val2014": {"url": f"{url}/val2014.zip"},
            "flickr30k_entities": {"url": f"{url}/annotations.zip"},
        },
        "demo": {"corpus_sentences": 5, "sts_dev_pairs": 10, "sts_test_pairs": 10},
        **data,
    }
    return parse_config({"data": raw}).data


def test_flickr30k_pairs_images_and_manifest(archives, tmp_path, monkeypatch):
    files, url, digests = archives
    manifest = prepare_data(_config(url, pairs="flickr30k"), 0, tmp_path / "raw", tmp_path / "dl")
    raw = tmp_path / "raw"
    images = read_jsonl(raw / "images.jsonl")
    pairs = read_jsonl(raw / "pairs.jsonl")
    # train split only; 1003 (truncated) and 1004 (not in the archive) dropped and counted
    assert [r["image_id"] for r in images] == ["flickr30k-1000", "flickr30k-1001"]
    assert manifest["counts"]["images_unreadable"] == 1 and manifest["counts"]["images_missing"] == 1
    assert manifest["counts"]["images"] == 2 and manifest["counts"]["pairs"] == 5
    # Karpathy's test split is the retrieval test set, every caption of it, whatever trains
    assert [r["image_id"] for r in read_jsonl(raw / "retrieval/images.jsonl")] == ["flickr30k-1005"]
    assert read_jsonl(raw / "retrieval/captions.jsonl") == [{"image_id": "flickr30k-1005", "caption": "A test image ."}]
    assert manifest["retrieval_set"] == "flickr30k_1k"
    assert [p["caption"] for p in pairs][:2] == ["A man in a red hat walks a dog .", "Man walking."]
    assert all(p["phrases"] == [] for p in pairs) and manifest["counts"]["pairs_with_phrases"] == 0
    with Image.open(raw / images[1]["file"]) as img:
        assert img.size == (32, 48) and images[1]["split"] == "train"
    # each image's digest and size (the teacher-cache fingerprints see image bytes through them)
    for row in images:
        data = (raw / row["file"]).read_bytes()
        assert row["sha256"] == hashlib.sha256(data).hexdigest() and row["bytes"] == len(data)
    # the manifest records each archive's origin and digest, and digests of the tables
    assert manifest["sources"]["karpathy_splits"]["sha256"] == digests["caption_datasets.zip"]
    assert manifest["sources"]["flickr30k_images"]["sha256"] == digests["flickr30k-images.zip"]
    assert manifest["sources"]["flickr30k_images"]["origin"] == f"{url}/flickr30k-images.zip"
    assert read_json(raw / "manifest.json") == manifest
    assert manifest["sha256"]["pairs.jsonl"] == hashlib.sha256((raw / "pairs.jsonl").read_bytes()).hexdigest()

    # a rerun asks the server nothing and decodes no image (archives verified and extracted
    # once, each image's verdict remembered) and writes the same data
    RangeHandler.requests.clear()
    with monkeypatch.context() as patch:
        patch.setattr(sources, "_readable", lambda path: pytest.fail(f"{path} decoded again"))
        patch.setattr(sources, "_file_record", lambda path: pytest.fail(f"{path} hashed again"))
        again = prepare_data(_config(url, pairs="flickr30k"), 0, tmp_path / "raw", tmp_path / "dl")
    assert RangeHandler.requests == [] and again == manifest

    # the caption choice applies to real pairs too; more splits, a limit
    longest = prepare_data(_config(url, pairs="flickr30k", captions="longest"), 0, tmp_path / "l", tmp_path / "dl")
    assert [p["caption"] for p in read_jsonl(tmp_path / "l/pairs.jsonl")] == [
        "A man in a red hat walks a dog .", "Children playing in a park with a ball ."]
    assert longest["counts"]["pairs"] == 2
    some = prepare_data(_config(url, pairs="flickr30k", splits=["val"], image_limit=1), 0,
                        tmp_path / "v", tmp_path / "dl")
    assert [r["image_id"] for r in read_jsonl(tmp_path / "v/images.jsonl")] == ["flickr30k-1002"]
    assert some["splits"] == ["val"]


def test_coco_train_and_restval_come_from_both_archives(archives, tmp_path):
    _, url, digests = archives
    manifest = prepare_data(_config(url, pairs="coco", splits=["train", "restval"]), 0, tmp_path / "raw",
                            tmp_path / "dl")
    images = read_jsonl(tmp_path / "raw/images.jsonl")
    assert [(r["image_id"], r["split"]) for r in images] == [("coco-9", "train"), ("coco-42", "restval")]
    assert images[1]["file"] == "images/coco/val2014/COCO_val2014_000000000042.jpg"
    assert (tmp_path / "raw" / images[0]["file"]).is_file()
    assert manifest["sources"]["coco_train2014"]["sha256"] == digests["train2014.zip"]
    assert manifest["sources"]["coco_val2014"]["sha256"] == digests["val2014.zip"]
    assert "flickr30k_images" not in manifest["sources"]
    assert [r["image_id"] for r in read_jsonl(tmp_path / "raw/retrieval/images.jsonl")] == ["coco-73"]
    assert manifest["retrieval_set"] == "coco_5k"


def test_flickr30k_entities_give_phrase_spans_and_boxes(archives, tmp_path):
    _, url, _ = archives
    manifest = prepare_data(_config(url, pairs="flickr30k", annotations="flickr30k_entities"), 0, tmp_path / "raw",
                            tmp_path / "dl")
    images = {r["image_id"]: r for r in read_jsonl(tmp_path / "raw/images.jsonl")}
    pairs = read_jsonl(tmp_path / "raw/pairs.jsonl")
    # entity 1 has two boxes (union), 2 and 3 share one, 9 has none (scene): exclusive pixel boxes
    assert images["flickr30k-1000"]["objects"] == [
        {"entity": "1", "box": [2, 1, 13, 21]}, {"entity": "2", "box": [20, 4, 31, 10]},
        {"entity": "3", "box": [20, 4, 31, 10]}]
    first = pairs[0]
    assert first["caption"] == "A man in a red hat walks a dog ."
    assert [first["caption"][p["start"]:p["end"]] for p in first["phrases"]] == ["A man", "a red hat", "a dog"]
    assert [p["object"] for p in first["phrases"]] == [0, 1, 2]
    second = pairs[1]  # "the park" has no box: not an object phrase
    assert second["caption"] == "Man walking in the park ." and len(second["phrases"]) == 1
    assert manifest["counts"]["pairs_with_phrases"] == 3 and manifest["counts"]["pairs"] == 3


def test_entities_markup_and_xml_parsers(tmp_path):
    got = parse_entities_sentence("[/EN#18/people A man] with [/EN#20/bodyparts pierced ears] .")
    assert got.text == "A man with pierced ears ."
    assert [(e, got.text[a:b]) for e, a, b in got.phrases] == [("18", "A man"), ("20", "pierced ears")]
    with pytest.raises(ValueError, match="malformed"):
        parse_entities_sentence("[/EN#18/people A man with no end")
    (tmp_path / "a.xml").write_text(ENTITIES_XML["1001"])
    assert parse_entities_boxes(tmp_path / "a.xml") == {"5": [0, 0, 8, 8]}


@pytest.mark.parametrize("bad", ["corrupt", "truncated", "escaping"])
def test_a_bad_archive_fails_clearly_and_leaves_the_previous_data(archives, tmp_path, bad):
    files, url, _ = archives
    cfg = _config(url, pairs="flickr30k")
    before = prepare_data(_config(url), 0, tmp_path / "raw", tmp_path / "dl")  # an earlier demo download
    good = (files / "flickr30k-images.zip").read_bytes()
    blob = {"corrupt": b"PK\x03\x04" + b"\x00garbage" * 50, "truncated": good[: len(good) // 2],
            "escaping": make_zip({"flickr30k-images/1000.jpg": good[:10], "../../evil.txt": b"pwned"})}[bad]
    (files / "flickr30k-images.zip").write_bytes(blob)
    message = {"corrupt": "not a complete zip or tar", "truncated": "not a complete zip or tar",
               "escaping": "would be written outside"}[bad]
    with pytest.raises(DownloadError, match=message):
        prepare_data(cfg, 0, tmp_path / "raw", tmp_path / "dl")
    assert read_json(tmp_path / "raw/manifest.json") == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dl", "raw", "served"]  # no half-built data folder
    assert sorted(p.name for p in (tmp_path / "dl/flickr30k_images").iterdir()) == [
        "flickr30k-images.zip", "flickr30k-images.zip.sha256.json"]  # nothing extracted
    assert not list(tmp_path.rglob("evil.txt"))


def test_a_digest_mismatch_is_an_error_naming_the_source(archives, tmp_path):
    _, url, digests = archives
    raw = _config(url, pairs="flickr30k").sources
    cfg = parse_config({"data": {"pairs": "flickr30k", "sources": {
        **{k: {"url": getattr(raw, k).url} for k in ("karpathy_splits", "flickr30k_images")},
        "karpathy_splits": {"url": raw.karpathy_splits.url, "sha256": "0" * 64}}}}).data
    with pytest.raises(DownloadError, match="SHA-256 mismatch"):
        prepare_data(cfg, 0, tmp_path / "raw", tmp_path / "dl")
    assert not (tmp_path / "raw").exists()
    ok = parse_config({"data": {"pairs": "flickr30k", "demo": {"corpus_sentences": 5}, "sources": {
        "karpathy_splits": {"url": raw.karpathy_splits.url, "sha256": digests["caption_datasets.zip"]},
        "flickr30k_images": {"url": raw.flickr30k_images.url}}}}).data
    assert prepare_data(ok, 0, tmp_path / "raw", tmp_path / "dl")["counts"]["images"] == 2


def test_offline_sources_fail_fast_naming_what_is_missing(archives, tmp_path, monkeypatch):
    _, url, _ = archives
    monkeypatch.setenv("MMCSE_OFFLINE", "1")
    with pytest.raises(DownloadError, match="caption_datasets.zip: not downloaded yet .* offline"):
        prepare_data(_config(url, pairs="flickr30k"), 0, tmp_path / "raw", tmp_path / "dl")
    assert not (tmp_path / "raw").exists()


def test_local_paths_need_no_server(archives, tmp_path):
    files, _, _ = archives
    shutil.unpack_archive(files / "flickr30k-images.zip", tmp_path / "mine")
    cfg = parse_config({"data": {"pairs": "flickr30k", "demo": {"corpus_sentences": 5}, "sources": {
        "karpathy_splits": {"path": str(files / "caption_datasets.zip")},
        "flickr30k_images": {"path": str(tmp_path / "mine")}}}}).data
    manifest = prepare_data(cfg, 0, tmp_path / "raw", tmp_path / "dl")
    assert manifest["counts"]["images"] == 2 and manifest["sources"]["flickr30k_images"]["origin"].startswith("path:")
    assert not list(files.glob("*.sha256.json"))  # nothing written beside the user's own files


def test_flickr30k_images_from_the_hub_cache_offline(archives, tmp_path, monkeypatch):
    files, url, digests = archives
    import huggingface_hub.constants as constants

    commit = "1" * 40
    repo = tmp_path / "hub" / "datasets--nlphuji--flickr30k"
    (repo / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(files / "flickr30k-images.zip", repo / "snapshots" / commit / "flickr30k-images.zip")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = parse_config({"data": {"pairs": "flickr30k", "demo": {"corpus_sentences": 5}, "sources": {
        "karpathy_splits": {"path": str(files / "caption_datasets.zip")}}}}).data  # images: the default hub source
    manifest = prepare_data(cfg, 0, tmp_path / "raw", tmp_path / "dl")
    assert manifest["sources"]["flickr30k_images"] == {
        "origin": "hub:nlphuji/flickr30k/flickr30k-images.zip", "sha256": digests["flickr30k-images.zip"],
        "bytes": (files / "flickr30k-images.zip").stat().st_size, "verified": "first use"}
    assert manifest["counts"]["images"] == 2


def test_senteval_archive_is_downloaded_and_read(server, senteval_dir, tmp_path):
    files, url = server
    members = {}
    for task in ("STSBenchmark", "STS16"):
        folder = next((senteval_dir / "downstream" / "STS").glob(f"{task}*"))
        for path in folder.rglob("*"):
            if path.is_file():
                members[f"downstream/STS/{folder.name}/{path.relative_to(folder)}"] = path.read_bytes()
    (files / "senteval.tar").write_bytes(tar_gz(members))
    cfg = parse_config({"data": {"source": "senteval", "senteval_dir": "download",
                                 "demo": {"corpus_sentences": 5},
                                 "sources": {"senteval": {"url": f"{url}/senteval.tar"}}}}).data
    manifest = prepare_data(cfg, 0, tmp_path / "raw", tmp_path / "dl")
    assert manifest["counts"]["sts_dev_pairs"] == 1500
    assert manifest["counts"]["sts_test_pairs"] == 1379 + 1186  # STS-B test + STS16
    assert manifest["sources"]["senteval"]["origin"] == f"{url}/senteval.tar"


def test_bad_source_declarations_fail_at_load():
    with pytest.raises(ConfigError, match="data.sources.wiki1m.: needs exactly one of url, hub"):
        parse_config({"data": {"sources": {"wiki1m": {"url": "http://x/y", "hub": "a/b", "file": "c"}}}})
    with pytest.raises(ConfigError, match="data.sources.wiki1m.sha256"):
        parse_config({"data": {"sources": {"wiki1m": {"url": "http://x/y", "sha256": "abc"}}}})
    with pytest.raises(ConfigError, match="unknown key.*data.sources.flickr8k"):
        parse_config({"data": {"sources": {"flickr8k": {"url": "http://x/y"}}}})
    with pytest.raises(ConfigError, match="data.splits.*valid: train, restval, val, test"):
        parse_config({"data": {"splits": ["training"]}})
    with pytest.raises(ConfigError, match="data.annotations"):
        parse_config({"data": {"pairs": "coco", "annotations": "flickr30k_entities"}})


def test_verify_images_off_keeps_what_the_archive_lists_and_downloads_dir_moves_the_archives(archives, tmp_path):
    from mmcse.config import Config
    from mmcse.pipeline.paths import Paths

    _, url, _ = archives
    manifest = prepare_data(_config(url, pairs="flickr30k", verify_images=False), 0, tmp_path / "raw",
                            tmp_path / "dl")
    assert manifest["counts"]["images"] == 3 and manifest["counts"]["images_unreadable"] == 0  # 1003 kept
    for row in read_jsonl(tmp_path / "raw/images.jsonl"):  # hashed though not decoded
        assert row["sha256"] == hashlib.sha256((tmp_path / "raw" / row["file"]).read_bytes()).hexdigest()
    paths = Paths.of(Config(data=parse_config({"data": {"downloads_dir": "archives"}}).data), tmp_path)
    assert paths.downloads == tmp_path / "data" / "archives"


def test_a_source_without_a_declared_digest_is_trusted_on_first_use_then_held_to_it(archives, tmp_path, caplog):
    """Issue 33.11: the first fetch records the archive's SHA-256 (with a warning saying so); a later
    fetch of the same URL that brings other bytes is refused, never extracted."""
    from mmcse.data.sources import TRUST_FILE, fetch_source

    files, url, digests = archives
    spec = _config(url, pairs="flickr30k").sources.karpathy_splits
    first = fetch_source(spec, "karpathy_splits", tmp_path / "dl")
    assert first.record["sha256"] == digests["caption_datasets.zip"] and first.record["verified"] == "first use"
    assert f"data.sources.karpathy_splits: no sha256 declared in params.yaml; recorded {first.record['sha256']} " \
           "on first use" in caplog.text
    recorded = json.loads((tmp_path / "dl" / TRUST_FILE).read_text())[spec.url]
    assert recorded["sha256"] == digests["caption_datasets.zip"]
    again = fetch_source(spec, "karpathy_splits", tmp_path / "dl")  # the kept file, checked against the record
    assert again.record["sha256"] == first.record["sha256"]
    (files / "caption_datasets.zip").write_bytes(b"another archive")  # the server's file changed
    first.path.unlink()
    with pytest.raises(DownloadError, match="SHA-256 mismatch"):
        fetch_source(spec, "karpathy_splits", tmp_path / "dl")
    assert not first.path.exists()  # the changed download was deleted, not kept


def test_only_http_urls_are_fetched(tmp_path):
    from mmcse.data.fetch import http_download

    local = tmp_path / "a.txt"
    local.write_text("x")
    for url in (local.as_uri(), "ftp://example.org/a.zip", "data:text/plain,x"):
        with pytest.raises(DownloadError, match="only http\\(s\\) URLs are fetched"):
            http_download(url, tmp_path / "out" / "a.txt")
    assert not (tmp_path / "out").exists()
