"""Keyed dropout in plain torch layers (`mmcse.models.dropout.install_keyed_layers`, DUET's own layers): the
keyed attention is torch's attention but for the mask, a row's masks do not depend on the rows beside it, and
installing it changes no parameter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mmcse.models import dropout
from mmcse.models.dropout import KeyedDropout, KeyedMultiheadAttention, RowKeys, install_keyed_layers


def _layer(p: float) -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(8, 2, 16, p, activation="gelu", batch_first=True).double().train()


def _inputs(rows: int = 4, length: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, length, 8, generator=g, dtype=torch.float64)
    pad = torch.zeros(rows, length, dtype=torch.bool)
    pad[1, 3:] = True  # a padded row
    return x, pad


def test_the_keyed_attention_is_torchs_but_for_the_mask(monkeypatch):
    plain = _layer(0.0)
    keyed = copy.deepcopy(plain)
    keys = RowKeys()
    install_keyed_layers(keyed, keys)
    for module in keyed.modules():  # a dropout probability for the keyed path to take, the mask made all-keep
        if isinstance(module, (KeyedDropout, KeyedMultiheadAttention)):
            module.p = module.dropout = 0.5
    monkeypatch.setattr(dropout, "keyed_dropout", lambda x, p, keys, salt, training: x)
    x, pad = _inputs()
    keys.seed, keys.rows = 3, torch.arange(4)
    assert torch.allclose(keyed(x, src_key_padding_mask=pad), plain(x, src_key_padding_mask=pad), rtol=0, atol=1e-12)


def test_a_rows_masks_do_not_depend_on_the_rows_beside_it():
    layer = _layer(0.3)
    keys = RowKeys()
    install_keyed_layers(layer, keys)
    x, pad = _inputs()
    keys.seed, keys.rows = 7, torch.arange(4)
    whole = layer(x, src_key_padding_mask=pad)  # (4, L, d)
    keys.rows = torch.arange(2, 4)
    part = layer(x[2:], src_key_padding_mask=pad[2:])  # the same rows in a pass of their own
    assert torch.allclose(part, whole[2:], rtol=0, atol=1e-12)
    keys.seed, keys.rows = 8, torch.arange(4)
    assert (layer(x, src_key_padding_mask=pad) - whole).abs().max() > 1e-3  # another step, other masks
    keys.rows = None  # outside a keyed pass: torch's dropout, as before
    assert (layer(x, src_key_padding_mask=pad) - whole).abs().max() > 1e-3


def test_installing_keyed_layers_changes_no_parameter_and_leaves_no_torch_dropout():
    layer = _layer(0.1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    last = install_keyed_layers(layer, RowKeys(), salt=100)
    assert last == 104  # dropout, dropout1, dropout2 and the attention: four salts of their own
    assert not any(type(m) is nn.Dropout for m in layer.modules())
    assert isinstance(layer.self_attn, KeyedMultiheadAttention)
    after = layer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_the_keyed_attention_refuses_what_it_does_not_compute():
    layer = _layer(0.3)
    keys = RowKeys()
    install_keyed_layers(layer, keys)
    x, _ = _inputs()
    keys.seed, keys.rows = 1, torch.arange(4)
    with pytest.raises(ValueError, match="batch-first self-attention without attn_mask"):
        layer.self_attn(x, x.clone(), x.clone())
