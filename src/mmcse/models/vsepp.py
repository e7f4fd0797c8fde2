"""VSE++ (Faghri, Fleet, Kiros, Fidler: "VSE++: Improving Visual-Semantic Embeddings with Hard
Negatives", BMVC 2018), DUET Table 1's first baseline: two encoders into one joint space and the
max-violation hinge.

* text: word embeddings (``word_dim``, uniform ±0.1 init) → a GRU (``joint_dim`` hidden) whose state
  at the caption's last token is the caption's embedding, L2-normalised (the authors'
  ``EncoderText``);
* image: the image's feature, L2-normalised, then a linear map (Xavier-uniform, bias 0),
  L2-normalised (their ``EncoderImageFull``; their ``EncoderImagePrecomp`` reads features stored
  normalised). The feature is either the mean of the image's region features (the cache_regions set:
  with ``regions.source: grid`` ResNet-152's 7 × 7 cells, whose mean is its pooled feature; with
  ``objects`` the whole image's and its objects' CNN features; with BUTD files the detector's
  regions), or, built with ``cnn`` (``model.vsepp.image_input: pixels``), the torchvision CNN run on
  the image's pixels in the model, so training can fine-tune it (VSE++'s "FT" rows);
* loss: the max-violation hinge summed over the batch, VSE++ Eq. 5 — the same function as DUET
  Eq. 28–29 (`mmcse.methods.duet.max_violation_hinge`, ``reduction="sum"``).

The model has DuetModel's interface (``encode_image(regions, boxes, mask)``, ``encode_text(ids,
mask)``, ``forward`` → `DuetOutput`, ``joint_dim``), so DUET's training loop, dev score and
evaluation (`mmcse.training.duet`) run it unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mmcse.models.cnn import pooled_resnet
from mmcse.models.duet import DuetOutput


class VseppModel(nn.Module):
    """VSE++'s text GRU and image projection (see the module docstring)."""

    @classmethod
    def from_architecture(cls, fields: dict) -> VseppModel:
        """The model a checkpoint's vsepp.json (its keyword arguments) describes."""
        return cls(**fields)

    def __init__(self, vocab_size: int, region_dim: int, word_dim: int = 300, joint_dim: int = 1024,
                 gru_layers: int = 1, pad_id: int = 0, cnn: str | None = None, crop_size: int = 224) -> None:
        super().__init__()
        self.joint_dim, self.pad_id = joint_dim, pad_id
        # pixels in: a torchvision ResNet without its classifier, (B, 3, crop, crop) → (B, 2048); its
        # weights are loaded by whoever builds the model (ImageNet's for training, a checkpoint's own)
        self.cnn = pooled_resnet(cnn) if cnn else None
        self.crop_size = crop_size  # the pixels' side it was trained on (evaluation crops the same)
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.gru = nn.GRU(word_dim, joint_dim, gru_layers, batch_first=True)
        self.image_fc = nn.Linear(region_dim, joint_dim)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # the authors' EncoderText.init_weights
        r = math.sqrt(6.0) / math.sqrt(region_dim + joint_dim)  # their EncoderImagePrecomp.init_weights
        nn.init.uniform_(self.image_fc.weight, -r, r)
        nn.init.zeros_(self.image_fc.bias)

    @property
    def reads_pixels(self) -> bool:
        """True when `encode_image` takes pixels ``(B, 3, H, W)`` (built with ``cnn``), else regions."""
        return self.cnn is not None

    def encode_image(self, regions: torch.Tensor, boxes: torch.Tensor | None = None,
                     region_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """v_I (B, joint_dim), unit rows, of ``regions (B, n, d)`` (their mean is the image's feature), or
        with a CNN of pixels ``(B, 3, H, W)``; ``boxes`` are not read."""
        if self.cnn is not None:
            if regions.dim() != 4:
                raise ValueError(f"this VSE++ runs its CNN on pixels (B, 3, H, W), not a {tuple(regions.shape)} tensor")
            feature = self.cnn(regions)  # (B, 2048): the CNN's pooled feature
        else:
            B, n, _ = regions.shape
            if region_mask is None:
                region_mask = torch.ones(B, n, dtype=torch.bool, device=regions.device)
            keep = region_mask.to(regions.dtype).unsqueeze(-1)  # (B, n, 1)
            feature = (regions * keep).sum(1) / keep.sum(1).clamp_min(1.0)  # (B, d): the image's one feature
        # EncoderImageFull: l2norm(cnn(images)) before the projection (precomputed features come normalised)
        return F.normalize(self.image_fc(F.normalize(feature, dim=-1)), dim=-1), None

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """v_C (B, joint_dim), unit rows: the GRU state at each caption's last token."""
        lengths = attention_mask.sum(1)  # (B,)
        if bool((lengths == 0).any()):
            raise ValueError("an empty caption (no tokens) has no VSE++ embedding")
        x = self.embed(input_ids)  # (B, m, word_dim)
        # packed: the padding never enters the recurrence (the authors pack too)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        states, _ = pad_packed_sequence(out, batch_first=True)  # (B, max_len, joint_dim)
        last = states[torch.arange(len(lengths), device=states.device), lengths.to(states.device) - 1]  # (B, joint)
        return F.normalize(last, dim=-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, regions: torch.Tensor,
                boxes: torch.Tensor | None = None, region_mask: torch.Tensor | None = None) -> DuetOutput:
        v_img, _ = self.encode_image(regions, boxes, region_mask)
        v_txt = self.encode_text(input_ids, attention_mask)
        n = 1 if self.cnn is not None else regions.shape[1]  # no regions, no box regression (DUET's alone)
        return DuetOutput(v_img=v_img, v_txt=v_txt, box_pred=v_img.new_zeros(regions.shape[0], n, 5))

