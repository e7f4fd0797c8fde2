"""Alignment and uniformity of sentence embeddings (Wang & Isola 2020; DALR Appendix D,
Eq. 15–16, Table 6). Both on L2-normalised embeddings; smaller is better for both."""

from __future__ import annotations

import numpy as np

PRIMARY = "uniformity"


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)


def alignment(x: np.ndarray, y: np.ndarray) -> float:
    """DALR Eq. 15: E ||f(x) − f(x⁺)||² over positive pairs, rows of ``x, y (N, d)``."""
    if x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(f"alignment needs two equal, non-empty (N, d) arrays: {x.shape}, {y.shape}")
    return float(((_unit(x) - _unit(y)) ** 2).sum(axis=1).mean())


def uniformity(x: np.ndarray, t: float = 2.0) -> float:
    """DALR Eq. 16: log E exp(−t ||f(x) − f(y)||²) over distinct pairs of rows of ``x (N, d)``."""
    if x.shape[0] < 2:
        raise ValueError(f"uniformity needs at least two embeddings, got {x.shape[0]}")
    u = _unit(x)
    sq = np.clip(2.0 - 2.0 * (u @ u.T), 0.0, None)  # (N, N) squared distances of unit vectors
    upper = sq[np.triu_indices(u.shape[0], k=1)]  # each unordered pair once
    # log-mean-exp, stable for large t·distances
    z = -t * upper
    return float(z.max() + np.log(np.exp(z - z.max()).mean()))


def geometry_metrics(pos_a: np.ndarray, pos_b: np.ndarray, sentences: np.ndarray) -> dict[str, float]:
    """``alignment`` of positive pairs (e.g. STS-B dev pairs with gold ≥ 4) and ``uniformity`` (t = 2)
    of all sentences (e.g. every STS-B dev sentence)."""
    return {"alignment": alignment(pos_a, pos_b), "uniformity": uniformity(sentences)}
