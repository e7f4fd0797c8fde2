"""Alignment and uniformity of sentence embeddings (Wang & Isola 2020; DALR Appendix D,
Eq. 15–16, Table 6). Both on L2-normalised embeddings; smaller is better for both."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from mmcse.data.senteval import SentencePair
from mmcse.errors import InputError
from mmcse.evaluation.retrieval import unit_rows
from mmcse.evaluation.sts import encode_unique

# Gold score from which an STS pair counts as a positive pair for ``alignment``: 4 on STS-B's
# 0–5 scale (Wang & Isola's and SimCSE's choice, which DALR Table 6 follows). The demo world's
# dev set (`mmcse.data.demo.sts_pair`: 5 × meaning overlap) is on the same 0–5 scale, so the
# same threshold applies and keeps the same kind of pairs: its paraphrases (gold 5, ~27% of
# pairs) and light edits such as a changed size (a further ~14%); colour or shape changes and
# unrelated scenes fall below 4.
POSITIVE_GOLD = 4.0
UNIFORMITY_T = 2.0


def alignment(x: np.ndarray, y: np.ndarray) -> float:
    """DALR Eq. 15: E ||f(x) − f(x⁺)||² over positive pairs, rows of ``x, y (N, d)``."""
    if x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(f"alignment needs two equal, non-empty (N, d) arrays: {x.shape}, {y.shape}")
    return float(((unit_rows(x) - unit_rows(y)) ** 2).sum(axis=1).mean())


def uniformity(x: np.ndarray, t: float = 2.0) -> float:
    """DALR Eq. 16: log E exp(−t ||f(x) − f(y)||²) over distinct pairs of rows of ``x (N, d)``."""
    if x.shape[0] < 2:
        raise ValueError(f"uniformity needs at least two embeddings, got {x.shape[0]}")
    u = unit_rows(x)
    sq = np.clip(2.0 - 2.0 * (u @ u.T), 0.0, None)  # (N, N) squared distances of unit vectors
    upper = sq[np.triu_indices(u.shape[0], k=1)]  # each unordered pair once
    # log-mean-exp, stable for large t·distances
    z = -t * upper
    return float(z.max() + np.log(np.exp(z - z.max()).mean()))


def geometry_metrics(pos_a: np.ndarray, pos_b: np.ndarray, sentences: np.ndarray) -> dict[str, float]:
    """``alignment`` of positive pairs (e.g. STS-B dev pairs with gold ≥ 4) and ``uniformity`` (t = 2)
    of all sentences (e.g. every STS-B dev sentence)."""
    return {"alignment": alignment(pos_a, pos_b), "uniformity": uniformity(sentences)}


DevPairs = Sequence[SentencePair] | Mapping[str, Sequence[SentencePair]]


def _flat(pairs: DevPairs) -> list[SentencePair]:
    """Pairs of one list, or of every task of a ``task -> pairs`` mapping (`group_by_task`)."""
    if isinstance(pairs, Mapping):
        return [p for task_pairs in pairs.values() for p in task_pairs]
    return list(pairs)


def positive_pairs(pairs: DevPairs, threshold: float = POSITIVE_GOLD) -> list[SentencePair]:
    """The pairs with gold ``score >= threshold``."""
    return [p for p in _flat(pairs) if p.score >= threshold]


def check_sts_geometry(pairs: DevPairs, threshold: float = POSITIVE_GOLD, where: str = "STS pairs") -> None:
    """Raise one clear error, before anything is encoded, when ``pairs`` cannot give both numbers:
    no pair with gold >= ``threshold`` (alignment) or fewer than two distinct sentences (uniformity).
    ``where`` names the source (e.g. the dev file) in the message."""
    flat = _flat(pairs)
    if not positive_pairs(flat, threshold):
        top = max((p.score for p in flat), default=float("nan"))
        raise InputError(f"{where}: no pair with gold score >= {threshold:g} (highest {top:g} in {len(flat)} pairs), "
                         "so the dev alignment has no positive pairs; use a dev set with high-similarity pairs")
    if len({s for p in flat for s in (p.s1, p.s2)}) < 2:
        raise InputError(f"{where}: fewer than two distinct sentences, so the dev uniformity is undefined")


def sts_geometry(
    vectors: Mapping[str, np.ndarray], pairs: DevPairs, threshold: float = POSITIVE_GOLD, t: float = UNIFORMITY_T
) -> dict[str, float]:
    """``alignment`` over the pairs with gold >= ``threshold`` and ``uniformity`` (``t``) over every
    distinct sentence of ``pairs``, from already computed embeddings ``vectors`` (sentence -> (d,),
    e.g. ``evaluate_sts(..., keep_vectors=True).vectors``): nothing is encoded here."""
    flat = _flat(pairs)
    check_sts_geometry(flat, threshold)
    positives = positive_pairs(flat, threshold)
    a = np.stack([vectors[p.s1] for p in positives])  # (P, d)
    b = np.stack([vectors[p.s2] for p in positives])  # (P, d)
    # each distinct sentence once: a repeated sentence would add zero distances to the mean
    distinct = sorted({s for p in flat for s in (p.s1, p.s2)})
    every = np.stack([vectors[s] for s in distinct])  # (N, d)
    return {"alignment": alignment(a, b), "uniformity": uniformity(every, t)}


def sts_dev_geometry(
    encode: Callable[[list[str]], np.ndarray], dev_pairs: DevPairs, threshold: float = POSITIVE_GOLD,
    batch_size: int = 128,
) -> dict[str, float]:
    """``{"alignment", "uniformity"}`` of the model behind ``encode`` (an ``EncodeFn``, e.g.
    `mmcse.evaluation.sts.TextEncoder` of the best checkpoint) on STS dev pairs: each distinct
    sentence encoded once, then `sts_geometry`. Bad pairs are refused before encoding."""

    flat = _flat(dev_pairs)
    check_sts_geometry(flat, threshold)
    vectors = encode_unique(encode, [s for p in flat for s in (p.s1, p.s2)], batch_size, desc="geometry")
    return sts_geometry(vectors, flat, threshold)
