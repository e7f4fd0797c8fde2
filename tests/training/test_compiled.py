"""train.compile: step (`mmcse.training.compiled`): every method's step traces to one graph per batch kind with no
graph break, and the compiled step makes the eager step's update.

The compiled steps here run on torch.compile's ``aot_eager`` backend: the same capture (dynamo, AOTAutograd's joint
forward and backward, the compiled optimizer update) with torch's kernels, since inductor's code generation takes
minutes per graph on 2 CPU cores (benchmarks/step_time.py --compile step runs inductor; tests/cuda does on a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.methods.objectives import Objective, active_terms, needed_features
from mmcse.models.dropout import install_keyed_dropout
from mmcse.models.precision import grad_scaler
from mmcse.models.student import Student, load_backbone, load_mlm_head, load_tokenizer
from mmcse.training.batches import BatchFeatures
from mmcse.training.compiled import graph_breaks, seed_tensor
from mmcse.training.engine import GRAD_NORM, Update, build_optimizer
from mmcse.training.loop import StudentStep
from mmcse.training.step import TrainStep
from tests.conftest import REPO, TINY_DUET, TINY_MODEL

pytestmark = pytest.mark.slow

STUDENTS = ("simcse", "mcse", "kdmcse", "dalr", "mcseo")
B, L = 6, TINY_MODEL["max_seq_len"]
IMAGE, JOINT, TEXT_TEACHER = 48, 24, 40  # cached feature widths (small: only the shapes matter here)
TOL = {"rtol": 1e-5, "atol": 1e-5}


# one encoder layer: a second adds nothing to what is captured (the same layer's ops again) and a third of the
# seconds dynamo and AOTAutograd spend tracing each case
ONE_LAYER = {**TINY_MODEL, "config_overrides": {**TINY_MODEL["config_overrides"], "num_hidden_layers": 1}}


def config(method: str, **overrides):
    model = {f"model.{k}": v for k, v in ONE_LAYER.items()}
    return with_overrides(load_config(REPO / "params.yaml", overrides={"ablate.preset": "none"}),
                          {**model, "train.method": method, "train.dropout_rng": "per_row", "train.compile": "step",
                           "train.learning_rate": 1e-3, "train.max_grad_norm": 1.0, **overrides})


def token_batch(g: torch.Generator, vocab: int) -> dict[str, torch.Tensor]:
    """``(B, L)`` ids padded to the full width, as a compiled step's batches are; lengths 8..L."""
    lengths = torch.randint(8, L + 1, (B,), generator=g)
    ids = torch.randint(1000, vocab, (B, L), generator=g)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    ids[:, 0], ids[torch.arange(B), lengths - 1] = 101, 102  # [CLS] … [SEP]
    return {"input_ids": ids * mask, "attention_mask": mask}


def features(need: set[str], g: torch.Generator, phrases: int = 2 * B) -> BatchFeatures:
    """Random cached features of the groups in ``need``; ``phrases`` object–phrase pairs (MCSEO), two per caption
    from the first, inside its first 7 tokens."""
    f = BatchFeatures()
    unit = torch.nn.functional.normalize
    if "image" in need:
        f.image = torch.randn(B, IMAGE, generator=g).relu()
    if "joint" in need:
        f.joint_text, f.joint_image = (unit(torch.randn(B, JOINT, generator=g), dim=1) for _ in range(2))
    if "text_teachers" in need:
        f.text_teachers = [unit(torch.randn(B, TEXT_TEACHER, generator=g), dim=1) for _ in range(2)]
        f.text_weights = [0.33, 0.67]
    if "objects" in need:
        f.object_row = torch.arange(B).repeat_interleave(2)[:phrases]
        f.object_start = torch.tensor([1, 3] * B)[:phrases]
        f.object_end = torch.tensor([3, 6] * B)[:phrases]
        f.objects = torch.randn(phrases, IMAGE, generator=g).relu()
    return f


def student_for(cfg, mlm: bool) -> Student:
    torch.manual_seed(0)
    backbone = load_backbone(cfg.model, dropout=cfg.train.dropout)
    install_keyed_dropout(backbone)
    student = Student(backbone, IMAGE, cfg.model.proj_dim, JOINT, text_teacher_dim=TEXT_TEACHER,
                      head=cfg.model.projection_head)
    if mlm:
        student.mlm_head = load_mlm_head(cfg.model, load_tokenizer(cfg.model.name_or_path), "new")
    return student.train()


def run(student: Student, cfg, device: torch.device):
    optimizer, scheduler = build_optimizer(student, cfg.train, 10, device)
    return Update(cfg.train, optimizer, grad_scaler(cfg.train.precision, device), device), scheduler


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def fullgraph_of(monkeypatch) -> list[bool]:
    """``fullgraph`` of each function a step hands torch.compile, in order: a forward compiled with fullgraph=True
    raises at its first call on a graph break, so a step that runs has none (``torch._dynamo.explain``, which
    names the break, costs seconds a case: the DUET test runs it)."""
    import mmcse.training.step as step

    calls, real = [], step.compile_graph

    def spy(fn, device, backend=None, fullgraph=True):
        calls.append(fullgraph)
        return real(fn, device, backend, fullgraph)

    monkeypatch.setattr(step, "compile_graph", spy)
    return calls


EXTRA = {"mlm": {"loss.simcse.mlm": True}, "transformers_adamw": {"train.optimizer": "transformers_adamw"}}


@pytest.mark.parametrize("case", [*STUDENTS, "simcse+mlm", "mcse+transformers_adamw"])
def test_a_students_compiled_step_has_no_graph_break_and_makes_the_eager_update(case, device, fullgraph_of):
    """Per method: each batch kind's forward compiled with fullgraph=True (a graph break would raise), then 3 steps
    (pair, text, pair batches) from the same weights, eager and compiled: every step's terms and, after the third,
    every gradient agree within 1e-5 (fp32; dropout on, keyed by row; clipping on), the weights within 1e-4."""
    method, _, extra = case.partition("+")
    cfg = config(method, **EXTRA.get(extra, {}))
    o = Objective.of(cfg)
    on = active_terms(o)
    eager_student = student_for(cfg, mlm=extra == "mlm").to(device)
    compiled_student = copy.deepcopy(eager_student)
    g = torch.Generator().manual_seed(7)
    kinds = (True, False, True)  # pair, text, pair batches; the second pair batch has one object–phrase pair less
    batches = [({k: v.to(device) for k, v in token_batch(g, eager_student.backbone.config.vocab_size).items()},
                features(needed_features(o, pair, on), g, 2 * B - step).to(device))
               for step, pair in enumerate(kinds)]

    eager_update, eager_schedule = run(eager_student, cfg, device)
    update, schedule = run(compiled_student, cfg, device)
    eager = StudentStep(eager_student, o, eager_update, on)
    compiled = StudentStep(compiled_student, o, update, on, compiled=True, backend="aot_eager")
    for step, (pair, (batch, feats)) in enumerate(zip(kinds, batches, strict=True)):
        seed = 1000 + step
        want = eager(batch, feats, pair, seed)
        got = compiled(batch, feats, pair, seed)
        eager_schedule.step()
        schedule.step()
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=f"step {step}: {name}")
    assert set(compiled.step.forwards) == {True, False}  # one graph per batch kind, made once
    assert fullgraph_of == [False, True, True]  # the optimizer update (PyTorch's AdamW step breaks), then the forwards
    want_grads, got_grads = gradients(eager_student), gradients(compiled_student)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=name)
    # the weights within 1e-4: AdamW divides each gradient by its own running RMS, so a 1e-9 difference in a
    # near-zero gradient (a rare token's embedding) moves that weight by up to a tenth of the rate (1e-3)
    for (name, p), q in zip(eager_student.named_parameters(), compiled_student.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert float(schedule.get_last_lr()[0]) == pytest.approx(float(eager_schedule.get_last_lr()[0]))


def test_duets_compiled_step_has_no_graph_break_and_makes_the_eager_update(device):
    """DUET's step (its BERT stream and its own layers, keyed dropout on both): no graph break; 3 steps eager and
    compiled agree within 1e-5 (terms every step, gradients and weights after the third)."""
    from mmcse.models.duet import DuetArchitecture, DuetModel
    from mmcse.training.duet import duet_architecture, same_image_mask
    from mmcse.training.duet_step import RetrievalStep

    cfg = config("duet", **{f"model.duet.{k}": v for k, v in TINY_DUET.items()})
    regions_n, region_dim = 5, 24
    torch.manual_seed(0)
    eager_model = DuetModel(load_backbone(cfg.model, dropout=cfg.train.dropout),
                            DuetArchitecture(**duet_architecture(cfg.model.duet, region_dim))).to(device)
    eager_model.install_keyed_dropout()
    eager_model.train()
    compiled_model = copy.deepcopy(eager_model)
    g = torch.Generator().manual_seed(3)
    ignore = same_image_mask(["a", "b", "a", "c", "d", "e"], device)  # pairs 0 and 2 show one image

    def inputs():
        batch = {k: v.to(device) for k, v in token_batch(g, eager_model.text.config.vocab_size).items()}
        lo = torch.rand(B, regions_n, 2, generator=g) * 0.5
        boxes = torch.cat([lo, lo + 0.4, torch.full((B, regions_n, 1), 0.16)], dim=-1)  # (B, n, 5): x1 y1 x2 y2 area
        regions = (torch.randn(B, regions_n, region_dim, generator=g).relu().to(device), boxes.to(device),
                   torch.ones(B, regions_n, dtype=torch.bool, device=device))
        return batch, regions

    steps = [inputs() for _ in range(3)]
    eager_update, _ = run(eager_model, cfg, device)
    update, _ = run(compiled_model, cfg, device)
    eager = RetrievalStep(eager_model, cfg.loss, eager_update)
    compiled = RetrievalStep(compiled_model, cfg.loss, update, compiled=True, backend="aot_eager")
    batch, (r, boxes, mask) = steps[0]
    breaks, why = graph_breaks(compiled.step.forward_of("pairs"), batch["input_ids"], batch["attention_mask"], r,
                               boxes, mask, ignore, seed_tensor(5, device), (0, 1))
    assert breaks == 0, why
    for step, (batch, regions) in enumerate(steps):
        want = eager(batch, regions, ignore, seed=50 + step)
        got = compiled(batch, regions, ignore, 50 + step)
        assert want.keys() == got.keys() >= {"hinge", "box", "norm", "loss", GRAD_NORM}
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=f"step {step}: {name}")
    want_grads, got_grads = gradients(eager_model), gradients(compiled_model)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=name)


def test_a_resumed_compiled_run_is_bit_identical_to_an_uninterrupted_one(project, monkeypatch):
    """train.compile: step through the training loop (full-width batches, the schedule's rate in a tensor, the
    resume point): a run killed after its step-4 resume point and rerun ends with the uninterrupted run's weights
    and history, bit for bit."""
    import mmcse.training.compiled
    from tests.training.test_loop import killed_and_resumed

    monkeypatch.setattr(mmcse.training.compiled, "BACKEND", "aot_eager")
    compiled_steps = []
    step = TrainStep.__call__
    monkeypatch.setattr(TrainStep, "__call__",
                        lambda self, *a, **k: compiled_steps.append(self.compiled) or step(self, *a, **k))
    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 8, "train.eval_steps": 4,
                                                        "train.checkpoint_steps": 4, "train.compile": "step",
                                                        "train.dropout_rng": "per_row",
                                                        "model.config_overrides": ONE_LAYER["config_overrides"]})
    full, resumed, a, b = killed_and_resumed(cfg, project)
    assert resumed.history == full.history
    assert compiled_steps == [True] * (8 + 8 + 4)  # every step of the three runs was the compiled one
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("method", ["dalr", "mcseo"])
def test_gradient_cached_passes_through_compiled_graphs_make_the_whole_batchs_update(method, device):
    """train.micro_batch with train.compile: step: the encoder passes (cached forward, replay; 12 rows as passes of
    8 and 4, so the smaller last pass compiles too) run as compiled graphs, and the step's terms and gradients are
    the whole batch's eager ones (float64, dropout on, keyed by row)."""
    from tests.training.test_gradcache import _double_student

    cfg, whole_student, batch, feats = _double_student(method, device=device)
    cached_student = copy.deepcopy(whole_student)
    o = Objective.of(cfg)
    whole_update, _ = run(whole_student, cfg, device)
    micro = with_overrides(cfg, {"train.micro_batch": 4})
    cached_update, _ = run(cached_student, micro, device)
    cached = StudentStep(cached_student, o, cached_update, compiled=True, backend="aot_eager")
    assert cached.passes is not None and not cached.step.compiled  # the passes are the graphs
    want = StudentStep(whole_student, o, whole_update)(batch, feats, True, seed=11)
    got = cached(batch, feats, True, seed=11)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    want_grads, got_grads = gradients(whole_student), gradients(cached_student)
    assert want_grads.keys() == got_grads.keys() and any(n.startswith("backbone.") for n in want_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=1e-6, msg=name)
