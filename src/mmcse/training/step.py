"""One run's training step, built once (`TrainStep`): the forward of a batch kind, its backward and the update, run
eager or, under ``train.compile: step``, as compiled graphs (`mmcse.training.compiled`). The students'
(`mmcse.training.loop.StudentStep`, with gradient-cached micro-batches and several processes) and DUET's
(`mmcse.training.duet_step.RetrievalStep`) are this one step around their forward."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch

from mmcse.config import ConfigError
from mmcse.training.compiled import compile_graph, fresh_graphs, loud, no_tf32, seed_tensor, tensor_lr
from mmcse.training.engine import GRAD_NORM, Update

# a batch kind's forward: a function of tensors returning the step's terms, ``loss`` among them
Forward = Callable[..., dict[str, torch.Tensor]]


class TrainStep:
    """``step(kind, *inputs, size=, after_backward=)``: ``forward_of(kind)(*inputs)`` under ``train.precision``'s
    autocast, then `Update.apply` (backward, a gradient cache's ``after_backward``, the gradients averaged over
    ``size`` processes, clipping and the optimizer's step: `mmcse.training.engine.clipped_update`, the one place).

    ``compiled`` (``train.compile: step``): each kind's forward is one graph (``fullgraph``: a graph break is an
    error, not a silent slower step), its backward the graph AOTAutograd derives, and the clipped update a graph of
    its own (PyTorch compiles AdamW's step); on CUDA as CUDA graphs. ``backend`` is torch.compile's (default
    inductor; the tests' ``aot_eager`` traces the same graphs without code generation). Returns the terms and
    `GRAD_NORM`, on the device, safe to keep (a CUDA graph reuses its outputs' memory, so they are copied)."""

    def __init__(self, model: torch.nn.Module, update: Update, forward_of: Callable[[Hashable], Forward],
                 compiled: bool = False, backend: str | None = None) -> None:
        self.model, self.update, self.forward_of, self.compiled = model, update, forward_of, compiled
        self.backend = backend
        self.forwards: dict[Hashable, Forward] = {}
        self.clipped: Callable[[], torch.Tensor] | None = None
        if compiled:
            if update.scaler.is_enabled():
                raise ConfigError("train.compile: step cannot take fp16's loss scaler (its skipped steps are decided "
                                  "on the host); use train.precision: bf16 or fp32")
            fresh_graphs()
            tensor_lr(update.optimizer)  # a new rate is new data, not a new graph
            self.clipped = self.compile(functools.partial(update.clipped, model), fullgraph=False)

    def compile(self, fn: Callable[..., Any], fullgraph: bool = True) -> Callable[..., Any]:
        """``fn`` through torch.compile with this step's backend and mode (CUDA graphs on CUDA)."""
        return compile_graph(fn, self.update.device, self.backend, fullgraph)

    def seed(self, seed: int) -> int | torch.Tensor:
        """The step's seed as its forward takes it: a 0-d tensor in a graph (a new step is new data, not a new
        graph), the int itself eager."""
        return seed_tensor(seed, self.update.device) if self.compiled else seed

    def forward(self, kind: Hashable) -> Forward:
        """Batch kind ``kind``'s forward under the step's autocast, made (and compiled) once."""
        if kind not in self.forwards:
            fn, autocast = self.forward_of(kind), self.update.autocast

            def forward(*inputs: Any) -> dict[str, torch.Tensor]:
                with autocast():
                    return fn(*inputs)

            self.forwards[kind] = self.compile(forward) if self.compiled else forward
        return self.forwards[kind]

    def __call__(self, kind: Hashable, *inputs: Any, size: int = 1,
                 after_backward: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
        device = self.update.device
        graphs = self.compiled
        if graphs and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with no_tf32(device) if graphs else contextlib.nullcontext(), loud() if graphs else contextlib.nullcontext():
            terms = self.forward(kind)(*inputs)
            norm = self.update.apply(self.model, terms["loss"], size, after_backward, self.clipped)
        if graphs:
            return {k: v.detach().clone() for k, v in terms.items()} | {GRAD_NORM: norm.detach().clone()}
        return terms | {GRAD_NORM: norm}
