"""`mmcse preflight`'s teacher-cache check: the cache_teachers stage's own encoders and cache writes run on a few
synthetic items in the real formats (JPEG files, sentences), once per distinct teacher configuration of a table.

Each encoder the configuration names is built as the stage builds it: real weights and tokenizer where the model
is on this machine, else its architecture (`mmcse.models.architectures`, torchvision's ResNet-50, open_clip's
model configuration) with random weights and, without its tokenizer's files, `WordTokenizer`. The features go
through `mmcse.teachers.cache.cached_features` into a temporary folder (written, hashed, read back), and the
seconds an item took give, where this machine downloaded the data, the stage's projected time: the images and
test images through the image encoder, the captions and corpus sentences through each text teacher, the
captions and images through a pretrained joint teacher. MCSEO's object crops are not counted (their number is
the detector's). Nothing is downloaded and nothing is written outside the temporary folder.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmcse.config import Config
from mmcse.config.inputs import JOINT_TEXT_TEACHER
from mmcse.errors import InputError, ModelUnavailableError
from mmcse.experiments.stand_ins import used_sets
from mmcse.hub import local_model
from mmcse.models.architectures import model_config
from mmcse.models.device import resolve_device
from mmcse.teachers import encoders
from mmcse.teachers.cache import cached_features, fit_cca, image_encoder, text_teacher_features

CAPTION_WORDS = 12  # a Flickr30k / COCO caption's words, about
IMAGE_SIZE = (500, 375)  # a Flickr30k photo's usual width × height
# (start id, end id, padding id, lowest word id) of a model family's tokenizer, for `WordTokenizer`
SPECIAL_IDS = {"bert": (101, 102, 0, 1000), "roberta": (0, 2, 1, 4), "clip": (49406, 49407, 49407, 256)}
WORDS = ("a man woman child dog two people in on the red blue green shirt street water grass ball running "
         "sitting playing standing next to with near small large white black young old group of").split()


class WordTokenizer:
    """A tokenizer for a model whose tokenizer files are not on this machine: each word of a sentence is one id
    (its hash, above the family's special ids), between the family's start and end ids, padded to the batch's
    longest. A sentence gets its real word count in tokens (WordPiece and BPE give as many or a few more), so
    the forward passes are the stage's shapes; the features mean nothing."""

    def __init__(self, model_type: str, vocab_size: int) -> None:
        family = "clip" if model_type.startswith("clip") else model_type
        if family not in SPECIAL_IDS:
            raise ModelUnavailableError(f"no tokenizer of model type {model_type!r} on this machine and no known "
                                        f"special ids for it (mmcse.experiments.preflight_cache.SPECIAL_IDS)")
        self.start, self.end, self.pad, self.low = SPECIAL_IDS[family]
        self.high = min(vocab_size, self.start if family == "clip" else vocab_size)  # CLIP's specials are last

    def __call__(self, texts: Sequence[str], padding: bool = True, truncation: bool = True,
                 max_length: int | None = None, return_tensors: str = "pt") -> Any:
        from transformers import BatchEncoding

        rows = []
        for text in texts:
            words = [self.low + zlib.crc32(w.encode()) % (self.high - self.low) for w in text.split()]
            ids = [self.start, *words, self.end]
            rows.append(ids[: max_length - 1] + [self.end] if max_length and len(ids) > max_length else ids)
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})


@dataclasses.dataclass
class _ClipParts:
    """What `mmcse.teachers.encoders.clip_features` reads of a CLIP processor."""

    tokenizer: Any
    image_processor: Any


def synthetic_items(folder: Path, n: int, seed: int = 0) -> tuple[list[str], list[Path]]:
    """``n`` caption-like sentences and ``n`` photo-sized JPEG files (noise) in ``folder``."""
    rng = np.random.default_rng(seed)
    sentences = [" ".join(rng.choice(WORDS, CAPTION_WORDS)) for _ in range(n)]
    files = []
    for i in range(n):
        pixels = rng.integers(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)
        files.append(folder / f"image-{i}.jpg")
        Image.fromarray(pixels).save(files[-1], quality=90)
    return sentences, files


def _text_teacher(name: str) -> tuple[Any, bool]:
    """``((tokenizer, model), real)`` of a text teacher, as `text_teacher_features` takes it."""
    from transformers import AutoModel, AutoTokenizer

    location = local_model(name)
    if location is not None:
        return (AutoTokenizer.from_pretrained(location), AutoModel.from_pretrained(location)), True
    config = model_config(name)[0]
    return (WordTokenizer(config.model_type, config.vocab_size), AutoModel.from_config(config)), False


def _clip(name: str) -> tuple[Any, bool]:
    """``((model, processor), real)`` of a transformers CLIP, as `clip_features` takes it."""
    from transformers import CLIPImageProcessor, CLIPModel

    if local_model(name) is not None:
        return encoders.load_clip(name), True
    config = model_config(name)[0]
    # CLIPImageProcessor's defaults are OpenAI CLIP's preprocessing (224 shortest side, center 224, CLIP's mean/std)
    parts = _ClipParts(WordTokenizer("clip", config.text_config.vocab_size), CLIPImageProcessor())
    return (CLIPModel(config).eval(), parts), False


def _open_clip(architecture: str, pretrained: str) -> tuple[Any, bool]:
    """``((model, preprocess, tokenizer), real)`` of an open_clip model (its tokenizer ships with open_clip)."""
    import open_clip

    try:
        return encoders.load_open_clip(architecture, pretrained, download=False), True
    except ModelUnavailableError:
        model, _, preprocess = open_clip.create_model_and_transforms(architecture, pretrained=None)
        return (model.eval(), preprocess, open_clip.get_tokenizer(architecture)), False


def _seconds(compute: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = compute()
    return out, time.perf_counter() - start


def marginal(run: Callable[[int], Any], items: int) -> tuple[Any, float, float]:
    """``(run(items)'s output, seconds an item, fixed seconds)``: ``run(n)`` encodes n items; the first call
    builds and moves the model (not timed, as the stage builds it once), then one item and ``items`` are
    timed, and an item's cost is the difference over ``items − 1``: a call's own start (the loader's
    workers, the first batch's allocations) is the fixed part, paid once per set, not per item."""
    run(1)
    _, one = _seconds(lambda: run(1))
    out, many = _seconds(lambda: run(items))
    per_item = max(many - one, 0.0) / max(items - 1, 1)
    return out, per_item, max(one - per_item, 0.0)


def teacher_cache_check(job: Config, items: int) -> dict[str, Any]:
    """The cache_teachers stage's sets of ``job``'s teachers built from ``items`` (≥ 2) synthetic items each:
    ``{"items", "sets": [{"set", "model", "weights" (real, random, none), "dim", "seconds_per_item",
    "fixed_seconds", "write_seconds", "counted"}]}`` (`marginal`; ``write_seconds``: the set written through
    the stage's cache and read back; ``counted``: the download's counts of the items the stage runs the set's
    encoder on)."""
    if items < 2:
        raise InputError(f"--cache-items {items}: an item's time is measured between 1 and at least 2 items")
    t, j = job.teachers, job.teachers.joint
    used = used_sets(job)  # only the sets the row's terms read
    device = resolve_device(job.base.device)
    sets: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mmcse-preflight-cache-") as tmp:
        folder = Path(tmp)
        (folder / "images").mkdir()
        sentences, files = synthetic_items(folder / "images", items, job.base.seed)
        ids = [f"item-{i}" for i in range(items)]

        def record(name: str, model: str, real: bool | None, counted: list[str], measured: tuple[Any, float, float],
                   features: np.ndarray | None = None) -> np.ndarray:
            """A set's times, and its features written and read back through the stage's cache."""
            out, per_item, fixed = measured
            features = out if features is None else features
            store, write = _seconds(lambda: cached_features(folder / "cache", name.replace(" ", "_"),
                                                            {"set": name, "model": model}, "synthetic", ids,
                                                            lambda: features)[0])
            weights = {True: "real", False: "random", None: "none"}[real]
            sets.append({"set": name, "model": model, "weights": weights, "dim": store.dim,
                         "seconds_per_item": per_item, "fixed_seconds": fixed, "write_seconds": write,
                         "counted": counted})
            return np.asarray(store.features)

        image = None
        if used["image"]:
            real_image = None if t.image_encoder == "colour-edge-grid" else True  # weight-free, or ResNet-50's
            try:
                described, encode = image_encoder(t, device, download=False)  # ResNet-50's weights if they are here
            except ModelUnavailableError:
                described, encode = image_encoder(dataclasses.replace(t, image_weights="random"), device)
                real_image = False
            image = record("image", described["name"], real_image, ["images", "retrieval_images"],
                           marginal(lambda n: encode(files[:n], "synthetic images"), items))

        wanted: dict[str, list[str]] = {}  # every text teacher's poolers: one forward a model, as the stage
        for teacher in t.text if used["text"] else []:
            if teacher.teacher != JOINT_TEXT_TEACHER:
                wanted.setdefault(teacher.teacher, []).append(teacher.pooler)
        if used["cca_text"] and j.text_pooler not in wanted.setdefault(j.text_teacher, []):
            wanted[j.text_teacher].append(j.text_pooler)
        text: dict[tuple[str, str], np.ndarray] = {}
        for name, poolers in wanted.items():
            loaded, real = _clip(name) if "clip" in poolers else _text_teacher(name)

            def encode_text(n: int, name=name, poolers=poolers, loaded=loaded) -> dict[str, np.ndarray]:
                return text_teacher_features(name, sentences[:n], poolers, t.batch_size, device=device, loaded=loaded)

            out, per_item, fixed = marginal(encode_text, items)
            for i, pooler in enumerate(poolers):  # one forward for every pooler: its time goes to the first's set
                text[(name, pooler)] = record(f"text {pooler}", name, real, ["pairs", "corpus_sentences"],
                                              (out[pooler], per_item, fixed) if i == 0 else (out[pooler], 0.0, 0.0))

        if not used["joint"]:
            return {"items": items, "sets": sets}
        if j.kind == "cca":  # fitted on the training pairs' text-teacher and image features, once
            source = text[(j.text_teacher, j.text_pooler)]
            fitted, seconds = _seconds(lambda: fit_cca(source, image, j.dim, j.regularization))
            record("joint text (cca)", "cca", None, [], (fitted.text(source), 0.0, seconds))
            return {"items": items, "sets": sets}
        if j.kind == "clip":
            loaded, real = _clip(j.model)
            model = j.model

            def joint(captions: Sequence[str], images: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
                return encoders.clip_features(j.model, captions, images, t.batch_size, t.num_workers, device, loaded)
        else:
            loaded, real = _open_clip(j.model, j.pretrained)
            model = f"open_clip/{j.model}"

            def joint(captions: Sequence[str], images: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
                return encoders.open_clip_features(j.model, j.pretrained, captions, images, t.batch_size,
                                                   t.num_workers, device, loaded)
        # each side alone, one item of the other keeping its batch non-empty, as the stage computes them
        record("joint text", model, real, ["pairs"], marginal(lambda n: joint(sentences[:n], files[:1])[0], items))
        if j.image_side == "image_encoder":  # v̂ is the image encoder's own set (measured above)
            return {"items": items, "sets": sets}
        record("joint image", model, real, ["images", "retrieval_images"],
               marginal(lambda n: joint(sentences[:1], files[:n])[1], items))
    return {"items": items, "sets": sets}


def projected_minutes(sets: Sequence[dict[str, Any]], counts: dict[str, int] | None) -> float | None:
    """The stage's minutes on this device: each set's seconds an item × the items the download counted, and
    its fixed seconds once for each kind of item it runs on (the stage encodes each kind in its own call)."""
    if counts is None:
        return None
    seconds = sum(s["seconds_per_item"] * sum(int(counts.get(c, 0)) for c in s["counted"])
                  + s.get("fixed_seconds", 0.0) * max(1, len(s["counted"])) for s in sets)
    return seconds / 60


def caches_text(caches: Sequence[dict[str, Any]], items: int, size: Callable[[int | None], str]) -> list[str]:
    """`mmcse preflight`'s teacher-cache section: per check, its rows, peak and projection, then one line a set."""
    if not caches:
        return []
    lines = ["", f"teacher caches: the cache_teachers stage's encoders on {items} synthetic items, the sets written "
                 "and read back (once per teachers configuration)"]
    for c in caches:
        head = f"  rows {', '.join(c['rows'])}: {c['status']}"
        if c["status"] != "ran":
            lines.append(f"{head} ({c['error']})")
            continue
        minutes = c["projected_minutes"]
        said = "the downloaded data" if c.get("counts_from") == "downloaded" else "the data at its published size"
        lines.append(f"{head}, peak {size(c.get('peak_bytes'))}, " + (
            "no projection (the data's size is unknown here)" if minutes is None
            else f"about {minutes:.1f} min to cache {said} on this device (object crops not counted)"))
        lines.append(f"    {'set':<24} {'model':<46} {'weights':<8} {'s/item':>8} {'fixed s':>8}  over")
        for s in c["sets"]:
            lines.append(f"    {s['set'][:24]:<24} {s['model'][:46]:<46} {s['weights']:<8} "
                         f"{s['seconds_per_item']:>8.4f} {s['fixed_seconds']:>8.2f}  {', '.join(s['counted']) or '-'}")
    return lines
