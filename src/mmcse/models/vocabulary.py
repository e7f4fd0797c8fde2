"""A word-level tokenizer built from training captions (VSE++'s vocabulary), as a transformers
fast tokenizer so the token cache (`mmcse.models.tokens`) and ``save_pretrained`` treat it as any other.

VSE++ (Faghri et al. 2018; its code's ``vocab.py``) lowercases each caption, splits it into words
(NLTK's ``word_tokenize``; here: runs of word characters and runs of punctuation, which needs no
downloaded model), keeps the words seen at least ``min_count`` times in the training captions, and
wraps every caption as ``<start> … <end>``; rarer words become ``<unk>``, ``<pad>`` is id 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from mmcse.models.student import remember_loaded_state

SPECIAL_TOKENS = ("<pad>", "<start>", "<end>", "<unk>")  # ids 0..3, VSE++'s order


def _normalise_and_split() -> tuple[Any, Any]:
    from tokenizers import normalizers, pre_tokenizers

    return normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), pre_tokenizers.Whitespace()


def caption_words(caption: str) -> list[str]:
    """The words of one caption as the vocabulary sees them (lowercased; words and punctuation apart)."""
    normaliser, splitter = _normalise_and_split()
    return [word for word, _ in splitter.pre_tokenize_str(normaliser.normalize_str(caption))]


def word_tokenizer(captions: Sequence[str], min_count: int = 4) -> Any:
    """A `transformers.PreTrainedTokenizerFast` over the words of ``captions`` seen ``min_count``
    times or more, ids in order of frequency (ties: alphabetical) after the four special tokens:
    the same captions give the same ids on every machine."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    counts = Counter(word for caption in captions for word in caption_words(caption))
    words = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIAL_TOKENS),
                   key=lambda w: (-counts[w], w))
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer, tokenizer.pre_tokenizer = _normalise_and_split()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<start> $A <end>", special_tokens=[("<start>", vocab["<start>"]), ("<end>", vocab["<end>"])])
    return remember_loaded_state(PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<start>", eos_token="<end>",
        model_max_length=10**6))
