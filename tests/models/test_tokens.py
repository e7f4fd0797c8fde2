"""Token tables: tokenized once, cached, batched with dynamic padding, rebuilt when corrupt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmcse.models import tokens
from mmcse.models.student import load_tokenizer
from mmcse.models.tokens import TokenCacheError, cached_tokens, open_table, tokenize_texts

TEXTS = [
    "A dog runs across the grass.",
    "Two children are playing football in a park near the river.",
    "ok",
    "A man in a red jacket rides a bicycle down a busy street while talking on his phone today.",
    "The cat sleeps.",
    "Several people wait at a bus stop in the rain, holding umbrellas of many colours.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("packaged:all-MiniLM-L6-v2")


@pytest.mark.parametrize("max_len", [8, 32])
def test_batches_equal_per_batch_tokenization(tokenizer, device, max_len):
    """Every subset's ``input_ids``/``attention_mask`` are exactly what tokenizing that batch
    with padding to its longest sentence gives (what training did per step before)."""
    table = tokenize_texts(tokenizer, TEXTS, max_len)
    for idx in ([0, 1, 2], [2, 4], [3, 5, 0, 1], list(range(len(TEXTS)))):
        want = tokenizer([TEXTS[i] for i in idx], padding=True, truncation=True, max_length=max_len,
                         return_tensors="pt")
        got = table.batch(idx, device)
        assert got["input_ids"].device.type == device.type
        assert got["input_ids"].dtype == got["attention_mask"].dtype == torch.int64
        torch.testing.assert_close(got["input_ids"].cpu(), want["input_ids"], rtol=0, atol=0)
        torch.testing.assert_close(got["attention_mask"].cpu(), want["attention_mask"], rtol=0, atol=0)
    assert table.lengths.max() == max_len if max_len == 8 else table.lengths.max() < max_len


def test_cache_is_written_once_and_keyed_by_texts_and_length(tokenizer, tmp_path, monkeypatch):
    first = cached_tokens(tmp_path, "captions", tokenizer, TEXTS, 16)
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 1 and folders[0].startswith("captions-")

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again although the cache holds these texts")

    monkeypatch.setattr(tokens, "tokenize_texts", no_tokenizing)
    again = cached_tokens(tmp_path, "captions", tokenizer, TEXTS, 16)
    np.testing.assert_array_equal(again.ids, first.ids)
    np.testing.assert_array_equal(again.lengths, first.lengths)
    monkeypatch.undo()

    cached_tokens(tmp_path, "captions", tokenizer, TEXTS, 12)  # another length
    cached_tokens(tmp_path, "captions", tokenizer, TEXTS[:-1] + ["changed"], 16)  # other texts
    assert len(list(tmp_path.iterdir())) == 3
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no leftovers of the atomic write


def test_truncated_cache_is_named_and_rebuilt(tokenizer, tmp_path, capsys):
    good = cached_tokens(tmp_path, "corpus", tokenizer, TEXTS, 16)
    want = np.array(good.ids)  # a copy: good.ids maps the file damaged below
    folder = good.folder
    ids_file = folder / "ids.npy"
    ids_file.write_bytes(ids_file.read_bytes()[:-20])
    with pytest.raises(TokenCacheError, match=str(folder)):
        open_table(folder)
    rebuilt = cached_tokens(tmp_path, "corpus", tokenizer, TEXTS, 16)
    assert "rebuilding" in capsys.readouterr().out
    np.testing.assert_array_equal(rebuilt.ids, want)
    assert open_table(folder).ids.shape == (len(TEXTS), 16)


@pytest.mark.parametrize("damage", ["no header", "wrong rows", "bad lengths", "ids overwritten", "foreign header"])
def test_damaged_cache_folders_are_rebuilt(tokenizer, tmp_path, damage):
    good = cached_tokens(tmp_path, "corpus", tokenizer, TEXTS, 16)
    want_ids, want_lengths = np.array(good.ids), np.array(good.lengths)
    folder = good.folder
    header = folder / "tokens.json"
    if damage == "no header":
        header.unlink()
    elif damage == "wrong rows":
        header.write_text(header.read_text().replace(f'"rows": {len(TEXTS)}', '"rows": 99'))
    elif damage == "bad lengths":
        np.save(folder / "lengths.npy", np.zeros(len(TEXTS), dtype=np.int32))
    elif damage == "ids overwritten":  # the right shape, dtype and lengths: only the digest tells
        ids = np.array(good.ids)
        ids[ids > 1000] = 1997
        np.save(folder / "ids.npy", ids)
    else:  # another key's header (and arrays) copied in
        other = cached_tokens(tmp_path, "other", tokenizer, TEXTS[::-1], 16).folder
        for name in ("tokens.json", "ids.npy", "lengths.npy"):
            (folder / name).write_bytes((other / name).read_bytes())
    with pytest.raises(TokenCacheError, match=str(folder)):
        open_table(folder, folder.name.split("-", 1)[1])
    rebuilt = cached_tokens(tmp_path, "corpus", tokenizer, TEXTS, 16)
    np.testing.assert_array_equal(rebuilt.ids, want_ids)
    np.testing.assert_array_equal(rebuilt.lengths, want_lengths)
