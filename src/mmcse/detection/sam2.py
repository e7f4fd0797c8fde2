"""Backend ``sam2`` of ``detect_objects``: MCSEO §3.3 with the paper's models.

Florence-2 grounds every caption of an image (``<CAPTION_TO_PHRASE_GROUNDING>`` + caption),
:func:`mmcse.detection.grounding.parse_grounding` maps its post-processed output to caption character
spans and pixel boxes, and SAM 2 segments all boxes of the image in one predictor call (box
prompts, one mask each). Each object becomes a crop on a transparent background (alpha =
its SAM mask inside the box) and each phrase a token span of the student's tokenizer, with
the annotations backend's exclusions; ``objects.jsonl`` has the same rows either way.

Work is persisted per shard of ``detect.shard_size`` images (``shards/shard-NNNNN.jsonl``,
written atomically after its crops) and keyed by a hash of the shard's pairs, captions and
image bytes, the detect config and the tokenizer, so an interrupted run resumes at the
first unfinished shard and a changed input redoes exactly the shards it touches.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from mmcse.config import DetectConfig, to_dict
from mmcse.detection.crops import caption_offsets, char_span_to_token_span, masked_crop, object_record, write_objects
from mmcse.detection.grounding import TASK, GroundedPhrase, parse_grounding
from mmcse.errors import InputError, MissingEntry
from mmcse.hub import ModelUnavailableError, hf_download_command, hub_unreachable, resolve_model
from mmcse.io import atomic_path, open_image, read_jsonl, sha256_file, sha256_json, write_jsonl
from mmcse.models.device import resolve_device

logger = logging.getLogger(__name__)

# (images, captions) → one post-processed grounding output per caption, in Florence-2's
# documented format {TASK: {"bboxes": [[x0, y0, x1, y1], ...], "labels": [...]}} (pixels).
Grounder = Callable[[Sequence[Image.Image], Sequence[str]], list[dict[str, Any]]]
# (RGB image, boxes (N, 4) float32 pixels x0 y0 x1 y1) → masks (N, H, W) bool.
Segmenter = Callable[[Image.Image, np.ndarray], np.ndarray]

SHARD_FORMAT = 1  # bump when the shard rows change meaning: old shards are then redone
STAT_KEYS = (
    "images_in", "images_unreadable", "pairs_in", "pairs_unreadable_image", "pairs_too_few_objects",
    "pairs_kept", "phrases_grounded", "phrases_unmatched", "phrases_repeated", "bad_boxes",
    "phrases_truncated", "masks_empty",
)
_SHARD_NAME = re.compile(r"^shard-(\d{5,})\.jsonl$")


def _autocast(device: torch.device):
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


# --------------------------------------------------------------------------- model resolution


def resolve_grounding_model(name_or_path: str) -> str:
    """A local folder (or cached snapshot) of the Florence-2 checkpoint; fails fast offline."""
    try:
        return resolve_model(name_or_path)
    except ModelUnavailableError as err:
        raise ModelUnavailableError(f"detect.grounding_model: {err}") from None


def sam2_checkpoint_filename(repo_id: str) -> str:
    """The weights file of a SAM 2 hub repo: ``facebook/sam2.1-hiera-base-plus`` →
    ``sam2.1_hiera_base_plus.pt`` (the naming of Meta's repos)."""
    return repo_id.rsplit("/", 1)[-1].replace("-", "_") + ".pt"


def resolve_sam2_checkpoint(spec: str) -> Path:
    """A local SAM 2 ``.pt`` for ``spec`` (a file, or a hub repo id taken from the Hugging
    Face cache first and downloaded only when online); :class:`ModelUnavailableError` naming
    the checkpoint and how to provide it otherwise."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if spec.endswith((".pt", ".pth")) or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelUnavailableError(f"detect.sam2_checkpoint: {spec}: checkpoint file not found")
    from huggingface_hub import constants, hf_hub_download

    filename = sam2_checkpoint_filename(spec)
    try:
        return Path(hf_hub_download(spec, filename, local_files_only=True))
    except (OSError, ValueError):  # LocalEntryNotFoundError is an OSError
        pass
    hint = (f"detect.sam2_checkpoint: SAM 2 checkpoint {spec!r} ({filename}) is not in the local Hugging Face "
            f"cache ({constants.HF_HUB_CACHE})")
    why = hub_unreachable()
    if why is not None:
        raise ModelUnavailableError(
            f"{hint} and the hub cannot be used here ({why}). Download it on a machine with internet "
            f"(`{hf_download_command(spec, filename)}`) into that cache, or set detect.sam2_checkpoint to a "
            "local .pt file."
        )
    try:
        return Path(hf_hub_download(spec, filename, etag_timeout=5))
    except Exception as err:  # network errors come in many types; all mean "not here"
        raise ModelUnavailableError(
            f"{hint}, and downloading it failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
            "Set detect.sam2_checkpoint to a local .pt file or fill the cache on a machine with internet."
        ) from None


# --------------------------------------------------------------------------- models


class FlorenceGrounder:
    """Florence-2 phrase grounding through transformers (``Florence2ForConditionalGeneration``
    + its processor): one generate call per batch of (image, caption) prompts."""

    def __init__(self, location: str, device: torch.device, max_new_tokens: int, num_beams: int):
        from transformers import AutoProcessor, Florence2ForConditionalGeneration

        self.device, self.max_new_tokens, self.num_beams = device, max_new_tokens, num_beams
        self.model = Florence2ForConditionalGeneration.from_pretrained(location).to(device).eval()
        self.processor = AutoProcessor.from_pretrained(location)

    def __call__(self, images: Sequence[Image.Image], captions: Sequence[str]) -> list[dict[str, Any]]:
        rgb = [im.convert("RGB") for im in images]
        # Prompts of different lengths are padded; pixel_values (B, 3, S, S) at the processor's size.
        inputs = self.processor(text=[TASK + c for c in captions], images=rgb, return_tensors="pt", padding=True)
        with torch.inference_mode(), _autocast(self.device):
            ids = self.model.generate(**inputs.to(self.device), max_new_tokens=self.max_new_tokens,
                                      num_beams=self.num_beams, do_sample=False)  # (B, T)
        # Location tokens <loc_k> are added (not special) tokens: kept by the decode, turned into
        # pixel boxes by post_process_generation at each image's own size.
        texts = self.processor.batch_decode(ids, skip_special_tokens=False)
        return [self.processor.post_process_generation(text, task=TASK, image_size=im.size)
                for text, im in zip(texts, rgb, strict=True)]


def build_sam2_model(config: str, checkpoint: Path | None) -> torch.nn.Module:
    """SAM 2 from a config bundled with the sam2 package, on the CPU in eval mode. Weights come
    from ``checkpoint`` (its ``model`` state dict, loaded with ``weights_only=True`` so no
    pickled code runs); ``None`` keeps the fresh random weights (tests, shape checks)."""
    from sam2.build_sam import build_sam2

    model = build_sam2(config, ckpt_path=None, device="cpu")
    if checkpoint is not None:
        try:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        except Exception as err:  # unpickling refusals and corrupt files alike
            raise InputError(f"{checkpoint}: not a loadable SAM 2 checkpoint ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200]})") from None
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise InputError(f"{checkpoint}: a SAM 2 checkpoint holds its weights under the key 'model'")
        try:
            model.load_state_dict(state["model"], strict=True)
        except RuntimeError as err:
            raise InputError(f"{checkpoint}: does not fit detect.sam2_config {config} "
                             f"({str(err).splitlines()[0][:200]})") from None
    return model.eval()


class Sam2Segmenter:
    """SAM 2's image predictor: one image embedding per image, one mask per box prompt."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from sam2.sam2_image_predictor import SAM2ImagePredictor

        self.device = device
        self.predictor = SAM2ImagePredictor(model.to(device))

    def __call__(self, image: Image.Image, boxes: np.ndarray) -> np.ndarray:
        rgb = np.array(image.convert("RGB"))  # (H, W, 3) uint8, writable: sam2 wraps it in a tensor
        height, width = rgb.shape[:2]
        with torch.inference_mode(), _autocast(self.device):
            self.predictor.set_image(rgb)
            # (N, 1, H, W), or (1, H, W) for one box, thresholded at the predictor's mask_threshold
            masks, _, _ = self.predictor.predict(box=np.asarray(boxes, dtype=np.float32), multimask_output=False)
        return masks.reshape(len(boxes), height, width) > 0.5


def load_models(
    cfg: DetectConfig, device: torch.device, grounder: Grounder | None = None, segmenter: Segmenter | None = None
) -> tuple[Grounder, Segmenter]:
    """The grounder and segmenter of ``cfg`` (those not given): every missing one is resolved
    (failing fast, naming it) before any is loaded."""
    grounding = resolve_grounding_model(cfg.grounding_model) if grounder is None else ""
    checkpoint = resolve_sam2_checkpoint(cfg.sam2_checkpoint) if segmenter is None else None
    if grounder is None:
        grounder = FlorenceGrounder(grounding, device, cfg.max_new_tokens, cfg.num_beams)
    if segmenter is None:
        segmenter = Sam2Segmenter(build_sam2_model(cfg.sam2_config, checkpoint), device)
    return grounder, segmenter


# --------------------------------------------------------------------------- shards


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the token spans depend on: the tokenizer's full definition (fast tokenizers),
    without the truncation/padding state a previous call leaves on it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return f"{type(tokenizer).__name__}:{tokenizer.name_or_path}:{len(tokenizer)}"
    spec = json.loads(backend.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    return sha256_json(spec)


def _file_digest(path: Path) -> str:
    try:
        return sha256_file(path)
    except OSError as err:  # unreadable now: the hash changes once the file is repaired
        return f"unreadable:{type(err).__name__}"


def _shard_hash(key: dict[str, Any], images: list[dict[str, Any]], by_image: dict[str, list[dict[str, Any]]],
                data_dir: Path) -> str:
    return sha256_json({
        **key,
        "images": [[r["image_id"], r["file"], _file_digest(data_dir / r["file"])] for r in images],
        "pairs": [[p["pair_id"], p["caption"]] for r in images for p in by_image[r["image_id"]]],
    })


def _load_shard(path: Path, expected: str, out_dir: Path) -> tuple[list[dict[str, Any]], dict[str, int]] | None:
    """A finished shard's rows and counts, or None when it must be (re)done: missing, corrupt,
    made from other inputs, or one of its crops is gone."""
    if not path.is_file():
        return None
    try:
        header, *rows = read_jsonl(path)
    except ValueError as err:
        logger.warning("detect_objects: %s is corrupt, redoing it (%s)", path, err)
        return None
    if not isinstance(header, dict) or header.get("hash") != expected or not isinstance(header.get("stats"), dict):
        logger.info("detect_objects: %s was made from other inputs or config, redoing it", path)
        return None
    if any(not (out_dir / o["crop"]).is_file() for row in rows for o in row["objects"]):
        logger.warning("detect_objects: %s names missing crops, redoing it", path)
        return None
    return rows, header["stats"]


def _objects_of_image(
    image: Image.Image, pairs: list[dict[str, Any]], outputs: list[dict[str, Any]], segmenter: Segmenter,
    cfg: DetectConfig, tokenizer: PreTrainedTokenizerBase, max_seq_len: int, out_dir: Path, stats: dict[str, int],
) -> list[dict[str, Any]]:
    """The ``objects.jsonl`` rows of one image's pairs (crops written)."""
    width, height = image.size
    candidates: list[tuple[dict[str, Any], list[tuple[GroundedPhrase, tuple[int, int]]]]] = []
    for pair, output in zip(pairs, outputs, strict=True):
        grounded, dropped = parse_grounding(output, pair["caption"], width, height)
        stats["phrases_grounded"] += len(grounded)
        stats["phrases_unmatched"] += dropped["unmatched"]
        stats["phrases_repeated"] += dropped["repeats"]
        stats["bad_boxes"] += dropped["bad_boxes"]
        offsets = caption_offsets(tokenizer, pair["caption"], max_seq_len)
        kept = []
        for phrase in grounded:
            span = char_span_to_token_span(offsets, phrase.start, phrase.end)
            if span is None:  # cut by max_seq_len (MCSEO drops it)
                stats["phrases_truncated"] += 1
                continue
            kept.append((phrase, span))
        if len(kept) < cfg.min_objects:
            stats["pairs_too_few_objects"] += 1
            continue
        candidates.append((pair, kept))
    if not candidates:  # no image embedding needed
        return []
    # Every box of every caption of the image in one predictor call: (N, 4) → masks (N, H, W).
    boxes = np.array([p.box for _, kept in candidates for p, _ in kept], dtype=np.float32)
    masks = segmenter(image, boxes)
    if masks.shape != (len(boxes), height, width):
        raise RuntimeError(f"segmenter returned masks {masks.shape} for {len(boxes)} boxes on a {width}x{height} image")
    rows, m = [], 0
    for pair, kept in candidates:
        objects = []
        for phrase, span in kept:
            mask, m = masks[m], m + 1
            x0, y0, x1, y1 = phrase.box
            if not mask[y0:y1, x0:x1].any():  # a fully transparent crop carries no object
                stats["masks_empty"] += 1
                continue
            objects.append((phrase, span, mask))
        if len(objects) < cfg.min_objects:
            stats["pairs_too_few_objects"] += 1
            continue
        records = []
        for k, (phrase, span, mask) in enumerate(objects):
            crop = f"crops/{pair['pair_id']}-o{k}.png"  # per pair: grounding is per caption
            with atomic_path(out_dir / crop) as tmp:
                masked_crop(image, mask, phrase.box).save(tmp, format="PNG")
            records.append(object_record(k, crop, phrase.box, pair["caption"], phrase.start, phrase.end, span))
        rows.append({"pair_id": pair["pair_id"], "image_id": pair["image_id"], "objects": records})
        stats["pairs_kept"] += 1
    return rows


@dataclass(frozen=True)
class ShardModels:
    """What a shard runs: the phrase grounder, the segmenter, and the student's tokenizer at its
    ``max_seq_len`` (an object's phrase as a token span of the caption)."""

    grounder: Grounder
    segmenter: Segmenter
    tokenizer: PreTrainedTokenizerBase
    max_seq_len: int


def _detect_shard(
    images: list[dict[str, Any]], by_image: dict[str, list[dict[str, Any]]], data_dir: Path, out_dir: Path,
    cfg: DetectConfig, models: ShardModels, progress: tqdm,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    stats = dict.fromkeys(STAT_KEYS, 0)
    rows: list[dict[str, Any]] = []
    for start in range(0, len(images), cfg.batch_size):
        loaded = []
        for row in images[start : start + cfg.batch_size]:
            pairs = by_image[row["image_id"]]
            stats["images_in"] += 1
            stats["pairs_in"] += len(pairs)
            path = data_dir / row["file"]
            try:
                image = open_image(path, "rerun the download stage").convert("RGB")
            except (FileNotFoundError, ValueError) as err:  # skipped and counted, never fatal
                logger.warning("detect_objects: skipping image %s: %s", path, err)
                stats["images_unreadable"] += 1
                stats["pairs_unreadable_image"] += len(pairs)
                progress.update(1)
                continue
            loaded.append((image, pairs))
        if not loaded:
            continue
        # One prompt per caption: the image repeats for each of its captions.
        captions = [p["caption"] for _, pairs in loaded for p in pairs]
        outputs = models.grounder([image for image, pairs in loaded for _ in pairs], captions)
        if len(outputs) != len(captions):
            raise RuntimeError(f"grounder returned {len(outputs)} outputs for {len(captions)} captions")
        at = 0
        for image, pairs in loaded:
            rows += _objects_of_image(image, pairs, outputs[at : at + len(pairs)], models.segmenter, cfg,
                                      models.tokenizer, models.max_seq_len, out_dir, stats)
            at += len(pairs)
            progress.update(1)
    return rows, stats


def detect_objects_sam2(
    data_dir: str | Path,
    out_dir: str | Path,
    cfg: DetectConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    device: str = "cpu",
    grounder: Grounder | None = None,
    segmenter: Segmenter | None = None,
) -> dict[str, Any]:
    """MCSEO §3.3 image–caption pairs → object–phrase pairs with Florence-2 and SAM 2.

    Writes ``objects.jsonl`` (the annotations backend's rows), ``crops/<pair_id>-o<k>.png``
    and ``shards/`` under ``out_dir``; returns counts for metrics. Models are resolved before
    any compute (offline and not cached: :class:`ModelUnavailableError`) and only loaded when
    a shard is left to do. ``grounder`` / ``segmenter`` replace the models (same contracts as
    :class:`FlorenceGrounder` / :class:`Sam2Segmenter`). An unreadable image is logged,
    skipped and counted (``images_unreadable``).
    """
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    images = read_jsonl(data_dir / "images.jsonl")
    pairs = read_jsonl(data_dir / "pairs.jsonl")
    known = {r["image_id"] for r in images}
    by_image: dict[str, list[dict[str, Any]]] = {}
    for pair in pairs:
        if not pair["caption"].strip():
            raise InputError(f"{data_dir / 'pairs.jsonl'}: pair {pair['pair_id']} has an empty caption")
        if pair["image_id"] not in known:
            raise MissingEntry(f"{data_dir / 'pairs.jsonl'}: pair {pair['pair_id']} names unknown image")
        by_image.setdefault(pair["image_id"], []).append(pair)
    order = [r for r in images if r["image_id"] in by_image]  # images with captions, in images.jsonl order
    shards = [order[i : i + cfg.shard_size] for i in range(0, len(order), cfg.shard_size)]
    # batch_size and shard_size do not change what a shard holds: a rerun with a smaller batch resumes.
    key = {"format": SHARD_FORMAT, "max_seq_len": max_seq_len, "tokenizer": tokenizer_fingerprint(tokenizer),
           "detect": {k: v for k, v in to_dict(cfg).items() if k not in ("batch_size", "shard_size")}}
    hashes = [_shard_hash(key, shard, by_image, data_dir) for shard in shards]
    shard_dir = out_dir / "shards"
    done = [_load_shard(shard_dir / f"shard-{i:05d}.jsonl", h, out_dir) for i, h in enumerate(hashes)]
    reused = sum(d is not None for d in done)
    if reused < len(shards):
        grounder, segmenter = load_models(cfg, resolve_device(device), grounder, segmenter)

    progress = tqdm(total=len(order), initial=sum(len(s) for s, d in zip(shards, done, strict=True) if d is not None),
                    desc="detect_objects: sam2", unit="image")
    with progress:
        for i, shard in enumerate(shards):
            if done[i] is not None:
                continue
            rows, stats = _detect_shard(shard, by_image, data_dir, out_dir, cfg,
                                        ShardModels(grounder, segmenter, tokenizer, max_seq_len), progress)
            # Crops are on disk; the shard file, written last and atomically, marks the shard done.
            write_jsonl(shard_dir / f"shard-{i:05d}.jsonl",
                        [{"format": SHARD_FORMAT, "shard": i, "hash": hashes[i], "stats": stats}, *rows])
            done[i] = (rows, stats)
    if shard_dir.is_dir():  # shards of a longer input or smaller shard_size
        for path in shard_dir.iterdir():
            match = _SHARD_NAME.match(path.name)
            if match and int(match.group(1)) >= len(shards):
                path.unlink()

    position = {p["pair_id"]: i for i, p in enumerate(pairs)}
    rows = sorted((row for shard_rows, _ in done for row in shard_rows), key=lambda r: position[r["pair_id"]])
    totals: dict[str, Any] = {k: sum(int(s.get(k, 0)) for _, s in done) for k in STAT_KEYS}
    totals["objects"] = totals["crops"] = sum(len(r["objects"]) for r in rows)
    totals |= {"shards": len(shards), "shards_reused": reused}
    write_objects(out_dir, rows)
    return totals
