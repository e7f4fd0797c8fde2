"""The loss-term registry: each term is one object, and what a step loads, computes and sums is derived
from the registered terms (mmcse.methods.terms, mmcse.methods.objectives)."""

import dataclasses
import itertools

import pytest
import torch

from mmcse.config import Config, with_overrides
from mmcse.methods import objectives
from mmcse.methods.objectives import Objective, active_terms, needed_features, needed_inputs
from mmcse.methods.step import step_objective
from mmcse.methods.terms import REGISTRY, TERMS, LossTerm, StepEmbeddings, register
from mmcse.methods.terms.base import INPUT_FEATURES, always, never
from tests.methods.test_objectives import _embeddings

METHODS = ("simcse", "mcse", "kdmcse", "dalr", "mcseo")


def _cfg(**overrides) -> Config:
    return with_overrides(Config(), overrides)


def old_needed_features(cfg: Config, pair_batch: bool) -> set[str]:
    """The hand-written table the derived `needed_features` replaced (main before the registry),
    transcribed as the independent reference."""
    on = active_terms(Objective.of(cfg))
    need: set[str] = set()
    if pair_batch:
        if on["image"]:
            need.add("image")
        if on["kdmcse"] or on["info"] or on["consistency"] or on["cma"] or on["clip_text"]:
            need.add("joint")
        if on["object"]:
            need.add("objects")
    if (pair_batch or cfg.loss.dalr.text_batches) and (on["rank"] or on["ima"]):
        need.add("text_teachers")
    if pair_batch and on["cma"]:  # Q^{t2t}: h^t (projected) or the text teachers' own similarity (raw)
        need.add("text_teachers")
    return need


VARIANTS = [
    {"train.method": m, **extra}
    for m, extra in itertools.product(METHODS, [
        {}, {"loss.dalr.cml": True}, {"loss.dalr.iml": True}, {"loss.dalr.iml": True, "loss.dalr.text_batches": True},
        {"loss.dalr.teacher_space": "raw"}, {"loss.dalr.cml": True, "loss.dalr.teacher_space": "raw"},
        {"loss.image_term": False}, {"loss.mcse.clip_text": True}, {"loss.kdmcse.soft_labels": "clip"},
        {"loss.dalr.info_margin": True}, {"loss.dalr.alignment": False}, {"loss.dalr.consistency": False},
        {"loss.dalr.rank": False, "loss.dalr.ima": False}, {"loss.mcseo.object_phrase": False},
    ])
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_derived_features_equal_the_hand_written_table(overrides):
    cfg = _cfg(**overrides)
    for pair_batch in (False, True):
        assert needed_features(Objective.of(cfg), pair_batch) == old_needed_features(cfg, pair_batch)


def test_every_term_is_one_object_with_its_source_and_a_unique_place():
    assert [t.order for t in TERMS] == sorted(t.order for t in TERMS)
    assert len({t.order for t in TERMS}) == len(TERMS) == len(REGISTRY)
    streams = [t.stream for t in TERMS if t.stream is not None]
    assert len(streams) == len(set(streams))
    for term in TERMS:
        assert term.equation.strip(), f"{term.name}: say where it comes from (any paper, or what it is)"
        assert term.compute.__doc__, f"{term.name}: its function's docstring names the equation"
        assert term.compute.__module__ == term.active.__module__, f"{term.name}: one module holds it all"
        for method in METHODS:
            assert term.inputs(Objective.of(_cfg(**{"train.method": method}))) <= INPUT_FEATURES.keys()
    with pytest.raises(ValueError, match="registered twice"):
        register(dataclasses.replace(TERMS[0], order=999))
    with pytest.raises(ValueError, match="share order"):
        register(dataclasses.replace(TERMS[0], name="another", order=TERMS[1].order))


def test_no_term_name_is_spelled_outside_its_module():
    """No module outside the terms' own picks a term out by name (``on["ima"]``, ``terms["ima"]``):
    the loop, the configuration and the evaluation derive everything from the registry."""
    from pathlib import Path

    src = Path(objectives.__file__).parents[1]
    for term in TERMS:
        homes = {Path(__import__(term.compute.__module__, fromlist=["_"]).__file__)}
        for path in src.rglob("*.py"):
            if path in homes:
                continue
            text = path.read_text()
            for quoted in (f'on["{term.name}"]', f"on['{term.name}']", f'terms["{term.name}"]'):
                assert quoted not in text, f"{path.relative_to(src)} spells loss term {term.name!r}"


def _mean_cosine(o, e, generator):
    """A throwaway term for this test: 1 − mean cos(s1, image)."""
    return 1 - torch.nn.functional.cosine_similarity(e.s1, e.image).mean()


def _throwaway(weight: str | None = "loss.lambda_img") -> LossTerm:
    return LossTerm(name="throwaway", equation="a test (MCSE Eq. 3's inputs)", order=35, weight=weight,
                    active=lambda o: o.method == "dalr", inputs=lambda o: {"s", "image"}, on_pairs=always,
                    on_text=never, compute=_mean_cosine)


def test_a_new_term_is_summed_with_its_weight_and_loads_what_it_reads(monkeypatch):
    cfg = _cfg(**{"train.method": "dalr", "loss.lambda_img": 0.25})
    e = _embeddings()
    before = step_objective(Objective.of(cfg), e)
    monkeypatch.setattr(objectives, "TERMS", tuple(sorted((*TERMS, _throwaway()), key=lambda t: t.order)))
    o = Objective.of(cfg)
    assert active_terms(o)["throwaway"]
    assert "image" in needed_features(o, pair_batch=True) and "image" not in old_needed_features(cfg, True)
    assert {"s", "image"} <= needed_inputs(o, pair_batch=True)
    after = step_objective(o, e)
    expected = 1 - torch.nn.functional.cosine_similarity(e.s1, e.image).mean()
    torch.testing.assert_close(after["throwaway"], expected)
    torch.testing.assert_close(after["loss"], before["loss"] + 0.25 * expected)
    # text batches: it said pairs only
    assert "throwaway" not in step_objective(Objective.of(cfg), _embeddings(pair_batch=False))
    # switched off by its predicate: mcse's step is unchanged
    mcse = _cfg(**{"train.method": "mcse"})
    assert not active_terms(Objective.of(mcse))["throwaway"]


def test_a_term_that_reads_what_no_step_makes_is_refused(monkeypatch):
    bad = dataclasses.replace(_throwaway(), inputs=lambda o: {"s", "depth_map"})
    monkeypatch.setattr(objectives, "TERMS", (*TERMS, bad))
    with pytest.raises(ValueError, match="'throwaway' reads \\['depth_map'\\].*it may read: z, s, image"):
        needed_features(Objective.of(_cfg(**{"train.method": "dalr"})), pair_batch=True)


def test_a_swept_weight_must_weigh_an_active_term():
    from mmcse.config import ConfigError
    from mmcse.methods.objectives import Objective, check_sweep_space

    def sweep_check(cfg: Config) -> None:
        check_sweep_space(Objective.of(cfg), cfg.sweep.space)

    space = {"sweep.space": {"loss.dalr.mu_iml": {"type": "float", "low": 0.01, "high": 1.0}}}
    sweep_check(_cfg(**{"train.method": "dalr"}, **space))
    with pytest.raises(ConfigError, match="'loss.dalr.mu_iml': is swept, but train.method 'mcse' has no term"):
        sweep_check(_cfg(**{"train.method": "mcse"}, **space))
    sweep_check(_cfg(**{"train.method": "mcse", "loss.dalr.iml": True}, **space))
    # a swept key that weighs no term (a temperature) is not this check's business
    sweep_check(_cfg(**{"train.method": "mcse", "sweep.space": {
        "loss.temperature": {"type": "float", "low": 0.01, "high": 0.1}}}))


def test_the_step_builds_only_the_embeddings_its_terms_read():
    dalr = Objective.of(_cfg(**{"train.method": "dalr"}))
    assert needed_inputs(dalr, pair_batch=False) == {"z"}
    # L_rank reads the teachers' ranking scores, L_CMA and L_IMA the projected h^t
    assert needed_inputs(dalr, pair_batch=True) == {"z", "s", "teacher_image", "text_teacher", "rank_teacher_sim",
                                                    "shared_text", "shared_image"}
    # raw: L_CMA's and L_IMA's targets from the text teachers' own similarity and the raw image features
    raw = Objective.of(_cfg(**{"train.method": "dalr", "loss.dalr.teacher_space": "raw"}))
    assert needed_inputs(raw, pair_batch=True) == {"z", "s", "teacher_image", "joint_image", "text_teacher_sim",
                                                   "rank_teacher_sim", "shared_text", "shared_image"}
    code = Objective.of(_cfg(**{"train.method": "dalr", "loss.dalr.teacher_space": "raw",
                                "loss.dalr.cma_inputs": "raw"}))  # the student side: z against v̂
    assert needed_inputs(code, pair_batch=True) == {"z", "s", "teacher_image", "joint_image", "text_teacher_sim",
                                                    "rank_teacher_sim", "shared_text", "shared_image"}
    assert needed_inputs(Objective.of(_cfg(**{"train.method": "simcse"})), pair_batch=True) == {"z"}
    projections = _cfg(**{"train.method": "kdmcse", "loss.kdmcse.soft_labels": "projections"})
    assert needed_inputs(Objective.of(projections), pair_batch=True) == {"z", "s", "teacher_text", "teacher_image"}
    assert needed_inputs(Objective.of(_cfg(**{"train.method": "kdmcse"})), pair_batch=True) == {
        "z", "s", "teacher_text", "teacher_image", "joint_text", "joint_image"}  # Eq. 7's α on t̂, v̂


def test_step_embeddings_fields_are_the_inputs_a_term_may_read():
    fields = {f.name for f in dataclasses.fields(StepEmbeddings)} - {"pair_batch"}
    # z, s: both dropout views; mlm: the LM head's logits at the masked tokens and their labels
    named = set(INPUT_FEATURES) - {"z", "s", "mlm"} | {"z1", "z2", "s1", "s2", "mlm_logits", "mlm_labels"}
    assert fields == named


def test_the_codes_raw_l_cma_needs_one_width_and_says_so_before_training():
    """``loss.dalr.cma_inputs: raw`` compares the SimCSE space with the raw image features (BERT-base and CLIP
    ViT-L/14: 768 each); other widths are refused in one line naming the setting, before any step."""
    from mmcse.methods.objectives import active_terms
    from mmcse.methods.terms.dalr import cma_width_problem

    raw = Objective.of(_cfg(**{"train.method": "dalr", "loss.dalr.cma_inputs": "raw"}))
    on = active_terms(raw)
    assert cma_width_problem(raw, on, 768, 768) is None
    problem = cma_width_problem(raw, on, 384, 32)
    assert problem.startswith("loss.dalr.cma_inputs: raw compares the student's SimCSE space (width 384) with the "
                              "raw image features (width 32)") and "set loss.dalr.cma_inputs: projected" in problem
    projected = Objective.of(_cfg(**{"train.method": "dalr"}))
    assert cma_width_problem(projected, active_terms(projected), 384, 32) is None
    no_cma = Objective.of(_cfg(**{"train.method": "dalr", "loss.dalr.cma_inputs": "raw", "loss.dalr.alignment": False}))
    assert cma_width_problem(no_cma, active_terms(no_cma), 384, 32) is None


def test_a_term_a_test_registers_is_gone_after_it(request):
    """tests/conftest.py's `registries_restored`: the next test sees the registry as before (checked here by hand)."""
    from tests.conftest import registries_restored

    before = dict(REGISTRY)
    restore = registries_restored.__wrapped__()
    next(restore)
    register(dataclasses.replace(TERMS[-1], name="a_tests_own", order=10_001))
    assert "a_tests_own" in REGISTRY
    next(restore, None)
    assert REGISTRY == before
