"""Training-step time and memory of every method relative to a SimCSE and an MCSE step (same student, same batch).

    python benchmarks/step_time.py --device cuda --precision bf16 --student bert-base --batch-size 64 128
    python benchmarks/step_time.py --device cpu --student tiny --batch-size 32 --repeats 20
    python benchmarks/step_time.py --params params.yaml --teachers data/teachers   # the project's model and cache

A student step (simcse, mcse, kdmcse, dalr, mcseo) is :class:`mmcse.training.loop.StudentStep` — the
forward pass (two dropout views as one doubled batch) under ``train.precision``'s autocast, the
method's loss terms on cached teacher features, backward through the fp16 loss scaler when
enabled, and the AdamW update (fused on CUDA, :func:`mmcse.training.engine.build_optimizer`) — exactly what
``train`` runs per batch, with the same deterministic-algorithm and TF32 settings. A DUET step is
:class:`mmcse.training.duet_step.RetrievalStep`, what ``train_duet`` runs per batch. Data loading is
not timed: the batch, its features and regions are on the device before the clock starts.

What one step of each method contains, for a batch of B captions (B images):

* ``simcse``: 2B sentences (each caption twice, two dropout masks) through the student and its
  MLP pooler; the in-batch InfoNCE; backward; AdamW over the student.
* ``mcse``: the same 2B-sentence pass, plus the projection heads on the [CLS] states and on the
  B cached 2048-d image features, and the sentence–image InfoNCE term.
* ``kdmcse``: the 2B-sentence pass, plus projections of the cached 512-d CLIP text/image
  features and the teacher-filtered, margin-adjusted contrastive terms.
* ``dalr``: the 2B-sentence pass, plus L_info on the projected CLIP image features, the
  cross-modal terms (consistency MLPs, L_CMA against CLIP) and the intra-modal ones (ListMLE
  ranking, L_IMA) against two 768-d text teachers.
* ``mcseo``: the 2B-sentence pass, plus the image term and the object–phrase term (3
  phrase spans per caption, mean-pooled, against 2048-d object features).
* ``duet``: ONE pass of the B captions (no dropout-doubled batch) through the same student
  backbone (DUET's text stream, Eq. 25), its projection and the shared top layers; plus the
  visual stream: B × 36 regions (+ the [I-CLS] token) through Eq. 24's MLP, the visual-only and
  the shared Transformer layers and the box head (Eq. 30); Eq. 33's hinge + box + norm terms;
  backward; AdamW over the text stream and every added layer. The visual stream is new
  compute the students do not have; the caption pass is half of theirs.

The students' terms are those the params file's ``loss.*`` switches on (the repo's
``params.yaml`` unless ``--params``), DUET's ``loss.duet``.

Students: ``bert-base`` (``BertModel(BertConfig())``), ``roberta-base`` (``RobertaModel(
RobertaConfig())``), ``tiny`` (2 layers, 64 wide: quick CPU runs) — random weights, nothing
downloaded — or ``--params FILE``: the project's ``model.*`` (:func:`mmcse.models.student.load_backbone`).
Every method starts from the same initial weights (DUET's text stream is a copy of the same
backbone, built into ``DuetModel(backbone, DuetArchitecture(**duet_architecture(...)))``). Features are
random with the papers' shapes (2048-d ResNet-50 image and object features, 512-d CLIP ViT-B/32
joint space, two 768-d text teachers, 3 object–phrase pairs per caption; DUET: 36 regions × 2048-d
per image, boxes ``normalized_boxes`` (Eq. 23) of random valid boxes in a 640 × 480 image, every
region valid), or with ``--teachers DIR`` read from a teacher cache (its ``../raw`` and
``../objects`` beside it) for real captions. DUET's regions in ``--teachers`` mode: the first
region set in ``DIR/../regions`` (``cache_regions``, by folder name) that holds the images of the
timed pairs gives their rows (its width and region count; two captions of one image in a batch
are not each other's negatives, as in ``train_duet``); with no such set they are random as above.

DUET's architecture (``--duet-size``): ``paper`` = recipes/duet.yaml's ``model.duet``
(§5.2: 4 visual-only + 2 shared layers, joint width 1024, 16 heads, feed-forward 4096), ``demo`` =
this repo's ``params.yaml`` ``model.duet`` (joint 256, 4 heads, feed-forward 1024). The default
follows the student: ``tiny`` -> demo, ``bert-base`` / ``roberta-base`` -> paper; with
``--params`` the file's own ``model.duet``.

``--compile backbone`` (or a bare ``--compile``) compiles the students' backbones, as ``train.compile: backbone``
(DUET's run stays eager, as ``train_duet`` does then). ``--compile step`` runs every method's step as
``train.compile: step`` does (`mmcse.training.compiled`: each method's forward one graph, its backward and the
update compiled, CUDA graphs on a GPU; inductor's code generation takes minutes per method on a CPU, counted in no
timing: the warm-up rounds compile), and counts each method's graph breaks (``torch._dynamo.explain`` of its
forward: 0 is the promise), printed and in the JSON beside ``ms`` and ``ratio_to_simcse``.

Batch size: DUET's paper trains with 90 image–caption pairs per batch, the students' papers
with 64 (BERT) / 128 (RoBERTa). This benchmark times every method at the SAME batch size, one
row (and one ratio) per ``--batch-size`` given; pass e.g. ``--batch-size 64 90`` and compare the
DUET cell of B = 90 with the MCSE cell of B = 64 for the papers' settings.

The peer (``st_mnrl``, with ``simcse`` unless ``--no-peer``): sentence-transformers'
``MultipleNegativesRankingLoss`` step, SimCSE's objective as that library trains it, on a copy of the
same backbone (saved and loaded as a sentence-transformers ``Transformer`` + CLS ``Pooling``, no MLP
head), the same batch, scale 1/``loss.temperature`` (20), the same precision's autocast and an AdamW of
the same rate (fused on CUDA): the anchor and positive are the batch's sentences, each encoded in its
own pass (two dropout masks), then backward and the update. Its ratio to mmcse's SimCSE step is in the
table beside the methods' (> 1: the peer is slower).

Methods are interleaved within each repeat (the order rotates), so a change in machine
speed hits them alike; warm-up rounds are not counted; on CUDA the device is synchronized
before each clock read. Prints the median step time, its ratio to SimCSE and to MCSE in the
same run, and peak memory, then markdown tables; ``--json FILE`` writes the numbers.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import dataclasses
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

REPO = Path(__file__).resolve().parents[1]
STUDENT_METHODS = ("simcse", "mcse", "kdmcse", "dalr", "mcseo")
METHODS = (*STUDENT_METHODS, "duet")
STUDENTS = ("tiny", "bert-base", "roberta-base")
# The papers' cached-feature shapes: ResNet-50 pooled features (MCSE / MCSEO images and
# object crops), CLIP ViT-B/32's 512-d projection space (KDMCSE / DALR, the profiles'
# teachers.joint.model), SimCSE + DiffCSE BERT-base text teachers weighted 0.33 / 0.67 (DALR).
PAPER_IMAGE_DIM = 2048
PAPER_JOINT_DIM = 512
PAPER_TEXT_TEACHERS = ((768, 0.33), (768, 0.67))
OBJECTS_PER_CAPTION = 3
# DUET §4.1.1 / §5.2: the top 36 bottom-up-attention regions per image, 2048-d each; boxes in a
# COCO-sized image (Eq. 23 divides by its width and height).
PAPER_REGIONS = 36
PAPER_REGION_DIM = 2048
BOX_IMAGE_SIZE = (640, 480)
DUET_SIZES = ("paper", "demo")
PEER = "st_mnrl"  # sentence-transformers' MultipleNegativesRankingLoss step on the same backbone
MIB = 2**20


def fail(message: str) -> NoReturn:
    """One clear line on stderr, exit status 2 (no traceback for bad input)."""
    raise SystemExit(f"{Path(sys.argv[0]).name}: {message}")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no CUDA device is available to this process (torch.cuda.is_available() is False)")
    return torch.device(name)


def default_precision(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def checked_precision(precision: str, device: torch.device) -> None:
    """:func:`mmcse.models.precision.check_precision` as one line (e.g. bf16 on a GPU without it)."""
    from mmcse.errors import PrecisionError
    from mmcse.models.precision import check_precision

    try:
        check_precision(precision, device)
    except PrecisionError as err:
        fail(str(err))


def setup_like_train(device: torch.device, fill_uninitialized_memory: bool = False) -> None:
    """The kernel settings :func:`mmcse.training.loop.train` runs its steps under
    (``fill_uninitialized_memory``: torch's default fill that train turns off, for comparison)."""
    from mmcse.entry import quiet_libraries
    from mmcse.models.precision import configure_kernels, deterministic_kernels

    quiet_libraries()
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    configure_kernels(device)
    deterministic_kernels()
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory
    warnings.filterwarnings("ignore", message=".*deterministic.*")


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads (no GPU used)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_backbone(student: str, dropout: float = 0.1) -> Any:
    """A random-weight encoder of the named size (no download)."""
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    drop = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    if student == "bert-base":
        return BertModel(BertConfig(**drop), add_pooling_layer=False)
    if student == "roberta-base":
        return RobertaModel(RobertaConfig(**drop), add_pooling_layer=False)
    if student == "tiny":  # the tests' TINY_MODEL sizes
        return BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=128, **drop), add_pooling_layer=False)
    fail(f"--student {student!r}: choose one of {', '.join(STUDENTS)}")


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def synthetic_lengths(batch_size: int, seq_len: int, g: torch.Generator) -> list[int]:
    """Real tokens per sentence ([CLS] … [SEP]): uniform in [seq_len/2, seq_len], the first
    at seq_len, so the padded width is ``seq_len`` as in a batch with one full-length sentence."""
    low = max(seq_len // 2, 5)
    lengths = torch.randint(low, seq_len + 1, (batch_size,), generator=g).tolist()
    lengths[0] = seq_len
    return lengths


def synthetic_batch(lengths: Sequence[int], vocab_size: int, pad_id: int,
                    g: torch.Generator) -> dict[str, torch.Tensor]:
    """``input_ids, attention_mask (B, L)`` on the CPU: random ids, then padding."""
    width = max(lengths)
    ids = torch.randint(5, vocab_size, (len(lengths), width), generator=g)
    ids[ids == pad_id] = pad_id + 1
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, n:] = pad_id
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def object_spans(lengths: Sequence[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``OBJECTS_PER_CAPTION`` phrase spans per sentence, ``(row, start, end)`` each ``(T,)``:
    non-empty, inside the real tokens, after [CLS] and before [SEP]."""
    rows, starts, ends = [], [], []
    for i, n in enumerate(lengths):
        inner = n - 2  # tokens between [CLS] and [SEP]
        cuts = [1 + (k * inner) // OBJECTS_PER_CAPTION for k in range(OBJECTS_PER_CAPTION + 1)]
        for k in range(OBJECTS_PER_CAPTION):
            lo, hi = cuts[k], max(cuts[k + 1], cuts[k] + 1)
            rows.append(i)
            starts.append(lo)
            ends.append(lo + int(torch.randint(1, hi - lo + 1, (1,), generator=g)))
    return (torch.tensor(rows), torch.tensor(starts), torch.tensor(ends))


def synthetic_features(need: set[str], lengths: Sequence[int], g: torch.Generator,
                       image_dim: int = PAPER_IMAGE_DIM, joint_dim: int = PAPER_JOINT_DIM) -> Any:
    """Random cached features (float32, as the feature stores hold them) of the groups in
    ``need`` (:func:`mmcse.methods.objectives.needed_features`) for a batch of ``len(lengths)``."""
    from mmcse.training.batches import BatchFeatures

    n = len(lengths)
    feats = BatchFeatures()
    if "image" in need:
        feats.image = torch.randn(n, image_dim, generator=g).relu()  # (B, 2048): pooled ResNet features are >= 0
    if "joint" in need:
        unit = torch.nn.functional.normalize
        feats.joint_text = unit(torch.randn(n, joint_dim, generator=g), dim=1)  # (B, 512) t̂
        feats.joint_image = unit(torch.randn(n, joint_dim, generator=g), dim=1)  # (B, 512) v̂
    if "text_teachers" in need:  # text teachers' features are L2-normalised
        feats.text_teachers = [torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
                               for d, _ in PAPER_TEXT_TEACHERS]
        feats.text_weights = [w for _, w in PAPER_TEXT_TEACHERS]
    if "objects" in need:
        feats.object_row, feats.object_start, feats.object_end = object_spans(lengths, g)  # (T,) each
        feats.objects = torch.randn(len(feats.object_row), image_dim, generator=g).relu()  # (T, 2048)
    return feats


def synthetic_regions(batch_size: int, g: torch.Generator, n_regions: int = PAPER_REGIONS,
                      region_dim: int = PAPER_REGION_DIM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DUET's inputs for ``batch_size`` images on the CPU: ``(regions (B, n, d), boxes (B, n, 5),
    mask (B, n))``: post-ReLU random features (bottom-up-attention features are >= 0), boxes
    ``normalized_boxes`` (Eq. 23) of random valid x1 <= x2, y1 <= y2 boxes in a 640 × 480 image,
    every region valid (the 36-box files have no padding)."""
    from mmcse.models.duet import normalized_boxes

    width, height = BOX_IMAGE_SIZE
    regions = torch.randn(batch_size, n_regions, region_dim, generator=g).relu()  # (B, n, d)
    xs = torch.rand(batch_size, n_regions, 2, generator=g).sort(dim=-1).values * width  # (B, n, 2): x1 <= x2
    ys = torch.rand(batch_size, n_regions, 2, generator=g).sort(dim=-1).values * height  # (B, n, 2): y1 <= y2
    xyxy = torch.stack([xs[..., 0], ys[..., 0], xs[..., 1], ys[..., 1]], dim=-1)  # (B, n, 4) pixels
    boxes = normalized_boxes(xyxy, width, height)  # (B, n, 5)
    return regions, boxes, torch.ones(batch_size, n_regions, dtype=torch.bool)


def duet_size_overrides(size: str) -> dict[str, Any]:
    """``model.duet.*`` overrides of a ``--duet-size``: ``paper`` = DUET's recipe (recipes/duet.yaml, §5.2) over
    :class:`mmcse.config.DuetModelConfig`'s defaults, ``demo`` = the repo's params.yaml ``model.duet``."""
    from mmcse.config import ConfigError, DuetModelConfig
    from mmcse.experiments.params import load_config
    from mmcse.experiments.recipes import load_recipes

    if size == "paper":
        recipe = load_recipes(REPO)["duet"].values(None)
        defaults = {f"model.duet.{k}": v for k, v in dataclasses.asdict(DuetModelConfig()).items()}
        return {**defaults, **{k: v for k, v in recipe.items() if k.startswith("model.duet.")}}
    if size == "demo":
        try:
            duet = load_config(REPO / "params.yaml").model.duet
        except ConfigError as err:
            fail(str(err))
    else:
        fail(f"--duet-size {size!r}: choose one of {', '.join(DUET_SIZES)}")
    return {f"model.duet.{k}": v for k, v in dataclasses.asdict(duet).items()}


def find_region_store(regions_dir: Path, image_ids: Sequence[str]) -> Any:
    """The first region set (by folder name) in ``regions_dir`` holding every image of ``image_ids``
    (:class:`mmcse.detection.regions.RegionStore`), or None; sets that fail to open are skipped."""
    from mmcse.detection.regions import RegionStore

    wanted = set(image_ids)
    for index in sorted(regions_dir.glob("*/index.json")) if regions_dir.is_dir() else []:
        try:
            store = RegionStore.open(index.parent)
        except Exception as err:  # a damaged set: cache_regions rebuilds it; random regions here
            print(f"skipping region set {index.parent}: {err}")
            continue
        if wanted <= set(store.ids):
            return store
    return None


def tensors_bytes(*groups: Any) -> int:
    """Bytes of the distinct tensors in ``groups`` (modules' parameters and gradients,
    optimizers' state, dicts / lists / BatchFeatures of tensors)."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen.setdefault(t.data_ptr(), t.numel() * t.element_size())

    for group in groups:
        if isinstance(group, torch.nn.Module):
            for p in group.parameters():
                add(p)
                add(p.grad)
        elif isinstance(group, torch.optim.Optimizer):
            for state in group.state.values():
                for v in state.values():
                    add(v)
        elif dataclasses.is_dataclass(group):
            for f in dataclasses.fields(group):
                value = getattr(group, f.name)
                for v in value if isinstance(value, list) else [value]:
                    add(v)
        elif isinstance(group, dict):
            for v in group.values():
                add(v)
        elif isinstance(group, (tuple, list)):
            for v in group:
                add(v)
    return sum(seen.values())


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (VmHWM) of this process (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclasses.dataclass
class Run:
    """One method's model, optimizer, scaler and inputs for one batch size. A DUET run has
    ``regions`` (regions (B, n, d), boxes (B, n, 5), mask (B, n)) and ``ignore`` (B, B)
    (:func:`mmcse.training.duet.same_image_mask`) and no ``feats``; its ``student`` is the
    :class:`mmcse.models.duet.DuetModel`."""

    cfg: Any
    on: dict[str, bool]
    student: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    batch: dict[str, torch.Tensor]
    feats: Any
    pair_batch: bool = True
    regions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ignore: torch.Tensor | None = None
    peer_loss: torch.nn.Module | None = None  # the peer's loss module (its ``student``: the SentenceTransformer)
    step: Any = None  # the run's training step (StudentStep / RetrievalStep), built once, eager or compiled
    graph_breaks: int | None = None  # of its forward (torch._dynamo.explain); None: not compiled


def build_step(run: Run, device: torch.device, compiled: bool) -> None:
    """The run's training step as train builds it (`StudentStep` / `RetrievalStep`), compiled for ``train.compile:
    step`` (then the graph breaks of its forward on the run's inputs are counted)."""
    from mmcse.methods.objectives import Objective
    from mmcse.training.compiled import graph_breaks, seed_tensor
    from mmcse.training.duet_step import RetrievalStep
    from mmcse.training.engine import Update
    from mmcse.training.loop import StudentStep, step_draws

    update = Update(run.cfg.train, run.optimizer, run.scaler, device)
    tokens = (run.batch["input_ids"], run.batch["attention_mask"])
    if run.regions is not None:
        run.step = RetrievalStep(run.student, run.cfg.loss, update, compiled=compiled)
        forward, inputs = run.step.step.forward_of("pairs"), (*tokens, *run.regions, run.ignore,
                                                               seed_tensor(0, device), (0, 1))
    else:
        o = Objective.of(run.cfg)
        run.step = StudentStep(run.student, o, update, run.on, compiled=compiled)
        draws = step_draws(run.student, o, tuple(tokens[0].shape), run.pair_batch, 0, run.on)
        forward, inputs = run.step.step.forward_of(run.pair_batch), (*tokens, run.feats, seed_tensor(0, device),
                                                                     draws, None)
    if compiled:
        run.graph_breaks, reasons = graph_breaks(forward, *inputs)
        for reason in reasons:
            print(f"  graph break ({run.cfg.train.method}): {reason}")


def make_run(cfg: Any, base: torch.nn.Module, batch: dict[str, torch.Tensor], feats: Any, device: torch.device,
             total_steps: int, compile_mode: Any, pair_batch: bool = True) -> Run:
    """A copy of ``base`` (the same initial weights for every method) with train's optimizer, compiled as
    ``compile_mode`` (``train.compile``) says."""
    from mmcse.methods.objectives import Objective, active_terms
    from mmcse.models.precision import grad_scaler
    from mmcse.training.engine import build_optimizer

    student = copy.deepcopy(base).to(device).train()
    if compile_mode == "backbone":
        student.backbone.compile(dynamic=True)  # as train does with train.compile: backbone (in place)
    optimizer, _ = build_optimizer(student, cfg.train, total_steps, device)
    run = Run(cfg, active_terms(Objective.of(cfg)), student, optimizer, grad_scaler(cfg.train.precision, device),
              batch, feats, pair_batch)
    build_step(run, device, compile_mode == "step")
    return run


def make_duet_run(cfg: Any, base: torch.nn.Module, batch: dict[str, torch.Tensor],
                  regions: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ignore: torch.Tensor,
                  device: torch.device, total_steps: int, compile_mode: Any = False) -> Run:
    """A copy of the DUET model ``base`` with ``train_duet``'s optimizer and scaler, its step compiled with
    ``compile_mode`` ``step`` (``train_duet`` compiles nothing else)."""
    from mmcse.models.precision import grad_scaler
    from mmcse.training.engine import build_optimizer

    model = copy.deepcopy(base).to(device).train()
    optimizer, _ = build_optimizer(model, cfg.train, total_steps, device)
    run = Run(cfg, {}, model, optimizer, grad_scaler(cfg.train.precision, device), batch, None,
              regions=regions, ignore=ignore)
    build_step(run, device, compile_mode == "step")
    return run


def make_peer_run(cfg: Any, backbone: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
                  folder: Path) -> Run:
    """sentence-transformers' MNRL step on a copy of ``backbone`` (`peers.ranking_loss`, the student's
    tokenizer): the peer of mmcse's SimCSE step."""
    from peers import ranking_loss

    from mmcse.models.precision import grad_scaler

    loss = ranking_loss(backbone, Path(tempfile.mkdtemp(dir=folder)), device, cfg.loss.temperature,
                        max_seq_length=batch["input_ids"].shape[1], tokenizer=cfg.model.name_or_path)
    optimizer = torch.optim.AdamW(loss.model.parameters(), lr=cfg.train.learning_rate,
                                  weight_decay=cfg.train.weight_decay, fused=device.type == "cuda")
    return Run(cfg, {}, loss.model, optimizer, grad_scaler(cfg.train.precision, device), batch, None, peer_loss=loss)


def peer_step(run: Run, device: torch.device) -> dict[str, torch.Tensor]:
    """One MNRL update: anchors and positives are the same sentences, each list encoded in its own pass."""
    from mmcse.models.precision import autocast

    run.optimizer.zero_grad(set_to_none=True)
    features = {"input_ids": run.batch["input_ids"], "attention_mask": run.batch["attention_mask"]}
    with autocast(run.cfg.train.precision, device):
        loss = run.peer_loss([features, dict(features)], None)
    run.scaler.scale(loss).backward()
    run.scaler.step(run.optimizer)
    run.scaler.update()
    return {"loss": loss.detach()}


def run_step(run: Run, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The training step of the run's method, as train runs it (`mmcse.training.duet_step.RetrievalStep` for DUET,
    `mmcse.training.loop.StudentStep` for the students), or the peer's. Returns the loss terms."""
    if run.peer_loss is not None:
        return peer_step(run, device)
    if run.regions is not None:
        return run.step(run.batch, run.regions, run.ignore, seed)
    return run.step(run.batch, run.feats, run.pair_batch, seed)


def timed_step(run: Run, device: torch.device, seed: int) -> tuple[float, int]:
    """One :func:`run_step`: (seconds, peak device bytes the method alone would need — its
    weights, gradients, AdamW state and inputs plus the step's transient peak on top; 0 on
    the CPU)."""
    resident = 0
    synchronize(device)
    if device.type == "cuda":
        resident = tensors_bytes(run.student, run.optimizer, run.batch, run.feats,
                                 [*(run.regions or ()), run.ignore])
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    run_step(run, device, seed)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = resident + torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    return seconds, peak


def time_runs(runs: dict[str, Run], device: torch.device, repeats: int, warmup: int) -> dict[str, dict[str, Any]]:
    """Interleaved steps of every run: ``warmup`` uncounted rounds, then ``repeats`` rounds;
    the order of the runs rotates each round."""
    names = list(runs)
    times: dict[str, list[float]] = {m: [] for m in names}
    peaks = dict.fromkeys(names, 0)
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, peak = timed_step(runs[name], device, seed=round_)
            if round_ >= warmup:
                times[name].append(seconds)
                peaks[name] = max(peaks[name], peak)
    return {m: {"median_ms": statistics.median(times[m]) * 1000, "times_ms": [t * 1000 for t in times[m]],
                "peak_mib": peaks[m] / MIB if device.type == "cuda" else None} for m in names}


def guard_teachers() -> None:
    """A step that ran a teacher model raises: features must come from the cache."""
    import mmcse.teachers.cache

    def no_teacher(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a training step ran a teacher model: features must come from the cache")

    for name in ("text_teacher_features", "colour_edge_grid_features", "pretrained_joint_teacher"):
        setattr(mmcse.teachers.cache, name, no_teacher)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--precision", default=None, choices=("fp32", "bf16", "fp16"),
                        help="train.precision (default: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--student", default=None, choices=STUDENTS,
                        help="random-weight student (default: bert-base on CUDA, tiny on the CPU)")
    parser.add_argument("--params", default=None, metavar="FILE",
                        help="use this params file's model.* as the student (load_backbone) instead of --student")
    parser.add_argument("--teachers", default=None, metavar="DIR",
                        help="read captions and features from this teacher cache (DIR/../raw, DIR/../objects); "
                             "DUET's regions from the first set in DIR/../regions holding the pairs' images, "
                             "else random")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[64])
    parser.add_argument("--seq-len", type=int, default=32, help="padded tokens per sentence (synthetic batches)")
    parser.add_argument("--repeats", type=int, default=40, help="timed rounds (each runs every method once)")
    parser.add_argument("--warmup", type=int, default=3, help="uncounted rounds first")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--duet-size", default=None, choices=DUET_SIZES,
                        help="DUET's added layers: paper (recipes/duet.yaml: 4 visual + 2 shared layers, "
                             "joint 1024, 16 heads, ff 4096) or demo (params.yaml: joint 256, 4 heads, ff 1024); "
                             "default: demo for --student tiny, paper for bert-base / roberta-base, the file's "
                             "model.duet with --params")
    parser.add_argument("--compile", nargs="?", const="backbone", default="false",
                        choices=("false", "backbone", "step"),
                        help="train.compile: backbone (a bare --compile) compiles the students' backbones (DUET stays "
                             "eager, as train_duet does then); step compiles every method's whole step and counts "
                             "its graph breaks")
    parser.add_argument("--fill-uninitialized-memory", action="store_true",
                        help="torch's NaN fill of new tensors under deterministic algorithms (train turns it off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peer", action="store_true",
                        help=f"leave out the peer ({PEER}: sentence-transformers' MNRL step, timed with simcse)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the numbers here")
    args = parser.parse_args(argv)
    args.methods = list(dict.fromkeys(args.methods))  # each once, in the order given
    args.compile = False if args.compile == "false" else args.compile  # train.compile's values
    if args.params and args.student:
        parser.error("--params and --student both name the student: give one")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if min(args.batch_size) < 2:
        parser.error("--batch-size must be >= 2 (in-batch negatives)")
    if not 8 <= args.seq_len <= 512:
        parser.error("--seq-len must be in [8, 512]")
    return args


def load_base_config(params: str | None, precision: str, compile_mode: Any) -> Any:
    """The loss and optimizer settings: ``params`` or the repo's params.yaml, with the
    benchmark's precision and ``train.compile``."""
    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config

    file = Path(params) if params else REPO / "params.yaml"
    try:
        return load_config(file, overrides={"train.precision": precision, "train.compile": compile_mode,
                                            "ablate.preset": "none"})
    except ConfigError as err:
        fail(str(err))


def markdown_tables(results: list[dict[str, Any]], methods: Sequence[str], precision: str,
                    device: torch.device) -> str:
    head = "| B | tokens | precision | " + " | ".join(
        f"{m} ms" if m == "simcse" or "simcse" not in methods else m for m in methods) + " |"
    lines = [head, "|" + "---|" * (len(methods) + 3)]
    for r in results:
        cells = []
        for m in methods:
            ms = r["methods"][m]["median_ms"]
            ratio = r["methods"][m].get("ratio")
            cells.append(f"{ms:.1f}" if m == "simcse" or ratio is None else f"{ms:.1f} ({ratio:.2f}×)")
        lines.append(f"| {r['batch_size']} | {r['tokens']} | {precision} | " + " | ".join(cells) + " |")
    lines.append("")
    if "mcse" in methods:
        lines.append("| B | " + " | ".join(f"{m} ÷ mcse" for m in methods) + " |")
        lines.append("|" + "---|" * (len(methods) + 1))
        for r in results:
            lines.append(f"| {r['batch_size']} | "
                         + " | ".join(f"{r['methods'][m]['ratio_mcse']:.2f}×" for m in methods) + " |")
        lines.append("")
    if device.type == "cuda":
        lines.append("| B | " + " | ".join(f"{m} peak MiB" for m in methods) + " |")
        lines.append("|" + "---|" * (len(methods) + 1))
        for r in results:
            lines.append(f"| {r['batch_size']} | "
                         + " | ".join(f"{r['methods'][m]['peak_mib']:.0f}" for m in methods) + " |")
    else:
        lines.append("| B | peak RSS MiB (process, every method's model resident) |")
        lines.append("|---|---|")
        for r in results:
            lines.append(f"| {r['batch_size']} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    precision = args.precision or default_precision(device)
    checked_precision(precision, device)  # before any compute
    setup_like_train(device, args.fill_uninitialized_memory)

    from mmcse.config import with_overrides
    from mmcse.methods.objectives import Objective, needed_features
    from mmcse.models.duet import DuetArchitecture, DuetModel
    from mmcse.models.student import Student, load_backbone, load_tokenizer
    from mmcse.models.tokens import tokenize_texts
    from mmcse.training.batches import TrainData
    from mmcse.training.duet import duet_architecture, same_image_mask

    guard_teachers()
    base_cfg = load_base_config(args.params, precision, args.compile)
    students = [m for m in args.methods if m != "duet"]
    student_name = None if args.params else args.student or ("bert-base" if device.type == "cuda" else "tiny")
    duet_size = args.duet_size or (None if args.params else "demo" if student_name == "tiny" else "paper")
    cfgs = {m: with_overrides(base_cfg, {"train.method": m}) for m in students}
    if "duet" in args.methods:
        cfgs["duet"] = with_overrides(base_cfg, {"train.method": "duet",
                                                 **(duet_size_overrides(duet_size) if duet_size else {})})

    data = None
    region_store = None
    if args.teachers:
        teachers = Path(args.teachers)
        if not (teachers / "manifest.json").is_file():
            fail(f"{teachers / 'manifest.json'} not found: --teachers must name a teacher cache "
                 "(dvc repro cache_teachers)")
        data = TrainData.load(teachers.parent / "raw", teachers, teachers.parent / "objects")
        image_dim, joint_dim = data.image_features.dim, data.joint_image.dim
        # the first pairs with object–phrase pairs, so the MCSEO step has its full term
        with_objects = [i for i, p in enumerate(data.pair_ids) if p in data.objects][:max(args.batch_size)]
        if "duet" in args.methods:
            region_store = find_region_store(teachers.parent / "regions", [data.image_ids[i] for i in with_objects])
    else:
        image_dim, joint_dim = PAPER_IMAGE_DIM, PAPER_JOINT_DIM
    n_regions, region_dim = ((region_store.max_regions, region_store.dim) if region_store is not None
                             else (PAPER_REGIONS, PAPER_REGION_DIM))

    torch.manual_seed(args.seed)
    if args.params:
        backbone = load_backbone(base_cfg.model, dropout=base_cfg.train.dropout)
        student_name = f"{base_cfg.model.name_or_path} ({base_cfg.model.init}, from {args.params})"
    else:
        backbone = build_backbone(student_name, dropout=base_cfg.train.dropout)
    vocab_size, pad_id = backbone.config.vocab_size, backbone.config.pad_token_id or 0
    duet_base = None
    if "duet" in args.methods:  # its text stream: a copy of the students' initial backbone
        duet_base = DuetModel(copy.deepcopy(backbone), DuetArchitecture(**duet_architecture(cfgs["duet"].model.duet,
                                                                                            region_dim)))
    base = Student(backbone, image_dim, base_cfg.model.proj_dim, joint_dim,
                   text_teacher_dim=PAPER_TEXT_TEACHERS[0][0], head=base_cfg.model.projection_head)

    print(f"device: {device_description(device)}")
    print(f"torch {torch.__version__}, precision {precision}, student {student_name} "
          f"({parameter_count(base) / 1e6:.1f}M parameters with heads), compile {args.compile}, "
          f"fill_uninitialized_memory {args.fill_uninitialized_memory}")
    print(f"features: {'teacher cache ' + str(args.teachers) if data else 'synthetic'} (image {image_dim}-d, "
          f"joint {joint_dim}-d); median of {args.repeats} rounds after {args.warmup} warm-up rounds")
    duet_info = None
    if duet_base is not None:
        d = cfgs["duet"].model.duet
        regions_from = str(region_store.folder) if region_store is not None else "synthetic"
        duet_info = {"size": duet_size or f"model.duet of {args.params}",
                     "architecture": duet_architecture(cfgs["duet"].model.duet, region_dim),
                     "parameters": parameter_count(duet_base), "regions": regions_from, "n_regions": n_regions,
                     "region_dim": region_dim}
        print(f"duet: {duet_info['size']} ({d.visual_layers} visual + {d.shared_layers} shared layers, joint "
              f"{d.joint_dim}, {d.heads} heads, ff {d.ff_dim}; {duet_info['parameters'] / 1e6:.1f}M parameters); "
              f"regions {regions_from} ({n_regions} × {region_dim}-d per image)")

    timed = [*args.methods, *([PEER] if "simcse" in args.methods and not args.no_peer else [])]
    peer_folder = Path(tempfile.mkdtemp(prefix="step_time_peer_"))  # the peer's saved backbones, removed at exit
    atexit.register(shutil.rmtree, peer_folder, True)
    results = []
    for batch_size in args.batch_size:
        g = torch.Generator().manual_seed(args.seed * 1000 + batch_size)
        regions = None
        if data is not None:
            idx = with_objects[:batch_size]
            if len(idx) < batch_size:
                fail(f"--batch-size {batch_size}: the cache has only {len(idx)} pairs with objects")
            tokenizer = load_tokenizer(base_cfg.model.name_or_path)
            batch = tokenize_texts(tokenizer, [data.captions[i] for i in idx], base_cfg.model.max_seq_len).batch(
                range(len(idx)), device)
            feats = {m: data.pair_features(idx, needed_features(Objective.of(cfgs[m]), pair_batch=True), device)
                     for m in students}
            image_ids = [data.image_ids[i] for i in idx]
            if region_store is not None:
                r, b, mask = region_store.rows(image_ids)
                regions = tuple(torch.from_numpy(a) for a in (r, b, mask))
        else:
            lengths = synthetic_lengths(batch_size, args.seq_len, g)
            batch = {k: v.to(device) for k, v in synthetic_batch(lengths, vocab_size, pad_id, g).items()}
            # one draw of every group, so each method reads the same numbers for a group
            every = synthetic_features({"image", "joint", "text_teachers", "objects"}, lengths, g, image_dim, joint_dim)
            feats = {}
            for m in students:
                need = needed_features(Objective.of(cfgs[m]), pair_batch=True)
                keep = {f.name: getattr(every, f.name) for f in dataclasses.fields(every)}
                for group, names in {"image": ["image"], "joint": ["joint_text", "joint_image"],
                                     "text_teachers": ["text_teachers", "text_weights"],
                                     "objects": ["objects", "object_row", "object_start", "object_end"]}.items():
                    if group not in need:
                        keep.update(dict.fromkeys(names))
                feats[m] = type(every)(**keep).to(device)
            image_ids = [f"image-{i}" for i in range(batch_size)]  # one image per caption
        if duet_base is not None and regions is None:
            regions = synthetic_regions(batch_size, g, n_regions, region_dim)
        tokens = batch["input_ids"].shape[1]
        print(f"\nbatch {batch_size} × {tokens} tokens (pair batch: every image term on)")
        reset_peak_rss()
        runs = {m: make_run(cfgs[m], base, batch, feats[m], device, args.warmup + args.repeats, args.compile)
                for m in students}
        if duet_base is not None:
            duet_regions = tuple(t.to(device) for t in regions)
            runs["duet"] = make_duet_run(cfgs["duet"], duet_base, batch, duet_regions,
                                         same_image_mask(image_ids, device), device, args.warmup + args.repeats,
                                         args.compile)
        runs = {m: runs[m] for m in args.methods}  # the order asked for
        if PEER in timed:
            runs[PEER] = make_peer_run(base_cfg, base.backbone, batch, device, peer_folder)
        stats = time_runs(runs, device, args.repeats, args.warmup)
        simcse = stats.get("simcse", {}).get("median_ms")
        mcse = stats.get("mcse", {}).get("median_ms")
        for m in timed:
            stats[m]["ratio"] = stats[m]["median_ms"] / simcse if simcse else None
            stats[m]["ratio_mcse"] = stats[m]["median_ms"] / mcse if mcse else None
            # the names --compile step's JSON promises (ms, ratio_to_simcse, graph_breaks), beside the table's
            stats[m] |= {"ms": stats[m]["median_ms"], "ratio_to_simcse": stats[m]["ratio"],
                         "graph_breaks": runs[m].graph_breaks}
            ratio = f"   ratio to simcse: {stats[m]['ratio']:.3f}" if simcse else ""
            ratio += f"   ratio to mcse: {stats[m]['ratio_mcse']:.3f}" if mcse else ""
            peak = f"   peak {stats[m]['peak_mib']:8.0f} MiB" if device.type == "cuda" else ""
            breaks = f"   graph breaks: {runs[m].graph_breaks}" if runs[m].graph_breaks is not None else ""
            print(f"{m:>7} step: {stats[m]['median_ms']:9.1f} ms{ratio}{peak}{breaks}")
        result = {"batch_size": batch_size, "tokens": tokens, "methods": stats}
        if device.type == "cpu":
            result["peak_rss_mib"] = peak_rss_mib()
            print(f"peak RSS (process, {len(runs)} models resident): {result['peak_rss_mib']:.0f} MiB")
        results.append(result)
        del runs
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    print(markdown_tables(results, timed, precision, device))
    if args.json:
        from mmcse.io import write_json

        out = {"device": device_description(device), "torch": torch.__version__, "precision": precision,
               "student": student_name, "compile": args.compile, "repeats": args.repeats, "warmup": args.warmup,
               "fill_uninitialized_memory": args.fill_uninitialized_memory,
               "features": str(args.teachers) if data else "synthetic", "image_dim": image_dim,
               "joint_dim": joint_dim, "duet": duet_info, "peer": PEER if PEER in timed else None,
               "results": results}
        write_json(Path(args.json), out)
        print(f"\nwrote {args.json}")

if __name__ == "__main__":
    main()
