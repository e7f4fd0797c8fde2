"""VSRN's objective (Li et al., ICCV 2019, §3.4): L = L_M + L_G, the matching loss L_M — VSE++'s
max-violation hinge summed over the batch (`mmcse.methods.duet.max_violation_hinge`, the same
function as VSE++ Eq. 5 and DUET Eq. 28–29) — plus the caption generation loss L_G, the negative
log-likelihood of each caption's words given its image's reasoned regions. As the authors' code
computes it (``model.py`` ``train_emb``, ``misc/utils.py`` ``LanguageModelCriterion``, ``data.py``
``PrecompDataset``): the masked NLL summed over the batch's target words and divided by the batch
size. The model is :mod:`mmcse.models.vsrn`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmcse.methods.duet import max_violation_hinge


def caption_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_len: int, end_id: int,
                    pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher forcing of VSRN's caption generator, as the authors' ``data.py`` builds it: ``(inputs
    (B, T), targets (B, T), mask (B, T))`` from captions ``<start> w_1 … w_k <end>`` (``input_ids``,
    ``attention_mask`` (B, L); their length l = k + 2).

    A caption longer than ``max_len`` tokens is cut to ``max_len`` with ``<end>`` last. Step t reads
    token c_t and predicts c_{t+1}; the targets counted are c_1 … c_m with m = min(l, max_len − 1):
    the words, ``<end>``, and — where the caption is shorter than that — the ``<pad>`` after
    ``<end>`` (the code's mask reaches one position past ``<end>``). T is the batch's largest m:
    the code decodes max_len − 1 steps, and the steps after a caption's last counted target change
    nothing it is scored on."""
    B = input_ids.shape[0]
    lengths = attention_mask.sum(1)  # (B,) l
    ids = input_ids.masked_fill(attention_mask == 0, pad_id)[:, :max_len]  # (B, ≤ max_len)
    if ids.shape[1] == max_len:  # a caption may be longer: its last kept token becomes <end> (no host sync)
        cut = (lengths > max_len)[:, None] & (torch.arange(max_len, device=ids.device) == max_len - 1)[None, :]
        ids = ids.masked_fill(cut, end_id)
    counted = lengths.clamp(max=max_len - 1)  # (B,) m
    T = int(counted.max())  # the step's one host sync: the decoder's number of steps
    if ids.shape[1] < T + 1:  # room for the <pad> target after the longest caption's <end>
        ids = F.pad(ids, (0, T + 1 - ids.shape[1]), value=pad_id)
    steps = torch.arange(1, T + 1, device=ids.device)  # (T,) the target positions 1..T
    mask = (steps[None, :] <= counted[:, None]).to(torch.float32)  # (B, T)
    assert mask.shape == (B, T)
    return ids[:, :T], ids[:, 1 : T + 1], mask


def caption_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L_G: −Σ log p(target) over the counted steps of every caption, divided by the batch size B
    (``LanguageModelCriterion``); ``logits (B, T, vocab)``, ``targets``, ``mask (B, T)``."""
    B, T, V = logits.shape
    # at least fp32: a log-softmax over the vocabulary in bf16 loses the small probabilities
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), reduction="none")  # (B·T,)
    return (nll * mask.reshape(B * T).to(nll.dtype)).sum() / B


def vsrn_objective(v_img: torch.Tensor, v_txt: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                   mask: torch.Tensor, margin: float = 0.2, caption_weight: float = 1.0,
                   ignore: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """L = L_M + caption_weight · L_G (§3.4; the code adds them with weight 1): ``{"hinge", "caption",
    "loss"}``. ``v_img``, ``v_txt`` (B, d) unit rows; ``ignore`` (B, B) as `max_violation_hinge`'s."""
    hinge = max_violation_hinge(v_img, v_txt, margin=margin, reduction="sum", ignore=ignore)
    caption = caption_loss(logits, targets, mask)
    return {"hinge": hinge, "caption": caption, "loss": hinge + caption_weight * caption}
