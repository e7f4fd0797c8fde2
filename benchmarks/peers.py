"""The peer the step benchmarks time beside mmcse's SimCSE step: sentence-transformers' (Cached)
MultipleNegativesRankingLoss on a copy of the same backbone (`step_time.py`, `micro_batch.py`)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mmcse.models.student import load_tokenizer  # noqa: E402

TOKENIZER = "packaged:all-MiniLM-L6-v2"  # BERT uncased's vocabulary, the benchmarks' random students' too


def ranking_loss(backbone: torch.nn.Module, folder: Path, device: torch.device, temperature: float,
                 mini_batch: int = 0, max_seq_length: int | None = None, tokenizer: str = TOKENIZER) -> Any:
    """``MultipleNegativesRankingLoss`` (``mini_batch`` 0) or ``CachedMultipleNegativesRankingLoss`` at that
    ``mini_batch_size``, at scale 1/``temperature``, over a SentenceTransformer made of ``backbone``'s weights
    (saved to ``folder`` with ``tokenizer`` and loaded as a ``Transformer`` module) and CLS pooling, in train
    mode on ``device``; its ``.model`` is that SentenceTransformer."""
    with warnings.catch_warnings():  # v6 moved the modules; the old paths work in every version
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import SentenceTransformer, losses, models

    backbone.save_pretrained(folder)
    load_tokenizer(tokenizer).save_pretrained(folder)
    transformer = models.Transformer(str(folder), max_seq_length=max_seq_length)
    pooling = models.Pooling(backbone.config.hidden_size, pooling_mode="cls")
    model = SentenceTransformer(modules=[transformer, pooling], device=str(device)).train()
    if mini_batch:
        return losses.CachedMultipleNegativesRankingLoss(model, scale=1 / temperature, mini_batch_size=mini_batch)
    return losses.MultipleNegativesRankingLoss(model, scale=1 / temperature)
