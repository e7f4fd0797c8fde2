"""Each data source's published size, declared with the source: what the download stage would count, known
before anything is downloaded (`mmcse preflight` projects a row's steps and teacher caching from it).

The numbers are the sources' own: Wiki1M is SimCSE's 1,000,000 sentences; Karpathy's Flickr30k split
holds 29,000 / 1,014 / 1,000 images (train / val / test), Flickr30k Entities' 29,783 / 1,000 / 1,000,
Karpathy's COCO 82,783 train + 30,504 restval / 5,000 / 5,000, each image with five captions (COCO's
few sixth and seventh captions are left out: 0.05% of its pairs); STS-B's dev set has 1,500 pairs; a
CC12M subset is ``data.image_limit`` pairs. The demo world's sizes are its own parameters.
"""

from __future__ import annotations

from pathlib import Path

from mmcse.config import DataConfig

WIKI1M_SENTENCES = 1_000_000
STSB_DEV_PAIRS = 1_500
CAPTIONS_PER_IMAGE = 5
# images per split of each real image–caption source
SPLIT_IMAGES: dict[str, dict[str, int]] = {
    "flickr30k/karpathy": {"train": 29_000, "restval": 0, "val": 1_014, "test": 1_000},
    "flickr30k/entities": {"train": 29_783, "val": 1_000, "test": 1_000},
    "coco/karpathy": {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000},
}


def _split_images(pairs: str, flickr_split: str) -> dict[str, int]:
    return SPLIT_IMAGES[f"{pairs}/{flickr_split if pairs == 'flickr30k' else 'karpathy'}"]


def _cut(n: int, limit: int) -> int:
    return min(n, limit) if limit else n


def published_counts(data: DataConfig) -> dict[str, int] | None:
    """The counts the download stage writes into its manifest (``corpus_sentences``, ``images``, ``pairs``,
    ``sts_dev_pairs``, ``retrieval_images``, ``retrieval_val_images``, ``retrieval_val_captions``) for
    ``data``, from the sources' published sizes; None where a size is not known before the download (a
    local corpus file that is not here)."""
    d = data.demo
    if data.corpus == "demo":
        corpus = d.corpus_sentences
    elif data.corpus == "wiki1m":
        corpus = WIKI1M_SENTENCES
    elif Path(data.corpus).expanduser().is_file():
        with open(Path(data.corpus).expanduser(), encoding="utf8", errors="replace") as lines:
            corpus = sum(1 for line in lines if line.strip())
    else:
        return None
    counts = {"corpus_sentences": _cut(corpus, data.corpus_limit),
              "sts_dev_pairs": d.sts_dev_pairs if data.source == "demo" else STSB_DEV_PAIRS}
    per_image = CAPTIONS_PER_IMAGE if data.captions == "all" else 1
    if data.pairs == "demo":
        images, test, val = d.num_images, d.retrieval_images, d.retrieval_val_images
        per_image = d.captions_per_image if data.captions == "all" else 1
        test_captions = val_captions = d.captions_per_image
    elif data.pairs == "none":
        images = test = val = 0
        test_captions = val_captions = 0
    elif data.pairs == "cc12m":
        images, per_image = data.image_limit, 1
        test = val = 0  # CC12M has no test or val split
        test_captions = val_captions = 0
    else:
        split = _split_images(data.pairs, data.flickr_split)
        images = _cut(sum(split.get(s, 0) for s in data.splits), data.image_limit)
        val = 0 if "val" in data.splits else _cut(split["val"], data.val_images)
        source = data.pairs if data.retrieval_test == "same" else data.retrieval_test
        test = _split_images(source, data.flickr_split)["test"]
        test_captions = val_captions = CAPTIONS_PER_IMAGE
    return counts | {"images": images, "pairs": images * per_image, "retrieval_images": test,
                     "retrieval_captions": test * test_captions, "retrieval_val_images": val,
                     "retrieval_val_captions": val * val_captions}
