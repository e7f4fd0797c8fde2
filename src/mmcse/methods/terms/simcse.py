"""The text term every sentence encoder trains on, SimCSE's InfoNCE between two dropout views (KDMCSE Eq. 1), and
SimCSE's auxiliary masked-language-modelling term (SimCSE App. E), with its section ``loss.simcse``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from mmcse.config.declared import SECTION, Bool, NonNegative
from mmcse.config.training import RETRIEVAL_METHODS
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, always, loss_section, need, register

if TYPE_CHECKING:
    import torch


@loss_section("simcse", "SimCSE's auxiliary MLM objective (SimCSE App. E, \"w/ MLM\"), any sentence encoder")
@dataclass(frozen=True)
class SimCSELossConfig:
    __pydantic_config__ = SECTION
    # SimCSE's auxiliary masked-language-modelling objective (SimCSE App. E, "w/ MLM"): ℓ + λ·ℓ^mlm on every
    # batch of any sentence encoder; princeton-nlp/SimCSE train.py: --do_mlm, --mlm_weight 0.1,
    # --mlm_probability 0.15 (BERT's 80 % [MASK] / 10 % random / 10 % kept)
    mlm: Bool = False
    """+ λ_mlm·ℓ^mlm on every batch"""
    mlm_weight: NonNegative = 0.1
    """λ_mlm (SimCSE train.py --mlm_weight)"""
    mlm_probability: Annotated[float, Field(gt=0, lt=1)] = 0.15
    """share of tokens masked: 80 % [MASK], 10 % random, 10 % kept"""
    mlm_head: Literal["pretrained", "new"] = "pretrained"
    """the LM head: the checkpoint's own (a new one where it has none) | new: fresh weights, as SimCSE's BertForCL
    (its lm_head is not a key of bert-base's checkpoint; RobertaForCL loads roberta's)"""


def text_reads(o: Objective) -> set[str]:
    """The text term's parameters: τ; for kdmcse its ``text_batches`` and, with ``angular_margin``, the margin
    and its gate; for dalr the student margin (and its gate)."""
    if o.method == "dalr":
        gate = {"loss.kdmcse.margin_gate"} if o.loss.dalr.student_margin else set()
        return {"loss.temperature", "loss.dalr.student_margin"} | gate
    if o.method != "kdmcse":
        return {"loss.temperature"}
    margin = ({"loss.kdmcse.text_margin", "loss.kdmcse.margin_gate"}
              if o.loss.kdmcse.text_batches == "angular_margin" else set())
    return {"loss.temperature", "loss.kdmcse.text_batches"} | margin


def text_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """SimCSE (KDMCSE Eq. 1) on every batch (but DALR's image–caption batches, as printed); for kdmcse
    with ``text_batches: angular_margin``, a constant angular margin on every negative (AdapACSE, Eq. 12,
    with Δ = 1) wherever the term runs: the authors' MCSE.compute_loss scores every batch's SimCSE
    term with the same ArcSimilarity (text batches, and pair batches under ``simcse_plus_kdmcse``), gated as
    ``margin_gate`` says; for dalr, ``loss.dalr.student_margin`` (the authors' ArcSimilarity(τ, MARGIN1))."""
    import torch

    from mmcse.methods.losses import adapacse_loss, simcse_loss

    k = o.loss.kdmcse
    margin = (k.text_margin if o.method == "kdmcse" and k.text_batches == "angular_margin"
              else o.loss.dalr.student_margin if o.method == "dalr" else 0.0)
    if margin:
        none_similar = torch.zeros(e.z1.shape[0], e.z1.shape[0], dtype=e.z1.dtype, device=e.z1.device)
        return adapacse_loss(e.z1, e.z2, o.loss.temperature, margin, margin_sim=none_similar,
                             beyond_margin=k.margin_gate == "beyond_margin")
    return simcse_loss(e.z1, e.z2, o.loss.temperature)


register(LossTerm(
    name="simcse", equation="SimCSE (KDMCSE Eq. 1)", order=0, weight=None,
    # DUET and VSE++ are retrieval models: their losses are loss.duet's (Eq. 33) / loss.vsepp's
    active=lambda o: o.method not in RETRIEVAL_METHODS,
    inputs=lambda o: {"z"}, reads=text_reads, on_text=always, yields_to_alone=True,
    # DALR's Eq. 14 trains image–caption batches without it, as printed; its authors' code keeps it
    on_pairs=lambda o: o.method != "dalr" or bool(o.loss.dalr.simcse_on_pairs),
    compute=text_term,
))


def mlm_on(o: Objective) -> bool:
    return o.method not in RETRIEVAL_METHODS and bool(o.loss.simcse.mlm)


def mlm_term(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """SimCSE's auxiliary MLM loss ℓ^mlm (SimCSE App. E) on the tokens the step masked."""
    from mmcse.methods.losses import masked_lm_loss

    return masked_lm_loss(need(e.mlm_logits, "mlm_logits", "mlm"), need(e.mlm_labels, "mlm_labels", "mlm"))


# its stream draws the step's masks (`mmcse.training.loop.step_draws`: the encoder pass needs them), which the term
# then scores
MLM = LossTerm(
    name="mlm", equation="SimCSE ℓ + λ·ℓ^mlm (SimCSE App. E)", order=5, weight="loss.simcse.mlm_weight",
    active=mlm_on, inputs=lambda o: {"mlm"}, on_pairs=always, on_text=always, stream=3, compute=mlm_term,
)
register(MLM)
