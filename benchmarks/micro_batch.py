"""Gradient-cached batches (``train.micro_batch``): peak memory and step time of a SimCSE step against
the whole batch in one pass, for a BERT-base student, in one run, ratios printed with the device.

    python benchmarks/micro_batch.py --device cuda --precision bf16 --batch-size 128 512 --micro 32 64
    python benchmarks/micro_batch.py --device cpu --batch-size 128 512 --micro 32 64 --repeats 1

Each configuration runs in its own process (a process's peak resident memory never goes down, so the
CPU's peak is per configuration), with the same initial weights and batch:

* ``whole, torch``: the default training step, the whole doubled batch (2B rows) in one pass, torch's
  dropout;
* ``whole, per_row``: the same with the keyed dropout gradient caching needs
  (``train.dropout_rng: per_row``, `mmcse.models.dropout`): what that dropout costs by itself;
* ``micro M``: ``train.micro_batch: M`` (`mmcse.training.gradcache.CachedTokens`): M sentences
  (2M rows) per encoder pass, then the loss over all B, then each pass again with its graph.

* ``st MNRL`` / ``st cached M``: the peer, sentence-transformers' ``MultipleNegativesRankingLoss`` on the
  whole batch, and its ``CachedMultipleNegativesRankingLoss`` (GradCache) at ``mini_batch_size`` M, on
  the same BERT-base (saved and loaded as a sentence-transformers ``Transformer`` + CLS pooling), batch,
  scale 20 (τ 0.05), precision and AdamW: SimCSE's objective as that library trains it, anchors and
  positives each encoded in their own passes. ``× whole`` is against mmcse's whole-batch step, so the
  peer's rows and mmcse's compare directly.

The step is SimCSE's as ``mmcse.training.loop.training_step_loss`` runs it (both views as one doubled
batch through the student, the MLP pooler on [CLS], the in-batch InfoNCE at τ 0.05), under the
precision's autocast, then backward and AdamW; it is spelled out here rather than imported because
``mmcse.training.loop`` pulls in MLflow, which a bare GPU machine lacks; the encoder holds nearly all
of a step's activations for every method, so SimCSE stands for them. Peak memory: CUDA's
``max_memory_allocated`` over the timed steps (weights, AdamW state and activations), or the
process's peak resident set on a CPU.
Inputs: every sentence ``--seq-len`` tokens (the papers' ``max_seq_len`` 32, all real), random ids,
random weights (BERT-base's configuration: nothing is downloaded).

``--verify``: before timing, one float64 step of a 2-layer BERT at B 8 with dropout on, micro-batched
(2 sentences a pass) against the whole batch: the largest difference of the loss and of any gradient
(the tests hold it within 1e-6 for every method).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import BertConfig, BertModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from peers import ranking_loss  # noqa: E402

from mmcse.methods.losses import simcse_loss  # noqa: E402
from mmcse.models.dropout import install_keyed_dropout  # noqa: E402
from mmcse.models.precision import autocast, configure_kernels  # noqa: E402
from mmcse.models.student import Student  # noqa: E402
from mmcse.training.gradcache import CachedTokens, direct_tokens  # noqa: E402

TEMPERATURE = 0.05
PEER_KIND = 2  # --one's third value: 0 torch dropout, 1 per_row, 2 the sentence-transformers peer
DROPOUT = {0: "torch", 1: "per_row", PEER_KIND: "torch (st)"}


def build(layers: int, hidden: int, device: torch.device, keyed: bool, dtype: torch.dtype) -> Student:
    torch.manual_seed(0)
    config = BertConfig() if layers == 12 and hidden == 768 else BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=max(hidden // 64, 1),
        intermediate_size=4 * hidden)
    backbone = BertModel(config, add_pooling_layer=False)
    if keyed:
        install_keyed_dropout(backbone)
    return Student(backbone, image_dim=8, proj_dim=8).to(device=device, dtype=dtype).train()


def batch(n: int, seq_len: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(1000, vocab, (n, seq_len), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] … [SEP]
    return ids.to(device), torch.ones(n, seq_len, dtype=torch.long, device=device)


def step(student: Student, ids: torch.Tensor, mask: torch.Tensor, micro: int, seed: int, precision: str,
         device: torch.device) -> torch.Tensor:
    """SimCSE's loss of one batch and its gradients (accumulated into ``.grad``)."""
    n = ids.shape[0]
    cached = CachedTokens(student, seed, 2 * micro, lambda: autocast(precision, device)) if micro else None
    encode = cached or direct_tokens(student, seed)
    rows = torch.arange(2 * n, device=device)  # (2B,): both views of every sentence
    with autocast(precision, device):
        tokens = encode(ids.repeat(2, 1), mask.repeat(2, 1), rows)  # (2B, L, H)
        z = student.mlp(tokens[:, 0])  # (2B, H)
        loss = simcse_loss(z[:n], z[n:], TEMPERATURE)
    loss.backward()
    if cached is not None:
        cached.backward()
    return loss.detach()


def verify(device: torch.device) -> dict[str, float]:
    """The largest |micro − whole| of the loss and of any gradient, float64, dropout on."""
    out = {}
    grads = {}
    for micro in (0, 2):
        student = build(2, 64, device, keyed=True, dtype=torch.float64)
        ids, mask = batch(8, 16, student.backbone.config.vocab_size, device)
        out[micro] = step(student, ids, mask, micro, seed=3, precision="fp32", device=device).item()
        grads[micro] = {k: p.grad for k, p in student.named_parameters() if p.grad is not None}
    return {"loss": abs(out[2] - out[0]),
            "grad": max((grads[2][k] - g).abs().max().item() for k, g in grads[0].items())}


def timed_steps(args: argparse.Namespace, device: torch.device, one_step: Callable[[int], Any]) -> dict[str, Any]:
    """``args.warmup`` uncounted then ``args.repeats`` timed calls of ``one_step(i)`` (a whole update): the
    median seconds and the peak memory (CUDA: allocated over the timed steps; CPU: the process's resident)."""
    times = []
    for i in range(args.warmup + args.repeats):
        if i == args.warmup and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        one_step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - began)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"seconds": statistics.median(times), "peak_mib": peak / 2**20}


def measure(args: argparse.Namespace, b: int, micro: int, keyed: bool) -> dict[str, Any]:
    """One configuration of mmcse's step in this process: median step seconds and peak memory."""
    device = torch.device(args.device)
    configure_kernels(device)
    student = build(12, 768, device, keyed, torch.float32)
    ids, mask = batch(b, args.seq_len, student.backbone.config.vocab_size, device)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-5, fused=device.type == "cuda" or None)

    def one_step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        step(student, ids, mask, micro, seed=i, precision=args.precision, device=device)
        optimizer.step()

    return timed_steps(args, device, one_step)


def measure_peer(args: argparse.Namespace, b: int, micro: int) -> dict[str, Any]:
    """The peer's configuration in this process (`peers.ranking_loss`: MNRL, or CachedMNRL at ``micro``):
    median step seconds and peak memory."""
    device = torch.device(args.device)
    configure_kernels(device)
    with tempfile.TemporaryDirectory() as folder:
        loss_fn = ranking_loss(build(12, 768, torch.device("cpu"), False, torch.float32).backbone, Path(folder),
                               device, TEMPERATURE, mini_batch=micro)
    ids, mask = batch(b, args.seq_len, loss_fn.model[0].auto_model.config.vocab_size, device)
    features = {"input_ids": ids, "attention_mask": mask}
    optimizer = torch.optim.AdamW(loss_fn.model.parameters(), lr=3e-5, fused=device.type == "cuda" or None)

    def one_step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(args.precision, device):
            loss = loss_fn([features, dict(features)], None)
        loss.backward()
        optimizer.step()

    return timed_steps(args, device, one_step)


def device_description(device: str) -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), " \
           f"torch {torch.__version__}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--batch-size", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--micro", type=int, nargs="+", default=[32, 64], help="train.micro_batch values")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--no-peer", action="store_true", help="leave out sentence-transformers' (C)MNRL rows")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument("--one", nargs=3, type=int, metavar=("B", "MICRO", "KEYED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        b, micro, kind = args.one
        print(json.dumps(measure_peer(args, b, micro) if kind == PEER_KIND else measure(args, b, micro, bool(kind))))
        return
    print(f"device: {device_description(args.device)}; {args.precision}, BERT-base, {args.seq_len} tokens, "
          f"median of {args.repeats} step(s) after {args.warmup} warm-up", flush=True)
    if args.verify:
        print(f"verify (float64, dropout on, 2 sentences a pass): {verify(torch.device(args.device))}", flush=True)
    forwarded = ["--device", args.device, "--precision", args.precision, "--seq-len", str(args.seq_len),
                 "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    rows = []
    print("| B | encoder passes | dropout | step s | × whole | peak MiB | × whole |\n|---|---|---|---|---|---|---|",
          flush=True)
    for b in args.batch_size:
        whole = None
        peers = [] if args.no_peer else [(0, PEER_KIND)] + [(m, PEER_KIND) for m in args.micro if m < b]
        for micro, keyed in [(0, 0), (0, 1)] + [(m, 1) for m in args.micro if m < b] + peers:
            done = subprocess.run([sys.executable, __file__, *forwarded, "--one", str(b), str(micro), str(keyed)],
                                  capture_output=True, text=True)
            label = "whole batch" if micro == 0 else f"micro {micro} ({-(-b // micro)} passes)"
            if keyed == PEER_KIND:
                label = "st MNRL, whole batch" if micro == 0 else f"st cached {micro} ({-(-b // micro)} passes)"
            if done.returncode != 0:
                # a process the kernel killed (a CPU out of memory) leaves no traceback, only its signal
                error = (done.stderr.strip().splitlines() or [
                    f"killed by signal {-done.returncode} (out of memory?)" if done.returncode < 0
                    else f"exit code {done.returncode}"])[-1][:120]
                print(f"| {b} | {label} | {DROPOUT[keyed]} | failed: {error} | | | |", flush=True)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if micro == 0 and not keyed:
                whole = result  # the baseline: the default step, when it ran
            rows.append({"batch": b, "micro": micro, "dropout": DROPOUT[keyed], "peer": keyed == PEER_KIND, **result})
            time_ratio = f"{result['seconds'] / whole['seconds']:.2f}" if whole else "-"
            peak_ratio = f"{result['peak_mib'] / whole['peak_mib']:.2f}" if whole else "-"
            print(f"| {b} | {label} | {DROPOUT[keyed]} | {result['seconds']:.3f} | {time_ratio} | "
                  f"{result['peak_mib']:.0f} | {peak_ratio} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_description(args.device), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
