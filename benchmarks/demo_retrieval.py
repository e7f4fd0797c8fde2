"""What the demo's image–text retrieval learns, and how long it takes: the demo's MCSE trained for more steps and
at other learning rates, its test R@K beside chance and beside a linear probe of the same image features.

    dvc repro evaluate   # the demo's data and teacher sets first
    python benchmarks/demo_retrieval.py --runs 20:3e-5 200:3e-5 1000:3e-5 200:3e-4 --json demo_retrieval.json

Each run is ``steps:learning_rate``: params.yaml's configuration (MCSE, λ 0.1) trained for that many steps (over as
many epochs as they take; the demo's epoch is ~230 steps) into a scratch folder, with one dev evaluation at its end
(``train.eval_steps`` = the steps: the scored checkpoint is the last one, not the best-dev one), then scored as the
evaluate stage scores it (`mmcse.pipeline.evaluate.run_evaluate`: the text head on [CLS] against the image head on
the test images' cached features). *Chance* is what a random ranking scores on the same test set
(`mmcse.evaluation.retrieval.chance_metrics`); the *probe* is a ridge map from the starting encoder's mean-pooled
caption embeddings to the standardised image features, fitted on the training pairs: what a linear read-out of
these features reaches, an upper reference for the heads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from step_time import device_description  # noqa: E402

from mmcse.config import with_overrides  # noqa: E402
from mmcse.evaluation.retrieval import chance_metrics, retrieval_metrics  # noqa: E402
from mmcse.experiments.params import load_config  # noqa: E402
from mmcse.hub import resolve_model  # noqa: E402
from mmcse.io import read_json, read_jsonl, write_json  # noqa: E402
from mmcse.models.device import resolve_device  # noqa: E402
from mmcse.pipeline.evaluate import run_evaluate  # noqa: E402
from mmcse.pipeline.paths import Paths  # noqa: E402
from mmcse.teachers.cache import FeatureStore  # noqa: E402
from mmcse.training.engine import Hooks  # noqa: E402
from mmcse.training.loop import train  # noqa: E402

KEYS = ("i2t_R1", "i2t_R5", "i2t_R10", "t2i_R1", "t2i_R5", "t2i_R10", "rsum")


def probe(cfg, paths: Paths, ridge: float) -> dict[str, float]:
    """R@K of a ridge map from caption embeddings to image features, fitted on the training pairs."""
    from sentence_transformers import SentenceTransformer

    sets = read_json(paths.teachers / "manifest.json")["sets"]
    pairs = read_jsonl(paths.raw / "pairs.jsonl")
    images = read_jsonl(paths.raw / "retrieval/images.jsonl")
    rows = read_jsonl(paths.raw / "retrieval/captions.jsonl")
    train_images = FeatureStore.open(paths.teachers / sets["image"]).rows([p["image_id"] for p in pairs])  # (N, d_v)
    test_images = FeatureStore.open(paths.teachers / sets["retrieval_image"]).rows([r["image_id"] for r in images])
    encoder = SentenceTransformer(resolve_model(cfg.model.name_or_path), device="cpu")
    captions = encoder.encode([p["caption"] for p in pairs], batch_size=64)  # (N, H)
    test_captions = encoder.encode([r["caption"] for r in rows], batch_size=64)  # (N_txt, H)
    mean_v, scale_v, mean_t = train_images.mean(0), train_images.std(0) + 1e-6, captions.mean(0)
    centred = captions - mean_t
    weights = np.linalg.solve(centred.T @ centred + ridge * np.eye(centred.shape[1]),
                              centred.T @ ((train_images - mean_v) / scale_v))  # (H, d_v)
    index = {r["image_id"]: i for i, r in enumerate(images)}
    owner = [index[r["image_id"]] for r in rows]
    return retrieval_metrics((test_images - mean_v) / scale_v, (test_captions - mean_t) @ weights, owner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["20:3e-5", "200:3e-5", "200:3e-4"], help="steps:learning_rate")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--ridge", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="write the table here too")
    args = parser.parse_args()
    cfg = load_config(args.params)
    paths = Paths.of(cfg)
    if not (paths.teachers / "manifest.json").is_file():
        sys.exit(f"{paths.teachers / 'manifest.json'}: no teacher sets; run `dvc repro evaluate` first")
    images = read_jsonl(paths.raw / "retrieval/images.jsonl")
    index = {r["image_id"]: i for i, r in enumerate(images)}
    owner = [index[r["image_id"]] for r in read_jsonl(paths.raw / "retrieval/captions.jsonl")]
    chance = {k.removeprefix("demo_"): v for k, v in chance_metrics("demo", owner, len(images)).items()}
    rows = [{"run": "chance", **chance}, {"run": f"probe (ridge {args.ridge})", **probe(cfg, paths, args.ridge)}]
    for spec in args.runs:
        steps, rate = int(spec.split(":")[0]), float(spec.split(":")[1])
        # epochs enough for the steps, max_steps the stop
        run_cfg = with_overrides(cfg, {"train.epochs": max(cfg.train.epochs, steps), "train.max_steps": steps,
                                       "train.eval_steps": steps,
                                       "train.checkpoint_steps": steps, "train.learning_rate": rate,
                                       "evaluate.mteb": [], "evaluate.evaluators": ["sts", "retrieval"],
                                       "evaluate.retrieval.examples": 0}, where=f"run {spec}")
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="demo-retrieval-") as scratch:
            result = train(run_cfg, paths.raw, paths.teachers, Path(scratch) / "run", Hooks(progress=False))
            scores = run_evaluate(run_cfg, paths, result.best_dir, transfer=False)
        rows.append({"run": f"{cfg.train.method} {steps} steps, lr {rate:g}", "scored_step": result.best_step,
                     "test_sts": scores["avg"], **{k: scores[f"demo_{k}"] for k in KEYS},
                     "minutes": (time.perf_counter() - started) / 60})
        print(json.dumps(rows[-1]), flush=True)
    device = device_description(resolve_device(cfg.base.device))
    print(f"\ndevice: {device}; test set: {len(images)} images × {len(owner) // len(images)} captions\n")
    print("| run | " + " | ".join(KEYS) + " | test STS |")
    print("|---|" + "---:|" * (len(KEYS) + 1))
    for row in rows:
        sts = f"{row['test_sts']:.1f}" if "test_sts" in row else ""
        print(f"| {row['run']} | " + " | ".join(f"{row[k]:.1f}" for k in KEYS) + f" | {sts} |")
    if args.json:
        write_json(args.json, {"device": device, "rows": rows})


if __name__ == "__main__":
    main()
