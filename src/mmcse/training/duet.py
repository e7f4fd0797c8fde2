"""The ``train`` stage for the retrieval methods on image–caption pairs: ``train.method: duet``, DUET
(`mmcse.methods.duet`), ``vsepp``, VSE++ (`mmcse.methods.vsepp`: its own word vocabulary,
`mmcse.models.vocabulary`, GRU and image projection, the hinge of ``loss.vsepp``), and ``vsrn``, VSRN
(`mmcse.models.vsrn`: VSE++'s text side, region reasoning, a caption generator; `mmcse.methods.vsrn`).

DUET is an image–text retrieval model, not a sentence encoder, so its loop differs from the
students' (`mmcse.training.loop`) in what it reads and scores, and shares everything else:

* batches are image–caption pairs only (no text corpus), ``train.batch_size`` pairs each, in an
  order that is a pure function of (seed, epoch): a resumed run replays the same batches;
* an image's regions and boxes come from the ``cache_regions`` stage's region set
  (`mmcse.detection.regions.RegionStore`), the captions from the token cache;
* the loss is `mmcse.methods.duet.duet_objective` (Eq. 33) with ``loss.duet``; two captions of
  one image in a batch are not each other's negatives (the hinge's ``ignore`` mask);
* the dev score is the R@K rsum on the retrieval val split (`mmcse.evaluation.retrieval`); the
  best one is kept in ``<out>/best``, a resume point in ``<out>/last`` (the same writers, checks and
  MLflow run continuation as the students': `mmcse.training.loop`).

``<out>/best`` is the text stream as an HF folder (``config.json``, ``model.safetensors``, the
tokenizer) plus ``duet.safetensors`` (every other DUET parameter) and ``duet.json`` (the
architecture), so `load_duet` rebuilds the model without params.yaml; a VSE++ (VSRN) ``best`` holds
its vocabulary (``tokenizer.json``), ``vsepp.safetensors`` and ``vsepp.json`` (``vsrn.*``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mmcse.config import Config, DuetModelConfig, VseppModelConfig, VsrnModelConfig, reads_pixels
from mmcse.data.images import ImagePixels, OneAhead
from mmcse.detection.regions import RegionStore
from mmcse.errors import InputError
from mmcse.evaluation.retrieval import check_text_image, retrieval_metrics
from mmcse.integrity.files import check_model_folder
from mmcse.io import read_json, read_jsonl, write_json
from mmcse.models.cnn import RESNET_WIDTH
from mmcse.models.duet import DuetArchitecture, DuetModel
from mmcse.models.precision import autocast, grad_scaler
from mmcse.models.student import load_backbone, load_tokenizer, save_tokenizer
from mmcse.models.tokens import TokenTable, cached_tokens, to_device
from mmcse.models.vocabulary import word_tokenizer
from mmcse.models.vsepp import VseppModel
from mmcse.models.vsrn import VsrnModel
from mmcse.teachers.encoders import build_resnet50, resolve_resnet50
from mmcse.training.checkpoints import Checkpoints, TrainState
from mmcse.training.compiled import STEP
from mmcse.training.duet_step import RetrievalModel, RetrievalStep
from mmcse.training.engine import (
    DevScore,
    Hooks,
    TrainResult,
    TrainTask,
    Update,
    build_optimizer,
    fit,
    seed_kernels,
    training_device,
)

log = logging.getLogger(__name__)
DUET_WEIGHTS, DUET_META = "duet.safetensors", "duet.json"
BEST_REQUIRED = ("config.json", "model.safetensors", DUET_WEIGHTS, DUET_META)
VSEPP_WEIGHTS, VSEPP_META = "vsepp.safetensors", "vsepp.json"
VSRN_WEIGHTS, VSRN_META = "vsrn.safetensors", "vsrn.json"
# the retrieval models on their own word vocabulary: method → (class, weights file, architecture file)
WORD_MODELS: dict[str, tuple[type[VseppModel], str, str]] = {
    "vsrn": (VsrnModel, VSRN_WEIGHTS, VSRN_META), "vsepp": (VseppModel, VSEPP_WEIGHTS, VSEPP_META)}


def best_checkpoint_files(method: str) -> tuple[str, ...]:
    """The files a best checkpoint of retrieval method ``method`` must hold (DUET's, VSE++'s, VSRN's)."""
    if method in WORD_MODELS:
        return ("tokenizer.json", *WORD_MODELS[method][1:])
    return BEST_REQUIRED
TEXT_PREFIX = "text."  # the text stream's parameters: saved as the HF folder, not in duet.safetensors
DEV_METRIC = "rsum"  # the dev score: R@1+5+10 both ways on the val split (×100, max 600)


def duet_architecture(d: DuetModelConfig, region_dim: int) -> dict[str, Any]:
    """`DuetModel`'s keyword arguments from ``model.duet`` (``region_dim``: the region set's width)."""
    return {"region_dim": int(region_dim), "visual_layers": d.visual_layers, "shared_layers": d.shared_layers,
            "joint_dim": d.joint_dim, "box_layer": d.box_layer or None, "heads": d.heads, "ff_dim": d.ff_dim,
            "dropout": d.dropout, "visual_dim": d.visual_dim or None, "region_norm": d.region_norm,
            "tie_shared": d.tie_shared, "spatial": d.spatial}


def vsepp_architecture(v: VseppModelConfig, region_dim: int, tokenizer: Any, cnn: str | None = None) -> dict[str, Any]:
    """`VseppModel`'s keyword arguments from ``model.vsepp`` and the caption vocabulary ``tokenizer``;
    ``cnn``: the ResNet it runs on pixels (``model.vsepp.image_input: pixels``), None on region features."""
    pixels = {"cnn": cnn, "crop_size": v.crop_size} if cnn else {}
    return {"vocab_size": len(tokenizer), "region_dim": int(region_dim), "word_dim": v.word_dim,
            "joint_dim": v.joint_dim, "gru_layers": v.gru_layers, "pad_id": int(tokenizer.pad_token_id)} | pixels


def vsrn_architecture(v: VsrnModelConfig, region_dim: int, tokenizer: Any, pairs: str) -> dict[str, Any]:
    """`VsrnModel`'s keyword arguments from ``model.vsrn``, the vocabulary and the data's pairs (its variant)."""
    return {"vocab_size": len(tokenizer), "region_dim": int(region_dim), "word_dim": v.word_dim,
            "joint_dim": v.joint_dim, "gru_layers": v.gru_layers, "pad_id": int(tokenizer.pad_token_id),
            "gcn_layers": v.gcn_layers, "variant": v.resolved_variant(pairs), "region_l2": v.region_l2,
            "caption_hidden": v.caption_hidden, "caption_word_dim": v.caption_word_dim,
            "caption_dropout": v.caption_dropout, "caption_max_len": v.caption_max_len,
            "end_id": int(tokenizer.eos_token_id)}


def save_word_model(model: VseppModel, tokenizer: Any, architecture: dict[str, Any], folder: Path) -> None:
    """A model on its own word vocabulary, VSE++ or VSRN: its vocabulary (``tokenizer.json``), weights
    (``vsepp.safetensors``, ``vsrn.safetensors``) and architecture (``vsepp.json``, ``vsrn.json``)."""
    _, weights, meta = WORD_MODELS["vsrn" if isinstance(model, VsrnModel) else "vsepp"]
    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, folder)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / weights))
    write_json(folder / meta, {"architecture": architecture})


def save_duet(model: DuetModel, tokenizer: Any, architecture: dict[str, Any], folder: Path) -> None:
    """The text stream as an HF folder, the rest in ``duet.safetensors``, the architecture in ``duet.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    model.text.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    rest = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith(TEXT_PREFIX)}
    save_file(rest, str(folder / DUET_WEIGHTS))
    write_json(folder / DUET_META, {"architecture": architecture})


def load_duet(folder: str | Path, device: torch.device | str = "cpu") -> tuple[RetrievalModel, Any]:
    """A DUET checkpoint folder (`save_duet`), or a VSE++ / VSRN one (`save_word_model`), as ``(model in
    eval mode on device, tokenizer)``; a damaged or foreign folder is named before anything loads."""
    from transformers import AutoModel, AutoTokenizer

    folder = Path(folder)
    for method, (cls, weights, meta) in WORD_MODELS.items():
        if not (folder / meta).is_file():
            continue
        check_model_folder(folder, "retrain it (dvc repro train)", required=best_checkpoint_files(method))
        model = cls.from_architecture(read_json(folder / meta)["architecture"])
        try:
            model.load_state_dict(load_file(str(folder / weights)))
        except RuntimeError as err:
            raise InputError(f"{folder / weights}: does not match {folder / meta} "
                             f"({str(err).splitlines()[0]}); retrain it") from None
        return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)
    check_model_folder(folder, "retrain it (dvc repro train)", required=BEST_REQUIRED)
    architecture = read_json(folder / DUET_META)["architecture"]
    # built as `mmcse.models.student.load_backbone` builds it (no pooler: DUET reads the token states)
    model = DuetModel(AutoModel.from_pretrained(folder, add_pooling_layer=False), DuetArchitecture(**architecture))
    rest = load_file(str(folder / DUET_WEIGHTS))
    missing, unexpected = model.load_state_dict(rest, strict=False)
    missing = [k for k in missing if not k.startswith(TEXT_PREFIX)]
    if missing or unexpected:
        raise InputError(f"{folder / DUET_WEIGHTS}: does not match {folder / DUET_META} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}); retrain it")
    return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)


# --------------------------------------------------------------------------- data


ImageSource = RegionStore | ImagePixels  # what a retrieval model reads of an image: region features or pixels


@dataclass
class RetrievalSplit:
    """An image set with every caption: the val split (dev score) or the test split (evaluate)."""

    image_ids: list[str]
    captions: list[str]
    text_image: np.ndarray  # (N_txt,) row of each caption's image in image_ids
    regions: ImageSource

    @classmethod
    def load(cls, images_file: Path, captions_file: Path, regions: ImageSource) -> RetrievalSplit:
        for f in (images_file, captions_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing; rerun the download stage (dvc repro download)")
        image_ids = [row["image_id"] for row in read_jsonl(images_file)]
        rows = read_jsonl(captions_file)
        if not image_ids or not rows:
            raise InputError(f"{images_file}: no images or captions in this split; train.method duet needs a "
                             "retrieval val split (data.splits must not include val)")
        index = {image_id: i for i, image_id in enumerate(image_ids)}
        unknown = sorted({row["image_id"] for row in rows} - index.keys())
        if unknown:
            raise InputError(f"{captions_file}: captions of images not in {images_file.name}: {unknown[:5]}")
        text_image = check_text_image([index[row["image_id"]] for row in rows], len(rows), len(image_ids))
        regions.row_indices(image_ids)  # every image has regions, or a KeyError names the set
        return cls(image_ids, [row["caption"] for row in rows], text_image, regions)


@dataclass
class DuetData:
    """Training pairs with their images' rows (in a region set, or among the images read as pixels),
    and the val split."""

    captions: list[str]
    image_ids: list[str]
    regions: ImageSource
    region_rows: np.ndarray  # (N_pairs,) row of each pair's image in ``regions``
    val: RetrievalSplit

    @classmethod
    def load(cls, data_dir: Path, region_sets: dict[str, Path], pixels: tuple[int, int] | None = None) -> DuetData:
        """``pixels = (crop, workers)``: the images' files are read (`ImagePixels`), not region sets."""
        if pixels is None:
            for split in ("train", "val"):
                if split not in region_sets:
                    raise FileNotFoundError(f"no {split} region set: run the cache_regions stage "
                                            "(dvc repro cache_regions)")
        pairs = read_jsonl(data_dir / "pairs.jsonl")
        if not pairs:
            raise InputError(f"{data_dir / 'pairs.jsonl'}: no image–caption pairs; train.method duet needs them")
        image_ids = [p["image_id"] for p in pairs]
        val_images = data_dir / "retrieval" / "val_images.jsonl"
        val_captions = data_dir / "retrieval" / "val_captions.jsonl"
        if pixels is None:
            regions: ImageSource = RegionStore.open(region_sets["train"])
            val_source: ImageSource = RegionStore.open(region_sets["val"])
        else:
            regions = ImagePixels(data_dir, image_ids, *pixels)
            val_ids = [row["image_id"] for row in read_jsonl(val_images)] if val_images.is_file() else []
            val_source = ImagePixels(data_dir, val_ids, *pixels)
        val = RetrievalSplit.load(val_images, val_captions, val_source)
        return cls([p["caption"] for p in pairs], image_ids, regions, regions.row_indices(image_ids), val)


def region_batch(store: RegionStore, rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(regions (B, n, d), boxes (B, n, 5), mask (B, n))`` of region-set rows, on ``device``."""
    regions, boxes, mask = store.take(rows)
    return tuple(to_device(torch.from_numpy(np.ascontiguousarray(a)), device) for a in (regions, boxes, mask))


def same_image_mask(image_ids: Sequence[str], device: torch.device) -> torch.Tensor:
    """``(B, B)`` True where two different pairs of the batch show the same image: a caption of
    the image is no negative for it (Eq. 29's hardest negative must be another image's)."""
    codes = {image_id: i for i, image_id in enumerate(dict.fromkeys(image_ids))}
    ids = torch.tensor([codes[i] for i in image_ids], device=device)
    same = ids[:, None] == ids[None, :]
    return same & ~torch.eye(len(image_ids), dtype=torch.bool, device=device)


# --------------------------------------------------------------------------- encoding + dev score


@torch.no_grad()
def encode_split_images(model: RetrievalModel, regions: ImageSource, image_ids: Sequence[str], batch_size: int,
                        device: torch.device, precision: str = "fp32") -> np.ndarray:
    """v_I (Eq. 27) of every image, ``(N, joint_dim)`` float32 (raw: retrieval normalises); images read
    as pixels are center-cropped (`ImagePixels.eval_batch`)."""
    rows = regions.row_indices(image_ids)
    out = []
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        if isinstance(regions, ImagePixels):
            r, b, m = to_device(regions.eval_batch(part), device), None, None
        else:
            r, b, m = region_batch(regions, part, device)
        with autocast(precision, device):
            v_img, _ = model.encode_image(r, b, m)
        out.append(v_img.float().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, model.joint_dim), np.float32)


@torch.no_grad()
def encode_split_captions(model: RetrievalModel, tokens: TokenTable, batch_size: int, device: torch.device,
                          precision: str = "fp32") -> np.ndarray:
    """v_C (Eq. 27) of every caption of a token table, ``(N, joint_dim)`` float32."""
    n = len(tokens.lengths)
    out = []
    for start in range(0, n, batch_size):
        batch = tokens.batch(np.arange(start, min(start + batch_size, n)), device)
        with autocast(precision, device):
            v_txt = model.encode_text(batch["input_ids"], batch["attention_mask"])
        out.append(v_txt.float().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, model.joint_dim), np.float32)


def split_embeddings(model: RetrievalModel, split: RetrievalSplit, tokens: TokenTable, batch_size: int,
                     device: torch.device, precision: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """``(image_emb (N_img, d), text_emb (N_txt, d))`` of a retrieval split, the model left as it was."""
    was_training = model.training
    model.eval()
    try:
        images = encode_split_images(model, split.regions, split.image_ids, batch_size, device, precision)
        texts = encode_split_captions(model, tokens, batch_size, device, precision)
    finally:
        model.train(was_training)
    return images, texts


# --------------------------------------------------------------------------- training


def imagenet_cnn(cfg: Config) -> torch.nn.Module:
    """``regions.grid_model`` with ``regions.grid_weights`` (ImageNet's; `resolve_resnet50` says where they
    are or why not, offline included): VSE++'s CNN before training."""
    r = cfg.regions
    path, _, _ = resolve_resnet50(r.grid_weights, r.grid_model, "regions.grid_weights")
    return build_resnet50(path, r.grid_model)


def finetune_rate(scheduler: torch.optim.lr_scheduler.LambdaLR, from_step: int, factor: float) -> None:
    """From step ``from_step`` on, every group's rate is ``factor`` × its base rate (VSE++'s fine-tuning
    rate, constant); before it the scheduler's own schedule."""
    scheduler.lr_lambdas = [lambda step, f=f: f(step) if step < from_step else factor for f in scheduler.lr_lambdas]


def start_finetuning(model: VseppModel, optimizer: torch.optim.Optimizer, state: TrainState,
                     checkpoints: Checkpoints) -> None:
    """VSE++'s "FT": the frozen phase's best weights (held, or its ``best/``), the CNN unfrozen, fresh Adam
    moments (the authors resume into a new optimizer) and a fresh best score (their ``best_rsum = 0``):
    the result is the fine-tuning's best dev step."""
    best = checkpoints.best_weights
    if best is None:
        best = load_file(str(checkpoints.best / VSEPP_WEIGHTS))
    model.load_state_dict(best)
    optimizer.state.clear()
    state.best_score, state.best_step = -math.inf, -1
    model.cnn.requires_grad_(True)
    log.info("step %d: fine-tuning the CNN from the frozen phase's best weights", state.step)


class RetrievalTask(TrainTask):
    """A retrieval model's part of the training loop (DUET, VSE++, VSRN): image–caption pairs in an order that is a
    pure function of (seed, epoch), their images' regions (or pixels, random crops decoded a step ahead), the
    val R@K rsum as the dev score (``dev_rsum``, ``dev_<direction>_R<k>`` logged), the best checkpoint as
    `save_duet` / `save_word_model` write it, and VSE++'s fine-tuning phase."""

    dev_label = f"dev_{DEV_METRIC}"

    def __init__(self, cfg: Config, data_dir: Path, region_sets: dict[str, Path]) -> None:
        self.cfg, self.region_sets = cfg, region_sets
        self.device = device = training_device(cfg)
        self.pixels = pixels = reads_pixels(cfg)  # VSE++ with its CNN in the loop: images in, no region set
        # pixels are decoded in teachers.num_workers threads (the setting for every image reader)
        self.data = data = DuetData.load(data_dir, region_sets,
                                         (cfg.model.vsepp.crop_size, cfg.teachers.num_workers) if pixels else None)
        seed_kernels(cfg, device)
        self.model, self.tokenizer, self.architecture, self.save_model = retrieval_model(cfg, data, device)
        self.best_required = best_checkpoint_files(cfg.train.method)
        token_dir = data_dir.parent / "tokens"
        self.captions = cached_tokens(token_dir, "captions", self.tokenizer, data.captions, cfg.model.max_seq_len)
        self.val_tokens = cached_tokens(token_dir, "val_captions", self.tokenizer, data.val.captions,
                                        cfg.model.max_seq_len)

        b = cfg.train.batch_size
        self.per_epoch = len(data.captions) // b
        if self.per_epoch == 0:
            raise InputError(f"train.batch_size={b} exceeds the {len(data.captions)} image–caption pairs")
        # VSE++'s fine-tuning: train.epochs with the CNN frozen, then model.vsepp.finetune_epochs more with it
        self.finetune_epochs = cfg.model.vsepp.finetune_epochs if pixels else 0
        self.frozen_steps = self.per_epoch * cfg.train.epochs  # the step the fine-tuning starts at
        total = self.per_epoch * (cfg.train.epochs + self.finetune_epochs)
        self.total = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        # weight_decay 0: Adam, as §5.2; the schedule spans the frozen steps, the fine-tuning's rate is constant
        optimizer, self.scheduler = build_optimizer(self.model, cfg.train, min(self.total, self.frozen_steps),
                                                    device, self.per_epoch)
        if self.finetune_epochs:
            finetune_rate(self.scheduler, self.frozen_steps,
                          cfg.model.vsepp.finetune_learning_rate / cfg.train.learning_rate)
        self.update = Update(cfg.train, optimizer, grad_scaler(cfg.train.precision, device), device)
        # train.compile: step (DUET; the config refuses VSE++, VSRN): one graph, full-width captions
        self.full_width = cfg.train.compile == STEP
        self.train_step = RetrievalStep(self.model, cfg.loss, self.update, compiled=self.full_width)
        # random crops of (seed, step), a resume replays them; decoded one step ahead, while this one trains
        self.crops = OneAhead(lambda step: data.regions.train_batch(data.region_rows[self.step_rows(step)],
                                                                    cfg.base.seed, step)) \
            if isinstance(data.regions, ImagePixels) else None

    @functools.lru_cache(maxsize=2)  # noqa: B019 (the task lives as long as its run)
    def epoch_order(self, epoch: int) -> np.ndarray:
        """The pairs' order in ``epoch``: a pure function of (seed, epoch), so resumable."""
        g = torch.Generator().manual_seed(self.cfg.base.seed * 100_003 + epoch)
        return torch.randperm(len(self.data.captions), generator=g).numpy()

    def step_rows(self, step: int) -> np.ndarray:
        """``(B,)`` pair rows of a step."""
        epoch, offset = divmod(step, self.per_epoch)
        b = self.cfg.train.batch_size
        return self.epoch_order(epoch)[offset * b : (offset + 1) * b]

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], tuple, torch.Tensor]:
        idx, device = self.step_rows(step), self.device
        if self.crops is not None:
            pixels_now = self.crops.get(step, step + 1 if step + 1 < self.total else None)
            images = (to_device(pixels_now, device), None, None)
        else:
            images = region_batch(self.data.regions, self.data.region_rows[idx], device)
        ignore = same_image_mask([self.data.image_ids[i] for i in idx], device)
        return self.captions.batch(idx, device, full_width=self.full_width), images, ignore

    def step(self, batch: tuple[dict[str, torch.Tensor], tuple, torch.Tensor], seed: int,
             ranks: tuple[int, int]) -> dict[str, torch.Tensor]:
        captions, images, ignore = batch
        return self.train_step(captions, images, ignore, seed, ranks)

    def dev(self) -> DevScore:
        cfg = self.cfg
        images, texts = split_embeddings(self.model, self.data.val, self.val_tokens, cfg.evaluate.batch_size,
                                         self.device, cfg.train.precision)
        scores = retrieval_metrics(images, texts, self.data.val.text_image, cfg.evaluate.retrieval.block_size)
        return DevScore(scores[DEV_METRIC], logged={f"dev_{k}": v for k, v in scores.items()})

    def save_best(self, tmp: Path, state: TrainState) -> None:
        self.save_model(self.model, self.tokenizer, self.architecture, tmp)
        write_json(tmp / "train_state.json", {"step": state.best_step, "dev": state.best_score, "dev_metric":
                                              f"val {DEV_METRIC}", "method": self.cfg.train.method, "image_head": None,
                                              "region_sets": {k: v.name for k, v in self.region_sets.items()},
                                              "image_input": "pixels" if self.pixels else "regions"})

    def restored(self, state: TrainState) -> None:
        if self.pixels:  # the CNN learns only once the fine-tuning has started (frozen: no graph through it at all)
            self.model.cnn.requires_grad_(self.finetune_epochs > 0 and state.step > self.frozen_steps)

    def before_step(self, state: TrainState, checkpoints: Checkpoints) -> None:
        if self.finetune_epochs and state.step == self.frozen_steps:
            start_finetuning(self.model, self.update.optimizer, state, checkpoints)

    def ends_phase(self, step: int) -> bool:
        return step == self.frozen_steps  # the frozen phase ends with a dev score and a resume point

    def close(self) -> None:
        if self.crops is not None:
            self.crops.close()


def retrieval_model(cfg: Config, data: DuetData, device: torch.device) -> tuple[RetrievalModel, Any, dict[str, Any],
                                                                               Callable[..., None]]:
    """``(model on device, its tokenizer, its architecture, its checkpoint writer)`` of ``train.method``: VSE++
    (its own word vocabulary of the training captions, a GRU, a projection; on pixels with ImageNet's CNN),
    VSRN (VSE++'s vocabulary and text GRU, region reasoning, a captioner) or DUET (BERT and its streams)."""
    if cfg.train.method == "vsepp":
        tokenizer = word_tokenizer(data.captions, cfg.model.vsepp.min_word_count)
        if reads_pixels(cfg):
            architecture = vsepp_architecture(cfg.model.vsepp, RESNET_WIDTH, tokenizer, cfg.regions.grid_model)
            model: RetrievalModel = VseppModel(**architecture)
            model.cnn = imagenet_cnn(cfg)  # the same architecture, ImageNet's weights
        else:
            architecture = vsepp_architecture(cfg.model.vsepp, data.regions.dim, tokenizer)
            model = VseppModel(**architecture)
        return model.to(device), tokenizer, architecture, save_word_model
    if cfg.train.method == "vsrn":
        tokenizer = word_tokenizer(data.captions, cfg.model.vsrn.min_word_count)
        architecture = vsrn_architecture(cfg.model.vsrn, data.regions.dim, tokenizer, cfg.data.pairs)
        return VsrnModel.from_architecture(architecture).to(device), tokenizer, architecture, save_word_model
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    architecture = duet_architecture(cfg.model.duet, data.regions.dim)
    model = DuetModel(load_backbone(cfg.model, dropout=cfg.train.dropout), DuetArchitecture(**architecture)).to(device)
    if cfg.train.dropout_rng == "per_row":  # each pair's masks from (step, row, layer) alone: train.devices
        model.install_keyed_dropout()
    return model, tokenizer, architecture, save_duet


def train_duet(cfg: Config, data_dir: str | Path, region_sets: dict[str, Path], out_dir: str | Path,
               hooks: Hooks | None = None) -> TrainResult:
    """Train DUET, VSE++ or VSRN (`RetrievalTask` in `mmcse.training.engine.fit`) on ``<data_dir>/pairs.jsonl``
    with the region sets ``region_sets`` (``train``, ``val``: folders of `RegionStore`); the best val rsum's
    weights go to ``out_dir/best`` (`save_duet`), a resume point to ``out_dir/last``. Logged: the loss terms
    ``loss/hinge|box|norm|loss``, dev ``dev_rsum`` and ``dev_<direction>_R<k>``; the history's ``dev`` entries
    are val rsums."""
    return fit(RetrievalTask(cfg, Path(data_dir), region_sets), cfg, out_dir, hooks)
