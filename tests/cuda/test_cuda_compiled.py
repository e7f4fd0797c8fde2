"""train.compile: step on a GPU: inductor's kernels run as CUDA graphs (``mode="reduce-overhead"``), the path the
CPU tests cannot take (there they trace with ``aot_eager``; tests/training/test_compiled.py). Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from mmcse.methods.objectives import Objective, active_terms, needed_features
from mmcse.training.compiled import graph_mode
from mmcse.training.loop import StudentStep
from tests.training.test_compiled import config, features, run, student_for, token_batch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is false)"),
]

CUDA = torch.device("cuda")


@pytest.mark.parametrize("method", ["simcse", "dalr"])
def test_a_compiled_step_as_cuda_graphs_makes_the_eager_update(method):
    """4 steps (pair, text, pair, text batches) eager and as inductor's CUDA graphs from the same weights, fp32 without
    TF32 on both sides: the terms of every step within 1e-4 (inductor fuses and reorders float sums), and the
    logged values kept across steps are the steps' own (a CUDA graph's replay reuses its outputs' memory)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = config(method)
    o = Objective.of(cfg)
    on = active_terms(o)
    eager = student_for(cfg, mlm=False).to(CUDA)
    compiled_student = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(7)
    kinds = (True, False, True, False)
    batches = [({k: v.to(CUDA) for k, v in token_batch(g, eager.backbone.config.vocab_size).items()},
                features(needed_features(o, pair, on), g).to(CUDA)) for pair in kinds]
    eager_update, _ = run(eager, cfg, CUDA)
    update, _ = run(compiled_student, cfg, CUDA)
    eager_step = StudentStep(eager, o, eager_update, on)
    compiled = StudentStep(compiled_student, o, update, on, compiled=True)
    assert graph_mode(CUDA, "inductor") == "reduce-overhead"
    kept = []
    for step, (pair, (batch, feats)) in enumerate(zip(kinds, batches, strict=True)):
        want = eager_step(batch, feats, pair, 100 + step)
        got = compiled(batch, feats, pair, 100 + step)
        kept.append((want["loss"], got["loss"]))
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=f"step {step}: {name}")
    for want, got in kept:  # read after every step ran
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
