"""The student outputs a step makes (`mmcse.training.inputs`): one producer per input a term may read, and a step
makes exactly the inputs its running terms ask for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmcse.methods.objectives import Objective, active_terms, needed_features, needed_inputs
from mmcse.methods.terms import StepEmbeddings
from mmcse.methods.terms.base import INPUT_FEATURES
from mmcse.training import inputs as step_inputs
from mmcse.training.inputs import PRODUCERS
from mmcse.training.loop import training_step_loss
from tests.training.test_compiled import config, features, student_for, token_batch

# the StepEmbeddings fields an input name fills
FIELDS = {"z": ("z1", "z2"), "s": ("s1", "s2"), "mlm": ("mlm_logits", "mlm_labels")}


def test_every_input_a_term_may_read_has_one_producer():
    assert list(PRODUCERS) != [] and set(PRODUCERS) == set(INPUT_FEATURES) - {"z"}  # z: the encoder pass itself
    named = {f for name in INPUT_FEATURES for f in FIELDS.get(name, (name,))}
    assert named == {f.name for f in dataclasses.fields(StepEmbeddings)} - {"pair_batch"}


@pytest.mark.parametrize("case", ["simcse", "mcse", "kdmcse", "dalr", "mcseo", "simcse+mlm"])
@pytest.mark.parametrize("pair_batch", [True, False])
def test_a_step_makes_exactly_what_its_running_terms_read(case, pair_batch, monkeypatch):
    method, _, extra = case.partition("+")
    cfg = config(method, **({"loss.simcse.mlm": True} if extra == "mlm" else {}))
    o = Objective.of(cfg)
    on = active_terms(o)
    student = student_for(cfg, mlm=extra == "mlm")
    g = torch.Generator().manual_seed(3)
    made: list[StepEmbeddings] = []
    real = step_inputs.produce

    def recorded(p, e, wanted):
        made.append(real(p, e, wanted))
        return made[-1]

    monkeypatch.setattr("mmcse.training.loop.produce", recorded)
    terms = training_step_loss(student, o, token_batch(g, student.backbone.config.vocab_size),
                               features(needed_features(o, pair_batch, on), g), pair_batch, seed=4, on=on)
    assert torch.isfinite(terms["loss"])
    wanted = needed_inputs(o, pair_batch, on) | {"z"}
    fields = {f.name for f in dataclasses.fields(StepEmbeddings)} - {"pair_batch"}
    set_fields = {name for name in fields if getattr(made[0], name) is not None}
    assert set_fields == {f for name in wanted for f in FIELDS.get(name, (name,))}


def test_a_term_that_reads_an_input_no_step_makes_is_named_with_the_valid_ones(monkeypatch):
    """The check runs inside the compiled step too (torch 2.11's dynamo could not trace its former set arithmetic
    with a dict view): the unknown name and every valid one in one line."""
    import mmcse.methods.objectives as objectives

    o = Objective.of(config("simcse"))
    on = active_terms(o)
    first = next(t for t in objectives.TERMS if on[t.name] and t.runs_on(o, False))
    odd = dataclasses.replace(first, inputs=lambda o: {"z", "no_such_output"})
    monkeypatch.setattr(objectives, "TERMS", [odd if t is first else t for t in objectives.TERMS])
    with pytest.raises(ValueError, match=r"reads \['no_such_output'\], which a step does not make; it may read: z"):
        needed_inputs(o, False, on)
    assert needed_inputs(o, False, on | {first.name: False}) == set()  # the term off: nothing read
