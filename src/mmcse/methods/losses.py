"""Contrastive objectives as functions of embeddings (so cached features plug in).

Equation numbers refer to the background section of the KDMCSE paper
(``shared/papers/kdmcse.txt`` §3.1), which restates SimCSE and MCSE.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmcse.models.precision import full_precision


def cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarities ``(N, M)`` of rows of ``a (N, d)`` and ``b (M, d)``.

    Always at least fp32, outside autocast and TF32: every loss divides these by a
    temperature as small as 0.05, which would turn bf16's rounding (~4e-3) into ~0.08 of
    logit noise. The matrices are (B, B), so full precision costs next to nothing."""
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    with full_precision(a.device):
        return F.normalize(a.to(dtype), dim=-1) @ F.normalize(b.to(dtype), dim=-1).T


def info_nce(anchors: torch.Tensor, candidates: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over i of -log softmax_j(sim(a_i, c_j)/τ)[i]: candidate i is the positive of anchor i."""
    logits = cosine_matrix(anchors, candidates) / temperature  # (N, N)
    targets = torch.arange(anchors.shape[0], device=anchors.device)
    return F.cross_entropy(logits, targets)


def simcse_loss(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """Unsupervised SimCSE, KDMCSE paper Eq. 1.

    ``z1, z2 (N, d)`` are the two dropout views h^z, h^z' of the same N sentences;
    the other sentences' second views are the negatives.
    """
    return info_nce(z1, z2, temperature)


IGNORED = -100  # a label cross-entropy skips: tokens the MLM objective did not choose


def mlm_draws(shape: tuple[int, ...], vocab: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """The random numbers of `mlm_masking` for ids of ``shape``, drawn on the CPU from ``generator`` (the same masks
    on every device; drawn ahead of a compiled step, which takes them as inputs): three uniform draws (chosen,
    replaced, randomised) and the random words below ``vocab``, in that order."""
    uniform = tuple(torch.rand(shape, generator=generator) for _ in range(3))
    return (*uniform, torch.randint(vocab, shape, generator=generator))


def mlm_masking(
    ids: torch.Tensor, special: torch.Tensor, mask_id: int, vocab: int, probability: float,
    generator: torch.Generator | None = None, draws: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of SimCSE's auxiliary MLM objective (SimCSE App. E; its train.py ``mask_tokens``,
    BERT's recipe): every token of ``ids (B, L)`` that is not in ``special (S,)`` (pads, [CLS],
    [SEP]) is chosen with ``probability``; of the chosen, 80 % become ``mask_id``, half of the rest a
    random id below ``vocab``, the rest stay. Returns the masked ids ``(B, L)`` and the labels
    ``(B, L)``: the original id where chosen, `IGNORED` elsewhere.

    The draws are ``draws`` (`mlm_draws`, made ahead) or made here from ``generator``; either way on the CPU
    (the same masks on every device), moved to ``ids``' device."""
    draws = draws if draws is not None else mlm_draws(tuple(ids.shape), vocab, generator)
    chosen_draw, replace_draw, random_draw, words = (t.to(ids.device, non_blocking=True) for t in draws)
    chosen = (chosen_draw < probability) & ~torch.isin(ids, special)  # (B, L)
    replaced = chosen & (replace_draw < 0.8)
    randomised = chosen & ~replaced & (random_draw < 0.5)
    masked = torch.where(replaced, torch.full_like(ids, mask_id), ids)
    masked = torch.where(randomised, words, masked)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORED))
    return masked, labels


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ℓ^mlm (SimCSE App. E): cross-entropy of the LM head's ``logits (T, V)`` against ``labels (T,)``, the original
    id at each of the M tokens the masking chose and `IGNORED` elsewhere, averaged over those M (0 when a batch
    chose none: no term rather than 0/0); at least fp32 (a softmax over a vocabulary of ~30k ids in bf16 would round
    away most of it)."""
    total = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels,
                            ignore_index=IGNORED, reduction="sum")
    return total / labels.ne(IGNORED).sum().clamp(min=1)


def mcse_image_loss(
    s1: torch.Tensor, s2: torch.Tensor, v: torch.Tensor, temperature: float, views: str = "sum"
) -> torch.Tensor:
    """MCSE's sentence–image objective, KDMCSE paper Eq. 3 (mean over the batch).

    ``s1, s2 (N, p)``: the projected dropout views s^z, s^z' (Eq. 2); ``v (N, p)``: the
    projected images. Eq. 3 sums the InfoNCE of both views against the images (``views="sum"``);
    MCSE's released code averages them (``"mean"``: uds-lsv/MCSE src/model.py ``compute_loss``).
    """
    total = info_nce(s1, v, temperature) + info_nce(s2, v, temperature)
    if views == "sum":
        return total
    if views == "mean":
        return total / 2.0
    raise ValueError(f"loss.mcse.image_views: {views!r}; choose sum or mean")


def mcseo_image_caption_loss(h_cap: torch.Tensor, h_img: torch.Tensor, temperature: float) -> torch.Tensor:
    """MCSEO's sentence–image objective l^img-cap, mcseo.txt Eq. 3 (mean over the batch).

    ``h_cap (N, p)``: one projected caption embedding each (one dropout view: Eq. 2 encodes the
    caption once); ``h_img (N, p)``: the projected images; image i is caption i's positive, the batch's
    other images its negatives, at temperature τ'. Unlike `mcse_image_loss` (KDMCSE Eq. 3) no second
    view is added, so α weighs one InfoNCE, not two."""
    return info_nce(h_cap, h_img, temperature)


# --------------------------------------------------------------------------- KDMCSE


def safe_arccos(cos: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """arccos with the input clamped inside (-1, 1): the derivative -1/sqrt(1-x²) is
    infinite at ±1, so identical (θ = 0) or opposite (θ = π) vectors would give NaN gradients."""
    return torch.arccos(cos.clamp(-1.0 + eps, 1.0 - eps))


def threshold_keep_mask(teacher_sim: torch.Tensor, threshold: float | None, drops: str) -> torch.Tensor:
    """KDMCSE Threshold Filtering, paper Eq. 8: φ_ij, as a bool ``(N, N)`` mask of the kept terms.

    ``teacher_sim (N, N)`` holds α_ij. ``drops="below"`` is Eq. 8 as typeset (φ = 0 where α_ij <
    threshold: only negatives at least as similar as the threshold stay); ``"above"`` drops negative j of
    anchor i when α_ij is *above* ``threshold`` (a likely false negative), as §6.2's prose and the authors'
    train_mix.py (−99999.99 added where the score exceeds ``score_base``). The positive (diagonal) is always
    kept; ``threshold=None`` keeps everything.
    """
    keep = torch.ones_like(teacher_sim, dtype=torch.bool)
    if threshold is not None:
        if drops == "above":
            keep = teacher_sim <= threshold
        elif drops == "below":
            keep = teacher_sim >= threshold
        else:
            raise ValueError(f"loss.kdmcse.threshold_drops: {drops!r}; choose below or above")
    return keep | torch.eye(teacher_sim.shape[0], dtype=torch.bool, device=teacher_sim.device)


def angular_margin_cosines(
    anchors: torch.Tensor, targets: torch.Tensor, margin: float, margin_sim: torch.Tensor | None,
    beyond_margin: bool = False,
) -> torch.Tensor:
    """The cosines of KDMCSE Eq. 12 before τ ``(N, N)``: cos θ_ii on the diagonal (the positives), cos(θ_ij − m·Δ_ij)
    for j ≠ i, Δ_ij = |1 − α_ij| from ``margin_sim (N, N)`` (all zeros: Δ = 1, a constant margin m, ArcCSE's form;
    None: no shift). ``beyond_margin`` shifts only the negatives whose angle θ_ij exceeds m (the authors'
    ArcSimilarity.calculate_arccos2, KDMCSE src/model.py l.78–90 and DALR src/model_modified.py l.80–92; Eq. 12
    shifts every negative)."""
    theta = safe_arccos(cosine_matrix(anchors, targets))  # (N, N)
    eye = torch.eye(theta.shape[0], theta.shape[1], dtype=torch.bool, device=theta.device)
    if margin and margin_sim is None:
        raise ValueError("an adaptive margin needs the teacher similarities margin_sim")
    delta = (1.0 - margin_sim).abs() if margin_sim is not None else torch.zeros_like(theta)  # (N, N)
    unshifted = eye | (theta <= margin) if beyond_margin else eye  # (N, N)
    return torch.cos(torch.where(unshifted, theta, theta - margin * delta))


def adapacse_loss(
    anchors: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    margin: float = 0.0,
    margin_sim: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    beyond_margin: bool = False,
) -> torch.Tensor:
    """AdapACSE with Threshold Filtering, KDMCSE paper Eq. 12–13 (mean over anchors).

    ``anchors, targets (N, p)``: target i is the positive of anchor i. The positive
    logit is cos(θ_ii)/τ; negative j gets cos(θ_ij − m·Δ_ij)/τ with Δ_ij = |1 − α_ij|
    from ``margin_sim (N, N)`` (α; `angular_margin_cosines`, ``beyond_margin`` the code's gate); ``keep (N, N)``
    removes filtered negatives (Eq. 13's φ). With ``margin=0`` and no filtering this is InfoNCE.
    """
    logits = angular_margin_cosines(anchors, targets, margin, margin_sim, beyond_margin) / temperature  # (N, N)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return (torch.logsumexp(logits, dim=1) - logits.diagonal()).mean()


def kdmcse_term(
    s1: torch.Tensor,
    s2: torch.Tensor,
    teacher_proj: torch.Tensor,
    temperature: float,
    margin: float,
    margin_sim: torch.Tensor | None,
    keep: torch.Tensor | None,
    beyond_margin: bool = False,
) -> torch.Tensor:
    """ℓ^{m'} of one modality m: Eq. 13 applied to both dropout views s^z, s^z' and summed,
    as Eq. 9 sums over z (``teacher_proj (N, p)`` = g_φm of the cached CLIP features)."""
    return sum(adapacse_loss(s, teacher_proj, temperature, margin, margin_sim, keep, beyond_margin)
               for s in (s1, s2))


def kdmcse_soft_labels(text: torch.Tensor, image: torch.Tensor) -> dict[str, torch.Tensor]:
    """KDMCSE's soft labels, kdmcse.txt Eq. 7 and App. D Algorithm 1 (``tt_score``, ``tv_score``): the
    cosines α^{t,v}_{ij} = cos(t_i, v_j), α^{t,t}_{ij} = cos(t_i, t_j) and α^{v,v}_{ij} = cos(v_i, v_j)
    ``(N, N)`` of the caption features ``text (N, k)`` and image features ``image (N, k)``. Eq. 7 and
    kdmcse-2.txt's Algorithm 1 (``tt_score``, ``tv_score``) take them on the raw CLIP t̂, v̂
    (`loss.kdmcse.soft_labels: clip`); ``projections`` passes g_φt(t̂), g_φv(v̂) instead. They are labels
    (threshold filtering, Eq. 8, and the margin's Δ), so no gradient flows through them: the algorithm
    computes them as scores, and the paper is silent on gradients."""
    with torch.no_grad():
        return {"tv": cosine_matrix(text, image), "tt": cosine_matrix(text, text), "vv": cosine_matrix(image, image)}


def kdmcse_objective(image_term: torch.Tensor, text_term: torch.Tensor) -> torch.Tensor:
    """KDMCSE paper Eq. 14: the mean of the visual and textual AdapACSE terms."""
    return (image_term + text_term) / 2.0


# --------------------------------------------------------------------------- DALR


AUTHORS_ROLL = 5  # DALR's src/model_modified.py prepare_data: image.roll(shifts=5, dims=0)


def mismatch_permutation(n: int, mode: str = "derangement", generator: torch.Generator | None = None) -> torch.Tensor:
    """Image index paired with each text to build DALR's mismatched pairs D' (§3.2).

    ``generator`` must be a CPU generator. ``derangement``: a uniformly random permutation
    with no fixed point (rejection sampling); ``roll``: the authors' code's cyclic shift of the images
    by 5 (src/model_modified.py l.495, ``roll(shifts=5)``), by 1 where 5 is a multiple of ``n`` (a
    batch of 5: the code's shift would pair every caption with its own image). ``(n,)`` long tensor.
    """
    if n < 2:
        raise ValueError("mismatched pairs need a batch of at least 2")
    if mode == "roll":
        return torch.roll(torch.arange(n), AUTHORS_ROLL % n or 1)
    if mode != "derangement":
        raise ValueError(f"unknown mismatch mode {mode!r}; modes: derangement, roll")
    # Drawn on the host (a CPU generator): the same seed gives the same pairs whatever device
    # trains, and the rejection test is no device sync. The caller moves it (non-blocking).
    while True:
        perm = torch.randperm(n, generator=generator, device="cpu")
        if not (perm == torch.arange(n)).any():
            return perm


def consistency_loss(
    text_shared: torch.Tensor, image_shared: torch.Tensor, mismatch: torch.Tensor, margin: float = 0.2
) -> torch.Tensor:
    """DALR cross-modal consistency, paper Eq. 5 (cosine-embedding loss, mean over 2N pairs).

    ``text_shared, image_shared (N, p)``: the shared-space projections of aligned pairs
    (label 1: 1 − cos); image ``mismatch[i]`` with text i is a mismatched pair (label 0:
    max(0, cos − m)).
    """
    aligned = 1.0 - F.cosine_similarity(text_shared, image_shared, dim=-1)  # (N,)
    wrong = (F.cosine_similarity(text_shared, image_shared[mismatch], dim=-1) - margin).clamp_min(0.0)  # (N,)
    return torch.cat([aligned, wrong]).mean()


def _kl_rows(target_logits: torch.Tensor, pred_logits: torch.Tensor) -> torch.Tensor:
    """Σ_i KL(softmax(target_i) ‖ softmax(pred_i)) / N for ``(N, N)`` logits."""
    return F.kl_div(F.log_softmax(pred_logits, -1), F.log_softmax(target_logits, -1), log_target=True,
                    reduction="batchmean")


def cross_modal_alignment_loss(
    text_image: torch.Tensor,
    teacher_text_sim: torch.Tensor,
    teacher_image_sim: torch.Tensor,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    pairing: str = "eq8",
) -> torch.Tensor:
    """DALR L_CMA, paper Eq. 6–8 (mean over the batch instead of the printed sum).

    ``text_image (N_txt, N_img)``: the student's sim(s_j, h^v_i) at [j, i]; ``teacher_text_sim``,
    ``teacher_image_sim (N, N)``: the teachers' self-similarities behind Q^{t2t}, Q^{v2v} (softmaxed with τ_t).
    ``pairing="eq8"``: P^{t2v}_i = softmax_j sim(s_j, h^v_i)/τ_s (image i over the texts) against Q^{t2t}_i and
    (P^{t2v})^T, read as the softmax of the transposed similarities (text i over the images), against Q^{v2v}_i,
    as Eq. 8 prints; ``"by_rows"``: each text's distribution over the images against Q^{t2t}, each image's over
    the texts against Q^{v2v} (the authors' src/model_modified.py l.748–750). With both temperatures 1 this is the
    paper as printed."""
    p_text = text_image / student_temperature  # (N_txt, N_img): row j = text j over the images
    q_tt = teacher_text_sim / teacher_temperature
    q_vv = teacher_image_sim / teacher_temperature
    if pairing == "eq8":
        return 0.5 * (_kl_rows(q_tt, p_text.T) + _kl_rows(q_vv, p_text))
    if pairing == "by_rows":
        return 0.5 * (_kl_rows(q_tt, p_text) + _kl_rows(q_vv, p_text.T))
    raise ValueError(f"loss.dalr.cma_pairing: {pairing!r}; choose eq8 or by_rows")


def intra_modal_alignment_loss(
    student_sim: torch.Tensor,
    teacher_sim: torch.Tensor,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
) -> torch.Tensor:
    """DALR L_IMA, paper Eq. 11–12: KL(Q^{t2t}_i ‖ P^{t2t}_i), mean over i.

    P^{t2t}_i = softmax_j sim(s^z_i, s^{z'}_j)/τ_s of the student's view-to-view similarities ``student_sim (N, N)``;
    ``teacher_sim (N, N)`` is the (possibly multi-teacher) teacher cosine matrix.
    """
    return _kl_rows(teacher_sim / teacher_temperature, student_sim / student_temperature)


def tie_order(m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The random order ``(m,)`` in which `teacher_rankings` breaks ties, drawn on the host from a CPU generator,
    so that the same seed ranks alike on every device (and a compiled step takes it as an input)."""
    return torch.randperm(m, generator=generator, device="cpu")


def teacher_rankings(
    teacher_sim: torch.Tensor, generator: torch.Generator | None = None, include_diagonal: bool = True,
    ties: torch.Tensor | None = None,
) -> torch.Tensor:
    """π^T per row: column indices by descending teacher score, ties in a seeded random order.

    The order is ``ties`` (`tie_order`, drawn ahead) or drawn here from ``generator``, a CPU generator (the
    draw is device-independent). Returns ``(N, M)`` (``(N, M-1)`` without the diagonal, RankCSE includes it).
    """
    n, m = teacher_sim.shape
    device = teacher_sim.device
    # only the (M,) permutation is copied over
    shuffle = (ties if ties is not None else tie_order(m, generator)).to(device, non_blocking=True)  # (M,)
    order = shuffle[torch.argsort(teacher_sim[:, shuffle], dim=1, descending=True, stable=True)]  # (N, M)
    if include_diagonal:
        return order
    # Drop each row's own index without boolean indexing (a host sync): a stable sort moves the
    # one diagonal entry per row to the end, keeping the others in ranking order.
    is_self = (order == torch.arange(n, device=device).unsqueeze(1)).to(torch.uint8)  # (N, M)
    keep = torch.argsort(is_self, dim=1, stable=True)[:, : m - 1]  # (N, M-1)
    return order.gather(1, keep)


def listmle_loss(student_scores: torch.Tensor, ranking: torch.Tensor, temperature: float = 1.0,
                 eps: float = 0.0) -> torch.Tensor:
    """ListMLE, DALR paper Eq. 10 (mean over lists instead of the printed sum).

    −Σ_j [S_{π(j)}/τ − log Σ_{k≥j} exp(S_{π(k)}/τ)] for each row of ``student_scores (N, M)``
    ordered by ``ranking (N, L)`` (teacher order, L ≤ M). ``eps`` > 0 is the authors' ListMLE
    (src/model_modified.py l.206–212): each row shifted by its maximum, then log(Σ_{k≥j} exp(·) + ε), which
    no longer cancels the shift: the list's low tail, exp(·) ≪ ε, adds log ε − x.
    """
    ordered = student_scores.gather(1, ranking) / temperature  # (N, L)
    if eps:
        ordered = ordered - ordered.max(dim=1, keepdim=True).values  # (N, L), as the code (the gradient too)
    # log Σ_{k≥j} exp(x_k): a reversed cumulative logsumexp
    tail = torch.logcumsumexp(ordered.flip(1), dim=1).flip(1)
    if eps:
        tail = torch.logaddexp(tail, torch.full_like(tail, math.log(eps)))  # log(Σ exp + ε)
    return (tail - ordered).sum(1).mean()


def weighted_teacher_similarity(features: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """A weighted sum of the text teachers' cosine matrices, Σ_k w_k · cos(F_k, F_k) ``(N, N)``
    (``loss.dalr.teacher_weighting: similarities``, mmcse's earlier reading; teachers of any width)."""
    if len(features) != len(weights) or not features:
        raise ValueError("need one weight per teacher feature matrix")
    return sum(w * cosine_matrix(f, f) for f, w in zip(features, weights, strict=True))


def aggregated_teacher_embedding(features: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """DALR's multi-teacher text representation (dalr.txt §3.3 and App. B 'Teacher Text Model': "a
    weighted combination of [CLS] token embeddings yielding the final representation"): the teachers'
    embeddings ``F_k (N, d)`` summed with their weights, f_t = Σ_k w_k F_k ``(N, d)``. The paper does not
    say whether F_k are normalised first: they are used as cached (the cache stores unit vectors). The
    teachers must share a width."""
    if len(features) != len(weights) or not features:
        raise ValueError("need one weight per teacher feature matrix")
    widths = sorted({f.shape[-1] for f in features})
    if len(widths) > 1:
        raise ValueError(f"teachers.text: embeddings of widths {widths} cannot be aggregated (DALR App. B); use "
                         "teachers of one width, or loss.dalr.teacher_weighting: similarities")
    return sum(w * f for f, w in zip(features, weights, strict=True))  # (N, d)


def aggregated_teacher_similarity(features: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """cos(f_t, f_t) ``(N, N)`` of DALR's aggregated text teacher (`aggregated_teacher_embedding`): the
    teacher's own similarity lists, before any projection."""
    aggregated = aggregated_teacher_embedding(features, weights)  # (N, d)
    return cosine_matrix(aggregated, aggregated)


def text_teacher_similarity(features: list[torch.Tensor], weights: list[float], weighting: str) -> torch.Tensor:
    """The text teachers' similarity ``(N, N)`` by ``loss.dalr.teacher_weighting``: ``embeddings``
    (`aggregated_teacher_similarity`, the paper's) or ``similarities`` (`weighted_teacher_similarity`)."""
    if weighting == "embeddings":
        return aggregated_teacher_similarity(features, weights)
    if weighting == "similarities":
        return weighted_teacher_similarity(features, weights)
    raise ValueError(f"loss.dalr.teacher_weighting: {weighting!r}; choose embeddings or similarities")


# --------------------------------------------------------------------------- MCSEO


def object_phrase_loss(
    phrases: torch.Tensor, objects: torch.Tensor, pair_index: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MCSEO l^{obj-phra}, paper Eq. 7: InfoNCE of each phrase against the K objects of its
    own image–caption pair only; summed over a pair's phrases, mean over pairs.

    ``phrases, objects (T, p)``: row t of each is the t-th object–phrase pair of the batch;
    ``pair_index (T,)`` says which image–caption pair it belongs to.
    """
    logits = cosine_matrix(phrases, objects) / temperature  # (T, T)
    same_pair = pair_index.unsqueeze(0) == pair_index.unsqueeze(1)  # (T, T)
    logits = logits.masked_fill(~same_pair, float("-inf"))
    per_phrase = torch.logsumexp(logits, 1) - logits.diagonal()  # (T,)
    # mean over pairs of each pair's sum = Σ_t loss_t / #pairs, and #pairs = Σ_t 1/|pair(t)|:
    # no torch.unique, whose output size would need a host sync.
    n_pairs = (1.0 / same_pair.sum(1).to(per_phrase.dtype)).sum()  # scalar
    return per_phrase.sum() / n_pairs


def span_mean(hidden: torch.Tensor, row: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """MCSEO phrase embedding: mean of ``hidden (B, L, H)`` over tokens [start, end) of sentence
    ``row`` — the full-sentence forward pass, no re-encoding. Returns ``(T, H)``."""
    length = hidden.shape[1]
    if (start.device.type == "cpu" and not torch.compiler.is_compiling()
            and not bool(((start < end) & (start < length)).all())):
        # checked where the spans live on the host (a compiled step does not read values: no graph break);
        # training checks them when it loads objects.jsonl
        raise ValueError("every phrase span needs at least one token")
    positions = torch.arange(length, device=hidden.device)  # (L,)
    mask = (positions >= start.unsqueeze(1)) & (positions < end.unsqueeze(1))  # (T, L)
    tokens = hidden[row]  # (T, L, H)
    return (tokens * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
