"""`mmcse preflight`: every row of a table (or params.yaml's own run) built at its real architectures and
shapes and run for a few training steps on this machine, before anyone spends GPU hours on it.

Per row (the same rows `mmcse plan` resolves: recipe, profile, overrides), in a process of its own:

* the models the row trains, at the row's configuration: the student (its ``model.name_or_path``) with every head
  its method trains, the widths of the teacher features its loss reads (the image encoder, the joint teacher,
  each text teacher: `mmcse.models.architectures`), or the retrieval model (DUET's text stream and visual layers,
  VSE++'s GRU and, on pixels, its ResNet; VSRN's reasoning and caption generator). Weights are the real ones
  where the model is here; otherwise random ("random weights: wiring, memory and time only"). Nothing downloads.
* ``steps`` training steps through the train stage's own step (`mmcse.training.loop.StudentStep`,
  `mmcse.training.duet_step.RetrievalStep`): the row's batch size, ``model.max_seq_len`` tokens per sentence, its
  precision, dropout and gradient caching, an image–caption batch (SimCSE rows: a text batch), random inputs.
* what it measured: ran or failed (the error's first line), the peak memory (CUDA's max allocated on a GPU; the
  process's peak resident set on a CPU), the median step time after the first step, and, where this machine
  downloaded the row's data, the row's training steps and the projected time of its training and dev evaluations.
* the train stage's resume point (weights, optimizer, scheduler, RNG) written to a temporary folder and read back:
  its size and the seconds it took (the weights must come back as written).
* a row that runs out of memory is tried again with ``train.micro_batch`` halved (gradient-cached batches, the same
  update: `mmcse.training.gradcache`) until one fits; the row reports it with its time.

It writes nothing into the stages' outputs and logs nothing to MLflow.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mmcse.config import Config, ConfigError, parse_config, to_dict, with_overrides
from mmcse.config.inputs import JOINT_TEXT_TEACHER
from mmcse.config.training import RETRIEVAL_METHODS
from mmcse.data.sizes import published_counts
from mmcse.experiments.estimate import downloaded_counts, job_steps
from mmcse.experiments.jobs import expand, job_config
from mmcse.experiments.params import load_config
from mmcse.experiments.preflight_cache import caches_text, projected_minutes, teacher_cache_check
from mmcse.experiments.stand_ins import used_sets
from mmcse.hub import local_model
from mmcse.methods.objectives import Objective, active_terms, needed_features
from mmcse.models.architectures import model_config, projection_width, text_width
from mmcse.models.cnn import RESNET_WIDTH
from mmcse.models.device import resolve_device
from mmcse.models.dropout import install_keyed_dropout
from mmcse.models.duet import DuetArchitecture, DuetModel
from mmcse.models.precision import autocast, check_precision, grad_scaler
from mmcse.models.student import MaskedLMHead, Student, configure, load_mlm_head, load_tokenizer
from mmcse.models.vsepp import VseppModel
from mmcse.models.vsrn import VsrnModel
from mmcse.training.batches import BatchFeatures
from mmcse.training.checkpoints import TrainState, restore_resume_point, save_resume_point
from mmcse.training.duet import duet_architecture, vsepp_architecture, vsrn_architecture
from mmcse.training.duet_step import RetrievalStep
from mmcse.training.engine import Update, build_optimizer, is_out_of_memory
from mmcse.training.loop import StudentStep

RANDOM = "random weights: wiring, memory and time only"
MIN_STEPS = 2  # the first step is not timed
MIN_TIMEOUT = 30  # seconds: a row's process imports torch and builds its models before it steps
WORD_VOCABULARY = 10_000  # VSE++ / VSRN without the data here: about COCO's words seen 4 times
OBJECTS_PER_SENTENCE = 3  # MCSEO: object–phrase pairs per caption in a synthetic batch
# a model family's mask token and special ids (the tokenizer's) when no tokenizer is on the machine
MASKING = {"bert": (103, [0, 100, 101, 102, 103]), "roberta": (50264, [0, 1, 2, 3, 50264])}


# --------------------------------------------------------------------------- widths of the row's inputs


def _joint_widths(job: Config, image_dim: int) -> tuple[int, int]:
    """``(t̂ width, v̂ width)`` of the joint teacher (KDMCSE Eq. 5–6)."""
    j = job.teachers.joint
    if j.kind == "cca":
        text = image = j.dim
    elif j.kind == "clip":
        text = image = projection_width(model_config(j.model)[0])
    else:
        import open_clip

        text = image = int(open_clip.get_model_config(j.model)["embed_dim"])
    return text, (image_dim if j.image_side == "image_encoder" else image)


def input_widths(job: Config) -> dict[str, Any]:
    """The widths of the cached features the row's student reads: ``image``, ``joint_text``,
    ``joint_image`` and ``text_teachers`` (one per teacher), from the teachers' architectures."""
    t = job.teachers
    image = RESNET_WIDTH if t.image_encoder == "resnet50" else t.image_grid ** 2 * (t.colour_bins ** 3 + 8)
    joint_text, joint_image = _joint_widths(job, image)
    teachers = []
    for teacher in t.text:
        if teacher.teacher == JOINT_TEXT_TEACHER:
            teachers.append(joint_text)
        elif teacher.pooler == "clip":
            teachers.append(projection_width(model_config(teacher.teacher)[0]))
        else:
            teachers.append(text_width(model_config(teacher.teacher)[0]))
    return {"image": image, "joint_text": joint_text, "joint_image": joint_image, "text_teachers": teachers}


# --------------------------------------------------------------------------- models and batches


def _backbone(job: Config) -> tuple[torch.nn.Module, Any, bool]:
    """``(encoder, its configuration, real weights)`` of ``model.name_or_path``, without a download."""
    from transformers import AutoModel

    config, here = model_config(job.model.name_or_path)
    configure(config, job.model, dropout=job.train.dropout)
    if here and job.model.init == "pretrained":
        location = local_model(job.model.name_or_path)
        return AutoModel.from_pretrained(location, config=config, add_pooling_layer=False), config, True
    return AutoModel.from_config(config, add_pooling_layer=False), config, False


def _mlm_head(job: Config, config: Any, real: bool) -> MaskedLMHead:
    if real:
        return load_mlm_head(job.model, load_tokenizer(job.model.name_or_path), job.loss.simcse.mlm_head)
    from transformers import AutoModelForMaskedLM

    if config.model_type not in MASKING:
        raise ConfigError(f"loss.simcse.mlm: no tokenizer of {job.model.name_or_path!r} here and no known mask "
                         f"token for model type {config.model_type!r}")
    model = AutoModelForMaskedLM.from_config(config)
    head = next(m for name, m in model.named_children() if name != model.base_model_prefix)
    mask_id, special = MASKING[config.model_type]
    return MaskedLMHead(head, mask_id, config.vocab_size, special)


def _ids(batch: int, length: int, vocab: int, low: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 1_000 + length)
    return {"input_ids": torch.randint(low, vocab, (batch, length), generator=g),
            "attention_mask": torch.ones(batch, length, dtype=torch.long)}


def _unit(*shape: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(*shape), dim=-1)


def _student_features(job: Config, widths: dict[str, Any], need: set[str], batch: int, length: int) -> BatchFeatures:
    """Random teacher features of the real widths for the groups ``need`` (`needed_features`)."""
    feats = BatchFeatures()
    if "image" in need:
        feats.image = _unit(batch, widths["image"])
    if "joint" in need:
        feats.joint_text, feats.joint_image = _unit(batch, widths["joint_text"]), _unit(batch, widths["joint_image"])
    if "text_teachers" in need:
        feats.text_teachers = [_unit(batch, w) for w in widths["text_teachers"]]
        feats.text_weights = [t.weight for t in job.teachers.text]
    if "objects" in need:
        k = OBJECTS_PER_SENTENCE
        start = torch.randint(1, max(length - 2, 2), (batch * k,))
        feats.object_row = torch.arange(batch).repeat_interleave(k)  # (T,)
        feats.object_start, feats.object_end = start, torch.minimum(start + 2, torch.tensor(length - 1))
        feats.objects = _unit(batch * k, widths["image"])
    return feats


class _Vocabulary:
    """A word vocabulary's size and ids as `vsepp_architecture` reads them (VSE++'s `<pad> <start> <end>`)."""

    pad_token_id, eos_token_id = 0, 2

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def _region_shape(job: Config) -> tuple[int, int]:
    """``(regions per image, width)`` of the row's region set (BUTD files: 2048; objects: the image encoder's)."""
    r = job.regions
    if r.source == "grid":
        return 49, RESNET_WIDTH
    if r.source == "objects":
        return r.max_regions, input_widths(job)["image"]
    return r.max_regions, r.dim or RESNET_WIDTH


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, steps: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _retrieval_model(job: Config, width: int) -> tuple[torch.nn.Module, int, str, bool]:
    """The row's retrieval model on regions of ``width`` (VSE++ on pixels: a CNN): (model, its vocabulary's size,
    what it is, whether its weights are real: word models start new, DUET's text stream may be real)."""
    words = _Vocabulary(WORD_VOCABULARY)
    if job.train.method == "duet":
        backbone, config, real = _backbone(job)
        return DuetModel(backbone, DuetArchitecture(**duet_architecture(job.model.duet, width))), config.vocab_size, \
            job.model.name_or_path, real
    if job.train.method == "vsrn":
        model = VsrnModel.from_architecture(vsrn_architecture(job.model.vsrn, width, words, job.data.pairs))
        return model, len(words), f"VSRN on {WORD_VOCABULARY} words", False
    pixels = job.model.vsepp.image_input == "pixels"
    cnn = job.regions.grid_model if pixels else None
    model = VseppModel(**vsepp_architecture(job.model.vsepp, RESNET_WIDTH if pixels else width, words, cnn))
    return model, len(words), f"VSE++ on {WORD_VOCABULARY} words" + (f", {cnn} on pixels" if pixels else ""), False


def run_row(job: Config, steps: int) -> dict[str, Any]:
    """Build the row's models and run ``steps`` training steps (see the module docstring). Returns
    ``{"weights", "model" (what was built), "step_seconds"}`` and, for VSE++ fine-tuning its CNN, the
    fine-tuning's own ``finetune_step_seconds``."""
    device = resolve_device(job.base.device)
    check_precision(job.train.precision, device)
    torch.manual_seed(job.base.seed)
    b, length = job.train.batch_size, job.model.max_seq_len
    scaler = grad_scaler(job.train.precision, device)
    phases: dict[str, float] = {}
    if job.train.method in RETRIEVAL_METHODS:
        n, width = _region_shape(job)
        model, vocab, described, real = _retrieval_model(job, width)
        model = model.to(device).train()
        pixels = isinstance(model, VseppModel) and model.reads_pixels
        if pixels:
            model.cnn.requires_grad_(False)  # the frozen phase first, as training runs it
        batch = {k: v.to(device) for k, v in _ids(b, length, vocab).items()}
        if pixels:
            images = (torch.randn(b, 3, job.model.vsepp.crop_size, job.model.vsepp.crop_size, device=device), None,
                      None)
        else:
            boxes = torch.rand(b, n, 5, device=device).sort(-1).values  # any valid-looking box rows
            images = (torch.randn(b, n, width, device=device), boxes, torch.ones(b, n, dtype=torch.bool, device=device))
        optimizer, scheduler = build_optimizer(model, job.train, 1000, device, 1)
        step = functools.partial(RetrievalStep(model, job.loss, Update(job.train, optimizer, scaler, device)), batch,
                                 images, None)

        times = _timed(step, steps, device)
        if pixels and job.model.vsepp.finetune_epochs:
            model.cnn.requires_grad_(True)
            phases["finetune_step_seconds"] = statistics.median(_timed(step, steps, device)[1:] or [math.nan])
        e = job.evaluate.batch_size
        dev_images = tuple(x[:e] if x is not None else None for x in images)
        dev_ids = {k: v[:e] for k, v in batch.items()}

        def dev_batch() -> None:  # the val split's dev score: a batch of images and one of captions
            model.encode_image(*dev_images)
            model.encode_text(dev_ids["input_ids"], dev_ids["attention_mask"])
    else:
        backbone, config, real = _backbone(job)
        if job.train.dropout_rng == "per_row":
            install_keyed_dropout(backbone)
        widths = input_widths(job)
        objective = Objective.of(job)
        on = active_terms(objective)
        pair_batch = job.train.method != "simcse" or job.data.pairs != "none"
        need = needed_features(objective, pair_batch, on)
        teacher_widths = widths["text_teachers"]
        student = Student(backbone, widths["image"], job.model.proj_dim, widths["joint_image"],
                          text_teacher_dim=teacher_widths[0], head=job.model.projection_head,
                          joint_text_dim=widths["joint_text"])
        if on.get("mlm"):
            student.mlm_head = _mlm_head(job, config, real)
        student = student.to(device).train()
        batch = {k: v.to(device) for k, v in _ids(b, length, config.vocab_size, low=1000 if
                                                  config.vocab_size > 2000 else 4).items()}
        feats = _student_features(job, widths, need, b, length).to(device)
        optimizer, scheduler = build_optimizer(student, job.train, 1000, device, 1)
        model = student
        counter = iter(range(10**9))
        train_step = StudentStep(student, objective, Update(job.train, optimizer, scaler, device), on)

        def step() -> None:
            train_step(batch, feats, pair_batch, seed=next(counter))

        times = _timed(step, steps, device)
        described = job.model.name_or_path
        dev = {k: v.to(device) for k, v in _ids(job.evaluate.batch_size, length, config.vocab_size,
                                                 low=1000 if config.vocab_size > 2000 else 4).items()}

        def dev_batch() -> None:  # the dev STS score: a batch of dev sentences through the evaluation pooler
            student.encode(dev["input_ids"], dev["attention_mask"], job.evaluate.pooler)

    model.eval()
    with torch.no_grad(), autocast(job.train.precision, device):
        dev_seconds = statistics.median(_timed(dev_batch, 3, device)[1:])
    model.train()
    return {"weights": "real" if real else RANDOM, "model": described,
            "step_seconds": statistics.median(times[1:] or times), **phases, "dev_batch_seconds": dev_seconds,
            **resume_point_round_trip(model, optimizer, scheduler, scaler, steps)}


def resume_point_round_trip(model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any,
                            step: int) -> dict[str, float]:
    """The train stage's resume point (weights, optimizer, scheduler, scaler, RNG) written and read back
    in a temporary folder: its size on disk and the seconds both took; the weights read back must be the
    ones written."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory(prefix="mmcse-preflight-") as tmp:
        folder = Path(tmp) / "last"
        start = time.perf_counter()
        save_resume_point(folder, model, optimizer, scheduler, scaler, TrainState(step=step), "preflight")
        size = sum(f.stat().st_size for f in folder.iterdir())
        restored = restore_resume_point(folder, model, optimizer, scheduler, scaler)
        seconds = time.perf_counter() - start
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    if restored.step != step or changed:
        raise RuntimeError(f"the resume point did not read back as written (step {restored.step}, "
                           f"changed {changed[:3]})")
    return {"checkpoint_bytes": size, "checkpoint_seconds": seconds}


# --------------------------------------------------------------------------- one process per row


def _peak(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "CUDA max allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak resident set"  # Linux: KiB


def _child(config: dict[str, Any], steps: int, conn: Any, check: Any = None, start_method: str | None = None,
           scratch: str | None = None) -> None:
    if start_method:  # the stages' own (a spawned child defaults to spawn): their loaders' workers start as there
        mp.set_start_method(start_method, force=True)
    if scratch:  # the row's temporary folders inside the parent's, which removes it however the row ends
        tempfile.tempdir = scratch
    try:
        job = parse_config(config, where="preflight row")
        out = (check or run_row)(job, steps)
        out["peak_bytes"], out["peak_kind"] = _peak(resolve_device(job.base.device))
        out["status"] = "ran"
    except Exception as err:  # a row that fails is reported, not raised: the other rows still run
        first = (str(err).splitlines() or [""])[0][:300]
        out = {"status": "failed", "error": f"{type(err).__name__}: {first}", "out_of_memory": is_out_of_memory(err)}
    conn.send(out)
    conn.close()


def check_in_process(job: Config, steps: int, timeout: float | None = None, check: Any = None) -> dict[str, Any]:
    """`run_row` of ``job`` (or ``check(job, steps)``: `teacher_cache_check`) in a fresh process (its peak
    memory is its own; a crash or a kill is the row's failure, not preflight's)."""
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    # not a daemon: a check may start its own workers (the teachers' image DataLoader); killed below if it hangs
    own = {"check": check, "start_method": mp.get_start_method()} if check else {}
    scratch = tempfile.mkdtemp(prefix="mmcse-preflight-row-")
    process = ctx.Process(target=_child, args=(to_dict(job), steps, send), kwargs={**own, "scratch": scratch})
    process.start()
    send.close()
    timed_out = False
    try:
        try:  # a child that dies (killed for memory) closes the pipe: EOF, not a hang
            timed_out = not receive.poll(timeout)
            result = None if timed_out else receive.recv()
        except EOFError:
            result = None
        process.join(0 if timed_out else 5)  # a row past its timeout is stopped at once, below
    finally:  # timed out, or preflight interrupted: the check does not outlive it, nor do its temporary files
        if process.is_alive():
            process.kill()
            process.join()
        shutil.rmtree(scratch, ignore_errors=True)
    if timed_out:
        return {"status": "failed", "out_of_memory": False, "timed_out": True,
                "error": f"timed out: no result after --timeout {timeout:g} s (the row was stopped)"}
    if result is None:
        code = process.exitcode
        killed = code is not None and code < 0
        return {"status": "failed", "out_of_memory": killed,
                "error": f"the row's process ended without a result (exit code {code}"
                         f"{': killed, e.g. out of memory' if killed else ''})"}
    return result


def _with_micro_batch(job: Config, micro: int) -> Config:
    return with_overrides(job, {"train.micro_batch": micro, "train.dropout_rng": "per_row"}, where="preflight")


def preflight_row(job: Config, steps: int, timeout: float | None = None) -> dict[str, Any]:
    """`check_in_process`; out of memory, a sentence encoder's row is tried again with ``train.micro_batch``
    halved (B/2, B/4, …, 1) until one fits: ``micro_batch`` then names it (0: the row fit as it is)."""
    result = check_in_process(job, steps, timeout)
    result["micro_batch"] = job.train.micro_batch
    if result["status"] == "ran" or not result.get("out_of_memory") or job.train.method in RETRIEVAL_METHODS:
        return result
    micro = (job.train.micro_batch or job.train.batch_size) // 2
    while micro >= 1:
        retry = check_in_process(_with_micro_batch(job, micro), steps, timeout)
        if retry["status"] == "ran":
            return retry | {"micro_batch": micro, "fits_with": f"train.micro_batch: {micro}",
                            "error": result["error"]}
        if not retry.get("out_of_memory"):
            return result
        micro //= 2
    return result


def row_jobs(cfg: Config) -> list[tuple[str, Config]]:
    """``(row, its configuration)`` of every row of ``cfg``'s ablation (its first seed), or params.yaml's
    own run when ``ablate.preset`` names none."""
    if not cfg.ablate.variants:
        return [("params.yaml", cfg)]
    rows: dict[str, Config] = {}
    for job in expand(cfg):
        rows.setdefault(job.variant, job_config(cfg, job))
    return list(rows.items())


DOWNLOADED, PUBLISHED = "downloaded", "published sizes"


def row_counts(job: Config, params: Config, downloaded: dict[str, int] | None
               ) -> tuple[dict[str, int] | None, str | None]:
    """What a row's data counts, and from where: the download stage's counts where this machine downloaded the
    row's data (params.yaml's), else its sources' published sizes (`mmcse.data.sizes`), else nothing known."""
    if downloaded is not None and job.data == params.data:
        return downloaded, DOWNLOADED
    published = published_counts(job.data)
    return (published, PUBLISHED) if published is not None else (None, None)


def dev_evaluations(job: Config, total: int, counts: dict[str, int]) -> int:
    """The dev batches a training of ``total`` steps encodes: a dev score at step 0, every
    ``train.eval_steps`` and at the end, each over the dev STS sentences (two a pair) or, for a retrieval
    model, the val split's images and captions (`run_row` times a batch of each together)."""
    scores = 1 + total // job.train.eval_steps + (1 if total % job.train.eval_steps else 0)
    if job.train.method in RETRIEVAL_METHODS:
        items = max(int(counts.get("retrieval_val_images", 0)), int(counts.get("retrieval_val_captions", 0)))
    else:
        items = 2 * int(counts.get("sts_dev_pairs", 0))
    return scores * math.ceil(items / job.evaluate.batch_size)


def teacher_caches(jobs: list[tuple[str, Config]], items: int, params: Config, downloaded: dict[str, int] | None,
                   timeout: float | None = None, progress: Any = None) -> list[dict[str, Any]]:
    """`teacher_cache_check` once per distinct ``teachers`` section and used sets (`used_sets`) among the sentence
    encoders' rows that read a teacher feature, each in a process of its own: ``[{"rows", "status", "sets",
    "peak_bytes", "projected_minutes"}]``."""
    groups: dict[str, list[tuple[str, Config]]] = {}
    for name, job in jobs:
        used = used_sets(job)
        # DUET, VSE++ and VSRN read regions, not teachers; a row whose terms read no teacher feature (SimCSE)
        # needs no set, and a row builds only the sets its terms read (no stand-in nobody trains on)
        if job.train.method not in RETRIEVAL_METHODS and any(used.values()):
            key = json.dumps({"teachers": to_dict(job)["teachers"], "sets": used}, sort_keys=True)
            groups.setdefault(key, []).append((name, job))
    out = []
    for group in groups.values():
        result = check_in_process(group[0][1], items, timeout, check=teacher_cache_check)
        counts, counted = row_counts(group[0][1], params, downloaded)
        minutes = projected_minutes(result["sets"], counts) if result["status"] == "ran" else None
        out.append({"rows": [name for name, _ in group], "projected_minutes": minutes,
                    "counts_from": counted if minutes is not None else None, **result})
        if progress:
            progress(out[-1])
    return out


def preflight(params: str | Path = "params.yaml", preset: str | None = None, steps: int = 2,
              timeout: float | None = None, progress: Any = None, cache_items: int = 16) -> dict[str, Any]:
    """Every row of the ablation ``params`` describes (``preset``: ``ablate.preset`` replaced) checked
    at its real shapes (`preflight_row`), and its teacher caches built from ``cache_items`` synthetic items
    (`teacher_caches`; 0: not checked): ``{"profile", "preset", "device", "steps", "rows": [...],
    "total_minutes", "teacher_caches": [...], "cache_minutes"}``. ``progress(row)`` is called as each row
    and each cache check finishes."""
    if cache_items < 0 or cache_items == 1:
        raise ConfigError(f"cache_items={cache_items}: 0 (no teacher-cache check) or at least 2 (an item's time is "
                         "measured between 1 item and that many)")
    if steps < MIN_STEPS:
        raise ConfigError(f"--steps {steps}: at least {MIN_STEPS} (the first step is not timed: it builds kernels "
                         "and caches)")
    if timeout is not None and timeout < MIN_TIMEOUT:
        raise ConfigError(f"--timeout {timeout:g}: at least {MIN_TIMEOUT} s (a row's process imports torch and builds "
                         "its models before its first step), or leave it out: no limit")
    params = Path(params)
    cfg = load_config(params, {"ablate.preset": preset} if preset else None)
    root = params.parent
    downloaded = downloaded_counts(cfg, root)
    rows = []
    jobs = row_jobs(cfg)
    for name, job in jobs:
        result = preflight_row(job, steps, timeout)
        counts, counted = row_counts(job, cfg, downloaded)
        total = job_steps(job, job, root, counts) if counts is not None else None
        minutes = None
        if result["status"] == "ran" and total is not None:
            seconds = result["step_seconds"] * total
            if "finetune_step_seconds" in result:  # VSE++: the fine-tuning's steps at their own pace
                v = job.model.vsepp
                finetune = total * v.finetune_epochs // (job.train.epochs + v.finetune_epochs)
                seconds += (result["finetune_step_seconds"] - result["step_seconds"]) * finetune
            seconds += dev_evaluations(job, total, counts) * result["dev_batch_seconds"]
            minutes = seconds / 60
        # a row that ran names what it built (``result``'s model): VSE++ and VSRN read no model.name_or_path
        row = {"row": name, "method": job.train.method, "model": job.model.name_or_path,
               "batch_size": job.train.batch_size, "max_seq_len": job.model.max_seq_len,
               "precision": job.train.precision, "training_steps": total, "projected_minutes": minutes,
               "counts_from": counted if total is not None else None, **result}
        rows.append(row)
        if progress:
            progress(row)
    known = [r["projected_minutes"] for r in rows if r["projected_minutes"] is not None]
    caches = teacher_caches(jobs, cache_items, cfg, downloaded, timeout, progress) if cache_items else []
    cached = [c["projected_minutes"] for c in caches if c["projected_minutes"] is not None]
    return {"profile": cfg.base.profile, "preset": cfg.ablate.preset, "device": describe_device(cfg),
            "steps": steps, "rows": rows, "total_minutes": sum(known) if known else None,
            "cache_items": cache_items, "teacher_caches": caches, "cache_minutes": sum(cached) if cached else None}


def describe_device(cfg: Config) -> str:
    device = resolve_device(cfg.base.device)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
        return f"{torch.cuda.get_device_name(device)} ({memory:.0f} GiB)"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def progress_line(row: dict[str, Any]) -> str:
    """One finished row (or teacher-cache check), as the command shows it while the others run."""
    if "rows" in row:
        said = f"{len(row['sets'])} sets" if row["status"] == "ran" else row["error"]
        return f"  teacher caches of {', '.join(row['rows'])}: {row['status']} ({said})"
    said = f"{row['step_seconds']:.2f} s/step" if row["status"] == "ran" else row["error"]
    return f"  {row['row']}: {row['status']} ({said})"


def failed_rows(result: dict[str, Any]) -> list[str]:
    """The rows that did not run, even with a smaller micro-batch, and the teacher caches that did not build."""
    return [r["row"] for r in result["rows"] if r["status"] != "ran"] + [
        f"teacher caches of {', '.join(c['rows'])}" for c in result.get("teacher_caches", []) if c["status"] != "ran"]


def _minutes(m: float) -> str:
    return f"{m:.1f} min" if m < 10 else f"{m:.0f} min"


def _size(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def preflight_text(result: dict[str, Any]) -> str:
    """The preflight as a table, one line per row, then the table's total and the rows' notes."""
    lines = [f"preflight of profile {result['profile']}, preset {result['preset']} on {result['device']}: "
             f"{result['steps']} step(s) per row", "",
             f"{'row':<28} {'method':<7} {'batch':>9} {'result':<7} {'peak':>9} {'s/step':>8} {'steps':>8} "
             f"{'projected':>10}"]
    notes = []
    for r in result["rows"]:
        projected = "-" if r["projected_minutes"] is None else _minutes(r["projected_minutes"])
        step = "-" if r["status"] != "ran" else f"{r['step_seconds']:.2f}"
        shape = f"{r['batch_size']}x{r['max_seq_len']}"  # sentences × tokens
        peak = _size(r.get("peak_bytes"))
        lines.append(f"{r['row'][:28]:<28} {r['method']:<7} {shape:>9} {r['status']:<7} {peak:>9} "
                     f"{step:>8} {r['training_steps'] if r['training_steps'] is not None else '-':>8} {projected:>10}")
        if r["status"] == "ran" and r["weights"] != "real":
            notes.append(f"{r['row']}: {r['weights']} ({r['model']})")
        if r.get("fits_with"):
            notes.append(f"{r['row']}: does not fit as it is ({r['error']}); fits with {r['fits_with']} "
                         "(train.dropout_rng: per_row), the same update: the time above is with it")
        elif r["status"] != "ran":
            notes.append(f"{r['row']}: {r['error']}")
        if r["status"] == "ran":
            notes.append(f"{r['row']}: a resume point of {_size(r['checkpoint_bytes'])} written and read back in "
                         f"{r['checkpoint_seconds']:.1f} s")
        if "finetune_step_seconds" in r:
            notes.append(f"{r['row']}: fine-tuning steps {r['finetune_step_seconds']:.2f} s each")
    total = result["total_minutes"]
    published = sorted({r["row"] for r in result["rows"] if r.get("counts_from") == PUBLISHED})
    if total is not None:
        said = f"about {_minutes(total)} of training on this device (steps and dev evaluations)"
    elif not any(r["status"] == "ran" for r in result["rows"]):
        said = "no projection: no row ran (their errors are below)"
    else:
        said = "no projection: the rows' data sizes are unknown (not downloaded here, and no published size)"
    lines += ["", "total: " + said]
    if published:
        lines.append(f"projected from the sources' published sizes, not downloaded here: {', '.join(published)}")
    caches = caches_text(result.get("teacher_caches", []), result.get("cache_items", 0), _size)
    return "\n".join(lines + ([""] + notes if notes else []) + caches)


def preflight_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, default=float)
