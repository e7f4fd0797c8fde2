"""Cross-modal retrieval on a COCO-5K-sized test set: the blockwise evaluator against a naive one.

    python benchmarks/retrieval_5k.py                     # 5,000 images × 25,000 captions, d = 256
    python benchmarks/retrieval_5k.py --images 1000 --dim 1024 --block 512

The naive evaluator is the textbook one: the whole (N_img, N_txt) cosine matrix at once, then
the ranks of both directions from it. `mmcse.evaluation.retrieval.retrieval_ranks` holds
``--block`` rows at a time (image→text over image blocks, text→image over caption blocks).
Both run in this process on the same random embeddings (five noisy captions per image), in
alternating order, ``--repeats`` times each; the script checks they give the same ranks and
prints the median time and the peak memory numpy allocated during each call (tracemalloc
sees numpy's buffers), with the ratio blockwise / naive.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import tracemalloc

import numpy as np

from mmcse.evaluation.retrieval import retrieval_ranks, unit_rows


def naive_ranks(image_emb: np.ndarray, text_emb: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both directions from one full similarity matrix (what blocking avoids)."""
    sim = unit_rows(image_emb) @ unit_rows(text_emb).T  # (N_img, N_txt): 1 GB at 5K × 25K
    gt = owner[None, :] == np.arange(sim.shape[0])[:, None]
    best_gt = np.where(gt, sim, -np.inf).max(axis=1)
    i2t = (np.where(gt, -np.inf, sim) >= best_gt[:, None]).sum(axis=1)
    own = sim[owner, np.arange(owner.size)]
    t2i = (sim >= own[None, :]).sum(axis=0) - 1
    return i2t, t2i


def measure(fn, *args) -> tuple[float, float, tuple[np.ndarray, np.ndarray]]:
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return seconds, peak, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    images = rng.normal(size=(args.images, args.dim))
    owner = np.repeat(np.arange(args.images), args.captions_per_image)
    texts = images[owner] + rng.normal(scale=2.0, size=(owner.size, args.dim))
    times: dict[str, list[float]] = {"blockwise": [], "naive": []}
    peaks: dict[str, float] = {}
    results = {}
    for _ in range(args.repeats):
        for name, fn in (("blockwise", lambda a, b, c: retrieval_ranks(a, b, c, args.block)),
                         ("naive", naive_ranks)):
            seconds, peak, out = measure(fn, images, texts, owner)
            times[name].append(seconds)
            peaks[name] = max(peaks.get(name, 0.0), peak)
            results[name] = out
    for a, b in zip(results["blockwise"], results["naive"], strict=True):
        if not np.array_equal(a, b):
            raise SystemExit("blockwise and naive ranks differ")
    print(f"device: cpu ({platform.processor() or platform.machine()}), numpy {np.__version__}; "
          f"{args.images} images × {owner.size} captions, d = {args.dim}, block = {args.block}")
    print("| evaluator | median s | peak MiB |")
    print("|---|---|---|")
    base_t, base_m = statistics.median(times["naive"]), peaks["naive"]
    for name in ("naive", "blockwise"):
        t, m = statistics.median(times[name]), peaks[name]
        print(f"| {name} | {t:.2f} ({t / base_t:.2f}×) | {m:.0f} ({m / base_m:.2f}×) |")


if __name__ == "__main__":
    main()
