"""The keyed dropout (``train.dropout_rng: per_row``, `mmcse.models.dropout`) against torch's dropout, in one run:
eager (one kernel per hash round) and compiled as one elementwise function (what ``train.compile: step``'s graphs
fuse it into), forward and backward, on a BERT layer's two dropout shapes.

    python benchmarks/keyed_dropout.py --device cuda --rows 256 --seq-len 32
    python benchmarks/keyed_dropout.py --device cpu --rows 64 --repeats 20

Shapes: hidden states ``(R, L, 768)`` (BERT-base's hidden and output dropouts) and attention probabilities
``(R, 12, L, L)``; R rows (SimCSE's doubled batch: 2B). ``torch`` is ``nn.functional.dropout``; ``keyed`` is
`mmcse.models.dropout.keyed_dropout` with the step's seed a Python int (eager training); ``keyed, compiled`` is the
same function with the seed a 0-d tensor under ``torch.compile(fullgraph=True)`` (inductor: the hash, the
compare and the scale in one kernel per direction). Each: forward, then backward of the sum, median of
``--repeats`` interleaved rounds after ``--warmup``; ratios to torch's dropout in the same run, and the device.
The compiled mask is checked equal to the eager one before timing (the hash is the same).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from step_time import device_description, pick_device, synchronize  # noqa: E402

from mmcse.models.dropout import RowKeys, keyed_dropout  # noqa: E402

P = 0.1


def timed(fn: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rows", type=int, default=256, help="R: rows of a pass (2 × the batch)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    device = pick_device(args.device)
    rows = torch.arange(args.rows, device=device)
    shapes = {"hidden (R, L, 768)": (args.rows, args.seq_len, 768),
              "attention (R, 12, L, L)": (args.rows, 12, args.seq_len, args.seq_len)}
    print(f"device: {device_description(device)}; torch {torch.__version__}; p = {P}; median of {args.repeats} rounds "
          f"after {args.warmup} warm-up rounds")

    def eager_keyed(x: torch.Tensor, seed: int) -> torch.Tensor:
        return keyed_dropout(x, P, RowKeys(seed, rows), salt=3, training=True)

    @torch.compile(fullgraph=True)
    def compiled_keyed(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(x, P, RowKeys(seed, rows), salt=3, training=True)

    print("| shape | torch ms | keyed ms | keyed, compiled ms | keyed ÷ torch | compiled ÷ torch |")
    print("|---|---|---|---|---|---|")
    for name, shape in shapes.items():
        x = torch.randn(shape, device=device, requires_grad=True)
        seed_t = torch.tensor(7, device=device)
        if not torch.equal(compiled_keyed(x, seed_t) != 0, eager_keyed(x, 7) != 0):
            raise SystemExit("the compiled keyed dropout drew another mask than the eager one")
        variants = {
            "torch": lambda x=x: torch.nn.functional.dropout(x, P, training=True).sum().backward(),
            "keyed": lambda x=x: eager_keyed(x, 7).sum().backward(),
            "compiled": lambda x=x, seed_t=seed_t: compiled_keyed(x, seed_t).sum().backward(),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for round_ in range(args.warmup + args.repeats):
            for key in list(variants)[round_ % 3:] + list(variants)[: round_ % 3]:
                seconds = timed(variants[key], device)
                if round_ >= args.warmup:
                    times[key].append(seconds * 1000)
        ms = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {name} | {ms['torch']:.3f} | {ms['keyed']:.3f} | {ms['compiled']:.3f} | "
              f"{ms['keyed'] / ms['torch']:.2f}× | {ms['compiled'] / ms['torch']:.2f}× |")


if __name__ == "__main__":
    main()
