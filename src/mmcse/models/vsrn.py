"""VSRN (Li, Zhang, Li, Li, Fu: "Visual Semantic Reasoning for Image-Text Matching", ICCV 2019),
DUET Table 1's second baseline: VSE++'s text GRU and hinge, with an image side that reasons over the
regions before pooling them, and a caption generator trained beside the matching loss.

The paper is not among ``../shared/papers``; the numbers DUET Table 1 quotes come from the authors'
released code (KunpengLi1994/VSRN), and this module follows that code (``model.py``,
``GCN_lib/Rs_GCN.py``, ``models/{EncoderRNN,DecoderRNN,Attention}.py``, ``train.py``'s defaults):

* text: VSE++'s ``EncoderText`` (`mmcse.models.vsepp.VseppModel.encode_text`: word embeddings, a GRU
  whose state at the caption's last token is its embedding, L2-normalised);
* image (``EncoderImagePrecompAttn``, §3.1–3.3): a linear map of each region feature into the
  ``joint_dim`` space (VSE++'s Xavier init), L2-normalised (COCO; the code's Flickr30k branch skips
  it), ``gcn_layers`` = 4 region-relation GCNs (`RegionRelationGCN`, §3.2), L2-normalised again, a
  GRU over the regions whose last state is the image (global semantic reasoning, §3.3; Flickr30k:
  a BatchNorm on it), L2-normalised;
* caption generation (§3.4, ``S2VTAttModel``): a GRU encoder over the reasoned regions and a GRU
  decoder with additive attention over them, teacher-forced (`CaptionGenerator`); its loss and the
  hinge are :mod:`mmcse.methods.vsrn`.

**Where the code's L2 norm runs.** The code's ``l2norm(X)`` sums over ``dim=1``; on the ``(B, N, D)``
region tensors that is the *region* axis, so each feature channel is normalised across an image's
regions, not each region across its channels. ``region_l2="regions"`` is that reading (the recipe);
``"features"`` normalises each region vector, ``"none"`` neither.

**Padding.** mmcse's region sets pad images with fewer regions (the demo's object sets); BUTD's 36
regions never pad, and there every step below equals the authors' code. A padded slot is zero
throughout, is no neighbour in R, is left out of the BatchNorm statistics and the region count N,
and never enters either GRU (packed sequences) or the attention: an image scores the same padded or
not.

The model has DuetModel's interface (``encode_image(regions, boxes, mask)``, ``encode_text(ids,
mask)``, ``forward`` → `DuetOutput`, ``joint_dim``), so DUET's loop, dev score and evaluation run it;
``encode_image`` returns the reasoned regions beside v_I, which the caption generator reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mmcse.models.duet import DuetOutput
from mmcse.models.vsepp import VseppModel

RegionL2 = Literal["regions", "features", "none"]
VARIANTS = ("coco", "flickr30k")  # the authors' two image branches (model.py: data_name == 'f30k_precomp')


def masked_batch_norm(bn: nn.BatchNorm1d, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``bn`` over the channels of ``x (B, n, D)`` with statistics (and running statistics) from the
    real regions alone (``mask (B, n)``; None: every slot is real, as the authors' BatchNorm1d over
    (B, D, n)); padded slots come back as zero."""
    B, n, D = x.shape
    if mask is None:
        return bn(x.reshape(B * n, D)).view(B, n, D)
    out = x.new_zeros(B, n, D)
    out[mask] = bn(x[mask])  # (M, D): the M real regions of the batch
    return out


class RegionRelationGCN(nn.Module):
    """VSRN §3.2's region relationship reasoning, the authors' ``Rs_GCN``: affinities R = θ(v)ᵀφ(v)
    divided by the number of regions N, then v* = BN(W(R · g(v))) + v. θ, φ, g, W are the code's
    kernel-1 convolutions (linear maps of each region, ``inter_dim`` = ``dim`` as VSRN builds them);
    the BatchNorm's weight and bias start at 0, so every layer starts as the identity."""

    def __init__(self, dim: int, inter_dim: int | None = None) -> None:
        super().__init__()
        inter = inter_dim or dim
        self.g, self.theta, self.phi = nn.Linear(dim, inter), nn.Linear(dim, inter), nn.Linear(dim, inter)
        self.W = nn.Linear(inter, dim)
        self.bn = nn.BatchNorm1d(dim)
        nn.init.zeros_(self.bn.weight)  # Rs_GCN: nn.init.constant(self.W[1].weight, 0), bias 0
        nn.init.zeros_(self.bn.bias)

    def forward(self, v: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``v (B, n, D)`` → v* (B, n, D); ``keep (B, n, 1)``: 1 on real regions; ``mask``: as `masked_batch_norm`."""
        affinity = self.theta(v) @ self.phi(v).transpose(1, 2)  # (B, n, n) R_ij = θ(v_i)·φ(v_j)
        # padded j are no neighbours; N is the image's own region count (the code's R / N)
        affinity = affinity * keep.transpose(1, 2) / keep.sum(1, keepdim=True)
        reasoned = self.W(affinity @ self.g(v))  # (B, n, D)
        return (masked_batch_norm(self.bn, reasoned, mask) + v) * keep


class CaptionGenerator(nn.Module):
    """VSRN §3.4's sentence generation, the authors' ``S2VTAttModel`` in training mode: the reasoned
    regions → a linear map (``vid2hid``, Xavier-normal) and dropout → a GRU encoder; a GRU decoder
    that starts from the encoder's last state and at each step reads [word embedding; attention
    context] (dropout on both), the context an additive attention over the encoder's outputs
    (``Attention``: linear2(tanh(linear1([h_enc; h_dec])))), and predicts the next word
    (``out``, Xavier-normal). One decoder layer, so the code's between-layer RNN dropout never acts."""

    def __init__(self, vocab_size: int, region_dim: int, hidden: int = 512, word_dim: int = 300,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.region_in = nn.Linear(region_dim, hidden)
        self.encoder = nn.GRU(hidden, hidden, batch_first=True)
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.attend = nn.Linear(2 * hidden, hidden)
        self.score = nn.Linear(hidden, 1, bias=False)
        self.decoder = nn.GRU(word_dim + hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab_size)
        self.dropout = nn.Dropout(dropout)
        nn.init.xavier_normal_(self.region_in.weight)  # EncoderRNN._init_hidden
        nn.init.xavier_normal_(self.out.weight)  # DecoderRNN._init_weights

    def attention(self, state: torch.Tensor, encoded: torch.Tensor, region_mask: torch.Tensor) -> torch.Tensor:
        """The context (B, H) of decoder state ``state (B, H)`` over ``encoded (B, n, H)``'s real regions."""
        both = torch.cat([encoded, state.unsqueeze(1).expand_as(encoded)], dim=-1)  # (B, n, 2H)
        scores = self.score(torch.tanh(self.attend(both))).squeeze(-1)  # (B, n)
        weights = torch.softmax(scores.masked_fill(~region_mask, float("-inf")), dim=-1)
        return (weights.unsqueeze(1) @ encoded).squeeze(1)

    def forward(self, regions: torch.Tensor, region_mask: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Next-word logits (B, T, vocab) for the teacher-forced words ``inputs (B, T)`` given the
        reasoned ``regions (B, n, D)`` (real where ``region_mask (B, n)``)."""
        B, n, _ = regions.shape
        x = self.dropout(self.region_in(regions))  # (B, n, H)
        counts = region_mask.sum(1).cpu()
        packed = pack_padded_sequence(x, counts, batch_first=True, enforce_sorted=False)
        encoded, state = self.encoder(packed)  # state (1, B, H): each image's last real region
        encoded, _ = pad_packed_sequence(encoded, batch_first=True, total_length=n)  # (B, n, H)
        words = self.embed(inputs)  # (B, T, W)
        outputs = []
        for t in range(inputs.shape[1]):  # the attention reads the state before step t: sequential
            context = self.attention(state[-1], encoded, region_mask)  # (B, H)
            step = self.dropout(torch.cat([words[:, t], context], dim=-1)).unsqueeze(1)  # (B, 1, W + H)
            out, state = self.decoder(step, state)
            outputs.append(out[:, 0])
        return self.out(torch.stack(outputs, dim=1))  # (B, T, vocab)


@dataclass(frozen=True)
class VsrnArchitecture:
    """`VsrnModel`'s shape: VSE++'s text encoder and image projection (vocabulary, region width, word and joint
    widths, GRU layers, padding id), the reasoning GCN's layers, the code's variant (flickr30k: a BatchNorm on the
    image embedding), the regions' l2 (see the module docstring) and the caption generator's widths, dropout, length
    and end id (`mmcse.training.duet.vsrn_architecture` from ``model.vsrn``; a checkpoint's vsrn.json keeps
    these fields)."""

    vocab_size: int
    region_dim: int
    word_dim: int = 300
    joint_dim: int = 2048
    gru_layers: int = 1
    pad_id: int = 0
    gcn_layers: int = 4
    variant: str = "coco"
    region_l2: RegionL2 = "regions"
    caption_hidden: int = 512
    caption_word_dim: int = 300
    caption_dropout: float = 0.2
    caption_max_len: int = 60
    end_id: int = 2


class VsrnModel(VseppModel):
    """VSRN (see the module docstring): VSE++'s text encoder and image projection (``image_fc``,
    the code's ``fc``), region reasoning, the region GRU and the caption generator."""

    def __init__(self, arch: VsrnArchitecture) -> None:
        a = arch
        super().__init__(a.vocab_size, a.region_dim, a.word_dim, a.joint_dim, a.gru_layers, a.pad_id)
        # what the caption loss reads of a caption: its first caption_max_len tokens, <end> (id end_id) last
        self.caption_max_len, self.end_id = a.caption_max_len, a.end_id
        if a.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {a.variant!r}")
        self.variant, self.region_l2 = a.variant, a.region_l2
        self.gcn = nn.ModuleList(RegionRelationGCN(a.joint_dim) for _ in range(a.gcn_layers))
        self.region_gru = nn.GRU(a.joint_dim, a.joint_dim, 1, batch_first=True)
        self.image_bn = nn.BatchNorm1d(a.joint_dim) if a.variant == "flickr30k" else None
        self.captioner = CaptionGenerator(a.vocab_size, a.joint_dim, a.caption_hidden, a.caption_word_dim,
                                          a.caption_dropout)

    @classmethod
    def from_architecture(cls, fields: dict) -> VsrnModel:
        """The model a checkpoint's vsrn.json (`VsrnArchitecture`'s fields) describes."""
        return cls(VsrnArchitecture(**fields))

    def _l2(self, x: torch.Tensor) -> torch.Tensor:
        """The code's ``l2norm`` on (B, n, D) region features (see the module docstring)."""
        if self.region_l2 == "none":
            return x
        return F.normalize(x, dim=1 if self.region_l2 == "regions" else -1)

    def encode_image(self, regions: torch.Tensor, boxes: torch.Tensor | None = None,
                     region_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """v_I (B, joint_dim), unit rows, and the reasoned regions (B, n, joint_dim) the caption
        generator reads; ``boxes`` are not read."""
        B, n, _ = regions.shape
        if region_mask is None:
            region_mask = torch.ones(B, n, dtype=torch.bool, device=regions.device)
        region_mask = region_mask.bool()
        # the one host sync of the image side: packing needs the counts on the CPU, and the checks read them there
        counts = region_mask.sum(1).cpu()  # (B,)
        if bool((counts == 0).any()):
            raise ValueError("an image without regions has no VSRN embedding")
        keep = region_mask.unsqueeze(-1).to(regions.dtype)  # (B, n, 1)
        bn_mask = None if bool((counts == n).all()) else region_mask  # BUTD's 36 regions: the code's BatchNorm as is
        x = self.image_fc(regions) * keep  # (B, n, D)
        if self.variant == "coco":
            x = self._l2(x)
        for layer in self.gcn:
            x = layer(x, keep, bn_mask)  # (B, n, D)
        x = self._l2(x)
        packed = pack_padded_sequence(x, counts, batch_first=True, enforce_sorted=False)
        _, state = self.region_gru(packed)  # (1, B, D): the state after each image's last real region
        image = state[-1]
        if self.image_bn is not None:
            image = self.image_bn(image)
        return F.normalize(image, dim=-1), x

    def caption_logits(self, reasoned: torch.Tensor, region_mask: torch.Tensor | None,
                       inputs: torch.Tensor) -> torch.Tensor:
        """Next-word logits (B, T, vocab) of the teacher-forced ``inputs (B, T)`` (`CaptionGenerator`)."""
        if region_mask is None:
            region_mask = torch.ones(reasoned.shape[:2], dtype=torch.bool, device=reasoned.device)
        return self.captioner(reasoned, region_mask.bool(), inputs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, regions: torch.Tensor,
                boxes: torch.Tensor | None = None, region_mask: torch.Tensor | None = None) -> DuetOutput:
        v_img, _ = self.encode_image(regions, boxes, region_mask)
        v_txt = self.encode_text(input_ids, attention_mask)
        return DuetOutput(v_img=v_img, v_txt=v_txt, box_pred=v_img.new_zeros(regions.shape[0], regions.shape[1], 5))
