"""How each method adds its terms up: weights, switches, combinations, text batches.

Each test runs on every device of the ``device`` fixture: the embeddings are drawn on the
CPU (the references read those), the objective runs on copies on ``device`` (:func:`_step`).
"""

import dataclasses
import math

import pytest
import torch

from mmcse.config import Config, parse_config, with_overrides
from mmcse.experiments.recipes import load_recipes
from mmcse.methods.losses import IGNORED, adapacse_loss, info_nce, simcse_loss
from mmcse.methods.objectives import Objective, StepEmbeddings, active_terms, needed_features
from mmcse.methods.step import step_objective
from tests.conftest import REPO
from tests.methods.test_losses import eq1_loop, eq3_loop
from tests.methods.test_losses_kdmcse import eq13_loop

N, P, K, H = 6, 5, 4, 7


def _embeddings(seed: int = 0, pair_batch: bool = True) -> StepEmbeddings:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    text_feats = [r(N, 8), r(N, 3)]
    sim = sum(w * torch.nn.functional.normalize(f, dim=1) @ torch.nn.functional.normalize(f, dim=1).T
              for f, w in zip(text_feats, [0.33, 0.67], strict=True))
    return StepEmbeddings(
        z1=r(N, H), z2=r(N, H), pair_batch=pair_batch, s1=r(N, P), s2=r(N, P), image=r(N, P),
        teacher_text=r(N, P), teacher_image=r(N, P), joint_text=r(N, K), joint_image=r(N, K),
        shared_text=r(N, P), shared_image=r(N, P), text_teacher_sim=sim, rank_teacher_sim=sim, text_teacher=r(N, P),
        phrases=r(7, P), objects=r(7, P), object_pair=torch.tensor([0, 0, 2, 2, 2, 5, 5]),
    )


def _cfg(**overrides) -> Config:
    return with_overrides(Config(), overrides)


def _on(e: StepEmbeddings, device: torch.device) -> StepEmbeddings:
    """``e`` with every tensor field copied to ``device``."""
    moved = {f.name: getattr(e, f.name).to(device) for f in dataclasses.fields(e)
             if isinstance(getattr(e, f.name), torch.Tensor)}
    return dataclasses.replace(e, **moved)


def _step(device: torch.device, cfg: Config, e: StepEmbeddings, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`step_objective` on ``e``'s copy on ``device``; every term (diagnostics too) must
    come back on that device. Returns the terms on the CPU, to compare with the references."""
    terms = step_objective(Objective.of(cfg), _on(e, device), seed)
    for name, t in terms.items():
        assert t.device.type == device.type, f"term {name} on {t.device}, embeddings on {device}"
    return {name: t.cpu() for name, t in terms.items()}


def test_mcse_is_simcse_plus_lambda_times_eq3(device):
    e = _embeddings()
    cfg = _cfg(**{"train.method": "mcse", "loss.lambda_img": 0.3, "loss.temperature_img": 0.1})
    terms = _step(device, cfg, e)
    assert set(terms) == {"simcse", "image", "loss"}
    expected = eq1_loop(e.z1, e.z2, 0.05) + 0.3 * eq3_loop(e.s1, e.s2, e.image, 0.1)
    assert float(terms["loss"]) == pytest.approx(expected, abs=1e-6)
    # text-only batches: SimCSE alone
    text = _step(device, cfg, _embeddings(pair_batch=False))
    assert set(text) == {"simcse", "loss"}


def test_simcse_method_has_no_image_term(device):
    terms = _step(device, _cfg(**{"train.method": "simcse"}), _embeddings())
    assert set(terms) == {"simcse", "loss"}


def _alphas(t, v):
    cos = torch.nn.functional.cosine_similarity
    return (cos(t.unsqueeze(1), v.unsqueeze(0), dim=-1), cos(t.unsqueeze(1), t.unsqueeze(0), dim=-1),
            cos(v.unsqueeze(1), v.unsqueeze(0), dim=-1))


def test_kdmcse_is_algorithm1_eq14_of_eq13_per_view_with_projected_soft_labels(device):
    """App. D Algorithm 1: an image–caption batch's loss is ℓ^KDMCSE (Eq. 14) alone, its soft labels
    the cosines of the projections g_φt(t̂), g_φv(v̂); the switches give SimCSE + λ·ℓ^KDMCSE and the
    raw-CLIP soft labels."""
    e = _embeddings(1)
    cfg = _cfg(**{"train.method": "kdmcse", "loss.lambda_img": 0.5, "loss.kdmcse.threshold": 0.3,
                  "loss.kdmcse.threshold_drops": "above",
                  "loss.kdmcse.margin": 0.1, "loss.kdmcse.soft_labels": "projections",
                  "loss.kdmcse.margin_similarity": "within"})
    terms = _step(device, cfg, e)
    assert set(terms) == {"kdmcse", "kdmcse_image", "kdmcse_text", "loss",
                          "stat/kdmcse_filtered_image", "stat/kdmcse_filtered_text"}

    def expected(t, v, margin_similarity="within"):
        a_tv, a_tt, a_vv = _alphas(t, v)
        a_margin = a_vv if margin_similarity == "within" else a_tv
        image = sum(eq13_loop(s, e.teacher_image, 0.05, 0.1, a_margin, a_tv, 0.3) for s in (e.s1, e.s2))
        text = sum(eq13_loop(s, e.teacher_text, 0.05, 0.1, a_tt, a_tt, 0.3) for s in (e.s1, e.s2))
        return image, text

    image, text = expected(e.teacher_text, e.teacher_image)
    assert float(terms["kdmcse_image"]) == pytest.approx(image, abs=1e-6)
    assert float(terms["kdmcse_text"]) == pytest.approx(text, abs=1e-6)
    assert float(terms["loss"]) == pytest.approx((image + text) / 2, abs=1e-6)  # no SimCSE, no λ
    # the authors' code: SimCSE + λ·ℓ^KDMCSE
    code = _step(device, with_overrides(cfg, {"loss.kdmcse.pair_objective": "simcse_plus_kdmcse"}), e)
    assert float(code["loss"]) == pytest.approx(eq1_loop(e.z1, e.z2, 0.05) + 0.5 * (image + text) / 2, abs=1e-6)
    # soft labels from the raw CLIP features (Eq. 7 read on t̂, v̂)
    raw = _step(device, with_overrides(cfg, {"loss.kdmcse.soft_labels": "clip"}), e)
    image_raw, text_raw = expected(e.joint_text, e.joint_image)
    assert float(raw["kdmcse_image"]) == pytest.approx(image_raw, abs=1e-6)
    assert float(raw["kdmcse_text"]) == pytest.approx(text_raw, abs=1e-6)
    assert abs(image_raw - image) > 1e-3  # the two readings differ on these inputs
    # cross: Δ of the image term from α^{t,v}
    cross = _step(device, with_overrides(cfg, {"loss.kdmcse.margin_similarity": "cross"}), e)
    image_cross, _ = expected(e.teacher_text, e.teacher_image, "cross")
    assert float(cross["kdmcse_image"]) == pytest.approx(image_cross, abs=1e-6)


def test_kdmcse_defaults_are_the_paper_as_printed_and_its_recipe_names_the_code(device):
    """Eq. 7's α on the CLIP features t̂, v̂ and the margin from text-text / text-visual α by default (the
    printed paper), Eq. 8's filter dropping the negatives above the threshold (its prose and the code: the equation
    as typeset, which drops those below, contradicts them); the kdmcse recipe keeps the printed α (the code agrees)
    and takes the code's α^{v,v} margin."""
    cfg = _cfg(**{"train.method": "kdmcse", "loss.kdmcse.threshold": 0.3, "loss.kdmcse.margin": 0.1})
    assert (cfg.loss.kdmcse.soft_labels, cfg.loss.kdmcse.margin_similarity) == ("clip", "cross")
    assert (cfg.loss.kdmcse.threshold_drops, cfg.loss.kdmcse.text_filter, cfg.loss.kdmcse.margin_gate) == (
        "above", "tt", "every")
    e = _embeddings(1)
    a_tv, a_tt, _ = _alphas(e.joint_text, e.joint_image)
    image = sum(eq13_loop(s, e.teacher_image, 0.05, 0.1, a_tv, a_tv, 0.3) for s in (e.s1, e.s2))
    text = sum(eq13_loop(s, e.teacher_text, 0.05, 0.1, a_tt, a_tt, 0.3) for s in (e.s1, e.s2))
    terms = _step(device, cfg, e)
    assert float(terms["kdmcse_image"]) == pytest.approx(image, abs=1e-6)
    assert float(terms["kdmcse_text"]) == pytest.approx(text, abs=1e-6)
    recipe = load_recipes(REPO)["kdmcse"].values("bert")
    assert (recipe["loss.kdmcse.soft_labels"], recipe["loss.kdmcse.margin_similarity"]) == ("clip", "within")
    assert recipe["loss.kdmcse.threshold_drops"] == "above"


def _eq13_torch(s, m, tau, margin, alpha_margin, alpha_filter, threshold):
    """Eq. 13 element by element in torch (autograd follows it): the gradient reference."""
    n = s.shape[0]
    total = s.new_zeros(())
    for i in range(n):
        pos = torch.exp(torch.nn.functional.cosine_similarity(s[i], m[i], dim=0) / tau)
        den = pos
        for j in range(n):
            if j == i or float(alpha_filter[i, j]) > threshold:
                continue
            theta = torch.acos(torch.nn.functional.cosine_similarity(s[i], m[j], dim=0))
            den = den + torch.exp(torch.cos(theta - margin * abs(1.0 - float(alpha_margin[i, j]))) / tau)
        total = total - torch.log(pos / den)
    return total / n


def test_kdmcse_gradients_treat_the_soft_labels_as_labels(device):
    """The projections g_φt(t̂), g_φv(v̂) get gradient as Eq. 13's candidates, none through α."""
    e = _embeddings(12)
    cfg = _cfg(**{"train.method": "kdmcse", "loss.kdmcse.threshold": 0.4, "loss.kdmcse.margin": 0.15,
                  "loss.kdmcse.threshold_drops": "above",
                  "loss.kdmcse.soft_labels": "projections", "loss.kdmcse.margin_similarity": "within"})
    leaves = {name: getattr(e, name).clone().requires_grad_(True) for name in ("s1", "s2", "teacher_text",
                                                                                "teacher_image")}
    got = step_objective(Objective.of(cfg), _on(dataclasses.replace(e, **leaves), device))["loss"]
    got.backward()
    ref = {name: t.detach().clone().requires_grad_(True) for name, t in leaves.items()}
    a_tv, a_tt, a_vv = _alphas(ref["teacher_text"].detach(), ref["teacher_image"].detach())
    image = sum(_eq13_torch(ref[s], ref["teacher_image"], 0.05, 0.15, a_vv, a_tv, 0.4) for s in ("s1", "s2"))
    text = sum(_eq13_torch(ref[s], ref["teacher_text"], 0.05, 0.15, a_tt, a_tt, 0.4) for s in ("s1", "s2"))
    ((image + text) / 2).backward()
    assert float(got.detach().cpu()) == pytest.approx(float(((image + text) / 2).detach()), abs=1e-9)
    for name in leaves:
        assert torch.allclose(leaves[name].grad.cpu(), ref[name].grad, atol=1e-9), name


def test_kdmcse_threshold_above_every_similarity_equals_no_filtering(device):
    e = _embeddings(2)
    base = {"train.method": "kdmcse", "loss.kdmcse.soft_labels": "projections",
            "loss.kdmcse.margin_similarity": "within", "loss.kdmcse.threshold_drops": "above"}
    above = _step(device, _cfg(**base, **{"loss.kdmcse.threshold": 1.0}), e)
    off = _step(device, _cfg(**base, **{"loss.kdmcse.threshold": "off"}), e)
    assert float(above["loss"]) == pytest.approx(float(off["loss"]), abs=1e-12)
    low = _step(device, _cfg(**base, **{"loss.kdmcse.threshold": -1.0}), e)  # every negative removed
    assert float(low["kdmcse"]) == pytest.approx(0.0, abs=1e-9)
    assert float(low["stat/kdmcse_filtered_image"]) == 1.0 and float(above["stat/kdmcse_filtered_text"]) == 0.0
    mid_cfg = _cfg(**base, **{"loss.kdmcse.threshold": 0.2, "loss.kdmcse.pair_objective": "simcse_plus_kdmcse"})
    mid = _step(device, mid_cfg, e)
    t = torch.nn.functional.normalize(e.teacher_text, dim=1)  # α^{t,t} of the projections g_φt(t̂)
    above_02 = ((t @ t.T > 0.2) & ~torch.eye(N, dtype=torch.bool)).sum() / (N * (N - 1))
    assert float(mid["stat/kdmcse_filtered_text"]) == pytest.approx(float(above_02))
    # diagnostics are not part of the loss
    lam = mid_cfg.loss.lambda_img
    assert float(mid["loss"]) == pytest.approx(float(mid["simcse"]) + lam * float(mid["kdmcse"]), abs=1e-12)


def test_kdmcse_angular_margin_on_text_batches(device):
    e = _embeddings(3, pair_batch=False)
    cfg = _cfg(**{"train.method": "kdmcse", "loss.kdmcse.text_batches": "angular_margin",
                  "loss.kdmcse.text_margin": 0.2})
    terms = _step(device, cfg, e)
    zeros = torch.zeros(N, N, dtype=torch.float64)  # Δ = |1 − 0| = 1: the same margin on every negative
    assert float(terms["simcse"]) == pytest.approx(eq13_loop(e.z1, e.z2, 0.05, 0.2, zeros, zeros, None), abs=1e-6)
    assert float(terms["simcse"]) > float(simcse_loss(e.z1, e.z2, 0.05))  # the margin makes negatives harder
    # pair batches: no SimCSE under Algorithm 1; with the authors' objective their SimCSE term carries the same
    # margin (their MCSE.compute_loss scores every batch with one ArcSimilarity)
    assert "simcse" not in _step(device, cfg, _embeddings(3))
    code = with_overrides(cfg, {"loss.kdmcse.pair_objective": "simcse_plus_kdmcse"})
    pair = _step(device, code, _embeddings(3))
    assert float(pair["simcse"]) == pytest.approx(eq13_loop(e.z1, e.z2, 0.05, 0.2, zeros, zeros, None), abs=1e-6)


DALR = {"train.method": "dalr"}
WEIGHT = {"info": "loss.dalr.info_weight", "consistency": "loss.dalr.lambda_cml", "cma": "loss.dalr.lambda_cml",
          "rank": "loss.dalr.mu_iml", "ima": "loss.dalr.mu_iml"}
SWITCH = {"info": "loss.dalr.info", "consistency": "loss.dalr.consistency", "cma": "loss.dalr.alignment",
          "rank": "loss.dalr.rank", "ima": "loss.dalr.ima"}


def test_dalr_is_eq14_and_each_switch_removes_exactly_its_term(device):
    e = _embeddings(4)
    cfg = _cfg(**DALR, **{"loss.dalr.lambda_cml": 0.3, "loss.dalr.mu_iml": 0.7, "loss.dalr.info_weight": 0.9})
    full = _step(device, cfg, e)
    # Eq. 14 as printed: a pair batch trains L_total alone, no SimCSE L_text
    assert set(full) == {"info", "consistency", "cma", "rank", "ima", "loss"}
    expected = 0.9 * float(full["info"]) + 0.3 * (
        float(full["consistency"]) + float(full["cma"])) + 0.7 * (float(full["rank"]) + float(full["ima"]))
    assert float(full["loss"]) == pytest.approx(expected, abs=1e-9)
    for term, switch in SWITCH.items():
        off = _step(device, with_overrides(cfg, {switch: False}), e)
        assert term not in off
        weight = {"info": 0.9, "consistency": 0.3, "cma": 0.3, "rank": 0.7, "ima": 0.7}[term]
        assert float(full["loss"] - off["loss"]) == pytest.approx(weight * float(full[term]), abs=1e-9), term
        for other in set(off) - {"loss"}:  # the other terms' numbers do not move
            assert float(off[other]) == pytest.approx(float(full[other]), abs=1e-12), (term, other)
    # the group switches
    no_cml = _step(device, with_overrides(cfg, {"loss.dalr.cml": False}), e)
    no_iml = _step(device, with_overrides(cfg, {"loss.dalr.iml": False}), e)
    assert set(no_cml) == {"info", "rank", "ima", "loss"}
    assert set(no_iml) == {"info", "consistency", "cma", "loss"}
    # SimCSE's L_text joins the pair batches only when asked (the authors' code)
    with_text = _step(device, with_overrides(cfg, {"loss.dalr.simcse_on_pairs": True}), e)
    assert float(with_text["loss"]) == pytest.approx(expected + eq1_loop(e.z1, e.z2, 0.05), abs=1e-6)


def _eq4_torch(s, h_v, tau):
    """DALR Eq. 4, one view: -log e^{sim(s_i^z, h_i^v)/τ} / Σ_j e^{sim(s_i^z, h_j^v)/τ}, averaged over i."""
    cos = torch.nn.functional.cosine_similarity
    total = 0.0
    for i in range(s.shape[0]):
        logits = torch.stack([cos(s[i], h_v[j], dim=0) for j in range(h_v.shape[0])]) / tau
        total = total - (logits[i] - torch.logsumexp(logits, 0))
    return total / s.shape[0]


def test_dalr_eq14_as_printed_and_as_the_authors_code_sum_it(device):
    """Printed: L_info (Eq. 4 on s^z alone) + λ(L_cons + L_CMA) + μ(L_rank + L_IMA), with gradient
    reaching s^z and h^v only through Eq. 4's one view. The authors' code (src/train_mix.py l.542,
    src/model_modified.py l.764-765): SimCSE + 0.1·(0.01·L_cons + L_CMA + mean of both views'
    L_info) + 0.2·(L_IMA + L_rank), which the recipe's settings spell."""
    e = _embeddings(9)
    printed = _cfg(**DALR, **{"loss.dalr.alignment": False, "loss.dalr.iml": False, "loss.dalr.consistency": False})
    leaves = {n: getattr(e, n).clone().requires_grad_(True) for n in ("s1", "s2", "teacher_image")}
    terms = step_objective(Objective.of(printed), _on(dataclasses.replace(e, **leaves), device))
    terms["loss"].backward()
    ref = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    want = _eq4_torch(ref["s1"], ref["teacher_image"], 0.05)
    want.backward()
    assert float(terms["loss"].detach().cpu()) == pytest.approx(float(want.detach()), abs=1e-9)
    for n in ("s1", "teacher_image"):
        assert torch.allclose(leaves[n].grad.cpu(), ref[n].grad, atol=1e-9), n
    assert leaves["s2"].grad is None or float(leaves["s2"].grad.abs().sum()) == 0.0  # Eq. 4 reads one view

    code = _cfg(**DALR, **{"loss.dalr.simcse_on_pairs": True, "loss.dalr.info_views": "mean",
                           "loss.dalr.info_weight": 0.1, "loss.dalr.consistency_scale": 0.01})
    got = _step(device, code, e)
    info_mean = (_eq4_torch(e.s1, e.teacher_image, 0.05) + _eq4_torch(e.s2, e.teacher_image, 0.05)) / 2
    assert float(got["info"]) == pytest.approx(float(info_mean), abs=1e-9)
    cross = 0.01 * float(got["consistency"]) + float(got["cma"]) + float(info_mean)
    intra = float(got["ima"]) + float(got["rank"])
    assert float(got["loss"]) == pytest.approx(eq1_loop(e.z1, e.z2, 0.05) + 0.1 * cross + 0.2 * intra, abs=1e-6)
    summed = _step(device, with_overrides(code, {"loss.dalr.info_views": "sum"}), e)
    assert float(summed["info"]) == pytest.approx(eq3_loop(e.s1, e.s2, e.teacher_image, 0.05), abs=1e-6)
    # the recipe of the paper profiles takes the code's sum, saying so
    recipe = load_recipes(REPO)["dalr"].values("bert")
    assert {k: recipe[k] for k in ("loss.dalr.simcse_on_pairs", "loss.dalr.info_views", "loss.dalr.info_weight",
                                   "loss.dalr.consistency_scale")} == {
        "loss.dalr.simcse_on_pairs": True, "loss.dalr.info_views": "mean", "loss.dalr.info_weight": 0.1,
        "loss.dalr.consistency_scale": 0.01}


def _kl_torch(q_logits, p_logits):
    """Σ_j q_j log(q_j / p_j) of one row's softmaxes, term by term."""
    q, p = torch.softmax(q_logits, 0), torch.softmax(p_logits, 0)
    return sum(q[j] * torch.log(q[j] / p[j]) for j in range(q.shape[0]))


def test_dalr_shares_one_projected_q_t2t_between_cma_and_ima(device):
    """Eq. 3, 7, 11: Q^{t2t} comes from h^t = g_φt(f_t(t)) in both L_CMA and L_IMA, Q^{v2v} from
    h^v = g_φv(f_v(v)); the equations have no stop-gradient, so h^t and h^v get gradient through Q.
    ``teacher_space: raw`` takes the unprojected teachers (the authors' code): the text teachers' own cosines
    (Q^{t2t} of L_CMA and L_IMA) and the raw image features' (Q^{v2v})."""
    e = _embeddings(13)
    cfg = _cfg(**DALR, **{"loss.dalr.cma_student_temperature": 0.5, "loss.dalr.cma_teacher_temperature": 0.2,
                          "loss.dalr.ima_student_temperature": 0.3, "loss.dalr.ima_teacher_temperature": 0.4})
    leaves = {name: getattr(e, name).clone().requires_grad_(True)
              for name in ("s1", "z1", "z2", "teacher_image", "text_teacher")}
    terms = step_objective(Objective.of(cfg), _on(dataclasses.replace(e, **leaves), device))
    (terms["cma"] + terms["ima"]).backward()

    ref = {name: t.detach().clone().requires_grad_(True) for name, t in leaves.items()}
    cos = torch.nn.functional.cosine_similarity

    def cma(s, h_v, q_t, q_v, text_rows=None):  # Eq. 6–8, mean over the batch
        total = 0.0
        for i in range(N):
            p_t2v = torch.stack([cos(s[j], h_v[i], dim=0) for j in range(N)]) / 0.5  # image i over texts
            p_v2t = torch.stack([cos(s[i], h_v[j], dim=0) for j in range(N)]) / 0.5  # text i over images
            q_tt = (text_rows(i) if text_rows else torch.stack([cos(q_t[i], q_t[j], dim=0) for j in range(N)])) / 0.2
            q_vv = torch.stack([cos(q_v[i], q_v[j], dim=0) for j in range(N)]) / 0.2
            total = total + 0.5 * (_kl_torch(q_tt, p_t2v) + _kl_torch(q_vv, p_v2t))
        return total / N

    def ima(z1, z2, teacher_rows):  # Eq. 11–12, mean over the batch
        return sum(_kl_torch(teacher_rows(i) / 0.4, torch.stack([cos(z1[i], z2[j], dim=0) for j in range(N)]) / 0.3)
                   for i in range(N)) / N

    h_t = ref["text_teacher"]
    want_cma = cma(ref["s1"], ref["teacher_image"], h_t, ref["teacher_image"])
    want_ima = ima(ref["z1"], ref["z2"], lambda i: torch.stack([cos(h_t[i], h_t[j], dim=0) for j in range(N)]))
    (want_cma + want_ima).backward()
    assert float(terms["cma"].detach().cpu()) == pytest.approx(float(want_cma.detach()), abs=1e-9)
    assert float(terms["ima"].detach().cpu()) == pytest.approx(float(want_ima.detach()), abs=1e-9)
    for name in leaves:
        assert torch.allclose(leaves[name].grad.cpu(), ref[name].grad, atol=1e-9), name
    assert float(ref["text_teacher"].grad.abs().sum()) > 0  # g_φt learns through Q^{t2t}

    raw = _step(device, with_overrides(cfg, {"loss.dalr.teacher_space": "raw"}), e)
    want_raw_cma = cma(e.s1, e.teacher_image, None, e.joint_image, lambda i: e.text_teacher_sim[i])
    want_raw_ima = ima(e.z1, e.z2, lambda i: e.text_teacher_sim[i])
    assert float(raw["cma"]) == pytest.approx(float(want_raw_cma), abs=1e-9)
    assert float(raw["ima"]) == pytest.approx(float(want_raw_ima), abs=1e-9)
    assert abs(float(raw["cma"]) - float(terms["cma"].detach())) > 1e-3
    # the ranking keeps the teachers' own similarity lists either way
    assert float(raw["rank"]) == pytest.approx(float(terms["rank"].detach()), abs=1e-12)


def test_dalr_projected_targets_need_the_text_teachers_on_pair_batches():
    assert needed_features(Objective.of(_cfg(**DALR)), pair_batch=True) == {"joint", "text_teachers"}
    cml_only = _cfg(**DALR, **{"loss.dalr.iml": False})
    assert needed_features(Objective.of(cml_only), pair_batch=True) == {"joint", "text_teachers"}
    raw = with_overrides(cml_only, {"loss.dalr.teacher_space": "raw"})  # the text teachers' own similarity
    assert needed_features(Objective.of(raw), pair_batch=True) == {"joint", "text_teachers"}
    no_cma = with_overrides(raw, {"loss.dalr.alignment": False})
    assert needed_features(Objective.of(no_cma), pair_batch=True) == {"joint"}


@pytest.mark.parametrize("include_diagonal", [True, False])
@pytest.mark.parametrize("mismatch", ["derangement", "roll"])
def test_dalr_draws_do_not_depend_on_the_device(include_diagonal, mismatch, device):
    """The mismatched pairs and ranking ties come from CPU generators seeded by ``seed``: the
    terms on ``device`` equal the CPU terms for the same seed, and the seed changes the draws."""
    e = _embeddings(11)
    # tied teacher scores (two values off the diagonal), so the tie order is the seed's
    tied = (e.text_teacher_sim > e.text_teacher_sim.median()).to(torch.float64) * 0.5
    e = dataclasses.replace(e, rank_teacher_sim=tied.fill_diagonal_(1.0))
    cfg = _cfg(**DALR, **{"loss.dalr.rank_include_diagonal": include_diagonal, "loss.dalr.mismatch": mismatch})
    per_seed = []
    for seed in (0, 1, 2, 3):
        cpu = step_objective(Objective.of(cfg), e, seed)
        got = _step(device, cfg, e, seed)
        assert set(got) == set(cpu)
        for name in cpu:
            assert float(got[name]) == pytest.approx(float(cpu[name]), abs=1e-9), (seed, name)
        per_seed.append((float(cpu["consistency"]), float(cpu["rank"])))
    assert len({rank for _, rank in per_seed}) > 1  # the ties do follow the seed
    if mismatch == "derangement":
        assert len({cons for cons, _ in per_seed}) > 1


def test_dalr_with_lambda_mu_zero_is_info_alone(device):
    e = _embeddings(5)
    terms = _step(device, _cfg(**DALR, **{"loss.dalr.lambda_cml": 0.0, "loss.dalr.mu_iml": 0.0}), e)
    assert float(terms["info"]) == pytest.approx(eq1_loop(e.s1, e.teacher_image, 0.05), abs=1e-6)  # Eq. 4, s^z
    assert float(terms["loss"]) == pytest.approx(float(terms["info"]), abs=1e-12)


def test_dalr_info_margin_option_uses_the_adaptive_margin(device):
    e = _embeddings(6)
    terms = _step(device, _cfg(**DALR, **{"loss.dalr.info_margin": True, "loss.dalr.info_margin_size": 0.2,
                                          "loss.dalr.info_views": "sum"}), e)
    v = torch.nn.functional.normalize(e.joint_image, dim=1)
    a_vv = v @ v.T
    expected = sum(eq13_loop(s, e.teacher_image, 0.05, 0.2, a_vv, a_vv, None) for s in (e.s1, e.s2))
    assert float(terms["info"]) == pytest.approx(expected, abs=1e-6)
    one = _step(device, _cfg(**DALR, **{"loss.dalr.info_margin": True, "loss.dalr.info_margin_size": 0.2}), e)
    assert float(one["info"]) == pytest.approx(eq13_loop(e.s1, e.teacher_image, 0.05, 0.2, a_vv, a_vv, None),
                                               abs=1e-6)


def test_dalr_iml_on_text_batches_only_when_asked(device):
    e = _embeddings(7, pair_batch=False)
    assert set(_step(device, _cfg(**DALR), e)) == {"simcse", "loss"}
    terms = _step(device, _cfg(**DALR, **{"loss.dalr.text_batches": True}), e)
    assert set(terms) == {"simcse", "rank", "ima", "loss"}
    text_batches = Objective.of(_cfg(**DALR, **{"loss.dalr.text_batches": True}))
    assert needed_features(text_batches, pair_batch=False) == {"text_teachers"}
    assert needed_features(Objective.of(_cfg(**DALR)), pair_batch=False) == set()


@pytest.mark.parametrize(("extra", "added"), [({"loss.dalr.cml": True}, {"consistency", "cma"}),
                                                ({"loss.dalr.iml": True}, {"rank", "ima"})])
def test_kdmcse_combines_with_cml_and_iml(extra, added, device):
    e = _embeddings(8)
    plain = _step(device, _cfg(**{"train.method": "kdmcse"}), e)
    combo = _step(device, _cfg(**{"train.method": "kdmcse"}, **extra), e)
    assert set(combo) - set(plain) == added
    weight = 0.1 if "cma" in added else 0.2
    assert float(combo["loss"] - plain["loss"]) == pytest.approx(weight * sum(float(combo[t]) for t in added),
                                                                  abs=1e-9)


def test_mcseo_adds_beta_times_object_phrase_term(device):
    e = _embeddings(9)
    cfg = _cfg(**{"train.method": "mcseo", "loss.lambda_img": 0.01, "loss.mcseo.beta": 0.5})
    terms = _step(device, cfg, e)
    assert set(terms) == {"simcse", "image", "object", "loss"}
    # Eq. 7 by hand: each phrase against the objects of its own pair, summed per pair, mean over pairs
    per_pair: dict[int, float] = {}
    cos = torch.nn.functional.cosine_similarity
    for t in range(7):
        same = [u for u in range(7) if int(e.object_pair[u]) == int(e.object_pair[t])]
        den = sum(math.exp(float(cos(e.phrases[t], e.objects[u], dim=0)) / 0.05) for u in same)
        num = math.exp(float(cos(e.phrases[t], e.objects[t], dim=0)) / 0.05)
        per_pair[int(e.object_pair[t])] = per_pair.get(int(e.object_pair[t]), 0.0) - math.log(num / den)
    object_term = sum(per_pair.values()) / len(per_pair)
    assert float(terms["object"]) == pytest.approx(object_term, abs=1e-6)
    off = _step(device, with_overrides(cfg, {"loss.mcseo.object_phrase": False}), e)
    assert float(terms["loss"] - off["loss"]) == pytest.approx(0.5 * object_term, abs=1e-6)


def test_mcseo_image_caption_term_is_its_eq3_on_one_view_and_both_with_image_views_2(device):
    """MCSEO Eq. 3 encodes the caption once: α weighs one InfoNCE (KDMCSE's Eq. 3 sums two views)."""
    e = _embeddings(10)
    cfg = _cfg(**{"train.method": "mcseo", "loss.lambda_img": 0.01, "loss.mcseo.object_phrase": False})
    cos = torch.nn.functional.cosine_similarity

    def view(s):  # -log softmax over the batch's images at τ' = 0.05, mean over captions
        n = e.image.shape[0]
        return sum(-math.log(math.exp(float(cos(s[i], e.image[i], dim=0)) / 0.05)
                             / sum(math.exp(float(cos(s[i], e.image[j], dim=0)) / 0.05) for j in range(n)))
                   for i in range(n)) / n

    one = _step(device, cfg, e)
    assert float(one["image"]) == pytest.approx(view(e.s1), abs=1e-6)
    both = _step(device, with_overrides(cfg, {"loss.mcseo.image_views": 2}), e)
    assert float(both["image"]) == pytest.approx(view(e.s1) + view(e.s2), abs=1e-6)
    mcse = _step(device, _cfg(**{"train.method": "mcse", "loss.lambda_img": 0.01}), e)  # MCSE keeps both views
    assert float(mcse["image"]) == pytest.approx(float(both["image"]), abs=1e-9)
    assert float(one["loss"] - one["simcse"]) == pytest.approx(0.01 * view(e.s1), abs=1e-8)


def test_active_terms_resolve_auto_per_method():
    assert active_terms(Objective.of(_cfg(**{"train.method": "mcse"}))) == {
        "simcse": True, "mlm": False, "image": True, "clip_text": False, "kdmcse": False, "info": False,
        "consistency": False, "cma": False, "rank": False, "ima": False, "object": False}
    dalr = active_terms(Objective.of(_cfg(**DALR)))
    assert all(dalr[t] for t in ("info", "consistency", "cma", "rank", "ima")) and not dalr["image"]
    assert active_terms(Objective.of(_cfg(**{"train.method": "simcse", "loss.dalr.iml": True})))["rank"]
    # simcse trains on text only: the image-side terms stay off whatever their switches say
    assert not active_terms(Objective.of(_cfg(**{"train.method": "simcse", "loss.dalr.cml": True})))["cma"]


def _with_mlm(e: StepEmbeddings, seed: int = 12) -> StepEmbeddings:
    g = torch.Generator().manual_seed(seed)
    return dataclasses.replace(e, mlm_logits=torch.randn(9, 13, generator=g, dtype=torch.float64),
                               mlm_labels=torch.randint(13, (9,), generator=g))


@pytest.mark.parametrize("method", ["simcse", "mcse", "kdmcse", "dalr", "mcseo"])
@pytest.mark.parametrize("pair_batch", [True, False])
def test_mlm_adds_its_weight_times_the_masked_lm_loss_on_every_batch(method, pair_batch, device):
    """SimCSE App. E: ℓ + λ·ℓ^mlm; any sentence encoder, text and pair batches alike (KDMCSE's
    Algorithm 1 trains ℓ^KDMCSE alone on a pair batch, but the auxiliary term is not its text term)."""
    e = _with_mlm(_embeddings(14, pair_batch=pair_batch))
    cfg = _cfg(**{"train.method": method})
    plain = _step(device, cfg, e)
    mlm = _step(device, with_overrides(cfg, {"loss.simcse.mlm": True, "loss.simcse.mlm_weight": 0.3}), e)
    assert set(mlm) - set(plain) == {"mlm"}
    ce = sum(-float(torch.log_softmax(e.mlm_logits[m], 0)[e.mlm_labels[m]]) for m in range(9)) / 9
    assert float(mlm["mlm"]) == pytest.approx(ce, abs=1e-9)
    assert float(mlm["loss"] - plain["loss"]) == pytest.approx(0.3 * ce, abs=1e-9)
    # every token through the head, the unchosen ones' labels IGNORED (the one MLM path): the same ℓ^mlm
    ignored = torch.full((5,), IGNORED, dtype=e.mlm_labels.dtype)
    padded = dataclasses.replace(e, mlm_logits=torch.cat([e.mlm_logits, torch.randn(5, e.mlm_logits.shape[1],
                                                                                        dtype=e.mlm_logits.dtype)]),
                                 mlm_labels=torch.cat([e.mlm_labels, ignored]))
    again = _step(device, with_overrides(cfg, {"loss.simcse.mlm": True, "loss.simcse.mlm_weight": 0.3}), padded)
    assert float(again["mlm"]) == pytest.approx(ce, abs=1e-9)
    # no token chosen in a short batch: ℓ^mlm is 0, not 0/0, and nothing is added
    none = dataclasses.replace(e, mlm_labels=torch.full_like(e.mlm_labels, IGNORED))
    got = _step(device, with_overrides(cfg, {"loss.simcse.mlm": True}), none)
    assert float(got["mlm"]) == 0.0 and float(got["loss"]) == pytest.approx(float(plain["loss"]), abs=1e-12)


def test_mlm_is_off_for_retrieval_models():
    for method in ("duet", "vsepp"):
        assert not active_terms(Objective.of(_cfg(**{"train.method": method, "loss.simcse.mlm": True})))["mlm"]


def test_impossible_combinations_fail_at_load():
    from mmcse.config import ConfigError

    with pytest.raises(ConfigError, match="loss.dalr.text_batches"):
        parse_config({"loss": {"dalr": {"iml": False, "text_batches": True}}})
    with pytest.raises(ConfigError, match="loss.kdmcse.threshold"):
        parse_config({"loss": {"kdmcse": {"threshold": 1.5}}})
    with pytest.raises(ConfigError, match="valid keys under loss.dalr"):
        parse_config({"loss": {"dalr": {"lamda_cml": 0.1}}})
    with pytest.raises(ConfigError, match="loss.dalr.teacher_space.*teacher_weighting: embeddings"):
        parse_config({"loss": {"dalr": {"teacher_weighting": "similarities"}}})
    parse_config({"loss": {"dalr": {"teacher_weighting": "similarities", "teacher_space": "raw"}}})


def test_yaml_off_disables_the_threshold():
    import yaml

    raw = yaml.safe_load("loss:\n  kdmcse:\n    threshold: off\n")
    assert parse_config(raw).loss.kdmcse.threshold_value is None
    assert parse_config({"loss": {"kdmcse": {"threshold": "off"}}}).loss.kdmcse.threshold_value is None
    assert parse_config({"loss": {"kdmcse": {"threshold": 0}}}).loss.kdmcse.threshold_value == 0.0


def test_adapacse_zero_margin_is_infonce_inside_the_objective(device):
    e = _embeddings(10)
    cfg = _cfg(**{"train.method": "kdmcse", "loss.kdmcse.margin": 0.0, "loss.kdmcse.threshold": "off"})
    terms = _step(device, cfg, e)
    image = info_nce(e.s1, e.teacher_image, 0.05) + info_nce(e.s2, e.teacher_image, 0.05)
    assert float(terms["kdmcse_image"]) == pytest.approx(float(image), abs=1e-9)
    assert float(adapacse_loss(e.s1, e.teacher_image, 0.05)) == pytest.approx(
        float(info_nce(e.s1, e.teacher_image, 0.05)), abs=1e-9)


def test_mcse_plus_clip_text_adds_eq3_against_the_teacher_text_with_its_gradients(device):
    """KDMCSE Table 5's "MCSE + CLIP text": SimCSE + λ·Eq. 3 on the images + λ·Eq. 3 on g_φt(t̂),
    both dropout views, written out term by term; the gradients reach s1, s2 and g_φt(t̂)."""
    e = _embeddings(12)
    for name in ("s1", "s2", "teacher_text"):
        setattr(e, name, getattr(e, name).clone().requires_grad_(True))
    cfg = _cfg(**{"train.method": "mcse", "loss.lambda_img": 0.2, "loss.temperature_img": 0.1,
                  "loss.mcse.clip_text": True})
    terms = step_objective(Objective.of(cfg), e, 0)
    assert set(terms) == {"simcse", "image", "clip_text", "loss"}
    n = e.s1.shape[0]

    def eq3(s, targets):  # -log softmax over the batch's targets at τ' = 0.1, mean over captions
        cos = torch.nn.functional.cosine_similarity
        out = 0.0
        for i in range(n):
            logits = torch.stack([cos(s[i], targets[j], dim=0) / 0.1 for j in range(n)])
            out = out - torch.log(torch.exp(logits[i]) / torch.exp(logits).sum())
        return out / n

    clip_text = eq3(e.s1, e.teacher_text) + eq3(e.s2, e.teacher_text)
    image = eq3(e.s1, e.image) + eq3(e.s2, e.image)
    assert float(terms["clip_text"].detach()) == pytest.approx(float(clip_text.detach()), abs=1e-9)
    want = terms["simcse"] + 0.2 * (image + clip_text)
    assert float(terms["loss"].detach()) == pytest.approx(float(want.detach()), abs=1e-9)
    got = torch.autograd.grad(terms["loss"], [e.s1, e.s2, e.teacher_text])
    ref = torch.autograd.grad(want, [e.s1, e.s2, e.teacher_text])
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, atol=1e-9) and g.abs().sum() > 0
    for other in ({"loss.image_term": False}, {"train.method": "kdmcse"}):  # MCSE's term, with its image term
        cfg = _cfg(**{"train.method": "mcse", "loss.mcse.clip_text": True, **other})
        assert not active_terms(Objective.of(cfg))["clip_text"]


def _leaves(tree: dict, prefix: str = "loss") -> dict:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out |= _leaves(value, f"{prefix}.{name}")
        else:
            out[f"{prefix}.{name}"] = value
    return out


def _literal_choices(path: str) -> list:
    """The Literal values a loss parameter's type names (``loss.dalr.mismatch`` → random, roll, …)."""
    import typing

    from mmcse.config import LossConfig

    cls = LossConfig
    *sections, name = path.split(".")[1:]
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    found: list = []

    def walk(hint) -> None:
        if typing.get_origin(hint) is typing.Literal:
            found.extend(typing.get_args(hint))
            return
        for arg in typing.get_args(hint):
            walk(arg)

    walk(typing.get_type_hints(cls, include_extras=True)[name])
    return found


def _other_values(path: str, value) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1]
    if isinstance(value, float):
        return [value * 1.5 + 0.05]
    return [c for c in _literal_choices(path) if c != value]


SLOW = pytest.mark.slow  # ~2 s each; the fast tier keeps SimCSE (the case) and KDMCSE with DALR's terms


@pytest.mark.parametrize("overrides", [
    {"train.method": "simcse"}, pytest.param({"train.method": "simcse", "loss.simcse.mlm": True}, marks=SLOW),
    pytest.param({"train.method": "mcse"}, marks=SLOW),
    pytest.param({"train.method": "mcse", "loss.mcse.clip_text": True}, marks=SLOW),
    pytest.param({"train.method": "kdmcse"}, marks=SLOW),
    {"train.method": "kdmcse", "loss.dalr.cml": True, "loss.dalr.iml": True},
    pytest.param({"train.method": "kdmcse", "loss.kdmcse.text_batches": "angular_margin"}, marks=SLOW),
    pytest.param({"train.method": "dalr"}, marks=SLOW), pytest.param({"train.method": "mcseo"}, marks=SLOW)])
def test_a_loss_parameter_outside_objective_keys_changes_nothing_a_step_computes(overrides):
    """`objective_keys` (what an ablation job's identity keeps of ``loss``) is complete: every other loss
    parameter, set to each other valid value, leaves every term of both kinds of batch as it was."""
    from mmcse.config import ConfigError, to_dict
    from mmcse.methods.objectives import objective_keys

    cfg = _cfg(**overrides)
    keys = objective_keys(Objective.of(cfg))
    assert "loss.temperature" in keys and "loss.vsepp.margin" not in keys
    batches = [_with_mlm(_embeddings(pair_batch=True)), _with_mlm(_embeddings(pair_batch=False))]
    cpu = torch.device("cpu")
    reference = [_step(cpu, cfg, e) for e in batches]
    checked = 0
    for path, value in _leaves(to_dict(cfg.loss)).items():
        if path in keys:
            continue
        for other in _other_values(path, value):
            try:
                changed = with_overrides(cfg, {path: other})
            except ConfigError:
                continue
            for e, ref in zip(batches, reference, strict=True):
                got = _step(cpu, changed, e)
                assert got.keys() == ref.keys(), (path, other)
                assert all(torch.equal(got[k], ref[k]) for k in ref), (path, other)
            checked += 1
    assert checked >= 10


ORACLE_VARIANTS = [
    {"train.method": "simcse"}, {"train.method": "simcse", "loss.simcse.mlm": True},
    {"train.method": "mcse"}, {"train.method": "mcse", "loss.mcse.clip_text": True},
    {"train.method": "mcse", "loss.image_term": False},
    {"train.method": "kdmcse"}, {"train.method": "kdmcse", "loss.kdmcse.text_batches": "angular_margin"},
    {"train.method": "kdmcse", "loss.kdmcse.soft_labels": "projections", "loss.kdmcse.threshold": "off"},
    {"train.method": "kdmcse", "loss.kdmcse.pair_objective": "simcse_plus_kdmcse"},
    {"train.method": "kdmcse", "loss.dalr.cml": True, "loss.dalr.iml": True},
    {"train.method": "dalr"}, {"train.method": "dalr", "loss.dalr.teacher_space": "raw"},
    {"train.method": "dalr", "loss.dalr.info_margin": True, "loss.dalr.simcse_on_pairs": True},
    {"train.method": "dalr", "loss.dalr.text_batches": True, "loss.dalr.info_views": "mean"},
    {"train.method": "mcseo"}, {"train.method": "mcseo", "loss.mcseo.image_views": 2},
    {"train.method": "mcseo", "loss.mcseo.object_phrase": False},
]


@pytest.mark.parametrize("overrides", ORACLE_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_objective_keys_are_what_the_step_reads(overrides):
    """`objective_keys` reads the terms' declarations (`LossTerm.reads`), no tensor: it must name exactly the
    ``loss`` parameters the step reads when it runs both kinds of batch, recorded as they are read."""
    from mmcse.methods.objectives import INPUT_SETTINGS, _Recorded, needed_inputs, objective_keys

    o = Objective.of(_cfg(**overrides))
    seen: set[str] = set()
    recorded = Objective(o.method, _Recorded(o.loss, "loss", seen))
    on = active_terms(recorded)
    for pair_batch in (True, False):
        for name in needed_inputs(recorded, pair_batch, on):
            seen.update(INPUT_SETTINGS.get(name, ()))
        with torch.no_grad():
            step_objective(recorded, _with_mlm(_embeddings(pair_batch=pair_batch)), 0, on)
    assert objective_keys(o) == seen


def _configurations_running(term) -> list[Config]:
    """The configurations (each method's defaults, then `ORACLE_VARIANTS`) under which ``term`` is on."""
    candidates = [_cfg(**{"train.method": m}) for m in ("simcse", "mcse", "kdmcse", "dalr", "mcseo")]
    candidates += [_cfg(**v) for v in ORACLE_VARIANTS]
    return [c for c in candidates if term.active(Objective.of(c))]


def test_every_registered_term_reads_what_it_declares():
    """Every term in the registry, not a listed few: under each configuration that runs it, its function and its
    draw read exactly the ``loss`` parameters its declaration's ``reads`` names (recorded as they are read)."""
    from mmcse.methods.objectives import _Recorded
    from mmcse.methods.step import term_generator
    from mmcse.methods.terms import TERMS

    for term in TERMS:
        configurations = _configurations_running(term)
        assert configurations, f"loss term {term.name!r} runs under no method's defaults nor any ORACLE_VARIANTS row"
        for cfg in configurations:
            o = Objective.of(cfg)
            for pair_batch in (True, False):
                if not term.runs_on(o, pair_batch):
                    continue
                e = _with_mlm(_embeddings(pair_batch=pair_batch))
                seen: set[str] = set()
                recorded = Objective(o.method, _Recorded(o.loss, "loss", seen))
                draw = term.draw(recorded, e.z1.shape[0], term_generator(term, 0)) if term.draw else None
                with torch.no_grad():
                    term.compute(recorded, e, draw)
                assert seen == term.reads(o), (term.name, cfg.train.method, pair_batch)
