"""The ``download`` stage: materialise training pairs, corpus and STS sets under ``data/``.

Image–caption pairs come from the generated scene world (``data.pairs: demo``) or from
Flickr30k / MS-COCO 2014 with Karpathy's splits (:mod:`mmcse.data.sources`); the STS sets
from the generator or a SentEval folder; the corpus from the generator, Wiki1M or a file.

Layout written (all paths relative to the data folder)::

    images/<image_id>.png        demo: RGB scene | images/<dataset>/...: real images (hard links)
    masks/<image_id>.png         demo: label mask (0 background, k = object k-1)
    images.jsonl                 image_id, file, sha256, bytes (+ split; demo: mask; objects [{box, ...}] where
                                 annotated); the digests put image bytes into the teacher-cache fingerprints
    pairs.jsonl                  pair_id, image_id, caption, phrases [{object, start, end}] (empty: none)
    retrieval/images.jsonl       the retrieval test set (Karpathy test split; demo: test scenes): image rows
    retrieval/captions.jsonl     image_id, caption: every caption of those images
    retrieval/val_images.jsonl   the retrieval validation set (dev R@K rsum picks checkpoints: DUET): image rows
                                 of Karpathy's val split, first data.val_images (demo: val scenes); empty when
                                 data.splits trains on val or data.pairs is none
    retrieval/val_captions.jsonl image_id, caption: every caption of those images
    test_captions/<set>.jsonl    image_id, caption: every caption of Karpathy's test split of flickr30k and coco,
                                 whenever Karpathy's file is read (real pairs): the caption sets a figure may
                                 encode (ablate.figure_captions; DALR Fig. 3 encodes COCO's)
    corpus.txt                   text-only sentences (one per line)
    sts/dev.jsonl, sts/test.jsonl  task, subset, s1, s2, score
    manifest.json                counts, sources (origin, SHA-256, bytes), SHA-256 of every table
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mmcse.config import DataConfig, SourceConfig
from mmcse.data import demo
from mmcse.data.senteval import available_transfer_tasks, read_sts_task, read_sts_tasks, read_transfer_task
from mmcse.data.sources import (
    KARPATHY_SETS,
    Fetched,
    cc12m_pairs,
    fetch_source,
    karpathy_test_captions,
    real_pairs,
    senteval_folder,
)
from mmcse.errors import InputError
from mmcse.io import atomic_path, build_dir, sha256_file, write_bytes, write_json, write_jsonl, write_text

log = logging.getLogger(__name__)

# The demo world's scene sets: (random stream suffix, id prefix, data.demo count key). Each set has
# its own stream and ids, so no test or validation scene is a training scene (or one another's).
_DEMO_SETS = {
    "train": ("images", "img", "num_images"),
    "test": ("retrieval", "test", "retrieval_images"),
    "val": ("retrieval-val", "val", "retrieval_val_images"),
}

def _generate_pairs(cfg: DataConfig, seed: int, out: Path, split: str = "train") -> tuple[list[dict], list[dict]]:
    """The demo world's training scenes (``split`` train, ids ``img00000``), retrieval test scenes
    (``test``: ``test00000``) or retrieval validation scenes (``val``: ``val00000``): each from its
    own random stream (``{seed}-images`` / ``{seed}-retrieval`` / ``{seed}-retrieval-val``), so no
    evaluation image is a training image and adding the val set changes no train or test scene."""
    d = cfg.demo
    stream, prefix, count_key = _DEMO_SETS[split]
    rng = random.Random(f"{seed}-{stream}")
    count = getattr(d, count_key)
    images, pairs = [], []
    label = "" if split == "train" else f"{split} "
    for i in tqdm(range(count), desc=f"download: drawing {label}scenes", unit="img"):
        image_id = f"{prefix}{i:05d}"
        scene = demo.sample_scene(rng, d.min_objects, d.max_objects)
        picture, labels, boxes = demo.render_scene(scene, d.image_size, rng)
        encoded = io.BytesIO()
        picture.save(encoded, format="PNG")
        write_bytes(out / "images" / f"{image_id}.png", encoded.getvalue())
        with atomic_path(out / "masks" / f"{image_id}.png") as tmp:
            demo.Image.fromarray(labels, "L").save(tmp, format="PNG")
        images.append(
            {
                "image_id": image_id,
                "file": f"images/{image_id}.png",
                "sha256": hashlib.sha256(encoded.getvalue()).hexdigest(),  # in the teacher-cache fingerprints
                "bytes": len(encoded.getvalue()),
                "mask": f"masks/{image_id}.png",
                "background": scene.background,
                "objects": [
                    {"shape": o.shape, "colour": o.colour, "size": o.size, "box": list(box)}
                    for o, box in zip(scene.objects, boxes, strict=True)
                ],
            }
        )
        for c in range(d.captions_per_image):
            caption = demo.describe(scene, rng)
            pairs.append(
                {
                    "pair_id": f"{image_id}-c{c}",
                    "image_id": image_id,
                    "caption": caption.text,
                    "phrases": [
                        {"object": p.object_index, "start": p.start, "end": p.end} for p in caption.phrases
                    ],
                }
            )
    return images, pairs


def select_captions(pairs: list[dict], mode: str, seed: int) -> list[dict]:
    """Which captions of each image become training pairs (``data.captions``): ``all`` (KDMCSE),
    ``random`` (MCSE: one per image, seeded) or ``longest`` (MCSEO; ties: the first)."""
    if mode == "all":
        return pairs
    by_image: dict[str, list[dict]] = {}
    for pair in pairs:
        by_image.setdefault(pair["image_id"], []).append(pair)
    rng = random.Random(f"{seed}-captions")
    if mode == "random":
        return [rng.choice(group) for group in by_image.values()]
    if mode == "longest":
        return [max(group, key=lambda p: len(p["caption"])) for group in by_image.values()]
    raise InputError(f"unknown caption choice {mode!r}; choices: all, random, longest")


def retrieval_set_name(pairs: str) -> str:
    """The retrieval test set of ``data.pairs``: Karpathy's test split (Flickr30k: 1,000 images;
    COCO: 5,000, also scored as five 1K folds) or the demo world's test scenes."""
    return {"flickr30k": "flickr30k_1k", "coco": "coco_5k"}.get(pairs, pairs)


def retrieval_source(cfg: DataConfig) -> str:
    """The data set whose test split is the retrieval test set: ``data.pairs``, or the one
    ``data.retrieval_test`` names."""
    return cfg.pairs if cfg.retrieval_test == "same" else cfg.retrieval_test


def retrieval_val_set_name(pairs: str) -> str:
    """The retrieval validation set of ``data.pairs``: Karpathy's val split (``flickr30k_val``,
    ``coco_val``; cut to ``data.val_images``) or the demo world's val scenes (``demo_val``)."""
    return f"{pairs}_val"


def _retrieval_test_set(cfg: DataConfig, seed: int, out: Path, downloads: Path,
                        report: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """Images and every caption of the retrieval test set (``retrieval/images.jsonl``: the
    images.jsonl fields; ``retrieval/captions.jsonl``: image_id, caption), all captions per
    image whatever ``data.captions`` picks for training."""
    if cfg.pairs == "none" or retrieval_source(cfg) == "cc12m":  # text only, or CC12M: no test split
        return [], []
    if cfg.pairs == "demo":
        images, pairs = _generate_pairs(cfg, seed, out, "test")
    else:
        # Karpathy's test split (of data.retrieval_test's data set when it names another); data.splits
        # cannot name it (config validation), so no test image trains
        test_cfg = dataclasses.replace(cfg, pairs=retrieval_source(cfg), splits=["test"], image_limit=0,
                                       annotations="none")
        images, pairs, test_report = real_pairs(test_cfg, out, downloads, allow_empty=True)
        report["sources"] |= test_report["sources"]
        for key in ("images_missing", "images_unreadable"):
            report[f"retrieval_{key}"] = test_report.get(key, 0)
    # image rows as in images.jsonl (demo: masks and annotated objects too: DUET's regions read them)
    return images, [{"image_id": p["image_id"], "caption": p["caption"]} for p in pairs]


def _retrieval_val_set(cfg: DataConfig, seed: int, out: Path, downloads: Path,
                       report: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """Images and every caption of the retrieval validation set (``retrieval/val_images.jsonl``,
    ``retrieval/val_captions.jsonl``, the test set's fields): the demo world's val scenes, or the
    first ``data.val_images`` images of Karpathy's val split (0: all). Empty for ``data.pairs:
    none``, and when ``data.splits`` trains on val: those images cannot select checkpoints (a
    method that needs the set refuses that configuration at load; the download itself is valid)."""
    if cfg.pairs in ("none", "cc12m"):  # CC12M has no val split
        return [], []
    if cfg.pairs == "demo":
        images, pairs = _generate_pairs(cfg, seed, out, "val")
    elif "val" in cfg.splits:
        log.warning("data.splits trains on Karpathy's val split: no retrieval validation set written")
        return [], []
    else:
        val_cfg = dataclasses.replace(cfg, splits=["val"], image_limit=cfg.val_images, annotations="none")
        images, pairs, val_report = real_pairs(val_cfg, out, downloads, allow_empty=True)
        report["sources"] |= val_report["sources"]
        for key in ("images_missing", "images_unreadable"):
            report[f"retrieval_val_{key}"] = val_report.get(key, 0)
    return images, [{"image_id": p["image_id"], "caption": p["caption"]} for p in pairs]


def corpus_source(cfg: DataConfig, downloads: str | Path) -> Fetched | None:
    """The file of ``data.corpus`` with its manifest record (None for the generated corpus)."""
    if cfg.corpus == "demo":
        return None
    spec = cfg.sources.wiki1m if cfg.corpus == "wiki1m" else SourceConfig(path=cfg.corpus)
    return fetch_source(spec, "wiki1m" if cfg.corpus == "wiki1m" else "corpus", downloads)


def load_corpus(cfg: DataConfig, seed: int, downloads: str | Path | None = None,
                source: Fetched | None = None) -> list[str]:
    """The text-only corpus of ``data.corpus`` (demo / wiki1m / a text file), blank lines
    dropped, cut to ``data.corpus_limit`` sentences when set; an empty corpus is an error.
    ``source``: the corpus file when :func:`corpus_source` already fetched it."""
    if cfg.corpus == "demo":
        sentences = _generate_corpus(cfg, seed)
    else:
        if source is None:
            source = corpus_source(cfg, downloads if downloads is not None else Path("data") / cfg.downloads_dir)
        with open(source.path, encoding="utf-8") as handle:
            sentences = [line.strip() for line in handle if line.strip()]
        if not sentences:
            raise InputError(f"params.yaml: data.corpus={cfg.corpus!r}: {source.path} holds no sentences")
    return sentences[: cfg.corpus_limit] if cfg.corpus_limit else sentences


def _generate_corpus(cfg: DataConfig, seed: int) -> list[str]:
    d = cfg.demo
    rng = random.Random(f"{seed}-corpus")
    return [
        demo.describe(demo.sample_scene(rng, 1, d.max_objects), rng).text for _ in range(d.corpus_sentences)
    ]


def _generate_sts(cfg: DataConfig, seed: int, split: str, count: int) -> list[dict]:
    d = cfg.demo
    rng = random.Random(f"{seed}-sts-{split}")
    rows = []
    for _ in range(count):
        s1, s2, gold = demo.sts_pair(rng, d.min_objects, d.max_objects)
        rows.append({"task": "DemoSTS", "subset": split, "s1": s1, "s2": s2, "score": gold})
    return rows


def prepare_data(cfg: DataConfig, seed: int, out_dir: str | Path, downloads_dir: str | Path | None = None
                 ) -> dict[str, Any]:
    """Write the data folder for ``cfg`` (deterministic from ``seed`` and the sources) and return
    its manifest. The folder is built beside ``out_dir`` and swapped in only when complete, so
    a failed run (a bad archive, an offline source) leaves the previous folder as it was."""
    out = Path(out_dir)
    downloads = Path(downloads_dir) if downloads_dir is not None else out.parent / cfg.downloads_dir
    senteval, senteval_record = (senteval_folder(cfg, downloads) if cfg.source == "senteval" else (None, None))
    if senteval is not None:
        present = available_transfer_tasks(senteval)
        missing = [task for task in cfg.transfer_tasks if task not in present]
        if missing:
            raise FileNotFoundError(
                f"params.yaml: data.transfer_tasks names {', '.join(missing)}, but {senteval} has no data for "
                f"{'it' if len(missing) == 1 else 'them'} (present: {', '.join(present) or 'none'})"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    build = build_dir(out.parent, prefix=f".{out.name}.")
    try:
        manifest = _build(cfg, seed, build, downloads, senteval, senteval_record)
        if out.exists():
            shutil.rmtree(out)
        os.replace(build, out)
    finally:
        if build.exists():
            shutil.rmtree(build, ignore_errors=True)
    return manifest


def _build(cfg: DataConfig, seed: int, out: Path, downloads: Path, senteval: Path | None,
           senteval_record: dict | None) -> dict[str, Any]:
    report: dict[str, Any] = {"sources": {}}
    if cfg.pairs == "none":  # text corpus only (SimCSE "wiki"): empty tables, so every stage reads the same layout
        images, pairs = [], []
    elif cfg.pairs == "demo":
        images, pairs = _generate_pairs(cfg, seed, out)
    elif cfg.pairs == "cc12m":
        images, pairs, report = cc12m_pairs(cfg, out, downloads)
    else:
        images, pairs, report = real_pairs(cfg, out, downloads)
    pairs = select_captions(pairs, cfg.captions, seed)
    test_images, test_captions = _retrieval_test_set(cfg, seed, out, downloads, report)
    val_images, val_captions = _retrieval_val_set(cfg, seed, out, downloads, report)
    figure_captions: dict[str, list[dict]] = {}
    if cfg.pairs in KARPATHY_SETS or retrieval_source(cfg) in KARPATHY_SETS:
        figure_captions, report["sources"]["karpathy_splits"] = karpathy_test_captions(cfg, downloads)
    corpus_file = corpus_source(cfg, downloads)
    corpus = load_corpus(cfg, seed, source=corpus_file)
    if corpus_file is not None:
        report["sources"]["wiki1m" if cfg.corpus == "wiki1m" else "corpus"] = corpus_file.record

    if senteval is None:
        dev = _generate_sts(cfg, seed, "dev", cfg.demo.sts_dev_pairs)
        test = _generate_sts(cfg, seed, "test", cfg.demo.sts_test_pairs)
    else:
        # SimCSE's protocol: STS-B dev selects checkpoints; the seven STS tasks are the test.
        report["sources"]["senteval"] = senteval_record
        dev = [p.to_row() for p in read_sts_task(senteval, "STSBenchmark", "dev")]
        test = [p.to_row() for task in read_sts_tasks(senteval).values() for p in task]
    transfer = {task: [e.to_row() for e in read_transfer_task(senteval, task)] for task in cfg.transfer_tasks}

    write_jsonl(out / "images.jsonl", images)
    write_jsonl(out / "pairs.jsonl", pairs)
    write_jsonl(out / "retrieval" / "images.jsonl", test_images)
    write_jsonl(out / "retrieval" / "captions.jsonl", test_captions)
    write_jsonl(out / "retrieval" / "val_images.jsonl", val_images)
    write_jsonl(out / "retrieval" / "val_captions.jsonl", val_captions)
    for dataset, rows in figure_captions.items():
        write_jsonl(out / "test_captions" / f"{dataset}.jsonl", rows)
    write_text(out / "corpus.txt", "\n".join(corpus) + "\n")
    write_jsonl(out / "sts" / "dev.jsonl", dev)
    write_jsonl(out / "sts" / "test.jsonl", test)
    for task, rows in transfer.items():  # the evaluate stage probes every task in this folder
        write_jsonl(out / "transfer" / f"{task}.jsonl", rows)

    tables = ["images.jsonl", "pairs.jsonl", "retrieval/images.jsonl", "retrieval/captions.jsonl",
              "retrieval/val_images.jsonl", "retrieval/val_captions.jsonl",
              "corpus.txt", "sts/dev.jsonl", "sts/test.jsonl",
              *(f"transfer/{task}.jsonl" for task in transfer),
              *(f"test_captions/{dataset}.jsonl" for dataset in figure_captions)]
    counts = {
        "images": len(images),
        "pairs": len(pairs),
        "corpus_sentences": len(corpus),
        "sts_dev_pairs": len(dev),
        "sts_test_pairs": len(test),
        "pairs_with_phrases": sum(1 for p in pairs if p.get("phrases")),
        "retrieval_images": len(test_images),
        "retrieval_captions": len(test_captions),
        "retrieval_val_images": len(val_images),
        "retrieval_val_captions": len(val_captions),
        **{f"transfer_{task}": len(rows) for task, rows in transfer.items()},
        **{f"test_captions_{dataset}": len(rows) for dataset, rows in figure_captions.items()},
    }
    for key in ("images_missing", "images_unreadable", "images_without_entities", "captions_missing",
                "retrieval_images_missing",
                "retrieval_images_unreadable", "retrieval_val_images_missing", "retrieval_val_images_unreadable"):
        if key in report:
            counts[key] = report[key]
    manifest = {
        "source": cfg.source,
        "pairs": cfg.pairs,
        "splits": list(cfg.splits) if cfg.pairs not in ("demo", "none") else [],
        "retrieval_set": retrieval_set_name(retrieval_source(cfg)) if test_images else None,
        "retrieval_val_set": retrieval_val_set_name(cfg.pairs) if val_images else None,
        "seed": seed,
        "counts": counts,
        "sources": report["sources"],
        "sha256": {name: sha256_file(out / name) for name in tables},
    }
    write_json(out / "manifest.json", manifest)
    return manifest

