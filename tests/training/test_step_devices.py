"""One training step of every method on every device (the ``device`` fixture).

A tiny random student (``TINY_MODEL``: 2 layers, 64 wide) and random cached features of
the right shapes go through :func:`mmcse.training.loop.training_step_loss` — no prepared project,
no teacher. Each step must stay on the device of its inputs, give the method's terms,
send gradients to the method's heads only, and give the CPU's numbers for the same
weights, inputs and seed (the random draws come from CPU generators).

The helpers are reused by ``tests/cuda`` (fp32 vs bf16 on a GPU).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch

from mmcse.config import Config, parse_config
from mmcse.methods.objectives import Objective, needed_features
from mmcse.models.student import Student, load_backbone
from mmcse.training.batches import BatchFeatures
from mmcse.training.loop import training_step_loss
from tests.conftest import TINY_MODEL
from tests.training.test_loop import METHOD_TERMS

B, L = 6, 12  # sentences per batch, padded length
IMAGE_DIM, JOINT_DIM, TEXT_TEACHER_DIMS = 24, 16, (20, 20)  # DALR aggregates its teachers: one width
# object–phrase pairs: (sentence, token start, token end); sentence 3 has none, spans stay
# inside each sentence's real tokens (lengths below) and before its [SEP]
SPANS = [(0, 1, 3), (0, 4, 5), (1, 2, 6), (2, 1, 2), (2, 2, 4), (2, 5, 7), (4, 1, 9), (5, 3, 4)]
LENGTHS = [12, 8, 10, 6, 11, 7]  # real tokens per sentence ([CLS] … [SEP]); the rest is padding

# The heads each method's pair batch trains (the rest get no gradient).
METHOD_HEADS = {
    "simcse": {"mlp"},
    "mcse": {"mlp", "text_proj", "image_proj"},
    "kdmcse": {"text_proj", "teacher_text_proj", "teacher_image_proj"},  # Algorithm 1: no SimCSE, no mlp
    "dalr": {"mlp", "text_proj", "teacher_image_proj", "text_teacher_proj", "shared_text", "shared_image"},
    "mcseo": {"mlp", "text_proj", "image_proj"},
}
METHODS = sorted(METHOD_TERMS)


def tiny_config(method: str) -> Config:
    return parse_config({"model": copy.deepcopy(TINY_MODEL), "train": {"method": method}}, where="test")


def tiny_student(cfg: Config, seed: int = 0, dropout: float | None = None) -> Student:
    """A fresh random student on the CPU; the same seed gives the same weights."""
    torch.manual_seed(seed)
    return Student(load_backbone(cfg.model, dropout=dropout), IMAGE_DIM, cfg.model.proj_dim, JOINT_DIM,
                   text_teacher_dim=TEXT_TEACHER_DIMS[0])


def random_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids, attention_mask (B, L)`` on the CPU: [CLS] … [SEP] then padding (id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab_size, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, 0], ids[i, n - 1], ids[i, n:] = 101, 102, 0  # BERT's [CLS], [SEP], [PAD]
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def random_features(need: set[str], seed: int = 0) -> BatchFeatures:
    """Cached-feature groups ``need`` (:func:`needed_features`) of one pair batch, on the CPU,
    float32 as the feature stores hold them."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    feats = BatchFeatures()
    if "image" in need:
        feats.image = r(B, IMAGE_DIM)
    if "joint" in need:
        feats.joint_text, feats.joint_image = r(B, JOINT_DIM), r(B, JOINT_DIM)
    if "text_teachers" in need:
        # text teachers' features are L2-normalised
        feats.text_teachers = [torch.nn.functional.normalize(r(B, d), dim=1) for d in TEXT_TEACHER_DIMS]
        feats.text_weights = [0.33, 0.67]
    if "objects" in need:
        rows, starts, ends = (torch.tensor(c, dtype=torch.long) for c in zip(*SPANS, strict=True))
        feats.object_row, feats.object_start, feats.object_end = rows, starts, ends
        feats.objects = r(len(SPANS), IMAGE_DIM)
    return feats


def step_inputs(cfg: Config, vocab_size: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], BatchFeatures]:
    """A pair batch and exactly the feature groups the method loads for one (CPU)."""
    return random_batch(vocab_size, seed), random_features(needed_features(Objective.of(cfg), pair_batch=True), seed)


def run_step(student: Student, cfg: Config, batch: dict[str, torch.Tensor], feats: BatchFeatures,
             device: torch.device, seed: int = 3) -> dict[str, torch.Tensor]:
    """:func:`training_step_loss` with the batch and features moved to ``device``."""
    batch = {k: v.to(device) for k, v in batch.items()}
    return training_step_loss(student, Objective.of(cfg), batch, feats.to(device), pair_batch=True, seed=seed)


def head_grads(student: Student) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in student.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def fp32_matmuls() -> Iterator[None]:
    """Plain fp32 matmuls on CUDA (no TF32, 10-bit mantissa) inside the block: comparing with
    the CPU needs them, and a training run earlier in the session may have switched TF32 on."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture
def full_fp32_matmuls():
    with fp32_matmuls():
        yield


@pytest.mark.parametrize("method", METHODS)
def test_a_training_step_runs_on_the_device(method, device):
    """Dropout on (as in training): every term on ``device`` and finite, the method's term
    set, finite gradients on ``device`` that reach exactly the method's heads."""
    cfg = tiny_config(method)
    student = tiny_student(cfg).to(device).train()
    batch, feats = step_inputs(cfg, student.backbone.config.vocab_size)
    terms = run_step(student, cfg, batch, feats, device)
    assert {k for k in terms if not k.startswith("stat/")} - {"loss"} == METHOD_TERMS[method]
    for name, t in terms.items():
        assert t.device.type == device.type, f"{name} on {t.device}, inputs on {device}"
        assert t.dim() == 0 and torch.isfinite(t), (name, t)
    assert terms["loss"].dtype == torch.float32
    terms["loss"].backward()
    grads = head_grads(student)
    for name, g in grads.items():
        assert g.device.type == device.type and torch.isfinite(g).all(), name
    assert {n.split(".")[0] for n in grads} - {"backbone"} == METHOD_HEADS[method]
    assert any(n.startswith("backbone.") for n in grads)  # the encoder itself learns
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if n.startswith(tuple(METHOD_HEADS[method])))


@pytest.mark.parametrize("method", METHODS)
def test_a_step_on_the_device_gives_the_cpu_numbers(method, device, full_fp32_matmuls):
    """The same weights, batch, features and seed give the same terms and gradients on
    ``device`` as on the CPU (dropout off: CPU and CUDA dropout masks come from different
    generators; the step's own draws come from CPU generators and must match)."""
    cfg = tiny_config(method)
    cpu_student = tiny_student(cfg, dropout=0.0).train()
    dev_student = copy.deepcopy(cpu_student).to(device)
    batch, feats = step_inputs(cfg, cpu_student.backbone.config.vocab_size, seed=1)
    want = run_step(cpu_student, cfg, batch, feats, torch.device("cpu"), seed=11)
    got = run_step(dev_student, cfg, batch, feats, device, seed=11)
    assert set(got) == set(want)
    tol = {"rtol": 1e-4, "atol": 1e-4} if device.type == "cuda" else {"rtol": 0.0, "atol": 1e-6}
    for name in want:
        torch.testing.assert_close(got[name].detach().cpu(), want[name].detach(), **tol, msg=name)
    want["loss"].backward()
    got["loss"].backward()
    want_g, got_g = head_grads(cpu_student), head_grads(dev_student)
    assert set(got_g) == set(want_g)
    tol = {"rtol": 1e-3, "atol": 1e-4} if device.type == "cuda" else {"rtol": 0.0, "atol": 1e-6}
    for name in want_g:
        torch.testing.assert_close(got_g[name].cpu(), want_g[name], **tol, msg=name)


@pytest.mark.parametrize("method", ["dalr", "kdmcse"])
def test_the_step_seed_moves_only_the_seeded_terms(method, device):
    """``seed`` is the step's draws only: dalr's consistency and rank terms change with it, the
    rest do not; kdmcse has no draws (dropout off, so the forward pass is the same)."""
    cfg = tiny_config(method)
    student = tiny_student(cfg, dropout=0.0).to(device)
    batch, feats = step_inputs(cfg, student.backbone.config.vocab_size, seed=2)
    # tied teacher scores so that the rank term's tie order is the seed's
    if feats.text_teachers is not None:
        feats.text_teachers = [torch.ones_like(t) / t.shape[1] ** 0.5 for t in feats.text_teachers]
    with torch.no_grad():
        runs = [run_step(student, cfg, batch, feats, device, seed=s) for s in range(4)]
    seeded = {"consistency", "rank"} if method == "dalr" else set()
    for name in runs[0]:
        values = {round(float(r[name]), 6) for r in runs}
        if name in seeded:
            assert len(values) > 1, name
        elif name not in ("loss",):
            assert len(values) == 1, (name, values)


def test_an_mlm_step_on_the_device_gives_the_cpu_numbers(device, full_fp32_matmuls):
    """SimCSE's auxiliary MLM (loss.simcse.mlm): the masks come from the term's CPU stream, so the
    device's term and gradients are the CPU's; the LM head and the encoder learn from it, and its
    draws move with the step seed only."""
    from mmcse.models.student import load_mlm_head, load_tokenizer

    cfg = parse_config({"model": copy.deepcopy(TINY_MODEL), "train": {"method": "simcse"},
                        "loss": {"simcse": {"mlm": True, "mlm_probability": 0.3}}}, where="test")
    cpu_student = tiny_student(cfg, dropout=0.0).train()
    cpu_student.mlm_head = load_mlm_head(cfg.model, load_tokenizer(cfg.model.name_or_path), "new")
    dev_student = copy.deepcopy(cpu_student).to(device)
    batch, feats = step_inputs(cfg, cpu_student.backbone.config.vocab_size, seed=4)
    want = run_step(cpu_student, cfg, batch, feats, torch.device("cpu"), seed=5)
    got = run_step(dev_student, cfg, batch, feats, device, seed=5)
    assert set(want) == {"simcse", "mlm", "loss"}
    assert float(want["mlm"].detach()) > 5.0  # a fresh head over a ~30k vocabulary: about log(30522) ≈ 10.3
    tol = {"rtol": 1e-4, "atol": 1e-4} if device.type == "cuda" else {"rtol": 0.0, "atol": 1e-6}
    for name in want:
        torch.testing.assert_close(got[name].detach().cpu(), want[name].detach(), **tol, msg=name)
    got["loss"].backward()
    grads = head_grads(dev_student)
    assert any(n.startswith("mlm_head.") and float(g.abs().max()) > 0 for n, g in grads.items())
    with torch.no_grad():
        again = run_step(dev_student, cfg, batch, feats, device, seed=5)
        other = run_step(dev_student, cfg, batch, feats, device, seed=6)
    assert float(again["mlm"]) == pytest.approx(float(got["mlm"]), abs=1e-6)
    assert float(other["mlm"]) != pytest.approx(float(got["mlm"]), abs=1e-6)
    assert float(other["simcse"]) == pytest.approx(float(got["simcse"]), abs=1e-6)


def test_a_dalr_step_reads_an_image_only_teachers_v_hat_of_its_own_width(device):
    """teachers.joint.image_side: image_encoder: v̂ has the image encoder's width, t̂ the joint teacher's;
    g_φv and the consistency MLP read v̂, g_φt reads t̂, and the step is DALR's."""
    cfg = tiny_config("dalr")
    torch.manual_seed(0)
    student = Student(load_backbone(cfg.model), IMAGE_DIM, cfg.model.proj_dim, joint_dim=IMAGE_DIM,
                      text_teacher_dim=TEXT_TEACHER_DIMS[0], joint_text_dim=JOINT_DIM).to(device)
    assert student.teacher_image_proj[0].in_features == student.shared_image[0].in_features == IMAGE_DIM
    assert student.teacher_text_proj[0].in_features == JOINT_DIM
    batch, feats = step_inputs(cfg, student.backbone.config.vocab_size)
    feats.joint_image = torch.randn(B, IMAGE_DIM, generator=torch.Generator().manual_seed(3))  # v̂: image features
    terms = run_step(student, cfg, batch, feats, device)
    assert {k for k in terms if not k.startswith("stat/")} - {"loss"} == METHOD_TERMS["dalr"]
    assert all(torch.isfinite(t) for t in terms.values())


@pytest.mark.parametrize("sentence", ["encoder", "pooler"])
def test_dalr_consistency_reads_the_sentence_its_setting_names(sentence, monkeypatch):
    """``loss.dalr.consistency_text``: L_cons's sentence side is f_θ's [CLS] (§3.2) or the SimCSE space z (the
    authors' ``self.consistency(z1, …)``): the step hands the consistency head the one it names."""
    from mmcse.config import with_overrides
    from mmcse.training import loop

    cfg = with_overrides(tiny_config("dalr"), {"loss.dalr.consistency_text": sentence}, where="test")
    student = tiny_student(cfg, dropout=0.0).train()
    batch, feats = step_inputs(cfg, student.backbone.config.vocab_size)
    seen: dict = {}
    monkeypatch.setattr(loop, "step_objective", lambda o, e, **kw: seen.setdefault("e", e) and {"loss": e.z1.sum()})
    run_step(student, cfg, batch, feats, torch.device("cpu"))
    e = seen["e"]
    with torch.no_grad():  # dropout 0: the encoder's [CLS] of the same batch, computed apart
        cls = student.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state[
            :, 0]  # (B, H)
        read, other = (cls, e.z1) if sentence == "encoder" else (e.z1, cls)
        assert torch.allclose(e.shared_text, student.shared_text(read), atol=1e-5)
        assert not torch.allclose(e.shared_text, student.shared_text(other), atol=1e-3)
