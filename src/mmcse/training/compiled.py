"""``train.compile: step``: a training step as compiled graphs instead of ~2,000 operator calls from Python.

The step's forward pass (every view through the encoder, every active loss term) is one graph per batch kind
(``torch.compile(fullgraph=True)``: a graph break is an error, not a silent slower step), its backward the graph
AOTAutograd derives from it, and the update compiled too: gradient clipping, then AdamW's step, which PyTorch
compiles as a graph of its own (its ``optimizer.step`` breaks the graph on purpose). On CUDA the graphs run as
CUDA graphs (``mode="reduce-overhead"``): one launch each instead of one per operator, which is where a BERT-base
step's time goes on a GPU (docs/benchmarks.md: the step is host-bound).

What makes a step compilable: nothing in it reads a tensor's value on the host or draws from a random generator.
The terms' random draws (DALR's mismatched pairs and ranking ties, SimCSE's MLM masks) are made on the host ahead of
it and passed in (`mmcse.training.loop.step_draws`); the keyed dropout takes the step's seed as a 0-d tensor (a new
step is new data, not a new graph); KDMCSE's thresholds, the divergence watch and the logged values are tensor code;
shapes are static (tokens padded to ``model.max_seq_len``, batches of one size: the last short one is dropped).
`graph_breaks` counts what would split a step, per method, in the tests and in ``benchmarks/step_time.py``. The
step itself is `mmcse.training.step.TrainStep`, the same one eager and compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

STEP = "step"  # train.compile's value that compiles the whole step
BACKBONE = "backbone"  # train.compile's value that compiles the encoder alone
# torch.compile's backend for a run's step: inductor generates the fused kernels. The tests' "aot_eager" traces the
# same graphs (dynamo, AOTAutograd's joint forward and backward) and runs them with torch's kernels: inductor's
# code generation takes minutes on a CPU (benchmarks/step_time.py --compile step runs it).
BACKEND = "inductor"


@contextlib.contextmanager
def no_tf32(device: torch.device) -> Iterator[None]:
    """fp32 matmuls at full precision on CUDA while a compiled step runs: a graph cannot switch TF32 per matmul as
    eager steps do for the loss terms' similarities (`mmcse.models.precision.full_precision`), so the whole step
    runs without it (under bf16 the encoder's matmuls are bf16 either way)."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def seed_tensor(seed: int, device: torch.device) -> torch.Tensor:
    """The step's seed as a 0-d int64 tensor on ``device`` (the keyed dropout's input in a compiled step)."""
    return torch.tensor(seed, dtype=torch.int64).to(device, non_blocking=True)


def fresh_graphs() -> None:
    """A run's graphs start from an empty cache: torch counts a code object's compiled variants per process, and the
    graphs of finished runs (an ablation's or a sweep's earlier jobs in the same process) would bring it to its
    recompile limit, past which it runs the code eager without a word. Within a run `loud` makes that limit an
    error instead."""
    torch.compiler.reset()


def loud() -> Any:
    """A compiled call during which reaching torch's recompile limit raises instead of falling back to eager
    (``fullgraph=True`` graphs raise anyway; the optimizer's step is not one)."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def graph_mode(device: torch.device, backend: str) -> str | None:
    """torch.compile's mode: CUDA graphs on CUDA (``reduce-overhead``: one launch per graph instead of one per
    operator), inductor's default elsewhere; backends other than inductor take no mode."""
    return "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None


def on_device(value: Any, device: torch.device) -> Any:
    """Host draws (tensors, tuples and dicts of them) moved to ``device`` before they enter a graph."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    return value


def compile_graph(fn: Callable[..., Any], device: torch.device, backend: str | None = None,
                  fullgraph: bool = True) -> Callable[..., Any]:
    """``fn`` through torch.compile as a step's graph: ``backend`` (default `BACKEND`), CUDA graphs on CUDA
    (`graph_mode`), ``fullgraph`` so that a graph break is an error, not a silent slower step."""
    backend = backend or BACKEND
    return torch.compile(fn, fullgraph=fullgraph, backend=backend, mode=graph_mode(device, backend))


def graph_breaks(fn: Callable[..., Any], *inputs: Any) -> tuple[int, list[str]]:
    """How many graph breaks ``fn(*inputs)`` has under torch.compile (``torch._dynamo.explain``: traced, not run for
    its values), and why: (count, reasons)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*inputs)
    torch._dynamo.reset()
    return explained.graph_break_count, [str(b.reason) for b in explained.break_reasons]


def tensor_lr(optimizer: torch.optim.Optimizer) -> None:
    """Each group's learning rate as a 0-d CPU tensor, which the schedulers update in place: a compiled optimizer
    step then reads a new rate as new data instead of compiling again for every value."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]))
