"""SentEval transfer tasks: a logistic-regression probe on frozen sentence embeddings.

The protocol is SentEval's (Conneau & Kiela, 2018) with its PyTorch classifier, as SimCSE's
``evaluation.py`` runs it and DALR Table 2 / KDMCSE report it (accuracy × 100):

- MR, CR, SUBJ, MPQA: nested k-fold. For each outer fold the L2 penalty is chosen from
  {1e-5, 1e-4, 1e-3, 1e-2} by an inner k-fold on the outer training part, then a probe
  trained on that whole part (5 % held out for early stopping) is tested on the outer fold;
  the score is the mean over outer folds.
- SST-2: the penalty is chosen on dev; test accuracy of a probe trained on train.
- TREC, MRPC: the penalty is chosen by k-fold on train; test accuracy of a probe trained on
  train (5 % held out). MRPC's features are ``[|u − v|, u ⊙ v]``.

Examples are sorted by (length, label) before the folds are drawn, and the folds, splits and
probe initialisations use SentEval's seed (1111), so a given encoder's numbers are
reproducible. Each probe trains ``epoch_size`` epochs between checks of its held-out
accuracy and stops after ``tenacity`` checks without improvement (at most ``max_epoch``
epochs), keeping the best weights.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.model_selection import StratifiedKFold
from tqdm.auto import tqdm

from mmcse.config import TransferConfig
from mmcse.data.senteval import TREC_CLASSES, TransferExample
from mmcse.errors import InputError
from mmcse.evaluation import names
from mmcse.evaluation.sts import EncodeFn, encode_unique

TRANSFER_PRIMARY = names.TRANSFER_PRIMARY
L2_PENALTIES = (1e-5, 1e-4, 1e-3, 1e-2)  # SentEval's grid for its PyTorch classifier
NUM_CLASSES = {"MR": 2, "CR": 2, "SUBJ": 2, "MPQA": 2, "SST2": 2, "TREC": len(TREC_CLASSES), "MRPC": 2}
_NESTED = ("MR", "CR", "SUBJ", "MPQA")
_FINAL_HOLDOUT = 0.05  # share of the training part held out for early stopping of the final probe


class LogisticProbe:
    """A linear softmax classifier (SentEval's MLP with ``nhid = 0``) with L2 penalty
    ``l2`` as weight decay, trained with early stopping on held-out accuracy."""

    def __init__(self, dim: int, num_classes: int, l2: float, cfg: TransferConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.rng = np.random.RandomState(cfg.seed)  # batch order and hold-out split
        with torch.random.fork_rng(devices=[]):  # a seeded init without touching the caller's RNG
            torch.manual_seed(cfg.seed)
            self.model = torch.nn.Linear(dim, num_classes).to(device)
        optim, lr = (torch.optim.Adam, 1e-3) if cfg.optim == "adam" else (torch.optim.RMSprop, 1e-2)
        self.optimizer = optim(self.model.parameters(), lr=lr, weight_decay=l2)

    def fit(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        held_out: tuple[torch.Tensor, torch.Tensor] | None = None,
        held_out_share: float = 0.0,
    ) -> float:
        """Train on ``(x, y)``; early stopping on ``held_out`` or on a random ``held_out_share``
        of ``x``. Returns the best held-out accuracy (the weights kept are that epoch's)."""
        if held_out is None:
            order = torch.from_numpy(self.rng.permutation(len(x)))
            cut = int(held_out_share * len(x))
            held_out = (x[order[:cut]], y[order[:cut]])
            x, y = x[order[cut:]], y[order[cut:]]
        best, best_state, stalled, epoch = -1.0, None, 0, 0
        while epoch <= self.cfg.max_epoch:
            self.model.train()
            for _ in range(self.cfg.epoch_size):
                order = torch.from_numpy(self.rng.permutation(len(x)))
                for start in range(0, len(x), self.cfg.batch_size):
                    idx = order[start : start + self.cfg.batch_size]
                    loss = torch.nn.functional.cross_entropy(self.model(x[idx]), y[idx])
                    self.optimizer.zero_grad()
                    loss.backward()
                    self.optimizer.step()
            epoch += self.cfg.epoch_size
            accuracy = self.accuracy(*held_out)
            if accuracy > best:
                best, best_state = accuracy, copy.deepcopy(self.model.state_dict())
            else:
                if stalled >= self.cfg.tenacity:
                    break
                stalled += 1
        if best_state is not None:
            self.model.load_state_dict(best_state)
        return best

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        if len(x) == 0:
            return 0.0
        return float((self.model(x).argmax(dim=1) == y).float().mean())


@dataclass
class TransferResult:
    scores: dict[str, float]  # task -> test accuracy × 100, plus transfer_avg
    dev: dict[str, float] = field(default_factory=dict)  # task -> accuracy × 100 that chose the penalty

    @property
    def primary(self) -> float:
        return self.scores[TRANSFER_PRIMARY]


def _pct(accuracy: float) -> float:
    return round(100.0 * accuracy, 2)  # SentEval rounds here; ties in the choice go to the smaller penalty


def _folds(y: np.ndarray, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(len(y)), y))


def _cross_validated_penalty(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, cfg: TransferConfig, device: torch.device, bar
) -> tuple[float, float]:
    """(penalty, its mean k-fold accuracy × 100): each fold's probe stops early on that fold."""
    folds = _folds(y.cpu().numpy(), cfg.kfold, cfg.seed)
    scores = []
    for l2 in L2_PENALTIES:
        fold_scores = []
        for train_idx, test_idx in folds:
            probe = LogisticProbe(x.shape[1], num_classes, l2, cfg, device)
            held_out = (x[test_idx], y[test_idx])
            probe.fit(x[train_idx], y[train_idx], held_out=held_out)
            fold_scores.append(probe.accuracy(*held_out))
            bar.update(1)
        scores.append(_pct(float(np.mean(fold_scores))))
    best = int(np.argmax(scores))
    return L2_PENALTIES[best], scores[best]


def _final_probe(x, y, num_classes, l2, cfg, device, held_out=None) -> LogisticProbe:
    probe = LogisticProbe(x.shape[1], num_classes, l2, cfg, device)
    probe.fit(x, y, held_out=held_out, held_out_share=_FINAL_HOLDOUT)
    return probe


def probe_task(
    task: str,
    features: Mapping[str, tuple[np.ndarray, np.ndarray]],
    cfg: TransferConfig,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """(dev, test) accuracy × 100 of one task from its features: ``features[split] = (X, y)``
    with splits ``all`` (MR, CR, SUBJ, MPQA), ``train``/``dev``/``test`` (SST2) or
    ``train``/``test`` (TREC, MRPC), rows in SentEval's order."""
    device = torch.device(device)
    num_classes = NUM_CLASSES[task]

    def tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = features[split]
        return torch.as_tensor(x, dtype=torch.float32, device=device), torch.as_tensor(y, device=device).long()

    k, grid = cfg.kfold, len(L2_PENALTIES)
    if task in _NESTED:
        x, y = tensors("all")
        total = k * (grid * k + 1)
    elif task == "SST2":
        total = grid + 1
    else:
        total = grid * k + 1
    bar = tqdm(total=total, desc=f"probe {task}", unit="fit", leave=False)
    try:
        if task in _NESTED:
            dev_scores, test_scores = [], []
            for train_idx, test_idx in _folds(y.cpu().numpy(), k, cfg.seed):
                l2, dev = _cross_validated_penalty(x[train_idx], y[train_idx], num_classes, cfg, device, bar)
                probe = _final_probe(x[train_idx], y[train_idx], num_classes, l2, cfg, device)
                dev_scores.append(dev)
                test_scores.append(_pct(probe.accuracy(x[test_idx], y[test_idx])))
                bar.update(1)
            return round(float(np.mean(dev_scores)), 2), round(float(np.mean(test_scores)), 2)
        train, test = tensors("train"), tensors("test")
        if task == "SST2":
            dev = tensors("dev")
            scores = []
            for l2 in L2_PENALTIES:
                probe = LogisticProbe(train[0].shape[1], num_classes, l2, cfg, device)
                probe.fit(*train, held_out=dev)
                scores.append(_pct(probe.accuracy(*dev)))
                bar.update(1)
            best = int(np.argmax(scores))
            probe = _final_probe(*train, num_classes, L2_PENALTIES[best], cfg, device, held_out=dev)
            dev_score = scores[best]
        else:
            l2, dev_score = _cross_validated_penalty(*train, num_classes, cfg, device, bar)
            probe = _final_probe(*train, num_classes, l2, cfg, device)
        bar.update(1)
        return dev_score, _pct(probe.accuracy(*test))
    finally:
        bar.close()


def _senteval_order(examples: Sequence[TransferExample]) -> list[TransferExample]:
    # SentEval sorts by token count (both sentences for MRPC), then label, before drawing folds.
    def key(e: TransferExample) -> tuple:
        lengths = (len(e.text.split()),) if e.text2 is None else (len(e.text.split()), len(e.text2.split()))
        return (*lengths, e.label)

    return sorted(examples, key=key)


def task_features(
    examples: Sequence[TransferExample], vectors: Mapping[str, np.ndarray]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``split -> (X, y)`` in SentEval's order; pairs become ``[|u − v|, u ⊙ v]``."""
    by_split: dict[str, list[TransferExample]] = {}
    for e in examples:
        by_split.setdefault(e.split, []).append(e)
    out = {}
    for split, rows in by_split.items():
        rows = _senteval_order(rows)
        u = np.stack([vectors[e.text] for e in rows])  # (N, d)
        if rows[0].text2 is not None:
            v = np.stack([vectors[e.text2] for e in rows])  # (N, d)
            u = np.concatenate([np.abs(u - v), u * v], axis=1)  # (N, 2d)
        out[split] = (u, np.array([e.label for e in rows], dtype=np.int64))
    return out


_SPLITS = {"SST2": {"train", "dev", "test"}, "TREC": {"train", "test"}, "MRPC": {"train", "test"}}


def evaluate_transfer(
    encode: EncodeFn,
    tasks: Mapping[str, Sequence[TransferExample]],
    cfg: TransferConfig,
    batch_size: int = 128,
    device: torch.device | str = "cpu",
) -> TransferResult:
    """Test accuracy × 100 per transfer task plus ``transfer_avg`` (their mean); each distinct
    sentence is encoded once. Splits are checked before anything is encoded."""
    tasks = {name: list(rows) for name, rows in tasks.items() if rows}
    if not tasks:
        raise InputError("no transfer-task examples to evaluate")
    for name, rows in tasks.items():
        if name not in NUM_CLASSES:
            raise InputError(f"unknown transfer task {name!r}; known: {', '.join(NUM_CLASSES)}")
        splits = {e.split for e in rows}
        expected = _SPLITS.get(name, {"all"})
        if splits != expected:
            raise InputError(f"transfer task {name}: splits {sorted(splits)}, expected {sorted(expected)}")
        labels = {e.label for e in rows}
        if not labels <= set(range(NUM_CLASSES[name])) or len(labels) < 2:
            raise InputError(f"transfer task {name}: labels {sorted(labels)} outside 0..{NUM_CLASSES[name] - 1} "
                             "or a single class")
    sentences = [s for rows in tasks.values() for e in rows for s in (e.text, e.text2) if s is not None]
    vectors = encode_unique(encode, sentences, batch_size, desc="encode transfer")
    result = TransferResult(scores={})
    for name, rows in tasks.items():
        dev, test = probe_task(name, task_features(rows, vectors), cfg, device)
        result.scores[name], result.dev[name] = test, dev
    result.scores[TRANSFER_PRIMARY] = round(float(np.mean([result.scores[n] for n in tasks])), 2)
    if len(tasks) == 1:  # one task: its score is the average, reported once (`mmcse.evaluation.names`)
        result.scores[TRANSFER_PRIMARY] = result.scores.pop(next(iter(tasks)))
    return result

