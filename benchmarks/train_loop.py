"""Throughput of the real training loop against bare training steps, projected onto the paper profiles.

    python benchmarks/train_loop.py --device cuda --precision bf16 --student bert-base --steps 250
    python benchmarks/train_loop.py --device cpu                      # tiny student, fp32

1. Prepares a demo project in a temporary folder (download, detect_objects, cache_teachers
   from :mod:`mmcse.pipeline`; a 1,500-pair dev set, the size of STS-B dev) and runs the real
   :func:`mmcse.training.loop.train` for ``--steps`` steps with a paper profile's training settings
   (``--profile``: method, batch size, learning rate, loss weights, dev evaluation and
   resume point every 125 steps). Loop throughput counts from the end of the step-0 dev
   evaluation to the return of ``train``: data loading, logging, dev evaluations, best
   checkpoints and resume points included.
2. Times bare steps — :class:`mmcse.training.loop.StudentStep` on the same student (its final
   weights), the same batches (the loop's first batches, already on the device) and the
   same optimizer settings, in a loop with nothing else — and prints both throughputs.
3. For every paper profile (``profiles/*.yaml``): the step count of a full run, from the
   profile's epochs, batch size and data (Wiki1M's 1,000,000 sentences; Karpathy's
   Flickr30k / COCO train split, one caption or all per image as ``data.captions`` says),
   through the library's own batch schedule (:func:`mmcse.training.schedule.alternation_schedule`);
   a text-batch and a pair-batch step time of the profile's method and batch size on a
   student of the profile's size (BERT-base / RoBERTa-base; all ``tiny`` with ``--student
   tiny``) with synthetic features of the papers' shapes; and the projected minutes: steps ×
   bare step time; and the loop's: steps × bare step time × the loop's data-loading and
   logging overhead measured in 1–2, plus one measured dev evaluation per ``train.eval_steps``
   and one measured checkpoint write per ``train.checkpoint_steps`` of the profile (a short
   loop writes one at its end; a profile one every 1,000 steps).

Students have random weights and the project's shipped tokenizer (packaged:all-MiniLM-L6-v2,
BERT uncased's 30,522-token vocabulary): ``bert-base`` is that model's config sized like
BERT-base (``model.init: random`` with ``model.config_overrides``), ``roberta-base`` likewise
with RoBERTa-base's vocabulary and position sizes. Timings of dev evaluation and checkpoint
writing come from wrapping the library's functions; on CUDA they include waiting for the
steps queued before them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time as st  # noqa: E402  (the sibling benchmark: devices, students, synthetic features)

REPO = st.REPO
TOKENIZER = "packaged:all-MiniLM-L6-v2"
_SIZES = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
STUDENT_MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128},
    "bert-base": _SIZES,
    "roberta-base": _SIZES | {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1},
}
# The demo project: enough pairs for a 128 batch, dev set the size of STS-B dev (1,500 pairs).
DEMO = {"num_images": 160, "captions_per_image": 4, "corpus_sentences": 4000, "sts_dev_pairs": 1500,
        "sts_test_pairs": 10}

# Training-set sizes of the papers' data (the profiles' data.corpus / data.pairs / data.splits):
# SimCSE's wiki1m_for_simcse.txt, and (images, captions) of Karpathy's splits.
WIKI1M_SENTENCES = 1_000_000
KARPATHY_SPLITS = {
    "flickr30k": {"train": (29_000, 145_000), "val": (1_014, 5_070), "test": (1_000, 5_000)},
    "coco": {"train": (82_783, 414_113), "restval": (30_504, 152_634), "val": (5_000, 25_010),
             "test": (5_000, 25_010)},
}


def training_set_sizes(cfg: Any) -> tuple[int, int]:
    """(corpus sentences, image–caption pairs) a full run of ``cfg`` trains on."""
    data = cfg.data
    if data.corpus == "wiki1m":
        corpus = WIKI1M_SENTENCES
    elif data.corpus == "demo":
        corpus = data.demo.corpus_sentences
    else:
        corpus = sum(1 for line in Path(data.corpus).read_text().splitlines() if line.strip())
    if data.corpus_limit:
        corpus = min(corpus, data.corpus_limit)
    if data.pairs == "demo":
        images, captions = data.demo.num_images, data.demo.num_images * data.demo.captions_per_image
    elif data.pairs == "none":  # text only (SimCSE's wiki rows)
        images, captions = 0, 0
    elif data.pairs == "cc12m":  # a subset of data.image_limit usable samples, one caption each
        images = captions = data.image_limit
    else:
        known = KARPATHY_SPLITS[data.pairs]
        unknown = [s for s in data.splits if s not in known]
        if unknown:
            st.fail(f"data.splits {unknown}: no size known for {data.pairs} (known: {', '.join(known)})")
        images = sum(known[s][0] for s in data.splits)
        captions = sum(known[s][1] for s in data.splits)
    if data.image_limit and data.image_limit < images:
        captions, images = round(captions * data.image_limit / images), data.image_limit
    pairs = captions if data.captions == "all" else images  # random / longest: one caption per image
    return corpus, pairs


def run_steps(cfg: Any) -> dict[str, int]:
    """Text and pair batches per epoch and steps of a full run, by train's own schedule."""
    from mmcse.training.schedule import PAIR, TEXT, alternation_schedule

    corpus, pairs = training_set_sizes(cfg)
    b = cfg.train.batch_size
    schedule = alternation_schedule(corpus // b, pairs // b)  # drop_last, as train's batches
    total = len(schedule) * cfg.train.epochs
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)
    return {"corpus": corpus, "pairs": pairs, "text_per_epoch": schedule.count(TEXT),
            "pair_per_epoch": schedule.count(PAIR), "epochs": cfg.train.epochs, "steps": total}


def profile_config(name: str, precision: str, compile_backbone: bool) -> Any:
    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config
    from mmcse.experiments.profiles import profile_values

    overrides = profile_values(name, REPO) | {"train.precision": precision,
                                               "train.compile": "backbone" if compile_backbone else False}
    try:
        return load_config(REPO / "params.yaml", overrides=overrides)
    except ConfigError as err:
        if overrides.get("detect.backend") != "sam2":
            st.fail(str(err))
    # a machine without the sam2 package (MCSEO's detector): the detect stage's backend changes no
    # training step, so the profile's steps are timed with the annotations backend's settings
    try:
        return load_config(REPO / "params.yaml", overrides=overrides | {"detect.backend": "annotations"})
    except ConfigError as err:
        st.fail(str(err))


def project_params(profile: str, student: str, device: torch.device, precision: str, steps: int,
                   eval_steps: int | None, batch_size: int | None, compile_backbone: bool) -> dict[str, Any]:
    """The repo's params.yaml on demo data, the profile's train.* and loss.* settings, the
    benchmark's student, precision, device and length."""
    from mmcse.config import apply_overrides
    from mmcse.experiments.profiles import profile_values

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    overrides = {k: v for k, v in profile_values(profile, REPO).items()
                 if k.startswith(("train.", "loss.")) and k not in ("train.epochs", "train.max_steps")}
    overrides |= {
        "base.device": device.type, "base.seed": 42,
        "data.source": "demo", "data.pairs": "demo", "data.corpus": "demo", "data.captions": "all",
        "data.transfer_tasks": [], "detect.backend": "annotations", "ablate.preset": "none",
        "model.name_or_path": TOKENIZER, "model.init": "random",
        "model.config_overrides": STUDENT_MODELS[student], "model.max_seq_len": 32,
        "train.precision": precision, "train.compile": "backbone" if compile_backbone else False,
        "train.epochs": 1000, "train.max_steps": steps, "train.warmup_ratio": 0.0,
    }
    if eval_steps:
        overrides["train.eval_steps"] = eval_steps
    if batch_size:
        overrides["train.batch_size"] = batch_size
    raw = apply_overrides(raw, overrides, where="train_loop")
    raw["data"]["demo"].update(DEMO)
    return raw


def prepare_project(root: Path, raw: dict[str, Any]) -> Any:
    """``root/params.yaml`` from ``raw``, then download, detect_objects and cache_teachers."""
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.cache_teachers import run_cache_teachers
    from mmcse.pipeline.detect import run_detect
    from mmcse.pipeline.download import run_download
    from mmcse.pipeline.paths import Paths

    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cwd = os.getcwd()
    os.chdir(root)
    bars = io.StringIO()  # the stages' progress bars: shown only if a stage fails
    try:
        with contextlib.redirect_stderr(bars):
            cfg = load_config("params.yaml")
            paths = Paths.of(cfg)
            run_download(cfg, paths)
            run_detect(cfg, paths)
            run_cache_teachers(cfg, paths)
    except BaseException:
        sys.stderr.write(bars.getvalue()[-4000:])
        raise
    finally:
        os.chdir(cwd)
    return cfg


class Stopwatch:
    """Wall-clock intervals spent inside wrapped library functions."""

    def __init__(self) -> None:
        self.intervals: dict[str, list[tuple[float, float]]] = {}

    def wrap(self, module: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.intervals.setdefault(label, []).append((start, time.perf_counter()))

        setattr(module, name, timed)

    def seconds(self, label: str, since: float) -> tuple[float, int]:
        spans = [(a, b) for a, b in self.intervals.get(label, []) if a >= since]
        return sum(b - a for a, b in spans), len(spans)


def run_loop(cfg: Any, root: Path) -> dict[str, Any]:
    """The real ``train`` on the prepared project; loop time from the end of the step-0 dev
    evaluation (the last thing before the first step) to the return of ``train``."""
    import mmcse.training.checkpoints
    import mmcse.training.loop
    from mmcse.pipeline.paths import Paths
    from mmcse.training.engine import Hooks

    paths = Paths.of(cfg, root)
    watch = Stopwatch()
    watch.wrap(mmcse.training.loop, "evaluate_sts", "dev evaluation")
    # what `mmcse.training.checkpoints.Checkpoints.save` spends on the training thread: the resume point's snapshot
    # (CPU copies) and the best weights' folder; the resume point's files (SHA-256 seals, atomic swap) are written
    # on a thread beside training, timed apart (the loop waits for them only at the next save and at its end)
    watch.wrap(mmcse.training.checkpoints, "resume_snapshot", "resume points")
    watch.wrap(mmcse.training.checkpoints, "write_weights_folder", "best checkpoints")
    watch.wrap(mmcse.training.checkpoints, "write_resume_point", "resume point files (background)")
    marks: dict[str, float] = {}

    def log_metrics(entries: list[tuple[dict[str, float], int]]) -> None:
        if any("dev_sts" in metrics and step == 0 for metrics, step in entries):
            marks.setdefault("loop_start", time.perf_counter())

    start = time.perf_counter()
    result = mmcse.training.loop.train(
        cfg, paths.raw, paths.teachers, root / "models" / "student",
        hooks=Hooks(log_metrics=log_metrics, progress=False),
    )
    end = time.perf_counter()
    loop_s = end - marks["loop_start"]
    parts = {label: watch.seconds(label, marks["loop_start"]) for label in watch.intervals}
    return {"steps": result.steps, "setup_s": marks["loop_start"] - start, "loop_s": loop_s,
            "loop_steps_per_s": result.steps / loop_s,
            "parts": {label: {"seconds": s, "count": n} for label, (s, n) in parts.items()},
            "best_dev": result.best_score, "out_dir": str(root / "models" / "student")}


def run_bare(cfg: Any, root: Path, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """``steps`` optimizer steps (after ``warmup``) on the loop's final student and its first
    batches, already on the device: no data loading, evaluation, logging or checkpoints."""
    from safetensors.torch import load_file

    from mmcse.methods.objectives import Objective, active_terms, needed_features
    from mmcse.models.precision import grad_scaler
    from mmcse.models.student import Student, load_backbone, load_tokenizer
    from mmcse.pipeline.paths import Paths
    from mmcse.training.batches import PAIR, TEXT, Batches, TrainData
    from mmcse.training.engine import Update, build_optimizer
    from mmcse.training.loop import StudentStep

    paths = Paths.of(cfg, root)
    data = TrainData.load(paths.raw, paths.teachers, paths.objects)
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    tokens = data.token_tables(tokenizer, cfg.model.max_seq_len, paths.raw.parent / "tokens")
    need = {kind: needed_features(Objective.of(cfg), pair_batch=kind == PAIR) for kind in (TEXT, PAIR)}
    # the loop's batch order (train's private schedule class: the same batches, not a copy of its logic)
    batches = Batches(len(data.corpus), len(data.captions), cfg.train.batch_size, cfg.base.seed)
    order: list[tuple[str, list[int]]] = []
    epoch = 0
    while len(order) < steps:
        order += batches.epoch(epoch)
        epoch += 1
    order = order[:steps]
    inputs = []
    for kind, idx in order:
        feats = (data.pair_features(idx, need[PAIR], device) if kind == PAIR
                 else data.text_features(idx, need[TEXT], device))
        inputs.append((kind, tokens[kind].batch(idx, device), feats))

    student = Student(load_backbone(cfg.model, dropout=cfg.train.dropout), data.image_features.dim,
                      cfg.model.proj_dim, data.joint_image.dim, text_teacher_dim=data.text_captions[0].dim,
                      head=cfg.model.projection_head)
    student.load_state_dict(load_file(str(root / "models" / "student" / "last" / "student.safetensors")))
    student = student.to(device).train()
    if cfg.train.compile:
        student.backbone.compile(dynamic=True)
    optimizer, _ = build_optimizer(student, cfg.train, steps + warmup, device)
    scaler = grad_scaler(cfg.train.precision, device)
    objective = Objective.of(cfg)
    train_step = StudentStep(student, objective, Update(cfg.train, optimizer, scaler, device), active_terms(objective))

    def step(i: int) -> None:
        kind, batch, feats = inputs[i % len(inputs)]
        train_step(batch, feats, kind == PAIR, seed=i)

    for i in range(warmup):
        step(i)
    st.synchronize(device)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    st.synchronize(device)
    seconds = time.perf_counter() - start
    return {"steps": steps, "seconds": seconds, "steps_per_s": steps / seconds,
            "pair_batches": sum(kind == PAIR for kind, _ in order)}


def profile_student(profile_cfg: Any, student: str) -> str:
    if student == "tiny":
        return "tiny"
    return "roberta-base" if "roberta" in profile_cfg.model.name_or_path else "bert-base"


def time_profiles(names: Sequence[str], student: str, device: torch.device, precision: str, compile_backbone: bool,
                  repeats: int, warmup: int, seq_len: int) -> dict[str, dict[str, Any]]:
    """Median text-batch and pair-batch step time of every distinct (method, batch size,
    student) among the profiles, interleaved; synthetic batches of ``seq_len`` tokens."""
    from mmcse.methods.objectives import Objective, needed_features
    from mmcse.models.student import Student

    cfgs = {n: profile_config(n, precision, compile_backbone) for n in names}
    keys = {n: (cfgs[n].train.method, cfgs[n].train.batch_size, profile_student(cfgs[n], student)) for n in names}
    runs: dict[str, st.Run] = {}
    for method, batch_size, arch in dict.fromkeys(keys.values()):
        cfg = next(cfgs[n] for n in names if keys[n] == (method, batch_size, arch))
        torch.manual_seed(0)
        backbone = st.build_backbone(arch, dropout=cfg.train.dropout)
        base = Student(backbone, st.PAPER_IMAGE_DIM, cfg.model.proj_dim, st.PAPER_JOINT_DIM,
                       text_teacher_dim=st.PAPER_TEXT_TEACHERS[0][0], head=cfg.model.projection_head)
        g = torch.Generator().manual_seed(batch_size)
        vocab, pad = backbone.config.vocab_size, backbone.config.pad_token_id or 0
        kinds = {}
        for kind, pair_batch in (("pair", True), ("text", False)):
            lengths = st.synthetic_lengths(batch_size, seq_len, g)
            batch = {k: v.to(device) for k, v in st.synthetic_batch(lengths, vocab, pad, g).items()}
            need = needed_features(Objective.of(cfg), pair_batch=pair_batch)
            kinds[kind] = (batch, st.synthetic_features(need, lengths, g).to(device), pair_batch)
        pair = st.make_run(cfg, base, *kinds["pair"][:2], device, warmup + repeats,
                           "backbone" if compile_backbone else False)
        runs[f"{method}|{batch_size}|{arch}|pair"] = pair
        runs[f"{method}|{batch_size}|{arch}|text"] = dataclasses.replace(
            pair, batch=kinds["text"][0], feats=kinds["text"][1], pair_batch=False)  # the same student
        del base, backbone
    stats = st.time_runs(runs, device, repeats, warmup)
    out = {}
    for n in names:
        method, batch_size, arch = keys[n]
        key = f"{method}|{batch_size}|{arch}"
        out[n] = {"method": method, "batch_size": batch_size, "student": arch,
                  "text_ms": stats[f"{key}|text"]["median_ms"], "pair_ms": stats[f"{key}|pair"]["median_ms"],
                  "eval_steps": cfgs[n].train.eval_steps, "checkpoint_steps": cfgs[n].train.checkpoint_steps,
                  **run_steps(cfgs[n])}
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--precision", default=None, choices=("fp32", "bf16", "fp16"),
                        help="train.precision (default: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--student", default=None, choices=tuple(STUDENT_MODELS),
                        help="random-weight student (default: bert-base on CUDA, tiny on the CPU)")
    parser.add_argument("--profile", default="kdmcse-flickr-bert",
                        help="paper profile whose train.* and loss.* settings the loop runs")
    parser.add_argument("--batch-size", type=int, default=None, help="override the profile's train.batch_size")
    parser.add_argument("--steps", type=int, default=250, help="training steps of the loop")
    parser.add_argument("--eval-steps", type=int, default=None, help="override the profile's train.eval_steps (125)")
    parser.add_argument("--bare-steps", type=int, default=50, help="timed bare steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="uncounted steps / rounds before timing")
    parser.add_argument("--profile-repeats", type=int, default=10,
                        help="timed rounds per profile step (0: no projection)")
    parser.add_argument("--seq-len", type=int, default=32, help="padded tokens of the profiles' synthetic batches")
    parser.add_argument("--compile", action="store_true", help="torch.compile the backbone (train.compile: backbone)")
    parser.add_argument("--workdir", default=None, help="prepare the project here and keep it (default: a temp dir)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the numbers here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.bare_steps < 1 or args.warmup < 0 or args.profile_repeats < 0:
        parser.error("--steps and --bare-steps must be >= 1, --warmup and --profile-repeats >= 0")
    if args.batch_size is not None and args.batch_size < 2:
        parser.error("--batch-size must be >= 2 (in-batch negatives)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = st.pick_device(args.device)
    precision = args.precision or st.default_precision(device)
    st.checked_precision(precision, device)  # before any compute
    student = args.student or ("bert-base" if device.type == "cuda" else "tiny")
    st.setup_like_train(device)

    from mmcse.config import parse_config
    from mmcse.experiments.profiles import list_profiles

    profiles = list_profiles(REPO)
    if args.profile not in profiles:
        st.fail(f"--profile {args.profile!r}: profiles in {REPO / 'profiles'}: {', '.join(profiles)}")
    raw = project_params(args.profile, student, device, precision, args.steps, args.eval_steps, args.batch_size,
                         args.compile)
    cfg = parse_config(copy.deepcopy(raw), where="train_loop params")

    print(f"device: {st.device_description(device)}")
    print(f"torch {torch.__version__}, precision {precision}, compile {args.compile}")
    print(f"student: {student} with random weights: {TOKENIZER} (its tokenizer and BERT architecture), "
          f"model.init random, model.config_overrides {STUDENT_MODELS[student]}")
    print(f"loop: {args.profile}'s training settings on demo data: {cfg.train.method}, batch {cfg.train.batch_size}, "
          f"{args.steps} steps, dev evaluation every {cfg.train.eval_steps} steps ({DEMO['sts_dev_pairs']} pairs), "
          f"resume point every {cfg.train.checkpoint_steps}")

    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="mmcse-train-loop-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        cfg = prepare_project(root, raw)
        print(f"demo project prepared in {time.perf_counter() - t0:.0f} s ({root})")
        loop = run_loop(cfg, root)
        bare = run_bare(cfg, root, device, args.bare_steps, args.warmup)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    ratio = bare["steps_per_s"] / loop["loop_steps_per_s"]  # loop time per step / bare time per step
    # The loop's time in three parts, projected apart: steps with data loading and logging (scale
    # with the step time), dev evaluations (a fixed cost every train.eval_steps) and checkpoint
    # writes (resume point + best weights, every train.checkpoint_steps and at the last step: a
    # short loop writes one at its end, a profile one per 1,000 steps).
    parts = loop["parts"]

    def spent(*labels: str) -> tuple[float, int]:
        return (sum(parts[k]["seconds"] for k in labels if k in parts),
                max((parts[k]["count"] for k in labels if k in parts), default=0))

    eval_s, evals = spent("dev evaluation")
    write_s, writes = spent("resume points", "best checkpoints")
    per_eval_s = eval_s / evals if evals else 0.0
    per_write_s = write_s / writes if writes else 0.0
    data_ratio = (loop["loop_s"] - eval_s - write_s) * bare["steps_per_s"] / loop["steps"]

    print(f"\nloop:  {loop['steps']} steps in {loop['loop_s']:.1f} s = {loop['loop_steps_per_s']:.2f} steps/s "
          f"(setup and step-0 dev evaluation before it: {loop['setup_s']:.1f} s)")
    background_s, _ = spent("resume point files (background)")
    print(f"       of which dev evaluation {eval_s:.1f} s ({evals}×), checkpoint writes {write_s:.1f} s ({writes}×) "
          f"on the training thread; resume point files {background_s:.1f} s beside it")
    print(f"bare:  {bare['steps']} steps in {bare['seconds']:.1f} s = {bare['steps_per_s']:.2f} steps/s "
          f"(the loop's first {min(bare['steps'], args.steps)} batches, {bare['pair_batches']} of them pair batches)")
    print(f"loop / bare time per step: {ratio:.2f}; without dev evaluation and checkpoint writes "
          f"(data loading, logging): {data_ratio:.2f}")
    print(f"per dev evaluation ({DEMO['sts_dev_pairs']} pairs): {per_eval_s:.2f} s; "
          f"per checkpoint write: {per_write_s:.2f} s")

    projection = {}
    if args.profile_repeats:
        print(f"\nprofile steps: synthetic batches ({args.seq_len} tokens, features of the papers' shapes), "
              f"median of {args.profile_repeats} after {args.warmup} warm-up rounds, precision {precision}")
        # the sentence-encoder profiles (DUET's and VSE++'s loop is timed by step_time.py's duet row)
        students = [n for n in profiles if n != "demo"
                    and profile_config(n, precision, args.compile).train.method in st.STUDENT_METHODS]
        projection = time_profiles(students, student, device, precision, args.compile, args.profile_repeats,
                                   args.warmup, args.seq_len)
        print("\n| profile | method | B | student | steps (epochs × (text + pair)/epoch) | text ms | pair ms "
              "| min (bare) | min (loop) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, p in projection.items():
            epoch_s = (p["text_per_epoch"] * p["text_ms"] + p["pair_per_epoch"] * p["pair_ms"]) / 1000
            p["bare_min"] = epoch_s * p["steps"] / (p["text_per_epoch"] + p["pair_per_epoch"]) / 60
            evals_p = 1 + p["steps"] // p["eval_steps"] + (p["steps"] % p["eval_steps"] > 0)  # step 0 and the end
            writes_p = math.ceil(p["steps"] / p["checkpoint_steps"])
            p["loop_min"] = (p["bare_min"] * data_ratio + (evals_p * per_eval_s + writes_p * per_write_s) / 60)
            print(f"| {name} | {p['method']} | {p['batch_size']} | {p['student']} | {p['steps']:,} "
                  f"({p['epochs']} × ({p['text_per_epoch']:,} + {p['pair_per_epoch']:,})) | {p['text_ms']:.1f} "
                  f"| {p['pair_ms']:.1f} | {p['bare_min']:,.0f} | {p['loop_min']:,.0f} |")
        print(f"\ndata: Wiki1M {WIKI1M_SENTENCES:,} sentences; Karpathy train split: Flickr30k "
              f"{KARPATHY_SPLITS['flickr30k']['train'][0]:,} images / {KARPATHY_SPLITS['flickr30k']['train'][1]:,} "
              f"captions, COCO {KARPATHY_SPLITS['coco']['train'][0]:,} / {KARPATHY_SPLITS['coco']['train'][1]:,} "
              "(MCSEO's min_objects exclusions not counted: its counts are upper bounds)")
        print("min (loop) = min (bare) × the loop's data-loading ratio + a measured dev evaluation every "
              "train.eval_steps (dev set the size of STS-B dev) + a measured checkpoint write every "
              "train.checkpoint_steps")

    if args.json:
        out = {"device": st.device_description(device), "torch": torch.__version__, "precision": precision,
               "student": student, "compile": args.compile, "profile": args.profile,
               "batch_size": cfg.train.batch_size, "method": cfg.train.method, "loop": loop, "bare": bare,
               "loop_over_bare": ratio, "loop_over_bare_without_eval_and_writes": data_ratio,
               "seconds_per_dev_evaluation": per_eval_s, "seconds_per_checkpoint_write": per_write_s,
               "projection": projection}
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
