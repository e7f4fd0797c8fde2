"""Dropout keyed by example: each row's mask depends on (step seed, row key, layer) alone, never on
which other rows share its forward pass.

torch's dropout draws one mask for a whole tensor from the global generator, so the mask a sentence
gets depends on the batch it sits in and on how many random numbers ran before. A gradient-cached
step (`mmcse.training.gradcache`) runs each micro-batch twice, once without and once with the
graph, and its update equals the full batch's only if both runs, and the full batch, give every row
the same mask (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup": the re-run replays the first pass's dropout). ``train.dropout_rng: per_row`` installs this
dropout in the student's backbone (`install_keyed_dropout`): its hidden-state dropouts become
`KeyedDropout` modules and its attention runs `keyed_attention` (eager attention with the keyed
dropout on the attention probabilities). Under `row_keys` each forward pass says which rows it
holds; outside one it falls back to torch's dropout.

The mask of element j of row r in layer l keeps it iff ``hash(hash(hash(seed, r), l), j) >= p``,
a counter-based hash in 31-bit integer arithmetic (exact on every device, no overflow in int64);
SimCSE's two views of a sentence are two rows, so they get two masks. j is the element's index in
the row's flattened tensor, so two passes over slices of one padded batch (same length) agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.models.bert.modeling_bert import eager_attention_forward

KEYED_ATTENTION = "mmcse_keyed"  # the attention implementation `install_keyed_dropout` sets
_MASK31 = 0x7FFFFFFF
_MULT = 0x45D9F3B  # < 2**27: a 31-bit value times it stays below 2**58, exact in int64
_UNIT = 1 << 24  # keep-or-drop compares 24 bits of the hash with p


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (two xor-shift-multiply rounds), elementwise on int64 tensors."""
    x = (((x >> 16) ^ x) * _MULT) & _MASK31
    x = (((x >> 16) ^ x) * _MULT) & _MASK31
    return (x >> 16) ^ x


def _mix_int(x: int) -> int:
    """`_mix` of one Python int (the step's seed and the layer's salt stay on the host: no copy to the device)."""
    x &= _MASK31
    x = (((x >> 16) ^ x) * _MULT) & _MASK31
    x = (((x >> 16) ^ x) * _MULT) & _MASK31
    return (x >> 16) ^ x


def row_hashes(seed: int | torch.Tensor, rows: torch.Tensor, salt: int) -> torch.Tensor:
    """``(R,)`` int64: the hash of (step ``seed``, each row key, the layer's ``salt``). ``seed`` is a Python int
    (eager steps: hashed on the host) or a 0-d int64 tensor (a compiled step's input, so that a new step's seed
    is new data, not a new graph): the same hash either way."""
    mixed = _mix_int(seed) if isinstance(seed, int) else _mix(seed.to(torch.int64) & _MASK31)
    return _mix(_mix(mixed ^ (rows.to(torch.int64) & _MASK31)) ^ (int(salt) & _MASK31))


def keep_mask(seed: int | torch.Tensor, rows: torch.Tensor, salt: int, shape: torch.Size, p: float) -> torch.Tensor:
    """``shape`` (rows first) bool: which elements dropout keeps, each row by its key alone (the element
    index mixed into the row's hash by the full `_mix`: one round leaves a row's masks too regular)."""
    per_row = int(torch.Size(shape[1:]).numel())
    j = torch.arange(per_row, dtype=torch.int64, device=rows.device)  # (n,): index within the row
    h = _mix(row_hashes(seed, rows, salt)[:, None] ^ j[None, :])  # (R, n)
    return ((h & (_UNIT - 1)) >= int(round(p * _UNIT))).view(shape)


@dataclass
class RowKeys:
    """What the current forward pass holds: the step's seed and one key per row (None: torch's dropout); each keyed
    layer holds its own salt."""

    seed: int | torch.Tensor = 0  # a 0-d int64 tensor in a compiled step (`row_hashes`)
    rows: torch.Tensor | None = None


def keyed_dropout(x: torch.Tensor, p: float, keys: RowKeys, salt: int, training: bool) -> torch.Tensor:
    """Inverted dropout of ``x`` (rows first) with the masks of `keep_mask`; torch's without keys."""
    if not training or p == 0.0:
        return x
    if keys.rows is None:
        return nn.functional.dropout(x, p, training=True)
    if keys.rows.shape[0] != x.shape[0]:
        raise ValueError(f"keyed dropout: {keys.rows.shape[0]} row keys for a tensor of {x.shape[0]} rows")
    return x * keep_mask(keys.seed, keys.rows, salt, x.shape, p).to(x.dtype) / (1.0 - p)


class KeyedDropout(nn.Module):
    """``nn.Dropout`` whose mask is `keyed_dropout`'s (a drop-in: same ``p``, same train/eval switch)."""

    def __init__(self, p: float, keys: RowKeys, salt: int) -> None:
        super().__init__()
        self.p, self.keys, self.salt = p, keys, salt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(x, self.p, self.keys, self.salt, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, salt={self.salt}"


def keyed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention (BERT/RoBERTa's) with the keyed dropout on the probabilities ``(R, heads, L, L)``."""
    keys: RowKeys | None = getattr(module, "mmcse_row_keys", None)
    if keys is None and module.training and dropout > 0.0:
        raise ValueError(f"train.dropout_rng: per_row does not know {type(module).__name__}'s attention (keyed: "
                         "BERT/RoBERTa self-attention); its dropout would not replay: use train.dropout_rng: torch")
    if keys is None or keys.rows is None or not module.training or dropout == 0.0:
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                       dropout=dropout, **kwargs)
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (R, heads, L, L)
    if attention_mask is not None:
        weights = weights + attention_mask
    probs = keyed_dropout(nn.functional.softmax(weights, dim=-1), dropout, keys, module.mmcse_salt, True)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (R, L, heads, d)
    return out, probs


AttentionInterface.register(KEYED_ATTENTION, keyed_attention)
AttentionMaskInterface.register(KEYED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # additive (R, 1, L, L)


def install_keyed_dropout(backbone: nn.Module) -> RowKeys:
    """Make ``backbone``'s dropout keyed by row (in place): every ``nn.Dropout`` becomes a `KeyedDropout`
    and its attention `keyed_attention`; returns the `RowKeys` that `row_keys` fills. A backbone whose
    attention is not the eager BERT/RoBERTa kind (no ``set_attn_implementation``) is refused."""
    existing = getattr(backbone, "mmcse_row_keys", None)
    if existing is not None:
        return existing
    if not hasattr(backbone, "set_attn_implementation"):
        raise ValueError(f"train.dropout_rng: per_row needs a Hugging Face encoder, not {type(backbone).__name__}")
    keys = RowKeys()
    salt = 0
    for module in list(backbone.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                salt += 1
                setattr(module, child_name, KeyedDropout(child.p, keys, salt))
        if hasattr(module, "attention_head_size"):  # a self-attention block: its probabilities' dropout
            salt += 1
            module.mmcse_salt = salt  # on the module: a deep copy of the backbone keeps its salts
            module.mmcse_row_keys = keys
    backbone.set_attn_implementation(KEYED_ATTENTION)
    backbone.mmcse_row_keys = keys
    return keys


@contextlib.contextmanager
def row_keys(backbone: nn.Module, seed: int | torch.Tensor, rows: torch.Tensor) -> Iterator[None]:
    """Within the block, ``backbone``'s forward passes hold the rows ``rows`` (``(R,)`` int keys) of step
    ``seed``; a backbone without keyed dropout is left as it is."""
    keys: RowKeys | None = getattr(backbone, "mmcse_row_keys", None)
    if keys is None:
        yield
        return
    keys.seed, keys.rows = seed, rows
    try:
        yield
    finally:
        keys.rows = None


# Salts of the keyed layers outside a Hugging Face backbone (DUET's own layers): above any backbone's
# (BERT-large has ~75), so no layer of the model shares another's masks.
OWN_LAYERS_SALT = 1_000_000


class KeyedMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose dropout on the attention probabilities ``(R, heads, L, L)`` is keyed
    by row while `row_keys` gives the pass its rows (torch's attention otherwise). Installed on an existing
    module by `install_keyed_layers`, which sets its class: its parameters and their names do not change.
    Batch-first self-attention with packed projections (what ``nn.TransformerEncoderLayer`` runs)."""

    mmcse_row_keys: RowKeys
    mmcse_salt: int

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys = self.mmcse_row_keys
        if keys.rows is None or not self.training or self.dropout == 0.0:
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        if not (self.batch_first and query is key is value and self._qkv_same_embed_dim and attn_mask is None
                and self.bias_k is None and not is_causal):
            raise ValueError("keyed attention: batch-first self-attention without attn_mask or bias_k only")
        R, L, E = query.shape
        heads, width = self.num_heads, E // self.num_heads
        qkv = nn.functional.linear(query, self.in_proj_weight, self.in_proj_bias)  # (R, L, 3E)
        q, k, v = (t.view(R, L, heads, width).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (R, heads, L, d)
        scores = torch.matmul(q, k.transpose(-2, -1)) * width**-0.5  # (R, heads, L, L)
        if key_padding_mask is not None:  # True / -inf: a padded key (the encoder layer passes it additive)
            pad = key_padding_mask[:, None, None, :]
            scores = scores.masked_fill(pad, float("-inf")) if pad.dtype == torch.bool else scores + pad
        probs = keyed_dropout(scores.softmax(dim=-1), self.dropout, keys, self.mmcse_salt, True)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(R, L, E)  # (R, L, E)
        return self.out_proj(out), None


def install_keyed_layers(module: nn.Module, keys: RowKeys, salt: int = OWN_LAYERS_SALT) -> int:
    """Make a plain torch ``module``'s dropout keyed by ``keys`` (in place): every ``nn.Dropout`` becomes a
    `KeyedDropout` and every ``nn.MultiheadAttention`` a `KeyedMultiheadAttention`, each with its own salt
    counted up from ``salt``. Returns the last salt used (the next module's start)."""
    for sub in list(module.modules()):
        for child_name, child in list(sub.named_children()):
            if isinstance(child, nn.Dropout):
                salt += 1
                setattr(sub, child_name, KeyedDropout(child.p, keys, salt))
        if isinstance(sub, nn.MultiheadAttention) and not isinstance(sub, KeyedMultiheadAttention):
            salt += 1
            sub.__class__ = KeyedMultiheadAttention
            sub.mmcse_row_keys, sub.mmcse_salt = keys, salt
    return salt
