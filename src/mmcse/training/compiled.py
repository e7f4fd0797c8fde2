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
`graph_breaks` counts what would split a step, per method, in the tests and in ``benchmarks/step_time.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from mmcse.models.dropout import row_keys
from mmcse.models.student import Student
from mmcse.training.engine import GRAD_NORM, Update
from mmcse.training.gradcache import TokenEncoder

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


class CompiledStep:
    """One run's compiled training step: ``step(kind, loss_fn, *inputs)`` runs ``loss_fn(*inputs)`` (a function of
    tensors returning the step's terms, ``loss`` among them) as the compiled graph of batch kind ``kind`` (compiled
    on its first call), then backward and the compiled update (one process: the configuration refuses more).
    ``backend`` is torch.compile's (default `BACKEND`, inductor; the tests' ``aot_eager`` traces the same graphs
    without code generation). Returns the terms and `GRAD_NORM`, on the device, safe to keep (CUDA graphs reuse
    their outputs' memory, so they are copied)."""

    def __init__(self, model: torch.nn.Module, update: Update, backend: str | None = None) -> None:
        if update.scaler.is_enabled():
            raise ValueError("train.compile: step cannot take fp16's loss scaler (its skipped steps are decided on "
                             "the host); use train.precision: bf16 or fp32")
        fresh_graphs()
        self.model, self.update, self.backend = model, update, backend or BACKEND
        self.mode = graph_mode(update.device, self.backend)
        self.graphs: dict[Hashable, Callable[..., dict[str, torch.Tensor]]] = {}
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.apply = torch.compile(self._update, backend=self.backend, mode=self.mode)

    def _update(self) -> torch.Tensor:
        """Gradient clipping (``train.max_grad_norm``) and the optimizer's step; the norm before clipping."""
        train = self.update.train
        if train.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters, train.max_grad_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters if p.grad is not None])
        self.update.optimizer.step()
        return norm

    def graph(self, kind: Hashable, loss_fn: Callable[..., dict[str, torch.Tensor]]
              ) -> Callable[..., dict[str, torch.Tensor]]:
        """The compiled forward of batch kind ``kind`` (``loss_fn`` under the step's autocast), made once."""
        if kind not in self.graphs:
            autocast = self.update.autocast

            def forward(*inputs: Any) -> dict[str, torch.Tensor]:
                with autocast():
                    return loss_fn(*inputs)

            self.graphs[kind] = torch.compile(forward, fullgraph=True, backend=self.backend, mode=self.mode)
        return self.graphs[kind]

    def step(self, kind: Hashable, loss_fn: Callable[..., dict[str, torch.Tensor]], *inputs: Any
             ) -> dict[str, torch.Tensor]:
        graph = self.graph(kind, loss_fn)
        device = self.update.device
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with no_tf32(device), loud():
            terms = graph(*inputs)
            self.update.optimizer.zero_grad(set_to_none=True)
            terms["loss"].backward()
            norm = self.apply()
        return {k: v.detach().clone() for k, v in terms.items()} | {GRAD_NORM: norm.detach().clone()}


class CompiledPasses:
    """The encoder pass of a gradient-cached step (``train.micro_batch`` with ``train.compile: step``) as compiled
    graphs: ``(input_ids, attention_mask, row keys, seed) -> token states`` under the step's autocast, one graph for
    the cached forward (no grad) and one, with its backward, for the replay; a last, smaller pass compiles once
    more. `encoder` gives `mmcse.training.gradcache.CachedTokens` the pass of one step."""

    def __init__(self, student: Student, update: Update, backend: str | None = None) -> None:
        fresh_graphs()
        self.device = update.device
        backend = backend or BACKEND
        autocast = update.autocast

        def encode(ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
            with autocast(), row_keys(student.backbone, seed, rows):
                return student.token_states(ids, mask)

        self.graph = torch.compile(encode, fullgraph=True, backend=backend, mode=graph_mode(self.device, backend))

    def encoder(self, seed: int) -> TokenEncoder:
        seed_t = seed_tensor(seed, self.device)

        def encode(ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            with loud():
                return self.graph(ids, mask, rows, seed_t)

        return encode


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
