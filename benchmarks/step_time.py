"""Step time of every method relative to a SimCSE step on the same student and batch.

    python benchmarks/step_time.py [--params params.yaml] [--repeats 9] [--batch-size N]

Needs the teacher cache (``dvc repro cache_teachers``): every step reads its teacher
features from it, as training does; a step that ran a teacher model would raise here.
Each step is forward (two dropout views), loss, backward and an AdamW update on the
student named in params.yaml, on one fixed image–caption batch. Methods are timed in
turn within each repeat, so a change in machine speed hits them alike; prints the
median step time of each and its ratio to SimCSE (target for the extra terms: <= 1.10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mmcse.teachers
from mmcse.cli import quiet_libraries
from mmcse.config import load_config, with_overrides
from mmcse.models import Student, load_backbone, load_tokenizer
from mmcse.objectives import needed_features
from mmcse.pipeline import Paths
from mmcse.train import PAIR, TrainData, tokenize_batch, training_step_loss

METHODS = ("simcse", "mcse", "kdmcse", "dalr", "mcseo")


def _no_teacher(*args, **kwargs):
    raise RuntimeError("a training step ran a teacher model: features must come from the cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args()
    quiet_libraries()
    cfg = load_config(args.params)
    paths = Paths.of(cfg)
    if not (paths.teachers / "manifest.json").is_file():
        raise SystemExit(f"{paths.teachers / 'manifest.json'} not found: run `dvc repro cache_teachers` first")
    mmcse.teachers.text_teacher_features = _no_teacher
    mmcse.teachers.colour_edge_grid_features = _no_teacher

    data = TrainData.load(paths.raw, paths.teachers, paths.objects)
    batch_size = args.batch_size or cfg.train.batch_size
    # the first pairs that have object–phrase pairs, so the MCSEO step has its full term
    idx = [i for i, p in enumerate(data.pair_ids) if p in data.objects][:batch_size]
    device = torch.device("cpu")
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    batch = tokenize_batch(tokenizer, [data.captions[i] for i in idx], cfg.model.max_seq_len, device)

    runs = {}
    for method in METHODS:
        torch.manual_seed(0)
        method_cfg = with_overrides(cfg, {"train.method": method})
        student = Student(load_backbone(cfg.model, cfg.train.dropout), data.image_features.dim,
                          cfg.model.proj_dim, data.joint_image.dim).train()
        optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.train.learning_rate)
        runs[method] = (method_cfg, student, optimizer, needed_features(method_cfg, pair_batch=True))

    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for repeat in range(args.repeats + 1):
        for method, (method_cfg, student, optimizer, need) in runs.items():
            start = time.perf_counter()
            feats = data.pair_features(idx, need, device)  # cached features: part of the step
            loss = training_step_loss(student, method_cfg, batch, feats, pair_batch=True, seed=repeat)["loss"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if repeat:  # the first round warms up allocators and kernels
                times[method].append(time.perf_counter() - start)

    medians = {m: statistics.median(t) for m, t in times.items()}
    print(f"student: {cfg.model.name_or_path} ({cfg.model.init}), {PAIR} batch {len(idx)} x "
          f"{batch['input_ids'].shape[1]} tokens, {torch.get_num_threads()} threads, median of {args.repeats}")
    for method in METHODS:
        ratio = medians[method] / medians["simcse"]
        print(f"{method:>7} step: {medians[method] * 1000:8.1f} ms   ratio to simcse: {ratio:.3f}")


if __name__ == "__main__":
    main()
