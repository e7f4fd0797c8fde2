"""One training job over several processes (`mmcse.training.distributed`): throughput of a SimCSE step of a
BERT-base student at a global batch, 1 process against N, in one run, the scaling ratio printed with the device.

    python benchmarks/distributed_step.py --device cpu --ranks 1 2 --batch-size 32
    python benchmarks/distributed_step.py --device cuda --precision bf16 --ranks 1 2 4 8 --per-rank 128

Each world size runs in its own processes (torch.multiprocessing, gloo on CPUs, NCCL on GPUs, 127.0.0.1).
Every rank holds the step's whole batch, encodes its share of the rows (both views of every sentence: 2B
rows, keyed dropout ``train.dropout_rng: per_row``), all-gathers the token states (differentiable), computes
SimCSE's loss over all B, back-propagates and averages the gradients over the ranks, then AdamW: the step
``mmcse.training.loop.StudentStep`` takes with ``ranks``, spelled out as ``benchmarks/micro_batch.py``
spells it (``mmcse.training.loop`` pulls in MLflow, which a bare GPU machine lacks). On a CPU the cores are
shared: N ranks get cores / N threads each, so the ratio says what the gather and the all-reduce cost, not
a speed-up. On GPUs rank r runs on GPU r; ``--per-rank`` fixes each GPU's share (the global batch grows
with N: weak scaling, the issue's target ≥ 0.9·N for BERT-base at 128 a GPU).

``--verify``: before timing, a float64 step of a 2-layer BERT at B 8, dropout on, over 2 ranks against one
process: the largest difference of the loss and of any gradient (the tests hold it within 1e-6 for every
method).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from micro_batch import TEMPERATURE, batch, build, device_description  # noqa: E402

from mmcse.methods.losses import simcse_loss  # noqa: E402
from mmcse.models.precision import autocast, configure_kernels  # noqa: E402
from mmcse.training.distributed import ShardedTokens, average_gradients  # noqa: E402
from mmcse.training.gradcache import direct_tokens  # noqa: E402


def sharded_step(student: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, seed: int, precision: str,
                 device: torch.device, rank: int, size: int) -> torch.Tensor:
    """SimCSE's loss of the global batch, this rank encoding its share; gradients averaged over the ranks."""
    n = ids.shape[0]
    encode = direct_tokens(student, seed)
    if size > 1:
        encode = ShardedTokens(encode, rank, size)
    rows = torch.arange(2 * n, device=device)  # (2B,): both views of every sentence
    with autocast(precision, device):
        tokens = encode(ids.repeat(2, 1), mask.repeat(2, 1), rows)  # (2B, L, H), every rank's rows
        z = student.mlp(tokens[:, 0])  # (2B, H)
        loss = simcse_loss(z[:n], z[n:], TEMPERATURE)
    loss.backward()
    average_gradients(student.parameters(), size)
    return loss.detach()


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, out: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the cores shared between the ranks
    if size > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=600), device_id=device if cuda else None)
    try:
        configure_kernels(device)
        if args.verify_run:
            student = build(2, 64, device, keyed=True, dtype=torch.float64)
            ids, mask = batch(8, 16, student.backbone.config.vocab_size, device)
            loss = sharded_step(student, ids, mask, 3, "fp32", device, rank, size)
            grads = {k: p.grad.cpu() for k, p in student.named_parameters() if p.grad is not None}
            torch.save({"loss": loss.item(), "grads": grads}, f"{out}.{rank}")
            return
        b = args.per_rank * size if args.per_rank else args.batch_size
        student = build(12, 768, device, True, torch.float32)
        ids, mask = batch(b, args.seq_len, student.backbone.config.vocab_size, device)
        optimizer = torch.optim.AdamW(student.parameters(), lr=3e-5, fused=cuda or None)
        times = []
        for i in range(args.warmup + args.repeats):
            if size > 1:
                dist.barrier()
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            sharded_step(student, ids, mask, i, args.precision, device, rank, size)
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - began)
        if rank == 0:
            torch.save({"batch": b, "seconds": statistics.median(times)}, f"{out}.0")
    finally:
        if size > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace, size: int, folder: str) -> dict:
    out = str(Path(folder) / f"size-{size}-{int(args.verify_run)}")
    tmp.start_processes(_rank, args=(size, _free_port(), args, out), nprocs=size, start_method="spawn")
    return torch.load(f"{out}.0", weights_only=False)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch (sentences)")
    parser.add_argument("--per-rank", type=int, default=0, help="sentences a rank instead (weak scaling)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args(argv)
    print(f"device: {device_description(args.device)}; {args.precision}, BERT-base SimCSE step, "
          f"{args.seq_len} tokens, median of {args.repeats} step(s) after {args.warmup} warm-up", flush=True)
    with tempfile.TemporaryDirectory(prefix="mmcse-distributed-") as folder:
        if args.verify:
            args.verify_run = True
            one, two = run(args, 1, folder), run(args, 2, folder)
            worst = max((two["grads"][k] - g).abs().max().item() for k, g in one["grads"].items())
            print(f"verify (float64, dropout on, 2 ranks against 1): loss {abs(two['loss'] - one['loss']):.1e}, "
                  f"largest gradient difference {worst:.1e}", flush=True)
        args.verify_run = False
        print("| ranks | global batch | step s | examples/s | × 1 rank |\n|---|---|---|---|---|", flush=True)
        base = None
        for size in args.ranks:
            result = run(args, size, folder)
            throughput = result["batch"] / result["seconds"]
            base = base or (throughput if size == 1 else None)
            ratio = f"{throughput / base:.2f}" if base else "-"
            print(f"| {size} | {result['batch']} | {result['seconds']:.3f} | {throughput:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
