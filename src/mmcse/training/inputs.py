"""The student outputs a loss term may read (`mmcse.methods.terms.base.INPUT_FEATURES`), each made by one producer
from the step's encoder pass and the batch's cached features: the step runs the producers of exactly the inputs its
running terms ask for (`mmcse.methods.objectives.needed_inputs`), in this table's order, and nothing else.

A term that reads a new input adds its name to ``INPUT_FEATURES`` (with the cached feature group it comes from) and
its producer here; `tests/training/test_inputs.py` holds the two tables to each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmcse.methods.losses import aggregated_teacher_embedding, mlm_masking, span_mean, text_teacher_similarity
from mmcse.methods.terms import Objective, StepEmbeddings
from mmcse.models.student import Student
from mmcse.training.batches import BatchFeatures
from mmcse.training.gradcache import TokenEncoder


@dataclass
class StepPass:
    """What the producers read: the step's encoder pass over both dropout views of the batch's ``n`` sentences and
    the batch's cached features (only the groups its terms need are loaded)."""

    student: Student
    o: Objective
    ids: torch.Tensor  # (B, L) token ids
    mask: torch.Tensor  # (B, L) attention mask
    rows: torch.Tensor  # (2B,) the dropout key of each row of the doubled batch
    tokens: torch.Tensor  # (2B, L, H) last-layer token states, view z then view z'
    feats: BatchFeatures
    encode: TokenEncoder
    draws: dict[str, Any]

    @property
    def n(self) -> int:
        return self.ids.shape[0]

    @property
    def cls(self) -> torch.Tensor:
        return self.tokens[:, 0]  # (2B, H)


def _mlm(p: StepPass, e: StepEmbeddings) -> None:
    """SimCSE's MLM (App. E; its train.py ``mask_tokens`` masks each of the two copies of a sentence on its own):
    the LM head on every token of the masked copies, the unchosen tokens' labels `IGNORED` (so the shapes do not
    depend on the draw: one path eager and compiled, as the authors' BertForCL runs its head on every token)."""
    head = p.student.mlm_head
    if head is None:
        raise ValueError("loss.simcse.mlm is on, but the student was built without its LM head (load_mlm_head)")
    masked, labels = mlm_masking(p.ids.repeat(2, 1), head.special_ids, head.mask_id, head.vocab,
                                 p.o.loss.simcse.mlm_probability, draws=p.draws["mlm"])  # (2B, L) each
    states = p.encode(masked, p.mask.repeat(2, 1), p.rows + 2 * p.n)  # (2B, L, H): dropout keys of their own
    e.mlm_logits, e.mlm_labels = head(states.flatten(0, 1)), labels.flatten()  # (2B·L, V), (2B·L,)


def _s(p: StepPass, e: StepEmbeddings) -> None:
    s = p.student.text_proj(p.cls)  # (2B, p): g_φ1 on [CLS] (MCSE Eq. 2)
    e.s1, e.s2 = s[: p.n], s[p.n :]


def _shared_text(p: StepPass, e: StepEmbeddings) -> None:
    # L_cons's sentence: f_θ's [CLS] (DALR §3.2) or the SimCSE space z (the authors' code)
    sentence = p.cls[: p.n] if p.o.loss.dalr.consistency_text == "encoder" else e.z1  # (B, H)
    e.shared_text = p.student.shared_text(sentence)  # (B, p)


def _text_teacher_sim(p: StepPass, e: StepEmbeddings) -> None:
    with torch.no_grad():
        e.text_teacher_sim = text_teacher_similarity(p.feats.text_teachers, p.feats.text_weights,
                                                     p.o.loss.dalr.teacher_weighting)  # (B, B)


def _rank_teacher_sim(p: StepPass, e: StepEmbeddings) -> None:
    d = p.o.loss.dalr
    if d.rank_teacher_weighting == d.teacher_weighting and e.text_teacher_sim is not None:
        e.rank_teacher_sim = e.text_teacher_sim  # the same scores: computed once
        return
    with torch.no_grad():
        e.rank_teacher_sim = text_teacher_similarity(p.feats.text_teachers, p.feats.text_weights,
                                                     d.rank_teacher_weighting)  # (B, B)


def _text_teacher(p: StepPass, e: StepEmbeddings) -> None:
    # DALR h^t = g_φt(f_t(t)) (Eq. 3): one projected text teacher for L_CMA's and L_IMA's Q^{t2t}
    e.text_teacher = p.student.text_teacher_proj(
        aggregated_teacher_embedding(p.feats.text_teachers, p.feats.text_weights))  # (B, p)


def _set(field: str, make: Callable[[StepPass], torch.Tensor]) -> Callable[[StepPass, StepEmbeddings], None]:
    def produce(p: StepPass, e: StepEmbeddings) -> None:
        setattr(e, field, make(p))

    return produce


# input name -> its producer, in the order they run (the MLM's encoder pass first: a gradient cache replays the
# passes in the order they ran)
PRODUCERS: dict[str, Callable[[StepPass, StepEmbeddings], None]] = {
    "mlm": _mlm,
    "s": _s,
    "image": _set("image", lambda p: p.student.image_proj(p.feats.image)),  # (B, p): g_φ2 (MCSE Eq. 2)
    "joint_text": _set("joint_text", lambda p: p.feats.joint_text),  # (B, k) t̂
    "joint_image": _set("joint_image", lambda p: p.feats.joint_image),  # (B, k) v̂
    "teacher_text": _set("teacher_text", lambda p: p.student.teacher_text_proj(p.feats.joint_text)),  # g_φt(t̂)
    "teacher_image": _set("teacher_image", lambda p: p.student.teacher_image_proj(p.feats.joint_image)),  # g_φv(v̂)
    "shared_text": _shared_text,
    "shared_image": _set("shared_image", lambda p: p.student.shared_image(p.feats.joint_image)),  # (B, p)
    "text_teacher_sim": _text_teacher_sim,
    "rank_teacher_sim": _rank_teacher_sim,
    "text_teacher": _text_teacher,
    # MCSEO's object–phrase pairs: each phrase's span mean of the view-z tokens, g_φ1 of it; g_φ2 of each crop
    "phrases": _set("phrases", lambda p: p.student.text_proj(span_mean(
        p.tokens[: p.n], p.feats.object_row, p.feats.object_start, p.feats.object_end))),  # (T, p)
    "objects": _set("objects", lambda p: p.student.image_proj(p.feats.objects)),  # (T, p)
    "object_pair": _set("object_pair", lambda p: p.feats.object_row),  # (T,)
}


def produce(p: StepPass, e: StepEmbeddings, wanted: set[str]) -> StepEmbeddings:
    """``e`` with every input in ``wanted`` made by its producer, in `PRODUCERS`' order."""
    for name, producer in PRODUCERS.items():
        if name in wanted:
            producer(p, e)
    return e
