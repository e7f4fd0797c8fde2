"""One training step of the retrieval methods (DUET, VSE++, VSRN): the batch's loss terms and the update.

Over several processes (``train.devices``, `mmcse.training.distributed`) each process encodes its contiguous
share of the step's image–caption pairs and the embeddings ``(B, d)`` (and DUET's box predictions) are
all-gathered in rank order, keeping each share's gradient; every process computes the whole batch's loss (the
max-violation hinge over all B in-batch negatives) and the gradients are averaged: one process's update. This
holds for models whose pairs do not meet before the loss: DUET, with its dropout keyed by row
(``train.dropout_rng: per_row``: BERT's and its own layers', the image and the caption of a pair keyed apart),
and VSE++ on region features (no dropout, no batch statistics). VSRN's BatchNorm and VSE++'s CNN take
statistics over the whole batch, so they train on one process (`mmcse.config.TrainConfig.validate`).
"""

from __future__ import annotations

import torch

from mmcse.config import LossConfig
from mmcse.methods.duet import duet_objective
from mmcse.methods.vsepp import vsepp_objective
from mmcse.methods.vsrn import caption_targets, vsrn_objective
from mmcse.models.dropout import row_keys
from mmcse.models.duet import DuetModel, DuetOutput
from mmcse.models.vsepp import VseppModel
from mmcse.models.vsrn import VsrnModel
from mmcse.training.distributed import gathered, share
from mmcse.training.engine import Update
from mmcse.training.step import TrainStep

RetrievalModel = DuetModel | VseppModel  # VsrnModel is a VseppModel


def pair_embeddings(model: RetrievalModel, batch: dict[str, torch.Tensor],
                    regions: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], seed: int = 0,
                    ranks: tuple[int, int] = (0, 1)) -> DuetOutput:
    """``v_img``, ``v_txt`` ``(B, d)`` and ``box_pred`` ``(B, n, 5)`` of every pair of the batch, this process
    encoding its share of the pairs (all of them in one process) and the shares gathered in rank order. DUET's
    keyed dropout takes pair i's image as row 2i and its caption as row 2i + 1 of step ``seed``."""
    r, boxes, mask = regions
    ids, attention = batch["input_ids"], batch["attention_mask"]
    rank, size = ranks
    mine = share(ids.shape[0], rank, size)

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[mine]

    if isinstance(model, DuetModel):
        pairs = torch.arange(ids.shape[0], device=ids.device)[mine]  # (b,) this share's pairs in the batch
        with row_keys(model.text, seed, 2 * pairs):
            v_img, box_pred = model.encode_image(r[mine], boxes[mine], part(mask))
        with row_keys(model.text, seed, 2 * pairs + 1):
            v_txt = model.encode_text(ids[mine], attention[mine])
        out = DuetOutput(v_img=v_img, v_txt=v_txt, box_pred=box_pred)
    else:
        out = model(ids[mine], attention[mine], r[mine], part(boxes), part(mask))
    if size == 1:
        return out
    return DuetOutput(v_img=gathered(out.v_img), v_txt=gathered(out.v_txt), box_pred=gathered(out.box_pred))


def duet_step_loss(model: RetrievalModel, loss: LossConfig, batch: dict[str, torch.Tensor],
                   regions: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   ignore: torch.Tensor | None = None, seed: int = 0,
                   ranks: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
    """Eq. 33's terms (`duet_objective` with ``loss.duet``) of one batch: captions ``batch``
    (``input_ids``, ``attention_mask`` (B, l)) and their images' ``regions`` = (regions (B, n, d),
    boxes (B, n, 5), mask (B, n)); ``ignore`` (B, B): `same_image_mask`. VSE++: its hinge
    (`vsepp_objective` with ``loss.vsepp``); VSRN: the hinge and the caption loss (`vsrn_objective`
    with ``loss.vsrn``, the captions teacher-forced as `caption_targets` builds them). ``ranks``: this
    process and the job's processes (`pair_embeddings`)."""
    r, boxes, mask = regions
    if isinstance(model, VsrnModel):
        if ranks[1] > 1:
            raise ValueError("VSRN trains on one process (its BatchNorm takes the whole batch's statistics)")
        ids, attention = batch["input_ids"], batch["attention_mask"]
        v_img, reasoned = model.encode_image(r, boxes, mask)  # (B, d), (B, n, d)
        inputs, targets, counted = caption_targets(ids, attention, model.caption_max_len, model.end_id, model.pad_id)
        logits = model.caption_logits(reasoned, mask, inputs)  # (B, T, vocab)
        return vsrn_objective(v_img.float(), model.encode_text(ids, attention).float(), logits, targets, counted,
                              loss.vsrn.margin, loss.vsrn.caption_weight, ignore)
    out = pair_embeddings(model, batch, regions, seed, ranks)
    if isinstance(model, VseppModel):
        return vsepp_objective(out.v_img.float(), out.v_txt.float(), loss.vsepp.margin, ignore)
    c = loss.duet
    # the objective in fp32: the hinge compares cosines that differ in the third decimal
    return duet_objective(out.v_img.float(), out.v_txt.float(), out.box_pred.float(), boxes, mask, margin=c.margin,
                          lambdas=(c.lambda_box, c.lambda_norm), reduction=c.reduction, ignore=ignore)


class RetrievalStep:
    """DUET's (VSE++'s, VSRN's) training step, built once per run, as `mmcse.training.loop.StudentStep` is a
    student's: `duet_step_loss` as the forward of one `mmcse.training.step.TrainStep`, eager or compiled
    (``train.compile: step``, DUET only: the configuration refuses VSE++ and VSRN). ``step(batch, regions, ignore,
    seed, ranks)``: the forward under ``train.precision``'s autocast, backward (through the fp16 scaler when
    enabled), the gradients averaged over the job's processes (``ranks``), the update. Returns the terms and the
    gradient norm (`GRAD_NORM`), still on the device."""

    def __init__(self, model: RetrievalModel, loss: LossConfig, update: Update, compiled: bool = False,
                 backend: str | None = None) -> None:
        self.step = TrainStep(model, update, lambda kind: self._forward, compiled=compiled, backend=backend)
        self.model, self.loss = model, loss

    def _forward(self, ids: torch.Tensor, attention: torch.Tensor, r: torch.Tensor, boxes: torch.Tensor | None,
                 mask: torch.Tensor | None, ignore: torch.Tensor | None, seed: int | torch.Tensor,
                 ranks: tuple[int, int]) -> dict[str, torch.Tensor]:
        return duet_step_loss(self.model, self.loss, {"input_ids": ids, "attention_mask": attention}, (r, boxes, mask),
                              ignore, seed, ranks)

    def __call__(self, batch: dict[str, torch.Tensor], regions: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 ignore: torch.Tensor | None, seed: int = 0, ranks: tuple[int, int] = (0, 1)
                 ) -> dict[str, torch.Tensor]:
        return self.step("pairs", batch["input_ids"], batch["attention_mask"], *regions, ignore, self.step.seed(seed),
                         ranks, size=ranks[1])


def duet_optimizer_step(model: RetrievalModel, loss: LossConfig, batch: dict[str, torch.Tensor],
                        regions: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ignore: torch.Tensor | None,
                        update: Update, seed: int = 0, ranks: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
    """One eager step of a `RetrievalStep` made for it (a test's or a one-off's; a run builds its step once)."""
    return RetrievalStep(model, loss, update)(batch, regions, ignore, seed, ranks)
