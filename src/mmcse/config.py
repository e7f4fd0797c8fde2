"""Typed, frozen configuration parsed once from ``params.yaml``.

Every section of ``params.yaml`` maps to one frozen dataclass. Parsing walks the
dataclass fields, so an unknown key fails with the list of valid keys and a value
of the wrong type or out of range fails with the dotted key named — all before
any compute starts.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mmcse.data.senteval import TRANSFER_TASKS


class ConfigError(ValueError):
    """A params file or override that cannot be turned into a valid config."""


def _fail(where: str, key: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{where}: key '{key}': {message}")


def _check(cond: bool, where: str, key: str, message: str) -> None:
    if not cond:
        _fail(where, key, message)


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class BaseConfig:
    seed: int = 42
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    data_dir: str = "data"
    models_dir: str = "models"
    metrics_dir: str = "metrics"
    plots_dir: str = "plots"
    mlflow_tracking_uri: str = "sqlite:///mlruns/mlflow.db"
    experiment_prefix: str = "mmcse"

    def validate(self, where: str) -> None:
        _check(self.seed >= 0, where, "base.seed", "must be >= 0")
        for name in ("data_dir", "models_dir", "metrics_dir", "plots_dir", "experiment_prefix"):
            _check(bool(getattr(self, name).strip()), where, f"base.{name}", "must not be empty")


@dataclass(frozen=True)
class DemoDataConfig:
    num_images: int = 320
    captions_per_image: int = 4
    image_size: int = 64
    min_objects: int = 2
    max_objects: int = 4
    corpus_sentences: int = 6000
    sts_dev_pairs: int = 400
    sts_test_pairs: int = 800
    retrieval_images: int = 100  # the retrieval test set: scenes drawn apart from training's
    # the retrieval validation set (dev rsum picks checkpoints, e.g. DUET's): scenes apart from both
    retrieval_val_images: int = 50

    def validate(self, where: str) -> None:
        p = "data.demo."
        _check(self.num_images >= 4, where, p + "num_images", "must be >= 4")
        _check(self.captions_per_image >= 1, where, p + "captions_per_image", "must be >= 1")
        _check(32 <= self.image_size <= 512, where, p + "image_size", "must be in [32, 512]")
        _check(self.min_objects >= 1, where, p + "min_objects", "must be >= 1")
        _check(
            self.min_objects <= self.max_objects <= 6,
            where,
            p + "max_objects",
            "must be in [min_objects, 6]",
        )
        _check(self.corpus_sentences >= 1, where, p + "corpus_sentences", "must be >= 1")
        _check(self.sts_dev_pairs >= 10, where, p + "sts_dev_pairs", "must be >= 10")
        _check(self.sts_test_pairs >= 10, where, p + "sts_test_pairs", "must be >= 10")
        _check(self.retrieval_images >= 10, where, p + "retrieval_images", "must be >= 10")
        _check(self.retrieval_val_images >= 10, where, p + "retrieval_val_images", "must be >= 10")


_SHA256_HEX = set("0123456789abcdef")


@dataclass(frozen=True)
class SourceConfig:
    # Where one dataset file comes from: `url` (plain HTTP with Range resume), `hub` + `file`
    # (a Hugging Face hub dataset repo, through its cache and offline mode) or `path` (a file or
    # folder already on this machine: nothing is fetched). sha256 is checked when given and
    # every fetched file's digest is written to the download manifest either way.
    url: str = ""
    hub: str = ""
    file: str = ""
    revision: str = ""
    path: str = ""
    sha256: str = ""

    def validate(self, where: str, key: str) -> None:
        given = [name for name in ("url", "hub", "path") if getattr(self, name)]
        _check(len(given) == 1, where, key, f"needs exactly one of url, hub (+ file) or path; got {given or 'none'}")
        if self.hub:
            _check(bool(self.file), where, key + ".file", "must name the file inside the hub repo")
        if self.url:
            _check(self.url.startswith(("http://", "https://")), where, key + ".url", "must be an http(s) URL")
        if self.sha256:
            _check(len(self.sha256) == 64 and set(self.sha256.lower()) <= _SHA256_HEX, where, key + ".sha256",
                   "must be 64 hex digits (or empty: unknown, recorded after the download)")


@dataclass(frozen=True)
class SourcesConfig:
    # Karpathy's caption_datasets.zip: dataset_flickr30k.json + dataset_coco.json (splits, captions)
    karpathy_splits: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"))
    flickr30k_images: SourceConfig = field(default_factory=lambda: SourceConfig(
        hub="nlphuji/flickr30k", file="flickr30k-images.zip"))
    coco_train2014: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="http://images.cocodataset.org/zips/train2014.zip"))
    coco_val2014: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="http://images.cocodataset.org/zips/val2014.zip"))
    # Flickr30k Entities: Sentences/<id>.txt phrase markup + Annotations/<id>.xml boxes
    flickr30k_entities: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="https://github.com/BryanPlummer/flickr30k_entities/raw/master/annotations.zip"))
    wiki1m: SourceConfig = field(default_factory=lambda: SourceConfig(
        hub="princeton-nlp/datasets-for-simcse", file="wiki1m_for_simcse.txt"))
    # SimCSE's copy of the SentEval data: downstream/{STS,SICK,MR,CR,SUBJ,MPQA,SST,TREC,MRPC}
    senteval: SourceConfig = field(default_factory=lambda: SourceConfig(
        hub="princeton-nlp/datasets-for-simcse", file="senteval.tar"))

    def validate(self, where: str) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(where, f"data.sources.{f.name}")


KARPATHY_SPLITS = ("train", "restval", "val", "test")


@dataclass(frozen=True)
class DataConfig:
    # STS sets. demo: generated; senteval: STS-B dev + the seven STS test sets from
    # senteval_dir (a SentEval-layout folder, or `download`: fetch sources.senteval).
    source: Literal["demo", "senteval"] = "demo"
    senteval_dir: str = "../shared/data/senteval"
    # SentEval transfer tasks copied from senteval_dir for the evaluate stage (source senteval):
    # any of MR, CR, SUBJ, MPQA, SST2, TREC, MRPC.
    transfer_tasks: list[str] = field(default_factory=list)
    # Image–caption pairs. demo: the generated scene world; flickr30k / coco: the real images
    # with Karpathy's splits (sources.karpathy_splits + the image archives); none: no pairs at
    # all, the text corpus only (SimCSE's "wiki" setting: needs train.method simcse).
    pairs: Literal["demo", "flickr30k", "coco", "none"] = "demo"
    splits: list[str] = field(default_factory=lambda: ["train"])  # coco papers: train + restval
    image_limit: int = 0  # first N images of the chosen splits (0: all)
    # The retrieval validation set: the first N images of Karpathy's val split (0: all); none
    # when data.splits trains on val
    val_images: int = 1000
    verify_images: bool = True  # decode every image once; unreadable ones are dropped and counted
    # Phrase boxes for detect.backend annotations on real pairs: none | flickr30k_entities
    annotations: Literal["none", "flickr30k_entities"] = "none"
    downloads_dir: str = "downloads"  # under base.data_dir: fetched archives, kept for resume and reruns
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    # Training pairs per image: all captions (KDMCSE), one random (MCSE) or the longest (MCSEO).
    captions: Literal["all", "random", "longest"] = "all"
    # The text-only corpus: demo (generated), wiki1m (SimCSE's 1M Wikipedia sentences,
    # sources.wiki1m), or a local text file with one sentence per line.
    corpus: str = "demo"
    corpus_limit: int = 0  # keep the first N sentences (0: all)
    demo: DemoDataConfig = field(default_factory=DemoDataConfig)

    def validate(self, where: str) -> None:
        self.demo.validate(where)
        self.sources.validate(where)
        _check(self.corpus_limit >= 0, where, "data.corpus_limit", "must be >= 0 (0: all)")
        _check(self.image_limit >= 0, where, "data.image_limit", "must be >= 0 (0: all)")
        _check(self.val_images >= 0, where, "data.val_images", "must be >= 0 (0: all)")
        _check(bool(self.splits), where, "data.splits", f"must name at least one of {', '.join(KARPATHY_SPLITS)}")
        for split in self.splits:
            _check(split in KARPATHY_SPLITS, where, "data.splits",
                   f"unknown split {split!r}; valid: {', '.join(KARPATHY_SPLITS)}")
        _check("test" not in self.splits or self.pairs == "demo", where, "data.splits",
               "must not include test: Karpathy's test split is the retrieval test set (evaluate.retrieval)")
        _check(self.annotations == "none" or self.pairs == "flickr30k", where, "data.annotations",
               "flickr30k_entities annotates Flickr30k images: needs data.pairs: flickr30k")
        _check(bool(self.downloads_dir.strip()), where, "data.downloads_dir", "must not be empty")
        if self.corpus not in ("demo", "wiki1m"):
            _check(Path(self.corpus).expanduser().is_file(), where, "data.corpus",
                   f"is neither demo, wiki1m nor an existing text file: {self.corpus!r}")
        if self.source == "senteval":
            _check(bool(self.senteval_dir), where, "data.senteval_dir", "must be set when source=senteval")
        _check(not self.transfer_tasks or self.source == "senteval", where, "data.transfer_tasks",
               "needs data.source: senteval (the tasks are read from data.senteval_dir)")
        for task in self.transfer_tasks:
            _check(task in TRANSFER_TASKS, where, "data.transfer_tasks",
                   f"unknown task {task!r}; valid: {', '.join(TRANSFER_TASKS)}")
        _check(len(set(self.transfer_tasks)) == len(self.transfer_tasks), where, "data.transfer_tasks",
               "lists a task twice")


_SAM2_SIZES = {"tiny": "t", "small": "s", "base-plus": "b+", "large": "l"}
_SAM2_HUB_ID = re.compile(r"^facebook/(sam2(?:\.1)?)-hiera-(tiny|small|base-plus|large)$")


def sam2_config_for(checkpoint: str) -> str | None:
    """The bundled sam2 config that fits an official ``facebook/sam2[.1]-hiera-<size>`` id
    (None for any other checkpoint, whose architecture cannot be told from its name)."""
    match = _SAM2_HUB_ID.match(checkpoint)
    if match is None:
        return None
    version, size = match.groups()
    return f"configs/{version}/{version}_hiera_{_SAM2_SIZES[size]}.yaml"


@dataclass(frozen=True)
class DetectConfig:
    # annotations: the generator's ground-truth boxes, masks and phrase spans. sam2: MCSEO §3.3's
    # models: Florence-2 phrase grounding of each caption, then SAM 2 masks from the boxes.
    # Phrases are tokenised with the student's tokenizer at model.max_seq_len.
    backend: Literal["annotations", "sam2"] = "annotations"
    min_objects: int = 2
    # sam2 backend. Florence-2 through transformers (HF id or local folder); the paper used -large.
    grounding_model: str = "florence-community/Florence-2-base"
    sam2_config: str = "configs/sam2.1/sam2.1_hiera_t.yaml"  # bundled in the sam2 package
    sam2_checkpoint: str = "facebook/sam2.1-hiera-tiny"  # HF repo id (hub cache first) or a local .pt
    batch_size: int = 8  # images per grounding batch (all their captions in one generate call)
    shard_size: int = 256  # images per persisted shard: an interrupted run resumes at the first unfinished one
    max_new_tokens: int = 1024
    num_beams: int = 3

    def validate(self, where: str) -> None:
        p = "detect."
        _check(self.min_objects >= 1, where, p + "min_objects", "must be >= 1")
        for name in ("grounding_model", "sam2_config", "sam2_checkpoint"):
            _check(bool(getattr(self, name).strip()), where, p + name, "must not be empty")
        _check(self.sam2_config.endswith(".yaml"), where, p + "sam2_config",
               f"must name a .yaml config bundled with sam2 (e.g. {DetectConfig.sam2_config}), "
               f"got {self.sam2_config!r}")
        _check(self.batch_size >= 1, where, p + "batch_size", "must be >= 1")
        _check(self.shard_size >= 1, where, p + "shard_size", "must be >= 1")
        # Florence-2's BART decoder has 1024 positions.
        _check(1 <= self.max_new_tokens <= 1024, where, p + "max_new_tokens", "must be in [1, 1024]")
        _check(1 <= self.num_beams <= 16, where, p + "num_beams", "must be in [1, 16]")
        expected = sam2_config_for(self.sam2_checkpoint)
        _check(expected is None or expected == self.sam2_config, where, p + "sam2_config",
               f"{self.sam2_config!r} does not fit detect.sam2_checkpoint {self.sam2_checkpoint!r}: "
               f"that checkpoint needs {expected!r}")
        if self.backend == "sam2":
            spec = importlib.util.find_spec("sam2")
            _check(spec is not None and bool(spec.submodule_search_locations), where, p + "backend",
                   "sam2 needs the sam2 package: SAM2_BUILD_CUDA=0 PIP_CONSTRAINT=<file pinning the installed torch> "
                   "pip install -e '.[sam2]' (docs/environment.md)")
            root = Path(next(iter(spec.submodule_search_locations)))
            bundled = sorted(str(f.relative_to(root)) for f in (root / "configs").rglob("*.yaml")
                             if "_training" not in f.parent.name)
            _check((root / self.sam2_config).is_file(), where, p + "sam2_config",
                   f"{self.sam2_config!r} is not a config bundled with sam2; bundled: {', '.join(bundled)}")


@dataclass(frozen=True)
class TextTeacherConfig:
    # HF id, local folder or packaged:<name>; any SimCSE pooler that needs no trained MLP head
    # (a frozen teacher has none of ours).
    teacher: str = "packaged:all-MiniLM-L6-v2"
    pooler: Literal["avg", "cls_before_pooler", "avg_first_last", "avg_top2"] = "avg"
    weight: float = 1.0


@dataclass(frozen=True)
class JointTeacherConfig:
    # The joint text–image teacher whose similarities α (KDMCSE Eq. 7, DALR Q) and features
    # t̂, v̂ (KDMCSE Eq. 5–6) the methods distil. cca: regularised CCA between a text teacher and
    # the image encoder, fitted on the training pairs (no download); clip: a transformers CLIP
    # (model = HF id or folder); open_clip: model = architecture, pretrained = tag or file.
    kind: Literal["cca", "clip", "open_clip"] = "cca"
    text_teacher: str = "packaged:all-MiniLM-L6-v2"  # cca
    text_pooler: Literal["avg", "cls_before_pooler", "avg_first_last", "avg_top2"] = "avg"  # cca
    dim: int = 32  # cca
    regularization: float = 0.1  # cca
    model: str = "openai/clip-vit-base-patch32"  # clip / open_clip
    pretrained: str = "openai"  # open_clip

    def validate(self, where: str) -> None:
        p = "teachers.joint."
        _check(bool(self.text_teacher.strip()), where, p + "text_teacher", "must not be empty")
        _check(self.dim >= 2, where, p + "dim", "must be >= 2")
        _check(self.regularization > 0, where, p + "regularization", "must be > 0")
        _check(bool(self.model.strip()), where, p + "model", "must not be empty")
        _check(bool(self.pretrained.strip()), where, p + "pretrained", "must not be empty")


@dataclass(frozen=True)
class TeachersConfig:
    # Frozen feature extractors whose outputs are cached once and memory-mapped.
    # text: DALR's multi-teacher text similarity Σ_k w_k cos(F_k, F_k) (SimCSE + DiffCSE in the paper).
    text: list[TextTeacherConfig] = field(
        default_factory=lambda: [
            TextTeacherConfig(pooler="avg_first_last", weight=0.33),
            TextTeacherConfig(pooler="avg", weight=0.67),
        ]
    )
    # colour-edge-grid: weight-free; resnet50: torchvision (MCSE's image / MCSEO's object encoder)
    image_encoder: Literal["colour-edge-grid", "resnet50"] = "colour-edge-grid"
    image_grid: int = 4  # colour-edge-grid
    colour_bins: int = 4  # colour-edge-grid
    image_weights: str = "IMAGENET1K_V2"  # resnet50: torchvision weights name, a local file, or random
    joint: JointTeacherConfig = field(default_factory=JointTeacherConfig)
    batch_size: int = 128
    num_workers: int = 2  # DataLoader workers reading images for the neural encoders
    cache_dir: str = "teachers"

    def validate(self, where: str) -> None:
        _check(len(self.text) >= 1, where, "teachers.text", "needs at least one text teacher")
        for i, t in enumerate(self.text):
            _check(bool(t.teacher.strip()), where, f"teachers.text[{i}].teacher", "must not be empty")
            _check(t.weight > 0, where, f"teachers.text[{i}].weight", "must be > 0")
        keys = [(t.teacher, t.pooler) for t in self.text]
        _check(len(set(keys)) == len(keys), where, "teachers.text", "lists the same teacher and pooler twice")
        _check(1 <= self.image_grid <= 16, where, "teachers.image_grid", "must be in [1, 16]")
        _check(2 <= self.colour_bins <= 16, where, "teachers.colour_bins", "must be in [2, 16]")
        self.joint.validate(where)
        _check(self.batch_size >= 1, where, "teachers.batch_size", "must be >= 1")
        _check(self.num_workers >= 0, where, "teachers.num_workers", "must be >= 0")


@dataclass(frozen=True)
class DuetModelConfig:
    # train.method duet (DUET §4.2, §5.2; docs/duet.md): the visual stream's own Transformer layers,
    # then the top shared_layers, used by both streams (weight-tied unless tie_shared is false), at
    # joint_dim; the text stream is model.name_or_path (BERT in the paper) fine-tuned.
    visual_layers: int = 4  # §5.2: four dedicated visual layers
    shared_layers: int = 2  # k (§5.2: 2); 0: no shared top layers
    tie_shared: bool = True  # false: the text stream gets its own copy (Table 2 "w/o shared layers")
    joint_dim: int = 1024  # §5.2: the joint space
    visual_dim: int = 0  # width of the visual-only layers; 0: joint_dim
    heads: int = 16  # attention heads of every added layer (64-wide heads, as BERT's)
    ff_dim: int = 4096  # feed-forward width of every added layer (4 × joint_dim, as BERT's)
    dropout: float = 0.1  # in the added layers
    box_layer: int = 0  # l of Eq. 30 (1..L-1 of the visual stream); 0: min(visual_layers, L - 1)
    region_norm: Literal["layernorm", "l2", "none"] = "layernorm"  # on r_i before Eq. 24
    spatial: bool = True  # b_i enters Eq. 24 (false: Table 2 "w/o spatial features")

    def validate(self, where: str) -> None:
        p = "model.duet."
        _check(self.visual_layers >= 1, where, p + "visual_layers", "must be >= 1")
        _check(self.shared_layers >= 0, where, p + "shared_layers", "must be >= 0")
        _check(self.joint_dim >= 1, where, p + "joint_dim", "must be >= 1")
        _check(self.visual_dim >= 0, where, p + "visual_dim", "must be >= 0 (0: joint_dim)")
        _check(self.heads >= 1, where, p + "heads", "must be >= 1")
        for name, width in (("joint_dim", self.joint_dim), ("visual_dim", self.visual_dim or self.joint_dim)):
            _check(width % self.heads == 0, where, p + name,
                   f"{width} is not divisible by model.duet.heads={self.heads}")
        _check(self.ff_dim >= 1, where, p + "ff_dim", "must be >= 1")
        _check(0 <= self.dropout < 1, where, p + "dropout", "must be in [0, 1)")
        depth = self.visual_layers + self.shared_layers
        _check(self.box_layer == 0 or 1 <= self.box_layer <= depth - 1, where, p + "box_layer",
               f"must be 0 (default) or in [1, {depth - 1}]: an intermediate layer l < L = visual_layers + "
               f"shared_layers = {depth} (Eq. 30)")
        _check(depth >= 2, where, p + "visual_layers",
               "visual_layers + shared_layers must be >= 2: Eq. 30 regresses boxes from a layer below the last")


@dataclass(frozen=True)
class ModelConfig:
    # HF id, local folder, or "packaged:all-MiniLM-L6-v2" (weights shipped in a pip package).
    name_or_path: str = "packaged:all-MiniLM-L6-v2"
    # pretrained: load the weights. random: the same tokenizer and model family with fresh
    # weights, its HF config changed by config_overrides (e.g. a 2-layer, 128-wide BERT).
    init: Literal["pretrained", "random"] = "pretrained"
    config_overrides: dict[str, Any] = field(default_factory=dict)
    max_seq_len: int = 32
    proj_dim: int = 256
    duet: DuetModelConfig = field(default_factory=DuetModelConfig)

    def validate(self, where: str) -> None:
        self.duet.validate(where)
        _check(bool(self.name_or_path.strip()), where, "model.name_or_path", "must not be empty")
        _check(
            not self.config_overrides or self.init == "random",
            where,
            "model.config_overrides",
            "changes the architecture, so it needs model.init: random (pretrained weights would not fit)",
        )
        _check(8 <= self.max_seq_len <= 512, where, "model.max_seq_len", "must be in [8, 512]")
        _check(self.proj_dim >= 1, where, "model.proj_dim", "must be >= 1")


@dataclass(frozen=True)
class TrainConfig:
    method: Literal["simcse", "mcse", "kdmcse", "dalr", "mcseo", "duet"] = "mcse"
    batch_size: int = 64
    epochs: int = 1
    max_steps: int = 0  # 0: run all epochs
    learning_rate: float = 3e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    eval_steps: int = 125
    checkpoint_steps: int = 125
    dropout: float = 0.1
    # Autocast precision of the student's forward pass (fp16 adds a gradient scaler); similarity
    # and logsumexp terms stay fp32 whatever this says (τ = 0.05 would amplify bf16 rounding).
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    compile: bool = False  # torch.compile the backbone (CUDA; dynamic shapes: one graph per padded length)

    def validate(self, where: str) -> None:
        _check(self.batch_size >= 2, where, "train.batch_size", "must be >= 2 (in-batch negatives)")
        _check(self.epochs >= 1, where, "train.epochs", "must be >= 1")
        _check(self.max_steps >= 0, where, "train.max_steps", "must be >= 0 (0: all epochs)")
        _check(self.learning_rate > 0, where, "train.learning_rate", "must be > 0")
        _check(self.weight_decay >= 0, where, "train.weight_decay", "must be >= 0")
        _check(0 <= self.warmup_ratio < 1, where, "train.warmup_ratio", "must be in [0, 1)")
        _check(self.eval_steps >= 1, where, "train.eval_steps", "must be >= 1")
        _check(self.checkpoint_steps >= 1, where, "train.checkpoint_steps", "must be >= 1")
        _check(0 <= self.dropout < 1, where, "train.dropout", "must be in [0, 1)")


Switch = bool | Literal["auto"]  # auto: on when train.method's paper uses the term


@dataclass(frozen=True)
class KDMCSELossConfig:
    # train.method kdmcse: λ·(ℓ^v' + ℓ^t')/2 (Eq. 14) replaces MCSE's image term on pair batches.
    threshold: float | Literal["off", False] = 0.9  # Eq. 8: drop negatives whose teacher α is above
    margin: float = 0.125  # AdapACSE m (Eq. 12); 0 = InfoNCE with threshold filtering
    margin_similarity: Literal["within", "cross"] = "within"
    text_batches: Literal["simcse", "angular_margin"] = "simcse"
    text_margin: float = 0.1  # the constant angular margin of text_batches: angular_margin

    @property
    def threshold_value(self) -> float | None:
        off = self.threshold is False or self.threshold == "off"  # not `in`: 0.0 == False
        return None if off else float(self.threshold)

    def validate(self, where: str) -> None:
        p = "loss.kdmcse."
        if self.threshold_value is not None:
            _check(-1 <= self.threshold_value <= 1, where, p + "threshold", "must be in [-1, 1] or off")
        _check(0 <= self.margin <= math.pi / 2, where, p + "margin", "must be in [0, π/2]")
        _check(0 <= self.text_margin <= math.pi / 2, where, p + "text_margin", "must be in [0, π/2]")


@dataclass(frozen=True)
class DALRLossConfig:
    # DALR Eq. 14: L_info + λ·L_CML + μ·L_IML (added to SimCSE). cml/iml may also be switched on
    # for kdmcse (DALR Tables 4–5: KDMCSE + CML, KDMCSE + IML) or any other method.
    info: bool = True  # L_info, Eq. 4 (method dalr)
    info_weight: float = 1.0
    info_margin: bool = False  # the KDMCSE adaptive margin (loss.kdmcse.margin) on L_info
    cml: Switch = "auto"  # L_CML = L_cons + L_CMA (Eq. 9)
    lambda_cml: float = 0.1
    consistency: bool = True  # L_cons, Eq. 5
    consistency_margin: float = 0.2
    mismatch: Literal["derangement", "roll"] = "derangement"
    alignment: bool = True  # L_CMA, Eq. 6–8
    cma_student_temperature: float = 1.0
    cma_teacher_temperature: float = 1.0
    iml: Switch = "auto"  # L_IML = L_rank + L_IMA (Eq. 13)
    mu_iml: float = 0.2
    rank: bool = True  # L_rank, Eq. 10 (ListMLE)
    rank_temperature: float = 0.05
    rank_include_diagonal: bool = True
    ima: bool = True  # L_IMA, Eq. 11–12
    ima_student_temperature: float = 1.0
    ima_teacher_temperature: float = 1.0
    text_batches: bool = False  # also μ·L_IML on text-only batches

    def validate(self, where: str) -> None:
        p = "loss.dalr."
        for name in ("info_weight", "lambda_cml", "mu_iml", "consistency_margin"):
            _check(getattr(self, name) >= 0, where, p + name, "must be >= 0")
        _check(self.consistency_margin <= 1, where, p + "consistency_margin", "must be in [0, 1]")
        for name in ("cma_student_temperature", "cma_teacher_temperature", "rank_temperature",
                     "ima_student_temperature", "ima_teacher_temperature"):
            _check(getattr(self, name) > 0, where, p + name, "must be > 0")


@dataclass(frozen=True)
class MCSEOLossConfig:
    # train.method mcseo: l_text + α·l_img-cap + β·l_obj-phra (Eq. 8); α is loss.lambda_img.
    object_phrase: bool = True
    beta: float = 0.005
    temperature: float = 0.05

    def validate(self, where: str) -> None:
        _check(self.beta >= 0, where, "loss.mcseo.beta", "must be >= 0")
        _check(self.temperature > 0, where, "loss.mcseo.temperature", "must be > 0")


@dataclass(frozen=True)
class DuetLossConfig:
    # train.method duet: L_match + λ1·L_bbox + λ2·L_norm (DUET Eq. 33)
    margin: float = 0.2  # α of the max-violation hinge (Eq. 28; §5.2: 0.2)
    lambda_box: float = 1.0  # λ1 (Eq. 30–31 box regression; the paper gives no value); 0: off
    lambda_norm: float = 1.0  # λ2 (Eq. 32 norm regularizer; no value given); 0: off
    reduction: Literal["mean", "sum"] = "mean"  # over the batch, all three terms (VSE++ sums)

    def validate(self, where: str) -> None:
        p = "loss.duet."
        _check(self.margin >= 0, where, p + "margin", "must be >= 0")
        _check(self.lambda_box >= 0, where, p + "lambda_box", "must be >= 0")
        _check(self.lambda_norm >= 0, where, p + "lambda_norm", "must be >= 0")


@dataclass(frozen=True)
class LossConfig:
    temperature: float = 0.05
    image_term: bool = True  # the sentence–image term of mcse / kdmcse / mcseo
    temperature_img: float = 0.05
    lambda_img: float = 0.01
    kdmcse: KDMCSELossConfig = field(default_factory=KDMCSELossConfig)
    dalr: DALRLossConfig = field(default_factory=DALRLossConfig)
    mcseo: MCSEOLossConfig = field(default_factory=MCSEOLossConfig)
    duet: DuetLossConfig = field(default_factory=DuetLossConfig)

    def validate(self, where: str) -> None:
        self.duet.validate(where)
        _check(self.temperature > 0, where, "loss.temperature", "must be > 0")
        _check(self.temperature_img > 0, where, "loss.temperature_img", "must be > 0")
        _check(self.lambda_img >= 0, where, "loss.lambda_img", "must be >= 0")
        self.kdmcse.validate(where)
        self.dalr.validate(where)
        self.mcseo.validate(where)


@dataclass(frozen=True)
class RegionsConfig:
    # Stage cache_regions: DUET's region features r_i and boxes b_i (§4.1.1, Eq. 23), cached once per
    # image set (training, val, test) under <base.data_dir>/<cache_dir> (mmcse.detection.regions).
    # objects: each image's objects (demo annotations / the detect stage's) and the whole image,
    # encoded with teachers.image_encoder | tsv: bottom-up-attention TSV files | npy: a folder of
    # per-image .npz / .npy files (the published 36 x 2048 Visual Genome features).
    source: Literal["objects", "tsv", "npy"] = "objects"
    files: list[str] = field(default_factory=list)  # tsv: the TSV file(s)
    folder: str = ""  # npy: the folder
    dim: int = 0  # tsv / npy: the feature width the files must have (0: whatever they hold, equal across images)
    max_regions: int = 36  # regions kept per image (§5.2: top 36)
    whole_image: bool = True  # objects: the whole image as one more region (context; never an empty image)
    dtype: Literal["float16", "float32"] = "float16"  # on disk (COCO: 123k × 36 × 2048 floats)
    cache_dir: str = "regions"  # under base.data_dir

    def validate(self, where: str) -> None:
        p = "regions."
        _check(self.source != "tsv" or bool(self.files), where, p + "files", "source tsv needs the TSV file(s)")
        _check(self.source == "tsv" or not self.files, where, p + "files", "is read by source tsv only")
        _check(self.source != "npy" or bool(self.folder.strip()), where, p + "folder", "source npy needs the folder")
        _check(self.source == "npy" or not self.folder, where, p + "folder", "is read by source npy only")
        _check(self.dim >= 0, where, p + "dim", "must be >= 0 (0: any)")
        _check(self.source != "objects" or self.dim == 0, where, p + "dim",
               "is for tsv / npy files; objects' width is teachers.image_encoder's")
        _check(1 <= self.max_regions <= 100, where, p + "max_regions", "must be in [1, 100]")
        _check(bool(self.cache_dir.strip()), where, p + "cache_dir", "must not be empty")


POOLERS = ("cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2")


@dataclass(frozen=True)
class TransferConfig:
    # SentEval's logistic-regression probe (mmcse.evaluation.transfer); defaults are SimCSE's "test" mode,
    # its "fasttest" mode is kfold 5, rmsprop, batch_size 128, tenacity 3, epoch_size 2.
    kfold: int = 10
    optim: Literal["adam", "rmsprop"] = "adam"
    batch_size: int = 64
    tenacity: int = 5  # checks without improvement before stopping
    epoch_size: int = 4  # epochs between checks
    max_epoch: int = 200
    seed: int = 1111  # SentEval's: folds, hold-out splits and probe initialisation

    def validate(self, where: str) -> None:
        p = "evaluate.transfer."
        _check(self.kfold >= 2, where, p + "kfold", "must be >= 2")
        _check(self.batch_size >= 1, where, p + "batch_size", "must be >= 1")
        _check(self.tenacity >= 0, where, p + "tenacity", "must be >= 0")
        _check(self.epoch_size >= 1, where, p + "epoch_size", "must be >= 1")
        _check(self.max_epoch >= self.epoch_size, where, p + "max_epoch", "must be >= evaluate.transfer.epoch_size")


@dataclass(frozen=True)
class RetrievalConfig:
    # Image–text retrieval on the test split of data.pairs (mmcse.evaluation.retrieval) with the
    # student's trained heads; methods without an image head (simcse) report none.
    enabled: bool = True
    block_size: int = 1024  # rows of the similarity matrix held at once
    examples: int = 5  # DALR Table 10: query captions whose nearest test captions are listed
    examples_k: int = 3  # neighbours listed per query

    def validate(self, where: str) -> None:
        p = "evaluate.retrieval."
        _check(self.block_size >= 1, where, p + "block_size", "must be >= 1")
        _check(self.examples >= 0, where, p + "examples", "must be >= 0")
        _check(self.examples_k >= 1, where, p + "examples_k", "must be >= 1")


@dataclass(frozen=True)
class NdcgConfig:
    # Graded NDCG@k of the retrieval (DUET, TERAN's protocol: mmcse.evaluation.ndcg) with caption
    # relevance from ROUGE-L and/or SPICE (Java + CoreNLP jars: `pip install -e ".[spice]"`);
    # the relevance matrices are the `relevance` stage's output. Empty: no NDCG.
    relevance: list[str] = field(default_factory=lambda: ["rouge_l"])
    k: int = 25

    def validate(self, where: str) -> None:
        p = "evaluate.ndcg."
        for kind in self.relevance:
            _check(kind in ("rouge_l", "spice"), where, p + "relevance",
                   f"unknown kind {kind!r}; valid: rouge_l, spice")
        _check(len(set(self.relevance)) == len(self.relevance), where, p + "relevance", "names a kind twice")
        _check(self.k >= 1, where, p + "k", "must be >= 1")


@dataclass(frozen=True)
class EvaluateConfig:
    pooler: Literal["cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2"] = (
        "cls_before_pooler"
    )
    batch_size: int = 128
    transfer: TransferConfig = field(default_factory=TransferConfig)  # for data.transfer_tasks
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    ndcg: NdcgConfig = field(default_factory=NdcgConfig)
    # MTEB task names (or task types Reranking, Classification, Retrieval, STS: DALR Table 5), run by
    # mmcse.evaluation.mteb; names are checked against mteb's registry (and the data sets loaded)
    # before any encoding, not here: importing mteb costs seconds every stage would pay.
    mteb: list[str] = field(default_factory=list)

    def validate(self, where: str) -> None:
        _check(self.batch_size >= 1, where, "evaluate.batch_size", "must be >= 1")
        self.transfer.validate(where)
        self.retrieval.validate(where)
        self.ndcg.validate(where)
        for i, name in enumerate(self.mteb):
            _check(bool(name.strip()), where, f"evaluate.mteb[{i}]", "must be a non-empty task name")
        _check(len(set(self.mteb)) == len(self.mteb), where, "evaluate.mteb", "task names repeat")


@dataclass(frozen=True)
class AblateConfig:
    # name -> {dotted.param.key: value}; the empty override is the reference configuration.
    variants: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"mcse": {}, "simcse": {"train.method": "simcse"}}
    )
    reference: str = "mcse"
    # A numeric dotted key every variant sets: the table is also drawn as a line over it.
    plot_x: str = ""
    # none, or a file <presets_dir>/<preset>.yaml (next to params.yaml) that replaces
    # variants, reference and plot_x (its `base` overrides go into every variant), and seeds /
    # turns on transfer where it names them.
    preset: str = "none"
    presets_dir: str = "ablations"
    title: str = ""  # heading of the table (a preset sets its description)
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    retries: int = 1
    metric: str = "avg"
    # Also probe data.transfer_tasks for every job (the papers' ablation tables are STS only).
    transfer: bool = False
    # local: every job in the ablation's own process, one after another; deployment: each job a
    # flow run of Prefect deployment `ablation-job` (pool gpu), spread over the GPU workers.
    fan_out: Literal["local", "deployment"] = "local"

    def validate(self, where: str) -> None:
        _check(len(self.variants) >= 1, where, "ablate.variants", "needs at least one variant")
        if self.plot_x:
            for name, overrides in self.variants.items():
                value = overrides.get(self.plot_x) if isinstance(overrides, Mapping) else None
                _check(
                    isinstance(value, int | float) and not isinstance(value, bool),
                    where,
                    f"ablate.variants.{name}",
                    f"must set a number for ablate.plot_x ({self.plot_x})",
                )
        _check(
            self.reference in self.variants,
            where,
            "ablate.reference",
            f"'{self.reference}' is not a variant; variants: {sorted(self.variants)}",
        )
        _check(len(self.seeds) >= 1, where, "ablate.seeds", "needs at least one seed")
        _check(len(set(self.seeds)) == len(self.seeds), where, "ablate.seeds", "seeds repeat")
        _check(self.retries >= 0, where, "ablate.retries", "must be >= 0")
        _check(self.transfer or (self.metric not in TRANSFER_TASKS and self.metric != "transfer_avg"),
               where, "ablate.metric", f"{self.metric!r} is a transfer-task score: needs ablate.transfer: true")
        for name, overrides in self.variants.items():
            _check(
                isinstance(overrides, Mapping),
                where,
                f"ablate.variants.{name}",
                "must map dotted param keys to values",
            )


@dataclass(frozen=True)
class SweepConfig:
    study_name: str = "mmcse-sweep"
    storage: str = "sqlite:///mlruns/optuna.db"
    n_trials: int = 8
    direction: Literal["maximize", "minimize"] = "maximize"
    # dotted.param.key -> {type: float|int|categorical, low, high, log, choices}
    space: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "loss.lambda_img": {"type": "float", "low": 0.001, "high": 1.0, "log": True},
            "loss.temperature": {"type": "float", "low": 0.02, "high": 0.1},
        }
    )
    pruner_startup_trials: int = 2
    pruner_warmup_steps: int = 0

    def validate(self, where: str) -> None:
        _check(bool(self.study_name), where, "sweep.study_name", "must not be empty")
        _check(bool(self.storage), where, "sweep.storage", "must not be empty")
        _check(self.n_trials >= 1, where, "sweep.n_trials", "must be >= 1")
        _check(len(self.space) >= 1, where, "sweep.space", "needs at least one parameter")
        _check(self.pruner_startup_trials >= 0, where, "sweep.pruner_startup_trials", "must be >= 0")
        _check(self.pruner_warmup_steps >= 0, where, "sweep.pruner_warmup_steps", "must be >= 0")
        for key, spec in self.space.items():
            k = f"sweep.space.{key}"
            _check(isinstance(spec, Mapping), where, k, "must be a mapping with a 'type'")
            kind = spec.get("type")
            if kind in ("float", "int"):
                allowed = {"type", "low", "high", "log", "step"}
                _check("low" in spec and "high" in spec, where, k, "needs 'low' and 'high'")
                _check(spec["low"] < spec["high"], where, k, "'low' must be < 'high'")
                if spec.get("log"):
                    _check(spec["low"] > 0, where, k, "'low' must be > 0 with log: true")
            elif kind == "categorical":
                allowed = {"type", "choices"}
                _check(bool(spec.get("choices")), where, k, "needs non-empty 'choices'")
            else:
                _fail(where, k, f"type must be one of ['categorical', 'float', 'int'], got {kind!r}")
            extra = set(spec) - allowed
            _check(not extra, where, k, f"unknown keys {sorted(extra)}; valid keys: {sorted(allowed)}")


@dataclass(frozen=True)
class Config:
    base: BaseConfig = field(default_factory=BaseConfig)
    data: DataConfig = field(default_factory=DataConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    regions: RegionsConfig = field(default_factory=RegionsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    ablate: AblateConfig = field(default_factory=AblateConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def validate(self, where: str) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(where)
        _validate_terms(self, where)
        # Every ablation/sweep override must name a real, valid parameter.
        raw = to_dict(self)
        for name, overrides in self.ablate.variants.items():
            # A variant's values are checked now too, not when its job starts.
            here = f"{where} (ablate.variants.{name})"
            check_variable_keys(overrides, here)
            variant = _build(Config, apply_overrides(raw, overrides, where=here), here, "")
            for f in dataclasses.fields(variant):
                if f.name not in ("ablate", "sweep"):
                    getattr(variant, f.name).validate(here)
            _validate_terms(variant, here)
        check_variable_keys(self.sweep.space, f"{where} (sweep.space)")
        for key in self.sweep.space:
            _resolve_path(raw, key, where=f"{where} (sweep.space)")


# --------------------------------------------------------------------------- per-job keys

# Keys an ablation variant or a sweep trial cannot set: they choose the evaluation data (so the
# rows of one table would be scored on different test sets), where artifacts and runs are
# stored, or the ablation/sweep itself. Everything else may vary per job.
FIXED_KEYS = (
    "base.data_dir", "base.models_dir", "base.metrics_dir", "base.plots_dir", "base.mlflow_tracking_uri",
    "base.experiment_prefix",
    "data.source", "data.senteval_dir", "data.transfer_tasks", "data.downloads_dir", "data.sources",
    "data.demo.min_objects", "data.demo.max_objects", "data.demo.sts_dev_pairs", "data.demo.sts_test_pairs",
    "data.demo.retrieval_images", "data.demo.retrieval_val_images", "data.val_images",
    "teachers.cache_dir", "regions.cache_dir",
    "ablate", "sweep",
)
# What a job may change upstream of training (the message of a rejected key lists these).
UPSTREAM_KEYS = (
    "data.pairs", "data.splits", "data.image_limit", "data.verify_images", "data.annotations", "data.captions",
    "data.corpus", "data.corpus_limit", "data.demo.num_images", "data.demo.captions_per_image",
    "data.demo.image_size", "data.demo.corpus_sentences", "detect.*", "teachers.* (not cache_dir)",
    "model.name_or_path", "model.max_seq_len", "regions.* (not cache_dir)",
)


def is_fixed(key: str) -> bool:
    """A fixed key, a key under one, or a whole section holding one (``data.demo``)."""
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in FIXED_KEYS)


def check_variable_keys(keys: Any, where: str) -> None:
    """Reject an override of a key that cannot vary per job, in one line listing those that can."""
    fixed = sorted(str(k) for k in keys if is_fixed(str(k)))
    if fixed:
        raise ConfigError(
            f"{where}: {', '.join(fixed)} cannot vary per job (evaluation data, storage or the ablation/sweep itself); "
            f"upstream keys that can: {', '.join(UPSTREAM_KEYS)}; and every base.seed, base.device, model.*, "
            "train.*, loss.*, evaluate.* key"
        )


def _switch(value: bool | str, on_for: bool) -> bool:
    return on_for if value == "auto" else bool(value)


def active_terms(cfg: Config) -> dict[str, bool]:
    """Which loss terms a configuration trains with (every one has its own switch).

    ``simcse`` runs on every batch; the others on image–caption batches (``rank``/``ima``
    also on text batches with ``loss.dalr.text_batches``).
    """
    method, loss = cfg.train.method, cfg.loss
    cml = _switch(loss.dalr.cml, method == "dalr") and method != "simcse"  # simcse trains on text only
    iml = _switch(loss.dalr.iml, method == "dalr")
    return {
        "simcse": method != "duet",  # DUET is a retrieval model: its terms are loss.duet's (Eq. 33)
        "image": method in ("mcse", "mcseo") and loss.image_term,
        "kdmcse": method == "kdmcse" and loss.image_term,
        "info": method == "dalr" and loss.dalr.info,
        "consistency": cml and loss.dalr.consistency,
        "cma": cml and loss.dalr.alignment,
        "rank": iml and loss.dalr.rank,
        "ima": iml and loss.dalr.ima,
        "object": method == "mcseo" and loss.mcseo.object_phrase,
    }


def _validate_terms(cfg: Config, where: str) -> None:
    if cfg.data.pairs == "none" and cfg.train.method != "simcse":
        _fail(where, "data.pairs", f"none (text corpus only) trains SimCSE alone, but train.method is "
              f"{cfg.train.method!r}: set train.method: simcse, or choose image–caption pairs (demo, flickr30k, coco)")
    if cfg.train.method == "duet":
        _check(cfg.data.pairs != "none", where, "data.pairs", "none has no images; train.method duet retrieves images")
        _check("val" not in cfg.data.splits or cfg.data.pairs == "demo", where, "data.splits",
               "must not include val with train.method duet: the val split's R@K picks its best checkpoint")
        _check(cfg.evaluate.retrieval.enabled, where, "evaluate.retrieval.enabled",
               "must be true with train.method duet: it is scored by image–text retrieval alone")
    if cfg.loss.dalr.text_batches and cfg.loss.dalr.iml is False:
        _fail(where, "loss.dalr.text_batches", "adds L_IML to text batches, but loss.dalr.iml is false")


# --------------------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            _fail(where, key, f"must be a mapping, got {type(value).__name__}")
        return _build(tp, value, where, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            _fail(where, key, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where, key)
            except ConfigError:
                continue
        _fail(where, key, f"has the wrong type: {value!r}")
    if origin is dict:
        if not isinstance(value, Mapping):
            _fail(where, key, f"must be a mapping, got {type(value).__name__}")
        return {str(k): copy.deepcopy(v) for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list | tuple):
            _fail(where, key, f"must be a list, got {type(value).__name__}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            _fail(where, key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(where, key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML reads "1e-3" as a string
            except ValueError:
                _fail(where, key, f"must be a number, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(where, key, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(where, key, f"must be a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)} for {key}")


def _build(cls: type, raw: Mapping[str, Any], where: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        dotted = ", ".join(f"{prefix}.{k}" if prefix else str(k) for k in unknown)
        raise ConfigError(
            f"{where}: unknown key(s) {dotted}; valid keys"
            f"{' under ' + prefix if prefix else ''}: {', '.join(names)}"
        )
    kwargs = {}
    for name in names:
        if name in raw:
            key = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _coerce(raw[name], hints[name], where, key)
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for logging, hashing and overrides)."""
    return copy.deepcopy(dataclasses.asdict(config))


def _resolve_path(raw: dict[str, Any], dotted: str, where: str) -> tuple[dict[str, Any], str]:
    parts = dotted.split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        if not isinstance(node, dict) or part not in node or not isinstance(node[part], dict):
            valid = sorted(k for k, v in node.items() if isinstance(v, dict)) if isinstance(node, dict) else []
            prefix = ".".join(parts[:depth])
            raise ConfigError(
                f"{where}: unknown key '{dotted}': no section '{part}'"
                f"{' under ' + prefix if prefix else ''}; valid sections: {', '.join(valid)}"
            )
        node = node[part]
    leaf = parts[-1]
    # Free-form mappings (variants, sweep space) accept new keys; typed sections do not.
    if leaf not in node and not _is_free_form(parts[:-1]):
        prefix = ".".join(parts[:-1])
        raise ConfigError(
            f"{where}: unknown key '{dotted}'; valid keys under {prefix}: {', '.join(sorted(node))}"
        )
    return node, leaf


def _is_free_form(parent: list[str]) -> bool:
    return parent in (["ablate", "variants"], ["sweep", "space"]) or (
        len(parent) >= 3 and parent[:2] in (["ablate", "variants"], ["sweep", "space"])
    )


def apply_overrides(
    raw: dict[str, Any], overrides: Mapping[str, Any], where: str = "overrides"
) -> dict[str, Any]:
    """Return a copy of ``raw`` with ``{"section.key": value}`` overrides applied."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        node, leaf = _resolve_path(out, str(dotted), where)
        node[leaf] = copy.deepcopy(value)
    return out


def parse_config(raw: Mapping[str, Any] | None, where: str = "params.yaml") -> Config:
    """Build and validate a :class:`Config` from a nested mapping."""
    raw = dict(raw or {})
    config = _build(Config, raw, where, "")
    config.validate(where)
    return config


def load_config(
    path: str | Path = "params.yaml", overrides: Mapping[str, Any] | None = None
) -> Config:
    """Read ``params.yaml``, apply dotted overrides, validate; raises :class:`ConfigError`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    if overrides:
        raw = apply_overrides(_deep_merge(to_dict(Config()), raw), overrides, where=str(path))
    return parse_config(expand_preset(raw, path.parent, str(path)), where=str(path))


def read_keyed_yaml(file: Path, valid_keys: tuple[str, ...]) -> dict[str, Any]:
    """A YAML mapping from ``file`` whose top-level keys must be among ``valid_keys`` (preset
    and profile files); invalid YAML or an unknown key is a ConfigError naming the file."""
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{file}: not valid YAML: {err}") from None
    unknown = sorted(set(raw) - set(valid_keys)) if isinstance(raw, Mapping) else ["<not a mapping>"]
    if unknown:
        raise ConfigError(f"{file}: unknown key(s) {unknown}; valid keys: {', '.join(valid_keys)}")
    return dict(raw)


def list_presets(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


PRESET_KEYS = ("description", "base", "reference", "variants", "plot_x", "seeds", "transfer", "metric")


def expand_preset(raw: Mapping[str, Any], root: Path, where: str) -> dict[str, Any]:
    """Replace ``ablate.variants/reference/plot_x`` by those of ``ablate.preset`` (a YAML file
    under ``root/<ablate.presets_dir>``); the preset's ``base`` overrides go into every variant.
    A preset that names ``seeds`` replaces ``ablate.seeds``; ``transfer: true`` turns on
    ``ablate.transfer`` (a table with a transfer column, e.g. DALR's TR (Avg.))."""
    raw = copy.deepcopy(dict(raw))
    ablate = raw.get("ablate")
    if not isinstance(ablate, Mapping) or ablate.get("preset", "none") == "none":
        return raw
    name = str(ablate["preset"])
    folder = root / str(ablate.get("presets_dir", AblateConfig.presets_dir))
    file = folder / f"{name}.yaml"
    if not file.is_file():
        _fail(where, "ablate.preset", f"no preset file {file}; presets: {', '.join(list_presets(folder)) or 'none'}")
    preset = read_keyed_yaml(file, PRESET_KEYS)
    base = preset.get("base") or {}
    variants = preset.get("variants") or {}
    if not isinstance(base, Mapping) or not isinstance(variants, Mapping) or not variants:
        raise ConfigError(f"{file}: 'base' must be a mapping and 'variants' a non-empty mapping")
    ablate = dict(ablate)
    ablate["variants"] = {str(k): {**base, **(v or {})} for k, v in variants.items()}
    ablate["reference"] = preset.get("reference", next(iter(variants)))
    ablate["plot_x"] = preset.get("plot_x", "")
    ablate["title"] = preset.get("description", name)
    if "seeds" in preset:
        ablate["seeds"] = preset["seeds"]
    if "metric" in preset:
        ablate["metric"] = preset["metric"]
    if "transfer" in preset:
        if not isinstance(preset["transfer"], bool):
            raise ConfigError(f"{file}: 'transfer' must be true or false, got {preset['transfer']!r}")
        ablate["transfer"] = bool(ablate.get("transfer", False)) or preset["transfer"]
    raw["ablate"] = ablate
    return raw


def with_overrides(config: Config, overrides: Mapping[str, Any], where: str = "overrides") -> Config:
    """A new validated config with dotted overrides applied (ablation variants, sweep trials)."""
    return parse_config(apply_overrides(to_dict(config), overrides, where), where=where)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and key not in ("variants", "space"):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
