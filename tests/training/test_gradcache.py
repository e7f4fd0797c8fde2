"""Gradient-cached batches (``train.micro_batch``, `mmcse.training.gradcache`): for every sentence-encoder
method, a step whose encoder runs in micro-batches gives the whole batch's loss and every parameter's
gradient (float64, dropout on, keyed by row); the keyed dropout is what makes it so."""

from __future__ import annotations

import copy

import pytest
import torch

from mmcse.config import ConfigError, parse_config, with_overrides
from mmcse.methods.objectives import Objective
from mmcse.models.dropout import install_keyed_dropout, keep_mask, row_keys
from mmcse.models.precision import grad_scaler
from mmcse.training.engine import Update, build_optimizer
from mmcse.training.gradcache import CachedTokens
from mmcse.training.loop import optimizer_step, training_step_loss
from tests.conftest import TINY_MODEL
from tests.training.test_step_devices import METHODS, B, step_inputs, tiny_config, tiny_student


def _double_student(method: str, keyed: bool = True, device: torch.device | None = None):
    device = device or torch.device("cpu")
    cfg = with_overrides(tiny_config(method), {"train.dropout_rng": "per_row"} if keyed else {})
    student = tiny_student(cfg, dropout=0.1).double().train().to(device)
    if keyed:
        install_keyed_dropout(student.backbone)
    batch, feats = step_inputs(cfg, student.backbone.config.vocab_size)
    for name in ("image", "joint_text", "joint_image", "objects"):
        if getattr(feats, name) is not None:
            setattr(feats, name, getattr(feats, name).double())
    if feats.text_teachers is not None:
        feats.text_teachers = [t.double() for t in feats.text_teachers]
    return cfg, student, {k: v.to(device) for k, v in batch.items()}, feats.to(device)


def _loss_and_grads(student, cfg, batch, feats, micro: int, seed: int = 11):
    student.zero_grad(set_to_none=True)
    cached = CachedTokens(student, seed, 2 * micro) if micro else None
    terms = training_step_loss(student, Objective.of(cfg), batch, feats, pair_batch=True, seed=seed, encode=cached)
    terms["loss"].backward()
    if cached is not None:
        cached.backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in terms.items()}, grads


# micro: sentences a pass (B = 6 sentences, 12 rows): 4 = passes of 8 and 4 rows; 1 = six passes of 2.
# The fast tier: DALR (the most terms) both ways and MCSEO (token states reach its phrase spans) with 4;
# the slow tier every other method both ways.
FAST = {("dalr", 4), ("dalr", 1), ("mcseo", 4)}


@pytest.mark.parametrize(("method", "micro"), [
    pytest.param(m, k, marks=[] if (m, k) in FAST else [pytest.mark.slow]) for k in (4, 1) for m in METHODS])
def test_a_gradient_cached_step_equals_the_whole_batch(method, micro, device):
    cfg, student, batch, feats = _double_student(method, device=device)
    whole_terms, whole = _loss_and_grads(student, cfg, batch, feats, micro=0)
    cached_terms, cached = _loss_and_grads(student, cfg, batch, feats, micro=micro)
    assert set(cached_terms) == set(whole_terms)
    for name, value in whole_terms.items():
        assert cached_terms[name].item() == pytest.approx(value.item(), abs=1e-6), name
    assert set(cached) == set(whole) and any(n.startswith("backbone.") for n in whole)
    for name, grad in whole.items():
        assert torch.allclose(cached[name], grad, rtol=0, atol=1e-6), (name, (cached[name] - grad).abs().max())
    # dropout was on: another step seed draws other masks, so another loss
    other, _ = _loss_and_grads(student, cfg, batch, feats, micro=0, seed=12)
    assert abs(other["loss"].item() - whole_terms["loss"].item()) > 1e-4


def test_with_torchs_dropout_the_replay_would_not_be_the_first_pass():
    """Why train.micro_batch needs per-row keys: torch's masks depend on the generator's position, so a
    replayed micro-batch draws other masks and the encoder's gradient is not the whole batch's."""
    cfg, student, batch, feats = _double_student("simcse", keyed=False)
    torch.manual_seed(0)
    _, whole = _loss_and_grads(student, cfg, batch, feats, micro=0)
    torch.manual_seed(0)
    _, cached = _loss_and_grads(student, cfg, batch, feats, micro=1)
    worst = max((cached[n] - g).abs().max().item() for n, g in whole.items() if n.startswith("backbone."))
    assert worst > 1e-3


def test_the_training_step_with_micro_batches_makes_the_whole_batchs_update():
    """optimizer_step wires it: AdamW's update of every parameter after one step is the same."""
    after = {}
    for micro in (0, 2):
        cfg, student, batch, feats = _double_student("dalr")  # the same initial weights each time
        train = with_overrides(cfg, {"train.micro_batch": micro, "train.learning_rate": 1e-3}).train
        optimizer, _ = build_optimizer(student, train, total_steps=10)
        update = Update(train, optimizer, grad_scaler("fp32", torch.device("cpu")), torch.device("cpu"))
        terms = optimizer_step(student, Objective.of(cfg), batch, feats, True, update, seed=5)
        after[micro] = (terms["loss"].item(), {n: p.detach().clone() for n, p in student.named_parameters()})
    assert after[2][0] == pytest.approx(after[0][0], abs=1e-9)
    for name, value in after[0][1].items():
        assert torch.allclose(after[2][1][name], value, rtol=0, atol=1e-9), name
    _, initial, _, _ = _double_student("dalr")
    moved = sum(not torch.equal(p.detach(), after[0][1][n]) for n, p in initial.named_parameters())
    assert moved > 10  # the step did update the encoder and the heads


def test_a_rows_masks_depend_on_its_key_alone():
    cfg = tiny_config("simcse")
    student = tiny_student(cfg, dropout=0.1).double().train()
    install_keyed_dropout(student.backbone)
    batch, _ = step_inputs(cfg, student.backbone.config.vocab_size)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows = torch.arange(B)
    with row_keys(student.backbone, 7, rows):
        full = student.token_states(ids, mask)
    with row_keys(student.backbone, 7, rows[[4, 1]]):  # two rows, in another order, in a batch of their own
        part = student.token_states(ids[[4, 1]], mask[[4, 1]])
    assert torch.allclose(part, full[[4, 1]], rtol=0, atol=1e-12)
    with row_keys(student.backbone, 7, rows + 1):  # other keys: other masks
        shifted = student.token_states(ids, mask)
    assert (shifted - full).abs().max() > 1e-2
    student.eval()  # evaluation: no dropout, keys or not
    with row_keys(student.backbone, 7, rows):
        a = student.token_states(ids, mask)
    assert torch.allclose(a, student.token_states(ids, mask), rtol=0, atol=1e-12)


def test_an_attention_module_the_install_did_not_key_is_refused_in_training():
    """keyed_attention never falls back to torch's dropout silently for a module it holds no keys of."""
    from mmcse.models.dropout import keyed_attention

    attention = torch.nn.Module().train()
    q = torch.randn(2, 1, 3, 4)
    with pytest.raises(ValueError, match="per_row does not know Module's attention"):
        keyed_attention(attention, q, q, q, None, dropout=0.1)
    out, _ = keyed_attention(attention.eval(), q, q, q, None, dropout=0.1)  # evaluation: no dropout to key
    assert out.shape == (2, 3, 1, 4)


def test_the_keyed_masks_keep_one_minus_p_independently():
    keep = keep_mask(3, torch.arange(400), salt=2, shape=torch.Size([400, 32, 64]), p=0.1).float()  # (R, L, H)
    assert keep.mean().item() == pytest.approx(0.9, abs=0.003)
    per_row = keep.mean(dim=(1, 2))
    assert per_row.std().item() == pytest.approx((0.9 * 0.1 / (32 * 64)) ** 0.5, rel=0.25)  # rows independent
    flat = keep.view(400, -1) - 0.9
    neighbours = (flat[:, 1:] * flat[:, :-1]).mean() / flat.pow(2).mean()
    assert abs(neighbours.item()) < 0.01  # adjacent elements uncorrelated
    assert not torch.equal(keep, keep_mask(3, torch.arange(400), salt=3, shape=keep.shape, p=0.1).float())


@pytest.mark.parametrize(
    ("train", "message"),
    [({"micro_batch": 8}, "key 'train.micro_batch': needs train.dropout_rng: per_row"),
     ({"micro_batch": 8, "dropout_rng": "per_row", "method": "duet"},
      "key 'train.micro_batch': is for the sentence encoders"),
     ({"dropout_rng": "per_row", "method": "vsepp"}, "key 'train.dropout_rng': per_row keys the dropout"),
     ({"micro_batch": -1}, "train.micro_batch"),
     # a micro-batch that covers the batch pays two passes for nothing
     ({"micro_batch": 32, "batch_size": 32, "dropout_rng": "per_row"},
      "key 'train.micro_batch': 32 covers the whole batch (train.batch_size 32)"),
     ({"micro_batch": 64, "batch_size": 32, "dropout_rng": "per_row"}, "64 covers the whole batch")],
)
def test_settings_gradient_caching_cannot_honour_are_refused_in_one_line(train, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config({"model": copy.deepcopy(TINY_MODEL), "train": train})


def test_a_micro_batch_that_does_not_divide_the_batch_says_how_the_last_pass_is_cut():
    """Issue 53.10: the note's numbers are the passes `CachedTokens` makes (two rows a sentence)."""
    from mmcse.training.gradcache import passes_note

    for batch, micro, processes in ((6, 4, 1), (64, 24, 1), (64, 12, 2), (65, 16, 1)):
        share = batch // processes
        cuts = [c.stop - c.start for c in CachedTokens(None, 0, 2 * micro)._chunks(2 * share)]
        full, last = divmod(share, micro)
        assert cuts == [2 * micro] * full + [2 * last]
        note = passes_note(batch, micro, processes)
        assert note.startswith(f"train.micro_batch {micro} does not divide the {share} sentences each process")
        assert note.endswith(f"each batch in {full} pass{'es' if full > 1 else ''} of {micro} and a last one of {last}")
    assert passes_note(64, 16) is None and passes_note(64, 0) is None and passes_note(64, 16, 2) is None
    assert "over 2 processes" in passes_note(64, 12, 2)
