"""VSE++'s word vocabulary (`mmcse.models.vocabulary`): which words it keeps, their ids, how a
caption becomes ids, and that it saves and loads back as the same tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from mmcse.models.tokens import tokenize_texts
from mmcse.models.vocabulary import SPECIAL_TOKENS, caption_words, word_tokenizer

CAPTIONS = [
    "A dog runs on the grass.",
    "A dog, a cat.",
    "The dog sleeps.",
    "A Dog jumps!",
    "a dog barks at THE cat",
]


def test_caption_words_lowercase_and_split_punctuation():
    assert caption_words("A Dog, jumps!") == ["a", "dog", ",", "jumps", "!"]


def test_vocabulary_keeps_frequent_words_in_order_of_frequency_then_alphabet():
    # counts: a 5, dog 5, the 3, . 3, cat 2, the rest 1
    tok = word_tokenizer(CAPTIONS, min_count=2)
    vocab = tok.get_vocab()
    assert [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] == [
        *SPECIAL_TOKENS, "a", "dog", ".", "the", "cat"]
    assert tok.pad_token_id == 0


def test_a_caption_is_start_words_end_with_rare_words_unknown():
    tok = word_tokenizer(CAPTIONS, min_count=2)
    ids = tok("The dog runs.")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<start>", "the", "dog", "<unk>", ".", "<end>"]


def test_token_tables_pad_with_the_pad_id_and_truncate(tmp_path):
    tok = word_tokenizer(CAPTIONS, min_count=1)
    table = tokenize_texts(tok, ["a dog", "the cat sleeps on the grass"], 5)
    batch = table.batch([0, 1], torch.device("cpu"))
    words = [tok.convert_ids_to_tokens(row) for row in batch["input_ids"].tolist()]
    # padded with <pad> (id 0); cut to 5 tokens with <start> and <end> kept
    assert words == [["<start>", "a", "dog", "<end>", "<pad>"], ["<start>", "the", "cat", "sleeps", "<end>"]]
    assert batch["attention_mask"].sum(1).tolist() == [4, 5]


def test_same_captions_give_the_same_ids_and_a_saved_vocabulary_loads_back(tmp_path):
    one, two = word_tokenizer(CAPTIONS), word_tokenizer(list(CAPTIONS))
    assert one.get_vocab() == two.get_vocab()
    one.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "A dog barks at the cat."
    assert loaded(text)["input_ids"] == one(text)["input_ids"]
    assert loaded.pad_token_id == 0


def test_min_count_below_one_is_refused():
    with pytest.raises(ValueError, match="min_count"):
        word_tokenizer(CAPTIONS, min_count=0)
