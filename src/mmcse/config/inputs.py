"""The sections of what a model is trained from: ``base``, ``data``, ``detect``, ``teachers``
and ``regions``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from mmcse.config.checks import check
from mmcse.config.declared import SECTION, Bool, Int, Name, NonNegativeInt, PositiveInt, Str

AtLeast10 = Annotated[Int, Field(ge=10)]

# SentEval's transfer tasks, in its order: `data.transfer_tasks` names some (`mmcse.data.senteval` reads them)
TRANSFER_TASKS = ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC")


@dataclass(frozen=True)
class BaseConfig:
    __pydantic_config__ = SECTION
    seed: NonNegativeInt = 42
    """seeds data generation, model initialisation and training (an ablation job's seed replaces it)"""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """cpu | cuda | auto"""
    threads: NonNegativeInt = 2
    """CPU threads of torch and numpy's BLAS in every stage, ablation job and sweep trial: the same bytes on any
    machine at the same count (a kernel splits its sums by it); 0: every core (torch's default: the numbers then
    follow the machine's core count)"""
    data_dir: Name = "data"
    """data/raw (download), data/objects (detect), data/teachers (cache)"""
    models_dir: Name = "models"
    """models/student/{best,last}"""
    metrics_dir: Name = "metrics"
    """where stages write their metrics files (DVC metrics)"""
    plots_dir: Name = "plots"
    """where stages write their plot data and figures (DVC plots)"""
    mlflow_tracking_uri: Str = "sqlite:///mlruns/mlflow.db"
    """the MLflow store runs are logged to; MLflow 3 needs a sqlite:/// URI (the file store is read-only)"""
    experiment_prefix: Name = "mmcse"
    """experiments are <prefix>-<method>, <prefix>-ablate, <prefix>-sweep"""
    profile: Str = "demo"
    """the paper profile this file holds: `mmcse profile NAME` writes it (mmcse.experiments.recipes;
    docs/real-data.md)"""


@dataclass(frozen=True)
class DemoDataConfig:
    __pydantic_config__ = SECTION
    num_images: Annotated[Int, Field(ge=4)] = 320
    """scenes (images) the demo world generates"""
    captions_per_image: PositiveInt = 4
    """1,280 image–caption pairs"""
    image_size: Annotated[Int, Field(ge=32, le=512)] = 64
    """side of each generated image, in pixels"""
    min_objects: PositiveInt = 2
    """fewest objects placed in a scene"""
    max_objects: Annotated[Int, Field(le=6)] = 4
    """most objects placed in a scene (min_objects..6)"""
    corpus_sentences: PositiveInt = 6000
    """text-only corpus standing in for Wiki1M"""
    sts_dev_pairs: AtLeast10 = 200
    """generated STS sentence pairs with gold scores for the dev set (best checkpoint by its Spearman)"""
    sts_test_pairs: AtLeast10 = 400
    """generated STS sentence pairs with gold scores for the test set"""
    retrieval_images: AtLeast10 = 100
    """the image–text retrieval test set (drawn apart from training's scenes)"""
    retrieval_val_images: AtLeast10 = 50
    """the retrieval validation set (dev rsum picks checkpoints, e.g. DUET's): scenes apart from both"""

    def validate(self, where: str) -> None:
        check(self.min_objects <= self.max_objects, where, "data.demo.max_objects", "must be in [min_objects, 6]")


_SHA256_HEX = set("0123456789abcdef")


@dataclass(frozen=True)
class SourceConfig:
    __pydantic_config__ = SECTION
    # Where one dataset file comes from: `url` (plain HTTP with Range resume), `hub` + `file`
    # (a Hugging Face hub dataset repo, through its cache and offline mode) or `path` (a file or
    # folder already on this machine: nothing is fetched). sha256 is checked when given and
    # every fetched file's digest is written to the download manifest either way.
    url: Str = ""
    """COCO serves its zips over http only: pin sha256"""
    hub: Str = ""
    """a Hugging Face hub dataset repo id (with file): fetched through the hub cache, offline mode honoured"""
    file: Str = ""
    """the file inside the hub repo (hub); cc12m: a pattern with {shard}"""
    revision: Str = ""
    """the hub repo's revision (branch, tag or commit); empty: its default branch"""
    path: Str = ""
    """a file or folder already on this machine: nothing is fetched"""
    sha256: Str = ""
    """the file's SHA-256 (64 hex digits), checked after every fetch; empty: recorded on first fetch and later fetches
    held to it"""

    def check_source(self, where: str, key: str) -> None:
        """One source's rules, ``key`` its dotted name (``data.sources.<name>``)."""
        given = [name for name in ("url", "hub", "path") if getattr(self, name)]
        check(len(given) == 1, where, key, f"needs exactly one of url, hub (+ file) or path; got {given or 'none'}")
        if self.hub:
            check(bool(self.file), where, key + ".file", "must name the file inside the hub repo")
        if self.url:
            check(self.url.startswith(("http://", "https://")), where, key + ".url", "must be an http(s) URL")
        if self.sha256:
            check(len(self.sha256) == 64 and set(self.sha256.lower()) <= _SHA256_HEX, where, key + ".sha256",
                   "must be 64 hex digits (or empty: unknown, recorded after the download)")


@dataclass(frozen=True)
class SourcesConfig:
    __pydantic_config__ = SECTION
    # Karpathy's caption_datasets.zip: dataset_flickr30k.json + dataset_coco.json (splits, captions)
    karpathy_splits: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"))
    """Karpathy's caption_datasets.zip: dataset_flickr30k.json + dataset_coco.json (splits, captions)"""
    flickr30k_images: SourceConfig = field(default_factory=lambda: SourceConfig(
        hub="nlphuji/flickr30k", file="flickr30k-images.zip"))
    """the Flickr30k images (a zip of JPEGs)"""
    coco_train2014: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="http://images.cocodataset.org/zips/train2014.zip"))
    """COCO's train2014 images (Karpathy's train and restval splits)"""
    coco_val2014: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="http://images.cocodataset.org/zips/val2014.zip"))
    """COCO's val2014 images (Karpathy's val and test splits, part of restval)"""
    flickr30k_entities: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="https://github.com/BryanPlummer/flickr30k_entities/raw/master/annotations.zip"))
    """Flickr30k Entities: Sentences/<id>.txt phrase markup + Annotations/<id>.xml boxes"""
    entities_train: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="https://github.com/BryanPlummer/flickr30k_entities/raw/master/train.txt",
        sha256="7fac836ec29afdbda7396fe5473c4156908d60d248cae75892f5a94f08016516"))
    """Flickr30k Entities' split lists (one image id a line: 29,783 / 1,000 / 1,000), the split the sentence-encoder
    papers train on (data.flickr_split: entities)"""
    entities_val: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="https://github.com/BryanPlummer/flickr30k_entities/raw/master/val.txt",
        sha256="764e1d2b2bae38bde75f8edda435a7ad20d404e83b77233934844f6a7dbccd9a"))
    """Flickr30k Entities' val image ids (1,000), data.flickr_split: entities"""
    entities_test: SourceConfig = field(default_factory=lambda: SourceConfig(
        url="https://github.com/BryanPlummer/flickr30k_entities/raw/master/test.txt",
        sha256="58c576ebf3af64f346cc3e2ede7eb66523ab172b45c8b42414daa9f2914047e1"))
    """Flickr30k Entities' test image ids (1,000), data.flickr_split: entities"""
    wiki1m: SourceConfig = field(default_factory=lambda: SourceConfig(
        hub="princeton-nlp/datasets-for-simcse", file="wiki1m_for_simcse.txt"))
    """SimCSE's one million Wikipedia sentences (data.corpus: wiki1m)"""
    senteval: SourceConfig = field(default_factory=lambda: SourceConfig(
        hub="princeton-nlp/datasets-for-simcse", file="senteval.tar"))
    """SimCSE's copy of the SentEval data: downstream/{STS,SICK,MR,CR,SUBJ,MPQA,SST,TREC,MRPC}"""
    cc12m: SourceConfig = field(default_factory=lambda: SourceConfig(
        hub="pixparse/cc12m-wds", file="cc12m-train-{shard:04d}.tar"))
    """Conceptual 12M as webdataset shards (<key>.jpg + <key>.txt per sample): a hub file or URL pattern with {shard}
    (shards 0, 1, … fetched until data.image_limit pairs are in), or a local folder of shards (*.tar) or of
    extracted samples (img2dataset's `files` output)"""

    def validate(self, where: str) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).check_source(where, f"data.sources.{f.name}")
        c = self.cc12m
        if c.url or c.hub:
            key = "data.sources.cc12m." + ("url" if c.url else "file")
            check("{shard" in (c.url or c.file), where, key, "must be a shard pattern with {shard} "
                  "(e.g. cc12m-train-{shard:04d}.tar)")
            check(not c.sha256, where, "data.sources.cc12m.sha256",
                  "one digest cannot check many shards; leave it out (each shard's is recorded)")


KARPATHY_SPLITS = ("train", "restval", "val", "test")


@dataclass(frozen=True)
class DataConfig:
    __pydantic_config__ = SECTION
    # STS sets. demo: generated; senteval: STS-B dev + the seven STS test sets from
    # senteval_dir (a SentEval-layout folder, or `download`: fetch sources.senteval).
    source: Literal["demo", "senteval"] = "demo"
    """STS sets. demo: generated | senteval: STS-B dev + the 7 STS tests from senteval_dir"""
    senteval_dir: Str = "../shared/data/senteval"
    """a SentEval-layout folder, or `download` (sources.senteval)"""
    transfer_tasks: list[Str] = field(default_factory=list)
    """SentEval transfer tasks copied from senteval_dir for the evaluate stage (source senteval): any of MR, CR, SUBJ,
    MPQA, SST2, TREC, MRPC."""
    pairs: Literal["demo", "flickr30k", "coco", "cc12m", "none"] = "demo"
    """Image–caption pairs. demo: the generated scene world; flickr30k / coco: the real images with Karpathy's splits
    (sources.karpathy_splits + the image archives); none: no pairs at all, the text corpus only (SimCSE's "wiki"
    setting: needs train.method simcse). cc12m: Conceptual 12M (one caption per image, no test split; KDMCSE Table
    4), in subsets of data.image_limit pairs."""
    splits: list[Str] = field(default_factory=lambda: ["train"])
    """Karpathy splits to train on: train | restval | val | test (COCO papers: train + restval)"""
    flickr_split: Literal["karpathy", "entities"] = "karpathy"
    """Flickr30k's split, wherever Flickr30k is read (training pairs, retrieval val and test): karpathy = Karpathy's
    (29,000 / 1,014 / 1,000 images, captions from his file); entities = Flickr30k Entities' (29,783 / 1,000 /
    1,000, captions from its Sentences files: sources.entities_* + sources.flickr30k_entities), the split KDMCSE,
    MCSE and MCSEO train on"""
    # first N images of the chosen splits; cc12m: the subset size
    image_limit: Annotated[Int, Field(ge=0, description="0: all")] = 0
    cc12m_subset: PositiveInt = 1
    """cc12m: which block of data.image_limit pairs, in shard order (KDMCSE Table 4's subsets 1 and 2)"""
    # The retrieval validation set: the first N images of Karpathy's val split (0: all); none
    # when data.splits trains on val
    val_images: Annotated[Int, Field(ge=0, description="0: all")] = 1000
    retrieval_test: Literal["same", "flickr30k", "coco"] = "same"
    """The retrieval test set: same = Karpathy's test split of data.pairs (demo: its own test scenes); flickr30k /
    coco = that data set's test split whatever trains (DALR Table 4 scores its wiki+coco models on Flickr30k). No
    pairs (none): no image head, no retrieval test set."""
    verify_images: Bool = True
    """decode every real image once; unreadable ones are dropped and counted"""
    annotations: Literal["none", "flickr30k_entities"] = "none"
    """Phrase boxes for detect.backend annotations on real pairs: none | flickr30k_entities"""
    downloads_dir: Name = "downloads"
    """under base.data_dir: fetched archives (resumed, hashed once, reused)"""
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    """each: url (HTTP, Range resume) | hub + file (HF hub cache) | path (local); sha256 checked when set, else
    recorded on first fetch and every later fetch held to it (data/downloads/first_use_sha256.json)"""
    captions: Literal["all", "random", "longest"] = "all"
    """Training pairs per image: all captions (KDMCSE), one random (MCSE) or the longest (MCSEO)."""
    corpus: Str = "demo"
    """The text-only corpus: demo (generated), wiki1m (SimCSE's 1M Wikipedia sentences, sources.wiki1m), or a local
    text file with one sentence per line."""
    corpus_limit: Annotated[Int, Field(ge=0, description="0: all")] = 0  # keep the first N sentences
    demo: DemoDataConfig = field(default_factory=DemoDataConfig)
    """the procedural scene world (docs/pipeline.md)"""

    def validate(self, where: str) -> None:
        check(bool(self.splits), where, "data.splits", f"must name at least one of {', '.join(KARPATHY_SPLITS)}")
        for split in self.splits:
            check(split in KARPATHY_SPLITS, where, "data.splits",
                   f"unknown split {split!r}; valid: {', '.join(KARPATHY_SPLITS)}")
        if self.flickr_split == "entities" and self.pairs == "flickr30k":
            check("restval" not in self.splits, where, "data.splits",
                  "Flickr30k Entities' split has train, val and test (no restval)")
        check("test" not in self.splits or self.pairs == "demo", where, "data.splits",
               "must not include test: Karpathy's test split is the retrieval test set (evaluate.retrieval)")
        if self.pairs == "cc12m":
            check(self.splits == ["train"], where, "data.splits", "CC12M has one split: leave data.splits at [train]")
            check(self.image_limit > 0 or self.cc12m_subset == 1, where, "data.cc12m_subset",
                  "needs data.image_limit (the subset size; KDMCSE Table 4: 1000000)")
            c = self.sources.cc12m
            check(self.image_limit > 0 or bool(c.path), where, "data.image_limit",
                  "must be > 0 with a remote data.sources.cc12m (all of CC12M is ~2,000 shards); "
                  "0 reads a local folder whole")
        check(self.retrieval_test == "same" or self.pairs != "demo", where, "data.retrieval_test",
               f"{self.retrieval_test} is a real data set's test split; the demo world (data.pairs: demo) is "
               "scored on its own test scenes: use same")
        check(self.annotations == "none" or self.pairs == "flickr30k", where, "data.annotations",
               "flickr30k_entities annotates Flickr30k images: needs data.pairs: flickr30k")
        if self.corpus not in ("demo", "wiki1m"):
            check(Path(self.corpus).expanduser().is_file(), where, "data.corpus",
                   f"is neither demo, wiki1m nor an existing text file: {self.corpus!r}")
        if self.source == "senteval":
            check(bool(self.senteval_dir), where, "data.senteval_dir", "must be set when source=senteval")
        check(not self.transfer_tasks or self.source == "senteval", where, "data.transfer_tasks",
               "needs data.source: senteval (the tasks are read from data.senteval_dir)")
        for task in self.transfer_tasks:
            check(task in TRANSFER_TASKS, where, "data.transfer_tasks",
                   f"unknown task {task!r}; valid: {', '.join(TRANSFER_TASKS)}")
        check(len(set(self.transfer_tasks)) == len(self.transfer_tasks), where, "data.transfer_tasks",
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
    __pydantic_config__ = SECTION
    # annotations: the generator's ground-truth boxes, masks and phrase spans. sam2: MCSEO §3.3's
    # models: Florence-2 phrase grounding of each caption, then SAM 2 masks from the boxes.
    # Phrases are tokenised with the student's tokenizer at model.max_seq_len.
    backend: Literal["annotations", "sam2"] = "annotations"
    """annotations: the generator's boxes/masks + phrase spans | sam2: Florence-2 + SAM 2 (MCSEO)"""
    min_objects: PositiveInt = 2
    """MCSEO: drop pairs left with fewer objects"""
    grounding_model: Name = "florence-community/Florence-2-base"
    """sam2 backend. Florence-2 through transformers (HF id or local folder); the paper used -large."""
    sam2_config: Name = "configs/sam2.1/sam2.1_hiera_t.yaml"
    """sam2: bundled config; paper: configs/sam2.1/sam2.1_hiera_l.yaml"""
    sam2_checkpoint: Name = "facebook/sam2.1-hiera-tiny"
    """sam2: HF repo id (hub cache first) or a local .pt; paper: facebook/sam2.1-hiera-large"""
    batch_size: PositiveInt = 8
    """sam2: images per grounding batch (all their captions in one generate call)"""
    shard_size: PositiveInt = 256
    """sam2: images per persisted shard (data/objects/shards): a rerun resumes at the first unfinished"""
    max_new_tokens: Annotated[Int, Field(ge=1, le=1024)] = 1024
    """Florence-2's BART decoder has 1024 positions"""
    num_beams: Annotated[Int, Field(ge=1, le=16)] = 3
    """sam2: Florence-2 beam search"""

    def validate(self, where: str) -> None:
        p = "detect."
        check(self.sam2_config.endswith(".yaml"), where, p + "sam2_config",
               f"must name a .yaml config bundled with sam2 (e.g. {DetectConfig.sam2_config}), "
               f"got {self.sam2_config!r}")
        expected = sam2_config_for(self.sam2_checkpoint)
        check(expected is None or expected == self.sam2_config, where, p + "sam2_config",
               f"{self.sam2_config!r} does not fit detect.sam2_checkpoint {self.sam2_checkpoint!r}: "
               f"that checkpoint needs {expected!r}")
        if self.backend == "sam2":
            spec = importlib.util.find_spec("sam2")
            check(spec is not None and bool(spec.submodule_search_locations), where, p + "backend",
                   "sam2 needs the sam2 package: SAM2_BUILD_CUDA=0 PIP_CONSTRAINT=<file pinning the installed torch> "
                   "pip install -e '.[sam2]' (docs/environment.md)")
            root = Path(next(iter(spec.submodule_search_locations)))
            bundled = sorted(str(f.relative_to(root)) for f in (root / "configs").rglob("*.yaml")
                             if "_training" not in f.parent.name)
            check((root / self.sam2_config).is_file(), where, p + "sam2_config",
                   f"{self.sam2_config!r} is not a config bundled with sam2; bundled: {', '.join(bundled)}")


JOINT_TEXT_TEACHER = "joint"  # teachers.text[*].teacher: the joint teacher's text side


@dataclass(frozen=True)
class TextTeacherConfig:
    __pydantic_config__ = SECTION
    # HF id, local folder or packaged:<name>; any SimCSE pooler that needs no trained MLP head
    # (a frozen teacher has none of ours). joint: the joint teacher's own text embedding
    # (teachers.joint: CLIP's projected text feature, DALR Table 9's "CLIP" text teacher; the CCA's
    # text side offline), pooled its own way: leave pooler out.
    teacher: Name = "packaged:all-MiniLM-L6-v2"
    """HF id, local folder or packaged:<name>; joint: the joint teacher's own text embedding (teachers.joint: CLIP's
    projected text feature, DALR Table 9's CLIP text teacher; the CCA's text side offline), pooled its own way"""
    pooler: Literal["avg", "cls_before_pooler", "avg_first_last", "avg_top2", "clip"] = "avg"
    """avg | cls_before_pooler | avg_first_last | avg_top2 (SimCSE's poolers that need no trained head) | clip: a CLIP
    model's projected text feature (teacher: a transformers CLIP id or folder)"""
    weight: Annotated[float, Field(gt=0)] = 1.0
    """the teacher's share in DALR's weighted multi-teacher representation (App. B)"""


@dataclass(frozen=True)
class JointTeacherConfig:
    __pydantic_config__ = SECTION
    # The joint text–image teacher whose similarities α (KDMCSE Eq. 7, DALR Q) and features
    # t̂, v̂ (KDMCSE Eq. 5–6) the methods distil. cca: regularised CCA between a text teacher and
    # the image encoder, fitted on the training pairs (no download); clip: a transformers CLIP
    # (model = HF id or folder); open_clip: model = architecture, pretrained = tag or file.
    kind: Literal["cca", "clip", "open_clip"] = "cca"
    """cca: fitted here, no download | clip: transformers CLIP | open_clip"""
    text_teacher: Name = "packaged:all-MiniLM-L6-v2"
    """cca: its text side"""
    text_pooler: Literal["avg", "cls_before_pooler", "avg_first_last", "avg_top2"] = "avg"
    """cca"""
    dim: Annotated[Int, Field(ge=2)] = 32
    """cca: width of the joint space"""
    regularization: Annotated[float, Field(gt=0)] = 0.1
    """cca: ridge on each covariance, relative to its mean eigenvalue"""
    model: Name = "openai/clip-vit-base-patch32"
    """clip: HF id or folder (the papers' teacher) | open_clip: e.g. ViT-L-14"""
    pretrained: Name = "openai"
    """open_clip: pretrained tag or a local checkpoint file"""
    image_side: Literal["joint", "image_encoder"] = "joint"
    """v̂, the joint teacher's image side: joint = the teacher's own image tower | image_encoder = the features of
    teachers.image_encoder (an image-only teacher beside the joint text side: DALR Table 9's ResNet rows)"""


@dataclass(frozen=True)
class TeachersConfig:
    __pydantic_config__ = SECTION
    # Frozen feature extractors whose outputs are cached once and memory-mapped.
    # text: DALR's multi-teacher text similarity Σ_k w_k cos(F_k, F_k) (SimCSE + DiffCSE in the paper).
    text: list[TextTeacherConfig] = field(
        default_factory=lambda: [
            TextTeacherConfig(pooler="avg_first_last", weight=0.33),
            TextTeacherConfig(pooler="avg", weight=0.67),
        ]
    )
    """text teachers, each {teacher, pooler, weight}: DALR's weighted multi-teacher representation (L_rank, L_IMA,
    L_CMA's Q^{t2t}); DALR: SimCSE 0.33 + DiffCSE 0.67 (authors' code); offline: two poolers of MiniLM"""
    image_encoder: Literal["colour-edge-grid", "resnet50"] = "colour-edge-grid"
    """colour-edge-grid: weight-free; resnet50: torchvision (MCSE's image / MCSEO's object encoder)"""
    image_grid: Annotated[Int, Field(ge=1, le=16)] = 4
    """colour-edge-grid: cells per side"""
    colour_bins: Annotated[Int, Field(ge=2, le=16)] = 4
    """colour-edge-grid: levels per RGB channel"""
    image_weights: Str = "IMAGENET1K_V2"
    """resnet50: torchvision weights name, or a local .pth/.safetensors file"""
    joint: JointTeacherConfig = field(default_factory=JointTeacherConfig)
    """joint text–image teacher (CLIP in KDMCSE/DALR): α similarities, t̂ and v̂"""
    batch_size: PositiveInt = 128
    """sentences or images per teacher forward pass while caching"""
    num_workers: NonNegativeInt = 2
    """DataLoader workers reading images for resnet50 / clip / open_clip"""
    cache_dir: Str = "teachers"
    """under base.data_dir"""
    stand_ins: Literal["refuse", "allow"] = "refuse"
    """Under a paper profile (base.profile other than demo) a row that trains with this machine's offline stand-ins
    (packaged:* text teachers, the CCA joint teacher, colour-edge-grid image features) is refused before anything
    runs; allow: train it anyway, `mmcse plan` marking it (mmcse.experiments.stand_ins)"""

    def validate(self, where: str) -> None:
        check(len(self.text) >= 1, where, "teachers.text", "needs at least one text teacher")
        for i, t in enumerate(self.text):
            check(t.teacher != JOINT_TEXT_TEACHER or t.pooler == "avg", where, f"teachers.text[{i}].pooler",
                  "the joint text teacher pools its own way (CLIP's projection, the CCA's text side): leave pooler out")
        keys = [(t.teacher, t.pooler) for t in self.text]
        check(len(set(keys)) == len(keys), where, "teachers.text", "lists the same teacher and pooler twice")
        clip = {t.teacher for t in self.text if t.pooler == "clip"}
        mixed = sorted({t.teacher for t in self.text if t.pooler != "clip"} & clip)
        check(not mixed, where, "teachers.text", f"{mixed}: a CLIP model (pooler clip) has no other pooler")


@dataclass(frozen=True)
class RegionsConfig:
    __pydantic_config__ = SECTION
    # Stage cache_regions: DUET's region features r_i and boxes b_i (§4.1.1, Eq. 23), cached once per
    # image set (training, val, test) under <base.data_dir>/<cache_dir> (mmcse.detection.regions).
    # objects: each image's objects (demo annotations / the detect stage's) and the whole image,
    # encoded with teachers.image_encoder | tsv: bottom-up-attention TSV files | npy: a folder of
    # per-image .npz / .npy files (the published 36 x 2048 Visual Genome features) | grid: grid_model's
    # last feature map over the whole image, 7 x 7 cells of 2048 (VSE++'s ResNet-152 features).
    source: Literal["objects", "tsv", "npy", "grid"] = "objects"
    """objects: the images' objects + the whole image, encoded with teachers.image_encoder | tsv: bottom-up-attention
    TSV file(s) | npy: a folder of per-image .npz/.npy (36 x 2048) | grid: grid_model's 7 x 7 x 2048 last feature
    map of the whole image (VSE++'s ResNet-152)"""
    files: list[Str] = field(default_factory=list)
    """tsv: the TSV file(s)"""
    folder: Str = ""
    """npy: the folder"""
    # tsv / npy: the feature width the files must have (0: whatever they hold, equal across images)
    dim: Annotated[Int, Field(ge=0, description="0: any")] = 0
    max_regions: Annotated[Int, Field(ge=1, le=100)] = 36
    """regions kept per image (§5.2: top 36)"""
    whole_image: Bool = True
    """objects: the whole image as one more region (context; never an empty image)"""
    dtype: Literal["float16", "float32"] = "float16"
    """on disk (COCO: 123k × 36 × 2048 floats)"""
    cache_dir: Name = "regions"
    """under base.data_dir: one set per (source, images), reused"""
    grid_model: Literal["resnet50", "resnet101", "resnet152"] = "resnet152"
    """grid: the torchvision CNN (VSE++: ResNet-152) and its weights: a torchvision weights name (hub cache;
    downloaded only when online), a local .pth / .safetensors file, or random (offline stand-in)"""
    grid_weights: Str = "random"
    """grid: a torchvision weights name (IMAGENET1K_V1: VSE++'s), a local file, or random (offline)"""

    def validate(self, where: str) -> None:
        p = "regions."
        check(self.source != "tsv" or bool(self.files), where, p + "files", "source tsv needs the TSV file(s)")
        check(self.source == "tsv" or not self.files, where, p + "files", "is read by source tsv only")
        check(self.source != "npy" or bool(self.folder.strip()), where, p + "folder", "source npy needs the folder")
        check(self.source == "npy" or not self.folder, where, p + "folder", "is read by source npy only")
        check(self.source != "objects" or self.dim == 0, where, p + "dim",
               "is for tsv / npy files; objects' width is teachers.image_encoder's")
        check(self.source != "grid" or self.dim in (0, 2048), where, p + "dim",
              "must be 0 or 2048 with source grid: the width of a ResNet's last feature map")
        check(self.source != "grid" or self.max_regions >= 49, where, p + "max_regions",
              "must be >= 49 with source grid: every cell of the 7 x 7 feature map is a region")
