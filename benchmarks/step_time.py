"""Step time of an MCSE step relative to a SimCSE step on the same student and batch.

    python benchmarks/step_time.py [--params params.yaml] [--repeats 7] [--batch-size N]

Both steps run forward (two dropout views), loss, backward and an AdamW update on the
student named in params.yaml; the MCSE step adds the projection heads and the
sentence–image term on image features read from the teacher cache when it exists
(random features of the same width otherwise). Prints medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from mmcse.cli import quiet_libraries
from mmcse.config import load_config, with_overrides
from mmcse.data import demo
from mmcse.models import Student, load_backbone, load_tokenizer
from mmcse.train import training_step_loss


def _image_features(cache: Path, batch: int) -> torch.Tensor:
    from mmcse.io import read_json
    from mmcse.teachers import FeatureStore

    manifest = cache / "manifest.json"
    if manifest.is_file():
        store = FeatureStore.open(cache / read_json(manifest)["sets"]["image"])
        return torch.from_numpy(store.rows(list(store.ids[:batch])).copy())
    return torch.nn.functional.normalize(torch.randn(batch, 1152), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args()
    quiet_libraries()
    cfg = load_config(args.params)
    batch_size = args.batch_size or cfg.train.batch_size
    import random

    rng = random.Random(0)
    sentences = [demo.describe(demo.sample_scene(rng, 2, 4), rng).text for _ in range(batch_size)]
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=cfg.model.max_seq_len,
                    return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    feats = _image_features(Path(cfg.base.data_dir) / cfg.teachers.cache_dir, batch_size)

    times: dict[str, list[float]] = {}
    for method in ("simcse", "mcse"):
        torch.manual_seed(0)
        method_cfg = with_overrides(cfg, {"train.method": method})
        student = Student(load_backbone(cfg.model, cfg.train.dropout), feats.shape[1], cfg.model.proj_dim).train()
        optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.train.learning_rate)
        times[method] = []
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            loss = training_step_loss(student, method_cfg, batch, feats)["loss"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i:  # the first step warms up allocators and kernels
                times[method].append(time.perf_counter() - start)
    simcse, mcse = (statistics.median(times[m]) for m in ("simcse", "mcse"))
    print(f"student: {cfg.model.name_or_path} ({cfg.model.init}), batch {batch_size} x {cfg.model.max_seq_len} tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"simcse step: {simcse * 1000:8.1f} ms")
    print(f"mcse step:   {mcse * 1000:8.1f} ms")
    print(f"ratio mcse/simcse: {mcse / simcse:.3f}")


if __name__ == "__main__":
    main()
