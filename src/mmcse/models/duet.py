"""DUET: the dual-stream image–text retrieval model (``shared/papers/duet.txt`` §4.1–4.2, Eq. 23–27, 30);
its objective (Eq. 28–33) is :mod:`mmcse.methods.duet`.

Architecture (§4.1–4.2, §5.2)::

    regions r_i (B, n, d_v), boxes b_i (B, n, 5) -- Eq. 23 normalized_boxes
      -> [norm(r_i); b_i] -> MLP_vis (Eq. 24) -> (B, n, d_vis), prepend learned [I-CLS] -> (B, n+1, d_vis)
      -> visual_layers own TE layers (Eq. 26)          -> project to joint_dim if d_vis != joint_dim
      -> k shared TE layers --------------------------> v_I = h_vis,0 (Eq. 27)
    caption -> BERT (Eq. 25) (B, m+1, H) -> project to joint_dim if H != joint_dim
      -> the SAME k shared TE layers (same nn.Module objects) -> v_C = h_text,0 (Eq. 27)

With ``shared_layers=0`` each stream ends after its own layers (then the projections map both
[CLS] states into the joint space). ``tie_shared=False`` keeps the top k layers but gives the text
stream its own copy: the paper's ablation "w/o shared layers: disables transformer weight sharing"
(Table 2) at equal depth. ``spatial=False`` is the ablation "w/o spatial features: removes
bounding-box coordinate input" (Table 2): Eq. 24's MLP takes norm(r_i) alone, so b_i never enters
v_I (below).

Choices where the paper is silent (each is a constructor argument; reasons below):

* ``visual_layers=4`` are the *dedicated* visual layers ("four dedicated Transformer Encoder layers",
  §5.2) and the ``shared_layers=2`` sit on top of them, so the visual depth is L = visual_layers + k.
* Where the 1024-d projection sits (``joint_dim``): the shared layers themselves run at
  ``joint_dim`` ("the top two Transformer layers are shared ..., projecting into a joint
  1024-dimensional embedding space"). The visual width ``visual_dim`` defaults to ``joint_dim``, so
  Eq. 24's MLP maps regions straight to the joint width and only BERT's 768-d states need a linear
  projection (applied to every token, before the shared layers; the identity when widths agree).
  v_I, v_C are the raw [CLS] outputs of the last layer — no projection after it.
* Box-regression layer l (Eq. 30, "an intermediate transformer layer l < L"): ``box_layer`` counts
  layers of the visual stream, 1 = output of the first own layer, L = the last. The default is the
  last layer that is not the embedding layer *and* not shared with text, ``min(visual_layers, L - 1)``
  (4 for the paper's 4 + 2): every dedicated layer must then carry the geometry up to where the
  shared layers begin, while the shared layers stay free to abstract. A low l would be nearly
  trivial, since b_i is itself an input of Eq. 24 (l = 0 would be a copy), so l = 0 is refused.
* Region-feature normalisation (``region_norm``): "layernorm" (default, a LayerNorm with its own
  affine on r_i before the concatenation with b_i), "l2" or "none". Bottom-up-attention features
  are post-ReLU with magnitudes of tens; b_i is in [0, 1]. LayerNorm puts the 2048 feature entries
  at unit scale, comparable to the 5 box entries, so the box input is not drowned at init (L2 would
  shrink each entry to ~1/sqrt(2048), making the box input dominate instead).
* MLP_vis hidden width = ``visual_dim``; MLP_pos (Eq. 30) is Linear(w, w) -> ReLU -> Linear(w, 5)
  with a linear output (no sigmoid: Eq. 30 has none, and Eq. 31 is a plain squared distance).
* Encoder layers: ``nn.TransformerEncoderLayer`` post-LN with GELU like BERT, ``heads=4``,
  ``ff_dim=2048``, ``dropout=0.1``; no positional embedding on regions (a set; position is b_i).
  The learned [I-CLS] token starts at N(0, 0.02²) like BERT's embeddings.
* λ1 = λ2 = 1 by default (the paper gives no values; Eq. 33 weights both terms as "tunable").
* Batch aggregation: Eq. 28, 31 and 32 are written per pair / per image. Every loss takes
  ``reduction`` ("mean" default, "sum" = VSE++'s batch sum, "none" = the per-pair values); the
  objective uses one reduction for all three terms, so λ1, λ2 mean the same at every batch size.
* Eq. 31 with padding: the 1/n average runs over each image's real regions only.
* ``spatial=False`` (Table 2's "w/o spatial features") removes b_i from Eq. 24's input only: the
  MLP's first Linear has ``region_dim`` inputs instead of ``region_dim + 5`` and v_I is a function
  of the region features alone. The paper names no other change, so the rest of the objective
  stays: Eq. 30–31's head still regresses b_i (the boxes remain its target, no longer also its
  input, so at l >= 1 it must read geometry off the appearance features), and λ1 keeps its value.
  Callers pass boxes as before (the same batches serve both settings).
* Eq. 29's hardest negatives are taken over j != i; the optional ``ignore`` mask also removes pairs
  that are positives in disguise (two captions of one image in a batch). A batch of one has no
  negatives: its hinge is 0.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from mmcse.models.dropout import OWN_LAYERS_SALT, RowKeys, install_keyed_dropout, install_keyed_layers

REGION_NORMS = ("layernorm", "l2", "none")


# --------------------------------------------------------------------------- inputs (§4.1)


def normalized_boxes(boxes_xyxy: torch.Tensor, width: float, height: float) -> torch.Tensor:
    """DUET Eq. 23: b_i = [x1/W, y1/H, x2/W, y2/H, (x2-x1)(y2-y1)/(W·H)].

    ``boxes_xyxy (..., n, 4)`` in pixels of a ``width`` x ``height`` image; returns ``(..., n, 5)``.
    """
    if boxes_xyxy.shape[-1] != 4:
        raise ValueError(f"boxes_xyxy must end in 4 coordinates (x1, y1, x2, y2), got shape {tuple(boxes_xyxy.shape)}")
    if not (width > 0 and height > 0):
        raise ValueError(f"image width and height must be positive, got width={width}, height={height}")
    x1, y1, x2, y2 = boxes_xyxy.unbind(-1)  # each (..., n)
    if bool(((x2 < x1) | (y2 < y1)).any()):
        raise ValueError("boxes_xyxy has a box with x2 < x1 or y2 < y1 (expected x1, y1, x2, y2 order)")
    area = (x2 - x1) * (y2 - y1) / (width * height)
    return torch.stack([x1 / width, y1 / height, x2 / width, y2 / height, area], dim=-1)  # (..., n, 5)


class RegionEmbedding(nn.Module):
    """DUET Eq. 24: r̂_i = W2·ReLU(W1[r_i; b_i] + b1) + b2, with r_i normalised first (``region_norm``).

    ``spatial=False`` (Table 2, "w/o spatial features"): r̂_i = W2·ReLU(W1 r_i + b1) + b2, W1 with
    ``region_dim`` columns; ``forward`` still takes the boxes (same call either way) and ignores them."""

    def __init__(self, region_dim: int, out_dim: int, region_norm: str = "layernorm", spatial: bool = True) -> None:
        super().__init__()
        if region_norm not in REGION_NORMS:
            raise ValueError(f"region_norm={region_norm!r} is not one of {', '.join(REGION_NORMS)}")
        self.region_norm, self.spatial = region_norm, spatial
        self.norm = nn.LayerNorm(region_dim) if region_norm == "layernorm" else nn.Identity()
        in_dim = region_dim + 5 if spatial else region_dim  # [r_i; b_i] or r_i alone
        self.mlp = nn.Sequential(nn.Linear(in_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim))

    def forward(self, regions: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        # regions (B, n, d_v), boxes (B, n, 5) -> (B, n, d)
        r = F.normalize(regions, dim=-1) if self.region_norm == "l2" else self.norm(regions)
        if not self.spatial:
            return self.mlp(r)  # (B, n, d): no box input, so no gradient reaches the boxes through here
        return self.mlp(torch.cat([r, boxes.to(r.dtype)], dim=-1))


# --------------------------------------------------------------------------- model (§4.2)


@dataclass
class DuetOutput:
    """Raw (not normalised) [CLS] embeddings and the box predictions of layer l."""

    v_img: torch.Tensor  # (B, joint_dim), Eq. 27 v_I
    v_txt: torch.Tensor  # (B, joint_dim), Eq. 27 v_C
    box_pred: torch.Tensor  # (B, n, 5), Eq. 30 b̂_i (rows of padded regions are meaningless)


def _encoder_layer(width: int, heads: int, ff_dim: int, dropout: float) -> nn.TransformerEncoderLayer:
    if width % heads:
        raise ValueError(f"layer width {width} is not divisible by heads={heads}")
    return nn.TransformerEncoderLayer(
        width, heads, ff_dim, dropout, activation="gelu", batch_first=True, norm_first=False
    )


@dataclass(frozen=True)
class DuetArchitecture:
    """`DuetModel`'s shape: the region width, the visual stream's own and the shared layers (§4.2, §5.2), the box
    head's layer l (Eq. 30; None: min(visual_layers, L - 1)), the added layers' heads, feed-forward width and
    dropout, the visual-only width (None: joint_dim), the region norm before Eq. 24, whether the shared layers are
    weight-tied and whether boxes reach the embeddings (`mmcse.training.duet.duet_architecture` from
    ``model.duet``; a checkpoint's duet.json keeps these fields)."""

    region_dim: int = 2048
    visual_layers: int = 4
    shared_layers: int = 2
    joint_dim: int = 1024
    box_layer: int | None = None
    heads: int = 4
    ff_dim: int = 2048
    dropout: float = 0.1
    visual_dim: int | None = None
    region_norm: str = "layernorm"
    tie_shared: bool = True
    spatial: bool = True


class DuetModel(nn.Module):
    """DUET's dual Transformer encoder (§4.2): own visual layers, BERT for text, top k layers shared.

    ``forward(input_ids, attention_mask, regions, boxes, region_mask=None, token_type_ids=None)``
    returns :class:`DuetOutput`; :meth:`encode_image` / :meth:`encode_text` run one stream (offline
    indexing, §5.6). ``region_mask (B, n)``: True (or 1) for a real region, False for padding.
    ``spatial=False``: the boxes are still passed (and shape-checked) but never reach v_I or b̂.
    """

    def __init__(self, text_backbone: PreTrainedModel, arch: DuetArchitecture | None = None) -> None:
        super().__init__()
        arch = arch or DuetArchitecture()
        region_dim, visual_layers, shared_layers, joint_dim = arch.region_dim, arch.visual_layers, \
            arch.shared_layers, arch.joint_dim
        box_layer, heads, ff_dim, dropout, visual_dim = arch.box_layer, arch.heads, arch.ff_dim, arch.dropout, \
            arch.visual_dim
        region_norm, tie_shared, spatial = arch.region_norm, arch.tie_shared, arch.spatial
        if visual_layers < 1:
            raise ValueError(f"visual_layers={visual_layers} must be >= 1 (the visual stream needs its own layers)")
        if shared_layers < 0:
            raise ValueError(f"shared_layers={shared_layers} must be >= 0")
        depth = visual_layers + shared_layers  # L, the visual stream's depth
        if box_layer is None:
            box_layer = min(visual_layers, depth - 1)
        if not 1 <= box_layer <= depth - 1:
            raise ValueError(
                f"box_layer={box_layer} must satisfy 1 <= l < L = visual_layers + shared_layers = {depth} "
                "(Eq. 30: an intermediate layer)"
            )
        visual_dim = joint_dim if visual_dim is None else visual_dim
        text_dim = int(text_backbone.config.hidden_size)
        self.visual_layers_n, self.shared_layers_n, self.box_layer, self.tie_shared, self.spatial = (
            visual_layers, shared_layers, box_layer, tie_shared, spatial
        )
        self.joint_dim, self.visual_dim = joint_dim, visual_dim

        self.text = text_backbone
        # spatial=False: Table 2's "w/o spatial features" (b_i out of Eq. 24; still Eq. 31's target)
        self.region_embed = RegionEmbedding(region_dim, visual_dim, region_norm, spatial)
        self.img_cls = nn.Parameter(torch.randn(1, 1, visual_dim) * 0.02)  # learned [I-CLS], r_0
        self.visual = nn.ModuleList(_encoder_layer(visual_dim, heads, ff_dim, dropout) for _ in range(visual_layers))
        # Into the joint width: before the shared layers, or at the end when there are none.
        self.vis_proj = nn.Linear(visual_dim, joint_dim) if visual_dim != joint_dim else nn.Identity()
        self.text_proj = nn.Linear(text_dim, joint_dim) if text_dim != joint_dim else nn.Identity()
        # The top k layers: ONE set of modules that both streams call (weight tying by identity).
        self.shared = nn.ModuleList(_encoder_layer(joint_dim, heads, ff_dim, dropout) for _ in range(shared_layers))
        # Ablation (Table 2, "w/o shared layers" at equal depth): the text stream's own copy.
        self.text_top = None if tie_shared else copy.deepcopy(self.shared)
        box_width = visual_dim if box_layer <= visual_layers else joint_dim
        self.box_head = nn.Sequential(nn.Linear(box_width, box_width), nn.ReLU(), nn.Linear(box_width, 5))

    def install_keyed_dropout(self) -> RowKeys:
        """Every dropout of the model keyed by row (``train.dropout_rng: per_row``): BERT's
        (`install_keyed_dropout`) and the added layers' (`install_keyed_layers`), under one `RowKeys`, which
        ``row_keys(model.text, ...)`` fills for a pass."""
        keys = install_keyed_dropout(self.text)
        salt = OWN_LAYERS_SALT
        for name, child in self.named_children():
            if name != "text":
                salt = install_keyed_layers(child, keys, salt)
        return keys

    def text_layers(self) -> nn.ModuleList:
        """The top layers the text stream runs: ``self.shared`` itself when tied."""
        return self.shared if self.text_top is None else self.text_top

    def encode_image(
        self, regions: torch.Tensor, boxes: torch.Tensor, region_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """v_I (B, joint_dim) (Eq. 27) and the box predictions b̂ (B, n, 5) of layer l (Eq. 30)."""
        B, n, _ = regions.shape
        if boxes.shape != (B, n, 5):
            raise ValueError(f"boxes must have shape {(B, n, 5)} (Eq. 23 normalized_boxes), got {tuple(boxes.shape)}")
        if region_mask is None:
            region_mask = torch.ones(B, n, dtype=torch.bool, device=regions.device)
        if region_mask.shape != (B, n):
            raise ValueError(f"region_mask must have shape {(B, n)}, got {tuple(region_mask.shape)}")
        keep = torch.cat([region_mask.new_ones(B, 1, dtype=torch.bool), region_mask.bool()], dim=1)  # (B, n+1)
        pad = ~keep  # key padding: True = ignore; the [CLS] is always kept
        x = self.region_embed(regions, boxes)  # (B, n, d_vis)
        x = torch.cat([self.img_cls.expand(B, -1, -1).to(x.dtype), x], dim=1)  # (B, n+1, d_vis)
        box_states = None
        for i, layer in enumerate(self.visual, start=1):
            x = layer(x, src_key_padding_mask=pad)  # (B, n+1, d_vis)
            if i == self.box_layer:
                box_states = x
        x = self.vis_proj(x)  # (B, n+1, joint_dim)
        for i, layer in enumerate(self.shared, start=len(self.visual) + 1):
            x = layer(x, src_key_padding_mask=pad)  # (B, n+1, joint_dim)
            if i == self.box_layer:
                box_states = x
        assert box_states is not None  # box_layer is validated to lie in [1, L-1]
        box_pred = self.box_head(box_states[:, 1:])  # (B, n, 5): regions only, not the [CLS]
        return x[:, 0], box_pred

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """v_C (B, joint_dim): BERT (Eq. 25), projection, the top layers, the [T-CLS] state (Eq. 27)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        h = self.text_proj(self.text(**kwargs).last_hidden_state)  # (B, m+1, joint_dim)
        pad = ~attention_mask.bool()  # (B, m+1)
        for layer in self.text_layers():
            h = layer(h, src_key_padding_mask=pad)  # (B, m+1, joint_dim)
        return h[:, 0]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        regions: torch.Tensor,
        boxes: torch.Tensor,
        region_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> DuetOutput:
        v_img, box_pred = self.encode_image(regions, boxes, region_mask)
        v_txt = self.encode_text(input_ids, attention_mask, token_type_ids)
        return DuetOutput(v_img=v_img, v_txt=v_txt, box_pred=box_pred)
