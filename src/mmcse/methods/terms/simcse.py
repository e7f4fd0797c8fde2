"""The text term every sentence encoder trains on, SimCSE's InfoNCE between two dropout views, and
SimCSE's auxiliary masked-language-modelling term (their functions: `mmcse.methods.compute.simcse`)."""

from __future__ import annotations

from mmcse.config import RETRIEVAL_METHODS
from mmcse.methods.terms.base import LossTerm, Objective, register


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


register(LossTerm(
    name="simcse", equation="SimCSE (KDMCSE Eq. 1)", order=0,
    # DUET and VSE++ are retrieval models: their losses are loss.duet's (Eq. 33) / loss.vsepp's
    active=lambda o: o.method not in RETRIEVAL_METHODS,
    inputs=lambda o: {"z"}, reads=text_reads, on_text=lambda o: True, yields_to_alone=True,
    # DALR's Eq. 14 trains image–caption batches without it, as printed; its authors' code keeps it
    on_pairs=lambda o: o.method != "dalr" or bool(o.loss.dalr.simcse_on_pairs),
))


def mlm_on(o: Objective) -> bool:
    return o.method not in RETRIEVAL_METHODS and bool(o.loss.simcse.mlm)


# its stream draws the step's masks (mmcse.training.loop), which the term then scores
MLM = LossTerm(
    name="mlm", equation="SimCSE ℓ + λ·ℓ^mlm (SimCSE App. E)", order=5, weight="loss.simcse.mlm_weight",
    active=mlm_on, inputs=lambda o: {"mlm"}, on_text=lambda o: True, stream=3,
    # a short batch may draw no token: nothing to score
    applies=lambda e: e.mlm_labels is None or e.mlm_labels.numel() > 0,
)
register(MLM)
