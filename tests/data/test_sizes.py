"""The sources' published sizes: what the download stage would count, known before the download."""

from __future__ import annotations

import dataclasses

import pytest

from mmcse.config import DataConfig
from mmcse.data.sizes import published_counts
from mmcse.experiments.params import load_config
from mmcse.io import read_json


def test_the_demos_published_counts_are_what_its_download_counted(prepared_project):
    cfg = load_config(prepared_project / "params.yaml")
    counted = read_json(prepared_project / "data/raw/manifest.json")["counts"]
    published = published_counts(cfg.data)
    shared = sorted(set(published) & set(counted))
    assert {"corpus_sentences", "pairs", "images", "sts_dev_pairs", "retrieval_images",
            "retrieval_val_images"} <= set(shared)
    assert {k: published[k] for k in shared} == {k: counted[k] for k in shared}
    one = published_counts(dataclasses.replace(cfg.data, captions="random"))
    assert one["pairs"] == one["images"] == published["images"]


@pytest.mark.parametrize(("data", "expected"), [
    # KDMCSE §4.1: 29,783 Flickr30k images (Entities' split), every caption; Wiki1M
    ({"pairs": "flickr30k", "flickr_split": "entities", "corpus": "wiki1m", "source": "senteval"},
     {"images": 29_783, "pairs": 148_915, "corpus_sentences": 1_000_000, "sts_dev_pairs": 1_500,
      "retrieval_images": 1_000, "retrieval_val_images": 1_000, "retrieval_val_captions": 5_000}),
    ({"pairs": "flickr30k", "captions": "random", "val_images": 0},
     {"images": 29_000, "pairs": 29_000, "retrieval_val_images": 1_014, "retrieval_images": 1_000}),
    # COCO train + restval (113,287), scored on Flickr30k's test split (DALR Table 4's wiki+coco rows)
    ({"pairs": "coco", "splits": ["train", "restval"], "retrieval_test": "flickr30k", "flickr_split": "entities"},
     {"images": 113_287, "pairs": 566_435, "retrieval_images": 1_000, "retrieval_val_images": 1_000}),
    ({"pairs": "cc12m", "image_limit": 1_000_000}, {"images": 1_000_000, "pairs": 1_000_000, "retrieval_images": 0}),
    ({"pairs": "none", "corpus": "wiki1m", "corpus_limit": 1000}, {"pairs": 0, "corpus_sentences": 1000}),
])
def test_published_counts_of_the_papers_sources(data, expected):
    from mmcse.config import parse_config

    method = {"train": {"method": "simcse"}} if data["pairs"] == "none" else {}
    got = published_counts(parse_config({"data": data, **method}).data)
    assert {k: got[k] for k in expected} == expected


def test_a_local_corpus_is_counted_and_a_missing_one_is_unknown(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one\n\ntwo\nthree\n")
    assert published_counts(dataclasses.replace(DataConfig(), corpus=str(corpus)))["corpus_sentences"] == 3
    corpus.unlink()
    assert published_counts(dataclasses.replace(DataConfig(), corpus=str(corpus))) is None
