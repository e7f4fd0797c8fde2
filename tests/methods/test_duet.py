"""DUET (``shared/papers/duet.txt`` §4–5): losses against loop transcriptions of Eq. 23, 28–29, 31–33,
their gradients (gradcheck in float64, and which parameters they reach), and the model's weight tying.

Every test runs on each device of the ``device`` fixture: reference values are computed on the CPU
with Python loops, the code under test on ``device``, results compared after ``.cpu()``.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModel, BertConfig

from mmcse.methods.duet import box_regression_loss, duet_objective, max_violation_hinge, norm_regularizer
from mmcse.models.duet import DuetArchitecture, DuetModel, RegionEmbedding, normalized_boxes
from tests.conftest import TINY_MODEL

# ---------------------------------------------------------------------------- references (loops)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a @ b) / (a.norm() * b.norm()))


def hinge_loop(v_img, v_txt, margin, ignore=None) -> list[float]:
    """L_match(i, c_i) = max_{k≠i} [α + S(i,c_k) - S(i,c_i)]_+ + max_{j≠i} [α + S(j,c_i) - S(i,c_i)]_+."""
    B = v_img.shape[0]
    out = []
    for i in range(B):
        pos = _cos(v_img[i], v_txt[i])
        neg_c = [_cos(v_img[i], v_txt[k]) for k in range(B) if k != i and not (ignore is not None and ignore[i, k])]
        neg_i = [_cos(v_img[j], v_txt[i]) for j in range(B) if j != i and not (ignore is not None and ignore[j, i])]
        term_c = max((max(0.0, margin + s - pos) for s in neg_c), default=0.0)
        term_i = max((max(0.0, margin + s - pos) for s in neg_i), default=0.0)
        out.append(term_c + term_i)
    return out


def box_loop(pred, boxes, mask=None) -> list[float]:
    """(1/n_real) Σ_{real i} Σ_c (b̂_ic - b_ic)² per image."""
    out = []
    for b in range(pred.shape[0]):
        rows = [i for i in range(pred.shape[1]) if mask is None or bool(mask[b, i])]
        total = sum(sum((float(pred[b, i, c]) - float(boxes[b, i, c])) ** 2 for c in range(5)) for i in rows)
        out.append(total / len(rows) if rows else 0.0)
    return out


def norm_loop(v_img, v_txt) -> list[float]:
    def length(v):
        return math.sqrt(sum(float(x) ** 2 for x in v))

    return [abs(length(v_img[i]) - 1) + abs(length(v_txt[i]) - 1) for i in range(v_img.shape[0])]


def _reduce(values: list[float], reduction: str):
    return {"mean": sum(values) / len(values), "sum": sum(values), "none": values}[reduction]


# ---------------------------------------------------------------------------- Eq. 23


def test_normalized_boxes_by_hand(device):
    boxes = torch.tensor([[10.0, 20.0, 50.0, 80.0], [0.0, 0.0, 200.0, 100.0]], device=device)
    got = normalized_boxes(boxes, width=200, height=100).cpu()
    want = torch.tensor([[0.05, 0.2, 0.25, 0.8, 40 * 60 / 20000], [0.0, 0.0, 1.0, 1.0, 1.0]])
    assert got.shape == (2, 5)
    assert torch.allclose(got, want)


@pytest.mark.parametrize(
    ("boxes", "w", "h", "match"),
    [
        (torch.zeros(3, 5), 10, 10, "4 coordinates"),
        (torch.zeros(3, 4), 0, 10, "positive"),
        (torch.tensor([[5.0, 0.0, 1.0, 1.0]]), 10, 10, "x2 < x1"),
    ],
)
def test_normalized_boxes_rejects_bad_input(boxes, w, h, match):
    with pytest.raises(ValueError, match=match):
        normalized_boxes(boxes, w, h)


# ---------------------------------------------------------------------------- Eq. 28–29


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("margin", [0.2, 0.0])
def test_hinge_matches_loop(device, reduction, margin):
    g = torch.Generator().manual_seed(0)
    v_img, v_txt = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    got = max_violation_hinge(v_img.to(device), v_txt.to(device), margin=margin, reduction=reduction).cpu()
    want = torch.tensor(_reduce(hinge_loop(v_img, v_txt, margin), reduction))
    assert torch.allclose(got.float(), want.float(), atol=1e-5)
    assert float(got.sum()) > 0  # random pairs violate the margin: the test would see a wrong 0


def test_hinge_hardest_negative_excludes_the_positive(device):
    # S = I: every negative has cosine 0, the positive 1 -> no violation with α = 0.2. A max that
    # included j = i would take S(i,i) = 1 and give 2α per pair.
    e = torch.eye(3, device=device)
    assert float(max_violation_hinge(e, e, margin=0.2, reduction="sum")) == pytest.approx(0.0)
    # α = 1.5: [1.5 + 0 - 1]_+ in both directions = 1.0 per pair.
    assert float(max_violation_hinge(e, e, margin=1.5, reduction="mean")) == pytest.approx(1.0)


def test_hinge_takes_the_max_not_the_sum_of_negatives(device):
    # Image 0 = caption 0 direction; captions 1, 2 are at cos 0.8 and 0.6 from image 0.
    v_img = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    v_txt = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8]])
    got = max_violation_hinge(v_img.to(device), v_txt.to(device), margin=0.5, reduction="none").cpu()
    want = hinge_loop(v_img, v_txt, 0.5)
    # pair 0, caption direction: max([0.5 + 0.8 - 1]_+, [0.5 + 0.6 - 1]_+) = 0.3 (a sum would be 0.4)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    caption_term_0 = 0.5 + 0.8 - 1.0
    image_term_0 = max(0.0, 0.5 + max(_cos(v_img[1], v_txt[0]), _cos(v_img[2], v_txt[0])) - 1.0)
    assert float(got[0]) == pytest.approx(caption_term_0 + image_term_0, abs=1e-6)


def test_hinge_ties_between_negatives(device):
    # Captions 1 and 2 are identical: both are the hardest negative of image 0 with the same S.
    v_img = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    v_txt = torch.tensor([[1.0, 0.1, 0.0], [0.7, 0.7, 0.0], [0.7, 0.7, 0.0]])
    want = hinge_loop(v_img, v_txt, 0.2)
    got = max_violation_hinge(v_img.to(device), v_txt.to(device), margin=0.2, reduction="none").cpu()
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    # The tie's gradient is finite, and is shared between the two tied captions (amax).
    v_txt_d = v_txt.clone().to(device).requires_grad_(True)
    max_violation_hinge(v_img.to(device), v_txt_d, margin=0.2, reduction="none")[0].backward()
    grad = v_txt_d.grad.cpu()
    assert torch.isfinite(grad).all()
    assert torch.allclose(grad[1], grad[2])


def test_hinge_batch_of_one_has_no_negatives(device):
    v_img = torch.randn(1, 4, device=device, requires_grad=True)
    v_txt = torch.randn(1, 4, device=device, requires_grad=True)
    loss = max_violation_hinge(v_img, v_txt, margin=0.2)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.isfinite(v_img.grad).all() and float(v_img.grad.abs().sum()) == 0.0


def test_hinge_batch_of_two_by_hand(device):
    # S = [[1, 0.6], [0, 0.8]] (rows: images, columns: captions); α = 0.3.
    v_img = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v_txt = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    got = max_violation_hinge(v_img.to(device), v_txt.to(device), margin=0.3, reduction="none").cpu()
    # pair 0: [0.3 + 0.6 - 1]_+ + [0.3 + 0 - 1]_+ = 0 ; pair 1: [0.3 + 0 - 0.8]_+ + [0.3 + 0.6 - 0.8]_+ = 0.1
    assert torch.allclose(got, torch.tensor([0.0, 0.1]), atol=1e-6)


def test_hinge_ignore_mask_drops_false_negatives(device):
    g = torch.Generator().manual_seed(1)
    v_img, v_txt = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    ignore = torch.zeros(4, 4, dtype=torch.bool)
    ignore[0, 1] = ignore[1, 0] = True  # images 0 and 1 are the same picture
    got = max_violation_hinge(v_img.to(device), v_txt.to(device), reduction="none", ignore=ignore.to(device)).cpu()
    assert torch.allclose(got, torch.tensor(hinge_loop(v_img, v_txt, 0.2, ignore)), atol=1e-6)
    plain = max_violation_hinge(v_img.to(device), v_txt.to(device), reduction="none").cpu()
    assert not torch.allclose(got, plain)  # the mask changes something on this draw


def test_hinge_rejects_bad_input():
    with pytest.raises(ValueError, match="reduction"):
        max_violation_hinge(torch.randn(2, 3), torch.randn(2, 3), reduction="avg")
    with pytest.raises(ValueError, match="v_img and v_txt"):
        max_violation_hinge(torch.randn(2, 3), torch.randn(3, 3))
    with pytest.raises(ValueError, match="ignore"):
        max_violation_hinge(torch.randn(2, 3), torch.randn(2, 3), ignore=torch.zeros(3, 3, dtype=torch.bool))


# ---------------------------------------------------------------------------- Eq. 31, 32, 33


def test_box_loss_by_hand(device):
    pred = torch.zeros(1, 2, 5)
    boxes = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 0.0, 0.0, 0.0, 0.0]]])
    # region 0: 0.01+0.04+0.09+0.16+0.25 = 0.55 ; region 1: 1.0 -> mean over n = 2: 0.775
    assert float(box_regression_loss(pred.to(device), boxes.to(device))) == pytest.approx(0.775)
    mask = torch.tensor([[True, False]])
    assert float(box_regression_loss(pred.to(device), boxes.to(device), mask.to(device))) == pytest.approx(0.55)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_box_loss_with_padding_matches_loop(device, reduction):
    g = torch.Generator().manual_seed(2)
    pred, boxes = torch.randn(3, 4, 5, generator=g), torch.rand(3, 4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # last image: no region
    got = box_regression_loss(pred.to(device), boxes.to(device), mask.to(device), reduction=reduction).cpu()
    assert torch.allclose(got, torch.tensor(_reduce(box_loop(pred, boxes, mask), reduction)), atol=1e-5)


def test_norm_regularizer_by_hand(device):
    v_img = torch.tensor([[3.0, 4.0], [0.6, 0.8]])  # norms 5, 1
    v_txt = torch.tensor([[0.3, 0.4], [0.0, 2.0]])  # norms 0.5, 2
    got = norm_regularizer(v_img.to(device), v_txt.to(device), reduction="none").cpu()
    assert torch.allclose(got, torch.tensor([4.5, 1.0]))
    assert torch.allclose(got, torch.tensor(norm_loop(v_img, v_txt)))
    assert float(norm_regularizer(v_img.to(device), v_txt.to(device))) == pytest.approx(2.75)


def test_objective_is_eq33(device):
    g = torch.Generator().manual_seed(3)
    v_img, v_txt = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    pred, boxes = torch.randn(5, 3, 5, generator=g), torch.rand(5, 3, 5, generator=g)
    mask = torch.rand(5, 3, generator=g) > 0.3
    out = duet_objective(
        v_img.to(device), v_txt.to(device), pred.to(device), boxes.to(device), mask.to(device),
        margin=0.2, lambdas=(0.5, 0.25),
    )
    assert set(out) == {"hinge", "box", "norm", "loss"}
    hinge = _reduce(hinge_loop(v_img, v_txt, 0.2), "mean")
    box = _reduce(box_loop(pred, boxes, mask), "mean")
    norm = _reduce(norm_loop(v_img, v_txt), "mean")
    assert float(out["hinge"]) == pytest.approx(hinge, abs=1e-5)
    assert float(out["box"]) == pytest.approx(box, abs=1e-5)
    assert float(out["norm"]) == pytest.approx(norm, abs=1e-5)
    assert float(out["loss"]) == pytest.approx(hinge + 0.5 * box + 0.25 * norm, abs=1e-5)


def test_losses_gradcheck_float64(device):
    g = torch.Generator().manual_seed(4)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device).requires_grad_(True)

    v_img, v_txt = leaf(5, 4), leaf(5, 4)
    assert torch.autograd.gradcheck(
        lambda a, b: max_violation_hinge(a, b, margin=0.3, reduction="none"), (v_img, v_txt)
    )
    pred = leaf(3, 4, 5)
    boxes = torch.rand(3, 4, 5, generator=g, dtype=torch.float64).to(device)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool, device=device)
    assert torch.autograd.gradcheck(lambda p: box_regression_loss(p, boxes, mask, reduction="none"), (pred,))
    assert torch.autograd.gradcheck(lambda a, b: norm_regularizer(a, b, reduction="none"), (v_img, v_txt))
    assert torch.autograd.gradcheck(
        lambda a, b, p: duet_objective(a, b, p, boxes, mask, lambdas=(0.7, 0.3))["loss"],
        (v_img, v_txt, pred),
    )


# ---------------------------------------------------------------------------- the model

VOCAB, REGION_DIM, N_REGIONS = 50, 12, 4


def tiny_model(device, shared_layers: int = 2, **kwargs) -> DuetModel:
    """The project's tiny BERT (TINY_MODEL sizes, random weights) under a tiny DUET, dropout off."""
    sizes = TINY_MODEL["config_overrides"]
    config = BertConfig(
        vocab_size=VOCAB, max_position_embeddings=TINY_MODEL["max_seq_len"], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **sizes,
    )
    torch.manual_seed(0)
    bert = AutoModel.from_config(config, add_pooling_layer=False)
    kwargs = {"heads": 2, "ff_dim": 48, "dropout": 0.0, "joint_dim": 32} | kwargs
    model = DuetModel(bert, DuetArchitecture(region_dim=REGION_DIM, visual_layers=2, shared_layers=shared_layers,
                                             **kwargs))
    return model.to(device)


def tiny_batch(device, B: int = 3, m: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (B, m), generator=g)
    attention_mask = torch.ones(B, m, dtype=torch.long)
    attention_mask[0, 4:] = 0  # one padded caption
    regions = torch.randn(B, N_REGIONS, REGION_DIM, generator=g).abs() * 5  # post-ReLU-like features
    xy = torch.rand(B, N_REGIONS, 2, generator=g) * 50
    wh = torch.rand(B, N_REGIONS, 2, generator=g) * 50
    boxes = normalized_boxes(torch.cat([xy, xy + wh], -1), width=100, height=100)
    region_mask = torch.ones(B, N_REGIONS, dtype=torch.bool)
    region_mask[1, 2:] = False  # one image with 2 of 4 regions
    return {k: v.to(device) for k, v in dict(
        input_ids=input_ids, attention_mask=attention_mask, regions=regions, boxes=boxes, region_mask=region_mask
    ).items()}


def test_forward_shapes_and_objective(device):
    model = tiny_model(device).eval()
    batch = tiny_batch(device)
    out = model(**batch)
    assert out.v_img.shape == (3, 32) and out.v_txt.shape == (3, 32) and out.box_pred.shape == (3, N_REGIONS, 5)
    terms = duet_objective(out.v_img, out.v_txt, out.box_pred, batch["boxes"], batch["region_mask"])
    assert all(torch.isfinite(t) for t in terms.values())
    assert float(terms["box"].detach()) > 0 and float(terms["norm"].detach()) > 0


def test_padded_regions_do_not_change_the_image(device):
    model = tiny_model(device).eval()
    b = tiny_batch(device)
    with torch.no_grad():
        v_ref, box_ref = model.encode_image(b["regions"][1:2, :2], b["boxes"][1:2, :2])  # the 2 real regions only
        v_pad, box_pad = model.encode_image(b["regions"][1:2], b["boxes"][1:2], b["region_mask"][1:2])
        junk = b["regions"][1:2].clone()
        junk[:, 2:] = 1000.0  # change what sits in the padded slots
        v_junk, _ = model.encode_image(junk, b["boxes"][1:2], b["region_mask"][1:2])
        v_unmasked, _ = model.encode_image(junk, b["boxes"][1:2])  # the same slots NOT masked
    assert torch.allclose(v_pad, v_ref, atol=1e-5)
    assert torch.allclose(v_junk, v_ref, atol=1e-5)
    assert torch.allclose(box_pad[:, :2], box_ref, atol=1e-5)
    assert not torch.allclose(v_unmasked, v_ref, atol=1e-3)  # unmasked, the slots do matter


def _grads(model: DuetModel) -> dict[str, bool]:
    return {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in model.named_parameters()}


def test_gradients_reach_only_what_they_should(device):
    model = tiny_model(device).train()
    b = tiny_batch(device)
    out = model(**b)
    box_regression_loss(out.box_pred, b["boxes"], b["region_mask"]).backward()
    got = _grads(model)
    assert not any(v for n, v in got.items() if n.startswith(("text.", "text_proj.")))  # no text gradient
    assert not any(v for n, v in got.items() if n.startswith("shared."))  # l = 2 lies below the shared layers
    assert all(v for n, v in got.items() if n.startswith(("region_embed.mlp", "box_head.", "visual.0.")))

    model.zero_grad(set_to_none=True)
    out = model(**b)
    max_violation_hinge(out.v_img, out.v_txt, margin=0.5).backward()
    got = _grads(model)
    assert any(v for n, v in got.items() if n.startswith("text.encoder"))
    assert got["text.embeddings.word_embeddings.weight"] and got["text_proj.weight"]
    assert got["region_embed.mlp.0.weight"] and got["img_cls"]
    assert all(v for n, v in got.items() if n.startswith("shared."))
    assert not any(v for n, v in got.items() if n.startswith("box_head."))  # only the box loss trains it


def _used_by(model: DuetModel, loss) -> set[int]:
    """ids of the parameters that get a non-zero gradient from ``loss``."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {id(p) for p in model.parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}


def test_shared_layers_are_one_set_of_parameters(device):
    model = tiny_model(device, shared_layers=2).eval()
    b = tiny_batch(device)
    assert len(model.shared) == 2 and model.text_top is None
    for i in range(2):
        assert model.text_layers()[i] is model.shared[i]
    shared_ids = {id(p) for p in model.shared.parameters()}
    # Every parameter that both streams use belongs to the shared layers.
    both = _used_by(model, model.encode_text(b["input_ids"], b["attention_mask"]).pow(2).sum()) & _used_by(
        model, model.encode_image(b["regions"], b["boxes"], b["region_mask"])[0].pow(2).sum()
    )
    assert both and both <= shared_ids

    # One optimizer step on a text-only loss moves the shared weights, and so the image embedding.
    with torch.no_grad():
        v_before = model.encode_image(b["regions"], b["boxes"], b["region_mask"])[0].clone()
    shared_before = [p.detach().clone() for p in model.shared.parameters()]
    visual_before = [p.detach().clone() for p in model.visual.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model.encode_text(b["input_ids"], b["attention_mask"]).pow(2).sum().backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(shared_before, model.shared.parameters(), strict=True))
    # the visual stream's own layers are untouched by a text-only loss
    assert all(torch.equal(a, p) for a, p in zip(visual_before, model.visual.parameters(), strict=True))
    with torch.no_grad():
        v_after = model.encode_image(b["regions"], b["boxes"], b["region_mask"])[0]
    assert not torch.allclose(v_before, v_after, atol=1e-6)


@pytest.mark.parametrize("variant", [{"shared_layers": 0}, {"shared_layers": 2, "tie_shared": False}])
def test_untied_streams_share_no_parameter(device, variant):
    model = tiny_model(device, **variant).eval()
    b = tiny_batch(device)
    if variant["shared_layers"]:
        assert all(model.text_layers()[i] is not model.shared[i] for i in range(2))
    else:
        assert len(model.shared) == 0
    text_ids = _used_by(model, model.encode_text(b["input_ids"], b["attention_mask"]).pow(2).sum())
    image_ids = _used_by(model, model.encode_image(b["regions"], b["boxes"], b["region_mask"])[0].pow(2).sum())
    assert text_ids and image_ids and not (text_ids & image_ids)
    out = model(**b)
    assert out.v_img.shape == out.v_txt.shape == (3, 32)


def test_box_layer_inside_the_shared_layers_and_other_widths(device):
    model = tiny_model(device, box_layer=3, visual_dim=16).eval()  # l = 3: the first shared layer
    assert model.box_head[0].in_features == 32
    out = model(**tiny_batch(device))
    assert out.v_img.shape == (3, 32) and out.box_pred.shape == (3, N_REGIONS, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"box_layer": 4}, "box_layer"),  # l = L
        ({"box_layer": 0}, "box_layer"),
        ({"region_norm": "batchnorm"}, "region_norm"),
        ({"heads": 5}, "divisible"),
    ],
)
def test_model_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_model(torch.device("cpu"), **kwargs)


def test_model_rejects_bad_shapes():
    model = tiny_model(torch.device("cpu")).eval()
    b = tiny_batch(torch.device("cpu"))
    with pytest.raises(ValueError, match="boxes"):
        model.encode_image(b["regions"], b["boxes"][..., :4])
    with pytest.raises(ValueError, match="region_mask"):
        model.encode_image(b["regions"], b["boxes"], b["region_mask"][:, :2])


# ---------------------------------------------------------------------------- w/o spatial features (Table 2)


def test_region_embedding_without_boxes_is_eq24_on_the_features_alone():
    torch.manual_seed(1)
    emb = RegionEmbedding(REGION_DIM, 8, spatial=False)
    assert emb.mlp[0].in_features == REGION_DIM and RegionEmbedding(REGION_DIM, 8).mlp[0].in_features == REGION_DIM + 5
    regions = torch.randn(2, 3, REGION_DIM).abs() * 5
    got = emb(regions, torch.rand(2, 3, 5))
    # W2·ReLU(W1 LN(r) + b1) + b2 by hand, LN with the layer's own affine
    w1, b1, w2, b2 = emb.mlp[0].weight, emb.mlp[0].bias, emb.mlp[2].weight, emb.mlp[2].bias
    mu, var = regions.mean(-1, keepdim=True), regions.var(-1, unbiased=False, keepdim=True)
    r = (regions - mu) / torch.sqrt(var + emb.norm.eps) * emb.norm.weight + emb.norm.bias
    want = torch.relu(r @ w1.T + b1) @ w2.T + b2
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("spatial", [True, False])
def test_without_spatial_features_boxes_never_reach_the_image(device, spatial):
    model = tiny_model(device, spatial=spatial).eval()
    assert model.spatial is spatial
    assert model.region_embed.mlp[0].in_features == (REGION_DIM + 5 if spatial else REGION_DIM)
    b = tiny_batch(device)
    other = tiny_batch(device, seed=1)  # other boxes for the same regions, other regions in the same boxes
    with torch.no_grad():
        v, box = model.encode_image(b["regions"], b["boxes"], b["region_mask"])
        v_moved, box_moved = model.encode_image(b["regions"], other["boxes"], b["region_mask"])
        v_feats, box_feats = model.encode_image(other["regions"], b["boxes"], b["region_mask"])
    if spatial:
        assert not torch.allclose(v, v_moved, atol=1e-4) and not torch.allclose(box, box_moved, atol=1e-4)
    else:
        assert torch.equal(v, v_moved) and torch.equal(box, box_moved)
    # the box head still reads the features either way
    assert not torch.allclose(v, v_feats, atol=1e-4) and not torch.allclose(box, box_feats, atol=1e-4)


@pytest.mark.parametrize("spatial", [True, False])
def test_without_spatial_features_the_boxes_are_only_the_target(device, spatial):
    model = tiny_model(device, spatial=spatial).train()
    b = tiny_batch(device)
    boxes_in = b["boxes"].clone().requires_grad_(True)  # what the image stream reads
    target = b["boxes"].clone()  # what Eq. 31 regresses to
    out = model(b["input_ids"], b["attention_mask"], b["regions"], boxes_in, b["region_mask"])
    terms = duet_objective(out.v_img, out.v_txt, out.box_pred, target, b["region_mask"])
    assert float(terms["box"].detach()) > 0  # Eq. 31 still applies
    (grad,) = torch.autograd.grad(terms["loss"], boxes_in, allow_unused=True)
    if spatial:
        assert grad is not None and bool(grad.abs().sum() > 0)
    else:
        assert grad is None or not bool(grad.abs().any())
    # the box loss still trains the box head and, through the features, the visual stream
    model.zero_grad(set_to_none=True)
    box_regression_loss(model(**b).box_pred, b["boxes"], b["region_mask"]).backward()
    got = _grads(model)
    assert all(v for n, v in got.items() if n.startswith(("region_embed.mlp", "box_head.", "visual.0.")))
